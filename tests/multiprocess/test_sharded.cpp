// Sharded syncs: R producer ranks (separate processes) write one sync, each
// its own pieces; consumers read whole tensors or slices, bit-exact against
// the logical tensors. Faults: a rank killed mid-sync, a rank that never
// arrives, pieces that do not tile a tensor. A late rank: consumers read the
// other rank's published chunks meanwhile (out of order), with checksums,
// with a killed rank.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>

#include "base/layout.hpp"
#include "shmcast/shmcast.hpp"
#include "support.hpp"

using namespace shmcast;
using namespace shmcast_test;
using namespace std::chrono_literals;

namespace {

struct TDef {
  std::string name;
  DType dt;
  std::vector<std::int64_t> shape;
  int shard_dim;  // -1: whole, owned by `owner`
  int owner;
};

std::vector<TDef> model(int R) {
  return {
      {"a", DType::kF32, {37, 24}, 0, 0},          // uneven Shard(0)
      {"b", DType::kBF16, {16, 50}, 1, 0},         // uneven Shard(1)
      {"c", DType::kF32, {3, 5, 7}, 1, 0},         // Shard(1) of a 3-d tensor
      {"d", DType::kU8, {1000}, -1, R - 1},        // whole, last rank
      {"e", DType::kF32, {64, 64}, -1, 0},         // whole, rank 0
      {"big", DType::kF32, {2000, 1024}, 0, 0},    // several slots per rank
      {"z", DType::kF32, {2, 3}, 0, 0},            // R > 2: empty shards
      {"s", DType::kF64, {}, -1, R > 1 ? 1 : 0},   // a scalar
  };
}

std::uint64_t esize(DType d) { return dtype_size(d); }
std::uint64_t numel(const std::vector<std::int64_t>& s) {
  std::uint64_t n = 1;
  for (auto d : s) n *= static_cast<std::uint64_t>(d);
  return n;
}

// torch.chunk's split: ceil(n / R) rows each, the last ones shorter or empty.
std::pair<std::int64_t, std::int64_t> chunk_range(std::int64_t n, int R, int r) {
  const std::int64_t c = (n + R - 1) / R;
  const std::int64_t start = std::min<std::int64_t>(n, c * r);
  return {start, std::min<std::int64_t>(n, start + c) - start};
}

std::vector<std::uint8_t> full_tensor(const TDef& t, std::size_t index, std::uint64_t version) {
  std::vector<std::uint8_t> v(numel(t.shape) * esize(t.dt));
  fill_pattern(v.data(), v.size(), seed_of(version, index));
  return v;
}

// Rows [start, start + len) along `dim` of a row-major tensor, contiguous.
std::vector<std::uint8_t> slice(const std::vector<std::uint8_t>& full, const std::vector<std::int64_t>& shape,
                                std::uint64_t es, int dim, std::int64_t start, std::int64_t len) {
  if (dim < 0) return full;
  std::uint64_t outer = 1, inner = es;
  for (int d = 0; d < dim; ++d) outer *= static_cast<std::uint64_t>(shape[d]);
  for (std::size_t d = static_cast<std::size_t>(dim) + 1; d < shape.size(); ++d)
    inner *= static_cast<std::uint64_t>(shape[d]);
  const auto n = static_cast<std::uint64_t>(shape[static_cast<std::size_t>(dim)]);
  std::vector<std::uint8_t> out(outer * static_cast<std::uint64_t>(len) * inner);
  if (out.empty()) return out;
  for (std::uint64_t o = 0; o < outer; ++o)
    std::memcpy(out.data() + o * static_cast<std::uint64_t>(len) * inner,
                full.data() + (o * n + static_cast<std::uint64_t>(start)) * inner, static_cast<std::uint64_t>(len) * inner);
  return out;
}

ProducerOptions rank_opts(int r, int R) {
  ProducerOptions o;
  o.slot_bytes = 2 << 20;
  o.slots = static_cast<std::uint32_t>(2 * R);
  o.max_consumers = 4;
  o.rank = static_cast<std::uint32_t>(r);
  o.world_size = static_cast<std::uint32_t>(R);
  o.pin = Pin::kNo;
  o.engine = CopyEngine::kHost;
  o.consumer_timeout = 20s;
  o.rank_timeout = 20s;
  return o;
}

// Rank r's pieces of sync `version`, written with the host engine.
struct RankSync {
  std::vector<TensorSpec> specs;
  std::vector<std::vector<std::uint8_t>> data;
  RankSync(const std::vector<TDef>& m, int r, int R, std::uint64_t version) {
    for (std::size_t i = 0; i < m.size(); ++i) {
      const TDef& t = m[i];
      TensorSpec s{t.name, t.dt, t.shape};
      const auto full = full_tensor(t, i, version);
      if (t.shard_dim < 0) {
        if (t.owner != r) continue;
        data.push_back(full);
      } else {
        auto [start, len] = chunk_range(t.shape[static_cast<std::size_t>(t.shard_dim)], R, r);
        s.shard_dim = t.shard_dim;
        s.shard_start = start;
        s.shard_length = len;
        data.push_back(slice(full, t.shape, esize(t.dt), t.shard_dim, start, len));
      }
      specs.push_back(s);
    }
  }
};

int run_rank(const std::string& name, int r, int R, int syncs, SharedFlags* f = nullptr, int stop_after = -1) {
  Producer p = Producer::create(name, rank_opts(r, R));
  if (r == 0) p.wait_for_consumers(2, 20s);
  const auto m = model(R);
  for (int v = 1; v <= syncs; ++v) {
    RankSync rs(m, r, R, static_cast<std::uint64_t>(v));
    const std::uint64_t got = p.begin_sync(rs.specs);
    if (got != static_cast<std::uint64_t>(v)) return 10;
    for (std::size_t i = 0; i < rs.specs.size(); ++i) {
      if (v == syncs && static_cast<int>(i) == stop_after) {
        f->v[0].store(1);
        ::pause();  // killed here, mid-sync
      }
      p.write(i, rs.data[i].data());
    }
    p.end_sync();
    const SyncLayout& l = p.last_layout();
    if (l.rank != static_cast<std::uint32_t>(r) || l.world_size != static_cast<std::uint32_t>(R)) return 11;
  }
  if (r == 0) p.wait_drained(20s);
  return 0;
}

// A consumer that reads `syncs` syncs; `part` >= 0: a TP worker of 2 that
// reads part `part` of each sharded tensor along the other dim than it is
// sharded on (the harder case), else whole tensors.
int run_consumer(const std::string& name, int R, int syncs, int part, SharedFlags* f, int flag) {
  ConsumerOptions co;
  co.pin = Pin::kNo;
  co.chunk_timeout = 20s;
  Consumer c = Consumer::open(name, co);
  f->v[flag].store(1);
  const auto m = model(R);
  for (int v = 1; v <= syncs; ++v) {
    const SyncInfo& s = c.wait_sync(30s);
    if (s.version != static_cast<std::uint64_t>(v) || s.tensors.size() != m.size() || s.world_size != static_cast<std::uint32_t>(R))
      return 12;
    // The manifest lists tensors in order of first appearance (rank 0's,
    // then the others'): find each by name.
    std::vector<std::vector<std::uint8_t>> got(m.size()), want(m.size());
    std::vector<void*> dsts(m.size());
    std::vector<Selection> sels(m.size());
    for (std::size_t i = 0; i < m.size(); ++i) {
      const TDef& t = m[i];
      const std::ptrdiff_t at = s.find(t.name);
      if (at < 0 || s.tensors[static_cast<std::size_t>(at)].shape != t.shape) return 14;
      const auto j = static_cast<std::size_t>(at);
      const auto full = full_tensor(t, i, static_cast<std::uint64_t>(v));
      Selection sel;
      if (part >= 0 && !t.shape.empty()) {
        const int dim = t.shape.size() > 1 && t.shard_dim == 0 ? 1 : 0;
        auto [start, len] = chunk_range(t.shape[static_cast<std::size_t>(dim)], 2, part);
        sel = Selection{dim, start, len};
      }
      sels[j] = sel;
      want[j] = slice(full, t.shape, esize(t.dt), sel.dim, sel.start, sel.length);
      got[j].assign(want[j].size(), 0xEE);
      dsts[j] = got[j].data();
    }
    if (part >= 0) c.read_into(dsts, sels);
    else c.read_into(dsts);
    for (std::size_t i = 0; i < m.size(); ++i)
      if (got[i] != want[i]) {
        std::fprintf(stderr, "sync %d tensor %s differs\n", v, s.tensors[i].name.c_str());
        return 13;
      }
  }
  return 0;
}

void sharded_round_trip(int R) {
  const std::string name = unique_name("shard" + std::to_string(R));
  RegionGuard g{name};
  SharedFlags* f = SharedFlags::make();
  std::vector<std::unique_ptr<Child>> kids;  // (a Child copied is a Child killed)
  for (int r = 0; r < R; ++r) kids.emplace_back(new Child(Child::spawn([&, r] { return run_rank(name, r, R, 3); })));
  Child whole = Child::spawn([&] { return run_consumer(name, R, 3, -1, f, 1); });
  Child tp0 = Child::spawn([&] { return run_consumer(name, R, 3, 0, f, 2); });
  for (int r = 0; r < R; ++r) EXPECT_EQ(kids[static_cast<std::size_t>(r)]->wait(60s), 0) << "rank " << r;
  EXPECT_EQ(whole.wait(60s), 0);
  EXPECT_EQ(tp0.wait(60s), 0);
}

}  // namespace

