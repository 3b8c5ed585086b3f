#include "relay_status.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <ostream>
#include <sstream>

#include "base/sys.hpp"

namespace shmcast::inspect {

namespace {

constexpr std::size_t kMaxBytes = 1u << 20;
constexpr std::size_t kMaxString = 1000;
constexpr std::size_t kMaxDownstream = 1024;

std::int64_t unix_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

struct Bad : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Copies the fields of `in` named in `spec` into `out`, checking each one's
// type: 's' string (at most kMaxString bytes), 'u' unsigned integer, 'b'
// bool, 'n' finite number >= 0. Absent fields are left out.
void take(const nlohmann::json& in, const std::string& where, const std::vector<std::pair<const char*, char>>& spec,
          json* out) {
  for (const auto& [key, kind] : spec) {
    auto it = in.find(key);
    if (it == in.end()) continue;
    const nlohmann::json& v = *it;
    const std::string name = where.empty() ? key : where + "." + key;
    switch (kind) {
      case 's':
        if (!v.is_string() || v.get_ref<const std::string&>().size() > kMaxString)
          throw Bad("field '" + name + "' is not a string of at most 1000 bytes");
        (*out)[key] = v.get<std::string>();
        break;
      case 'u':
        if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<std::int64_t>() >= 0))
          throw Bad("field '" + name + "' is not a count");
        (*out)[key] = v.get<std::uint64_t>();
        break;
      case 'b':
        if (!v.is_boolean()) throw Bad("field '" + name + "' is not true or false");
        (*out)[key] = v.get<bool>();
        break;
      case 'n': {
        if (!v.is_number()) throw Bad("field '" + name + "' is not a number");
        const double d = v.get<double>();
        if (!(d >= 0) || d > 1e18) throw Bad("field '" + name + "' is not a finite number >= 0");
        (*out)[key] = d;
        break;
      }
    }
  }
}

const nlohmann::json* object(const nlohmann::json& in, const char* key) {
  auto it = in.find(key);
  if (it == in.end()) return nullptr;
  if (!it->is_object()) throw Bad(std::string("field '") + key + "' is not an object");
  return &*it;
}

json checked(const nlohmann::json& in) {
  if (!in.is_object()) throw Bad("not a JSON object");
  json out = json::object();
  take(in, "",
       {{"region", 's'}, {"role", 's'}, {"pid", 'u'}, {"state", 's'}, {"updated_unix_ns", 'u'}, {"listen", 's'},
        {"checksums", 'b'}, {"syncs", 'u'}, {"syncs_aborted", 'u'}, {"syncs_skipped", 'u'}, {"bytes_in", 'u'},
        {"bytes_out", 'u'}, {"last_error", 's'}, {"downstream_ready", 'u'}, {"refused", 'u'}, {"rejected", 'u'},
        {"ignored", 'u'}},
       &out);
  if (const auto* ls = object(in, "last_sync")) {
    json o = json::object();
    take(*ls, "last_sync", {{"version", 'u'}, {"bytes", 'u'}, {"seconds", 'n'}, {"gbps", 'n'}}, &o);
    out["last_sync"] = o;
  }
  if (const auto* rs = object(in, "region_state")) {
    json o = json::object();
    take(*rs, "region_state",
         {{"ready", 'b'}, {"slot_bytes", 'u'}, {"version", 'u'}, {"syncs", 'u'}, {"failed", 'u'}, {"consumers", 'u'},
          {"last_error", 's'}},
         &o);
    out["region_state"] = o;
  }
  if (const auto* up = object(in, "upstream")) {
    json o = json::object();
    take(*up, "upstream",
         {{"address", 's'}, {"state", 's'}, {"connection", 'u'}, {"connects", 'u'}, {"since_unix_ns", 'u'},
          {"refusals", 'u'}, {"last_refusal", 's'}, {"last_error", 's'}},
         &o);
    out["upstream"] = o;
  }
  if (auto it = in.find("downstream"); it != in.end()) {
    if (!it->is_array() || it->size() > kMaxDownstream)
      throw Bad("field 'downstream' is not a list of at most 1024 entries");
    json arr = json::array();
    for (const nlohmann::json& d : *it) {
      if (!d.is_object()) throw Bad("an entry of 'downstream' is not an object");
      json o = json::object();
      take(d, "downstream[]",
           {{"connection", 'u'}, {"peer", 's'}, {"state", 's'}, {"syncs", 'u'}, {"bytes_sent", 'u'},
            {"since_unix_ns", 'u'}},
           &o);
      arr.push_back(o);
    }
    out["downstream"] = arr;
  }
  return out;
}

