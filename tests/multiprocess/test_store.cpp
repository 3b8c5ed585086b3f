// Store regions (RegionMode::kStore): the newest complete version, kept for
// consumers that come at any time. Late joiners, readers racing a writer
// (no torn version), a version outliving its producer, held versions and
// what the producer does about them, aborted syncs, refusals.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <span>

#include "shmcast/shmcast.hpp"
#include "support.hpp"

using namespace shmcast;
using namespace shmcast_test;
using namespace std::chrono_literals;

namespace {

ProducerOptions store_opts(std::uint64_t store_bytes, std::chrono::milliseconds consumer_timeout = 20000ms) {
  ProducerOptions o;
  o.mode = RegionMode::kStore;
  o.store_bytes = store_bytes;
  o.pin = Pin::kNo;
  o.engine = CopyEngine::kHost;
  o.consumer_timeout = consumer_timeout;
  o.max_consumers = 8;
  return o;
}

ConsumerOptions copts(std::chrono::milliseconds open_timeout = 10000ms) {
  ConsumerOptions o;
  o.pin = Pin::kNo;
  o.open_timeout = open_timeout;
  return o;
}

// Reads the sync wait_sync() returned into fresh buffers.
std::vector<std::vector<std::uint8_t>> read_all(Consumer& c) {
  const SyncInfo& s = c.sync();
  std::vector<std::vector<std::uint8_t>> got(s.tensors.size());
  std::vector<void*> dsts;
  for (std::size_t i = 0; i < got.size(); ++i) {
    got[i].resize(s.tensors[i].nbytes);
    dsts.push_back(got[i].data());
  }
  c.read_into(dsts);
  return got;
}

std::uint64_t send_pattern(Producer& p, std::uint64_t version_seed, int count = 3, std::uint64_t bytes = 100000) {
  PatternSync s(count, bytes, version_seed);
  return p.send(s.specs, s.ptrs);
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// A small ring region (the default mode), for comparison.
ProducerOptions ring_opts() {
  ProducerOptions o;
  o.pin = Pin::kNo;
  o.engine = CopyEngine::kHost;
  o.slot_bytes = 2 << 20;
  return o;
}

// The Errc fn throws, or Errc{} when it does not.
// Runs `body` in a child. The body calls crash() once it is in the state
// the test wants; the child is SIGKILLed there (a crash: nothing closed).
// A body that returns instead exits with its value (a failure here).
void crash_child_when_ready(const std::function<int(const std::function<void()>& crash)>& body) {
  SharedFlags* f = SharedFlags::make();
  Child c = Child::spawn([&] {
    return body([f] {
      f->v[0].store(1);
      for (;;) ::pause();
    });
  });
  ASSERT_TRUE(f->wait(0, 1, 30s)) << "child exit " << c.wait(1s);
  c.kill9();
  ASSERT_EQ(c.wait(10s), 128 + SIGKILL);
}

// A store producer that stores `versions` versions of pattern `seed`, then crashes.
void store_then_die(const std::string& name, int versions, std::uint64_t seed) {
  crash_child_when_ready([&](const std::function<void()>& crash) {
    Producer p = Producer::create(name, store_opts(1 << 20));
    for (int v = 0; v < versions; ++v) send_pattern(p, seed);
    crash();
    return 0;
  });
}

}  // namespace

TEST(Store, LateJoinerGetsTheNewestVersionAtOnceThenWaitsForANewerOne) {
  const std::string name = unique_name("store-late");
  RegionGuard g{name};
  Producer p = Producer::create(name, store_opts(1 << 20));
  EXPECT_EQ(p.mode(), RegionMode::kStore);
  for (std::uint64_t v = 1; v <= 3; ++v) ASSERT_EQ(send_pattern(p, v), v);  // nobody attached: nothing waits
  SharedFlags* f = SharedFlags::make();
  Child c = Child::spawn([&] {
    try {
      Consumer k = Consumer::open(name, copts());
      if (k.mode() != RegionMode::kStore) return 1;
      // The stored version, without the producer sending anything.
      const SyncInfo& s = k.wait_sync(0ms);
      if (s.version != 3) return 2;
      if (!check_pattern(read_all(k), 3)) return 3;
      // Nothing newer yet: a timeout, not the same version again.
      try {
        k.wait_sync(100ms);
        return 4;
      } catch (const Error& e) {
        if (e.code() != Errc::kTimeout) return 5;
      }
      f->v[0].store(1);  // now send 4
      if (k.wait_sync(20s).version != 4) return 6;
      if (!check_pattern(read_all(k), 4)) return 7;
      return 0;
    } catch (const Error& e) {
      return errc_exit(e);
    }
  });
  ASSERT_TRUE(f->wait(0, 1, 30s)) << "consumer exit " << c.wait(1s);
  EXPECT_EQ(send_pattern(p, 4), 4u);
  EXPECT_EQ(c.wait(30s), 0);
}

// >= 10,000 versions replace each other while readers in other processes
// read whole versions (read_into and views()) as fast as they can: every
// version a reader gets is one version's bytes, never a mix.
TEST(Store, ReadersRacingAWriterNeverSeeATornVersion) {
  const std::string name = unique_name("store-race");
  RegionGuard g{name};
  constexpr int kTensors = 4;
  constexpr std::uint64_t kWords = 2048;  // 16 KiB per tensor
  constexpr std::uint64_t kFlips = 10000;
  std::vector<TensorSpec> specs;
  for (int i = 0; i < kTensors; ++i) specs.push_back({"t" + std::to_string(i), DType::kU64, {std::int64_t{kWords}}});
  auto word = [](std::uint64_t version, int t, std::uint64_t k) {
    return version * 0x9E3779B97F4A7C15ull ^ (std::uint64_t(t) << 56) ^ k;
  };
  Producer p = Producer::create(name, store_opts(store_bytes_needed(specs)));
  SharedFlags* f = SharedFlags::make();  // v[r]: reader r's result + 1; v[8 + r]: reader r attached
  constexpr int kReaders = 3;
  std::vector<Child> readers;
  for (int r = 0; r < kReaders; ++r) {
    readers.push_back(Child::spawn([&, r] {
      try {
        Consumer c = Consumer::open(name, copts());
        f->v[8 + r].store(1);
        std::vector<std::uint64_t> buf(kTensors * kWords);
        std::uint64_t last = 0, reads = 0;
        for (;;) {
          const SyncInfo& s = c.wait_sync(60s);
          if (s.version <= last) return 10;  // versions only go up
          last = s.version;
          if (r == 2) {  // zero-copy: check the bytes in place, under the hold
            const std::vector<const std::byte*> v = c.views();
            for (int t = 0; t < kTensors; ++t) {
              const auto* w = reinterpret_cast<const std::uint64_t*>(v[t]);
              for (std::uint64_t k = 0; k < kWords; ++k)
                if (w[k] != word(s.version, t, k)) return 11;
            }
            if (!c.views_valid()) return 12;
            c.skip();
          } else {
            std::vector<void*> d;
            for (int t = 0; t < kTensors; ++t) d.push_back(buf.data() + t * kWords);
            c.read_into(d);
            for (int t = 0; t < kTensors; ++t)
              for (std::uint64_t k = 0; k < kWords; ++k)
                if (buf[t * kWords + k] != word(s.version, t, k)) return 13;
          }
          ++reads;
          if (last >= kFlips) break;
        }
        f->v[4 + r].store(static_cast<int>(reads));
        return 0;
      } catch (const Error& e) {
        return errc_exit(e);
      }
    }));
  }
  for (int r = 0; r < kReaders; ++r) ASSERT_TRUE(f->wait(8 + r, 1, 30s)) << "reader " << r << " exit " << readers[r].wait(1s);
  std::vector<std::uint64_t> src(kTensors * kWords);
  std::vector<const void*> ptrs;
  for (int t = 0; t < kTensors; ++t) ptrs.push_back(src.data() + t * kWords);
  for (std::uint64_t v = 1; v <= kFlips; ++v) {
    for (int t = 0; t < kTensors; ++t)
      for (std::uint64_t k = 0; k < kWords; ++k) src[t * kWords + k] = word(v, t, k);
    ASSERT_EQ(p.send(specs, ptrs), v);
  }
  for (int r = 0; r < kReaders; ++r) {
    EXPECT_EQ(readers[r].wait(120s), 0) << "reader " << r;
    EXPECT_GT(f->v[4 + r].load(), 1) << "reader " << r << " read only the last version: no race was tested";
  }
}

TEST(Store, VersionOutlivesADeadProducer) {
  const std::string name = unique_name("store-dead");
  RegionGuard g{name};
  ASSERT_NO_FATAL_FAILURE(store_then_die(name, 1, 7));
  // Opened after the producer died: the stored version is there.
  Consumer c = Consumer::open(name, copts(2000ms));
  EXPECT_EQ(c.wait_sync(0ms).version, 1u);
  EXPECT_TRUE(check_pattern(read_all(c), 7));
  // Nothing newer can come: PeerDied at once, not a timeout.
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(code_of([&] { c.wait_sync(20s); }), Errc::kPeerDied) << "a newer version from a dead producer";
  EXPECT_LT(ms_since(t0), 5000.0);
}

TEST(Store, VersionOutlivesAClosedProducerThatKeptTheName) {
  const std::string name = unique_name("store-closed");
  RegionGuard g{name};
  {
    ProducerOptions o = store_opts(1 << 20);
    o.unlink_on_close = false;
    Producer p = Producer::create(name, o);
    send_pattern(p, 11);
  }
  Consumer c = Consumer::open(name, copts(2000ms));
  EXPECT_EQ(c.wait_sync(0ms).version, 1u);
  EXPECT_TRUE(check_pattern(read_all(c), 11));
  EXPECT_EQ(code_of([&] { c.wait_sync(5s); }), Errc::kClosed) << "a newer version from a closed producer";
}

TEST(Store, EmptyStoreRegionWithADeadProducerIsNotOpened) {
  const std::string name = unique_name("store-empty");
  RegionGuard g{name};
  ASSERT_NO_FATAL_FAILURE(store_then_die(name, 0, 0));
  try {
    Consumer::open(name, copts(300ms));
    ADD_FAILURE() << "opened a store region with no version and a dead producer";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kPeerDied) << e.what();
  }
}

