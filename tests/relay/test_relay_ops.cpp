// The relay's operations against slow peers and other users (issue 41, items
// 6-8; ctest -L attack, also -L relay): a downstream that is only slower
// than its sibling keeps its syncs; the key file is never read through a
// planted link or a FIFO; a status name another uid took first is refused
// at start. Real processes (relay_peer as trainer and workers,
// shmcast-relay as the relays); each test failed on the relay before its
// fix (8ab0c58).
#include <sys/stat.h>

#include "relay_cluster.hpp"

using namespace relay_test;

namespace {

const std::string kSlowRecv = RELAY_SLOW_RECV_LIB;

bool have_setpriv() { return ::access("/usr/bin/setpriv", X_OK) == 0 || ::access("/bin/setpriv", X_OK) == 0; }

// Runs argv to its end (at most 30 s); its exit code, -1 on timeout.
int run_as(const std::vector<std::string>& argv, const std::string& log) {
  Proc p = Proc::start(argv, log);
  return p.wait(std::chrono::seconds(30));
}

// Waits (90 s at most) for `line` in `report`.
bool wait_report(const Cluster& c, const std::string& report, const std::string& line) {
  return c.wait_line(report, line, 90s);
}

}  // namespace

// Item 6 of issue 41. Two downstream relays of one source: F fast, T
// reading from the network at 2 MiB/s (tests/relay/slow_recv.c, a steady
// pace, as a loaded node or a slower link would), each sync one tensor of
// 4 MiB (two 2 MiB slots of the source region, the whole ring), a sync
// every 3.5 s, which T keeps up with (about 2 s each). Before the fix the
// source measured T's lag against F: F had the sync at once, T fell more
// than --max-lag (1 s here) behind it and was dropped from every sync (its
// worker got Aborted each time). Now a downstream is dropped only when it
// holds the source back without taking a fragment for --max-lag: T takes
// one every ~125 ms and gets every sync, and F keeps >= 0.9x the rate it
// had alone (the first phase of the same run, T not started yet).
TEST(RelayOps, SlowButSteadyDownstreamKeepsItsSyncs) {
  constexpr int kPhase = 4;                // syncs per phase
  constexpr auto kEvery = 3500ms;          // the trainer's cadence
  constexpr std::uint64_t kBytes = 4u << 20;
  const std::string bytes = std::to_string(kBytes);
  Cluster c(3, "steady");
  c.peer("trainer", 0,
         {"produce", c.region(), "--syncs", std::to_string(2 * kPhase), "--bytes", bytes, "--go", c.file("go"),
          "--report", c.file("trainer.txt")});
  ASSERT_TRUE(c.wait_line(c.file("trainer.txt"), "ready"));
  // Small socket buffers on both ends of T's link, so that the kernel does
  // not take in a sync T has not read.
  c.relay_env(0, {{"UCX_TCP_SNDBUF", "65536"}});
  c.relay(0, 0, true, kKey, 0, {"--max-lag", "1", "--fragment-bytes", "256K"});
  const int port = c.listen_port(0);
  ASSERT_NE(port, 0);
  c.wait_status(0, [](const json& j) { return j["region_state"].value("ready", false); });
  Proc& fast = c.relay(1, port, false);
  ASSERT_FALSE(c.wait_status(1, [](const json& j) { return upstream_connected(j); }).is_null()) << fast.output();
  c.peer("worker1", 1,
         {"consume", c.region(), "--syncs", std::to_string(2 * kPhase), "--bytes", bytes, "--report",
          c.file("worker1.txt")});
  ASSERT_TRUE(c.wait_line(c.file("worker1.txt"), "attached"));
  c.wait_status(0, [](const json& j) { return downstream_ready(j, 1); });

  // Syncs v0+1 .. v0+kPhase at the cadence; seconds from the first go to
  // F's worker having the last one.
  auto phase = [&](int v0) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int v = v0 + 1; v <= v0 + kPhase; ++v) {
      if (v > v0 + 1) std::this_thread::sleep_until(t0 + (v - v0 - 1) * kEvery);  // the trainer's pace
      c.touch(c.file("go." + std::to_string(v)));
    }
    if (!wait_report(c, c.file("worker1.txt"), "ok " + std::to_string(v0 + kPhase))) return -1.0;
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  const double alone = phase(0);
  ASSERT_GT(alone, 0);

  c.relay_env(2, preload_env(kSlowRecv, {{"SHMCAST_TEST_RECV_BPS", std::to_string(2u << 20)},
                                         {"UCX_TCP_RCVBUF", "65536"}}));
  Proc& slow = c.relay(2, port, false);
  ASSERT_FALSE(c.wait_status(2, [](const json& j) { return upstream_connected(j); }).is_null()) << slow.output();
  c.peer("worker2", 2,
         {"consume", c.region(), "--syncs", std::to_string(kPhase), "--bytes", bytes, "--report",
          c.file("worker2.txt")});
  ASSERT_TRUE(c.wait_line(c.file("worker2.txt"), "attached"));
  c.wait_status(0, [](const json& j) { return downstream_ready(j, 2); });
  const double beside = phase(kPhase);
  ASSERT_GT(beside, 0);
  // T got every sync of the phase, without being dropped once.
  EXPECT_TRUE(c.wait_line(c.file("worker2.txt"), "ok " + std::to_string(2 * kPhase), 30s));
  for (int v = kPhase + 1; v <= 2 * kPhase; ++v)
    EXPECT_TRUE(has_line(c.file("worker2.txt"), "ok " + std::to_string(v))) << slurp(c.file("worker2.txt"));
  EXPECT_EQ(slurp(c.file("worker2.txt")).find("error"), std::string::npos) << slurp(c.file("worker2.txt"));
  const std::string log0 = slurp(c.file("relay0.log"));
  EXPECT_EQ(log0.find("held the source back"), std::string::npos) << log0;
  EXPECT_EQ(log0.find("fell behind"), std::string::npos) << log0;
  const json s2 = c.wait_status(2, [](const json& j) { return upstream_connected(j); });
  EXPECT_EQ(s2["upstream"].value("connects", 0), 1) << s2.dump();
  // F's rate beside T, recorded (0.975-1.000x on an idle machine, issue 41;
  // a figure, not a test's: under scripts/under-load.sh's stress-ng it
  // measured 0.82x). The test holds F to half its rate alone, which a
  // sibling that stalled the source for --max-lag per sync would not keep.
  RecordProperty("fast_alone_seconds", std::to_string(alone));
  RecordProperty("fast_beside_slow_seconds", std::to_string(beside));
  EXPECT_GE(alone / beside, 0.5) << "F took " << beside << " s for " << kPhase << " syncs beside T, " << alone
                                 << " s alone";
  std::printf("F: %d syncs in %.2f s alone, %.2f s beside T (rate %.3fx)\n", kPhase, alone, beside, alone / beside);
}

