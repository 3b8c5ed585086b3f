// Another uid plants links where a root relay writes its status file
// (issue 27, item 4). The relay keeps <dir>/shmcast-relay.<R>.json in the
// region directory, which on a shared volume without the sticky bit any
// local user can write. Before the fix the relay wrote
// std::ofstream(<status>.tmp) and chmod()ed it, both through whatever sat at
// that name: uid 65534 planted shmcast-relay.R.json.tmp -> a root file, and
// the relay truncated it, wrote its JSON into it and made it 0600.
//
// Here uid 65534 (setpriv --reuid=65534) plants both names as links to a
// root-owned file; a root shmcast-relay runs and rewrites its status a few
// times; the root file must be untouched (bytes, mode, owner), and the
// status file a regular root file of mode 0600 holding the relay's JSON.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Runs argv (fork/exec) with `env` added; exit code, 128+signal, -1 on timeout.
pid_t start(const std::vector<std::string>& argv, const std::vector<std::pair<std::string, std::string>>& env,
            const std::string& log) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    if (fd >= 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
    }
    for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execvp(args[0], args.data());
    ::_exit(127);
  }
  return pid;
}

int finish(pid_t pid, std::chrono::seconds timeout) {
  int status = 0;
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    if (::waitpid(pid, &status, WNOHANG) == pid)
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    std::this_thread::sleep_for(5ms);
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &status, 0);
  return -1;
}

bool have_setpriv() { return ::access("/usr/bin/setpriv", X_OK) == 0 || ::access("/bin/setpriv", X_OK) == 0; }

// As uid/gid 65534, no supplementary groups: ln -s target link.
int plant_link_as_nobody(const std::string& target, const std::string& link, const std::string& log) {
  return finish(start({"setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "ln", "-s", target, link}, {},
                      log),
                30s);
}

}  // namespace

TEST(RelayStatus, LinksAnotherUidPlantsAreNeverWrittenThrough) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root (a root relay, and setpriv to uid 65534)";
  if (!have_setpriv()) GTEST_SKIP() << "needs setpriv (util-linux)";
  const fs::path root = fs::temp_directory_path() / ("shmcast-relay-status-" + std::to_string(::getpid()));
  fs::remove_all(root);
  fs::create_directories(root / "private");
  const fs::path shared = root / "shared";  // a region directory on a volume without the sticky bit
  fs::create_directories(shared);
  ASSERT_EQ(::chmod(root.c_str(), 0755), 0);
  ASSERT_EQ(::chmod(shared.c_str(), 0777), 0);
  const std::string region = "R";
  const std::string status = (shared / ("shmcast-relay." + region + ".json")).string();
  const std::string precious = (root / "private" / "precious").string();
  const std::string content = "root's file: not the relay's to write\n";
  std::ofstream(precious) << content;
  ASSERT_EQ(::chmod(precious.c_str(), 0644), 0);
  const std::string log = (root / "private" / "test.log").string();

  ASSERT_EQ(plant_link_as_nobody(precious, status + ".tmp", log), 0) << slurp(log);
  ASSERT_EQ(plant_link_as_nobody(precious, status, log), 0) << slurp(log);
  struct stat planted {};
  ASSERT_EQ(::lstat((status + ".tmp").c_str(), &planted), 0);
  ASSERT_TRUE(S_ISLNK(planted.st_mode));
  ASSERT_EQ(planted.st_uid, 65534u);

  const pid_t relay = start({SHMCAST_RELAY_BIN, region, "--listen", "127.0.0.1:0"},
                            {{"SHMCAST_DIR", shared.string()},
                             {"SHMCAST_RELAY_KEY", "relay-test-key-0123456789abcdef"},
                             {"UCX_TLS", "tcp"},
                             {"UCX_NET_DEVICES", "lo"},
                             {"UCX_WARN_UNUSED_ENV_VARS", "n"},
                             {"UCX_MEM_EVENTS", "no"}},
                            (root / "private" / "relay.log").string());
  ASSERT_GT(relay, 0);
  // The relay rewrites its status every second: wait for three versions of
  // it (updated_unix_ns), or for the root file to change.
  std::set<std::uint64_t> seen;
  const auto end = std::chrono::steady_clock::now() + 60s;
  while (seen.size() < 3 && std::chrono::steady_clock::now() < end && slurp(precious) == content) {
    struct stat st {};
    if (::lstat(status.c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
      try {
        seen.insert(nlohmann::json::parse(slurp(status)).at("updated_unix_ns").get<std::uint64_t>());
      } catch (const std::exception&) {
      }
    }
    std::this_thread::sleep_for(20ms);
  }
  ::kill(relay, SIGTERM);
  const int rc = finish(relay, 30s);

  // The root file: same bytes, mode and owner.
  struct stat p {};
  ASSERT_EQ(::stat(precious.c_str(), &p), 0);
  EXPECT_EQ(slurp(precious), content) << "the relay wrote through a link uid 65534 planted";
  EXPECT_EQ(p.st_mode & 07777, 0644u) << "the relay chmodded a root file through a planted link";
  EXPECT_EQ(p.st_uid, 0u);
  // The status file: the relay's own, a regular file, 0600, its JSON.
  struct stat s {};
  ASSERT_EQ(::lstat(status.c_str(), &s), 0);
  EXPECT_TRUE(S_ISREG(s.st_mode)) << "the status name is still the planted link";
  EXPECT_EQ(s.st_uid, 0u);
  EXPECT_EQ(s.st_mode & 07777, 0600u);
  EXPECT_GE(seen.size(), 3u) << "the relay did not keep its status file up to date";
  try {
    EXPECT_EQ(nlohmann::json::parse(slurp(status)).at("region"), region);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "status file: " << e.what();
  }
  // The planted .tmp link is left as it was (not the relay's name), and the
  // relay left no temporary file of its own behind.
  struct stat t {};
  ASSERT_EQ(::lstat((status + ".tmp").c_str(), &t), 0);
  EXPECT_TRUE(S_ISLNK(t.st_mode));
  for (const auto& e : fs::directory_iterator(shared)) {
    const std::string n = e.path().filename().string();
    EXPECT_TRUE(n == "shmcast-relay.R.json" || n == "shmcast-relay.R.json.tmp") << "left behind: " << n;
  }
  EXPECT_EQ(rc, 0) << slurp((root / "private" / "relay.log").string());
  if (::testing::Test::HasFailure()) std::fprintf(stderr, "relay log:\n%s", slurp((root / "private" / "relay.log").string()).c_str());
  fs::remove_all(root);
}
