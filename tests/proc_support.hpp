// A real child process for the tests that run shmcast's programs (the
// relay, shmcast-publish, the seccomp runner, the fd-channel peer): argv[0]
// exec'd (searched in PATH) with its output in files, waited for with a
// deadline, killed at scope exit if it still runs. One definition for every
// tier that spawns programs (tests/relay, tests/seccomp, tests/fileio,
// tests/fdchan_support.hpp); the forked-function children of support.hpp
// (`Child`) are the other kind.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace shmcast_test {

inline std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

struct Proc {
  // Where the output goes and what the child gets.
  struct Io {
    std::string log{};  // stdout, and stderr too when `err` is empty
    std::string err{};
    bool append = false;  // O_APPEND instead of O_TRUNC (one log for several runs)
    std::map<std::string, std::string> env{};  // set; an empty value unsets
    rlim_t nofile_soft = 0;  // > 0: the child's soft RLIMIT_NOFILE (as a login shell's usual 1024)
    bool remove_logs = false;  // the log files are removed with the Proc
    std::chrono::milliseconds wait_default{std::chrono::seconds(60)};  // wait() without a timeout
  };

  pid_t pid = -1;
  int status = 0;
  bool done = false;
  std::string log, err;
  bool remove_logs = false;
  std::chrono::milliseconds wait_default{std::chrono::seconds(60)};

  static Proc start(const std::vector<std::string>& argv, const Io& io) {
    Proc p;
    p.log = io.log;
    p.err = io.err;
    p.remove_logs = io.remove_logs;
    p.wait_default = io.wait_default;
    p.pid = ::fork();
    if (p.pid == 0) {
      if (rlimit rl{}; io.nofile_soft > 0 && ::getrlimit(RLIMIT_NOFILE, &rl) == 0) {
        rl.rlim_cur = std::min(io.nofile_soft, rl.rlim_max);
        ::setrlimit(RLIMIT_NOFILE, &rl);
      }
      const int flags = O_WRONLY | O_CREAT | O_CLOEXEC | (io.append ? O_APPEND : O_TRUNC);
      const int o = ::open(io.log.c_str(), flags, 0600);
      const int e = io.err.empty() ? o : ::open(io.err.c_str(), flags, 0600);
      ::dup2(o, 1);
      ::dup2(e, 2);
      for (const auto& [k, v] : io.env) {
        if (v.empty()) ::unsetenv(k.c_str());
        else ::setenv(k.c_str(), v.c_str(), 1);
      }
      std::vector<char*> args;
      for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      ::execvp(args[0], args.data());
      ::_exit(127);
    }
    return p;
  }
  static Proc start(const std::vector<std::string>& argv, const std::string& log) {
    return start(argv, Io{.log = log});
  }

  Proc() = default;
  Proc(Proc&& o) noexcept
      : pid(o.pid), status(o.status), done(o.done), log(std::move(o.log)), err(std::move(o.err)),
        remove_logs(o.remove_logs), wait_default(o.wait_default) {
    o.pid = -1;
    o.remove_logs = false;
  }
  Proc& operator=(Proc&&) = delete;

  // Exit code, 128 + signal, or -1 when it did not end within `timeout`
  // (then it is killed).
  int wait() { return wait(wait_default); }
  int wait(std::chrono::milliseconds timeout) {
    if (pid <= 0) return -1;  // never started (fork failed): nothing to reap
    const auto end = std::chrono::steady_clock::now() + timeout;
    while (!done && std::chrono::steady_clock::now() < end) {
      if (::waitpid(pid, &status, WNOHANG) == pid) done = true;
      else std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    if (!done) {
      kill9();
      return -1;
    }
    return code();
  }
  bool running() {
    if (done || pid <= 0) return false;
    if (::waitpid(pid, &status, WNOHANG) == pid) done = true;
    return !done;
  }
  void signal(int sig) const {
    if (pid > 0 && !done) ::kill(pid, sig);
  }
  void kill9() {
    if (pid > 0 && !done) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      done = true;
    }
  }
  // SIGTERM, then the exit code as wait() gives it.
  int term(std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
    if (done) return code();
    signal(SIGTERM);
    return wait(timeout);
  }
  // Handshake: waits until stderr holds `needle` (false at the deadline, or
  // once the process ended without writing it).
  bool wait_stderr(const std::string& needle, std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
    const auto end = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < end) {
      if (stderr_text().find(needle) != std::string::npos) return true;
      if (!running()) return stderr_text().find(needle) != std::string::npos;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return false;
  }

  std::string output() const { return slurp(log); }
  std::string stdout_text() const { return slurp(log); }
  std::string stderr_text() const { return slurp(err.empty() ? log : err); }
  std::string both() const { return "stdout: " + stdout_text() + "\nstderr: " + stderr_text(); }

  ~Proc() {
    kill9();
    if (remove_logs) {
      ::unlink(log.c_str());
      if (!err.empty()) ::unlink(err.c_str());
    }
  }

 private:
  int code() const { return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status); }
};

}  // namespace shmcast_test