// Item 7 of issue 41. The key file is opened as regions are: never through
// a link that someone else may have planted, never blocking on a FIFO, and
// only a regular file. Before the fix a link in a directory anyone may
// write, to /proc/self/environ, became the key, and a FIFO at the path hung
// the relay with no log line. Now both are refused at once (exit 2) with
// the path and what to do; a good file still loads, and so does a link
// only this user (or root) can have made, in a directory others cannot
// change (a Kubernetes Secret volume's key -> ..data/key).
TEST(RelayOps, KeyFileLinksAndFifosAreRefused) {
  Cluster c(2, "keylink");
  const std::string key = c.file("relay.key");
  {
    std::ofstream(key) << kKey << "\n";
  }
  ASSERT_EQ(::chmod(key.c_str(), 0600), 0);
  int n = 0;
  auto try_key = [&](const std::string& path) -> Proc& {
    return c.start("key" + std::to_string(n++),
                   {kRelay, c.region(), "--from", "127.0.0.1:9", "--key-file", path, "--status", "-"}, 1, "");
  };
  auto starts = [&](Proc& p) {
    const auto end = std::chrono::steady_clock::now() + 60s;
    while (p.output().find("upstream 127.0.0.1:9") == std::string::npos && p.running() &&
           std::chrono::steady_clock::now() < end)
      std::this_thread::sleep_for(5ms);
    const bool ok = p.running();
    EXPECT_EQ(p.term(), 0) << p.output();
    return ok;
  };
  // A good file loads.
  Proc& good = try_key(key);
  EXPECT_TRUE(starts(good)) << good.output();

  // A link in a directory anyone may write (no sticky bit), to
  // /proc/self/environ (whose bytes the attacker knows): refused.
  const std::string open_dir = c.file("open");
  ASSERT_EQ(::mkdir(open_dir.c_str(), 0777), 0);
  ASSERT_EQ(::chmod(open_dir.c_str(), 0777), 0);
  const std::string planted = open_dir + "/relay.key";
  ASSERT_EQ(::symlink("/proc/self/environ", planted.c_str()), 0);
  Proc& environ = try_key(planted);
  EXPECT_EQ(environ.wait(30s), 2) << environ.output();
  EXPECT_NE(environ.output().find("key file " + planted + " is a symbolic link in " + open_dir), std::string::npos)
      << environ.output();
  EXPECT_NE(environ.output().find("which others may write"), std::string::npos) << environ.output();

  // A FIFO: refused at once, not a hang.
  const std::string fifo = c.file("fifo.key");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const auto t0 = std::chrono::steady_clock::now();
  Proc& pipe = try_key(fifo);
  EXPECT_EQ(pipe.wait(30s), 2) << "a FIFO key file hung the relay: " << pipe.output();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 30s);
  EXPECT_NE(pipe.output().find("key file " + fifo + " is a FIFO"), std::string::npos) << pipe.output();

  // A link this user made, in a directory only it can write (a Kubernetes
  // Secret volume's layout): followed, the target checked as a key file.
  const std::string own_dir = c.file("secret");
  ASSERT_EQ(::mkdir(own_dir.c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((own_dir + "/..2026_12_06").c_str(), 0755), 0);
  ASSERT_EQ(::rename(key.c_str(), (own_dir + "/..2026_12_06/key").c_str()), 0);
  ASSERT_EQ(::symlink("..2026_12_06", (own_dir + "/..data").c_str()), 0);
  ASSERT_EQ(::symlink("..data/key", (own_dir + "/key").c_str()), 0);
  Proc& secret = try_key(own_dir + "/key");
  EXPECT_TRUE(starts(secret)) << secret.output();

  if (::geteuid() != 0 || !have_setpriv()) GTEST_SKIP() << "the other-uid link needs root and setpriv";
  // In a sticky directory (as /tmp, /dev/shm) uid 65534 plants a link to
  // this user's key file: the target passes every check, the link does not.
  const std::string sticky = c.file("sticky");
  ASSERT_EQ(::mkdir(sticky.c_str(), 0777), 0);
  ASSERT_EQ(::chmod(sticky.c_str(), 01777), 0);
  const std::string theirs = sticky + "/relay.key";
  ASSERT_EQ(run_as({"setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "ln", "-s",
                    own_dir + "/..2026_12_06/key", theirs},
                   c.file("setpriv.log")),
            0)
      << slurp(c.file("setpriv.log"));
  Proc& other = try_key(theirs);
  EXPECT_EQ(other.wait(30s), 2) << other.output();
  EXPECT_NE(other.output().find("is a symbolic link owned by uid 65534"), std::string::npos) << other.output();
}

