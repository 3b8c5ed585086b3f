// list, show, watch (read-only) and gc, rm (act).
#include "commands.hpp"
#include "relay_status.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <iostream>
#include <map>
#include <sstream>
#include <thread>

#include "format.hpp"

namespace shmcast::inspect {

std::string fail_json(const Common& c, const std::string& command, int code, const std::string& message) {
  json j = doc(command, false);
  j["dir"] = c.dir;
  j["exit_code"] = code;
  j["error"] = message;
  return json_text(j);
}

int fail(const Common& c, const std::string& command, int code, const std::string& message) {
  std::cerr << "shmcast-inspect " << command << ": " << term_safe(message) << "\n";
  if (c.json) {
    std::cout << fail_json(c, command, code, message) << "\n";
    std::cout.flush();
  }
  return code;
}

bool check_name(const Common& c, const std::string& command, const std::string& name, int* rc) {
  const std::string why = validate_name(name);
  if (why.empty()) return true;
  *rc = fail(c, command, kExitUsage, why + ": '" + name + "'");
  return false;
}

namespace {

// The region names in c.dir; false (with *rc the reported failure) when the
// directory cannot be read.
bool scan(const Common& c, const std::string& command, std::vector<std::string>* names, int* rc) {
  try {
    *names = probe::scan_dir(c.dir);
    return true;
  } catch (const std::exception& e) {
    *rc = fail(c, command, kExitFailure, e.what());
    return false;
  }
}

// Probes one region of a directory listing: never throws. A file that
// vanished between readdir and open gives false.
bool probe_listed(const std::string& dir, const std::string& name, const probe::Options& o, probe::Region* out) {
  try {
    *out = probe::probe_region(dir, name, o);
    return true;
  } catch (const Error& e) {
    if (e.code() == Errc::kNotFound) return false;
    *out = probe::Region{};
    out->name = name;
    out->path = probe::region_file(dir, name);
    out->state = probe::State::kUnreadable;
    out->reason = e.what();
    return true;
  } catch (const std::exception& e) {
    *out = probe::Region{};
    out->name = name;
    out->path = probe::region_file(dir, name);
    out->state = probe::State::kUnreadable;
    out->reason = e.what();
    return true;
  }
}

std::string producer_cell(const probe::Region& r) {
  if (!r.have_header) return "-";
  return std::to_string(r.producer.pid);
}

// ---------------------------------------------------------------- removal

// Removes `path` if it is still the file we probed (same inode) and still
// nobody holds a lock on it. Returns "" or why not.
std::string remove_checked(const std::string& path, std::uint64_t inode, bool check_locks) {
  if (check_locks) {
    const probe::FileCheck f = probe::check_file(path);
    if (f.error != 0) return std::string("open: ") + std::strerror(f.error);
    if (!f.regular) return "the file was replaced while gc ran (now " + f.file_type + ")";
    if (f.inode != inode) return "the file was replaced while gc ran (a new region took the name)";
    if (!f.owner.trusted) return "the file changed owner or mode while gc ran: " + f.owner.trust_problem;
    if (f.any_lock != probe::Alive::kNo) return "a participant attached while gc ran";
  }
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return std::string("lstat: ") + std::strerror(errno);
  if (static_cast<std::uint64_t>(st.st_ino) != inode) return "the file was replaced (a new region took the name)";
  if (::unlink(path.c_str()) != 0) return std::string("unlink: ") + std::strerror(errno);
  return {};
}

volatile sig_atomic_t g_stop = 0;

void on_stop(int) { g_stop = 1; }

void install_stop_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_stop;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;  // no SA_RESTART: sleeps return early
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGHUP, &sa, nullptr);
}

// Sleeps until `seconds` passed or a stop signal arrived.
void sleep_unless_stopped(double seconds) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!g_stop) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= end) return;
    auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(end - now);
    if (left > std::chrono::milliseconds(50)) left = std::chrono::milliseconds(50);
    struct timespec ts {};
    ts.tv_sec = static_cast<time_t>(left.count() / 1000000000);
    ts.tv_nsec = static_cast<long>(left.count() % 1000000000);
    ::nanosleep(&ts, nullptr);
  }
}

// Restores the terminal however watch ends.
struct TerminalGuard {
  bool active = false;
  void enter() {
    active = true;
    std::cout << "\x1b[?1049h\x1b[?25l" << std::flush;  // alternate screen, hide cursor
  }
  void leave() {
    if (!active) return;
    active = false;
    std::cout << "\x1b[?25h\x1b[?1049l" << std::flush;
  }
  ~TerminalGuard() { leave(); }
};

std::int64_t wall_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

