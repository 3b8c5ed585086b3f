// The CUDA delta kernels (lib/core/engine/kernels/delta.cu) compiled for the host
// and run by a small emulator, through the codec's own launch sequences
// (delta_launch.hpp) and status handling, against the host codec: so the
// kernels' logic (indexing, block-wide scans and sums, compaction, padding,
// validation, slice mapping, grid-stride loops) is tested on every machine,
// GPU or not. tests/gpu/test_delta_gpu.cpp runs the same comparisons on a
// real GPU.
//
// The emulator runs one CUDA block at a time, its threads as fibers on the
// calling thread (made once with makecontext, switched with _setjmp and
// _longjmp) that switch only at __syncthreads and at warp shuffles (which
// wait for the warp's other lanes), in turn or (g_warp_ahead) a warp at a
// time. What it cannot show: races between blocks (blocks run
// one after another), memory-model effects, misaligned device accesses and
// the GPU's speed. Not run under ASan or TSan: they do not follow stack
// switches made this way.
#include <gtest/gtest.h>
#include <ucontext.h>

#include <csetjmp>
#include <cstdlib>
#include <functional>
#include <memory>
#include <type_traits>
#include <vector>

#include "protocol/delta_launch.hpp"
#include "delta_support.hpp"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define SHMCAST_EMU_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define SHMCAST_EMU_SANITIZED 1
#endif
#endif

// ---------------------------------------------------------------- emulator

namespace emu {

struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};

constexpr std::size_t kStack = 64 * 1024;
constexpr unsigned kMaxThreads = 1024;

struct Fiber {
  ucontext_t uc;
  jmp_buf jb;
  bool started = false, done = false;
};

struct State {
  unsigned threads = 0, current = 0, live = 0;
  std::vector<Fiber> fibers = std::vector<Fiber>(kMaxThreads);
  std::unique_ptr<char[]> stacks{new char[kMaxThreads * kStack]};  // untouched pages cost nothing
  jmp_buf sched;
  ucontext_t sched_uc;
  std::function<void()> body;
  unsigned bar_arrived = 0, bar_gen = 0;
  unsigned warp_arrived[kMaxThreads / 32] = {}, warp_gen[kMaxThreads / 32] = {}, warp_live[kMaxThreads / 32] = {};
  unsigned long long slot[kMaxThreads] = {};
  std::uint64_t switches = 0;
};

inline State& st() {
  static State* s = new State;  // leaked: fibers' stacks live in it
  return *s;
}

inline Dim3 g_block_idx, g_block_dim, g_grid_dim;
inline Dim3 thread_idx() { return Dim3{st().current, 0, 0}; }

inline void yield() {
  State& s = st();
  if (++s.switches > 4'000'000'000ull) {
    std::fprintf(stderr, "emulator: no progress (a barrier some threads never reach?)\n");
    std::abort();
  }
  if (!_setjmp(s.fibers[s.current].jb)) _longjmp(s.sched, 1);
}

inline void release_waiters() {
  State& s = st();
  if (s.bar_arrived > 0 && s.bar_arrived >= s.live) s.bar_arrived = 0, ++s.bar_gen;
  const unsigned w = s.current / 32;
  if (s.warp_arrived[w] > 0 && s.warp_arrived[w] >= s.warp_live[w]) s.warp_arrived[w] = 0, ++s.warp_gen[w];
}

inline void syncthreads() {
  State& s = st();
  const unsigned gen = s.bar_gen;
  if (++s.bar_arrived >= s.live) {
    s.bar_arrived = 0;
    ++s.bar_gen;
    return;
  }
  while (s.bar_gen == gen) yield();
}

inline void syncwarp() {
  State& s = st();
  const unsigned w = s.current / 32, gen = s.warp_gen[w];
  if (++s.warp_arrived[w] >= s.warp_live[w]) {
    s.warp_arrived[w] = 0;
    ++s.warp_gen[w];
    return;
  }
  while (s.warp_gen[w] == gen) yield();
}

template <class T>
T shfl(T v, int delta, bool down) {
  State& s = st();
  const unsigned t = s.current, lane = t % 32;
  s.slot[t] = static_cast<unsigned long long>(v);
  syncwarp();
  T r = v;
  if (down && lane + static_cast<unsigned>(delta) < 32) r = static_cast<T>(s.slot[t + delta]);
  if (!down && lane >= static_cast<unsigned>(delta)) r = static_cast<T>(s.slot[t - delta]);
  syncwarp();
  return r;
}

// A fiber's life: it runs the block's body, reports that it is done, and
// waits in its jmp_buf until the scheduler starts it again for the next
// block (or launch); so each fiber is made once per process.
inline void entry() {
  for (;;) {
    State& s = st();
    s.body();
    s.fibers[s.current].done = true;
    --s.live;
    --s.warp_live[s.current / 32];
    release_waiters();
    if (!_setjmp(s.fibers[s.current].jb)) _longjmp(s.sched, 1);
  }
}

// The order fibers run in: round robin (each thread one step, to its next
// switch, in turn), or with g_warp_ahead each warp kAhead steps before the
// next warp's, so that a warp runs ahead of the others up to their next
// __syncthreads: shared memory one warp still reads while another already
// rewrites it then shows (round robin keeps every warp in step).
inline bool g_warp_ahead = false;
constexpr unsigned kAhead = 64;

