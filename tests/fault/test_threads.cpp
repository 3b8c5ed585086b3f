// Producer and consumers as threads of one process. ThreadSanitizer cannot
// see a peer in another process (each process has its own shadow memory),
// so this is the tier that lets TSan check the library's in-process state:
// one object per thread, as docs/design.md requires, over one region.
#include "fault_support.hpp"

using namespace fault;

namespace {

// One producer and three consumer threads over one region; the consumers
// read with read_into, or (`visit_odd`) odd seats with visit. With checksums
// the producer publishes whole slots and read_into waits for them; without,
// the producer fills progressively (marks each 2 MiB step final as it goes)
// and read_into copies a slot out while it is still being filled: the
// newest data path, which TSan must see too.
void run_threads(const char* fault, bool checksums, bool visit_odd, std::uint64_t slot_bytes,
                 std::uint64_t max_tensor_bytes) {
  Matrix m(fault, run_seed());
  const std::string name = unique_name("thr");
  RegionGuard guard{name};
  constexpr int kConsumers = 3;
  const int syncs = trials(60);
  std::atomic<int> verified{0}, mismatched{0}, failed{0};
  ProducerOptions o = popts(kConsumers, 20000ms, StallPolicy::kFail, 3, checksums);
  o.slot_bytes = slot_bytes;
  Producer p = Producer::create(name, o);
  std::vector<std::thread> threads;
  for (int i = 0; i < kConsumers; ++i)
    threads.emplace_back([&, i] {
      try {
        Consumer c = Consumer::open(name, copts());
        for (int s = 0; s < syncs; ++s) {
          const SyncInfo& info = c.wait_sync(20s);
          if (read_and_check(c, info, visit_odd && i % 2 == 1))
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
      EpochSync sync(1, static_cast<std::uint64_t>(s), rng(), max_tensor_bytes);
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

}  // namespace

// Checksums on: whole slots, each verified before it is copied out.
TEST(Threads, ProducerAndConsumerThreadsBitExact) {
  run_threads("threads_in_process", true, true, kSlot, 5 * kSlot / 2);
}

// Checksums off: progressive fill. 8 MiB slots and tensors up to 12 MiB, so
// that a tensor is copied in several 2 MiB steps within one slot, and every
// consumer uses read_into, which takes a slot in pieces while the producer
// is still writing it (visit waits for whole slots).
TEST(Threads, ProgressiveFillThreadsBitExact) {
  run_threads("threads_progressive_fill", false, false, 4 * kSlot, 6 * kSlot);
}
