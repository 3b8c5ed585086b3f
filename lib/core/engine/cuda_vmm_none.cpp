// Built when SHMCAST_WITH_CUDA is off: device slots (cuda_vmm.hpp) report,
// at run time, that this build has no CUDA.

#include "base/text.hpp"
#include "engine/cuda_vmm.hpp"
#include "shmcast/shmcast.hpp"

namespace shmcast::detail::vmm {

namespace {
[[noreturn]] void no_cuda() {
  throw Error(Errc::kCudaUnavailable,
              "this shmcast was built without CUDA, so it has no device slots: rebuild with -DSHMCAST_WITH_CUDA=ON "
              "(needs the CUDA toolkit), or use a host-slot region");
}
}  // namespace

std::string uuid_text(const Uuid& u) { return gpu_uuid_text(u); }
Uuid device_uuid(int) { no_cuda(); }
int device_with_uuid(const Uuid&) { no_cuda(); }
int current_device() { no_cuda(); }
std::uint64_t granularity(int) { no_cuda(); }
MemInfo mem_info(int) { no_cuda(); }

Mapping::Mapping(Mapping&& o) noexcept { *this = std::move(o); }
Mapping& Mapping::operator=(Mapping&&) noexcept { return *this; }  // a Mapping is always empty here
Mapping Mapping::allocate(int, std::uint64_t) { no_cuda(); }
Mapping Mapping::import(int, std::uint64_t, const Uuid&, int) { no_cuda(); }
int Mapping::export_fd() const { no_cuda(); }
void Mapping::release() noexcept {}

}  // namespace shmcast::detail::vmm
