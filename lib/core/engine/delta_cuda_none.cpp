// Built without SHMCAST_WITH_CUDA: the CUDA delta codec reports, at run
// time, that this build has no CUDA (see delta_cuda.hpp).
#include "engine/delta_cuda.hpp"

#include "shmcast/shmcast.hpp"

namespace shmcast::detail::delta {

namespace {
constexpr const char* kNoCuda = "this shmcast was built without CUDA: rebuild with -DSHMCAST_WITH_CUDA=ON (needs the "
                                "CUDA toolkit) to encode or apply deltas on GPUs, or use the host codec";
[[noreturn]] void no_cuda() { throw Error(Errc::kCudaUnavailable, kNoCuda); }
}  // namespace

struct CudaCodec::Impl {};

bool cuda_codec_available(std::string* why) {
  if (why) *why = kNoCuda;
  return false;
}

bool copy_pieces_ready(std::string* why) {
  if (why) *why = kNoCuda;
  return false;
}
void launch_copy_pieces(const void*, std::uint64_t, void*) { no_cuda(); }

CudaCodec::CudaCodec() = default;
CudaCodec::~CudaCodec() = default;
void CudaCodec::plan(const void*, const void*, std::uint32_t, std::uint64_t, void*, void*) { no_cuda(); }
void CudaCodec::plan_batch(const std::vector<PlanItem>&, void*) { no_cuda(); }
void CudaCodec::encode(void*, const void*, std::uint32_t, std::uint64_t, const void*, void*, std::uint64_t, void*) {
  no_cuda();
}
void CudaCodec::encode_table(const std::vector<EncodeItem>&, void*) { no_cuda(); }
void CudaCodec::encode_range(std::size_t, std::size_t, void*) { no_cuda(); }
void CudaCodec::apply(const void*, std::uint64_t, std::uint32_t, const SliceMap&, void*, std::uint64_t, bool, void*) {
  no_cuda();
}
void CudaCodec::apply_batch(const std::vector<ApplyItem>&, void*) { no_cuda(); }
void CudaCodec::checksum(const void*, std::uint64_t, void*, void*) { no_cuda(); }
void CudaCodec::finish(void*) { no_cuda(); }
Header CudaCodec::read_header(const void*, void*) { no_cuda(); }
void* CudaCodec::buffer(int, std::uint64_t, void*) { no_cuda(); }
void* CudaCodec::alloc(std::uint64_t, void*) { no_cuda(); }
void CudaCodec::release(void*) noexcept {}
void CudaCodec::upload(void*, const void*, std::uint64_t, void*) { no_cuda(); }
void CudaCodec::download(void*, const void*, std::uint64_t, void*) { no_cuda(); }
void CudaCodec::copy(void*, const void*, std::uint64_t, void*) { no_cuda(); }
void CudaCodec::wait(void*) { no_cuda(); }

}  // namespace shmcast::detail::delta
