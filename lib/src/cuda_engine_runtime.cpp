// The CUDA copy engine against the CUDA runtime API (linked with libcudart),
// built with SHMCAST_WITH_CUDA and -DSHMCAST_CUDA_API=runtime. The default
// build uses cuda_engine.cpp instead: the same engine on the driver API,
// loaded at run time. This one is kept to measure the two against each other
// (scripts/device-pip.sh). No kernels, so no nvcc is needed to build it.
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
//   cudaMemcpyAsync per piece (a tensor's bytes inside one slot); no events per
//   piece.
// * chunk_done(fn) records one reusable event on the copy stream after the
//   chunk's copies, makes a second library stream ("callback stream") wait for
//   it, and queues fn there with cudaLaunchHostFunc. The callback stream holds
//   nothing but these waits and host functions, so the copy stream never stalls
//   behind a host function: the DMA engine goes straight on to the next chunk
//   while the CUDA callback thread publishes (producer) or releases (consumer)
//   the previous one. fn only does atomics and a futex wake (and, with
//   checksums, hashes the slot): it never calls CUDA.
//   SHMCAST_CUDA_CALLBACKS=inline queues the host functions on the copy stream
//   itself instead (one stream; the copies stall behind each host function).
//   Measured on an H200 (docs/benchmarks.md): 41.8 GB/s inline against 43.4
//   with the callback stream, so the callback stream is the default.
// * SHMCAST_CUDA_D2H_STREAMS / SHMCAST_CUDA_H2D_STREAMS (1..4, default 1) give
//   an engine several copy streams; pieces of 8 MiB or more are then split
//   across them (several DMA engines at once). On the H200 this gained nothing
//   (44.7 GB/s with 2 H2D streams against 44.7 with 1; 42.9 with 2 + 2), so
//   one stream each is the default; the knob stays for other machines.
// * drain() records a blocking-sync event after everything on all streams and
//   waits for it with cudaEventSynchronize: the caller's thread sleeps, it does
//   not spin. Copy errors and exceptions thrown by a host function are
//   rethrown there as Error(Errc::kCuda).
//
// Devices: an engine works on the device that is current when it is first
// used (cudaGetDevice in begin()). If a later begin() finds another device
// current, the engine drains and moves its streams to that device. The
// consumer's staging(device, ...) moves it to `device`. Copies between pinned
// host memory and any device's memory work from a stream of any device
// (unified addressing), but a stream on the tensor's own device uses its own
// copy engines, which is the fast path.
//
// Non-contiguous sources (Strided2D): copied straight from the strided tensor
// with cudaMemcpy2DAsync (a piece that starts or ends mid-row adds a
// one-row cudaMemcpyAsync for the partial row at either end). No device
// staging buffer is used, so the trainer's GPU memory is never held by the
// library: once a tensor's D2H copies have run, its memory may be reused
// (end_sync() returns only after that).
#include <sys/mman.h>
#include <sys/resource.h>

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "engine.hpp"

