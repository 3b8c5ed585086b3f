// Over 800 lines on purpose: one PTX module (nvcc makes one .cu into one module, delta_kernels.cmake) whose kernels share the device helpers below.
// The delta codec's CUDA kernels (docs/protocol.md, "Delta encoding").
//
// Compiled to PTX by nvcc at build time (lib/core/engine/kernels/delta_kernels.cmake),
// embedded in libshmcast as bytes and loaded at run time with
// cuModuleLoadDataEx through the driver API (delta_cuda.cpp): the library
// links no CUDA library. The format's rules (sizes, kinds, lane counting,
// the checksum's mixer, the slice map) come from delta_format.hpp, the same
// code the host codec runs, so both make the same bytes.
//
// Every kernel takes one argument block (delta_format.hpp) by value. Blocks
// of 256 threads, one delta block (4096 elements) at a time, grid-stride
// over the delta blocks; thread t owns elements [16t, 16t + 16) where the
// order of changed elements matters (compaction), element j + 256 i
// otherwise (coalesced). Pointers the host passes are 8-byte aligned
// (delta_cuda.cpp checks), except the destination of apply (element-aligned)
// and the data of checksum (any).
#include "protocol/delta_format.hpp"

using namespace shmcast::detail::delta;

typedef unsigned long long ull;

// Full unrolling (register arrays indexed by constants); nothing when the
// host compiles these kernels (tests/unit/test_delta_kernels.cpp).
#if defined(__CUDACC__)
#define SHMCAST_UNROLL _Pragma("unroll")
#else
#define SHMCAST_UNROLL
#endif

namespace {

constexpr unsigned kThreads = kKernelThreads;  // the launches use the same constant (delta_launch.hpp)
constexpr unsigned kWarps = kThreads / 32;
constexpr unsigned kPerThread = kBlockElems / kThreads;  // 16
static_assert(kPerThread == 16, "a thread owns 16 elements: one u16 of a bitmap");

template <int W> struct ElemOf;
template <> struct ElemOf<1> { typedef unsigned char T; };
template <> struct ElemOf<2> { typedef unsigned short T; };
template <> struct ElemOf<4> { typedef unsigned int T; };
template <> struct ElemOf<8> { typedef ull T; };

__device__ __forceinline__ ull warp_sum(ull v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  return v;
}

// Sum of v over the block's threads, valid in thread 0. Every thread calls
// it; `sh` holds kWarps values and is free again when it returns.
__device__ ull block_sum(ull v, ull* sh) {
  const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  ull r = 0;
  if (warp == 0) {
    r = lane < kWarps ? sh[lane] : 0;
    r = warp_sum(r);
  }
  __syncthreads();
  return r;
}

// block_sum of two values at once (one pair of barriers), valid in thread
// 0; `sh` holds 2 kWarps values and is free again when it returns.
__device__ void block_sum2(ull* a, ull* b, ull* sh) {
  const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  ull x = warp_sum(*a), y = warp_sum(*b);
  if (lane == 0) {
    sh[warp] = x;
    sh[kWarps + warp] = y;
  }
  __syncthreads();
  if (warp == 0) {
    x = warp_sum(lane < kWarps ? sh[lane] : 0);
    y = warp_sum(lane < kWarps ? sh[kWarps + lane] : 0);
  }
  __syncthreads();
  *a = x;
  *b = y;
}

// Exclusive prefix sum of v over the block's threads (in thread order);
// *total gets the sum, in every thread. Every thread calls it; `sh` holds
// kWarps values and is free again when it returns.
__device__ unsigned block_scan(unsigned v, unsigned* sh, unsigned* total) {
  const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned x = v;
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= static_cast<unsigned>(o)) x += y;
  }
  if (lane == 31) sh[warp] = x;  // the warp's total
  __syncthreads();
  if (warp == 0) {
    unsigned s = lane < kWarps ? sh[lane] : 0;
    for (int o = 1; o < 32; o <<= 1) {
      const unsigned y = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= static_cast<unsigned>(o)) s += y;
    }
    if (lane < kWarps) sh[lane] = s;  // inclusive prefix of the warps' totals
  }
  __syncthreads();
  const unsigned before = warp > 0 ? sh[warp - 1] : 0;
  *total = sh[kWarps - 1];
  __syncthreads();
  return before + x - v;
}