// Item 8 of issue 41. The default status file lies in the region directory,
// /dev/shm, where anyone may create files and the sticky bit keeps a user
// from replacing another's. uid 65534 creates shmcast-relay.R.json first;
// a relay of another user (uid 65533) then cannot write its status. Before
// the fix it ran on without one (every write failed; shmcast-inspect called
// the file untrusted). Now it refuses to start (exit 2), naming the file's
// owner and --status; with --status in a directory of its own it runs.
TEST(RelayOps, StatusNameAnotherUidTookIsRefusedAtStart) {
  if (::geteuid() != 0 || !have_setpriv()) GTEST_SKIP() << "needs root and setpriv (two other uids)";
  Cluster c(1, "squat");
  const std::string shm = c.file("shm");  // the region directory: as /dev/shm, sticky and open to all
  ASSERT_EQ(::mkdir(shm.c_str(), 0777), 0);
  ASSERT_EQ(::chmod(shm.c_str(), 01777), 0);
  ASSERT_EQ(::chmod(c.file("").c_str(), 0755), 0);
  const std::string status = shm + "/shmcast-relay." + c.region() + ".json";
  ASSERT_EQ(run_as({"setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "touch", status},
                   c.file("setpriv.log")),
            0)
      << slurp(c.file("setpriv.log"));
  struct stat st {};
  ASSERT_EQ(::lstat(status.c_str(), &st), 0);
  ASSERT_EQ(st.st_uid, 65534u);
  const std::map<std::string, std::string> env = {{"SHMCAST_DIR", shm}};
  auto relay_as_65533 = [&](const std::string& tag, std::vector<std::string> extra) -> Proc& {
    std::vector<std::string> argv = {"setpriv", "--reuid=65533", "--regid=65533", "--clear-groups",
                                     kRelay,    c.region(),     "--listen",      "127.0.0.1:0"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return c.start(tag, argv, 0, kKey, env);
  };
  Proc& squatted = relay_as_65533("relay-squatted", {});
  EXPECT_EQ(squatted.wait(30s), 2) << squatted.output();
  const std::string out = squatted.output();
  EXPECT_NE(out.find("status file " + status + " belongs to uid 65534"), std::string::npos) << out;
  EXPECT_NE(out.find("--status"), std::string::npos) << out;
  // The way out: a status path of its own.
  const std::string own = c.file("own");
  ASSERT_EQ(::mkdir(own.c_str(), 0755), 0);
  ASSERT_EQ(::chown(own.c_str(), 65533, 65533), 0);
  Proc& moved = relay_as_65533("relay-moved", {"--status", own + "/relay.json"});
  // Running: its status names the port it listens on (written once run()
  // has begun; the first write, at construction, comes before the tool
  // handles SIGTERM).
  const auto end = std::chrono::steady_clock::now() + 60s;
  bool listening = false;
  while (!listening && moved.running() && std::chrono::steady_clock::now() < end) {
    try {
      listening = !json::parse(slurp(own + "/relay.json")).value("listen", std::string()).empty();
    } catch (const std::exception&) {
    }
    if (!listening) std::this_thread::sleep_for(5ms);
  }
  EXPECT_TRUE(listening) << moved.output();
  EXPECT_TRUE(moved.running()) << moved.output();
  struct stat ms {};
  ASSERT_EQ(::lstat((own + "/relay.json").c_str(), &ms), 0);
  EXPECT_EQ(ms.st_uid, 65533u);
  EXPECT_EQ(moved.term(), 0) << moved.output();
}