namespace shmcast::detail {

namespace {

constexpr std::uint64_t kPinChunk = 64ull << 30;  // cudaHostRegister at most 64 GiB per call

std::string err_text(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + " (" + cudaGetErrorString(e) + ")";
}

// Clears the calling thread's last (non-sticky) error so nothing trips a
// later, unrelated CUDA call.
void clear_error() noexcept { (void)cudaGetLastError(); }

[[noreturn]] void throw_cuda(cudaError_t e, const std::string& what, const char* todo) {
  clear_error();
  std::string msg = "CUDA: " + what + " failed: " + err_text(e);
  if (todo && *todo) msg += std::string("; ") + todo;
  throw Error(Errc::kCuda, msg);
}

constexpr const char* kTodoArgs =
    "check that the pointer is device memory of the stated size (and, for Strided2D, that the layout fits the "
    "allocation) and that the stream belongs to the current device";
constexpr const char* kTodoAsync =
    "an earlier asynchronous copy or kernel failed; the CUDA context is usually unusable after this, so restart the "
    "process (run with CUDA_LAUNCH_BLOCKING=1 or compute-sanitizer to find the failing call)";

#define SHMCAST_CK(call, what, todo)            \
  do {                                          \
    const cudaError_t e_ = (call);              \
    if (e_ != cudaSuccess) throw_cuda(e_, what, todo); \
  } while (0)

bool inline_callbacks() {
  static const bool v = [] {
    const char* s = std::getenv("SHMCAST_CUDA_CALLBACKS");
    return s != nullptr && std::strcmp(s, "inline") == 0;
  }();
  return v;
}

// Makes `dev` current for the scope, then restores the caller's device.
class DeviceScope {
 public:
  explicit DeviceScope(int dev) {
    if (cudaGetDevice(&prev_) != cudaSuccess) {
      clear_error();
      prev_ = -1;
    }
    if (prev_ != dev) {
      SHMCAST_CK(cudaSetDevice(dev), "cudaSetDevice(" + std::to_string(dev) + ")", "");
    } else {
      prev_ = -1;
    }
  }
  ~DeviceScope() {
    if (prev_ >= 0 && cudaSetDevice(prev_) != cudaSuccess) clear_error();
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int prev_ = -1;
};

int current_device() {
  int d = 0;
  SHMCAST_CK(cudaGetDevice(&d), "cudaGetDevice", "");
  return d;
}

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
constexpr std::uint64_t kSplitMin = 8ull << 20;  // split pieces of at least this size

// What a host function carries: the user callback and the lane to report to.
class Lane;
struct HostCall {
  std::function<void()> fn;
  Lane* lane;
};

// Copy streams plus a callback stream on one device; see the file comment.
class Lane {
 public:
  explicit Lane(int streams) : n_(streams < 1 ? 1 : (streams > kMaxCopyStreams ? kMaxCopyStreams : streams)) {}
  ~Lane() { destroy(); }
  Lane(const Lane&) = delete;
  Lane& operator=(const Lane&) = delete;

  int device() const { return device_; }
  int streams() const { return n_; }
  cudaStream_t stream(int i) const { return copy_[i]; }
  // The stream for the next piece that is not split (round robin).
  cudaStream_t next_stream() { return copy_[n_ == 1 ? 0 : rr_++ % n_]; }

