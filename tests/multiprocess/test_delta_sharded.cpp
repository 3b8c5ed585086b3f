// Delta syncs from sharded producers (docs/protocol.md §12.1, "Sharded
// producers"): R producer rank processes each keep the base of their own
// shards and encode their changes; the ranks agree each round's kind
// (full, or every rank a delta against one base); consumers apply each
// rank's blobs to whole tensors or TP slices, bit-exact every version (a TP
// slice across a rank's piece takes deltas only with checks off; with them
// on, such a delta is refused and a full sync read instead).
// Faults: a rank whose own keyframe or fallback makes the round full (the
// kind mismatch), a consumer that skips versions or asks for a full sync,
// a rank killed mid-delta (an error, never wrong data), a rank restarted
// between syncs (no base: the round is full).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <cmath>
#include <random>

#include "protocol/rounds.hpp"
#include "shmcast/shmcast.hpp"
#include "support.hpp"

using namespace shmcast;
using namespace shmcast_test;
using namespace std::chrono_literals;

namespace {

std::int64_t mono_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct TDef {
  std::string name;
  DType dt;
  std::vector<std::int64_t> shape;
  int shard_dim;  // -1: whole, owned by the last rank
};

// bf16, fp32, fp8 and fp16 shards along dim 0 and dim 1, a c128 tensor (sent
// as its bytes), empty shards (R > 2), and a tensor whose shards are larger
// than a slot (its blobs cross chunks when many elements change).
std::vector<TDef> model() {
  return {
      {"w", DType::kBF16, {96, 1500}, 0},
      {"norm", DType::kF32, {300, 333}, 1},
      {"fp8", DType::kF8E4M3FN, {64, 1000}, 1},
      {"u8", DType::kU8, {5000}, 0},
      {"h", DType::kF16, {100, 77}, -1},
      {"rot", DType::kC128, {10}, -1},
      {"z", DType::kF32, {2, 3}, 0},
      {"big", DType::kBF16, {3072, 1024}, 0},
  };
}

std::uint64_t numel(const std::vector<std::int64_t>& s) {
  std::uint64_t n = 1;
  for (auto d : s) n *= static_cast<std::uint64_t>(d);
  return n;
}

// The logical tensors at each version: version v makes f * n changes, f a
// random 0.5-30 % (every 7th version 70 % for "big": its blobs then exceed a
// slot), at random elements, some twice: 1 - e^-f of the elements, 0.5-26 %
// (about half of "big"), change to other bits. Deterministic in the version
// (support.hpp's change_elements).
struct Weights {
  std::vector<TDef> m = model();
  std::vector<std::vector<std::uint8_t>> data;
  std::uint64_t at = 1;
  Weights() {
    for (std::size_t i = 0; i < m.size(); ++i) {
      data.emplace_back(numel(m[i].shape) * dtype_size(m[i].dt));
      fill_pattern(data.back().data(), data.back().size(), 0xd17a + i);
    }
  }
  void step(std::uint64_t v) {
    for (std::size_t i = 0; i < m.size(); ++i) {
      const std::size_t z = dtype_size(m[i].dt);
      // Each version's fractions as this test has always drawn them (its
      // kinds of rounds depend on them); the positions from a faster stream.
      double f = 0.005 + 0.295 * static_cast<double>(std::mt19937_64(v * 7919 + i)() % 10001) / 10000.0;
      SplitMix rng{v * 7919 + i};
      if (m[i].name == "big" && v % 7 == 0) f = 0.70;
      // f * n changes at random positions, some on the same element, as
      // this test first drew them: 1 - e^-f of the elements, about half of
      // "big" in its 70 % versions.
      change_elements(data[i].data(), data[i].size(), z, 1.0 - std::exp(-f), rng);
    }
  }
  void advance_to(std::uint64_t v) {
    while (at < v) step(++at);
  }
};

// torch.chunk's split: ceil(n / R) rows each, the last ones shorter or empty.
std::pair<std::int64_t, std::int64_t> chunk_range(std::int64_t n, int R, int r) {
  const std::int64_t c = (n + R - 1) / R;
  const std::int64_t start = std::min<std::int64_t>(n, c * r);
  return {start, std::min<std::int64_t>(n, start + c) - start};
}

// Rows [start, start + len) along `dim` of a row-major tensor, contiguous.
std::vector<std::uint8_t> slice(const std::vector<std::uint8_t>& full, const std::vector<std::int64_t>& shape,
                                std::uint64_t es, int dim, std::int64_t start, std::int64_t len) {
  if (dim < 0) return full;
  std::uint64_t outer = 1, inner = es;
  for (int d = 0; d < dim; ++d) outer *= static_cast<std::uint64_t>(shape[static_cast<std::size_t>(d)]);
  for (std::size_t d = static_cast<std::size_t>(dim) + 1; d < shape.size(); ++d)
    inner *= static_cast<std::uint64_t>(shape[d]);
  const auto n = static_cast<std::uint64_t>(shape[static_cast<std::size_t>(dim)]);
  const auto l = static_cast<std::uint64_t>(len);
  std::vector<std::uint8_t> out(outer * l * inner);
  if (out.empty()) return out;
  for (std::uint64_t o = 0; o < outer; ++o)
    std::memcpy(out.data() + o * l * inner, full.data() + (o * n + static_cast<std::uint64_t>(start)) * inner, l * inner);
  return out;
}

// Rank r's pieces of the weights.
struct Shards {
  std::vector<TensorSpec> specs;
  std::vector<std::vector<std::uint8_t>> data;
  std::uint64_t bytes = 0;
  Shards(const Weights& w, int r, int R) {
    for (std::size_t i = 0; i < w.m.size(); ++i) {
      const TDef& t = w.m[i];
      TensorSpec s{t.name, t.dt, t.shape};
      if (t.shard_dim < 0) {
        if (r != R - 1) continue;
        data.push_back(w.data[i]);
      } else {
        auto [start, len] = chunk_range(t.shape[static_cast<std::size_t>(t.shard_dim)], R, r);
        s.shard_dim = t.shard_dim;
        s.shard_start = start;
        s.shard_length = len;
        data.push_back(slice(w.data[i], t.shape, dtype_size(t.dt), t.shard_dim, start, len));
      }
      bytes += data.back().size();
      specs.push_back(s);
    }
  }
  std::vector<const void*> ptrs() const {
    std::vector<const void*> p;
    for (const auto& d : data) p.push_back(d.data());
    return p;
  }
};

ProducerOptions rank_opts(int r, int R) {
  ProducerOptions o;
  o.slot_bytes = 2 << 20;
  o.slots = static_cast<std::uint32_t>(2 * R);
  o.max_consumers = 4;
  o.rank = static_cast<std::uint32_t>(r);
  o.world_size = static_cast<std::uint32_t>(R);
  o.pin = Pin::kNo;
  o.engine = CopyEngine::kHost;
  o.delta = true;
  o.delta_max_ratio = 0.95;
  o.checksums = true;
  o.consumer_timeout = 30s * kSlowdown;
  o.rank_timeout = 30s * kSlowdown;
  return o;
}

ConsumerOptions copts(bool verify = true) {
  ConsumerOptions o;
  o.verify_checksums = verify;
  o.pin = Pin::kNo;
  o.open_timeout = 30s;
  o.chunk_timeout = 30s * kSlowdown;
  return o;
}

// Shared between the test's processes: per version, the kind each rank and
// each consumer saw (0 none yet, 1 full, 2 delta).
struct Kinds {
  std::atomic<int> rank[4][64];
  std::atomic<int> consumer[4][64];
  std::atomic<int> flag[8];
  static Kinds* make() {
    void* m = ::mmap(nullptr, sizeof(Kinds), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    return new (m) Kinds{};
  }
};

// How a rank behaves (every rank names each version: begin_sync(specs, v)).
struct RankPlan {
  int versions = 32;
  std::uint32_t keyframe_every = 0;
  double max_ratio = 0.95;
  int pause_joined_at = 0;    // pauses (to be killed) once it hears go for this version
  int pause_after = 0;        // pauses (to be killed) once this version's end_sync returned
  int first = 1;              // its first version (a restarted rank)
  bool tolerate_failure = false;  // a failed sync is reported in its kinds, not fatal
  int wait_flag = -1;         // before version wait_at: waits until this flag is set
  int wait_at = 0;
  std::uint32_t consumers = 3;  // rank 0 waits for this many before its first sync
};

int run_rank(const std::string& name, int r, int R, const RankPlan& plan, Kinds* k) {
  ProducerOptions o = rank_opts(r, R);
  o.keyframe_every = plan.keyframe_every;
  o.delta_max_ratio = plan.max_ratio;
  if (plan.pause_joined_at > 0) {
    detail::test_point = [&](const detail::TestPointArgs& a) {
      if (a.at == detail::TestPoint::kJoined && a.round == static_cast<std::uint64_t>(plan.pause_joined_at)) {
        k->flag[0].store(1);
        ::pause();
      }
    };
  }
  Producer p = Producer::create(name, o);
  if (plan.first > 1) k->flag[2].store(1);  // a restarted rank: attached
  if (r == 0 && plan.first == 1) p.wait_for_consumers(plan.consumers, 30s);
  Weights w;
  for (int v = plan.first; v <= plan.versions; ++v) {
    if (plan.wait_flag >= 0 && v == plan.wait_at)
      while (k->flag[plan.wait_flag].load() == 0) ::usleep(1000);
    w.advance_to(static_cast<std::uint64_t>(v));
    const Shards s(w, r, R);
    try {
      if (p.send(s.specs, s.ptrs(), static_cast<std::uint64_t>(v)) != static_cast<std::uint64_t>(v)) return 10;
    } catch (const Error& e) {
      if (!plan.tolerate_failure) {
        std::fprintf(stderr, "rank %d version %d: %s\n", r, v, e.what());
        return 20 + static_cast<int>(e.code());
      }
      k->rank[r][v].store(3);
      continue;
    }
    const SyncReport rep = p.last_sync();
    if (rep.version != static_cast<std::uint64_t>(v) || rep.logical_bytes != s.bytes) return 11;
    if (p.delta_base_bytes() != s.bytes) return 12;  // the base holds this rank's shards only
    if (rep.delta && rep.payload_bytes >= rep.logical_bytes) return 13;
    k->rank[r][v].store(rep.delta ? 2 : 1);
    if (v == plan.pause_after) {
      k->flag[1].store(1);
      ::pause();
    }
  }
  if (r == 0) p.wait_drained(30s);
  return 0;
}

// A consumer: whole tensors (part < 0) or TP slices (part 0 or 1 of 2, along
// the other dim than the tensor is sharded on when part is 0, the same dim
// when 1). `skip`: versions it lets go without reading; `ask_full_after`:
// after reading it, asks for a full sync. Reads until version `last`;
// every read bit-exact.
struct ConsumerPlan {
  int part = -1;
  int last = 32;
  std::vector<int> skip;
  int ask_full_after = 0;
  bool expect_error = false;  // a rank dies: some read fails (never wrong data)
  // Checks off: a TP slice across a rank's piece takes deltas unchecked
  // (with checks on, such a delta is refused: run_slice_consumer).
  bool verify = true;
};

ConsumerPlan plan_part(int part) {
  ConsumerPlan p;
  p.part = part;
  p.verify = part < 0;
  return p;
}

// The TP slice of part `part` (as run_consumer reads it) of tensor `t`, or
// the whole tensor (dim -1) for a 1-d one.
Selection part_selection(const TDef& t, int part) {
  if (part < 0 || t.shape.size() < 2) return Selection{};
  const int dim = part == 0 ? (t.shard_dim == 0 ? 1 : 0) : std::max(t.shard_dim, 0);
  auto [start, len] = chunk_range(t.shape[static_cast<std::size_t>(dim)], 2, part);
  return Selection{dim, start, len};
}

int run_consumer(const std::string& name, int id, const ConsumerPlan& plan, Kinds* k) {
  Consumer c = Consumer::open(name, copts(plan.verify));
  Weights w;
  const std::vector<TDef> m = model();
  bool missed = false;  // the last version was not read into the destinations
  bool asked = false;
  int errors = 0;
  std::vector<std::vector<std::uint8_t>> got;
  std::vector<void*> dsts;
  std::vector<Selection> sels;
  for (;;) {
    SyncInfo s;
    try {
      s = c.wait_sync(60s * kSlowdown);
    } catch (const Error& e) {
      if (plan.expect_error && errors > 0 && e.code() == Errc::kClosed) return 0;
      std::fprintf(stderr, "consumer %d wait: %s\n", id, e.what());
      return 20 + static_cast<int>(e.code());
    }
    const auto v = static_cast<int>(s.version);
    w.advance_to(s.version);
    if (std::find(plan.skip.begin(), plan.skip.end(), v) != plan.skip.end()) {
      c.skip();
      missed = true;
      if (v == plan.last) return 0;
      continue;
    }
    // A delta is only ever handed to a consumer whose destinations hold its base.
    if (s.delta() && (missed || asked)) return 30;
    if (got.empty()) {
      got.resize(m.size());
      dsts.resize(m.size());
      sels.resize(m.size());
      for (std::size_t i = 0; i < m.size(); ++i) {
        const TDef& t = m[i];
        const auto j = static_cast<std::size_t>(s.find(t.name));
        const Selection sel = part_selection(t, plan.part);
        sels[j] = sel;
        got[j].assign(sel.nbytes(s.tensors[j]), 0xEE);
        dsts[j] = got[j].data();
      }
    }
    try {
      if (plan.part >= 0)
        c.read_into(dsts, sels);
      else
        c.read_into(dsts);
    } catch (const Error& e) {
      if (!plan.expect_error) {
        std::fprintf(stderr, "consumer %d read %d: %s\n", id, v, e.what());
        return 20 + static_cast<int>(e.code());
      }
      ++errors;
      missed = true;
      k->consumer[id][v].store(3);
      continue;
    }
    for (std::size_t i = 0; i < m.size(); ++i) {
      const TDef& t = m[i];
      const auto j = static_cast<std::size_t>(s.find(t.name));
      if (got[j] != slice(w.data[i], t.shape, dtype_size(t.dt), sels[j].dim, sels[j].start, sels[j].length)) {
        std::fprintf(stderr, "consumer %d version %d (%s) tensor %s differs\n", id, v, s.delta() ? "delta" : "full",
                     t.name.c_str());
        return 31;
      }
    }
    if (c.last_sync().delta != s.delta()) return 32;
    k->consumer[id][v].store(s.delta() ? 2 : 1);
    missed = false;
    asked = false;
    if (v == plan.ask_full_after) {
      c.request_full_sync();
      asked = true;
    }
    if (v >= plan.last) return 0;
  }
}

// A consumer of whole tensors whose destination of `victim` (a tensor the
// ranks cut along dim 1: each rank's piece lands in strided rows of it) is
// changed in place after it read version `change_after`, as an engine that
// transforms its weights after loading leaves it. The next read of a delta
// must fail (kCorrupt: the pieces applied there are checked where they
// land) and never return wrong weights; the read after that is a full sync
// (the failure asked for one), and the deltas after it apply bit-exact.
int run_changed_consumer(const std::string& name, int id, const std::string& victim, int change_after, int last,
                         Kinds* k) {
  Consumer c = Consumer::open(name, copts());
  Weights w;
  const std::vector<TDef> m = model();
  std::vector<std::vector<std::uint8_t>> got(m.size());
  std::vector<void*> dsts(m.size());
  bool changed = false, failed = false;
  for (;;) {
    const SyncInfo s = c.wait_sync(60s * kSlowdown);
    const auto v = static_cast<int>(s.version);
    w.advance_to(s.version);
    if (v == 1)
      for (std::size_t j = 0; j < m.size(); ++j) {
        got[j].assign(s.tensors[j].nbytes, 0xEE);
        dsts[j] = got[j].data();
      }
    try {
      c.read_into(dsts);
    } catch (const Error& e) {
      if (!changed || failed || !s.delta() || e.code() != Errc::kCorrupt) {
        std::fprintf(stderr, "consumer %d read %d: %s\n", id, v, e.what());
        return 20 + static_cast<int>(e.code());
      }
      failed = true;
      k->consumer[id][v].store(3);
      continue;
    }
    if (changed && !failed) {
      std::fprintf(stderr, "consumer %d: version %d (%s) was applied to a changed destination and reported good\n",
                   id, v, s.delta() ? "delta" : "full");
      return 40;
    }
    for (std::size_t i = 0; i < m.size(); ++i) {
      const auto j = static_cast<std::size_t>(s.find(m[i].name));
      if (got[j] != w.data[i]) {
        std::fprintf(stderr, "consumer %d version %d (%s) tensor %s differs\n", id, v, s.delta() ? "delta" : "full",
                     m[i].name.c_str());
        return 31;
      }
    }
    k->consumer[id][v].store(s.delta() ? 2 : 1);
    if (v == change_after) {
      const auto j = static_cast<std::size_t>(s.find(victim));
      for (std::uint8_t& b : got[j]) b ^= 0x40;  // every element: each rank's piece has some the delta leaves alone
      changed = true;
    }
    if (v >= last) return 0;
  }
}

// A TP-slice reader with checks on (the default): its selection (part 0:
// across every rank's piece) holds only part of the pieces, which the blobs'
// checksums cannot check, so every delta it is handed is refused
// (kNeedsFullSync naming a tensor and verify_checksums) before a byte of
// its destinations is written; the sync after a refusal is full, and every
// full sync is bit-exact. Reads until version `last`.
int run_slice_consumer(const std::string& name, int id, int part, int last, Kinds* k) {
  Consumer c = Consumer::open(name, copts());
  Weights w;
  const std::vector<TDef> m = model();
  std::vector<std::vector<std::uint8_t>> got;
  std::vector<void*> dsts;
  std::vector<Selection> sels;
  bool refused = false;
  for (;;) {
    SyncInfo s;
    try {
      s = c.wait_sync(60s * kSlowdown);
    } catch (const Error& e) {
      // The ranks ended while this reader waited for the full sync its
      // refusal asked for: a refusal that comes after rank 0 began the
      // next sync (a delta, not handed to this reader) is answered by the
      // one after it, and after the last there is none (scripts/soak).
      if (refused && e.code() == Errc::kClosed) return 0;
      throw;
    }
    const auto v = static_cast<int>(s.version);
    w.advance_to(s.version);
    if (v >= last) return 0;
    if (refused && s.delta()) {
      std::fprintf(stderr, "consumer %d: version %d after a refusal is a delta\n", id, v);
      return 41;
    }
    if (got.empty()) {
      got.resize(m.size());
      dsts.resize(m.size());
      sels.resize(m.size());
      for (std::size_t i = 0; i < m.size(); ++i) {
        const auto j = static_cast<std::size_t>(s.find(m[i].name));
        sels[j] = part_selection(m[i], part);
        got[j].assign(sels[j].nbytes(s.tensors[j]), 0xEE);
        dsts[j] = got[j].data();
      }
    }
    const std::vector<std::vector<std::uint8_t>> before = got;
    try {
      c.read_into(dsts, sels);
    } catch (const Error& e) {
      const std::string what = e.what();
      if (!s.delta() || e.code() != Errc::kNeedsFullSync || what.find("verify_checksums") == std::string::npos ||
          what.find("holds only part of rank") == std::string::npos) {
        std::fprintf(stderr, "consumer %d read %d: %s\n", id, v, e.what());
        return 20 + static_cast<int>(e.code());
      }
      if (got != before) {
        std::fprintf(stderr, "consumer %d: the refused delta %d wrote into the destinations\n", id, v);
        return 42;
      }
      refused = true;
      k->consumer[id][v].store(3);
      continue;
    }
    if (s.delta()) {
      std::fprintf(stderr, "consumer %d: delta %d was applied to a slice across pieces, unchecked\n", id, v);
      return 40;
    }
    for (std::size_t i = 0; i < m.size(); ++i) {
      const TDef& t = m[i];
      const auto j = static_cast<std::size_t>(s.find(t.name));
      if (got[j] != slice(w.data[i], t.shape, dtype_size(t.dt), sels[j].dim, sels[j].start, sels[j].length)) {
        std::fprintf(stderr, "consumer %d version %d tensor %s differs\n", id, v, t.name.c_str());
        return 31;
      }
    }
    refused = false;
    k->consumer[id][v].store(1);
  }
}

struct Procs {
  std::string name;
  RegionGuard guard;
  Kinds* k = Kinds::make();
  std::vector<std::unique_ptr<Child>> ranks, consumers;
  explicit Procs(const std::string& tag) : name(unique_name(tag)), guard{name} {}
  void rank(int r, int R, const RankPlan& plan) {
    ranks.emplace_back(new Child(Child::spawn([=, this] { return run_rank(name, r, R, plan, k); })));
  }
  void consumer(int id, const ConsumerPlan& plan) {
    consumers.emplace_back(new Child(Child::spawn([=, this] { return run_consumer(name, id, plan, k); })));
  }
};

void bit_exact(int R) {
  Procs t("dshard" + std::to_string(R));
  for (int r = 0; r < R; ++r) t.rank(r, R, RankPlan{});
  t.consumer(0, plan_part(-1));
  t.consumer(1, plan_part(0));
  t.consumer(2, plan_part(1));
  for (int r = 0; r < R; ++r) EXPECT_EQ(t.ranks[static_cast<std::size_t>(r)]->wait(240s), 0) << "rank " << r;
  for (int i = 0; i < 3; ++i) EXPECT_EQ(t.consumers[static_cast<std::size_t>(i)]->wait(240s), 0) << "consumer " << i;
  // Version 1 full, every later one a delta, on every rank and consumer.
  for (int v = 1; v <= 32; ++v) {
    for (int r = 0; r < R; ++r) EXPECT_EQ(t.k->rank[r][v].load(), v == 1 ? 1 : 2) << "rank " << r << " v " << v;
    for (int i = 0; i < 3; ++i) EXPECT_EQ(t.k->consumer[i][v].load(), v == 1 ? 1 : 2) << "consumer " << i << " v " << v;
  }
}

}  // namespace

TEST(ShardedDelta, TwoRanksWholeAndTpSlicesBitExact) { bit_exact(2); }
TEST(ShardedDelta, ThreeRanksWholeAndTpSlicesBitExact) { bit_exact(3); }
TEST(ShardedDelta, FourRanksWithEmptyShardsBitExact) { bit_exact(4); }

// Shard(1) pieces (row-parallel layers: each rank holds columns of "norm",
// f32 [300, 333]) read whole by a consumer whose destination of "norm" was
// changed after it read version 5: version 6, a delta, fails (kCorrupt)
// instead of returning wrong weights as a good delta (it did: only pieces
// landing in one run of the destination were checked); version 7 is full
// and the rest are deltas again, bit-exact. A consumer beside it that left
// its destinations alone reads every version as a delta.
TEST(ShardedDelta, ShardOnePiecesOntoAChangedDestinationFailNeverApplyBlind) {
  const int R = 2;
  Procs t("dshardcol");
  RankPlan rp;
  rp.versions = 12;
  rp.consumers = 2;
  for (int r = 0; r < R; ++r) t.rank(r, R, rp);
  t.consumers.emplace_back(new Child(Child::spawn([&] { return run_changed_consumer(t.name, 0, "norm", 5, 12, t.k); })));
  ConsumerPlan calm;
  calm.last = 12;
  t.consumer(1, calm);
  for (auto& c : t.ranks) EXPECT_EQ(c->wait(240s), 0);
  for (auto& c : t.consumers) EXPECT_EQ(c->wait(240s), 0);
  EXPECT_EQ(t.k->rank[0][6].load(), 2) << "version 6 went out as a delta";
  EXPECT_EQ(t.k->consumer[0][6].load(), 3) << "version 6 failed on the changed destination";
  // The failure asked for a full sync: the next version the consumer reads
  // (7, or 8 when the ranks had begun 7 already: a delta it lets go) is
  // full, and deltas follow.
  int next = 7;
  while (next < 12 && t.k->consumer[0][next].load() == 0) ++next;
  EXPECT_EQ(t.k->consumer[0][next].load(), 1) << "v " << next;
  EXPECT_EQ(t.k->rank[0][next].load(), 1) << "v " << next;
  for (int v = next + 1; v <= 12; ++v) EXPECT_EQ(t.k->consumer[0][v].load(), 2) << "v " << v;
  for (int v = 2; v <= 12; ++v) EXPECT_EQ(t.k->consumer[1][v].load(), v == next ? 1 : 2) << "v " << v;
}

// A TP-slice reader (each tensor's slice across both ranks' pieces, as a TP
// worker of another layout reads them) with checks on: the blobs' checksums
// cover whole pieces, so it cannot check a delta applied to part of one. It
// refuses each delta (kNeedsFullSync, nothing written: it applied them
// unchecked), and the full sync its refusal asked for comes next,
// bit-exact. A whole-tensor reader beside it reads every version, deltas
// bit-exact between the full ones.
TEST(ShardedDelta, TpSliceAcrossPiecesRefusesDeltasThenReadsAFullSyncBitExact) {
  const int R = 2;
  Procs t("dshardtp");
  RankPlan rp;
  rp.versions = 13;
  rp.consumers = 2;
  for (int r = 0; r < R; ++r) t.rank(r, R, rp);
  t.consumers.emplace_back(new Child(Child::spawn([&] { return run_slice_consumer(t.name, 0, 0, 13, t.k); })));
  ConsumerPlan whole;
  whole.last = 13;
  t.consumer(1, whole);
  for (auto& c : t.ranks) EXPECT_EQ(c->wait(240s), 0);
  for (auto& c : t.consumers) EXPECT_EQ(c->wait(240s), 0);
  int refused = 0, full_after_refusal = 0;
  for (int v = 2; v < 13; ++v) {
    refused += t.k->consumer[0][v].load() == 3;
    if (t.k->consumer[0][v].load() == 1)
      for (int u = v - 1; u >= 2 && t.k->consumer[0][u].load() != 1; --u)
        if (t.k->consumer[0][u].load() == 3) {
          ++full_after_refusal;
          break;
        }
  }
  EXPECT_GE(refused, 2);
  EXPECT_GE(full_after_refusal, 2);
  EXPECT_EQ(t.k->consumer[0][1].load(), 1);
  for (int v = 1; v <= 13; ++v) EXPECT_EQ(t.k->consumer[1][v].load(), t.k->rank[0][v].load()) << "v " << v;
}

// The round kind mismatch: rank 1 sends a keyframe every 5th sync and falls
// back to full whenever its blobs exceed 12 % of its shards (a fraction
// rank 0 does not see), while rank 0 and rank 2 would send deltas. Each such
// round is full on every rank (rank 0 and rank 2 lay their lists of blobs
// out whole and send from their bases), every consumer reads it as full,
// and every version is bit-exact.
TEST(ShardedDelta, OneRanksKeyframeOrFallbackMakesTheRoundFull) {
  const int R = 3;
  Procs t("dshardmix");
  t.rank(0, R, RankPlan{});
  RankPlan odd;
  odd.keyframe_every = 5;
  odd.max_ratio = 0.12;
  t.rank(1, R, odd);
  t.rank(2, R, RankPlan{});
  t.consumer(0, plan_part(-1));
  t.consumer(1, plan_part(0));
  t.consumer(2, plan_part(1));
  for (auto& c : t.ranks) EXPECT_EQ(c->wait(240s), 0);
  for (auto& c : t.consumers) EXPECT_EQ(c->wait(240s), 0);
  int full = 0, delta = 0;
  for (int v = 1; v <= 32; ++v) {
    const int kind = t.k->rank[0][v].load();
    for (int r = 0; r < R; ++r) EXPECT_EQ(t.k->rank[r][v].load(), kind) << "rank " << r << " v " << v;
    for (int i = 0; i < 3; ++i) EXPECT_EQ(t.k->consumer[i][v].load(), kind) << "consumer " << i << " v " << v;
    (kind == 1 ? full : delta) += 1;
  }
  EXPECT_GE(full, 7) << "keyframes of rank 1 (and its fallbacks) make rounds full";
  EXPECT_GE(delta, 5) << "the other rounds stay deltas";
}

// A consumer that skips versions never gets a delta against a version it
// does not hold: the next one it reads is full (it asked). So is the first
// after request_full_sync(). The other consumers keep reading bit-exact.
TEST(ShardedDelta, SkippingOrAskingConsumerGetsAFullSync) {
  const int R = 2;
  Procs t("dshardskip");
  for (int r = 0; r < R; ++r) t.rank(r, R, RankPlan{});
  t.consumer(0, ConsumerPlan{-1, 32, {6, 7, 19}, 25});
  t.consumer(1, ConsumerPlan{0, 32, {12}, 0, false, false});  // TP slices across pieces: unchecked
  t.consumer(2, plan_part(-1));
  for (auto& c : t.ranks) EXPECT_EQ(c->wait(240s), 0);
  for (auto& c : t.consumers) EXPECT_EQ(c->wait(240s), 0);
  auto first_read_after = [&](int id, int v) {
    for (int u = v + 1; u <= 32; ++u)
      if (t.k->consumer[id][u].load() != 0) return t.k->consumer[id][u].load();
    return 0;
  };
  EXPECT_EQ(first_read_after(0, 7), 1);
  EXPECT_EQ(first_read_after(0, 19), 1);
  EXPECT_EQ(first_read_after(0, 25), 1);
  EXPECT_EQ(first_read_after(1, 12), 1);
  int deltas = 0;
  for (int v = 2; v <= 32; ++v) deltas += t.k->consumer[2][v].load() == 2;
  EXPECT_GE(deltas, 15);
}

// A rank killed in the middle of a delta sync (after rank 0's go, before its
// chunks): the sync fails on every rank and for every consumer reading it,
// never with wrong data; a new process takes the rank's place without a
// base, so the next round is full, and deltas follow, all bit-exact.
TEST(ShardedDelta, RankKilledMidDeltaThenRestarted) {
  const int R = 3;
  Procs t("dshardkill");
  RankPlan keep;
  keep.tolerate_failure = true;
  keep.wait_flag = 2;  // version 12 waits for the new rank 1
  keep.wait_at = 12;
  t.rank(0, R, keep);
  RankPlan victim;
  victim.pause_joined_at = 11;
  t.rank(1, R, victim);
  t.rank(2, R, keep);
  ConsumerPlan cp;
  cp.expect_error = true;
  t.consumer(0, cp);
  cp.part = 0;
  cp.verify = false;  // TP slices across pieces: deltas unchecked
  t.consumer(1, cp);
  cp.part = 1;
  t.consumer(2, cp);
  const std::int64_t until = mono_now_ns() + 60'000'000'000;
  while (t.k->flag[0].load() == 0 && mono_now_ns() < until) ::usleep(1000);
  ASSERT_EQ(t.k->flag[0].load(), 1) << "rank 1 never heard go for version 11";
  t.ranks[1]->kill9();
  EXPECT_EQ(t.ranks[1]->wait(10s), 128 + SIGKILL);
  t.ranks.erase(t.ranks.begin() + 1);
  RankPlan again;
  again.first = 12;
  t.rank(1, R, again);
  for (auto& c : t.ranks) EXPECT_EQ(c->wait(240s), 0);
  for (auto& c : t.consumers) EXPECT_EQ(c->wait(240s), 0);
  for (int r : {0, 2}) EXPECT_EQ(t.k->rank[r][11].load(), 3) << "version 11 fails on rank " << r;
  for (int i = 0; i < 3; ++i) {
    const int k11 = t.k->consumer[i][11].load();
    EXPECT_TRUE(k11 == 0 || k11 == 3) << "consumer " << i << " read version 11 (" << k11 << "): it never completed";
    EXPECT_EQ(t.k->consumer[i][12].load(), 1) << "consumer " << i;
    EXPECT_EQ(t.k->consumer[i][13].load(), 2) << "consumer " << i;
  }
  for (int r = 0; r < R; ++r) {
    EXPECT_EQ(t.k->rank[r][12].load(), 1) << "the new rank 1 has no base: version 12 is full on rank " << r;
    EXPECT_EQ(t.k->rank[r][13].load(), 2) << "rank " << r;
  }
}

// A rank restarted between two syncs (its base lost; the others' bases are
// valid): its first round is full for every rank, not a delta against bases
// its new process does not hold.
TEST(ShardedDelta, RankRestartedBetweenSyncsMakesTheNextRoundFull) {
  const int R = 2;
  Procs t("dshardrestart");
  RankPlan lead;
  lead.wait_flag = 2;
  lead.wait_at = 9;
  t.rank(0, R, lead);
  RankPlan victim;
  victim.pause_after = 8;
  t.rank(1, R, victim);
  t.consumer(0, plan_part(-1));
  t.consumer(1, plan_part(0));
  t.consumer(2, plan_part(1));
  const std::int64_t until = mono_now_ns() + 60'000'000'000;
  while (t.k->flag[1].load() == 0 && mono_now_ns() < until) ::usleep(1000);
  ASSERT_EQ(t.k->flag[1].load(), 1) << "rank 1 never finished version 8";
  t.ranks[1]->kill9();
  EXPECT_EQ(t.ranks[1]->wait(10s), 128 + SIGKILL);
  t.ranks.erase(t.ranks.begin() + 1);
  RankPlan again;
  again.first = 9;
  t.rank(1, R, again);
  for (auto& c : t.ranks) EXPECT_EQ(c->wait(240s), 0);
  for (auto& c : t.consumers) EXPECT_EQ(c->wait(240s), 0);
  for (int v = 1; v <= 32; ++v) {
    const int want = v == 1 || v == 9 ? 1 : 2;
    EXPECT_EQ(t.k->rank[0][v].load(), want) << "v " << v;
    for (int i = 0; i < 3; ++i) EXPECT_EQ(t.k->consumer[i][v].load(), want) << "consumer " << i << " v " << v;
  }
}
