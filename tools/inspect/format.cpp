#include "format.hpp"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <ctime>
#include <iostream>
#include <sstream>

namespace shmcast::inspect {

json doc(const std::string& command, bool ok) {
  json j;
  j["tool"] = "shmcast-inspect";
  j["schema"] = kSchemaVersion;
  j["command"] = command;
  j["ok"] = ok;
  return j;
}

std::string json_text(const json& j) { return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace); }

void print_json(const json& j) {
  std::cout << json_text(j) << "\n";
  std::cout.flush();
}

json alive_json(probe::Alive a) {
  switch (a) {
    case probe::Alive::kYes: return true;
    case probe::Alive::kNo: return false;
    default: return nullptr;
  }
}

const char* alive_word(probe::Alive a) {
  switch (a) {
    case probe::Alive::kYes: return "yes";
    case probe::Alive::kNo: return "no";
    default: return "?";
  }
}

std::string errc_text(std::uint32_t code) {
  if (code == 0) return "";
  return errc_name(static_cast<Errc>(code));
}

std::string hex64(std::uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%016" PRIx64, v);
  return buf;
}

std::string mode_text(std::uint32_t mode) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "%04o", static_cast<unsigned>(mode & 07777));
  return buf;
}

std::string seat_state_text(const probe::Seat& s) {
  if (s.state == probe::SeatState::kInvalid) return "invalid(" + std::to_string(s.state_raw) + ")";
  return probe::state_name(s.state);
}

std::string human_rate(double bps) {
  if (bps <= 0) return "0 B/s";
  return human_bytes(static_cast<std::uint64_t>(bps)) + "/s";
}

std::string human_age(double s) {
  char buf[64];
  if (s < 60)
    std::snprintf(buf, sizeof buf, "%.0fs", s);
  else if (s < 3600)
    std::snprintf(buf, sizeof buf, "%dm%02ds", static_cast<int>(s / 60), static_cast<int>(s) % 60);
  else if (s < 86400)
    std::snprintf(buf, sizeof buf, "%dh%02dm", static_cast<int>(s / 3600), static_cast<int>(s / 60) % 60);
  else
    std::snprintf(buf, sizeof buf, "%dd%02dh", static_cast<int>(s / 86400), static_cast<int>(s / 3600) % 24);
  return buf;
}

std::string unix_ns_text(std::uint64_t ns) {
  if (ns == 0) return "-";
  const std::time_t t = static_cast<std::time_t>(ns / 1000000000ull);
  struct tm tm {};
  if (::gmtime_r(&t, &tm) == nullptr) return "-";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%03uZ", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
                tm.tm_hour, tm.tm_min, tm.tm_sec, static_cast<unsigned>((ns / 1000000ull) % 1000));
  return buf;
}

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

std::string term_safe(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  auto esc = [&](unsigned char c) {
    char buf[8];
    std::snprintf(buf, sizeof buf, "\\x%02x", c);
    out += buf;
  };
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const std::size_t n = s.size();
  for (std::size_t i = 0; i < n;) {
    const unsigned char c = p[i];
    if (c < 0x20 || c == 0x7f) {
      esc(c);
      ++i;
      continue;
    }
    if (c < 0x80) {
      out += static_cast<char>(c);
      ++i;
      continue;
    }
    // Validate one UTF-8 sequence; reject overlongs, surrogates, > U+10FFFF
    // and the C1 controls (U+0080..U+009F), which terminals may obey.
    std::size_t len = 0;
    std::uint32_t cp = 0;
    if ((c & 0xe0) == 0xc0) {
      len = 2;
      cp = c & 0x1f;
    } else if ((c & 0xf0) == 0xe0) {
      len = 3;
      cp = c & 0x0f;
    } else if ((c & 0xf8) == 0xf0) {
      len = 4;
      cp = c & 0x07;
    }
    bool ok = len > 0 && i + len <= n;
    for (std::size_t k = 1; ok && k < len; ++k) {
      if ((p[i + k] & 0xc0) != 0x80)
        ok = false;
      else
        cp = (cp << 6) | (p[i + k] & 0x3f);
    }
    if (ok) {
      const std::uint32_t min_cp = len == 2 ? 0x80 : len == 3 ? 0x800 : 0x10000;
      if (cp < min_cp || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff) || (cp >= 0x80 && cp <= 0x9f)) ok = false;
    }
    if (!ok) {
      esc(c);
      ++i;
      continue;
    }
    out.append(s, i, len);
    i += len;
  }
  return out;
}

