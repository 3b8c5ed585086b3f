// A CUDA build without nvcc: no quantize-on-send kernels (fp8_kernels.cmake).
// GPU quantization sees kFp8PtxBytes == 0 and says how to get them.
#include <cstddef>

namespace shmcast::detail::quant {
extern const unsigned char kFp8Ptx[];
extern const std::size_t kFp8PtxBytes;
const unsigned char kFp8Ptx[] = {0};
const std::size_t kFp8PtxBytes = 0;
}  // namespace shmcast::detail::quant
