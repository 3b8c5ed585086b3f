// Multi-process transfers: real forked producer and consumer processes that
// share nothing but the region name.
#include <gtest/gtest.h>

#include "support.hpp"
#include "transfer_support.hpp"

using namespace shmcast;
using namespace shmcast_test;
using namespace std::chrono_literals;
using namespace transfer_test;

namespace {

// Consumer side: receive `syncs` syncs and check every byte.
int run_consumer(const std::string& name, int syncs, std::uint64_t seed, int count, bool use_visit) {
  ConsumerOptions co;
  co.pin = Pin::kNo;
  Consumer c = Consumer::open(name, co);
  for (int s = 0; s < syncs; ++s) {
    const SyncInfo& info = c.wait_sync(20s);
    auto specs = random_manifest(seed + s, kSlot, count);
    if (info.tensors.size() != specs.size()) return 10;
    std::vector<std::vector<std::uint8_t>> got(specs.size());
    std::vector<void*> dst;
    for (std::size_t i = 0; i < specs.size(); ++i) {
      if (info.tensors[i].name != specs[i].name || info.tensors[i].nbytes != specs[i].nbytes() ||
          info.tensors[i].shape != specs[i].shape || info.tensors[i].dtype != specs[i].dtype)
        return 11;
      got[i].assign(specs[i].nbytes(), 0xEE);
      dst.push_back(got[i].data());
    }
    if (use_visit) {
      c.visit([&](const Piece& p) {
        if (p.bytes > 0) std::memcpy(got[p.tensor].data() + p.offset, p.data, p.bytes);  // zero-size: data is null
      });
    } else {
      c.read_into(dst);
    }
    for (std::size_t i = 0; i < specs.size(); ++i) {
      std::vector<std::uint8_t> want(specs[i].nbytes());
      fill_pattern(want.data(), want.size(), seed_of(info.version, i));
      if (want != got[i]) {
        std::fprintf(stderr, "sync %llu tensor %zu (%s) differs\n", (unsigned long long)info.version, i,
                     specs[i].name.c_str());
        return 12;
      }
    }
  }
  return 0;
}

}  // namespace

TEST(Transfer, OneConsumerRandomManifestsBitExact) {
  const std::string name = unique_name("one");
  RegionGuard g{name};
  Child prod = Child::spawn([&] { return run_producer(name, 5, 1, 42, 40); });
  Child cons = Child::spawn([&] { return run_consumer(name, 5, 42, 40, false); });
  EXPECT_EQ(cons.wait(kBulkWait), 0);
  EXPECT_EQ(prod.wait(kBulkWait), 0);
}

TEST(Transfer, ThreeConsumersBitExact) {
  const std::string name = unique_name("three");
  RegionGuard g{name};
  Child prod = Child::spawn([&] { return run_producer(name, 4, 3, 7, 30); });
  Child c1 = Child::spawn([&] { return run_consumer(name, 4, 7, 30, false); });
  Child c2 = Child::spawn([&] { return run_consumer(name, 4, 7, 30, true); });
  Child c3 = Child::spawn([&] { return run_consumer(name, 4, 7, 30, false); });
  EXPECT_EQ(c1.wait(kBulkWait), 0);
  EXPECT_EQ(c2.wait(kBulkWait), 0);
  EXPECT_EQ(c3.wait(kBulkWait), 0);
  EXPECT_EQ(prod.wait(kBulkWait), 0);
}

namespace {

// lend_chunk(): the producer's caller fills the slots itself (a relay
// receiving from the network), several chunks lent at once and filled in
// reverse order, published in two steps per group.
int run_lending_producer(const std::string& name, int syncs, std::uint64_t seed, int count) {
  Producer p = Producer::create(name, small_opts(4));
  p.wait_for_consumers(2, 20s);
  const std::uint64_t S = p.slot_bytes();
  for (int s = 0; s < syncs; ++s) {
    auto specs = random_manifest(seed + s, kSlot, count);
    const std::uint64_t version = static_cast<std::uint64_t>(s) + 1;
    if (p.begin_sync(specs) != version) return 3;
    const SyncLayout& l = p.last_layout();
    std::vector<std::uint8_t> stream(l.stream_bytes, 0x5A);
    for (std::size_t i = 0; i < specs.size(); ++i)
      fill_pattern(stream.data() + l.offsets[i], specs[i].nbytes(), seed_of(version, i));
    const std::uint64_t n = l.chunks;
    for (std::uint64_t c0 = 0; c0 < n; c0 += 3) {
      const std::uint64_t c1 = std::min<std::uint64_t>(n, c0 + 3);
      std::vector<std::span<std::byte>> spans;
      for (std::uint64_t c = c0; c < c1; ++c) {
        spans.push_back(p.lend_chunk(c));
        if (spans.back().size() != std::min(S, l.stream_bytes - c * S)) return 4;
      }
      for (std::uint64_t c = c1; c-- > c0;) std::memcpy(spans[c - c0].data(), stream.data() + c * S, spans[c - c0].size());
      p.publish_chunks(c1 - 1);
      p.publish_chunks(c1);
    }
    p.end_sync();
  }
  p.wait_drained(20s);
  return 0;
}

// A producer with a consumer in this process whose reads time out fast.
struct QuickPair {
  Producer p;
  Consumer c;
  explicit QuickPair(const std::string& name)
      : p(Producer::create(name, small_opts(2))), c(Consumer::open(name, [] {
          ConsumerOptions co;
          co.pin = Pin::kNo;
          co.chunk_timeout = 300ms;
          return co;
        }())) {}
};

}  // namespace

