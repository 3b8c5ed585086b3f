// Writes a tensor's bytes on a CUDA stream, late: the write starts only after
// about `delay_ms` of other work queued on that stream. With nvcc (CUDA
// language enabled for tests/gpu) that is a spinning kernel followed by a fill
// kernel; without it, a host function that sleeps followed by cudaMemsetAsync.
// Either way the bytes appear on the stream long after the call returns, so a
// copy that is not ordered after the stream reads the old bytes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace shmcast_gpu {

// Queues the late write of `n` bytes at device pointer `p` on `stream`.
cudaError_t slow_fill(void* p, std::size_t n, std::uint64_t seed, int delay_ms, cudaStream_t stream);
// What slow_fill writes, computed on the host.
void slow_fill_expected(std::uint8_t* host, std::size_t n, std::uint64_t seed);
// True when slow_fill uses kernels (built with nvcc).
bool slow_fill_uses_kernel();

// Shared by the kernel and the host check.
inline std::uint8_t mix_byte(std::uint64_t seed, std::uint64_t i) {
  std::uint64_t x = seed ^ (i * 0x9E3779B97F4A7C15ull);
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return static_cast<std::uint8_t>(x);
}

}  // namespace shmcast_gpu
