// Peers that join late, die, stall or restart; regions that are corrupt.
// Every test forks real processes; no test asserts how long anything takes,
// only that nothing hangs (Child::wait has a deadline) and errors are typed.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include "base/layout.hpp"
#include "protocol/manifest.hpp"
#include "protocol/rounds.hpp"  // detail::take_over_stale: the takeover test pauses inside it
#include "support.hpp"

using namespace shmcast;
using namespace shmcast_test;
using namespace std::chrono_literals;

namespace {

constexpr std::uint64_t kSlot = 2ull << 20;

ProducerOptions opts(std::chrono::milliseconds consumer_timeout = 20000ms, StallPolicy policy = StallPolicy::kFail) {
  ProducerOptions o;
  o.slot_bytes = kSlot;
  o.slots = 2;
  o.max_consumers = 4;
  o.pin = Pin::kNo;
  o.consumer_timeout = consumer_timeout;
  o.stall_policy = policy;
  return o;
}

ConsumerOptions copts(std::chrono::milliseconds open_timeout = 20000ms) {
  ConsumerOptions c;
  c.pin = Pin::kNo;
  c.open_timeout = open_timeout;
  c.chunk_timeout = 20s;
  return c;
}

// Receives one sync into vectors; returns 0 when it matches the pattern.
int receive_checked(Consumer& c, std::uint64_t* version_out = nullptr) {
  const SyncInfo& info = c.wait_sync(20s);
  std::vector<std::vector<std::uint8_t>> got;
  std::vector<void*> dst;
  for (const auto& t : info.tensors) got.emplace_back(t.nbytes, 0xEE);
  for (auto& g : got) dst.push_back(g.data());
  c.read_into(dst);
  if (version_out) *version_out = info.version;
  return check_pattern(got, info.version) ? 0 : 12;
}

// A consumer that stops itself (SIGSTOP) holding its first slot; after
// SIGCONT it exits with 0 or errc_exit() of the error it then gets.
Child spawn_stalling_consumer(const std::string& name, SharedFlags* f) {
  return Child::spawn([&name, f] {
    Consumer c = Consumer::open(name, copts());
    c.wait_sync(20s);
    try {
      c.visit([&](const Piece&) {
        if (f->v[0].exchange(1) == 0) ::raise(SIGSTOP);
      });
    } catch (const Error& e) {
      return errc_exit(e);
    }
    return 0;
  });
}

void corrupt_file(const std::string& path, std::size_t offset, const void* bytes, std::size_t n) {
  int fd = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::pwrite(fd, bytes, n, static_cast<off_t>(offset)), static_cast<ssize_t>(n));
  ::close(fd);
}

}  // namespace

TEST(Liveness, ConsumerAttachingMidStreamStartsWithTheNextSync) {
  const std::string name = unique_name("mid");
  RegionGuard g{name};
  SharedFlags* f = SharedFlags::make();
  Child prod = Child::spawn([&] {
    Producer p = Producer::create(name, opts());
    p.wait_for_consumers(1, 20s);
    for (std::uint64_t v = 1; v <= 40; ++v) {
      PatternSync s(3, 300000, v);
      p.send(s.specs, s.ptrs);
      f->v[0].store(static_cast<int>(v));
      if (v == 5) f->wait(1, 1);  // late consumer attached
    }
    p.wait_drained(20s);
    return 0;
  });
  Child early = Child::spawn([&] {
    Consumer c = Consumer::open(name, copts());
    for (int i = 0; i < 40; ++i)
      if (int rc = receive_checked(c)) return rc;
    return 0;
  });
  ASSERT_TRUE(f->wait(0, 5));
  Child late = Child::spawn([&] {
    Consumer c = Consumer::open(name, copts());
    f->v[1].store(1);
    std::uint64_t v = 0;
    for (int i = 0; i < 5; ++i)
      if (int rc = receive_checked(c, &v)) return rc;
    return v > 5 ? 0 : 13;  // never saw a sync that began before it attached
  });
  EXPECT_EQ(late.wait(), 0);
  EXPECT_EQ(early.wait(), 0);
  EXPECT_EQ(prod.wait(), 0);
}

