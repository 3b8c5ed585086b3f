// api/ (layer 6): the public Consumer, but for its reads: open (the
// region found, trusted, checked and mapped; its device slots fetched),
// wait_sync (the next sync's manifest copied and checked), skip, close and
// the getters. The reads are in consumer_read.cpp (host), consumer_device.cpp
// (device and staging), consumer_delta.cpp (delta syncs) and
// consumer_store.cpp (views); Consumer::Impl is consumer_impl.hpp.
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <iterator>
#include <memory>
#include <new>
#include <thread>

#include "api/consumer_impl.hpp"
#include "api/device_slots.hpp"
#include "base/checks.hpp"
#include "engine/cuda_vmm.hpp"
#include "engine/engine.hpp"
#include "protocol/manifest.hpp"
#include "protocol/ring.hpp"
#include "shm/doorbell.hpp"
#include "shm/liveness.hpp"
#include "shm/region.hpp"
#include "shmcast/shmcast.hpp"

namespace shmcast {

using namespace detail;
using State = Consumer::Impl::State;

void Consumer::Impl::close_quietly() noexcept {
  if (view.file().inherited()) {
    // A forked child's copy: the seat and the engines are the parent's.
    (void)cuda_engine.release();
    (void)host_engine.release();
    ring.reset();  // no side effects: leave() is never called here
    view.file().unmap();
    return;
  }
  if (!view.mapped()) return;
  try {
    if (cuda_engine) cuda_engine->drain();
  } catch (...) {
  }
  cuda_engine.reset();
  slot_mem.release();
  if (ring) ring->leave();
  ring.reset();
  if (pin.pinned) cuda_unpin(view.file().data() + view.geo().data_offset, view.file().size() - view.geo().data_offset);
  pin.pinned = false;
  view.file().unmap();
}

void Consumer::Impl::index_pieces() {
  by_rank.resize(info.world_size);  // the lists keep their memory from sync to sync
  for (auto& v : by_rank) v.clear();
  for (std::uint32_t t = 0; t < info.tensors.size(); ++t) {
    const auto& sh = info.tensors[t].shards;
    for (std::uint32_t k = 0; k < sh.size(); ++k)
      by_rank[sh[k].rank].push_back(PieceRef{sh[k].stream_offset, sh[k].wire_bytes, t, k});
  }
  // A rank's pieces come in stream order when its tensors are listed in
  // the order it packed them (every producer of one rank): no sort then.
  const auto by_offset = [](const PieceRef& a, const PieceRef& b) { return a.offset < b.offset; };
  for (auto& v : by_rank)
    if (!std::is_sorted(v.begin(), v.end(), by_offset)) std::sort(v.begin(), v.end(), by_offset);
}

Consumer::Consumer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Consumer::Consumer(Consumer&&) noexcept = default;
Consumer& Consumer::operator=(Consumer&&) noexcept = default;
Consumer::~Consumer() = default;

namespace {

// A region whose slots are GPU memory: fetch the allocation's fd from the
// producer's fd channel (its server checked, the message checked against
// the header), map it for this consumer's device, and make the CUDA engine
// that copies out of it. Everything that can make the region unreadable
// here fails now, with kUnsupported, never in the middle of a sync.
void open_device_slots(Consumer::Impl& m, const std::string& dir, const TrustPolicy& trust, std::int64_t deadline) {
  const DeviceSlotsFixed& d = m.device_slots;
  vmm::Uuid uuid;
  std::copy(std::begin(d.gpu_uuid), std::end(d.gpu_uuid), uuid.begin());
  const std::string what = "region '" + m.name + "' keeps its slots in the memory of GPU " + vmm::uuid_text(uuid);
  const char* fix = "; a consumer without that GPU needs a region of host slots (create the producer with "
                    "slot_memory = kHost, Python slot_memory=\"host\")";
  std::string why;
  if (!cuda_present(&why)) throw Error(Errc::kUnsupported, what + ", which this process cannot map: " + why + fix);
  int device = m.opts.device;
  try {
    if (device < 0) device = vmm::current_device();
  } catch (const Error& e) {
    throw Error(Errc::kUnsupported, what + ", which this process cannot map: " + e.what() + fix);
  }
  m.slot_mem = map_device_slots(m.view, d, dir, m.name, trust, deadline, device, "the producer");
  m.cuda_engine = make_cuda_consumer_engine(true, device);
}

}  // namespace

Consumer Consumer::open(std::string_view name, const ConsumerOptions& o) {
  const std::int64_t t0 = mono_ns();
  require_valid_name(name);
  const std::string dir = region_dir();
  const std::int64_t deadline = t0 + o.open_timeout.count();
  auto impl = std::make_unique<Impl>();
  impl->name = std::string(name);
  impl->opts = o;
  const TrustPolicy trust{o.group_access, o.trusted_uids};
  std::string waiting_for = "the region to appear";
  Errc waiting_code = Errc::kNotFound;
  for (;;) {
    try {
      MappedFile f = MappedFile::open(dir, name, true);
      // Another user's region is never read: its owner could hand us any
      // tensors, or cut the file under us.
      if (std::string distrust = trust_problem(f, trust); !distrust.empty())
        throw Error(Errc::kPermission, distrust);
      if (f.size() >= kHeaderBytes) {
        const Header& live = *reinterpret_cast<const Header*>(f.data());
        // init_state first (acquire), then the snapshot: when init_state
        // reads kInitReady the snapshot holds the producer's whole geometry.
        const std::uint32_t init = live.init_state.load(std::memory_order_acquire);
        const HeaderFixed snap = snapshot_header(f.data());
        // A creator that has allocated the file but not yet written its
        // header leaves it all zero: that is "being created", not corrupt.
        if ((snap.magic == kMagic || snap.magic == 0) && init == kInitCreating) {
          waiting_for = "the producer to finish creating the region";
          waiting_code = Errc::kNotFound;
        } else {
          const Geometry g = checked_geometry(f, snap);
          // A producer replacing a dead one holds the old file's byte 0
          // for a moment: that is not a live producer (a consumer that
          // joined the old file then got PeerDied, scripts/soak).
          const Alive a = producer_alive_for_join(f.fd(), live.producer);
          // A store region keeps its newest version for readers after its
          // producer closed or died: such a region is open for reading. One
          // whose producer died inside its record flip left the record torn:
          // the banks say what is kept.
          RecordSnapshot stored{};
          bool kept = false;
          if (g.store && init != kInitCreating) {
            if (read_record(live, &stored))
              kept = stored.version > 0;
            else if (a == Alive::kNo)
              kept = recover_store_record(f.data(), g, &stored);
          }
          if (!f.still_at_path()) {
            // Removed or replaced since it was opened (a takeover has just
            // finished, or the producer closed): the next look opens the path.
            waiting_for = init == kInitClosed ? "a new producer (the region was closed and removed)"
                                              : "a new producer (the region file was replaced)";
            waiting_code = init == kInitClosed ? Errc::kClosed : Errc::kPeerDied;
          } else if ((init == kInitReady && a != Alive::kNo) || kept) {
            impl->checksums = (snap.features & kFeatureChecksums) != 0;
            impl->delta_region = (snap.features & kFeatureDelta) != 0;
            // Delta syncs come from ring regions only (Producer::create
            // refuses a store region): anything else was crafted.
            if (impl->delta_region && g.store)
              throw Error(Errc::kCorrupt, f.path() + " claims delta syncs in a store region, which no shmcast "
                                          "producer makes: not opened");
            impl->device_slots = snapshot_device_slots(f.data());
            if (std::string bad = device_slots_problem(impl->device_slots, g, snap.features); !bad.empty())
              throw Error(Errc::kCorrupt, f.path() + ": " + bad + ": not opened");
            impl->view = RegionView(std::move(f), g);
            if (!g.device_slots) break;
            // Device slots: the fd from the producer's socket. A producer
            // that died, or was replaced, since the header was read is
            // waited for like a dead one (a new one may come by the deadline).
            try {
              open_device_slots(*impl, dir, trust, deadline);
              break;
            } catch (const Error& e) {
              const bool replaced = !impl->view.file().still_at_path();
              if (!(e.code() == Errc::kPeerDied || (e.code() == Errc::kCorrupt && replaced)) || mono_ns() >= deadline)
                throw;
              impl->view = RegionView();
              waiting_for = "a new producer (the region's producer died or was replaced while its device slots were "
                            "fetched)";
              waiting_code = Errc::kPeerDied;
            }
          } else {
            waiting_for = init == kInitClosed ? "a new producer (the region is closed)"
                          : lock_held(f.fd(), kTakeoverLockByte) == Alive::kYes
                              ? "a new producer (one is taking over the region: lock byte 129 is held)"
                              : "a new producer (the region's producer is dead)";
            waiting_code = init == kInitClosed ? Errc::kClosed : Errc::kPeerDied;
          }
        }
      } else {
        // The creator takes the producer lock as soon as the file exists,
        // then sets the whole size at once (posix_fallocate): size 0 is a
        // region being created, a short non-empty file was cut. (The size
        // seen at open may predate the allocation: re-read it.)
        // Held by its producer, not by a takeover of the stale file (§9).
        const bool held = lock_held(f.fd(), kProducerLockByte) == Alive::kYes &&
                          lock_held(f.fd(), kTakeoverLockByte) != Alive::kYes;
        const std::uint64_t size_now = f.size_now();
        if (size_now >= kHeaderBytes) {
          waiting_for = "the producer to allocate the region";  // it just did: look again
          waiting_code = Errc::kNotFound;
        } else if (size_now > 0) {
          const std::string cut = f.path() + " has " + std::to_string(size_now) +
                                  " bytes, less than a region header (truncated?)";
          if (held) throw Error(Errc::kCorrupt, cut + " while its producer is alive");
          waiting_for = "the producer to allocate the region (" + cut + ")";
          waiting_code = Errc::kCorrupt;
        } else {
          waiting_for = "the producer to allocate the region";
          waiting_code = Errc::kNotFound;
        }
      }
    } catch (const Error& e) {
      if (e.code() != Errc::kNotFound) throw;
    }
    if (mono_ns() >= deadline)
      throw Error(waiting_code, "gave up waiting for " + waiting_for + " at " + region_path(name) +
                                    ": is the producer running, with the same SHMCAST_DIR?");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  impl->ring.emplace(&impl->view);
  impl->ring->claim();
  impl->host_engine = make_host_consumer_engine();
  // A store region's versions are shared by every reader, so this process
  // maps them read-only: from its manifest areas (page-aligned) to the end,
  // the banks included; header and seats stay writable. A write through
  // views() then faults (SIGSEGV) instead of changing the kept version for
  // everyone (docs/reliability.md).
  MappedFile& file = impl->view.file();
  std::uint64_t read_only_from = file.size();
  if (impl->view.geo().store) {
    const std::uint64_t page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
    read_only_from = align_up(impl->view.geo().manifest_offset, page);
    if (const int rc = file.protect_from(read_only_from, false); rc != 0)
      throw Error(Errc::kSystem, "cannot map the store region's versions read-only (mprotect): " +
                                     std::string(std::strerror(-rc)), -rc);
    impl->read_only_views = true;
  }
  if (o.pin != Pin::kNo && !impl->view.geo().device_slots) {  // device slots: no slot bytes in the file
    // The slot data only: pinning the sparse manifest areas (docs/protocol.md
    // §2.1) would allocate them. read_only_from is then relative to it.
    const std::uint64_t data_at = impl->view.geo().data_offset;
    impl->pin = cuda_pin(file.data() + data_at, file.size() - data_at,
                         read_only_from > data_at ? read_only_from - data_at : 0);
    if (impl->pin.pinned && read_only_from < file.size() && !impl->pin.read_only) impl->read_only_views = false;
    if (!impl->pin.pinned && o.pin == Pin::kYes)
      throw Error(Errc::kCudaUnavailable, "cannot pin region '" + impl->name + "': " + impl->pin.why);
  }
  impl->open_s = static_cast<double>(mono_ns() - t0) * 1e-9;
  return Consumer(std::move(impl));
}

namespace {

// XXH3-64 of `len` bytes at `area`, read with pread 1 MiB at a time (bytes
// past the end of the file: hashed as zeros, as a short copy fails anyway).
std::uint64_t hash_of_area(const RegionView& view, const std::byte* area, std::uint64_t len) {
  struct State {
    XXH3_state_t* s = XXH3_createState();
    ~State() { XXH3_freeState(s); }
  } st;
  if (st.s == nullptr) throw std::bad_alloc();
  XXH3_64bits_reset(st.s);
  std::vector<std::byte> buf(std::min<std::uint64_t>(len, 1u << 20));
  for (std::uint64_t at = 0; at < len;) {
    const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(buf.size(), len - at));
    if (!view.copy_out(area + at, n, buf.data())) std::fill(buf.begin(), buf.end(), std::byte{0});
    XXH3_64bits_update(st.s, buf.data(), n);
    at += n;
  }
  return XXH3_64bits_digest(st.s);
}

// The next sync this consumer takes part in, its manifest copied and
// checked: m.info, state kManifest.
void next_sync(Consumer::Impl& m, std::int64_t deadline) {
  const Geometry& g = m.view.geo();
  RecordSnapshot rec{};
  auto corrupt = [&](const std::string& why) {
    m.ring->set_error(Errc::kCorrupt, why);
    return Error(Errc::kCorrupt, "sync " + std::to_string(rec.version) + " of '" + m.name + "': " + why);
  };
  auto kept_rewriting = [] {
    return Error(Errc::kTimeout, "the producer kept rewriting the manifest (syncs begun and aborted) until the "
                                 "timeout: no sync could be read");
  };
  std::vector<std::byte> bytes;
  for (;;) {
    rec = m.ring->wait_announce(m.last_version, deadline);
    // Refuse a file cut since it was mapped before touching the manifest or
    // slots (its missing pages would raise SIGBUS): docs/reliability.md.
    if (const std::uint64_t now = m.view.file().size_now(); now != g.total_bytes)
      throw Error(Errc::kCorrupt, "region file " + m.view.file().path() + " is " + std::to_string(now) +
                                      " bytes, not " + std::to_string(g.total_bytes) +
                                      ": another process truncated or resized it; open the region again");
    if (std::string bad = record_problem(rec, g); !bad.empty()) throw corrupt(bad);
    if (g.store) {
      if (rec.chunks != 1 || rec.stream_bytes > g.slot_bytes) throw corrupt("a store record must be one chunk of one bank");
      // Hold the bank, so the producer leaves it alone, before reading its
      // manifest; a bank already being replaced means a newer version.
      // A bank already being refilled means a newer version: wait for the
      // record to move on, then look again.
      if (!m.ring->hold(rec, deadline)) continue;
    }
    // pread, not the mapping (docs/protocol.md §2.1): bytes the producer
    // announced but never allocated read as zeros (and fail the hash)
    // instead of faulting. The header and entries are checked a window at
    // a time first: a size announced into the area's holes, or entries
    // that are not valid, cost no copy of up to kMaxManifestBytes.
    const std::byte* area = m.view.manifest_of(rec.first_seq);
    const std::string early = manifest_prefix_problem(
        [&](std::uint64_t off, std::size_t n, void* dst) { return m.view.copy_out(area + off, n, dst); },
        rec.manifest_used, rec.version, rec.stream_bytes);
    if (!early.empty() && (g.store || m.ring->record_unchanged(rec))) {
      m.ring->unhold();
      m.ring->check_seat();
      // Bytes that are not the producer's (their hash disagrees) are named
      // as such; the hash is taken 1 MiB at a time, nothing allocated for all.
      throw corrupt(hash_of_area(m.view, area, rec.manifest_used) != rec.manifest_hash
                        ? std::string("manifest bytes do not match their hash")
                        : early);
    }
    if (!early.empty()) {  // rewritten under us: look again
      if (mono_ns() >= deadline) throw kept_rewriting();
      continue;
    }
    bytes.resize(rec.manifest_used);
    if (!m.view.copy_out(area, bytes.size(), bytes.data()))
      throw corrupt("the region file ends inside the manifest (truncated)");
    // The manifest is covered by the record's seqlock: a producer that
    // aborted this sync and began the next may have rewritten it while we
    // copied. Then the copy is not corrupt, just stale: look again. (A held
    // store bank's manifest does not change.)
    if (!g.store && !m.ring->record_unchanged(rec)) {
      if (mono_ns() >= deadline) throw kept_rewriting();
      continue;
    }
    if (XXH3_64bits(bytes.data(), bytes.size()) != rec.manifest_hash) {
      m.ring->unhold();
      m.ring->check_seat();
      throw corrupt("manifest bytes do not match their hash");
    }
    break;
  }
  // From here an error lets go of a held store bank.
  struct Unhold {
    ConsumerRing* r;
    ~Unhold() {
      if (r) r->unhold();
    }
  } unhold_on_error{g.store ? &*m.ring : nullptr};
  SyncInfo& info = m.spare;
  std::string why = decode_manifest(bytes, rec.version, rec.stream_bytes, g.slot_bytes, &info, true,
                                    ManifestCheck::kFull, &m.names);
  if (why.empty() && info.world_size != g.world_size)
    why = "manifest of " + std::to_string(info.world_size) + " ranks in a region of " + std::to_string(g.world_size);
  if (why.empty() && !g.store && rec.chunks != sync_chunks(info.rank_bytes, g.slot_bytes))
    why = "chunk count disagrees with the ranks' sub-streams";
  if (why.empty() && g.store && info.world_size != 1) why = "a store version of several ranks";
  if (!why.empty()) throw corrupt(why);
  info.first_seq = rec.first_seq;
  info.chunks = rec.chunks;
  std::swap(m.info, m.spare);
  m.index_pieces();
  if (!g.store) {
    m.ring->ack(rec.version);
    // Chunks before this sync are not ours to read (earlier or aborted syncs).
    if (rec.first_seq > 1) m.ring->release(rec.first_seq - 1);
  }
  unhold_on_error.r = nullptr;
  m.last_version = rec.version;
  m.state = State::kManifest;
  if (m.info.delta() && !m.delta_region) {
    m.release_rest();  // never readable
    throw corrupt("a delta sync in a region created without deltas");
  }
}

}  // namespace

const SyncInfo& Consumer::wait_sync(Duration timeout) {
  Impl& m = *impl_;
  m.require_open();
  if (m.state != State::kIdle) m.release_rest();  // the previous sync was not read: skip it
  const std::int64_t deadline = mono_ns() + timeout.count();
  for (;;) {
    next_sync(m, deadline);
    if (!m.info.delta() || m.forwarding || m.holds(m.info.base_version)) return m.info;
    // A delta against a version this consumer's destinations do not hold (it
    // attached late, or skipped or failed a sync): never applied. It asks for
    // a full sync, lets this one go and waits for the next.
    m.request_full(m.info.version);
    m.release_rest();
  }
}
void Consumer::skip() {
  impl_->require_open();
  impl_->release_rest();
}
SyncReport Consumer::last_sync() const { return impl_->report; }
SlotMemory Consumer::slot_memory() const {
  return impl_->view.geo().device_slots ? SlotMemory::kDevice : SlotMemory::kHost;
}
bool Consumer::delta() const { return impl_->delta_region; }
void Consumer::forward_syncs() {
  impl_->require_open();
  impl_->forwarding = true;
}
void Consumer::request_full_sync() {
  Impl& m = *impl_;
  m.require_open();
  if (!m.delta_region) return;
  m.applied.clear();
  const std::uint64_t announced = m.view.header().sync.version.load(std::memory_order_acquire);
  m.request_full(std::max<std::uint64_t>({m.last_version, announced, 1}));
}

void Consumer::forget_destinations(const void* ptr, std::uint64_t bytes) {
  Impl& m = *impl_;
  m.require_open();
  m.forget({{reinterpret_cast<std::uintptr_t>(ptr), std::max<std::uint64_t>(bytes, 1)}});
}

const SyncInfo& Consumer::sync() const { return impl_->info; }
std::uint64_t Consumer::last_version() const { return impl_->last_version; }
RegionMode Consumer::mode() const { return impl_->view.geo().store ? RegionMode::kStore : RegionMode::kRing; }
std::uint64_t Consumer::slot_bytes() const { return impl_->view.geo().slot_bytes; }
int Consumer::seat() const { return impl_->ring ? impl_->ring->seat() : -1; }
const std::string& Consumer::name() const { return impl_->name; }
bool Consumer::pinned() const { return impl_->pin.pinned; }
double Consumer::pin_seconds() const { return impl_->pin.seconds; }
double Consumer::open_seconds() const { return impl_->open_s; }
void Consumer::close() {
  if (impl_) impl_->close_quietly();
}

}  // namespace shmcast
