// Fault matrix, part 2: SIGSTOP a consumer (a stalled, live peer).
//
// Documented policy (docs/reliability.md, ProducerOptions::stall_policy):
//  * StallPolicy::kFail: the producer's send() throws Errc::kTimeout after
//    consumer_timeout and aborts the sync; the other consumers get
//    Errc::kAborted for it (never its bytes). Once the stalled consumer runs
//    again it gets kAborted too, and the next sync reaches everyone.
//  * StallPolicy::kEvict: the producer evicts the stalled consumer and
//    carries on; the others get every sync. The evicted consumer, resumed,
//    gets Errc::kEvicted (or kCorrupt when it notices the overwrite of the
//    slot it was reading first) and may open the region again.
#include "fault_support.hpp"

using namespace fault;

namespace {

// Receives until it has verified an epoch-2 sync. kAborted: go on with the
// same consumer. kEvicted / kCorrupt (only when `evictable`): open again.
// Waits for `c` like Child::wait, sending it SIGCONT every 20 ms.
int wait_continuing(Child& c, std::chrono::milliseconds timeout) {
  const auto end = std::chrono::steady_clock::now() + timeout * kSlowdown;
  while (std::chrono::steady_clock::now() < end) {
    ::kill(c.pid, SIGCONT);
    if (::waitpid(c.pid, &c.status, WNOHANG) == c.pid) {
      c.waited = true;
      return c.decode();
    }
    std::this_thread::sleep_for(20ms);
  }
  return c.wait(0ms);  // kills it and reports the hang
}

int stall_consumer(const std::string& name, Board* b, int idx, bool use_visit, bool evictable, int stop_piece) {
  int reopens = 0, pieces = 0;
  for (;;) {
    try {
      Consumer c = Consumer::open(name, copts());
      b->attached[idx].fetch_add(1);
      for (;;) {
        try {
          const SyncInfo& info = c.wait_sync(30s);
          const std::uint64_t epoch = epoch_of(info);
          bool ok;
          if (stop_piece >= 0 && epoch == 1) {
            // Stops itself at a chosen piece: stalls while holding a slot.
            std::vector<std::vector<std::uint8_t>> got;
            for (const auto& t : info.tensors) got.emplace_back(t.nbytes, 0xEE);
            c.visit([&](const Piece& p) {
              // Only while the test has not yet resumed everyone (go): a
              // stop after that would never be continued.
              if (pieces++ == stop_piece && b->go.load() == 0) {
                b->in_visit[idx].store(1);
                ::raise(SIGSTOP);
              }
              if (p.bytes) std::memcpy(got[p.tensor].data() + p.offset, p.data, p.bytes);
            });
            ok = true;
            for (std::size_t i = 0; i < got.size(); ++i) {
              std::vector<std::uint8_t> want(got[i].size());
              fill_pattern(want.data(), want.size(), epoch_seed(epoch, info.version, i));
              ok &= want == got[i];
            }
          } else {
            ok = read_and_check(c, info, use_visit);
          }
          if (!ok) {
            b->mismatches.fetch_add(1);
            return kMismatchExit;
          }
          b->verified[idx].fetch_add(1);
          if (epoch == 2) {
            b->done[idx].store(1);
            return 0;
          }
        } catch (const Error& e) {
          if (e.code() != Errc::kAborted) throw;
          b->errors_seen[static_cast<int>(e.code())].fetch_add(1);
        }
      }
    } catch (const Error& e) {
      b->errors_seen[static_cast<int>(e.code())].fetch_add(1);
      const bool again = evictable && (e.code() == Errc::kEvicted || e.code() == Errc::kCorrupt);
      // Under load a slow consumer can be evicted again after it reopens
      // (the 500 ms consumer_timeout is short on purpose): the bound only
      // stops a loop; every wait inside has its own deadline.
      if (!again || ++reopens > 50) {
        std::fprintf(stderr, "consumer %d: %s\n", idx, e.what());
        return errc_exit(e);
      }
    }
  }
}

void run_stall_matrix(StallPolicy policy, const char* fault_name) {
  Matrix m(fault_name, run_seed());
  std::mt19937_64 rng(m.seed);
  const int n = trials(12);
  const bool evict = policy == StallPolicy::kEvict;
  int producer_timeouts = 0, evictions = 0;
  for (int t = 0; t < n; ++t) {
    const std::string name = unique_name(evict ? "se" : "sf");
    RegionGuard guard{name};
    Board* b = Board::make();
    const std::uint64_t ts = rng();
    const bool checksums = ts & 1;
    const std::uint32_t slots = 2 + static_cast<std::uint32_t>((ts >> 1) % 2);
    // kFail: how many more syncs the producer tries while the consumer is
    // still stopped (each must fail the same way).
    const int retries = evict ? 0 : static_cast<int>((ts >> 4) % 3);
    const bool self_stop = (ts >> 8) & 1;
    const int stop_piece = self_stop ? static_cast<int>((ts >> 12) % 6) : -1;
    // producer_state: 1 timed out (kFail), 2 evicted (kEvict), +10 per
    // spurious timeout of the recovery sync.
    Child prod = Child::spawn([&] {
      Producer p = Producer::create(name, popts(2, 500ms, policy, slots, checksums));
      p.wait_for_consumers(2, 20s);
      int stalls = 0;
      bool done = false;
      for (int i = 0; i < 20000 && !done; ++i) {
        EpochSync s(1, p.last_version() + 1, ts + static_cast<std::uint64_t>(i));
        try {
          p.send(s.specs, s.ptrs);
        } catch (const Error& e) {
          if (e.code() != Errc::kTimeout || evict) return errc_exit(e);
          b->producer_syncs.fetch_add(1);  // timeouts while the consumer is stopped
          if (++stalls > retries) {
            b->producer_state.store(1);
            done = true;
          }
          continue;
        }
        if (evict)
          for (const auto& ev : p.take_events())
            if (ev.find("evicted") != std::string::npos) {
              b->producer_state.store(2);
              done = true;
            }
      }
      if (!done) return 32;
      if (!wait_for([&] { return b->go.load() == 1; }, 60s)) return 31;
      p.wait_for_consumers(2, 20s);
      // Recovery: epoch-2 syncs until both consumers have verified one. Under
      // load a slow (not stopped) consumer can trip the short
      // consumer_timeout (kFail: the sync is aborted; kEvict: it is evicted
      // and opens the region again), so one sync may not reach both: the
      // producer sends another until both are done, within a deadline.
      const auto recovery_end = std::chrono::steady_clock::now() + 60s * kSlowdown;
      while (!(b->done[0].load() && b->done[1].load())) {
        if (std::chrono::steady_clock::now() > recovery_end) return code(Errc::kTimeout);
        // At most 256 KiB: the sync fits one slot, so a consumer that is
        // merely slow reads it long before the 500 ms consumer_timeout.
        EpochSync s(2, p.last_version() + 1, ts, 256 << 10);
        try {
          p.send(s.specs, s.ptrs);
        } catch (const Error& e) {
          if (e.code() != Errc::kTimeout) return errc_exit(e);
          b->producer_state.fetch_add(10);
          continue;
        }
        wait_for([&] { return b->done[0].load() && b->done[1].load(); }, 500ms);
      }
      p.wait_drained(20s);
      return 0;
    });
    Child survivor = Child::spawn([&] { return stall_consumer(name, b, 0, (ts >> 9) & 1, true, -1); });
    Child victim = Child::spawn([&] { return stall_consumer(name, b, 1, (ts >> 10) & 1, evict, stop_piece); });
    wait_for([&] { return b->attached[0].load() && b->attached[1].load(); }, 20s);
    if (self_stop) {
      wait_for([&] { return b->in_visit[1].load() == 1; }, 20s);
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds((ts >> 16) % 20000));
      ::kill(victim.pid, SIGSTOP);
    }
    wait_for([&] { return b->producer_state.load() % 10 != 0; }, 60s);
    const int st = b->producer_state.load() % 10;
    m.note("producer", st == 1 ? "stall:Timeout" : st == 2 ? "stall:evicted" : "stall:not_detected");
    if (st == 1) ++producer_timeouts;
    for (int i = 0; i < b->producer_syncs.load(); ++i) m.note("producer", "send:Timeout");
    if (st == 2) ++evictions;
    if (st != (evict ? 2 : 1)) ++m.unexpected;
    b->go.store(1);
    ::kill(victim.pid, SIGCONT);
    // The victim checks `go` before it stops itself, but may have checked it
    // just before the store: SIGCONT goes on until it ends, so that a stop
    // that lands after the first SIGCONT is continued too.
    m.child("victim", wait_continuing(victim, 90s), {0});
    m.child("producer", prod.wait(90s), {0});
    m.child("survivor", survivor.wait(90s), {0});
    if (b->producer_state.load() >= 10) m.note("producer", "recovery_retried");
    for (int e = 1; e < 64; ++e)
      for (int i = 0; i < b->errors_seen[e].load(); ++i) m.note("consumer", std::string("saw:") + errc_name(static_cast<Errc>(e)));
    m.syncs_verified += b->total_verified();
    std::string why;
    if (!fresh_pair_syncs(name, &why)) {
      ++m.unreusable;
      ADD_FAILURE() << "trial " << t << ": region not reusable: " << why;
    }
    Board::destroy(b);
    m.trial_done();
  }
  m.finish();
  if (evict)
    EXPECT_EQ(evictions, n);
  else
    EXPECT_EQ(producer_timeouts, n);
}

}  // namespace

TEST(FaultMatrix, SigstopConsumerFailPolicyTimesOut) { run_stall_matrix(StallPolicy::kFail, "sigstop_consumer_kFail"); }

TEST(FaultMatrix, SigstopConsumerEvictPolicyEvicts) { run_stall_matrix(StallPolicy::kEvict, "sigstop_consumer_kEvict"); }
