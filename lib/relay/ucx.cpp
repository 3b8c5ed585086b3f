#include "ucx.hpp"

#include <arpa/inet.h>
#include <dirent.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace shmcast::relay::ucx {

std::string status_str(ucs_status_t st) { return ucs_status_string(st); }

void check(ucs_status_t st, const std::string& what) {
  if (st != UCS_OK) throw Error(Errc::kSystem, what + ": " + status_str(st));
}

Context::Context(const std::string& net_devices) {
  ucp_config_t* config = nullptr;
  check(ucp_config_read(nullptr, nullptr, &config), "UCX configuration (UCX_* variables)");
  if (!net_devices.empty() && std::getenv("UCX_NET_DEVICES") == nullptr) {
    const ucs_status_t st = ucp_config_modify(config, "NET_DEVICES", net_devices.c_str());
    if (st != UCS_OK) {
      ucp_config_release(config);
      check(st, "UCX NET_DEVICES=" + net_devices);
    }
  }
  ucp_params_t p{};
  p.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  p.features = UCP_FEATURE_TAG | UCP_FEATURE_STREAM | UCP_FEATURE_WAKEUP;  // stream: the data connection's proof
  p.mt_workers_shared = 1;  // workers progressed by threads of their own
  p.name = "shmcast-relay";
  const ucs_status_t st = ucp_init(&p, config, &h_);
  ucp_config_release(config);
  check(st, "ucp_init (is a UCX transport available? UCX_TLS=tcp works everywhere)");
}

Context::~Context() {
  if (h_) ucp_cleanup(h_);
}

Worker::Worker(const Context& ctx, bool threaded) : threaded_(threaded) {
  ucp_worker_params_t p{};
  p.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  p.thread_mode = threaded ? UCS_THREAD_MODE_MULTI : UCS_THREAD_MODE_SINGLE;
  check(ucp_worker_create(ctx.get(), &p, &h_), "ucp_worker_create");
  if (threaded) {  // a UCX built without thread support gives a one-thread worker: progressed inline then
    ucp_worker_attr_t a{};
    a.field_mask = UCP_WORKER_ATTR_FIELD_THREAD_MODE;
    threaded_ = ucp_worker_query(h_, &a) == UCS_OK && a.thread_mode == UCS_THREAD_MODE_MULTI;
  }
  const ucs_status_t st = ucp_worker_get_efd(h_, &efd_);
  if (st != UCS_OK) {
    ucp_worker_destroy(h_);
    h_ = nullptr;
    check(st, "ucp_worker_get_efd");
  }
}

Worker::~Worker() {
  stop_progress();
  if (stop_fd_ >= 0) ::close(stop_fd_);
  if (h_) ucp_worker_destroy(h_);
}