  // Creates the streams and events on `dev` (drains and destroys old ones).
  void home(int dev) {
    if (copy_[0] != nullptr && dev == device_) return;
    if (copy_[0] != nullptr) {
      drain();
      destroy();
    }
    DeviceScope scope(dev);
    device_ = dev;
    for (int i = 0; i < n_; ++i) {
      SHMCAST_CK(cudaStreamCreateWithFlags(&copy_[i], cudaStreamNonBlocking), "cudaStreamCreateWithFlags", "");
      SHMCAST_CK(cudaEventCreateWithFlags(&chunk_ev_[i], cudaEventDisableTiming), "cudaEventCreateWithFlags", "");
    }
    SHMCAST_CK(cudaStreamCreateWithFlags(&cb_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags", "");
    SHMCAST_CK(cudaEventCreateWithFlags(&order_ev_, cudaEventDisableTiming), "cudaEventCreateWithFlags", "");
    SHMCAST_CK(cudaEventCreateWithFlags(&drain_ev_, cudaEventDisableTiming | cudaEventBlockingSync),
               "cudaEventCreateWithFlags", "");
  }

  // The copy streams wait for the work queued so far on `caller`.
  void after(void* caller) {
    DeviceScope scope(device_);
    SHMCAST_CK(cudaEventRecord(order_ev_, static_cast<cudaStream_t>(caller)), "cudaEventRecord on the caller's stream",
               "pass a cudaStream_t of the current device (or nullptr for the default stream)");
    for (int i = 0; i < n_; ++i) SHMCAST_CK(cudaStreamWaitEvent(copy_[i], order_ev_, 0), "cudaStreamWaitEvent", "");
  }

  // `caller` waits for the copies queued so far on the copy streams.
  void before(void* caller) {
    DeviceScope scope(device_);
    for (int i = 0; i < n_; ++i) {
      SHMCAST_CK(cudaEventRecord(chunk_ev_[i], copy_[i]), "cudaEventRecord", "");
      SHMCAST_CK(cudaStreamWaitEvent(static_cast<cudaStream_t>(caller), chunk_ev_[i], 0),
                 "cudaStreamWaitEvent on the caller's stream",
                 "pass a cudaStream_t of the current device (or nullptr for the default stream)");
    }
  }

  // Runs fn once every copy queued so far has completed.
  void when_done(std::function<void()> fn) {
    rethrow_host_error();
    auto* call = new HostCall{std::move(fn), this};
    cudaError_t e = cudaSuccess;
    if (inline_callbacks() && n_ == 1) {
      e = cudaLaunchHostFunc(copy_[0], &Lane::trampoline, call);
    } else {
      e = join_copies();
      if (e == cudaSuccess) e = cudaLaunchHostFunc(cb_, &Lane::trampoline, call);
    }
    if (e != cudaSuccess) {
      delete call;
      throw_cuda(e, "queueing the completion callback (cudaLaunchHostFunc)", kTodoAsync);
    }
  }

  // Blocks (sleeping, not spinning) until every copy and host function queued
  // so far has completed; rethrows their errors.
  void drain() {
    if (copy_[0] == nullptr) return;
    {
      DeviceScope scope(device_);
      cudaError_t e = join_copies();
      if (e == cudaSuccess) e = cudaEventRecord(drain_ev_, cb_);
      if (e == cudaSuccess) e = cudaEventSynchronize(drain_ev_);
      if (e != cudaSuccess) {
        // A plain synchronize gives the error of the failed copy itself.
        cudaError_t e2 = cudaSuccess;
        for (int i = 0; i < n_ && e2 == cudaSuccess; ++i) e2 = cudaStreamSynchronize(copy_[i]);
        throw_cuda(e2 != cudaSuccess ? e2 : e, "an asynchronous copy between the shared region and GPU memory",
                   kTodoAsync);
      }
    }
    rethrow_host_error();
  }

 private:
  // The callback stream waits for everything queued on the copy streams.
  cudaError_t join_copies() {
    cudaError_t e = cudaSuccess;
    for (int i = 0; i < n_ && e == cudaSuccess; ++i) {
      e = cudaEventRecord(chunk_ev_[i], copy_[i]);
      if (e == cudaSuccess) e = cudaStreamWaitEvent(cb_, chunk_ev_[i], 0);
    }
    return e;
  }

  static void CUDART_CB trampoline(void* p) {
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
    if (copy_[0] == nullptr) return;
    int prev = -1;
    if (cudaGetDevice(&prev) == cudaSuccess && prev != device_) (void)cudaSetDevice(device_);
    // Let queued host functions run before their streams go away. Errors here
    // (a dead context, the runtime unloading at exit) are ignored.
    for (int i = 0; i < n_; ++i) (void)cudaStreamSynchronize(copy_[i]);
    (void)cudaStreamSynchronize(cb_);
    for (int i = 0; i < n_; ++i) {
      (void)cudaEventDestroy(chunk_ev_[i]);
      (void)cudaStreamDestroy(copy_[i]);
      chunk_ev_[i] = nullptr;
      copy_[i] = nullptr;
    }
    (void)cudaEventDestroy(order_ev_);
    (void)cudaEventDestroy(drain_ev_);
    (void)cudaStreamDestroy(cb_);
    if (prev >= 0 && prev != device_) (void)cudaSetDevice(prev);
    clear_error();
    cb_ = nullptr;
    order_ev_ = drain_ev_ = nullptr;
  }

  const int n_;
  int device_ = -1;
  unsigned rr_ = 0;
  cudaStream_t copy_[kMaxCopyStreams] = {};
  cudaEvent_t chunk_ev_[kMaxCopyStreams] = {};
  cudaStream_t cb_ = nullptr;
  cudaEvent_t order_ev_ = nullptr, drain_ev_ = nullptr;
  std::atomic<bool> has_host_error_{false};
  std::mutex mu_;
  std::string host_error_;
};

// Copies bytes [offset, offset + n) of a tensor laid out as `l` at `tensor`
// to (to_slot) or from the contiguous slot memory `slot`, on the lane's
// streams.
void copy_async(std::byte* slot, std::byte* tensor, const Strided2D& l, std::uint64_t offset, std::uint64_t n,
                bool to_slot, Lane& lane) {
  auto one = [&](std::byte* s, std::byte* t, std::uint64_t bytes, cudaStream_t stream) {
    const cudaError_t e = to_slot ? cudaMemcpyAsync(s, t, bytes, cudaMemcpyDeviceToHost, stream)
                                  : cudaMemcpyAsync(t, s, bytes, cudaMemcpyHostToDevice, stream);
    if (e != cudaSuccess) throw_cuda(e, std::string("cudaMemcpyAsync ") + (to_slot ? "D2H" : "H2D") + " of " +
                                            std::to_string(bytes) + " bytes", kTodoArgs);
  };
  if (n == 0) return;
  if (l.rows == 0 || l.pitch_bytes == l.row_bytes) {
    const int k = lane.streams();
    if (k == 1 || n < kSplitMin) {
      one(slot, tensor + offset, n, lane.next_stream());
      return;
    }
    // Split a large piece across the copy streams (4 KiB-aligned parts).
    const std::uint64_t part = (n / k + 4095) & ~std::uint64_t{4095};
    for (int i = 0; i < k; ++i) {
      const std::uint64_t a = part * static_cast<std::uint64_t>(i);
      if (a >= n) break;
      const std::uint64_t len = n - a < part ? n - a : part;
      one(slot + a, tensor + offset + a, len, lane.stream(i));
    }
    return;
  }
  cudaStream_t stream = lane.next_stream();
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
    std::byte* t = tensor + row * l.pitch_bytes;
    const std::uint64_t w = l.row_bytes, p = l.pitch_bytes;
    cudaError_t e = to_slot ? cudaMemcpy2DAsync(slot, w, t, p, w, full, cudaMemcpyDeviceToHost, stream)
                            : cudaMemcpy2DAsync(t, p, slot, w, w, full, cudaMemcpyHostToDevice, stream);
    if (e == cudaErrorInvalidPitchValue) {
      // Pitch beyond what the 2D copy takes: one copy per row.
      clear_error();
      for (std::uint64_t r = 0; r < full; ++r) one(slot + r * w, t + r * p, w, stream);
    } else if (e != cudaSuccess) {
      throw_cuda(e, std::string("cudaMemcpy2DAsync ") + (to_slot ? "D2H" : "H2D") + " of " + std::to_string(full) +
                        " rows of " + std::to_string(w) + " bytes (pitch " + std::to_string(p) + ")",
                 kTodoArgs);
    }
  }
  slot += full * l.row_bytes;
  n -= full * l.row_bytes;
  row += full;
  if (n > 0) one(slot, tensor + row * l.pitch_bytes, n, stream);  // tail: a partial row
}

// Host-side scatter of contiguous slot bytes into a (maybe strided) tensor.
void scatter_host(std::byte* base, const Strided2D& l, std::uint64_t offset, const std::byte* src, std::uint64_t n) {
  if (l.rows == 0) {
    std::memcpy(base + offset, src, n);
    return;
  }
  while (n > 0) {
    const std::uint64_t row = offset / l.row_bytes, col = offset % l.row_bytes;
    const std::uint64_t take = l.row_bytes - col < n ? l.row_bytes - col : n;
    std::memcpy(base + row * l.pitch_bytes + col, src, take);
    src += take;
    offset += take;
    n -= take;
  }
}

class CudaProducerEngine final : public ProducerEngine {
 public:
  CudaProducerEngine() : lane_(stream_count("SHMCAST_CUDA_D2H_STREAMS", kD2HStreams)) { lane_.home(current_device()); }
  ~CudaProducerEngine() override = default;  // the lane waits for queued work

