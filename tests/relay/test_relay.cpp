// shmcast-relay between simulated nodes on one machine: every node is its
// own SHMCAST_DIR, relays talk UCX over TCP loopback (UCX_TLS=tcp), and every
// process is a real fork/exec (relay_peer as trainer and workers,
// shmcast-relay as the relays). Every step waits for a handshake (a report
// line, a status file field), never for time to pass, and every wait has a
// deadline.
#include "relay_cluster.hpp"

using namespace relay_test;

namespace {

class ChainOf : public ::testing::TestWithParam<int> {};

}  // namespace

// Three syncs of multi-slot manifests (tensors from empty to three slots)
// through 2, 3 and 4 nodes: every worker on every node gets every byte and
// the manifest, under the source's version numbers.
TEST_P(ChainOf, SyncsArriveBitExactOnEveryNode) {
  const int n = GetParam();
  Cluster c(n, "chain" + std::to_string(n));
  Chain ch(c, n, 3);
  ASSERT_FALSE(HasFailure());
  for (int v = 1; v <= 3; ++v) ch.go(v);
  for (int i = 1; i < n; ++i) {
    EXPECT_EQ(ch.workers[static_cast<std::size_t>(i - 1)]->wait(), 0) << ch.workers[static_cast<std::size_t>(i - 1)]->output();
    for (int v = 1; v <= 3; ++v) EXPECT_TRUE(has_line(ch.report(i), "ok " + std::to_string(v))) << slurp(ch.report(i));
  }
  // Each node received the way it was told to.
  for (int i = 1; i < n; ++i) {
    const std::string log = ch.relays[static_cast<std::size_t>(i)]->output();
    EXPECT_EQ(log.find("receiving into this node's slots") != std::string::npos, i != 2) << log;
  }
  const json last = c.wait_status(n - 1, [](const json& j) { return j["region_state"].value("syncs", 0) == 3; });
  EXPECT_EQ(last["region_state"].value("version", 0), 3);
  EXPECT_EQ(last.value("syncs_aborted", -1), 0);
  const json src = c.wait_status(0, [](const json& j) { return j.value("syncs", 0) == 3; });
  EXPECT_EQ(src.value("syncs_skipped", -1), 0);
  // shmcast-inspect show puts the relay's state next to the region, on the
  // source node and on the first downstream one.
  for (int node : {0, 1}) {
    const std::string out = run_inspect(c, node, {"show", c.region(), "--json"});
    json j;
    ASSERT_NO_THROW(j = json::parse(out)) << out;
    const json& r = j["relay"];
    EXPECT_EQ(r.value("status", ""), "ok") << r.dump();
    EXPECT_FALSE(r.value("stale", true)) << r.dump();
    EXPECT_EQ(r["relay"].value("role", ""), node == 0 ? "source" : "relay") << r.dump();
    EXPECT_EQ(r["relay"].value("syncs", 0), 3) << r.dump();
    if (node == 1) {
      EXPECT_EQ(r["relay"]["upstream"].value("state", ""), "connected") << r.dump();
      EXPECT_EQ(r["relay"]["region_state"].value("version", 0), 3) << r.dump();
    }
    if (n > 2 || node == 0) {
      ASSERT_EQ(r["relay"]["downstream"].size(), 1u) << r.dump();
      EXPECT_GT(r["relay"]["downstream"][0].value("bytes_sent", 0ull), 0ull) << r.dump();
    }
    const std::string text = run_inspect(c, node, {"show", c.region()});
    EXPECT_NE(text.find(node == 0 ? "role source" : "role relay"), std::string::npos) << text;
    EXPECT_NE(text.find("last sync   version 3"), std::string::npos) << text;
  }
}

INSTANTIATE_TEST_SUITE_P(Nodes, ChainOf, ::testing::Values(2, 3, 4),
                         [](const auto& info) { return std::to_string(info.param) + "Nodes"; });

