// The relay's data path against a peer without the key (issue 41, items 4
// and 5; ctest -L attack, also -L relay): a keyless local peer that finds
// the source relay's data listener in /proc/net/tcp and connects to it
// while a keyed downstream attaches (tests/relay/relay_data_attacker.cpp).
// Real processes: relay_peer as trainer and worker, shmcast-relay as the
// relays. Both tests failed on the relay before the fix (8ab0c58): the
// first with the source relay dead of SIGSEGV, the second with the chunks
// sent to the keyless peer.
#include <sys/stat.h>

#include <regex>

#include "relay_cluster.hpp"

using namespace relay_test;

namespace {

const std::string kDataAttacker = RELAY_DATA_ATTACKER_BIN;

// The source relay's data listener port, from its log ("" when it names
// none: the relay before the fix opened one per downstream instead).
std::string data_port(Cluster& c) {
  std::smatch m;
  const std::string log = slurp(c.file("relay0.log"));
  static const std::regex re("data connections on 127\\.0\\.0\\.1:([0-9]+)");
  return std::regex_search(log, m, re) ? m[1].str() : std::string();
}

long count_prefix(const std::string& report, const std::string& key, long* sum = nullptr) {
  long n = 0;
  std::istringstream in(slurp(report));
  for (std::string l; std::getline(in, l);)
    if (l.rfind(key + " ", 0) == 0) {
      ++n;
      if (sum) *sum += std::stol(l.substr(key.size() + 1));
    }
  return n;
}

struct Source {
  int port = 0;
  Proc* relay = nullptr;
};
Source start_source(Cluster& c, int syncs) {
  Source s;
  c.peer("trainer", 0, {"produce", c.region(), "--syncs", std::to_string(syncs), "--go", c.file("go"), "--report",
                        c.file("trainer.txt")});
  if (!c.wait_line(c.file("trainer.txt"), "ready")) return s;
  s.relay = &c.relay(0, 0, true);
  s.port = c.listen_port(0);
  c.wait_status(0, [](const json& j) { return j["region_state"].value("ready", false); });
  return s;
}

std::vector<std::string> watch_args(Cluster& c, const Source& s, const std::string& report) {
  std::vector<std::string> a = {kDataAttacker, "watch", "--pid", std::to_string(s.relay->pid), "--ctrl",
                                std::to_string(s.port), "--conns", "3", "--seconds", "300", "--report", report};
  if (const std::string p = data_port(c); !p.empty()) a.insert(a.end(), {"--ports", p});
  return a;
}

}  // namespace

// Item 4. A keyless peer opens 3 UCX connections to every data listener of
// the source relay it sees, each time a downstream attaches, across 50
// attachments of a keyed downstream (started, given its sync, killed).
// Before the fix the source relay destroyed a downstream's data listener
// as soon as it took the first connection, while another was mid-handshake
// on it: UCX 1.13 then called through the freed listener (SIGSEGV in its
// async thread), at the first or second attachment. Now the data listener
// lives as long as the relay: the source runs through all 50, every
// attachment gets its sync, and SIGTERM ends it normally.
TEST(RelayDataAttack, KeylessConnectionsToTheDataListenerNeverCrashTheSource) {
  constexpr int kAttachments = 50;
  Cluster c(2, "datacrash");
  const Source src = start_source(c, kAttachments);
  ASSERT_NE(src.port, 0);
  Proc& watcher = c.start("watcher", watch_args(c, src, c.file("watch.txt")), 1);
  ASSERT_TRUE(c.wait_line(c.file("watch.txt"), "watching"));
  for (int v = 1; v <= kAttachments; ++v) {
    const long hits_before = count_prefix(c.file("watch.txt"), "hit");
    std::filesystem::remove(c.status_path(1));
    Proc& down = c.relay(1, src.port, false);
    const int pid = down.pid;
    const json s1 = c.wait_status(1, [&](const json& j) { return j.value("pid", 0) == pid && upstream_connected(j); });
    ASSERT_FALSE(s1.is_null()) << "attachment " << v << "\n" << down.output();
    ASSERT_FALSE(c.wait_status(0, [](const json& j) { return downstream_ready(j); }).is_null()) << "attachment " << v;
    c.touch(c.file("go." + std::to_string(v)));
    bool got = false;
    for (const auto end = std::chrono::steady_clock::now() + 60s;
         !got && src.relay->running() && std::chrono::steady_clock::now() < end;) {
      try {
        const json j = json::parse(slurp(c.status_path(1)));
        got = j.value("pid", 0) == pid && j.value("syncs", 0) >= 1 && j["last_sync"].value("version", 0) == v;
      } catch (const std::exception&) {
      }
      if (!got) std::this_thread::sleep_for(5ms);
    }
    ASSERT_TRUE(src.relay->running()) << "the source relay died at attachment " << v << ":\n"
                                      << src.relay->output().substr(0, 4000);
    ASSERT_TRUE(got) << "attachment " << v << " got no sync\n" << down.output();
    // The keyless peer takes its turn at this attachment (reports its hit)
    // before the downstream goes: it notices an attachment by polling the
    // relay's sockets (about every 20 ms), and beside stress-ng
    // (scripts/soak) it once slept through one whole attachment (49 hits
    // of 50).
    for (const auto end = std::chrono::steady_clock::now() + 60s;
         count_prefix(c.file("watch.txt"), "hit") <= hits_before && watcher.running() &&
         std::chrono::steady_clock::now() < end;)
      std::this_thread::sleep_for(5ms);
    ASSERT_GT(count_prefix(c.file("watch.txt"), "hit"), hits_before)
        << "the keyless peer did not hit attachment " << v << (watcher.running() ? "" : " (it had ended)") << "\n"
        << slurp(c.file("watch.txt"));
    down.kill9();
    ASSERT_FALSE(c.wait_status(0, [](const json& j) { return j.value("downstream_ready", 1) == 0; }).is_null());
  }
  // The keyless peer was at it on every attachment.
  EXPECT_GE(count_prefix(c.file("watch.txt"), "hit"), kAttachments) << slurp(c.file("watch.txt"));
  watcher.kill9();
  EXPECT_TRUE(src.relay->running()) << src.relay->output().substr(0, 4000);
  EXPECT_EQ(src.relay->term(), 0) << src.relay->output().substr(0, 4000);
}

