// The two clocks every layer reads: CLOCK_MONOTONIC for deadlines and
// durations, CLOCK_REALTIME for the wall-clock stamps the region records
// (created_unix_ns, attach_unix_ns). Nanoseconds, as std::int64_t.
#pragma once

#include <cstdint>
#include <ctime>

namespace shmcast::detail {

// CLOCK_MONOTONIC now, in nanoseconds.
inline std::int64_t mono_ns() noexcept {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return std::int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

// CLOCK_REALTIME now, in nanoseconds since the Unix epoch.
inline std::int64_t unix_ns() noexcept {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return std::int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

}  // namespace shmcast::detail