// The first k (< 8) bytes at p, little-endian, zero-extended.
__device__ __forceinline__ ull load_partial(const unsigned char* p, unsigned k) {
  ull x = 0;
  for (unsigned i = 0; i < k; ++i) x |= static_cast<ull>(p[i]) << (8 * i);
  return x;
}

// A thread's 16 elements as 8-byte words, and element i of them (little-endian).
template <int W>
constexpr unsigned kWordsPerThread = 16 * W / 8;
template <int W>
__device__ __forceinline__ typename ElemOf<W>::T word_elem(const ull* words, unsigned i) {
  constexpr unsigned per = 8 / W;
  return static_cast<typename ElemOf<W>::T>(words[i / per] >> (8 * W * (i % per)));
}

__device__ __forceinline__ Scratch* scratch_of(ull p) { return reinterpret_cast<Scratch*>(p); }

// ---------------------------------------------------------------- plan

// Delta block b: how many elements differ, and the block's sum of checksum
// terms, into its table entry (offset holds the sum until the scan). Every
// thread of the CUDA block calls it with the same b; `sh` holds 2 kWarps
// values and is free again when it returns.
template <int W>
__device__ void count_unit(const CountArgs& a, ull b, ull* sh) {
  const unsigned char* base = reinterpret_cast<const unsigned char*>(a.base);
  const unsigned char* next = reinterpret_cast<const unsigned char*>(a.next);
  Entry* table = reinterpret_cast<Entry*>(a.table);
  const ull len = block_len(a.n, b);
  const ull byte0 = b * kBlockElems * W, bytes = len * W, words = bytes / 8, word0 = byte0 / 8;
  const ull* pn = reinterpret_cast<const ull*>(next + byte0);
  const ull* pb = reinterpret_cast<const ull*>(base + byte0);
  ull c = 0, s = 0;
  if (len == kBlockElems) {
    // A whole block: each thread's 2W words (coalesced) all in flight
    // before any is used (a loop of unknown length waited for each).
    ull xs[kWordsPerThread<W>], ys[kWordsPerThread<W>];
    SHMCAST_UNROLL
    for (unsigned i = 0; i < kWordsPerThread<W>; ++i) {
      xs[i] = pn[threadIdx.x + i * kThreads];
      ys[i] = pb[threadIdx.x + i * kThreads];
    }
    SHMCAST_UNROLL
    for (unsigned i = 0; i < kWordsPerThread<W>; ++i) {
      s += checksum_term(word0 + threadIdx.x + i * kThreads, xs[i]);
      c += static_cast<ull>(lanes_nonzero<W>(xs[i] ^ ys[i]));
    }
  } else {
    for (ull k = threadIdx.x; k < words; k += kThreads) {
      const ull x = pn[k], y = pb[k];
      s += checksum_term(word0 + k, x);
      c += static_cast<ull>(lanes_nonzero<W>(x ^ y));
    }
  }
  const unsigned tail = static_cast<unsigned>(bytes % 8);
  if (tail != 0 && threadIdx.x == 0) {
    const ull x = load_partial(next + byte0 + 8 * words, tail), y = load_partial(base + byte0 + 8 * words, tail);
    s += checksum_term(word0 + words, x);
    c += static_cast<ull>(lanes_nonzero<W>(x ^ y));
  }
  block_sum2(&c, &s, sh);
  if (threadIdx.x == 0) {
    table[b].offset = s;
    table[b].count = static_cast<unsigned>(c);
    table[b].reserved = 0;
  }
}

template <int W>
__device__ void count_body(const CountArgs& a) {
  __shared__ ull sh[2 * kWarps];
  for (ull b = blockIdx.x; b < a.blocks; b += gridDim.x) count_unit<W>(a, b, sh);
}

