// Tests for shmcast-seccomp-run and shmcast_test::apply_docker_profile.
//
// Every test starts its own processes (fork/exec of the runner, which execs
// seccomp_probe), so a filter never lands on the test program itself.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "seccomp_profile.hpp"

namespace {

using namespace std::chrono_literals;

const std::string kRunner = SHMCAST_SECCOMP_RUN;
const std::string kProbe = SHMCAST_SECCOMP_PROBE;
const std::string kDockerDefault =
    std::string(SHMCAST_SECCOMP_PROFILE_DIR) + "/docker-default.json";
const std::string kNoPidfd = std::string(SHMCAST_SECCOMP_PROFILE_DIR) + "/no-pidfd.json";
const std::string kSharedDockerDefault =
    std::string(SHMCAST_SHARED_SECCOMP_DIR) + "/docker-default.json";
const std::string kNone = shmcast_test::kBuiltinNoneProfile;

// Safety net against a hung child; ctest's TIMEOUT 60 is the outer one.
constexpr auto kChildDeadline = 30s;

// ------------------------------------------------------------ processes --

struct RunResult {
  int exit_code = -1;  // when exited normally
  int signal = 0;      // when killed by a signal
  bool timed_out = false;
  std::string out;
  std::string err;
};

std::string describe(const RunResult& r) {
  std::ostringstream os;
  if (r.timed_out) os << "timed out; ";
  if (r.signal != 0)
    os << "killed by signal " << r.signal << "; ";
  else
    os << "exit " << r.exit_code << "; ";
  os << "stdout: [" << r.out << "] stderr: [" << r.err << "]";
  return os.str();
}

[[noreturn]] void exec_child(const std::vector<std::string>& argv, int out_fd, int err_fd) {
  dup2(out_fd, STDOUT_FILENO);
  dup2(err_fd, STDERR_FILENO);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  execv(args[0], args.data());
  const char msg[] = "test_seccomp_runner: execv failed\n";
  (void)!write(STDERR_FILENO, msg, sizeof msg - 1);
  _exit(250);
}

// Reads both pipes until EOF or the deadline.  Returns false on timeout.
bool drain(int out_fd, int err_fd, RunResult& r) {
  const auto deadline = std::chrono::steady_clock::now() + kChildDeadline;
  std::array<pollfd, 2> fds{{{out_fd, POLLIN, 0}, {err_fd, POLLIN, 0}}};
  std::array<std::string*, 2> sinks{&r.out, &r.err};
  int open_fds = 2;
  while (open_fds > 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left <= 0ms) return false;
    const int n = poll(fds.data(), fds.size(), static_cast<int>(left.count()));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return false;
    for (std::size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      char buf[4096];
      const ssize_t got = read(fds[i].fd, buf, sizeof buf);
      if (got > 0) {
        sinks[i]->append(buf, static_cast<std::size_t>(got));
      } else if (got == 0 || errno != EINTR) {
        fds[i].fd = -1;
        --open_fds;
      }
    }
  }
  return true;
}

RunResult run(const std::vector<std::string>& argv) {
  RunResult r;
  int out[2], err[2];
  if (pipe2(out, O_CLOEXEC) != 0 || pipe2(err, O_CLOEXEC) != 0) {
    r.err = std::string("pipe2: ") + std::strerror(errno);
    return r;
  }
  const pid_t pid = fork();
  if (pid == 0) exec_child(argv, out[1], err[1]);
  close(out[1]);
  close(err[1]);
  if (pid < 0) {
    r.err = std::string("fork: ") + std::strerror(errno);
  } else {
    r.timed_out = !drain(out[0], err[0], r);
    if (r.timed_out) kill(pid, SIGKILL);
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
    if (WIFSIGNALED(status)) r.signal = WTERMSIG(status);
  }
  close(out[0]);
  close(err[0]);
  return r;
}

std::vector<std::string> runner_args(const std::string& profile,
                                     const std::vector<std::string>& extra = {}) {
  std::vector<std::string> argv{kRunner, "--profile", profile};
  argv.insert(argv.end(), extra.begin(), extra.end());
  argv.push_back("--");
  return argv;
}

RunResult run_probe(const std::string& profile, const std::string& probe,
                    const std::vector<std::string>& extra = {}) {
  std::vector<std::string> argv = runner_args(profile, extra);
  argv.push_back(kProbe);
  argv.push_back(probe);
  return run(argv);
}

// "ok", an errno name such as "EPERM", or a description of what went wrong.
std::string outcome(const RunResult& r) {
  const std::string& o = r.out;
  if (r.exit_code == 0 && o.find("result=ok") != std::string::npos) return "ok";
  const auto at = o.find("errno=");
  if (at != std::string::npos && r.signal == 0) {
    return o.substr(at + 6, o.find(' ', at) - (at + 6));
  }
  return "unexpected: " + describe(r);
}

