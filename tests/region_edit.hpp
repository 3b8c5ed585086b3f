// Tests that tamper with a region file as a buggy or hostile producer could
// (the probe's unit tests, the inspect tool's tests).
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>
#include <xxhash.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>

#include "base/layout.hpp"
#include "shm/liveness.hpp"

namespace shmcast_test {

// Rewrites the manifest of the current sync in a region file and fixes the
// sync record's hash to match (unless `rehash` is false).
inline void rewrite_manifest(const std::string& path, const std::function<void(std::string&)>& edit,
                             bool rehash = true) {
  namespace detail = shmcast::detail;
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0) << path;
  detail::HeaderFixed f{};
  ASSERT_EQ(::pread(fd, &f, sizeof f, 0), static_cast<ssize_t>(sizeof f));
  const off_t rec = offsetof(detail::Header, sync);
  std::uint64_t used = 0;
  ASSERT_EQ(::pread(fd, &used, 8, rec + offsetof(detail::SyncRecord, manifest_used)), 8);
  ASSERT_GE(used, sizeof(detail::ManifestHeader));
  std::string m(used, '\0');
  ASSERT_EQ(::pread(fd, m.data(), used, static_cast<off_t>(f.manifest_offset)), static_cast<ssize_t>(used));
  edit(m);
  ASSERT_EQ(::pwrite(fd, m.data(), used, static_cast<off_t>(f.manifest_offset)), static_cast<ssize_t>(used));
  if (rehash) {
    const std::uint64_t h = XXH3_64bits(m.data(), m.size());
    ASSERT_EQ(::pwrite(fd, &h, 8, rec + offsetof(detail::SyncRecord, manifest_hash)), 8);
  }
  ::close(fd);
}

// The device-slots block a producer on a GPU would write: a UUID of bytes
// 0x10..0x1f ("GPU-10111213-1415-1617-1819-1a1b1c1d1e1f"), an allocation of
// `alloc_bytes`, a nonce.
inline shmcast::detail::DeviceSlotsFixed device_block(std::uint64_t alloc_bytes) {
  shmcast::detail::DeviceSlotsFixed b{};
  for (int i = 0; i < 16; ++i) b.gpu_uuid[i] = static_cast<std::uint8_t>(0x10 + i);
  b.alloc_bytes = alloc_bytes;
  b.nonce = 0x1234567890abcdefull;
  return b;
}
inline constexpr const char* kDeviceBlockUuid = "GPU-10111213-1415-1617-1819-1a1b1c1d1e1f";

// A ready ring region of device slots (layout 4) written by hand, as a live
// producer on a GPU would leave it, with no GPU: 4 seats, 2 slots of 2 MiB
// per producer rank (`world`; descriptors only: no slot bytes in the file),
// the feature bits `features` and the block `dev`, this process as its
// producer, holding the producer's lock byte while the object lives. With
// `device_geometry` false the sections are those of host slots (slot
// bytes in the file), for crafted mismatches. The file is removed at the
// end.
struct CraftedDeviceRegion {
  std::string path;
  int fd = -1;
  CraftedDeviceRegion(std::string file, std::uint64_t features, const shmcast::detail::DeviceSlotsFixed& dev,
                      bool device_geometry = true, std::uint32_t world = 1)
      : path(std::move(file)) {
    namespace d = shmcast::detail;
    d::Geometry g{};
    EXPECT_EQ(d::compute_geometry(4, 2 * world, 2ull << 20, 1 << 20, &g, world, false, device_geometry), "");
    fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    EXPECT_GE(fd, 0) << path;
    EXPECT_EQ(::posix_fallocate(fd, 0, static_cast<off_t>(g.total_bytes)), 0);
    EXPECT_EQ(d::lock_byte(fd, d::kProducerLockByte), 0);
    d::HeaderFixed h = d::make_fixed_header(g, features);
    EXPECT_EQ(::pwrite(fd, &h, sizeof h, 0), static_cast<ssize_t>(sizeof h));
    EXPECT_EQ(::pwrite(fd, &dev, sizeof dev, offsetof(d::Header, device_slots)), static_cast<ssize_t>(sizeof dev));
    alignas(8) d::Identity id{};
    d::write_identity(id, d::self_identity());
    EXPECT_EQ(::pwrite(fd, &id, sizeof id, offsetof(d::Header, producer)), static_cast<ssize_t>(sizeof id));
    const std::uint32_t ready = d::kInitReady;
    EXPECT_EQ(::pwrite(fd, &ready, 4, offsetof(d::Header, init_state)), 4);
  }
  ~CraftedDeviceRegion() {
    ::unlink(path.c_str());
    if (fd >= 0) ::close(fd);
  }
  CraftedDeviceRegion(const CraftedDeviceRegion&) = delete;
  CraftedDeviceRegion& operator=(const CraftedDeviceRegion&) = delete;
};

}  // namespace shmcast_test
