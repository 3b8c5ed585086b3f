// The fd channel; see fd_channel.hpp and docs/protocol.md ("The fd channel").
// One object, one job, so one file past 800 lines: the server (socket made
// like a region, SO_PEERCRED check, the serve loop) and the client (connect,
// receive, check the SCM_RIGHTS fds) share the frame format and its checks.
#include "protocol/fd_channel.hpp"

#include <fcntl.h>
#include <poll.h>
#include <stdio.h>  // renameat2, RENAME_NOREPLACE
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <utility>

#include "base/checks.hpp"
#include "base/sys.hpp"
#include "shm/liveness.hpp"

namespace shmcast::detail {

static_assert(std::endian::native == std::endian::little, "the fd message is little-endian, like the region");

void UniqueFd::reset(int fd) noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

namespace {

using SteadyClock = std::chrono::steady_clock;

constexpr int kBacklog = 128;             // connections the kernel queues for the server
constexpr int kAcceptBatch = 64;          // accepts per wake-up, then the stop flag is looked at again
constexpr int kRetryAcceptMs = 10;        // after EMFILE and the like
constexpr std::int64_t kMaxConnectBackoffNs = 50'000'000;  // client: between connection attempts
constexpr std::int64_t kPeerCheckNs = 50'000'000;          // client: peer_gone() at least this often

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(SteadyClock::now().time_since_epoch()).count();
}

template <class T>
void put(std::byte* p, T v) {
  std::memcpy(p, &v, sizeof v);
}
template <class T>
T get(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Header offsets (docs/protocol.md, "The fd channel").
constexpr std::size_t kOffMagic = 0, kOffVersion = 4, kOffHeaderBytes = 6, kOffFdCount = 8, kOffKind = 12,
                      kOffNonce = 16, kOffUuid = 24, kOffReserved = 40, kOffSizes = 64;

const char* kind_name(FdKind k) {
  switch (k) {
    case FdKind::kHostMemory: return "host memory (memfd)";
    case FdKind::kCudaVmm: return "CUDA VMM allocations";
  }
  return "an unknown kind";
}

bool known_kind(std::uint32_t k) { return k == 1 || k == 2; }

std::string secs(std::int64_t ns) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f s", static_cast<double>(ns) / 1e9);
  return b;
}

// ---- descriptors the server owns are closed in a forked child
// (liveness.hpp), so a child never keeps the socket or the memory alive.

template <class F>
int make_tracked(F&& make) {
  ForkGuard g;
  const int fd = make();
  if (fd >= 0) track_fd(fd, g);
  return fd;
}

void close_tracked(int& fd) {
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
bool make_addr(const std::string& dir, int dirfd, const std::string& file, sockaddr_un* a, socklen_t* len) {
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
void fd_addr(int fd, sockaddr_un* a, socklen_t* len) {
  *a = sockaddr_un{};
  a->sun_family = AF_UNIX;
  const std::string p = "/proc/self/fd/" + std::to_string(fd);
  std::memcpy(a->sun_path, p.data(), p.size());
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + p.size() + 1);
}

std::string file_phrase(mode_t m) {
  if (S_ISLNK(m)) return "a symbolic link";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISREG(m)) return "a regular file";
  if (S_ISDIR(m)) return "a directory";
  if (S_ISSOCK(m)) return "a socket";
  return "a device or other special file";
}

bool peer_cred(int fd, PeerCred* out) {
  ucred uc{};
  socklen_t len = sizeof uc;
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &uc, &len) != 0 || len != sizeof uc) return false;
  out->pid = uc.pid;
  out->uid = uc.uid;
  out->gid = uc.gid;
  return true;
}

// The peer's supplementary groups (SO_PEERGROUPS, Linux 4.13); empty when
// the kernel cannot tell.
std::vector<std::uint32_t> peer_groups(int fd) {
  std::vector<gid_t> g(64);
  for (int attempt = 0; attempt < 2; ++attempt) {
    socklen_t len = static_cast<socklen_t>(g.size() * sizeof(gid_t));
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, g.data(), &len) == 0) {
      g.resize(len / sizeof(gid_t));
      return {g.begin(), g.end()};
    }
    if (errno != ERANGE) break;
    g.resize(len / sizeof(gid_t) + 1);
  }
  return {};
}

// At most a burst of lines, then one a second, each saying how many were
// left out before it.
class RateLimit {
 public:
  bool allow(std::uint64_t* suppressed) {
    const auto now = SteadyClock::now();
    const double dt = std::chrono::duration<double>(now - last_).count();
    last_ = now;
    tokens_ = std::min(kBurst, tokens_ + dt * kPerSecond);
    if (tokens_ < 1.0) {
      ++dropped_;
      return false;
    }
    tokens_ -= 1.0;
    *suppressed = std::exchange(dropped_, 0);
    return true;
  }