TEST(Liveness, ProducerKilledMidSyncGivesPeerDied) {
  const std::string name = unique_name("pkill");
  RegionGuard g{name};
  SharedFlags* f = SharedFlags::make();
  Child prod = Child::spawn([&] {
    Producer p = Producer::create(name, opts());
    p.wait_for_consumers(1, 20s);
    PatternSync s(5, kSlot, 1);  // 5 slots' worth through 2 slots: blocks mid-sync
    p.send(s.specs, s.ptrs);
    return 0;
  });
  Child cons = Child::spawn([&] {
    Consumer c = Consumer::open(name, copts());
    c.wait_sync(20s);
    try {
      c.visit([&](const Piece&) {
        if (f->v[0].exchange(1) == 0) f->wait(1, 1);  // hold the first slot until the producer is dead
      });
    } catch (const Error& e) {
      return errc_exit(e);
    }
    return 0;
  });
  ASSERT_TRUE(f->wait(0, 1));
  prod.kill9();
  EXPECT_EQ(prod.wait(), 128 + SIGKILL);
  f->v[1].store(1);
  EXPECT_EQ(cons.wait(), 20 + static_cast<int>(Errc::kPeerDied));
}

TEST(Liveness, ConsumerKilledMidSyncIsEvictedAndOthersFinish) {
  const std::string name = unique_name("ckill");
  RegionGuard g{name};
  SharedFlags* f = SharedFlags::make();
  Child prod = Child::spawn([&] {
    Producer p = Producer::create(name, opts());
    p.wait_for_consumers(2, 20s);
    for (std::uint64_t v = 1; v <= 2; ++v) {
      PatternSync s(5, kSlot, v);
      p.send(s.specs, s.ptrs);
    }
    const auto events = p.take_events();
    if (events.empty()) return 14;
    return events[0].find("died") != std::string::npos ? 0 : 15;
  });
  Child victim = Child::spawn([&] {
    Consumer c = Consumer::open(name, copts());
    c.wait_sync(20s);
    c.visit([&](const Piece&) {
      f->v[0].store(1);
      ::pause();  // killed here, holding a slot
    });
    return 16;
  });
  Child survivor = Child::spawn([&] {
    Consumer c = Consumer::open(name, copts());
    for (int i = 0; i < 2; ++i)
      if (int rc = receive_checked(c)) return rc;
    return 0;
  });
  ASSERT_TRUE(f->wait(0, 1));
  victim.kill9();
  EXPECT_EQ(victim.wait(), 128 + SIGKILL);
  EXPECT_EQ(survivor.wait(), 0);
  EXPECT_EQ(prod.wait(), 0);
}

TEST(Liveness, StalledConsumerFailsTheSyncWithTimeout) {
  const std::string name = unique_name("stall");
  RegionGuard g{name};
  SharedFlags* f = SharedFlags::make();
  Child prod = Child::spawn([&] {
    Producer p = Producer::create(name, opts(300ms, StallPolicy::kFail));
    p.wait_for_consumers(1, 20s);
    PatternSync s(5, kSlot, 1);
    try {
      p.send(s.specs, s.ptrs);
    } catch (const Error& e) {
      return errc_exit(e);
    }
    return 0;
  });
  Child cons = spawn_stalling_consumer(name, f);
  ASSERT_TRUE(f->wait(0, 1));
  EXPECT_EQ(prod.wait(), 20 + static_cast<int>(Errc::kTimeout));
  ::kill(cons.pid, SIGCONT);
  // The producer aborted the sync when it failed: the consumer learns that.
  EXPECT_EQ(cons.wait(), 20 + static_cast<int>(Errc::kAborted));
}

TEST(Liveness, StalledConsumerIsEvictedUnderEvictPolicy) {
  const std::string name = unique_name("evict");
  RegionGuard g{name};
  SharedFlags* f = SharedFlags::make();
  Child prod = Child::spawn([&] {
    Producer p = Producer::create(name, opts(300ms, StallPolicy::kEvict));
    p.wait_for_consumers(1, 20s);
    PatternSync s(5, kSlot, 1);
    p.send(s.specs, s.ptrs);
    f->v[1].store(1);
    return p.take_events().empty() ? 17 : 0;
  });
  Child cons = spawn_stalling_consumer(name, f);
  ASSERT_TRUE(f->wait(0, 1));
  EXPECT_EQ(prod.wait(), 0);
  ::kill(cons.pid, SIGCONT);
  // The producer evicted it, refilled its slot and exited before it was
  // resumed: the seat check comes first wherever the consumer looks next
  // (slot validity, the next chunk), so it is told kEvicted, never the bytes
  // and never a bare kCorrupt.
  EXPECT_EQ(cons.wait(), 20 + static_cast<int>(Errc::kEvicted));
}

