// shmcast where CUDA IPC fails: producer and consumer processes under
// Docker's default seccomp profile, under a profile that denies only pidfd_*
// (like the managed container in the seed report), and in separate PID
// namespaces. Every process is a real fork/exec of shmcast_peer.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "proc_support.hpp"
#include "shmcast/shmcast.hpp"

using namespace std::chrono_literals;

namespace {

const std::string kRunner = SHMCAST_SECCOMP_RUN;
const std::string kPeer = SHMCAST_PEER;
const std::string kDir = SHMCAST_SECCOMP_PROFILE_DIR;
const std::string kDockerDefault = kDir + "/docker-default.json";
const std::string kNoPidfd = kDir + "/no-pidfd.json";

int exit_for(shmcast::Errc e) { return 20 + static_cast<int>(e); }

using shmcast_test::Proc;

std::string unique(const std::string& tag) { return "ct-" + tag + "-" + std::to_string(::getpid()); }

std::vector<std::string> under(const std::string& profile, std::vector<std::string> cmd) {
  std::vector<std::string> v = {kRunner, "--profile", profile, "--"};
  v.insert(v.end(), cmd.begin(), cmd.end());
  return v;
}

std::vector<std::string> in_pidns(std::vector<std::string> cmd) {
  std::vector<std::string> v = {"unshare", "--pid", "--fork", "--kill-child", "--mount-proc"};
  v.insert(v.end(), cmd.begin(), cmd.end());
  return v;
}

std::string tmp(const std::string& tag) { return "/tmp/shmcast-ct-" + tag + "-" + std::to_string(::getpid()); }

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Handshake with shmcast_peer: it appends "role=<role> ..." to its --report
// file once Producer::create() (the region is ready) or Consumer::open()
// (the consumer holds a seat) has returned. Waits for that complete line;
// false when it did not come within `timeout` (a file that merely exists
// says nothing about either).
bool wait_report(const std::string& report, const std::string& role, std::chrono::seconds timeout = 60s) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  const std::string key = "role=" + role + " ";
  while (std::chrono::steady_clock::now() < end) {
    const std::string r = slurp(report);
    const auto at = r.find(key);
    if (at != std::string::npos && r.find('\n', at) != std::string::npos) return true;
    std::this_thread::sleep_for(2ms);
  }
  return false;
}

bool can_unshare_pid() {
  Proc p = Proc::start({"unshare", "--pid", "--fork", "--mount-proc", "true"}, tmp("unshare-probe"));
  return p.wait(20s) == 0;
}

class UnderProfile : public ::testing::TestWithParam<std::string> {};

}  // namespace

TEST_P(UnderProfile, FullSyncArrivesBitExact) {
  const std::string name = unique("sync");
  const std::string profile = kDir + "/" + GetParam();
  Proc prod = Proc::start(under(profile, {kPeer, "produce", name, "--syncs", "3"}), tmp("p"));
  Proc cons = Proc::start(under(profile, {kPeer, "consume", name, "--syncs", "3"}), tmp("c"));
  EXPECT_EQ(cons.wait(), 0) << cons.output();
  EXPECT_EQ(prod.wait(), 0) << prod.output();
  shmcast::unlink_region(name);
}

TEST_P(UnderProfile, FileEngineFallsBackWhenIoUringIsDenied) {
  const std::string name = unique("save");
  const std::string profile = kDir + "/" + GetParam();
  const std::string report = tmp("report-" + GetParam());
  ::unlink(report.c_str());
  Proc prod = Proc::start(under(profile, {kPeer, "produce", name, "--syncs", "1"}), tmp("p2"));
  Proc cons = Proc::start(
      under(profile, {kPeer, "consume", name, "--syncs", "1", "--save", tmp("saved"), "--report", report}), tmp("c2"));
  EXPECT_EQ(cons.wait(), 0) << cons.output();
  EXPECT_EQ(prod.wait(), 0) << prod.output();
  const std::string r = slurp(report);
  if (GetParam() == "docker-default.json") {
    // Docker's profile denies io_uring_setup: the bytes went through pwrite.
    EXPECT_NE(r.find("backend=pwrite"), std::string::npos) << r;
    EXPECT_NE(r.find("Operation not permitted"), std::string::npos) << r;
  } else {
    EXPECT_NE(r.find("backend="), std::string::npos) << r;
  }
  ::unlink(tmp("saved").c_str());
  shmcast::unlink_region(name);
}

