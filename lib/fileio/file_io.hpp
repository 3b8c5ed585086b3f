// fileio, the writer: positioned writes to a file through io_uring when the
// kernel and the seccomp profile allow it, else pwrite(2). Docker's default
// profile denies io_uring_setup (EPERM): the writer then falls back by itself.
// Calls return 0 or -errno, liburing style. Not thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace shmcast::detail {

class FileWriter {
 public:
  FileWriter();
  ~FileWriter();
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;

  // Creates `path` (a new file, mode 0600: shmcast::create_file) for
  // writing. With `allow_uring` false, or SHMCAST_NO_URING=1, only pwrite is
  // used.
  int open(const std::string& path, bool allow_uring = true);
  // Writes to an fd the caller opened and keeps owning (close() leaves it open).
  int attach(int fd, bool allow_uring = true);
  // Queues a write of [buf, buf + n) at `offset`. With io_uring the buffer
  // must stay valid until flush() returns.
  int write_at(const void* buf, std::size_t n, std::uint64_t offset);
  // Waits for every queued write; returns the first error.
  int flush();
  int fsync();
  int close();

  // "io_uring" or "pwrite", and why io_uring is not used when it is not.
  const char* backend() const;
  const std::string& fallback_reason() const { return why_; }
  std::uint64_t bytes_written() const { return written_; }

 private:
  struct Uring;
  int setup_uring(bool allow_uring);
  int fd_ = -1;
  bool owns_fd_ = true;
  std::unique_ptr<Uring> ring_;
  std::string why_;
  std::uint64_t written_ = 0;
  int first_error_ = 0;
};

}  // namespace shmcast::detail