TEST(Liveness, ConsumerReattachesAfterProducerRestart) {
  const std::string name = unique_name("restart");
  RegionGuard g{name};
  SharedFlags* f = SharedFlags::make();
  Child first = Child::spawn([&] {
    Producer p = Producer::create(name, opts());
    p.wait_for_consumers(1, 20s);
    PatternSync s(2, 1000, 1);
    p.send(s.specs, s.ptrs);
    f->v[0].store(1);
    ::pause();
    return 0;
  });
  Child cons = Child::spawn([&] {
    Consumer c = Consumer::open(name, copts());
    if (int rc = receive_checked(c)) return rc;
    try {
      c.wait_sync(20s);
      return 18;
    } catch (const Error& e) {
      if (e.code() != Errc::kPeerDied) return errc_exit(e);
    }
    f->v[1].store(1);
    c = Consumer::open(name, copts());  // waits for the new producer
    std::uint64_t v = 0;
    if (int rc = receive_checked(c, &v)) return rc;
    return v == 1 ? 0 : 19;
  });
  ASSERT_TRUE(f->wait(0, 1));
  first.kill9();
  first.wait();
  ASSERT_TRUE(f->wait(1, 1));
  Child second = Child::spawn([&] {
    Producer p = Producer::create(name, opts());  // replaces the stale region
    p.wait_for_consumers(1, 20s);
    PatternSync s(2, 1000, 1);
    p.send(s.specs, s.ptrs);
    p.wait_drained(20s);
    return 0;
  });
  EXPECT_EQ(cons.wait(), 0);
  EXPECT_EQ(second.wait(), 0);
}

// A consumer that opens the name while a new producer takes over the stale
// region (it holds the old file's lock byte 0, as proof that the old
// producer is dead, until the name is removed) must not take that lock for
// a live producer: it waits, and joins the new region. Before the fix it
// joined the old file and got PeerDied once the takeover let go (the soak
// caught ConsumerReattachesAfterProducerRestart in that window). The
// takeover is paused inside, with both locks held (detail::take_over_stale's
// test hook); the consumer's open_timeout is 300 ms there, sixty of its
// looks at the path.
TEST(Liveness, ConsumerOpeningDuringATakeoverWaitsForTheNewRegion) {
  const std::string name = unique_name("takeover");
  RegionGuard g{name};
  SharedFlags* f = SharedFlags::make();
  Child dead = Child::spawn([&] {
    Producer p = Producer::create(name, opts());
    f->v[0].store(1);
    ::pause();
    return 0;
  });
  ASSERT_TRUE(f->wait(0, 1));
  dead.kill9();
  dead.wait();
  Child taker = Child::spawn([&] {
    detail::take_over_stale(region_dir(), name, true, false, [&] {
      f->v[1].store(1);
      if (!f->wait(2, 1)) std::_Exit(3);
    });
    Producer p = Producer::create(name, opts());
    p.wait_for_consumers(1, 60s);
    PatternSync s(2, 1000, 1);
    p.send(s.specs, s.ptrs);
    p.wait_drained(60s);
    return 0;
  });
  ASSERT_TRUE(f->wait(1, 1)) << "the takeover never paused";
  try {
    Consumer c = Consumer::open(name, copts(300ms));
    ADD_FAILURE() << "joined the old file while a takeover held it";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kPeerDied) << e.what();
  }
  f->v[2].store(1);
  Consumer c = Consumer::open(name, copts());
  std::uint64_t v = 0;
  EXPECT_EQ(receive_checked(c, &v), 0);
  EXPECT_EQ(v, 1u);
  EXPECT_EQ(taker.wait(), 0);
}

TEST(Liveness, OpeningARegionWhoseProducerIsDeadTimesOutWithPeerDied) {
  const std::string name = unique_name("stale");
  RegionGuard g{name};
  SharedFlags* f = SharedFlags::make();
  Child dead = Child::spawn([&] {
    Producer p = Producer::create(name, opts());
    f->v[0].store(1);  // create() returned: the region is initialised
    ::pause();
    return 0;
  });
  ConsumerOptions co = copts(20000ms);
  // Wait until the producer has created the region (a file that exists may
  // still be half made), then kill it without letting it unlink.
  ASSERT_TRUE(f->wait(0, 1));
  dead.kill9();
  dead.wait();
  co.open_timeout = 200ms;
  try {
    Consumer::open(name, co);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kPeerDied) << e.what();
  }
}

TEST(Liveness, ClosedProducerGivesClosed) {
  const std::string name = unique_name("closed");
  RegionGuard g{name};
  Producer p = Producer::create(name, opts());
  Consumer c = Consumer::open(name, copts());
  p.close();
  try {
    c.wait_sync(5s);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kClosed);
  }
}

