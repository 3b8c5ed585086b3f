// Device side of content.hpp (cuda_kernels.cu, built by nvcc): fills a tensor
// with the bytes of a key and counts the 8-byte words that differ from them,
// on the device, so that checking 6 GB per sync takes milliseconds.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace bench::kernels {

// The bytes at p..p+n become the bytes of `key` (word w = splitmix64(key +
// (w + 1) * golden), little-endian; a last partial word is cut short).
cudaError_t fill(void* p, std::uint64_t n, std::uint64_t key, cudaStream_t s);
// Adds to *bad (device memory) the number of words in p..p+n that differ from
// the bytes of `key`.
cudaError_t count_bad(const void* p, std::uint64_t n, std::uint64_t key, unsigned long long* bad, cudaStream_t s);

}  // namespace bench::kernels
