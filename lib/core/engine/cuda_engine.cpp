// The CUDA copy engine (built with SHMCAST_WITH_CUDA). Plain C++ against the
// CUDA driver API, which cuda_driver.cpp loads at run time: libshmcast links
// no CUDA library, so one build works on machines with and without a GPU and
// next to any CUDA runtime (torch's, the application's). Only cuda.h is needed
// to build it; no nvcc. Here: the producer's and the consumer's engines (each
// one lane, cuda_lane.hpp, which says how a lane works: its streams in
// cuda_lane.cpp, its completion thread in cuda_poll.cpp, its copies in
// cuda_copy.cpp), the consumer's staging buffer, cuda_present, and the pinning
// of a region's host memory (cuda_pin, cuda_unpin).
#include <sys/mman.h>
#include <sys/resource.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/cuda_driver.hpp"
#include "engine/cuda_fill.hpp"
#include "engine/cuda_lane.hpp"
#include "engine/engine.hpp"

namespace shmcast::detail {

using namespace cuda;  // cuda_lane.hpp

namespace {

constexpr std::uint64_t kPinChunk = 64ull << 30;  // cuMemHostRegister at most 64 GiB per call

// How chunk completions reach the host (cuda_lane.hpp): by the
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

constexpr int kD2HStreams = 1;  // defaults, from docs/benchmarks.md
constexpr int kH2DStreams = 1;
constexpr int kDeviceSlotStreams = 2;  // either direction, device slots (docs/benchmarks.md)

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
      fill_ok_ = dev == lane_.device();  // a kernel there could not read another GPU's tensor
      lane_.after(caller_stream);
      return;
    }
    lane_.home(dev);
    fill_ok_ = true;
    lane_.after(caller_stream);
  }
  void copy(std::byte* dst, const Buffer& src, std::uint64_t offset, std::uint64_t n) override {
    if (src.fill != nullptr) {
      // Made on the GPU (quantize-on-send): a kernel on a copy stream writes
      // a device slot; a host slot through staging pieces (cuda_fill.hpp).
      if (!fill_ok_) throw Error(Errc::kInvalidArgument, "a device fill the engine cannot run (can_fill() was false)");
      if (!device_slots_) {
        if (!stage_) stage_ = std::make_unique<FillStage>(lane_);
        stage_->fill(dst, *src.fill, offset, n);
        return;
      }
      CtxScope scope(lane_.api(), lane_.context());
      src.fill->launch(dst, offset, n, lane_.next_stream());
      return;
    }
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
  bool can_fill(bool pinned) const override { return fill_ok_ && (device_slots_ || pinned); }

 private:
  Lane lane_;
  bool device_slots_;
  bool fill_ok_ = false;             // the last begin()'s caller is on the lane's GPU
  std::unique_ptr<FillStage> stage_;  // host slots' fills (made on the first); waits for its streams when destroyed
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
