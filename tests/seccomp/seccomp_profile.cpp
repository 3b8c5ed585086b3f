// Applies a Docker-format seccomp profile with libseccomp, following the
// rules moby uses to turn the profile into a container's filter (see
// moby/profiles seccomp/seccomp_linux.go) and runc uses to load it.
#include "seccomp_profile.hpp"

#include <fcntl.h>
#include <seccomp.h>
#include <sys/prctl.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string_view>
#include <tuple>

namespace shmcast_test {
namespace {

using nlohmann::json;

// ---------------------------------------------------------------- errors --

// A malformed or unsupported profile; becomes -EINVAL / Stage::profile.
struct ProfileError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// libseccomp or the kernel refused; becomes -errno / Stage::install.
struct InstallError : std::runtime_error {
  InstallError(const std::string& what, int neg_errno) : std::runtime_error(what), rc(neg_errno) {}
  int rc;
};

std::string errno_text(int neg_errno) {
  return std::strerror(neg_errno < 0 ? -neg_errno : neg_errno);
}

// ------------------------------------------------------------ parsed form --

struct Action {
  uint32_t value = SCMP_ACT_ALLOW;
  std::string text;  // e.g. "SCMP_ACT_ERRNO(1)"
};

struct Condition {
  unsigned index = 0;
  uint64_t value = 0;
  uint64_t value_two = 0;
  scmp_compare op = SCMP_CMP_EQ;
};

struct Selector {  // `includes` or `excludes`
  std::vector<std::string> arches;
  std::vector<std::string> caps;
  std::optional<std::string> min_kernel;
};

struct Entry {
  std::string where;  // "syscalls[3]", for messages
  std::vector<std::string> names;
  Action action;
  std::vector<Condition> args;
  Selector includes;
  Selector excludes;
};

struct Profile {
  Action default_action;
  std::vector<uint32_t> arches;  // besides the native one
  std::vector<std::string> flags;
  std::vector<Entry> entries;
};

// ---------------------------------------------------------- architectures --

struct ArchName {
  uint32_t token;
  const char* docker;  // name used in includes/excludes.arches (Go style)
};

// Docker's names for native architectures (moby's nativeToSeccomp), where
// they differ from libseccomp's; "mips3l64n32" is moby's own spelling.
constexpr std::array kDockerArchNames{
    ArchName{SCMP_ARCH_X86_64, "amd64"},
    ArchName{SCMP_ARCH_X86, "x86"},
    ArchName{SCMP_ARCH_X32, "x32"},
    ArchName{SCMP_ARCH_AARCH64, "arm64"},
    ArchName{SCMP_ARCH_ARM, "arm"},
    ArchName{SCMP_ARCH_MIPSEL, "mipsle"},
    ArchName{SCMP_ARCH_MIPSEL64N32, "mips3l64n32"},
};

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string upper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

// "SCMP_ARCH_X86_64" (or "x86_64") -> token; 0 when libseccomp lacks it.
uint32_t resolve_scmp_arch(const std::string& name) {
  constexpr std::string_view prefix = "SCMP_ARCH_";
  std::string bare = name.starts_with(prefix) ? name.substr(prefix.size()) : name;
  bare = lower(bare);
  return seccomp_arch_resolve_name(bare.c_str());
}

constexpr std::array kScmpArchSuffixes{
    "X86",    "X86_64",   "X32",         "ARM",         "AARCH64", "MIPS",    "MIPS64", "MIPS64N32",
    "MIPSEL", "MIPSEL64", "MIPSEL64N32", "PPC",         "PPC64",   "PPC64LE", "S390",   "S390X",
    "PARISC", "PARISC64", "RISCV64",     "LOONGARCH64", "M68K",    "SH",      "SHEB"};

// Token -> "X86_64" (the part after SCMP_ARCH_); empty if not in the table.
std::string scmp_arch_suffix(uint32_t token) {
  for (const char* n : kScmpArchSuffixes) {
    if (resolve_scmp_arch(n) == token) return n;
  }
  return {};
}

std::string scmp_arch_label(uint32_t token) {
  const std::string suffix = scmp_arch_suffix(token);
  return suffix.empty() ? "arch-" + std::to_string(token) : "SCMP_ARCH_" + suffix;
}

std::string docker_arch_name(uint32_t token) {
  for (const auto& a : kDockerArchNames) {
    if (a.token == token) return a.docker;
  }
  const std::string suffix = scmp_arch_suffix(token);
  return suffix.empty() ? "arch-" + std::to_string(token) : lower(suffix);
}

// An entry of includes/excludes.arches names the native arch: either in
// Docker's spelling ("amd64") or as an SCMP_ARCH_* / libseccomp name.
bool arch_list_has_native(const std::vector<std::string>& arches) {
  const uint32_t native = seccomp_arch_native();
  const std::string docker = docker_arch_name(native);
  return std::any_of(arches.begin(), arches.end(), [&](const std::string& a) {
    return a == docker || resolve_scmp_arch(a) == native;
  });
}

// --------------------------------------------------------------- kernel --

using KernelVersion = std::tuple<int, int, int>;

// "6.1.0-18-amd64" -> (6,1,0); "4.8" -> (4,8,0); needs at least major.minor.
std::optional<KernelVersion> parse_kernel_version(const std::string& text) {
  int major = 0, minor = 0, patch = 0;
  if (std::sscanf(text.c_str(), "%d.%d.%d", &major, &minor, &patch) < 2) return std::nullopt;
  return KernelVersion{major, minor, patch};
}

std::string kernel_release() {
  utsname u{};
  if (uname(&u) != 0) return "0.0";
  return u.release;
}

// ----------------------------------------------------------------- caps --

std::string normalize_cap(const std::string& cap) {
  std::string c = upper(cap);
  if (c == "ALL" || c.starts_with("CAP_")) return c;
  return "CAP_" + c;
}

struct Context {
  KernelVersion kernel{0, 0, 0};
  std::set<std::string> caps;
  bool all_caps = false;

