// The snapshot the read-only probe takes of one region (probe_region() of
// shmcast/probe.hpp, on shmcast-inspect's thread that probes): the file's
// kind, owner and times, then from private copies its header, lifecycle,
// sync record, seats and slot descriptors, each turned into the plain data
// of shmcast/probe.hpp; the manifest is manifest_stream.cpp's. The work is
// done among the library's own types; the public function at the end hands
// out the copy.
#include <sys/mman.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>

#include "base/checks.hpp"
#include "base/layout.hpp"
#include "base/text.hpp"
#include "probe/bus_guard.hpp"
#include "probe/file.hpp"
#include "probe/manifest_stream.hpp"
#include "probe/record.hpp"
#include "protocol/fd_channel.hpp"
#include "protocol/ring.hpp"
#include "shm/liveness.hpp"
#include "shm/region.hpp"
#include "shmcast/probe.hpp"

namespace shmcast::detail::probe_impl {

namespace {

using probe_impl::pub;  // pub(Alive), file.hpp, beside the overloads below

// ---------------------------------------------------------------- plain copies

P::Identity pub(const Identity& id) {
  P::Identity out;
  out.pid = id.pid.load(std::memory_order_relaxed);
  out.start_time = id.start_time.load(std::memory_order_relaxed);
  out.pidns = id.pidns.load(std::memory_order_relaxed);
  return out;
}

P::FixedHeader pub(const HeaderFixed& f) {
  P::FixedHeader h;
  h.magic = f.magic;
  h.shmcast_magic = f.magic == kMagic;
  h.layout_version = f.layout_version;
  h.header_bytes = f.header_bytes;
  h.total_bytes = f.total_bytes;
  h.features = f.features;
  h.checksums = (f.features & kFeatureChecksums) != 0;
  h.store = (f.features & kFeatureStore) != 0;
  h.delta = (f.features & kFeatureDelta) != 0;
  h.device_slots = (f.features & kFeatureDeviceSlots) != 0;
  h.max_consumers = f.max_consumers;
  h.slot_count = f.slot_count;
  h.slot_bytes = f.slot_bytes;
  h.seats_offset = f.seats_offset;
  h.slots_offset = f.slots_offset;
  h.manifest_offset = f.manifest_offset;
  h.manifest_bytes = f.manifest_bytes;
  h.data_offset = f.data_offset;
  h.world_size = f.world_size;
  h.ranks_offset = f.ranks_offset;
  h.created_unix_ns = f.created_unix_ns;
  return h;
}

P::SyncRecord pub(const RecordSnapshot& r, bool stable) {
  P::SyncRecord out;
  out.stable = stable;
  out.version = r.version;
  out.first_seq = r.first_seq;
  out.chunks = r.chunks;
  out.stream_bytes = r.stream_bytes;
  out.manifest_used = r.manifest_used;
  out.manifest_hash = r.manifest_hash;
  out.aborted = r.aborted;
  return out;
}

P::InitState init_state_of(std::uint32_t s) {
  switch (s) {
    case kInitCreating: return P::InitState::kCreating;
    case kInitReady: return P::InitState::kReady;
    case kInitClosed: return P::InitState::kClosed;
    default: return P::InitState::kInvalid;
  }
}

P::SeatState seat_state_of(std::uint32_t s) {
  switch (s) {
    case kSeatFree: return P::SeatState::kFree;
    case kSeatActive: return P::SeatState::kActive;
    case kSeatEvicted: return P::SeatState::kEvicted;
    default: return P::SeatState::kInvalid;
  }
}

// ---------------------------------------------------------------- file times and owner

std::int64_t now_unix_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void set_times(P::Region* r, const struct stat& st, const P::Options& opts) {
  const std::int64_t c = std::int64_t{st.st_ctim.tv_sec} * 1000000000 + st.st_ctim.tv_nsec;
  const std::int64_t m = std::int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec;
  const std::int64_t last = std::max(c, m);
  const std::int64_t age = now_unix_ns() - last;
  r->age_s = age > 0 ? static_cast<double>(age) * 1e-9 : 0.0;
  r->young = r->age_s < opts.grace_s;
  r->size = static_cast<std::uint64_t>(st.st_size);
  r->inode = st.st_ino;
}

void fill_owner(P::Region* r, const struct stat& st) {
  r->owner = owner_of(st);
  r->file_type = file_kind(st.st_mode).name;
}

// ---------------------------------------------------------------- probe

// Seats, slot descriptors and the sync record of a region whose header was
// validated (geometry `g`), from private copies. False when the file shrank.
bool read_tables(P::Region& r, const Geometry& g, int fd, const std::byte* base, std::uint64_t size) {
  const std::uint64_t seats_len = std::uint64_t{g.max_consumers} * kSeatBytes;
  const std::uint64_t slots_len = std::uint64_t{g.slot_count} * kSlotDescBytes;
  if (g.seats_offset + seats_len > size || g.slots_offset + slots_len > size) {
    r.state = P::State::kCorrupt;
    r.reason = "seat or slot tables run past the end of the file";
    return false;
  }
  AlignedBytes sbuf(seats_len), dbuf(slots_len);
  if (!guarded_copy(sbuf.data(), base + g.seats_offset, seats_len) ||
      !guarded_copy(dbuf.data(), base + g.slots_offset, slots_len)) {
    r.state = P::State::kTruncated;
    r.reason = "the file shrank while it was read";
    return false;
  }

  // The sync record, under its seqlock, from the live header.
  RecordSnapshot rec{};
  bool stable = false, recovered = false;
  r.have_record = read_record_or_recover(reinterpret_cast<const Header*>(base), g,
                                         r.producer_alive == P::Alive::kNo, &rec, &stable, &recovered);
  if (r.have_record) {
    r.record = pub(rec, stable);
    r.record.recovered = recovered;
  }
  if (!r.have_record) {
    r.sync_status = P::SyncStatus::kUnknown;
  } else if (rec.version == 0) {
    r.sync_status = P::SyncStatus::kNone;
  } else if (rec.aborted) {
    r.sync_status = P::SyncStatus::kAborted;
  } else if (rec.chunks == 0 || (rec.first_seq > 0 && r.published_seq >= rec.first_seq + rec.chunks - 1)) {
    r.sync_status = P::SyncStatus::kPublished;
  } else {
    r.sync_status = P::SyncStatus::kWriting;
  }
  if (r.have_record && rec.first_seq > 0 && r.published_seq >= rec.first_seq)
    r.chunks_published = std::min(r.published_seq - rec.first_seq + 1, rec.chunks);

  r.seats.reserve(g.max_consumers);
  for (std::uint32_t i = 0; i < g.max_consumers; ++i) {
    const Seat& s = *reinterpret_cast<const Seat*>(sbuf.data() + std::uint64_t{i} * kSeatBytes);
    P::Seat sr;
    sr.index = i;
    sr.word = s.word.load(std::memory_order_relaxed);
    sr.state_raw = seat_state(sr.word);
    sr.state = seat_state_of(sr.state_raw);
    sr.generation = seat_gen(sr.word);
    sr.consumer = pub(s.consumer);
    sr.alive = pub(lock_held(fd, seat_lock_byte(i)));
    sr.attach_unix_ns = s.attach_unix_ns.load(std::memory_order_relaxed);
    sr.released_seq = s.released_seq.load(std::memory_order_relaxed);
    sr.hold_seq = s.hold_seq.load(std::memory_order_relaxed);
    sr.acked_version = s.acked_version.load(std::memory_order_relaxed);
    sr.syncs_done = s.syncs_done.load(std::memory_order_relaxed);
    sr.bytes_done = s.bytes_done.load(std::memory_order_relaxed);
    sr.error_code = s.error_code.load(std::memory_order_relaxed);
    sr.error_text = read_error_text(s.error_text);
    sr.included_gen = s.included_gen.load(std::memory_order_relaxed);
    sr.first_seq = s.first_seq.load(std::memory_order_relaxed);
    sr.first_version = s.first_version.load(std::memory_order_relaxed);
    sr.evict_reason = s.evict_reason.load(std::memory_order_relaxed);
    const bool active = sr.state_raw == kSeatActive;
    sr.enrolled = active && sr.included_gen == sr.generation;
    if (active) {
      ++r.consumers_attached;
      if (sr.alive == P::Alive::kYes) ++r.consumers_alive;
    }
    if (sr.enrolled && sr.alive != P::Alive::kNo) {
      const std::uint64_t done = std::max(sr.released_seq, sr.first_seq > 0 ? sr.first_seq - 1 : 0);
      sr.lag_chunks = r.published_seq > done ? r.published_seq - done : 0;
    }
    r.seats.push_back(std::move(sr));
  }

  r.slots.reserve(g.slot_count);
  for (std::uint32_t k = 0; k < g.slot_count; ++k) {
    const SlotDesc& d = *reinterpret_cast<const SlotDesc*>(dbuf.data() + std::uint64_t{k} * kSlotDescBytes);
    P::Slot sl;
    sl.index = k;
    sl.seq = d.seq.load(std::memory_order_relaxed);
    sl.version = d.version.load(std::memory_order_relaxed);
    sl.bytes = d.bytes.load(std::memory_order_relaxed);
    sl.checksum = d.checksum.load(std::memory_order_relaxed);
    if (sl.seq == 0) {
      sl.state = (sl.version == 0 && sl.bytes == 0) ? P::SlotState::kEmpty : P::SlotState::kFilling;
    } else {
      for (const P::Seat& s : r.seats) {
        if (s.alive == P::Alive::kNo) continue;
        if (r.fixed.store ? s.state == P::SeatState::kActive && s.hold_seq == sl.seq  // a reader holds the version
                          : s.enrolled && s.first_seq <= sl.seq && s.released_seq < sl.seq)
          ++sl.holders;
      }
      sl.state = sl.holders > 0 ? P::SlotState::kHeld : P::SlotState::kReleased;
    }
    r.slots.push_back(std::move(sl));
  }
  return true;
}

// The device-slots block as the header holds it (validated later), and
// what lies at the name of the region's slot socket (lstat: never followed,
// never opened or connected to).
void fill_device_slots(P::Region* r, const std::string& dir, std::string_view name, const DeviceSlotsFixed& d) {
  r->slot_memory = SlotMemory::kDevice;
  r->slot_gpu_uuid = gpu_uuid_text(d.gpu_uuid);
  r->slot_device_bytes = d.alloc_bytes;
  r->slot_socket = slot_socket_file(dir, name);
  struct stat st {};
  if (::lstat(r->slot_socket.c_str(), &st) == 0) r->slot_socket_type = file_kind(st.st_mode).name;
}

P::Region probe_region(const std::string& dir, std::string_view name, const P::Options& opts) {
  P::Region r;
  r.name = std::string(name);
  r.path = region_file(dir, name);
  // The report with its state and the reason for it.
  auto verdict = [&r](P::State state, std::string why) {
    r.state = state;
    r.reason = std::move(why);
    return r;
  };

  // lstat first, so that a symlink, FIFO or device is reported without
  // being opened at all; the descriptor's fstat below is what counts.
  struct stat lst {};
  if (::lstat(r.path.c_str(), &lst) != 0) {
    const int e = errno;
    if (e == ENOENT) throw Error(Errc::kNotFound, "no region at " + r.path, e);
    return verdict(P::State::kUnreadable, std::string("lstat: ") + std::strerror(e));
  }
  set_times(&r, lst, opts);
  fill_owner(&r, lst);
  auto not_regular = [&](const struct stat& st) {
    fill_owner(&r, st);
    return verdict(P::State::kForeign, file_kind(st.st_mode).phrase);
  };
  if (!S_ISREG(lst.st_mode)) return not_regular(lst);
  const std::string bad = validate_name(name);
  if (!bad.empty()) {
    r.valid_name = false;
    return verdict(P::State::kForeign, "file name is not a valid region name: " + bad);
  }
  auto untrusted = [&](const std::string& why) {
    return verdict(P::State::kUntrustedOwner, why + "; its contents are not read");
  };
  if (!r.owner.trusted) return untrusted(r.owner.trust_problem);

  ReadOnlyMap f;
  struct stat st {};
  int err = 0;
  f.fd = open_region_file(r.path, &st, &err);
  if (f.fd < 0) {
    if (err == ENOENT) throw Error(Errc::kNotFound, "no region at " + r.path, err);
    if (err == 0) return not_regular(st);  // swapped under the name since the lstat
    struct stat again {};
    if ((err == ELOOP || err == ENXIO) && ::lstat(r.path.c_str(), &again) == 0 && !S_ISREG(again.st_mode))
      return not_regular(again);
    return verdict(P::State::kUnreadable, "cannot open " + r.path + ": " + std::strerror(err));
  }
  set_times(&r, st, opts);
  fill_owner(&r, st);
  if (!r.owner.trusted) return untrusted(r.owner.trust_problem);
  r.any_lock = pub(any_lock_held(f.fd));
  const std::uint64_t size = static_cast<std::uint64_t>(st.st_size);
  r.size = size;
  if (size > 0) {
    void* m = ::mmap(nullptr, static_cast<std::size_t>(size), PROT_READ, MAP_SHARED, f.fd, 0);
    if (m == MAP_FAILED)
      return verdict(P::State::kUnreadable, std::string("cannot map ") + r.path + ": " + std::strerror(errno));
    f.base = static_cast<const std::byte*>(m);
    f.len = static_cast<std::size_t>(size);
  }
  const std::byte* base = f.base;

  if (size == 0) {
    if (r.young || r.any_lock == P::Alive::kYes)
      return verdict(P::State::kCreating, "the file is empty: its creator has not allocated it yet");
    return verdict(P::State::kTruncated, "the file is empty");
  }
  if (size < sizeof(std::uint64_t))
    return verdict(P::State::kTruncated, printf_u64("the file has %llu bytes, too few for a header", size));

  AlignedBytes hbuf(kHeaderBytes);
  const std::size_t hn = static_cast<std::size_t>(std::min<std::uint64_t>(size, kHeaderBytes));
  if (!guarded_copy(hbuf.data(), base, hn)) return verdict(P::State::kTruncated, "the file shrank while it was read");
  std::uint64_t magic = 0;
  std::memcpy(&magic, hbuf.data(), sizeof magic);
  std::uint32_t init_raw = 0;
  if (hn >= offsetof(Header, init_state) + sizeof(std::uint32_t))
    std::memcpy(&init_raw, hbuf.data() + offsetof(Header, init_state), sizeof init_raw);
  HeaderFixed fixed{};
  if (size >= sizeof(HeaderFixed)) {
    r.have_fixed = true;
    std::memcpy(&fixed, hbuf.data(), sizeof fixed);
    r.fixed = pub(fixed);
  }

  if (magic != kMagic) {
    if (magic == 0 && init_raw == kInitCreating) {
      // A creator allocates the file (all zeros), takes its lock, then
      // writes the header: this is one that has not got that far.
      if (r.young || r.any_lock == P::Alive::kYes) return verdict(P::State::kCreating, "the header is not written yet");
      if (size < kHeaderBytes)  // creators allocate the whole file first: this is not one
        return verdict(P::State::kTruncated, printf_u64("the file has %llu bytes of zeros, fewer than the %llu-byte "
                                                        "header", size, kHeaderBytes));
      return verdict(P::State::kDead, "the header was never written: its creator died while creating it");
    }
    return verdict(P::State::kForeign, printf_u64("not a shmcast region (magic 0x%016llx)", magic));
  }
  const std::string too_short =
      printf_u64("the file has %llu bytes, fewer than the %llu-byte header", size, kHeaderBytes);
  if (!r.have_fixed) return verdict(P::State::kTruncated, too_short);
  if (fixed.layout_version != kLayoutVersion) {
    r.state = fixed.layout_version > kLayoutVersion ? P::State::kNewerVersion : P::State::kOlderVersion;
    r.reason = printf_u64("layout version %llu; this tool reads version %llu", fixed.layout_version, kLayoutVersion);
    // Byte 0 is the producer's lock byte in every layout so far; informative only.
    r.producer_alive = pub(lock_held(f.fd, kProducerLockByte));
    return r;
  }
  if (size < kHeaderBytes) return verdict(P::State::kTruncated, too_short);

  // ---- our magic and version, a whole header: read the lifecycle fields
  // from the private copy.
  const Header& h = *reinterpret_cast<const Header*>(hbuf.data());
  r.have_header = true;
  r.init_state_raw = init_raw;
  r.init_state = init_state_of(init_raw);
  r.error_code = h.error_code.load(std::memory_order_relaxed);
  r.error_text = read_error_text(h.error_text);
  r.producer = pub(h.producer);
  r.generation = h.generation.load(std::memory_order_relaxed);
  r.evictions = h.evictions.load(std::memory_order_relaxed);
  r.published_seq = h.published_seq.load(std::memory_order_relaxed);
  r.syncs_done = h.syncs_done.load(std::memory_order_relaxed);
  r.bytes_done = h.bytes_done.load(std::memory_order_relaxed);
  r.last_sync_ns = h.last_sync_ns.load(std::memory_order_relaxed);
  r.last_end_unix_ns = h.last_end_unix_ns.load(std::memory_order_relaxed);
  r.producer_alive = pub(peer_alive(f.fd, kProducerLockByte, h.producer));
  DeviceSlotsFixed dev{};
  std::memcpy(&dev, hbuf.data() + offsetof(Header, device_slots), sizeof dev);
  if (r.fixed.device_slots) fill_device_slots(&r, dir, name, dev);

  if (init_raw == kInitCreating) {
    if (r.young || r.producer_alive == P::Alive::kYes)
      return verdict(P::State::kCreating, "the producer is still initialising the header");
    return verdict(P::State::kDead, "initialisation never finished: its creator died while creating it");
  }
  if (fixed.total_bytes != size)
    return verdict(P::State::kTruncated,
                   printf_u64("the header says %llu bytes but the file has %llu", fixed.total_bytes, size));
  bool version_mismatch = false;
  if (std::string why = validate_header(fixed, size, &version_mismatch); !why.empty())
    return verdict(P::State::kCorrupt, why);
  if (init_raw != kInitReady && init_raw != kInitClosed)
    return verdict(P::State::kCorrupt, printf_u64("init_state is %llu (expected 0, 1 or 2)", init_raw));
  Geometry g{};
  if (!compute_geometry(fixed.max_consumers, fixed.slot_count, fixed.slot_bytes, fixed.manifest_bytes, &g,
                       fixed.world_size, (fixed.features & kFeatureStore) != 0,
                       (fixed.features & kFeatureDeviceSlots) != 0).empty() ||
      g.total_bytes != size)
    return verdict(P::State::kCorrupt, "geometry does not match the file");
  if (std::string why = device_slots_problem(dev, g, fixed.features); !why.empty())
    return verdict(P::State::kCorrupt, why);
  r.header_valid = true;
  if (init_raw == kInitClosed) {
    r.state = P::State::kClosed;
    r.reason = "the producer closed the region";
  } else if (r.producer_alive == P::Alive::kNo) {
    r.state = P::State::kDead;
    r.reason = "producer pid " + std::to_string(r.producer.pid) + " is gone";
  } else {
    r.state = P::State::kReady;
    if (r.producer_alive == P::Alive::kUnknown) r.reason = "producer liveness unknown (lock probe failed)";
  }

  if (!read_tables(r, g, f.fd, base, size)) {
    r.header_valid = false;
    return r;
  }
  if (opts.decode_manifest)
    decode_current_manifest(&r, g, f.fd, base, size, opts.manifest_limit);
  else
    r.manifest.status = P::ManifestStatus::kSkipped;
  return r;
}

}  // namespace

}  // namespace shmcast::detail::probe_impl

namespace shmcast::probe {

Region probe_region(const std::string& dir, std::string_view name, const Options& options) {
  return detail::probe_impl::probe_region(dir, name, options);
}

}  // namespace shmcast::probe
