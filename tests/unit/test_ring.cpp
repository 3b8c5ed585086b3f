// The ring layer alone: ProducerRing/ChunkWriter and ConsumerRing/ChunkReader
// over a region file, without Producer, Consumer or a copy engine. Two
// threads of one process share the mapping through two views.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <random>
#include <thread>

#include "ring.hpp"

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

  explicit RingFixture(std::uint32_t slots = 2) {
    char tmpl[] = "/dev/shm/shmcast-ring-XXXXXX";
    dir = ::mkdtemp(tmpl);
    name = "ring";
    EXPECT_EQ(compute_geometry(2, slots, kS, 64 << 10, &g), "");
    MappedFile f = MappedFile::create(dir, name, g.total_bytes, false, kProducerLockByte);
    Header& h = *reinterpret_cast<Header*>(f.data());
    h.fixed = make_fixed_header(g, 0);
    h.generation.store(1);
    h.init_state.store(kInitReady);
    pview = RegionView(std::move(f), g);
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
