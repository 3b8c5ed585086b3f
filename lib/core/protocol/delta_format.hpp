// The delta encoding's bytes and rules (docs/protocol.md, "Delta encoding"),
// written once for the host codec (delta.cpp) and the CUDA kernels
// (kernels/delta.cu, compiled by nvcc as C++17): the header and table
// layouts, the rule that picks a block's kind from its count, the lane
// counter, the content checksum's mixer, the mapping of a piece's elements
// into a selection, and the kernels' argument blocks. Host and device run
// this same code, so they make the same choices and the same checksums.
//
// Nothing here allocates, throws or includes more than <stdint.h>.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define SHMCAST_HD __host__ __device__ __forceinline__
#else
#define SHMCAST_HD inline
#endif

namespace shmcast::detail::delta {

// ---------------------------------------------------------------- format

inline constexpr uint32_t kMagic = 0x4c444353u;  // "SCDL" little-endian
inline constexpr uint16_t kFormat = 1;
inline constexpr uint32_t kBlockElems = 4096;   // B: elements per block (u16 indices)
inline constexpr uint64_t kHeaderBytes = 64;
inline constexpr uint64_t kEntryBytes = 16;
inline constexpr uint64_t kAlign = 16;          // every block area starts and ends 16-aligned

// Blob header, 64 bytes at offset 0. All fields little-endian.
struct Header {
  uint32_t magic;          // kMagic
  uint16_t format;         // kFormat
  uint16_t elem_bytes;     // w: 1, 2, 4 or 8
  uint32_t block_elems;    // kBlockElems
  uint32_t reserved0;      // 0
  uint64_t elems;          // n
  uint64_t blocks;         // ceil(n / B)
  uint64_t payload_bytes;  // bytes after the table
  uint64_t checksum;       // content checksum of the new bytes (n * w of them)
  uint64_t changed;        // sum of the blocks' counts
  uint64_t reserved1;      // 0
};
static_assert(sizeof(Header) == kHeaderBytes, "delta header is 64 bytes");

// Block table entry, 16 bytes per block, right after the header.
struct Entry {
  uint64_t offset;    // of the block's area, from the start of the payload
  uint32_t count;     // elements of the block whose new word differs from the base's
  uint32_t reserved;  // 0
};
static_assert(sizeof(Entry) == kEntryBytes, "delta table entry is 16 bytes");

enum Kind : uint32_t {
  kUnchanged = 0,  // count 0: no area
  kSparse = 1,     // u16 indices[count] | pad | values[count] | pad
  kBitmap = 2,     // bitmap of len bits, LSB first, in u64 words | pad | values[count] | pad
  kDense = 3,      // the block's new bytes | pad
};

// CUDA threads per block of the kernels (kernels/delta.cu) and of their
// launches (delta_launch.hpp): every kernel but the scan, and the scan.
inline constexpr unsigned kKernelThreads = 256;
inline constexpr unsigned kScanThreads = 1024;

SHMCAST_HD uint64_t align16(uint64_t x) { return (x + (kAlign - 1)) & ~(kAlign - 1); }
SHMCAST_HD uint64_t block_count(uint64_t n) { return n / kBlockElems + (n % kBlockElems != 0 ? 1 : 0); }
// Elements of block b (the last one may be short).
SHMCAST_HD uint32_t block_len(uint64_t n, uint64_t b) {
  const uint64_t rest = n - b * kBlockElems;
  return rest < kBlockElems ? static_cast<uint32_t>(rest) : kBlockElems;
}
// Header and table: where the payload starts.
SHMCAST_HD uint64_t head_bytes_for(uint64_t blocks) { return kHeaderBytes + kEntryBytes * blocks; }

SHMCAST_HD uint64_t sparse_bytes(uint64_t count, uint64_t w) { return align16(2 * count) + align16(count * w); }
SHMCAST_HD uint64_t bitmap_head_bytes(uint64_t len) { return align16(8 * ((len + 63) / 64)); }
SHMCAST_HD uint64_t bitmap_bytes(uint64_t count, uint64_t len, uint64_t w) {
  return bitmap_head_bytes(len) + align16(count * w);
}
SHMCAST_HD uint64_t dense_bytes(uint64_t len, uint64_t w) { return align16(len * w); }

// The kind of a block with `count` changed elements out of `len` (count <=
// len <= B): the smallest encoding; ties go to dense, then bitmap.
SHMCAST_HD uint32_t kind_of(uint64_t count, uint64_t len, uint64_t w) {
  if (count == 0) return kUnchanged;
  const uint64_t s = sparse_bytes(count, w), m = bitmap_bytes(count, len, w), d = dense_bytes(len, w);
  if (d <= s && d <= m) return kDense;
  if (m <= s) return kBitmap;
  return kSparse;
}
SHMCAST_HD uint64_t area_bytes(uint32_t kind, uint64_t count, uint64_t len, uint64_t w) {
  switch (kind) {
    case kSparse: return sparse_bytes(count, w);
    case kBitmap: return bitmap_bytes(count, len, w);
    case kDense: return dense_bytes(len, w);
    default: return 0;
  }
}

SHMCAST_HD bool valid_width(uint64_t w) { return w == 1 || w == 2 || w == 4 || w == 8; }

// ---------------------------------------------------------------- words

SHMCAST_HD int popcount64(uint64_t x) {
#if defined(__CUDA_ARCH__)
  return __popcll(x);
#else
  return __builtin_popcountll(x);
#endif
}

// The w-byte lanes of `x` (a little-endian 8-byte word) that are not zero,
// as the top bit of each such lane: with x = new ^ base, the elements of the
// word that changed. Padding lanes of a partial word are zero.
template <int W>
SHMCAST_HD uint64_t lane_mask(uint64_t x) {
  if constexpr (W == 8) {
    return x != 0 ? 1ull << 63 : 0;
  } else {
    // Per lane: (low bits + 0x7f..) carries into the lane's top bit unless
    // the low bits are zero, and no lane carries into the next.
    constexpr uint64_t low = W == 1 ? 0x7f7f7f7f7f7f7f7full : W == 2 ? 0x7fff7fff7fff7fffull : 0x7fffffff7fffffffull;
    return (((x & low) + low) | x) & ~low;
  }
}
// How many of them. On the host without a popcount instruction in the
// baseline ISA (x86-64), a multiply adds the lanes' flags into the top lane.
template <int W>
SHMCAST_HD int lanes_nonzero(uint64_t x) {
#if defined(__CUDA_ARCH__) || defined(__POPCNT__) || defined(__aarch64__)
  return popcount64(lane_mask<W>(x));
#else
  constexpr int bits = 8 * W;
  constexpr uint64_t ones = W == 1 ? 0x0101010101010101ull : W == 2 ? 0x0001000100010001ull : W == 4 ? 0x0000000100000001ull : 1;
  return static_cast<int>(((lane_mask<W>(x) >> (bits - 1)) * ones) >> (64 - bits));
#endif
}

// ---------------------------------------------------------------- checksum
//
// checksum(bytes[0..L)) = mix(S ^ mix(L + kLenKey)), where
// S = sum over 8-byte words i (mod 2^64) of mix(x_i ^ (kPosKey * (i + 1))),
// x_i the little-endian word at byte 8i; the last L % 8 bytes, if any, form
// one more word (index L / 8) zero-extended. mix is the splitmix64
// finalizer, a bijection, so a change confined to one word always changes
// S; the sum makes the order of accumulation irrelevant (any split across
// threads gives the same value).

inline constexpr uint64_t kPosKey = 0x9e3779b97f4a7c15ull;
inline constexpr uint64_t kLenKey = 0x6a09e667f3bcc909ull;

SHMCAST_HD uint64_t mix64(uint64_t z) {
  z ^= z >> 30;
  z *= 0xbf58476d1ce4e5b9ull;
  z ^= z >> 27;
  z *= 0x94d049bb133111ebull;
  z ^= z >> 31;
  return z;
}
SHMCAST_HD uint64_t checksum_term(uint64_t index, uint64_t word) { return mix64(word ^ (kPosKey * (index + 1))); }
SHMCAST_HD uint64_t checksum_final(uint64_t sum, uint64_t bytes) { return mix64(sum ^ mix64(bytes + kLenKey)); }

// ---------------------------------------------------------------- slices
//
// Where element e of a piece (the blob's elements, in the piece's row-major
// order) goes in a destination laid out as a selection, in elements: with
// t = e - src0, o = t / s_outer, r = (t % s_outer) / s_row, c = t % s_outer %
// s_row, the element is selected when o < outer, r < rows and c < width, and
// goes to dst0 + o * d_outer + r * d_row + c. Built on the host from the
// consumer's copy plan (delta.cpp, slice_map); the identity map (a whole
// piece into a whole destination) has outer = rows = 1, width = n.
struct SliceMap {
  uint64_t n;            // piece elements
  uint64_t dst_elems;    // destination elements
  uint64_t src0, dst0;
  uint64_t outer, rows, width;
  uint64_t s_outer, s_row;  // >= 1
  uint64_t d_outer, d_row;
  uint32_t identity;     // 1: e goes to e (outer = rows = 1, width = n, src0 = dst0 = 0)
  uint32_t reserved;
};

SHMCAST_HD bool map_element(const SliceMap& m, uint64_t e, uint64_t* d) {
  if (m.identity) {
    *d = e;
    return true;
  }
  if (e < m.src0) return false;
  uint64_t t = e - m.src0;
  const uint64_t o = t / m.s_outer;
  if (o >= m.outer) return false;
  t -= o * m.s_outer;
  const uint64_t r = t / m.s_row;
  if (r >= m.rows) return false;
  const uint64_t c = t - r * m.s_row;
  if (c >= m.width) return false;
  *d = m.dst0 + o * m.d_outer + r * m.d_row + c;
  return true;
}

// Whether the piece lands in one contiguous run of the destination, at
// dst0 (its content is then that run's bytes).
SHMCAST_HD bool map_contiguous(const SliceMap& m) {
  return m.identity != 0 || m.n == 0 || (m.outer == 1 && m.rows == 1 && m.width == m.n && m.src0 == 0);
}

// Whether every element of the piece lands in the destination (the
// selection holds the whole piece, maybe strided: a tensor sharded along a
// dim >= 1 read whole): then the piece's content, and so its checksum, can
// be read back from the destination, run after run (mapped_word).
SHMCAST_HD bool map_holds_piece(const SliceMap& m) {
  if (m.identity != 0 || m.n == 0) return true;
  if (m.src0 != 0 || m.s_row == 0 || m.s_outer == 0 || m.width != m.s_row) return false;
  return m.s_outer % m.s_row == 0 && m.s_outer / m.s_row == m.rows && m.n % m.s_outer == 0 &&
         m.n / m.s_outer == m.outer;
}

// The destination element of piece element e (< n) under a map that holds
// the whole piece, and the elements from e to the end of its run.
SHMCAST_HD uint64_t map_run(const SliceMap& m, uint64_t e, uint64_t* d) {
  if (m.identity != 0) {
    *d = e;
    return m.n - e;
  }
  const uint64_t o = e / m.s_outer, t = e - o * m.s_outer, r = t / m.s_row, c = t - r * m.s_row;
  *d = m.dst0 + o * m.d_outer + r * m.d_row + c;
  return m.width - c;
}

// Checksum word i of the piece's content (its bytes [8i, 8i + k), k = 8, or
// L % 8 for the last one), read from the destination `dst` (elements of w
// bytes) through a map that holds the whole piece: one run's bytes, or
// gathered element by element where the word crosses runs.
SHMCAST_HD uint64_t mapped_word(const SliceMap& m, const unsigned char* dst, uint32_t w, uint64_t i, unsigned k) {
  uint64_t x = 0;
  for (unsigned q = 0; q < k;) {
    uint64_t d = 0;
    const uint64_t left = map_run(m, (8 * i + q) / w, &d);
    const unsigned char* p = dst + d * w;
    const unsigned take = left * w < k - q ? static_cast<unsigned>(left * w) : k - q;
    if (take == 0) break;  // never, for a map that holds the piece
    for (unsigned b = 0; b < take; ++b) x |= static_cast<uint64_t>(p[b]) << (8 * (q + b));
    q += take;
  }
  return x;
}

// ---------------------------------------------------------------- kernels
//
// One argument block per kernel, passed by value (cuLaunchKernel's single
// parameter); host and device see the same layout. Device addresses are
// carried as integers. Status bits are or-ed into a u32 the codec owns.

enum Status : uint32_t {
  kStBadHeader = 1u << 0,     // header field wrong (magic, format, w, B, n, blocks, payload, reserved)
  kStBadTable = 1u << 1,      // an entry's reserved field, count, offset or area size
  kStBadIndices = 1u << 2,    // sparse indices not strictly increasing or past the block
  kStBadBitmap = 1u << 3,     // bitmap bits past the block, or popcount != count
  kStBadPadding = 1u << 4,    // a non-zero padding byte
  kStBadChanged = 1u << 5,    // the counts do not add up to the header's `changed`
  kStBadChecksum = 1u << 6,   // the applied result's checksum differs from the header's
  kStPlanMismatch = 1u << 7,  // encode found other counts than plan (inputs changed in between)
  kStOutTooSmall = 1u << 8,   // encode: the output cannot hold the blob
};
inline constexpr uint32_t kStRejected = kStBadHeader | kStBadTable | kStBadIndices | kStBadBitmap | kStBadPadding |
                                        kStBadChanged;

// Scratch words of a codec (device memory, 32 bytes).
struct Scratch {
  uint32_t status;   // accumulated status bits since the last finish()
  uint32_t op_err;   // this apply's validation bits
  uint64_t op_sum;   // this apply's sum of counts
  uint64_t sum;      // checksum accumulator
  uint64_t pad;
};
static_assert(sizeof(Scratch) == 32, "scratch is 32 bytes");

struct CountArgs {  // plan step 1: per block, changed count and checksum partial (in the table)
  uint64_t base, next, table, n, blocks;
};
struct ScanArgs {  // plan step 2: offsets, header (one CUDA block)
  uint64_t head, n, blocks, w;
};
struct EncodeArgs {  // payload and base update
  uint64_t base, next, head, out, out_bytes, n, blocks, scratch;
};
struct ValidateArgs {  // apply step 1
  uint64_t blob, blob_bytes, n, blocks, scratch;
};
struct ApplyArgs {  // apply step 2
  uint64_t blob, n, blocks, dst, scratch;
  SliceMap map;
};
struct ChecksumArgs {  // sum of terms over [data, data + bytes) into scratch->sum
  uint64_t data, bytes, scratch;
};
struct FinishArgs {  // checksum_final into *out, or compare with a blob's header
  uint64_t scratch, bytes, out, blob;  // out != 0: store; blob != 0: compare (only when op_err == 0)
};
struct ResetArgs {  // scratch->op_err = op_sum = sum = 0, and status too when `all`
  uint64_t scratch, all;
};

// A batched apply (CudaCodec::apply_batch): the apply of many pieces in
// five launches (reset, validate, apply, checksum, finish) instead of five
// each. `jobs` (device memory) holds njobs ApplyJobs; each has its own
// Scratch for the validation and checksum words, and the status bits go to
// the codec's Scratch (`status`). A job's units: its delta blocks (at least
// 1: unit 0 checks the header) for validate and apply, from unit0 on;
// kSumUnitWords-word runs of its piece's content for the checksum (0 when
// it is not verified; read back through its map, which holds the whole
// piece), from sum_unit0 on. Both run over every job in order.
struct ApplyJob {
  uint64_t blob, blob_bytes, n, blocks, dst, scratch;
  uint64_t unit0, sum_unit0, sum_units;
  uint32_t w, verify;
  SliceMap map;
};
struct BatchArgs {
  uint64_t jobs, njobs, units, status;  // units: of this launch's kind (blocks, or checksum runs)
};
inline constexpr uint64_t kSumUnitWords = 256 * 16;  // 32 KiB of destination per checksum unit

// A batch of plans (CudaCodec::plan_batch): the count of every job's delta
// blocks in one launch (a job's units are its blocks, from unit0 on, in job
// order), then every job's scan in one launch (a CUDA block per job). `jobs`
// (device memory) holds njobs PlanJobs; each writes its header and table at
// `head`, as plan() does.
struct PlanJob {
  uint64_t base, next, head, n, blocks, unit0;
  uint32_t w, reserved;
};
struct PlanBatchArgs {
  uint64_t jobs, njobs, units;
};

// A batch of encodes (CudaCodec::encode_batch): the encode of many tensors
// in one launch instead of one each. `jobs` (device memory) holds the
// EncodeJobs of a table numbered from its first job (number_encode_jobs:
// a job's units are max(blocks, 1), from unit0 on); a launch covers njobs
// of them from `jobs` on, whose units are [unit0, unit0 + units). The
// status bits go to the codec's Scratch (`scratch`). A job's unit 0 also
// zeroes the `pad` bytes after its blob's room (out + out_bytes on): the
// gap to the next blob where the blobs are laid out as a stream.
struct EncodeJob {
  uint64_t base, next, head, out, out_bytes, n, blocks, unit0, pad;
  uint32_t w, reserved;
};
struct EncodeBatchArgs {
  uint64_t jobs, njobs, unit0, units, scratch;
};

// Not the delta format, but the same kernels' module: a batch of small
// device-to-device copies in one launch (the CUDA engine, device slots:
// engine/cuda_copy.cpp). `pieces` (device memory) holds n {src, dst,
// bytes}; one CUDA block per piece (grid-stride over them).
struct CopyPiece {
  uint64_t src, dst, bytes;
};
struct CopyPiecesArgs {
  uint64_t pieces, n;
};
// The engine splits a batch's pieces into blocks of kCopyPieceMin to
// kCopyPieceMax bytes (copy_block_bytes, delta_launch.hpp), one CUDA block each.
inline constexpr uint64_t kCopyPieceMin = 64 << 10;
inline constexpr uint64_t kCopyPieceMax = 1 << 20;

}  // namespace shmcast::detail::delta
