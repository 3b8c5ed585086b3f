#include "file_read.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "shmcast/shmcast.hpp"

#if SHMCAST_WITH_URING
#include <liburing.h>
#endif

namespace shmcast::detail {

namespace {
constexpr std::uint64_t kMaxPread = 1ull << 30;
constexpr int kEndedEarly = -1;  // a read returned 0 before the bytes it needed
}  // namespace

#if SHMCAST_WITH_URING
struct ReadEngine::Uring {
  io_uring ring{};
  bool live = false;
  ~Uring() {
    if (live) io_uring_queue_exit(&ring);
  }
};
#else
struct ReadEngine::Uring {};
#endif

std::unique_ptr<ReadEngine> ReadEngine::make_uring(unsigned depth, std::string* why) {
#if SHMCAST_WITH_URING
  std::unique_ptr<ReadEngine> e(new ReadEngine());
  e->ring_ = std::make_unique<Uring>();
  const int rc = io_uring_queue_init(depth, &e->ring_->ring, 0);
  if (rc < 0) {
    // EPERM under Docker's default seccomp profile (and with
    // kernel.io_uring_disabled), ENOSYS under Podman's and on old kernels.
    *why = std::string("io_uring_setup: ") + std::strerror(-rc);
    return nullptr;
  }
  e->ring_->live = true;
  e->uring_ = true;
  const char* inl = std::getenv("SHMCAST_URING_INLINE");
  e->async_buffered_ = !(inl && std::strcmp(inl, "1") == 0);
  e->depth_ = depth;
  return e;
#else
  (void)depth;
  *why = "built without liburing";
  return nullptr;
#endif
}

std::unique_ptr<ReadEngine> ReadEngine::make_pread(unsigned threads) {
  std::unique_ptr<ReadEngine> e(new ReadEngine());
  e->depth_ = threads;
  return e;
}

ReadEngine::~ReadEngine() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
    // Reads not yet issued are dropped; issued ones are waited for below
    // (the kernel may be writing into their buffers).
    while (!queue_.empty()) {
      finish(queue_.front(), ECANCELED);
      queue_.pop_front();
    }
  }
  work_cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

bool ReadEngine::register_buffers(std::span<const iovec> bufs, std::string* why) {
#if SHMCAST_WITH_URING
  {
    std::lock_guard lk(mu_);
    if (!uring_ || bufs.empty() || inflight_ != 0 || !queue_.empty()) {
      *why = "buffers not registered (reads in flight)";
      return false;
    }
  }
  // The I/O thread is idle (no read queued or in flight): the ring is ours.
  if (registered_) {
    io_uring_unregister_buffers(&ring_->ring);
    registered_ = false;
  }
  const int rc = io_uring_register_buffers(&ring_->ring, bufs.data(), static_cast<unsigned>(bufs.size()));
  if (rc < 0) {
    *why = std::string("io_uring_register_buffers: ") + std::strerror(-rc) +
           (rc == -ENOMEM ? " (RLIMIT_MEMLOCK too low: ulimit -l)" : "");
    return false;
  }
  registered_ = true;
  return true;
#else
  (void)bufs;
  *why = "built without liburing";
  return false;
#endif
}

void ReadEngine::start(unsigned threads) {
  if (uring_) {
    threads_.emplace_back([this] { uring_loop(); });
  } else {
    for (unsigned i = 0; i < threads; ++i) threads_.emplace_back([this] { pread_loop(); });
  }
}

std::uint64_t ReadEngine::submit(std::vector<ReadReq> reqs) {
  std::uint64_t id;
  {
    std::lock_guard lk(mu_);
    if (threads_.empty()) start(depth_);
    id = next_batch_++;
    Batch& b = batches_[id];
    b.remaining = reqs.size();
    for (ReadReq& r : reqs) {
      r.batch = id;
      queue_.push_back(r);
    }
  }
  work_cv_.notify_all();
  return id;
}

void ReadEngine::wait(std::uint64_t batch) {
  std::unique_lock lk(mu_);
  const auto it = batches_.find(batch);
  if (it == batches_.end()) return;
  Batch* pb = &it->second;  // references survive a rehash; iterators do not
  done_cv_.wait(lk, [&] { return pb->remaining == 0; });
  const Batch b = std::move(*pb);
  batches_.erase(batch);
  lk.unlock();
  if (b.err == kEndedEarly) throw Error(Errc::kCorrupt, b.message);
  if (b.err) throw Error(Errc::kSystem, b.message, b.err);
}

ReadEngineStats ReadEngine::stats() const {
  std::lock_guard lk(mu_);
  return stats_;
}

void ReadEngine::finish(const ReadReq& r, int err) {
  const auto it = batches_.find(r.batch);
  if (it == batches_.end()) return;
  Batch& b = it->second;
  if (err && !b.err) {
    b.err = err;
    const std::string file = r.what ? *r.what : std::string("a checkpoint file");
    if (err == kEndedEarly)
      b.message = file + ": the file ended at offset " + std::to_string(r.offset) +
                  ", before the bytes its header promises (it was truncated while being read): load it again "
                  "once it is complete";
    else
      b.message = "reading " + file + " at offset " + std::to_string(r.offset) + ": " + std::strerror(err);
  }
  if (--b.remaining == 0) done_cv_.notify_all();
}