TEST(Sharded, TwoRanksBitExactWholeAndSliced) { sharded_round_trip(2); }
TEST(Sharded, ThreeRanksBitExactWholeAndSliced) { sharded_round_trip(3); }
TEST(Sharded, FourRanksWithEmptyShardsBitExact) { sharded_round_trip(4); }

TEST(Sharded, RankKilledMidSyncFailsTheSyncForEveryone) {
  const int R = 3;
  const std::string name = unique_name("shardkill");
  RegionGuard g{name};
  SharedFlags* f = SharedFlags::make();
  Child r0 = Child::spawn([&] {
    try {
      return run_rank(name, 0, R, 2);
    } catch (const Error& e) {
      std::fprintf(stderr, "rank 0: %s\n", e.what());
      return errc_exit(e);
    }
  });
  Child r1 = Child::spawn([&] { return run_rank(name, 1, R, 2, f, 0); });  // stops before its first piece of sync 2
  Child r2 = Child::spawn([&] {
    try {
      return run_rank(name, 2, R, 2);
    } catch (const Error& e) {
      return errc_exit(e);
    }
  });
  auto consumer = [&](int part, int flag) {
    return Child::spawn([&, part, flag] {
      try {
        return run_consumer(name, R, 2, part, f, flag);
      } catch (const Error& e) {
        std::fprintf(stderr, "consumer: %s\n", e.what());
        return errc_exit(e);
      }
    });
  };
  Child c1 = consumer(-1, 1), c2 = consumer(1, 2);
  ASSERT_TRUE(f->wait(0, 1, 30s)) << "rank 1 never reached sync 2";
  r1.kill9();
  EXPECT_EQ(r1.wait(10s), 128 + SIGKILL);
  const int died = 20 + static_cast<int>(Errc::kPeerDied), aborted = 20 + static_cast<int>(Errc::kAborted);
  EXPECT_EQ(r0.wait(60s), died) << "rank 0 must see rank 1 die";
  // A consumer that was reading sync 2 gets PeerDied or Aborted; one that had
  // not yet taken it never sees it (it was aborted) and gets Closed when rank 0
  // exits. None may read sync 2 successfully.
  const int closed = 20 + static_cast<int>(Errc::kClosed);
  for (Child* c : {&c1, &c2}) {
    const int rc = c->wait(60s);
    EXPECT_TRUE(rc == died || rc == aborted || rc == closed) << "consumer exit " << rc << ": sync 2 must fail, never tear";
  }
  const int rc2 = r2.wait(60s);
  EXPECT_TRUE(rc2 == 0 || rc2 == died || rc2 == aborted) << rc2;
}