  bool holds(const std::string& cap) const {
    return all_caps || caps.count(normalize_cap(cap)) != 0;
  }
  bool kernel_at_least(const std::string& min) const {
    auto v = parse_kernel_version(min);
    return v && kernel >= *v;
  }
};

// ------------------------------------------------------------ JSON input --

const json* member(const json& obj, const char* key) {
  auto it = obj.find(key);
  return (it == obj.end() || it->is_null()) ? nullptr : &*it;
}

std::string as_string(const json& v, const std::string& where) {
  if (!v.is_string()) throw ProfileError(where + ": expected a string");
  return v.get<std::string>();
}

uint64_t as_uint(const json& v, const std::string& where) {
  if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<int64_t>() >= 0))
    throw ProfileError(where + ": expected a non-negative integer");
  return v.get<uint64_t>();
}

std::vector<std::string> string_list(const json& obj, const char* key, const std::string& where) {
  std::vector<std::string> out;
  const json* v = member(obj, key);
  if (v == nullptr) return out;
  const std::string here = where + "." + key;
  if (!v->is_array()) throw ProfileError(here + ": expected an array of strings");
  for (std::size_t i = 0; i < v->size(); ++i) {
    out.push_back(as_string((*v)[i], here + "[" + std::to_string(i) + "]"));
  }
  return out;
}

Action parse_action(const std::string& name, std::optional<uint64_t> errno_ret,
                    const std::string& where, ProfileReport& report) {
  const uint32_t ret = static_cast<uint32_t>(errno_ret.value_or(EPERM));
  if (errno_ret && *errno_ret > 0xffff)
    throw ProfileError(where + ": errnoRet " + std::to_string(*errno_ret) + " out of range");
  const std::string num = "(" + std::to_string(ret) + ")";
  if (name == "SCMP_ACT_ALLOW") return {SCMP_ACT_ALLOW, name};
  if (name == "SCMP_ACT_ERRNO") return {SCMP_ACT_ERRNO(ret), name + num};
  if (name == "SCMP_ACT_TRACE") return {SCMP_ACT_TRACE(ret), name + num};
  if (name == "SCMP_ACT_KILL" || name == "SCMP_ACT_KILL_THREAD")
    return {SCMP_ACT_KILL_THREAD, name};
  if (name == "SCMP_ACT_KILL_PROCESS") return {SCMP_ACT_KILL_PROCESS, name};
  if (name == "SCMP_ACT_TRAP") return {SCMP_ACT_TRAP, name};
  if (name == "SCMP_ACT_LOG") return {SCMP_ACT_LOG, name};
  if (name == "SCMP_ACT_NOTIFY") {
    report.notes.push_back(where +
                           ": SCMP_ACT_NOTIFY has no listener here; "
                           "treated as SCMP_ACT_ERRNO(EPERM)");
    return {SCMP_ACT_ERRNO(EPERM), "SCMP_ACT_NOTIFY->SCMP_ACT_ERRNO(1)"};
  }
  throw ProfileError(where + ": unknown action \"" + name + "\"");
}