 private:
  static constexpr double kBurst = 10, kPerSecond = 1;
  double tokens_ = kBurst;
  SteadyClock::time_point last_ = SteadyClock::now();
  std::uint64_t dropped_ = 0;
};

}  // namespace

// ------------------------------------------------------------------ message

std::vector<std::byte> encode_fd_message(const FdSetInfo& info) {
  const std::size_t n = info.sizes.size();
  if (n == 0 || n > kMaxChannelFds)
    throw Error(Errc::kInvalidArgument, "an fd channel message carries 1.." + std::to_string(kMaxChannelFds) +
                                            " fds, not " + std::to_string(n));
  if (!known_kind(static_cast<std::uint32_t>(info.kind)))
    throw Error(Errc::kInvalidArgument, "unknown fd kind " + std::to_string(static_cast<std::uint32_t>(info.kind)));
  if (info.region_nonce == 0) throw Error(Errc::kInvalidArgument, "the region nonce of an fd channel must not be 0");
  for (std::size_t i = 0; i < n; ++i)
    if (info.sizes[i] == 0 || info.sizes[i] > kMaxChannelFdBytes)
      throw Error(Errc::kInvalidArgument, "fd " + std::to_string(i) + " has size " + std::to_string(info.sizes[i]) +
                                              "; each must be 1 byte to 64 TiB");
  std::vector<std::byte> m(kFdMessageHeaderBytes + 8 * n);  // zeros: reserved bytes
  put<std::uint32_t>(&m[kOffMagic], kFdMessageMagic);
  put<std::uint16_t>(&m[kOffVersion], kFdMessageVersion);
  put<std::uint16_t>(&m[kOffHeaderBytes], static_cast<std::uint16_t>(kFdMessageHeaderBytes));
  put<std::uint32_t>(&m[kOffFdCount], static_cast<std::uint32_t>(n));
  put<std::uint32_t>(&m[kOffKind], static_cast<std::uint32_t>(info.kind));
  put<std::uint64_t>(&m[kOffNonce], info.region_nonce);
  std::memcpy(&m[kOffUuid], info.device_uuid.data(), 16);
  for (std::size_t i = 0; i < n; ++i) put<std::uint64_t>(&m[kOffSizes + 8 * i], info.sizes[i]);
  return m;
}

std::string decode_fd_message(std::span<const std::byte> m, FdSetInfo* out) {
  if (m.size() < kFdMessageHeaderBytes)
    return "the message has " + std::to_string(m.size()) + " bytes, less than its 64-byte header";
  const auto magic = get<std::uint32_t>(&m[kOffMagic]);
  if (magic != kFdMessageMagic) return printf_u64("bad magic 0x%08llx (not an fd channel message)", magic);
  const auto version = get<std::uint16_t>(&m[kOffVersion]);
  if (version != kFdMessageVersion)
    return "message version " + std::to_string(version) + ", this shmcast reads version " +
           std::to_string(kFdMessageVersion) + " (producer and consumer run different shmcast versions)";
  const auto hb = get<std::uint16_t>(&m[kOffHeaderBytes]);
  if (hb != kFdMessageHeaderBytes) return "header size " + std::to_string(hb) + ", not 64";
  const auto n = get<std::uint32_t>(&m[kOffFdCount]);
  if (n == 0 || n > kMaxChannelFds) return "fd count " + std::to_string(n) + " is outside 1.." + std::to_string(kMaxChannelFds);
  if (m.size() != kFdMessageHeaderBytes + 8ull * n)
    return "the message has " + std::to_string(m.size()) + " bytes; " + std::to_string(n) + " fds make " +
           std::to_string(kFdMessageHeaderBytes + 8ull * n);
  const auto kind = get<std::uint32_t>(&m[kOffKind]);
  if (!known_kind(kind)) return "unknown fd kind " + std::to_string(kind);
  const auto nonce = get<std::uint64_t>(&m[kOffNonce]);
  if (nonce == 0) return "region nonce 0";
  for (std::size_t i = kOffReserved; i < kFdMessageHeaderBytes; ++i)
    if (m[i] != std::byte{0}) return "reserved header byte " + std::to_string(i) + " is not zero";
  FdSetInfo info;
  info.kind = static_cast<FdKind>(kind);
  info.region_nonce = nonce;
  std::memcpy(info.device_uuid.data(), &m[kOffUuid], 16);
  info.sizes.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    info.sizes[i] = get<std::uint64_t>(&m[kOffSizes + 8 * i]);
    if (info.sizes[i] == 0 || info.sizes[i] > kMaxChannelFdBytes)
      return "fd " + std::to_string(i) + " has size " + std::to_string(info.sizes[i]) + " (1 byte to 64 TiB)";
  }
  *out = std::move(info);
  return {};
}

