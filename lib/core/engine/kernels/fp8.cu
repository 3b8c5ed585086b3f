// Quantize-on-send's kernels (engine/fp8_cuda.cpp launches them; the format
// is engine/quant.hpp's, and these make the same bits as quant_host.cpp).
// Compiled to PTX by nvcc at build time and embedded (fp8_kernels.cmake).
//
// Every float operation that decides a bit is written with an explicit
// round-to-nearest intrinsic (__fmul_rn, __fadd_rn, __fdiv_rn): nvcc would
// otherwise contract the product and the conversion's add into one FMA, and
// the host rounds each separately.

namespace {

constexpr int kBlock = 128;
constexpr int kThreads = 256;
// DType values (shmcast.hpp): the sources quantize-on-send takes.
constexpr int kF16 = 10, kF32 = 12;  // and 11, bf16

__device__ __forceinline__ float half_to_float(unsigned short h) {
  const unsigned int sign = (h & 0x8000u) << 16;
  const int exp = (h >> 10) & 0x1f;
  unsigned int man = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in float
    const float v = __int2float_rn(static_cast<int>(man)) * 5.9604644775390625e-8f;
    return __int_as_float(static_cast<int>(sign | static_cast<unsigned int>(__float_as_int(v))));
  }
  if (exp == 31) return __int_as_float(static_cast<int>(sign | 0x7f800000u | (man << 13)));
  return __int_as_float(static_cast<int>(sign | (static_cast<unsigned int>(exp - 15 + 127) << 23) | (man << 13)));
}

__device__ __forceinline__ float load(const unsigned char* row, long long c, int dtype) {
  if (dtype == kF32) return reinterpret_cast<const float*>(row)[c];
  const unsigned short h = reinterpret_cast<const unsigned short*>(row)[c];
  if (dtype == kF16) return half_to_float(h);
  return __int_as_float(static_cast<int>(static_cast<unsigned int>(h) << 16));  // kBF16
}

// torch's float -> float8_e4m3fn (c10 fp8e4m3fn_from_fp32_value), as
// quant_host.cpp's to_e4m3fn.
__device__ __forceinline__ unsigned char to_e4m3fn(float f) {
  unsigned int b = static_cast<unsigned int>(__float_as_int(f));
  const unsigned int sign = b & 0x80000000u;
  b ^= sign;
  unsigned int code;
  if (b >= 0x43F00000u) {
    code = 0x7f;
  } else if (b < 0x3C800000u) {
    code = static_cast<unsigned int>(__float_as_int(__fadd_rn(__int_as_float(static_cast<int>(b)), 16384.0f))) -
           0x46800000u;
  } else {
    const unsigned int odd = (b >> 20) & 1u;
    b += 0xC407FFFFu + odd;
    code = b >> 20;
  }
  return static_cast<unsigned char>((code | (sign >> 24)) & 0xffu);
}

}  // namespace

// One CUDA block per 128 x 128 block of the [rows, cols] source (row r at
// src + r * pitch): its amax, then its scale_inv and multiplier. A NaN or
// Inf sets *bad to the least linear block index + 1 that holds one.
extern "C" __global__ void __launch_bounds__(kThreads)
    shmcast_fp8_block_scales(const unsigned char* src, int dtype, long long rows, long long cols,
                             unsigned long long pitch, int ue8m0, float* scale_inv, float* mult,
                             unsigned long long* bad) {
  const long long br = blockIdx.y, bc = blockIdx.x;
  float amax = 0.0f;
  int nonfinite = 0;
  for (int k = threadIdx.x; k < kBlock * kBlock; k += kThreads) {
    const long long r = br * kBlock + (k / kBlock), c = bc * kBlock + (k % kBlock);
    if (r >= rows || c >= cols) continue;
    const float a = fabsf(load(src + r * pitch, c, dtype));
    if (!(a <= 3.402823466e38f))
      nonfinite = 1;
    else if (a > amax)
      amax = a;
  }
  for (int off = 16; off > 0; off >>= 1) {
    amax = fmaxf(amax, __shfl_down_sync(0xffffffffu, amax, off));
    nonfinite |= __shfl_down_sync(0xffffffffu, nonfinite, off);
  }
  __shared__ float warp_max[kThreads / 32];
  __shared__ int warp_bad[kThreads / 32];
  if (threadIdx.x % 32 == 0) {
    warp_max[threadIdx.x / 32] = amax;
    warp_bad[threadIdx.x / 32] = nonfinite;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int w = 1; w < kThreads / 32; ++w) {
    amax = fmaxf(amax, warp_max[w]);
    nonfinite |= warp_bad[w];
  }
  const long long i = br * gridDim.x + bc;
  if (nonfinite) atomicMin(bad, static_cast<unsigned long long>(i) + 1ull);
  const float a = amax < 1e-4f ? 1e-4f : amax;
  if (ue8m0) {
    const unsigned int b = static_cast<unsigned int>(__float_as_int(__fdiv_rn(a, 448.0f)));
    unsigned int e = ((b >> 23) & 0xffu) + ((b & 0x7fffffu) != 0 ? 1u : 0u);
    e = e < 1u ? 1u : (e > 254u ? 254u : e);
    const float s = __int_as_float(static_cast<int>(e << 23));
    scale_inv[i] = s;
    mult[i] = __fdiv_rn(1.0f, s);
  } else {
    scale_inv[i] = __fdiv_rn(a, 448.0f);
    mult[i] = __fmul_rn(__fdiv_rn(1.0f, a), 448.0f);  // torch: x_amax.reciprocal() * 448.0
  }
}