TEST(Sharded, RankThatNeverArrivesIsATimeoutNamingIt) {
  const std::string name = unique_name("shardlate");
  RegionGuard g{name};
  ProducerOptions o = rank_opts(0, 3);
  o.rank_timeout = 500ms;
  Producer p = Producer::create(name, o);
  // Rank 1 attaches but never begins a sync; rank 2 never attaches.
  SharedFlags* f = SharedFlags::make();
  Child r1 = Child::spawn([&] {
    ProducerOptions o1 = rank_opts(1, 3);
    Producer q = Producer::create(name, o1);
    f->v[0].store(1);
    ::pause();
    return 0;
  });
  ASSERT_TRUE(f->wait(0, 1, 20s));
  RankSync rs(model(3), 0, 3, 1);
  try {
    p.begin_sync(rs.specs);
    FAIL() << "begin_sync without the other ranks returned";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kTimeout) << e.what();
    EXPECT_NE(std::string(e.what()).find("rank 1 is attached but did not begin"), std::string::npos) << e.what();
  }
  r1.kill9();
  r1.wait(10s);
  // Rank 1 is gone now: the next try names it dead or missing, never hangs.
  try {
    p.begin_sync(rs.specs);
    FAIL() << "begin_sync returned";
  } catch (const Error& e) {
    EXPECT_TRUE(e.code() == Errc::kPeerDied || e.code() == Errc::kTimeout) << e.what();
  }
}

