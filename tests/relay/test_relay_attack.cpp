// The relay's attack tests (ctest -L attack, also -L relay): a peer without
// the key (tests/relay/relay_attacker.cpp) forges control messages, floods
// the listener with connections, or takes the upstream's port and refuses
// everyone; a downstream stops or crawls; key files that someone else
// controls; UCX's own listeners. Real processes throughout (relay_peer as
// trainer and workers, shmcast-relay as the relays); each test was run
// against the relay before its fix and failed there (docs/reliability.md).
#include <dirent.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/inotify.h>

#include <atomic>
#include <set>

#include "relay_cluster.hpp"

using namespace relay_test;

namespace {

const std::string kAttacker = RELAY_ATTACKER_BIN;

// The protocol the keyless peer speaks where it must choose (a fake
// upstream): 3, this relay's; RELAY_ATTACK_PROTO=2 makes it speak the wire
// of the relay before issue 27's fixes, to run these tests against that one.
std::string attack_proto() {
  const char* p = std::getenv("RELAY_ATTACK_PROTO");
  return p && *p ? p : "5";  // the current protocol (3 and 4 framed alike)
}

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif

// The keyless peer (relay_attacker MODE ARGS), on `node`.
Proc& attacker(Cluster& c, const std::string& tag, int node, std::vector<std::string> args) {
  std::vector<std::string> argv = {kAttacker};
  argv.insert(argv.end(), args.begin(), args.end());
  return c.start(tag, argv, node, "");
}

// The value after `key ` on the last line of `report` that has one (-1: none).
long report_value(const std::string& report, const std::string& key) {
  long v = -1;
  std::istringstream in(slurp(report));
  for (std::string l; std::getline(in, l);)
    if (l.rfind(key + " ", 0) == 0) v = std::stol(l.substr(key.size() + 1));
  return v;
}

std::size_t count_lines(const std::string& text) { return static_cast<std::size_t>(std::count(text.begin(), text.end(), '\n')); }

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

// Item 1 of issue 27. A peer without the key connects again and again and
// sprays forged control messages: protocol-2 "responses" on the tags of the
// connections around its own (the ids were sequential: its neighbours are
// the victims), forged active messages, junk. Meanwhile a keyed downstream
// connects (its handshake runs during the spray) and takes three syncs
// (after its handshake). Before the fix the listener took a message's
// connection from the tag: the victim was refused ("wrong key", exit 3) or
// dropped. Now a message counts only on the endpoint it arrived on, and only
// when it echoes that connection's challenge nonce: the victim connects once
// and gets every sync; the forger's own connections are refused.
TEST(RelayAttack, ForgedControlMessagesCannotStopAKeyedDownstream) {
  Cluster c(2, "forge");
  const int port = start_source(c, 3).port;
  ASSERT_NE(port, 0);
  Proc& forger = attacker(c, "forger", 1,
                          {"forge", "--to", "127.0.0.1:" + std::to_string(port), "--seconds", "60", "--report",
                           c.file("forger.txt")});
  // The spray is under way before the victim connects.
  for (auto end = std::chrono::steady_clock::now() + 60s;
       report_value(c.file("forger.txt"), "round") < 2 && std::chrono::steady_clock::now() < end;)
    std::this_thread::sleep_for(5ms);
  ASSERT_GE(report_value(c.file("forger.txt"), "round"), 2) << forger.output();
  Proc& victim = c.relay(1, port, false);
  ASSERT_FALSE(c.wait_status(1, [](const json& j) { return upstream_connected(j); }).is_null()) << victim.output();
  c.wait_status(0, [](const json& j) { return downstream_ready(j); });
  Proc& w = c.peer("worker1", 1, {"consume", c.region(), "--syncs", "3", "--report", c.file("worker1.txt")});
  ASSERT_TRUE(c.wait_line(c.file("worker1.txt"), "attached"));
  for (int v = 1; v <= 3; ++v) c.touch(c.file("go." + std::to_string(v)));
  EXPECT_EQ(w.wait(120s), 0) << slurp(c.file("worker1.txt"));
  // The forger was at it the whole time, and had its own connections.
  EXPECT_TRUE(forger.running()) << forger.output();
  EXPECT_GE(report_value(c.file("forger.txt"), "round"), 3) << slurp(c.file("forger.txt"));
  forger.kill9();
  EXPECT_TRUE(victim.running()) << victim.output();
  const json s1 = c.wait_status(1, [](const json& j) { return upstream_connected(j); });
  EXPECT_EQ(s1["upstream"].value("connects", 0), 1) << s1.dump();  // never dropped, never refused
  EXPECT_EQ(s1["upstream"].value("refusals", -1), 0) << s1.dump();
  // The forger's own responses were refused, on its own connections. (The
  // status file is written at most every 100 ms: wait for the third sync.)
  const json s0 =
      c.wait_status(0, [](const json& j) { return j.value("refused", 0) >= 1 && j.value("syncs", 0) >= 3; });
  EXPECT_EQ(s0.value("syncs", 0), 3) << s0.dump();
}

// Item 2 of issue 27. A peer without the key takes the upstream's port
// (here before the upstream starts; in life while it restarts) and answers
// every connection with "refused: wrong key". Before the fix the keyed relay
// exited 3 at the first refusal and printed the attacker's text as its
// reason. Now no refusal is proven (a keyless peer can send one), so the
// relay reports it and retries with a backoff; once the real upstream takes
// its port back, the relay connects and the sync arrives.
TEST(RelayAttack, FakeUpstreamRefusalsNeverStopAKeyedRelay) {
  Cluster c(2, "fakeup");
  Proc& fake = attacker(c, "fake", 1,
                        {"fake-upstream", "--listen", "127.0.0.1:0", "--proto", attack_proto(), "--report",
                         c.file("fake.txt")});
  long port = -1;
  for (auto end = std::chrono::steady_clock::now() + 60s; port <= 0 && std::chrono::steady_clock::now() < end;
       std::this_thread::sleep_for(5ms))
    port = report_value(c.file("fake.txt"), "listening");
  ASSERT_GT(port, 0) << fake.output();
  Proc& victim = c.relay(1, static_cast<int>(port), false);
  const json s = c.wait_status(1, [](const json& j) {
    return j.contains("upstream") && j["upstream"].value("refusals", 0) >= 2;
  });
  ASSERT_FALSE(s.is_null()) << victim.output();
  EXPECT_TRUE(victim.running()) << victim.output();
  EXPECT_NE(s["upstream"].value("last_refusal", "").find("refused this relay"), std::string::npos) << s.dump();
  EXPECT_NE(victim.output().find("not proven"), std::string::npos) << victim.output();
  EXPECT_FALSE(std::filesystem::exists(c.dir(1) + "/shmcast." + c.region()));  // nothing taken from it
  // The real upstream takes its port back.
  fake.kill9();
  start_source(c, 1, {}, static_cast<int>(port));
  ASSERT_FALSE(c.wait_status(1, [](const json& j) { return upstream_connected(j); }).is_null()) << victim.output();
  c.wait_status(0, [](const json& j) { return downstream_ready(j); });
  Proc& w = c.peer("worker1", 1, {"consume", c.region(), "--syncs", "1", "--report", c.file("worker1.txt")});
  ASSERT_TRUE(c.wait_line(c.file("worker1.txt"), "attached"));
  c.touch(c.file("go.1"));
  EXPECT_EQ(w.wait(), 0) << slurp(c.file("worker1.txt"));
}

// Review of issue 27, H1. Bytes that are not UTF-8 from peers without the
// key: responses for a region whose name holds bytes 0x80-0xff (on the
// source's listener), and a fake upstream whose refusals and challenges do
// (for a relay on node 2). Before the fix the peer's text went into the
// status file's last_error, nlohmann's dump() threw on it (type_error 316),
// and the relay died of SIGABRT (std::terminate, from the final status
// write) after the first such message. Now both relays keep running, their
// status files stay valid JSON without the peer's bytes in last_error, and
// a keyed downstream of the source still gets its sync.
TEST(RelayAttack, NonUtf8BytesFromKeylessPeersNeverEndTheRelay) {
  Cluster c(3, "utf8");
  const Source src = start_source(c, 1);
  ASSERT_NE(src.port, 0);
  Proc& bad = attacker(c, "bad", 1,
                       {"bad-response", "--to", "127.0.0.1:" + std::to_string(src.port), "--seconds", "2", "--report",
                        c.file("bad.txt")});
  ASSERT_TRUE(c.wait_line(c.file("bad.txt"), "done", 120s)) << bad.output();
  const long sent = report_value(c.file("bad.txt"), "sent");
  ASSERT_GE(sent, 1) << slurp(c.file("bad.txt"));
  const json s0 = c.wait_status(0, [&](const json& j) { return j.value("refused", 0) >= sent; }, 20s);
  ASSERT_FALSE(s0.is_null()) << src.relay->output().substr(0, 4000);
  EXPECT_TRUE(src.relay->running()) << src.relay->output().substr(0, 4000);
  EXPECT_EQ(s0.value("last_error", "").find("region"), std::string::npos) << s0.dump();
  // A fake upstream that answers with bytes that are not UTF-8.
  Proc& fake = attacker(c, "fake", 2,
                        {"fake-upstream", "--listen", "127.0.0.1:0", "--bytes", "1", "--report", c.file("fake.txt")});
  long fport = -1;
  for (auto end = std::chrono::steady_clock::now() + 60s; fport <= 0 && std::chrono::steady_clock::now() < end;
       std::this_thread::sleep_for(5ms))
    fport = report_value(c.file("fake.txt"), "listening");
  ASSERT_GT(fport, 0) << fake.output();
  Proc& victim = c.relay(2, static_cast<int>(fport), false);
  // Both kinds of answer (a refusal, a challenge for another region) came.
  const json s2 = c.wait_status(2, [](const json& j) {
    return j.contains("upstream") && j["upstream"].value("refusals", 0) >= 2;
  }, 30s);
  ASSERT_FALSE(s2.is_null()) << victim.output();
  EXPECT_TRUE(victim.running()) << victim.output();
  EXPECT_NE(s2["upstream"].value("last_refusal", "").find("\\x"), std::string::npos) << s2.dump();
  EXPECT_EQ(s2.value("last_error", "").find("\\x"), std::string::npos) << s2.dump();
  // The source still serves a keyed downstream.
  Proc& down = c.relay(1, src.port, false);
  ASSERT_FALSE(c.wait_status(1, [](const json& j) { return upstream_connected(j); }).is_null()) << down.output();
  c.wait_status(0, [](const json& j) { return downstream_ready(j); });
  Proc& w = c.peer("worker1", 1, {"consume", c.region(), "--syncs", "1", "--report", c.file("worker1.txt")});
  ASSERT_TRUE(c.wait_line(c.file("worker1.txt"), "attached"));
  c.touch(c.file("go.1"));
  EXPECT_EQ(w.wait(60s), 0) << slurp(c.file("worker1.txt"));
  EXPECT_TRUE(src.relay->running()) << src.relay->output().substr(0, 4000);
  EXPECT_TRUE(victim.running()) << victim.output();
  EXPECT_EQ(src.relay->term(), 0) << src.relay->output().substr(0, 4000);
  EXPECT_EQ(victim.term(), 0) << victim.output();
  fake.kill9();
}

// Item 2 of issue 27, the other half: a real key mismatch. The downstream
// with another key is refused by the upstream; it says so in its log, in its
// status file (upstream.refusals, upstream.last_refusal) and in
// shmcast-inspect show, writes nothing into its node, and retries. With
// --exit-on-refusal it exits 3 instead. The upstream counts the refusals and
// keeps serving relays that hold the key. (Before: exit 3 at once, always.)
TEST(RelayAttack, WrongKeyIsReportedAndRetriedUnlessExitOnRefusal) {
  Cluster c(2, "wrongkey");
  const int port = start_source(c, 1).port;
  ASSERT_NE(port, 0);
  const std::string other = "another-key-0123456789abcdef";
  Proc& bad = c.relay(1, port, false, other);
  const json s = c.wait_status(1, [](const json& j) {
    return j.contains("upstream") && j["upstream"].value("refusals", 0) >= 2;
  });
  ASSERT_FALSE(s.is_null()) << bad.output();
  EXPECT_TRUE(bad.running()) << bad.output();
  EXPECT_NE(s["upstream"].value("last_refusal", "").find("wrong key"), std::string::npos) << s.dump();
  EXPECT_NE(bad.output().find("wrong key"), std::string::npos) << bad.output();
  EXPECT_FALSE(std::filesystem::exists(c.dir(1) + "/shmcast." + c.region()));
  // shmcast-inspect show: no region here (exit 3), and the relay's state says why.
  const std::string shown = run_inspect(c, 1, {"show", c.region(), "--json"}, 3);
  json j;
  ASSERT_NO_THROW(j = json::parse(shown.substr(std::min(shown.find('{'), shown.size())))) << shown;
  EXPECT_GE(j["relay"]["relay"]["upstream"].value("refusals", 0), 2) << shown;
  const std::string text = run_inspect(c, 1, {"show", c.region()}, 3);
  EXPECT_NE(text.find("refused"), std::string::npos) << text;
  EXPECT_NE(text.find("wrong key"), std::string::npos) << text;
  EXPECT_EQ(bad.term(), 0) << bad.output();
  const json s0 = c.wait_status(0, [](const json& j) { return j.value("refused", 0) >= 2; });
  EXPECT_EQ(s0.value("downstream_ready", -1), 0);
  // Asked to, it exits 3 at the first refusal.
  Proc& quits = c.relay(1, port, false, other, 0, {"--exit-on-refusal", "--status", c.file("quits.json")});
  EXPECT_EQ(quits.wait(60s), 3) << quits.output();
  EXPECT_NE(quits.output().find("wrong key"), std::string::npos) << quits.output();
  // A relay with no key at all does not even start.
  Proc& nokey = c.relay(1, port, false, "");
  EXPECT_EQ(nokey.wait(60s), 2) << nokey.output();
  // The right key still gets in, and the sync arrives.
  c.relay(1, port, false);
  c.wait_status(1, [](const json& j) { return upstream_connected(j); });
  c.wait_status(0, [](const json& j) { return downstream_ready(j); });
  Proc& w = c.peer("worker1", 1, {"consume", c.region(), "--syncs", "1", "--report", c.file("worker1.txt")});
  ASSERT_TRUE(c.wait_line(c.file("worker1.txt"), "attached"));
  c.touch(c.file("go.1"));
  EXPECT_EQ(w.wait(), 0) << w.output();
}

// Item 3 of issue 27. 1,000 connections without the key (300 under the
// sanitizers), held open and never answering the challenge, against a source
// relay started with the usual soft limit of 1024 descriptors. Before the
// fix the relay died of SIGABRT (a UCX assertion when descriptors ran out)
// or wrote hundreds of thousands of log lines, and the keyed downstream got
// no sync. Now the relay raises its soft limit to the hard one, refuses
// connections beyond 64 pending handshakes (8 per address) at once, and
// rate-limits its logging: the keyed downstream gets every sync, bit-exact,
// while the flood holds, and the relay ends normally.
TEST(RelayAttack, KeylessFloodNeitherKillsTheRelayNorStopsItsSyncs) {
  const int conns = kSanitized ? 300 : 1000;
  constexpr int kSyncs = 4;
  Cluster c(2, "flood");
  c.relay_nofile(0, 1024);
  const Source src = start_source(c, kSyncs + 1);
  const int port = src.port;
  ASSERT_NE(port, 0);
  Proc& down = c.relay(1, port, false);
  ASSERT_FALSE(c.wait_status(1, [](const json& j) { return upstream_connected(j); }).is_null()) << down.output();
  c.wait_status(0, [](const json& j) { return downstream_ready(j); });
  Proc& w = c.peer("worker1", 1,
                   {"consume", c.region(), "--syncs", std::to_string(kSyncs + 1), "--report", c.file("worker1.txt")});
  ASSERT_TRUE(c.wait_line(c.file("worker1.txt"), "attached"));
  c.touch(c.file("go.1"));
  ASSERT_TRUE(c.wait_line(c.file("worker1.txt"), "ok 1"));
  Proc& flood = attacker(c, "flood", 1,
                         {"flood", "--to", "127.0.0.1:" + std::to_string(port), "--conns", std::to_string(conns),
                          "--raw", "100", "--seconds", "120", "--report", c.file("flood.txt")});
  ASSERT_TRUE(c.wait_line(c.file("flood.txt"), "flooding", 120s)) << flood.output();
  EXPECT_GT(report_value(c.file("flood.txt"), "raw"), 0) << slurp(c.file("flood.txt"));
  // Every connection is open now; the syncs go while they are held.
  for (int v = 2; v <= kSyncs + 1; ++v) {
    c.touch(c.file("go." + std::to_string(v)));
    ASSERT_TRUE(c.wait_line(c.file("worker1.txt"), "ok " + std::to_string(v), 120s));
  }
  EXPECT_TRUE(flood.running()) << flood.output();
  EXPECT_EQ(report_value(c.file("flood.txt"), "opened"), conns) << slurp(c.file("flood.txt"));
  // The relay closes what passes its caps as the connections reach it
  // (UCX connects in the background): a newcomer beyond a cap evicts the
  // oldest pending one, and a connection silent past the first-response
  // deadline is dropped (unproven). More than half of them, in time; which
  // of the two counts grows depends on how fast they arrive.
  const json s0 = c.wait_status(
      0,
      [&](const json& j) {
        return j.value("rejected", 0) + j.value("evicted", 0) + j.value("unproven", 0) > conns / 2;
      },
      120s);
  EXPECT_FALSE(s0.is_null()) << slurp(c.status_path(0));
  flood.kill9();
  EXPECT_EQ(w.wait(60s), 0) << slurp(c.file("worker1.txt"));
  // No signal ended the source relay: it is running, and SIGTERM ends it
  // normally. Its log stayed short.
  EXPECT_TRUE(src.relay->running()) << src.relay->output().substr(0, 4000);
  EXPECT_EQ(src.relay->term(), 0) << src.relay->output().substr(0, 4000);
  const std::string log0 = slurp(c.file("relay0.log"));
  EXPECT_LT(count_lines(log0), 400u) << log0.substr(0, 4000);
  EXPECT_NE(log0.find("left out"), std::string::npos) << log0.substr(0, 4000);
}

namespace {
// How many times `dir`/`name` is renamed into place (a status file write)
// within `window`.
int status_writes(const std::string& dir, const std::string& name, std::chrono::milliseconds window) {
  const int fd = ::inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
  if (fd < 0 || ::inotify_add_watch(fd, dir.c_str(), IN_MOVED_TO) < 0) {
    ADD_FAILURE() << "inotify: " << std::strerror(errno);
    if (fd >= 0) ::close(fd);
    return -1;
  }
  int n = 0;
  const auto end = std::chrono::steady_clock::now() + window;
  alignas(inotify_event) char buf[64 * 1024];
  while (std::chrono::steady_clock::now() < end) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 10) <= 0) continue;
    const ssize_t len = ::read(fd, buf, sizeof buf);
    for (ssize_t off = 0; off < len;) {
      const auto* e = reinterpret_cast<const inotify_event*>(buf + off);
      if (e->len > 0 && name == e->name) ++n;
      off += static_cast<ssize_t>(sizeof(inotify_event) + e->len);
    }
  }
  ::close(fd);
  return n;
}
}  // namespace