TEST(Transfer, LentChunksFilledByTheCallerArriveBitExact) {
  const std::string name = unique_name("lend");
  RegionGuard g{name};
  Child prod = Child::spawn([&] { return run_lending_producer(name, 4, 99, 30); });
  Child c1 = Child::spawn([&] { return run_consumer(name, 4, 99, 30, false); });
  Child c2 = Child::spawn([&] { return run_consumer(name, 4, 99, 30, true); });
  EXPECT_EQ(c1.wait(kBulkWait), 0);
  EXPECT_EQ(c2.wait(kBulkWait), 0);
  EXPECT_EQ(prod.wait(kBulkWait), 0);
}

// What lend_chunk() refuses, and that a lent chunk stays invisible to
// consumers until it is published.
TEST(Transfer, LendChunkRefusalsAndUnpublishedChunksStayHidden) {
  const std::string name = unique_name("lend-refuse");
  RegionGuard g{name};
  QuickPair q(name);
  Producer& p = q.p;
  Consumer& c = q.c;
  EXPECT_EQ(code_of([&] { p.lend_chunk(0); }), Errc::kInvalidArgument);  // outside a sync
  PatternSync s(3, 3 * kSlot / 2, 1);                                     // 4.5 slots: 5 chunks
  ASSERT_EQ(p.begin_sync(s.specs), 1u);
  EXPECT_EQ(code_of([&] { p.publish_chunks(1); }), Errc::kInvalidArgument);  // nothing lent
  EXPECT_EQ(code_of([&] { p.lend_chunk(5); }), Errc::kInvalidArgument);      // the sync has 5
  EXPECT_EQ(code_of([&] { p.lend_chunk(2); }), Errc::kInvalidArgument);      // 2 slots: at most chunks 0 and 1
  std::span<std::byte> c0 = p.lend_chunk(0);
  ASSERT_EQ(c0.size(), kSlot);
  std::memcpy(c0.data(), s.ptrs[0], kSlot);
  EXPECT_EQ(code_of([&] { p.write(0, s.ptrs[0]); }), Errc::kInvalidArgument);
  EXPECT_EQ(code_of([&] { p.publish_chunks(2); }), Errc::kInvalidArgument);  // chunk 1 never lent
  ASSERT_EQ(c.wait_sync(5s).version, 1u);
  // Chunk 0 is filled but not published: the reader waits for it and times out.
  std::vector<std::vector<std::uint8_t>> got(3);
  std::vector<void*> dst;
  for (auto& v : got) {
    v.assign(3 * kSlot / 2, 0);
    dst.push_back(v.data());
  }
  EXPECT_EQ(code_of([&] { c.read_into(dst); }), Errc::kTimeout);
  p.abort_sync("test");
  // Lending after write() is refused too; a sync filled by write() still works.
  ASSERT_EQ(p.begin_sync(s.specs), 2u);
  p.write(0, s.ptrs[0]);
  EXPECT_EQ(code_of([&] { p.lend_chunk(0); }), Errc::kInvalidArgument);
  p.abort_sync("test");
}

// A chunk never released: visit_chunks() times out at chunk_timeout, and
// the release function called afterwards does nothing.
TEST(Transfer, VisitChunksTimesOutOnAChunkNeverReleased) {
  const std::string name = unique_name("defer-stuck");
  RegionGuard g{name};
  QuickPair q(name);
  Producer& p = q.p;
  Consumer& c = q.c;
  PatternSync s(1, kSlot / 2, 1);  // one chunk
  p.send(s.specs, s.ptrs);
  ASSERT_EQ(c.wait_sync(5s).version, 1u);
  std::function<void()> kept;
  int calls = 0;
  EXPECT_EQ(code_of([&] {
              c.visit_chunks([&](std::uint64_t, const std::byte*, std::uint64_t, std::function<void()> r) {
                ++calls;
                kept = std::move(r);
              });
            }),
            Errc::kTimeout);
  EXPECT_EQ(calls, 1);
  ASSERT_TRUE(kept);
  kept();  // late: nothing happens
}
