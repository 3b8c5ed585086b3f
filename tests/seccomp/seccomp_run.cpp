// shmcast-seccomp-run: run a command under a Docker-format seccomp profile,
// emulating a container that holds no capabilities (or only --caps ones).
//
//   shmcast-seccomp-run --profile FILE.json [--caps CAP_A,CAP_B]
//                       [--print-summary] -- CMD ARGS...
//
// Exit codes, as with `docker run`: 125 bad usage or profile, 126 the filter
// cannot be installed, 127 the command cannot be executed; otherwise the
// command's own exit status.
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "seccomp_profile.hpp"

namespace {

constexpr int kExitUsage = 125;
constexpr int kExitInstall = 126;
constexpr int kExitExec = 127;
constexpr const char* kProg = "shmcast-seccomp-run";

struct Options {
  std::string profile;
  std::vector<std::string> caps;
  bool print_summary = false;
  bool help = false;
  std::vector<std::string> command;
};

void print_usage(FILE* out) {
  std::fprintf(out,
               "usage: %s --profile FILE.json|builtin:none [--caps CAP_A,CAP_B]\n"
               "       %*s [--print-summary] -- CMD ARGS...\n"
               "Runs CMD under a Docker-format seccomp profile, as in a container\n"
               "holding no capabilities except those given with --caps.\n"
               "Exit codes: 125 bad usage/profile, 126 cannot install filter,\n"
               "127 cannot execute CMD, else CMD's exit status.\n",
               kProg, static_cast<int>(std::strlen(kProg)), "");
}

[[noreturn]] void usage_error(const std::string& msg) {
  std::fprintf(stderr, "%s: error: %s\n", kProg, msg.c_str());
  print_usage(stderr);
  std::exit(kExitUsage);
}

void add_caps(const std::string& list, Options& o) {
  std::stringstream ss(list);
  std::string cap;
  while (std::getline(ss, cap, ',')) {
    if (cap.empty()) usage_error("--caps: empty capability name in \"" + list + "\"");
    o.caps.push_back(cap);
  }
}

// Returns the value of "--name VALUE" or "--name=VALUE" at argv[i], advancing
// i past it; nullopt when argv[i] is not this option.
std::optional<std::string> option_value(std::string_view name, int argc, char** argv, int& i) {
  const std::string_view arg = argv[i];
  if (arg.starts_with(name) && arg.size() > name.size() && arg[name.size()] == '=')
    return std::string(arg.substr(name.size() + 1));
  if (arg != name) return std::nullopt;
  if (i + 1 >= argc || std::string_view(argv[i + 1]) == "--")
    usage_error(std::string(name) + " needs a value");
  return std::string(argv[++i]);
}

Options parse_args(int argc, char** argv) {
  Options o;
  int i = 1;
  for (; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (auto v = option_value("--profile", argc, argv, i)) {
      o.profile = *v;
    } else if (auto c = option_value("--caps", argc, argv, i)) {
      add_caps(*c, o);
    } else if (arg == "--print-summary") {
      o.print_summary = true;
    } else if (arg == "-h" || arg == "--help") {
      o.help = true;
      return o;
    } else if (arg.starts_with("-")) {
      usage_error("unknown option " + std::string(arg));
    } else {
      break;  // the command starts here
    }
  }
  o.command.assign(argv + i, argv + argc);
  if (o.profile.empty()) usage_error("--profile is required");
  if (o.command.empty()) usage_error("no command given after --");
  return o;
}

void print_summary(const std::string& profile, const shmcast_test::ProfileReport& r) {
  std::fprintf(stderr, "%s: profile %s\n", kProg, profile.c_str());
  std::istringstream lines(shmcast_test::format_report(r));
  for (std::string line; std::getline(lines, line);) {
    std::fprintf(stderr, "%s: %s\n", kProg, line.c_str());
  }
}

[[noreturn]] void exec_command(const std::vector<std::string>& command) {
  std::vector<char*> argv;
  for (const std::string& a : command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  execvp(argv[0], argv.data());
  const int e = errno;
  std::fprintf(stderr, "%s: error: cannot execute %s: %s\n", kProg, argv[0], std::strerror(e));
  std::exit(kExitExec);
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse_args(argc, argv);
  if (o.help) {
    print_usage(stdout);
    return 0;
  }
  using Stage = shmcast_test::ProfileReport::Stage;
  shmcast_test::ProfileReport report;
  std::string err;
  const int rc = shmcast_test::apply_docker_profile(o.profile, o.caps, &err, &report);
  if (o.print_summary && report.stage != Stage::profile) print_summary(o.profile, report);
  if (rc != 0) {
    std::fprintf(stderr, "%s: error: %s\n", kProg, err.c_str());
    return report.stage == Stage::profile ? kExitUsage : kExitInstall;
  }
  exec_command(o.command);
}
