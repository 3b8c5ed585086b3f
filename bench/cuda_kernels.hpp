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
// Changes about `fraction` of the 2-byte elements of p..p+n (bf16 weights),
// at positions and to values the key decides (each changed element gets
// other bits): the same call on equal bytes gives equal bytes.
cudaError_t mutate_u16(void* p, std::uint64_t n, double fraction, std::uint64_t key, cudaStream_t s);
// Adds to *bad the number of 8-byte words in which a..a+n and b..b+n differ
// (n a multiple of 8, both 8-byte aligned).
cudaError_t count_diff(const void* a, const void* b, std::uint64_t n, unsigned long long* bad, cudaStream_t s);

}  // namespace bench::kernels
