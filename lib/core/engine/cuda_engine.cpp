// The CUDA copy engine (built with SHMCAST_WITH_CUDA). Plain C++ against the
// CUDA driver API, which cuda_driver.cpp loads at run time: libshmcast links
// no CUDA library, so one build works on machines with and without a GPU and
// next to any CUDA runtime (torch's, the application's). Only cuda.h is needed
// to build it; no nvcc. One engine, one file past 800 lines: its lanes,
// streams and callbacks are one state machine.
//
// How a lane works (one per engine, on one device):
//
//   copy stream     D2H/H2D copies of chunk c ... | D2H/H2D of chunk c+1 ...
//                                     record(ev) ^
//   callback stream            wait(ev) -> host func(publish/release c)
//
// * The copies run on a non-blocking stream the library owns ("copy stream").
//   begin(caller_stream) records an event on the caller's stream and makes the
//   copy stream wait for it, so the kernels that produced (producer) or last
//   used (consumer) the tensors come first. Nothing waits on the host. One
//   cuMemcpyDtoHAsync / cuMemcpyHtoDAsync per piece (a tensor's bytes inside
//   one slot); no events per piece.
// * chunk_done(fn) records one reusable event on the copy stream after the
//   chunk's copies, makes a second library stream ("callback stream") wait for
//   it, and queues fn there with cuLaunchHostFunc. The callback stream holds
//   nothing but these waits and host functions, so the copy stream never stalls
//   behind a host function: the DMA engine goes straight on to the next chunk
//   while the CUDA callback thread publishes (producer) or releases (consumer)
//   the previous one. fn only does atomics and a futex wake (and, with
//   checksums, hashes the slot): it never calls CUDA.
//   SHMCAST_CUDA_CALLBACKS=inline queues the host functions on the copy stream
//   itself instead (one stream; the copies stall behind each host function).
//   Measured on an H200 (docs/benchmarks-log.md): 41.8 GB/s inline against 43.4
//   with the callback stream, so the callback stream is the default.
// * Device slots complete chunks by polling instead (SHMCAST_CUDA_COMPLETION=
//   poll | callback picks either for any lane): chunk_done(fn) records an
//   event from a small pool after the chunk's copies and queues {event, fn}
//   for a thread the lane owns, which waits for the events in order (spinning
//   on cuEventQuery, yielding the CPU after 20 us, for up to
//   SHMCAST_CUDA_POLL_NS, default 2 ms, then sleeping in cuEventSynchronize)
//   and runs each fn; drain() returns once it has handled everything queued.
//   A device-slot chunk takes a fraction of a millisecond, and its hand-over
//   to the other process is the sync's critical path, so the wake-up of the
//   driver's callback thread is taken out of it (docs/benchmarks.md has the
//   figures). An event that fails drops its fn: the chunk is never published
//   or released, and drain() throws the copy's error.
// * SHMCAST_CUDA_D2H_STREAMS / SHMCAST_CUDA_H2D_STREAMS (1..4) give an engine
//   several copy streams; pieces of 8 MiB or more are then split across them
//   (several DMA engines at once) and smaller ones take turns. Host slots:
//   default 1, since on the H200 more gained nothing (44.7 GB/s with 2 H2D
//   streams against 44.7 with 1; 42.9 with 2 + 2). Device slots: default 2,
//   since there each device-to-device copy's fixed cost is exposed (the two
//   processes' contexts take turns on the GPU) and a second stream hides it
//   (2 x 1 GiB slots: 8.4 -> 8.1 ms; with pieces under 8 MiB batched, 7.2).
// * drain() records a blocking-sync event after everything on all streams and
//   waits for it with cuEventSynchronize: the caller's thread sleeps, it does
//   not spin. Copy errors and exceptions thrown by a host function are
//   rethrown there as Error(Errc::kCuda).
//
// Contexts and devices. Everything happens in the primary context of a device:
// the context the CUDA runtime (and so torch) uses for it, so a cudaStream_t
// of the runtime is a CUstream of that context. The library retains each
// device's primary context once, on first use, for the life of the process
// (as the runtime does), and pushes it on the calling thread around its calls
// (nothing is pushed when it is current already, as it is after cudaSetDevice
// or under torch.cuda.device). An engine works on the device that is current
// when it is first used; begin(caller_stream) then picks the device whose
// context owns the caller's stream (cuStreamGetCtx), or, for a default stream
// (0, cudaStreamLegacy, cudaStreamPerThread), the device of the current
// context (device 0 when none is current, like cudaGetDevice). If that is
// another device, the engine drains and moves its streams there. The
// consumer's staging(device, ...) moves it to `device`. Copies between pinned
// host memory and any device's memory work from a stream of any device
// (unified addressing), but a stream on the tensor's own device uses its own
// copy engines, which is the fast path. Streams of contexts made with
// cuCtxCreate (not a primary context) are not supported.
//
// Non-contiguous sources (Strided2D): copied straight from the strided tensor
// with cuMemcpy2DAsync (a piece that starts or ends mid-row adds a one-row
// copy for the partial row at either end; a pitch above the device's
// CU_DEVICE_ATTRIBUTE_MAX_PITCH is copied row by row). No device staging
// buffer is used, so the trainer's GPU memory is never held by the library:
// once a tensor's D2H copies have run, its memory may be reused (end_sync()
// returns only after that).
#include <sys/mman.h>
#include <sys/resource.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <vector>

#include <sched.h>
#include <unistd.h>

#include "base/clock.hpp"  // cpu_relax(), mono_ns()
#include "engine/cuda_driver.hpp"
#include "engine/delta_cuda.hpp"
#include "engine/engine.hpp"