TEST(Corruption, BadMagicIsCorrupt) {
  const std::string name = unique_name("magic");
  RegionGuard g{name};
  Producer p = Producer::create(name, opts());
  const std::uint64_t junk = 0x4141414141414141ull;
  corrupt_file(region_path(name), 0, &junk, sizeof junk);
  try {
    Consumer::open(name, copts(200ms));
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kCorrupt) << e.what();
  }
}

TEST(Corruption, NewerLayoutVersionIsVersionMismatch) {
  const std::string name = unique_name("ver");
  RegionGuard g{name};
  Producer p = Producer::create(name, opts());
  const std::uint32_t v = shmcast::detail::kLayoutVersion + 1;
  corrupt_file(region_path(name), 8, &v, sizeof v);
  try {
    Consumer::open(name, copts(200ms));
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kVersionMismatch) << e.what();
  }
}

TEST(Corruption, GeometryFieldsAreCheckedBeforeUse) {
  const std::string name = unique_name("geo");
  RegionGuard g{name};
  Producer p = Producer::create(name, opts());
  const std::uint64_t evil = 1ull << 50;
  corrupt_file(region_path(name), offsetof(shmcast::detail::HeaderFixed, data_offset), &evil, sizeof evil);
  try {
    Consumer::open(name, copts(200ms));
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kCorrupt) << e.what();
  }
}

TEST(Corruption, ManifestBytesAreRejected) {
  const std::string name = unique_name("mf");
  RegionGuard g{name};
  Producer p = Producer::create(name, opts());
  Consumer c = Consumer::open(name, copts());
  PatternSync s(3, 100, 1);
  p.begin_sync(s.specs);
  // Flip a byte inside the manifest after it was announced.
  shmcast::detail::Geometry geo{};
  shmcast::detail::compute_geometry(4, 2, kSlot, ProducerOptions{}.manifest_bytes, &geo);
  const std::uint8_t x = 0x5a;
  corrupt_file(region_path(name), geo.manifest_offset + 70, &x, 1);
  try {
    c.wait_sync(5s);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kCorrupt) << e.what();
  }
  // The consumer's error is visible to the producer side, in its seat.
  shmcast::detail::Seat seat;
  int fd = ::open(region_path(name).c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::pread(fd, static_cast<void*>(&seat), sizeof seat, static_cast<off_t>(geo.seats_offset + c.seat() * sizeof seat)),
            static_cast<ssize_t>(sizeof seat));
  ::close(fd);
  EXPECT_EQ(seat.error_code.load(), static_cast<std::uint32_t>(Errc::kCorrupt));
  EXPECT_NE(std::string(seat.error_text).find("hash"), std::string::npos) << seat.error_text;
}

// A manifest altered into another valid one (a tensor renamed) decodes
// cleanly: only the sync record's hash tells, and the consumer refuses it.
// The name is found through the manifest's own header (names_offset), not a
// fixed offset, and the altered bytes are decoded here first: the test fails
// if the change ever stops being a valid manifest, which the decoder would
// refuse without the hash.
TEST(Corruption, ManifestAlteredIntoAnotherValidOneIsRejectedByItsHash) {
  namespace d = shmcast::detail;
  const std::string name = unique_name("mfh");
  RegionGuard g{name};
  Producer p = Producer::create(name, opts());
  Consumer c = Consumer::open(name, copts());
  PatternSync s(3, 100, 1);  // tensors "t0", "t1", "t2"
  const std::uint64_t version = p.begin_sync(s.specs);
  d::Geometry geo{};
  d::compute_geometry(4, 2, kSlot, ProducerOptions{}.manifest_bytes, &geo);
  int fd = ::open(region_path(name).c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  d::ManifestHeader mh{};
  ASSERT_EQ(::pread(fd, &mh, sizeof mh, static_cast<off_t>(geo.manifest_offset)), static_cast<ssize_t>(sizeof mh));
  ASSERT_EQ(mh.tensor_count, 3u);
  d::ManifestEntry e0{};
  ASSERT_EQ(::pread(fd, &e0, sizeof e0, static_cast<off_t>(geo.manifest_offset + sizeof mh)),
            static_cast<ssize_t>(sizeof e0));
  std::vector<std::byte> bytes(mh.names_offset + mh.names_bytes);
  ASSERT_EQ(::pread(fd, bytes.data(), bytes.size(), static_cast<off_t>(geo.manifest_offset)),
            static_cast<ssize_t>(bytes.size()));
  ::close(fd);
  const std::uint64_t at = mh.names_offset + e0.name_offset + 1;  // "t0" becomes "t9": still a valid, unique name
  ASSERT_EQ(e0.name_bytes, 2u);
  ASSERT_EQ(static_cast<char>(bytes[at]), '0');
  bytes[at] = static_cast<std::byte>('9');
  SyncInfo altered;
  ASSERT_EQ(d::decode_manifest(bytes, version, mh.stream_bytes, kSlot, &altered), "");
  ASSERT_EQ(altered.tensors.at(0).name, "t9");
  const char renamed = '9';
  corrupt_file(region_path(name), geo.manifest_offset + at, &renamed, 1);
  try {
    const SyncInfo& info = c.wait_sync(5s);
    FAIL() << "accepted a manifest that does not match its hash (first tensor '" << info.tensors.at(0).name << "')";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kCorrupt) << e.what();
    EXPECT_NE(std::string(e.what()).find("hash"), std::string::npos) << e.what();
  }
}

