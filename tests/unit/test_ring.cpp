// The ring layer alone: ProducerRing/ChunkWriter and ConsumerRing/ChunkReader
// over a region file, without Producer, Consumer or a copy engine. Two
// threads of one process share the mapping through two views.
#include <gtest/gtest.h>
#include <unistd.h>

#include <xxhash.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>

#include "protocol/ring.hpp"

using namespace shmcast;
using namespace shmcast::detail;

namespace {

constexpr std::uint64_t kS = 2 << 20;  // slot bytes

struct RingFixture {
  std::string dir, name;
  Geometry g{};
  RegionView pview, cview;
  std::optional<ProducerRing> prod;
  std::optional<ConsumerRing> cons;

  // `world`: producer ranks (the region's rank seats; ranks >= 1 are made
  // to look alive by taking their lock bytes on the producer's view).
  explicit RingFixture(std::uint32_t slots = 2, std::uint32_t world = 1) {
    char tmpl[] = "/dev/shm/shmcast-ring-XXXXXX";
    dir = ::mkdtemp(tmpl);
    name = "ring";
    EXPECT_EQ(compute_geometry(2, slots, kS, 64 << 10, &g, world), "");
    MappedFile f = MappedFile::create(dir, name, g.total_bytes, false, kProducerLockByte);
    Header& h = *reinterpret_cast<Header*>(f.data());
    h.fixed = make_fixed_header(g, 0);
    h.generation.store(1);
    h.init_state.store(kInitReady);
    pview = RegionView(std::move(f), g);
    for (std::uint32_t r = 1; r < world; ++r) EXPECT_EQ(lock_byte(pview.fd(), rank_lock_byte(r)), 0);
    cview = RegionView(MappedFile::open(dir, name, true), g);  // a second open file description
    prod.emplace(&pview, ProducerRingOptions{StallPolicy::kFail, 5'000'000'000});
    cons.emplace(&cview);
    cons->claim();
  }
  ~RingFixture() {
    ::unlink((dir + "/shmcast." + name).c_str());
    ::rmdir(dir.c_str());
  }
  // Announces sync `version` of `stream` bytes starting at chunk `first_seq`.
  void announce(std::uint64_t version, std::uint64_t first_seq, std::uint64_t stream) {
    prod->enroll(version, first_seq);
    RecordSnapshot rec{};
    rec.version = version;
    rec.first_seq = first_seq;
    rec.chunks = chunk_count(stream, kS);
    rec.stream_bytes = stream;
    prod->announce(rec);
  }
};

std::vector<std::uint8_t> random_bytes(std::size_t n, std::uint64_t seed) {
  std::vector<std::uint8_t> v(n);
  std::mt19937_64 rng(seed);
  for (auto& b : v) b = static_cast<std::uint8_t>(rng());
  return v;
}

// Writes `src` through the writer in pieces of `piece` bytes, marking
// progressive fill, publishing each chunk at once (a host engine).
void write_stream(ChunkWriter& w, const std::vector<std::uint8_t>& src, std::uint64_t piece) {
  auto now = [](std::function<void()> publish) { publish(); };
  for (std::uint64_t pos = 0; pos < src.size();) {
    w.complete_below(pos, now);
    std::uint64_t room;
    std::byte* dst = w.claim(pos, &room);
    const std::uint64_t n = std::min<std::uint64_t>({piece, room, src.size() - pos});
    std::memcpy(dst, src.data() + pos, n);
    pos += n;
    w.filled_to(pos);
  }
  w.complete_below(src.size(), now);
}

// Reads the whole stream through the reader; releases each chunk at once.
std::vector<std::uint8_t> read_stream(RingFixture& fx, std::uint64_t version, std::uint64_t first_seq,
                                      std::uint64_t stream, bool follow, int* ranges) {
  std::vector<std::uint8_t> out(stream);
  ChunkReader r(&*fx.cons, &fx.cview, version, first_seq, chunk_count(stream, kS), {stream}, follow, false,
                5'000'000'000);
  std::atomic<bool> broken{false};
  ChunkReader::Range range;
  *ranges = 0;
  while (r.next(&range)) {
    ++*ranges;
    EXPECT_LE(range.start + range.bytes, stream);
    std::memcpy(out.data() + range.start, range.data, range.bytes);
    if (range.last) r.releaser(range, &broken)();
  }
  EXPECT_FALSE(broken.load());
  return out;
}

}  // namespace

// Five chunks through two slots: the writer must wait for releases, the
// reader gets every byte in order, partial ranges included.
TEST(Ring, StreamLargerThanTheRingArrivesWhole) {
  RingFixture fx(2);
  const std::uint64_t stream = 5 * kS - 12345;
  const auto src = random_bytes(stream, 1);
  fx.announce(1, 1, stream);
  std::thread writer([&] {
    ChunkWriter w(&*fx.prod, &fx.pview, 1, 1, stream, false);
    EXPECT_EQ(w.chunks(), 5u);
    write_stream(w, src, 512 << 10);
    EXPECT_EQ(w.next_seq(), 6u);
  });
  int ranges = 0;
  const auto got = read_stream(fx, 1, 1, stream, true, &ranges);
  writer.join();
  EXPECT_TRUE(got == src);
  EXPECT_GE(ranges, 5);
  EXPECT_EQ(fx.pview.header().published_seq.load(), 5u);
  EXPECT_EQ(fx.cview.seat(0).released_seq.load(), 5u);
}

// The writer cannot refill a slot the reader has not released: it times
// out naming the seat (StallPolicy::kFail).
TEST(Ring, WriterWaitsForReleaseAndTimesOut) {
  RingFixture fx(2);
  fx.prod.emplace(&fx.pview, ProducerRingOptions{StallPolicy::kFail, 200'000'000});
  const std::uint64_t stream = 3 * kS;
  fx.announce(1, 1, stream);
  ChunkWriter w(&*fx.prod, &fx.pview, 1, 1, stream, false);
  const auto src = random_bytes(stream, 2);
  try {
    write_stream(w, src, kS);
    ADD_FAILURE() << "the writer overwrote an unreleased slot";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kTimeout) << e.what();
    EXPECT_NE(std::string(e.what()).find("seat 0"), std::string::npos) << e.what();
  }
}

// A published chunk whose bytes no longer match its checksum is refused.
TEST(Ring, ReaderChecksTheChecksum) {
  RingFixture fx(2);
  const std::uint64_t stream = kS + 100;
  fx.announce(1, 1, stream);
  ChunkWriter w(&*fx.prod, &fx.pview, 1, 1, stream, true);
  write_stream(w, random_bytes(stream, 3), 64 << 10);
  fx.pview.slot_data(0)[7] ^= std::byte{1};  // flipped after publication
  ChunkReader r(&*fx.cons, &fx.cview, 1, 1, 2, {stream}, false, true, 1'000'000'000);
  ChunkReader::Range range;
  try {
    r.next(&range);
    ADD_FAILURE() << "a corrupted chunk was handed out";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kChecksum) << e.what();
  }
}

// An abort reaches a reader waiting for a chunk that will never come.
TEST(Ring, AbortReachesAWaitingReader) {
  RingFixture fx(2);
  const std::uint64_t stream = 2 * kS;
  fx.announce(1, 1, stream);
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the reader is waiting by then, or not: both fine
    fx.prod->abort(1);
  });
  ChunkReader r(&*fx.cons, &fx.cview, 1, 1, 2, {stream}, true, false, 5'000'000'000);
  ChunkReader::Range range;
  try {
    r.next(&range);
    ADD_FAILURE() << "a chunk of an aborted sync was handed out";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kAborted) << e.what();
  }
  aborter.join();
}