namespace shmcast::detail {

namespace {

constexpr std::uint64_t kPinChunk = 64ull << 30;  // cuMemHostRegister at most 64 GiB per call

// The loaded driver. Engines and pins call this only after cuda_present()
// said yes, so it does not fail in practice.
const cu::Api& drv() {
  std::string why;
  const cu::Api* a = cu::load(&why);
  if (a == nullptr) throw Error(Errc::kCudaUnavailable, why);
  return *a;
}

std::string err_text(CUresult e) {
  const cu::Api* a = cu::load(nullptr);
  return a != nullptr ? cu::error_text(*a, e) : "CUresult " + std::to_string(static_cast<int>(e));
}

[[noreturn]] void throw_cuda(CUresult e, const std::string& what, const char* todo) {
  std::string msg = "CUDA: " + what + " failed: " + err_text(e);
  if (todo && *todo) msg += std::string("; ") + todo;
  throw Error(Errc::kCuda, msg);
}

constexpr const char* kTodoArgs =
    "check that the pointer is device memory of the stated size (and, for Strided2D, that the layout fits the "
    "allocation) and that the stream belongs to the tensor's device";
constexpr const char* kTodoStream =
    "pass a stream of the tensor's device (a cudaStream_t of the CUDA runtime, i.e. of the device's primary context, "
    "or nullptr for the current device's default stream)";
constexpr const char* kTodoAsync =
    "an earlier asynchronous copy or kernel failed; the CUDA context is usually unusable after this, so restart the "
    "process (run with CUDA_LAUNCH_BLOCKING=1 or compute-sanitizer to find the failing call)";

#define SHMCAST_CK(call, what, todo)                      \
  do {                                                    \
    const CUresult e_ = (call);                           \
    if (e_ != CUDA_SUCCESS) throw_cuda(e_, what, todo);   \
  } while (0)

CUdeviceptr dptr(const void* p) { return static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(p)); }

bool inline_callbacks() {
  static const bool v = [] {
    const char* s = std::getenv("SHMCAST_CUDA_CALLBACKS");
    return s != nullptr && std::strcmp(s, "inline") == 0;
  }();
  return v;
}

// How chunk completions reach the host (see the file comment): by the
// lane's polling thread, or by cuLaunchHostFunc. SHMCAST_CUDA_COMPLETION=
// poll | callback; unset, device slots poll and host slots use callbacks.
bool poll_completion(bool device_slots) {
  static const int v = [] {
    const char* s = std::getenv("SHMCAST_CUDA_COMPLETION");
    if (s == nullptr || *s == 0) return -1;
    if (std::strcmp(s, "poll") == 0) return 1;
    if (std::strcmp(s, "callback") == 0) return 0;
    return -1;
  }();
  return v < 0 ? device_slots : v == 1;
}

// A number from environment variable `name` (decimal, in [lo, hi], a
// multiple of `multiple`), else `dflt`. docs/design.md, "Tuning", lists them.
std::uint64_t env_number(const char* name, std::uint64_t dflt, std::uint64_t lo, std::uint64_t hi,
                         std::uint64_t multiple = 1) {
  const char* s = std::getenv(name);
  if (s == nullptr || *s < '0' || *s > '9') return dflt;
  char* end = nullptr;
  errno = 0;
  const unsigned long long n = std::strtoull(s, &end, 10);
  const bool ok = errno == 0 && end != nullptr && *end == 0 && n >= lo && n <= hi && n % multiple == 0;
  return ok ? static_cast<std::uint64_t>(n) : dflt;
}

// How long the polling thread spins on a chunk's event before it sleeps in
// cuEventSynchronize, in ns (SHMCAST_CUDA_POLL_NS, 0..1e9, default 2 ms).
std::int64_t poll_spin_ns() {
  static const auto v = static_cast<std::int64_t>(env_number("SHMCAST_CUDA_POLL_NS", 2'000'000, 0, 1'000'000'000));
  return v;
}

using cu::CtxScope;         // cuda_driver.hpp
using cu::primary_context;  // retained on first use, kept for the life of the process

// The device of the calling thread's current context (the runtime makes the
// primary context of its current device current: cudaSetDevice does since
// CUDA 12, and any runtime call that needs it does), else device 0, which is
// what cudaGetDevice reports before any cudaSetDevice.
int current_device(const cu::Api& d) {
  CUcontext c = nullptr;
  if (d.cuCtxGetCurrent(&c) == CUDA_SUCCESS && c != nullptr) {
    CUdevice dev = 0;  // a CUdevice is the device's ordinal
    if (d.cuCtxGetDevice(&dev) == CUDA_SUCCESS) return static_cast<int>(dev);
  }
  return 0;
}

// The device of context `c`, or -1.
int context_device(const cu::Api& d, CUcontext c) {
  if (d.cuCtxPushCurrent(c) != CUDA_SUCCESS) return -1;
  CUdevice dev = -1;
  if (d.cuCtxGetDevice(&dev) != CUDA_SUCCESS) dev = -1;
  CUcontext popped = nullptr;
  (void)d.cuCtxPopCurrent(&popped);
  return static_cast<int>(dev);
}

bool is_default_stream(CUstream s) { return s == nullptr || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD; }

void require_cuda() {
  std::string why;
  if (!cuda_present(&why)) throw Error(Errc::kCudaUnavailable, why);
}

// Copy streams per engine direction: SHMCAST_CUDA_D2H_STREAMS (producer) and
// SHMCAST_CUDA_H2D_STREAMS (consumer), 1..4. With more than one, a large
// contiguous piece is split across the streams, so that several DMA engines
// work on it at once (docs/benchmarks.md has the measurements).
int stream_count(const char* env, int dflt) {
  const char* s = std::getenv(env);
  if (s == nullptr || *s == 0) return dflt;
  const int n = std::atoi(s);
  return n < 1 ? 1 : (n > 4 ? 4 : n);
}

constexpr int kMaxCopyStreams = 4;
constexpr int kD2HStreams = 1;  // defaults, from docs/benchmarks.md
constexpr int kH2DStreams = 1;
constexpr int kDeviceSlotStreams = 2;  // either direction, device slots (docs/benchmarks.md)
constexpr std::uint64_t kSplitMin = 8ull << 20;  // split pieces of at least this size
constexpr std::uint64_t kBatchBytes = 8ull << 20;  // device slots: batch copies under this size (Lane::batch_bytes)

// What a host function carries: the user callback and the lane to report to.
class Lane;
struct HostCall {
  std::function<void()> fn;
  Lane* lane;
};

// Copy streams plus a callback stream in one device's primary context; see
// the file comment.
class Lane {
 public:
  Lane(int streams, bool poll)
      : d_(drv()), n_(streams < 1 ? 1 : (streams > kMaxCopyStreams ? kMaxCopyStreams : streams)), poll_(poll) {}
  ~Lane() { destroy(); }
  Lane(const Lane&) = delete;
  Lane& operator=(const Lane&) = delete;

  const cu::Api& api() const { return d_; }
  CUcontext context() const { return ctx_; }
  int device() const { return device_; }
  int streams() const { return n_; }
  std::uint64_t max_pitch() const { return max_pitch_; }
  CUstream stream(int i) const { return copy_[i]; }
  // The stream for the next piece that is not split (round robin).
  CUstream next_stream() { return copy_[n_ == 1 ? 0 : rr_++ % n_]; }

  // The device for work ordered after `caller`: the device whose context owns
  // it, or for a default stream the current context's (see the file comment).
  int device_for(void* caller) const {
    const CUstream s = static_cast<CUstream>(caller);
    if (!is_default_stream(s)) {
      CUcontext c = nullptr;
      if (d_.cuStreamGetCtx(s, &c) == CUDA_SUCCESS && c != nullptr) {
        if (c == ctx_) return device_;
        const int dev = context_device(d_, c);
        if (dev >= 0) return dev;
      }
      // Not a stream the driver knows: cuEventRecord reports it in after().
    }
    return current_device(d_);
  }

  // Creates the streams and events on `dev` (drains and destroys old ones).
  void home(int dev) {
    if (ctx_ != nullptr && dev == device_) return;
    if (ctx_ != nullptr) {
      drain();
      destroy();
    }
    CUcontext ctx = primary_context(d_, dev);
    CtxScope scope(d_, ctx);
    ctx_ = ctx;
    device_ = dev;
    try {
      for (int i = 0; i < n_; ++i) {
        SHMCAST_CK(d_.cuStreamCreate(&copy_[i], CU_STREAM_NON_BLOCKING), "cuStreamCreate", "");
        SHMCAST_CK(d_.cuEventCreate(&chunk_ev_[i], CU_EVENT_DISABLE_TIMING), "cuEventCreate", "");
      }
      SHMCAST_CK(d_.cuStreamCreate(&cb_, CU_STREAM_NON_BLOCKING), "cuStreamCreate", "");
      SHMCAST_CK(d_.cuEventCreate(&order_ev_, CU_EVENT_DISABLE_TIMING), "cuEventCreate", "");
      SHMCAST_CK(d_.cuEventCreate(&drain_ev_, CU_EVENT_DISABLE_TIMING | CU_EVENT_BLOCKING_SYNC), "cuEventCreate",
                 "");
      CUdevice h = 0;
      int pitch = 0;
      if (d_.cuDeviceGet(&h, dev) == CUDA_SUCCESS &&
          d_.cuDeviceGetAttribute(&pitch, CU_DEVICE_ATTRIBUTE_MAX_PITCH, h) == CUDA_SUCCESS && pitch > 0)
        max_pitch_ = static_cast<std::uint64_t>(pitch);
      else
        max_pitch_ = 0;  // unknown: try the 2D copy, fall back to rows if it is refused
    } catch (...) {
      destroy();
      throw;
    }
  }

  // The copy streams wait for the work queued so far on `caller`.
  void after(void* caller) {
    CtxScope scope(d_, ctx_);
    SHMCAST_CK(d_.cuEventRecord(order_ev_, static_cast<CUstream>(caller)), "cuEventRecord on the caller's stream",
               kTodoStream);
    for (int i = 0; i < n_; ++i) SHMCAST_CK(d_.cuStreamWaitEvent(copy_[i], order_ev_, 0), "cuStreamWaitEvent", "");
  }

  // `caller` waits for the copies queued so far on the copy streams.
  void before(void* caller) {
    flush_small();
    CtxScope scope(d_, ctx_);
    for (int i = 0; i < n_; ++i) {
      SHMCAST_CK(d_.cuEventRecord(chunk_ev_[i], copy_[i]), "cuEventRecord", "");
      SHMCAST_CK(d_.cuStreamWaitEvent(static_cast<CUstream>(caller), chunk_ev_[i], 0),
                 "cuStreamWaitEvent on the caller's stream", kTodoStream);
    }
  }

  // Device slots: a device-to-device piece under batch_bytes() (8 MiB) is
  // not copied at once but gathered, and flush_small() copies the gathered
  // pieces in one kernel launch on copy stream 0 (a cudaMemcpy's fixed
  // cost, about 6 us on an H200, dominates small copies: 253 of
  // Qwen2.5-3B's 434 tensors are under 8 MiB). False (copy it yourself)
  // when the kernels cannot run here (a build without nvcc). Every
  // completion point (when_done, before, drain) flushes first.
  static std::uint64_t batch_bytes() {
    static const std::uint64_t v = env_number("SHMCAST_CUDA_BATCH_BYTES", kBatchBytes, 0, ~std::uint64_t{0});
    return v;
  }
  // The most bytes one CUDA block of the batch kernel copies (a larger
  // piece is split): SHMCAST_CUDA_PIECE_BYTES, a multiple of 16 from 4 KiB
  // to 64 MiB, default delta::kCopyPieceMax (64 KiB).
  static std::uint64_t piece_bytes() {
    static const std::uint64_t v =
        env_number("SHMCAST_CUDA_PIECE_BYTES", delta::kCopyPieceMax, 4u << 10, 64ull << 20, 16);
    return v;
  }
  // Whether the pieces of the current tensor may be batched: false when it
  // lives on another GPU than the lane's (the kernel could not read it).
  void batch_small(bool on) { batch_on_ = on; }
  bool add_small(std::byte* dst, const std::byte* src, std::uint64_t bytes) {
    if (bytes >= batch_bytes() || !batch_on_) return false;
    if (small_ok_ < 0) {
      CtxScope scope(d_, ctx_);
      small_ok_ = delta::copy_pieces_ready(nullptr) ? 1 : 0;
    }
    if (small_ok_ == 0) return false;
    const std::uint64_t most = piece_bytes();
    for (std::uint64_t at = 0; at < bytes; at += most) {
      const std::uint64_t n = bytes - at < most ? bytes - at : most;
      small_.push_back(delta::CopyPiece{dptr(src + at), dptr(dst + at), n});
    }
    if (small_.size() >= kSmallBatch) flush_small();
    return true;
  }
  void flush_small() {
    if (small_.empty()) return;
    // The gathered pieces leave the lane before anything here can throw: a
    // failed flush drops them (its error fails the sync they belong to),
    // never leaves them for the next flush, which would copy an old sync's
    // pieces (slots since reused, destinations since freed) into the next.
    std::vector<delta::CopyPiece> batch;
    batch.swap(small_);
    small_.reserve(batch.capacity());
    CtxScope scope(d_, ctx_);
    const std::uint64_t bytes = batch.size() * sizeof(delta::CopyPiece);
    if (bytes > desc_cap_) {
      // The old table may still be read by a queued launch.
      if (desc_ != 0) {
        SHMCAST_CK(d_.cuStreamSynchronize(copy_[0]), "cuStreamSynchronize", kTodoAsync);
        (void)d_.cuMemFree(desc_);
        desc_ = 0;
        desc_cap_ = 0;
      }
      const std::uint64_t cap = bytes < (64u << 10) ? (64u << 10) : bytes;
      SHMCAST_CK(d_.cuMemAlloc(&desc_, cap), "cuMemAlloc of the copy table", "");
      desc_cap_ = cap;
    }
    // From pageable memory the upload returns once the table was read, and
    // it runs on stream 0 after the launch that read the previous table.
    SHMCAST_CK(d_.cuMemcpyHtoDAsync(desc_, batch.data(), bytes, copy_[0]), "cuMemcpyHtoDAsync of the copy table",
               kTodoAsync);
    delta::launch_copy_pieces(reinterpret_cast<const void*>(static_cast<std::uintptr_t>(desc_)), batch.size(),
                              copy_[0]);
  }

  // Runs fn once every copy queued so far has completed.
  void when_done(std::function<void()> fn) {
    flush_small();
    rethrow_host_error();
    if (poll_) {
      poll_when_done(std::move(fn));
      return;
    }
    auto call = std::make_unique<HostCall>(HostCall{std::move(fn), this});
    CtxScope scope(d_, ctx_);
    CUresult e = CUDA_SUCCESS;
    if (inline_callbacks() && n_ == 1) {
      e = d_.cuLaunchHostFunc(copy_[0], &Lane::trampoline, call.get());
    } else {
      e = join_copies();
      if (e == CUDA_SUCCESS) e = d_.cuLaunchHostFunc(cb_, &Lane::trampoline, call.get());
    }
    if (e != CUDA_SUCCESS) throw_cuda(e, "queueing the completion callback (cuLaunchHostFunc)", kTodoAsync);
    (void)call.release();  // the trampoline deletes it
  }

  // Blocks (sleeping, not spinning) until every copy and host function queued
  // so far has completed; rethrows their errors.
  void drain() {
    if (ctx_ == nullptr) return;
    // A flush that fails still waits for the copies already queued (a
    // caller that drains on its error path then releases the slots).
    std::exception_ptr flush_error;
    try {
      flush_small();
    } catch (...) {
      flush_error = std::current_exception();
    }
    {
      CtxScope scope(d_, ctx_);
      CUresult e = join_copies();
      if (e == CUDA_SUCCESS) e = d_.cuEventRecord(drain_ev_, cb_);
      if (e == CUDA_SUCCESS) e = d_.cuEventSynchronize(drain_ev_);
      // The polling thread has seen every event complete (or fail) and run
      // (or dropped) each completion before drain() returns.
      if (poller_ != nullptr) poll_wait_idle();
      if (e != CUDA_SUCCESS) {
        // A plain synchronize gives the error of the failed copy itself.
        CUresult e2 = CUDA_SUCCESS;
        for (int i = 0; i < n_ && e2 == CUDA_SUCCESS; ++i) e2 = d_.cuStreamSynchronize(copy_[i]);
        throw_cuda(e2 != CUDA_SUCCESS ? e2 : e, "an asynchronous copy between the shared region and GPU memory",
                   kTodoAsync);
      }
    }
    if (flush_error) std::rethrow_exception(flush_error);
    rethrow_host_error();
  }

 private:
  // Completion by polling: an event per completion, recorded after the
  // chunk's copies, and a thread per lane that waits for the events in order
  // (spinning on cuEventQuery for up to poll_spin_ns(), then sleeping in
  // cuEventSynchronize) and runs each fn. A failed event drops its fn (the
  // chunk is never published or released; drain() reports the copy's error).
  // drain() returns only once the thread has handled everything queued.
  struct Pending {
    CUevent ev;
    std::function<void()> fn;
  };

  void poll_when_done(std::function<void()> fn) {
    CtxScope scope(d_, ctx_);
    CUevent ev = nullptr;
    {
      std::lock_guard<std::mutex> lock(pmu_);
      if (!pfree_.empty()) {
        ev = pfree_.back();
        pfree_.pop_back();
      }
    }
    if (ev == nullptr) {
      SHMCAST_CK(d_.cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING | CU_EVENT_BLOCKING_SYNC), "cuEventCreate", "");
      try {
        std::lock_guard<std::mutex> lock(pmu_);
        pfree_.reserve(nevents_ + 1);  // so that giving an event back never allocates
        ++nevents_;
      } catch (...) {
        (void)d_.cuEventDestroy(ev);
        throw;
      }
    }
    // From here on `ev` goes back to the pool on any failure.
    auto give_back = [this, ev] {
      std::lock_guard<std::mutex> lock(pmu_);
      pfree_.push_back(ev);  // capacity reserved above
    };
    CUresult e = n_ == 1 ? CUDA_SUCCESS : join_copies();
    if (e == CUDA_SUCCESS) e = d_.cuEventRecord(ev, n_ == 1 ? copy_[0] : cb_);
    if (e != CUDA_SUCCESS) {
      give_back();
      throw_cuda(e, "recording a chunk's completion event", kTodoAsync);
    }
    try {
      if (poller_ == nullptr) {
        poller_pid_ = ::getpid();
        poller_ = std::make_unique<std::thread>([this] { poll_loop(); });
      }
      std::lock_guard<std::mutex> lock(pmu_);
      pq_.push_back(Pending{ev, std::move(fn)});
    } catch (const std::system_error& x) {
      give_back();
      throw Error(Errc::kCuda, std::string("starting the lane's completion thread failed: ") + x.what() +
                                   "; raise the process's thread limit, or set SHMCAST_CUDA_COMPLETION=callback");
    } catch (...) {
      give_back();
      throw;
    }
    pcv_.notify_one();
  }

  // Spins on the event (yielding the CPU after the first 20 us, so that a
  // thread pinned to the same core still runs), then sleeps until it is done.
  CUresult poll_event(CUevent ev) {
    const std::int64_t start = mono_ns();
    const std::int64_t yield_at = start + 20'000, spin_end = start + poll_spin_ns();
    for (;;) {
      const CUresult r = d_.cuEventQuery(ev);
      if (r != CUDA_ERROR_NOT_READY) return r;
      const std::int64_t now = mono_ns();
      if (now >= spin_end) return d_.cuEventSynchronize(ev);
      if (now >= yield_at) {
        (void)sched_yield();
      } else {
        for (int i = 0; i < 16; ++i) cpu_relax();
      }
    }
  }

  void poll_loop() {
    (void)d_.cuCtxPushCurrent(ctx_);  // this thread's only context
    std::unique_lock<std::mutex> lock(pmu_);
    for (;;) {
      pcv_.wait(lock, [this] { return pstop_ || !pq_.empty(); });
      if (pq_.empty()) break;  // stopping, and nothing left
      Pending p = std::move(pq_.front());
      pq_.pop_front();
      ++pbusy_;
      lock.unlock();
      // A failed event (a copy failed: the context's error is sticky) drops
      // its fn, as the driver skips host functions after an error; drain()
      // reports the copy's own error.
      if (poll_event(p.ev) == CUDA_SUCCESS) {
        try {
          p.fn();
        } catch (const std::exception& x) {
          try {
            note_host_error(x.what());
          } catch (...) {  // out of memory for the message
          }
        } catch (...) {
          try {
            note_host_error("unknown exception");
          } catch (...) {
          }
        }
      }
      p.fn = nullptr;  // its captures go before the lane is idle
      lock.lock();
      pfree_.push_back(p.ev);  // capacity reserved: no allocation
      --pbusy_;
      if (pq_.empty() && pbusy_ == 0) pidle_.notify_all();
    }
    CUcontext popped = nullptr;
    (void)d_.cuCtxPopCurrent(&popped);
  }

  // Waits until the polling thread has handled every queued completion, so
  // that none runs after drain() returned (a late release would free a slot
  // twice, or touch a caller's frame that is gone). No deadline: the events
  // are complete when drain() calls this, and a completion only stores to
  // atomics and wakes a futex, so the wait is as short as those.
  void poll_wait_idle() {
    if (poller_pid_ != ::getpid()) return;  // a forked child: no thread, and CUDA is unusable here
    std::unique_lock<std::mutex> lock(pmu_);
    pidle_.wait(lock, [this] { return pq_.empty() && pbusy_ == 0; });
  }

  // Stops the polling thread once it has handled what is queued (the
  // streams are synchronized first, so every event is complete), then frees
  // the events. In a forked child the thread does not exist, and its lock
  // and events are the parent's: forget them all.
  void poll_stop() noexcept {
    if (poller_ != nullptr && poller_pid_ != ::getpid()) {
      (void)poller_.release();
      return;
    }
    if (poller_ != nullptr) {
      {
        std::lock_guard<std::mutex> lock(pmu_);
        pstop_ = true;
      }
      pcv_.notify_all();
      poller_->join();
      poller_.reset();
    }
    std::lock_guard<std::mutex> lock(pmu_);
    for (CUevent ev : pfree_) (void)d_.cuEventDestroy(ev);
    pfree_.clear();
    for (Pending& p : pq_) (void)d_.cuEventDestroy(p.ev);
    pq_.clear();
    nevents_ = 0;
    pbusy_ = 0;
    pstop_ = false;
  }

  // The callback stream waits for everything queued on the copy streams.
  CUresult join_copies() {
    CUresult e = CUDA_SUCCESS;
    for (int i = 0; i < n_ && e == CUDA_SUCCESS; ++i) {
      e = d_.cuEventRecord(chunk_ev_[i], copy_[i]);
      if (e == CUDA_SUCCESS) e = d_.cuStreamWaitEvent(cb_, chunk_ev_[i], 0);
    }
    return e;
  }

  static void CUDA_CB trampoline(void* p) {
    HostCall* call = static_cast<HostCall*>(p);
    Lane* lane = call->lane;
    try {
      call->fn();
    } catch (const std::exception& e) {
      lane->note_host_error(e.what());
    } catch (...) {
      lane->note_host_error("unknown exception");
    }
    delete call;
  }

  void note_host_error(const char* what) {
    std::lock_guard<std::mutex> lock(mu_);
    if (host_error_.empty()) host_error_ = what;
    has_host_error_.store(true, std::memory_order_release);
  }

  void rethrow_host_error() {
    if (!has_host_error_.load(std::memory_order_acquire)) return;
    std::string what;
    {
      std::lock_guard<std::mutex> lock(mu_);
      what.swap(host_error_);
      has_host_error_.store(false, std::memory_order_relaxed);
    }
    throw Error(Errc::kCuda, "a completion callback failed: " + what);
  }

  void destroy() noexcept {
    if (ctx_ == nullptr) return;
    // Errors here (a dead context, the driver shutting down at exit) are
    // ignored.
    CUcontext cur = nullptr, popped = nullptr;
    const bool push = d_.cuCtxGetCurrent(&cur) == CUDA_SUCCESS && cur != ctx_;
    const bool pushed = push && d_.cuCtxPushCurrent(ctx_) == CUDA_SUCCESS;
    // Let queued host functions run before their streams go away.
    for (int i = 0; i < n_; ++i)
      if (copy_[i] != nullptr) (void)d_.cuStreamSynchronize(copy_[i]);
    if (cb_ != nullptr) (void)d_.cuStreamSynchronize(cb_);
    poll_stop();
    for (int i = 0; i < n_; ++i) {
      if (chunk_ev_[i] != nullptr) (void)d_.cuEventDestroy(chunk_ev_[i]);
      if (copy_[i] != nullptr) (void)d_.cuStreamDestroy(copy_[i]);
      chunk_ev_[i] = nullptr;
      copy_[i] = nullptr;
    }
    if (desc_ != 0) (void)d_.cuMemFree(desc_);
    desc_ = 0;
    desc_cap_ = 0;
    small_.clear();
    small_ok_ = -1;
    if (order_ev_ != nullptr) (void)d_.cuEventDestroy(order_ev_);
    if (drain_ev_ != nullptr) (void)d_.cuEventDestroy(drain_ev_);
    if (cb_ != nullptr) (void)d_.cuStreamDestroy(cb_);
    if (pushed) (void)d_.cuCtxPopCurrent(&popped);
    cb_ = nullptr;
    order_ev_ = drain_ev_ = nullptr;
    ctx_ = nullptr;
    device_ = -1;
  }

  const cu::Api& d_;
  const int n_;
  CUcontext ctx_ = nullptr;  // non-null once homed
  int device_ = -1;
  unsigned rr_ = 0;
  std::uint64_t max_pitch_ = 0;
  CUstream copy_[kMaxCopyStreams] = {};
  CUevent chunk_ev_[kMaxCopyStreams] = {};
  CUstream cb_ = nullptr;
  CUevent order_ev_ = nullptr, drain_ev_ = nullptr;
  std::atomic<bool> has_host_error_{false};
  std::mutex mu_;
  std::string host_error_;
  static constexpr std::size_t kSmallBatch = 4096;  // pieces per launch at most
  std::vector<delta::CopyPiece> small_;              // gathered, not yet launched
  CUdeviceptr desc_ = 0;                             // their table on the device (stream 0)
  std::uint64_t desc_cap_ = 0;
  int small_ok_ = -1;                                // the kernels run here: -1 not asked yet
  bool batch_on_ = true;                             // batch_small()
  // Completion by polling (poll_when_done); pmu_ guards the rest.
  const bool poll_;
  std::unique_ptr<std::thread> poller_;
  pid_t poller_pid_ = 0;
  std::mutex pmu_;
  std::condition_variable pcv_, pidle_;
  std::deque<Pending> pq_;      // recorded, not yet handled, in order
  std::vector<CUevent> pfree_;  // completed events, for reuse (capacity: nevents_)
  std::size_t nevents_ = 0;     // events made
  std::size_t pbusy_ = 0;       // taken by the thread, not yet handled
  bool pstop_ = false;
};

// Where the two sides of a copy live: the slot (host memory, or device
// slots) and the tensor (device memory, or a host buffer when the slots are
// on the device).
struct Sides {
  bool to_slot;    // tensor -> slot (producer), else slot -> tensor (consumer)
  bool slot_dev;   // device slots
  bool tensor_dev;
};

// One contiguous copy of `bytes` between slot memory `s` and tensor memory
// `t` (a small device-to-device one gathered by the lane, Lane::add_small).
void copy_one(Lane& lane, std::byte* s, std::byte* t, std::uint64_t bytes, const Sides& k, CUstream stream) {
  const cu::Api& d = lane.api();
  CUresult e;
  const char* what;
  if (k.slot_dev && k.tensor_dev) {
    if (k.to_slot ? lane.add_small(s, t, bytes) : lane.add_small(t, s, bytes)) return;
    e = k.to_slot ? d.cuMemcpyDtoDAsync(dptr(s), dptr(t), bytes, stream)
                  : d.cuMemcpyDtoDAsync(dptr(t), dptr(s), bytes, stream);
    what = "cuMemcpyDtoDAsync";
  } else if (k.slot_dev) {  // a host tensor, device slots
    e = k.to_slot ? d.cuMemcpyHtoDAsync(dptr(s), t, bytes, stream) : d.cuMemcpyDtoHAsync(t, dptr(s), bytes, stream);
    what = k.to_slot ? "cuMemcpyHtoDAsync" : "cuMemcpyDtoHAsync";
  } else {  // host slots, a device tensor
    e = k.to_slot ? d.cuMemcpyDtoHAsync(s, dptr(t), bytes, stream) : d.cuMemcpyHtoDAsync(dptr(t), s, bytes, stream);
    what = k.to_slot ? "cuMemcpyDtoHAsync" : "cuMemcpyHtoDAsync";
  }
  if (e != CUDA_SUCCESS) throw_cuda(e, std::string(what) + " of " + std::to_string(bytes) + " bytes", kTodoArgs);
}

// `rows` rows of `w` bytes between slot memory (pitch `sp`) and a tensor
// (pitch `tp`), in one cuMemcpy2DAsync, or one copy per row when the pitch
// exceeds what a 2D copy takes (a bad pointer then fails in the first row's
// copy, with its own error).
void copy_rows(std::byte* slot, std::uint64_t sp, std::byte* t, std::uint64_t tp, std::uint64_t w,
               std::uint64_t rows, const Sides& k, Lane& lane, CUstream stream) {
  const cu::Api& d = lane.api();
  const std::uint64_t max_pitch = lane.max_pitch();
  const bool fits = max_pitch == 0 || (sp <= max_pitch && tp <= max_pitch);
  CUresult e = CUDA_ERROR_INVALID_VALUE;
  if (fits) {
    CUDA_MEMCPY2D c{};
    c.WidthInBytes = w;
    c.Height = rows;
    // The slot's side and the tensor's, as source and destination.
    std::byte* src = k.to_slot ? t : slot;
    std::byte* dst = k.to_slot ? slot : t;
    const bool src_dev = k.to_slot ? k.tensor_dev : k.slot_dev;
    const bool dst_dev = k.to_slot ? k.slot_dev : k.tensor_dev;
    c.srcPitch = k.to_slot ? tp : sp;
    c.dstPitch = k.to_slot ? sp : tp;
    c.srcMemoryType = src_dev ? CU_MEMORYTYPE_DEVICE : CU_MEMORYTYPE_HOST;
    c.dstMemoryType = dst_dev ? CU_MEMORYTYPE_DEVICE : CU_MEMORYTYPE_HOST;
    if (src_dev)
      c.srcDevice = dptr(src);
    else
      c.srcHost = src;
    if (dst_dev)
      c.dstDevice = dptr(dst);
    else
      c.dstHost = dst;
    e = d.cuMemcpy2DAsync(&c, stream);
  }
  if (fits && e != CUDA_ERROR_INVALID_VALUE) {
    if (e != CUDA_SUCCESS)
      throw_cuda(e, std::string("cuMemcpy2DAsync ") + (k.to_slot ? "to" : "from") + " the slots of " +
                        std::to_string(rows) + " rows of " + std::to_string(w) + " bytes (pitches " +
                        std::to_string(sp) + ", " + std::to_string(tp) + ")",
                 kTodoArgs);
    return;
  }
  for (std::uint64_t r = 0; r < rows; ++r) copy_one(lane, slot + r * sp, t + r * tp, w, k, stream);
}

// Copies bytes [offset, offset + n) of a tensor laid out as `l` at `tensor`
// to (to_slot) or from the contiguous slot memory `slot`, on the lane's
// streams. The lane's context must be current.
void copy_async(std::byte* slot, std::byte* tensor, const Strided2D& l, std::uint64_t offset, std::uint64_t n,
                const Sides& k, Lane& lane) {
  auto one = [&](std::byte* s, std::byte* t, std::uint64_t bytes, CUstream stream) {
    copy_one(lane, s, t, bytes, k, stream);
  };
  if (n == 0) return;
  if (l.rows == 0 || l.pitch_bytes == l.row_bytes) {
    const int streams = lane.streams();
    if (streams == 1 || n < kSplitMin) {
      one(slot, tensor + offset, n, lane.next_stream());
      return;
    }
    // Split a large piece across the copy streams (4 KiB-aligned parts).
    const std::uint64_t part = (n / streams + 4095) & ~std::uint64_t{4095};
    for (int i = 0; i < streams; ++i) {
      const std::uint64_t a = part * static_cast<std::uint64_t>(i);
      if (a >= n) break;
      const std::uint64_t len = n - a < part ? n - a : part;
      one(slot + a, tensor + offset + a, len, lane.stream(i));
    }
    return;
  }
  CUstream stream = lane.next_stream();
  std::uint64_t row = offset / l.row_bytes, col = offset % l.row_bytes;
  if (col != 0) {  // head: the rest of a partial row
    const std::uint64_t take = l.row_bytes - col < n ? l.row_bytes - col : n;
    one(slot, tensor + row * l.pitch_bytes + col, take, stream);
    slot += take;
    n -= take;
    ++row;
  }
  const std::uint64_t full = n / l.row_bytes;
  if (full == 1) {
    one(slot, tensor + row * l.pitch_bytes, l.row_bytes, stream);
  } else if (full > 1) {
    copy_rows(slot, l.row_bytes, tensor + row * l.pitch_bytes, l.pitch_bytes, l.row_bytes, full, k, lane, stream);
  }
  slot += full * l.row_bytes;
  n -= full * l.row_bytes;
  row += full;
  if (n > 0) one(slot, tensor + row * l.pitch_bytes, n, stream);  // tail: a partial row
}

class CudaProducerEngine final : public ProducerEngine {
 public:
  // `device` >= 0: the lane starts there (device slots: the slots' GPU, so
  // that copies from host sources run on the GPU the slots are mapped for).
  CudaProducerEngine(bool device_slots, int device)
      : lane_(stream_count("SHMCAST_CUDA_D2H_STREAMS", device_slots ? kDeviceSlotStreams : kD2HStreams),
              poll_completion(device_slots)),
        device_slots_(device_slots) {
    if (device >= 0) {
      int count = 0;
      SHMCAST_CK(lane_.api().cuDeviceGetCount(&count), "cuDeviceGetCount", "");
      if (device >= count)
        throw Error(Errc::kInvalidArgument, "no CUDA device " + std::to_string(device) + " in this process (it sees " +
                                                std::to_string(count) + "; check CUDA_VISIBLE_DEVICES)");
    }
    lane_.home(device >= 0 ? device : current_device(lane_.api()));
  }
  ~CudaProducerEngine() override = default;  // the lane waits for queued work

  void begin(void* caller_stream) override {
    const int dev = lane_.device_for(caller_stream);
    if (device_slots_) {
      // The lane stays on the slots' GPU (the only one the producer mapped
      // them for) and waits for the caller's stream, wherever it is; a
      // tensor on another GPU is copied by the driver, never by the batch
      // kernel, which would read memory its GPU cannot reach.
      lane_.batch_small(dev == lane_.device());
      lane_.after(caller_stream);
      return;
    }
    lane_.home(dev);
    lane_.after(caller_stream);
  }
  void copy(std::byte* dst, const Buffer& src, std::uint64_t offset, std::uint64_t n) override {
    if (!src.device && !device_slots_) {
      // A host source into host slots: plain memcpy. Pending async copies
      // into this slot write other bytes, so this cannot race with them.
      gather_host(dst, static_cast<const std::byte*>(src.ptr), src.layout, offset, n);
      return;
    }
    // Into device slots a host source is an H2D copy (from pageable memory
    // it returns once the source was read).
    CtxScope scope(lane_.api(), lane_.context());
    copy_async(dst, static_cast<std::byte*>(src.ptr), src.layout, offset, n, Sides{true, device_slots_, src.device},
               lane_);
  }
  void chunk_done(std::function<void()> publish) override { lane_.when_done(std::move(publish)); }
  void drain() override { lane_.drain(); }
  bool is_cuda() const override { return true; }

 private:
  Lane lane_;
  bool device_slots_;
};

class CudaConsumerEngine final : public ConsumerEngine {
 public:
  explicit CudaConsumerEngine(bool device_slots, int device)
      : lane_(stream_count("SHMCAST_CUDA_H2D_STREAMS", device_slots ? kDeviceSlotStreams : kH2DStreams),
              poll_completion(device_slots)),
        device_slots_(device_slots) {
    lane_.home(device >= 0 ? device : current_device(lane_.api()));
  }
  ~CudaConsumerEngine() override {
    try {
      lane_.drain();  // nothing may still copy into the staging buffer
    } catch (...) {
    }
    free_staging();
  }

  void begin(void* caller_stream) override {
    const int dev = staging_next_ >= 0 ? staging_next_ : lane_.device_for(caller_stream);
    staging_next_ = -1;
    if (device_slots_) {
      // As the producer's: the lane stays on the GPU the slots are mapped
      // for (ConsumerOptions::device); destinations on another GPU are
      // copied by the driver, not by the batch kernel.
      lane_.batch_small(dev == lane_.device());
      lane_.after(caller_stream);
      return;
    }
    lane_.home(dev);
    lane_.after(caller_stream);
  }
  void copy(const Buffer& dst, std::uint64_t offset, const std::byte* src, std::uint64_t n) override {
    if (!dst.device && !device_slots_) {
      scatter_host(static_cast<std::byte*>(dst.ptr), dst.layout, offset, src, n);
      return;
    }
    // Out of device slots into host memory: D2H (into pageable memory it
    // returns once the bytes are there).
    CtxScope scope(lane_.api(), lane_.context());
    copy_async(const_cast<std::byte*>(src), static_cast<std::byte*>(dst.ptr), dst.layout, offset, n,
               Sides{false, device_slots_, dst.device}, lane_);
  }
  void copy2d(const Buffer& dst, std::uint64_t offset, std::uint64_t dst_pitch, const std::byte* src,
              std::uint64_t src_pitch, std::uint64_t width, std::uint64_t rows) override {
    if (!dst.device || dst.layout.rows != 0 || rows < 2) {
      ConsumerEngine::copy2d(dst, offset, dst_pitch, src, src_pitch, width, rows);
      return;
    }
    CtxScope scope(lane_.api(), lane_.context());
    // One strided copy straight out of the slot: only the selected bytes
    // move (cross PCIe, for host slots).
    copy_rows(const_cast<std::byte*>(src), src_pitch, static_cast<std::byte*>(dst.ptr) + offset, dst_pitch, width, rows,
              Sides{false, device_slots_, true}, lane_, lane_.next_stream());
  }
  void chunk_done(std::function<void()> release) override { lane_.when_done(std::move(release)); }
  void end(void* caller_stream) override { lane_.before(caller_stream); }
  void drain() override { lane_.drain(); }
  bool is_cuda() const override { return true; }

  std::byte* staging(int device, std::uint64_t bytes) override {
    const cu::Api& d = lane_.api();
    int count = 0;
    SHMCAST_CK(d.cuDeviceGetCount(&count), "cuDeviceGetCount", "");
    if (device < 0 || device >= count)
      throw Error(Errc::kInvalidArgument, "staging device " + std::to_string(device) + " does not exist (" +
                                              std::to_string(count) + " CUDA devices)");
    if (device_slots_ && device != lane_.device())
      throw Error(Errc::kUnsupported, "read_to_staging() on GPU " + std::to_string(device) + ", but this consumer "
                                      "mapped the region's device slots for GPU " + std::to_string(lane_.device()) +
                                      ": stage on that GPU, or open the consumer with ConsumerOptions::device = " +
                                      std::to_string(device));
    lane_.home(device);  // drains first if the lane moves
    staging_next_ = device;
    if (staging_ != nullptr && staging_device_ == device && staging_bytes_ >= bytes) return staging_;
    lane_.drain();  // nothing may still copy into the old buffer
    free_staging();
    CtxScope scope(d, lane_.context());
    CUdeviceptr p = 0;
    const std::uint64_t want = bytes == 0 ? 1 : bytes;
    const CUresult e = d.cuMemAlloc(&p, want);
    if (e != CUDA_SUCCESS)
      throw_cuda(e, "cuMemAlloc of a " + std::to_string(want) + "-byte staging buffer on device " +
                        std::to_string(device),
                 "free GPU memory, or read into your own buffers with read_into_device()");
    staging_ = reinterpret_cast<std::byte*>(static_cast<std::uintptr_t>(p));
    staging_bytes_ = want;
    staging_device_ = device;
    staging_ctx_ = lane_.context();
    return staging_;
  }

 private:
  void free_staging() noexcept {
    if (staging_ == nullptr) return;
    const cu::Api& d = lane_.api();
    CUcontext cur = nullptr, popped = nullptr;
    const bool pushed = d.cuCtxGetCurrent(&cur) == CUDA_SUCCESS && cur != staging_ctx_ &&
                        d.cuCtxPushCurrent(staging_ctx_) == CUDA_SUCCESS;
    (void)d.cuMemFree(dptr(staging_));  // fails harmlessly when the driver is shutting down
    if (pushed) (void)d.cuCtxPopCurrent(&popped);
    staging_ = nullptr;
    staging_bytes_ = 0;
  }

  Lane lane_;
  bool device_slots_;
  int staging_next_ = -1;
  std::byte* staging_ = nullptr;
  std::uint64_t staging_bytes_ = 0;
  int staging_device_ = -1;
  CUcontext staging_ctx_ = nullptr;
};

std::string memlock_text() {
  struct rlimit rl {};
  if (::getrlimit(RLIMIT_MEMLOCK, &rl) != 0) return "unknown";
  if (rl.rlim_cur == RLIM_INFINITY) return "unlimited";
  return std::to_string(rl.rlim_cur) + " bytes";
}

// Which device's primary context registered each pinned region (by base
// address), and where each of its registrations starts, so that it is
// unregistered there.
struct PinRecord {
  int device;
  std::vector<std::byte*> regs;
};
std::mutex& pin_mutex() {
  static std::mutex* const m = new std::mutex;
  return *m;
}
std::unordered_map<void*, PinRecord>& pin_devices() {
  static auto* const m = new std::unordered_map<void*, PinRecord>;
  return *m;
}

}  // namespace

bool cuda_present(std::string* why) {
  std::string load_why;
  const cu::Api* d = cu::load(&load_why);
  if (d == nullptr) {
    if (why) *why = "CUDA is unavailable: " + load_why;
    return false;
  }
  int n = 0;
  const CUresult e = d->cuDeviceGetCount(&n);
  if (e != CUDA_SUCCESS) {
    if (why)
      *why = "no CUDA device: cuDeviceGetCount failed: " + cu::error_text(*d, e) +
             "; is a GPU visible (nvidia-smi; in a container, run it with --gpus or the NVIDIA runtime; check "
             "CUDA_VISIBLE_DEVICES)?";
    return false;
  }
  if (n == 0) {
    if (why)
      *why = "no CUDA device: the NVIDIA driver (CUDA " + cu::version_text(d->driver_version) +
             ") found 0 devices (check CUDA_VISIBLE_DEVICES)";
    return false;
  }
  if (why) why->clear();
  return true;
}

std::unique_ptr<ProducerEngine> make_cuda_producer_engine(bool device_slots, int device) {
  require_cuda();
  return std::make_unique<CudaProducerEngine>(device_slots, device);
}

std::unique_ptr<ConsumerEngine> make_cuda_consumer_engine(bool device_slots, int device) {
  require_cuda();
  return std::make_unique<CudaConsumerEngine>(device_slots, device);
}

PinInfo cuda_pin(void* base, std::uint64_t bytes, std::uint64_t read_only_from) {
  PinInfo info;
  std::string why;
  if (!cuda_present(&why)) {
    info.why = why;
    return info;
  }
  const cu::Api& d = drv();
  const auto t0 = std::chrono::steady_clock::now();
  std::byte* p = static_cast<std::byte*>(base);
  const std::uint64_t ro = read_only_from < bytes ? read_only_from : bytes;
  std::vector<std::byte*> regs;  // the base of each registration, for cuda_unpin
  const unsigned flags = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP;
  // Registers [p + from, p + to) in calls of at most kPinChunk.
  auto reg = [&](std::uint64_t from, std::uint64_t to, unsigned f, std::string* err) {
    for (std::uint64_t done = from; done < to;) {
      const std::uint64_t n = to - done < kPinChunk ? to - done : kPinChunk;
      const CUresult e = d.cuMemHostRegister(p + done, n, f);
      if (e != CUDA_SUCCESS) {
        *err = "cuMemHostRegister of " + std::to_string(n) + " bytes at offset " + std::to_string(done) + " (of " +
               std::to_string(bytes) + ((f & CU_MEMHOSTREGISTER_READ_ONLY) ? ", read-only" : "") +
               ") failed: " + cu::error_text(d, e);
        return false;
      }
      regs.push_back(p + done);
      done += n;
    }
    return true;
  };
  auto unreg_all = [&] {
    for (std::byte* r : regs) (void)d.cuMemHostUnregister(r);
    regs.clear();
  };
  const std::string hint = ". Page-locking needs RLIMIT_MEMLOCK to cover the region (now " + memlock_text() +
                           "; `ulimit -l unlimited`, or `--ulimit memlock=-1` for a container) and, in a container, "
                           "a /dev/shm large enough for it; or use Pin::kNo (unpinned copies are slower)";
  try {
    // Registered in the current device's primary context (the runtime's
    // cudaHostRegister does the same); portable, so every context sees the
    // region as pinned, and mapped, as cudaHostRegisterDefault is under
    // unified addressing.
    const int dev = current_device(d);
    CtxScope scope(d, primary_context(d, dev));
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
    // Map every page of the region into this process first, rather than
    // have the registration fault them in. Older kernels say EINVAL: fine.
    if (ro > 0) (void)::madvise(base, ro, MADV_POPULATE_WRITE);
    if (ro < bytes) (void)::madvise(p + ro, bytes - ro, MADV_POPULATE_READ);
    std::string err;
    if (!reg(0, ro, flags, &err)) {
      unreg_all();
      info.why = err + hint;
      return info;
    }
    if (ro < bytes) {
      // The caller mapped [ro, bytes) read-only. The driver pins such memory
      // only with CU_MEMHOSTREGISTER_READ_ONLY (which also keeps the GPU
      // from writing it), or without the flag where the GPU uses the host's
      // page tables; elsewhere (older drivers and GPUs) the range is made
      // writable again and pinned as before.
      CUdevice h = 0;
      int ro_ok = 0, host_tables = 0;
      if (d.cuDeviceGet(&h, dev) == CUDA_SUCCESS) {
        if (d.cuDeviceGetAttribute(&ro_ok, CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED, h) != CUDA_SUCCESS)
          ro_ok = 0;
        if (d.cuDeviceGetAttribute(&host_tables, CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES,
                                   h) != CUDA_SUCCESS)
          host_tables = 0;
      }
      const std::size_t before = regs.size();
      auto drop_tail = [&] {
        while (regs.size() > before) {
          (void)d.cuMemHostUnregister(regs.back());
          regs.pop_back();
        }
      };
      std::string ro_err;  // why a read-only registration failed (the fallback below needs no reason)
      bool done = false;
      if (ro_ok) {
        done = reg(ro, bytes, flags | CU_MEMHOSTREGISTER_READ_ONLY, &ro_err);
        if (!done) drop_tail();
      }
      if (!done && host_tables) {
        done = reg(ro, bytes, flags, &ro_err);
        if (!done) drop_tail();
      }
      if (done) {
        info.read_only = true;
      } else {
        if (::mprotect(p + ro, bytes - ro, PROT_READ | PROT_WRITE) != 0) {
          const int e = errno;
          unreg_all();
          info.why = std::string("cannot map the store banks writable again to pin them: ") + std::strerror(e);
          return info;
        }
        if (!reg(ro, bytes, flags, &err)) {
          unreg_all();
          (void)::mprotect(p + ro, bytes - ro, PROT_READ);  // unpinned: read-only again
          info.why = err + hint;
          return info;
        }
      }
    }
    std::lock_guard<std::mutex> lock(pin_mutex());
    pin_devices()[base] = PinRecord{dev, std::move(regs)};
  } catch (const Error& e) {
    unreg_all();
    info.why = e.what();
    return info;
  }
  info.pinned = true;
  info.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return info;
}

void cuda_unpin(void* base, std::uint64_t) {
  const cu::Api* d = cu::load(nullptr);
  if (d == nullptr) return;
  PinRecord rec{-1, {}};
  {
    std::lock_guard<std::mutex> lock(pin_mutex());
    const auto it = pin_devices().find(base);
    if (it != pin_devices().end()) {
      rec = std::move(it->second);
      pin_devices().erase(it);
    }
  }
  if (rec.device < 0) return;  // not registered here
  try {
    CtxScope scope(*d, primary_context(*d, rec.device));
    for (std::byte* r : rec.regs) (void)d->cuMemHostUnregister(r);
  } catch (...) {
    // A dead context or a driver shutting down: the registration goes with it.
  }
}

}  // namespace shmcast::detail