namespace {

std::size_t display_width(const std::string& s) {
  std::size_t w = 0;
  for (unsigned char c : s)
    if ((c & 0xc0) != 0x80) ++w;
  return w;
}

std::string ms_text(std::uint64_t ns) {
  if (ns == 0) return "-";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f ms", static_cast<double>(ns) * 1e-6);
  return buf;
}

json u64_or_null(bool have, std::uint64_t v) { return have ? json(v) : json(nullptr); }

const char* sync_kind(const probe::Manifest& m) { return m.delta() ? "delta" : "full"; }

// Where the slots live: "2 x 64 MiB in the region file (host slots)" or
// "2 x 64 MiB on GPU GPU-... (device slots, 128 MiB allocated)".
std::string slots_place_text(const probe::Region& r) {
  const std::string n = std::to_string(r.fixed.slot_count) + " x " + human_bytes(r.fixed.slot_bytes);
  if (r.slot_memory != SlotMemory::kDevice) return n + " in the region file (host slots)";
  return n + " on GPU " + r.slot_gpu_uuid + " (device slots, " + human_bytes(r.slot_device_bytes) + " allocated)";
}

// "full, 1.0 MiB payload" or "delta against version 4, 1.0 MiB logical, 10 KiB payload (1.0 %)".
std::string sync_size_text(const probe::Manifest& m) {
  if (!m.delta()) return "full, " + human_bytes(m.payload_bytes) + " payload";
  char pct[32] = "";
  if (m.logical_bytes > 0)
    std::snprintf(pct, sizeof pct, " (%.1f %%)",
                  100.0 * static_cast<double>(m.payload_bytes) / static_cast<double>(m.logical_bytes));
  return "delta against version " + std::to_string(m.base_version) + ", " + human_bytes(m.logical_bytes) +
         " logical, " + human_bytes(m.payload_bytes) + " payload" + pct;
}

}  // namespace

std::string owner_text(const probe::Owner& o) {
  if (!o.known) return "?";
  return "uid " + std::to_string(o.uid) + (o.user.empty() ? "" : " (" + o.user + ")") + ", gid " +
         std::to_string(o.gid) + (o.group.empty() ? "" : " (" + o.group + ")") + ", mode " + mode_text(o.mode) +
         (o.trusted ? "" : ", NOT TRUSTED");
}