// A sync whose tensors are all empty has no chunk to send: node 1 (direct
// receive, so nothing is lent) and node 2 (buffered) publish it, and the
// syncs after it still arrive (a region left with a sync open would refuse
// them).
TEST(Relay, SyncOfEmptyTensorsThenFullSyncsArrive) {
  Cluster c(3, "empty");
  Chain ch(c, 3, 3, {"--empty-sync", "2"}, -1, {}, {"--empty-sync", "2"});
  ASSERT_FALSE(HasFailure());
  for (int v = 1; v <= 3; ++v) ch.go(v);
  for (int i = 1; i < 3; ++i) {
    EXPECT_EQ(ch.workers[static_cast<std::size_t>(i - 1)]->wait(), 0) << ch.workers[static_cast<std::size_t>(i - 1)]->output();
    for (int v = 1; v <= 3; ++v) EXPECT_TRUE(has_line(ch.report(i), "ok " + std::to_string(v))) << slurp(ch.report(i));
  }
  const json last = c.wait_status(1, [](const json& j) { return j["region_state"].value("syncs", 0) == 3; });
  EXPECT_EQ(last["region_state"].value("failed", -1), 0) << last.dump();
}

// The source relay is killed while sync 2 is half sent: both downstream
// regions abort sync 2 (their workers get Aborted, never torn bytes); the
// relay is restarted on its port, the downstream relay reconnects by
// itself, and sync 3 arrives whole everywhere.
TEST(RelayFaults, SourceRelayKilledMidSyncThenRestarted) {
  Cluster c(3, "killsrc");
  Chain ch(c, 3, 3, {"--pause-sync", "2", "--resume", c.file("resume")}, 2);
  ASSERT_FALSE(HasFailure());
  ch.go(1);
  for (int i = 1; i < 3; ++i) ASSERT_TRUE(c.wait_line(ch.report(i), "ok 1"));
  ch.go(2);
  ASSERT_TRUE(c.wait_line(c.file("trainer.txt"), "paused 2"));
  // Sync 2 is under way on every node (a worker that has not seen its
  // manifest yet would never see it: an aborted sync is skipped).
  for (int i = 1; i < 3; ++i) ASSERT_TRUE(c.wait_line(ch.report(i), "manifest 2"));
  ch.relays[0]->kill9();
  for (int i = 1; i < 3; ++i) ASSERT_TRUE(c.wait_line(ch.report(i), "error 2 Aborted"));
  c.touch(c.file("resume"));
  ASSERT_TRUE(c.wait_line(c.file("trainer.txt"), "sent 2"));  // the trainer evicted the dead relay and went on
  // The restarted relay's own status (the killed one's file is still there
  // until the new one writes, at most 100 ms after a change).
  const pid_t restarted = c.relay(0, 0, true, kKey, ch.ports[0]).pid;
  ASSERT_FALSE(c.wait_status(0, [&](const json& j) {
                  return j.value("pid", 0) == restarted && j["region_state"].value("ready", false) &&
                         downstream_ready(j);
                }).is_null());
  ASSERT_FALSE(c.wait_status(1, [](const json& j) { return upstream_connected(j) && downstream_ready(j); }).is_null());
  ch.go(3);
  for (int i = 1; i < 3; ++i) {
    EXPECT_EQ(ch.workers[static_cast<std::size_t>(i - 1)]->wait(), 0) << slurp(ch.report(i));
    EXPECT_TRUE(has_line(ch.report(i), "ok 3")) << slurp(ch.report(i));
    EXPECT_FALSE(has_line(ch.report(i), "ok 2")) << slurp(ch.report(i));
  }
  const json s1 = c.wait_status(1, [](const json& j) { return j["upstream"].value("connects", 0) >= 2; });
  EXPECT_GE(s1.value("syncs_aborted", 0), 1);
}

