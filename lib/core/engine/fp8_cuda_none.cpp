// Built without SHMCAST_WITH_CUDA: GPU quantization reports, at run time,
// that this build has no CUDA (fp8_cuda.hpp).
#include "engine/fp8_cuda.hpp"

namespace shmcast::detail::quant {

namespace {
constexpr const char* kNoCuda = "this shmcast was built without CUDA: rebuild with -DSHMCAST_WITH_CUDA=ON (needs the "
                                "CUDA toolkit) to quantize GPU tensors, or send them from host memory";
[[noreturn]] void no_cuda() { throw Error(Errc::kCudaUnavailable, kNoCuda); }
}  // namespace

struct CudaQuantizer::Impl {};

bool cuda_quantize_available(std::string* why) {
  if (why) *why = kNoCuda;
  return false;
}

CudaQuantizer::CudaQuantizer() = default;
CudaQuantizer::~CudaQuantizer() = default;
std::string CudaQuantizer::scales(const Matrix&, Quantize, void*, Scales*) { no_cuda(); }
void CudaQuantizer::quantize(const Matrix&, std::byte*, std::uint64_t, std::uint64_t, void*) { no_cuda(); }
std::byte* CudaQuantizer::staging(std::uint64_t) { no_cuda(); }
void CudaQuantizer::reset() {}
std::string CudaQuantizer::scales_batch(const std::vector<const Matrix*>&, Quantize, void*, DeviceScales*, std::size_t*) {
  no_cuda();
}
CudaQuantizer::Fill::Fill(CudaQuantizer& q, const Matrix& m, std::uint64_t, std::int64_t)
    : q_(&q), m_(m), mult_(0), bcols_(0) {
  no_cuda();
}
CudaQuantizer::Fill::Fill(CudaQuantizer& q, const Matrix& m) : q_(&q), m_(m), mult_(0), bcols_(0) { no_cuda(); }
void CudaQuantizer::Fill::launch(std::byte*, std::uint64_t, std::uint64_t, void*) const { no_cuda(); }

}  // namespace shmcast::detail::quant