// StallPolicy::kFail: a version a live consumer holds is never overwritten;
// the sync that needs its bank fails with a Timeout naming the consumer.
TEST(Store, HeldVersionIsNotOverwritten) {
  const std::string name = unique_name("store-hold");
  RegionGuard g{name};
  Producer p = Producer::create(name, store_opts(1 << 20, 300ms));
  send_pattern(p, 1, 1, 4096);
  Consumer c = Consumer::open(name, copts());
  ASSERT_EQ(c.wait_sync(0ms).version, 1u);
  const std::vector<const std::byte*> v = c.views();
  std::vector<std::uint8_t> want(4096);
  fill_pattern(want.data(), want.size(), seed_of(1, 0));
  ASSERT_EQ(std::memcmp(v[0], want.data(), want.size()), 0);
  EXPECT_EQ(send_pattern(p, 2, 1, 4096), 2u);  // the other bank: no wait
  const auto t0 = std::chrono::steady_clock::now();
  try {
    send_pattern(p, 3, 1, 4096);  // needs version 1's bank
    ADD_FAILURE() << "version 1 was replaced while held";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kTimeout) << e.what();
    EXPECT_NE(std::string(e.what()).find("consumer seat"), std::string::npos) << e.what();
  }
  EXPECT_GE(ms_since(t0), 250.0);
  EXPECT_TRUE(c.views_valid());
  EXPECT_EQ(std::memcmp(v[0], want.data(), want.size()), 0);
  // The failed sync left version 2 in place; letting go of 1 lets the next sync through.
  c.skip();
  EXPECT_FALSE(c.views_valid());
  EXPECT_EQ(send_pattern(p, 4, 1, 4096), 4u);
  EXPECT_EQ(c.wait_sync(0ms).version, 4u);
  EXPECT_TRUE(check_pattern(read_all(c), 4));
}

