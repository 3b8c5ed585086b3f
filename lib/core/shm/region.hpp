// shm/ (layer 1): the named region. A file in the region directory ($SHMCAST_DIR or
// /dev/shm), created O_EXCL with mode 0600 (0660 on request), allocated with
// posix_fallocate before it is mapped, so that a full tmpfs is an error at
// create time and never a SIGBUS later. Ranges the creator names sparse (the
// manifest areas: room for the largest manifest, most of it never used) stay
// holes until the writer allocates the part it is about to write
// (allocate()); readers of such a range copy it with read_at() (pread), which
// reads a hole as zeros and never faults.
//
// The path is opened once: every open uses O_NOFOLLOW|O_CLOEXEC|O_NONBLOCK
// (a symlink is refused, a FIFO never blocks), and everything after it
// (fstat checks, fallocate, locks, mmap) works on that one descriptor.
// Boost.Interprocess's mapped_region maps the descriptor (RAII unmap).
//
// Fork: the mapping is MADV_DONTFORK and every region descriptor is closed
// in a forked child (pthread_atfork), so a child never holds a reference to
// the region's open file description, and so never keeps its parent's OFD
// liveness locks alive. A MappedFile inherited by a child never unmaps or
// closes anything.
//
// region.cpp includes shm/liveness.hpp (the liveness locks) for one call: create()
// takes the creator's OFD lock byte (liveness's lock_byte) on the descriptor
// it just opened, before anyone can find the file, so a racing opener never
// sees a new region without its owner's lock. The lock rules (lock_op, its
// EINTR retry, EACCES read as EAGAIN, GETLK probes) stay whole in liveness:
// copying lock_byte down would write them twice. Both files are shm/, so the
// include stays inside one folder (scripts/check-layers).
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace shmcast::detail {

// Region `name` is the file <dir>/shmcast.<name>.
inline constexpr std::string_view kRegionFilePrefix = "shmcast.";
std::string region_file(std::string_view dir, std::string_view name);
// `dir` without trailing slashes ("/" stays "/").
std::string trim_dir(std::string_view dir);

// The one way the project creates a file (a region, a status file, a
// dump; shmcast/files.hpp): open(O_CREAT|O_EXCL|O_NOFOLLOW|O_CLOEXEC|
// O_NONBLOCK | access, mode) of a name that must not exist, so nothing at
// the name (a planted link, a FIFO, another user's file) is ever opened,
// then fchmod(mode) on the descriptor. Returns the descriptor or -errno.
int open_exclusive(const std::string& path, int access, unsigned mode);

// Who may have made a region this process trusts: its owner must be our
// effective uid or one of `trusted_uids`; no other-write bit; group write
// only with `group_access` and a group we belong to.
struct TrustPolicy {
  bool group_access = false;
  std::vector<std::uint32_t> trusted_uids;
};

class MappedFile {
 public:
  // Creates `path` exclusively and maps `bytes` of it read-write. Throws
  // shmcast::Error (kRegionFull with free vs needed bytes, kExists, ...).
  // With `lock_byte` >= 0 the OFD write lock on that byte is taken right
  // after the file exists, before it is allocated: a second creator racing
  // for the name then sees a live owner, never an abandoned file.
  // `sparse`: [offset, end) ranges (page-aligned, ascending, inside
  // `bytes`) left unallocated; the free-space check counts only the rest.
  static MappedFile create(const std::string& dir, std::string_view name, std::uint64_t bytes, bool group_access,
                           std::int64_t lock_byte = -1,
                           std::span<const std::pair<std::uint64_t, std::uint64_t>> sparse = {});
  // Opens an existing region file, read-write when `writable`, and maps the
  // whole file; a file of size 0 (being created) is returned unmapped with
  // size() 0. Refuses symlinks and non-regular files. Does not judge the
  // owner: call trust_problem().
  static MappedFile open(const std::string& dir, std::string_view name, bool writable);
  // Opens without mapping: for probing the owner and the liveness locks.
  static MappedFile open_unmapped(const std::string& dir, std::string_view name, bool writable);

  MappedFile();
  MappedFile(MappedFile&&) noexcept;
  MappedFile& operator=(MappedFile&&) noexcept;
  ~MappedFile();

  std::byte* data() const { return base_; }
  std::uint64_t size() const { return size_; }
  // The file's size now (fstat), 0 when unknown. Differs from size() when
  // another process truncated or grew the file after it was mapped.
  std::uint64_t size_now() const;
  int fd() const { return fd_; }  // for OFD locks; valid until unmap()
  const std::string& path() const { return path_; }
  std::uint64_t inode() const { return inode_; }
  std::uint32_t owner_uid() const { return uid_; }
  std::uint32_t owner_gid() const { return gid_; }
  std::uint32_t mode() const { return mode_; }  // permission bits
  // True in a process forked from the one that opened the file: such a copy
  // must not be used (its descriptor is closed, its mapping absent).
  bool inherited() const;
  pid_t opener_pid() const { return pid_; }
  // Does the path still name this file (same device and inode)?
  bool still_at_path() const;
  // Removes the path if it still names this file. True when removed.
  bool unlink_if_same() const;
  // Maps bytes [from, size()) read-only (mprotect PROT_READ), or read-write
  // again with `writable`. `from` is rounded up to a page. 0 or -errno.
  int protect_from(std::uint64_t from, bool writable);
  // Allocates bytes [offset, offset + len) of the file (posix_fallocate;
  // already allocated pages stay as they are) before a write to a sparse
  // range. Throws kRegionFull when the filesystem has no room for them.
  void allocate(std::uint64_t offset, std::uint64_t len) const;
  // Copies bytes [offset, offset + len) of the file into `dst` with pread:
  // a hole reads as zeros, a file cut short is an error, and nothing faults
  // (no SIGBUS whatever the writer allocated). 0, or -errno (-EIO: short).
  int read_at(std::uint64_t offset, void* dst, std::uint64_t len) const;

  void unmap();

 private:
  void map(bool writable);
  void close_fd();
  // Identity, owner and permission bits from the descriptor's fstat.
  void take_stat(const struct stat& st);

  struct Impl;
  std::unique_ptr<Impl> impl_;
  int fd_ = -1;
  std::byte* base_ = nullptr;
  std::uint64_t size_ = 0;
  std::uint64_t inode_ = 0, dev_ = 0;
  std::uint32_t uid_ = 0, gid_ = 0, mode_ = 0;
  pid_t pid_ = 0;  // the process that opened it
  std::string path_;
};

// The owner part of the rule, for a file or for a process: is `uid` this
// process's effective uid or one of policy.trusted_uids?
bool uid_trusted(std::uint32_t uid, const TrustPolicy& policy);

// Empty when `f` may be trusted under `policy`; else the reason, naming the
// owner and mode, and what to do.
std::string trust_problem(const MappedFile& f, const TrustPolicy& policy);
// The same rule for any file: its owner, group and mode bits.
std::string trust_problem(const std::string& path, std::uint32_t uid, std::uint32_t gid, std::uint32_t mode,
                          const TrustPolicy& policy);

// A process at the other end of a Unix socket (SO_PEERCRED, SO_PEERGROUPS).
struct PeerCred {
  std::int32_t pid = 0;  // as this process's PID namespace sees it; 0 when it cannot
  std::uint32_t uid = 0, gid = 0;
  std::vector<std::uint32_t> groups;  // supplementary groups (may be empty when unknown)
};
// The same rule, applied by a region's producer to a process that asks it
// for something only the region's readers may have: empty when the peer's
// uid is trusted (uid_trusted: this process's euid or one of
// policy.trusted_uids), or when policy.group_access is set and the peer
// belongs to the region's group `region_gid` (-1: none); else the reason,
// naming the peer, and what to do.
std::string peer_trust_problem(const PeerCred& peer, const TrustPolicy& policy, std::int64_t region_gid);

// Throws kInvalidArgument: `what` (a Producer, a Consumer) was inherited
// from the process that made it through fork and cannot be used here.
[[noreturn]] void throw_inherited(const char* what, const MappedFile& f);

// "uid 65534 (nobody)"
std::string describe_uid(std::uint32_t uid);

// Free bytes in the filesystem that holds `dir`, or -errno.
std::int64_t free_bytes(const std::string& dir);

}  // namespace shmcast::detail