scmp_compare parse_op(const std::string& op, const std::string& where) {
  static const std::pair<const char*, scmp_compare> ops[] = {
      {"SCMP_CMP_NE", SCMP_CMP_NE},
      {"SCMP_CMP_LT", SCMP_CMP_LT},
      {"SCMP_CMP_LE", SCMP_CMP_LE},
      {"SCMP_CMP_EQ", SCMP_CMP_EQ},
      {"SCMP_CMP_GE", SCMP_CMP_GE},
      {"SCMP_CMP_GT", SCMP_CMP_GT},
      {"SCMP_CMP_MASKED_EQ", SCMP_CMP_MASKED_EQ}};
  for (const auto& [name, value] : ops) {
    if (op == name) return value;
  }
  throw ProfileError(where + ": unknown operator \"" + op + "\"");
}

Condition parse_condition(const json& a, const std::string& where) {
  if (!a.is_object()) throw ProfileError(where + ": expected an object");
  Condition c;
  const json* index = member(a, "index");
  const json* op = member(a, "op");
  if (index == nullptr || op == nullptr) throw ProfileError(where + ": needs \"index\" and \"op\"");
  const uint64_t idx = as_uint(*index, where + ".index");
  if (idx > 5) throw ProfileError(where + ".index: " + std::to_string(idx) + " is not 0..5");
  c.index = static_cast<unsigned>(idx);
  c.op = parse_op(as_string(*op, where + ".op"), where + ".op");
  if (const json* v = member(a, "value")) c.value = as_uint(*v, where + ".value");
  if (const json* v = member(a, "valueTwo")) c.value_two = as_uint(*v, where + ".valueTwo");
  return c;
}

Selector parse_selector(const json& entry, const char* key, const std::string& where) {
  Selector s;
  const json* v = member(entry, key);
  if (v == nullptr) return s;
  const std::string here = where + "." + key;
  if (!v->is_object()) throw ProfileError(here + ": expected an object");
  s.arches = string_list(*v, "arches", here);
  s.caps = string_list(*v, "caps", here);
  if (const json* k = member(*v, "minKernel")) {
    s.min_kernel = as_string(*k, here + ".minKernel");
    if (!parse_kernel_version(*s.min_kernel))
      throw ProfileError(here + ".minKernel: \"" + *s.min_kernel + "\" is not a kernel version");
  }
  return s;
}

Entry parse_entry(const json& e, std::size_t i, ProfileReport& report) {
  Entry out;
  out.where = "syscalls[" + std::to_string(i) + "]";
  if (!e.is_object()) throw ProfileError(out.where + ": expected an object");
  out.names = string_list(e, "names", out.where);
  if (const json* name = member(e, "name")) {
    if (!out.names.empty()) throw ProfileError(out.where + ": has both \"name\" and \"names\"");
    out.names.push_back(as_string(*name, out.where + ".name"));
  } else if (member(e, "names") == nullptr) {
    throw ProfileError(out.where + ": needs \"names\"");
  }
  const json* action = member(e, "action");
  if (action == nullptr) throw ProfileError(out.where + ": needs \"action\"");
  std::optional<uint64_t> errno_ret;
  if (const json* r = member(e, "errnoRet")) errno_ret = as_uint(*r, out.where + ".errnoRet");
  out.action =
      parse_action(as_string(*action, out.where + ".action"), errno_ret, out.where, report);
  if (const json* args = member(e, "args")) {
    if (!args->is_array()) throw ProfileError(out.where + ".args: expected an array");
    for (std::size_t j = 0; j < args->size(); ++j) {
      out.args.push_back(
          parse_condition((*args)[j], out.where + ".args[" + std::to_string(j) + "]"));
    }
  }
  out.includes = parse_selector(e, "includes", out.where);
  out.excludes = parse_selector(e, "excludes", out.where);
  return out;
}

