#include "shm/region.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <grp.h>
#include <pwd.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <pthread.h>
#include <boost/interprocess/mapped_region.hpp>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <optional>
#include <random>
#include <utility>
#include <vector>

#include "base/checks.hpp"
#include "base/sys.hpp"
#include "base/text.hpp"
#include "shm/liveness.hpp"
#include "shmcast/files.hpp"
#include "shmcast/shmcast.hpp"

namespace bip = boost::interprocess;

namespace shmcast::detail {

namespace {

int boost_errno(const bip::interprocess_exception& ex) {
  int e = ex.get_native_error();
  return e != 0 ? e : EIO;
}

// What Boost.Interprocess needs to map a descriptor we opened ourselves.
struct FdMappable {
  int fd;
  bip::mapping_handle_t get_mapping_handle() const { return bip::ipcdetail::mapping_handle_from_file_handle(fd); }
};

constexpr int kOpenFlags = O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK;

// After open(): refuse what is not a plain file.
void check_regular(int fd, const std::string& path, struct stat* st) {
  if (::fstat(fd, st) != 0) throw_errno(errno, "fstat " + path);
  if (!S_ISREG(st->st_mode)) {
    throw Error(Errc::kCorrupt, path + " is not a regular file (a FIFO, socket, device or directory sits at the "
                                       "region's name): remove it, or pick another region name");
  }
}

[[noreturn]] void throw_open_error(int e, const std::string& path, const char* what) {
  if (e == ELOOP)
    throw Error(Errc::kPermission, path + " is a symbolic link: refused (a region is never opened through a "
                                          "link; someone may be redirecting it): remove the link",
                e);
  if (e == ENOENT) throw Error(Errc::kNotFound, "no region at " + path + " (is the producer running?)", e);
  if (e == EACCES || e == EPERM) {
    struct stat st {};
    std::string who;
    if (::lstat(path.c_str(), &st) == 0) who = " (owned by " + describe_uid(st.st_uid) + ")";
    throw Error(Errc::kPermission, std::string(what) + " " + path + who + ": " + std::strerror(e) +
                                       ": regions are mode 0600; run as the user that created it, or create it "
                                       "with group_access and share a group",
                e);
  }
  throw_errno(e, std::string(what) + " " + path);
}

std::string shm_size_hint(std::uint64_t need) {
  // Suggest a size that fits this region plus headroom, rounded up to GiB.
  std::uint64_t gib = (need + (need >> 2) + (1ull << 30) - 1) >> 30;
  if (gib < 1) gib = 1;
  return std::to_string(gib) + "g";
}

[[noreturn]] void throw_full(const std::string& dir, std::int64_t free, std::uint64_t need) {
  std::string msg = dir + " has " + (free >= 0 ? human_bytes(static_cast<std::uint64_t>(free)) : "unknown space") +
                    " free, region needs " + human_bytes(need) + ": run the container with --shm-size=" +
                    shm_size_hint(need) +
                    ", point SHMCAST_DIR at a larger tmpfs, or use fewer or smaller slots";
  throw Error(Errc::kRegionFull, msg, ENOSPC);
}

}  // namespace

int open_exclusive(const std::string& path, int access, unsigned mode) {
  const int fd = ::open(path.c_str(), access | O_CREAT | O_EXCL | kOpenFlags, static_cast<mode_t>(mode));
  if (fd < 0) return -errno;
  // The exact mode whatever the umask, on the descriptor: never by path.
  if (::fchmod(fd, static_cast<mode_t>(mode)) != 0) {
    const int e = errno;
    ::close(fd);
    ::unlink(path.c_str());  // ours: O_EXCL made it, and a name we created is ours to remove
    return -e;
  }
  return fd;
}

std::string trim_dir(std::string_view dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.remove_suffix(1);
  return std::string(dir);
}

std::string region_file(std::string_view dir, std::string_view name) {
  std::string p = trim_dir(dir);
  p += '/';
  p += kRegionFilePrefix;
  p += name;
  return p;
}

std::int64_t free_bytes(const std::string& dir) {
  struct statvfs vfs {};
  if (::statvfs(dir.c_str(), &vfs) != 0) return -errno;
  return static_cast<std::int64_t>(vfs.f_bavail) * static_cast<std::int64_t>(vfs.f_frsize);
}

struct MappedFile::Impl {
  std::unique_ptr<bip::mapped_region> region;
};

MappedFile::MappedFile() = default;
MappedFile::MappedFile(MappedFile&& o) noexcept { *this = std::move(o); }
MappedFile& MappedFile::operator=(MappedFile&& o) noexcept {
  if (this != &o) {
    unmap();
    impl_ = std::move(o.impl_);
    fd_ = std::exchange(o.fd_, -1);
    base_ = std::exchange(o.base_, nullptr);
    size_ = std::exchange(o.size_, 0);
    inode_ = o.inode_;
    dev_ = o.dev_;
    uid_ = o.uid_;
    gid_ = o.gid_;
    mode_ = o.mode_;
    pid_ = o.pid_;
    path_ = std::move(o.path_);
  }
  return *this;
}
MappedFile::~MappedFile() { unmap(); }

namespace {

// This process's pid, without a getpid() system call each time (inherited()
// is asked on every write of a tensor: 100,000 tensors, 100,000 calls). A
// fork() child refreshes it in its atfork handler, registered before the
// first value is stored.
std::atomic<pid_t> g_self_pid{0};
void refresh_self_pid() { g_self_pid.store(::getpid(), std::memory_order_relaxed); }
pid_t self_pid() {
  static std::once_flag once;
  std::call_once(once, [] {
    ::pthread_atfork(nullptr, nullptr, refresh_self_pid);
    refresh_self_pid();
  });
  return g_self_pid.load(std::memory_order_relaxed);
}

}  // namespace

bool MappedFile::inherited() const { return fd_ >= 0 && pid_ != self_pid(); }

std::uint64_t MappedFile::size_now() const {
  struct stat st {};
  if (fd_ < 0 || inherited() || ::fstat(fd_, &st) != 0) return 0;
  return static_cast<std::uint64_t>(st.st_size);
}

bool MappedFile::still_at_path() const {
  struct stat st {};
  return ::lstat(path_.c_str(), &st) == 0 && st.st_ino == inode_ && st.st_dev == dev_;
}

bool MappedFile::unlink_if_same() const {
  // A window remains between the check and the unlink; in a directory with
  // the sticky bit (as /dev/shm has) nobody else can rename our file into it.
  return still_at_path() && ::unlink(path_.c_str()) == 0;
}

int MappedFile::protect_from(std::uint64_t from, bool writable) {
  if (base_ == nullptr || inherited()) return -EINVAL;
  const std::uint64_t page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  from = (from + page - 1) / page * page;
  if (from >= size_) return 0;
  if (::mprotect(base_ + from, size_ - from, writable ? PROT_READ | PROT_WRITE : PROT_READ) != 0) return -errno;
  return 0;
}

void MappedFile::take_stat(const struct stat& st) {
  inode_ = st.st_ino;
  dev_ = st.st_dev;
  uid_ = st.st_uid;
  gid_ = st.st_gid;
  mode_ = st.st_mode & 07777;
}

void MappedFile::close_fd() {
  if (fd_ >= 0) {
    ForkGuard g;
    untrack_fd(fd_, g);
    ::close(fd_);
  }
  fd_ = -1;
}

void MappedFile::unmap() {
  if (fd_ >= 0 && pid_ != ::getpid()) {
    // A copy inherited through fork: the mapping was not inherited
    // (MADV_DONTFORK) and the descriptor was closed at fork. Touch neither:
    // the address range and the descriptor number may be reused by now.
    if (impl_) (void)impl_->region.release();
    fd_ = -1;
  } else {
    if (impl_) impl_->region.reset();
    close_fd();
  }
  base_ = nullptr;
  size_ = 0;
}

void MappedFile::map(bool writable) {
  if (size_ == 0) return;
  if (!impl_) impl_ = std::make_unique<Impl>();
  // A forked child must not inherit the mapping: it would keep the region's
  // open file description, and with it this process's liveness locks, alive.
  // The guard keeps a fork() from another thread out of mmap..madvise.
  ForkGuard g;
  try {
    impl_->region = std::make_unique<bip::mapped_region>(FdMappable{fd_}, writable ? bip::read_write : bip::read_only,
                                                         0, static_cast<std::size_t>(size_));
  } catch (const bip::interprocess_exception& ex) {
    throw_errno(boost_errno(ex), "cannot map region " + path_);
  }
  base_ = static_cast<std::byte*>(impl_->region->get_address());
  ::madvise(base_, size_, MADV_DONTFORK);
}

MappedFile MappedFile::create(const std::string& dir, std::string_view name, std::uint64_t bytes,
                              bool group_access, std::int64_t lock_byte,
                              std::span<const std::pair<std::uint64_t, std::uint64_t>> sparse) {
  MappedFile mf;
  mf.path_ = region_file(dir, name);
  mf.pid_ = ::getpid();
  const mode_t mode = group_access ? 0660 : 0600;

  // The ranges allocated now: [0, bytes) less the sparse ones.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> dense;
  std::uint64_t at = 0, need = 0;
  for (const auto& [from, to] : sparse) {
    if (from < at || to < from || to > bytes) throw Error(Errc::kInvalidArgument, "bad sparse range of a region");
    if (from > at) dense.emplace_back(at, from);
    at = to;
  }
  if (at < bytes) dense.emplace_back(at, bytes);
  for (const auto& [from, to] : dense) need += to - from;

  const std::int64_t avail = free_bytes(dir);
  if (avail == -ENOENT) throw Error(Errc::kNotFound, "region directory " + dir + " does not exist", ENOENT);
  if (avail >= 0 && static_cast<std::uint64_t>(avail) < need) throw_full(dir, avail, need);

  // The one open of the path: everything below works on this descriptor.
  int fd;
  {
    ForkGuard g;
    fd = open_exclusive(mf.path_, O_RDWR, mode);
    if (fd >= 0) track_fd(fd, g);
  }
  if (fd < 0) {
    const int e = -fd;
    if (e == EEXIST) throw Error(Errc::kExists, "region " + mf.path_ + " exists", e);
    throw_open_error(e, mf.path_, "cannot create region");
  }
  mf.fd_ = fd;
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw_errno(errno, "fstat " + mf.path_);
  mf.take_stat(st);
  // From here on, failures remove the file we made (and only that file).
  auto fail = [&](auto&& thrower) {
    mf.unlink_if_same();
    thrower();
  };
  if (lock_byte >= 0) {
    if (const int rc = detail::lock_byte(fd, lock_byte); rc != 0) {
      // Someone who found the name took the lock first: the name is theirs now.
      if (rc == -EAGAIN) throw Error(Errc::kExists, "another producer took region " + mf.path_ + " over as it was created", EAGAIN);
      fail([&] { throw_errno(-rc, "cannot lock new region " + mf.path_); });
    }
    // Between the create and the lock, another producer may have found the
    // name unlocked, taken it over and removed it: then the name is not ours.
    if (!mf.still_at_path())
      throw Error(Errc::kExists, "another producer replaced region " + mf.path_ + " as it was created", EEXIST);
  }

  // Allocate every page now (but the sparse ranges', which their writer
  // allocates before it writes them): a full tmpfs fails here with ENOSPC
  // instead of killing a process with SIGBUS at its first touch of an
  // unbacked page. The file keeps size 0 until every range is allocated
  // (FALLOC_FL_KEEP_SIZE, then one ftruncate), so an opener sees it empty
  // (being created) or whole, never in between. A filesystem without
  // KEEP_SIZE gets the whole file allocated (no sparse areas there).
  auto alloc = [&](int mode, std::uint64_t from, std::uint64_t len) {
    int rc;
    do {
      rc = mode == 0 ? ::posix_fallocate(fd, static_cast<off_t>(from), static_cast<off_t>(len))
                     : (::fallocate(fd, mode, static_cast<off_t>(from), static_cast<off_t>(len)) == 0 ? 0 : errno);
    } while (rc == EINTR);
    return rc;
  };
  auto fail_alloc = [&](int rc, std::uint64_t want) {
    if (rc == ENOSPC || rc == ENOMEM || rc == EFBIG) fail([&] { throw_full(dir, free_bytes(dir), want); });
    fail([&] { throw_errno(rc, "fallocate of region " + mf.path_); });
  };
  bool whole = false;
  for (const auto& [from, to] : dense) {
    if (to == from) continue;
    const int rc = alloc(FALLOC_FL_KEEP_SIZE, from, to - from);
    if (rc == EOPNOTSUPP) {
      whole = true;
      break;
    }
    if (rc != 0) fail_alloc(rc, need);
  }
  if (whole) {
    if (const int rc = alloc(0, 0, bytes); rc != 0) fail_alloc(rc, bytes);
  } else if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int e = errno;
    fail([&] { throw_errno(e, "ftruncate of region " + mf.path_); });
  }
  mf.size_ = bytes;
  try {
    mf.map(true);
  } catch (...) {
    mf.unlink_if_same();
    throw;
  }
  // Large pages where tmpfs allows them (shmem_enabled=advise); harmless else.
  ::madvise(mf.base_, bytes, MADV_HUGEPAGE);
  return mf;
}

