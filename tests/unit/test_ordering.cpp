// Ordering: what the region says about a chunk must never run ahead of its
// bytes. A producer that publishes a chunk (or marks bytes of it final for
// progressive fill) before it has copied them in, or a consumer that
// releases a slot before it has copied it out, delivers wrong bytes only
// when another process happens to look in that instant: tests that merely
// compare bytes catch it by luck, if at all. Here the copy itself is stopped
// in the middle, and the region is read at that moment:
//
//  * the producer's source tensors (or the consumer's destination buffers)
//    are mapped PROT_NONE; every page the library's memcpy touches faults
//    once, and the SIGSEGV handler reads the region's publication state
//    before it opens the page and lets the copy go on;
//  * at each fault, the chunk being copied must not be published, the
//    slot's "filled" mark must not reach past the byte being copied
//    (producer), and the consumer's seat must not have released the chunk
//    it is copying out of (consumer).
//
// Single process, one producer and one consumer thread (or two producer
// ranks of a sharded sync, one thread each); no timing.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

#include "base/layout.hpp"
#include "protocol/manifest.hpp"
#include "protocol/ring.hpp"
#include "support.hpp"

using namespace shmcast;
using namespace shmcast_test;
using namespace std::chrono_literals;
namespace d = shmcast::detail;

namespace {

constexpr std::uint64_t kSlot = 2ull << 20;

// ---- a read-only view of a region, as an outside observer.
struct RegionPeek {
  const std::byte* base = nullptr;
  std::size_t size = 0;
  explicit RegionPeek(const std::string& name) {
    const int fd = ::open(region_path(name).c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    size = static_cast<std::size_t>(::lseek(fd, 0, SEEK_END));
    void* m = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
    ::close(fd);
    if (m != MAP_FAILED) base = static_cast<const std::byte*>(m);
  }
  ~RegionPeek() {
    if (base) ::munmap(const_cast<std::byte*>(base), size);
  }
  const d::Header& header() const { return *reinterpret_cast<const d::Header*>(base); }
  const d::SlotDesc& slot_of_seq(std::uint64_t seq) const {
    const d::HeaderFixed& f = header().fixed;
    return reinterpret_cast<const d::SlotDesc*>(base + f.slots_offset)[(seq - 1) % f.slot_count];
  }
  const d::Seat& seat(int i) const {
    return reinterpret_cast<const d::Seat*>(base + header().fixed.seats_offset)[i];
  }
};

// ---- buffers whose pages fault once each, and the handler that watches.
std::size_t page_size() { return static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)); }

struct Trapped {
  std::byte* p = nullptr;
  std::size_t mapped = 0;
  explicit Trapped(std::size_t bytes) {
    mapped = (bytes + page_size() - 1) / page_size() * page_size();
    if (mapped == 0) mapped = page_size();
    void* m = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m != MAP_FAILED) p = static_cast<std::byte*>(m);
  }
  ~Trapped() {
    if (p) ::munmap(p, mapped);
  }
  void arm() { ::mprotect(p, mapped, PROT_NONE); }
  void disarm() { ::mprotect(p, mapped, PROT_READ | PROT_WRITE); }
};

// What one fault saw. Filled in by the handler: fixed storage, no allocation.
struct Seen {
  std::uint64_t pos;           // stream byte being copied when the copy stopped
  std::uint64_t published;     // header published_seq
  std::uint64_t fill_seq;      // of the slot the byte belongs to
  std::uint64_t filled;
  std::uint64_t released;      // the consumer seat's released_seq
  std::uint64_t slot_seq;      // the chunk the byte's slot holds (published)
};

struct Watch {
  static constexpr int kMax = 1 << 14;
  const RegionPeek* region = nullptr;
  int seat = -1;
  // The producer rank whose copy is watched, of `world` ranks: its chunk j is
  // seq 1 + j * world + rank (the region's first sync).
  std::uint64_t world = 1, rank = 0;
  // The trapped buffers, one per tensor, and where each tensor starts in the stream.
  std::vector<const std::byte*> lo;
  std::vector<std::size_t> len;
  std::vector<std::uint64_t> stream_offset;
  Seen seen[kMax];
  std::atomic<int> n{0};
  std::atomic<int> foreign{0};
};