// A slot overwritten while the reader copied it is reported, never
// delivered as success.
TEST(Ring, OverwriteDuringTheCopyIsDetected) {
  RingFixture fx(2);
  const std::uint64_t stream = kS;
  fx.announce(1, 1, stream);
  ChunkWriter w(&*fx.prod, &fx.pview, 1, 1, stream, false);
  write_stream(w, random_bytes(stream, 4), kS);
  ChunkReader r(&*fx.cons, &fx.cview, 1, 1, 1, {stream}, false, false, 1'000'000'000);
  ChunkReader::Range range;
  ASSERT_TRUE(r.next(&range));
  ASSERT_TRUE(range.last);
  fx.prod->begin_fill(3);  // chunk 3 lands in slot 0 while we "copy"
  std::atomic<bool> broken{false};
  r.releaser(range, &broken)();
  EXPECT_TRUE(broken.load());
}

// ---------------------------------------------------------------- sharded reads

namespace {

// Publishes chunk `seq` of sync 1 as `bytes` bytes of pattern `seq` (what a
// producer rank's ChunkWriter does, minus the waits: the tests below decide
// the order chunks appear in).
void publish_chunk(RingFixture& fx, std::uint64_t seq, std::uint64_t bytes, bool checksum = false) {
  fx.prod->begin_fill(seq);
  std::byte* d = fx.pview.slot_data(fx.pview.slot_of(seq));
  std::memset(d, static_cast<int>(seq), bytes);
  fx.prod->publish(seq, 1, bytes, checksum ? XXH3_64bits(d, bytes) : 0);
}

}  // namespace

// Two ranks, four slots, two chunks each (seq 1, 3: rank 0; 2, 4: rank 1).
// Rank 0's first chunk is late: the reader hands out rank 1's published
// chunks meanwhile (a strictly ordered reader times out on seq 1), and the
// seat's cumulative release waits for seq 1. Completions that arrive out of
// order release exactly the copied prefix.
TEST(Ring, ShardedReaderTakesReadyChunksOfAnotherRankFirst) {
  RingFixture fx(4, 2);
  const std::vector<std::uint64_t> rank_bytes{2 * kS, kS + 4096};
  fx.announce(1, 1, 4 * kS);
  publish_chunk(fx, 2, kS);
  publish_chunk(fx, 4, 4096);
  ChunkReader r(&*fx.cons, &fx.cview, 1, 1, 4, rank_bytes, false, false, 300'000'000);
  std::atomic<bool> broken{false};
  std::atomic<std::uint64_t>& released = fx.cview.seat(0).released_seq;
  ChunkReader::Range a, b, c, d;
  ASSERT_TRUE(r.next(&a));  // throws Timeout naming chunk 1 when read in seq order
  EXPECT_EQ(a.seq, 2u);
  EXPECT_EQ(a.rank, 1u);
  EXPECT_EQ(a.start, 0u);
  EXPECT_EQ(a.bytes, kS);
  EXPECT_TRUE(a.last);
  EXPECT_EQ(a.data[0], std::byte{2});
  r.releaser(a, &broken)();
  EXPECT_EQ(released.load(), 0u) << "chunk 2 released before chunk 1 was read";
  ASSERT_TRUE(r.next(&b));
  EXPECT_EQ(b.seq, 4u);
  EXPECT_EQ(b.start, kS);
  EXPECT_EQ(b.bytes, 4096u);
  // Rank 1 is done; only rank 0's chunks are left, and none is published.
  try {
    r.next(&c);
    ADD_FAILURE() << "handed out chunk " << c.seq << ", which is not published";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kTimeout) << e.what();
    EXPECT_NE(std::string(e.what()).find("chunk 1 of sync 1"), std::string::npos) << e.what();
  }
  publish_chunk(fx, 3, kS);
  publish_chunk(fx, 1, kS);
  ASSERT_TRUE(r.next(&c));  // both ready: the lower seq first
  EXPECT_EQ(c.seq, 1u);
  EXPECT_EQ(c.rank, 0u);
  ASSERT_TRUE(r.next(&d));
  EXPECT_EQ(d.seq, 3u);
  EXPECT_EQ(d.start, kS);
  EXPECT_FALSE(r.next(&a));
  // Completions in the order 3, 1, 4 (an engine may finish them so).
  r.releaser(d, &broken)();
  EXPECT_EQ(released.load(), 0u);
  EXPECT_EQ(r.released(), 0u);
  r.releaser(c, &broken)();
  EXPECT_EQ(released.load(), 3u) << "1, 2 and 3 are copied; 4 is not";
  r.releaser(b, &broken)();
  EXPECT_EQ(released.load(), 4u);
  EXPECT_EQ(r.released(), 4u);
  EXPECT_FALSE(broken.load());
}

