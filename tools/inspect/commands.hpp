// shmcast-inspect: the verbs.
#pragma once

#include <cstdint>
#include <string>

namespace shmcast::inspect {

struct Common {
  std::string dir;  // region directory, already resolved
  bool json = false;
};

int cmd_list(const Common& c);
int cmd_show(const Common& c, const std::string& name, std::size_t limit);
int cmd_watch(const Common& c, const std::string& name, double interval_s, std::uint64_t count);
int cmd_dump(const Common& c, const std::string& name, const std::string& out, double timeout_s, bool overwrite);
int cmd_gc(const Common& c, bool dry_run, double grace_s);
int cmd_rm(const Common& c, const std::string& name, bool force);

// True when `name` is a valid region name; else reports a usage error (exit
// code in *rc).
bool check_name(const Common& c, const std::string& command, const std::string& name, int* rc);

// Reports a failure: a message on stderr, and with --json a document
// {"ok": false, "exit_code": code, "error": message} on stdout. Returns code.
int fail(const Common& c, const std::string& command, int code, const std::string& message);
// That failure document, on one line without the newline.
std::string fail_json(const Common& c, const std::string& command, int code, const std::string& message);

}  // namespace shmcast::inspect
