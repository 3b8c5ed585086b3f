// Built when SHMCAST_WITH_CUDA is off: every CUDA entry point reports, at
// run time, that this build has no CUDA.
#include "engine/engine.hpp"

namespace shmcast::detail {

namespace {
const char* kNoCuda = "this shmcast was built without CUDA: rebuild with -DSHMCAST_WITH_CUDA=ON "
                      "(needs the CUDA toolkit) to copy to or from GPU memory";
}

std::unique_ptr<ProducerEngine> make_cuda_producer_engine(bool, int) { throw Error(Errc::kCudaUnavailable, kNoCuda); }
std::unique_ptr<ConsumerEngine> make_cuda_consumer_engine(bool, int) { throw Error(Errc::kCudaUnavailable, kNoCuda); }

PinInfo cuda_pin(void*, std::uint64_t, std::uint64_t) { return PinInfo{false, 0.0, kNoCuda, false}; }
void cuda_unpin(void*, std::uint64_t) {}
bool cuda_present(std::string* why) {
  if (why) *why = kNoCuda;
  return false;
}

}  // namespace shmcast::detail