// The reader never looks past what the ring can hold for it: with chunk 1
// unread, seq 6 (rank 1's third chunk) lives in the slot of seq 2, which the
// producer may not refill. A slot that claims seq 6 anyway (a producer that
// broke the rule) is not read: the reader waits for chunk 1.
TEST(Ring, ShardedReaderStaysInsideItsWindow) {
  RingFixture fx(4, 2);
  const std::vector<std::uint64_t> rank_bytes{3 * kS, 3 * kS};
  fx.announce(1, 1, 6 * kS);
  publish_chunk(fx, 2, kS);
  publish_chunk(fx, 4, kS);
  ChunkReader r(&*fx.cons, &fx.cview, 1, 1, 6, rank_bytes, false, false, 200'000'000);
  std::atomic<bool> broken{false};
  ChunkReader::Range a, b, c;
  ASSERT_TRUE(r.next(&a));
  ASSERT_TRUE(r.next(&b));
  EXPECT_EQ(a.seq, 2u);
  EXPECT_EQ(b.seq, 4u);
  r.releaser(a, &broken)();
  r.releaser(b, &broken)();
  publish_chunk(fx, 6, kS);  // into slot 1, over chunk 2
  try {
    r.next(&c);
    ADD_FAILURE() << "handed out chunk " << c.seq << " past the window (released " << r.released() << ")";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kTimeout) << e.what();
    EXPECT_NE(std::string(e.what()).find("chunk 1 of sync 1"), std::string::npos) << e.what();
  }
}