Watch* g_watch = nullptr;
struct sigaction g_old_segv {};

void on_segv(int, siginfo_t* si, void*) {
  Watch* w = g_watch;
  const std::byte* a = static_cast<const std::byte*>(si->si_addr);
  std::size_t t = 0;
  while (w && t < w->lo.size() && !(a >= w->lo[t] && a < w->lo[t] + w->len[t])) ++t;
  if (!w || t == w->lo.size()) {
    // Not ours: put the old handler back and let the access fault again.
    if (w) w->foreign.fetch_add(1);
    ::sigaction(SIGSEGV, &g_old_segv, nullptr);
    return;
  }
  const std::uint64_t pos = w->stream_offset[t] + static_cast<std::uint64_t>(a - w->lo[t]);
  const int i = w->n.fetch_add(1);
  if (i < Watch::kMax) {
    const RegionPeek& r = *w->region;
    const std::uint64_t seq = 1 + pos / r.header().fixed.slot_bytes * w->world + w->rank;  // the first sync's chunks start at 1
    const d::SlotDesc& s = r.slot_of_seq(seq);
    Seen& e = w->seen[i];
    e.pos = pos;
    e.published = r.header().published_seq.load();
    e.fill_seq = s.fill_seq.load();
    e.filled = s.filled.load();
    e.released = w->seat >= 0 ? r.seat(w->seat).released_seq.load() : 0;
    e.slot_seq = s.seq.load();
  }
  const std::uintptr_t page = reinterpret_cast<std::uintptr_t>(a) & ~(std::uintptr_t{page_size()} - 1);
  ::mprotect(reinterpret_cast<void*>(page), page_size(), PROT_READ | PROT_WRITE);
}

struct HandlerScope {
  explicit HandlerScope(Watch* w) {
    g_watch = w;
    struct sigaction sa {};
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGSEGV, &sa, &g_old_segv);
  }
  ~HandlerScope() {
    ::sigaction(SIGSEGV, &g_old_segv, nullptr);
    g_watch = nullptr;
  }
};

// Three tensors: one inside a slot, one over two slots, one small; with
// 2 MiB slots the sync is 3 chunks (more than the 2 slots: slots are reused).
std::vector<TensorSpec> specs() {
  return {{"a", DType::kU8, {static_cast<std::int64_t>(kSlot / 2 + 100)}},
          {"b", DType::kU8, {static_cast<std::int64_t>(kSlot + kSlot / 2 + 7)}},
          {"c", DType::kU8, {64 << 10}}};
}

ProducerOptions popts(bool checksums, std::uint64_t slot_bytes = kSlot) {
  ProducerOptions o;
  o.slot_bytes = slot_bytes;
  o.slots = 2;
  o.max_consumers = 1;
  o.manifest_bytes = 64 << 10;
  o.pin = Pin::kNo;
  o.checksums = checksums;
  o.consumer_timeout = 20s;
  return o;
}

ConsumerOptions copts() {
  ConsumerOptions c;
  c.pin = Pin::kNo;
  c.open_timeout = 20s;
  c.chunk_timeout = 20s;
  return c;
}

}  // namespace

// The producer's copy is stopped at every source page: the chunk it copies
// into must not be published yet, and its slot's progressive-fill mark must
// not cover the byte being read. Checksums on (whole slots) and off
// (progressive fill); slots of 2 MiB (one fill step) and 8 MiB (several).
class PublishOrder : public ::testing::TestWithParam<std::tuple<bool, std::uint64_t>> {};