// StallPolicy::kEvict: after consumer_timeout the holder is evicted and its
// bank rewritten; views_valid() says so, and the consumer gets kEvicted.
TEST(Store, EvictPolicyReplacesAHeldVersionAndTellsTheReader) {
  const std::string name = unique_name("store-evict");
  RegionGuard g{name};
  ProducerOptions o = store_opts(1 << 20, 300ms);
  o.stall_policy = StallPolicy::kEvict;
  Producer p = Producer::create(name, o);
  send_pattern(p, 1, 1, 4096);
  Consumer c = Consumer::open(name, copts());
  ASSERT_EQ(c.wait_sync(0ms).version, 1u);
  (void)c.views();
  ASSERT_TRUE(c.views_valid());
  send_pattern(p, 2, 1, 4096);
  EXPECT_EQ(send_pattern(p, 3, 1, 4096), 3u);  // waited 300 ms, then evicted the holder
  EXPECT_FALSE(c.views_valid());
  EXPECT_EQ(p.take_events().size(), 1u);
  EXPECT_EQ(code_of([&] { c.wait_sync(1s); }), Errc::kEvicted) << "an evicted consumer went on";
  // A new consumer gets the newest version.
  Consumer c2 = Consumer::open(name, copts());
  EXPECT_EQ(c2.wait_sync(0ms).version, 3u);
  EXPECT_TRUE(check_pattern(read_all(c2), 3));
}

