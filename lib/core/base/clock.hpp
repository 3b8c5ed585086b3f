// The two clocks every layer reads: CLOCK_MONOTONIC for deadlines and
// durations, CLOCK_REALTIME for the wall-clock stamps the region records
// (created_unix_ns, attach_unix_ns). Nanoseconds, as std::int64_t. And the
// CPU's spin-wait hint, for loops that poll them.
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

// A spin-wait hint to the CPU (x86 pause, AArch64 yield; nothing elsewhere),
// for the loops that poll a clock and a condition.
inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__) || defined(__arm__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace shmcast::detail
