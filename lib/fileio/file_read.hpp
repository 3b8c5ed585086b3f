// fileio, the reader: positioned reads into caller memory, many in flight.
// One I/O thread drives an io_uring (O_DIRECT or buffered descriptors,
// optionally registered buffers); or, where io_uring is denied (Docker's
// default seccomp profile: EPERM; Podman's: ENOSYS) or not wanted, a few
// threads call pread(2). Requests are queued in batches; wait(batch) blocks
// until every read of the batch has landed and throws shmcast::Error for the
// first that failed.
#pragma once

#include <sys/uio.h>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace shmcast::detail {

struct ReadReq {
  int fd = -1;              // descriptor to read from
  int buffered_fd = -1;     // the same file without O_DIRECT: where a refused or short O_DIRECT read finishes
  bool direct = false;      // fd has O_DIRECT (offset, length and dst are aligned)
  std::uint64_t offset = 0;
  std::uint64_t len = 0;    // bytes asked for
  std::uint64_t need = 0;   // bytes that must arrive (less than len only at the end of the file)
  std::byte* dst = nullptr;
  int buf_index = -1;       // registered buffer holding [dst, dst + len), or -1
  const std::string* what = nullptr;  // the file, for messages
  std::uint64_t batch = 0;  // set by submit()
};

struct ReadEngineStats {
  std::uint64_t bytes = 0;         // bytes that arrived
  std::uint64_t direct_bytes = 0;  // of those, through O_DIRECT
  std::uint64_t requests = 0;      // reads issued (retries and continuations included)
  std::uint64_t direct_fallbacks = 0;  // O_DIRECT reads finished through the buffered descriptor
};

class ReadEngine {
 public:
  // io_uring with `depth` entries; nullptr (and *why) when it cannot be set
  // up: built without liburing, or io_uring_setup failed.
  static std::unique_ptr<ReadEngine> make_uring(unsigned depth, std::string* why);
  // `threads` threads calling pread(2).
  static std::unique_ptr<ReadEngine> make_pread(unsigned threads);
  ~ReadEngine();
  ReadEngine(const ReadEngine&) = delete;
  ReadEngine& operator=(const ReadEngine&) = delete;

  bool uring() const { return uring_; }
  // Registers buffers for IORING_OP_READ_FIXED, replacing those registered
  // before; only while no read is queued or in flight. False (and *why) when
  // the kernel refuses (RLIMIT_MEMLOCK, ...): reads then use plain buffers.
  bool register_buffers(std::span<const iovec> bufs, std::string* why);
  bool registered() const { return registered_; }

  // Queues the reads; returns the batch number for wait().
  std::uint64_t submit(std::vector<ReadReq> reqs);
  // Blocks until every read of `batch` is done; throws shmcast::Error for the
  // first that failed.
  void wait(std::uint64_t batch);
  ReadEngineStats stats() const;

  struct Uring;

 private:
  ReadEngine() = default;
  void start(unsigned threads);
  void uring_loop();
  void pread_loop();
  void finish(const ReadReq& r, int err);  // under mu_
  // What to do with a completed read of `got` bytes (or -errno): under mu_.
  void complete(ReadReq r, long long got);

  struct Batch {
    std::uint64_t remaining = 0;
    int err = 0;
    std::string message;
  };

  bool uring_ = false;
  bool registered_ = false;
  bool async_buffered_ = true;  // SHMCAST_URING_INLINE=1 turns it off (for measurements)
  unsigned depth_ = 0;
  std::unique_ptr<Uring> ring_;
  mutable std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<ReadReq> queue_;
  std::unordered_map<std::uint64_t, Batch> batches_;
  std::uint64_t next_batch_ = 1;
  unsigned inflight_ = 0;
  bool stop_ = false;
  ReadEngineStats stats_;
  std::vector<std::thread> threads_;
};

}  // namespace shmcast::detail