#ifdef SHMCAST_INSPECT
TEST_P(UnderProfile, InspectListsShowsAndDumpsARegion) {
  const std::string name = unique("inspect");
  const std::string profile = kDir + "/" + GetParam();
  const std::string inspect = SHMCAST_INSPECT;
  const std::string ready = tmp("inspect-ready-" + GetParam());
  ::unlink(ready.c_str());
  Proc prod = Proc::start({kPeer, "produce", name, "--syncs", "1", "--tensors", "4", "--report", ready}, tmp("ip"));
  ASSERT_TRUE(wait_report(ready, "produce")) << prod.output();  // the region is ready, not just a file
  Proc list = Proc::start(under(profile, {inspect, "list", "--json"}), tmp("il"));
  ASSERT_EQ(list.wait(), 0) << list.output();
  EXPECT_NE(list.output().find("\"" + name + "\""), std::string::npos) << list.output();
  Proc show = Proc::start(under(profile, {inspect, "show", name, "--json"}), tmp("is"));
  ASSERT_EQ(show.wait(), 0) << show.output();
  EXPECT_NE(show.output().find("\"ready\""), std::string::npos) << show.output();
  // dump attaches as the consumer the producer waits for, and writes the
  // file through the file engine: pwrite where io_uring is denied.
  const std::string out = tmp("dump") + ".safetensors";
  ::unlink(out.c_str());
  Proc dump = Proc::start(under(profile, {inspect, "dump", name, "--out", out, "--json"}), tmp("id"));
  ASSERT_EQ(dump.wait(), 0) << dump.output();
  EXPECT_EQ(prod.wait(), 0) << prod.output();
  const std::string d = dump.output();
  EXPECT_NE(d.find("\"tensor_count\":4"), std::string::npos) << d;
  if (GetParam() == "docker-default.json") {
    EXPECT_NE(d.find("\"io_backend\":\"pwrite\""), std::string::npos) << d;
  }
  EXPECT_EQ(::access(out.c_str(), F_OK), 0);
  ::unlink(out.c_str());
  ::unlink(ready.c_str());
  shmcast::unlink_region(name);
}
#endif

INSTANTIATE_TEST_SUITE_P(Profiles, UnderProfile, ::testing::Values("docker-default.json", "no-pidfd.json"),
                         [](const auto& info) { return info.param == "docker-default.json" ? "DockerDefault" : "NoPidfd"; });

TEST(MixedProfiles, ConsumersUnderDifferentProfilesShareOneProducer) {
  const std::string name = unique("mixed");
  Proc prod = Proc::start(under(kDockerDefault, {kPeer, "produce", name, "--syncs", "2", "--consumers", "2"}), tmp("mp"));
  Proc c1 = Proc::start(under(kDockerDefault, {kPeer, "consume", name, "--syncs", "2"}), tmp("mc1"));
  Proc c2 = Proc::start(under(kNoPidfd, {kPeer, "consume", name, "--syncs", "2"}), tmp("mc2"));
  EXPECT_EQ(c1.wait(), 0) << c1.output();
  EXPECT_EQ(c2.wait(), 0) << c2.output();
  EXPECT_EQ(prod.wait(), 0) << prod.output();
  shmcast::unlink_region(name);
}

TEST(PidNamespaces, SyncWorksAcrossSeparatePidNamespacesUnderDockerDefault) {
  if (!can_unshare_pid()) GTEST_SKIP() << "unshare --pid needs root (CAP_SYS_ADMIN)";
  const std::string name = unique("pidns");
  const std::string report = tmp("pidns-report");
  ::unlink(report.c_str());
  Proc prod = Proc::start(
      in_pidns(under(kDockerDefault, {kPeer, "produce", name, "--syncs", "2", "--report", report})), tmp("np"));
  Proc cons = Proc::start(
      in_pidns(under(kDockerDefault, {kPeer, "consume", name, "--syncs", "2", "--report", report})), tmp("nc"));
  EXPECT_EQ(cons.wait(), 0) << cons.output();
  EXPECT_EQ(prod.wait(), 0) << prod.output();
  // Each ran as pid 1 of its own namespace: pids say nothing, locks still work.
  std::istringstream lines(slurp(report));
  std::string line, ns_p, ns_c;
  while (std::getline(lines, line)) {
    const auto at = line.find("pidns=");
    const std::string ns = line.substr(at + 6, line.find(' ', at) - at - 6);
    (line.find("role=produce") != std::string::npos ? ns_p : ns_c) = ns;
    EXPECT_NE(line.find("pid=1 "), std::string::npos) << line;
  }
  EXPECT_FALSE(ns_p.empty());
  EXPECT_FALSE(ns_c.empty());
  EXPECT_NE(ns_p, ns_c);
  shmcast::unlink_region(name);
}

TEST(PidNamespaces, ProducerDeathIsSeenAcrossNamespaces) {
  if (!can_unshare_pid()) GTEST_SKIP() << "unshare --pid needs root (CAP_SYS_ADMIN)";
  const std::string name = unique("pidns-death");
  const std::string report = tmp("pidns-death-report");
  ::unlink(report.c_str());
  // The producer waits for two consumers; only one comes, so it never sends.
  Proc prod = Proc::start(in_pidns({kPeer, "produce", name, "--consumers", "2", "--report", report}), tmp("dp"));
  Proc cons = Proc::start(in_pidns({kPeer, "consume", name, "--syncs", "1", "--report", report}), tmp("dc"));
  // The consumer has opened the region (a seat, a live producer) before the
  // producer dies, so it must learn of the death while attached.
  ASSERT_TRUE(wait_report(report, "consume")) << cons.output();
  ::kill(prod.pid, SIGKILL);  // --kill-child takes the producer with it
  prod.wait();
  EXPECT_EQ(cons.wait(), exit_for(shmcast::Errc::kPeerDied)) << cons.output();
  ::unlink(report.c_str());
  shmcast::unlink_region(name);
}