inline void run_block() {
  State& s = st();
  const unsigned n = g_block_dim.x;
  if (n == 0 || n > kMaxThreads || n % 32 != 0) std::abort();  // every launch uses whole warps (or 1 thread)
  s.threads = n;
  s.live = n;
  s.bar_arrived = 0;
  for (unsigned w = 0; w < n / 32; ++w) s.warp_arrived[w] = 0, s.warp_live[w] = 32;
  for (unsigned t = 0; t < n; ++t) {
    Fiber& f = s.fibers[t];
    f.done = false;
    if (f.started) continue;  // waiting at the end of entry()'s loop
    getcontext(&f.uc);
    f.uc.uc_stack.ss_sp = s.stacks.get() + t * kStack;
    f.uc.uc_stack.ss_size = kStack;
    f.uc.uc_link = nullptr;
    makecontext(&f.uc, entry, 0);
  }
  while (s.live > 0) {
    static unsigned t, k;  // not locals: read after _setjmp returns again
    const unsigned passes = g_warp_ahead ? kAhead : 1;
    for (k = 0; k < n * passes; ++k) {
      t = g_warp_ahead ? (k / (32 * kAhead)) * 32 + k % 32 : k;
      if (s.fibers[t].done) continue;
      s.current = t;
      if (!_setjmp(s.sched)) {
        if (!s.fibers[t].started) {
          s.fibers[t].started = true;
          swapcontext(&s.sched_uc, &s.fibers[t].uc);
        } else {
          _longjmp(s.fibers[t].jb, 1);
        }
      }
    }
  }
}

// One thread (reset, finish) runs as a warp of 32 whose other lanes return
// at once: the kernels' single-thread paths check threadIdx.x.
inline void launch(unsigned grid, unsigned block, std::function<void()> body) {
  st().body = std::move(body);
  g_grid_dim = Dim3{grid, 1, 1};
  g_block_dim = Dim3{block == 1 ? 32 : block, 1, 1};
  for (unsigned b = 0; b < grid; ++b) {
    g_block_idx = Dim3{b, 0, 0};
    run_block();
  }
}

}  // namespace emu

// What delta.cu needs of CUDA, on the host.
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define threadIdx (::emu::thread_idx())
#define blockIdx (::emu::g_block_idx)
#define blockDim (::emu::g_block_dim)
#define gridDim (::emu::g_grid_dim)
inline void __syncthreads() { emu::syncthreads(); }
template <class T>
T __shfl_down_sync(unsigned, T v, int d) {
  return emu::shfl(v, d, true);
}
template <class T>
T __shfl_up_sync(unsigned, T v, int d) {
  return emu::shfl(v, d, false);
}
struct uint4 {
  unsigned x, y, z, w;
};
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline unsigned atomicOr(unsigned* p, unsigned v) {
  const unsigned o = *p;
  *p = o | v;
  return o;
}
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  const unsigned long long o = *p;
  *p = o + v;
  return o;
}

#include "engine/kernels/delta.cu"

#undef threadIdx
#undef blockIdx
#undef blockDim
#undef gridDim

// ---------------------------------------------------------------- launcher

using namespace delta_test;
using shmcast::Errc;
using shmcast::Error;
namespace d = shmcast::detail::delta;

