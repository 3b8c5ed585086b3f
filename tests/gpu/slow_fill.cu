// slow_fill with kernels: one thread spins on clock64() for the delay, then a
// grid-stride kernel writes mix_byte(seed, i). Compiled only when nvcc exists.
#include "slow_fill.hpp"

namespace shmcast_gpu {
namespace {

__device__ std::uint8_t mix_byte_d(std::uint64_t seed, std::uint64_t i) {
  std::uint64_t x = seed ^ (i * 0x9E3779B97F4A7C15ull);
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return static_cast<std::uint8_t>(x);
}

__global__ void spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

__global__ void fill(std::uint8_t* p, std::size_t n, std::uint64_t seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    p[i] = mix_byte_d(seed, i);
}

}  // namespace

cudaError_t slow_fill(void* p, std::size_t n, std::uint64_t seed, int delay_ms, cudaStream_t stream) {
  int dev = 0, khz = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, dev);
  if (e != cudaSuccess) return e;
  if (khz <= 0) khz = 1000000;
  spin<<<1, 1, 0, stream>>>(static_cast<long long>(khz) * delay_ms);
  e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  fill<<<1024, 256, 0, stream>>>(static_cast<std::uint8_t*>(p), n, seed);
  return cudaGetLastError();
}

void slow_fill_expected(std::uint8_t* host, std::size_t n, std::uint64_t seed) {
  for (std::size_t i = 0; i < n; ++i) host[i] = mix_byte(seed, i);
}

bool slow_fill_uses_kernel() { return true; }

}  // namespace shmcast_gpu
