// The fd channel's client; see fd_channel.hpp and docs/protocol.md ("The fd
// channel", 13.4): connect, check the server, receive and check the
// SCM_RIGHTS fds; wait and connect again while the server sends refusals.
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <optional>
#include <cstring>
#include <thread>
#include <utility>

#include "base/checks.hpp"
#include "base/sys.hpp"
#include "protocol/fd_channel.hpp"
#include "protocol/fd_channel_parts.hpp"

namespace shmcast::detail {

using namespace fdc;

namespace {

constexpr std::int64_t kMaxConnectBackoffNs = 50'000'000;  // between connection attempts
constexpr std::int64_t kPeerCheckNs = 50'000'000;          // peer_gone() at least this often

// The server sent a refusal (it trusts us but cannot serve now): connect
// again until the deadline.
struct Refused {
  FdRefusalInfo info;
};

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

  // What to say when the server still refused this process at the deadline.
  [[noreturn]] void refused_until_deadline(const FdRefusalInfo& r) const {
    const std::string waited = " (refused for " + secs(now_ns() - start) + ")";
    std::string top;
    if (r.top_held > 0)
      top = "; process " + std::to_string(r.top_pid) + " (" + describe_uid(r.top_uid) + ") holds " +
            std::to_string(r.top_held) + " of them unread";
    switch (r.reason) {
      case FdRefusal::kKernelInFlight:
        throw Error(Errc::kSystem, server_text() + " could not pass the slots of region '" + name + "'" + waited +
                                       ": the kernel refused (ETOOMANYREFS): the producer's user has more file "
                                       "descriptors in flight (sent over Unix sockets, not yet received) than the "
                                       "producer's open-file limit; " + std::to_string(r.held) + " are the slot "
                                       "server's own unread messages" + top + ": find the process of that user that "
                                       "holds unread fd messages (a client that connects and never reads) and stop "
                                       "it, or raise the producer's ulimit -n",
                    ETOOMANYREFS);
      case FdRefusal::kServerFdLimit:
        throw Error(Errc::kSystem, server_text() + " could not take this connection" + waited + ": the producer is "
                                       "at its open-file limit (EMFILE); raise its ulimit -n, or find what holds "
                                       "its descriptors",
                    EMFILE);
      default:
        throw Error(Errc::kTimeout, server_text() + " refused this process" + waited + ": its limit of slot "
                                        "messages sent and not yet read is reached (" + std::to_string(r.held) +
                                        " unread by " + (r.reason == FdRefusal::kProcessLimit ? "this process"
                                        : r.reason == FdRefusal::kUidLimit ? "processes of this uid"
                                        : "all clients") + ", the limit " + std::to_string(r.limit) + ")" + top +
                                        ": a process that connects and never reads holds them until it exits; "
                                        "stop it, or retry with a longer timeout");
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
      std::uint32_t magic = 0;
      if (n >= 4) std::memcpy(&magic, data, 4);
      if (magic == kFdRefusalMagic && !(m.msg_flags & MSG_TRUNC)) {
        Refused r;
        if (std::string why = decode_fd_refusal({data, static_cast<std::size_t>(n)}, &r.info); !why.empty())
          throw Error(Errc::kCorrupt, bad + " (" + why + ")" + todo);
        if (!out.fds.empty())
          throw Error(Errc::kCorrupt, bad + " (a refusal carrying " + std::to_string(out.fds.size()) + " fds)" + todo);
        throw r;
      }
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
  bool told = false;
  std::int64_t backoff = 1'000'000;
  std::optional<FdRefusalInfo> last;  // the last refusal: named if the deadline passes on a retry
  for (;;) {
    UniqueFd s;
    try {
      s = f.connect_server();
    } catch (const Error& e) {
      if (last && e.code() == Errc::kTimeout) f.refused_until_deadline(*last);
      throw;
    }
    // The name proves nothing (anyone who can write the directory could have
    // put a socket there, and a check of the path races with connect): the
    // kernel's word on who listens does. Nothing is read before it passed.
    if (!peer_cred(s.get(), &f.server)) throw_errno(errno, "SO_PEERCRED on the slot socket " + f.path);
    if (!uid_trusted(f.server.uid, o.trust))
      throw Error(Errc::kPermission, f.server_text() + " does not run as this process's user (" +
                                         describe_uid(::geteuid()) + ") nor as a trusted uid: refused before "
                                         "reading anything (someone else may have put a socket at the name); run "
                                         "both sides as one user, or list that uid in trusted_uids if you trust it");
    if (o.expect_pid != 0 && f.server.pid != o.expect_pid)
      throw Error(Errc::kPermission, f.server_text() + " is not the region's producer (pid " +
                                         std::to_string(o.expect_pid) + "): refused before reading anything");
    if (o.on_connected && !std::exchange(told, true)) o.on_connected();
    try {
      return f.receive(s);
    } catch (const Refused& r) {
      // It trusts us but cannot serve now (its limits, the kernel's, its
      // fd limit): again until the deadline, on a new connection.
      s.reset();
      last = r.info;
      const std::int64_t left = f.deadline - now_ns();
      if (left <= 0) f.refused_until_deadline(r.info);
      std::this_thread::sleep_for(std::chrono::nanoseconds(std::min(backoff, left)));
      backoff = std::min(backoff * 2, kMaxConnectBackoffNs);
    } catch (const Error& e) {
      if (last && e.code() == Errc::kTimeout) f.refused_until_deadline(*last);
      throw;
    }
  }
}

}  // namespace shmcast::detail