namespace {

// Runs the launches of delta_launch.hpp on the emulator. max_grid < the
// requested grid exercises the kernels' grid-stride loops.
struct EmuLauncher {
  unsigned max_grid = ~0u;
  int launches = 0;
  template <class A>
  void launch(d::Kernel k, std::uint32_t w, unsigned grid, unsigned threads, const A& args) {
    if (grid > max_grid) grid = max_grid;
    ++launches;
    const int wi = w == 1 ? 0 : w == 2 ? 1 : w == 4 ? 2 : 3;
    std::function<void()> body;
    if constexpr (std::is_same_v<A, d::CountArgs>) {
      void (*const fs[4])(d::CountArgs) = {shmcast_delta_count_w1, shmcast_delta_count_w2, shmcast_delta_count_w4,
                                           shmcast_delta_count_w8};
      body = [f = fs[wi], args] { f(args); };
    } else if constexpr (std::is_same_v<A, d::EncodeArgs>) {
      void (*const fs[4])(d::EncodeArgs) = {shmcast_delta_encode_w1, shmcast_delta_encode_w2, shmcast_delta_encode_w4,
                                            shmcast_delta_encode_w8};
      body = [f = fs[wi], args] { f(args); };
    } else if constexpr (std::is_same_v<A, d::ValidateArgs>) {
      void (*const fs[4])(d::ValidateArgs) = {shmcast_delta_validate_w1, shmcast_delta_validate_w2,
                                              shmcast_delta_validate_w4, shmcast_delta_validate_w8};
      body = [f = fs[wi], args] { f(args); };
    } else if constexpr (std::is_same_v<A, d::ApplyArgs>) {
      void (*const fs[4])(d::ApplyArgs) = {shmcast_delta_apply_w1, shmcast_delta_apply_w2, shmcast_delta_apply_w4,
                                           shmcast_delta_apply_w8};
      body = [f = fs[wi], args] { f(args); };
    } else if constexpr (std::is_same_v<A, d::ScanArgs>) {
      body = [args] { shmcast_delta_scan(args); };
    } else if constexpr (std::is_same_v<A, d::ChecksumArgs>) {
      body = [args] { shmcast_delta_checksum(args); };
    } else if constexpr (std::is_same_v<A, d::FinishArgs>) {
      body = [args] { shmcast_delta_finish(args); };
    } else if constexpr (std::is_same_v<A, d::BatchArgs>) {
      void (*f)(d::BatchArgs) = k == d::Kernel::kBatchReset      ? shmcast_batch_reset
                                : k == d::Kernel::kBatchValidate ? shmcast_batch_validate
                                : k == d::Kernel::kBatchApply    ? shmcast_batch_apply
                                : k == d::Kernel::kBatchChecksum ? shmcast_batch_checksum
                                                                 : shmcast_batch_finish;
      body = [f, args] { f(args); };
    } else if constexpr (std::is_same_v<A, d::EncodeBatchArgs>) {
      body = [args] { shmcast_batch_encode(args); };
    } else if constexpr (std::is_same_v<A, d::PlanBatchArgs>) {
      void (*f)(d::PlanBatchArgs) = k == d::Kernel::kBatchCount ? shmcast_batch_count : shmcast_batch_scan;
      body = [f, args] { f(args); };
    } else {
      static_assert(std::is_same_v<A, d::ResetArgs>);
      body = [args] { shmcast_delta_reset(args); };
    }
    (void)k;
    emu::launch(grid, threads, std::move(body));
  }
};

std::uint64_t addr(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

// An emulated device codec: memory is the host's; the status words live here.
struct EmuCodec {
  EmuLauncher l;
  alignas(16) d::Scratch scratch{};
  std::uint64_t sc() { return addr(&scratch); }
  void finish() {
    const std::uint32_t status = scratch.status;
    d::launch_reset(l, sc(), true);
    d::throw_for_status(status);
  }
  // Plan and encode as the GPU test does; returns the blob, leaves base == next.
  Bytes blob(Bytes& base, const Bytes& next, std::uint32_t w, bool in_place) {
    const std::uint64_t n = base.size() / w;
    std::vector<std::uint64_t> head_buf((d::max_blob_bytes(w, n) + 7) / 8);  // 8-aligned, room for in-place
    std::vector<std::uint64_t> out_buf;
    d::launch_plan(l, addr(base.data()), addr(next.data()), w, n, addr(head_buf.data()));
    d::Header h;
    std::memcpy(&h, head_buf.data(), sizeof h);
    const std::uint64_t size = d::head_bytes(n) + h.payload_bytes;
    void* out = head_buf.data();
    if (!in_place) {
      out_buf.assign((size + 7) / 8, 0x5a5a5a5a5a5a5a5aull);
      out = out_buf.data();
    }
    d::launch_encode(l, addr(base.data()), addr(next.data()), w, n, addr(head_buf.data()), addr(out), size, sc());
    finish();
    const auto* p = static_cast<const std::uint8_t*>(out);
    return Bytes(p, p + size);
  }
  // The batched apply, as CudaCodec::apply_batch launches it.
  struct Item {
    Bytes blob;
    std::uint32_t w;
    d::SliceMap m;
    Bytes* dst;
    bool verify;
  };
  void apply_batch(const std::vector<Item>& items) {
    std::vector<std::vector<std::uint64_t>> blobs;  // 8-aligned copies
    std::vector<d::ApplyJob> jobs(items.size());
    std::vector<d::Scratch> scr(items.size());
    for (std::size_t k = 0; k < items.size(); ++k) {
      const Item& it = items[k];
      blobs.emplace_back((it.blob.size() + 7) / 8 + 1);
      std::memcpy(blobs.back().data(), it.blob.data(), it.blob.size());
      d::ApplyJob& j = jobs[k];
      j.blob = addr(blobs.back().data());
      j.blob_bytes = it.blob.size();
      j.n = it.m.n;
      j.blocks = d::block_count(it.m.n);
      j.dst = addr(it.dst->data());
      j.scratch = addr(&scr[k]);
      j.w = it.w;
      j.verify = it.verify ? 1 : 0;
      j.map = it.m;
    }
    std::uint64_t units = 0, sums = 0;
    d::number_jobs(jobs.data(), jobs.size(), &units, &sums);
    d::launch_apply_batch(l, addr(jobs.data()), jobs.size(), units, sums, sc());
    finish();
  }
  void apply(const Bytes& blob, std::uint32_t w, const d::SliceMap& m, Bytes& dst, bool verify) {
    if (verify && !d::covers_piece(m)) {  // strided: as CudaCodec::apply, through the batch's checksum
      apply_batch({Item{blob, w, m, &dst, true}});
      return;
    }
    std::vector<std::uint64_t> dblob((blob.size() + 7) / 8 + 1);  // the codec needs an 8-aligned blob
    std::memcpy(dblob.data(), blob.data(), blob.size());
    d::launch_apply(l, addr(dblob.data()), blob.size(), w, m, addr(dst.data()), verify, sc());
    finish();
  }
};

Errc error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.code();
  }
  return static_cast<Errc>(0);
}

#ifdef SHMCAST_EMU_SANITIZED
#define SKIP_UNDER_SANITIZERS() GTEST_SKIP() << "the fiber emulator does not run under ASan or TSan"
#else
#define SKIP_UNDER_SANITIZERS() (void)0
#endif

}  // namespace

TEST(DeltaKernels, EncodeMakesTheHostBlobAndApplyTheHostResult) {
  SKIP_UNDER_SANITIZERS();
  std::mt19937_64 rng(31);
  EmuCodec c;
  int cases = 0;
  for (std::uint32_t w : {1u, 2u, 4u, 8u})
    for (std::uint64_t n : {0ull, 1ull, 65ull, 4097ull, 2 * 4096ull + 17})
      for (double f : {0.0, 0.02, 0.3, 1.0}) {
        SCOPED_TRACE("w=" + std::to_string(w) + " n=" + std::to_string(n) + " f=" + std::to_string(f));
        c.l.max_grid = cases % 3 == 0 ? 1 : ~0u;  // one CUDA block strides over every delta block
        const Bytes base = random_bytes(n * w, rng);
        const Bytes next = mutate(base, w, f, rng);
        const Bytes want = host_blob(base, next, w);
        Bytes dbase = base;
        const Bytes got = c.blob(dbase, next, w, cases % 2 == 0);
        ASSERT_EQ(got, want);
        ASSERT_EQ(dbase, next);
        Bytes dst = base;
        c.apply(want, w, d::whole_map(n), dst, true);
        ASSERT_EQ(dst, next);
        ++cases;
      }
  EXPECT_EQ(cases, 4 * 5 * 4);
}

