// The relay's attack tests (ctest -L attack, also -L relay): key files that
// someone else controls; UCX's own listeners. Real processes throughout
// (relay_peer as trainer and workers, shmcast-relay as the relays); each
// test was run against the relay before its fix and failed there
// (docs/reliability.md).
#include <dirent.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>

#include <set>

#include "relay_cluster.hpp"

using namespace relay_test;

namespace {

// The trainer on node 0 (waiting for go files) and the source relay.
struct Source {
  int port = 0;
  Proc* relay = nullptr;
};
Source start_source(Cluster& c, int syncs, std::vector<std::string> relay_extra = {}, int port = 0) {
  Source s;
  c.peer("trainer", 0, {"produce", c.region(), "--syncs", std::to_string(syncs), "--go", c.file("go"), "--report",
                        c.file("trainer.txt")});
  if (!c.wait_line(c.file("trainer.txt"), "ready")) return s;
  s.relay = &c.relay(0, 0, true, kKey, port, std::move(relay_extra));
  s.port = c.listen_port(0);
  c.wait_status(0, [](const json& j) { return j["region_state"].value("ready", false); });
  return s;
}

}  // namespace

// Item 7 of issue 27. A key file that someone else controls: group-writable
// (0660), or owned by another uid (65534, mode 0640). Before the fix both
// started the relay (only o+rw was refused). Now both are refused with the
// reason (exit 2), and a key owned by root (the Kubernetes secret volume's
// 0440 with a group) is still taken.
TEST(RelayAttack, KeyFilesOthersControlAreRefused) {
  Cluster c(2, "keyfile");
  const std::string key = c.file("relay.key");
  {
    std::ofstream(key) << kKey << "\n";
  }
  auto try_key = [&](const std::string& tag) -> Proc& {
    return c.start(tag, {kRelay, c.region(), "--from", "127.0.0.1:9", "--key-file", key, "--status", "-"}, 1, "");
  };
  ASSERT_EQ(::chmod(key.c_str(), 0660), 0);
  Proc& group_w = try_key("key0660");
  EXPECT_EQ(group_w.wait(60s), 2) << group_w.output();
  EXPECT_NE(group_w.output().find("can be written by its group or by others"), std::string::npos) << group_w.output();
  if (::geteuid() != 0) GTEST_SKIP() << "the other-uid case needs root (chown)";
  ASSERT_EQ(::chmod(key.c_str(), 0640), 0);
  ASSERT_EQ(::chown(key.c_str(), 65534, 65534), 0);
  Proc& other = try_key("key65534");
  EXPECT_EQ(other.wait(60s), 2) << other.output();
  EXPECT_NE(other.output().find("is owned by uid 65534"), std::string::npos) << other.output();
  // Root's, 0440: taken (the relay then tries its upstream until stopped).
  ASSERT_EQ(::chown(key.c_str(), 0, 65534), 0);
  ASSERT_EQ(::chmod(key.c_str(), 0440), 0);
  Proc& ok = try_key("keyroot");
  const auto end = std::chrono::steady_clock::now() + 60s;
  while (ok.output().find("upstream 127.0.0.1:9") == std::string::npos && std::chrono::steady_clock::now() < end)
    std::this_thread::sleep_for(5ms);
  EXPECT_TRUE(ok.running()) << ok.output();
  EXPECT_EQ(ok.term(), 0) << ok.output();
}