// ---------------------------------------------------------------- list

int cmd_list(const Common& c) {
  std::vector<std::string> names;
  if (int rc; !scan(c, "list", &names, &rc)) return rc;
  probe::Options o;
  std::vector<probe::Region> reports;
  for (const std::string& n : names) {
    probe::Region r;
    if (probe_listed(c.dir, n, o, &r)) reports.push_back(std::move(r));
  }
  if (c.json) {
    json j = doc("list");
    j["dir"] = c.dir;
    json arr = json::array();
    for (const probe::Region& r : reports) arr.push_back(region_summary_json(r));
    j["regions"] = arr;
    print_json(j);
    return kExitOk;
  }
  if (reports.empty()) {
    std::cout << "no shmcast regions in " << term_safe(c.dir) << "\n";
    return kExitOk;
  }
  Table t({"NAME", "STATE", "SIZE", "LAYOUT", "PRODUCER", "ALIVE", "CONSUMERS", "LIVE", "SYNC", "NOTE"},
          {false, false, true, true, true, false, true, true, true, false});
  for (const probe::Region& r : reports) {
    const bool magic_ok = r.have_fixed && r.fixed.shmcast_magic;
    t.row({r.name, probe::state_name(r.state), human_bytes(r.size),
           !magic_ok ? "-"
           : r.have_header && r.slot_memory == SlotMemory::kDevice
               ? std::to_string(r.fixed.layout_version) + " (device slots)"
               : std::to_string(r.fixed.layout_version),
           producer_cell(r),
           r.have_header ? alive_word(r.producer_alive) : "-",
           r.header_valid ? std::to_string(r.consumers_attached) + "/" + std::to_string(r.fixed.max_consumers) : "-",
           r.header_valid ? std::to_string(r.consumers_alive) : "-",
           r.header_valid && r.have_record ? std::to_string(r.record.version) : "-", r.reason});
  }
  std::cout << "region directory " << term_safe(c.dir) << "\n";
  t.print(std::cout);
  return kExitOk;
}

// ---------------------------------------------------------------- show

int cmd_show(const Common& c, const std::string& name, std::size_t limit) {
  int rc = 0;
  if (!check_name(c, "show", name, &rc)) return rc;
  probe::Options o;
  o.decode_manifest = true;
  o.manifest_limit = limit;
  probe::Region r;
  try {
    r = probe::probe_region(c.dir, name, o);
  } catch (const Error& e) {
    if (e.code() != Errc::kNotFound) return fail(c, "show", kExitFailure, e.what());
    // No region (yet), but a relay that should make it here may say why:
    // its upstream refuses it, or it cannot connect.
    const RelayStatus relay = read_relay_status(c.dir, name);
    if (relay.state == RelayStatus::State::kNone) return fail(c, "show", kExitNotFound, e.what());
    std::cerr << "shmcast-inspect show: " << term_safe(e.what()) << "\n";
    if (c.json) {
      json j = json::parse(fail_json(c, "show", kExitNotFound, e.what()));
      j["relay"] = relay_status_json(relay);
      print_json(j);
    } else {
      print_relay_status(std::cout, relay);
    }
    return kExitNotFound;
  }
  const int exit = probe::state_is_damaged(r.state) ? kExitDamaged : kExitOk;
  const RelayStatus relay = read_relay_status(c.dir, name);
  if (c.json) {
    json j = doc("show");
    j["dir"] = c.dir;
    j["exit_code"] = exit;
    region_detail_json(r, limit, &j);
    j["relay"] = relay_status_json(relay);
    print_json(j);
  } else {
    print_region_detail(std::cout, r, limit);
    print_relay_status(std::cout, relay);
  }
  return exit;
}

// ---------------------------------------------------------------- watch