json region_summary_json(const probe::Region& r) {
  json j;
  j["name"] = r.name;
  j["file"] = r.path;
  j["state"] = probe::state_name(r.state);
  j["reason"] = r.reason;
  j["file_type"] = r.file_type.empty() ? json(nullptr) : json(r.file_type);
  j["trusted"] = r.owner.known ? json(r.owner.trusted) : json(nullptr);
  if (r.owner.known) {
    json o;
    o["uid"] = r.owner.uid;
    o["user"] = r.owner.user.empty() ? json(nullptr) : json(r.owner.user);
    o["gid"] = r.owner.gid;
    o["group"] = r.owner.group.empty() ? json(nullptr) : json(r.owner.group);
    o["mode"] = mode_text(r.owner.mode);
    j["owner"] = o;
  } else {
    j["owner"] = nullptr;
  }
  j["size_bytes"] = r.size;
  j["age_s"] = static_cast<double>(static_cast<std::int64_t>(r.age_s * 1000)) / 1000.0;
  j["layout_version"] = r.have_fixed && r.fixed.shmcast_magic ? json(r.fixed.layout_version) : json(nullptr);
  // Where the slots live (layout 4): from the header, null without one.
  const bool dev = r.have_header && r.slot_memory == SlotMemory::kDevice;
  j["slot_memory"] = r.have_header ? json(probe::slot_memory_name(r.slot_memory)) : json(nullptr);
  j["slot_gpu_uuid"] = dev ? json(r.slot_gpu_uuid) : json(nullptr);
  j["slot_device_bytes"] = u64_or_null(dev, r.slot_device_bytes);
  j["participants_alive"] = alive_json(r.any_lock);
  json p;
  p["pid"] = r.have_header ? json(r.producer.pid) : json(nullptr);
  p["alive"] = (r.have_header || r.state == probe::State::kNewerVersion || r.state == probe::State::kOlderVersion)
                   ? alive_json(r.producer_alive)
                   : json(nullptr);
  j["producer"] = p;
  json c;
  c["attached"] = r.header_valid ? json(r.consumers_attached) : json(nullptr);
  c["alive"] = r.header_valid ? json(r.consumers_alive) : json(nullptr);
  c["max"] = r.header_valid ? json(r.fixed.max_consumers) : json(nullptr);
  j["consumers"] = c;
  j["sync_version"] = u64_or_null(r.header_valid && r.have_record, r.record.version);
  j["sync_status"] = r.header_valid ? json(probe::state_name(r.sync_status)) : json(nullptr);
  j["syncs_done"] = u64_or_null(r.have_header, r.syncs_done);
  j["bytes_done"] = u64_or_null(r.have_header, r.bytes_done);
  return j;
}

