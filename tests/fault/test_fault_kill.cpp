// Fault matrix, part 1: kill -9 at random points.
//
//  * the producer, while it streams syncs to two consumers: every consumer
//    either verifies a sync bit-exact or gets Errc::kPeerDied, reopens, and
//    verifies a sync from a replacement producer on the same name;
//  * one of three consumers, at a random time or inside a visit() callback:
//    the producer finishes every sync, the survivors verify all of them, a
//    consumer that joins afterwards reclaims the dead seat.
//
// Counts are printed as FAULT-MATRIX {json} (see fault_support.hpp).
#include "fault_support.hpp"

using namespace fault;

namespace {

// A consumer that verifies every sync it gets; on kPeerDied it reopens (the
// replacement producer comes up on the same name). Returns 0 once it has
// verified a sync of `final_epoch`.
int resilient_consumer(const std::string& name, Board* b, int idx, bool use_visit, std::uint64_t final_epoch,
                       std::initializer_list<Errc> reopen_on) {
  int reopens = 0;
  for (;;) {
    try {
      Consumer c = Consumer::open(name, copts());
      b->attached[idx].fetch_add(1);
      for (;;) {
        const SyncInfo& info = c.wait_sync(20s);
        const std::uint64_t epoch = epoch_of(info);
        if (!read_and_check(c, info, use_visit)) {
          b->mismatches.fetch_add(1);
          return kMismatchExit;
        }
        b->verified[idx].fetch_add(1);
        if (epoch == final_epoch) return 0;
      }
    } catch (const Error& e) {
      b->errors_seen[static_cast<int>(e.code())].fetch_add(1);
      bool again = false;
      for (Errc r : reopen_on) again |= e.code() == r;
      if (!again || ++reopens > 8) {
        std::fprintf(stderr, "consumer %d: %s\n", idx, e.what());
        return errc_exit(e);
      }
    }
  }
}

void note_errors(Matrix& m, const Board* b, const char* role) {
  for (int e = 1; e < 64; ++e)
    if (int n = b->errors_seen[e].load())
      for (int i = 0; i < n; ++i) m.note(role, std::string("saw:") + errc_name(static_cast<Errc>(e)));
}

}  // namespace

TEST(FaultMatrix, Kill9ProducerAtRandomPoints) {
  Matrix m("kill9_producer", run_seed());
  std::mt19937_64 rng(m.seed);
  const int n = trials(60);
  for (int t = 0; t < n; ++t) {
    const std::string name = unique_name("kp");
    RegionGuard guard{name};
    Board* b = Board::make();
    const std::uint64_t ts = rng();
    const bool checksums = ts & 1;
    const std::uint32_t slots = 2 + static_cast<std::uint32_t>((ts >> 1) % 3);
    // producer_state: 1 created, 2 waiting for consumers, 100+i writing
    // tensor i of a sync, 3 between syncs.
    Child prod = Child::spawn([&] {
      Producer p = Producer::create(name, popts(2, 20000ms, StallPolicy::kFail, slots, checksums));
      b->producer_state.store(2);
      p.wait_for_consumers(2, 20s);
      for (std::uint64_t v = 1; v < 100000; ++v) {
        EpochSync s(1, v, ts + v);
        p.begin_sync(s.specs);
        for (std::size_t i = 0; i < s.specs.size(); ++i) {
          b->producer_state.store(100 + static_cast<int>(i));
          p.write(i, s.ptrs[i]);
        }
        b->producer_state.store(99);
        p.end_sync();
        b->producer_syncs.store(static_cast<int>(v));
        b->producer_state.store(3);
      }
      return 0;
    });
    Child c0 = Child::spawn([&] { return resilient_consumer(name, b, 0, false, 2, {Errc::kPeerDied}); });
    Child c1 = Child::spawn([&] { return resilient_consumer(name, b, 1, true, 2, {Errc::kPeerDied}); });

    // Kill point: mostly while syncs stream, sometimes during create/attach.
    const int mode = static_cast<int>((ts >> 8) % 6);
    if (mode == 0) {  // during create / attach
      std::this_thread::sleep_for(std::chrono::microseconds((ts >> 16) % 3000));
    } else if (mode <= 3) {  // inside a sync: a random moment after a write began
      wait_for([&] { return b->producer_syncs.load() >= static_cast<int>((ts >> 40) % 3) &&
                            b->producer_state.load() >= 100; }, 20s);
      std::this_thread::sleep_for(std::chrono::microseconds((ts >> 16) % 1500));
    } else {  // anywhere in the stream
      wait_for([&] { return b->producer_syncs.load() >= 1 || b->producer_state.load() >= 100; }, 20s);
      std::this_thread::sleep_for(std::chrono::microseconds((ts >> 16) % 30000));
    }
    prod.kill9();
    const int prc = prod.wait(20s);
    m.child("producer", prc, {}, SIGKILL);
    const int st = b->producer_state.load();
    m.note("kill_at", st == 0 ? "create" : st == 2 ? "waiting_consumers" : st == 3 ? "between_syncs"
                      : st == 99 ? "end_sync" : "writing_tensor");

    // A replacement producer takes the name over and sends one epoch-2 sync.
    Child repl = Child::spawn([&] {
      Producer p = Producer::create(name, popts(2, 20000ms, StallPolicy::kFail, slots, checksums));
      p.wait_for_consumers(2, 20s);
      EpochSync s(2, 1, ts ^ 0xabcdef);
      p.send(s.specs, s.ptrs);
      p.wait_drained(20s);
      return 0;
    });
    m.child("consumer", c0.wait(60s), {0});
    m.child("consumer", c1.wait(60s), {0});
    m.child("replacement", repl.wait(60s), {0});
    m.syncs_verified += b->total_verified();
    note_errors(m, b, "consumer");
    std::string why;
    if (!fresh_pair_syncs(name, &why)) {
      ++m.unreusable;
      ADD_FAILURE() << "trial " << t << ": region not reusable: " << why;
    }
    Board::destroy(b);
    m.trial_done();
  }
  m.finish();
}