std::string slot_socket_name(std::string_view name) {
  constexpr std::size_t kPlain = 64, kKept = 48;
  std::string f = "shmcast-slots.";
  if (name.size() <= kPlain) return f.append(name);
  char h[17];
  std::snprintf(h, sizeof h, "%016llx", static_cast<unsigned long long>(XXH3_64bits(name.data(), name.size())));
  return f.append(name.substr(0, kKept)).append("~").append(h);
}

std::string slot_socket_file(std::string_view dir, std::string_view name) {
  return trim_dir(dir) + "/" + slot_socket_name(name);
}

// ------------------------------------------------------------------ server

struct FdServer::Impl {
  std::string dir, file, path, name;
  FdServerOptions opts;
  std::vector<std::byte> message;
  std::vector<std::uint64_t> control;  // the SCM_RIGHTS control message, built once (8-byte aligned)
  std::size_t control_bytes = 0;
  int dirfd = -1, listen_fd = -1, event_fd = -1;
  std::vector<int> fds;  // our duplicates
  dev_t dev = 0;
  ino_t ino = 0;
  pid_t owner_pid = ::getpid();
  std::thread* thread = nullptr;  // a pointer: leaked, never touched, in a forked child
  std::atomic<std::uint64_t> served{0}, refused{0};
  RateLimit limit;  // the server thread's (and start()'s, before the thread)
  bool stopped = false;

  ~Impl() { stop(); }

  void event(const std::string& line, bool limited) {
    std::uint64_t suppressed = 0;
    if (limited && !limit.allow(&suppressed)) return;
    std::string text = "slot server of region '" + name + "': " + line;
    if (suppressed) text += " (" + std::to_string(suppressed) + " similar lines left out)";
    try {
      if (opts.on_event)
        opts.on_event(text);
      else
        std::fprintf(stderr, "shmcast: %s\n", text.c_str());
    } catch (...) {
    }
  }

  void build_control() {
    const std::size_t n = fds.size();
    control_bytes = CMSG_SPACE(sizeof(int) * n);
    control.assign((control_bytes + 7) / 8, 0);
    msghdr m{};
    m.msg_control = control.data();
    m.msg_controllen = control_bytes;
    cmsghdr* c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * n);
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * n);
  }

  void create_socket();
  bool take_over_stale();
  void run();
  int accept_some();
  void serve_one(int cfd);
  void stop();
};

// The socket appears at its name already bound, listening and with its final
// mode, and only if nothing is there (O_EXCL semantics):
//  1. mkdtemp makes a private directory (mode 0700) in the region directory.
//  2. The socket is bound inside it, then given its mode (0600, or 0660 with
//     group access) with fchmodat by name: the name lies in a directory
//     nobody else can enter, so nothing can be swapped in under it, and
//     nobody can connect while the mode is still the umask's. (fchmod on the
//     socket's descriptor would change the socket, not the inode bind made;
//     a umask around bind is process-wide, so not thread-safe.)
//  3. listen(), so that a socket found at the name always has a server or
//     had one that died (a connect refused means dead, never "not yet").
//  4. renameat2(RENAME_NOREPLACE) moves it to its name: fails if anything
//     is there, a dangling symlink included, and follows nothing (without
//     RENAME_NOREPLACE, link() + unlink(), which never replace either).
//  5. The private directory is removed.
// Something at the name: take_over_stale() removes it only if it is a socket
// of our uid on which no server listens any more; then step 4 once more.
void FdServer::Impl::create_socket() {
  const mode_t mode = opts.trust.group_access ? 0660 : 0600;
  std::string tmpl = dir + "/.shmcast-slots-XXXXXX";
  if (::mkdtemp(tmpl.data()) == nullptr)
    throw_errno(errno, "cannot make a private directory in " + dir + " to create the slot socket in");
  const std::string tmpname = tmpl.substr(tmpl.rfind('/') + 1);
  int tdir = -1;
  bool bound = false;
  auto cleanup = [&] {
    if (bound) ::unlinkat(tdir, "s", 0);  // still there when the rename did not happen
    if (tdir >= 0) ::close(tdir);
    ::unlinkat(dirfd, tmpname.c_str(), AT_REMOVEDIR);
  };
  try {
    tdir = ::openat(dirfd, tmpname.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (tdir < 0) throw_errno(errno, "cannot open the private directory " + tmpl);
    struct stat st {};
    if (::fstat(tdir, &st) != 0) throw_errno(errno, "fstat " + tmpl);
    if (st.st_uid != ::geteuid() || (st.st_mode & 077) != 0)
      throw Error(Errc::kPermission, "the private directory " + tmpl + " made for the slot socket was replaced (it "
                                     "belongs to " + describe_uid(st.st_uid) + "): someone tampers with " + dir);
    listen_fd = make_tracked([] { return ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0); });
    if (listen_fd < 0) throw_errno(errno, "cannot make a Unix socket");
    sockaddr_un a{};
    socklen_t alen = 0;
    if (!make_addr(tmpl, tdir, "s", &a, &alen))
      throw Error(Errc::kInvalidArgument, "the region directory path " + dir + " is too long for a Unix socket");
    if (::bind(listen_fd, reinterpret_cast<const sockaddr*>(&a), alen) != 0)
      throw_errno(errno, "cannot bind the slot socket in " + tmpl);
    bound = true;
    if (::fchmodat(tdir, "s", mode, 0) != 0) throw_errno(errno, "cannot set the mode of the slot socket");
    if (::fstatat(tdir, "s", &st, AT_SYMLINK_NOFOLLOW) != 0) throw_errno(errno, "fstatat slot socket");
    if (!S_ISSOCK(st.st_mode)) throw Error(Errc::kPermission, "the slot socket in " + tmpl + " was replaced");
    dev = st.st_dev;
    ino = st.st_ino;
    if (::listen(listen_fd, kBacklog) != 0) throw_errno(errno, "listen on the slot socket");
    for (int attempt = 0;; ++attempt) {
      int rc = ::renameat2(tdir, "s", dirfd, file.c_str(), RENAME_NOREPLACE);
      if (rc != 0 && (errno == EINVAL || errno == ENOSYS)) {  // a filesystem without RENAME_NOREPLACE
        rc = ::linkat(tdir, "s", dirfd, file.c_str(), 0);
        if (rc == 0) ::unlinkat(tdir, "s", 0);
      }
      if (rc == 0) {
        bound = false;
        break;
      }
      const int e = errno;
      if (e != EEXIST || attempt > 0) throw_errno(e, "cannot put the slot socket at " + path);
      take_over_stale();  // throws unless the name is free now
    }
  } catch (...) {
    cleanup();
    throw;
  }
  cleanup();
}