// The offsets and header of one blob from its counted table: the whole
// CUDA block (kScanThreads threads) takes it. Each thread takes a
// contiguous run of table entries; sizes from counts (kind_of), an
// exclusive scan into the offsets (warp shuffles, then the 32 warps'
// totals: no thread walks the 1024 partial sums alone), the checksum terms
// and counts summed; thread 0 writes the header. Every thread calls it;
// its shared memory is free again when it returns.
__device__ void scan_job(const ScanArgs& a) {
  __shared__ ull wsize_sh[32];
  __shared__ ull wsum_sh[32];
  __shared__ ull wchanged_sh[32];
  unsigned char* head = reinterpret_cast<unsigned char*>(a.head);
  Entry* table = reinterpret_cast<Entry*>(head + kHeaderBytes);
  const ull t = threadIdx.x, T = blockDim.x, nb = a.blocks;
  const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const ull per = (nb + T - 1) / T;
  const ull b0 = t * per < nb ? t * per : nb;
  const ull b1 = b0 + per < nb ? b0 + per : nb;
  ull size = 0, sum = 0, changed = 0;
  for (ull b = b0; b < b1; ++b) {
    const Entry e = table[b];
    const ull len = block_len(a.n, b);
    size += area_bytes(kind_of(e.count, len, a.w), e.count, len, a.w);
    sum += e.offset;  // the count kernel's checksum terms
    changed += e.count;
  }
  ull x = size;  // inclusive prefix within the warp
  for (int o = 1; o < 32; o <<= 1) {
    const ull y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= static_cast<unsigned>(o)) x += y;
  }
  const ull wsum = warp_sum(sum), wchanged = warp_sum(changed);
  if (lane == 31) wsize_sh[warp] = x;
  if (lane == 0) {
    wsum_sh[warp] = wsum;
    wchanged_sh[warp] = wchanged;
  }
  __syncthreads();
  if (warp == 0) {
    ull v = wsize_sh[lane];
    for (int o = 1; o < 32; o <<= 1) {
      const ull y = __shfl_up_sync(0xffffffffu, v, o);
      if (lane >= static_cast<unsigned>(o)) v += y;
    }
    const ull s = warp_sum(wsum_sh[lane]), c = warp_sum(wchanged_sh[lane]);
    // Each lane rewrites the entry it read; lane 0 writes the totals after
    // the shuffles above, which every lane reached after its reads.
    wsize_sh[lane] = v;  // inclusive prefix of the warps' totals
    if (lane == 0) {
      wsum_sh[0] = s;
      wchanged_sh[0] = c;
    }
  }
  __syncthreads();
  const ull total = wsize_sh[31];
  ull at = (warp > 0 ? wsize_sh[warp - 1] : 0) + x - size;
  for (ull b = b0; b < b1; ++b) {
    const unsigned count = table[b].count;
    const ull len = block_len(a.n, b);
    table[b].offset = at;
    table[b].reserved = 0;
    at += area_bytes(kind_of(count, len, a.w), count, len, a.w);
  }
  if (t == 0) {
    Header* h = reinterpret_cast<Header*>(head);
    h->magic = kMagic;
    h->format = kFormat;
    h->elem_bytes = static_cast<unsigned short>(a.w);
    h->block_elems = kBlockElems;
    h->reserved0 = 0;
    h->elems = a.n;
    h->blocks = nb;
    h->payload_bytes = total;
    h->checksum = checksum_final(wsum_sh[0], a.n * a.w);
    h->changed = wchanged_sh[0];
    h->reserved1 = 0;
  }
  __syncthreads();  // the shared words are read above before a next job rewrites them
}

}  // namespace

extern "C" __global__ void __launch_bounds__(kThreads) shmcast_delta_count_w1(CountArgs a) { count_body<1>(a); }
extern "C" __global__ void __launch_bounds__(kThreads) shmcast_delta_count_w2(CountArgs a) { count_body<2>(a); }
extern "C" __global__ void __launch_bounds__(kThreads) shmcast_delta_count_w4(CountArgs a) { count_body<4>(a); }
extern "C" __global__ void __launch_bounds__(kThreads) shmcast_delta_count_w8(CountArgs a) { count_body<8>(a); }