// The trainer abandons sync 2 halfway. The chunks travel as 64 KiB
// fragments (32 per 2 MiB chunk), so the abort can overtake fragments still
// in flight: each relay forwards the abort with the number of fragments it
// passed on, receives exactly those, and cancels the rest. Every worker of
// the four nodes gets Aborted for sync 2 (never torn bytes), no relay is
// left waiting, and sync 3 arrives whole on every node.
TEST(RelayFaults, TrainerAbortMidSyncReachesEveryNodeAndTheNextSyncArrives) {
  Cluster c(4, "abort");
  Chain ch(c, 4, 3, {"--pause-sync", "2", "--resume", c.file("resume"), "--abort-sync", "2"}, 2,
           {"--fragment-bytes", "64K"});
  ASSERT_FALSE(HasFailure());
  ch.go(1);
  for (int i = 1; i < 4; ++i) ASSERT_TRUE(c.wait_line(ch.report(i), "ok 1"));
  ch.go(2);
  ASSERT_TRUE(c.wait_line(c.file("trainer.txt"), "paused 2"));
  for (int i = 1; i < 4; ++i) ASSERT_TRUE(c.wait_line(ch.report(i), "manifest 2"));
  c.touch(c.file("resume"));  // the trainer abandons sync 2 now
  for (int i = 1; i < 4; ++i) ASSERT_TRUE(c.wait_line(ch.report(i), "error 2 Aborted"));
  ch.go(3);
  for (int i = 1; i < 4; ++i) {
    EXPECT_EQ(ch.workers[static_cast<std::size_t>(i - 1)]->wait(), 0) << slurp(ch.report(i));
    EXPECT_TRUE(has_line(ch.report(i), "ok 1")) << slurp(ch.report(i));
    EXPECT_FALSE(has_line(ch.report(i), "ok 2")) << slurp(ch.report(i));
    EXPECT_TRUE(has_line(ch.report(i), "ok 3")) << slurp(ch.report(i));
  }
  ASSERT_TRUE(c.wait_line(c.file("trainer.txt"), "aborted 2"));
  for (int i = 1; i < 4; ++i) {
    // (All three syncs accounted for: the status file is written at most
    // every 100 ms, and the region's version may show before the counts.)
    const json s = c.wait_status(i, [](const json& j) {
      return j["region_state"].value("version", 0) == 3 && j.value("syncs", 0) + j.value("syncs_aborted", 0) >= 3;
    });
    EXPECT_EQ(s.value("syncs_aborted", 0), 1) << s.dump();
    EXPECT_EQ(s.value("syncs", 0), 2) << s.dump();
  }
}

// An upstream that goes quiet in the middle of a sync (here the source
// relay, whose trainer paused) is dropped after --upstream-timeout: the
// downstream aborts the sync (its worker gets Aborted), reconnects by itself,
// and takes the next sync whole.
TEST(RelayFaults, QuietUpstreamMidSyncIsDroppedAndTheNextSyncArrives) {
  Cluster c(2, "quiet");
  Proc& trainer = c.peer("trainer", 0, {"produce", c.region(), "--syncs", "3", "--go", c.file("go"), "--report",
                                        c.file("trainer.txt"), "--pause-sync", "2", "--resume", c.file("resume")});
  ASSERT_TRUE(c.wait_line(c.file("trainer.txt"), "ready"));
  c.relay(0, 0, true);
  const int p0 = c.listen_port(0);
  c.wait_status(0, [](const json& j) { return j["region_state"].value("ready", false); });
  c.relay(1, p0, false, kKey, 0, {"--upstream-timeout", "1.5"});
  c.wait_status(1, [](const json& j) { return upstream_connected(j); });
  c.wait_status(0, [](const json& j) { return downstream_ready(j); });
  const std::string rep = c.file("worker1.txt");
  Proc& w = c.peer("worker1", 1, {"consume", c.region(), "--syncs", "2", "--report", rep});
  ASSERT_TRUE(c.wait_line(rep, "attached"));
  c.touch(c.file("go.1"));
  ASSERT_TRUE(c.wait_line(rep, "ok 1"));
  c.touch(c.file("go.2"));
  ASSERT_TRUE(c.wait_line(c.file("trainer.txt"), "paused 2"));
  ASSERT_TRUE(c.wait_line(rep, "error 2 Aborted"));  // the trainer is still paused: the timeout did it
  const json s1 = c.wait_status(1, [](const json& j) {
    return j["upstream"].value("connects", 0) >= 2 && upstream_connected(j);
  });
  EXPECT_NE(s1.value("last_error", "").find("sent nothing"), std::string::npos) << s1.dump();
  c.wait_status(0, [](const json& j) { return downstream_ready(j); });
  c.touch(c.file("resume"));
  ASSERT_TRUE(c.wait_line(c.file("trainer.txt"), "sent 2"));
  c.touch(c.file("go.3"));
  EXPECT_EQ(w.wait(), 0) << slurp(rep);
  EXPECT_TRUE(has_line(rep, "ok 3")) << slurp(rep);
  EXPECT_TRUE(trainer.running());
}