// moby: with an archMap, the filter covers the native arch and the
// subArchitectures listed for it; the older "architectures" list is taken
// as is.  Arch names libseccomp does not know are left out with a note.
std::vector<uint32_t> parse_arches(const json& root, ProfileReport& report) {
  const uint32_t native = seccomp_arch_native();
  std::vector<std::string> names;
  const json* map = member(root, "archMap");
  if (map != nullptr && member(root, "architectures") != nullptr)
    throw ProfileError("profile has both \"archMap\" and \"architectures\"");
  if (map != nullptr) {
    if (!map->is_array()) throw ProfileError("archMap: expected an array");
    for (std::size_t i = 0; i < map->size(); ++i) {
      const std::string where = "archMap[" + std::to_string(i) + "]";
      const json& m = (*map)[i];
      if (!m.is_object() || member(m, "architecture") == nullptr)
        throw ProfileError(where + ": needs \"architecture\"");
      const std::string arch = as_string(m["architecture"], where + ".architecture");
      std::vector<std::string> subs = string_list(m, "subArchitectures", where);
      if (resolve_scmp_arch(arch) != native) continue;
      names.push_back(arch);
      names.insert(names.end(), subs.begin(), subs.end());
    }
  } else {
    names = string_list(root, "architectures", "profile");
  }
  std::vector<uint32_t> out;
  for (const std::string& n : names) {
    const uint32_t token = resolve_scmp_arch(n);
    if (token == 0) {
      report.notes.push_back("architecture " + n + " unknown to this libseccomp; left out");
    } else if (std::find(out.begin(), out.end(), token) == out.end()) {
      out.push_back(token);
    }
  }
  return out;
}

Profile parse_profile(const std::string& text, ProfileReport& report) {
  json root;
  try {
    root = json::parse(text);
  } catch (const json::parse_error& e) {
    throw ProfileError(std::string("invalid JSON: ") + e.what());
  }
  if (!root.is_object()) throw ProfileError("top level must be a JSON object");
  Profile p;
  const json* def = member(root, "defaultAction");
  if (def == nullptr) throw ProfileError("needs \"defaultAction\"");
  std::optional<uint64_t> def_errno;
  if (const json* r = member(root, "defaultErrnoRet")) def_errno = as_uint(*r, "defaultErrnoRet");
  p.default_action =
      parse_action(as_string(*def, "defaultAction"), def_errno, "defaultAction", report);
  p.arches = parse_arches(root, report);
  p.flags = string_list(root, "flags", "profile");
  if (const json* calls = member(root, "syscalls")) {
    if (!calls->is_array()) throw ProfileError("syscalls: expected an array");
    for (std::size_t i = 0; i < calls->size(); ++i) {
      p.entries.push_back(parse_entry((*calls)[i], i, report));
    }
  }
  return p;
}

std::string read_file(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int e = errno;
    throw InstallError("cannot open profile " + path + ": " + errno_text(e), -e);
  }
  std::string text;
  char buf[65536];
  for (;;) {
    const ssize_t n = read(fd, buf, sizeof buf);
    if (n == 0) break;
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int e = errno;
      close(fd);
      throw InstallError("cannot read profile " + path + ": " + errno_text(e), -e);
    }
    text.append(buf, static_cast<std::size_t>(n));
  }
  close(fd);
  return text;
}

// ------------------------------------------------------------- selection --

enum class Skip { none, caps_missing, caps_held, arch, kernel, same_as_default };

// moby's setupSeccomp: excludes first, then includes.
Skip skip_reason(const Entry& e, const Context& ctx, const Action& def) {
  const Selector& ex = e.excludes;
  const Selector& in = e.includes;
  if (!ex.arches.empty() && arch_list_has_native(ex.arches)) return Skip::arch;
  if (std::any_of(ex.caps.begin(), ex.caps.end(),
                  [&](const std::string& c) { return ctx.holds(c); }))
    return Skip::caps_held;
  if (ex.min_kernel && ctx.kernel_at_least(*ex.min_kernel)) return Skip::kernel;
  if (!in.arches.empty() && !arch_list_has_native(in.arches)) return Skip::arch;
  if (!std::all_of(in.caps.begin(), in.caps.end(),
                   [&](const std::string& c) { return ctx.holds(c); }))
    return Skip::caps_missing;
  if (in.min_kernel && !ctx.kernel_at_least(*in.min_kernel)) return Skip::kernel;
  // libseccomp refuses (EACCES) a rule whose action is the default; runc
  // drops such rules too.
  if (e.action.value == def.value) return Skip::same_as_default;
  return Skip::none;
}

void count_skip(Skip s, ProfileReport& r) {
  switch (s) {
    case Skip::caps_missing:
      ++r.skipped_caps_missing;
      break;
    case Skip::caps_held:
      ++r.skipped_caps_held;
      break;
    case Skip::arch:
      ++r.skipped_arch;
      break;
    case Skip::kernel:
      ++r.skipped_kernel;
      break;
    case Skip::same_as_default:
      ++r.skipped_default;
      break;
    case Skip::none:
      break;
  }
}

