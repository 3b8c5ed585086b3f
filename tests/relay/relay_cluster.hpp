// What the relay tests share: child processes (fork/exec), simulated nodes
// (one SHMCAST_DIR each, relays over UCX on TCP loopback), chains of relays
// with a trainer and workers, and shmcast-inspect. Every wait has a
// deadline; steps wait for handshakes (report lines, status fields).
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "proc_support.hpp"

namespace relay_test {

using namespace std::chrono_literals;
using nlohmann::json;

inline const std::string kRelay = SHMCAST_RELAY_BIN;
inline const std::string kPeer = RELAY_PEER_BIN;
inline const std::string kKey = "relay-test-key-0123456789abcdef";

using shmcast_test::Proc;
using shmcast_test::slurp;

inline bool has_line(const std::string& path, const std::string& line) {
  std::istringstream in(slurp(path));
  for (std::string l; std::getline(in, l);)
    if (l == line) return true;
  return false;
}

// Nodes 0..n-1 of one test: node 0 has the trainer and the source relay.
// The environment that LD_PRELOADs `lib` (a shim built without the
// sanitizers: flip_send, gate_connect, slow_recv) into a relay, plus
// `more`. Under ASan the shim comes first in the library list, and ASan's
// runtime checks that it does; it still intercepts what it must (the shim
// calls on into it).
inline std::map<std::string, std::string> preload_env(const std::string& lib,
                                                      std::map<std::string, std::string> more = {}) {
  more["LD_PRELOAD"] = lib;
#if defined(__SANITIZE_ADDRESS__)
  const char* asan = std::getenv("ASAN_OPTIONS");
  more["ASAN_OPTIONS"] = std::string(asan ? asan : "") + (asan && *asan ? ":" : "") + "verify_asan_link_order=0";
#endif
  return more;
}

// The last `n` lines of `s`.
inline std::string last_lines(const std::string& s, int n) {
  std::size_t at = s.size();
  if (at > 0 && s[at - 1] == '\n') --at;
  while (n-- > 0 && at > 0) {
    const std::size_t nl = s.rfind('\n', at - 1);
    if (nl == std::string::npos) return s;
    at = nl;
  }
  return at == 0 ? s : s.substr(at + 1);
}

class Cluster {
 public:
  explicit Cluster(int nodes, const std::string& tag) {
    static int n = 0;
    root_ = (std::filesystem::temp_directory_path() /
             ("shmcast-relay-" + tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(n++)))
                .string();
    std::filesystem::remove_all(root_);
    for (int i = 0; i < nodes; ++i) std::filesystem::create_directories(dir(i));
    region_ = "relay-" + tag;
  }
  ~Cluster() {
    procs_.clear();  // killed
    if (::testing::Test::HasFailure()) dump_logs();
    std::error_code ec;
    std::filesystem::remove_all(root_, ec);
  }
  void dump_logs() const {
    for (const auto& e : std::filesystem::directory_iterator(root_)) {
      if (e.path().extension() != ".log") continue;
      std::fprintf(stderr, "---- %s\n%s", e.path().filename().c_str(), slurp(e.path().string()).c_str());
    }
    for (const auto& e : std::filesystem::recursive_directory_iterator(root_))
      if (e.path().extension() == ".json")
        std::fprintf(stderr, "---- %s\n%s", e.path().c_str(), slurp(e.path().string()).c_str());
  }

  const std::string& region() const { return region_; }
  std::string dir(int node) const { return root_ + "/node" + std::to_string(node); }
  std::string file(const std::string& name) const { return root_ + "/" + name; }
  std::string status_path(int node) const { return dir(node) + "/shmcast-relay." + region_ + ".json"; }

  std::map<std::string, std::string> env(int node, const std::string& key = kKey) const {
    std::map<std::string, std::string> e = {{"SHMCAST_DIR", dir(node)},
                                            {"UCX_TLS", "tcp"},
                                            {"UCX_NET_DEVICES", "lo"},
                                            {"UCX_WARN_UNUSED_ENV_VARS", "n"},
                                            {"SHMCAST_RELAY_KEY", key}};
#if defined(__SANITIZE_THREAD__)
    // UCX's memory-event hooks patch madvise in the process as libucm loads;
    // under TSan that patch crashes every thread that exits (glibc madvises
    // its stack). The relay registers its buffers itself and needs no events.
    e["UCX_MEM_EVENTS"] = "no";
#endif
    return e;
  }