// More delta blocks than the scan kernel has threads (each thread sums a
// run of entries) and partial sums that cross its 32 warps: the offsets,
// checksum and counts must still be the host's.
TEST(DeltaKernels, PlanOfManyBlocksScansLikeTheHost) {
  SKIP_UNDER_SANITIZERS();
  std::mt19937_64 rng(7);
  EmuCodec c;
  const std::uint32_t w = 1;
  const std::uint64_t n = 2500 * 4096ull + 123;  // 2501 blocks: 3 per scan thread, 834 threads busy
  const Bytes base = random_bytes(n * w, rng);
  const Bytes next = mutate(base, w, 0.02, rng);
  const Bytes want = host_blob(base, next, w);
  Bytes dbase = base;
  ASSERT_EQ(c.blob(dbase, next, w, false), want);
  ASSERT_EQ(dbase, next);
}

// The batched plan (CudaCodec::plan_batch): tensors of every width and of
// sizes around the block and scan boundaries, planned in two launches,
// each get the header and table that plan() gives them, and encoding from
// those makes the host's blob. One CUDA block striding over every job's
// blocks and scans too, with warps in step and with warps running ahead
// (shared memory reused from one job to the next: without the scan's last
// barrier a warp ahead rewrites the sums another still reads).
TEST(DeltaKernels, PlanBatchPlansEveryTensorLikePlan) {
  SKIP_UNDER_SANITIZERS();
  std::mt19937_64 rng(43);
  struct T {
    std::uint32_t w;
    std::uint64_t n;
    double f;
  };
  const std::vector<T> ts = {{2, 4096, 0.02}, {1, 65, 0.3},          {4, 0, 0.0},  {8, 4097, 1.0},
                             {2, 1, 0.0},     {2, 3 * 4096 + 5, 0.1}, {4, 4096, 0.0}, {1, 1100 * 4096ull + 3, 0.02}};
  // The tensors, and the heads plan() makes of them (it writes no base).
  std::vector<Bytes> base, next;
  std::vector<std::vector<std::uint64_t>> want_heads;
  EmuCodec c;
  std::uint64_t blocks = 0;
  for (const T& t : ts) {
    base.push_back(random_bytes(t.n * t.w, rng));
    next.push_back(mutate(base.back(), t.w, t.f, rng));
    want_heads.emplace_back((d::head_bytes(t.n) + 7) / 8, 0);
    d::launch_plan(c.l, addr(base.back().data()), addr(next.back().data()), t.w, t.n, addr(want_heads.back().data()));
    blocks += d::block_count(t.n);
  }
  struct Ahead {  // the emulator's default order again, whatever happens
    ~Ahead() { emu::g_warp_ahead = false; }
  } restore;
  const std::pair<unsigned, bool> modes[] = {{~0u, false}, {1u, false}, {3u, false}, {1u, true}};
  for (const auto& [max_grid, ahead] : modes) {
    SCOPED_TRACE("max_grid=" + std::to_string(max_grid) + (ahead ? ", warps ahead" : ""));
    emu::g_warp_ahead = ahead;
    c.l.max_grid = max_grid;
    std::vector<std::vector<std::uint64_t>> heads;
    std::vector<d::PlanJob> jobs;
    for (std::size_t k = 0; k < ts.size(); ++k) {
      heads.emplace_back(want_heads[k].size(), 0x5a5a5a5a5a5a5a5aull);
      jobs.push_back(d::PlanJob{addr(base[k].data()), addr(next[k].data()), addr(heads[k].data()), ts[k].n,
                                d::block_count(ts[k].n), 0, ts[k].w, 0});
    }
    const std::uint64_t units = d::number_plan_jobs(jobs.data(), jobs.size());
    ASSERT_EQ(units, blocks);
    const int before = c.l.launches;
    d::launch_plan_batch(c.l, addr(jobs.data()), jobs.size(), units);
    EXPECT_EQ(c.l.launches - before, 2);
    for (std::size_t k = 0; k < ts.size(); ++k) ASSERT_EQ(heads[k], want_heads[k]) << "tensor " << k;
  }
  emu::g_warp_ahead = false;
  c.l.max_grid = ~0u;
  // Encoding from those heads makes the host's blobs.
  for (std::size_t k = 0; k < ts.size(); ++k) {
    SCOPED_TRACE("tensor " + std::to_string(k));
    d::Header h;
    std::memcpy(&h, want_heads[k].data(), sizeof h);
    const std::uint64_t size = d::head_bytes(ts[k].n) + h.payload_bytes;
    std::vector<std::uint64_t> out((size + 7) / 8, 0);
    const Bytes want = host_blob(base[k], next[k], ts[k].w);
    d::launch_encode(c.l, addr(base[k].data()), addr(next[k].data()), ts[k].w, ts[k].n, addr(want_heads[k].data()),
                     addr(out.data()), size, c.sc());
    c.finish();
    const auto* p = reinterpret_cast<const std::uint8_t*>(out.data());
    ASSERT_EQ(Bytes(p, p + size), want);
    ASSERT_EQ(base[k], next[k]);
  }
}