TEST_P(PublishOrder, NothingIsPublishedBeforeItsBytesAreWritten) {
  const auto [checksums, slot] = GetParam();
  const std::string name = unique_name("pubord");
  RegionGuard guard{name};
  Producer p = Producer::create(name, popts(checksums, slot));
  RegionPeek region(name);
  ASSERT_NE(region.base, nullptr);
  const auto sp = specs();
  std::vector<std::uint64_t> offsets;
  std::uint64_t payload = 0;
  const std::uint64_t stream = d::pack(sp, p.slot_bytes(), &offsets, &payload);
  auto w = std::make_unique<Watch>();
  w->region = &region;
  std::vector<std::unique_ptr<Trapped>> src;
  std::vector<const void*> ptrs;
  for (std::size_t i = 0; i < sp.size(); ++i) {
    src.push_back(std::make_unique<Trapped>(sp[i].nbytes()));
    ASSERT_NE(src.back()->p, nullptr);
    fill_pattern(reinterpret_cast<std::uint8_t*>(src.back()->p), sp[i].nbytes(), seed_of(1, i));
    w->lo.push_back(src.back()->p);
    w->len.push_back(sp[i].nbytes());
    w->stream_offset.push_back(offsets[i]);
    ptrs.push_back(src.back()->p);
  }
  {
    HandlerScope h(w.get());
    for (auto& s : src) s->arm();
    p.send(sp, ptrs);  // no consumer: nothing to wait for
  }
  for (auto& s : src) s->disarm();
  const int n = w->n.load();
  ASSERT_LE(n, Watch::kMax);
  EXPECT_EQ(w->foreign.load(), 0);
  // Every page of every source was read, so every page faulted once.
  std::size_t pages = 0;
  for (auto& s : src) pages += s->mapped / page_size();
  EXPECT_GE(static_cast<std::size_t>(n), pages) << "the copy did not fault on every source page";
  int early_publish = 0, early_fill = 0;
  for (int i = 0; i < n; ++i) {
    const Seen& e = w->seen[i];
    const std::uint64_t seq = 1 + e.pos / p.slot_bytes();
    const std::uint64_t in_chunk = e.pos % p.slot_bytes();
    if (e.published >= seq) {
      if (early_publish++ == 0)
        ADD_FAILURE() << "chunk " << seq << " was published (published_seq " << e.published
                      << ") while the producer was still copying stream byte " << e.pos << " into it";
    }
    if (e.fill_seq == seq && e.filled > in_chunk) {
      if (early_fill++ == 0)
        ADD_FAILURE() << "chunk " << seq << ": " << e.filled << " bytes marked final while byte " << in_chunk
                      << " of it was still being copied";
    }
  }
  EXPECT_EQ(early_publish, 0);
  EXPECT_EQ(early_fill, 0);
  // Afterwards every chunk is published.
  EXPECT_EQ(region.header().published_seq.load(), d::chunk_count(stream, p.slot_bytes()));
}

INSTANTIATE_TEST_SUITE_P(Ordering, PublishOrder,
                         ::testing::Combine(::testing::Bool(), ::testing::Values(kSlot, 4 * kSlot)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) ? "Checksums" : "ProgressiveFill") +
                                  (std::get<1>(info.param) == kSlot ? "Slot2MiB" : "Slot8MiB");
                         });

// The same for a sharded producer: rank 1 of 2 (this thread; rank 0 writes
// its own pieces in another) is stopped at every page of its sources. Ranks
// publish out of order, so the chunk being copied into (seq 1 + j * 2 + 1)
// is judged by its slot, which must not hold it yet, and by its fill mark.
class ShardedPublishOrder : public ::testing::TestWithParam<bool> {};

