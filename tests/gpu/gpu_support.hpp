// Helpers for the GPU tier. The gtest process itself never initialises CUDA:
// CUDA must not be initialised before fork(), so every CUDA call, including
// the "is there a GPU?" probe, runs in a forked child.
#pragma once

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "support.hpp"

namespace shmcast_gpu {

// Probed once per test process, in a child.
inline bool gpu_present() {
  static int cached = -1;
  if (cached < 0) {
    shmcast_test::Child c = shmcast_test::Child::spawn([] { return shmcast::cuda_available() ? 0 : 1; });
    cached = c.wait(std::chrono::seconds(60)) == 0 ? 1 : 0;
  }
  return cached == 1;
}

#define SHMCAST_REQUIRE_GPU()                                                              \
  do {                                                                                     \
    if (!shmcast_gpu::gpu_present()) GTEST_SKIP() << "no usable CUDA device on this machine"; \
  } while (0)

inline void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
  }
}

// A device allocation freed on scope exit (nullptr for 0 bytes).
struct DevBuf {
  void* p = nullptr;
  std::size_t n = 0;
  DevBuf() = default;
  explicit DevBuf(std::size_t bytes) : n(bytes) {
    if (n) ck(cudaMalloc(&p, n), "cudaMalloc");
  }
  DevBuf(DevBuf&& o) noexcept : p(o.p), n(o.n) { o.p = nullptr; }
  DevBuf& operator=(DevBuf&& o) noexcept {
    std::swap(p, o.p);
    std::swap(n, o.n);
    return *this;
  }
  ~DevBuf() {
    if (p) cudaFree(p);
  }
  void upload(const void* host, std::size_t bytes) {
    if (bytes) ck(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
  }
};

inline std::vector<std::uint8_t> download(const void* dev, std::size_t n) {
  std::vector<std::uint8_t> v(n);
  if (n) ck(cudaMemcpy(v.data(), dev, n, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
  return v;
}

inline std::vector<std::uint8_t> pattern(std::size_t n, std::uint64_t seed) {
  std::vector<std::uint8_t> v(n);
  shmcast_test::fill_pattern(v.data(), n, seed);
  return v;
}

// Index of the first differing byte, or -1.
inline long long first_diff(const std::vector<std::uint8_t>& a, const std::vector<std::uint8_t>& b) {
  if (a.size() != b.size()) return 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return static_cast<long long>(i);
  return -1;
}

}  // namespace shmcast_gpu