// One CUDA block of kScanThreads threads: the offsets and header (scan_job).
static_assert(kScanThreads == 32 * 32, "the scan kernel's warps' totals fit one warp");
extern "C" __global__ void __launch_bounds__(kScanThreads) shmcast_delta_scan(ScanArgs a) { scan_job(a); }

namespace {

// ---------------------------------------------------------------- encode

// Unit b of an encode: writes delta block b's area of the blob into `out`
// from the planned head (copied into out unless out is the head: the
// header by unit 0, each table entry by its block's unit) and makes that
// block of the base equal to next. Units: max(blocks, 1) (unit 0 also
// carries the header of an empty tensor). Every thread of the CUDA block
// calls it with the same b.
template <int W>
__device__ void encode_unit(const EncodeArgs& a, ull b) {
  typedef typename ElemOf<W>::T E;
  __shared__ unsigned scan_sh[kWarps];
  __shared__ ull sum_sh[kWarps];
  Scratch* sc = scratch_of(a.scratch);
  const unsigned char* head = reinterpret_cast<const unsigned char*>(a.head);
  const Header* hin = reinterpret_cast<const Header*>(head);
  const Entry* tin = reinterpret_cast<const Entry*>(head + kHeaderBytes);
  unsigned char* out = reinterpret_cast<unsigned char*>(a.out);
  const ull headb = head_bytes_for(a.blocks);  // the host checked out_bytes >= headb
  const ull payload = hin->payload_bytes;
  if (hin->magic != kMagic || hin->elems != a.n || hin->blocks != a.blocks || hin->elem_bytes != W ||
      payload > a.out_bytes - headb) {
    if (b == 0 && threadIdx.x == 0) atomicOr(&sc->status, kStOutTooSmall);
    return;
  }
  const bool copy_head = a.out != a.head;
  if (copy_head && b == 0 && threadIdx.x < kHeaderBytes / 8)
    reinterpret_cast<ull*>(out)[threadIdx.x] = reinterpret_cast<const ull*>(head)[threadIdx.x];
  if (b >= a.blocks) return;
  E* base = reinterpret_cast<E*>(a.base);
  const E* next = reinterpret_cast<const E*>(a.next);
  {
    const Entry e = tin[b];
    if (copy_head && threadIdx.x < 2)
      reinterpret_cast<ull*>(out + kHeaderBytes + kEntryBytes * b)[threadIdx.x] =
          reinterpret_cast<const ull*>(head + kHeaderBytes + kEntryBytes * b)[threadIdx.x];
    const ull len = block_len(a.n, b), e0 = b * kBlockElems;
    const unsigned count = e.count;
    const unsigned kind = kind_of(count, len, W);
    if (kind == kUnchanged) return;
    const ull size = area_bytes(kind, count, len, W);
    if (e.offset > payload || size > payload - e.offset) {
      if (threadIdx.x == 0) atomicOr(&sc->status, kStPlanMismatch);
      return;
    }
    unsigned char* area = out + headb + e.offset;
    if (kind == kDense) {
      E* vals = reinterpret_cast<E*>(area);
      ull diff = 0;
      for (ull j = threadIdx.x; j < len; j += kThreads) {
        const E x = next[e0 + j];
        if (x != base[e0 + j]) ++diff;
        vals[j] = x;
        base[e0 + j] = x;
      }
      for (ull p = len * W + threadIdx.x; p < size; p += kThreads) area[p] = 0;
      diff = block_sum(diff, sum_sh);
      if (threadIdx.x == 0 && diff != count) atomicOr(&sc->status, kStPlanMismatch);
      return;
    }
    // Sparse or bitmap: thread t's elements [16t, 16t + 16), in order. In
    // a whole block they are 2W aligned 8-byte words (the block starts at a
    // multiple of 4096 W bytes, `next` and the base are 8-byte aligned):
    // read once each, as words, into registers (a thread's 16 scalar loads,
    // 32 bytes apart across the warp, cost many times the L1 traffic).
    const unsigned j0 = threadIdx.x * kPerThread;
    const bool whole = len == kBlockElems;
    ull xn[kWordsPerThread<W>], xb[kWordsPerThread<W>];
    unsigned bits = 0;
    if (whole) {
      const ull* pn = reinterpret_cast<const ull*>(next + e0 + j0);
      const ull* pb = reinterpret_cast<const ull*>(base + e0 + j0);
SHMCAST_UNROLL
      for (unsigned k = 0; k < kWordsPerThread<W>; ++k) {
        xn[k] = pn[k];
        xb[k] = pb[k];
      }
SHMCAST_UNROLL
      for (unsigned i = 0; i < kPerThread; ++i)
        if (word_elem<W>(xn, i) != word_elem<W>(xb, i)) bits |= 1u << i;
    } else {
      for (unsigned i = 0; i < kPerThread; ++i) {
        const ull j = j0 + i;
        if (j < len && next[e0 + j] != base[e0 + j]) bits |= 1u << i;
      }
    }
    const unsigned mine = static_cast<unsigned>(__popc(bits));
    unsigned total = 0;
    const unsigned first = block_scan(mine, scan_sh, &total);
    if (total != count) {  // the same in every thread
      if (threadIdx.x == 0) atomicOr(&sc->status, kStPlanMismatch);
      return;
    }
    const ull vals_at = kind == kSparse ? align16(2ull * count) : bitmap_head_bytes(len);
    E* vals = reinterpret_cast<E*>(area + vals_at);
    unsigned short* idx = kind == kSparse ? reinterpret_cast<unsigned short*>(area) : nullptr;
    if (kind == kSparse) {
      for (ull p = 2ull * count + threadIdx.x; p < vals_at; p += kThreads) area[p] = 0;
    } else {
      // Bit j of the bitmap is bit j % 16 of the little-endian u16 j / 16:
      // thread t's 16 bits. The u16s past the block's elements are zero.
      unsigned short* bm = reinterpret_cast<unsigned short*>(area);
      if (threadIdx.x < vals_at / 2) bm[threadIdx.x] = static_cast<unsigned short>(bits);
    }
    if (whole) {
      unsigned pos = first;
SHMCAST_UNROLL
      for (unsigned i = 0; i < kPerThread; ++i) {
        if (!(bits >> i & 1u)) continue;
        if (idx != nullptr) idx[pos] = static_cast<unsigned short>(j0 + i);
        vals[pos] = word_elem<W>(xn, i);
        ++pos;
      }
      ull* pb = reinterpret_cast<ull*>(base + e0 + j0);
SHMCAST_UNROLL
      for (unsigned k = 0; k < kWordsPerThread<W>; ++k)
        if (xn[k] != xb[k]) pb[k] = xn[k];  // the base takes the new words (equal elements stay equal)
    } else {
      unsigned pos = first;
      for (unsigned i = 0; i < kPerThread; ++i) {
        if (!(bits >> i & 1u)) continue;
        const ull j = j0 + i;
        const E x = next[e0 + j];
        if (idx != nullptr) idx[pos] = static_cast<unsigned short>(j);
        vals[pos] = x;
        base[e0 + j] = x;
        ++pos;
      }
    }
    for (ull p = static_cast<ull>(count) * W + threadIdx.x; p < size - vals_at; p += kThreads)
      area[vals_at + p] = 0;
  }
}

template <int W>
__device__ void encode_body(const EncodeArgs& a) {
  const ull units = a.blocks > 0 ? a.blocks : 1;
  for (ull b = blockIdx.x; b < units; b += gridDim.x) encode_unit<W>(a, b);
}

// ---------------------------------------------------------------- apply

// Step 1: every check of docs/protocol.md on the blob (in device memory the
// caller owns: it cannot change between the steps). Only locations derived
// from the caller's n and blob size are read; header fields are compared,
// never used to address. Errors go to op_err; counts add up in op_sum.
// Unit b of a validation: the header (unit 0) and delta block b (when
// b < blocks). Every thread of the CUDA block calls it with the same b.
template <int W>
__device__ void validate_unit(const ValidateArgs& a, ull b, Scratch* sc) {
  __shared__ int ok_sh;
  __shared__ ull sum_sh[kWarps];
  const unsigned char* blob = reinterpret_cast<const unsigned char*>(a.blob);
  const Header* h = reinterpret_cast<const Header*>(blob);
  const Entry* table = reinterpret_cast<const Entry*>(blob + kHeaderBytes);
  const ull headb = head_bytes_for(a.blocks);  // the host checked blob_bytes >= headb
  const ull P = a.blob_bytes - headb;
  const unsigned char* payload = blob + headb;
  if (b == 0 && threadIdx.x == 0) {
    const bool bad = h->magic != kMagic || h->format != kFormat || h->elem_bytes != W ||
                     h->block_elems != kBlockElems || h->reserved0 != 0 || h->reserved1 != 0 || h->elems != a.n ||
                     h->blocks != a.blocks || h->payload_bytes != P;
    if (bad) atomicOr(&sc->op_err, kStBadHeader);
  }
  if (b >= a.blocks) return;
  {
    const ull len = block_len(a.n, b);
    if (threadIdx.x == 0) {
      const Entry e = table[b];
      bool ok = e.reserved == 0 && e.count <= len;
      const ull size = ok ? area_bytes(kind_of(e.count, len, W), e.count, len, W) : 0;
      ok = ok && e.offset <= P && size <= P - e.offset;
      const ull next_at = b + 1 < a.blocks ? table[b + 1].offset : P;
      ok = ok && e.offset + size == next_at && (b != 0 || e.offset == 0);
      if (ok)
        atomicAdd(reinterpret_cast<ull*>(&sc->op_sum), static_cast<ull>(e.count));
      else
        atomicOr(&sc->op_err, kStBadTable);
      ok_sh = ok ? 1 : 0;
    }
    __syncthreads();
    const int ok = ok_sh;
    __syncthreads();  // ok_sh is rewritten in the next unit
    if (!ok) return;
    const Entry e = table[b];
    const unsigned count = e.count;
    const unsigned kind = kind_of(count, len, W);
    const unsigned char* area = payload + e.offset;
    const ull size = area_bytes(kind, count, len, W);
    unsigned bad = 0;
    ull vals_at = size;  // where the values' padding check starts from (below)
    if (kind == kSparse) {
      const unsigned short* idx = reinterpret_cast<const unsigned short*>(area);
      for (ull k = threadIdx.x; k < count; k += kThreads) {
        const unsigned v = idx[k];
        if (v >= len || (k > 0 && idx[k - 1] >= v)) bad |= kStBadIndices;
      }
      vals_at = align16(2ull * count);
      for (ull p = 2ull * count + threadIdx.x; p < vals_at; p += kThreads)
        if (area[p] != 0) bad |= kStBadPadding;
    } else if (kind == kBitmap) {
      const ull* bm = reinterpret_cast<const ull*>(area);
      const ull words = (len + 63) / 64;
      ull ones = 0;
      for (ull k = threadIdx.x; k < words; k += kThreads) {
        const ull x = bm[k];
        const ull valid = len - 64 * k >= 64 ? ~0ull : (1ull << (len - 64 * k)) - 1;
        if (x & ~valid) bad |= kStBadBitmap;
        ones += static_cast<ull>(__popcll(x));
      }
      ones = block_sum(ones, sum_sh);
      if (threadIdx.x == 0 && ones != count) bad |= kStBadBitmap;
      vals_at = bitmap_head_bytes(len);
      for (ull p = 8 * words + threadIdx.x; p < vals_at; p += kThreads)
        if (area[p] != 0) bad |= kStBadPadding;
    } else if (kind == kDense) {
      for (ull p = len * W + threadIdx.x; p < size; p += kThreads)
        if (area[p] != 0) bad |= kStBadPadding;
    }
    if (kind == kSparse || kind == kBitmap)
      for (ull p = static_cast<ull>(count) * W + threadIdx.x; p < size - vals_at; p += kThreads)
        if (area[vals_at + p] != 0) bad |= kStBadPadding;
    if (bad != 0) atomicOr(&sc->op_err, bad);
  }
}

template <int W>
__device__ void validate_body(const ValidateArgs& a) {
  const ull units = a.blocks > 0 ? a.blocks : 1;
  for (ull b = blockIdx.x; b < units; b += gridDim.x) validate_unit<W>(a, b, scratch_of(a.scratch));
}

// Step 2: writes the new elements the slice map selects, unless step 1
// found anything (then block 0 records the rejection and nothing is
// written).
// Unit b of an apply: the rejection (unit 0 records it: `op` holds the
// validation's words, `st` takes the status) and delta block b.
template <int W>
__device__ void apply_unit(const ApplyArgs& a, ull b, Scratch* op, Scratch* st) {
  typedef typename ElemOf<W>::T E;
  __shared__ unsigned scan_sh[kWarps];
  const unsigned char* blob = reinterpret_cast<const unsigned char*>(a.blob);
  const Header* h = reinterpret_cast<const Header*>(blob);
  const Entry* table = reinterpret_cast<const Entry*>(blob + kHeaderBytes);
  const unsigned char* payload = blob + head_bytes_for(a.blocks);
  const unsigned err = op->op_err;
  const ull sum = op->op_sum;
  if (err != 0 || sum != h->changed) {
    if (b == 0 && threadIdx.x == 0) {
      const unsigned why = err != 0 ? err : static_cast<unsigned>(kStBadChanged);
      atomicOr(&op->op_err, why);  // so that a verification after it is skipped
      atomicOr(&st->status, why);
    }
    return;
  }
  if (b >= a.blocks) return;
  E* dst = reinterpret_cast<E*>(a.dst);
  {
    const Entry e = table[b];
    const ull len = block_len(a.n, b), e0 = b * kBlockElems;
    const unsigned count = e.count;
    const unsigned kind = kind_of(count, len, W);
    const unsigned char* area = payload + e.offset;
    if (kind == kSparse) {
      const unsigned short* idx = reinterpret_cast<const unsigned short*>(area);
      const E* vals = reinterpret_cast<const E*>(area + align16(2ull * count));
      for (ull k = threadIdx.x; k < count; k += kThreads) {
        uint64_t d;
        if (map_element(a.map, e0 + idx[k], &d)) dst[d] = vals[k];
      }
    } else if (kind == kBitmap) {
      const ull vals_at = bitmap_head_bytes(len);
      const unsigned short* bm = reinterpret_cast<const unsigned short*>(area);
      const E* vals = reinterpret_cast<const E*>(area + vals_at);
      const unsigned bits = threadIdx.x < vals_at / 2 ? bm[threadIdx.x] : 0u;
      unsigned total = 0;
      unsigned pos = block_scan(static_cast<unsigned>(__popc(bits)), scan_sh, &total);
      const ull j0 = static_cast<ull>(threadIdx.x) * kPerThread;
      for (unsigned i = 0; i < kPerThread; ++i) {
        if (!(bits >> i & 1u)) continue;
        uint64_t d;
        if (map_element(a.map, e0 + j0 + i, &d)) dst[d] = vals[pos];
        ++pos;
      }
    } else if (kind == kDense) {
      const E* vals = reinterpret_cast<const E*>(area);
      for (ull j = threadIdx.x; j < len; j += kThreads) {
        uint64_t d;
        if (map_element(a.map, e0 + j, &d)) dst[d] = vals[j];
      }
    }
  }
}

template <int W>
__device__ void apply_body(const ApplyArgs& a) {
  Scratch* sc = scratch_of(a.scratch);
  const ull units = a.blocks > 0 ? a.blocks : 1;
  for (ull b = blockIdx.x; b < units; b += gridDim.x) apply_unit<W>(a, b, sc, sc);
}

// The job of unit u of a batch: the last whose first unit is <= u (of
// checksum units with `sums`; jobs without any are skipped over that way).
__device__ const ApplyJob* job_at(const BatchArgs& a, ull u, bool sums) {
  const ApplyJob* jobs = reinterpret_cast<const ApplyJob*>(a.jobs);
  ull lo = 0, hi = a.njobs;
  while (hi - lo > 1) {
    const ull mid = lo + (hi - lo) / 2;
    if ((sums ? jobs[mid].sum_unit0 : jobs[mid].unit0) <= u)
      lo = mid;
    else
      hi = mid;
  }
  return jobs + lo;
}

}  // namespace