  // extra_env: an empty value unsets the variable.
  Proc& start(const std::string& tag, std::vector<std::string> argv, int node, const std::string& key = kKey,
              const std::map<std::string, std::string>& extra_env = {}, rlim_t nofile_soft = 0) {
    if (!wrapper_.empty()) argv.insert(argv.begin(), wrapper_.begin(), wrapper_.end());
    auto e = env(node, key);
    for (const auto& [k, v] : extra_env) e[k] = v;
    procs_.push_back(std::make_unique<Proc>(
        Proc::start(argv, {.log = file(tag + ".log"),
                           .append = true,
                           .env = e,
                           .nofile_soft = nofile_soft,
                           .wait_default = std::chrono::seconds(90)})));
    return *procs_.back();
  }
  // Extra environment for the relays of `node` started from now on.
  void relay_env(int node, std::map<std::string, std::string> e) { relay_env_[node] = std::move(e); }
  // The trainer on node 0 (relay_peer produce) or a worker (consume).
  Proc& peer(const std::string& tag, int node, std::vector<std::string> args) {
    std::vector<std::string> argv = {kPeer};
    argv.insert(argv.end(), args.begin(), args.end());
    return start(tag, argv, node);
  }
  // A relay on `node`; upstream: the port of the relay it pulls from (0: source).
  Proc& relay(int node, int upstream_port, bool listen, const std::string& key = kKey, int listen_port = 0,
              std::vector<std::string> extra = {}) {
    std::vector<std::string> argv = {kRelay, region_};
    if (upstream_port != 0) argv.insert(argv.end(), {"--from", "127.0.0.1:" + std::to_string(upstream_port)});
    if (listen) argv.insert(argv.end(), {"--listen", "127.0.0.1:" + std::to_string(listen_port)});
    argv.insert(argv.end(), {"--handshake-timeout", "30"});
    argv.insert(argv.end(), extra.begin(), extra.end());
    const auto e = relay_env_.find(node);
    const auto n = relay_nofile_.find(node);
    return start("relay" + std::to_string(node), argv, node, key,
                 e == relay_env_.end() ? std::map<std::string, std::string>{} : e->second,
                 n == relay_nofile_.end() ? 0 : n->second);
  }
  // The soft RLIMIT_NOFILE the relays of `node` start with from now on.
  void relay_nofile(int node, rlim_t soft) { relay_nofile_[node] = soft; }
  // Commands run under `wrapper` (e.g. a seccomp runner) from now on.
  void wrap(std::vector<std::string> wrapper) { wrapper_ = std::move(wrapper); }

  // The relay status of `node` once `pred` holds (null json on timeout).
  json wait_status(int node, const std::function<bool(const json&)>& pred, std::chrono::seconds timeout = 60s) const {
    const auto end = std::chrono::steady_clock::now() + timeout;
    json last;
    while (std::chrono::steady_clock::now() < end) {
      try {
        last = json::parse(slurp(status_path(node)));
        if (pred(last)) return last;
      } catch (const std::exception&) {
      }
      std::this_thread::sleep_for(5ms);
    }
    ADD_FAILURE() << "node " << node << " status never matched; last: " << last.dump();
    return json();
  }
  int listen_port(int node) const {
    const json s = wait_status(node, [](const json& j) { return !j.value("listen", std::string()).empty(); });
    if (s.is_null()) return 0;
    const std::string l = s["listen"];
    return std::stoi(l.substr(l.rfind(':') + 1));
  }
  bool wait_line(const std::string& report, const std::string& line, std::chrono::seconds timeout = 60s) const {
    const auto end = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < end) {
      if (has_line(report, line)) return true;
      std::this_thread::sleep_for(2ms);
    }
    ADD_FAILURE() << "no line '" << line << "' in " << report << ":\n" << slurp(report);
    return false;
  }
  void touch(const std::string& path) const { std::ofstream(path) << "go\n"; }