// A relay that cannot listen (its port is taken by another relay) fails
// cleanly: exit 1 with the reason, no crash (its UCX worker's progress
// thread is stopped before what it uses goes), and the relay holding the
// port goes on.
TEST(RelayFaults, ListenPortInUseFailsCleanly) {
  Cluster c(2, "port");
  Proc& trainer = c.peer("trainer", 0, {"produce", c.region(), "--syncs", "1", "--go", c.file("go"), "--report",
                                        c.file("trainer.txt")});
  ASSERT_TRUE(c.wait_line(c.file("trainer.txt"), "ready"));
  Proc& first = c.relay(0, 0, true);
  const int port = c.listen_port(0);
  ASSERT_NE(port, 0);
  Proc& second = c.relay(1, port, true, kKey, port, {"--status", c.file("second.json")});
  EXPECT_EQ(second.wait(60s), 1) << second.output();
  EXPECT_NE(second.output().find("the port is in use"), std::string::npos) << second.output();
  EXPECT_TRUE(first.running());
  EXPECT_TRUE(trainer.running());
}

// A middle relay of four nodes is killed mid-sync and restarted: its own
// workers see their producer die (PeerDied) and reopen the new region, the
// two nodes behind it abort the sync, and the next sync reaches all three.
TEST(RelayFaults, MiddleRelayKilledMidSyncThenRestarted) {
  Cluster c(4, "killmid");
  Chain ch(c, 4, 3, {"--pause-sync", "2", "--resume", c.file("resume")}, 2);
  ASSERT_FALSE(HasFailure());
  ch.go(1);
  for (int i = 1; i < 4; ++i) ASSERT_TRUE(c.wait_line(ch.report(i), "ok 1"));
  ch.go(2);
  ASSERT_TRUE(c.wait_line(c.file("trainer.txt"), "paused 2"));
  for (int i = 1; i < 4; ++i) ASSERT_TRUE(c.wait_line(ch.report(i), "manifest 2"));
  ch.relays[1]->kill9();
  ASSERT_TRUE(c.wait_line(ch.report(1), "error 2 PeerDied"));
  for (int i = 2; i < 4; ++i) ASSERT_TRUE(c.wait_line(ch.report(i), "error 2 Aborted"));
  c.relay(1, ch.ports[0], true, kKey, ch.ports[1]);
  ASSERT_FALSE(c.wait_status(1, [](const json& j) { return upstream_connected(j) && downstream_ready(j); }).is_null());
  ASSERT_TRUE(c.wait_line(ch.report(1), "reopened"));
  // The worker holds a seat in the restarted relay's region (it may first
  // have caught the dead one's file while the new relay replaced it).
  ASSERT_FALSE(c.wait_status(1, [](const json& j) { return j["region_state"].value("consumers", 0) >= 1; }).is_null());
  ASSERT_FALSE(c.wait_status(0, [](const json& j) { return downstream_ready(j); }).is_null());
  ASSERT_FALSE(c.wait_status(2, [](const json& j) { return upstream_connected(j) && downstream_ready(j); }).is_null());
  c.touch(c.file("resume"));
  ASSERT_TRUE(c.wait_line(c.file("trainer.txt"), "sent 2"));
  ch.go(3);
  for (int i = 1; i < 4; ++i) {
    EXPECT_EQ(ch.workers[static_cast<std::size_t>(i - 1)]->wait(), 0) << slurp(ch.report(i));
    EXPECT_TRUE(has_line(ch.report(i), "ok 3")) << slurp(ch.report(i));
  }
}

