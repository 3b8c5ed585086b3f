// Doorbell: futex waits with absolute deadlines, wake only when waited on.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <thread>

#include "doorbell.hpp"

using namespace shmcast::detail;

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

TEST(Doorbell, RingWithoutWaitersMakesNoSyscallButBumpsTheWord) {
  Bell b{};
  ring(b);
  EXPECT_EQ(b.word.load(), 1u);
  EXPECT_EQ(b.waiters.load(), 0u);
}

TEST(Doorbell, WakesAWaiterInAnotherProcess) {
  // The bell lives in shared anonymous memory; a forked child rings it.
  void* mem = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mem, MAP_FAILED);
  auto* b = new (mem) Bell{};
  auto* flag = new (static_cast<char*>(mem) + 64) std::atomic<std::uint32_t>{0};
  pid_t pid = fork();
  if (pid == 0) {
    // Wait until the parent sleeps, then make the condition true and ring.
    while (b->waiters.load() == 0) usleep(100);
    flag->store(1);
    ring(*b);
    _exit(0);
  }
  const WaitResult r = wait_until(*b, [&] { return flag->load() == 1; }, mono_ns() + 10'000'000'000, kCheckNever);
  int st = 0;
  waitpid(pid, &st, 0);
  EXPECT_EQ(r, WaitResult::kReady);
  EXPECT_EQ(b->waiters.load(), 0u);
  munmap(mem, 4096);
}

TEST(Doorbell, FutexWaitOnChangedValueReturnsImmediately) {
  std::atomic<std::uint32_t> w{5};
  EXPECT_EQ(futex_wait(&w, 4, mono_ns() + 1'000'000'000), 0);
}

TEST(Doorbell, FutexWaitPastDeadlineTimesOut) {
  std::atomic<std::uint32_t> w{5};
  EXPECT_EQ(futex_wait(&w, 5, mono_ns() - 1), -ETIMEDOUT);
}