TEST(Liveness, ProducerAbortIsVisibleToConsumersWithItsReason) {
  const std::string name = unique_name("abort");
  RegionGuard g{name};
  Producer p = Producer::create(name, opts());
  Consumer c = Consumer::open(name, copts());
  PatternSync s(3, kSlot / 2, 1);  // fits the two slots: write() never waits here
  p.begin_sync(s.specs);
  p.write(0, s.ptrs[0]);
  c.wait_sync(5s);  // the consumer is in the sync when the producer gives up
  p.write(1, s.ptrs[1]);
  p.abort_sync("trainer step failed: CUDA OOM");
  std::vector<std::uint8_t> a(kSlot / 2), b(kSlot / 2), d(kSlot / 2);
  std::vector<void*> dst{a.data(), b.data(), d.data()};
  try {
    c.read_into(dst);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kAborted) << e.what();
    EXPECT_NE(std::string(e.what()).find("CUDA OOM"), std::string::npos) << e.what();
  }
  // The next sync goes through: the aborted range was released.
  PatternSync s2(2, 5000, 2);
  p.send(s2.specs, s2.ptrs);
  EXPECT_EQ(receive_checked(c), 0);
}

TEST(Corruption, OversizedManifestLengthInRecordIsRejected) {
  const std::string name = unique_name("mflen");
  RegionGuard g{name};
  Producer p = Producer::create(name, opts());
  Consumer c = Consumer::open(name, copts());
  PatternSync s(3, 100, 1);
  p.begin_sync(s.specs);
  const std::uint64_t huge = 1ull << 40;
  corrupt_file(region_path(name), offsetof(shmcast::detail::Header, sync) + 40, &huge, sizeof huge);
  try {
    c.wait_sync(5s);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kCorrupt) << e.what();
  }
}

TEST(Corruption, SlotDescriptorThatDisagreesIsRejected) {
  const std::string name = unique_name("slot");
  RegionGuard g{name};
  Producer p = Producer::create(name, opts());
  Consumer c = Consumer::open(name, copts());
  PatternSync s(1, 1000, 1);
  p.send(s.specs, s.ptrs);
  c.wait_sync(5s);
  shmcast::detail::Geometry geo{};
  shmcast::detail::compute_geometry(4, 2, kSlot, ProducerOptions{}.manifest_bytes, &geo);
  const std::uint64_t bad_bytes = 1ull << 40;
  corrupt_file(region_path(name), geo.slots_offset + 16, &bad_bytes, sizeof bad_bytes);
  std::vector<std::uint8_t> out(1000);
  std::vector<void*> dst{out.data()};
  try {
    c.read_into(dst);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kCorrupt) << e.what();
  }
}

TEST(Api, MisuseIsInvalidArgument) {
  const std::string name = unique_name("misuse");
  RegionGuard g{name};
  Producer p = Producer::create(name, opts());
  PatternSync s(2, 100, 1);
  auto expect_invalid = [](auto&& fn) {
    try {
      fn();
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::kInvalidArgument) << e.what();
    }
  };
  expect_invalid([&] { p.write(0, s.ptrs[0]); });  // outside a sync
  expect_invalid([&] { p.end_sync(); });
  p.begin_sync(s.specs);
  expect_invalid([&] { p.write(1, s.ptrs[1]); });  // out of order: aborts the sync
  EXPECT_EQ(p.begin_sync(s.specs), 2u);             // so a fresh one can begin
  expect_invalid([&] { p.end_sync(); });            // tensors missing
  expect_invalid([&] { p.begin_sync(s.specs); });   // nested
  p.write(0, s.ptrs[0]);
  p.write(1, s.ptrs[1]);
  p.end_sync();
  std::vector<TensorSpec> dup = {s.specs[0], s.specs[0]};
  expect_invalid([&] { p.begin_sync(dup); });
}
