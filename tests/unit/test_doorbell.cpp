// Doorbell: futex waits with absolute deadlines, wake only when waited on.
//
// Two things here could pass on a broken doorbell unless the test pins them
// down, so they are checked directly rather than by how long a test takes:
//  * a ring() must wake a sleeper (a lost FUTEX_WAKE would otherwise only
//    cost the sleeper its deadline, or the 50 ms liveness poll in the
//    library): sleepers below wait with kCheckNever and a 20 s deadline, the
//    ring comes only once the kernel reports the sleeper blocked in futex(),
//    and the sleeper must return long before its deadline;
//  * a ring() without sleepers must make no system call: futex() is trapped
//    with seccomp in a forked child and counted.
#include <gtest/gtest.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "shm/doorbell.hpp"

using namespace shmcast::detail;

namespace {

constexpr std::int64_t kSecond = 1'000'000'000;
// A sleeper has this long to wait for its ring; a woken one must be back
// within kWakeBound of the ring. The bound leaves room for a loaded 2-core
// machine (a woken thread may wait a few scheduler periods for a CPU) and is
// still a tenth of the deadline a lost wake-up would run into.
constexpr std::int64_t kSleepDeadline = 20 * kSecond;
constexpr std::int64_t kWakeBound = 2 * kSecond;

pid_t this_tid() { return static_cast<pid_t>(::syscall(SYS_gettid)); }

// What /proc says thread `tid` of process `pid` is doing: 1 when it is
// blocked in futex(), 0 when it is somewhere else, -1 when the kernel does not
// say (no /proc/PID/task/TID/syscall).
int in_futex(pid_t pid, pid_t tid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/task/" + std::to_string(tid) + "/syscall");
  std::string first;
  if (!(f >> first)) return -1;
  if (first == "running") return 0;
  try {
    return std::stol(first) == SYS_futex ? 1 : 0;
  } catch (...) {
    return -1;
  }
}

// Waits until the thread sleeps in futex() on `bell` (registered as a waiter
// and blocked in the kernel), so that only a FUTEX_WAKE can end its sleep
// before its deadline. Returns false when that could not be seen within 10 s.
bool wait_until_asleep(const Bell& bell, pid_t pid, pid_t tid) {
  const std::int64_t give_up = mono_ns() + 10 * kSecond;
  while (mono_ns() < give_up) {
    if (bell.waiters.load() != 0) {
      const int s = in_futex(pid, tid);
      if (s == 1) return true;
      if (s == -1) {
        // No /proc view of the syscall: registered, plus time to fall asleep.
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        return true;
      }
    }
    std::this_thread::yield();
  }
  return false;
}

// ---- counting futex() calls: a forked child traps them with seccomp.

volatile sig_atomic_t g_futex_calls = 0;

void on_sigsys(int, siginfo_t* si, void*) {
  if (si->si_syscall == SYS_futex) g_futex_calls = g_futex_calls + 1;
}

#if defined(__x86_64__)
constexpr std::uint32_t kAuditArch = AUDIT_ARCH_X86_64;
#elif defined(__aarch64__)
constexpr std::uint32_t kAuditArch = AUDIT_ARCH_AARCH64;
#else
constexpr std::uint32_t kAuditArch = 0;
#endif

// Runs fn() in a forked child in which every futex() call traps (SIGSYS,
// SECCOMP_RET_TRAP: the call is not made) and is counted. Returns the
// count, or -1 - (exit status) when the child did not report one.
int futex_calls_in_child(void (*fn)(Bell&), std::uint32_t waiters, std::uint32_t* word_after) {
  void* mem = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) return -1000;
  auto* b = new (mem) Bell{};
  b->waiters.store(waiters);  // a registered sleeper, as far as ring() can tell
  const pid_t pid = ::fork();
  if (pid == 0) {
    struct sigaction sa {};
    sa.sa_sigaction = on_sigsys;
    sa.sa_flags = SA_SIGINFO;
    if (::sigaction(SIGSYS, &sa, nullptr) != 0) ::_exit(101);
    sock_filter code[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, kAuditArch, 0, 3),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_futex, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_TRAP),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    sock_fprog prog{static_cast<unsigned short>(sizeof code / sizeof code[0]), code};
    if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) ::_exit(102);
    if (::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0) ::_exit(103);
    // The filter works: a futex call of our own is counted.
    std::atomic<std::uint32_t> probe{0};
    futex_wake(&probe, 1);
    if (g_futex_calls != 1) ::_exit(104);
    g_futex_calls = 0;
    fn(*b);
    ::_exit(static_cast<int>(g_futex_calls > 50 ? 50 : g_futex_calls));
  }
  int st = 0;
  ::waitpid(pid, &st, 0);
  if (word_after) *word_after = b->word.load();
  ::munmap(mem, 4096);
  if (WIFEXITED(st) && WEXITSTATUS(st) <= 50) return WEXITSTATUS(st);
  return -1 - (WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st));
}

}  // namespace