TEST(Store, DeadHolderDoesNotBlockTheProducer) {
  const std::string name = unique_name("store-deadhold");
  RegionGuard g{name};
  Producer p = Producer::create(name, store_opts(1 << 20, 20000ms));
  send_pattern(p, 1, 1, 4096);
  // A consumer that crashes while it holds version 1 (views).
  ASSERT_NO_FATAL_FAILURE(crash_child_when_ready([&](const std::function<void()>& crash) {
    Consumer k = Consumer::open(name, copts());
    if (k.wait_sync(0ms).version != 1) return 1;
    (void)k.views();
    crash();
    return 0;
  }));
  const auto t0 = std::chrono::steady_clock::now();
  send_pattern(p, 2, 1, 4096);
  EXPECT_EQ(send_pattern(p, 3, 1, 4096), 3u);
  EXPECT_LT(ms_since(t0), 5000.0) << "the producer waited for a dead holder";
}

// A consumer reading while the producer keeps storing versions: its hold
// makes the producer wait (briefly), never corrupts the read.
TEST(Store, ReaderHoldingAcrossTwoSyncsReadsItsVersionIntact) {
  const std::string name = unique_name("store-slow");
  RegionGuard g{name};
  Producer p = Producer::create(name, store_opts(1 << 20, 20000ms));
  send_pattern(p, 1);
  SharedFlags* f = SharedFlags::make();
  Child c = Child::spawn([&] {
    try {
      Consumer k = Consumer::open(name, copts());
      if (k.wait_sync(0ms).version != 1) return 1;
      f->v[0].store(1);  // holding version 1 now
      if (!f->wait(1, 1, 30s)) return 2;  // the producer stored 2 and is blocked on 3
      if (!check_pattern(read_all(k), 1)) return 3;  // reading lets go
      // Then the newest: 2 (if the producer has not stored 3 yet), then 3.
      for (;;) {
        const std::uint64_t v = k.wait_sync(30s).version;
        if (v != 2 && v != 3) return 4;
        if (!check_pattern(read_all(k), v)) return 5;
        if (v == 3) return 0;
      }
    } catch (const Error& e) {
      return errc_exit(e);
    }
  });
  ASSERT_TRUE(f->wait(0, 1, 30s)) << "consumer exit " << c.wait(1s);
  send_pattern(p, 2);
  f->v[1].store(1);
  EXPECT_EQ(send_pattern(p, 3), 3u);  // waits until the consumer has read 1
  EXPECT_EQ(c.wait(30s), 0);
}

