// The manifest: what a sync holds (name, dtype, shape, size, place in the
// stream), in a binary format (layout.hpp: ManifestHeader, ManifestEntry,
// then the names blob). Never pickle. The decoder treats its input as
// hostile: every count, offset and size is bounds-checked, and the result
// must describe a consistent packing.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "base/layout.hpp"
#include "shmcast/shmcast.hpp"

namespace shmcast::detail {

// Packing rule (per rank: each rank packs its own pieces into its own
// sub-stream): each tensor starts at a multiple of kTensorAlign; a tensor no
// larger than a slot never straddles a slot boundary (it moves to the next
// one), so a consumer can view it in place; a larger one is split.
// Fills stream offsets; returns the stream length.
std::uint64_t pack(std::span<const TensorSpec> specs, std::uint64_t slot_bytes, std::vector<std::uint64_t>* offsets,
                   std::uint64_t* payload_bytes);

// Bytes the encoded manifest takes.
std::uint64_t manifest_size(std::span<const TensorSpec> specs, std::uint64_t pieces = ~0ull,
                            std::uint32_t world_size = 1);

// Empty when the manifest of `specs` (`pieces` pieces, ~0: one per spec;
// `world_size` ranks) fits `capacity` bytes; else why not, with the number
// of such tensors (of the same mean name length and pieces) that would fit,
// and what to do. `who`: "the producer" or "rank 0" (who to create anew).
std::string manifest_room_problem(std::span<const TensorSpec> specs, std::uint64_t capacity,
                                  std::uint64_t pieces = ~0ull, std::uint32_t world_size = 1,
                                  const char* who = "the producer");

// Encodes a one-rank manifest (each spec is one piece of rank 0, whole or a
// shard, at `offsets`) into `out` (`capacity` bytes). Returns the bytes used,
// 0 when it does not fit.
std::uint64_t encode_manifest(std::span<const TensorSpec> specs, std::span<const std::uint64_t> offsets,
                              std::uint64_t sync_version, std::uint64_t stream_bytes, std::uint64_t payload_bytes,
                              std::byte* out, std::uint64_t capacity);
// The general form: logical tensors (whole shapes; shard fields ignored),
// their pieces (sorted by rank, then offset) and each rank's sub-stream length.
std::uint64_t encode_manifest(std::span<const TensorSpec> tensors, std::span<const ManifestPiece> pieces,
                              std::span<const std::uint64_t> rank_bytes, std::uint64_t sync_version,
                              std::uint64_t payload_bytes, std::byte* out, std::uint64_t capacity);

// Merges the decoded posts of R ranks (post r: rank r's pieces, each its own
// entry, rank field 0) into the sync's logical tensors and pieces, in order of
// first appearance. Returns an empty string, or why the posts do not make one
// consistent sync (dtype or shape disagree, pieces overlap or leave gaps).
// A delta piece keeps its blob size and base (rank 0 makes the posts of a
// round one kind first: producer_ranks.cpp, round_kind).
std::string merge_posts(std::span<const SyncInfo> posts, std::vector<TensorSpec>* tensors,
                        std::vector<ManifestPiece>* pieces, std::vector<std::uint64_t>* rank_bytes,
                        std::uint64_t* payload_bytes);

// Decodes a private copy of the manifest. Returns an empty string on success
// or why the bytes are not a valid manifest for (version, stream_bytes,
// slot_bytes).
// `check_names` false skips the name rules (UTF-8, NUL, duplicates) and
// leaves the names empty. (The probe, which once passed false for windows
// of entries, streams with the rules below now; every caller passes true.)
enum class ManifestCheck {
  kFull,     // a sync's manifest: every tensor's pieces are one whole piece,
             // or shards along one dim that tile it exactly
  kRankPost, // a rank's list: exactly one piece per entry, no tiling
};
// *out is decoded in place: its vectors, and its tensors' names, shapes and
// shard lists, keep their memory; on an error its contents are unspecified
// (decode into a spare and swap on success, as the consumer does).
// `names_scratch`, when given, is the table of the duplicate-name check,
// kept by the caller from one manifest to the next.
class NameSet;
std::string decode_manifest(std::span<const std::byte> bytes, std::uint64_t expect_version,
                            std::uint64_t expect_stream_bytes, std::uint64_t slot_bytes, SyncInfo* out,
                            bool check_names = true, ManifestCheck mode = ManifestCheck::kFull,
                            NameSet* names_scratch = nullptr);

// The rules decode_manifest applies, one part of a manifest at a time, for
// a reader that streams a manifest too large to copy whole (the inspect
// tool's probe, probe/manifest_stream.cpp): one definition of each rule.
// Each returns an empty string when valid, else why not.
//
// The header, for a manifest of `used` (>= sizeof(ManifestHeader)) bytes
// announced by a sync record of (expect_version, expect_stream_bytes):
// magic, format, entry size, sync version, stream size, world size, tensor
// and piece counts, and where the rank table, pieces and names blob lie.
std::string manifest_header_problem(const ManifestHeader& h, std::uint64_t used, std::uint64_t expect_version,
                                    std::uint64_t expect_stream_bytes);
// An entry's name: its length, that it lies inside a names blob of
// `names_bytes` bytes and starts where the previous entry's name ended
// (*names_next, 0 before the first entry; advanced past this name). Names
// lie end to end in entry order, so decoded names take no more memory than
// the blob. (name_problem checks the name's bytes.)
std::string entry_name_problem(const ManifestEntry& e, std::uint64_t names_bytes, std::uint64_t* names_next);
// After the last entry: the names fill the blob (*names_next == names_bytes).
std::string names_end_problem(std::uint64_t names_next, std::uint64_t names_bytes);
// Before a reader copies a manifest of `used` bytes whole (the consumer:
// up to kMaxManifestBytes): its header, and its entries read a window of
// 4096 at a time through `read` (offset in the manifest, bytes,
// destination; false when the file ends first), by the rules above. A
// manifest whose announced size is not backed by valid entries (a hostile
// size into the sparse area's holes) is refused at the cost of one window
// of memory, not `used` bytes.
std::string manifest_prefix_problem(const std::function<bool(std::uint64_t, std::size_t, void*)>& read,
                                    std::uint64_t used, std::uint64_t expect_version,
                                    std::uint64_t expect_stream_bytes);
// An entry's dtype, shape and byte size; adds its size to *logical, the sum
// of the entries so far, which must stay within the stream limit.
std::string entry_shape_problem(const ManifestEntry& e, std::uint64_t* logical);
// A valid entry as a tensor: dtype, shape, nbytes, stream offset (no name,
// no pieces).
TensorInfo entry_tensor(const ManifestEntry& e);
// The same into *t, whose name (left empty), shape and shard list (left
// empty) keep their memory.
void entry_tensor_into(const ManifestEntry& e, TensorInfo* t);
// The rank table: each rank's sub-stream within the limit, and together the
// stream's size.
std::string rank_bytes_problem(std::span<const std::uint64_t> rank_bytes, std::uint64_t stream_bytes);

// The structure of piece `p` given the pieces before it: its tensor index
// and rank exist, pieces run in (rank, offset) order, aligned, without
// overlap, inside their rank's sub-stream, and not across a slot boundary
// when they fit in one. Updates *rank_prev / *end_prev. Empty when valid.
std::string piece_problem(const ManifestPiece& p, std::uint32_t tensor_count, std::span<const std::uint64_t> rank_bytes,
                          std::uint64_t slot_bytes, std::uint32_t* rank_prev, std::uint64_t* end_prev);
// A delta piece's base (docs/protocol.md §6): a version before the sync's
// (`sync_version`), the same for every delta piece of the sync. *base_version
// is 0 until the first delta piece, then its base. A full piece (base 0)
// passes.
std::string piece_base_problem(const ManifestPiece& p, std::uint64_t sync_version, std::uint64_t* base_version);
// Piece `p` against its tensor (`dtype`, `shape`, `tensor_nbytes`: an entry
// that passed entry_shape_problem): a whole piece has no range, a shard's dim
// and range lie inside the tensor; a full piece's bytes are its range's, a
// delta piece's blob can carry its range (delta::piece_fits). Sets *logical
// to the piece's logical bytes when valid.
// (manifest_piece.cpp; decode_manifest applies them too.)
std::string piece_size_problem(const ManifestPiece& p, DType dtype, std::span<const std::int64_t> shape,
                               std::uint64_t tensor_nbytes, std::uint64_t* logical);
// The rules every tensor name follows; empty when `name` is valid.
std::string name_problem(std::string_view name);

// Checks a tensor spec (name, dtype, shape); empty string when valid.
std::string validate_spec(const TensorSpec& spec);

}  // namespace shmcast::detail