TEST(Sharded, PiecesThatDoNotTileAreRefusedOnEveryRank) {
  const std::string name = unique_name("shardtile");
  RegionGuard g{name};
  auto rank = [&](int r, std::int64_t start, std::int64_t len) {
    return Child::spawn([&, r, start, len] {
      Producer p = Producer::create(name, rank_opts(r, 2));
      std::vector<float> buf(static_cast<std::size_t>(len) * 4);
      std::vector<TensorSpec> specs = {{"w", DType::kF32, {10, 4}, 0, start, len}};
      try {
        p.begin_sync(specs);
      } catch (const Error& e) {
        if (std::string(e.what()).find("do not make one sync") == std::string::npos) return 40;
        return errc_exit(e);
      }
      return 0;
    });
  };
  Child a = rank(0, 0, 6), b = rank(1, 5, 5);  // rows 5 twice
  const int invalid = 20 + static_cast<int>(Errc::kInvalidArgument);
  EXPECT_EQ(a.wait(30s), invalid);
  EXPECT_EQ(b.wait(30s), invalid);
}

TEST(Sharded, RankWithAnotherWorldSizeIsRefused) {
  const std::string name = unique_name("shardws");
  RegionGuard g{name};
  Producer p = Producer::create(name, rank_opts(0, 2));
  try {
    Producer q = Producer::create(name, rank_opts(1, 3));
    FAIL() << "attached with another world_size";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kInvalidArgument) << e.what();
  }
  try {
    ProducerOptions o = rank_opts(0, 2);
    o.slots = 3;  // fewer than 2 per rank
    Producer q = Producer::create(unique_name("few"), o);
    FAIL() << "created with too few slots";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kInvalidArgument) << e.what();
  }
}

TEST(Sharded, OneRankProducerRefusesShards) {
  const std::string name = unique_name("shard1");
  RegionGuard g{name};
  ProducerOptions o;
  o.pin = Pin::kNo;
  o.engine = CopyEngine::kHost;
  Producer p = Producer::create(name, o);
  std::vector<TensorSpec> specs = {{"w", DType::kF32, {10, 4}, 0, 0, 5}};
  EXPECT_THROW(p.begin_sync(specs), Error);
}

// A begin_sync() that fails on one rank before it posts its list (an invalid
// spec here) still fails that sync for every rank, at once, and the next
// sync works: the ranks stay in step. Both directions: rank 0 fails, then
// rank 1 fails. Each rank reports each sync's result (0 or 20 + Errc) in a
// flag before going on, so the ranks go to the next sync only once both
// have finished the last.
TEST(Sharded, ALocalBeginSyncFailureKeepsTheRanksInStep) {
  const std::string name = unique_name("shardstep");
  RegionGuard g{name};
  SharedFlags* f = SharedFlags::make();  // v[2 * s + r]: rank r's result of sync s, + 1
  const std::vector<TensorSpec> good = {{"w", DType::kF32, {8, 4}, 0, 0, 4}};
  const std::vector<TensorSpec> good1 = {{"w", DType::kF32, {8, 4}, 0, 4, 4}};
  const std::vector<TensorSpec> bad = {{"", DType::kF32, {8, 4}, 0, 0, 4}};  // empty name: refused locally
  auto rank = [&](int r) {
    return Child::spawn([&, r] {
      ProducerOptions o = rank_opts(r, 2);
      o.rank_timeout = 10s;  // a rank left waiting for the other fails the test's timings below
      Producer p = Producer::create(name, o);
      // Both attached before the first round (a rank joins the next round
      // rank 0 has not answered).
      f->v[10 + r].store(1);
      if (!f->wait(10 + (1 - r), 1, 30s)) return 92;
      std::vector<float> buf(16, 1.0f);
      for (int s = 0; s < 4; ++s) {
        // Sync 0: rank 0's specs are invalid; sync 2: rank 1's.
        const bool fail_here = (s == 0 && r == 0) || (s == 2 && r == 1);
        int rc = 0;
        const auto t0 = std::chrono::steady_clock::now();
        try {
          p.begin_sync(fail_here ? bad : r == 0 ? good : good1);
          p.write(0, buf.data());
          p.end_sync();
        } catch (const Error& e) {
          rc = errc_exit(e);
        }
        // The other rank's failure must end this rank's sync well before rank_timeout.
        if (std::chrono::steady_clock::now() - t0 > 5s) rc = 90;
        f->v[2 * s + r].store(rc + 1);
        // Wait (bounded) for the other rank's result of this sync.
        const auto end = std::chrono::steady_clock::now() + 30s;
        while (f->v[2 * s + (1 - r)].load() == 0)
          if (std::chrono::steady_clock::now() > end) return 91;
      }
      return 0;
    });
  };
  Child r0 = rank(0), r1 = rank(1);
  EXPECT_EQ(r0.wait(90s), 0);
  EXPECT_EQ(r1.wait(90s), 0);
  const int invalid = 20 + static_cast<int>(Errc::kInvalidArgument);
  for (int s = 0; s < 4; ++s)
    for (int r = 0; r < 2; ++r) {
      const int rc = f->v[2 * s + r].load() - 1;
      if (s == 1 || s == 3)
        EXPECT_EQ(rc, 0) << "sync " << s << " rank " << r << ": the ranks fell out of step";
      else
        EXPECT_EQ(rc, invalid) << "sync " << s << " rank " << r;
    }
}

