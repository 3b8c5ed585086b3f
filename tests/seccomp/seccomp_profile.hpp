// Private test helper: apply a Docker-format seccomp profile to the calling
// process, the way `docker run` (moby + runc) would for a container holding
// no extra capabilities, or only the ones named.
//
// Typical use in a gtest program: fork(), then in the child
//   std::string err;
//   if (shmcast_test::apply_docker_profile(path, {}, &err) != 0) _exit(126);
// and run the code under test.  The filter is permanent for the calling
// process and everything it execs; it is never removed.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace shmcast_test {

// The profile value that means "no filter at all" (a control run, like
// `docker run --security-opt seccomp=unconfined`).
inline constexpr const char* kBuiltinNoneProfile = "builtin:none";

// What apply_docker_profile did; filled as far as it got, also on failure.
struct ProfileReport {
  enum class Stage {
    ok,       // filter installed (or builtin:none)
    profile,  // reading, parsing or validating the profile failed
    install,  // building the filter with libseccomp or loading it failed
  };
  Stage stage = Stage::ok;

  std::string native_arch;                 // Docker name, e.g. "amd64"
  std::vector<std::string> filter_arches;  // SCMP_ARCH_* names in the filter
  std::string default_action;              // e.g. "SCMP_ACT_ERRNO(1)"
  std::string kernel_release;              // uname -r
  std::vector<std::string> caps;           // capabilities treated as held

  // Entries of `syscalls[]`.
  std::size_t entries_total = 0;
  std::size_t entries_applied = 0;
  std::size_t skipped_caps_missing = 0;  // includes.caps not all held
  std::size_t skipped_caps_held = 0;     // excludes.caps has a held cap
  std::size_t skipped_arch = 0;          // includes/excludes.arches
  std::size_t skipped_kernel = 0;        // includes/excludes.minKernel
  std::size_t skipped_default = 0;       // action equals defaultAction

  // Syscall names inside the applied entries.
  std::size_t names_native = 0;   // rule added for the native arch
  std::size_t names_foreign = 0;  // only exists on another (sub-)arch
  std::size_t names_unknown = 0;  // unknown to this libseccomp version
  std::vector<std::string> unknown_names;
  std::size_t libseccomp_rules = 0;  // seccomp_rule_add calls that succeeded

  std::vector<std::string> notes;  // e.g. NOTIFY treated as ERRNO(EPERM)

  std::size_t entries_skipped() const {
    return skipped_caps_missing + skipped_caps_held + skipped_arch + skipped_kernel +
           skipped_default;
  }
};

// Reads the Docker-format seccomp profile at `path`, builds a libseccomp
// filter for a container holding only `caps` (e.g. {"CAP_SYS_PTRACE"}; the
// "CAP_" prefix is optional, case is ignored, "ALL" means every capability),
// sets no_new_privs and loads the filter into the calling process.
// `path` may be "builtin:none": nothing is installed.
// Returns 0, or -errno (-EINVAL for a malformed profile); `*err` (if not
// null) then holds a one-line explanation.
int apply_docker_profile(const std::string& path, const std::vector<std::string>& caps,
                         std::string* err);

// Same, and fills `*report` (if not null) with what was applied or skipped.
int apply_docker_profile(const std::string& path, const std::vector<std::string>& caps,
                         std::string* err, ProfileReport* report);

// Multi-line, human-readable summary of `report` (each line ends in '\n').
std::string format_report(const ProfileReport& report);

}  // namespace shmcast_test