TEST(FaultMatrix, Kill9ConsumerAtRandomPoints) {
  Matrix m("kill9_consumer", run_seed());
  std::mt19937_64 rng(m.seed);
  const int n = trials(60);
  constexpr int kSyncs = 6;
  for (int t = 0; t < n; ++t) {
    const std::string name = unique_name("kc");
    RegionGuard guard{name};
    Board* b = Board::make();
    const std::uint64_t ts = rng();
    const bool checksums = ts & 1;
    const std::uint32_t slots = 2 + static_cast<std::uint32_t>((ts >> 1) % 3);
    // Exactly three seats: the consumer that joins after the kill must
    // reclaim the dead one.
    Child prod = Child::spawn([&] {
      Producer p = Producer::create(name, popts(3, 20000ms, StallPolicy::kFail, slots, checksums));
      p.wait_for_consumers(3, 20s);
      for (std::uint64_t v = 1; v <= kSyncs; ++v) {
        EpochSync s(1, v, ts + v);
        p.send(s.specs, s.ptrs);
        b->producer_syncs.store(static_cast<int>(v));
      }
      b->producer_state.store(1);
      if (!wait_for([&] { return b->go.load() == 1; }, 30s)) return 31;
      p.wait_for_consumers(3, 20s);
      EpochSync s(2, kSyncs + 1, ts);
      p.send(s.specs, s.ptrs);
      p.wait_drained(20s);
      for (const auto& e : p.take_events())
        if (e.find("died") != std::string::npos) b->producer_state.fetch_add(10);
      return 0;
    });
    Child s0 = Child::spawn([&] { return resilient_consumer(name, b, 0, false, 2, {}); });
    Child s1 = Child::spawn([&] { return resilient_consumer(name, b, 1, true, 2, {}); });
    const int mode = static_cast<int>((ts >> 8) % 3);
    const int stop_piece = static_cast<int>((ts >> 12) % 8);
    Child victim = Child::spawn([&] {
      Consumer c = Consumer::open(name, copts());
      b->attached[2].store(1);
      int pieces = 0;
      for (;;) {
        const SyncInfo& info = c.wait_sync(20s);
        if (mode == 0) {  // killed inside a visit callback, holding a slot
          c.visit([&](const Piece&) {
            if (pieces++ == stop_piece) {
              b->in_visit[2].store(1);
              ::pause();
            }
          });
        } else if (!read_and_check(c, info, mode == 2)) {
          b->mismatches.fetch_add(1);
          return kMismatchExit;
        } else {
          b->verified[2].fetch_add(1);
        }
      }
    });
    wait_for([&] { return b->attached[0].load() && b->attached[1].load() && b->attached[2].load(); }, 20s);
    if (mode == 0) {
      // If the victim sees fewer pieces than stop_piece in all syncs it
      // blocks in wait_sync for the final one: kill it there.
      wait_for([&] { return b->in_visit[2].load() == 1 || b->producer_state.load() >= 1; }, 20s);
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds((ts >> 16) % 20000));
    }
    const int synced_at_kill = b->producer_syncs.load();
    victim.kill9();
    m.child("victim", victim.wait(20s), {}, SIGKILL);
    m.note("kill_at", b->in_visit[2].load() ? "inside_visit"
                      : synced_at_kill >= kSyncs ? "after_last_sync" : "mid_stream");
    // A new consumer joins and must get a seat (the dead one's).
    Child rejoin = Child::spawn([&] { return resilient_consumer(name, b, 3, false, 2, {}); });
    wait_for([&] { return b->attached[3].load() == 1; }, 20s);
    b->go.store(1);
    m.child("producer", prod.wait(60s), {0});
    m.child("survivor", s0.wait(60s), {0});
    m.child("survivor", s1.wait(60s), {0});
    m.child("rejoiner", rejoin.wait(60s), {0});
    if (b->verified[0].load() != kSyncs + 1 || b->verified[1].load() != kSyncs + 1) {
      ++m.unexpected;
      m.note("survivor", "missed_syncs");
    }
    if (b->producer_state.load() >= 11) m.note("producer", "evicted_dead_seat");
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
}