std::string probe_outcome(const std::string& profile, const std::string& probe,
                          const std::vector<std::string>& extra = {}) {
  return outcome(run_probe(profile, probe, extra));
}

// Why `probe` cannot show its unfiltered behaviour here, if it cannot: the
// kernel lacks the syscall, or this process already runs under a seccomp
// filter (e.g. CI inside a container) that denies it.
std::optional<std::string> host_blocks(const std::string& probe) {
  const std::string unfiltered = probe_outcome(kNone, probe);
  if (unfiltered == "ENOSYS")
    return probe + ": ENOSYS unfiltered (kernel lacks it, or an outer filter)";
  if (unfiltered != "EPERM") return std::nullopt;
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.starts_with("Seccomp:") && line.find('0') == std::string::npos)
      return probe + ": denied by a seccomp filter this test already runs under";
  }
  return std::nullopt;
}

#define SKIP_IF_HOST_BLOCKS(probe)                           \
  do {                                                       \
    if (auto why = host_blocks(probe)) GTEST_SKIP() << *why; \
  } while (0)

// ------------------------------------------------------------ files --

std::optional<std::string> slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  return std::string(std::istreambuf_iterator<char>(in), {});
}

class TempFile {
 public:
  explicit TempFile(const std::string& content) {
    const char* dir = std::getenv("TMPDIR");
    path_ =
        std::string(dir != nullptr && *dir != '\0' ? dir : "/tmp") + "/shmcast-seccomp-XXXXXX.json";
    const int fd = mkstemps(path_.data(), 5);
    if (fd < 0) throw std::runtime_error("mkstemps: " + std::string(std::strerror(errno)));
    const bool ok =
        write(fd, content.data(), content.size()) == static_cast<ssize_t>(content.size());
    close(fd);
    if (!ok) throw std::runtime_error("cannot write " + path_);
  }
  ~TempFile() { unlink(path_.c_str()); }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// ============================================================== profiles ==

TEST(SeccompProfiles, RepoDockerDefaultMatchesSharedCopy) {
  const auto repo = slurp(kDockerDefault);
  ASSERT_TRUE(repo.has_value()) << "cannot read " << kDockerDefault;
  const auto shared = slurp(kSharedDockerDefault);
  if (!shared) GTEST_SKIP() << "no shared copy at " << kSharedDockerDefault;
  EXPECT_TRUE(*repo == *shared) << kDockerDefault << " differs from " << kSharedDockerDefault;
}

// ======================================================== docker-default ==

TEST(DockerDefault, PidfdGetfdFailsWithEperm) {
  EXPECT_EQ(probe_outcome(kDockerDefault, "pidfd_getfd"), "EPERM");
}

TEST(DockerDefault, IoUringSetupFailsWithEperm) {
  EXPECT_EQ(probe_outcome(kDockerDefault, "io_uring_setup"), "EPERM");
}

TEST(DockerDefault, Clone3FailsWithEnosys) {
  EXPECT_EQ(probe_outcome(kDockerDefault, "clone3"), "ENOSYS");
}

TEST(DockerDefault, VsockSocketFailsWithEperm) {
  EXPECT_EQ(probe_outcome(kDockerDefault, "socket_vsock"), "EPERM");
}

// The profile's minKernel 4.8 entry allows process_vm_readv/writev and
// ptrace without CAP_SYS_PTRACE (the CAP_SYS_PTRACE entry adds nothing for
// them on such kernels).
TEST(DockerDefault, ProcessVmReadvAllowedWithoutCaps) {
  SKIP_IF_HOST_BLOCKS("process_vm_readv");
  EXPECT_EQ(probe_outcome(kDockerDefault, "process_vm_readv"), "ok");
}

TEST(DockerDefault, CapSysPtraceLetsPidfdGetfdThroughFilter) {
  SKIP_IF_HOST_BLOCKS("pidfd_getfd");
  // Allowed by the filter, pidfd_getfd(-1, ...) fails in the kernel: EBADF.
  EXPECT_EQ(probe_outcome(kDockerDefault, "pidfd_getfd", {"--caps", "CAP_SYS_PTRACE"}), "EBADF");
}

TEST(DockerDefault, PrintSummaryReportsAppliedAndSkippedRules) {
  const RunResult r = run_probe(kDockerDefault, "futex", {"--print-summary"});
  ASSERT_EQ(outcome(r), "ok");
  EXPECT_TRUE(contains(r.err, "rule entries:")) << r.err;
  EXPECT_TRUE(contains(r.err, " applied, ")) << r.err;
  EXPECT_TRUE(contains(r.err, "need a capability not held")) << r.err;
  EXPECT_TRUE(contains(r.err, "unknown to this libseccomp")) << r.err;
}

class DockerDefaultAllows : public testing::TestWithParam<const char*> {};

TEST_P(DockerDefaultAllows, SyscallSucceeds) {
  EXPECT_EQ(probe_outcome(kDockerDefault, GetParam()), "ok");
}

INSTANTIATE_TEST_SUITE_P(Syscalls, DockerDefaultAllows,
                         testing::Values("futex", "mmap", "memfd_create", "fallocate", "ftruncate",
                                         "openat", "eventfd2", "socket_unix"),
                         [](const auto& p) { return std::string(p.param); });

// ============================================================= no-pidfd ==

TEST(NoPidfd, PidfdOpenFailsWithEperm) {
  EXPECT_EQ(probe_outcome(kNoPidfd, "pidfd_open"), "EPERM");
}

TEST(NoPidfd, PidfdGetfdFailsWithEperm) {
  EXPECT_EQ(probe_outcome(kNoPidfd, "pidfd_getfd"), "EPERM");
}

// Everything else behaves exactly as with no filter at all.
class NoPidfdOthers : public testing::TestWithParam<const char*> {};

TEST_P(NoPidfdOthers, SameAsWithoutFilter) {
  const std::string unfiltered = probe_outcome(kNone, GetParam());
  ASSERT_FALSE(contains(unfiltered, "unexpected")) << unfiltered;
  EXPECT_EQ(probe_outcome(kNoPidfd, GetParam()), unfiltered);
}

INSTANTIATE_TEST_SUITE_P(Syscalls, NoPidfdOthers,
                         testing::Values("futex", "mmap", "memfd_create", "fallocate", "ftruncate",
                                         "openat", "eventfd2", "socket_unix", "socket_vsock",
                                         "io_uring_setup", "clone3", "process_vm_readv"),
                         [](const auto& p) { return std::string(p.param); });

// ========================================================= builtin:none ==

TEST(BuiltinNone, PidfdOpenSucceeds) {
  SKIP_IF_HOST_BLOCKS("pidfd_open");
  EXPECT_EQ(probe_outcome(kNone, "pidfd_open"), "ok");
}

TEST(BuiltinNone, PidfdGetfdOnInvalidPidfdIsEbadf) {
  SKIP_IF_HOST_BLOCKS("pidfd_getfd");
  EXPECT_EQ(probe_outcome(kNone, "pidfd_getfd"), "EBADF");
}

TEST(BuiltinNone, Clone3WithNullArgsIsEinval) {
  SKIP_IF_HOST_BLOCKS("clone3");
  EXPECT_EQ(probe_outcome(kNone, "clone3"), "EINVAL");
}

// =============================================================== errors ==

TEST(RunnerErrors, MalformedProfileExits125WithMessage) {
  TempFile bad("{ \"defaultAction\": \"SCMP_ACT_ALLOW\", \"syscalls\": [ ");
  const RunResult r = run_probe(bad.path(), "futex");
  EXPECT_EQ(r.exit_code, 125) << describe(r);
  EXPECT_TRUE(contains(r.err, "invalid JSON")) << r.err;
  EXPECT_TRUE(contains(r.err, bad.path())) << r.err;
  EXPECT_TRUE(r.out.empty()) << "the command must not run: " << r.out;
}

TEST(RunnerErrors, UnknownActionExits125WithMessage) {
  TempFile bad(R"({"defaultAction": "SCMP_ACT_ALLOW",
                  "syscalls": [{"names": ["getpid"], "action": "SCMP_ACT_MAYBE"}]})");
  const RunResult r = run_probe(bad.path(), "futex");
  EXPECT_EQ(r.exit_code, 125) << describe(r);
  EXPECT_TRUE(contains(r.err, "syscalls[0]: unknown action \"SCMP_ACT_MAYBE\"")) << r.err;
}