// The batched encode (CudaCodec::encode_table / encode_range): tensors of
// every width, empty ones and sizes around the block boundary, encoded from
// their plans in ranges of one launch each (an empty range launches
// nothing), make the host's blobs and leave every base equal to next; one
// CUDA block striding over every job's units too, with warps ahead. A
// tensor changed after its plan is noticed (kInvalidArgument), as encode()
// notices it.
TEST(DeltaKernels, EncodeBatchMakesEveryHostBlob) {
  SKIP_UNDER_SANITIZERS();
  std::mt19937_64 rng(47);
  struct T {
    std::uint32_t w;
    std::uint64_t n;
    double f;
  };
  const std::vector<T> ts = {{2, 4096, 0.02}, {1, 65, 0.3},   {4, 0, 0.0},  {8, 4097, 1.0},  {2, 1, 0.0},
                             {2, 3 * 4096 + 5, 0.1}, {4, 4096, 0.0}, {2, 0, 0.0}, {1, 40 * 4096ull + 3, 0.02}};
  const std::pair<std::size_t, std::size_t> ranges[] = {{0, 3}, {3, 3}, {3, 4}, {4, 9}};
  struct Ahead {
    ~Ahead() { emu::g_warp_ahead = false; }
  } restore;
  const std::pair<unsigned, bool> modes[] = {{~0u, false}, {1u, false}, {5u, true}};
  EmuCodec c;
  for (const auto& [max_grid, ahead] : modes) {
    SCOPED_TRACE("max_grid=" + std::to_string(max_grid) + (ahead ? ", warps ahead" : ""));
    std::vector<Bytes> base, next, want;
    std::vector<std::vector<std::uint64_t>> heads, outs;
    std::vector<d::EncodeJob> jobs;
    for (const T& t : ts) {
      base.push_back(random_bytes(t.n * t.w, rng));
      next.push_back(mutate(base.back(), t.w, t.f, rng));
      want.push_back(host_blob(base.back(), next.back(), t.w));
      heads.emplace_back((d::head_bytes(t.n) + 7) / 8, 0);
    }
    emu::g_warp_ahead = false;
    c.l.max_grid = ~0u;
    for (std::size_t k = 0; k < ts.size(); ++k) {
      d::launch_plan(c.l, addr(base[k].data()), addr(next[k].data()), ts[k].w, ts[k].n, addr(heads[k].data()));
      // Room for the blob, 8-aligned, then k + 3 bytes of pad the kernel zeroes (then 0x5a again).
      const std::uint64_t room = (want[k].size() + 7) / 8 * 8;
      outs.emplace_back((room + k + 3 + 8 + 7) / 8, 0x5a5a5a5a5a5a5a5aull);
      jobs.push_back(d::EncodeJob{addr(base[k].data()), addr(next[k].data()), addr(heads[k].data()),
                                  addr(outs[k].data()), room, ts[k].n, d::block_count(ts[k].n), 0, k + 3, ts[k].w, 0});
    }
    std::uint64_t units = 0;
    for (const T& t : ts) units += std::max<std::uint64_t>(d::block_count(t.n), 1);
    ASSERT_EQ(d::number_encode_jobs(jobs.data(), jobs.size()), units);
    emu::g_warp_ahead = ahead;
    c.l.max_grid = max_grid;
    const int before = c.l.launches;
    for (const auto& [first, last] : ranges)
      d::launch_encode_batch(c.l, addr(jobs.data()), jobs.data(), first, last, c.sc());
    EXPECT_EQ(c.l.launches - before, 3);
    c.finish();
    for (std::size_t k = 0; k < ts.size(); ++k) {
      SCOPED_TRACE("tensor " + std::to_string(k));
      const auto* p = reinterpret_cast<const std::uint8_t*>(outs[k].data());
      ASSERT_EQ(Bytes(p, p + want[k].size()), want[k]);
      ASSERT_EQ(base[k], next[k]);
      const std::uint64_t room = (want[k].size() + 7) / 8 * 8;
      for (std::uint64_t q = want[k].size(); q < room; ++q) ASSERT_EQ(p[q], 0x5a) << "past the blob, byte " << q;
      for (std::uint64_t q = room; q < room + k + 3; ++q) ASSERT_EQ(p[q], 0) << "pad byte " << q;
      ASSERT_EQ(p[room + k + 3], 0x5a) << "past the pad";
    }
  }
  // A change after the plan, in the last job of a range.
  emu::g_warp_ahead = false;
  c.l.max_grid = ~0u;
  const std::uint64_t n = 3 * 4096;
  Bytes b0 = random_bytes(n * 2, rng), b1 = random_bytes(64, rng);
  Bytes n0 = mutate(b0, 2, 0.02, rng), n1 = mutate(b1, 2, 0.3, rng);
  std::vector<std::uint64_t> h0(d::head_bytes(n) / 8 + 1), h1(d::head_bytes(32) / 8 + 1);
  d::launch_plan(c.l, addr(b0.data()), addr(n0.data()), 2, n, addr(h0.data()));
  d::launch_plan(c.l, addr(b1.data()), addr(n1.data()), 2, 32, addr(h1.data()));
  n0[2 * 4097] ^= 0x40;
  std::vector<std::uint64_t> o0(d::max_blob_bytes(2, n) / 8 + 1), o1(d::max_blob_bytes(2, 32) / 8 + 1);
  std::vector<d::EncodeJob> jobs = {
      d::EncodeJob{addr(b1.data()), addr(n1.data()), addr(h1.data()), addr(o1.data()), o1.size() * 8, 32, 1, 0, 0, 2, 0},
      d::EncodeJob{addr(b0.data()), addr(n0.data()), addr(h0.data()), addr(o0.data()), o0.size() * 8, n, 3, 0, 0, 2, 0}};
  d::number_encode_jobs(jobs.data(), jobs.size());
  d::launch_encode_batch(c.l, addr(jobs.data()), jobs.data(), 0, 2, c.sc());
  EXPECT_EQ(error_of([&] { c.finish(); }), Errc::kInvalidArgument);
  EXPECT_EQ(b1, n1);  // the other job was encoded
}

