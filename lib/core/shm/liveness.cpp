#include "shm/liveness.hpp"

#include "base/sys.hpp"

#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <vector>

namespace shmcast::detail {

namespace {

std::uint64_t read_start_time(const char* stat_path) {
  int fd = ::open(stat_path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  char buf[1024];
  ssize_t n = ::read(fd, buf, sizeof buf - 1);
  ::close(fd);
  if (n <= 0) return 0;
  buf[n] = 0;
  // The command name (field 2) may hold spaces and ')': skip to the last ')'.
  const char* p = std::strrchr(buf, ')');
  if (!p) return 0;
  p++;
  // Fields after ')' start at field 3; start time is field 22.
  for (int field = 3; field < 22; ++field) {
    p = std::strchr(p + 1, ' ');
    if (!p) return 0;
  }
  unsigned long long v = 0;
  if (std::sscanf(p + 1, "%llu", &v) != 1) return 0;
  return v;
}

// fcntl(cmd) of an OFD lock on `len` bytes from `byte` (len 0: to the end).
int lock_op(int fd, int cmd, short type, std::int64_t byte, struct flock* out, std::int64_t len = 1) {
  struct flock fl {};
  fl.l_type = type;
  fl.l_whence = SEEK_SET;
  fl.l_start = byte;
  fl.l_len = len;
  fl.l_pid = 0;  // required for OFD locks
  const int rc = retry_eintr([&] { return ::fcntl(fd, cmd, &fl); });
  if (rc < 0) return -errno;
  if (out) *out = fl;
  return 0;
}

// The tracked descriptors. The prepare handler takes the mutex so that no
// other thread holds it across fork(); the child closes every descriptor.
struct FdRegistry {
  std::mutex mu;
  std::vector<int> fds;
  FdRegistry() {
    ::pthread_atfork([] { registry().mu.lock(); }, [] { registry().mu.unlock(); },
                     [] {
                       FdRegistry& r = registry();
                       for (int fd : r.fds) ::close(fd);
                       r.fds.clear();
                       r.mu.unlock();
                     });
  }
  static FdRegistry& registry() {
    static FdRegistry* r = new FdRegistry();  // never destroyed: atfork handlers outlive statics
    return *r;
  }
};

}  // namespace

ForkGuard::ForkGuard() { FdRegistry::registry().mu.lock(); }
ForkGuard::~ForkGuard() { FdRegistry::registry().mu.unlock(); }

void track_fd(int fd, const ForkGuard&) { FdRegistry::registry().fds.push_back(fd); }

void untrack_fd(int fd, const ForkGuard&) {
  FdRegistry& r = FdRegistry::registry();
  for (std::size_t i = 0; i < r.fds.size(); ++i)
    if (r.fds[i] == fd) {
      r.fds[i] = r.fds.back();
      r.fds.pop_back();
      return;
    }
}

SelfIdentity self_identity() {
  SelfIdentity me{};
  me.pid = static_cast<std::uint32_t>(::getpid());
  me.start_time = read_start_time("/proc/self/stat");
  struct stat st {};
  if (::stat("/proc/self/ns/pid", &st) == 0) me.pidns = st.st_ino;
  return me;
}

void write_identity(Identity& dst, const SelfIdentity& me) {
  dst.pid.store(me.pid, std::memory_order_relaxed);
  dst.start_time.store(me.start_time, std::memory_order_relaxed);
  dst.pidns.store(me.pidns, std::memory_order_release);
}

std::uint64_t process_start_time(std::uint32_t pid) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%u/stat", pid);
  return read_start_time(path);
}

int lock_byte(int fd, std::int64_t byte) {
  int rc = lock_op(fd, F_OFD_SETLK, F_WRLCK, byte, nullptr);
  if (rc == -EACCES) rc = -EAGAIN;
  return rc;
}

int unlock_byte(int fd, std::int64_t byte) { return lock_op(fd, F_OFD_SETLK, F_UNLCK, byte, nullptr); }

Alive lock_held(int fd, std::int64_t byte) {
  struct flock fl {};
  // Probe with a read lock: it conflicts only with a write lock, and needs
  // only read access to the file (inspection tools open read-only).
  if (lock_op(fd, F_OFD_GETLK, F_RDLCK, byte, &fl) != 0) return Alive::kUnknown;
  return fl.l_type == F_UNLCK ? Alive::kNo : Alive::kYes;
}

Alive any_lock_held(int fd) {
  struct flock fl {};
  if (lock_op(fd, F_OFD_GETLK, F_RDLCK, 0, &fl, 0) != 0) return Alive::kUnknown;
  return fl.l_type == F_UNLCK ? Alive::kNo : Alive::kYes;
}

Alive producer_alive_for_join(int fd, const Identity& id) {
  const Alive a = peer_alive(fd, kProducerLockByte, id);
  if (a == Alive::kNo) return a;
  return lock_held(fd, kTakeoverLockByte) == Alive::kYes ? Alive::kNo : a;
}

Alive peer_alive(int fd, std::int64_t byte, const Identity& id) {
  Alive a = lock_held(fd, byte);
  if (a != Alive::kUnknown) return a;
  const SelfIdentity me = self_identity();
  const std::uint64_t ns = id.pidns.load(std::memory_order_acquire);
  if (ns == 0 || ns != me.pidns) return Alive::kUnknown;
  const std::uint32_t pid = id.pid.load(std::memory_order_relaxed);
  const std::uint64_t start = id.start_time.load(std::memory_order_relaxed);
  if (pid == 0) return Alive::kNo;
  const std::uint64_t now_start = process_start_time(pid);
  if (now_start == 0) return Alive::kNo;
  return now_start == start ? Alive::kYes : Alive::kNo;
}

}  // namespace shmcast::detail
