// api/ (layer 6): mapping a region's device slots (device_slots.hpp).
#include "api/device_slots.hpp"

#include <algorithm>
#include <chrono>

#include "base/clock.hpp"
#include "protocol/fd_channel.hpp"
#include "shm/liveness.hpp"
#include "shmcast/shmcast.hpp"

namespace shmcast::detail {

vmm::Mapping map_device_slots(RegionView& view, const DeviceSlotsFixed& d, const std::string& dir,
                              std::string_view name, const TrustPolicy& trust, std::int64_t deadline, int device,
                              const std::string& who) {
  vmm::Uuid uuid;
  std::copy(std::begin(d.gpu_uuid), std::end(d.gpu_uuid), uuid.begin());
  FdFetchOptions fo;
  fo.trust = trust;
  fo.kind = FdKind::kCudaVmm;
  fo.region_nonce = d.nonce;
  fo.expect_fds = 1;
  fo.expect_bytes = d.alloc_bytes;
  const Header& h = view.header();
  const SelfIdentity me = self_identity();
  if (me.pidns != 0 && h.producer.pidns.load(std::memory_order_relaxed) == me.pidns)
    fo.expect_pid = static_cast<std::int32_t>(h.producer.pid.load(std::memory_order_relaxed));
  // The producer serves its socket before it marks the region ready: the
  // fd is there at once unless the producer is going away (at least 1 s).
  const std::int64_t left = deadline - mono_ns();
  fo.timeout = std::chrono::nanoseconds(left > 1'000'000'000 ? left : 1'000'000'000);
  const int fd = view.fd();
  fo.peer_gone = [fd, who, region = std::string(name)] {
    return lock_held(fd, kProducerLockByte) == Alive::kNo ? who + " of '" + region + "' died" : std::string();
  };
  FetchedFds got = fetch_fds(dir, name, fo);
  if (got.info.device_uuid != uuid)
    throw Error(Errc::kCorrupt, "the fd channel of '" + std::string(name) + "' serves memory of GPU " +
                                    vmm::uuid_text(got.info.device_uuid) + ", but the region names " +
                                    vmm::uuid_text(uuid) + ": refused");
  vmm::Mapping m = vmm::Mapping::import(got.fds[0].get(), d.alloc_bytes, uuid, device);
  // (The fds close here: the mapping keeps the memory.)
  view.set_device_slots(static_cast<std::byte*>(m.data()));
  return m;
}

}  // namespace shmcast::detail
