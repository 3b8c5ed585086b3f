// shmcast-inspect: the state file shmcast-relay keeps next to a region
// (<dir>/shmcast-relay.<name>.json, docs/relay.md "State"), shown by `show`.
// The file is untrusted input: it is read only when it is a regular file of
// this user that no one else may write, at most 1 MiB, and every field is
// type-checked before it is shown.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>

#include "format.hpp"

namespace shmcast::inspect {

struct RelayStatus {
  enum class State { kNone, kOk, kUntrusted, kUnreadable };
  State state = State::kNone;
  std::string path;
  std::string why;       // kUntrusted / kUnreadable: what is wrong
  json fields;           // kOk: the checked fields (schema in docs/inspect.md)
  double age_s = 0;      // since the relay last rewrote it
  bool stale = false;    // not rewritten for more than kStaleSeconds, or its pid is gone
  std::string stale_why;
};

inline constexpr double kStaleSeconds = 5.0;  // the relay rewrites it every second

RelayStatus read_relay_status(const std::string& dir, const std::string& name);
json relay_status_json(const RelayStatus& s);
void print_relay_status(std::ostream& os, const RelayStatus& s);

}  // namespace shmcast::inspect
