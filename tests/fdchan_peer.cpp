// shmcast_fdchan_peer: one side of the fd channel (lib/core/protocol/fd_channel.hpp) as
// a real process, for the multiprocess, attack and seccomp tiers (run under
// setpriv as another uid, or under shmcast-seccomp-run).
//
//   serve --dir D --name N --nonce X --fds K --bytes B --seed S
//         [--ready FILE] [--log FILE] [--trust-uid U]... [--group-access --region-gid G]
//       K memfds of B bytes, fd i holding fill_pattern(S + i), served until
//       SIGTERM or SIGINT (then exit 0). Writes "ready pid=P path=PATH\n" to
//       FILE once serving; server events go to the log, one a line, and at
//       exit "served=N refused=M".
//         [--nofile L]: RLIMIT_NOFILE's soft limit lowered to L before serving
//         (the kernel holds a user's fds in flight to it: ETOOMANYREFS).
//         [--fill-fds 1]: once serving, every descriptor left is taken (EMFILE),
//         then "filled fds=N" is written to the ready file.
//   hoard --dir D --name N --conns K --ready FILE
//       Opens K connections to the server and never reads from them; writes
//       "hoarding conns=K" to FILE once they are all up, then waits for
//       SIGTERM or SIGINT.
//   inflight --count C --ready FILE
//       Puts C descriptors in flight (sent to itself over a socketpair, never
//       received): the kernel charges them to this uid, as it does the slot
//       server's. Writes "inflight count=C" to FILE, then waits for a signal.
//   fetch --dir D --name N --nonce X --fds K --bytes B --seed S [--timeout-ms T]
//         [--expect-pid P] [--trust-uid U]... [--connected FILE]
//       Fetches, checks every fd's size and bytes, closes them; prints
//       "ok fds=K server_pid=P". --connected: "connected\n" into FILE once
//       the server passed the checks, before its message is awaited.
//
// Exit: 0 ok; 20 + Errc on a shmcast::Error (its message on stderr); 2 bad
// usage; 3 a received descriptor left open (counted in /proc/self/fd); 4 the
// bytes differ.
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <thread>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "protocol/fd_channel.hpp"
#include "fdchan_support.hpp"

using namespace shmcast;
using namespace shmcast::detail;

namespace {

struct Args {
  std::map<std::string, std::string> one;
  std::vector<std::uint32_t> trust;
  bool group_access = false;
  std::string get(const std::string& k, const std::string& d = "") const {
    auto it = one.find(k);
    return it == one.end() ? d : it->second;
  }
  unsigned long long num(const std::string& k, unsigned long long d = 0) const {
    const std::string v = get(k);
    return v.empty() ? d : std::strtoull(v.c_str(), nullptr, 0);
  }
};

bool parse(int argc, char** argv, Args* a) {
  for (int i = 2; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--group-access") {
      a->group_access = true;
      continue;
    }
    if (k.rfind("--", 0) != 0 || i + 1 >= argc) return false;
    const std::string v = argv[++i];
    if (k == "--trust-uid")
      a->trust.push_back(static_cast<std::uint32_t>(std::strtoul(v.c_str(), nullptr, 10)));
    else
      a->one[k.substr(2)] = v;
  }
  return !a->get("dir").empty() && !a->get("name").empty();
}

void append(const std::string& file, const std::string& line) {
  if (file.empty()) {
    std::fprintf(stderr, "%s\n", line.c_str());
    return;
  }
  if (std::FILE* f = std::fopen(file.c_str(), "a")) {
    std::fprintf(f, "%s\n", line.c_str());
    std::fclose(f);
  }
}

int serve(const Args& a) {
  const std::size_t n = a.num("fds", 1), bytes = a.num("bytes", 4096);
  const std::uint64_t seed = a.num("seed", 1);
  std::vector<int> fds;
  for (std::size_t i = 0; i < n; ++i) {
    fds.push_back(fdchan_test::make_memfd(bytes, seed + i));
    if (fds.back() < 0) {
      std::perror("memfd");
      return 2;
    }
  }
  FdSetInfo info;
  info.kind = FdKind::kHostMemory;
  info.region_nonce = a.num("nonce", 1);
  info.sizes.assign(n, bytes);
  FdServerOptions o;
  o.trust.trusted_uids = a.trust;
  o.trust.group_access = a.group_access;
  o.region_gid = a.one.count("region-gid") ? static_cast<std::int64_t>(a.num("region-gid")) : -1;
  const std::string log = a.get("log");
  o.on_event = [log](const std::string& l) { append(log, l); };
  // SIGTERM and SIGINT are taken with sigwait, by this thread only.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  if (const unsigned long long lim = a.num("nofile", 0); lim != 0) {
    rlimit rl{};
    ::getrlimit(RLIMIT_NOFILE, &rl);
    rl.rlim_cur = lim;
    if (::setrlimit(RLIMIT_NOFILE, &rl) != 0) {
      std::perror("setrlimit");
      return 2;
    }
  }
  FdServer s = FdServer::start(a.get("dir"), a.get("name"), fds, info, o);
  for (int fd : fds) ::close(fd);  // the server keeps its own copies
  // --fill-fds: every descriptor left is taken (EMFILE from then on), after
  // the ready line.
  std::vector<int> filler;
  const bool fill = a.one.count("fill-fds") != 0;
  append(a.get("ready"), "ready pid=" + std::to_string(::getpid()) + " path=" + s.path());
  for (int fd; fill && (fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0;) filler.push_back(fd);
  if (fill) {  // one descriptor back for the line, then taken again
    ::close(filler.back());
    filler.pop_back();
    append(a.get("ready"), "filled fds=" + std::to_string(filler.size()));
    if (const int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC); fd >= 0) filler.push_back(fd);
  }
  int sig = 0;
  sigwait(&set, &sig);
  for (const int fd : filler) ::close(fd);
  s.stop();
  append(log, "served=" + std::to_string(s.served()) + " refused=" + std::to_string(s.refused()));
  return 0;
}