TEST(Store, AbortedSyncKeepsTheStoredVersion) {
  const std::string name = unique_name("store-abort");
  RegionGuard g{name};
  Producer p = Producer::create(name, store_opts(1 << 20));
  send_pattern(p, 1);
  Consumer c = Consumer::open(name, copts());
  PatternSync s(3, 100000, 2);
  p.begin_sync(s.specs);
  p.write(0, s.ptrs[0]);
  p.abort_sync("test abort");
  // Readers still get version 1, whole.
  EXPECT_EQ(c.wait_sync(0ms).version, 1u);
  EXPECT_TRUE(check_pattern(read_all(c), 1));
  EXPECT_EQ(code_of([&] { c.wait_sync(100ms); }), Errc::kTimeout) << "an aborted version was handed out";
  // The next sync reuses the aborted one's bank, not the stored version's.
  const std::uint64_t v = send_pattern(p, 3);
  EXPECT_EQ(c.wait_sync(1s).version, v);
  EXPECT_TRUE(check_pattern(read_all(c), 3));
  Consumer c2 = Consumer::open(name, copts());
  EXPECT_EQ(c2.wait_sync(0ms).version, v);
  EXPECT_TRUE(check_pattern(read_all(c2), 3));
}

TEST(Store, EmptyAndZeroSizedVersions) {
  const std::string name = unique_name("store-zero");
  RegionGuard g{name};
  Producer p = Producer::create(name, store_opts(1 << 20));
  std::vector<TensorSpec> specs = {{"e", DType::kF32, {0, 4}}};
  const void* src[] = {nullptr};
  ASSERT_EQ(p.send(specs, src), 1u);
  ASSERT_EQ(p.send({}, {}), 2u);
  Consumer c = Consumer::open(name, copts());
  const SyncInfo& s = c.wait_sync(0ms);
  EXPECT_EQ(s.version, 2u);
  EXPECT_TRUE(s.tensors.empty());
  c.read_into({});
  send_pattern(p, 5);
  EXPECT_EQ(c.wait_sync(1s).version, 3u);
  EXPECT_TRUE(check_pattern(read_all(c), 5));
}

TEST(Store, Refusals) {
  const std::string name = unique_name("store-refuse");
  RegionGuard g{name};
  EXPECT_EQ(code_of([&] { Producer::create(name, store_opts(0)); }), Errc::kInvalidArgument);
  ProducerOptions sharded = store_opts(1 << 20);
  sharded.world_size = 2;
  EXPECT_EQ(code_of([&] { Producer::create(name, sharded); }), Errc::kInvalidArgument);
  Producer p = Producer::create(name, store_opts(2 << 20));
  // A version larger than the store.
  std::vector<TensorSpec> big = {{"b", DType::kU8, {(3 << 20)}}};
  std::vector<std::uint8_t> bytes(3 << 20);
  const void* src[] = {bytes.data()};
  EXPECT_EQ(code_of([&] { p.send(big, src); }), Errc::kInvalidArgument);
  EXPECT_EQ(send_pattern(p, 1), 1u);  // and the producer goes on
  EXPECT_EQ(p.slots(), 2u);
  EXPECT_EQ(store_bytes_needed(big), std::uint64_t{3 << 20});
  // views() needs a store region and a version.
  Consumer c = Consumer::open(name, copts());
  EXPECT_EQ(code_of([&] { c.views(); }), Errc::kInvalidArgument);
  const std::string ring_name = unique_name("store-ring");
  RegionGuard g2{ring_name};
  Producer rp = Producer::create(ring_name, ring_opts());
  EXPECT_EQ(rp.mode(), RegionMode::kRing);
  Consumer rc = Consumer::open(ring_name, copts());
  EXPECT_EQ(rc.mode(), RegionMode::kRing);
  send_pattern(rp, 1);
  ASSERT_EQ(rc.wait_sync(5s).version, 1u);
  EXPECT_EQ(code_of([&] { rc.views(); }), Errc::kInvalidArgument);
  EXPECT_TRUE(check_pattern(read_all(rc), 1));
}