// Item 6 of issue 27. Asked to listen on 127.0.0.1, a relay lets UCX open
// its own TCP listeners (one per worker and interface) on the loopback
// interface only; so does the relay that reaches its upstream over loopback.
// Before the fix UCX listened on every interface (here the machine's other
// addresses). Checked from /proc: every listening TCP socket of each relay
// process is bound to 127.0.0.1.
namespace {

std::set<std::string> socket_inodes(pid_t pid) {
  std::set<std::string> out;
  const std::string dir = "/proc/" + std::to_string(pid) + "/fd";
  DIR* d = ::opendir(dir.c_str());
  if (!d) return out;
  while (dirent* e = ::readdir(d)) {
    char target[256];
    const ssize_t n = ::readlink((dir + "/" + e->d_name).c_str(), target, sizeof target - 1);
    if (n <= 0) continue;
    target[n] = 0;
    const std::string t = target;
    if (t.rfind("socket:[", 0) == 0) out.insert(t.substr(8, t.size() - 9));
  }
  ::closedir(d);
  return out;
}

// "ADDR:PORT" (hex, as /proc/net/tcp writes it) of every listening socket of `pid`.
std::vector<std::string> listening(pid_t pid) {
  const std::set<std::string> inodes = socket_inodes(pid);
  std::vector<std::string> out;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::istringstream in(slurp(table));
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream f(line);
      std::string sl, local, remote, state, queues, timer, retr, uid, timeout, inode;
      f >> sl >> local >> remote >> state >> queues >> timer >> retr >> uid >> timeout >> inode;
      if (state == "0A" && inodes.count(inode)) out.push_back(local);
    }
  }
  return out;
}

bool has_other_ipv4_interface() {
  ifaddrs* all = nullptr;
  if (::getifaddrs(&all) != 0) return false;
  bool found = false;
  for (ifaddrs* i = all; i; i = i->ifa_next)
    if (i->ifa_addr && i->ifa_addr->sa_family == AF_INET && (i->ifa_flags & IFF_UP) && !(i->ifa_flags & IFF_LOOPBACK))
      found = true;
  ::freeifaddrs(all);
  return found;
}

}  // namespace

TEST(RelayAttack, UcxListensOnlyWhereAsked) {
  if (!has_other_ipv4_interface())
    GTEST_SKIP() << "this machine has no network interface but loopback: UCX could not listen anywhere else";
  Cluster c(3, "ifaces");
  // UCX_NET_DEVICES unset (the tier sets it to lo): the relay decides.
  const std::map<std::string, std::string> free_ucx = {{"UCX_NET_DEVICES", ""}};
  c.relay_env(0, free_ucx);
  c.relay_env(1, free_ucx);
  c.relay_env(2, free_ucx);
  const int port = start_source(c, 1).port;
  ASSERT_NE(port, 0);
  Proc& mid = c.relay(1, port, true);
  const int p1 = c.listen_port(1);
  Proc& leaf = c.relay(2, p1, false);
  ASSERT_FALSE(c.wait_status(2, [](const json& j) { return upstream_connected(j); }).is_null()) << leaf.output();
  ASSERT_FALSE(c.wait_status(1, [](const json& j) { return upstream_connected(j) && downstream_ready(j); }).is_null())
      << mid.output();
  const json s0 = c.wait_status(0, [](const json& j) { return downstream_ready(j); });
  const std::vector<std::pair<std::string, pid_t>> relays = {
      {"source", static_cast<pid_t>(s0.value("pid", 0))},
      {"middle", static_cast<pid_t>(c.wait_status(1, [](const json&) { return true; }).value("pid", 0))},
      {"leaf", static_cast<pid_t>(c.wait_status(2, [](const json&) { return true; }).value("pid", 0))}};
  for (const auto& [role, pid] : relays) {
    ASSERT_GT(pid, 0) << role;
    const std::vector<std::string> socks = listening(pid);
    if (role != "leaf") {
      EXPECT_FALSE(socks.empty()) << role << ": no listening socket found";
    }
    for (const std::string& l : socks)
      EXPECT_EQ(l.substr(0, 9), "0100007F:") << role << " relay (pid " << pid << ") listens on " << l
                                             << " (hex, /proc/net/tcp): not only on 127.0.0.1";
  }
  EXPECT_NE(slurp(c.file("relay0.log")).find("UCX uses the network devices lo"), std::string::npos)
      << slurp(c.file("relay0.log"));
}