// One bit flipped on the wire between node `sender` and the next (below
// TCP's checksum: tests/relay/flip_send.c, preloaded into that relay) in
// sync 2 of a 4-node chain. The receiving node's XXH3 check catches it:
// no node behind the flip publishes sync 2 (its worker gets Aborted or
// never sees it, never the flipped bytes), the nodes before it get sync 2
// whole, and sync 3 arrives everywhere. Node 1 receives straight into its slots, node 2 into
// buffers (Chain), so sender 0 and sender 1 check both receive paths.
static void bit_flipped_on_the_wire(int sender) {
  Cluster c(4, "flip" + std::to_string(sender));
  const std::string arm = c.file("flip");
  c.relay_env(sender, preload_env(RELAY_FLIP_SEND_LIB, {{"SHMCAST_TEST_FLIP_FILE", arm}}));
  Chain ch(c, 4, 3, {}, 2);
  ASSERT_FALSE(::testing::Test::HasFailure());
  ch.go(1);
  for (int i = 1; i < 4; ++i) ASSERT_TRUE(c.wait_line(ch.report(i), "ok 1"));
  c.touch(arm);
  ch.go(2);
  // Every node behind the flip ends sync 2 without publishing it: the node
  // that received the flipped bytes fails its check; the ones after it fail
  // theirs (the bytes were forwarded as they came) or take the abort. (A
  // worker may or may not see sync 2 begin before it ends, so its report is
  // checked for what it must not hold, below.)
  for (int i = sender + 1; i < 4; ++i)
    ASSERT_FALSE(c.wait_status(i, [](const json& j) {
                    return j["region_state"].value("failed", 0) + j.value("syncs_aborted", 0) >= 1;
                  }).is_null());
  // The shim notes the flip once its sendmsg() returned, which may be after
  // the receivers failed the check: wait for the note.
  const auto until = std::chrono::steady_clock::now() + 60s;
  while (slurp(arm + ".sent").find("flipped") == std::string::npos && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(2ms);
  ASSERT_NE(slurp(arm + ".sent").find("flipped"), std::string::npos)
      << "the flip never went out: the test proved nothing";
  EXPECT_FALSE(std::filesystem::exists(arm));
  ASSERT_TRUE(c.wait_line(c.file("trainer.txt"), "sent 2"));
  for (int i = 1; i <= sender; ++i) ASSERT_TRUE(c.wait_line(ch.report(i), "ok 2"));
  ch.go(3);
  for (int i = 1; i < 4; ++i) {
    const std::string rep = ch.report(i);
    EXPECT_EQ(ch.workers[static_cast<std::size_t>(i - 1)]->wait(), 0) << slurp(rep);
    EXPECT_TRUE(has_line(rep, "ok 1")) << slurp(rep);
    EXPECT_FALSE(has_line(rep, "bad 2")) << slurp(rep);
    if (i <= sender) {
      EXPECT_TRUE(has_line(rep, "ok 2")) << slurp(rep);  // before the flip: whole
    } else {
      EXPECT_FALSE(has_line(rep, "ok 2")) << slurp(rep);
      EXPECT_TRUE(has_line(rep, "ok 3")) << slurp(rep);
    }
  }
  // The node that received the flipped bytes says why it failed sync 2; no
  // node behind the flip published it.
  for (int i = sender + 1; i < 4; ++i) {
    const json s = c.wait_status(i, [](const json& j) { return j["region_state"].value("version", 0) == 3; });
    EXPECT_EQ(s["region_state"].value("syncs", 0), 2) << s.dump();  // 1 and 3
    if (i == sender + 1) {
      EXPECT_NE(s["region_state"].value("last_error", "").find("fails its XXH3 checksum across the hop"),
                std::string::npos)
          << s.dump();
      EXPECT_EQ(s["region_state"].value("failed", 0), 1) << s.dump();
    }
  }
}

TEST(RelayFaults, BitFlippedOnTheWireIntoDirectReceiveIsCaught) { bit_flipped_on_the_wire(0); }
TEST(RelayFaults, BitFlippedOnTheWireIntoBufferedReceiveIsCaught) { bit_flipped_on_the_wire(1); }

// A worker that attaches and never reads stalls only its own node: with
// --stall-policy evict its relay evicts it after --consumer-timeout, and the
// node behind gets every sync.
TEST(RelayFaults, StalledWorkerDoesNotHoldTheChain) {
  Cluster c(3, "stall");
  Proc& trainer = c.peer("trainer", 0, {"produce", c.region(), "--syncs", "2", "--go", c.file("go"), "--report",
                                        c.file("trainer.txt")});
  ASSERT_TRUE(c.wait_line(c.file("trainer.txt"), "ready"));
  c.relay(0, 0, true);
  const int p0 = c.listen_port(0);
  c.wait_status(0, [](const json& j) { return j["region_state"].value("ready", false); });
  c.relay(1, p0, true, kKey, 0, {"--stall-policy", "evict", "--consumer-timeout", "1"});
  const int p1 = c.listen_port(1);
  c.wait_status(1, [](const json& j) { return upstream_connected(j); });
  c.relay(2, p1, false);
  c.wait_status(2, [](const json& j) { return upstream_connected(j); });
  c.wait_status(1, [](const json& j) { return downstream_ready(j); });
  c.wait_status(0, [](const json& j) { return downstream_ready(j); });
  c.peer("staller", 1, {"consume", c.region(), "--stall", "--report", c.file("staller.txt")});
  ASSERT_TRUE(c.wait_line(c.file("staller.txt"), "attached"));
  Proc& w2 = c.peer("worker2", 2, {"consume", c.region(), "--syncs", "2", "--report", c.file("worker2.txt")});
  ASSERT_TRUE(c.wait_line(c.file("worker2.txt"), "attached"));
  c.touch(c.file("go.1"));
  c.touch(c.file("go.2"));
  EXPECT_EQ(w2.wait(), 0) << w2.output();
  EXPECT_TRUE(trainer.running());
}

#ifdef SHMCAST_SECCOMP_RUN
// The whole chain, trainer, relays and workers, under Docker's default
// seccomp profile (tests/seccomp): UCX over TCP and the region need nothing
// the profile denies.
TEST(RelaySeccomp, ChainUnderDockerDefaultProfile) {
  Cluster c(3, "seccomp");
  c.wrap({SHMCAST_SECCOMP_RUN, "--profile", SHMCAST_SECCOMP_PROFILE_DIR "/docker-default.json", "--"});
  Chain ch(c, 3, 2);
  ASSERT_FALSE(HasFailure());
  ch.go(1);
  ch.go(2);
  for (int i = 1; i < 3; ++i) {
    EXPECT_EQ(ch.workers[static_cast<std::size_t>(i - 1)]->wait(), 0) << slurp(ch.report(i));
    EXPECT_TRUE(has_line(ch.report(i), "ok 2")) << slurp(ch.report(i));
  }
}
#endif