extern "C" __global__ void __launch_bounds__(kThreads) shmcast_delta_encode_w1(EncodeArgs a) { encode_body<1>(a); }
extern "C" __global__ void __launch_bounds__(kThreads) shmcast_delta_encode_w2(EncodeArgs a) { encode_body<2>(a); }
extern "C" __global__ void __launch_bounds__(kThreads) shmcast_delta_encode_w4(EncodeArgs a) { encode_body<4>(a); }
extern "C" __global__ void __launch_bounds__(kThreads) shmcast_delta_encode_w8(EncodeArgs a) { encode_body<8>(a); }

extern "C" __global__ void __launch_bounds__(kThreads) shmcast_delta_validate_w1(ValidateArgs a) { validate_body<1>(a); }
extern "C" __global__ void __launch_bounds__(kThreads) shmcast_delta_validate_w2(ValidateArgs a) { validate_body<2>(a); }
extern "C" __global__ void __launch_bounds__(kThreads) shmcast_delta_validate_w4(ValidateArgs a) { validate_body<4>(a); }
extern "C" __global__ void __launch_bounds__(kThreads) shmcast_delta_validate_w8(ValidateArgs a) { validate_body<8>(a); }

extern "C" __global__ void __launch_bounds__(kThreads) shmcast_delta_apply_w1(ApplyArgs a) { apply_body<1>(a); }
extern "C" __global__ void __launch_bounds__(kThreads) shmcast_delta_apply_w2(ApplyArgs a) { apply_body<2>(a); }
extern "C" __global__ void __launch_bounds__(kThreads) shmcast_delta_apply_w4(ApplyArgs a) { apply_body<4>(a); }
extern "C" __global__ void __launch_bounds__(kThreads) shmcast_delta_apply_w8(ApplyArgs a) { apply_body<8>(a); }

