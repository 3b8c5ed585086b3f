// Fault matrix, sharded producers: SIGKILL one rank of R (R = 2 and 3,
// every rank, rank 0 included) at every step of a sync, then restart every
// rank together on the same name.
//
// The steps, all in sync 2 of the first run: between syncs (before
// begin_sync), inside begin_sync (rank 0 gathering, or a rank waiting for
// rank 0's answer: the others are held back, and the parent sees the state
// in the region), right after begin_sync, after its first tensor is written,
// before end_sync, inside end_sync (every chunk of the victim published, the
// sync not complete: held back the same way), after end_sync.
//
// Every trial: the victim dies of the SIGKILL only; every surviving rank
// ends with PeerDied or Aborted (no hang, no Timeout: a dead peer is seen
// through its lock); a survivor that reports sync 2 done did so only if
// every consumer got it bit-exact; two consumers (read_into and visit)
// never get wrong bytes, reopen when the ranks are gone, and read both syncs
// of the restarted ranks bit-exact; the name is usable afterwards.
//
// The plain build runs all 35 trials (about 25 s on the 2-core machine); the
// sanitizer builds a third of them, every step and every rank still covered
// across R; SHMCAST_FAULT_TRIALS_PERCENT=25 (the under-load stage) a quarter.
// SHMCAST_SHARD_TRIAL=R,victim,step runs one trial (debugging).
// Counts are printed as FAULT-MATRIX {json} (see fault_support.hpp).
#include <sys/mman.h>

#include <algorithm>

#include "fault_support.hpp"
#include "protocol/rounds.hpp"

using namespace fault;
namespace rd = shmcast::detail::rounds;

