// shm/ (layer 3): the futex doorbell. A Bell is a 32-bit futex word in the shared
// region plus a count of sleepers. Shared futexes only (no
// FUTEX_PRIVATE_FLAG): waiter and waker are different processes. Deadlines
// are absolute CLOCK_MONOTONIC times. The caller's condition is re-checked
// after every wake, so spurious and stolen wake-ups are harmless.
//
// Low-level calls return 0 or -errno, liburing style.
#pragma once

#include <cstdint>
#include <ctime>

#include "base/clock.hpp"  // mono_ns(), unix_ns(), cpu_relax(): callers of the doorbell use them too
#include "base/layout.hpp"

namespace shmcast::detail {

// Sleeps on `word` while it still holds `expected`, until woken or until the
// absolute CLOCK_MONOTONIC deadline. 0 when woken (or the value had changed:
// -EAGAIN is folded into 0), -ETIMEDOUT, -EINTR, or another -errno.
int futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected, std::int64_t deadline_ns) noexcept;
// Wakes up to `n` sleepers. Returns how many woke or -errno.
int futex_wake(std::atomic<std::uint32_t>* word, int n) noexcept;

// Rings the bell: bumps the word and makes the wake syscall only when a
// sleeper is registered. Call it after making the condition true.
void ring(Bell& bell) noexcept;
// Like ring(), but bumps the word by two: for the sync record's bell, whose
// word doubles as a seqlock (odd = being written), when the record itself
// did not change (close, eviction, abort).
void ring_keep_parity(Bell& bell) noexcept;

// How long wait_until() spins before it sleeps, in ns (SHMCAST_SPIN_NS,
// default 20 us). Spinning keeps the small-sync round trip short.
std::int64_t spin_ns() noexcept;

enum class WaitResult { kReady, kTimeout, kCheck };

// check_every_ns for a wait that needs no liveness checkpoints.
inline constexpr std::int64_t kCheckNever = std::int64_t{1} << 60;

// Waits on `bell` until ready() is true or `deadline_ns` passes. Returns
// kCheck every `check_every_ns` so the caller can check its peer's liveness
// without waiting for the whole deadline. The condition is re-checked after
// every wake.
template <class Ready>
WaitResult wait_until(Bell& bell, Ready&& ready, std::int64_t deadline_ns, std::int64_t check_every_ns) {
  if (ready()) return WaitResult::kReady;
  const std::int64_t start = mono_ns();
  const std::int64_t spin_end = start + spin_ns();
  while (mono_ns() < spin_end) {
    if (ready()) return WaitResult::kReady;
    cpu_relax();
  }
  const std::int64_t check_at = start + check_every_ns;
  for (;;) {
    bell.waiters.fetch_add(1, std::memory_order_seq_cst);
    const std::uint32_t seen = bell.word.load(std::memory_order_seq_cst);
    if (ready()) {
      bell.waiters.fetch_sub(1, std::memory_order_seq_cst);
      return WaitResult::kReady;
    }
    const std::int64_t until = deadline_ns < check_at ? deadline_ns : check_at;
    futex_wait(&bell.word, seen, until);
    bell.waiters.fetch_sub(1, std::memory_order_seq_cst);
    if (ready()) return WaitResult::kReady;
    const std::int64_t now = mono_ns();
    if (now >= deadline_ns) return WaitResult::kTimeout;
    if (now >= check_at) return WaitResult::kCheck;
  }
}

}  // namespace shmcast::detail