void region_detail_json(const probe::Region& r, std::size_t limit, json* out) {
  json& j = *out;
  j["region"] = region_summary_json(r);

  if (r.have_fixed && r.fixed.shmcast_magic) {
    const probe::FixedHeader& f = r.fixed;
    json h;
    h["magic"] = hex64(f.magic);
    h["layout_version"] = f.layout_version;
    h["header_bytes"] = f.header_bytes;
    h["total_bytes"] = f.total_bytes;
    h["features"] = hex64(f.features);
    json names = json::array();
    if (f.checksums) names.push_back("checksums");
    if (f.store) names.push_back("store");
    if (f.delta) names.push_back("delta");
    if (f.device_slots) names.push_back("device-slots");
    h["feature_names"] = names;
    h["max_consumers"] = f.max_consumers;
    h["slot_count"] = f.slot_count;
    h["slot_bytes"] = f.slot_bytes;
    h["seats_offset"] = f.seats_offset;
    h["slots_offset"] = f.slots_offset;
    h["manifest_offset"] = f.manifest_offset;
    h["manifest_bytes"] = f.manifest_bytes;
    h["data_offset"] = f.data_offset;
    h["created_unix_ns"] = f.created_unix_ns;
    const bool dev = r.have_header && r.slot_memory == SlotMemory::kDevice;
    h["slot_memory"] = r.have_header ? json(probe::slot_memory_name(r.slot_memory)) : json(nullptr);
    h["slot_gpu_uuid"] = dev ? json(r.slot_gpu_uuid) : json(nullptr);
    h["slot_device_bytes"] = u64_or_null(dev, r.slot_device_bytes);
    h["slot_socket"] = dev ? json(r.slot_socket) : json(nullptr);
    h["slot_socket_type"] = dev && !r.slot_socket_type.empty() ? json(r.slot_socket_type) : json(nullptr);
    h["valid"] = r.header_valid;
    h["init_state"] = r.have_header ? json(probe::state_name(r.init_state)) : json(nullptr);
    h["init_state_raw"] = u64_or_null(r.have_header, r.init_state_raw);
    h["generation"] = u64_or_null(r.have_header, r.generation);
    h["evictions"] = u64_or_null(r.have_header, r.evictions);
    h["published_seq"] = u64_or_null(r.have_header, r.published_seq);
    h["syncs_done"] = u64_or_null(r.have_header, r.syncs_done);
    h["bytes_done"] = u64_or_null(r.have_header, r.bytes_done);
    h["last_sync_ns"] = u64_or_null(r.have_header, r.last_sync_ns);
    h["last_end_unix_ns"] = u64_or_null(r.have_header, r.last_end_unix_ns);
    j["header"] = h;
  } else {
    j["header"] = nullptr;
  }

  json p;
  p["pid"] = u64_or_null(r.have_header, r.producer.pid);
  p["start_time"] = u64_or_null(r.have_header, r.producer.start_time);
  p["pidns"] = u64_or_null(r.have_header, r.producer.pidns);
  p["alive"] = (r.have_header || r.state == probe::State::kNewerVersion || r.state == probe::State::kOlderVersion)
                   ? alive_json(r.producer_alive)
                   : json(nullptr);
  p["error_code"] = u64_or_null(r.have_header, r.error_code);
  p["error_name"] = r.have_header ? json(errc_text(r.error_code)) : json(nullptr);
  p["error_text"] = r.have_header ? json(r.error_text) : json(nullptr);
  j["producer"] = p;

  if (r.header_valid && r.have_record) {
    const probe::SyncRecord& rec = r.record;
    json s;
    s["version"] = rec.version;
    s["status"] = probe::state_name(r.sync_status);
    s["first_seq"] = rec.first_seq;
    s["chunks"] = rec.chunks;
    s["chunks_published"] = r.chunks_published;
    s["stream_bytes"] = rec.stream_bytes;
    s["manifest_used"] = rec.manifest_used;
    s["manifest_hash"] = hex64(rec.manifest_hash);
    s["aborted"] = rec.aborted;
    s["record_stable"] = r.record.stable;
    s["record_recovered"] = r.record.recovered;
    j["sync"] = s;
  } else {
    j["sync"] = nullptr;
  }

  json seats = json::array();
  for (const probe::Seat& s : r.seats) {
    json e;
    e["index"] = s.index;
    e["state"] = seat_state_text(s);
    e["generation"] = s.generation;
    e["pid"] = s.consumer.pid;
    e["alive"] = alive_json(s.alive);
    e["attach_unix_ns"] = s.attach_unix_ns;
    e["enrolled"] = s.enrolled;
    e["first_seq"] = s.first_seq;
    e["first_version"] = s.first_version;
    e["released_seq"] = s.released_seq;
    e["hold_seq"] = s.hold_seq;
    e["acked_version"] = s.acked_version;
    e["lag_chunks"] = s.lag_chunks;
    e["syncs_done"] = s.syncs_done;
    e["bytes_done"] = s.bytes_done;
    e["error_code"] = s.error_code;
    e["error_name"] = errc_text(s.error_code);
    e["error_text"] = s.error_text;
    e["evict_reason"] = s.evict_reason;
    e["evict_reason_name"] = errc_text(s.evict_reason);
    seats.push_back(std::move(e));
  }
  j["seats"] = seats;

  json slots = json::array();
  for (const probe::Slot& s : r.slots) {
    json e;
    e["index"] = s.index;
    e["state"] = probe::state_name(s.state);
    e["seq"] = s.seq;
    e["version"] = s.version;
    e["bytes"] = s.bytes;
    e["holders"] = s.holders;
    e["checksum"] = hex64(s.checksum);
    slots.push_back(std::move(e));
  }
  j["slots"] = slots;
  if (r.have_fixed && r.fixed.shmcast_magic) j["mode"] = r.fixed.store ? "store" : "ring";

  json m;
  m["status"] = probe::state_name(r.header_valid ? r.manifest.status : probe::ManifestStatus::kNone);
  m["reason"] = r.header_valid ? r.manifest.reason : std::string("the header is not valid");
  const bool ok = r.header_valid && r.manifest.status == probe::ManifestStatus::kOk;
  const probe::Manifest& info = r.manifest;
  m["version"] = u64_or_null(ok, info.version);
  m["tensor_count"] = u64_or_null(ok, info.tensor_count);
  m["kind"] = ok ? json(sync_kind(info)) : json(nullptr);
  m["base_version"] = u64_or_null(ok, info.base_version);
  m["logical_bytes"] = u64_or_null(ok, info.logical_bytes);
  m["payload_bytes"] = u64_or_null(ok, info.payload_bytes);
  m["stream_bytes"] = u64_or_null(ok, info.stream_bytes);
  m["world_size"] = u64_or_null(ok, info.world_size);
  m["limit"] = limit;
  json tensors = json::array();
  std::size_t shown = 0;
  if (ok) {
    for (std::size_t i = 0; i < info.tensors.size(); ++i) {
      if (limit != 0 && shown >= limit) break;
      const TensorInfo& t = info.tensors[i];
      json e;
      e["index"] = i;
      e["name"] = t.name;
      e["dtype"] = std::string(dtype_name(t.dtype));
      e["shape"] = t.shape;
      e["nbytes"] = t.nbytes;
      e["stream_offset"] = t.stream_offset;
      json pieces = json::array();
      for (const ShardInfo& sh : t.shards) {
        json p;
        p["rank"] = sh.rank;
        p["dim"] = sh.dim;
        p["start"] = sh.start;
        p["length"] = sh.length;
        p["offset"] = sh.stream_offset;
        p["nbytes"] = sh.nbytes;
        p["wire_bytes"] = sh.wire_bytes;
        p["base_version"] = sh.base_version;
        pieces.push_back(std::move(p));
      }
      e["pieces"] = std::move(pieces);
      tensors.push_back(std::move(e));
      ++shown;
    }
  }
  m["shown"] = shown;
  m["truncated"] = ok && shown < info.tensor_count;
  m["tensors"] = tensors;
  j["manifest"] = m;

  json errors = json::array();
  if (r.have_header && r.error_code != 0) {
    json e;
    e["who"] = "producer";
    e["seat"] = nullptr;
    e["code"] = r.error_code;
    e["name"] = errc_text(r.error_code);
    e["text"] = r.error_text;
    errors.push_back(std::move(e));
  }
  for (const probe::Seat& s : r.seats) {
    if (s.error_code != 0) {
      json e;
      e["who"] = "consumer";
      e["seat"] = s.index;
      e["code"] = s.error_code;
      e["name"] = errc_text(s.error_code);
      e["text"] = s.error_text;
      errors.push_back(std::move(e));
    }
    if (s.state == probe::SeatState::kEvicted) {
      json e;
      e["who"] = "eviction";
      e["seat"] = s.index;
      e["code"] = s.evict_reason;
      e["name"] = errc_text(s.evict_reason);
      e["text"] = "the producer evicted consumer pid " + std::to_string(s.consumer.pid);
      errors.push_back(std::move(e));
    }
  }
  j["errors"] = errors;
}