// A chunk taken out of order is checked like any other: a flipped byte in
// rank 1's published chunk fails its checksum before a byte is handed out.
TEST(Ring, ShardedReaderChecksTheChecksumOfAnEarlyChunk) {
  RingFixture fx(4, 2);
  const std::vector<std::uint64_t> rank_bytes{kS, kS};
  fx.announce(1, 1, 2 * kS);
  publish_chunk(fx, 2, kS, true);
  fx.pview.slot_data(1)[100] ^= std::byte{1};
  ChunkReader r(&*fx.cons, &fx.cview, 1, 1, 2, rank_bytes, false, true, 2'000'000'000);
  ChunkReader::Range a;
  try {
    r.next(&a);
    ADD_FAILURE() << "handed out chunk " << a.seq << ", which fails its checksum";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kChecksum) << e.what();
    EXPECT_NE(std::string(e.what()).find("chunk 2 "), std::string::npos) << e.what();
  }
}

// A rank r > 0 that owes a chunk dies (docs/protocol.md, "A rank dies in
// the middle of a sync"): the reader waits for rank 0's verdict, never
// PeerDied. Rank 0 never aborts here: Timeout at the reader's deadline,
// naming the dead rank.
TEST(Ring, ShardedReaderWaitsForRankZeroWhenARankThatOwesAChunkDies) {
  RingFixture fx(4, 2);
  const std::vector<std::uint64_t> rank_bytes{3 * kS, 3 * kS};
  fx.announce(1, 1, 6 * kS);
  publish_chunk(fx, 2, kS);
  publish_chunk(fx, 4, kS);
  ChunkReader r(&*fx.cons, &fx.cview, 1, 1, 6, rank_bytes, false, false, 300'000'000);
  ChunkReader::Range a, b, c;
  ASSERT_TRUE(r.next(&a));
  ASSERT_TRUE(r.next(&b));
  ASSERT_EQ(unlock_byte(fx.pview.fd(), rank_lock_byte(1)), 0);  // rank 1 "dies" before its seq 6
  try {
    r.next(&c);
    ADD_FAILURE() << "handed out chunk " << c.seq;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kTimeout) << e.what();
    EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("died"), std::string::npos) << e.what();
  }
}