void MappedFile::allocate(std::uint64_t offset, std::uint64_t len) const {
  if (len == 0) return;
  if (offset > size_ || len > size_ - offset)
    throw Error(Errc::kInvalidArgument, "allocation outside region " + path_);
  int rc;
  do {
    rc = ::posix_fallocate(fd_, static_cast<off_t>(offset), static_cast<off_t>(len));
  } while (rc == EINTR);
  if (rc == 0) return;
  const std::string dir = path_.substr(0, path_.rfind('/'));
  if (rc == ENOSPC || rc == ENOMEM || rc == EFBIG) throw_full(dir, free_bytes(dir), len);
  throw_errno(rc, "posix_fallocate of region " + path_);
}

int MappedFile::read_at(std::uint64_t offset, void* dst, std::uint64_t len) const {
  auto* out = static_cast<char*>(dst);
  while (len > 0) {
    const ssize_t n = ::pread(fd_, out, static_cast<std::size_t>(std::min<std::uint64_t>(len, 1ull << 30)),
                              static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (n == 0) return -EIO;  // the file ends before the range does
    out += n;
    offset += static_cast<std::uint64_t>(n);
    len -= static_cast<std::uint64_t>(n);
  }
  return 0;
}

MappedFile MappedFile::open_unmapped(const std::string& dir, std::string_view name, bool writable) {
  MappedFile mf;
  mf.path_ = region_file(dir, name);
  mf.pid_ = ::getpid();
  int fd;
  {
    ForkGuard g;
    fd = ::open(mf.path_.c_str(), (writable ? O_RDWR : O_RDONLY) | kOpenFlags);
    if (fd >= 0) track_fd(fd, g);
  }
  if (fd < 0) throw_open_error(errno, mf.path_, "cannot open region");
  mf.fd_ = fd;  // closed (and untracked) by mf on every path below
  struct stat st {};
  check_regular(fd, mf.path_, &st);
  mf.take_stat(st);
  mf.size_ = static_cast<std::uint64_t>(st.st_size);
  return mf;
}

MappedFile MappedFile::open(const std::string& dir, std::string_view name, bool writable) {
  MappedFile mf = open_unmapped(dir, name, writable);
  mf.map(writable);  // size 0: the creator has not allocated it yet; the caller retries
  return mf;
}

void throw_inherited(const char* what, const MappedFile& f) {
  throw Error(Errc::kInvalidArgument, std::string("this ") + what + " was made by process " +
                                          std::to_string(f.opener_pid()) + "; this process (" +
                                          std::to_string(::getpid()) +
                                          ") is a child forked from it and cannot use it: make a new one in the "
                                          "child (its parent's stays the parent's, and closing it here does nothing)");
}

std::string describe_uid(std::uint32_t uid) {
  std::string s = "uid " + std::to_string(uid);
  struct passwd pw {};
  struct passwd* res = nullptr;
  char buf[1024];
  if (::getpwuid_r(uid, &pw, buf, sizeof buf, &res) == 0 && res && res->pw_name) s += std::string(" (") + res->pw_name + ")";
  return s;
}

namespace {
bool in_my_groups(gid_t gid) {
  if (gid == ::getegid()) return true;
  const int n = ::getgroups(0, nullptr);
  if (n <= 0) return false;
  std::vector<gid_t> groups(static_cast<std::size_t>(n));
  const int got = ::getgroups(n, groups.data());
  for (int i = 0; i < got; ++i)
    if (groups[static_cast<std::size_t>(i)] == gid) return true;
  return false;
}
}  // namespace

bool uid_trusted(std::uint32_t uid, const TrustPolicy& policy) {
  bool ok = uid == ::geteuid();
  for (std::uint32_t u : policy.trusted_uids) ok = ok || uid == u;
  return ok;
}

std::string trust_problem(const std::string& path, std::uint32_t uid, std::uint32_t gid, std::uint32_t mode_bits,
                          const TrustPolicy& policy) {
  char mode[8];
  std::snprintf(mode, sizeof mode, "%04o", mode_bits & 07777);
  const std::uint32_t me = ::geteuid();
  if (!uid_trusted(uid, policy))
    return "region " + path + " belongs to " + describe_uid(uid) + " (mode " + mode + "), not to this process (" +
           describe_uid(me) + "): refused, since anyone who owns it can change the tensors under you; run both "
           "sides as one user, or list that uid in trusted_uids if you trust it";
  if (mode_bits & S_IWOTH)
    return "region " + path + " (owner " + describe_uid(uid) + ") is mode " + mode +
           ", writable by every user: refused; the producer creates regions 0600 or 0660, so someone changed it";
  if ((mode_bits & S_IWGRP) && !(policy.group_access && in_my_groups(gid)))
    return "region " + path + " (owner " + describe_uid(uid) + ") is mode " + mode + ", writable by group " +
           std::to_string(gid) + (policy.group_access ? ", which this user is not in: refused"
                                                      : ": refused unless the consumer sets group_access and belongs "
                                                        "to that group");
  return {};
}

std::string trust_problem(const MappedFile& f, const TrustPolicy& policy) {
  return trust_problem(f.path(), f.owner_uid(), f.owner_gid(), f.mode(), policy);
}

std::string peer_trust_problem(const PeerCred& peer, const TrustPolicy& policy, std::int64_t region_gid) {
  if (uid_trusted(peer.uid, policy)) return {};
  bool in_group = false;
  if (policy.group_access && region_gid >= 0) {
    const auto g = static_cast<std::uint32_t>(region_gid);
    in_group = peer.gid == g;
    for (std::uint32_t x : peer.groups) in_group = in_group || x == g;
  }
  if (in_group) return {};
  std::string group_rule;
  if (!policy.group_access)
    group_rule = "the region is not shared with a group (group_access is off)";
  else if (region_gid < 0)
    group_rule = "no region group is known";
  else
    group_rule = "it is not in the region's group " + std::to_string(region_gid);
  return "process " + std::to_string(peer.pid) + " runs as " + describe_uid(peer.uid) + " (gid " +
         std::to_string(peer.gid) + "), which this producer (" + describe_uid(::geteuid()) +
         ") does not trust: not its uid, not a trusted uid, and " + group_rule +
         "; run the consumer as the producer's user, or share the region with a group (group_access) the consumer "
         "is in";
}

}  // namespace shmcast::detail