// -------------------------------------------------------------- building --

struct FilterDeleter {
  void operator()(void* ctx) const { seccomp_release(ctx); }
};
using Filter = std::unique_ptr<void, FilterDeleter>;

void check(int rc, const std::string& what) {
  if (rc < 0) throw InstallError(what + ": " + errno_text(rc), rc);
}

void apply_flags(scmp_filter_ctx ctx, const std::vector<std::string>& flags) {
  for (const std::string& f : flags) {
    if (f == "SECCOMP_FILTER_FLAG_LOG") {
      check(seccomp_attr_set(ctx, SCMP_FLTATR_CTL_LOG, 1), "set flag " + f);
    } else if (f == "SECCOMP_FILTER_FLAG_SPEC_ALLOW") {
      check(seccomp_attr_set(ctx, SCMP_FLTATR_CTL_SSB, 1), "set flag " + f);
    } else if (f == "SECCOMP_FILTER_FLAG_TSYNC") {
      check(seccomp_attr_set(ctx, SCMP_FLTATR_CTL_TSYNC, 1), "set flag " + f);
    } else {
      throw ProfileError("flags: unknown flag \"" + f + "\"");
    }
  }
}

Filter new_filter(const Profile& p, ProfileReport& report) {
  Filter f(seccomp_init(p.default_action.value));
  if (!f) throw InstallError("seccomp_init(" + p.default_action.text + ") failed", -EINVAL);
  report.filter_arches = {scmp_arch_label(seccomp_arch_native())};
  for (uint32_t arch : p.arches) {
    const int rc = seccomp_arch_add(f.get(), arch);
    if (rc == -EEXIST) continue;  // the native arch is always there
    check(rc, "seccomp_arch_add(" + scmp_arch_label(arch) + ")");
    report.filter_arches.push_back(scmp_arch_label(arch));
  }
  // We set no_new_privs ourselves, so that a failure has its own message.
  check(seccomp_attr_set(f.get(), SCMP_FLTATR_CTL_NNP, 0), "seccomp_attr_set(CTL_NNP)");
  apply_flags(f.get(), p.flags);
  return f;
}

std::vector<scmp_arg_cmp> to_scmp(const std::vector<Condition>& conds) {
  std::vector<scmp_arg_cmp> out;
  for (const Condition& c : conds) {
    out.push_back(scmp_arg_cmp{c.index, c.op, c.value, c.value_two});
  }
  return out;
}

bool has_repeated_index(const std::vector<Condition>& conds) {
  std::set<unsigned> seen;
  for (const Condition& c : conds) {
    if (!seen.insert(c.index).second) return true;
  }
  return false;
}

void add_rule(scmp_filter_ctx ctx, const Entry& e, const std::string& name, int nr,
              const std::vector<scmp_arg_cmp>& conds, ProfileReport& report) {
  const int rc =
      seccomp_rule_add_array(ctx, e.action.value, nr, static_cast<unsigned>(conds.size()),
                             conds.empty() ? nullptr : conds.data());
  check(rc, e.where + ": seccomp_rule_add(" + name + ", " + e.action.text + ")");
  ++report.libseccomp_rules;
}

// Like runc: several conditions on one argument cannot be ANDed in a single
// libseccomp rule, so they become separate rules (ORed).
void add_name(scmp_filter_ctx ctx, const Entry& e, const std::string& name, ProfileReport& report) {
  const int nr = seccomp_syscall_resolve_name(name.c_str());
  if (nr == __NR_SCMP_ERROR) {
    ++report.names_unknown;
    report.unknown_names.push_back(name);
    return;
  }
  ++(nr < 0 ? report.names_foreign : report.names_native);
  const std::vector<scmp_arg_cmp> conds = to_scmp(e.args);
  if (!has_repeated_index(e.args)) {
    add_rule(ctx, e, name, nr, conds, report);
    return;
  }
  for (const scmp_arg_cmp& c : conds) add_rule(ctx, e, name, nr, {c}, report);
}

void add_entries(scmp_filter_ctx ctx, const Profile& p, const Context& c, ProfileReport& report) {
  report.entries_total = p.entries.size();
  for (const Entry& e : p.entries) {
    const Skip s = skip_reason(e, c, p.default_action);
    if (s != Skip::none) {
      count_skip(s, report);
      continue;
    }
    ++report.entries_applied;
    for (const std::string& name : e.names) add_name(ctx, e, name, report);
  }
}