TEST(Doorbell, ReadyConditionReturnsAtOnce) {
  Bell b{};
  EXPECT_EQ(wait_until(b, [] { return true; }, mono_ns() + 1'000'000'000, kCheckNever), WaitResult::kReady);
}

TEST(Doorbell, TimesOutAtTheAbsoluteDeadline) {
  Bell b{};
  const std::int64_t deadline = mono_ns() + 30'000'000;
  EXPECT_EQ(wait_until(b, [] { return false; }, deadline, kCheckNever), WaitResult::kTimeout);
  EXPECT_GE(mono_ns(), deadline);
}

TEST(Doorbell, ReportsCheckpointsBeforeTheDeadline) {
  Bell b{};
  EXPECT_EQ(wait_until(b, [] { return false; }, mono_ns() + 10'000'000'000, 20'000'000), WaitResult::kCheck);
}

// ring() makes the wake syscall only when a sleeper is registered, and then
// exactly one: futex() is counted in a child where seccomp traps it.
TEST(Doorbell, RingWithoutWaitersMakesNoSyscallButBumpsTheWord) {
  if (kAuditArch == 0) GTEST_SKIP() << "no seccomp audit arch for this CPU";
  std::uint32_t word = 0;
  EXPECT_EQ(futex_calls_in_child([](Bell& b) { ring(b); }, 0, &word), 0) << "ring() with no sleeper made a futex call";
  EXPECT_EQ(word, 1u);
  EXPECT_EQ(futex_calls_in_child([](Bell& b) { ring_keep_parity(b); }, 0, &word), 0);
  EXPECT_EQ(word, 2u);
}

TEST(Doorbell, RingWithAWaiterMakesExactlyOneWakeCall) {
  if (kAuditArch == 0) GTEST_SKIP() << "no seccomp audit arch for this CPU";
  std::uint32_t word = 0;
  EXPECT_EQ(futex_calls_in_child([](Bell& b) { ring(b); }, 1, &word), 1) << "ring() with a sleeper did not wake it";
  EXPECT_EQ(word, 1u);
  EXPECT_EQ(futex_calls_in_child([](Bell& b) { ring_keep_parity(b); }, 1, &word), 1);
  EXPECT_EQ(word, 2u);
}

// A sleeper in another process (the library's case: the bell is in shared
// memory) is woken by the ring, not by its deadline. The child sleeps (so
// that this process, its parent, may read its /proc syscall file).
TEST(Doorbell, WakesAWaiterInAnotherProcess) {
  void* mem = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mem, MAP_FAILED);
  auto* b = new (mem) Bell{};
  auto* flag = new (static_cast<char*>(mem) + 64) std::atomic<std::uint32_t>{0};
  auto* back = new (static_cast<char*>(mem) + 128) std::atomic<std::int64_t>{0};
  pid_t pid = fork();
  if (pid == 0) {
    const WaitResult r = wait_until(*b, [&] { return flag->load() == 1; }, mono_ns() + kSleepDeadline, kCheckNever);
    back->store(mono_ns());
    _exit(r == WaitResult::kReady ? 0 : 1);
  }
  // Wait until the child sleeps in futex(), then make the condition true and ring.
  const bool asleep = wait_until_asleep(*b, pid, pid);
  const std::int64_t rang = mono_ns();
  flag->store(1);
  ring(*b);
  int st = 0;
  waitpid(pid, &st, 0);
  EXPECT_TRUE(asleep) << "the child never slept in futex()";
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << "the sleeper did not see its condition (status " << st << ")";
  EXPECT_LT(back->load() - rang, kWakeBound)
      << "the sleeper returned " << (back->load() - rang) / 1000000 << " ms after the ring (its deadline was "
      << kSleepDeadline / 1000000 << " ms after it began): the ring did not wake it";
  EXPECT_EQ(b->waiters.load(), 0u);
  munmap(mem, 4096);
}

// Wake latency after an idle gap longer than the spin window: the waiter
// has stopped spinning and sleeps in the kernel, so only FUTEX_WAKE brings it
// back. 20 rounds, ring() and ring_keep_parity() in turn; each must be back
// within kWakeBound (a lost wake-up takes the whole 20 s deadline).
TEST(Doorbell, WakeAfterAnIdleGapIsPromptNotTheDeadline) {
  constexpr int kRounds = 20;
  std::vector<std::int64_t> latency;
  for (int round = 0; round < kRounds; ++round) {
    Bell b{};
    std::atomic<std::uint32_t> flag{0};
    std::atomic<pid_t> tid{0};
    std::atomic<std::int64_t> started{0}, back{0};
    WaitResult r = WaitResult::kCheck;
    std::thread waiter([&] {
      tid.store(this_tid());
      started.store(mono_ns());
      r = wait_until(b, [&] { return flag.load() == 1; }, started.load() + kSleepDeadline, kCheckNever);
      back.store(mono_ns());
    });
    while (tid.load() == 0) std::this_thread::yield();
    const bool asleep = wait_until_asleep(b, ::getpid(), tid.load());
    // The gap is past the spin window (asleep in futex() implies it; make sure).
    while (mono_ns() - started.load() < spin_ns() + 1'000'000) std::this_thread::yield();
    const std::int64_t rang = mono_ns();
    flag.store(1);
    if (round % 2 == 0)
      ring(b);
    else
      ring_keep_parity(b);
    waiter.join();
    ASSERT_TRUE(asleep) << "round " << round << ": the waiter never slept in futex()";
    ASSERT_EQ(r, WaitResult::kReady) << "round " << round;
    latency.push_back(back.load() - rang);
    ASSERT_LT(latency.back(), kWakeBound) << "round " << round << " (" << (round % 2 ? "ring_keep_parity" : "ring")
                                          << "): woken " << latency.back() / 1000000
                                          << " ms after the ring: the ring did not wake the sleeper";
  }
  std::sort(latency.begin(), latency.end());
  std::printf("DOORBELL-WAKE rounds=%d median_us=%lld max_us=%lld spin_ns=%lld\n", kRounds,
              static_cast<long long>(latency[kRounds / 2] / 1000), static_cast<long long>(latency.back() / 1000),
              static_cast<long long>(spin_ns()));
}

TEST(Doorbell, FutexWaitOnChangedValueReturnsImmediately) {
  std::atomic<std::uint32_t> w{5};
  EXPECT_EQ(futex_wait(&w, 4, mono_ns() + 1'000'000'000), 0);
}

TEST(Doorbell, FutexWaitPastDeadlineTimesOut) {
  std::atomic<std::uint32_t> w{5};
  EXPECT_EQ(futex_wait(&w, 5, mono_ns() - 1), -ETIMEDOUT);
}
