// engine/ (layer 5): a CUDA lane's completion thread (cuda_lane.hpp, the
// third bullet of its comment): completions by polling, the default for
// device slots. poll_when_done records an event from the lane's pool after
// the chunk's copies and queues {event, fn}; the thread waits for each event
// in order (spinning on cuEventQuery, then sleeping in cuEventSynchronize)
// and runs fn; poll_wait_idle lets drain() return only once it has handled
// everything queued; poll_stop ends it (or forgets it in a forked child).
#include <sched.h>
#include <unistd.h>

#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>

#include "base/clock.hpp"  // cpu_relax(), mono_ns()
#include "engine/cuda_driver.hpp"
#include "engine/cuda_lane.hpp"

namespace shmcast::detail::cuda {

namespace {

// How long the polling thread spins on a chunk's event before it sleeps in
// cuEventSynchronize, in ns (SHMCAST_CUDA_POLL_NS, 0..1e9, default 2 ms).
std::int64_t poll_spin_ns() {
  static const auto v = static_cast<std::int64_t>(env_number("SHMCAST_CUDA_POLL_NS", 2'000'000, 0, 1'000'000'000));
  return v;
}

}  // namespace

void Lane::poll_when_done(std::function<void()> fn) {
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

CUresult Lane::poll_event(CUevent ev) {
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

void Lane::poll_loop() {
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

void Lane::poll_wait_idle() {
  if (poller_pid_ != ::getpid()) return;  // a forked child: no thread, and CUDA is unusable here
  std::unique_lock<std::mutex> lock(pmu_);
  pidle_.wait(lock, [this] { return pq_.empty() && pbusy_ == 0; });
}

void Lane::poll_stop() noexcept {
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

}  // namespace shmcast::detail::cuda