// The same death, and rank 0 aborts the sync (as its end_sync does when it
// finds the rank dead): Aborted at once, not the deadline.
TEST(Ring, ShardedReaderGetsAbortedWhenRankZeroAbortsForADeadRank) {
  RingFixture fx(4, 2);
  const std::vector<std::uint64_t> rank_bytes{3 * kS, 3 * kS};
  fx.announce(1, 1, 6 * kS);
  publish_chunk(fx, 2, kS);
  publish_chunk(fx, 4, kS);
  ChunkReader r(&*fx.cons, &fx.cview, 1, 1, 6, rank_bytes, false, false, 5'000'000'000);
  ChunkReader::Range a, b, c;
  ASSERT_TRUE(r.next(&a));
  ASSERT_TRUE(r.next(&b));
  ASSERT_EQ(unlock_byte(fx.pview.fd(), rank_lock_byte(1)), 0);
  fx.prod->abort(1);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    r.next(&c);
    ADD_FAILURE() << "handed out chunk " << c.seq;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kAborted) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2)) << "the abort took the whole timeout";
}

// Progressive fill with two ranks: a chunk being filled is handed out in
// parts, and another rank's chunk may come between the parts.
TEST(Ring, ShardedReaderFollowsAFillBetweenAnotherRanksChunks) {
  RingFixture fx(4, 2);
  const std::vector<std::uint64_t> rank_bytes{kS, kS};
  fx.announce(1, 1, 2 * kS);
  fx.prod->begin_fill(1);
  std::byte* d1 = fx.pview.slot_data(0);
  std::memset(d1, 1, kS / 2);
  fx.prod->progress(1, kS / 2);
  ChunkReader r(&*fx.cons, &fx.cview, 1, 1, 2, rank_bytes, true, false, 2'000'000'000);
  std::atomic<bool> broken{false};
  ChunkReader::Range a, b, c;
  ASSERT_TRUE(r.next(&a));
  EXPECT_EQ(a.seq, 1u);
  EXPECT_FALSE(a.last);
  EXPECT_EQ(a.bytes, kS / 2);
  publish_chunk(fx, 2, kS);
  ASSERT_TRUE(r.next(&b));
  EXPECT_EQ(b.seq, 2u);
  EXPECT_TRUE(b.last);
  r.releaser(b, &broken)();
  EXPECT_EQ(fx.cview.seat(0).released_seq.load(), 0u);
  std::memset(d1 + kS / 2, 1, kS / 2);
  fx.prod->publish(1, 1, kS, 0);
  ASSERT_TRUE(r.next(&c));
  EXPECT_EQ(c.seq, 1u);
  EXPECT_TRUE(c.last);
  EXPECT_EQ(c.start, kS / 2);
  EXPECT_EQ(c.bytes, kS / 2);
  r.releaser(c, &broken)();
  EXPECT_EQ(fx.cview.seat(0).released_seq.load(), 2u);
  EXPECT_FALSE(broken.load());
}

// released_seq never goes down: a late completion releasing less than the
// reader's error path already released leaves it alone.
TEST(Ring, ReleaseIsMonotone) {
  RingFixture fx(2);
  fx.cons->release(7);
  fx.cons->release(3);
  EXPECT_EQ(fx.cview.seat(0).released_seq.load(), 7u);
  fx.cons->release(9);
  EXPECT_EQ(fx.cview.seat(0).released_seq.load(), 9u);
}
