// Multiprocess tests whose consumer has two threads over the library's state
// (a chunk released from another thread; a read on one thread while the
// test's main thread sends): a binary of their own, labelled threads, so
// that the TSan build (scripts/sanitizers.sh) builds these two and not all
// of test_multiprocess, whose other processes are one thread each.
#include <gtest/gtest.h>

#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>

#include "delta_host_support.hpp"
#include "delta_sync_support.hpp"
#include "support.hpp"
#include "transfer_support.hpp"

using namespace shmcast;
using namespace shmcast_test;
using namespace std::chrono_literals;
using namespace transfer_test;
using namespace delta_sync_test;
using namespace delta_host;

namespace {

// visit_chunks(): the consumer holds several slots at once and releases
// them later from another thread, in reverse order of arrival per batch;
// every chunk is checked against the stream the producer wrote.
int run_deferred_consumer(const std::string& name, int syncs, std::uint64_t seed, int count) {
  ConsumerOptions co;
  co.pin = Pin::kNo;
  Consumer c = Consumer::open(name, co);
  const std::uint64_t S = c.slot_bytes();
  for (int s = 0; s < syncs; ++s) {
    const SyncInfo& info = c.wait_sync(20s);
    auto specs = random_manifest(seed + s, kSlot, count);
    std::vector<std::uint8_t> want(info.stream_bytes, 0);
    std::vector<bool> data(info.stream_bytes, false);  // tensor bytes (padding is unspecified)
    for (std::size_t i = 0; i < specs.size(); ++i) {
      fill_pattern(want.data() + info.tensors[i].stream_offset, specs[i].nbytes(), seed_of(info.version, i));
      std::fill_n(data.begin() + static_cast<std::ptrdiff_t>(info.tensors[i].stream_offset), specs[i].nbytes(), true);
    }
    std::mutex mu;
    std::condition_variable cv;
    struct Held {
      std::uint64_t ch, n;
      const std::byte* p;
      std::function<void()> release;
    };
    std::vector<Held> held;
    bool stop = false, last = false;
    std::uint64_t next = 0, bad = 0, max_held = 0;
    // The releaser: lets go of the held chunks, newest first, once 3 are
    // held (the ring has 4 slots) or the sync's last chunk is. Each chunk is
    // checked again just before its release: a slot let go too early would
    // have been refilled by the producer by then.
    auto check = [&](std::uint64_t ch, const std::byte* p, std::uint64_t n) {
      std::uint64_t b = 0;
      for (std::uint64_t k = 0; k < n && ch * S + k < want.size(); ++k)
        if (data[ch * S + k] && static_cast<std::uint8_t>(p[k]) != want[ch * S + k]) ++b;
      return b;
    };
    std::thread releaser([&] {
      std::unique_lock<std::mutex> g(mu);
      for (;;) {
        cv.wait(g, [&] { return held.size() >= 3 || last || stop; });
        if (held.empty() && stop) return;
        std::vector<Held> take;
        take.swap(held);
        g.unlock();
        std::uint64_t b = 0;
        for (auto it = take.rbegin(); it != take.rend(); ++it) {
          b += check(it->ch, it->p, it->n);
          it->release();
        }
        g.lock();
        bad += b;
      }
    });
    c.visit_chunks([&](std::uint64_t ch, const std::byte* p, std::uint64_t n, std::function<void()> release) {
      if (ch != next++ || ch * S + n > info.stream_bytes || n != std::min(S, info.stream_bytes - ch * S)) ++bad;
      const std::uint64_t b = check(ch, p, n);
      std::lock_guard<std::mutex> g(mu);
      bad += b;
      held.push_back(Held{ch, n, p, std::move(release)});
      last = ch + 1 == info.chunks;
      max_held = std::max<std::uint64_t>(max_held, held.size());
      cv.notify_all();
    });
    {
      std::lock_guard<std::mutex> g(mu);
      stop = true;
      cv.notify_all();
    }
    releaser.join();
    if (bad != 0 || next != info.chunks) return 12;
    if (info.chunks >= 3 && max_held < 3) return 13;  // chunks were held at once
  }
  return 0;
}

}  // namespace

TEST(Transfer, VisitChunksHoldsSeveralSlotsReleasedFromAnotherThread) {
  const std::string name = unique_name("defer");
  RegionGuard g{name};
  Child prod = Child::spawn([&] { return run_producer(name, 4, 1, 5, 30, 4); });
  Child cons = Child::spawn([&] { return run_deferred_consumer(name, 4, 5, 30); });
  EXPECT_EQ(cons.wait(kBulkWait), 0);
  EXPECT_EQ(prod.wait(kBulkWait), 0);
}

// A read into memory that overlaps (without being the same pointers) the
// destinations of an earlier read of other tensors: those no longer hold
// that read's version, so the next delta of those tensors is let go (and a
// full sync asked for), never applied to the overwritten bytes.
TEST(DeltaSync, AReadOverlappingEarlierDestinationsForgetsThem) {
  RegionDir dir("delta");
  const std::string name = unique_name("deltaoverlap");
  RegionGuard guard{name};
  Producer p = Producer::create(name, delta_opts());
  Consumer c = Consumer::open(name, copts());
  Model m(false);
  const std::vector<TensorSpec> a = {m.specs[0]}, b = {m.specs[1]};  // bf16 [256, 1500], f32 [300, 333]
  std::vector<std::uint8_t> buf(m.data[0].size() + 4096);
  auto send = [&](const std::vector<TensorSpec>& s, std::size_t i) {
    return p.send(s, std::vector<const void*>{m.data[i].data()});
  };
  auto read = [&](void* dst) {
    std::vector<void*> d{dst};
    c.read_into(d);
  };
  ASSERT_EQ(send(a, 0), 1u);
  ASSERT_EQ(c.wait_sync(10s).version, 1u);
  read(buf.data());  // A's version 1 at buf
  ASSERT_EQ(send(b, 1), 2u);
  ASSERT_EQ(c.wait_sync(10s).version, 2u);
  read(buf.data() + 1000);  // B lands over the middle of A's bytes
  m.step(3);
  std::uint64_t got = 0;
  bool got_delta = true;
  std::thread reader([&] {  // lets version 3 go (its base is overwritten), takes the full sync after it
    try {
      const SyncInfo& s = c.wait_sync(20s);
      got = s.version;
      got_delta = s.delta();
      read(buf.data());
    } catch (const Error&) {
    }
  });
  ASSERT_EQ(send(a, 0), 3u);
  EXPECT_TRUE(p.last_sync().delta);  // against version 1: the producer cannot know
  for (int i = 0; i < 20000 && !p.full_sync_requested(); ++i) std::this_thread::sleep_for(1ms);
  EXPECT_TRUE(p.full_sync_requested());
  ASSERT_EQ(send(a, 0), 4u);
  EXPECT_FALSE(p.last_sync().delta);
  reader.join();
  EXPECT_EQ(got, 4u) << "the delta against version 1 was not let go";
  EXPECT_FALSE(got_delta);
  EXPECT_EQ(0, std::memcmp(buf.data(), m.data[0].data(), m.data[0].size()));
}