namespace {

struct Baseline {
  bool have = false;
  std::uint64_t inode = 0, generation = 0;
  std::int64_t t_ns = 0;
  std::uint64_t bytes_done = 0, published_seq = 0;
  std::map<std::uint32_t, std::pair<std::uint64_t, std::uint64_t>> seat_bytes;  // index -> (gen, bytes_done)
};

struct Rates {
  bool have = false;
  double bytes_per_s = 0, chunks_per_s = 0;
  std::map<std::uint32_t, double> seat_bytes_per_s;
};

Rates update_rates(Baseline* b, const probe::Region& r, std::int64_t t_ns) {
  Rates out;
  if (!r.have_header) {
    b->have = false;
    return out;
  }
  const bool same = b->have && b->inode == r.inode && b->generation == r.generation && t_ns > b->t_ns &&
                    r.bytes_done >= b->bytes_done && r.published_seq >= b->published_seq;
  if (same) {
    const double dt = static_cast<double>(t_ns - b->t_ns) * 1e-9;
    out.have = true;
    out.bytes_per_s = static_cast<double>(r.bytes_done - b->bytes_done) / dt;
    out.chunks_per_s = static_cast<double>(r.published_seq - b->published_seq) / dt;
    for (const probe::Seat& s : r.seats) {
      auto it = b->seat_bytes.find(s.index);
      if (it != b->seat_bytes.end() && it->second.first == s.generation && s.bytes_done >= it->second.second)
        out.seat_bytes_per_s[s.index] = static_cast<double>(s.bytes_done - it->second.second) / dt;
    }
  }
  b->have = true;
  b->inode = r.inode;
  b->generation = r.generation;
  b->t_ns = t_ns;
  b->bytes_done = r.bytes_done;
  b->published_seq = r.published_seq;
  b->seat_bytes.clear();
  for (const probe::Seat& s : r.seats) b->seat_bytes[s.index] = {s.generation, s.bytes_done};
  return out;
}

std::string render_watch(const Common& c, const std::string& name, const probe::Region* r, const Rates& rates,
                         double interval_s, std::uint64_t sample) {
  std::ostringstream os;
  char head[256];
  std::snprintf(head, sizeof head, "shmcast-inspect watch %s   every %.2fs   %s   refresh %llu   (Ctrl-C quits)",
                term_safe(name).c_str(), interval_s, unix_ns_text(static_cast<std::uint64_t>(wall_ns())).c_str(),
                static_cast<unsigned long long>(sample));
  os << head << "\n\n";
  if (r == nullptr) {
    os << "region " << term_safe(name) << " not found in " << term_safe(c.dir) << " (waiting for it)\n";
    return os.str();
  }
  Table kv({"FIELD", "VALUE"});
  kv.row({"state", probe::state_name(r->state) + (r->reason.empty() ? "" : " (" + r->reason + ")")});
  if (r->have_header)
    kv.row({"producer", "pid " + std::to_string(r->producer.pid) + ", alive " + alive_word(r->producer_alive) +
                            ", generation " + std::to_string(r->generation)});
  if (r->header_valid)
    kv.row({"consumers", std::to_string(r->consumers_attached) + " attached, " + std::to_string(r->consumers_alive) +
                             " alive (max " + std::to_string(r->fixed.max_consumers) + ")"});
  if (r->header_valid && r->have_record)
    kv.row({"sync", "version " + std::to_string(r->record.version) + " (" + probe::state_name(r->sync_status) + ", " +
                        std::to_string(r->chunks_published) + "/" + std::to_string(r->record.chunks) +
                        " chunks), " + std::to_string(r->syncs_done) + " syncs done, " +
                        human_bytes(r->bytes_done) + " total"});
  if (r->have_header) {
    std::string rate = "-";
    if (rates.have) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.1f", rates.chunks_per_s);
      rate = human_rate(rates.bytes_per_s) + " synced, " + buf + " chunks/s published";
    }
    kv.row({"throughput", rate});
    if (r->error_code) kv.row({"last error", errc_text(r->error_code) + ": " + r->error_text});
  }
  kv.print(os);
  if (r->header_valid) {
    os << "\nSEATS\n";
    Table t({"IDX", "STATE", "PID", "ALIVE", "ACKED", "RELEASED", "LAG", "SYNCS", "BYTES", "RATE", "ERROR"},
            {true, false, true, false, true, true, true, true, true, true, false});
    std::size_t hidden = 0;
    for (const probe::Seat& s : r->seats) {
      if (s.word == 0 && s.alive != probe::Alive::kYes) {
        ++hidden;
        continue;
      }
      auto it = rates.seat_bytes_per_s.find(s.index);
      t.row({std::to_string(s.index), seat_state_text(s), s.consumer.pid ? std::to_string(s.consumer.pid) : "-",
             alive_word(s.alive), std::to_string(s.acked_version), std::to_string(s.released_seq),
             std::to_string(s.lag_chunks), std::to_string(s.syncs_done), human_bytes(s.bytes_done),
             it != rates.seat_bytes_per_s.end() ? human_rate(it->second) : "-",
             s.error_code ? errc_text(s.error_code) : "-"});
    }
    t.print(os);
    if (hidden) os << "(" << hidden << " never-used seats hidden)\n";
    os << "\nSLOTS\n";
    Table s({"IDX", "STATE", "SEQ", "VERSION", "BYTES", "HOLDERS"}, {true, false, true, true, true, true});
    const std::size_t max_rows = 64;
    for (std::size_t k = 0; k < r->slots.size() && k < max_rows; ++k) {
      const probe::Slot& sl = r->slots[k];
      s.row({std::to_string(sl.index), probe::state_name(sl.state), std::to_string(sl.seq), std::to_string(sl.version),
             human_bytes(sl.bytes), std::to_string(sl.holders)});
    }
    s.print(os);
    if (r->slots.size() > max_rows) os << "... " << (r->slots.size() - max_rows) << " more slots\n";
  }
  return os.str();
}

}  // namespace

