// Helpers for the fd channel's tests (lib/core/protocol/fd_channel.hpp): memfds in
// place of GPU allocations, a scratch directory, descriptor counting, and a
// raw server that sends whatever bytes and fds a test crafts.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "protocol/fd_channel.hpp"
#include "support.hpp"

#include "proc_support.hpp"

namespace fdchan_test {

// A memfd of `bytes` holding fill_pattern(seed). -1 on failure.
inline int make_memfd(std::size_t bytes, std::uint64_t seed) {
  const int fd = ::memfd_create("shmcast-test-slot", MFD_CLOEXEC);
  if (fd < 0) return -1;
  std::vector<std::uint8_t> v(bytes);
  shmcast_test::fill_pattern(v.data(), bytes, seed);
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0 ||
      ::pwrite(fd, v.data(), bytes, 0) != static_cast<ssize_t>(bytes)) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Empty when `fd` is a file of `bytes` holding fill_pattern(seed); else what differs.
inline std::string memfd_problem(int fd, std::size_t bytes, std::uint64_t seed) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return "fstat failed";
  if (static_cast<std::size_t>(st.st_size) != bytes)
    return "size " + std::to_string(st.st_size) + ", want " + std::to_string(bytes);
  std::vector<std::uint8_t> got(bytes), want(bytes);
  if (::pread(fd, got.data(), bytes, 0) != static_cast<ssize_t>(bytes)) return "short read";
  shmcast_test::fill_pattern(want.data(), bytes, seed);
  if (got != want) return "bytes differ";
  return {};
}

// Open descriptors of this process (entries of /proc/self/fd).
inline int open_fds() {
  DIR* d = ::opendir("/proc/self/fd");
  if (d == nullptr) return -1;
  int n = 0;
  while (const dirent* e = ::readdir(d))
    if (e->d_name[0] != '.') ++n;
  ::closedir(d);
  return n - 1;  // the directory's own descriptor
}

// A scratch region directory, removed with its contents at scope exit.
struct ScratchDir {
  std::string path;
  explicit ScratchDir(const char* base = "/dev/shm", mode_t mode = 0700) {
    std::string t = std::string(base) + "/shmcast-fdc-XXXXXX";
    if (::mkdtemp(t.data()) != nullptr) path = t;
    ::chmod(path.c_str(), mode);
  }
  ~ScratchDir() {
    if (path.empty()) return;
    const std::string cmd = "rm -rf '" + path + "'";
    if (std::system(cmd.c_str()) != 0) std::fprintf(stderr, "cannot remove %s\n", path.c_str());
  }
};

// A listening SOCK_SEQPACKET socket bound at `path` (short paths only).
inline int listen_at(const std::string& path) {
  const int s = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  if (s < 0 || path.size() >= sizeof a.sun_path) return -1;
  std::memcpy(a.sun_path, path.c_str(), path.size());
  if (::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(s, 16) != 0) {
    ::close(s);
    return -1;
  }
  return s;
}

// Sends `bytes` with `fds` (SCM_RIGHTS, none when empty) on connection `c`.
inline bool send_with_fds(int c, const std::vector<std::byte>& bytes, const std::vector<int>& fds) {
  iovec iov{const_cast<std::byte*>(bytes.data()), bytes.size()};
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  std::vector<std::uint64_t> control((CMSG_SPACE(sizeof(int) * fds.size()) + 7) / 8);
  if (!fds.empty()) {
    m.msg_control = control.data();
    m.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c0 = CMSG_FIRSTHDR(&m);
    c0->cmsg_level = SOL_SOCKET;
    c0->cmsg_type = SCM_RIGHTS;
    c0->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c0), fds.data(), sizeof(int) * fds.size());
  }
  return ::sendmsg(c, &m, MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size());
}

// A server that plays a broken or hostile producer: it accepts one
// connection, sends `bytes` with `fds` (or nothing when `send` is false) and
// closes it; the listening socket stays open until the object goes (so a
// client's second connection is queued, as with a live server).
struct RawServer {
  std::string path;
  int listen_fd = -1;
  std::thread th;
  RawServer(const std::string& at, std::vector<std::byte> bytes, std::vector<int> fds, bool send = true)
      : path(at), listen_fd(listen_at(at)) {
    if (listen_fd < 0) return;
    th = std::thread([this, bytes = std::move(bytes), fds = std::move(fds), send] {
      const int c = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
      if (c < 0) return;
      if (send) send_with_fds(c, bytes, fds);
      ::close(c);
    });
  }
  // A connection of its own unblocks the accept when no client came.
  ~RawServer() {
    if (th.joinable()) {
      const int s = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
      sockaddr_un a{};
      a.sun_family = AF_UNIX;
      std::memcpy(a.sun_path, path.c_str(), path.size());
      (void)::connect(s, reinterpret_cast<sockaddr*>(&a), sizeof a);
      th.join();
      ::close(s);
    }
    if (listen_fd >= 0) ::close(listen_fd);
  }
};

using shmcast_test::Proc;
using shmcast_test::slurp;

// Waits until `file` holds a complete line starting with `key`; returns it
// (without the newline), or "" when none came within `timeout`.
inline std::string wait_line(const std::string& file, const std::string& key,
                             std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    const std::string s = slurp(file);
    for (std::size_t at = 0; at < s.size();) {
      const std::size_t nl = s.find('\n', at);
      if (nl == std::string::npos) break;
      if (s.compare(at, key.size(), key) == 0) return s.substr(at, nl - at);
      at = nl + 1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return {};
}

// Waits until every thread of `pid` is stopped (SIGSTOP took effect: state
// T in /proc/<pid>/task/*/stat). False after `timeout`.
inline bool wait_stopped(pid_t pid, std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  const std::string tasks = "/proc/" + std::to_string(pid) + "/task";
  while (std::chrono::steady_clock::now() < end) {
    bool all = true;
    int n = 0;
    if (DIR* d = ::opendir(tasks.c_str())) {
      while (const dirent* e = ::readdir(d)) {
        if (e->d_name[0] == '.') continue;
        ++n;
        const std::string st = slurp(tasks + "/" + e->d_name + "/stat");
        const std::size_t rp = st.rfind(')');
        if (rp == std::string::npos || rp + 2 >= st.size() || (st[rp + 2] != 'T' && st[rp + 2] != 't')) all = false;
      }
      ::closedir(d);
    }
    if (all && n > 0) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return false;
}

// The command that runs `program`, built for this test's target: behind the
// cross-compiling emulator when the tests run under one (the AArch64 stage:
// SHMCAST_TEST_EMULATOR is "qemu-aarch64|-L|/", since an arm64 binary
// cannot be exec'd on the host without binfmt_misc).
inline std::vector<std::string> target_command(const std::string& program) {
  std::vector<std::string> v;
#ifdef SHMCAST_TEST_EMULATOR
  const std::string e = SHMCAST_TEST_EMULATOR;
  for (std::size_t at = 0; at <= e.size();) {
    const std::size_t bar = std::min(e.find('|', at), e.size());
    if (bar > at) v.push_back(e.substr(at, bar - at));
    at = bar + 1;
  }
#endif
  v.push_back(program);
  return v;
}

// The exit code of a peer that threw `e` (tests/fdchan_peer.cpp).
inline int exit_for(shmcast::Errc e) { return 20 + static_cast<int>(e); }

}  // namespace fdchan_test