// ---------------------------------------------------------------- a late rank
//
// Two ranks, four slots of 2 MiB. Rank 0 begins the sync and then writes
// nothing (so publishes nothing: its first chunk, seq 1, is late) until it
// is told that a consumer has read rank 1's first two chunks (seq 2 and 4),
// which are published meanwhile. A consumer that walks the ring in seq
// order waits for seq 1 and never gets there: rank 0 gives up waiting after
// 10 s (exit 70) and writes anyway, and the consumer then sees rank 0's
// pieces first (exit 71). Rank 1's third chunk (seq 6, slot 1) waits for the
// consumers to release seq 2, which the cumulative release does only after
// seq 1: the sync completes only once rank 0 writes.

namespace {

// A pipe between forked processes; one byte, one message.
struct Pipe {
  int fd[2] = {-1, -1};
  Pipe() {
    if (::pipe(fd) != 0) fd[0] = fd[1] = -1;
  }
  ~Pipe() {
    for (int f : fd)
      if (f >= 0) ::close(f);
  }
  Pipe(const Pipe&) = delete;
  Pipe& operator=(const Pipe&) = delete;
  void send(int c) {
    const char b = static_cast<char>(c);
    if (::write(fd[1], &b, 1) != 1) std::fprintf(stderr, "pipe write: %s\n", std::strerror(errno));
  }
  // The next byte, or -1 when none comes within `timeout`.
  int receive(std::chrono::milliseconds timeout) {
    const auto end = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - std::chrono::steady_clock::now());
      if (left.count() < 0) return -1;
      pollfd p{fd[0], POLLIN, 0};
      const int n = ::poll(&p, 1, static_cast<int>(left.count()));
      if (n == 0) return -1;
      if (n < 0) {
        if (errno == EINTR) continue;
        return -1;
      }
      unsigned char b = 0;
      return ::read(fd[0], &b, 1) == 1 ? b : -1;
    }
  }
};

struct LateDef {
  std::string name;
  DType dt;
  std::vector<std::int64_t> shape;
  int shard_dim;        // -1: whole, owned by `owner`
  std::int64_t split;   // rank 0's rows [0, split) along shard_dim, rank 1's the rest
  int owner;
};

constexpr std::int64_t kLateRow = 1024;  // bytes of a row of "w"

// `rank1_rows` rows of "w" (1 KiB each) are rank 1's; rank 0 has 4000 (3.9
// MiB: two chunks). Uneven shards along dim 0 and dim 1, and whole tensors
// of each rank.
std::vector<LateDef> late_model(std::int64_t rank1_rows) {
  return {
      {"w", DType::kF32, {4000 + rank1_rows, kLateRow / 4}, 0, 4000, 0},
      {"x", DType::kF32, {6, 10}, 1, 7, 0},
      {"r0", DType::kU8, {1000}, -1, 0, 0},
      {"r1", DType::kBF16, {1500}, -1, 0, 1},
  };
}

std::vector<std::uint8_t> late_full(const LateDef& t, std::size_t index) {
  std::vector<std::uint8_t> v(numel(t.shape) * esize(t.dt));
  fill_pattern(v.data(), v.size(), seed_of(1, index));
  return v;
}

struct LateRank {
  std::vector<TensorSpec> specs;
  std::vector<std::vector<std::uint8_t>> data;
  LateRank(const std::vector<LateDef>& m, int r) {
    for (std::size_t i = 0; i < m.size(); ++i) {
      const LateDef& t = m[i];
      TensorSpec s{t.name, t.dt, t.shape};
      const auto full = late_full(t, i);
      if (t.shard_dim < 0) {
        if (t.owner != r) continue;
        data.push_back(full);
      } else {
        const std::int64_t n = t.shape[static_cast<std::size_t>(t.shard_dim)];
        s.shard_dim = t.shard_dim;
        s.shard_start = r == 0 ? 0 : t.split;
        s.shard_length = r == 0 ? t.split : n - t.split;
        data.push_back(slice(full, t.shape, esize(t.dt), t.shard_dim, s.shard_start, s.shard_length));
      }
      specs.push_back(s);
    }
  }
};