// Something is at the socket's name. Removes it if it is a socket of this
// uid on which no server listens (connect() refused: the server that made
// it is gone; a live server, even one too busy to accept, queues the
// connection). Anything else is left alone: kExists or kPermission.
bool FdServer::Impl::take_over_stale() {
  UniqueFd old(::openat(dirfd, file.c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC));
  if (!old) {
    if (errno == ENOENT) return true;  // gone meanwhile: try again
    throw Error(Errc::kExists, path + " exists but cannot be inspected (" + std::strerror(errno) +
                                   "): it is left alone; remove it if no producer of region '" + name + "' runs");
  }
  struct stat st {};
  if (::fstat(old.get(), &st) != 0) throw_errno(errno, "fstat " + path);
  if (S_ISLNK(st.st_mode))
    throw Error(Errc::kPermission, path + " is a symbolic link (owned by " + describe_uid(st.st_uid) +
                                       "), where region '" + name + "' puts its slot socket: it is never followed "
                                       "nor removed (someone may be redirecting consumers); remove it");
  if (!S_ISSOCK(st.st_mode))
    throw Error(Errc::kExists, path + " is " + file_phrase(st.st_mode) + " (owned by " + describe_uid(st.st_uid) +
                                   "), not a slot socket: it is left alone; remove it, or pick another region name");
  if (st.st_uid != ::geteuid())
    throw Error(Errc::kPermission, "the slot socket " + path + " belongs to " + describe_uid(st.st_uid) +
                                       ", not to this process (" + describe_uid(::geteuid()) +
                                       "): it is not taken over; have its owner remove it, or pick another region name");
  UniqueFd probe(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!probe) throw_errno(errno, "cannot make a Unix socket");
  sockaddr_un a{};
  socklen_t alen = 0;
  fd_addr(old.get(), &a, &alen);
  int rc = ::connect(probe.get(), reinterpret_cast<const sockaddr*>(&a), alen);
  if (rc != 0 && errno == ENOENT && make_addr(dir, dirfd, file, &a, &alen))  // no /proc: by name
    rc = ::connect(probe.get(), reinterpret_cast<const sockaddr*>(&a), alen);
  const int e = rc == 0 ? 0 : errno;
  if (e == 0 || e == EAGAIN) {
    PeerCred who;
    std::string pid;
    if (e == 0 && peer_cred(probe.get(), &who)) pid = " (pid " + std::to_string(who.pid) + ")";
    throw Error(Errc::kExists, "a live server" + pid + " listens on " + path + ": another producer of region '" +
                                   name + "' serves its slots; stop it, or pick another region name");
  }
  if (e != ECONNREFUSED)
    throw Error(Errc::kExists, "cannot tell whether the slot socket " + path + " is in use (connect: " +
                                   std::strerror(e) + "): it is left alone; remove it if no producer of region '" +
                                   name + "' runs");
  if (!opts.replace_stale)
    throw Error(Errc::kExists, "the slot socket " + path + " is stale (no server listens on it); remove it, or "
                               "set replace_stale");
  struct stat now {};
  if (::fstatat(dirfd, file.c_str(), &now, AT_SYMLINK_NOFOLLOW) == 0 && now.st_dev == st.st_dev &&
      now.st_ino == st.st_ino) {
    if (::unlinkat(dirfd, file.c_str(), 0) != 0 && errno != ENOENT)
      throw_errno(errno, "cannot remove the stale slot socket " + path);
    event("removed the stale slot socket " + path + " (no server listened on it: its producer is gone)", false);
  }
  return true;
}

