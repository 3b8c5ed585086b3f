// api/ (layer 6): a producer's region from create to close. create()
// checks the options, picks the engine, and then rank 0 creates the region
// (taking over a stale one whose producer is dead) while ranks 1.. of a
// sharded producer attach to rank 0's; close (close_quietly) marks the
// region closed, or a rank leaves its seat. Runs on the caller's thread.
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>

#include <cerrno>
#include <cstring>
#include <thread>

#include "api/device_slots.hpp"
#include "api/producer_impl.hpp"
#include "base/checks.hpp"
#include "engine/engine.hpp"
#include "protocol/ring.hpp"
#include "protocol/rounds.hpp"
#include "shm/doorbell.hpp"
#include "shm/liveness.hpp"
#include "shm/region.hpp"
#include "shmcast/shmcast.hpp"

namespace shmcast {

using namespace detail;

// A region of this name exists. Takes it over when its producer is proven
// dead (its lock byte is free and we now hold it, so no one can revive it),
// by removing the name; throws kExists or kPermission when it is alive, not
// ours, or its liveness cannot be told. Returns false when the name vanished.
// While it holds byte 0 of the old file it also holds kTakeoverLockByte
// (taken first, released last), so a rank attaching meanwhile never takes
// this lock for a live rank 0 (attach_rank). `before_unlink` (tests): runs
// with both locks held, just before the name is removed.
bool detail::take_over_stale(const std::string& dir, std::string_view name, bool replace_stale, bool group_access,
                             const std::function<void()>& before_unlink) {
  MappedFile old;
  try {
    old = MappedFile::open_unmapped(dir, name, true);  // read-write: the lock probe below takes the lock
  } catch (const Error& e) {
    if (e.code() == Errc::kNotFound) return false;
    throw Error(e.code() == Errc::kPermission ? Errc::kPermission : Errc::kExists,
                "region '" + std::string(name) + "' exists but cannot be inspected, so it is left alone: " + e.what());
  }
  const std::string why = trust_problem(old, TrustPolicy{group_access, {}});
  if (!why.empty()) throw Error(Errc::kPermission, why + "; pick another region name, or have its owner remove it");
  if (!replace_stale) {
    // Nothing to take over: the locks would only make consumers opening the
    // name meanwhile wait (they read a held takeover byte as a replacement).
    if (lock_held(old.fd(), kProducerLockByte) != Alive::kNo)
      throw Error(Errc::kExists, "region '" + std::string(name) + "' in " + dir +
                                     " belongs to a live producer (or its liveness cannot be checked): pick another "
                                     "name, or stop that producer");
    throw Error(Errc::kExists, "region '" + std::string(name) + "' exists (its producer is gone); remove it with "
                               "`shmcast-inspect rm " + std::string(name) + "` or set replace_stale");
  }
  int rc = lock_byte(old.fd(), kTakeoverLockByte);
  if (rc == -EAGAIN)
    throw Error(Errc::kExists, "region '" + std::string(name) + "' in " + dir +
                                   " is being taken over by another producer right now: pick another name, or stop "
                                   "that producer");
  if (rc == 0) rc = lock_byte(old.fd(), kProducerLockByte);
  if (rc == -EAGAIN)
    throw Error(Errc::kExists, "region '" + std::string(name) + "' in " + dir +
                                   " belongs to a live producer: pick another name, or stop that producer");
  if (rc != 0)
    throw Error(Errc::kExists, "region '" + std::string(name) + "' exists and the liveness of its producer cannot be "
                               "checked (" + std::strerror(-rc) + "): it is left alone; remove it with "
                               "`shmcast-inspect rm " + std::string(name) + "` if it is dead");
  // The old producer is dead: take the name over. Attached consumers keep
  // the old mapping, see the producer died, and reopen.
  if (before_unlink) before_unlink();
  if (!old.unlink_if_same() && old.still_at_path())
    throw Error(Errc::kPermission, "cannot replace stale region " + old.path() + ": " + std::strerror(errno), errno);
  return true;
}

namespace {

// A random 64-bit value (getrandom(2); the clock and pid when it fails).
std::uint64_t random_u64() {
  std::uint64_t v = 0;
  if (::getrandom(&v, sizeof v, 0) == static_cast<ssize_t>(sizeof v)) return v;
  return static_cast<std::uint64_t>(unix_ns()) ^ (static_cast<std::uint64_t>(::getpid()) << 32);
}

void init_header(RegionView& v, std::uint64_t features, const DeviceSlotsFixed* dev = nullptr) {
  Header& hdr = v.header();
  // The file is fresh from posix_fallocate, so every byte is zero already:
  // write the fixed header and the producer's identity, flip init_state last.
  hdr.fixed = make_fixed_header(v.geo(), features);
  if (dev != nullptr) hdr.device_slots = *dev;
  hdr.fixed.created_unix_ns = static_cast<std::uint64_t>(unix_ns());
  write_identity(hdr.producer, self_identity());
  hdr.generation.store(1, std::memory_order_relaxed);
  if (v.geo().world_size > 1) {
    RankSeat& rs = v.rank_seat(0);
    write_identity(rs.who, self_identity());
    rs.attach_unix_ns.store(static_cast<std::uint64_t>(unix_ns()), std::memory_order_relaxed);
    rs.word.store(make_seat_word(1, kSeatActive), std::memory_order_relaxed);
  }
  std::atomic_thread_fence(std::memory_order_release);
  hdr.init_state.store(kInitReady, std::memory_order_release);
}

}  // namespace

namespace {

// Why `f` (a ready region, header `h`) is not one a rank may join, or "":
// its rank 0 must hold lock byte 0 while no takeover holds
// kTakeoverLockByte, and the file must still be the one at the path. In
// that order: a takeover locks the takeover byte before byte 0 and removes
// the name before it lets go of either, so byte 0 held and then the
// takeover byte free means byte 0 is rank 0's own, or the takeover has
// finished, and then the path names another file.
std::string live_region_problem(const MappedFile& f, const Header& h) {
  if (producer_alive_for_join(f.fd(), h.producer) == Alive::kNo)
    return lock_held(f.fd(), kTakeoverLockByte) == Alive::kYes
               ? "rank 0 to finish replacing the region (a new rank 0 is taking over the stale one)"
               : "a live rank 0 (the region's rank 0 is dead)";
  if (!f.still_at_path()) return "rank 0 to create the region again (this file was removed or replaced)";
  return "";
}

// Rank r >= 1 of a region with device slots: fetches rank 0's allocation
// over its fd channel (rank 0 is the server: same uid, its pid when this
// rank shares its PID namespace) and maps it for this rank's device
// (slot_device, or the current device), which must be rank 0's GPU or reach
// it by peer access (else kUnsupported).
void import_rank_slots(Producer::Impl* m, const std::string& dir, std::string_view name, const ProducerOptions& o,
                       std::int64_t deadline) {
  const DeviceSlotsFixed d = snapshot_device_slots(m->view.file().data());
  const std::uint64_t features = snapshot_header(m->view.file().data()).features;
  if (std::string bad = device_slots_problem(d, m->view.geo(), features); !bad.empty())
    throw Error(Errc::kCorrupt, m->path + ": " + bad);
  const int device = o.slot_device >= 0 ? o.slot_device : vmm::current_device();
  m->slot_mem =
      map_device_slots(m->view, d, dir, name, TrustPolicy{o.group_access, {}}, deadline, device, "rank 0");
}

// Rank r >= 1 of a sharded producer: attaches to the region rank 0 created,
// a live one: the file at the path whose rank 0 holds its lock (not a stale
// file a new rank 0 is replacing), checked again once this rank holds its
// own lock byte; else it waits and opens the path again, up to rank_timeout.
Producer::Impl* attach_rank(Producer::Impl* m, std::string_view name, const ProducerOptions& o) {
  const std::string dir = region_dir();
  const std::int64_t deadline = mono_ns() + o.rank_timeout.count();
  std::string waiting = "the region to appear";
  for (;;) {
    try {
      MappedFile f = MappedFile::open(dir, name, true);
      if (std::string why = trust_problem(f, TrustPolicy{o.group_access, {}}); !why.empty())
        throw Error(Errc::kPermission, why);
      if (f.size() >= kHeaderBytes) {
        const Header& live = *reinterpret_cast<const Header*>(f.data());
        const std::uint32_t init = live.init_state.load(std::memory_order_acquire);
        const HeaderFixed snap = snapshot_header(f.data());
        if (init == kInitReady) {
          const Geometry g = checked_geometry(f, snap);
          if (snap.world_size != o.world_size)
            throw Error(Errc::kInvalidArgument, "region '" + std::string(name) + "' was created by rank 0 for " +
                                                    std::to_string(snap.world_size) + " ranks, this rank says " +
                                                    std::to_string(o.world_size) + ": give every rank the same world_size");
          waiting = live_region_problem(f, live);
          if (waiting.empty()) {
            const int rc = lock_byte(f.fd(), rank_lock_byte(o.rank));
            if (rc == -EAGAIN)
              throw Error(Errc::kExists, "producer rank " + std::to_string(o.rank) + " of region '" +
                                             std::string(name) +
                                             "' is already attached by a live process: give each rank its own rank "
                                             "number");
            if (rc != 0)
              throw Error(Errc::kSystem, std::string("cannot lock the rank's byte: ") + std::strerror(-rc), -rc);
            // Again, now that this rank holds its byte: a takeover that began
            // meanwhile, or a file replaced meanwhile, is not joined.
            waiting = live_region_problem(f, live);
            if (waiting.empty()) {
              if (g.device_slots != (o.slot_memory == SlotMemory::kDevice))
                throw Error(Errc::kInvalidArgument,
                            "region '" + std::string(name) + "' was created by rank 0 with " +
                                (g.device_slots ? "device" : "host") + " slots, this rank asks for " +
                                (g.device_slots ? "host" : "device") + " slots: give every rank the same slot_memory");
              if (((snap.features & kFeatureDelta) != 0) != o.delta)
                throw Error(Errc::kInvalidArgument,
                            "region '" + std::string(name) + "' was created by rank 0 " +
                                (o.delta ? "without" : "with") + " delta syncs, this rank asks for " +
                                (o.delta ? "them" : "none") + ": give every rank the same delta option");
              m->checksums = (snap.features & kFeatureChecksums) != 0;
              m->path = f.path();
              m->view = RegionView(std::move(f), g);
              break;
            }
            unlock_byte(f.fd(), rank_lock_byte(o.rank));
          }
        } else {
          waiting = init == kInitClosed ? "rank 0 to create the region again (it is closed)"
                                        : "rank 0 to finish creating the region";
        }
      }
    } catch (const Error& e) {
      if (e.code() != Errc::kNotFound) throw;
    }
    if (mono_ns() >= deadline)
      throw Error(Errc::kTimeout, "producer rank " + std::to_string(o.rank) + " gave up waiting for " + waiting + " at " +
                                      region_path(name) + " (rank_timeout): is rank 0 running, with the same SHMCAST_DIR?");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (m->view.geo().device_slots) import_rank_slots(m, dir, name, o, deadline);
  RankSeat& rs = m->view.rank_seat(o.rank);
  const std::uint64_t old = rs.word.load(std::memory_order_acquire);
  rs.published_seq.store(0, std::memory_order_relaxed);
  rs.error_code.store(0, std::memory_order_relaxed);
  rs.attach_unix_ns.store(static_cast<std::uint64_t>(unix_ns()), std::memory_order_relaxed);
  write_identity(rs.who, self_identity());
  // Join the next round rank 0 has not ended yet, unless the seat's
  // previous process posted for it (rank 0 may have taken that list: the
  // round is in flight, and it is not this process's), which the seat then
  // drops (rounds::rejoin). reply_round stays: rank 0 only ever raises it,
  // and it is no higher than `round` (a later round rank 0 fails meanwhile
  // is answered to this seat too).
  m->round = rounds::rejoin(m->words(), o.rank, m->view.rank_list(o.rank), m->view.room(m->view.rank_list(o.rank), 4096),
                            "producer rank " + std::to_string(o.rank) +
                                " was restarted in the middle of a sync round (its new process did not post its list)");
  // A round the seat dropped that rank 0 has not ended: its reason is in the
  // list area until rank 0 reads it (settle_dropped, before the first list).
  if (const std::uint64_t post = rs.post.load(std::memory_order_acquire);
      rounds::post_state(post) == rounds::PostState::kDropped && rounds::post_round(post) == m->round &&
      m->round > m->words().ended->load(std::memory_order_acquire))
    m->dropped = m->round;
  rs.word.store(make_seat_word(seat_gen(old) + 1, kSeatActive), std::memory_order_seq_cst);
  detail::ring(m->view.header().rank_post);
  return m;
}

}  // namespace

Producer Producer::create(std::string_view name, const ProducerOptions& o) {
  const std::int64_t t0 = mono_ns();
  require_valid_name(name);
  std::string why;
  if (o.world_size < 1 || o.world_size > limits::kMaxRanks || o.rank >= o.world_size)
    throw Error(Errc::kInvalidArgument, "rank " + std::to_string(o.rank) + " of world_size " +
                                            std::to_string(o.world_size) + ": need 0 <= rank < world_size <= " +
                                            std::to_string(limits::kMaxRanks));
  if (o.consumer_timeout.count() <= 0) throw Error(Errc::kInvalidArgument, "consumer_timeout must be positive");
  if (o.rank_timeout.count() <= 0) throw Error(Errc::kInvalidArgument, "rank_timeout must be positive");
  const bool store = o.mode == RegionMode::kStore;
  if (store && o.world_size != 1)
    throw Error(Errc::kInvalidArgument, "a store region takes one producer rank (world_size 1): gather the "
                                        "shards on one rank, or use a ring region");
  if (o.delta && store)
    throw Error(Errc::kInvalidArgument, "delta syncs need a ring region (a store region keeps full versions)");
  if (o.delta && !(o.delta_max_ratio > 0.0 && o.delta_max_ratio <= 1.0))
    throw Error(Errc::kInvalidArgument, "delta_max_ratio must be in (0, 1]");
  const bool dev_slots = o.slot_memory == SlotMemory::kDevice;
  if (quantize_name(o.quantize).empty())
    throw Error(Errc::kInvalidArgument, "unknown quantize value " + std::to_string(static_cast<int>(o.quantize)));
  if (dev_slots) {
    if (store)
      throw Error(Errc::kInvalidArgument, "device slots (slot_memory = kDevice) need a ring region: a store region "
                                          "keeps its versions in host memory (use host slots)");
    if (o.checksums)
      throw Error(Errc::kInvalidArgument, "slot checksums are computed on the host and device slots never are: turn "
                                          "checksums off, or use host slots");
    if (o.delta)
      throw Error(Errc::kInvalidArgument, "delta syncs are sent through host slots only: turn delta off, or use "
                                          "host slots");
    if (o.engine == CopyEngine::kHost)
      throw Error(Errc::kInvalidArgument, "device slots are copied by the GPU: create the producer with engine "
                                          "kAuto or kCuda, not kHost");
  }
  auto impl = std::make_unique<Impl>();
  impl->name = std::string(name);
  impl->opts = o;
  impl->rank = o.rank;
  impl->world = o.world_size;
  // The engine (and a required pin's CUDA) before the region exists: a
  // create refused for want of a GPU leaves nothing a consumer could open.
  const bool cuda =
      dev_slots || o.engine == CopyEngine::kCuda || (o.engine == CopyEngine::kAuto && cuda_available());
  // Device slots: the engine starts on the slots' GPU (slot_device; -1 the
  // current device, where the slots go too), where they are mapped.
  impl->engine = cuda ? make_cuda_producer_engine(dev_slots, dev_slots ? o.slot_device : -1)
                      : make_host_producer_engine();
  if (o.pin == Pin::kYes && !cuda_available())
    throw Error(Errc::kCudaUnavailable, "cannot pin region '" + impl->name + "': " + cuda_unavailable_reason());
  if (o.rank > 0) {
    attach_rank(impl.get(), name, o);
  } else {
    Geometry g{};
    if (store) {
      if (o.store_bytes == 0)
        throw Error(Errc::kInvalidArgument, "a store region needs store_bytes: the room for one version "
                                            "(store_bytes_needed(tensors))");
      why = compute_geometry(o.max_consumers, 2, o.store_bytes, o.manifest_bytes, &g, 1, true);
    } else {
      why = compute_geometry(o.max_consumers, o.slots, o.slot_bytes, o.manifest_bytes, &g, o.world_size, false,
                             dev_slots);
    }
    if (!why.empty()) throw Error(Errc::kInvalidArgument, why);
    // Device slots: the GPU memory before the region exists (a create
    // refused for want of it leaves nothing a consumer could open).
    DeviceSlotsFixed dev{};
    if (dev_slots) {
      const int device = o.slot_device >= 0 ? o.slot_device : vmm::current_device();
      impl->slot_mem = vmm::Mapping::allocate(device, g.slot_bytes * g.slot_count);
      const vmm::Uuid uuid = vmm::device_uuid(device);
      std::copy(uuid.begin(), uuid.end(), dev.gpu_uuid);
      dev.alloc_bytes = impl->slot_mem.bytes();
      while (dev.nonce == 0) dev.nonce = random_u64();
    }
    const std::string dir = region_dir();
    MappedFile file;
    for (int attempt = 0;; ++attempt) {
      try {
        // The manifest areas and rank lists stay holes until written (room()).
        const SparseRanges sparse = sparse_ranges(g);
        file = MappedFile::create(dir, name, g.total_bytes, o.group_access, kProducerLockByte,
                                  std::span(sparse.range, sparse.count));
        break;
      } catch (const Error& e) {
        if (e.code() != Errc::kExists || attempt >= 2) throw;
        take_over_stale(dir, name, o.replace_stale, o.group_access);  // detail::
      }
    }
    impl->path = file.path();
    impl->checksums = o.checksums;
    const std::uint32_t region_gid = file.owner_gid();
    impl->view = RegionView(std::move(file), g);
    if (dev_slots) {
      // The fds are served before the region is ready: a consumer that sees
      // it ready finds the socket.
      impl->view.set_device_slots(static_cast<std::byte*>(impl->slot_mem.data()));
      FdSetInfo info;
      info.kind = FdKind::kCudaVmm;
      info.region_nonce = dev.nonce;
      std::copy(std::begin(dev.gpu_uuid), std::end(dev.gpu_uuid), info.device_uuid.begin());
      info.sizes = {dev.alloc_bytes};
      FdServerOptions so;
      so.trust = TrustPolicy{o.group_access, {}};
      so.region_gid = o.group_access ? static_cast<std::int64_t>(region_gid) : -1;
      so.replace_stale = o.replace_stale;
      try {
        UniqueFd fd(impl->slot_mem.export_fd());
        const int fds[1] = {fd.get()};
        impl->slot_server = FdServer::start(dir, name, fds, info, so);
      } catch (...) {
        // Nothing may stay behind that a consumer would open: the file has
        // no header yet (a live server of another producer at the socket's
        // name, something that is no socket there, ...).
        (void)impl->view.file().unlink_if_same();
        throw;
      }
    }
    init_header(impl->view,
                (o.checksums ? kFeatureChecksums : 0) | (store ? kFeatureStore : 0) | (o.delta ? kFeatureDelta : 0) |
                    (dev_slots ? kFeatureDeviceSlots : 0),
                dev_slots ? &dev : nullptr);
  }
  impl->ring.emplace(&impl->view, ProducerRingOptions{o.stall_policy, o.consumer_timeout.count(), o.rank, o.world_size,
                                                      impl->view.geo().store});
  impl->create_s = static_cast<double>(mono_ns() - t0) * 1e-9;
  // Device slots: the file holds no slot bytes, nothing to pin. Only the
  // slot data is pinned: pinning the sparse manifest areas would allocate them.
  if (o.pin != Pin::kNo && !dev_slots) {
    impl->pin = cuda_pin(impl->pinned_base(), impl->view.file().size() - impl->view.geo().data_offset);
    if (!impl->pin.pinned && o.pin == Pin::kYes)
      throw Error(Errc::kCudaUnavailable, "cannot pin region '" + impl->name + "': " + impl->pin.why);
  }
  return Producer(std::move(impl));
}

void Producer::Impl::leave_rank() noexcept {
  RankSeat& rs = view.rank_seat(rank);
  const std::uint64_t w = rs.word.load(std::memory_order_acquire);
  rs.word.store(make_seat_word(seat_gen(w), kSeatFree), std::memory_order_release);
  detail::ring(view.header().rank_post);
  unlock_byte(view.fd(), rank_lock_byte(rank));
}

void Producer::Impl::close_quietly() noexcept {
  if (view.file().inherited()) {
    // A forked child's copy: the parent's region, seat and engine are not
    // ours to close. Forget them without touching any of it.
    (void)engine.release();
    view.file().unmap();
    return;
  }
  if (!view.mapped()) return;
  try {
    abort("the producer closed in the middle of the sync");
  } catch (...) {
  }
  if (!leader()) {
    // A rank leaves; the region is rank 0's.
    engine.reset();
    // Device slots: this rank's mapping of rank 0's memory (its copies were
    // drained with the engine), else it would keep the allocation alive
    // until this Producer object is destroyed.
    slot_mem.release();
    if (pin.pinned) cuda_unpin(pinned_base(), view.file().size() - view.geo().data_offset);
    pin.pinned = false;
    leave_rank();
    view.file().unmap();
    return;
  }
  Header& h = view.header();
  h.init_state.store(kInitClosed, std::memory_order_release);
  // The record is unchanged: a sync published before close stays readable.
  ring_keep_parity(h.sync.announce);
  detail::ring(h.publish);
  if (opts.unlink_on_close) view.file().unlink_if_same();
  engine.reset();
  // Device slots: no more fds for anyone, then our own hold on the memory
  // (it goes back to the GPU once every consumer has unmapped it).
  slot_server.stop();
  slot_mem.release();
  if (pin.pinned) cuda_unpin(pinned_base(), view.file().size() - view.geo().data_offset);  // unregister before unmap
  pin.pinned = false;
  unlock_byte(view.fd(), kProducerLockByte);
  view.file().unmap();
}

}  // namespace shmcast