TEST_P(ShardedPublishOrder, NothingIsPublishedBeforeItsBytesAreWritten) {
  const bool checksums = GetParam();
  constexpr std::uint32_t R = 2;
  constexpr std::int64_t kRows = 10240, kRowBytes = 1024;  // 5 MiB a rank: 3 chunks each
  const std::string name = unique_name("pubshard");
  RegionGuard guard{name};
  auto ropts = [&](std::uint32_t r) {
    ProducerOptions o = popts(checksums);
    o.slots = 2 * R;
    o.rank = r;
    o.world_size = R;
    o.engine = CopyEngine::kHost;
    o.rank_timeout = 20s;
    return o;
  };
  Producer p0 = Producer::create(name, ropts(0));
  Producer p1 = Producer::create(name, ropts(1));
  RegionPeek region(name);
  ASSERT_NE(region.base, nullptr);
  auto shard = [&](std::int64_t start) {
    TensorSpec t{"a", DType::kU8, {kRows, kRowBytes}};
    t.shard_dim = 0;
    t.shard_start = start;
    t.shard_length = kRows / 2;
    return t;
  };
  const std::vector<TensorSpec> s0{shard(0)};
  const std::vector<TensorSpec> s1{shard(kRows / 2), {"b", DType::kU8, {64 << 10}}};  // "b": rank 1's alone
  std::vector<std::uint8_t> a0(s0[0].local_nbytes());
  fill_pattern(a0.data(), a0.size(), seed_of(1, 0));
  std::atomic<int> rank0{0};
  std::thread t0([&] {
    try {
      p0.begin_sync(s0);
      p0.write(0, a0.data());
      p0.end_sync();
      rank0 = 1;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank 0: %s\n", e.what());
      rank0 = 2;
    }
  });
  auto w = std::make_unique<Watch>();
  w->region = &region;
  w->world = R;
  w->rank = 1;
  std::vector<std::unique_ptr<Trapped>> src;
  SyncLayout layout;
  std::string failed;
  try {
    p1.begin_sync(s1);
    layout = p1.last_layout();
    for (std::size_t i = 0; i < s1.size(); ++i) {
      src.push_back(std::make_unique<Trapped>(s1[i].local_nbytes()));
      if (src.back()->p == nullptr) throw std::runtime_error("mmap failed");
      fill_pattern(reinterpret_cast<std::uint8_t*>(src.back()->p), s1[i].local_nbytes(), seed_of(1, i + 1));
      w->lo.push_back(src.back()->p);
      w->len.push_back(s1[i].local_nbytes());
      w->stream_offset.push_back(layout.offsets.at(i));
    }
    {
      HandlerScope h(w.get());
      for (auto& b : src) b->arm();
      for (std::size_t i = 0; i < s1.size(); ++i) p1.write(i, src[i]->p);
      p1.end_sync();
    }
  } catch (const std::exception& e) {
    failed = e.what();
  }
  for (auto& b : src) b->disarm();
  t0.join();
  ASSERT_EQ(failed, "");
  ASSERT_EQ(rank0.load(), 1);
  ASSERT_EQ(layout.first_seq, 1u);
  ASSERT_EQ(layout.world_size, R);
  ASSERT_EQ(layout.rank_chunks, 3u);
  const int n = w->n.load();
  ASSERT_LE(n, Watch::kMax);
  EXPECT_EQ(w->foreign.load(), 0);
  std::size_t pages = 0;
  for (auto& b : src) pages += b->mapped / page_size();
  EXPECT_GE(static_cast<std::size_t>(n), pages) << "the copy did not fault on every source page";
  int early_publish = 0, early_fill = 0;
  for (int i = 0; i < n; ++i) {
    const Seen& e = w->seen[i];
    const std::uint64_t seq = 1 + e.pos / p1.slot_bytes() * R + 1;
    const std::uint64_t in_chunk = e.pos % p1.slot_bytes();
    if (e.slot_seq == seq && early_publish++ == 0)
      ADD_FAILURE() << "rank 1's chunk " << seq << " was published while the rank was still copying byte " << e.pos
                    << " of its sub-stream into it";
    if (e.fill_seq == seq && e.filled > in_chunk && early_fill++ == 0)
      ADD_FAILURE() << "rank 1's chunk " << seq << ": " << e.filled << " bytes marked final while byte " << in_chunk
                    << " of it was still being copied";
  }
  EXPECT_EQ(early_publish, 0);
  EXPECT_EQ(early_fill, 0);
  // Afterwards every chunk of both ranks is published (6 chunks, 4 slots).
  for (std::uint64_t seq = 3; seq <= 6; ++seq) EXPECT_EQ(region.slot_of_seq(seq).seq.load(), seq);
}