void FdServer::Impl::run() {
  int retry_ms = -1;  // after a failed accept: wait this long (for stop only) before accepting again
  for (;;) {
    pollfd p[2] = {{event_fd, POLLIN, 0}, {listen_fd, POLLIN, 0}};
    const nfds_t n = retry_ms < 0 ? 2 : 1;
    const int rc = ::poll(p, n, retry_ms);
    if (rc < 0) {
      if (errno == EINTR) continue;
      event(std::string("poll failed: ") + std::strerror(errno) + "; no longer serving", false);
      return;
    }
    if (p[0].revents != 0) return;  // stop()
    if (n == 1) {
      retry_ms = -1;
      continue;
    }
    if (p[1].revents & (POLLERR | POLLNVAL)) {
      event("the listening socket failed; no longer serving", false);
      return;
    }
    if (p[1].revents & POLLIN) retry_ms = accept_some();
  }
}

// Accepts and serves what is queued, at most kAcceptBatch at a time (then
// the stop flag is looked at again). Never blocks: each connection gets its
// message with one non-blocking send, or nothing, and is closed at once, so
// a client that never reads holds only its own connection.
int FdServer::Impl::accept_some() {
  for (int i = 0; i < kAcceptBatch; ++i) {
    const int c = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (c < 0) {
      const int e = errno;
      if (e == EINTR || e == ECONNABORTED) continue;
      if (e == EAGAIN || e == EWOULDBLOCK) return -1;
      event(std::string("cannot accept a connection: ") + std::strerror(e) +
                (e == EMFILE || e == ENFILE ? " (the process is at its open-file limit: raise ulimit -n)" : "") +
                "; trying again",
            true);
      return kRetryAcceptMs;
    }
    serve_one(c);
    ::close(c);
  }
  return -1;
}

