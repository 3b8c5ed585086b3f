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

#include "base/layout.hpp"

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

}  // namespace shmcast_test
