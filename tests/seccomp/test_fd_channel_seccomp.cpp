// The device slots' fd channel under Docker's default seccomp profile (and
// under one that denies only pidfd_*): socket(AF_UNIX, SOCK_SEQPACKET),
// bind, listen, renameat2, accept4, SO_PEERCRED, sendmsg/recvmsg with
// SCM_RIGHTS, memfd_create and eventfd, in real processes run by
// shmcast-seccomp-run (tests/fdchan_peer.cpp on both ends): the producer
// serves memfds, two consumers read their bytes back, the producer stops on
// SIGTERM and removes its socket.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include "fdchan_support.hpp"

using namespace fdchan_test;

namespace {

const std::string kRunner = SHMCAST_SECCOMP_RUN;
const std::string kPeer = SHMCAST_FDCHAN_PEER;
const std::string kDir = SHMCAST_SECCOMP_PROFILE_DIR;

std::vector<std::string> under(const std::string& profile, std::vector<std::string> cmd) {
  std::vector<std::string> v = {kRunner, "--profile", profile, "--"};
  v.insert(v.end(), cmd.begin(), cmd.end());
  return v;
}

class FdChannelUnderProfile : public ::testing::TestWithParam<std::string> {};

}  // namespace

TEST_P(FdChannelUnderProfile, FdsPassAndBytesArriveBitExact) {
  ScratchDir d;
  const std::string profile = kDir + "/" + GetParam();
  const std::string name = "sc-" + std::to_string(::getpid());
  const std::vector<std::string> common = {"--dir", d.path, "--name", name, "--nonce", "21", "--fds", "4",
                                           "--bytes", "1048576", "--seed", "3"};
  std::vector<std::string> serve = {kPeer, "serve"};
  serve.insert(serve.end(), common.begin(), common.end());
  serve.insert(serve.end(), {"--ready", d.path + "/ready", "--log", d.path + "/events"});
  Proc server = Proc::start(under(profile, serve), d.path + "/p.out");
  ASSERT_NE(wait_line(d.path + "/ready", "ready "), "") << server.output();
  std::vector<std::string> fetch = {kPeer, "fetch"};
  fetch.insert(fetch.end(), common.begin(), common.end());
  Proc c1 = Proc::start(under(profile, fetch), d.path + "/c1.out");
  Proc c2 = Proc::start(under(profile, fetch), d.path + "/c2.out");
  EXPECT_EQ(c1.wait(), 0) << c1.output();
  EXPECT_EQ(c2.wait(), 0) << c2.output();
  EXPECT_NE(c1.output().find("ok fds=4"), std::string::npos) << c1.output();
  server.signal(SIGTERM);
  EXPECT_EQ(server.wait(), 0) << server.output();
  EXPECT_NE(slurp(d.path + "/events").find("served=2 refused=0"), std::string::npos) << slurp(d.path + "/events");
  struct stat st {};
  EXPECT_NE(::lstat(shmcast::detail::slot_socket_file(d.path, name).c_str(), &st), 0);
}

INSTANTIATE_TEST_SUITE_P(Profiles, FdChannelUnderProfile, ::testing::Values("docker-default.json", "no-pidfd.json"),
                         [](const auto& info) { return info.param == "docker-default.json" ? "DockerDefault" : "NoPidfd"; });