// Item 5. A keyless peer running as another uid (65534) connects once first to
// the source relay's data listener while a keyed downstream attaches (the
// downstream's own data connection waits at a gate, gate_connect.c, until
// the peer's connection is up), and sync 1 goes while the downstream waits.
// Before the fix the source took the first UCX connection from the
// downstream's address as its data endpoint: the peer received sync 1's
// chunks. Now a data connection carries no chunk until it proved the
// session key: the source skips sync 1 (no downstream is ready), the peer
// receives no byte, and the downstream's worker gets sync 2 bit-exact.
TEST(RelayDataAttack, KeylessPeerOfAnotherUidReceivesNoChunk) {
  if (::geteuid() != 0) GTEST_SKIP() << "a second uid needs root (setpriv --reuid=65534)";
  if (::access("/usr/bin/setpriv", X_OK) != 0) GTEST_SKIP() << "no /usr/bin/setpriv";
  Cluster c(2, "datasteal");
  const Source src = start_source(c, 2);
  ASSERT_NE(src.port, 0);
  const std::string rep = c.file("steal.txt");
  { std::ofstream(rep) << ""; }
  ASSERT_EQ(::chmod(rep.c_str(), 0666), 0);  // the peer of uid 65534 appends to it
  std::vector<std::string> args = watch_args(c, src, rep);
  // One connection, once (three crashed the relay before the fix: item 4).
  args.insert(args.end(), {"--as-nobody", "1", "--hold-ms", "30000", "--conns", "1", "--max-hits", "1"});
  Proc& watcher = c.start("watcher", args, 1);
  ASSERT_TRUE(c.wait_line(rep, "watching"));
  const std::string gate = c.file("gate");
  c.relay_env(1, preload_env(RELAY_GATE_CONNECT_LIB, {{"SHMCAST_TEST_DATA_GATE", gate}}));
  Proc& down = c.relay(1, src.port, false);
  // The downstream proved the key and waits at the gate; the keyless peer's
  // connections to the data listener are up first.
  bool up = false;
  for (const auto end = std::chrono::steady_clock::now() + 60s; !up && std::chrono::steady_clock::now() < end;) {
    long n = 0;
    count_prefix(rep, "connected", &n);
    up = n > 0;
    if (!up) std::this_thread::sleep_for(5ms);
  }
  ASSERT_TRUE(up) << slurp(rep) << watcher.output();
  ASSERT_TRUE(std::filesystem::exists(gate + ".waiting")) << down.output();
  // Sync 1 while the downstream waits at the gate: sent to whatever the
  // source took for its data endpoint, or skipped.
  c.touch(c.file("go.1"));
  ASSERT_FALSE(c.wait_status(0, [](const json& j) {
                  return j.value("syncs", 0) + j.value("syncs_skipped", 0) >= 1;
                }).is_null());
  c.touch(gate);
  ASSERT_FALSE(c.wait_status(1, [](const json& j) { return upstream_connected(j); }).is_null()) << down.output();
  ASSERT_FALSE(c.wait_status(0, [](const json& j) { return downstream_ready(j); }).is_null());
  Proc& w = c.peer("worker1", 1, {"consume", c.region(), "--syncs", "1", "--report", c.file("worker1.txt")});
  ASSERT_TRUE(c.wait_line(c.file("worker1.txt"), "attached"));
  c.touch(c.file("go.2"));
  EXPECT_EQ(w.wait(60s), 0) << slurp(c.file("worker1.txt"));
  EXPECT_TRUE(has_line(c.file("worker1.txt"), "ok 2")) << slurp(c.file("worker1.txt"));
  // The source sent sync 2 (to the downstream only): the keyless peer,
  // still connected, received nothing of either sync.
  long bytes = 0;
  EXPECT_EQ(count_prefix(rep, "recv", &bytes), 0) << slurp(rep);
  EXPECT_EQ(bytes, 0) << slurp(rep);
  EXPECT_TRUE(src.relay->running()) << src.relay->output().substr(0, 4000);
  watcher.kill9();
}
