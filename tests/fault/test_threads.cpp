// Producer and consumers as threads of one process. ThreadSanitizer cannot
// see a peer in another process (each process has its own shadow memory),
// so this is the tier that lets TSan check the library's in-process state:
// one object per thread, as docs/design.md requires, over one region.
#include "fault_support.hpp"

using namespace fault;

TEST(Threads, ProducerAndConsumerThreadsBitExact) {
  Matrix m("threads_in_process", run_seed());
  const std::string name = unique_name("thr");
  RegionGuard guard{name};
  constexpr int kConsumers = 3;
  const int syncs = trials(60);
  std::atomic<int> verified{0}, mismatched{0}, failed{0};
  Producer p = Producer::create(name, popts(kConsumers, 20000ms, StallPolicy::kFail, 3, true));
  std::vector<std::thread> threads;
  for (int i = 0; i < kConsumers; ++i)
    threads.emplace_back([&, i] {
      try {
        Consumer c = Consumer::open(name, copts());
        for (int s = 0; s < syncs; ++s) {
          const SyncInfo& info = c.wait_sync(20s);
          if (read_and_check(c, info, i % 2 == 1))
            verified.fetch_add(1);
          else
            mismatched.fetch_add(1);
        }
      } catch (const std::exception& e) {
        std::fprintf(stderr, "consumer thread %d: %s\n", i, e.what());
        failed.fetch_add(1);
      }
    });
  std::mt19937_64 rng(m.seed);
  try {
    p.wait_for_consumers(kConsumers, 20s);
    for (int s = 1; s <= syncs; ++s) {
      EpochSync sync(1, static_cast<std::uint64_t>(s), rng());
      p.send(sync.specs, sync.ptrs);
    }
    p.wait_drained(20s);
  } catch (const std::exception& e) {
    ADD_FAILURE() << e.what();
  }
  for (auto& t : threads) t.join();
  m.trials = syncs;
  m.syncs_verified = verified.load();
  m.mismatches = mismatched.load();
  m.unexpected = failed.load();
  m.outcomes["consumer_thread:ok"] = kConsumers - failed.load();
  m.finish();
  EXPECT_EQ(verified.load(), syncs * kConsumers);
}