void FdServer::Impl::serve_one(int c) {
  PeerCred peer;
  if (!peer_cred(c, &peer)) {
    refused.fetch_add(1, std::memory_order_relaxed);
    event(std::string("cannot read a connecting process's credentials (SO_PEERCRED: ") + std::strerror(errno) +
              "): it gets nothing",
          true);
    return;
  }
  if (!uid_trusted(peer.uid, opts.trust) && opts.trust.group_access && opts.region_gid >= 0)
    peer.groups = peer_groups(c);
  if (std::string why = peer_trust_problem(peer, opts.trust, opts.region_gid); !why.empty()) {
    refused.fetch_add(1, std::memory_order_relaxed);
    event("refused " + why + ". It gets nothing.", true);
    return;
  }
  iovec iov{message.data(), message.size()};
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  m.msg_control = control.data();
  m.msg_controllen = control_bytes;
  const ssize_t n = ::sendmsg(c, &m, MSG_DONTWAIT | MSG_NOSIGNAL);
  if (n == static_cast<ssize_t>(message.size())) {
    served.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  const int e = n < 0 ? errno : EIO;
  if (e == EPIPE || e == ECONNRESET) return;  // it left before its message: nothing to do
  event("cannot send the slots to process " + std::to_string(peer.pid) + " (" + describe_uid(peer.uid) +
            "): " + std::strerror(e) + "; its connection is closed (it may connect again)",
        true);
}

void FdServer::Impl::stop() {
  if (stopped) return;
  stopped = true;
  if (owner_pid != ::getpid()) {
    // Inherited through fork: the thread does not exist here and the
    // descriptors were closed at fork (their numbers may be reused since).
    // Forget everything; the parent's server goes on.
    thread = nullptr;
    return;
  }
  if (thread != nullptr) {
    const std::uint64_t one = 1;
    (void)retry_eintr([&] { return ::write(event_fd, &one, sizeof one); });
    thread->join();
    delete thread;
    thread = nullptr;
  }
  // The name first (a consumer then finds nothing, rather than a socket
  // that refuses), and only if it is still this server's socket.
  if (dirfd >= 0 && ino != 0) {
    struct stat st {};
    if (::fstatat(dirfd, file.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && st.st_dev == dev && st.st_ino == ino)
      ::unlinkat(dirfd, file.c_str(), 0);
  }
  close_tracked(listen_fd);
  close_tracked(event_fd);
  for (int& fd : fds) close_tracked(fd);
  fds.clear();
  close_tracked(dirfd);
}

FdServer::FdServer() = default;
FdServer::FdServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
FdServer::FdServer(FdServer&&) noexcept = default;
FdServer& FdServer::operator=(FdServer&&) noexcept = default;
FdServer::~FdServer() = default;

void FdServer::stop() {
  if (impl_) impl_->stop();
}

const std::string& FdServer::path() const {
  static const std::string none;
  return impl_ ? impl_->path : none;
}
std::uint64_t FdServer::served() const { return impl_ ? impl_->served.load(std::memory_order_relaxed) : 0; }
std::uint64_t FdServer::refused() const { return impl_ ? impl_->refused.load(std::memory_order_relaxed) : 0; }

FdServer FdServer::start(const std::string& dir, std::string_view name, std::span<const int> fds,
                         const FdSetInfo& info, const FdServerOptions& options) {
  require_valid_name(name);
  if (fds.size() != info.sizes.size())
    throw Error(Errc::kInvalidArgument, std::to_string(fds.size()) + " fds to serve but " +
                                            std::to_string(info.sizes.size()) + " sizes in their descriptor");
  auto impl = std::make_unique<Impl>();
  impl->message = encode_fd_message(info);  // checks the descriptor
  impl->name = std::string(name);
  impl->opts = options;
  impl->dir = trim_dir(dir);
  impl->file = slot_socket_name(name);
  impl->path = impl->dir + "/" + impl->file;
  for (const int fd : fds) {
    const int d = make_tracked([fd] { return ::fcntl(fd, F_DUPFD_CLOEXEC, 3); });
    if (d < 0) {
      const int e = errno;
      if (e == EBADF) throw Error(Errc::kInvalidArgument, "fd " + std::to_string(fd) + " to serve is not open", e);
      throw_errno(e, "cannot duplicate fd " + std::to_string(fd) + " to serve");
    }
    impl->fds.push_back(d);
  }
  impl->build_control();
  impl->dirfd = make_tracked([&] { return ::open(impl->dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC); });
  if (impl->dirfd < 0) {
    const int e = errno;
    if (e == ENOENT) throw Error(Errc::kNotFound, "region directory " + impl->dir + " does not exist", e);
    throw_errno(e, "cannot open region directory " + impl->dir);
  }
  impl->event_fd = make_tracked([] { return ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK); });
  if (impl->event_fd < 0) throw_errno(errno, "eventfd");
  impl->create_socket();
  impl->thread = new std::thread([p = impl.get()] { p->run(); });
  return FdServer(std::move(impl));
}

// ------------------------------------------------------------------ client

namespace {

struct Fetch {
  explicit Fetch(const FdFetchOptions& opts) : o(opts) {}
  const FdFetchOptions& o;
  std::string dir, file, path, name;
  std::int64_t start = now_ns(), deadline = 0;
  UniqueFd dirfd;
  sockaddr_un addr{};
  socklen_t addr_len = 0;
  PeerCred server;

  void check_peer_gone() const {
    if (!o.peer_gone) return;
    if (std::string why = o.peer_gone(); !why.empty())
      throw Error(Errc::kPeerDied, "region '" + name + "': " + why + " (while fetching its slots from " + path + ")");
  }

  // Waits for the socket to be there and accept the connection.
  UniqueFd connect_server() {
    std::int64_t backoff = 1'000'000;
    bool refused = false;
    for (;;) {
      check_peer_gone();
      struct stat st {};
      refused = false;
      if (::fstatat(dirfd.get(), file.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) {
        if (S_ISLNK(st.st_mode))
          throw Error(Errc::kPermission, path + " is a symbolic link (owned by " + describe_uid(st.st_uid) +
                                             "), not the slot socket of region '" + name + "': refused (someone may "
                                             "be redirecting this consumer); remove it and restart the producer");
        if (!S_ISSOCK(st.st_mode))
          throw Error(Errc::kPermission, path + " is " + file_phrase(st.st_mode) + " (owned by " +
                                             describe_uid(st.st_uid) + "), not the slot socket of region '" + name +
                                             "': refused; remove it and restart the producer");
        UniqueFd s(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
        if (!s) throw_errno(errno, "cannot make a Unix socket");
        if (::connect(s.get(), reinterpret_cast<const sockaddr*>(&addr), addr_len) == 0) return s;
        const int e = errno;
        if (e == EACCES || e == EPERM)
          throw Error(Errc::kPermission, "cannot connect to the slot socket " + path + " (owned by " +
                                             describe_uid(st.st_uid) + "): " + std::strerror(e) +
                                             ": run the consumer as the producer's user, or share the region with "
                                             "a group (group_access) the consumer is in",
                      e);
        if (e == ECONNREFUSED)
          refused = true;
        else if (e != EAGAIN && e != ENOENT && e != EINTR)
          throw_errno(e, "cannot connect to the slot socket " + path);
      } else if (errno != ENOENT) {
        throw_errno(errno, "cannot look at " + path);
      }
      const std::int64_t left = deadline - now_ns();
      if (left <= 0) {
        if (refused)
          throw Error(Errc::kPeerDied, "the slot socket " + path + " of region '" + name + "' refuses connections "
                                       "(for " + secs(now_ns() - start) + "): no server listens on it, so its "
                                       "producer died or closed the region; reopen the region once it is restarted");
        throw Error(Errc::kTimeout, "no slot server at " + path + " after " + secs(now_ns() - start) +
                                        ": is region '" + name + "' a device-slot region, and is its producer up?");
      }
      std::this_thread::sleep_for(std::chrono::nanoseconds(std::min(backoff, left)));
      backoff = std::min(backoff * 2, kMaxConnectBackoffNs);
    }
  }

  std::string server_text() const {
    return "the slot server at " + path + " (pid " + std::to_string(server.pid) + ", " + describe_uid(server.uid) +
           ")";
  }

  // The server closed the connection without a message: it refused us, or
  // it is gone. A second connection tells which.
  [[noreturn]] void closed_without_message() {
    check_peer_gone();
    UniqueFd s(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    const bool alive = s && (::connect(s.get(), reinterpret_cast<const sockaddr*>(&addr), addr_len) == 0 ||
                             errno == EAGAIN);
    if (alive)
      throw Error(Errc::kPermission, server_text() + " closed the connection without sending the slots, and "
                                     "still listens: it refused this process (" + describe_uid(::geteuid()) +
                                     ", gid " + std::to_string(::getegid()) + "), most likely because it does not "
                                     "trust this uid, or could not send (the producer's log says which): run the "
                                     "consumer as the producer's user, or have the producer trust this uid or share "
                                     "the region with a group the consumer is in");
    throw Error(Errc::kPeerDied, server_text() + " closed the connection without sending the slots and no longer "
                                 "listens: its producer died or closed the region; reopen the region once it is "
                                 "restarted");
  }

  FetchedFds receive(const UniqueFd& s) {
    alignas(8) std::byte data[kMaxFdMessageBytes];
    std::vector<std::uint64_t> control((CMSG_SPACE(sizeof(int) * kMaxChannelFds) + 64 + 7) / 8);
    for (;;) {
      const std::int64_t left = deadline - now_ns();
      if (left <= 0)
        throw Error(Errc::kTimeout, server_text() + " accepted the connection but sent nothing in " +
                                        secs(now_ns() - start) + ": the producer is stuck or overloaded");
      pollfd p{s.get(), POLLIN, 0};
      const int wait_ms = static_cast<int>((std::min(left, kPeerCheckNs) + 999'999) / 1'000'000);
      const int rc = ::poll(&p, 1, wait_ms);
      if (rc < 0 && errno != EINTR) throw_errno(errno, "poll on the slot socket");
      if (rc <= 0) {
        check_peer_gone();
        continue;
      }
      iovec iov{data, sizeof data};
      msghdr m{};
      m.msg_iov = &iov;
      m.msg_iovlen = 1;
      m.msg_control = control.data();
      m.msg_controllen = control.size() * 8;
      const ssize_t n = ::recvmsg(s.get(), &m, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
      // Take every fd that arrived before anything else: from here on they
      // are owned, so any error below closes them all.
      FetchedFds out;
      if (n >= 0 && m.msg_controllen > 0) {
        for (cmsghdr* c = CMSG_FIRSTHDR(&m); c != nullptr; c = CMSG_NXTHDR(&m, c)) {
          if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS || c->cmsg_len < CMSG_LEN(0)) continue;
          const std::size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
          for (std::size_t i = 0; i < k; ++i) {
            int fd;
            std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
            out.fds.emplace_back(fd);
          }
        }
      }
      if (n < 0) {
        const int e = errno;
        if (e == EAGAIN || e == EWOULDBLOCK || e == EINTR) continue;
        if (e == ECONNRESET) closed_without_message();
        throw_errno(e, "cannot receive from the slot socket " + path);
      }
      if (n == 0 && out.fds.empty()) closed_without_message();
      const std::string bad = server_text() + " sent a bad message";
      const std::string todo = ": refused, every fd it carried closed (a producer of another shmcast version, or "
                               "not a shmcast producer)";
      if (m.msg_flags & MSG_TRUNC)
        throw Error(Errc::kCorrupt, bad + " (longer than " + std::to_string(kMaxFdMessageBytes) + " bytes)" + todo);
      if (std::string why = decode_fd_message({data, static_cast<std::size_t>(n)}, &out.info); !why.empty())
        throw Error(Errc::kCorrupt, bad + " (" + why + ")" + todo);
      const std::size_t want = out.info.sizes.size();
      if (m.msg_flags & MSG_CTRUNC)
        throw Error(Errc::kSystem, "the slot fds of region '" + name + "' did not all arrive (" +
                                       std::to_string(out.fds.size()) + " of " + std::to_string(want) +
                                       "): this process is probably at its open-file limit; raise it (ulimit -n)",
                    EMFILE);
      if (out.fds.size() != want)
        throw Error(Errc::kCorrupt, bad + " (it carries " + std::to_string(out.fds.size()) + " fds, its descriptor "
                                    "says " + std::to_string(want) + ")" + todo);
      if (out.info.kind != o.kind)
        throw Error(Errc::kCorrupt, server_text() + " serves " + kind_name(out.info.kind) + ", this consumer "
                                    "expects " + kind_name(o.kind) + ": refused (a producer of another kind of "
                                    "region at this name?)");
      if (out.info.region_nonce != o.region_nonce)
        throw Error(Errc::kCorrupt, server_text() + " serves the slots of another region (nonce " +
                                        printf_u64("%016llx", out.info.region_nonce) + ", the region opened has " +
                                        printf_u64("%016llx", o.region_nonce) +
                                        "): refused; the region was probably replaced by a restarted producer: "
                                        "reopen it");
      if (o.expect_fds != 0 && want != o.expect_fds)
        throw Error(Errc::kCorrupt, server_text() + " serves " + std::to_string(want) + " fds, the region has " +
                                        std::to_string(o.expect_fds) + ": refused");
      if (o.expect_bytes != 0)
        for (std::size_t i = 0; i < want; ++i)
          if (out.info.sizes[i] != o.expect_bytes)
            throw Error(Errc::kCorrupt, server_text() + " says fd " + std::to_string(i) + " holds " +
                                            std::to_string(out.info.sizes[i]) + " bytes, the region says " +
                                            std::to_string(o.expect_bytes) + ": refused");
      out.server_pid = server.pid;
      out.server_uid = server.uid;
      return out;
    }
  }
};

}  // namespace

FetchedFds fetch_fds(const std::string& dir, std::string_view name, const FdFetchOptions& o) {
  require_valid_name(name);
  if (o.region_nonce == 0) throw Error(Errc::kInvalidArgument, "fetch_fds needs the region's nonce (not 0)");
  Fetch f(o);
  f.name = std::string(name);
  f.dir = trim_dir(dir);
  f.file = slot_socket_name(name);
  f.path = f.dir + "/" + f.file;
  f.deadline = f.start + std::max<std::int64_t>(0, o.timeout.count());
  f.dirfd.reset(::open(f.dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (!f.dirfd) {
    const int e = errno;
    if (e == ENOENT) throw Error(Errc::kNotFound, "region directory " + f.dir + " does not exist", e);
    throw_errno(e, "cannot open region directory " + f.dir);
  }
  if (!make_addr(f.dir, f.dirfd.get(), f.file, &f.addr, &f.addr_len))
    throw Error(Errc::kInvalidArgument, "the region directory path " + f.dir + " is too long for a Unix socket");
  UniqueFd s = f.connect_server();
  // The name proves nothing (anyone who can write the directory could have
  // put a socket there, and a check of the path races with connect): the
  // kernel's word on who listens does. Nothing is read before it passed.
  if (!peer_cred(s.get(), &f.server)) throw_errno(errno, "SO_PEERCRED on the slot socket " + f.path);
  if (!uid_trusted(f.server.uid, o.trust))
    throw Error(Errc::kPermission, f.server_text() + " does not run as this process's user (" +
                                       describe_uid(::geteuid()) + ") nor as a trusted uid: refused before reading "
                                       "anything (someone else may have put a socket at the name); run both sides "
                                       "as one user, or list that uid in trusted_uids if you trust it");
  if (o.expect_pid != 0 && f.server.pid != o.expect_pid)
    throw Error(Errc::kPermission, f.server_text() + " is not the region's producer (pid " +
                                       std::to_string(o.expect_pid) + "): refused before reading anything");
  if (o.on_connected) o.on_connected();
  return f.receive(s);
}

}  // namespace shmcast::detail