TEST(DeltaKernels, SlicesApplyLikeTheHost) {
  SKIP_UNDER_SANITIZERS();
  std::mt19937_64 rng(11);
  EmuCodec c;
  for (int iter = 0; iter < 60; ++iter) {
    c.l.max_grid = iter % 2 == 0 ? 1 : ~0u;
    const std::uint32_t w = 1u << (rng() % 4);
    const std::vector<std::int64_t> shape = random_shape(rng, iter % 4 == 0);
    std::int64_t total = 1;
    for (auto x : shape) total *= x;
    const Selection piece = random_rows(rng, shape, 3), sel = random_rows(rng, shape, 3);
    const Bytes full_old = random_bytes(static_cast<std::size_t>(total) * w, rng);
    const double fracs[] = {0.02, 0.3, 1.0, 0.0};
    const Bytes full_new = mutate(full_old, w, fracs[iter % 4], rng);
    const Bytes blob = host_blob(piece_bytes(shape, w, full_old, piece), piece_bytes(shape, w, full_new, piece), w);
    const d::SliceMap m = d::slice_map(shape, w, piece, sel);
    Bytes host_dst = reference_slice(shape, w, full_old, full_old, Selection{}, sel);
    Bytes emu_dst = host_dst;
    const bool verify = d::holds_piece(m) && iter % 3 != 0;
    d::apply(as_span(blob), w, m, host_dst.data(), host_dst.size(), verify);
    c.apply(blob, w, m, emu_dst, verify);
    ASSERT_EQ(emu_dst, host_dst) << "iter " << iter;
    ASSERT_EQ(emu_dst, reference_slice(shape, w, full_old, full_new, piece, sel)) << "iter " << iter;
  }
}

// The batched apply (one launch of each kind for every piece): pieces of
// every width, slices, empty pieces, verified or not, many blocks per
// launch with one CUDA block striding over all: each destination exactly
// what the host apply makes. Then a batch with a damaged blob and a wrong
// base: Corrupt, the damaged piece's destination untouched, the others
// applied.
TEST(DeltaKernels, BatchAppliesEveryPieceLikeTheHost) {
  SKIP_UNDER_SANITIZERS();
  std::mt19937_64 rng(23);
  EmuCodec c;
  for (int round = 0; round < 4; ++round) {
    c.l.max_grid = round % 2 == 0 ? 1 : ~0u;
    std::vector<Bytes> host(24), emu(24), want(24);
    std::vector<EmuCodec::Item> items;
    for (int k = 0; k < 24; ++k) {
      const std::uint32_t w = 1u << (rng() % 4);
      const std::vector<std::int64_t> shape = k % 7 == 3 ? std::vector<std::int64_t>{0, 5} : random_shape(rng, k % 4 == 0);
      std::int64_t total = 1;
      for (auto x : shape) total *= x;
      const bool sliced = k % 3 == 1 && total > 0;
      const Selection piece = sliced ? random_rows(rng, shape, 3) : Selection{};
      const Selection sel = sliced ? random_rows(rng, shape, 3) : Selection{};
      const Bytes full_old = random_bytes(static_cast<std::size_t>(total) * w, rng);
      const double fracs[] = {0.02, 0.3, 1.0, 0.0, 0.1};
      const Bytes full_new = mutate(full_old, w, fracs[k % 5], rng);
      const Bytes blob = host_blob(piece_bytes(shape, w, full_old, piece), piece_bytes(shape, w, full_new, piece), w);
      const d::SliceMap m = d::slice_map(shape, w, piece, sel);
      host[k] = reference_slice(shape, w, full_old, full_old, Selection{}, sel);
      emu[k] = host[k];
      const bool verify = d::holds_piece(m) && k % 4 != 1;
      d::apply(as_span(blob), w, m, host[k].data(), host[k].size(), verify);
      want[k] = reference_slice(shape, w, full_old, full_new, piece, sel);
      items.push_back(EmuCodec::Item{blob, w, m, &emu[k], verify});
    }
    c.apply_batch(items);
    for (int k = 0; k < 24; ++k) {
      ASSERT_EQ(emu[k], host[k]) << "round " << round << " piece " << k;
      ASSERT_EQ(emu[k], want[k]) << "round " << round << " piece " << k;
    }
  }
  // A damaged blob and a wrong base among good pieces.
  const Sample s = make_sample();
  std::vector<Bytes> dst(4, s.base);
  dst[2][2 * 5001 + 1] ^= 0x10;  // not the base the blob was made on
  Bytes damaged = s.blob;
  damaged[d::head_bytes(s.n) + 3] ^= 0xff;  // a payload byte
  const Bytes before = dst[1];
  std::vector<EmuCodec::Item> items;
  for (int k = 0; k < 4; ++k) items.push_back(EmuCodec::Item{k == 1 ? damaged : s.blob, 2, d::whole_map(s.n), &dst[k], true});
  EXPECT_EQ(error_of([&] { c.apply_batch(items); }), Errc::kCorrupt);
  EXPECT_EQ(dst[0], s.next);
  EXPECT_EQ(dst[3], s.next);
  EXPECT_NE(dst[2], s.next);  // applied, then caught by its checksum
  // The damaged one: rejected by validation (nothing written), or, where
  // the byte is a value, applied and caught by its checksum.
  EXPECT_TRUE(dst[1] == before || dst[1] != s.next);
  // The codec is clean afterwards.
  std::vector<Bytes> again(2, s.base);
  c.apply_batch({EmuCodec::Item{s.blob, 2, d::whole_map(s.n), &again[0], true},
                 EmuCodec::Item{s.blob, 2, d::whole_map(s.n), &again[1], false}});
  EXPECT_EQ(again[0], s.next);
  EXPECT_EQ(again[1], s.next);
}

