// shmcast-inspect: output helpers. JSON documents (schema in docs/inspect.md)
// and aligned, terminal-safe tables for people.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "shmcast/probe.hpp"

namespace shmcast::inspect {

using json = nlohmann::ordered_json;

inline constexpr int kSchemaVersion = 1;

// Exit codes (documented in docs/inspect.md and in --help).
enum Exit : int {
  kExitOk = 0,
  kExitFailure = 1,    // runtime failure: I/O error, region error during dump, gc could not remove one
  kExitUsage = 2,      // bad arguments or region name
  kExitNotFound = 3,   // no such region
  kExitDamaged = 4,    // show/dump: region is corrupt/foreign/truncated/newer-/older-version/unreadable/untrusted-owner
  kExitRefused = 5,    // rm: a participant is alive or the file is untrusted (use --force);
                       // dump: output exists (use --overwrite)
  kExitTimeout = 6,    // dump: no sync arrived within --timeout
  kExitNoSpace = 7,    // dump: not enough free space for the file
  kExitInterrupted = 130,  // dump: interrupted by SIGINT/SIGTERM (temp file removed)
};

// Skeleton of every JSON document: tool, schema, command, ok.
json doc(const std::string& command, bool ok = true);
// Prints a JSON document on one line of stdout (invalid UTF-8 is replaced).
void print_json(const json& j);
// The same line as a string, without the newline.
std::string json_text(const json& j);

json alive_json(probe::Alive a);
const char* alive_word(probe::Alive a);  // yes / no / ?
std::string errc_text(std::uint32_t code);  // "" for 0, else errc_name
std::string mode_text(std::uint32_t mode);  // permission bits as four octal digits: "0640"
std::string seat_state_text(const probe::Seat& s);  // free / active / evicted / invalid(N)

json region_summary_json(const probe::Region& r);
// The full `show` document body (everything but the skeleton).
void region_detail_json(const probe::Region& r, std::size_t limit, json* out);

// Makes untrusted text safe for a terminal: control characters, C1 codes and
// invalid UTF-8 become \xNN escapes.
std::string term_safe(const std::string& s);
std::string hex64(std::uint64_t v);
using probe::human_bytes;
std::string human_rate(double bytes_per_s);
std::string human_age(double seconds);
std::string owner_text(const probe::Owner& o);  // "uid 0 (root), gid 0 (root), mode 0600"
std::string unix_ns_text(std::uint64_t ns);  // ISO 8601 UTC, "-" for 0
std::string shape_text(const std::vector<std::int64_t>& shape);

// An aligned text table. Cells are passed through term_safe.
class Table {
 public:
  explicit Table(std::vector<std::string> head, std::vector<bool> right_align = {});
  void row(std::vector<std::string> cells);
  void print(std::ostream& os, const std::string& indent = "") const;
  bool empty() const { return rows_.empty(); }

 private:
  std::vector<std::string> head_;
  std::vector<bool> right_;
  std::vector<std::vector<std::string>> rows_;
};

// Prints the human `show` view.
void print_region_detail(std::ostream& os, const probe::Region& r, std::size_t limit);

}  // namespace shmcast::inspect