TEST(RunnerErrors, MissingProfileFileExits125) {
  const RunResult r = run_probe("/nonexistent/profile.json", "futex");
  EXPECT_EQ(r.exit_code, 125) << describe(r);
  EXPECT_TRUE(contains(r.err, "No such file or directory")) << r.err;
}

TEST(RunnerErrors, MissingCommandExits125) {
  const RunResult r = run(runner_args(kNone));
  EXPECT_EQ(r.exit_code, 125) << describe(r);
  EXPECT_TRUE(contains(r.err, "no command")) << r.err;
}

TEST(RunnerErrors, UnknownOptionExits125) {
  const RunResult r = run({kRunner, "--profile", kNone, "--bogus", "--", kProbe, "futex"});
  EXPECT_EQ(r.exit_code, 125) << describe(r);
  EXPECT_TRUE(contains(r.err, "unknown option --bogus")) << r.err;
}

TEST(RunnerErrors, CommandNotFoundExits127) {
  std::vector<std::string> argv = runner_args(kDockerDefault);
  argv.push_back("/nonexistent/command");
  const RunResult r = run(argv);
  EXPECT_EQ(r.exit_code, 127) << describe(r);
  EXPECT_TRUE(contains(r.err, "cannot execute /nonexistent/command")) << r.err;
}

