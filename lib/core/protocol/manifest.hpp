// The manifest: what a sync holds (name, dtype, shape, size, place in the
// stream), in a binary format (layout.hpp: ManifestHeader, ManifestEntry,
// then the names blob). Never pickle. The decoder treats its input as
// hostile: every count, offset and size is bounds-checked, and the result
// must describe a consistent packing.
#pragma once

#include <cstdint>
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
std::string merge_posts(std::span<const SyncInfo> posts, std::vector<TensorSpec>* tensors,
                        std::vector<ManifestPiece>* pieces, std::vector<std::uint64_t>* rank_bytes,
                        std::uint64_t* payload_bytes);

// Decodes a private copy of the manifest. Returns an empty string on success
// or why the bytes are not a valid manifest for (version, stream_bytes,
// slot_bytes).
// `check_names` false skips the name rules (UTF-8, NUL, duplicates) and
// leaves the names empty: for a reader that validates windows of entries
// with placeholder names (shmcast-inspect show --limit).
enum class ManifestCheck {
  kFull,     // a sync's manifest: every tensor's pieces are one whole piece,
             // or shards along one dim that tile it exactly
  kRankPost, // a rank's list: exactly one piece per entry, no tiling
  kEntries,  // the entries alone (piece_count 0): a window of a large
             // manifest whose pieces the reader checks on its own
};
std::string decode_manifest(std::span<const std::byte> bytes, std::uint64_t expect_version,
                            std::uint64_t expect_stream_bytes, std::uint64_t slot_bytes, SyncInfo* out,
                            bool check_names = true, ManifestCheck mode = ManifestCheck::kFull);

// The structure of piece `p` given the pieces before it: its tensor index
// and rank exist, pieces run in (rank, offset) order, aligned, without
// overlap, inside their rank's sub-stream, and not across a slot boundary
// when they fit in one. Updates *rank_prev / *end_prev. Empty when valid.
std::string piece_problem(const ManifestPiece& p, std::uint32_t tensor_count, std::span<const std::uint64_t> rank_bytes,
                          std::uint64_t slot_bytes, std::uint32_t* rank_prev, std::uint64_t* end_prev);
// The rules every tensor name follows; empty when `name` is valid.
std::string name_problem(std::string_view name);

// Checks a tensor spec (name, dtype, shape); empty string when valid.
std::string validate_spec(const TensorSpec& spec);

}  // namespace shmcast::detail