Context make_context(const std::vector<std::string>& caps, ProfileReport& report) {
  Context c;
  report.native_arch = docker_arch_name(seccomp_arch_native());
  report.kernel_release = kernel_release();
  c.kernel = parse_kernel_version(report.kernel_release).value_or(KernelVersion{0, 0, 0});
  for (const std::string& cap : caps) {
    const std::string n = normalize_cap(cap);
    if (n == "ALL") c.all_caps = true;
    c.caps.insert(n);
    report.caps.push_back(n);
  }
  return c;
}

void load(scmp_filter_ctx ctx) {
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) {
    const int e = errno;
    throw InstallError(std::string("prctl(PR_SET_NO_NEW_PRIVS): ") + errno_text(e), -e);
  }
  check(seccomp_load(ctx), "seccomp_load");
}

int fail(ProfileReport& report, ProfileReport::Stage stage, int rc, const std::string& msg,
         std::string* err) {
  report.stage = stage;
  if (err != nullptr) *err = msg;
  return rc;
}

}  // namespace

int apply_docker_profile(const std::string& path, const std::vector<std::string>& caps,
                         std::string* err, ProfileReport* report_out) {
  ProfileReport local;
  ProfileReport& report = report_out != nullptr ? *report_out : local;
  report = ProfileReport{};
  const Context ctx = make_context(caps, report);
  if (path == kBuiltinNoneProfile) {
    report.default_action = "none (no filter)";
    return 0;
  }
  using Stage = ProfileReport::Stage;
  Profile profile;
  try {
    profile = parse_profile(read_file(path), report);
  } catch (const ProfileError& e) {
    return fail(report, Stage::profile, -EINVAL, "profile " + path + ": " + e.what(), err);
  } catch (const InstallError& e) {
    return fail(report, Stage::profile, e.rc, e.what(), err);
  }
  report.default_action = profile.default_action.text;
  try {
    Filter f = new_filter(profile, report);
    add_entries(f.get(), profile, ctx, report);
    load(f.get());
  } catch (const ProfileError& e) {
    return fail(report, Stage::profile, -EINVAL, "profile " + path + ": " + e.what(), err);
  } catch (const InstallError& e) {
    return fail(report, Stage::install, e.rc, "cannot install filter: " + std::string(e.what()),
                err);
  } catch (const std::bad_alloc&) {
    return fail(report, Stage::install, -ENOMEM, "cannot install filter: out of memory", err);
  }
  return 0;
}

int apply_docker_profile(const std::string& path, const std::vector<std::string>& caps,
                         std::string* err) {
  return apply_docker_profile(path, caps, err, nullptr);
}

namespace {

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string out;
  for (const std::string& s : v) out += (out.empty() ? "" : sep) + s;
  return out;
}

}  // namespace

std::string format_report(const ProfileReport& r) {
  std::ostringstream os;
  const unsigned api = seccomp_api_get();
  const scmp_version* v = seccomp_version();
  os << "default action: " << r.default_action << "\n"
     << "native arch: " << r.native_arch
     << "; filter arches: " << (r.filter_arches.empty() ? "-" : join(r.filter_arches, ",")) << "\n"
     << "kernel: " << r.kernel_release << "; libseccomp " << v->major << "." << v->minor << "."
     << v->micro << " (API level " << api << ")\n"
     << "capabilities held: " << (r.caps.empty() ? "none" : join(r.caps, ",")) << "\n"
     << "rule entries: " << r.entries_total << " total, " << r.entries_applied << " applied, "
     << r.entries_skipped() << " skipped (" << r.skipped_caps_missing
     << " need a capability not held, " << r.skipped_caps_held << " excluded by a held capability, "
     << r.skipped_arch << " other architecture, " << r.skipped_kernel << " kernel version, "
     << r.skipped_default << " same action as default)\n"
     << "syscall names in applied entries: " << (r.names_native + r.names_foreign + r.names_unknown)
     << " (" << r.names_native << " native, " << r.names_foreign
     << " only on another architecture, " << r.names_unknown
     << " unknown to this libseccomp and skipped"
     << (r.unknown_names.empty() ? "" : ": " + join(r.unknown_names, ",")) << ")\n"
     << "libseccomp rules added: " << r.libseccomp_rules << "\n";
  for (const std::string& n : r.notes) os << "note: " << n << "\n";
  return os.str();
}

}  // namespace shmcast_test
