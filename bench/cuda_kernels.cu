// The CUDA bench's content kernels (cuda_kernels.hpp).
#include <cstdint>

#include "cuda_kernels.hpp"

namespace bench::kernels {

namespace {

constexpr std::uint64_t kGolden = 0x9E3779B97F4A7C15ull;

__device__ __forceinline__ std::uint64_t word(std::uint64_t key, std::uint64_t w) {
  std::uint64_t x = key + (w + 1) * kGolden;
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

// Aligned: one 8-byte word per thread and step; the tail bytes by thread 0.
__global__ void fill_words(std::uint64_t* p, std::uint64_t words, std::uint8_t* tail, unsigned ntail,
                           std::uint64_t key) {
  const std::uint64_t stride = std::uint64_t{gridDim.x} * blockDim.x;
  for (std::uint64_t w = std::uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; w < words; w += stride)
    p[w] = word(key, w);
  if (blockIdx.x == 0 && threadIdx.x == 0 && ntail) {
    const std::uint64_t v = word(key, words);
    for (unsigned b = 0; b < ntail; ++b) tail[b] = static_cast<std::uint8_t>(v >> (8 * b));
  }
}

__global__ void check_words(const std::uint64_t* p, std::uint64_t words, const std::uint8_t* tail, unsigned ntail,
                            std::uint64_t key, unsigned long long* bad) {
  const std::uint64_t stride = std::uint64_t{gridDim.x} * blockDim.x;
  unsigned long long n = 0;
  for (std::uint64_t w = std::uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; w < words; w += stride)
    n += p[w] != word(key, w);
  if (blockIdx.x == 0 && threadIdx.x == 0 && ntail) {
    const std::uint64_t v = word(key, words);
    for (unsigned b = 0; b < ntail; ++b) n += tail[b] != static_cast<std::uint8_t>(v >> (8 * b));
  }
  if (n) atomicAdd(bad, n);
}

// Any alignment: byte by byte (slow; the bench's buffers are 256-byte aligned).
__global__ void fill_bytes(std::uint8_t* p, std::uint64_t n, std::uint64_t key) {
  const std::uint64_t stride = std::uint64_t{gridDim.x} * blockDim.x;
  for (std::uint64_t i = std::uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride)
    p[i] = static_cast<std::uint8_t>(word(key, i / 8) >> (8 * (i % 8)));
}

__global__ void check_bytes(const std::uint8_t* p, std::uint64_t n, std::uint64_t key, unsigned long long* bad) {
  const std::uint64_t stride = std::uint64_t{gridDim.x} * blockDim.x;
  unsigned long long c = 0;
  for (std::uint64_t i = std::uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride)
    c += p[i] != static_cast<std::uint8_t>(word(key, i / 8) >> (8 * (i % 8)));
  if (c) atomicAdd(bad, c);
}

// Element e (of `elems` 2-byte elements) changes when its hash falls below
// `threshold` (fraction * 2^64): xor with a non-zero 16-bit value.
__global__ void mutate_u16(std::uint16_t* p, std::uint64_t elems, std::uint64_t key, std::uint64_t threshold) {
  const std::uint64_t stride = std::uint64_t{gridDim.x} * blockDim.x;
  for (std::uint64_t e = std::uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; e < elems; e += stride) {
    const std::uint64_t h = word(key, e);
    if (h < threshold) p[e] ^= static_cast<std::uint16_t>((h >> 17) | 1);
  }
}

__global__ void diff_words(const std::uint64_t* a, const std::uint64_t* b, std::uint64_t words,
                           unsigned long long* bad) {
  const std::uint64_t stride = std::uint64_t{gridDim.x} * blockDim.x;
  unsigned long long n = 0;
  for (std::uint64_t w = std::uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; w < words; w += stride)
    n += a[w] != b[w];
  if (n) atomicAdd(bad, n);
}

unsigned blocks_for(std::uint64_t items) {
  const std::uint64_t b = (items + 255) / 256;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 4096 ? 4096 : b));
}

}  // namespace

cudaError_t fill(void* p, std::uint64_t n, std::uint64_t key, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  auto* b = static_cast<std::uint8_t*>(p);
  if (reinterpret_cast<std::uintptr_t>(p) % 8 == 0)
    fill_words<<<blocks_for(n / 8), 256, 0, s>>>(reinterpret_cast<std::uint64_t*>(b), n / 8, b + n / 8 * 8,
                                                 static_cast<unsigned>(n % 8), key);
  else
    fill_bytes<<<blocks_for(n), 256, 0, s>>>(b, n, key);
  return cudaGetLastError();
}

cudaError_t count_bad(const void* p, std::uint64_t n, std::uint64_t key, unsigned long long* bad, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  const auto* b = static_cast<const std::uint8_t*>(p);
  if (reinterpret_cast<std::uintptr_t>(p) % 8 == 0)
    check_words<<<blocks_for(n / 8), 256, 0, s>>>(reinterpret_cast<const std::uint64_t*>(b), n / 8, b + n / 8 * 8,
                                                  static_cast<unsigned>(n % 8), key, bad);
  else
    check_bytes<<<blocks_for(n), 256, 0, s>>>(b, n, key, bad);
  return cudaGetLastError();
}

cudaError_t mutate_u16(void* p, std::uint64_t n, double fraction, std::uint64_t key, cudaStream_t s) {
  if (n < 2 || fraction <= 0) return cudaSuccess;
  const double t = fraction >= 1 ? 18446744073709551615.0 : fraction * 18446744073709551616.0;
  const std::uint64_t threshold = fraction >= 1 ? ~0ull : static_cast<std::uint64_t>(t);
  mutate_u16<<<blocks_for(n / 2), 256, 0, s>>>(static_cast<std::uint16_t*>(p), n / 2, key, threshold);
  return cudaGetLastError();
}

cudaError_t count_diff(const void* a, const void* b, std::uint64_t n, unsigned long long* bad, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  if (n % 8 != 0 || reinterpret_cast<std::uintptr_t>(a) % 8 != 0 || reinterpret_cast<std::uintptr_t>(b) % 8 != 0)
    return cudaErrorInvalidValue;
  diff_words<<<blocks_for(n / 8), 256, 0, s>>>(static_cast<const std::uint64_t*>(a),
                                                static_cast<const std::uint64_t*>(b), n / 8, bad);
  return cudaGetLastError();
}

}  // namespace bench::kernels