// Review of issue 27, M2. Plain TCP connections without the key that send
// nothing, from 10 addresses (127.0.0.2-11), hold every pending slot (64 in
// all, 8 per address), and each one the relay closes is opened again at
// once. Before the fix a newcomer was refused at once while the idle ones
// held their slots for the whole --handshake-timeout (30 s for the tests'
// relays): the keyed downstream (127.0.0.1) could not get in within 20 s.
// Now a newcomer takes the place of the oldest connection of the address
// that holds the most, and an idle one is closed after
// --first-response-timeout (2 s): the keyed downstream connects within the
// bound and takes its sync.
TEST(RelayAttack, IdleKeylessConnectionsCannotKeepAKeyedDownstreamOut) {
  Cluster c(2, "idle");
  const Source src = start_source(c, 1);  // the tests' relays have --handshake-timeout 30
  ASSERT_NE(src.port, 0);
  Proc& flood = attacker(c, "flood", 1,
                         {"flood", "--to", "127.0.0.1:" + std::to_string(src.port), "--conns", "0", "--raw", "80",
                          "--sources", "10", "--sustain", "1", "--seconds", "90", "--report", c.file("flood.txt")});
  ASSERT_TRUE(c.wait_line(c.file("flood.txt"), "flooding", 60s)) << flood.output();
  ASSERT_FALSE(c.wait_status(0, [](const json& j) {
                 return j.value("rejected", 0) + j.value("evicted", 0) >= 100;
               }, 30s).is_null());
  // L3: the flood changes the relay's state on every pass; its status file
  // is written at most once per 100 ms all the same (before: on every pass,
  // thousands of times a second).
  const int writes = status_writes(c.dir(0), "shmcast-relay." + c.region() + ".json", 2000ms);
  EXPECT_GE(writes, 1);
  EXPECT_LE(writes, 30) << "status file writes in 2 s of flood";
  Proc& down = c.relay(1, src.port, false);
  ASSERT_FALSE(c.wait_status(1, [](const json& j) { return upstream_connected(j); }, 20s).is_null())
      << down.output() << slurp(c.status_path(0));
  EXPECT_TRUE(flood.running()) << flood.output();
  c.wait_status(0, [](const json& j) { return downstream_ready(j); });
  Proc& w = c.peer("worker1", 1, {"consume", c.region(), "--syncs", "1", "--report", c.file("worker1.txt")});
  ASSERT_TRUE(c.wait_line(c.file("worker1.txt"), "attached"));
  c.touch(c.file("go.1"));
  EXPECT_EQ(w.wait(60s), 0) << slurp(c.file("worker1.txt"));
  flood.kill9();
  EXPECT_EQ(src.relay->term(), 0) << src.relay->output().substr(0, 4000);
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
  // The middle relay knows the source's slot size before the leaf connects
  // (else the leaf makes its region only at the first sync, and this test
  // sends none).
  ASSERT_FALSE(c.wait_status(1, [](const json& j) { return upstream_connected(j); }).is_null()) << mid.output();
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

// Item 9 of issue 27. Three downstream relays of one source: H healthy, S
// stopped (SIGSTOP) for good, T stopped 4 s and resumed 0.3 s over and over.
// The trainer sends a sync every 150 ms for about 9 s. Before the fix S held
// every other downstream for the whole --peer-timeout (60 s here), and T was
// never dropped: H got nothing. Now a downstream that holds the source
// back (a slot H is done with waits for it) and has taken no fragment for
// --max-lag is dropped from the sync (issue 41 item 6: not for merely
// lagging behind H; tests/relay/test_relay_ops.cpp): H gets every sync in time, T reconnects and takes later ones, and S,
// resumed, gets the next sync. --max-lag is 1 s here (0.3 s by default,
// docs/benchmarks.md measures that one): a healthy relay starved by a loaded
// machine for 0.3 s would be dropped too.
TEST(RelayAttack, SlowDownstreamsAreDroppedAndTheOthersKeepGoing) {
  constexpr int kSyncs = 60;
  // The trainer can make up to kSpare more syncs than the healthy worker
  // takes: see `made` below.
  constexpr int kSpare = 10;
  Cluster c(4, "slow");
  const int port = start_source(c, kSyncs + kSpare + 1, {"--peer-timeout", "60", "--max-lag", "1"}).port;
  ASSERT_NE(port, 0);
  std::vector<Proc*> relays;
  for (int i = 1; i <= 3; ++i) {
    relays.push_back(&c.relay(i, port, false));
    ASSERT_FALSE(c.wait_status(i, [](const json& j) { return upstream_connected(j); }).is_null());
  }
  c.wait_status(0, [](const json& j) { return downstream_ready(j, 3); });
  std::vector<Proc*> workers;
  for (int i = 1; i <= 3; ++i) {
    const std::string rep = c.file("worker" + std::to_string(i) + ".txt");
    // Workers 2 and 3 sit behind the stopped relays: on a loaded machine
    // (TSan beside other stages) the healthy worker's 60 syncs alone took
    // over 90 s, the default wait for a sync, and they gave up before the
    // relays were resumed.
    workers.push_back(&c.peer("worker" + std::to_string(i), i,
                              {"consume", c.region(), "--syncs", i == 1 ? std::to_string(kSyncs) : "1000",
                               "--wait-sync", i == 1 ? "90" : "600", "--report", rep}));
    ASSERT_TRUE(c.wait_line(rep, "attached"));
  }
  Proc& h = *workers[0];
  Proc& s = *relays[1];
  Proc& t = *relays[2];
  ::kill(s.pid, SIGSTOP);
  std::atomic<bool> toggling{true};
  std::thread toggler([&] {
    while (toggling) {
      ::kill(t.pid, SIGSTOP);
      for (int i = 0; i < 400 && toggling; ++i) std::this_thread::sleep_for(10ms);
      ::kill(t.pid, SIGCONT);
      std::this_thread::sleep_for(300ms);
    }
  });
  const auto t0 = std::chrono::steady_clock::now();
  for (int v = 1; v <= kSyncs; ++v) {
    c.touch(c.file("go." + std::to_string(v)));
    std::this_thread::sleep_for(150ms);
  }
  // The syncs released so far. The healthy relay can be dropped too, by the
  // same rule: under TSan on CI's loaded machine it once took no fragment
  // for 1,042 ms (--max-lag is 1 s). It joins again at a later sync, and
  // the syncs around the drop (two there) never reach its worker; with
  // exactly kSyncs released, that worker then waited for syncs that never
  // came. So for each time the healthy relay connected again, up to two
  // more syncs are released, one at a time, when its worker is short and
  // has had nothing for 5 s. A healthy relay that was never dropped gets
  // none: its worker must get every one of the kSyncs.
  int made = kSyncs;
  int h_connects = 1;
  const auto healthy_connects = [&] {
    try {
      const json j = json::parse(slurp(c.status_path(1)));
      return std::max(h_connects, j["upstream"].value("connects", 1));
    } catch (const std::exception&) {
      return h_connects;
    }
  };
  // Isolation, not throughput: the healthy worker never waits anywhere near
  // --peer-timeout (60 s) for its next sync, which is what a stopped sibling
  // holding the source did before the fix. Its total time has a backstop
  // only: beside stress-ng (scripts/soak) its 60 syncs alone took over 60 s
  // with no gap above 4 s, and TSan runs the relays several times slower.
#if defined(__SANITIZE_THREAD__)
  const auto backstop = 180s;
#else
  const auto backstop = 150s;
#endif
  const auto oks = [&] {
    const std::string r = slurp(c.file("worker1.txt"));
    int n = 0;
    for (std::size_t at = 0; (at = r.find("ok ", at)) != std::string::npos; at += 3)
      if (at == 0 || r[at - 1] == '\n') ++n;
    return n;
  };
  int seen = 0;
  double max_gap = 0;
  auto last = std::chrono::steady_clock::now();
  auto last_go = last;
  while (h.running() && std::chrono::steady_clock::now() - t0 < backstop) {
    const auto now = std::chrono::steady_clock::now();
    if (const int n = oks(); n > seen) {
      seen = n;
      last = now;
    }
    max_gap = std::max(max_gap, std::chrono::duration<double>(now - last).count());
    if (now - last > 5s && now - last_go > 5s) {
      h_connects = healthy_connects();
      if (made - kSyncs < std::min(kSpare, 2 * (h_connects - 1))) {
        c.touch(c.file("go." + std::to_string(++made)));
        last_go = now;
      }
    }
    std::this_thread::sleep_for(50ms);
  }
  const int hrc = h.wait(1s);
  EXPECT_LT(max_gap, 30.0) << "the healthy worker waited " << max_gap << " s for a sync after its " << seen
                           << "th";
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  toggling = false;
  toggler.join();
  ::kill(t.pid, SIGCONT);
  ::kill(s.pid, SIGCONT);
  // On a failure, the last lines of what tells why come first (a CI log
  // keeps only the head of a failing test's output): the worker's report,
  // the source relay's log, the healthy relay's log.
  EXPECT_EQ(hrc, 0) << last_lines(slurp(c.file("worker1.txt")), 6) << "---- relay0.log (end)\n"
                    << last_lines(slurp(c.file("relay0.log")), 40) << "---- relay1.log (end)\n"
                    << last_lines(slurp(c.file("relay1.log")), 20);
  RecordProperty("healthy_seconds", std::to_string(took));
  RecordProperty("syncs_released", std::to_string(made));
  RecordProperty("healthy_relay_connects", std::to_string(h_connects));
  const std::string log0 = slurp(c.file("relay0.log"));
  EXPECT_NE(log0.find("held the source back: it has taken no fragment for"), std::string::npos)
      << log0.substr(0, 4000);
  EXPECT_NE(log0.find("(--max-lag 1000 ms)"), std::string::npos) << log0.substr(0, 4000);
  // Both slow ones were dropped and reconnected; each, running again, takes
  // the next sync.
  for (int i : {2, 3})
    ASSERT_FALSE(c.wait_status(i, [](const json& j) {
                    return upstream_connected(j) && j["upstream"].value("connects", 0) >= 2;
                  }).is_null())
        << relays[static_cast<std::size_t>(i - 1)]->output();
  c.wait_status(0, [](const json& j) { return downstream_ready(j, 3); });
  c.touch(c.file("go." + std::to_string(++made)));
  for (int i : {2, 3}) EXPECT_TRUE(c.wait_line(c.file("worker" + std::to_string(i) + ".txt"), "ok " + std::to_string(made)));
}