// Rank r of 2 writes sync 1. `go`, when given, is waited for (at most 10 s)
// after begin_sync and before the first byte: exit 70 when it never came.
// `after_write` runs once every piece is written (its chunks published).
int late_rank(const std::string& name, int r, const std::vector<LateDef>& m, bool checksums, int consumers,
              const std::function<bool()>& go, const std::function<void()>& after_write = {}) {
  ProducerOptions o = rank_opts(r, 2);
  o.checksums = checksums;
  Producer p = Producer::create(name, o);
  if (r == 0) p.wait_for_consumers(static_cast<std::uint32_t>(consumers), 20s);
  LateRank lr(m, r);
  if (p.begin_sync(lr.specs) != 1) return 10;
  int rc = 0;
  if (go && !go()) rc = 70;
  for (std::size_t i = 0; i < lr.specs.size(); ++i) p.write(i, lr.data[i].data());
  if (after_write) after_write();
  p.end_sync();
  if (r == 0) p.wait_drained(20s);
  return rc;
}

// What a consumer got, shard by shard, against the model: 0 or 13.
int late_check(const SyncInfo& s, const std::vector<LateDef>& m,
               const std::vector<std::vector<std::vector<std::uint8_t>>>& got) {
  for (std::size_t t = 0; t < s.tensors.size(); ++t) {
    const TensorInfo& ti = s.tensors[t];
    std::size_t i = 0;
    while (i < m.size() && m[i].name != ti.name) ++i;
    if (i == m.size() || ti.shape != m[i].shape) return 14;
    const auto full = late_full(m[i], i);
    for (std::size_t k = 0; k < ti.shards.size(); ++k) {
      const ShardInfo& sh = ti.shards[k];
      if (got[t][k] != slice(full, ti.shape, esize(ti.dtype), sh.dim, sh.start, sh.length)) {
        std::fprintf(stderr, "tensor %s shard %zu differs\n", ti.name.c_str(), k);
        return 13;
      }
    }
  }
  return 0;
}

ConsumerOptions late_copts() {
  ConsumerOptions co;
  co.pin = Pin::kNo;
  co.chunk_timeout = 30s;
  return co;
}

// Reads sync 1 with visit(): sends `tell` once it has seen the last piece of
// two chunks of rank 1 and no piece of rank 0. Exit 0, 71 when a piece of
// rank 0 came before those, 13/14 when bytes differ.
int late_visitor(const std::string& name, const std::vector<LateDef>& m, Pipe* tell) {
  Consumer c = Consumer::open(name, late_copts());
  const SyncInfo& s = c.wait_sync(30s);
  std::vector<std::vector<std::vector<std::uint8_t>>> got(s.tensors.size());
  for (std::size_t t = 0; t < s.tensors.size(); ++t)
    for (const ShardInfo& sh : s.tensors[t].shards) got[t].emplace_back(sh.nbytes, 0xEE);
  int rank1_chunks = 0, rank1_before_rank0 = -1;
  c.visit([&](const Piece& p) {
    const ShardInfo& sh = s.tensors[p.tensor].shards[p.shard];
    if (p.bytes > 0) std::memcpy(got[p.tensor][p.shard].data() + p.offset, p.data, p.bytes);
    if (sh.rank == 0 && rank1_before_rank0 < 0) rank1_before_rank0 = rank1_chunks;
    if (sh.rank == 1 && p.chunk_end && ++rank1_chunks == 2 && rank1_before_rank0 < 0) tell->send(1);
  });
  if (const int rc = late_check(s, m, got); rc != 0) return rc;
  if (rank1_before_rank0 < 2) {
    std::fprintf(stderr, "rank 0's first piece came after %d chunks of rank 1\n", rank1_before_rank0);
    return 71;
  }
  return 0;
}

