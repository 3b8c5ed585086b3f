// A CUDA build without nvcc: no delta kernels (delta_kernels.cmake). The
// CUDA delta codec sees kDeltaPtxBytes == 0 and says how to get them.
#include <cstddef>

namespace shmcast::detail::delta {
extern const unsigned char kDeltaPtx[];
extern const std::size_t kDeltaPtxBytes;
const unsigned char kDeltaPtx[] = {0};
const std::size_t kDeltaPtxBytes = 0;
}  // namespace shmcast::detail::delta