// ---------------------------------------------------------------- tables

Table::Table(std::vector<std::string> head, std::vector<bool> right)
    : head_(std::move(head)), right_(std::move(right)) {
  right_.resize(head_.size(), false);
}

void Table::row(std::vector<std::string> cells) {
  cells.resize(head_.size());
  for (auto& c : cells) c = term_safe(c);
  rows_.push_back(std::move(cells));
}

void Table::print(std::ostream& os, const std::string& indent) const {
  std::vector<std::size_t> w(head_.size(), 0);
  for (std::size_t i = 0; i < head_.size(); ++i) w[i] = display_width(head_[i]);
  for (const auto& r : rows_)
    for (std::size_t i = 0; i < r.size(); ++i) w[i] = std::max(w[i], display_width(r[i]));
  auto line = [&](const std::vector<std::string>& cells) {
    std::string out = indent;
    for (std::size_t i = 0; i < cells.size(); ++i) {
      const std::size_t pad = w[i] - display_width(cells[i]);
      const bool last = i + 1 == cells.size();
      if (right_[i]) out.append(pad, ' ');
      out += cells[i];
      if (!right_[i] && !last) out.append(pad, ' ');
      if (!last) out += "  ";
    }
    while (!out.empty() && out.back() == ' ') out.pop_back();
    os << out << "\n";
  };
  line(head_);
  for (const auto& r : rows_) line(r);
}

// ---------------------------------------------------------------- show

