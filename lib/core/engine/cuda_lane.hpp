// engine/ (layer 5), private to the CUDA engine (built with
// SHMCAST_WITH_CUDA): the lane that every CUDA engine copies through, its
// completion thread, the copies themselves, and the driver helpers they
// share. The engines are cuda_engine.cpp.
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
//
// One lane, in one file per role:
//   cuda_lane.cpp    streams and events on a device's primary context (home,
//                    device_for, after, before), completions by host
//                    function (when_done), drain, destroy; the driver helpers
//   cuda_poll.cpp    the completion thread (poll_when_done, poll_loop, ...)
//   cuda_copy.cpp    the copies: one range, rows, a Strided2D piece split
//                    across the streams; device slots' small pieces gathered
//                    and copied in one kernel launch (add_small, flush_small)
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <sys/types.h>

#include "engine/cuda_driver.hpp"
#include "engine/delta_cuda.hpp"
#include "engine/engine.hpp"

namespace shmcast::detail::cuda {

// The loaded driver. Engines and pins call this only after cuda_present()
// said yes, so it does not fail in practice.
const cu::Api& drv();

[[noreturn]] void throw_cuda(CUresult e, const std::string& what, const char* todo);

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

inline CUdeviceptr dptr(const void* p) { return static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(p)); }

// A number from environment variable `name` (decimal, in [lo, hi], a
// multiple of `multiple`), else `dflt`. docs/design.md, "Tuning", lists them.
std::uint64_t env_number(const char* name, std::uint64_t dflt, std::uint64_t lo, std::uint64_t hi,
                         std::uint64_t multiple = 1);

using cu::CtxScope;         // cuda_driver.hpp
using cu::primary_context;  // retained on first use, kept for the life of the process
// The device of the calling thread's current context (the runtime makes the
// primary context of its current device current: cudaSetDevice does since
// CUDA 12, and any runtime call that needs it does), else device 0, which is
// what cudaGetDevice reports before any cudaSetDevice.
int current_device(const cu::Api& d);

constexpr int kMaxCopyStreams = 4;

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
  // The event begin() last recorded on the caller's stream: for work that
  // must follow the caller's stream but not queue behind the copy streams.
  CUevent order_event() const { return order_ev_; }
  // The stream for the next piece that is not split (round robin).
  CUstream next_stream() { return copy_[n_ == 1 ? 0 : rr_++ % n_]; }

  // The device for work ordered after `caller`: the device whose context owns
  // it, or for a default stream the current context's (see the file comment).
  int device_for(void* caller) const;
  // Creates the streams and events on `dev` (drains and destroys old ones).
  void home(int dev);
  // The copy streams wait for the work queued so far on `caller`.
  void after(void* caller);
  // `caller` waits for the copies queued so far on the copy streams.
  void before(void* caller);
  // Device slots: a device-to-device piece under batch_bytes() (8 MiB) is
  // not copied at once but gathered, and flush_small() copies the gathered
  // pieces in one kernel launch on copy stream 0 (a cudaMemcpy's fixed
  // cost, about 6 us on an H200, dominates small copies: 253 of
  // Qwen2.5-3B's 434 tensors are under 8 MiB). False (copy it yourself)
  // when the kernels cannot run here (a build without nvcc). Every
  // completion point (when_done, before, drain) flushes first.
  static std::uint64_t batch_bytes();
  // The most bytes one CUDA block of the batch kernel copies (a larger
  // piece is split): SHMCAST_CUDA_PIECE_BYTES, a multiple of 16 from 4 KiB
  // to 64 MiB; 0 when unset: chosen per launch by delta::copy_block_bytes
  // (delta_launch.hpp), 64 KiB to 1 MiB by the batch's bytes.
  static std::uint64_t piece_bytes();
  // Whether the pieces of the current tensor may be batched: false when it
  // lives on another GPU than the lane's (the kernel could not read it).
  void batch_small(bool on) { batch_on_ = on; }
  bool add_small(std::byte* dst, const std::byte* src, std::uint64_t bytes);
  void flush_small();
  // Runs fn once every copy queued so far has completed.
  void when_done(std::function<void()> fn);
  // Blocks (sleeping, not spinning) until every copy and host function queued
  // so far has completed; rethrows their errors.
  void drain();

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

  void poll_when_done(std::function<void()> fn);
  // Spins on the event (yielding the CPU after the first 20 us, so that a
  // thread pinned to the same core still runs), then sleeps until it is done.
  CUresult poll_event(CUevent ev);
  void poll_loop();
  // Waits until the polling thread has handled every queued completion, so
  // that none runs after drain() returned (a late release would free a slot
  // twice, or touch a caller's frame that is gone). No deadline: the events
  // are complete when drain() calls this, and a completion only stores to
  // atomics and wakes a futex, so the wait is as short as those.
  void poll_wait_idle();
  // Stops the polling thread once it has handled what is queued (the
  // streams are synchronized first, so every event is complete), then frees
  // the events. In a forked child the thread does not exist, and its lock
  // and events are the parent's: forget them all.
  void poll_stop() noexcept;
  // The callback stream waits for everything queued on the copy streams.
  CUresult join_copies();
  static void CUDA_CB trampoline(void* p);
  void note_host_error(const char* what);
  void rethrow_host_error();
  void destroy() noexcept;

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
  std::vector<delta::CopyPiece> small_;              // gathered whole, not yet launched
  std::uint64_t small_bytes_ = 0;                    // their bytes
  std::vector<delta::CopyPiece> split_;              // the last launch's table (storage kept)
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
void copy_one(Lane& lane, std::byte* s, std::byte* t, std::uint64_t bytes, const Sides& k, CUstream stream);

// `rows` rows of `w` bytes between slot memory (pitch `sp`) and a tensor
// (pitch `tp`), in one cuMemcpy2DAsync, or one copy per row when the pitch
// exceeds what a 2D copy takes (a bad pointer then fails in the first row's
// copy, with its own error).
void copy_rows(std::byte* slot, std::uint64_t sp, std::byte* t, std::uint64_t tp, std::uint64_t w,
               std::uint64_t rows, const Sides& k, Lane& lane, CUstream stream);

// Copies bytes [offset, offset + n) of a tensor laid out as `l` at `tensor`
// to (to_slot) or from the contiguous slot memory `slot`, on the lane's
// streams. The lane's context must be current.
void copy_async(std::byte* slot, std::byte* tensor, const Strided2D& l, std::uint64_t offset, std::uint64_t n,
                const Sides& k, Lane& lane);

}  // namespace shmcast::detail::cuda