// Reads sync 1 with read_into(): whole tensors into `w_dst` (for "w", shared
// with the parent's other children) and private buffers, or with `part` >=
// 0 a TP worker's half of every tensor (along the dim it is not sharded on
// where it has two). 0, or 13 when bytes differ.
int late_reader(const std::string& name, const std::vector<LateDef>& m, std::uint8_t* w_dst, int part) {
  Consumer c = Consumer::open(name, late_copts());
  const SyncInfo& s = c.wait_sync(30s);
  std::vector<std::vector<std::uint8_t>> got(s.tensors.size()), want(s.tensors.size());
  std::vector<void*> dsts(s.tensors.size());
  std::vector<Selection> sels(s.tensors.size());
  for (std::size_t t = 0; t < s.tensors.size(); ++t) {
    const TensorInfo& ti = s.tensors[t];
    std::size_t i = 0;
    while (i < m.size() && m[i].name != ti.name) ++i;
    if (i == m.size()) return 14;
    Selection sel;
    if (part >= 0) {
      const int dim = ti.shape.size() > 1 && m[i].shard_dim == 0 ? 1 : 0;
      auto [start, len] = chunk_range(ti.shape[static_cast<std::size_t>(dim)], 2, part);
      sel = Selection{dim, start, len};
    }
    sels[t] = sel;
    want[t] = slice(late_full(m[i], i), ti.shape, esize(ti.dtype), sel.dim, sel.start, sel.length);
    got[t].assign(want[t].size(), 0xEE);
    dsts[t] = ti.name == "w" && part < 0 ? static_cast<void*>(w_dst) : got[t].data();
  }
  if (part >= 0)
    c.read_into(dsts, sels);
  else
    c.read_into(dsts);
  for (std::size_t t = 0; t < s.tensors.size(); ++t) {
    const std::uint8_t* g = dsts[t] == w_dst ? w_dst : got[t].data();
    if (std::memcmp(g, want[t].data(), want[t].size()) != 0) {
      std::fprintf(stderr, "tensor %s differs\n", s.tensors[t].name.c_str());
      return 13;
    }
  }
  return 0;
}

enum class LateRead { kVisit, kReadInto, kReadIntoChecksums };

