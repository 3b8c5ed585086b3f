// Delta syncs (ProducerOptions::delta, docs/protocol.md §9 and §12): the
// producer sends the elements that changed since the last version, and
// consumers apply them in place, bit-exact; full syncs whenever a consumer
// cannot apply a delta (late joiner, skipped version, other destinations, a
// damaged delta or destination), on a schedule (keyframe_every), or when
// deltas would not pay. Real consumer processes, several dtypes, random
// change fractions.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <random>
#include <thread>

#include "protocol/rounds.hpp"  // detail::test_point: a throw out of the sync, in end_sync()
#include "shmcast/shmcast.hpp"
#include "delta_sync_support.hpp"
#include "support.hpp"
#include "delta_host_support.hpp"

using namespace shmcast;
using namespace shmcast_test;
using namespace delta_sync_test;
using namespace delta_host;
using namespace std::chrono_literals;

namespace {

std::uint64_t send(Producer& p, const Model& m) { return p.send(m.specs, m.ptrs()); }

// A delta producer and one consumer in this process, in a private region
// directory; version 1 of a small model sent (a full sync) and read into `d`.
struct Pair {
  RegionDir dir{"delta"};
  std::string name;
  RegionGuard guard;
  Producer p;
  Consumer c;
  Model m{false};
  Dsts d{m};
  explicit Pair(const std::string& tag)
      : name(unique_name(tag)), guard{name}, p(Producer::create(name, delta_opts())), c(Consumer::open(name, copts())) {
    send(p, m);
    c.wait_sync(10s);
    c.read_into(d.ptrs);
  }
};

}  // namespace

// Two consumer processes, 50 versions, random change fractions, seven
// dtypes (a c128 tensor goes as its bytes, an empty one as an empty blob):
// every version arrives bit-exact, the first as a full sync and every later
// one as a delta smaller than the tensors.
TEST(DeltaSync, TwoConsumersFiftyVersionsBitExact) {
  RegionDir dir("delta");
  const std::string name = unique_name("delta50");
  RegionGuard guard{name};
  constexpr std::uint64_t kVersions = 50;
  auto consumer = [&] {
    Consumer c = Consumer::open(name, copts());
    Model want(true);
    Dsts got(want);
    for (std::uint64_t v = 1; v <= kVersions; ++v) {
      const SyncInfo& s = c.wait_sync(60s * kSlowdown);
      if (s.version != v) return 10;
      if (v > 1) want.step(v);
      c.read_into(got.ptrs);
      if (!got.equals(want)) return 11;
      const SyncReport r = c.last_sync();
      if (r.version != v || r.delta != (v > 1)) return 12;
      if (r.logical_bytes != want.bytes()) return 13;
      if (v > 1 && r.payload_bytes >= r.logical_bytes) return 14;
    }
    return 0;
  };
  Producer p = Producer::create(name, delta_opts());
  Child a = Child::spawn(consumer), b = Child::spawn(consumer);
  p.wait_for_consumers(2, 30s);
  Model m(true);
  std::uint64_t delta_payload = 0, delta_logical = 0;
  for (std::uint64_t v = 1; v <= kVersions; ++v) {
    if (v > 1) m.step(v);
    ASSERT_EQ(send(p, m), v);
    const SyncReport r = p.last_sync();
    EXPECT_EQ(r.version, v);
    EXPECT_EQ(r.delta, v > 1) << "version " << v;
    EXPECT_EQ(r.logical_bytes, m.bytes());
    if (v > 1) {
      delta_payload += r.payload_bytes;
      delta_logical += r.logical_bytes;
    }
  }
  EXPECT_EQ(a.wait(120s), 0);
  EXPECT_EQ(b.wait(120s), 0);
  EXPECT_EQ(p.delta_base_bytes(), m.bytes());
  // Changes of 0.5-30 %: the deltas take well under half of the bytes.
  EXPECT_LT(delta_payload, delta_logical / 2);
}