int cmd_watch(const Common& c, const std::string& name, double interval_s, std::uint64_t count) {
  int rc = 0;
  if (!check_name(c, "watch", name, &rc)) return rc;
  install_stop_handlers();
  const bool tty = !c.json && ::isatty(STDOUT_FILENO) == 1;
  TerminalGuard term;
  Baseline base;
  probe::Options o;
  for (std::uint64_t sample = 1; !g_stop; ++sample) {
    const std::int64_t t = wall_ns();
    probe::Region r;
    bool found = true;
    try {
      r = probe::probe_region(c.dir, name, o);
    } catch (const Error& e) {
      if (e.code() != Errc::kNotFound) return fail(c, "watch", kExitFailure, e.what());
      found = false;
    }
    if (!found && sample == 1) return fail(c, "watch", kExitNotFound, "no region at " + c.dir + "/shmcast." + name);
    const Rates rates = found ? update_rates(&base, r, t) : Rates{};
    if (!found) base.have = false;
    if (c.json) {
      json j = doc("watch");
      j["dir"] = c.dir;
      j["sample"] = sample;
      j["time_unix_ns"] = t;
      j["interval_s"] = interval_s;
      j["missing"] = !found;
      if (found) {
        region_detail_json(r, 0, &j);
        j.erase("manifest");
      } else {
        j["region"] = nullptr;
      }
      json rj;
      rj["bytes_per_s"] = rates.have ? json(rates.bytes_per_s) : json(nullptr);
      rj["chunks_per_s"] = rates.have ? json(rates.chunks_per_s) : json(nullptr);
      json seats = json::array();
      for (const auto& [idx, v] : rates.seat_bytes_per_s) seats.push_back(json{{"index", idx}, {"bytes_per_s", v}});
      rj["seats"] = seats;
      j["rates"] = rj;
      print_json(j);
    } else {
      const std::string frame = render_watch(c, name, found ? &r : nullptr, rates, interval_s, sample);
      if (tty) {
        if (!term.active) term.enter();
        std::cout << "\x1b[H\x1b[2J" << frame << std::flush;
      } else {
        std::cout << frame << "\n" << std::flush;
      }
    }
    if (count != 0 && sample >= count) break;
    sleep_unless_stopped(interval_s);
  }
  term.leave();
  return kExitOk;
}

// ---------------------------------------------------------------- gc

int cmd_gc(const Common& c, bool dry_run, double grace_s) {
  std::vector<std::string> names;
  if (int rc; !scan(c, "gc", &names, &rc)) return rc;
  probe::Options o;
  o.grace_s = grace_s;
  json removed = json::array(), kept = json::array(), failed = json::array();
  Table t({"ACTION", "NAME", "STATE", "WHY"});
  auto entry = [](const probe::Region& r, const std::string& why) {
    return json{{"name", r.name}, {"file", r.path}, {"state", probe::state_name(r.state)}, {"reason", why}};
  };
  for (const std::string& n : names) {
    probe::Region r;
    if (!probe_listed(c.dir, n, o, &r)) continue;
    std::string keep_why;
    if (r.state == probe::State::kUntrustedOwner) {
      keep_why = "not trusted (" + r.reason + "): gc never removes it; check it, then `rm " + r.name + " --force`";
    } else if (r.state == probe::State::kReady) {
      keep_why = "the producer is alive";
    } else if (r.state == probe::State::kCreating) {
      keep_why = "it is being created";
    } else if (r.state == probe::State::kDead || r.state == probe::State::kClosed ||
               r.state == probe::State::kCorrupt || r.state == probe::State::kTruncated) {
      if (r.any_lock == probe::Alive::kYes)
        keep_why = r.producer_alive == probe::Alive::kYes ? "the producer is alive" : "a consumer is still attached";
      else if (r.any_lock == probe::Alive::kUnknown)
        keep_why = "liveness unknown (lock probe failed)";
      else if ((r.state == probe::State::kCorrupt || r.state == probe::State::kTruncated) && r.young)
        keep_why = "damaged but changed less than --grace seconds ago";
    } else if (r.state == probe::State::kForeign) {
      keep_why = "not a shmcast region: remove it by hand if it is garbage";
    } else if (r.state == probe::State::kNewerVersion || r.state == probe::State::kOlderVersion) {
      keep_why = "made by another shmcast layout version: use that version's shmcast-inspect";
    } else {
      keep_why = "cannot be inspected: " + r.reason;
    }
    if (!keep_why.empty()) {
      kept.push_back(entry(r, keep_why));
      t.row({"keep", r.name, probe::state_name(r.state), keep_why});
      continue;
    }
    const std::string why = r.reason.empty() ? "nobody is attached" : r.reason + "; nobody is attached";
    if (dry_run) {
      removed.push_back(entry(r, why));
      t.row({"would remove", r.name, probe::state_name(r.state), why});
      continue;
    }
    const std::string err = remove_checked(r.path, r.inode, true);
    if (err.empty()) {
      removed.push_back(entry(r, why));
      t.row({"removed", r.name, probe::state_name(r.state), why});
    } else {
      json e = entry(r, why);
      e["error"] = err;
      failed.push_back(e);
      t.row({"failed", r.name, probe::state_name(r.state), err});
    }
  }
  const int exit = failed.empty() ? kExitOk : kExitFailure;
  if (c.json) {
    json j = doc("gc", exit == kExitOk);
    j["dir"] = c.dir;
    j["dry_run"] = dry_run;
    j["grace_s"] = grace_s;
    j["exit_code"] = exit;
    j["removed"] = removed;
    j["kept"] = kept;
    j["failed"] = failed;
    print_json(j);
  } else if (t.empty()) {
    std::cout << "no shmcast regions in " << term_safe(c.dir) << "\n";
  } else {
    t.print(std::cout);
  }
  return exit;
}

