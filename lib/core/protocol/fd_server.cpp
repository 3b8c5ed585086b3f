// The fd channel's server; see fd_channel.hpp and docs/protocol.md ("The fd
// channel", 13.3): the socket made like a region, the SO_PEERCRED check, the
// serve loop, and the limits on messages sent and not yet read.
#include <fcntl.h>
#include <linux/sockios.h>
#include <poll.h>
#include <stdio.h>  // renameat2, RENAME_NOREPLACE
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <utility>

#include "base/checks.hpp"
#include "base/sys.hpp"
#include "protocol/fd_channel.hpp"
#include "protocol/fd_channel_parts.hpp"
#include "shm/liveness.hpp"

namespace shmcast::detail {

using namespace fdc;

namespace {

constexpr int kBacklog = 128;       // connections the kernel queues for the server
constexpr int kAcceptBatch = 64;    // accepts per wake-up, then the stop flag is looked at again
constexpr int kRetryAcceptMs = 10;  // after EMFILE and the like
constexpr std::int64_t kDeadlineNs = std::chrono::nanoseconds(kFdTakeDeadline).count();
constexpr std::int64_t kRecheckNs = 50'000'000;        // a client that hung up with its message unread: again in
constexpr std::int64_t kMaxRecheckNs = 8'000'000'000;  // an unread message is looked at again at most this late

// A connection whose message is unread.
struct Held {
  int fd = -1;
  PeerCred peer;
  std::int64_t sent_ns = 0, check_ns = 0, step_ns = 0;
  bool quiet = false;     // an event came but the message is unread: no longer polled, only checked
  bool hoarding = false;  // past the deadline, logged
};

// Bytes we sent on `fd` that its client has not read yet (SIOCOUTQ: the
// socket's send-buffer charge, freed when the client reads the message or
// its socket goes). -1 when the kernel cannot tell.
int unread_bytes(int fd) {
  int q = 0;
  return ::ioctl(fd, SIOCOUTQ, &q) == 0 ? q : -1;
}

const char* refusal_phrase(FdRefusal r) {
  switch (r) {
    case FdRefusal::kProcessLimit: return "its process";
    case FdRefusal::kUidLimit: return "its uid";
    case FdRefusal::kTotalLimit: return "all clients together";
    case FdRefusal::kKernelInFlight: return "the kernel (ETOOMANYREFS)";
    case FdRefusal::kServerFdLimit: return "the open-file limit (EMFILE)";
  }
  return "?";
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
  std::atomic<std::uint32_t> unread_now{0};
  // Connections whose message is unread (see kFdUnreadPerProcess): kept
  // open and counted until the client has read it (SIOCOUTQ 0) or closed.
  std::vector<Held> held;
  std::uint32_t max_total = kFdUnreadTotal, max_uid = kFdUnreadPerUid, max_process = kFdUnreadPerProcess;
  int reserve_fd = -1;  // given up to accept (and refuse) a connection at EMFILE
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
  int accept_at_fd_limit();
  std::string trusted(int c, PeerCred* peer) const;
  bool serve_one(int c);
  void refuse(int c, const PeerCred& peer, FdRefusalInfo r);
  void check_held(std::int64_t now);
  int next_wait_ms(std::int64_t now) const;
  void top_holder(FdRefusalInfo* r) const;
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
  std::int64_t retry_until = 0;
  std::vector<pollfd> p;
  for (;;) {
    p.clear();
    p.push_back({event_fd, POLLIN, 0});
    p.push_back({retry_ms < 0 ? listen_fd : -1, POLLIN, 0});
    for (const Held& h : held) p.push_back({h.quiet ? -1 : h.fd, POLLIN | POLLRDHUP, 0});
    int wait_ms = next_wait_ms(now_ns());
    if (retry_ms >= 0) wait_ms = wait_ms < 0 ? retry_ms : std::min(wait_ms, retry_ms);
    const int rc = ::poll(p.data(), p.size(), wait_ms);
    if (rc < 0) {
      if (errno == EINTR) continue;
      event(std::string("poll failed: ") + std::strerror(errno) + "; no longer serving", false);
      return;
    }
    if (p[0].revents != 0) return;  // stop()
    const std::int64_t now = now_ns();
    for (std::size_t i = 2; i < p.size(); ++i)
      if (p[i].revents != 0) {  // hung up, shut down or wrote: look now, then never poll it again
        held[i - 2].quiet = true;
        held[i - 2].check_ns = now;
      }
    check_held(now);
    if (retry_ms >= 0) {
      if (rc == 0 || now >= retry_until) retry_ms = -1;
      continue;
    }
    if (p[1].revents & (POLLERR | POLLNVAL)) {
      event("the listening socket failed; no longer serving", false);
      return;
    }
    if (p[1].revents & POLLIN) {
      retry_ms = accept_some();
      if (retry_ms >= 0) retry_until = now_ns() + retry_ms * 1'000'000ll;
    }
  }
}

// The poll timeout: until the earliest look at an unread message; -1 when none.
int FdServer::Impl::next_wait_ms(std::int64_t now) const {
  std::int64_t soonest = -1;
  for (const Held& h : held) {
    const std::int64_t left = std::max<std::int64_t>(0, h.check_ns - now);
    if (soonest < 0 || left < soonest) soonest = left;
  }
  return soonest < 0 ? -1 : static_cast<int>((soonest + 999'999) / 1'000'000);
}

// Releases each connection due a look whose message was read (or whose
// client closed, which drops the message and its fds). One unread past the
// deadline is logged once (hoarding) and stays counted: closing our end
// would not return its fds. Looks: soon after an event (a client that
// closed may still be dropping its queue), at the deadline, then at
// doubling intervals up to kMaxRecheckNs (a client may read late).
void FdServer::Impl::check_held(std::int64_t now) {
  for (std::size_t i = 0; i < held.size();) {
    Held& h = held[i];
    if (h.check_ns > now) {
      ++i;
      continue;
    }
    if (unread_bytes(h.fd) == 0) {
      close_tracked(h.fd);
      held.erase(held.begin() + static_cast<std::ptrdiff_t>(i));
      continue;
    }
    if (now - h.sent_ns >= kDeadlineNs && !h.hoarding) {
      h.hoarding = true;
      event("process " + std::to_string(h.peer.pid) + " (" + describe_uid(h.peer.uid) + ") has not read its slot " +
                "message in " + secs(now - h.sent_ns) + ": its " + std::to_string(fds.size()) + " fds stay in " +
                "flight, charged by the kernel to this producer's user, until it reads them or exits (closing the "
                "connection would not return them), and count against its limits (" + std::to_string(max_process) +
                " unread per process, " + std::to_string(max_uid) + " per uid, " + std::to_string(max_total) +
                " in all); stop that process if it should not hold them",
            true);
    }
    h.step_ns = std::min(kMaxRecheckNs, h.step_ns == 0 ? kRecheckNs : h.step_ns * 2);
    h.check_ns = now + h.step_ns;
    if (!h.hoarding) h.check_ns = std::min(h.check_ns, h.sent_ns + kDeadlineNs);
    if (!h.quiet && !h.hoarding) h.check_ns = h.sent_ns + kDeadlineNs;  // polled meanwhile
    ++i;
  }
  unread_now.store(static_cast<std::uint32_t>(held.size()), std::memory_order_relaxed);
}

// Accepts and serves what is queued, at most kAcceptBatch at a time (then
// the stop flag is looked at again). Never blocks: each connection gets its
// message with one non-blocking send, or a refusal, or nothing; a served one
// is kept (counted) until its client reads its message or closes.
int FdServer::Impl::accept_some() {
  for (int i = 0; i < kAcceptBatch; ++i) {
    int c = make_tracked([this] { return ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK); });
    if (c < 0) {
      const int e = errno;
      if (e == EINTR || e == ECONNABORTED) continue;
      if (e == EAGAIN || e == EWOULDBLOCK) return -1;
      if (e == EMFILE || e == ENFILE) {
        const int took = accept_at_fd_limit();
        if (took > 0) continue;
        if (took == 0) return -1;  // nothing was queued any more
      }
      event(std::string("cannot accept a connection: ") + std::strerror(e) +
                (e == EMFILE || e == ENFILE ? " (the process is at its open-file limit: raise ulimit -n)" : "") +
                "; trying again",
            true);
      return kRetryAcceptMs;
    }
    if (!serve_one(c)) close_tracked(c);
  }
  return -1;
}

// accept() failed with EMFILE or ENFILE: the reserve descriptor is given up
// to take the next connection, which gets a refusal naming the cause (not a
// silent wait in the backlog), then taken back. Returns, with the
// reserve: 1 a connection was taken (and refused), 0 none was queued, -1
// no reserve or accept failed all the same.
int FdServer::Impl::accept_at_fd_limit() {
  if (reserve_fd < 0) return -1;
  close_tracked(reserve_fd);
  int c = make_tracked([this] { return ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK); });
  const int e = errno;
  int took = c >= 0 ? 1 : (e == EAGAIN || e == EWOULDBLOCK) ? 0 : -1;
  if (c >= 0) {
    PeerCred peer;
    if (peer_cred(c, &peer) && trusted(c, &peer).empty()) {
      FdRefusalInfo r;
      r.reason = FdRefusal::kServerFdLimit;
      r.held = static_cast<std::uint32_t>(held.size());
      refuse(c, peer, r);
    }
    close_tracked(c);
  }
  reserve_fd = make_tracked([this] { return ::fcntl(event_fd, F_DUPFD_CLOEXEC, 3); });
  return took;
}

// Empty when the peer may have the fds; else why not (peer_trust_problem).
std::string FdServer::Impl::trusted(int c, PeerCred* peer) const {
  if (!uid_trusted(peer->uid, opts.trust) && opts.trust.group_access && opts.region_gid >= 0)
    peer->groups = peer_groups(c);
  return peer_trust_problem(*peer, opts.trust, opts.region_gid);
}

// The client holding the most unread messages, into the refusal.
void FdServer::Impl::top_holder(FdRefusalInfo* r) const {
  for (const Held& h : held) {
    std::uint32_t n = 0;
    for (const Held& o : held) n += o.peer.pid == h.peer.pid && o.peer.uid == h.peer.uid;
    if (n > r->top_held) {
      r->top_held = n;
      r->top_pid = h.peer.pid;
      r->top_uid = h.peer.uid;
    }
  }
}

// Sends the refusal `r` (no fds) and logs it; the caller closes `c`.
void FdServer::Impl::refuse(int c, const PeerCred& peer, FdRefusalInfo r) {
  refused.fetch_add(1, std::memory_order_relaxed);
  top_holder(&r);
  const std::vector<std::byte> m = encode_fd_refusal(r);
  (void)::send(c, m.data(), m.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
  std::string line = "refused process " + std::to_string(peer.pid) + " (" + describe_uid(peer.uid) + ") for now: ";
  if (r.reason == FdRefusal::kKernelInFlight)
    line += "the kernel would not pass the fds (ETOOMANYREFS): this producer's user has more fds in flight (sent, "
            "not yet received) than its open-file limit; " + std::to_string(held.size()) + " of them are this "
            "server's unread messages";
  else if (r.reason == FdRefusal::kServerFdLimit)
    line += "this process is at its open-file limit (EMFILE): raise ulimit -n, or find what holds its descriptors";
  else
    line += std::to_string(r.held) + " messages unread by " + refusal_phrase(r.reason) + ", the limit";
  if (r.top_held > 0)
    line += "; process " + std::to_string(r.top_pid) + " (" + describe_uid(r.top_uid) + ") holds " +
            std::to_string(r.top_held) + " unread";
  event(line + ". It may connect again.", true);
}

// One accepted connection: true when it is kept (its message sent and
// unread); false when the caller closes it.
bool FdServer::Impl::serve_one(int c) {
  PeerCred peer;
  if (!peer_cred(c, &peer)) {
    refused.fetch_add(1, std::memory_order_relaxed);
    event(std::string("cannot read a connecting process's credentials (SO_PEERCRED: ") + std::strerror(errno) +
              "): it gets nothing",
          true);
    return false;
  }
  if (std::string why = trusted(c, &peer); !why.empty()) {
    refused.fetch_add(1, std::memory_order_relaxed);
    event("refused " + why + ". It gets nothing.", true);
    return false;
  }
  std::uint32_t of_process = 0, of_uid = 0;
  for (const Held& h : held) {
    of_uid += h.peer.uid == peer.uid;
    of_process += h.peer.uid == peer.uid && h.peer.pid == peer.pid;
  }
  FdRefusalInfo r;
  if (of_process >= max_process)
    r = {FdRefusal::kProcessLimit, of_process, max_process};
  else if (of_uid >= max_uid)
    r = {FdRefusal::kUidLimit, of_uid, max_uid};
  else if (held.size() >= max_total)
    r = {FdRefusal::kTotalLimit, static_cast<std::uint32_t>(held.size()), max_total};
  if (r.limit != 0) {
    refuse(c, peer, r);
    return false;
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
    Held h;
    h.fd = c;
    h.peer = peer;
    h.sent_ns = now_ns();
    h.check_ns = h.sent_ns + kDeadlineNs;
    held.push_back(std::move(h));
    unread_now.store(static_cast<std::uint32_t>(held.size()), std::memory_order_relaxed);
    return true;
  }
  const int e = n < 0 ? errno : EIO;
  if (e == EPIPE || e == ECONNRESET) return false;  // it left before its message: nothing to do
  if (e == ETOOMANYREFS) {
    refuse(c, peer, {FdRefusal::kKernelInFlight, static_cast<std::uint32_t>(held.size()), 0});
    return false;
  }
  event("cannot send the slots to process " + std::to_string(peer.pid) + " (" + describe_uid(peer.uid) +
            "): " + std::strerror(e) + "; its connection is closed (it may connect again)",
        true);
  return false;
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
  close_tracked(reserve_fd);
  // Messages already sent stay readable by their clients.
  for (Held& h : held) close_tracked(h.fd);
  held.clear();
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
std::uint32_t FdServer::unread() const { return impl_ ? impl_->unread_now.load(std::memory_order_relaxed) : 0; }

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
  // The limits (kFdUnreadTotal): each unread message costs this process a
  // descriptor and puts fds.size() in flight, which the kernel holds to
  // RLIMIT_NOFILE for the whole user; half of it at most.
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
    const rlim_t by_limit = rl.rlim_cur / (2 * (fds.size() + 1));
    impl->max_total = static_cast<std::uint32_t>(std::clamp<rlim_t>(by_limit, 1, kFdUnreadTotal));
  }
  impl->max_uid = std::min(kFdUnreadPerUid, impl->max_total);
  impl->max_process = std::min(kFdUnreadPerProcess, impl->max_total);
  impl->reserve_fd = make_tracked([&] { return ::fcntl(impl->event_fd, F_DUPFD_CLOEXEC, 3); });
  if (impl->reserve_fd < 0) throw_errno(errno, "cannot duplicate the eventfd (a reserve descriptor)");
  impl->create_socket();
  impl->thread = new std::thread([p = impl.get()] { p->run(); });
  return FdServer(std::move(impl));
}

}  // namespace shmcast::detail