std::string str(const json& j, const char* key, const char* dflt = "-") {
  auto it = j.find(key);
  return it != j.end() && it->is_string() ? term_safe(it->get<std::string>()) : std::string(dflt);
}
std::uint64_t num(const json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_number_unsigned() ? it->get<std::uint64_t>() : 0;
}

}  // namespace

RelayStatus read_relay_status(const std::string& dir, const std::string& name) {
  RelayStatus s;
  s.path = dir + "/shmcast-relay." + name + ".json";
  const int fd = ::open(s.path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    if (errno == ENOENT) return s;
    s.state = errno == ELOOP ? RelayStatus::State::kUntrusted : RelayStatus::State::kUnreadable;
    s.why = errno == ELOOP ? "a symbolic link: ignored" : std::string("cannot open: ") + std::strerror(errno);
    return s;
  }
  struct stat st {};
  std::string text;
  if (::fstat(fd, &st) != 0) {
    s.state = RelayStatus::State::kUnreadable;
    s.why = std::string("fstat: ") + std::strerror(errno);
  } else if (!S_ISREG(st.st_mode)) {
    s.state = RelayStatus::State::kUntrusted;
    s.why = "not a regular file: ignored";
  } else if (st.st_uid != ::geteuid()) {
    s.state = RelayStatus::State::kUntrusted;
    s.why = "owned by uid " + std::to_string(st.st_uid) + ", not by this user: ignored";
  } else if ((st.st_mode & 022) != 0) {
    s.state = RelayStatus::State::kUntrusted;
    s.why = "writable by others (mode " + mode_text(st.st_mode & 07777) + "): ignored";
  } else if (static_cast<std::uint64_t>(st.st_size) > kMaxBytes) {
    s.state = RelayStatus::State::kUnreadable;
    s.why = "larger than 1 MiB";
  } else {
    text.resize(static_cast<std::size_t>(st.st_size));
    std::size_t got = 0;
    while (got < text.size()) {
      const ssize_t n = shmcast::detail::retry_eintr([&] { return ::read(fd, text.data() + got, text.size() - got); });
      if (n <= 0) break;
      got += static_cast<std::size_t>(n);
    }
    text.resize(got);
  }
  ::close(fd);
  if (s.state != RelayStatus::State::kNone) return s;
  const nlohmann::json parsed = nlohmann::json::parse(text, nullptr, false);
  if (parsed.is_discarded()) {
    s.state = RelayStatus::State::kUnreadable;
    s.why = "not valid JSON (a relay of another version, or a damaged file)";
    return s;
  }
  try {
    s.fields = checked(parsed);
  } catch (const Bad& e) {
    s.state = RelayStatus::State::kUnreadable;
    s.why = e.what();
    return s;
  }
  s.state = RelayStatus::State::kOk;
  const std::uint64_t updated = num(s.fields, "updated_unix_ns");
  const std::int64_t now = unix_now_ns();
  s.age_s = updated == 0 ? -1 : static_cast<double>(now - static_cast<std::int64_t>(updated)) * 1e-9;
  const std::uint64_t pid = num(s.fields, "pid");
  const std::string state = str(s.fields, "state", "");
  // The age decides: the pid may belong to another pid namespace (a relay in
  // a sidecar container), so it only adds to the reason.
  const bool ended = state == "stopped" || state == "failed";
  if (!ended && (updated == 0 || s.age_s > kStaleSeconds)) {
    s.stale = true;
    s.stale_why = updated == 0 ? "it has no update time" : "not updated for " + human_age(s.age_s);
    if (pid > 0 && pid < (1ull << 31) && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH)
      s.stale_why += "; pid " + std::to_string(pid) + " is not running here";
  }
  return s;
}