// ---------------------------------------------------------------- checksum

// Adds the checksum terms of [data, data + bytes) to scratch->sum (any
// alignment: byte loads when data is not 8-byte aligned).
extern "C" __global__ void __launch_bounds__(kThreads) shmcast_delta_checksum(ChecksumArgs a) {
  __shared__ ull sh[kWarps];
  const unsigned char* p = reinterpret_cast<const unsigned char*>(a.data);
  const ull words = a.bytes / 8;
  const bool aligned = (a.data & 7) == 0;
  ull s = 0;
  const ull stride = static_cast<ull>(gridDim.x) * kThreads;
  for (ull i = static_cast<ull>(blockIdx.x) * kThreads + threadIdx.x; i < words; i += stride) {
    const ull x = aligned ? reinterpret_cast<const ull*>(p)[i] : load_partial(p + 8 * i, 8);
    s += checksum_term(i, x);
  }
  const unsigned tail = static_cast<unsigned>(a.bytes % 8);
  if (tail != 0 && blockIdx.x == 0 && threadIdx.x == 0) s += checksum_term(words, load_partial(p + 8 * words, tail));
  s = block_sum(s, sh);
  if (threadIdx.x == 0 && s != 0) atomicAdd(reinterpret_cast<ull*>(&scratch_of(a.scratch)->sum), s);
}

// One thread: the final checksum of scratch->sum over `bytes` bytes, stored
// at `out` and/or compared with a blob's header (only when op_err is 0).
extern "C" __global__ void shmcast_delta_finish(FinishArgs a) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  Scratch* sc = scratch_of(a.scratch);
  const ull c = checksum_final(sc->sum, a.bytes);
  if (a.out != 0) *reinterpret_cast<ull*>(a.out) = c;
  if (a.blob != 0 && sc->op_err == 0 && reinterpret_cast<const Header*>(a.blob)->checksum != c)
    atomicOr(&sc->status, kStBadChecksum);
}

// One thread: clears the per-operation words (and the status with `all`).
extern "C" __global__ void shmcast_delta_reset(ResetArgs a) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  Scratch* sc = scratch_of(a.scratch);
  sc->op_err = 0;
  sc->op_sum = 0;
  sc->sum = 0;
  if (a.all != 0) sc->status = 0;
}

#include "engine/kernels/delta_batch.cuh"