  void begin(void* caller_stream) override {
    lane_.home(current_device());
    lane_.after(caller_stream);
  }
  void copy(std::byte* dst, const Buffer& src, std::uint64_t offset, std::uint64_t n) override {
    if (!src.device) {
      // A host source: plain memcpy. Pending async copies into this slot
      // write other bytes, so this cannot race with them.
      gather_host(dst, static_cast<const std::byte*>(src.ptr), src.layout, offset, n);
      return;
    }
    copy_async(dst, static_cast<std::byte*>(src.ptr), src.layout, offset, n, true, lane_);
  }
  void chunk_done(std::function<void()> publish) override { lane_.when_done(std::move(publish)); }
  void drain() override { lane_.drain(); }
  bool is_cuda() const override { return true; }

 private:
  Lane lane_;
};

class CudaConsumerEngine final : public ConsumerEngine {
 public:
  CudaConsumerEngine() : lane_(stream_count("SHMCAST_CUDA_H2D_STREAMS", kH2DStreams)) { lane_.home(current_device()); }
  ~CudaConsumerEngine() override {
    try {
      lane_.drain();  // nothing may still copy into the staging buffer
    } catch (...) {
    }
    free_staging();
  }

  void begin(void* caller_stream) override {
    const int dev = staging_next_ >= 0 ? staging_next_ : current_device();
    staging_next_ = -1;
    lane_.home(dev);
    lane_.after(caller_stream);
  }
  void copy(const Buffer& dst, std::uint64_t offset, const std::byte* src, std::uint64_t n) override {
    if (!dst.device) {
      scatter_host(static_cast<std::byte*>(dst.ptr), dst.layout, offset, src, n);
      return;
    }
    copy_async(const_cast<std::byte*>(src), static_cast<std::byte*>(dst.ptr), dst.layout, offset, n, false, lane_);
  }
  void chunk_done(std::function<void()> release) override { lane_.when_done(std::move(release)); }
  void end(void* caller_stream) override { lane_.before(caller_stream); }
  void drain() override { lane_.drain(); }
  bool is_cuda() const override { return true; }