INSTANTIATE_TEST_SUITE_P(Ordering, ShardedPublishOrder, ::testing::Bool(),
                         [](const auto& info) { return std::string(info.param ? "Checksums" : "ProgressiveFill"); });

// The consumer's copy out is stopped at every destination page: its seat
// must not have released the chunk it is copying from (the producer could
// be refilling that slot under it). read_into, checksums on and off.
class ReleaseOrder : public ::testing::TestWithParam<bool> {};

TEST_P(ReleaseOrder, NoSlotIsReleasedBeforeItIsCopiedOut) {
  const bool checksums = GetParam();
  const std::string name = unique_name("relord");
  RegionGuard guard{name};
  Producer p = Producer::create(name, popts(checksums));
  RegionPeek region(name);
  ASSERT_NE(region.base, nullptr);
  Consumer c = Consumer::open(name, copts());
  const auto sp = specs();
  std::vector<std::vector<std::uint8_t>> bytes;
  std::vector<const void*> ptrs;
  for (std::size_t i = 0; i < sp.size(); ++i) {
    bytes.emplace_back(sp[i].nbytes());
    fill_pattern(bytes.back().data(), bytes.back().size(), seed_of(1, i));
    ptrs.push_back(bytes.back().data());
  }
  // The producer thread sends while this thread reads: 3 chunks through 2
  // slots, so it needs the first slot back before it can write the third.
  std::atomic<int> sent{0};
  std::thread producer([&] {
    try {
      p.wait_for_consumers(1, 20s);
      p.send(sp, ptrs);
      sent = 1;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "producer: %s\n", e.what());
      sent = 2;
    }
  });
  const SyncInfo& info = c.wait_sync(20s);
  ASSERT_EQ(info.tensors.size(), sp.size());
  auto w = std::make_unique<Watch>();
  w->region = &region;
  w->seat = c.seat();
  std::vector<std::unique_ptr<Trapped>> dst;
  std::vector<void*> dptrs;
  for (std::size_t i = 0; i < sp.size(); ++i) {
    dst.push_back(std::make_unique<Trapped>(info.tensors[i].nbytes));
    ASSERT_NE(dst.back()->p, nullptr);
    w->lo.push_back(dst.back()->p);
    w->len.push_back(info.tensors[i].nbytes);
    w->stream_offset.push_back(info.tensors[i].stream_offset);
    dptrs.push_back(dst.back()->p);
  }
  {
    HandlerScope h(w.get());
    for (auto& d : dst) d->arm();
    c.read_into(dptrs);
  }
  for (auto& d : dst) d->disarm();
  producer.join();
  EXPECT_EQ(sent.load(), 1);
  const int n = w->n.load();
  ASSERT_LE(n, Watch::kMax);
  EXPECT_EQ(w->foreign.load(), 0);
  std::size_t pages = 0;
  for (auto& d : dst) pages += d->mapped / page_size();
  EXPECT_GE(static_cast<std::size_t>(n), pages) << "the copy out did not fault on every destination page";
  int early = 0;
  for (int i = 0; i < n; ++i) {
    const Seen& e = w->seen[i];
    const std::uint64_t seq = info.first_seq + e.pos / p.slot_bytes();
    if (e.released >= seq && early++ == 0)
      ADD_FAILURE() << "chunk " << seq << " was released (released_seq " << e.released
                    << ") while the consumer was still copying stream byte " << e.pos << " out of it";
  }
  EXPECT_EQ(early, 0);
  for (std::size_t i = 0; i < sp.size(); ++i)
    EXPECT_EQ(std::memcmp(dst[i]->p, bytes[i].data(), bytes[i].size()), 0) << "tensor " << i;
}

INSTANTIATE_TEST_SUITE_P(Ordering, ReleaseOrder, ::testing::Bool(),
                         [](const auto& info) { return std::string(info.param ? "Checksums" : "ProgressiveFill"); });