// A consumer that attaches after the first syncs asks for a full sync: the
// producer's next sync is full, and the ones after it are deltas again.
TEST(DeltaSync, LateJoinerGetsAFullSyncFirst) {
  RegionDir dir("delta");
  const std::string name = unique_name("deltalate");
  RegionGuard guard{name};
  Producer p = Producer::create(name, delta_opts());
  Consumer a = Consumer::open(name, copts());
  Model m(false);
  Dsts da(m);
  for (std::uint64_t v = 1; v <= 3; ++v) {
    if (v > 1) m.step(v);
    send(p, m);
    a.wait_sync(10s);
    a.read_into(da.ptrs);
    ASSERT_TRUE(da.equals(m));
  }
  EXPECT_TRUE(p.last_sync().delta);
  Consumer b = Consumer::open(name, copts());
  Dsts db(m);
  m.step(4);
  send(p, m);
  EXPECT_FALSE(p.last_sync().delta) << "the late joiner's request makes version 4 full";
  for (Consumer* c : {&a, &b}) {
    EXPECT_EQ(c->wait_sync(10s).version, 4u);
    EXPECT_FALSE(c->sync().delta());
  }
  a.read_into(da.ptrs);
  b.read_into(db.ptrs);
  EXPECT_TRUE(da.equals(m));
  EXPECT_TRUE(db.equals(m));
  m.step(5);
  send(p, m);
  EXPECT_TRUE(p.last_sync().delta);
  a.wait_sync(10s);
  a.read_into(da.ptrs);
  b.wait_sync(10s);
  b.read_into(db.ptrs);
  EXPECT_TRUE(da.equals(m));
  EXPECT_TRUE(db.equals(m));
  EXPECT_TRUE(b.last_sync().delta);
}

// A consumer that skipped a version never applies the next delta (its base
// is gone): wait_sync() lets it go and asks for a full sync, which comes next.
TEST(DeltaSync, SkippedVersionIsNotApplied) {
  Pair t("deltaskip");
  Producer& p = t.p;
  Consumer& c = t.c;
  Model& m = t.m;
  Dsts& d = t.d;
  m.step(2);
  send(p, m);
  c.wait_sync(10s);
  c.skip();  // version 2 not read
  m.step(3);
  send(p, m);
  EXPECT_TRUE(p.last_sync().delta);
  EXPECT_EQ(code_of([&] { c.wait_sync(300ms); }), Errc::kTimeout) << "the delta on version 2 is not for this consumer";
  m.step(4);
  send(p, m);
  EXPECT_FALSE(p.last_sync().delta) << "the skipping consumer asked for a full sync";
  EXPECT_EQ(c.wait_sync(10s).version, 4u);
  c.read_into(d.ptrs);
  EXPECT_TRUE(d.equals(m));
}

// read_into() of a delta with other destinations than the last read's:
// NeedsFullSync, nothing written, and the next sync is full.
TEST(DeltaSync, OtherDestinationsNeedAFullSync) {
  RegionDir dir("delta");
  const std::string name = unique_name("deltadst");
  RegionGuard guard{name};
  Producer p = Producer::create(name, delta_opts());
  Consumer c = Consumer::open(name, copts());
  Model m(false);
  Dsts first(m), other(m);
  send(p, m);
  c.wait_sync(10s);
  c.read_into(first.ptrs);
  m.step(2);
  send(p, m);
  c.wait_sync(10s);
  const auto before = other.buf;
  EXPECT_EQ(code_of([&] { c.read_into(other.ptrs); }), Errc::kNeedsFullSync);
  EXPECT_EQ(other.buf, before) << "nothing is written into destinations that do not hold the base";
  // Selections are part of the destinations too.
  m.step(3);
  send(p, m);
  EXPECT_FALSE(p.last_sync().delta);
  c.wait_sync(10s);
  c.read_into(other.ptrs);
  EXPECT_TRUE(other.equals(m));
  m.step(4);
  send(p, m);
  EXPECT_TRUE(p.last_sync().delta);
  c.wait_sync(10s);
  std::vector<Selection> sels(m.specs.size());
  sels[0] = Selection{0, 0, 16};
  EXPECT_EQ(code_of([&] { c.read_into(other.ptrs, sels); }), Errc::kNeedsFullSync);
  m.step(5);
  send(p, m);
  c.wait_sync(10s);
  c.read_into(other.ptrs);
  EXPECT_TRUE(other.equals(m));
}

