#include "file_io.hpp"

#include "base/sys.hpp"
#include "shmcast/files.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#if SHMCAST_WITH_URING
#include <liburing.h>
#endif

namespace shmcast::detail {

namespace {
constexpr unsigned kDepth = 64;
constexpr std::size_t kMaxIo = 1u << 30;  // one write never exceeds 1 GiB

int pwrite_all(int fd, const char* p, std::size_t n, std::uint64_t off) {
  while (n > 0) {
    const ssize_t w = shmcast::detail::retry_eintr([&] { return ::pwrite(fd, p, n < kMaxIo ? n : kMaxIo, static_cast<off_t>(off)); });
    if (w < 0) return -errno;
    if (w == 0) return -EIO;
    p += w;
    n -= static_cast<std::size_t>(w);
    off += static_cast<std::uint64_t>(w);
  }
  return 0;
}
}  // namespace

#if SHMCAST_WITH_URING
struct FileWriter::Uring {
  io_uring ring{};
  unsigned inflight = 0;
  // Short writes are finished with pwrite from the completion: keep what
  // each request asked for.
  struct Req {
    const char* buf;
    std::size_t n;
    std::uint64_t off;
  };
  Req reqs[kDepth]{};
  unsigned free_list[kDepth]{};
  unsigned free_n = 0;
  bool live = false;
  ~Uring() {
    if (live) io_uring_queue_exit(&ring);
  }
};
#else
struct FileWriter::Uring {};
#endif

FileWriter::FileWriter() = default;
FileWriter::~FileWriter() { close(); }

const char* FileWriter::backend() const { return ring_ ? "io_uring" : "pwrite"; }

int FileWriter::open(const std::string& path, bool allow_uring) {
  if (fd_ >= 0) return -EBUSY;
  // Created the way every file of the project is (shmcast/files.hpp).
  try {
    fd_ = shmcast::create_file(path, 0600);
  } catch (const shmcast::Error& e) {
    return e.sys_errno() != 0 ? -e.sys_errno() : -EIO;
  }
  owns_fd_ = true;
  return setup_uring(allow_uring);
}

int FileWriter::attach(int fd, bool allow_uring) {
  if (fd_ >= 0) return -EBUSY;
  if (fd < 0) return -EBADF;
  fd_ = fd;
  owns_fd_ = false;
  return setup_uring(allow_uring);
}

int FileWriter::setup_uring(bool allow_uring) {
  const char* env = std::getenv("SHMCAST_NO_URING");
  if (!allow_uring || (env && std::strcmp(env, "1") == 0)) {
    why_ = "disabled";
    return 0;
  }
#if SHMCAST_WITH_URING
  auto r = std::make_unique<Uring>();
  const int rc = io_uring_queue_init(kDepth, &r->ring, 0);
  if (rc < 0) {
    // EPERM under Docker's default seccomp profile, ENOSYS on old kernels.
    why_ = std::string("io_uring_setup: ") + std::strerror(-rc);
    return 0;
  }
  r->live = true;
  for (unsigned i = 0; i < kDepth; ++i) r->free_list[r->free_n++] = i;
  ring_ = std::move(r);
#else
  why_ = "built without liburing";
#endif
  return 0;
}

int FileWriter::write_at(const void* buf, std::size_t n, std::uint64_t offset) {
  if (fd_ < 0) return -EBADF;
  if (first_error_) return first_error_;
  const char* p = static_cast<const char*>(buf);
  if (!ring_) {
    const int rc = pwrite_all(fd_, p, n, offset);
    if (rc == 0) written_ += n;
    return rc;
  }
#if SHMCAST_WITH_URING
  while (n > 0) {
    const std::size_t take = n < kMaxIo ? n : kMaxIo;
    if (ring_->free_n == 0) {
      const int rc = flush();
      if (rc) return rc;
    }
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_->ring);
    if (!sqe) {
      const int rc = flush();
      if (rc) return rc;
      continue;
    }
    const unsigned slot = ring_->free_list[--ring_->free_n];
    ring_->reqs[slot] = {p, take, offset};
    io_uring_prep_write(sqe, fd_, p, static_cast<unsigned>(take), offset);
    io_uring_sqe_set_data64(sqe, slot);
    ring_->inflight++;
    p += take;
    n -= take;
    offset += take;
  }
  const int rc = io_uring_submit(&ring_->ring);
  return rc < 0 ? rc : 0;
#else
  return -ENOSYS;
#endif
}

int FileWriter::flush() {
  if (!ring_) return first_error_;
#if SHMCAST_WITH_URING
  Uring& u = *ring_;
  while (u.inflight > 0) {
    io_uring_cqe* cqe = nullptr;
    int rc = io_uring_wait_cqe(&u.ring, &cqe);
    if (rc == -EINTR) continue;
    if (rc < 0) return first_error_ = rc;
    const unsigned slot = static_cast<unsigned>(io_uring_cqe_get_data64(cqe));
    const int res = cqe->res;
    io_uring_cqe_seen(&u.ring, cqe);
    u.inflight--;
    const Uring::Req req = u.reqs[slot];
    u.free_list[u.free_n++] = slot;
    if (res < 0) {
      if (!first_error_) first_error_ = res;
      continue;
    }
    const std::size_t done = static_cast<std::size_t>(res);
    if (done < req.n) {  // short write: finish it synchronously
      const int e = pwrite_all(fd_, req.buf + done, req.n - done, req.off + done);
      if (e && !first_error_) first_error_ = e;
    }
    written_ += req.n;
  }
#endif
  return first_error_;
}

int FileWriter::fsync() {
  if (fd_ < 0) return -EBADF;
  const int rc = flush();
  if (rc) return rc;
  return ::fsync(fd_) == 0 ? 0 : -errno;
}

int FileWriter::close() {
  if (fd_ < 0) return 0;
  int rc = flush();
  ring_.reset();
  if (owns_fd_ && ::close(fd_) != 0 && rc == 0) rc = -errno;
  fd_ = -1;
  return rc;
}

}  // namespace shmcast::detail
