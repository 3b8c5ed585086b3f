// slow_fill without nvcc: a host function that sleeps holds the stream, then
// cudaMemsetAsync writes one byte value derived from the seed.
#include <chrono>
#include <thread>

#include "slow_fill.hpp"

namespace shmcast_gpu {
namespace {

void CUDART_CB sleep_fn(void* arg) {
  std::this_thread::sleep_for(std::chrono::milliseconds(reinterpret_cast<std::intptr_t>(arg)));
}

std::uint8_t byte_of(std::uint64_t seed) { return static_cast<std::uint8_t>(mix_byte(seed, 0) | 1); }

}  // namespace

cudaError_t slow_fill(void* p, std::size_t n, std::uint64_t seed, int delay_ms, cudaStream_t stream) {
  cudaError_t e = cudaLaunchHostFunc(stream, &sleep_fn, reinterpret_cast<void*>(static_cast<std::intptr_t>(delay_ms)));
  if (e != cudaSuccess) return e;
  return cudaMemsetAsync(p, byte_of(seed), n, stream);
}

void slow_fill_expected(std::uint8_t* host, std::size_t n, std::uint64_t seed) {
  for (std::size_t i = 0; i < n; ++i) host[i] = byte_of(seed);
}

bool slow_fill_uses_kernel() { return false; }

}  // namespace shmcast_gpu