// Blocks SIGTERM and SIGINT and waits for one.
void wait_for_signal() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  int sig = 0;
  sigwait(&set, &sig);
}

int hoard(const Args& a) {
  const std::size_t n = a.num("conns", 1000);
  rlimit rl{};
  ::getrlimit(RLIMIT_NOFILE, &rl);
  if (rl.rlim_cur < n + 64) {
    rl.rlim_cur = std::min<rlim_t>(rl.rlim_max, n + 64);
    ::setrlimit(RLIMIT_NOFILE, &rl);
  }
  const std::string path = slot_socket_file(a.get("dir"), a.get("name"));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof addr.sun_path) return 2;
  std::memcpy(addr.sun_path, path.data(), path.size());
  std::vector<int> conns;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (conns.size() < n) {
    const int c = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (c < 0) {
      std::perror("socket");
      return 2;
    }
    if (::connect(c, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0) {
      conns.push_back(c);  // never read
      continue;
    }
    const int e = errno;
    ::close(c);
    if (e != EAGAIN || std::chrono::steady_clock::now() > give_up) {
      std::fprintf(stderr, "connect %zu: %s\n", conns.size(), std::strerror(e));
      return 2;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));  // the backlog is full: the server accepts
  }
  append(a.get("ready"), "hoarding conns=" + std::to_string(conns.size()));
  wait_for_signal();
  for (const int c : conns) ::close(c);
  return 0;
}

int inflight(const Args& a) {
  std::size_t left = a.num("count", 200);
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) {
    std::perror("socketpair");
    return 2;
  }
  while (left > 0) {
    const std::size_t k = std::min<std::size_t>(left, kMaxChannelFds);
    std::vector<int> fds(k, sv[0]);
    std::vector<std::uint64_t> control((CMSG_SPACE(sizeof(int) * k) + 7) / 8);
    char byte = 'x';
    iovec iov{&byte, 1};
    msghdr m{};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    m.msg_control = control.data();
    m.msg_controllen = CMSG_SPACE(sizeof(int) * k);
    cmsghdr* c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * k);
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * k);
    if (::sendmsg(sv[0], &m, MSG_NOSIGNAL) < 0) {
      std::perror("sendmsg");
      return 2;
    }
    left -= k;
  }
  append(a.get("ready"), "inflight count=" + a.get("count", "200"));
  wait_for_signal();
  return 0;
}

int fetch(const Args& a) {
  const std::size_t n = a.num("fds", 1), bytes = a.num("bytes", 4096);
  const std::uint64_t seed = a.num("seed", 1);
  FdFetchOptions o;
  o.kind = FdKind::kHostMemory;
  o.region_nonce = a.num("nonce", 1);
  o.expect_fds = static_cast<std::uint32_t>(n);
  o.expect_bytes = bytes;
  o.expect_pid = static_cast<std::int32_t>(a.num("expect-pid", 0));
  o.trust.trusted_uids = a.trust;
  o.timeout = std::chrono::milliseconds(a.num("timeout-ms", 30000));
  const std::string connected = a.get("connected");
  if (!connected.empty()) o.on_connected = [connected] { append(connected, "connected"); };
  const int before = fdchan_test::open_fds();
  int rc = 0;
  try {
    FetchedFds got = fetch_fds(a.get("dir"), a.get("name"), o);
    for (std::size_t i = 0; i < got.fds.size(); ++i)
      if (std::string why = fdchan_test::memfd_problem(got.fds[i].get(), bytes, seed + i); !why.empty()) {
        std::fprintf(stderr, "fd %zu: %s\n", i, why.c_str());
        rc = 4;
      }
    std::printf("ok fds=%zu server_pid=%d\n", got.fds.size(), got.server_pid);
  } catch (const Error& e) {
    std::fprintf(stderr, "error=%s %s\n", errc_name(e.code()), e.what());
    rc = 20 + static_cast<int>(e.code());
  }
  if (fdchan_test::open_fds() != before) {
    std::fprintf(stderr, "descriptors open before: %d, after: %d\n", before, fdchan_test::open_fds());
    return 3;
  }
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  if (argc < 2 || !parse(argc, argv, &a)) {
    std::fprintf(stderr, "usage: %s serve|fetch --dir D --name N [options] (see the source)\n", argv[0]);
    return 2;
  }
  try {
    if (std::strcmp(argv[1], "serve") == 0) return serve(a);
    if (std::strcmp(argv[1], "fetch") == 0) return fetch(a);
    if (std::strcmp(argv[1], "hoard") == 0) return hoard(a);
    if (std::strcmp(argv[1], "inflight") == 0) return inflight(a);
  } catch (const Error& e) {
    std::fprintf(stderr, "error=%s %s\n", errc_name(e.code()), e.what());
    return 20 + static_cast<int>(e.code());
  }
  return 2;
}
