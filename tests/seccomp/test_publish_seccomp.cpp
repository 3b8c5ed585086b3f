// shmcast-publish where io_uring is denied: under Docker's default seccomp
// profile (io_uring_setup fails with EPERM) and under a profile that denies
// it with ENOSYS (as Podman's does), the reads fall back to pread(2) and the
// consumer still gets every byte; forcing io_uring there fails with a
// message that says what to do. A control run without a filter uses
// io_uring (where the host allows it).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <sstream>
#include <thread>

#include "proc_support.hpp"
#include "st_support.hpp"

using namespace st_test;
using namespace std::chrono_literals;
namespace sf = shmcast::safetensors;

namespace {

const std::string kRunner = SHMCAST_SECCOMP_RUN;
const std::string kPublish = SHMCAST_PUBLISH_BIN;
const std::string kDir = SHMCAST_SECCOMP_PROFILE_DIR;

using shmcast_test::Proc;

// A run of a tool, its stdout and stderr in files of their own (removed with it).
Proc tool(const std::vector<std::string>& argv, const std::string& tag) {
  const std::string base = "/tmp/shmcast-pubsec-" + tag + "-" + std::to_string(::getpid());
  return Proc::start(argv, {.log = base + ".out", .err = base + ".err", .remove_logs = true});
}

// The last JSON line of a tool's stdout.
json last_json(const Proc& p) {
  std::istringstream in(p.stdout_text());
  std::string line, last;
  while (std::getline(in, line))
    if (!line.empty() && line[0] == '{') last = line;
  return last.empty() ? json() : json::parse(last);
}

std::vector<Tensor> make_checkpoint(const fs::path& dir) {
  std::vector<Tensor> ts = {make_tensor("embed", "BF16", {1200, 1024}, 1), make_tensor("norm", "F32", {1024}, 2),
                            make_tensor("w", "F16", {333, 77}, 3)};
  write_file(dir / "model.safetensors", file_bytes(ts));
  return ts;
}

// Publishes under `profile` to a consumer in this process; returns the
// tool's JSON document.
json publish_under(const std::string& profile, const std::vector<Tensor>& want, const fs::path& ckpt) {
  const std::string name = shmcast_test::unique_name("pubsec");
  shmcast_test::RegionGuard g{name};
  Proc p = tool({kRunner, "--profile", profile, "--", kPublish, ckpt.string(), "--region", name, "--slot-mb",
                        "2", "--wait-consumers", "1", "--json"},
                       "pub");
  shmcast::ConsumerOptions co;
  co.pin = shmcast::Pin::kNo;
  co.open_timeout = 30s;
  shmcast::Consumer c = shmcast::Consumer::open(name, co);
  const shmcast::SyncInfo& info = c.wait_sync(30s);
  EXPECT_EQ(info.tensors.size(), want.size());
  std::vector<std::vector<std::uint8_t>> got(info.tensors.size());
  std::vector<void*> dst;
  for (std::size_t i = 0; i < got.size(); ++i) {
    got[i].resize(info.tensors[i].nbytes);
    dst.push_back(got[i].data());
  }
  c.read_into(dst);
  for (std::size_t i = 0; i < got.size() && i < want.size(); ++i) EXPECT_EQ(got[i], want[i].data) << want[i].name;
  EXPECT_EQ(p.wait(), 0) << p.both();
  return last_json(p);
}

}  // namespace

TEST(PublishSeccomp, DockerDefaultFallsBackToPreadWithEperm) {
  TempDir d;
  const auto want = make_checkpoint(d.path);
  const json j = publish_under(kDir + "/docker-default.json", want, d.path);
  EXPECT_EQ(j["io"].value("path", ""), "pread") << j.dump();
  EXPECT_NE(j["io"].value("fallback_reason", "").find("io_uring_setup: Operation not permitted"), std::string::npos)
      << j.dump();
}

TEST(PublishSeccomp, EnosysProfileFallsBackToPread) {
  TempDir d;
  const auto want = make_checkpoint(d.path);
  const json j = publish_under(kDir + "/no-uring-enosys.json", want, d.path);
  EXPECT_EQ(j["io"].value("path", ""), "pread") << j.dump();
  EXPECT_NE(j["io"].value("fallback_reason", "").find("io_uring_setup: Function not implemented"), std::string::npos)
      << j.dump();
}

TEST(PublishSeccomp, ForcingIoUringUnderDockerDefaultSaysWhatToDo) {
  TempDir d;
  make_checkpoint(d.path);
  const std::string name = shmcast_test::unique_name("pubsecf");
  shmcast_test::RegionGuard g{name};
  Proc p = tool({kRunner, "--profile", kDir + "/docker-default.json", "--", kPublish, d.path.string(),
                        "--region", name, "--io", "buffered", "--json"},
                       "force");
  EXPECT_EQ(p.wait(), 1) << p.both();
  const json j = last_json(p);
  EXPECT_NE(j.value("error", "").find("io_uring is not available"), std::string::npos) << p.both();
  EXPECT_NE(j.value("error", "").find("--io pread"), std::string::npos) << p.both();
}

TEST(PublishSeccomp, WithoutAFilterIoUringIsUsed) {
  TempDir d;
  const auto want = make_checkpoint(d.path);
  const json j = publish_under("builtin:none", want, d.path);
  const std::string why = j["io"].value("fallback_reason", "");
  if (j["io"].value("path", "") == "pread" && why.find("io_uring_setup") != std::string::npos)
    GTEST_SKIP() << "this host denies io_uring itself: " << why;
  EXPECT_NE(j["io"].value("path", ""), "pread") << j.dump();
}