void Worker::start_progress(std::function<void()> on_events) {
  if (!threaded_) throw Error(Errc::kInvalidArgument, "start_progress on a worker created for one thread");
  if (t_.joinable()) return;
  stop_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (stop_fd_ < 0) throw Error(Errc::kSystem, std::string("eventfd: ") + std::strerror(errno), errno);
  t_ = std::thread([this, on_events = std::move(on_events)] {
    try {
      while (!stop_.load(std::memory_order_acquire)) {
        if (progress() > 0) {
          on_events();
          continue;
        }
        if (!arm()) continue;
        pollfd fds[2] = {{efd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
        ::poll(fds, 2, 100);
      }
    } catch (const std::exception& e) {
      failure_ = e.what();
      failed_.store(true, std::memory_order_release);
      on_events();
    }
  });
}

void Worker::stop_progress() {
  if (!t_.joinable()) return;
  stop_.store(true, std::memory_order_release);
  const std::uint64_t one = 1;
  [[maybe_unused]] const ssize_t r = ::write(stop_fd_, &one, sizeof one);
  t_.join();
}

void Worker::kick() {
  if (t_.joinable()) (void)ucp_worker_signal(h_);
}

std::string Worker::failure() const { return failed_.load(std::memory_order_acquire) ? failure_ : std::string(); }

unsigned Worker::progress() {
  unsigned total = 0;
  for (int i = 0; i < 64; ++i) {
    unsigned n = 0;
    {
      std::lock_guard<std::mutex> g(progress_mu_);
      n = ucp_worker_progress(h_);
    }
    if (n == 0) break;
    total += n;
  }
  return total;
}

bool Worker::arm() {
  const ucs_status_t st = ucp_worker_arm(h_);
  if (st == UCS_ERR_BUSY) return false;
  check(st, "ucp_worker_arm");
  return true;
}

std::string pick_devices(const std::vector<std::pair<std::string, in_addr_t>>& ifs,
                         const std::vector<in_addr_t>& wanted, const std::vector<std::string>& rdma, std::string* why) {
  std::vector<std::string> out;
  for (in_addr_t w : wanted) {
    auto it = std::find_if(ifs.begin(), ifs.end(), [&](const auto& i) { return i.second == w; });
    if (it == ifs.end()) {
      char b[INET_ADDRSTRLEN] = "?";
      in_addr a{};
      a.s_addr = w;
      ::inet_ntop(AF_INET, &a, b, sizeof b);
      *why = std::string("no network interface has the address ") + b;
      return "";
    }
    if (std::find(out.begin(), out.end(), it->first) == out.end()) out.push_back(it->first);
  }
  if (out.empty()) {
    *why = "no address to restrict UCX to";
    return "";
  }
  for (const std::string& r : rdma)
    if (std::find(out.begin(), out.end(), r) == out.end()) out.push_back(r);
  std::string s;
  for (const std::string& d : out) s += (s.empty() ? "" : ",") + d;
  return s;
}

namespace {

// RDMA devices as UCX names them: <device>:<port>.
std::vector<std::string> rdma_devices() {
  std::vector<std::string> out;
  const std::string root = "/sys/class/infiniband";
  DIR* d = ::opendir(root.c_str());
  if (!d) return out;
  while (dirent* e = ::readdir(d)) {
    const std::string dev = e->d_name;
    if (dev == "." || dev == "..") continue;
    DIR* p = ::opendir((root + "/" + dev + "/ports").c_str());
    if (!p) continue;
    while (dirent* q = ::readdir(p)) {
      const std::string port = q->d_name;
      if (port != "." && port != "..") out.push_back(dev + ":" + port);
    }
    ::closedir(p);
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

// The IPv4 address `host` names (the first), or false.
bool ipv4_of(const std::string& host, in_addr_t* out) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0 || res == nullptr) return false;
  *out = reinterpret_cast<const sockaddr_in*>(res->ai_addr)->sin_addr.s_addr;
  ::freeaddrinfo(res);
  return true;
}

}  // namespace

NetDevices relay_net_devices(const std::string& listen, const std::string& from) {
  NetDevices nd;
  std::vector<in_addr_t> wanted;
  if (!listen.empty()) {
    const Address a = parse_address(listen);
    in_addr_t ip = 0;
    if (a.host.find(':') != std::string::npos || !ipv4_of(a.host, &ip)) {
      nd.why = "the listen address " + a.str() + " is not an IPv4 address";
      return nd;
    }
    if (ip == htonl(INADDR_ANY)) {
      nd.why = "the listen address " + a.str() + " is every interface";
      return nd;
    }
    wanted.push_back(ip);
  }
  if (!from.empty()) {
    // The local address the kernel routes the upstream from (a UDP socket's
    // connect() picks it and sends nothing).
    const Address a = parse_address(from);
    in_addr_t ip = 0;
    if (a.host.find(':') != std::string::npos || !ipv4_of(a.host, &ip)) {
      nd.why = "the upstream " + a.str() + " does not resolve to an IPv4 address yet";
      return nd;
    }
    const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(a.port == 0 ? 9 : a.port);
    to.sin_addr.s_addr = ip;
    sockaddr_in local{};
    socklen_t len = sizeof local;
    const bool ok = fd >= 0 && ::connect(fd, reinterpret_cast<const sockaddr*>(&to), sizeof to) == 0 &&
                    ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0;
    if (fd >= 0) ::close(fd);
    if (!ok) {
      nd.why = "no route to the upstream " + a.str() + " (" + std::strerror(errno) + ")";
      return nd;
    }
    wanted.push_back(local.sin_addr.s_addr);
  }
  std::vector<std::pair<std::string, in_addr_t>> ifs;
  ifaddrs* all = nullptr;
  if (::getifaddrs(&all) != 0) {
    nd.why = std::string("getifaddrs: ") + std::strerror(errno);
    return nd;
  }
  for (ifaddrs* i = all; i; i = i->ifa_next)
    if (i->ifa_addr && i->ifa_addr->sa_family == AF_INET && (i->ifa_flags & IFF_UP))
      ifs.emplace_back(i->ifa_name, reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr);
  ::freeifaddrs(all);
  nd.devices = pick_devices(ifs, wanted, rdma_devices(), &nd.why);
  return nd;
}

sockaddr_storage resolve(const Address& a, bool passive, socklen_t* len) {
  // IPv4 first: a name with both kinds of address gets its IPv4 one.
  addrinfo* res = nullptr;
  int rc = 0;
  const std::string port = std::to_string(a.port);
  for (int family : {AF_INET, AF_UNSPEC}) {
    addrinfo hints{};
    hints.ai_family = family;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = passive ? AI_PASSIVE : 0;
    rc = ::getaddrinfo(a.host.empty() ? nullptr : a.host.c_str(), port.c_str(), &hints, &res);
    if (rc == 0 && res != nullptr) break;
  }
  if (rc != 0 || res == nullptr)
    throw Error(Errc::kInvalidArgument, "cannot resolve '" + a.str() + "': " + ::gai_strerror(rc));
  sockaddr_storage ss{};
  std::memcpy(&ss, res->ai_addr, res->ai_addrlen);
  *len = res->ai_addrlen;
  ::freeaddrinfo(res);
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  if (ss.ss_family == AF_INET6 && (major < 1 || (major == 1 && minor <= 13)))
    throw Error(Errc::kInvalidArgument,
                "'" + a.str() + "' is an IPv6 address: UCX " + ucp_get_version_string() +
                    " overruns a buffer in its TCP transport on IPv6 connections (uct_tcp_ep_set_dest_addr); "
                    "use an IPv4 address");
  return ss;
}

std::string sockaddr_str(const sockaddr_storage& ss) {
  char host[INET6_ADDRSTRLEN] = "?";
  if (ss.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&ss);
    ::inet_ntop(AF_INET, &in->sin_addr, host, sizeof host);
    return std::string(host) + ":" + std::to_string(ntohs(in->sin_port));
  }
  if (ss.ss_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&ss);
    ::inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof host);
    return "[" + std::string(host) + "]:" + std::to_string(ntohs(in6->sin6_port));
  }
  return "?";
}

std::uint16_t sockaddr_port(const sockaddr_storage& ss) {
  if (ss.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(&ss)->sin_port);
  if (ss.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_port);
  return 0;
}

Registration register_memory(ucp_context_h ctx, void* base, std::size_t bytes) {
  ucp_mem_map_params_t p{};
  p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  p.address = base;
  p.length = bytes;
  Registration r;
  check(ucp_mem_map(ctx, &p, &r.memh), "ucp_mem_map of " + std::to_string(bytes) + " bytes");
  r.base = base;
  r.bytes = bytes;
  return r;
}

void unregister_memory(ucp_context_h ctx, Registration* r) {
  if (r->memh) ucp_mem_unmap(ctx, r->memh);
  r->memh = nullptr;
}

}  // namespace shmcast::relay::ucx