void late_rank_round_trip(LateRead how) {
  const std::string name = unique_name("late");
  RegionGuard g{name};
  const auto m = late_model(5000);  // rank 1: 4.9 MiB of "w", three chunks
  const bool checksums = how == LateRead::kReadIntoChecksums;
  Pipe tell;
  // read_into(): rank 0 watches the whole-model worker's "w" (shared memory)
  // until rank 1's first two chunks, rows [4000, 8096), are there.
  const std::uint64_t w_bytes = numel(m[0].shape) * esize(m[0].dt);
  auto* w_dst = static_cast<std::uint8_t*>(
      ::mmap(nullptr, w_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(w_dst, MAP_FAILED);
  std::memset(w_dst, 0xEE, w_bytes);
  const auto w_full = late_full(m[0], 0);
  const std::uint64_t lo = 4000 * kLateRow, hi = (4000 + 4096) * kLateRow;
  std::function<bool()> go;
  if (how == LateRead::kVisit) {
    go = [&] { return tell.receive(10s) == 1; };
  } else {
    go = [&] {
      const auto end = std::chrono::steady_clock::now() + 10s;
      while (std::memcmp(w_dst + lo, w_full.data() + lo, hi - lo) != 0) {
        if (std::chrono::steady_clock::now() > end) return false;
        std::this_thread::sleep_for(200us);
      }
      return true;
    };
  }
  const int consumers = how == LateRead::kVisit ? 1 : 2;
  Child r0 = Child::spawn([&] { return late_rank(name, 0, m, checksums, consumers, go); });
  Child r1 = Child::spawn([&] { return late_rank(name, 1, m, checksums, consumers, {}); });
  std::vector<std::unique_ptr<Child>> readers;
  if (how == LateRead::kVisit) {
    readers.emplace_back(new Child(Child::spawn([&] { return late_visitor(name, m, &tell); })));
  } else {
    readers.emplace_back(new Child(Child::spawn([&] { return late_reader(name, m, w_dst, -1); })));
    readers.emplace_back(new Child(Child::spawn([&] { return late_reader(name, m, nullptr, 1); })));
  }
  EXPECT_EQ(r0.wait(60s), 0) << "rank 0 was not told that rank 1's chunks were read while its first was missing";
  EXPECT_EQ(r1.wait(60s), 0);
  for (auto& c : readers) EXPECT_EQ(c->wait(60s), 0);
  ::munmap(w_dst, w_bytes);
}

}  // namespace

TEST(ShardedLateRank, VisitReadsTheOtherRanksChunksFirst) { late_rank_round_trip(LateRead::kVisit); }
TEST(ShardedLateRank, ReadIntoReadsTheOtherRanksChunksFirst) { late_rank_round_trip(LateRead::kReadInto); }
TEST(ShardedLateRank, ReadIntoWithChecksumsReadsTheOtherRanksChunksFirst) {
  late_rank_round_trip(LateRead::kReadIntoChecksums);
}

// Rank 1 is killed after its first two chunks were read out of order and
// while rank 0's first is still missing: the sync fails for the consumer
// (PeerDied: a rank that owes chunks is dead; or Aborted by rank 0; or
// Closed: rank 0's process ends right after it aborted the sync, and a
// consumer that looks after that finds the region closed: the AArch64
// stage's qemu, beside the under-load tests, once did) and for rank 0
// (PeerDied), never tears.
TEST(ShardedLateRank, RankKilledWhileAnotherIsLateFailsTheSync) {
  const std::string name = unique_name("latekill");
  RegionGuard g{name};
  const auto m = late_model(5000);
  Pipe tell, go;
  Child r0 = Child::spawn([&] {
    try {
      return late_rank(name, 0, m, false, 1, [&] { return go.receive(20s) == 1; });
    } catch (const Error& e) {
      std::fprintf(stderr, "rank 0: %s\n", e.what());
      return errc_exit(e);
    }
  });
  Child r1 = Child::spawn([&] { return late_rank(name, 1, m, false, 1, {}); });
  Child c = Child::spawn([&] {
    try {
      return late_visitor(name, m, &tell);
    } catch (const Error& e) {
      std::fprintf(stderr, "consumer: %s\n", e.what());
      return errc_exit(e);
    }
  });
  ASSERT_EQ(tell.receive(20s), 1) << "the consumer did not read rank 1's chunks while rank 0's first was missing";
  r1.kill9();  // it waits for the slot of seq 6 by now, or is about to
  EXPECT_EQ(r1.wait(10s), 128 + SIGKILL);
  go.send(1);
  const int died = 20 + static_cast<int>(Errc::kPeerDied), aborted = 20 + static_cast<int>(Errc::kAborted),
            closed = 20 + static_cast<int>(Errc::kClosed);
  EXPECT_EQ(r0.wait(60s), died) << "rank 0 must see rank 1 die";
  const int rc = c.wait(60s);
  EXPECT_TRUE(rc == died || rc == aborted || rc == closed) << "consumer exit " << rc << ": the sync must fail, never tear";
}

// Rank 1 flips a byte of its first chunk after publishing it; rank 0 is late.
// The consumer reads that chunk first and fails on its checksum before rank 0
// has written anything, and tells rank 0 so.
TEST(ShardedLateRank, ChecksumFailureOfAChunkReadOutOfOrderIsDetected) {
  const std::string name = unique_name("latesum");
  RegionGuard g{name};
  const auto m = late_model(3000);  // rank 1: 2.9 MiB of "w", two chunks (the ring holds the whole sync)
  Pipe flipped, result;
  const int checksum = 20 + static_cast<int>(Errc::kChecksum);
  Child r0 = Child::spawn([&] {
    int got = -1;
    const int rc = late_rank(name, 0, m, true, 1, [&] {
      got = result.receive(10s);
      return got >= 0;
    });
    return rc != 0 ? rc : got == checksum ? 0 : 72;
  });
  Child r1 = Child::spawn([&] {
    return late_rank(name, 1, m, true, 1, {}, [&] {
      ProducerOptions o = rank_opts(1, 2);
      shmcast::detail::Geometry geo{};
      shmcast::detail::compute_geometry(o.max_consumers, o.slots, o.slot_bytes, o.manifest_bytes, &geo, 2);
      const int fd = ::open(region_path(name).c_str(), O_RDWR | O_CLOEXEC);
      const off_t at = static_cast<off_t>(geo.data_offset + 1 * geo.slot_bytes + 100);  // seq 2: slot 1
      std::uint8_t b = 0;
      if (fd < 0 || ::pread(fd, &b, 1, at) != 1) return;
      b ^= 0x5a;
      if (::pwrite(fd, &b, 1, at) == 1) flipped.send(1);
      ::close(fd);
    });
  });
  Child c = Child::spawn([&] {
    try {
      Consumer cons = Consumer::open(name, late_copts());
      const SyncInfo& s = cons.wait_sync(30s);
      if (flipped.receive(20s) != 1) return 73;
      std::vector<std::vector<std::uint8_t>> got;
      std::vector<void*> dsts;
      for (const TensorInfo& t : s.tensors) got.emplace_back(t.nbytes);
      for (auto& v : got) dsts.push_back(v.data());
      cons.read_into(dsts);
      result.send(0);
      return 0;
    } catch (const Error& e) {
      result.send(errc_exit(e));
      return errc_exit(e);
    }
  });
  EXPECT_EQ(c.wait(60s), checksum);
  EXPECT_EQ(r0.wait(60s), 0) << "rank 0 was not told of the checksum failure while its chunks were missing";
  EXPECT_EQ(r1.wait(60s), 0);
}
