// protocol/: the delta codec on the host (docs/protocol.md, "Delta encoding").
//
// A delta blob carries the elements of a tensor (or of one piece of it)
// whose raw w-byte words differ from a base, block by block, plus a content
// checksum of the new bytes. The producer plans (counts, sizes, checksum),
// encodes into a buffer of exactly the planned size and updates its base;
// a consumer applies a blob to the base it holds, the whole piece or the
// part of it inside its selection. Exactness never depends on floating
// point: elements are compared and copied as words.
//
// Blobs are untrusted input (they come out of a region another process
// writes): apply() validates the header, every table entry, index, bitmap
// and padding byte before it writes one byte of the destination, keeps its
// own copy of the table, and re-checks every index it uses, so a blob that
// changes while it is applied can make wrong values but never an access out
// of bounds. A bad blob is Error(Errc::kCorrupt).
//
// Large tensors use up to min(hardware threads, 8) threads, 8 MiB or more
// per thread; smaller ones run on the calling thread. Nothing is shared
// between calls: the functions are thread-safe.
//
// The CUDA codec (delta_cuda.hpp) makes and takes the same bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "protocol/delta_format.hpp"
#include "shmcast/shmcast.hpp"

namespace shmcast::detail::delta {

// ---- sizes

// Bytes of the header and table of a blob of n elements (where the payload starts).
std::uint64_t head_bytes(std::uint64_t n);
// The largest blob of n elements of w bytes (every block dense).
std::uint64_t max_blob_bytes(std::uint32_t w, std::uint64_t n);

// ---- tensors

// The element width a delta of a `dtype` tensor compares and copies: the
// dtype's size when it is 1, 2, 4 or 8 bytes, 8 for 16-byte dtypes (c128),
// 1 for raw bytes.
std::uint32_t elem_width(DType dtype);
// Whether a blob of `wire` bytes can carry a piece of `logical` bytes of
// `dtype` (at least its header and table, at most every block dense): the
// manifest's check of a delta piece's size (docs/protocol.md §6).
bool piece_fits(DType dtype, std::uint64_t logical, std::uint64_t wire);

// ---- checksum

// The content checksum of bytes [data, data + bytes) (delta_format.hpp).
std::uint64_t checksum(const void* data, std::uint64_t bytes);
// The content checksum of a piece read back from `dst` (elements of w
// bytes) through `m`, which must hold the whole piece (holds_piece): the
// piece's bytes in its own row-major order, wherever they land (one run,
// or strided: a tensor sharded along a dim >= 1, read whole).
std::uint64_t checksum(const SliceMap& m, const void* dst, std::uint32_t w);

// ---- encode

struct Plan {
  std::uint32_t w = 0;
  std::uint64_t n = 0;
  std::vector<std::uint32_t> counts;   // per block
  std::vector<std::uint64_t> offsets;  // per block, in the payload
  std::uint64_t changed = 0;           // sum of counts
  std::uint64_t payload_bytes = 0;
  std::uint64_t checksum = 0;          // of the new bytes
  std::uint64_t blob_bytes() const { return head_bytes(n) + payload_bytes; }
  std::uint64_t blocks() const { return counts.size(); }
};

// Compares `next` with `base` (n elements of w bytes each, w in {1, 2, 4,
// 8}; any alignment) and sizes the blob. Throws kInvalidArgument for a bad w
// or size.
Plan plan(const void* base, const void* next, std::uint32_t w, std::uint64_t n);
// Writes the blob of `p` into out[0, out_bytes) (out_bytes must be
// p.blob_bytes()) and makes `base` equal to `next` (writing its changed
// elements, or a dense block's whole bytes). `base` and `next` must hold what plan() saw: if
// they changed in between, throws kInvalidArgument, with `base` partly
// updated and `out` not a blob.
void encode(const Plan& p, void* base, const void* next, void* out, std::uint64_t out_bytes);

// ---- decode

// A blob's header, read and checked against the expected element width and
// count and the blob's size (only the header: apply checks the rest).
// Throws kCorrupt.
Header read_header(std::span<const std::byte> blob, std::uint32_t w, std::uint64_t n);

// Where a piece's elements go in a destination laid out as a selection.
// `shape` is the logical tensor's; `piece` the rows the blob covers (dim -1:
// the whole tensor), `sel` the consumer's rows (dim -1: the whole tensor).
// Throws kInvalidArgument for a bad w, piece or selection.
SliceMap slice_map(std::span<const std::int64_t> shape, std::uint32_t w, const Selection& piece,
                   const Selection& sel);
// The identity map of n elements (a whole piece into a whole destination).
SliceMap whole_map(std::uint64_t n);
// Whether every element of the piece lands, in order, in one contiguous run
// of the destination.
bool covers_piece(const SliceMap& m);
// Whether every element of the piece lands in the destination, in one run
// or strided (the selection holds the whole piece): then the result's
// checksum can be verified there. A selection that holds only part of a
// piece cannot check it: the blob's checksum covers the whole piece.
bool holds_piece(const SliceMap& m);

// Applies `blob` (elements of w bytes) to `dst` (dst_bytes = m.dst_elems *
// w), which holds the base at the positions `m` selects: afterwards they
// hold the new elements; positions outside the piece are not touched. With
// `verify` (only when holds_piece(m)), the result's checksum is compared
// with the header's: a mismatch (not the delta's base, or corrupted bytes)
// is kCorrupt, with the destination already written. A blob that fails
// validation is kCorrupt with `dst` untouched.
void apply(std::span<const std::byte> blob, std::uint32_t w, const SliceMap& m, void* dst, std::uint64_t dst_bytes,
           bool verify);
// The whole piece of n elements into a whole destination.
void apply(std::span<const std::byte> blob, std::uint32_t w, std::uint64_t n, void* dst, std::uint64_t dst_bytes,
           bool verify);

// Threads a job over `bytes` bytes uses (1 below 16 MiB).
unsigned threads_for(std::uint64_t bytes);

}  // namespace shmcast::detail::delta