namespace {

enum Point { kBetween, kInBegin, kAfterBegin, kMidWrite, kBeforeEnd, kInEnd, kAfterEnd, kPoints };
const char* const kPointNames[] = {"between_syncs", "in_begin_sync", "after_begin_sync", "mid_write",
                                   "before_end_sync", "in_end_sync", "after_end_sync"};

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif

constexpr std::int64_t kRowBytes = 1024;
constexpr std::int64_t kRowsPerRank = 3000;  // 2.9 MiB: two chunks a rank

struct ShardBoard {
  std::atomic<int> attached[2][4];    // run (0 first, 1 restart), rank
  std::atomic<int> parked;            // the victim stopped at its step
  std::atomic<int> release;           // ranks held back may go on
  std::atomic<int> sync2[4];          // rank r's sync 2 of the first run: 1 + (0 or 20 + Errc)
  std::atomic<int> verified[2][2][4]; // consumer, run, version
  std::atomic<int> mismatches;
  static ShardBoard* make() {
    void* m = ::mmap(nullptr, sizeof(ShardBoard), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    return new (m) ShardBoard{};
  }
  static void destroy(ShardBoard* b) { ::munmap(b, sizeof(ShardBoard)); }
};

// Rank r's pieces of sync `v` of run `epoch`: rows of "e<epoch>.0" (U8
// [R * 3000, 1024]) and, on the last rank, "e<epoch>.1" (U8 [5000], whole);
// the full tensors are fault_support's epoch patterns, so read_and_check()
// verifies them as they arrive.
struct RankPieces {
  std::vector<TensorSpec> specs;
  std::vector<std::vector<std::uint8_t>> data;
  RankPieces(std::uint64_t epoch, std::uint64_t v, int r, int R) {
    const std::int64_t rows = kRowsPerRank * R;
    std::vector<std::uint8_t> w(static_cast<std::size_t>(rows * kRowBytes));
    fill_pattern(w.data(), w.size(), epoch_seed(epoch, v, 0));
    TensorSpec s{"e" + std::to_string(epoch) + ".0", DType::kU8, {rows, kRowBytes}};
    s.shard_dim = 0;
    s.shard_start = kRowsPerRank * r;
    s.shard_length = kRowsPerRank;
    specs.push_back(s);
    data.emplace_back(w.begin() + s.shard_start * kRowBytes, w.begin() + (s.shard_start + kRowsPerRank) * kRowBytes);
    if (r == R - 1) {
      specs.push_back({"e" + std::to_string(epoch) + ".1", DType::kU8, {5000}});
      data.emplace_back(5000);
      fill_pattern(data.back().data(), 5000, epoch_seed(epoch, v, 1));
    }
  }
};

ProducerOptions rank_options(int r, int R) {
  ProducerOptions o;
  o.slot_bytes = kSlot;
  o.slots = static_cast<std::uint32_t>(2 * R);
  o.max_consumers = 2;
  o.manifest_bytes = 64 << 10;
  o.rank = static_cast<std::uint32_t>(r);
  o.world_size = static_cast<std::uint32_t>(R);
  o.pin = Pin::kNo;
  o.engine = CopyEngine::kHost;
  o.consumer_timeout = 20s;
  o.rank_timeout = 20s;
  return o;
}

// One rank of run `run` (0: the first, whose victim dies at `point` of sync
// 2; 1: the restart). Returns 0 after every sync, or 20 + Errc at the first
// error (the trainer would restart).
int matrix_rank(const std::string& name, ShardBoard* b, int run, int R, int r, int victim, Point point) {
  const bool first = run == 0, me = first && r == victim;
  auto park = [&] {
    b->parked.store(1);
    ::pause();  // SIGKILLed here
  };
  auto hold = [&] { wait_for([&] { return b->release.load() == 1; }, 60s); };
  try {
    Producer p = Producer::create(name, rank_options(r, R));
    if (r == 0) p.wait_for_consumers(2, 30s);
    b->attached[run][r].store(1);
    if (!wait_for([&] {
          for (int k = 0; k < R; ++k)
            if (b->attached[run][k].load() == 0) return false;
          return true;
        }))
      return 92;
    const int syncs = first ? 3 : 2;
    for (int v = 1; v <= syncs; ++v) {
      const bool at = first && v == 2;
      try {
        if (me && at && point == kBetween) park();
        if (at && !me && point == kInBegin) hold();  // the victim waits in begin_sync alone
        RankPieces pc(static_cast<std::uint64_t>(run + 1), static_cast<std::uint64_t>(v), r, R);
        p.begin_sync(pc.specs);
        if (me && at && point == kAfterBegin) park();
        // In end_sync the victim waits for the others' last chunks (victim
        // rank 0: they hold back their last tensor, whose write publishes its
        // chunk) or for rank 0 to complete the sync (rank 0 holds back its
        // end_sync).
        const bool hold_in_end = at && !me && point == kInEnd;
        for (std::size_t i = 0; i < pc.specs.size(); ++i) {
          if (hold_in_end && victim == 0 && i + 1 == pc.specs.size()) hold();
          p.write(i, pc.data[i].data());
          if (me && at && point == kMidWrite && i == 0) park();
        }
        if (me && at && point == kBeforeEnd) park();
        if (hold_in_end && victim != 0 && r == 0) hold();
        p.end_sync();
        if (me && at && point == kAfterEnd) park();
        if (at) b->sync2[r].store(1);
      } catch (const Error& e) {
        if (first && v == 2) b->sync2[r].store(1 + errc_exit(e));
        return errc_exit(e);
      }
    }
    if (r == 0) p.wait_drained(30s);
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "rank %d (run %d): %s\n", r, run, e.what());
    return errc_exit(e);
  }
}

// Reads the sync `info` announced (read_into, or visit when `use_visit`:
// each piece lies within its shard, and the shards here are rows along dim
// 0, so a shard's bytes start at its first row) and checks every byte.
bool read_sharded(Consumer& c, const SyncInfo& info, bool use_visit) {
  if (!use_visit) return read_and_check(c, info, false);
  const std::uint64_t epoch = epoch_of(info);
  std::vector<std::vector<std::uint8_t>> got;
  for (const auto& t : info.tensors) got.emplace_back(t.nbytes, 0xEE);
  c.visit([&](const Piece& p) {
    const TensorInfo& t = info.tensors[p.tensor];
    const ShardInfo& sh = t.shards[p.shard];
    const std::uint64_t row = t.shape.empty() || t.shape[0] == 0 ? 0 : t.nbytes / static_cast<std::uint64_t>(t.shape[0]);
    const std::uint64_t at = (sh.dim == 0 ? static_cast<std::uint64_t>(sh.start) * row : 0) + p.offset;
    if (p.bytes && at + p.bytes <= got[p.tensor].size()) std::memcpy(got[p.tensor].data() + at, p.data, p.bytes);
  });
  for (std::size_t i = 0; i < got.size(); ++i) {
    std::vector<std::uint8_t> want(got[i].size());
    fill_pattern(want.data(), want.size(), epoch_seed(epoch, info.version, i));
    if (want != got[i]) return false;
  }
  return true;
}

// Reads until it has verified sync 2 of the restart (epoch 2); verifies
// everything it gets; Aborted: the next sync; PeerDied, Closed: opens the
// region again (the ranks restart).
int matrix_consumer(const std::string& name, ShardBoard* b, int c) {
  ConsumerOptions co = copts(60s, 60s);
  for (int opens = 0; opens < 20; ++opens) {
    try {
      Consumer cons = Consumer::open(name, co);
      for (;;) {
        const SyncInfo& info = cons.wait_sync(60s);
        const std::uint64_t epoch = epoch_of(info), v = info.version;
        bool ok = false;
        try {
          ok = read_sharded(cons, info, c == 1);
        } catch (const Error& e) {
          if (e.code() == Errc::kAborted) continue;
          throw;
        }
        if (!ok) {
          b->mismatches.fetch_add(1);
          return kMismatchExit;
        }
        if (epoch >= 1 && epoch <= 2 && v < 4) b->verified[c][epoch - 1][v].store(1);
        if (epoch == 2 && v >= 2) return 0;
      }
    } catch (const Error& e) {
      if (e.code() != Errc::kPeerDied && e.code() != Errc::kClosed) {
        std::fprintf(stderr, "consumer %d: %s\n", c, e.what());
        return errc_exit(e);
      }
    }
  }
  return 98;
}

// The region as the parent sees it (read-only), to tell when the victim is
// inside begin_sync or end_sync.
struct Peek {
  int fd = -1;
  void* base = MAP_FAILED;
  std::size_t bytes = 0;
  ~Peek() {
    if (base != MAP_FAILED) ::munmap(base, bytes);
    if (fd >= 0) ::close(fd);
  }
  bool open(const std::string& name) {
    fd = ::open(region_path(name).c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    struct stat st {};
    if (::fstat(fd, &st) == 0 && st.st_size >= 4096) {
      bytes = static_cast<std::size_t>(st.st_size);
      base = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
    }
    if (base != MAP_FAILED) return true;
    ::close(fd);
    fd = -1;
    return false;
  }
  const detail::Header& h() const { return *static_cast<const detail::Header*>(base); }
  const detail::RankSeat& seat(int r) const {
    return *reinterpret_cast<const detail::RankSeat*>(static_cast<const std::byte*>(base) + h().fixed.ranks_offset +
                                                      static_cast<std::uint64_t>(r) * detail::kRankSeatBytes);
  }
  // The victim is waiting inside the library at `point` of sync 2 (round 2).
  bool victim_waiting(int victim, int R, Point point) const {
    if (point == kInBegin)
      return victim == 0 ? h().round_open.load() == 2
                         : seat(victim).post.load() == rd::post_word(2, rd::PostState::kList);
    // kInEnd: every chunk of the victim in sync 2 is published.
    const std::uint64_t first = h().sync.first_seq.load(), chunks = h().sync.chunks.load();
    if (h().sync.version.load() != 2 || chunks == 0) return false;
    const std::uint64_t last = first + (chunks / R - 1) * R + victim;
    return seat(victim).published_seq.load() >= last;
  }
};

void trial(Matrix& m, int R, int victim, Point point) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::string name = unique_name("ks");
  RegionGuard guard{name};
  ShardBoard* b = ShardBoard::make();
  std::vector<std::unique_ptr<Child>> consumers, ranks;
  for (int c = 0; c < 2; ++c) consumers.emplace_back(new Child(Child::spawn([&, c] { return matrix_consumer(name, b, c); })));
  for (int r = 0; r < R; ++r)
    ranks.emplace_back(new Child(Child::spawn([&, r] { return matrix_rank(name, b, 0, R, r, victim, point); })));
  bool reached;
  if (point == kInBegin || point == kInEnd) {
    Peek peek;
    reached = wait_for([&] { return b->attached[0][0].load() == 1 && (peek.base != MAP_FAILED || peek.open(name)) &&
                                    peek.victim_waiting(victim, R, point); },
                       30s);
  } else {
    reached = wait_for([&] { return b->parked.load() == 1; }, 30s);
  }
  if (!reached) {
    ++m.unexpected;
    m.note("victim", std::string("never_reached:") + kPointNames[point]);
  }
  ranks[static_cast<std::size_t>(victim)]->kill9();
  m.child("victim", ranks[static_cast<std::size_t>(victim)]->wait(30s), {}, SIGKILL);
  b->release.store(1);
  for (int r = 0; r < R; ++r)
    if (r != victim)
      m.child("survivor", ranks[static_cast<std::size_t>(r)]->wait(60s), {code(Errc::kPeerDied), code(Errc::kAborted)});
  // A survivor that reported sync 2 done: every consumer must get it.
  bool done2 = false;
  for (int r = 0; r < R; ++r) done2 |= r != victim && b->sync2[r].load() == 1;
  m.note("sync2", done2 ? "done_on_survivors" : "failed_on_survivors");
  // Every rank restarts together.
  std::vector<std::unique_ptr<Child>> again;
  for (int r = 0; r < R; ++r)
    again.emplace_back(new Child(Child::spawn([&, r] { return matrix_rank(name, b, 1, R, r, -1, point); })));
  for (auto& r : again) m.child("restarted", r->wait(60s), {0});
  for (auto& c : consumers) m.child("consumer", c->wait(60s), {0});
  for (int c = 0; c < 2; ++c) {
    const bool all = b->verified[c][0][1].load() && b->verified[c][1][1].load() && b->verified[c][1][2].load();
    if (!all || (done2 && !b->verified[c][0][2].load())) {
      ++m.unexpected;
      m.note("consumer", all ? "missed_a_sync_a_rank_reported_done" : "missed_a_sync");
      ADD_FAILURE() << "R " << R << " victim " << victim << " at " << kPointNames[point] << ": consumer " << c
                    << " verified e1v1 " << b->verified[c][0][1].load() << " e1v2 " << b->verified[c][0][2].load()
                    << " e2v1 " << b->verified[c][1][1].load() << " e2v2 " << b->verified[c][1][2].load()
                    << (done2 ? " (a rank reported e1v2 done)" : "");
    }
  }
  for (int c = 0; c < 2; ++c)
    for (int e = 0; e < 2; ++e)
      for (int v = 1; v < 4; ++v) m.syncs_verified += b->verified[c][e][v].load();
  m.mismatches += b->mismatches.load();
  std::string why;
  if (!fresh_pair_syncs(name, &why)) {
    ++m.unreusable;
    ADD_FAILURE() << "R " << R << " victim " << victim << " at " << kPointNames[point] << ": not reusable: " << why;
  }
  m.note("kill_at", kPointNames[point]);
  m.trial_done();
  std::fprintf(stderr, "trial R %d victim %d at %s: %.2f s\n", R, victim, kPointNames[point],
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  ShardBoard::destroy(b);
}

}  // namespace

TEST(FaultMatrix, Kill9ShardedRankAtEveryStep) {
  Matrix m("kill9_sharded_rank", run_seed());
  // Every stride-th trial (stride: 3 sanitized; 100 / the share that
  // SHMCAST_FAULT_TRIALS_PERCENT asks, see trials()): each residue of
  // victim + step + R still meets every step and every rank. Which residue
  // comes from the run's seed, so that repeated runs (scripts/soak) cover
  // every trial, not the same share each time.
  int stride = kSanitized ? 3 : 1;
  if (const char* pct = std::getenv("SHMCAST_FAULT_TRIALS_PERCENT"); pct && *pct) {
    const int share = std::atoi(pct);
    if (share > 0 && share < 100) stride = std::max(stride, (100 + share / 2) / share);
  }
  const int residue = static_cast<int>(m.seed % static_cast<std::uint64_t>(stride));
  for (int R : {2, 3})
    for (int victim = 0; victim < R; ++victim)
      for (int p = 0; p < kPoints; ++p) {
        if ((victim + p + R) % stride != residue) continue;
        if (const char* only = std::getenv("SHMCAST_SHARD_TRIAL"); only && *only &&
            std::to_string(R) + "," + std::to_string(victim) + "," + std::to_string(p) != only)
          continue;
        trial(m, R, victim, static_cast<Point>(p));
      }
  m.finish();
}
