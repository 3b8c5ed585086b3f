#include "shm/doorbell.hpp"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>

namespace shmcast::detail {

int futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected, std::int64_t deadline_ns) noexcept {
  if (deadline_ns < 0) deadline_ns = 0;
  timespec abs{static_cast<time_t>(deadline_ns / 1000000000), static_cast<long>(deadline_ns % 1000000000)};
  // FUTEX_WAIT_BITSET takes an absolute timeout on CLOCK_MONOTONIC (no
  // FUTEX_CLOCK_REALTIME), so a deadline survives EINTR and re-waits intact.
  long rc = syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAIT_BITSET, expected, &abs, nullptr,
                    FUTEX_BITSET_MATCH_ANY);
  if (rc == 0) return 0;
  if (errno == EAGAIN) return 0;
  return -errno;
}

int futex_wake(std::atomic<std::uint32_t>* word, int n) noexcept {
  long rc = syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAKE, n, nullptr, nullptr, 0);
  return rc < 0 ? -errno : static_cast<int>(rc);
}

void ring(Bell& bell) noexcept {
  bell.word.fetch_add(1, std::memory_order_seq_cst);
  if (bell.waiters.load(std::memory_order_seq_cst) != 0) futex_wake(&bell.word, INT_MAX);
}

void ring_keep_parity(Bell& bell) noexcept {
  bell.word.fetch_add(2, std::memory_order_seq_cst);
  if (bell.waiters.load(std::memory_order_seq_cst) != 0) futex_wake(&bell.word, INT_MAX);
}

std::int64_t spin_ns() noexcept {
  static const std::int64_t v = [] {
    const char* s = std::getenv("SHMCAST_SPIN_NS");
    if (s && *s) {
      char* end = nullptr;
      long long x = std::strtoll(s, &end, 10);
      if (end && *end == 0 && x >= 0 && x <= 10'000'000) return static_cast<std::int64_t>(x);
    }
    return std::int64_t{20000};
  }();
  return v;
}

}  // namespace shmcast::detail