// ---------------------------------------------------------------- rm

int cmd_rm(const Common& c, const std::string& name, bool force) {
  int rc = 0;
  if (!check_name(c, "rm", name, &rc)) return rc;
  probe::Options o;
  probe::Region r;
  try {
    r = probe::probe_region(c.dir, name, o);
  } catch (const Error& e) {
    if (e.code() == Errc::kNotFound) return fail(c, "rm", kExitNotFound, e.what());
    return fail(c, "rm", kExitFailure, e.what());
  }
  std::string refuse_why;
  if (r.state == probe::State::kUntrustedOwner) {
    refuse_why = "it is not trusted: " + r.reason;
  } else if (r.any_lock == probe::Alive::kYes) {
    refuse_why = r.producer_alive == probe::Alive::kYes
                     ? "its producer (pid " + std::to_string(r.producer.pid) + ") is alive"
                     : "a participant is alive";
    if (r.header_valid && r.consumers_alive > 0)
      refuse_why += ", " + std::to_string(r.consumers_alive) + " consumer(s) alive";
  } else if (r.state == probe::State::kCreating) {
    refuse_why = "it is being created";
  } else if (r.any_lock == probe::Alive::kUnknown && r.state != probe::State::kForeign) {
    refuse_why = "its participants' liveness is unknown";
  }
  if (!refuse_why.empty() && !force) {
    const std::string msg = "refusing to remove region '" + name + "': " + refuse_why +
                            "; pass --force to remove it anyway (attached processes keep their mapping)";
    std::cerr << "shmcast-inspect rm: " << term_safe(msg) << "\n";
    if (c.json) {
      json j = doc("rm", false);
      j["dir"] = c.dir;
      j["exit_code"] = static_cast<int>(kExitRefused);
      j["error"] = msg;
      j["name"] = name;
      j["file"] = r.path;
      j["state"] = probe::state_name(r.state);
      j["participants_alive"] = alive_json(r.any_lock);
      j["forced"] = false;
      j["removed"] = false;
      print_json(j);
    }
    return kExitRefused;
  }
  const std::string err = remove_checked(r.path, r.inode, false);
  if (!err.empty()) return fail(c, "rm", kExitFailure, "cannot remove " + r.path + ": " + err);
  if (c.json) {
    json j = doc("rm");
    j["dir"] = c.dir;
    j["exit_code"] = 0;
    j["name"] = name;
    j["file"] = r.path;
    j["state"] = probe::state_name(r.state);
    j["participants_alive"] = alive_json(r.any_lock);
    j["forced"] = force && !refuse_why.empty();
    j["removed"] = true;
    print_json(j);
  } else {
    std::cout << "removed " << term_safe(r.path) << " (" << probe::state_name(r.state)
              << (force && !refuse_why.empty() ? ", forced: " + refuse_why : std::string()) << ")\n";
  }
  return kExitOk;
}

}  // namespace shmcast::inspect