  std::byte* staging(int device, std::uint64_t bytes) override {
    int count = 0;
    SHMCAST_CK(cudaGetDeviceCount(&count), "cudaGetDeviceCount", "");
    if (device < 0 || device >= count)
      throw Error(Errc::kInvalidArgument, "staging device " + std::to_string(device) + " does not exist (" +
                                              std::to_string(count) + " CUDA devices)");
    lane_.home(device);  // drains first if the lane moves
    staging_next_ = device;
    if (staging_ != nullptr && staging_device_ == device && staging_bytes_ >= bytes) return staging_;
    lane_.drain();  // nothing may still copy into the old buffer
    free_staging();
    DeviceScope scope(device);
    void* p = nullptr;
    const std::uint64_t want = bytes == 0 ? 1 : bytes;
    const cudaError_t e = cudaMalloc(&p, want);
    if (e != cudaSuccess)
      throw_cuda(e, "cudaMalloc of a " + std::to_string(want) + "-byte staging buffer on device " +
                        std::to_string(device),
                 "free GPU memory, or read into your own buffers with read_into_device()");
    staging_ = static_cast<std::byte*>(p);
    staging_bytes_ = want;
    staging_device_ = device;
    return staging_;
  }

 private:
  void free_staging() noexcept {
    if (staging_ == nullptr) return;
    int prev = -1;
    if (cudaGetDevice(&prev) == cudaSuccess && prev != staging_device_) (void)cudaSetDevice(staging_device_);
    (void)cudaFree(staging_);
    if (prev >= 0 && prev != staging_device_) (void)cudaSetDevice(prev);
    clear_error();
    staging_ = nullptr;
    staging_bytes_ = 0;
  }