// ---------------------------------------------------------------- shmcast/files.hpp

namespace shmcast {

namespace {

[[noreturn]] void throw_create_error(int e, const std::string& path) {
  if (e == EEXIST)
    throw Error(Errc::kExists, path + " exists (a file, a link or another object sits at the name): shmcast creates "
                                      "files only under new names and never opens what it finds there",
                e);
  if (e == ENOENT) throw Error(Errc::kNotFound, "cannot create " + path + ": its directory does not exist", e);
  if (e == EACCES || e == EPERM)
    throw Error(Errc::kPermission, "cannot create " + path + ": " + std::strerror(e) +
                                       " (the directory is not writable by this user)",
                e);
  detail::throw_errno(e, "cannot create " + path);
}

std::string random_suffix() {
  static constexpr char kChars[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  std::random_device rd;
  std::string s;
  for (int i = 0; i < 12; ++i) s += kChars[rd() % (sizeof kChars - 1)];
  return s;
}

}  // namespace

int create_file(const std::string& path, unsigned mode) {
  const int fd = detail::open_exclusive(path, O_RDWR, mode);
  if (fd < 0) throw_create_error(-fd, path);
  return fd;
}

int create_temp_file(const std::string& dir, std::string_view prefix, unsigned mode, std::string* path) {
  std::string base = detail::trim_dir(dir.empty() ? std::string_view(".") : std::string_view(dir));
  if (base.back() != '/') base += '/';
  base += prefix;
  int e = EEXIST;
  for (int attempt = 0; attempt < 64 && e == EEXIST; ++attempt) {
    std::string p = base + random_suffix();
    const int fd = detail::open_exclusive(p, O_RDWR, mode);
    if (fd >= 0) {
      if (path) *path = std::move(p);
      return fd;
    }
    e = -fd;
  }
  throw_create_error(e, base + "XXXXXXXXXXXX");
}

void replace_file(const std::string& path, std::string_view contents, unsigned mode) {
  const std::size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  if (name.empty()) throw Error(Errc::kInvalidArgument, "replace_file: '" + path + "' names no file");
  std::string tmp;
  const int fd = create_temp_file(dir, "." + name + ".tmp.", mode, &tmp);
  for (std::size_t done = 0; done < contents.size();) {
    const ssize_t w = detail::retry_eintr([&] { return ::write(fd, contents.data() + done, contents.size() - done); });
    if (w > 0) {
      done += static_cast<std::size_t>(w);
    } else {
      const int e = w < 0 ? errno : EIO;
      ::close(fd);
      ::unlink(tmp.c_str());
      detail::throw_errno(e, "cannot write " + tmp);
    }
  }
  if (::close(fd) != 0) {
    const int e = errno;
    ::unlink(tmp.c_str());
    detail::throw_errno(e, "cannot write " + tmp);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    ::unlink(tmp.c_str());
    detail::throw_errno(e, "cannot rename " + tmp + " to " + path);
  }
}

}  // namespace shmcast