// Pieces that land strided (sharded along a dim >= 1, read whole) are
// checked by the batch's checksum kernel through their maps, one CUDA block
// or many, any run width (a word that crosses runs is gathered): a good
// base passes, bit-exact with the host; a destination altered at an element
// the delta leaves alone is kCorrupt, as on the host.
TEST(DeltaKernels, StridedPiecesAreVerifiedLikeTheHost) {
  SKIP_UNDER_SANITIZERS();
  std::mt19937_64 rng(43);
  EmuCodec c;
  int caught = 0;
  for (int iter = 0; iter < 24; ++iter) {
    c.l.max_grid = iter % 2 == 0 ? 1 : ~0u;
    emu::g_warp_ahead = iter % 3 == 0;
    const std::uint32_t w = 1u << (rng() % 4);
    const std::vector<std::int64_t> shape = {1 + static_cast<std::int64_t>(rng() % 40),
                                             1 + static_cast<std::int64_t>(rng() % (iter % 4 == 0 ? 3000 : 30))};
    const std::int64_t total = shape[0] * shape[1];
    Selection piece;
    piece.dim = 1;
    piece.start = static_cast<std::int64_t>(rng() % shape[1]);
    piece.length = 1 + static_cast<std::int64_t>(rng() % (shape[1] - piece.start));
    const d::SliceMap m = d::slice_map(shape, w, piece, Selection{});
    ASSERT_TRUE(d::holds_piece(m));
    const Bytes full_old = random_bytes(static_cast<std::size_t>(total) * w, rng);
    const Bytes full_new = mutate(full_old, w, 0.1, rng);
    const Bytes p_old = piece_bytes(shape, w, full_old, piece), p_new = piece_bytes(shape, w, full_new, piece);
    const Bytes blob = host_blob(p_old, p_new, w);
    const Bytes want = reference_slice(shape, w, full_old, full_new, piece, Selection{});
    Bytes dst = full_old;
    c.apply(blob, w, m, dst, true);
    ASSERT_EQ(dst, want) << "iter " << iter;
    std::vector<std::uint64_t> same;
    for (std::uint64_t k = 0; k < m.n; ++k)
      if (std::memcmp(&p_old[k * w], &p_new[k * w], w) == 0) same.push_back(k);
    if (same.empty()) continue;
    std::uint64_t at = 0;
    d::map_run(m, same[rng() % same.size()], &at);
    std::vector<Bytes> dsts(2, full_old);
    dsts[1][at * w] ^= 0x21;  // no longer the base
    Bytes host = full_old;
    host[at * w] ^= 0x21;
    const Errc on_host = error_of([&] { d::apply(as_span(blob), w, m, host.data(), host.size(), true); });
    // The host's verdict, on the GPU too: kCorrupt, or (the element's block
    // dense, rewritten whole) the right result.
    EXPECT_EQ(error_of([&] {
                c.apply_batch({EmuCodec::Item{blob, w, m, &dsts[0], true}, EmuCodec::Item{blob, w, m, &dsts[1], true}});
              }),
              on_host)
        << "iter " << iter;
    EXPECT_EQ(dsts[0], want) << "iter " << iter;
    if (on_host != Errc::kCorrupt) {
      ASSERT_EQ(host, want) << "iter " << iter;
      ASSERT_EQ(dsts[1], want) << "iter " << iter;
      continue;
    }
    ++caught;
  }
  emu::g_warp_ahead = false;
  c.l.max_grid = ~0u;
  EXPECT_GE(caught, 12);
}

TEST(DeltaKernels, ChecksumAtAnyAlignment) {
  SKIP_UNDER_SANITIZERS();
  std::mt19937_64 rng(17);
  EmuCodec c;
  const Bytes data = random_bytes(70000, rng);
  alignas(8) std::uint64_t out = 0;
  for (std::size_t off : {0u, 1u, 2u, 4u, 7u})
    for (std::size_t len : {0u, 1u, 9u, 4096u, 69000u}) {
      c.l.max_grid = off % 2 == 0 ? 1 : ~0u;
      d::launch_checksum(c.l, addr(data.data() + off), len, addr(&out), 0, c.sc(), true);
      c.finish();
      EXPECT_EQ(out, reference_checksum(data.data() + off, len)) << off << " + " << len;
    }
}

TEST(DeltaKernels, EveryMalformedBlobIsRejectedAndWritesNothing) {
  SKIP_UNDER_SANITIZERS();
  EmuCodec c;
  const Sample s = make_sample();
  Bytes ok = s.base;
  c.apply(s.blob, 2, d::whole_map(s.n), ok, true);
  ASSERT_EQ(ok, s.next);
  const std::uint64_t head = d::head_bytes(s.n);
  int on_device = 0;
  for (const Damage& dm : damages(s)) {
    SCOPED_TRACE(dm.name);
    Bytes blob = s.blob;
    dm.apply(blob);
    if (blob.size() < head) continue;  // the CUDA codec refuses these on the host, before any launch
    Bytes dst = s.base;
    EXPECT_EQ(error_of([&] { c.apply(blob, 2, d::whole_map(s.n), dst, false); }), Errc::kCorrupt);
    EXPECT_EQ(dst, s.base) << "the destination was written";
    ++on_device;
  }
  EXPECT_EQ(on_device, 30);
  // The wrong base fails verification (and the codec is clean afterwards).
  Bytes wrong = s.base;
  wrong[2 * 5001 + 1] ^= 0x10;
  EXPECT_EQ(error_of([&] { c.apply(s.blob, 2, d::whole_map(s.n), wrong, true); }), Errc::kCorrupt);
  Bytes again = s.base;
  c.apply(s.blob, 2, d::whole_map(s.n), again, true);
  EXPECT_EQ(again, s.next);
}

TEST(DeltaKernels, EncodeNoticesChangedInputsAndAShortOutput) {
  SKIP_UNDER_SANITIZERS();
  std::mt19937_64 rng(3);
  EmuCodec c;
  const std::uint64_t n = 3 * 4096;
  Bytes base = random_bytes(n * 2, rng);
  Bytes next = mutate(base, 2, 0.02, rng);
  std::vector<std::uint64_t> head((d::head_bytes(n)) / 8);
  d::launch_plan(c.l, addr(base.data()), addr(next.data()), 2, n, addr(head.data()));
  d::Header h;
  std::memcpy(&h, head.data(), sizeof h);
  const std::uint64_t size = d::head_bytes(n) + h.payload_bytes;
  // Too small: nothing written.
  std::vector<std::uint64_t> small((size - 16) / 8, 0x5a5a5a5a5a5a5a5aull);
  d::launch_encode(c.l, addr(base.data()), addr(next.data()), 2, n, addr(head.data()), addr(small.data()), size - 16,
                   c.sc());
  EXPECT_EQ(error_of([&] { c.finish(); }), Errc::kInvalidArgument);
  for (std::uint64_t x : small) EXPECT_EQ(x, 0x5a5a5a5a5a5a5a5aull);
  // Two more changes in block 1 after planning.
  next[2 * 4097] ^= 0x40;
  next[2 * 4099] ^= 0x40;
  std::vector<std::uint64_t> out(size / 8 + 1);
  d::launch_encode(c.l, addr(base.data()), addr(next.data()), 2, n, addr(head.data()), addr(out.data()), size, c.sc());
  EXPECT_EQ(error_of([&] { c.finish(); }), Errc::kInvalidArgument);
}

