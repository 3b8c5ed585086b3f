// The relay's log (stderr, or RelayOptions::log) and its status file (JSON,
// replaced whole: docs/relay.md "Status file"). log(), set_state() and
// note_error() are called from any thread; write_status() from the network
// thread.
#include "relay_impl.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <ctime>
#include <nlohmann/json.hpp>

#include "owner.hpp"
#include "shmcast/files.hpp"

namespace shmcast::relay {

namespace {

const char* state_name(Down::State s) {
  switch (s) {
    case Down::kHandshake: return "handshake";
    case Down::kJoining: return "joining";
    case Down::kReady: return "ready";
    case Down::kActive: return "active";
    case Down::kClosing: return "closing";
  }
  return "?";
}

}  // namespace

std::string fmt_gbs(std::uint64_t bytes, double seconds) {
  char b[64];
  std::snprintf(b, sizeof b, "%.3f GB/s", seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0.0);
  return b;
}

void Relay::Impl::log(const std::string& line) {
  if (o.log) {
    o.log(line);
    return;
  }
  const std::int64_t now = unix_ns();
  const std::time_t secs = static_cast<std::time_t>(now / 1000000000);
  std::tm tm{};
  ::gmtime_r(&secs, &tm);
  char ts[32];
  std::strftime(ts, sizeof ts, "%H:%M:%S", &tm);
  std::fprintf(stderr, "shmcast-relay %s %s.%03dZ %s\n", o.region.c_str(), ts,
               static_cast<int>((now / 1000000) % 1000), line.c_str());
}

void Relay::Impl::set_state(const std::string& s) {
  std::lock_guard<std::mutex> g(smu);
  if (st.state != s) {
    st.state = s;
    status_dirty = true;
  }
}

void Relay::Impl::note_error(const std::string& e) {
  std::lock_guard<std::mutex> g(smu);
  st.last_error = e;
  status_dirty = true;
}

// What a peer wrote, fit for one log line and for the status file's JSON:
// control bytes become '?', bytes from 0x80 up "\\xNN" (a peer's bytes
// need not be UTF-8, which JSON requires).
std::string Relay::Impl::printable(const std::string& s, std::size_t max) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (char ch : s.substr(0, max)) {
    const auto c = static_cast<unsigned char>(ch);
    if (c < 0x20 || c == 0x7f) {
      out += '?';
    } else if (c >= 0x80) {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += ch;
    }
  }
  if (s.size() > max) out += "...";
  return out;
}

void Relay::Impl::write_status(bool force) {
  if (status_path.empty()) return;
  const std::int64_t now = mono_ns();
  // At most one write per 100 ms however often the state changes (a flood
  // of connections changes it on every pass), and one a second at least.
  if (!force && (now < next_status_write_ns || (!status_dirty && now < next_status_ns))) return;
  next_status_ns = now + 1'000'000'000;
  next_status_write_ns = now + 100'000'000;
  status_dirty = false;
  nlohmann::json j;
  {
    std::lock_guard<std::mutex> g(smu);
    j["region"] = o.region;
    j["role"] = source ? "source" : "relay";
    j["pid"] = ::getpid();
    j["state"] = st.state;
    j["updated_unix_ns"] = unix_ns();
    j["listen"] = listen_str;
    j["checksums"] = o.checksums;
    j["syncs"] = st.syncs;
    j["syncs_aborted"] = st.aborted;
    j["syncs_skipped"] = st.skipped;
    j["bytes_in"] = st.bytes_in;
    j["bytes_out"] = st.bytes_out;
    j["last_sync"] = {{"version", st.last_version},
                      {"bytes", st.last_bytes},
                      {"seconds", st.last_seconds},
                      {"gbps", st.last_seconds > 0 ? static_cast<double>(st.last_bytes) / st.last_seconds / 1e9 : 0},
                      {"kind", st.last_kind},
                      {"logical_bytes", st.last_logical},
                      {"payload_bytes", st.last_payload}};
    j["delta"] = {{"syncs", st.delta_syncs}, {"skipped", st.delta_skipped}, {"full_requests", st.full_requests}};
    j["last_error"] = st.last_error;
    j["region_state"] = {{"ready", st.region_ready},
                         {"slot_bytes", st.region_slot_bytes},
                         {"version", st.region_version},
                         {"syncs", st.region_syncs},
                         {"failed", st.region_failed},
                         {"consumers", st.region_consumers},
                         {"last_error", st.region_error}};
  }
  if (!source) {
    static const char* names[] = {"idle", "connecting", "authenticating", "connected"};
    j["upstream"] = {{"address", from_addr.str()},
                     {"state", names[up.state]},
                     {"connection", up.tr.conn},
                     {"since_unix_ns", up.state == Up::kAuthed ? up.since_unix_ns : 0},
                     {"connects", up.connects},
                     {"refusals", up.refusals},
                     {"last_refusal", up.last_refusal},
                     {"last_error", up.last_error}};
  }
  nlohmann::json ds = nlohmann::json::array();
  int ready = 0;
  for (const auto& [id, d] : downs) {
    if (d->state == Down::kReady || d->state == Down::kActive) ++ready;
    ds.push_back({{"connection", id},
                  {"peer", d->peer},
                  {"state", state_name(d->state)},
                  {"since_unix_ns", d->since_unix_ns},
                  {"syncs", d->syncs},
                  {"bytes_sent", d->bytes_sent}});
  }
  j["downstream"] = ds;
  j["downstream_ready"] = ready;
  j["refused"] = refused;
  j["rejected"] = rejected;
  j["evicted"] = admission.evicted();
  j["ignored"] = ignored;
  j["unproven"] = unproven;
  // A new file under a fresh name, then renamed over the status file
  // (shmcast/files.hpp): a link or another user's file planted in the
  // region directory is replaced, never written through or chmodded.
  // Strings a peer sent are printable() already; replace keeps any other
  // invalid UTF-8 from making dump() throw (it would end the relay).
  try {
    replace_file(status_path, j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n", 0600);
    status_failed = false;
  } catch (const std::exception& e) {
    if (!status_failed) log(std::string("cannot write the status file (will retry): ") + e.what());
    status_failed = true;
  }
}

// The first write, at start. A name in a shared directory (the default,
// <region dir>, is /dev/shm: sticky, anyone may create files there) that
// another user created first cannot be replaced by this one (rename over
// another user's file in a sticky directory is refused): every later write
// would fail. Said now, naming the owner and the way out, instead of a
// relay that runs without its status (and that shmcast-inspect calls
// untrusted). Other failures (a full disk) are logged and retried as before.
void Relay::Impl::first_status() {
  if (status_path.empty()) return;
  write_status(true);
  if (!status_failed) return;
  struct stat st {};
  if (::lstat(status_path.c_str(), &st) != 0 || st.st_uid == ::geteuid()) return;
  const std::string owner = owner_text(st.st_uid);
  throw Error(Errc::kPermission,
              "status file " + status_path + " belongs to " + owner + ", not to this user (uid " +
                  std::to_string(::geteuid()) + "), and this relay cannot replace it: another user took the name "
                  "first. Give the status file a path of your own with --status FILE (RelayOptions::status_path; "
                  "- for none), or have that user (or root) remove " + status_path,
              EPERM);
}

}  // namespace shmcast::relay