json relay_status_json(const RelayStatus& s) {
  json j = json::object();
  j["path"] = s.path;
  switch (s.state) {
    case RelayStatus::State::kNone: j["status"] = "none"; return j;
    case RelayStatus::State::kUntrusted: j["status"] = "untrusted"; break;
    case RelayStatus::State::kUnreadable: j["status"] = "unreadable"; break;
    case RelayStatus::State::kOk: j["status"] = "ok"; break;
  }
  if (s.state != RelayStatus::State::kOk) {
    j["why"] = s.why;
    return j;
  }
  j["stale"] = s.stale;
  if (s.stale) j["stale_why"] = s.stale_why;
  j["age_seconds"] = s.age_s;
  j["relay"] = s.fields;
  return j;
}

void print_relay_status(std::ostream& os, const RelayStatus& s) {
  if (s.state == RelayStatus::State::kNone) return;
  os << "\nRELAY  " << term_safe(s.path) << "\n";
  if (s.state != RelayStatus::State::kOk) {
    os << "  " << (s.state == RelayStatus::State::kUntrusted ? "untrusted" : "unreadable") << ": " << term_safe(s.why)
       << "\n";
    return;
  }
  const json& f = s.fields;
  os << "  role " << str(f, "role") << ", state " << str(f, "state") << ", pid " << num(f, "pid");
  if (s.age_s >= 0) os << ", updated " << human_age(s.age_s) << " ago";
  if (s.stale) os << "  [STALE: " << s.stale_why << "]";
  os << "\n";
  if (auto it = f.find("upstream"); it != f.end()) {
    const json& u = *it;
    os << "  upstream    " << str(u, "address") << " " << str(u, "state") << " (connection " << num(u, "connection")
       << ", " << num(u, "connects") << " connects)";
    if (const std::string e = str(u, "last_error", ""); !e.empty()) os << "; last error: " << e;
    os << "\n";
    if (const std::uint64_t n = num(u, "refusals"); n > 0)
      os << "  refused     " << n << " times by the upstream (not proven: retried); last: "
         << str(u, "last_refusal", "") << "\n";
  }
  const std::string listen = str(f, "listen", "");
  const json ds = f.contains("downstream") ? f["downstream"] : json::array();
  os << "  downstream  " << (listen.empty() ? std::string("not listening") : "listening on " + listen) << "; "
     << num(f, "downstream_ready") << " ready of " << ds.size() << ", " << num(f, "refused") << " refused";
  if (const std::uint64_t n = num(f, "rejected"); n > 0) os << ", " << n << " rejected (too many pending handshakes)";
  if (const std::uint64_t n = num(f, "ignored"); n > 0) os << ", " << n << " messages ignored";
  os << "\n";
  for (const json& d : ds)
    os << "    #" << num(d, "connection") << " " << str(d, "peer") << " " << str(d, "state") << ", "
       << num(d, "syncs") << " syncs, " << human_bytes(num(d, "bytes_sent")) << " sent\n";
  os << "  syncs       " << num(f, "syncs") << " (" << num(f, "syncs_aborted") << " aborted, "
     << num(f, "syncs_skipped") << " skipped); in " << human_bytes(num(f, "bytes_in")) << ", out "
     << human_bytes(num(f, "bytes_out")) << "\n";
  if (auto it = f.find("last_sync"); it != f.end() && num(*it, "version") > 0) {
    const json& l = *it;
    const double secs = l.contains("seconds") ? l["seconds"].get<double>() : 0;
    std::ostringstream t;
    t.precision(3);
    t << std::fixed << secs;
    os << "  last sync   version " << num(l, "version") << ": " << human_bytes(num(l, "bytes")) << " in " << t.str()
       << " s";
    if (secs > 0) os << " (" << human_rate(static_cast<double>(num(l, "bytes")) / secs) << ")";
    os << "\n";
  }
  if (auto it = f.find("region_state"); it != f.end()) {
    const json& r = *it;
    os << "  region      " << (r.value("ready", false) ? "ready" : "not ready") << ", version " << num(r, "version")
       << ", " << num(r, "syncs") << " syncs, " << num(r, "failed") << " failed, " << num(r, "consumers")
       << " consumers";
    if (const std::string e = str(r, "last_error", ""); !e.empty()) os << "; last error: " << e;
    os << "\n";
  }
  if (const std::string e = str(f, "last_error", ""); !e.empty()) os << "  last error  " << e << "\n";
}

}  // namespace shmcast::inspect
