#include "region.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <boost/interprocess/file_mapping.hpp>
#include <boost/interprocess/mapped_region.hpp>
#include <boost/interprocess/shared_memory_object.hpp>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <optional>

#include "liveness.hpp"
#include "shmcast/shmcast.hpp"

namespace bip = boost::interprocess;

namespace shmcast::detail {

namespace {

constexpr const char* kDevShm = "/dev/shm";

bool is_dev_shm(const std::string& dir) { return dir == kDevShm || dir == "/dev/shm/"; }

std::string file_name(std::string_view name) { return "shmcast." + std::string(name); }

Errc errc_for_errno(int e) {
  switch (e) {
    case EEXIST: return Errc::kExists;
    case ENOENT: return Errc::kNotFound;
    case EACCES:
    case EPERM: return Errc::kPermission;
    case ENOSPC:
    case ENOMEM: return Errc::kRegionFull;
    default: return Errc::kSystem;
  }
}

[[noreturn]] void throw_errno(int e, const std::string& what) {
  std::string msg = what + ": " + std::strerror(e);
  if (e == EACCES || e == EPERM)
    msg += " (regions are created mode 0600: open it as the user that created it, or create it with group_access)";
  throw Error(errc_for_errno(e), msg, e);
}

int boost_errno(const bip::interprocess_exception& ex) {
  int e = ex.get_native_error();
  return e != 0 ? e : EIO;
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

std::string human_bytes(std::uint64_t b) {
  char buf[64];
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  if (u == 0)
    std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(b));
  else if (v < 10.0)
    std::snprintf(buf, sizeof buf, "%.1f %s", v, units[u]);
  else
    std::snprintf(buf, sizeof buf, "%.0f %s", v, units[u]);
  return buf;
}

std::int64_t free_bytes(const std::string& dir) {
  struct statvfs vfs {};
  if (::statvfs(dir.c_str(), &vfs) != 0) return -errno;
  return static_cast<std::int64_t>(vfs.f_bavail) * static_cast<std::int64_t>(vfs.f_frsize);
}

struct MappedFile::Impl {
  std::optional<bip::shared_memory_object> shm;
  std::optional<bip::file_mapping> file;
  std::optional<bip::mapped_region> region;
  int fd() const {
    if (shm) return shm->get_mapping_handle().handle;
    if (file) return file->get_mapping_handle().handle;
    return -1;
  }
};

MappedFile::MappedFile() = default;
MappedFile::MappedFile(MappedFile&&) noexcept = default;
MappedFile& MappedFile::operator=(MappedFile&&) noexcept = default;
MappedFile::~MappedFile() = default;

int MappedFile::fd() const { return impl_ ? impl_->fd() : -1; }

std::uint64_t MappedFile::size_now() const {
  struct stat st {};
  if (fd() < 0 || ::fstat(fd(), &st) != 0) return 0;
  return static_cast<std::uint64_t>(st.st_size);
}

void MappedFile::unmap() {
  if (impl_) {
    impl_->region.reset();
    impl_->shm.reset();
    impl_->file.reset();
  }
  base_ = nullptr;
  size_ = 0;
}

MappedFile MappedFile::create(const std::string& dir, std::string_view name, std::uint64_t bytes,
                              bool group_access, std::int64_t lock_byte) {
  MappedFile mf;
  mf.impl_ = std::make_unique<Impl>();
  mf.path_ = dir + "/" + file_name(name);
  const mode_t mode = group_access ? 0660 : 0600;

  const std::int64_t avail = free_bytes(dir);
  if (avail == -ENOENT) throw Error(Errc::kNotFound, "region directory " + dir + " does not exist", ENOENT);
  if (avail >= 0 && static_cast<std::uint64_t>(avail) < bytes) throw_full(dir, avail, bytes);

  int fd = -1;
  if (is_dev_shm(dir)) {
    try {
      bip::permissions perm(mode);
      mf.impl_->shm.emplace(bip::create_only, file_name(name).c_str(), bip::read_write, perm);
    } catch (const bip::interprocess_exception& ex) {
      throw_errno(boost_errno(ex), "cannot create region " + mf.path_);
    }
    fd = mf.impl_->fd();
  } else {
    int own = ::open(mf.path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, mode);
    if (own < 0) throw_errno(errno, "cannot create region " + mf.path_);
    ::fchmod(own, mode);  // exact mode whatever the umask
    ::close(own);
    try {
      mf.impl_->file.emplace(mf.path_.c_str(), bip::read_write);
    } catch (const bip::interprocess_exception& ex) {
      ::unlink(mf.path_.c_str());
      throw_errno(boost_errno(ex), "cannot open region " + mf.path_);
    }
    fd = mf.impl_->fd();
  }
  ::fcntl(fd, F_SETFD, FD_CLOEXEC);
  if (lock_byte >= 0) {
    if (const int rc = detail::lock_byte(fd, lock_byte); rc != 0) {
      ::unlink(mf.path_.c_str());
      throw_errno(-rc, "cannot lock new region " + mf.path_);
    }
  }

  // Allocate every page now: a full tmpfs fails here with ENOSPC instead of
  // killing a process with SIGBUS at its first touch of an unbacked page.
  int rc;
  do {
    rc = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  } while (rc == EINTR);
  if (rc != 0) {
    ::unlink(mf.path_.c_str());
    if (rc == ENOSPC || rc == ENOMEM || rc == EFBIG) throw_full(dir, free_bytes(dir), bytes);
    throw_errno(rc, "posix_fallocate of region " + mf.path_);
  }

  struct stat st {};
  ::fstat(fd, &st);
  mf.inode_ = st.st_ino;
  try {
    if (mf.impl_->shm)
      mf.impl_->region.emplace(*mf.impl_->shm, bip::read_write, 0, bytes);
    else
      mf.impl_->region.emplace(*mf.impl_->file, bip::read_write, 0, bytes);
  } catch (const bip::interprocess_exception& ex) {
    ::unlink(mf.path_.c_str());
    throw_errno(boost_errno(ex), "cannot map region " + mf.path_);
  }
  mf.base_ = static_cast<std::byte*>(mf.impl_->region->get_address());
  mf.size_ = bytes;
  // Large pages where tmpfs allows them (shmem_enabled=advise); harmless else.
  ::madvise(mf.base_, bytes, MADV_HUGEPAGE);
  return mf;
}

MappedFile MappedFile::open(const std::string& dir, std::string_view name, bool writable) {
  MappedFile mf;
  mf.impl_ = std::make_unique<Impl>();
  mf.path_ = dir + "/" + file_name(name);
  const bip::mode_t mode = writable ? bip::read_write : bip::read_only;
  try {
    if (is_dev_shm(dir))
      mf.impl_->shm.emplace(bip::open_only, file_name(name).c_str(), mode);
    else
      mf.impl_->file.emplace(mf.path_.c_str(), mode);
  } catch (const bip::interprocess_exception& ex) {
    const int e = boost_errno(ex);
    if (e == ENOENT) throw Error(Errc::kNotFound, "no region at " + mf.path_ + " (is the producer running?)", e);
    throw_errno(e, "cannot open region " + mf.path_);
  }
  const int fd = mf.impl_->fd();
  ::fcntl(fd, F_SETFD, FD_CLOEXEC);
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw_errno(errno, "fstat " + mf.path_);
  if (!S_ISREG(st.st_mode)) throw Error(Errc::kCorrupt, mf.path_ + " is not a regular file");
  mf.inode_ = st.st_ino;
  mf.size_ = static_cast<std::uint64_t>(st.st_size);
  if (mf.size_ == 0) return mf;  // creator has not allocated it yet: caller retries
  try {
    if (mf.impl_->shm)
      mf.impl_->region.emplace(*mf.impl_->shm, mode, 0, mf.size_);
    else
      mf.impl_->region.emplace(*mf.impl_->file, mode, 0, mf.size_);
  } catch (const bip::interprocess_exception& ex) {
    throw_errno(boost_errno(ex), "cannot map region " + mf.path_);
  }
  mf.base_ = static_cast<std::byte*>(mf.impl_->region->get_address());
  return mf;
}

}  // namespace shmcast::detail