void print_region_detail(std::ostream& os, const probe::Region& r, std::size_t limit) {
  Table kv({"FIELD", "VALUE"});
  kv.row({"region", r.name});
  kv.row({"file", r.path});
  kv.row({"state", probe::state_name(r.state) + (r.reason.empty() ? "" : " (" + r.reason + ")")});
  kv.row({"size", human_bytes(r.size) + " (" + std::to_string(r.size) + " bytes)"});
  if (r.owner.known) kv.row({"owner", owner_text(r.owner)});
  kv.row({"participants", r.any_lock == probe::Alive::kYes  ? "some alive"
                          : r.any_lock == probe::Alive::kNo ? "none alive"
                                                            : "?"});
  if (r.have_fixed && r.fixed.shmcast_magic) {
    const probe::FixedHeader& f = r.fixed;
    kv.row({"layout", "version " + std::to_string(f.layout_version) + (f.checksums ? ", checksums" : "") +
                          (f.store ? ", store" : "") + (f.delta ? ", delta syncs" : "") +
                          (f.device_slots ? ", device slots" : "")});
    kv.row({"mode", f.store ? "store (keeps the newest complete version; slots are its two banks)" : "ring"});
    kv.row({"geometry", std::to_string(f.max_consumers) + " seats, " + std::to_string(f.slot_count) + " slots x " +
                            human_bytes(f.slot_bytes) + ", manifest " + human_bytes(f.manifest_bytes)});
    if (r.have_header) kv.row({"slots", slots_place_text(r)});
    if (r.have_header && r.slot_memory == SlotMemory::kDevice)
      kv.row({"slot socket", r.slot_socket + " (" + (r.slot_socket_type.empty() ? "absent" : r.slot_socket_type) +
                                 ")"});
    kv.row({"created", unix_ns_text(f.created_unix_ns)});
  }
  if (r.have_header) {
    kv.row({"init_state", probe::state_name(r.init_state)});
    kv.row({"producer", "pid " + std::to_string(r.producer.pid) + ", alive " + alive_word(r.producer_alive) +
                            ", generation " + std::to_string(r.generation) + ", evictions " +
                            std::to_string(r.evictions)});
    kv.row({"totals", std::to_string(r.syncs_done) + " syncs, " + human_bytes(r.bytes_done) + ", last sync " +
                          ms_text(r.last_sync_ns) +
                          " ended " + unix_ns_text(r.last_end_unix_ns)});
    kv.row({"last error", r.error_code ? errc_text(r.error_code) + ": " + r.error_text : "none"});
  }
  if (r.header_valid && r.have_record) {
    const probe::SyncRecord& rec = r.record;
    kv.row({"sync", "version " + std::to_string(rec.version) + " (" + probe::state_name(r.sync_status) + ", " +
                        std::to_string(r.chunks_published) + "/" + std::to_string(rec.chunks) + " chunks), stream " +
                        human_bytes(rec.stream_bytes) + ", first chunk " + std::to_string(rec.first_seq) +
                        (rec.recovered ? "; record rebuilt from its bank (the producer died while announcing it)"
                                       : "")});
    // Its kind and sizes come from its manifest.
    const probe::Manifest& m = r.manifest;
    if (m.status == probe::ManifestStatus::kOk)
      kv.row({"sync kind", "version " + std::to_string(m.version) + ": " + sync_size_text(m)});
  }
  if (r.header_valid && r.fixed.store) {
    // Which versions the banks hold: complete ones (seq set), or one being written.
    std::string held;
    for (const probe::Slot& s : r.slots) {
      if (!held.empty()) held += "; ";
      held += "bank " + std::to_string(s.index) + ": ";
      held += s.seq != 0 ? "version " + std::to_string(s.version) + " (" + std::to_string(s.holders) + " readers)"
                         : (s.state == probe::SlotState::kEmpty ? std::string("empty") : std::string("being written"));
    }
    kv.row({"stored", held + (r.have_record ? "; newest " + std::to_string(r.record.version) : std::string())});
  }
  kv.print(os);

  if (!r.seats.empty()) {
    os << "\nSEATS\n";
    Table t({"IDX", "STATE", "PID", "ALIVE", "ENROLLED", "ACKED", "RELEASED", "LAG", "SYNCS", "BYTES", "ERROR",
             "EVICT"},
            {true, false, true, false, false, true, true, true, true, true, false, false});
    for (const probe::Seat& s : r.seats)
      t.row({std::to_string(s.index), seat_state_text(s), s.consumer.pid ? std::to_string(s.consumer.pid) : "-",
             alive_word(s.alive), s.enrolled ? "yes" : "no", std::to_string(s.acked_version),
             std::to_string(s.released_seq), std::to_string(s.lag_chunks), std::to_string(s.syncs_done),
             human_bytes(s.bytes_done), s.error_code ? errc_text(s.error_code) : "-",
             s.evict_reason ? errc_text(s.evict_reason) : "-"});
    t.print(os);
  }
  if (!r.slots.empty()) {
    os << "\nSLOTS\n";
    Table t({"IDX", "STATE", "SEQ", "VERSION", "BYTES", "HOLDERS"}, {true, false, true, true, true, true});
    for (const probe::Slot& s : r.slots)
      t.row({std::to_string(s.index), probe::state_name(s.state), std::to_string(s.seq), std::to_string(s.version),
             human_bytes(s.bytes), std::to_string(s.holders)});
    t.print(os);
  }
  if (r.header_valid) {
    const probe::Manifest& m = r.manifest;
    if (m.status == probe::ManifestStatus::kOk) {
      os << "\nMANIFEST  sync " << m.version << ": " << m.tensor_count << " tensors, " << sync_size_text(m) << ", "
         << human_bytes(m.stream_bytes) << " stream"
         << (m.world_size > 1 ? ", " + std::to_string(m.world_size) + " producer ranks" : std::string()) << "\n";
      // A delta sync: what each tensor's pieces took in the stream.
      std::vector<std::string> head{"#", "NAME", "DTYPE", "SHAPE", "BYTES", "OFFSET"};
      std::vector<bool> right{true, false, false, false, true, true};
      if (m.delta()) {
        head.insert(head.begin() + 5, "PAYLOAD");
        right.insert(right.begin() + 5, true);
      }
      Table t(head, right);
      std::size_t shown = 0;
      for (std::size_t i = 0; i < m.tensors.size(); ++i) {
        if (limit != 0 && shown >= limit) break;
        const TensorInfo& ti = m.tensors[i];
        std::vector<std::string> row{std::to_string(i), ti.name, std::string(dtype_name(ti.dtype)),
                                     shape_text(ti.shape), human_bytes(ti.nbytes), std::to_string(ti.stream_offset)};
        if (m.delta()) {
          std::uint64_t wire = 0;
          for (const ShardInfo& sh : ti.shards) wire += sh.wire_bytes;
          row.insert(row.begin() + 5, human_bytes(wire));
        }
        t.row(std::move(row));
        ++shown;
      }
      t.print(os);
      if (shown < m.tensor_count)
        os << "... " << (m.tensor_count - shown) << " more (use --limit 0 to show all)\n";
    } else {
      os << "\nMANIFEST  " << probe::state_name(m.status) << (m.reason.empty() ? "" : ": " + term_safe(m.reason))
         << "\n";
    }
  }
  std::vector<std::string> errs;
  for (const probe::Seat& s : r.seats) {
    if (s.error_code != 0)
      errs.push_back("seat " + std::to_string(s.index) + " (pid " + std::to_string(s.consumer.pid) + "): " +
                     errc_text(s.error_code) + ": " + s.error_text);
    if (s.state == probe::SeatState::kEvicted)
      errs.push_back("seat " + std::to_string(s.index) + " (pid " + std::to_string(s.consumer.pid) + "): evicted (" +
                     errc_text(s.evict_reason) + ")");
  }
  if (r.have_header && r.error_code != 0)
    errs.insert(errs.begin(), "producer: " + errc_text(r.error_code) + ": " + r.error_text);
  if (r.have_header) {
    os << "\nERRORS\n";
    if (errs.empty()) os << "  none\n";
    for (const std::string& e : errs) os << "  " << term_safe(e) << "\n";
  }
}

}  // namespace shmcast::inspect
