// The fd channel between real processes (tests/fdchan_peer.cpp): a producer
// serving memfds, the stand-ins for device slots' VMM fds, to consumer
// processes that read the bytes back; a consumer that never reads; a
// producer killed while a consumer waits for its message, or before the
// consumer came; a restarted producer taking over its dead predecessor's
// socket. Handshakes are lines the peers write ("ready", "connected").
#include <gtest/gtest.h>
#include <sys/stat.h>

#include "fdchan_support.hpp"

using namespace shmcast;
using namespace fdchan_test;
using namespace std::chrono_literals;

namespace {

const std::string kPeer = SHMCAST_FDCHAN_PEER;

struct Scene {
  ScratchDir dir;
  std::string name = "mp-" + std::to_string(::getpid());
  std::string f(const std::string& tag) const { return dir.path + "/" + tag; }

  std::vector<std::string> serve_args(const std::string& tag, std::uint64_t nonce, int fds = 3,
                                      std::size_t bytes = 256 << 10) const {
    std::vector<std::string> v = target_command(kPeer);
    v.insert(v.end(), {"serve", "--dir", dir.path, "--name", name, "--nonce", std::to_string(nonce), "--fds",
                       std::to_string(fds), "--bytes", std::to_string(bytes), "--seed", std::to_string(nonce * 100),
                       "--ready", f(tag + ".ready"), "--log", f(tag + ".events")});
    return v;
  }
  std::vector<std::string> fetch_args(std::uint64_t nonce, int fds = 3, std::size_t bytes = 256 << 10,
                                      int timeout_ms = 30000) const {
    std::vector<std::string> v = target_command(kPeer);
    v.insert(v.end(), {"fetch", "--dir", dir.path, "--name", name, "--nonce", std::to_string(nonce), "--fds",
                       std::to_string(fds), "--bytes", std::to_string(bytes), "--seed", std::to_string(nonce * 100),
                       "--timeout-ms", std::to_string(timeout_ms)});
    return v;
  }
  // Starts a server and waits for its "ready" line.
  Proc serve(const std::string& tag, std::uint64_t nonce) const {
    Proc p = Proc::start(serve_args(tag, nonce), f(tag + ".out"));
    EXPECT_NE(wait_line(f(tag + ".ready"), "ready "), "") << p.output();
    return p;
  }
  std::string socket_path() const { return shmcast::detail::slot_socket_file(dir.path, name); }
};

}  // namespace

TEST(FdChannelProcs, TwoConsumersReadBackTheBytes) {
  Scene s;
  Proc server = s.serve("p", 7);
  Proc c1 = Proc::start(s.fetch_args(7), s.f("c1.out"));
  Proc c2 = Proc::start(s.fetch_args(7), s.f("c2.out"));
  EXPECT_EQ(c1.wait(), 0) << c1.output();
  EXPECT_EQ(c2.wait(), 0) << c2.output();
  EXPECT_NE(c1.output().find("ok fds=3"), std::string::npos) << c1.output();
  server.signal(SIGTERM);
  EXPECT_EQ(server.wait(), 0) << server.output();
  EXPECT_NE(slurp(s.f("p.events")).find("served=2 refused=0"), std::string::npos) << slurp(s.f("p.events"));
  struct stat st {};
  EXPECT_NE(::lstat(s.socket_path().c_str(), &st), 0) << "a stopped server removes its socket";
}

TEST(FdChannelProcs, ConsumerThatNeverReadsHoldsUpNobody) {
  Scene s;
  Proc server = s.serve("p", 8);
  // Connections that never read their message (nor close), from this process.
  std::vector<int> idle;
  for (int i = 0; i < 40; ++i) {
    const int c = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::memcpy(a.sun_path, s.socket_path().c_str(), s.socket_path().size());
    ASSERT_EQ(::connect(c, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    idle.push_back(c);
  }
  Proc c = Proc::start(s.fetch_args(8), s.f("c.out"));
  EXPECT_EQ(c.wait(), 0) << c.output();
  // The server stops at once although 40 clients still hold their messages.
  server.signal(SIGTERM);
  EXPECT_EQ(server.wait(), 0) << server.output();
  for (int fd : idle) ::close(fd);
}

TEST(FdChannelProcs, ProducerKilledWhileAConsumerWaitsIsPeerDied) {
  Scene s;
  Proc server = s.serve("p", 9);
  // Frozen: it accepts nothing more, so the consumer's connection waits in
  // its queue for a message; then it is killed.
  server.signal(SIGSTOP);
  ASSERT_TRUE(wait_stopped(server.pid));
  std::vector<std::string> args = s.fetch_args(9, 3, 256 << 10, 120000);
  args.insert(args.end(), {"--connected", s.f("c.connected")});
  Proc c = Proc::start(args, s.f("c.out"));
  ASSERT_NE(wait_line(s.f("c.connected"), "connected"), "") << c.output();
  server.signal(SIGKILL);
  EXPECT_EQ(server.wait(), 128 + SIGKILL);
  // kPeerDied, not kTimeout: the consumer saw the server go, long before its
  // 120 s deadline (and no descriptor of it stayed open: exit 3 otherwise).
  EXPECT_EQ(c.wait(90s), exit_for(Errc::kPeerDied)) << c.output();
  EXPECT_NE(c.output().find("no longer listens"), std::string::npos) << c.output();
}

TEST(FdChannelProcs, ProducerKilledBeforeTheConsumerCameIsPeerDied) {
  Scene s;
  Proc server = s.serve("p", 10);
  server.signal(SIGKILL);
  server.wait();
  struct stat st {};
  ASSERT_EQ(::lstat(s.socket_path().c_str(), &st), 0) << "a killed server leaves its socket";
  Proc c = Proc::start(s.fetch_args(10, 3, 256 << 10, 300), s.f("c.out"));
  EXPECT_EQ(c.wait(), exit_for(Errc::kPeerDied)) << c.output();
  EXPECT_NE(c.output().find("refuses connections"), std::string::npos) << c.output();
}

TEST(FdChannelProcs, RestartedProducerTakesOverTheStaleSocket) {
  Scene s;
  {
    Proc dead = s.serve("a", 11);
    dead.signal(SIGKILL);
    dead.wait();
  }
  Proc server = s.serve("b", 12);
  EXPECT_NE(slurp(s.f("b.events")).find("removed the stale slot socket"), std::string::npos)
      << slurp(s.f("b.events"));
  Proc ok = Proc::start(s.fetch_args(12), s.f("ok.out"));
  EXPECT_EQ(ok.wait(), 0) << ok.output();
  // A consumer of the dead producer's region gets nothing of the new one.
  Proc old = Proc::start(s.fetch_args(11), s.f("old.out"));
  EXPECT_EQ(old.wait(), exit_for(Errc::kCorrupt)) << old.output();
  EXPECT_NE(old.output().find("another region"), std::string::npos) << old.output();
  // A second producer while this one lives is refused, and changes nothing.
  Proc second = Proc::start(s.serve_args("c", 13), s.f("c.out"));
  EXPECT_EQ(second.wait(), exit_for(Errc::kExists)) << second.output();
  Proc again = Proc::start(s.fetch_args(12), s.f("again.out"));
  EXPECT_EQ(again.wait(), 0) << again.output();
  server.signal(SIGTERM);
  EXPECT_EQ(server.wait(), 0);
}
