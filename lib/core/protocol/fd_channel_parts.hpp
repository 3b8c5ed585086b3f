// What the fd channel's three files share (fd_channel.cpp: the messages;
// fd_server.cpp: the server; fd_client.cpp: the client). Internal to
// lib/core/protocol: not a public header.
#pragma once

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "protocol/fd_channel.hpp"
#include "shm/liveness.hpp"

namespace shmcast::detail::fdc {

using SteadyClock = std::chrono::steady_clock;

inline std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(SteadyClock::now().time_since_epoch()).count();
}

inline const char* kind_name(FdKind k) {
  switch (k) {
    case FdKind::kHostMemory: return "host memory (memfd)";
    case FdKind::kCudaVmm: return "CUDA VMM allocations";
  }
  return "an unknown kind";
}

inline std::string secs(std::int64_t ns) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f s", static_cast<double>(ns) / 1e9);
  return b;
}

// ---- descriptors the server owns are closed in a forked child
// (liveness.hpp), so a child never keeps the socket or the memory alive.

template <class F>
inline int make_tracked(F&& make) {
  ForkGuard g;
  const int fd = make();
  if (fd >= 0) track_fd(fd, g);
  return fd;
}

inline void close_tracked(int& fd) {
  if (fd >= 0) {
    ForkGuard g;
    untrack_fd(fd, g);
    ::close(fd);
  }
  fd = -1;
}

// A socket address for `file` in directory `dir`, open as `dirfd`: the plain
// path when it fits sun_path, else /proc/self/fd/<dirfd>/<file> (a long
// SHMCAST_DIR). False when neither fits.
inline bool make_addr(const std::string& dir, int dirfd, const std::string& file, sockaddr_un* a, socklen_t* len) {
  *a = sockaddr_un{};
  a->sun_family = AF_UNIX;
  std::string p = dir + "/" + file;
  if (p.size() >= sizeof a->sun_path) p = "/proc/self/fd/" + std::to_string(dirfd) + "/" + file;
  if (p.size() >= sizeof a->sun_path) return false;
  std::memcpy(a->sun_path, p.data(), p.size());
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + p.size() + 1);
  return true;
}

// The address of the file open (O_PATH) as `fd` itself: connect() through
// the /proc magic link reaches exactly that inode, whatever the name holds now.
inline void fd_addr(int fd, sockaddr_un* a, socklen_t* len) {
  *a = sockaddr_un{};
  a->sun_family = AF_UNIX;
  const std::string p = "/proc/self/fd/" + std::to_string(fd);
  std::memcpy(a->sun_path, p.data(), p.size());
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + p.size() + 1);
}

inline std::string file_phrase(mode_t m) {
  if (S_ISLNK(m)) return "a symbolic link";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISREG(m)) return "a regular file";
  if (S_ISDIR(m)) return "a directory";
  if (S_ISSOCK(m)) return "a socket";
  return "a device or other special file";
}

inline bool peer_cred(int fd, PeerCred* out) {
  ucred uc{};
  socklen_t len = sizeof uc;
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &uc, &len) != 0 || len != sizeof uc) return false;
  out->pid = uc.pid;
  out->uid = uc.uid;
  out->gid = uc.gid;
  return true;
}

}  // namespace shmcast::detail::fdc