// The e4m3fn codes of elements [first, first + n) (row-major) of the source
// into dst[0, n): device memory, or pinned host memory the device maps
// (a host slot, over PCIe). Each thread makes 16 output bytes at a time and
// stores them at once (a warp writes 512 contiguous bytes): the bytes up to
// dst's first 16-byte boundary (the head) and after the last whole group
// (the tail) are two more work items, made byte by byte.
namespace {

__device__ __forceinline__ unsigned char one(const unsigned char* src, int dtype, long long cols,
                                             unsigned long long pitch, const float* mult, long long bcols,
                                             unsigned long long e) {
  const long long r = static_cast<long long>(e / static_cast<unsigned long long>(cols));
  const long long c = static_cast<long long>(e % static_cast<unsigned long long>(cols));
  return to_e4m3fn(__fmul_rn(load(src + r * pitch, c, dtype), mult[(r / kBlock) * bcols + c / kBlock]));
}

__device__ __forceinline__ float bits16(unsigned int w, int hi, int dtype) {
  const unsigned short h = static_cast<unsigned short>(hi ? (w >> 16) : (w & 0xffffu));
  if (dtype == kF16) return half_to_float(h);
  return __int_as_float(static_cast<int>(static_cast<unsigned int>(h) << 16));  // kBF16
}

}  // namespace

extern "C" __global__ void __launch_bounds__(kThreads)
    shmcast_fp8_quantize(const unsigned char* src, int dtype, long long rows, long long cols,
                         unsigned long long pitch, const float* mult, long long bcols, unsigned char* dst,
                         unsigned long long first, unsigned long long n) {
  (void)rows;
  const unsigned long long mis = reinterpret_cast<unsigned long long>(dst) & 15ull;
  const unsigned long long head = mis == 0 ? 0 : (16 - mis < n ? 16 - mis : n);
  const unsigned long long groups = (n - head) / 16, tail = head + groups * 16;
  const unsigned long long step = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  const bool narrow = first + n <= 0xffffffffull && static_cast<unsigned long long>(cols) <= 0xffffffffull;
  for (unsigned long long g = blockIdx.x * static_cast<unsigned long long>(blockDim.x) + threadIdx.x; g < groups + 2;
       g += step) {
    if (g >= groups) {  // groups: the head; groups + 1: the tail
      const unsigned long long a = g == groups ? 0 : tail, b = g == groups ? head : n;
      for (unsigned long long i = a; i < b; ++i) dst[i] = one(src, dtype, cols, pitch, mult, bcols, first + i);
      continue;
    }
    const unsigned long long o = head + 16 * g, e = first + o;
    long long r, c;
    if (narrow) {  // 32-bit division where it suffices: a 64-bit one costs more than the group's arithmetic
      const unsigned int e32 = static_cast<unsigned int>(e), c32 = static_cast<unsigned int>(cols);
      r = e32 / c32;
      c = e32 - static_cast<unsigned int>(r) * c32;
    } else {
      r = static_cast<long long>(e / static_cast<unsigned long long>(cols));
      c = static_cast<long long>(e % static_cast<unsigned long long>(cols));
    }
    unsigned int w[4] = {0, 0, 0, 0};
    if (c + 16 <= cols) {  // one row: its 16 elements, loaded 16 bytes at a time where aligned
      const unsigned char* row = src + r * pitch;
      const float* mrow = mult + (r / kBlock) * bcols;
      float x[16];
      const size_t es = dtype == kF32 ? 4 : 2;
      const unsigned char* at = row + static_cast<size_t>(c) * es;
      if ((reinterpret_cast<unsigned long long>(at) & 15ull) == 0) {
        const uint4* v = reinterpret_cast<const uint4*>(at);
        if (dtype == kF32) {
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const uint4 q = v[k];
            x[4 * k] = __uint_as_float(q.x);
            x[4 * k + 1] = __uint_as_float(q.y);
            x[4 * k + 2] = __uint_as_float(q.z);
            x[4 * k + 3] = __uint_as_float(q.w);
          }
        } else {
#pragma unroll
          for (int k = 0; k < 2; ++k) {
            const uint4 q = v[k];
            const unsigned int u[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              x[8 * k + 2 * j] = bits16(u[j], 0, dtype);
              x[8 * k + 2 * j + 1] = bits16(u[j], 1, dtype);
            }
          }
        }
      } else {
#pragma unroll
        for (int j = 0; j < 16; ++j) x[j] = load(row, c + j, dtype);
      }
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const unsigned int b = to_e4m3fn(__fmul_rn(x[j], mrow[(c + j) / kBlock]));
        w[j / 4] |= b << (8 * (j % 4));
      }
    } else {  // the group crosses a row's end
#pragma unroll 1
      for (int j = 0; j < 16; ++j) {
        const unsigned int b = one(src, dtype, cols, pitch, mult, bcols, e + static_cast<unsigned long long>(j));
        w[j / 4] |= b << (8 * (j % 4));
      }
    }
    *reinterpret_cast<uint4*>(dst + o) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}
