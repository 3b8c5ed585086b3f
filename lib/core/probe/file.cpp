// The region file before its bytes (file.hpp), and the public calls that
// look at files only: scan_dir() and check_file() of shmcast/probe.hpp.
#include "probe/file.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <grp.h>
#include <pwd.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include "base/checks.hpp"
#include "base/sys.hpp"
#include "shm/region.hpp"

namespace shmcast::detail::probe_impl {

namespace {

std::string user_name(uid_t uid) {
  struct passwd pw {}, *res = nullptr;
  char buf[4096];
  if (::getpwuid_r(uid, &pw, buf, sizeof buf, &res) != 0 || res == nullptr) return {};
  return res->pw_name;
}

std::string group_name(gid_t gid) {
  struct group gr {}, *res = nullptr;
  char buf[4096];
  if (::getgrgid_r(gid, &gr, buf, sizeof buf, &res) != 0 || res == nullptr) return {};
  return res->gr_name;
}

}  // namespace

AlignedBytes::AlignedBytes(std::size_t bytes) : n(bytes) {
  const std::size_t rounded = (bytes + 63) / 64 * 64;
  p.reset(static_cast<std::byte*>(std::aligned_alloc(64, rounded == 0 ? 64 : rounded)));
  if (!p) throw std::bad_alloc();
  std::memset(p.get(), 0, rounded == 0 ? 64 : rounded);
}

FileKind file_kind(mode_t mode) {
  if (S_ISREG(mode)) return {"regular", "a regular file"};
  if (S_ISLNK(mode)) return {"symlink", "a symbolic link (never followed)"};
  if (S_ISFIFO(mode)) return {"fifo", "a FIFO"};
  if (S_ISDIR(mode)) return {"directory", "a directory"};
  if (S_ISSOCK(mode)) return {"socket", "a socket"};
  if (S_ISCHR(mode)) return {"char-device", "a character device"};
  if (S_ISBLK(mode)) return {"block-device", "a block device"};
  return {"unknown", "not a regular file"};
}

P::Owner owner_of(const struct stat& st) {
  P::Owner o;
  o.known = true;
  o.uid = st.st_uid;
  o.gid = st.st_gid;
  o.user = user_name(st.st_uid);
  o.group = group_name(st.st_gid);
  o.mode = st.st_mode & 07777;
  o.trust_problem = trust_problem("the file", st.st_uid, st.st_gid, st.st_mode, TrustPolicy{true, {}});
  o.trusted = o.trust_problem.empty();
  return o;
}

P::Alive pub(Alive a) {
  switch (a) {
    case Alive::kYes: return P::Alive::kYes;
    case Alive::kNo: return P::Alive::kNo;
    default: return P::Alive::kUnknown;
  }
}

int open_region_file(const std::string& path, struct stat* st, int* err) {
  *err = 0;
  const int fd =
      retry_eintr([&] { return ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | O_NOCTTY); });
  if (fd < 0) {
    *err = errno;
    return -1;
  }
  if (::fstat(fd, st) != 0) {
    *err = errno;
    ::close(fd);
    return -1;
  }
  if (!S_ISREG(st->st_mode)) {
    ::close(fd);
    return -1;
  }
  return fd;
}

ReadOnlyMap::~ReadOnlyMap() {
  if (base != nullptr) ::munmap(const_cast<std::byte*>(base), len);
  if (fd >= 0) ::close(fd);
}

}  // namespace shmcast::detail::probe_impl

namespace shmcast::probe {

std::vector<std::string> scan_dir(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    const int e = errno;
    throw Error(detail::errc_for_errno(e), "cannot read region directory " + dir + ": " + std::strerror(e), e);
  }
  const std::string_view prefix = detail::kRegionFilePrefix;
  std::vector<std::string> names;
  while (const struct dirent* e = ::readdir(d)) {
    const std::string_view n = e->d_name;
    if (n.size() > prefix.size() && n.substr(0, prefix.size()) == prefix) names.emplace_back(n.substr(prefix.size()));
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

FileCheck check_file(const std::string& path) {
  namespace I = detail::probe_impl;
  FileCheck c;
  struct stat st {};
  const int fd = I::open_region_file(path, &st, &c.error);
  if (c.error == 0) {  // fstat ran
    c.file_type = I::file_kind(st.st_mode).name;
    c.inode = st.st_ino;
    c.owner = I::owner_of(st);
  }
  if (fd < 0) return c;
  c.regular = true;
  c.any_lock = I::pub(detail::any_lock_held(fd));
  ::close(fd);
  return c;
}

}  // namespace shmcast::probe