// The engine's batched copy (device slots, Lane::add_small) on the
// emulator: aligned and unaligned pieces, empty ones, more pieces than
// blocks (the grid-stride loop), every byte where it belongs and no other
// byte touched.
TEST(DeltaKernelsEmu, CopyPiecesMovesEveryPieceAndNothingElse) {
  std::mt19937_64 rng(7);
  alignas(16) static std::uint8_t src[1 << 20], dst[1 << 20];
  for (auto& b : src) b = static_cast<std::uint8_t>(rng());
  std::memset(dst, 0xee, sizeof dst);
  std::vector<d::CopyPiece> pieces;
  std::vector<std::uint8_t> want(sizeof dst, 0xee);
  std::uint64_t at = 0;
  for (int i = 0; i < 40; ++i) {
    const bool aligned = i % 3 != 0;
    const std::uint64_t n = i % 7 == 0 ? 0 : (aligned ? 16 * (1 + rng() % 400) : 1 + rng() % 5000);
    const std::uint64_t s_off = aligned ? 16 * (rng() % 4000) : rng() % 60000;
    const std::uint64_t d_off = aligned ? (at + 15) / 16 * 16 : at + 1;
    pieces.push_back(d::CopyPiece{addr(src + s_off), addr(dst + d_off), n});
    std::memcpy(want.data() + d_off, src + s_off, n);
    at = d_off + n + 32;
  }
  for (unsigned grid : {1u, 7u, 64u}) {
    std::memset(dst, 0xee, sizeof dst);
    const d::CopyPiecesArgs args{addr(pieces.data()), pieces.size()};
    emu::launch(grid, 256, [args] { shmcast_copy_pieces(args); });
    EXPECT_EQ(std::memcmp(dst, want.data(), sizeof dst), 0) << "grid " << grid;
  }
}

// The batch copy's blocks (device slots, Lane::flush_small): the size
// chosen for a batch (SHMCAST_CUDA_PIECE_BYTES when set, else 64 KiB to
// 1 MiB by the batch's bytes, a multiple of 4 KiB), and pieces of a
// MoE-like batch (whole 16-byte aligned pieces of several blocks, empty,
// unaligned and tiny ones) split at those sizes and copied by the kernel:
// every byte where it belongs and no other byte touched.
TEST(DeltaKernelsEmu, CopyPiecesSplitIntoBlocksOfTheBatchSize) {
  EXPECT_EQ(d::copy_block_bytes(1 << 20, 0), d::kCopyPieceMin);
  EXPECT_EQ(d::copy_block_bytes(0, 0), d::kCopyPieceMin);
  EXPECT_EQ(d::copy_block_bytes(256ull << 20, 0), 128u << 10);
  EXPECT_EQ(d::copy_block_bytes(1ull << 30, 0), 512u << 10);
  EXPECT_EQ(d::copy_block_bytes(64ull << 30, 0), d::kCopyPieceMax);
  EXPECT_EQ(d::copy_block_bytes(300'000'000, 0) % 4096, 0u);
  EXPECT_EQ(d::copy_block_bytes(1ull << 30, 4096), 4096u);
  std::mt19937_64 rng(17);
  constexpr std::size_t kBytes = 6 << 20;
  static std::vector<std::uint8_t> src(kBytes), dst(kBytes + 4096);
  for (auto& b : src) b = static_cast<std::uint8_t>(rng());
  const std::uint64_t sizes[] = {3 << 20, 0, 1, 15, 16, 65536, 65536 + 16, 200'000, 1'000'000 + 3, 4096 * 3};
  std::vector<d::CopyPiece> whole;
  std::vector<std::uint8_t> want(dst.size(), 0xee);
  std::uint64_t s_at = 0, d_at = 32;
  for (std::uint64_t n : sizes) {
    whole.push_back(d::CopyPiece{addr(src.data() + s_at), addr(dst.data() + d_at), n});
    std::memcpy(want.data() + d_at, src.data() + s_at, n);
    s_at = (s_at + n + 15) / 16 * 16 + (n % 2 == 1 ? 3 : 0);  // some sources unaligned
    d_at = (d_at + n + 31) / 16 * 16;
  }
  ASSERT_LE(s_at, src.size());
  for (std::uint64_t block : {std::uint64_t{4096}, d::kCopyPieceMin, std::uint64_t{256 << 10}, d::kCopyPieceMax}) {
    SCOPED_TRACE("block " + std::to_string(block));
    std::vector<d::CopyPiece> pieces;
    d::split_copy_pieces(whole, block, &pieces);
    std::uint64_t want_n = 0;
    for (std::uint64_t n : sizes) want_n += (n + block - 1) / block;
    ASSERT_EQ(pieces.size(), want_n);
    for (const d::CopyPiece& p : pieces) ASSERT_TRUE(p.bytes > 0 && p.bytes <= block);
    std::fill(dst.begin(), dst.end(), 0xee);
    const d::CopyPiecesArgs args{addr(pieces.data()), pieces.size()};
    emu::launch(7, 256, [args] { shmcast_copy_pieces(args); });
    ASSERT_EQ(std::memcmp(dst.data(), want.data(), dst.size()), 0);
  }
}