TEST(RunnerErrors, CommandExitStatusIsPassedThrough) {
  // Under no-pidfd.json pidfd_open fails with EPERM: the probe exits 1.
  const RunResult r = run_probe(kNoPidfd, "pidfd_open");
  EXPECT_EQ(r.exit_code, EPERM) << describe(r);
}

TEST(RunnerProfiles, UnknownSyscallNamesAreSkippedAndCounted) {
  TempFile profile(R"({"defaultAction": "SCMP_ACT_ALLOW",
                      "syscalls": [{"names": ["no_such_syscall_xyz", "pidfd_open"],
                                    "action": "SCMP_ACT_ERRNO", "errnoRet": 13}]})");
  const RunResult r = run_probe(profile.path(), "pidfd_open", {"--print-summary"});
  EXPECT_EQ(outcome(r), "EACCES");
  EXPECT_TRUE(contains(r.err, "1 unknown to this libseccomp and skipped: no_such_syscall_xyz"))
      << r.err;
}

TEST(RunnerProfiles, NotifyActionIsTreatedAsEperm) {
  TempFile profile(R"({"defaultAction": "SCMP_ACT_ALLOW",
                      "syscalls": [{"names": ["pidfd_open"], "action": "SCMP_ACT_NOTIFY"}]})");
  const RunResult r = run_probe(profile.path(), "pidfd_open", {"--print-summary"});
  EXPECT_EQ(outcome(r), "EPERM");
  EXPECT_TRUE(contains(r.err, "SCMP_ACT_NOTIFY")) << r.err;
}

// ============================================== apply_docker_profile() ==

// Runs `body` in a forked child and returns its exit status (or -signal).
template <typename F>
int in_child(F body) {
  const pid_t pid = fork();
  if (pid == 0) _exit(body());
  if (pid < 0) return -1000;
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
}

TEST(ApplyDockerProfile, FiltersTheCallingProcess) {
  const int rc = in_child([] {
    std::string err;
    if (shmcast_test::apply_docker_profile(kNoPidfd, {}, &err) != 0) return 10;
    errno = 0;
    const long fd = syscall(SYS_pidfd_open, getpid(), 0);
    return (fd == -1 && errno == EPERM) ? 0 : 11;
  });
  EXPECT_EQ(rc, 0) << "10: apply failed, 11: pidfd_open was not denied with EPERM";
}

TEST(ApplyDockerProfile, CapsArgumentIsHonoured) {
  SKIP_IF_HOST_BLOCKS("pidfd_getfd");
  const int rc = in_child([] {
    std::string err;
    if (shmcast_test::apply_docker_profile(kDockerDefault, {"sys_ptrace"}, &err) != 0) return 10;
    errno = 0;
    const long fd = syscall(SYS_pidfd_getfd, -1, 0, 0);
    return (fd == -1 && errno == EBADF) ? 0 : 11;
  });
  EXPECT_EQ(rc, 0) << "10: apply failed, 11: pidfd_getfd(-1) did not fail with EBADF";
}

TEST(ApplyDockerProfile, MalformedProfileReturnsEinval) {
  TempFile bad("[1, 2, 3]");
  const int rc = in_child([&] {
    std::string err;
    const int r = shmcast_test::apply_docker_profile(bad.path(), {}, &err);
    return (r == -EINVAL && contains(err, "top level must be a JSON object")) ? 0 : 1;
  });
  EXPECT_EQ(rc, 0);
}

TEST(ApplyDockerProfile, MissingFileReturnsEnoent) {
  std::string err;
  EXPECT_EQ(shmcast_test::apply_docker_profile("/nonexistent/p.json", {}, &err), -ENOENT);
  EXPECT_TRUE(contains(err, "/nonexistent/p.json")) << err;
}

TEST(ApplyDockerProfile, BuiltinNoneInstallsNothing) {
  std::string err;
  EXPECT_EQ(shmcast_test::apply_docker_profile(kNone, {}, &err), 0) << err;
}

}  // namespace