// fill_spans(): the caller fills the bank itself (what publish() does with
// file reads); end_sync() publishes it, abort_sync() drops it.
TEST(Store, FillSpansLendTheBankAndEndSyncPublishesIt) {
  const std::string name = unique_name("store-fill");
  RegionGuard g{name};
  Producer p = Producer::create(name, store_opts(1 << 20));
  EXPECT_EQ(code_of([&] { p.fill_spans(); }), Errc::kInvalidArgument);  // outside a sync
  PatternSync s(3, 100000, 5);
  s.specs.push_back({"empty", DType::kF32, {0}});
  ASSERT_EQ(p.begin_sync(s.specs), 1u);
  const std::vector<std::span<std::byte>> spans = p.fill_spans();
  ASSERT_EQ(spans.size(), 4u);
  EXPECT_TRUE(spans[3].empty());
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(spans[i].size(), 100000u);
    std::memcpy(spans[i].data(), s.ptrs[i], 100000);
  }
  EXPECT_EQ(code_of([&] { p.write(0, s.ptrs[0]); }), Errc::kInvalidArgument);
  EXPECT_EQ(code_of([&] { p.fill_spans(); }), Errc::kInvalidArgument);
  p.end_sync();
  Consumer c = Consumer::open(name, copts());
  ASSERT_EQ(c.wait_sync(0ms).version, 1u);
  std::vector<std::vector<std::uint8_t>> got = read_all(c);
  got.pop_back();  // the empty tensor
  EXPECT_TRUE(check_pattern(got, 5));
  // Lent, half filled, aborted: readers keep version 1.
  ASSERT_EQ(p.begin_sync(s.specs), 2u);
  std::memset(p.fill_spans()[0].data(), 0xAB, 100000);
  p.abort_sync("test");
  Consumer c2 = Consumer::open(name, copts());
  EXPECT_EQ(c2.wait_sync(0ms).version, 1u);
  got = read_all(c2);
  got.pop_back();
  EXPECT_TRUE(check_pattern(got, 5));
  // A ring region lends nothing.
  const std::string ring_name = unique_name("store-fill-ring");
  RegionGuard g2{ring_name};
  Producer rp = Producer::create(ring_name, ring_opts());
  rp.begin_sync(s.specs);
  EXPECT_EQ(code_of([&] { rp.fill_spans(); }), Errc::kInvalidArgument);
  rp.abort_sync("test");
}

// A store region's record rewritten by a hostile or broken peer: the
// consumer refuses it (Corrupt) or times out at its deadline, never reads
// outside a bank or hangs.
TEST(Store, CraftedRecordsAreRefused) {
  const std::string name = unique_name("store-craft");
  RegionGuard g{name};
  Producer p = Producer::create(name, store_opts(2 << 20));
  send_pattern(p, 1);
  const int fd = ::open(region_path(name).c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  constexpr off_t kRec = 192;  // Header::sync (docs/protocol.md §3.3)
  auto poke = [&](off_t field, std::uint64_t v) {
    ASSERT_EQ(::pwrite(fd, &v, 8, kRec + field), 8);
  };
  auto peek = [&](off_t field) {
    std::uint64_t v = 0;
    EXPECT_EQ(::pread(fd, &v, 8, kRec + field), 8);
    return v;
  };
  const std::uint64_t chunks = peek(24), stream = peek(32), hash = peek(48), first = peek(16);
  struct Case {
    const char* what;
    off_t field;
    std::uint64_t value;
    Errc want;
  };
  const Case cases[] = {
      {"two chunks", 24, 2, Errc::kCorrupt},
      {"a stream larger than a bank", 32, (4ull << 20), Errc::kCorrupt},
      {"a wrong manifest hash", 48, hash ^ 1, Errc::kCorrupt},
      {"a chunk no bank holds", 16, first + 7, Errc::kTimeout},
  };
  for (const Case& k : cases) {
    poke(24, chunks);
    poke(32, stream);
    poke(48, hash);
    poke(16, first);
    poke(k.field, k.value);
    Consumer c = Consumer::open(name, copts());
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_EQ(code_of([&] { c.wait_sync(200ms); }), k.want) << k.what;
    EXPECT_LT(ms_since(t0), 5000.0) << k.what;
  }
  ::close(fd);
}
