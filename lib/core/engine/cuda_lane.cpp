// engine/ (layer 5): a CUDA lane's streams and events (cuda_lane.hpp):
// homed on a device's primary context, ordered after and before the
// caller's stream, completions queued as host functions on the callback
// stream (or handed to the completion thread, cuda_poll.cpp), drained and
// destroyed; and the driver helpers every CUDA engine file shares.
#include <cstdlib>
#include <cstring>
#include <cerrno>
#include <exception>
#include <memory>
#include <mutex>
#include <string>

#include "engine/cuda_driver.hpp"
#include "engine/cuda_lane.hpp"
#include "engine/engine.hpp"

namespace shmcast::detail::cuda {

namespace {

std::string err_text(CUresult e) {
  const cu::Api* a = cu::load(nullptr);
  return a != nullptr ? cu::error_text(*a, e) : "CUresult " + std::to_string(static_cast<int>(e));
}

bool inline_callbacks() {
  static const bool v = [] {
    const char* s = std::getenv("SHMCAST_CUDA_CALLBACKS");
    return s != nullptr && std::strcmp(s, "inline") == 0;
  }();
  return v;
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

}  // namespace

const cu::Api& drv() {
  std::string why;
  const cu::Api* a = cu::load(&why);
  if (a == nullptr) throw Error(Errc::kCudaUnavailable, why);
  return *a;
}

[[noreturn]] void throw_cuda(CUresult e, const std::string& what, const char* todo) {
  std::string msg = "CUDA: " + what + " failed: " + err_text(e);
  if (todo && *todo) msg += std::string("; ") + todo;
  throw Error(Errc::kCuda, msg);
}

std::uint64_t env_number(const char* name, std::uint64_t dflt, std::uint64_t lo, std::uint64_t hi,
                         std::uint64_t multiple) {
  const char* s = std::getenv(name);
  if (s == nullptr || *s < '0' || *s > '9') return dflt;
  char* end = nullptr;
  errno = 0;
  const unsigned long long n = std::strtoull(s, &end, 10);
  const bool ok = errno == 0 && end != nullptr && *end == 0 && n >= lo && n <= hi && n % multiple == 0;
  return ok ? static_cast<std::uint64_t>(n) : dflt;
}

int current_device(const cu::Api& d) {
  CUcontext c = nullptr;
  if (d.cuCtxGetCurrent(&c) == CUDA_SUCCESS && c != nullptr) {
    CUdevice dev = 0;  // a CUdevice is the device's ordinal
    if (d.cuCtxGetDevice(&dev) == CUDA_SUCCESS) return static_cast<int>(dev);
  }
  return 0;
}

int Lane::device_for(void* caller) const {
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

void Lane::home(int dev) {
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

void Lane::after(void* caller) {
  CtxScope scope(d_, ctx_);
  SHMCAST_CK(d_.cuEventRecord(order_ev_, static_cast<CUstream>(caller)), "cuEventRecord on the caller's stream",
             kTodoStream);
  for (int i = 0; i < n_; ++i) SHMCAST_CK(d_.cuStreamWaitEvent(copy_[i], order_ev_, 0), "cuStreamWaitEvent", "");
}

void Lane::before(void* caller) {
  flush_small();
  CtxScope scope(d_, ctx_);
  for (int i = 0; i < n_; ++i) {
    SHMCAST_CK(d_.cuEventRecord(chunk_ev_[i], copy_[i]), "cuEventRecord", "");
    SHMCAST_CK(d_.cuStreamWaitEvent(static_cast<CUstream>(caller), chunk_ev_[i], 0),
               "cuStreamWaitEvent on the caller's stream", kTodoStream);
  }
}

void Lane::when_done(std::function<void()> fn) {
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

void Lane::drain() {
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

CUresult Lane::join_copies() {
  CUresult e = CUDA_SUCCESS;
  for (int i = 0; i < n_ && e == CUDA_SUCCESS; ++i) {
    e = d_.cuEventRecord(chunk_ev_[i], copy_[i]);
    if (e == CUDA_SUCCESS) e = d_.cuStreamWaitEvent(cb_, chunk_ev_[i], 0);
  }
  return e;
}

void CUDA_CB Lane::trampoline(void* p) {
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

void Lane::note_host_error(const char* what) {
  std::lock_guard<std::mutex> lock(mu_);
  if (host_error_.empty()) host_error_ = what;
  has_host_error_.store(true, std::memory_order_release);
}

void Lane::rethrow_host_error() {
  if (!has_host_error_.load(std::memory_order_acquire)) return;
  std::string what;
  {
    std::lock_guard<std::mutex> lock(mu_);
    what.swap(host_error_);
    has_host_error_.store(false, std::memory_order_relaxed);
  }
  throw Error(Errc::kCuda, "a completion callback failed: " + what);
}

void Lane::destroy() noexcept {
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
  small_bytes_ = 0;
  split_.clear();
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

}  // namespace shmcast::detail::cuda