// A destination changed behind the consumer's back (not the delta's base)
// gives a result whose checksum is not the producer's: Corrupt, a full sync
// is requested, and the next read is bit-exact again.
TEST(DeltaSync, ChecksumCatchesAWrongBaseThenAFullSyncRepairs) {
  Pair t("deltasum");
  Producer& p = t.p;
  Consumer& c = t.c;
  Model& m = t.m;
  Dsts& d = t.d;
  d.buf[0][100] ^= 0x40;  // someone wrote into the weights
  m.step(2);
  send(p, m);
  c.wait_sync(10s);
  EXPECT_EQ(code_of([&] { c.read_into(d.ptrs); }), Errc::kCorrupt);
  m.step(3);
  send(p, m);
  EXPECT_FALSE(p.last_sync().delta) << "the consumer asked for a full sync";
  EXPECT_EQ(c.wait_sync(10s).version, 3u);
  c.read_into(d.ptrs);
  EXPECT_TRUE(d.equals(m));
  m.step(4);
  send(p, m);
  c.wait_sync(10s);
  c.read_into(d.ptrs);
  EXPECT_TRUE(d.equals(m));
  EXPECT_TRUE(c.last_sync().delta);
}

// A delta damaged in the region (another process wrote into a slot) is
// rejected (Corrupt: a bad table, index or padding, or a checksum
// mismatch); the next sync is full and exact.
TEST(DeltaSync, DamagedDeltaIsCaughtThenAFullSyncRepairs) {
  Pair t("deltadmg");
  Producer& p = t.p;
  Consumer& c = t.c;
  Model& m = t.m;
  Dsts& d = t.d;
  m.step(2);
  send(p, m);
  const SyncInfo& s = c.wait_sync(10s);
  ASSERT_TRUE(s.delta());
  const ShardInfo& sh = s.tensors[0].shards[0];
  ASSERT_EQ(sh.base_version, 1u);
  ASSERT_LT(sh.wire_bytes, sh.nbytes);
  // The blob's first payload word, in the slot that holds it.
  const int fd = ::open(t.dir.file(t.name).c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  const std::uint64_t bytes = static_cast<std::uint64_t>(::lseek(fd, 0, SEEK_END));
  auto* map = static_cast<std::uint8_t*>(::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  ::close(fd);
  ASSERT_NE(map, MAP_FAILED);
  std::uint64_t data_offset, slot_bytes;
  std::uint32_t slot_count;
  std::memcpy(&slot_count, map + 36, 4);
  std::memcpy(&slot_bytes, map + 40, 8);
  std::memcpy(&data_offset, map + 80, 8);
  const std::uint64_t at = sh.stream_offset + 64 + 16 * ((sh.nbytes / 2 + 4095) / 4096);  // header + table
  const std::uint64_t seq = s.first_seq + at / slot_bytes;
  map[data_offset + ((seq - 1) % slot_count) * slot_bytes + at % slot_bytes] ^= 0x01;
  ::munmap(map, bytes);
  EXPECT_EQ(code_of([&] { c.read_into(d.ptrs); }), Errc::kCorrupt);
  m.step(3);
  send(p, m);
  EXPECT_FALSE(p.last_sync().delta);
  c.wait_sync(10s);
  c.read_into(d.ptrs);
  EXPECT_TRUE(d.equals(m));
}

// keyframe_every = 3: versions 1, 4, 7 are full. A sync whose every element
// changed goes out full on its own (deltas would not pay), and the next is a
// delta again.
TEST(DeltaSync, KeyframesOnScheduleAndWhenDeltasDoNotPay) {
  RegionDir dir("delta");
  const std::string name = unique_name("deltakey");
  RegionGuard guard{name};
  ProducerOptions o = delta_opts();
  o.keyframe_every = 3;
  Producer p = Producer::create(name, o);
  Consumer c = Consumer::open(name, copts());
  Model m(false);
  Dsts d(m);
  for (std::uint64_t v = 1; v <= 7; ++v) {
    if (v > 1) m.step(v, 0.05);
    send(p, m);
    EXPECT_EQ(p.last_sync().delta, v % 3 != 1) << "version " << v;
    c.wait_sync(10s);
    c.read_into(d.ptrs);
    ASSERT_TRUE(d.equals(m)) << "version " << v;
  }
  o.keyframe_every = 0;
  p.close();
  c.close();
  Producer q = Producer::create(name, o);
  Consumer c2 = Consumer::open(name, copts());
  send(q, m);
  c2.wait_sync(10s);
  c2.read_into(d.ptrs);
  m.step_all(2);
  send(q, m);
  EXPECT_FALSE(q.last_sync().delta) << "every element changed: a full sync";
  EXPECT_EQ(q.last_sync().payload_bytes, m.bytes());
  c2.wait_sync(10s);
  EXPECT_FALSE(c2.sync().delta());
  c2.read_into(d.ptrs);
  EXPECT_TRUE(d.equals(m));
  m.step(3, 0.01);
  send(q, m);
  EXPECT_TRUE(q.last_sync().delta);
  EXPECT_LT(q.last_sync().payload_bytes, m.bytes() / 5);
  c2.wait_sync(10s);
  c2.read_into(d.ptrs);
  EXPECT_TRUE(d.equals(m));
  // The consumer read every piece but the empty tensor's (a null
  // destination: skipped): the blobs and the c128 tensor, which a delta sync
  // sends as its bytes.
  std::uint64_t skipped = 0;
  for (std::size_t t = 0; t < d.ptrs.size(); ++t)
    if (d.ptrs[t] == nullptr)
      for (const ShardInfo& sh : c2.sync().tensors[t].shards) skipped += sh.wire_bytes;
  EXPECT_TRUE(c2.last_sync().delta);
  EXPECT_EQ(c2.last_sync().payload_bytes + skipped, q.last_sync().payload_bytes);
}

// The producer's report and keyframe schedule follow the manifest: a
// tensor set whose tensors all go as their bytes (c128 only) has no blob
// to send, so its syncs are full (the manifest names no base; consumers
// read them as full). With delta_max_ratio 1.0 such a sync never falls back
// either: the producer reported each one after the first as a delta and
// counted it for keyframe_every. Here a mixed set (deltas, a keyframe every
// third) and a c128-only set alternate, and on every sync the producer's
// last_sync, the consumer's and the manifest agree.
TEST(DeltaSync, ProducerAndConsumerReportsAgreeOnEverySync) {
  RegionDir dir("delta");
  const std::string name = unique_name("deltaagree");
  RegionGuard guard{name};
  ProducerOptions o = delta_opts();
  o.delta_max_ratio = 1.0;
  o.keyframe_every = 3;
  Producer p = Producer::create(name, o);
  Consumer c = Consumer::open(name, copts());
  Model m(false);
  Dsts d(m);
  const std::vector<TensorSpec> rot = {{"rot.a", DType::kC128, {10}}, {"rot.b", DType::kC128, {4, 33}}};
  std::vector<std::vector<std::uint8_t>> rd, rgot;
  std::vector<const void*> rsrc;
  std::vector<void*> rdst;
  for (const TensorSpec& t : rot) {
    rd.emplace_back(t.nbytes());
    rgot.emplace_back(t.nbytes());
    fill_pattern(rd.back().data(), rd.back().size(), 0xc128 + rd.size());
  }
  for (std::size_t i = 0; i < rot.size(); ++i) {
    rsrc.push_back(rd[i].data());
    rdst.push_back(rgot[i].data());
  }
  auto agree = [&](const char* set, std::uint64_t u) {
    const SyncReport pr = p.last_sync(), cr = c.last_sync();
    EXPECT_EQ(pr.version, cr.version) << set << " update " << u;
    EXPECT_EQ(pr.delta, c.sync().delta()) << set << " update " << u << ": the producer's report vs the manifest";
    EXPECT_EQ(cr.delta, c.sync().delta()) << set << " update " << u;
    EXPECT_EQ(pr.logical_bytes, cr.logical_bytes) << set << " update " << u;
    return pr.delta;
  };
  for (std::uint64_t u = 1; u <= 8; ++u) {
    if (u > 1) m.step(u, 0.05);
    send(p, m);
    c.wait_sync(10s);
    c.read_into(d.ptrs);
    ASSERT_TRUE(d.equals(m)) << "update " << u;
    EXPECT_EQ(agree("mixed", u), u % 3 != 1) << "update " << u << ": a keyframe every third sync of the set";
    for (auto& t : rd)
      for (std::size_t b = 0; b < t.size(); b += 7) t[b] = static_cast<std::uint8_t>(t[b] + u);
    p.send(rot, rsrc);
    c.wait_sync(10s);
    c.read_into(rdst);
    ASSERT_EQ(rgot, rd) << "update " << u;
    EXPECT_FALSE(agree("c128", u)) << "update " << u << ": no blob, so a full sync";
  }
}

// A throw while end_sync() is out of the sync (the blobs packed, before the
// ring: where a device buffer that cannot be allocated throws) forgets the
// base as abort() does: the bases already hold the unsent version, so the
// next sync is full, never a delta against a base the consumers do not
// hold. Read with verify_checksums off, where such a delta would pass.
TEST(DeltaSync, AThrowOutOfTheSyncInEndSyncMakesTheNextSyncFull) {
  RegionDir dir{"delta"};
  const std::string name = unique_name("deltagap");
  RegionGuard guard{name};
  Producer p = Producer::create(name, delta_opts());
  ConsumerOptions co = copts();
  co.verify_checksums = false;
  Consumer c = Consumer::open(name, co);
  Model m{false};
  Dsts d{m};
  for (std::uint64_t v = 1; v <= 2; ++v) {
    if (v > 1) m.step(v);
    send(p, m);
    c.wait_sync(10s);
    c.read_into(d.ptrs);
    ASSERT_TRUE(d.equals(m)) << "version " << v;
  }
  ASSERT_TRUE(p.last_sync().delta);
  m.step(3);
  detail::test_point = [](const detail::TestPointArgs& a) {
    if (a.at == detail::TestPoint::kDeltaOutOfSync) throw Error(Errc::kCuda, "test: no device buffer for the blobs");
  };
  EXPECT_EQ(code_of([&] { send(p, m); }), Errc::kCuda);
  detail::test_point = nullptr;
  m.step(4);
  send(p, m);
  EXPECT_FALSE(p.last_sync().delta) << "a delta against a base the consumers do not hold";
  EXPECT_EQ(c.wait_sync(10s).version, p.last_sync().version);
  c.read_into(d.ptrs);
  EXPECT_TRUE(d.equals(m));
}

// An aborted sync leaves the producer's base ahead of the consumers: the
// next sync is full. Changed tensors (another shape) are full too.
TEST(DeltaSync, AbortedSyncAndNewTensorsGoFull) {
  Pair t("deltaabort");
  Producer& p = t.p;
  Consumer& c = t.c;
  Model& m = t.m;
  Dsts& d = t.d;
  m.step(2);
  p.begin_sync(m.specs);
  p.write(0, m.data[0].data());
  p.abort_sync("the trainer changed its mind");
  m.step(3);
  send(p, m);
  EXPECT_FALSE(p.last_sync().delta);
  c.wait_sync(10s);
  c.read_into(d.ptrs);
  EXPECT_TRUE(d.equals(m));
  // Written in parts and with strides, a tensor still goes as a delta.
  m.step(4);
  p.begin_sync(m.specs);
  const std::uint64_t half = m.data[0].size() / 2;
  p.write_part(0, 0, m.data[0].data(), half);
  p.write_part(0, half, m.data[0].data() + half, m.data[0].size() - half);
  const TensorSpec& t1 = m.specs[1];
  p.write_strided(1, m.data[1].data(), Strided2D{static_cast<std::uint64_t>(t1.shape[0]),
                                                 static_cast<std::uint64_t>(t1.shape[1]) * 4,
                                                 static_cast<std::uint64_t>(t1.shape[1]) * 4});
  for (std::size_t i = 2; i < m.specs.size(); ++i) p.write(i, m.data[i].data());
  p.end_sync();
  EXPECT_TRUE(p.last_sync().delta);
  c.wait_sync(10s);
  c.read_into(d.ptrs);
  EXPECT_TRUE(d.equals(m));
  // Another tensor list: full.
  Model n(false);
  n.specs.pop_back();
  n.data.pop_back();
  send(p, n);
  EXPECT_FALSE(p.last_sync().delta);
}

// The producer dies while a delta sync larger than the ring streams: the
// consumer gets PeerDied, not a half-applied success.
TEST(DeltaSync, ProducerKilledMidDeltaGivesPeerDied) {
  RegionDir dir("delta");
  const std::string name = unique_name("deltakill");
  RegionGuard guard{name};
  Child prod = Child::spawn([&] {
    Producer p = Producer::create(name, delta_opts());
    p.wait_for_consumers(1, 20s);
    Model m(true, 4096);
    send(p, m);
    m.step(2, 0.30, 0.25);  // a quarter changed: a delta of several slots
    send(p, m);  // blocks: the consumer does not read it
    return 0;
  });
  Consumer c = Consumer::open(name, copts());
  Model m(true, 4096);
  Dsts d(m);
  c.wait_sync(20s * kSlowdown);
  c.read_into(d.ptrs);
  ASSERT_TRUE(d.equals(m));
  const SyncInfo& s = c.wait_sync(20s * kSlowdown);
  ASSERT_TRUE(s.delta());
  ASSERT_GT(s.wire_bytes, 2 * (2ull << 20)) << "the delta must not fit in the ring";
  prod.kill9();
  prod.wait();
  EXPECT_EQ(code_of([&] { c.read_into(d.ptrs); }), Errc::kPeerDied);
}

// request_full_sync(): the consumer's destinations changed behind its back
// (weights discarded and reloaded): the next sync is full, and no delta is
// applied to them meanwhile.
TEST(DeltaSync, RequestFullSyncMakesTheNextSyncFull) {
  Pair t("deltareq");
  Producer& p = t.p;
  Consumer& c = t.c;
  Model& m = t.m;
  Dsts& d = t.d;
  EXPECT_TRUE(c.delta());
  m.step(2);
  send(p, m);
  EXPECT_TRUE(p.last_sync().delta);
  c.wait_sync(10s);
  c.read_into(d.ptrs);
  std::fill(d.buf[0].begin(), d.buf[0].end(), 0);  // the weights were discarded
  c.request_full_sync();
  m.step(3);
  send(p, m);
  EXPECT_FALSE(p.last_sync().delta);
  EXPECT_EQ(c.wait_sync(10s).version, 3u);
  c.read_into(d.ptrs);
  EXPECT_TRUE(d.equals(m));
  // A region without deltas: nothing to ask for.
  const std::string plain = unique_name("plain");
  RegionGuard g2{plain};
  ProducerOptions o = delta_opts();
  o.delta = false;
  Producer q = Producer::create(plain, o);
  Consumer c2 = Consumer::open(plain, copts());
  EXPECT_FALSE(c2.delta());
  c2.request_full_sync();
}

// A region that claims delta syncs in a store region (which no producer
// makes: the bit was set by someone else) is not opened.
TEST(DeltaSync, CraftedStoreRegionWithDeltasIsNotOpened) {
  RegionDir dir("delta");
  const std::string name = unique_name("dcraft");
  RegionGuard guard{name};
  ProducerOptions o = delta_opts();
  o.delta = false;
  o.mode = RegionMode::kStore;
  o.store_bytes = 4ull << 20;
  Producer p = Producer::create(name, o);
  const int fd = ::open(dir.file(name).c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  std::uint64_t features = 0;
  ASSERT_EQ(::pread(fd, &features, 8, 24), 8);
  features |= 1ull << 2;
  ASSERT_EQ(::pwrite(fd, &features, 8, 24), 8);
  ::close(fd);
  ConsumerOptions co = copts();
  co.open_timeout = 2s;
  EXPECT_EQ(code_of([&] { Consumer::open(name, co); }), Errc::kCorrupt);
}

// Delta syncs need a ring region, and sharded ranks that all send them.
TEST(DeltaSync, RefusedWhereNotSupported) {
  RegionDir dir("delta");
  ProducerOptions o = delta_opts();
  o.mode = RegionMode::kStore;
  o.store_bytes = 4ull << 20;
  EXPECT_EQ(code_of([&] { Producer::create(unique_name("dstore"), o); }), Errc::kInvalidArgument);
  {
    // Sharded: every rank alike (a rank without delta does not join rank 0's delta region).
    o = delta_opts();
    o.world_size = 2;
    o.slots = 4;
    o.rank_timeout = 2s;
    const std::string ranks = unique_name("dranks");
    RegionGuard g{ranks};
    Producer r0 = Producer::create(ranks, o);
    o.rank = 1;
    o.delta = false;
    EXPECT_EQ(code_of([&] { Producer::create(ranks, o); }), Errc::kInvalidArgument);
  }
  o = delta_opts();
  o.delta_max_ratio = 0;
  EXPECT_EQ(code_of([&] { Producer::create(unique_name("dratio"), o); }), Errc::kInvalidArgument);
  // lend_chunk() hands out raw chunks: not for a delta producer.
  const std::string name = unique_name("dlend");
  RegionGuard guard{name};
  Producer p = Producer::create(name, delta_opts());
  Model m(false);
  p.begin_sync(m.specs);
  EXPECT_EQ(code_of([&] { p.lend_chunk(0); }), Errc::kInvalidArgument);
}

namespace {

// An update sent as buckets (one sync each, as verl's and the backends'
// bucket_bytes do): the tensors of each bucket, by index into the Model.
using Buckets = std::vector<std::vector<std::size_t>>;
const Buckets kThree = {{0, 1}, {2, 3, 4}, {5, 6}};
const Buckets kTwo = {{0, 1, 2}, {3, 4, 5, 6}};  // regrouped from update kRegroupAt on
constexpr std::uint64_t kUpdates = 12, kRegroupAt = 8;
const Buckets& buckets_of(std::uint64_t update) { return update < kRegroupAt ? kThree : kTwo; }
// The update and the bucket that sync version v carries.
std::pair<std::uint64_t, std::size_t> update_of(std::uint64_t v) {
  const std::uint64_t before = (kRegroupAt - 1) * kThree.size();
  if (v <= before) return {(v - 1) / kThree.size() + 1, (v - 1) % kThree.size()};
  return {kRegroupAt + (v - before - 1) / kTwo.size(), (v - before - 1) % kTwo.size()};
}

}  // namespace

// Buckets: every sync a different set of tensors. Each bucket's sync is a
// delta against that bucket's last version (not the sync before it), and
// consumers apply it to the destinations that version filled. A consumer
// that skips a bucket gets that bucket full again; regrouped tensors go
// full once, then as deltas; the base stays one copy of the tensors.
TEST(DeltaSync, BucketsAreDeltasAgainstTheirOwnLastVersion) {
  RegionDir dir("delta");
  const std::string name = unique_name("deltabuckets");
  RegionGuard guard{name};
  // skip_at: the version this consumer lets go (0: none).
  auto consumer = [&](std::uint64_t skip_at) {
    return [&, skip_at]() -> int {
      Consumer c = Consumer::open(name, copts());
      Model want(true);
      Dsts got(want);
      std::uint64_t at = 1, full_after_skip = 0;
      const std::uint64_t total = (kRegroupAt - 1) * kThree.size() + (kUpdates - kRegroupAt + 1) * kTwo.size();
      for (;;) {
        const SyncInfo& s = c.wait_sync(60s * kSlowdown);
        const std::uint64_t v = s.version;
        const auto [u, b] = update_of(v);
        while (at < u) want.step(++at);
        const std::vector<std::size_t>& idx = buckets_of(u)[b];
        if (s.tensors.size() != idx.size()) return 20;
        for (std::size_t k = 0; k < idx.size(); ++k)
          if (s.tensors[k].name != want.specs[idx[k]].name) return 21;
        if (v == skip_at) {
          c.skip();
          continue;
        }
        std::vector<void*> ptrs;
        for (std::size_t i : idx) ptrs.push_back(got.ptrs[i]);
        c.read_into(ptrs);
        for (std::size_t i : idx)
          if (got.buf[i] != want.data[i]) return 22;
        const SyncReport r = c.last_sync();
        if (r.version != v) return 23;
        // The skipped bucket's next read is full (the delta after the skip
        // was let go, and the producer answered the request).
        if (skip_at != 0 && v > skip_at && full_after_skip == 0 && update_of(skip_at).second == b) {
          if (r.delta) return 24;
          full_after_skip = v;
        }
        if (v == total) return skip_at != 0 && full_after_skip == 0 ? 25 : 0;
      }
    };
  };
  Producer p = Producer::create(name, delta_opts());
  Child a = Child::spawn(consumer(0));
  // Skips version 14: bucket 1 of update 5.
  Child b = Child::spawn(consumer(14));
  p.wait_for_consumers(2, 30s);
  Model m(true);
  int deltas = 0, syncs = 0;
  std::uint64_t v = 0;
  for (std::uint64_t u = 1; u <= kUpdates; ++u) {
    if (u > 1) m.step(u);
    for (const auto& idx : buckets_of(u)) {
      std::vector<TensorSpec> specs;
      std::vector<const void*> ptrs;
      for (std::size_t i : idx) {
        specs.push_back(m.specs[i]);
        ptrs.push_back(m.data[i].data());
      }
      ASSERT_EQ(p.send(specs, ptrs), ++v);
      const SyncReport r = p.last_sync();
      // The first update's buckets and the regrouped ones' first sync are full.
      if (u == 1 || u == kRegroupAt) {
        EXPECT_FALSE(r.delta) << "version " << v;
      }
      deltas += r.delta ? 1 : 0;
      ++syncs;
    }
    // One copy of the tensors: a base per bucket, the old buckets' dropped
    // when they were regrouped.
    EXPECT_EQ(p.delta_base_bytes(), m.bytes()) << "update " << u;
  }
  EXPECT_EQ(a.wait(120s), 0);
  EXPECT_EQ(b.wait(120s), 0);
  // All but the first update's, the regrouped update's, and about one
  // update's worth after the skipped bucket's full-sync request.
  EXPECT_GE(deltas, syncs - 3 - 2 - 4) << syncs;
}

// A relay's node region (Producer::begin_forwarded) that passes on an
// update sent as buckets: a consumer's request for a full sync is answered
// only once every bucket came full after it, not by the first bucket's
// full sync (the node would stop passing the request upstream while the
// other buckets' deltas still cannot apply).
TEST(DeltaSync, ForwardedBucketsAnswerARequestOnlyWhenEveryBucketCameFull) {
  RegionDir dir("delta");
  const std::string name = unique_name("deltafwd");
  RegionGuard guard{name};
  Producer p = Producer::create(name, delta_opts());
  Consumer c = Consumer::open(name, copts());
  Model m(false);
  const std::vector<TensorSpec> a = {m.specs[0]}, b = {m.specs[1]};
  Dsts d(m);
  auto forward_full = [&](const std::vector<TensorSpec>& s, std::size_t i, std::uint64_t v) {
    ASSERT_EQ(p.begin_forwarded(s, v, 0, {}, {}), v);
    p.write(0, m.data[i].data());
    p.end_sync();
    ASSERT_EQ(c.wait_sync(10s).version, v);
    std::vector<void*> dst{d.ptrs[i]};
    c.read_into(dst);
  };
  forward_full(a, 0, 1);
  forward_full(b, 1, 2);
  EXPECT_FALSE(p.full_sync_requested());
  c.request_full_sync();  // after version 2
  std::uint64_t after = 0;
  EXPECT_TRUE(p.full_sync_requested(&after));
  EXPECT_EQ(after, 2u);
  forward_full(a, 0, 3);
  EXPECT_TRUE(p.full_sync_requested()) << "bucket b has not come full since the request";
  forward_full(b, 1, 4);
  EXPECT_FALSE(p.full_sync_requested());
  EXPECT_TRUE(d.buf[0] == m.data[0] && d.buf[1] == m.data[1]);
}
