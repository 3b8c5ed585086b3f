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

bool have_setpriv() { return ::access("/usr/bin/setpriv", X_OK) == 0 || ::access("/bin/setpriv", X_OK) == 0; }

// Runs argv to its end (at most 30 s); its exit code, -1 on timeout.
int run_as(const std::vector<std::string>& argv, const std::string& log) {
  Proc p = Proc::start(argv, log);
  return p.wait(std::chrono::seconds(30));
}

}  // namespace

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
