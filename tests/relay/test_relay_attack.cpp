// The relay's attack tests (ctest -L attack, also -L relay): key files that
// someone else controls. Real processes throughout (shmcast-relay); each
// test was run against the relay before its fix and failed there
// (docs/reliability.md).
#include "relay_cluster.hpp"

using namespace relay_test;

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