  Lane lane_;
  int staging_next_ = -1;
  std::byte* staging_ = nullptr;
  std::uint64_t staging_bytes_ = 0;
  int staging_device_ = -1;
};

std::string memlock_text() {
  struct rlimit rl {};
  if (::getrlimit(RLIMIT_MEMLOCK, &rl) != 0) return "unknown";
  if (rl.rlim_cur == RLIM_INFINITY) return "unlimited";
  return std::to_string(rl.rlim_cur) + " bytes";
}

}  // namespace

bool cuda_present(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  clear_error();  // nothing sticky is left for a later call
  if (e != cudaSuccess) {
    if (why) {
      *why = "no CUDA device: " + std::string(cudaGetErrorString(e)) + " (" + cudaGetErrorName(e) + ")";
      if (e == cudaErrorInsufficientDriver || e == cudaErrorNoDevice)
        *why += "; is the NVIDIA driver installed and a GPU visible (nvidia-smi; in a container, run it with "
                "--gpus or the NVIDIA runtime; check CUDA_VISIBLE_DEVICES)?";
    }
    return false;
  }
  if (n == 0) {
    if (why) *why = "no CUDA device: cudaGetDeviceCount found 0 devices (check CUDA_VISIBLE_DEVICES)";
    return false;
  }
  if (why) why->clear();
  return true;
}

std::unique_ptr<ProducerEngine> make_cuda_producer_engine() {
  require_cuda();
  return std::make_unique<CudaProducerEngine>();
}

std::unique_ptr<ConsumerEngine> make_cuda_consumer_engine() {
  require_cuda();
  return std::make_unique<CudaConsumerEngine>();
}

PinInfo cuda_pin(void* base, std::uint64_t bytes) {
  PinInfo info;
  std::string why;
  if (!cuda_present(&why)) {
    info.why = why;
    return info;
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::byte* p = static_cast<std::byte*>(base);
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
  // Map every page of the region into this process first, in one call, rather
  // than have the registration fault them in. Older kernels say EINVAL: fine.
  (void)::madvise(base, bytes, MADV_POPULATE_WRITE);
  std::uint64_t done = 0;
  while (done < bytes) {
    const std::uint64_t n = bytes - done < kPinChunk ? bytes - done : kPinChunk;
    const cudaError_t e = cudaHostRegister(p + done, n, cudaHostRegisterDefault | cudaHostRegisterPortable);
    if (e != cudaSuccess) {
      clear_error();
      for (std::uint64_t u = 0; u < done; u += kPinChunk) (void)cudaHostUnregister(p + u);
      clear_error();
      info.why = "cudaHostRegister of " + std::to_string(n) + " bytes at offset " + std::to_string(done) + " (of " +
                 std::to_string(bytes) + ") failed: " + err_text(e) +
                 ". Page-locking needs RLIMIT_MEMLOCK to cover the region (now " + memlock_text() +
                 "; `ulimit -l unlimited`, or `--ulimit memlock=-1` for a container) and, in a container, "
                 "a /dev/shm large enough for it; or use Pin::kNo (unpinned copies are slower)";
      return info;
    }
    done += n;
  }
  info.pinned = true;
  info.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return info;
}

void cuda_unpin(void* base, std::uint64_t bytes) {
  std::byte* p = static_cast<std::byte*>(base);
  for (std::uint64_t u = 0; u < bytes; u += kPinChunk) (void)cudaHostUnregister(p + u);
  clear_error();
}

}  // namespace shmcast::detail