void ReadEngine::complete(ReadReq r, long long got) {
  if (got < 0) {
    const int e = static_cast<int>(-got);
    if (e == EINTR || e == EAGAIN) {
      queue_.push_front(r);
      return;
    }
    if (r.direct && r.buffered_fd >= 0 && (e == EINVAL || e == EOPNOTSUPP)) {
      // The file system refused this O_DIRECT read: finish it buffered.
      r.fd = r.buffered_fd;
      r.direct = false;
      stats_.direct_fallbacks++;
      queue_.push_front(r);
      return;
    }
    finish(r, e);
    return;
  }
  const auto n = static_cast<std::uint64_t>(got);
  stats_.bytes += n;
  if (r.direct) stats_.direct_bytes += n;
  if (n >= r.need) {
    finish(r, 0);
    return;
  }
  if (n == 0) {
    finish(r, kEndedEarly);
    return;
  }
  // A short read: ask for the rest (buffered: the rest may be unaligned).
  r.offset += n;
  r.dst += n;
  r.len -= n;
  r.need -= n;
  if (r.direct) {
    if (r.buffered_fd < 0) {
      finish(r, EIO);
      return;
    }
    r.fd = r.buffered_fd;
    r.direct = false;
    stats_.direct_fallbacks++;
  }
  queue_.push_front(r);
}

void ReadEngine::pread_loop() {
  for (;;) {
    ReadReq r;
    {
      std::unique_lock lk(mu_);
      work_cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      r = queue_.front();
      queue_.pop_front();
      inflight_++;
      stats_.requests++;
    }
    const std::size_t n = static_cast<std::size_t>(std::min(r.len, kMaxPread));
    long long got = ::pread(r.fd, r.dst, n, static_cast<off_t>(r.offset));
    if (got < 0) got = -errno;
    bool more;
    {
      std::lock_guard lk(mu_);
      inflight_--;
      complete(r, got);
      more = !queue_.empty();
    }
    if (more) work_cv_.notify_one();
  }
}

void ReadEngine::uring_loop() {
#if SHMCAST_WITH_URING
  io_uring* ring = &ring_->ring;
  std::vector<ReadReq> slots(depth_);
  std::vector<unsigned> free_slots;
  for (unsigned i = depth_; i > 0; --i) free_slots.push_back(i - 1);
  unsigned inflight = 0;  // this thread's count (inflight_ mirrors it under mu_)
  std::vector<unsigned> issue;
  for (;;) {
    issue.clear();
    {
      std::unique_lock lk(mu_);
      if (inflight == 0) work_cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty() && inflight == 0 && stop_) return;
      while (!queue_.empty() && !free_slots.empty()) {
        const unsigned s = free_slots.back();
        free_slots.pop_back();
        slots[s] = queue_.front();
        queue_.pop_front();
        issue.push_back(s);
        stats_.requests++;
      }
      inflight += static_cast<unsigned>(issue.size());
      inflight_ = inflight;
    }
    for (unsigned s : issue) {
      const ReadReq& r = slots[s];
      io_uring_sqe* sqe = io_uring_get_sqe(ring);  // never null: at most depth_ in flight
      const auto len = static_cast<unsigned>(std::min<std::uint64_t>(r.len, 1u << 30));
      if (r.buf_index >= 0)
        io_uring_prep_read_fixed(sqe, r.fd, r.dst, len, r.offset, r.buf_index);
      else
        io_uring_prep_read(sqe, r.fd, r.dst, len, r.offset);
      // Buffered reads go to io_uring's worker threads (IOSQE_ASYNC), so that
      // copies out of the page cache run on several cores at once instead of
      // one after another inside this thread's io_uring_enter.
      if (!r.direct && async_buffered_) io_uring_sqe_set_flags(sqe, IOSQE_ASYNC);
      io_uring_sqe_set_data64(sqe, s);
    }
    if (inflight == 0) continue;
    const int rc = io_uring_submit_and_wait(ring, 1);
    if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
      // Should not happen with a ring we own; back off and try again (the
      // queued SQEs stay in the ring).
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    io_uring_cqe* cqe = nullptr;
    unsigned head = 0, seen = 0;
    std::lock_guard lk(mu_);
    io_uring_for_each_cqe(ring, head, cqe) {
      const auto s = static_cast<unsigned>(io_uring_cqe_get_data64(cqe));
      const int res = cqe->res;
      ++seen;
      free_slots.push_back(s);
      --inflight;
      complete(slots[s], res);
    }
    io_uring_cq_advance(ring, seen);
    inflight_ = inflight;
  }
#endif
}

}  // namespace shmcast::detail