 private:
  std::string root_, region_;
  std::vector<std::unique_ptr<Proc>> procs_;
  std::vector<std::string> wrapper_;
  std::map<int, std::map<std::string, std::string>> relay_env_;
  std::map<int, rlim_t> relay_nofile_;
};

inline bool upstream_connected(const json& j) {
  return j.contains("upstream") && j["upstream"].value("state", "") == "connected" &&
         j["region_state"].value("ready", false);
}
inline bool downstream_ready(const json& j, int n = 1) { return j.value("downstream_ready", 0) >= n; }
// The node's region is ready: a source node has attached to the trainer's
// region (wait for it before a downstream connects: then the welcome
// carries the slot size and the downstream makes its region at once).
inline bool region_ready(const json& j) { return j["region_state"].value("ready", false); }

// Starts trainer, relays and one worker per downstream node; returns the
// listen ports. The trainer waits for the files go.<v>.
struct Chain {
  Cluster& c;
  int nodes;
  std::vector<int> ports;
  std::vector<Proc*> relays, workers;
  Proc* trainer = nullptr;

  Chain(Cluster& cl, int n, int syncs, std::vector<std::string> trainer_extra = {}, int worker_syncs = -1,
        std::vector<std::string> source_extra = {}, std::vector<std::string> worker_extra = {})
      : c(cl), nodes(n), ports(static_cast<std::size_t>(n), 0), relays(static_cast<std::size_t>(n), nullptr) {
    std::vector<std::string> targs = {"produce", c.region(), "--syncs", std::to_string(syncs), "--go", c.file("go"),
                                      "--report", c.file("trainer.txt")};
    targs.insert(targs.end(), trainer_extra.begin(), trainer_extra.end());
    trainer = &c.peer("trainer", 0, targs);
    if (!c.wait_line(c.file("trainer.txt"), "ready")) return;
    relays[0] = &c.relay(0, 0, true, kKey, 0, source_extra);
    ports[0] = c.listen_port(0);
    c.wait_status(0, [](const json& j) { return j["region_state"].value("ready", false); });
    // Nodes 1 and 3 receive straight into their region's slots; node 2
    // into buffers that it copies into its region (the default).
    for (int i = 1; i < n; ++i) {
      relays[static_cast<std::size_t>(i)] =
          &c.relay(i, ports[static_cast<std::size_t>(i - 1)], i + 1 < n, kKey, 0,
                   i != 2 ? std::vector<std::string>{"--direct-receive"} : std::vector<std::string>{});
      if (i + 1 < n) ports[static_cast<std::size_t>(i)] = c.listen_port(i);
      c.wait_status(i, [](const json& j) { return upstream_connected(j); });
    }
    for (int i = 0; i + 1 < n; ++i) c.wait_status(i, [](const json& j) { return downstream_ready(j); });
    for (int i = 1; i < n; ++i) {
      const std::string rep = c.file("worker" + std::to_string(i) + ".txt");
      std::vector<std::string> wargs = {"consume", c.region(), "--syncs",
                                        std::to_string(worker_syncs < 0 ? syncs : worker_syncs), "--report", rep};
      wargs.insert(wargs.end(), worker_extra.begin(), worker_extra.end());
      workers.push_back(&c.peer("worker" + std::to_string(i), i, wargs));
      c.wait_line(rep, "attached");
    }
  }
  std::string report(int node) const { return c.file("worker" + std::to_string(node) + ".txt"); }
  void go(int v) const { c.touch(c.file("go." + std::to_string(v))); }
};

// shmcast-inspect ARGS in node `node`'s region directory; its stdout.
inline std::string run_inspect(Cluster& c, int node, std::vector<std::string> args, int want_rc = 0) {
  static int runs = 0;  // a log file of its own per run (logs are appended to)
  args.insert(args.end(), {"--dir", c.dir(node)});
  Proc& p = c.start("inspect" + std::to_string(node) + "-" + std::to_string(++runs), [&] {
    std::vector<std::string> argv = {SHMCAST_INSPECT_BIN};
    argv.insert(argv.end(), args.begin(), args.end());
    return argv;
  }(), node);
  EXPECT_EQ(p.wait(60s), want_rc) << p.output();
  return p.output();
}

}  // namespace relay_test
