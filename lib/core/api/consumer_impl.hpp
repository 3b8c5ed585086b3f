// api/ (layer 6), private to the consumer: Consumer::Impl, the state behind
// the public Consumer, for its modes: host reads (read_into, visit,
// visit_chunks; a ring of one rank or several, host or device slots), device
// reads and staging (read_into_device, read_to_staging), delta syncs
// (applied in place on the host or the GPU, only on the destinations that
// hold the base) and store views. Its methods run on the caller's thread,
// one call at a time; the engine's completion threads only run the releasers
// ChunkReader hands them.
//
// Its methods live in one file per concern:
//   consumer.cpp         the public Consumer methods that are not reads:
//                        open (and a region's device slots), wait_sync (the
//                        next sync's manifest, checked), skip, close, getters
//   consumer_read.cpp    host reads: read_into, visit, visit_chunks, and
//                        read_planned (every read's copies, piece by piece)
//   consumer_device.cpp  device reads and staging: read_into_device,
//                        read_to_staging
//   consumer_delta.cpp   delta syncs: which destinations hold which version,
//                        the blobs applied on the host (apply_blob) or the
//                        GPU (read_delta_device), the read's report
//   consumer_store.cpp   store regions: views()
// The templates every read shares (for_each_chunk, pieces, read_tracked)
// are here.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "api/device_slots.hpp"
#include "base/checks.hpp"
#include "base/name_set.hpp"
#include "engine/cuda_vmm.hpp"
#include "engine/delta_cuda.hpp"
#include "engine/engine.hpp"
#include "protocol/manifest.hpp"
#include "protocol/ring.hpp"
#include "protocol/selection.hpp"
#include "shm/doorbell.hpp"
#include "shm/region.hpp"
#include "shmcast/shmcast.hpp"

namespace shmcast {

namespace detail {
// visit(), visit_chunks(), views() and read_to_staging() of a delta sync:
// kNeedsFullSync, after asking for a full sync (consumer_delta.cpp).
void refuse_delta(Consumer::Impl& m, const char* what);
}  // namespace detail

using namespace detail;

struct __attribute__((visibility("hidden"))) Consumer::Impl {
  // kViews: a store version handed out by views(), held until skip().
  enum class State { kIdle, kManifest, kReading, kViews };

  std::string name;
  ConsumerOptions opts;
  RegionView view;
  std::optional<ConsumerRing> ring;
  std::unique_ptr<ConsumerEngine> host_engine, cuda_engine;
  // Device slots: the producer's slot memory, imported and mapped here
  // (released after the engine, at close).
  vmm::Mapping slot_mem;
  DeviceSlotsFixed device_slots{};
  PinInfo pin;
  double open_s = 0;
  bool checksums = false;
  bool read_only_views = false;  // store banks mapped PROT_READ in this process

  State state = State::kIdle;
  SyncInfo info;
  // The next manifest is decoded into the sync before last's SyncInfo and
  // swapped in (its memory kept: the same manifest allocates nothing), with
  // the duplicate-name check's table kept too.
  SyncInfo spare;
  detail::NameSet names;
  std::uint64_t last_version = 0;
  std::uint64_t next_chunk = 0;  // chunks of this sync already released

  // ---- delta syncs (a region with kFeatureDelta, docs/protocol.md §9, §12)
  bool delta_region = false;
  // What complete reads filled: the destinations of each, and the version
  // they hold. A delta sync applies only to exactly the destinations that
  // hold its base (protocol.md §12.1). An update sent as several syncs of
  // different tensors (buckets) has one record per bucket; a read forgets
  // every record whose destinations it overlaps (they no longer hold that
  // version), and at most kMaxDeltaGroups are kept (the oldest go first).
  struct Applied {
    std::uint64_t version = 0;
    std::vector<void*> dsts;
    std::vector<Selection> sels;
    bool device = false;
    std::vector<std::pair<std::uintptr_t, std::uint64_t>> ranges;  // [start, bytes) of each destination
  };
  std::vector<Applied> applied;  // oldest first
  SyncReport report;
  std::unique_ptr<delta::CudaCodec> codec;  // read_into_device of a delta sync
  bool forwarding = false;  // forward_syncs(): a relay passes delta syncs on as they are

  // Asks the producer for a full sync after version `after` (Seat::full_after).
  void request_full(std::uint64_t after) {
    if (!ring || ring->seat() < 0) return;
    Seat& s = view.seat(static_cast<std::uint32_t>(ring->seat()));
    if (after > s.full_after.load(std::memory_order_relaxed)) s.full_after.store(after, std::memory_order_release);
    detail::ring(view.header().release);  // a producer waiting on the bell looks again
  }
  bool holds(std::uint64_t version) const {
    return std::any_of(applied.begin(), applied.end(), [&](const Applied& a) { return a.version == version; });
  }
  // The record of `version` whose destinations are exactly these, or null.
  const Applied* find_applied(std::uint64_t version, std::span<void* const> dsts, std::span<const Selection> sels,
                              bool device) const;
  // The byte ranges that a read of the current sync into `dsts` writes.
  std::vector<std::pair<std::uintptr_t, std::uint64_t>> ranges_of(std::span<void* const> dsts,
                                                                  std::span<const Selection> sels) const;
  // Forgets every record whose destinations overlap `ranges` (consumer_delta.cpp).
  void forget(const std::vector<std::pair<std::uintptr_t, std::uint64_t>>& ranges);

  ~Impl() { close_quietly(); }

  void require_open() const {
    if (view.file().inherited()) throw_inherited("Consumer", view.file());
    if (!view.mapped() || !ring) throw Error(Errc::kClosed, "this consumer is closed");
  }
  void close_quietly() noexcept;

  // Releases every chunk of the current sync that has not been released.
  void release_rest() {
    if (state == State::kIdle) return;
    if (view.geo().store)
      ring->unhold();
    else if (info.chunks > 0)
      ring->release(info.first_seq + info.chunks - 1);
    state = State::kIdle;
  }

  // Runs `per_range(data, rank, start, bytes)` over the sync's bytes (data
  // points at byte `start` of rank `rank`'s sub-stream), chunk by chunk, then
  // hands each chunk's releaser to `engine`. Each rank's bytes come in its
  // sub-stream's order; with several ranks, the ranks' chunks come in the
  // order they are ready, not in seq order (ChunkReader), and the releasers
  // may run in any order: the reader releases the copied prefix. With
  // `follow`, a chunk is handed over in several ranges as the producer fills
  // it (host copies without checksums), so the consumer copies bytes while
  // they are still in the CPU cache.
  template <class F>
  void for_each_chunk(ConsumerEngine& engine, F&& per_range, bool follow = false) {
    require_open();
    if (state != State::kManifest) throw Error(Errc::kInvalidArgument, "no sync to read: call wait_sync() first");
    state = State::kReading;
    ChunkReader reader(&*ring, &view, info.version, info.first_seq, info.chunks, info.rank_bytes, follow,
                       checksums && opts.verify_checksums, opts.chunk_timeout.count());
    // Set from the engine's completion thread (CUDA callbacks).
    std::atomic<bool> broken{false};
    try {
      ChunkReader::Range r;
      while (reader.next(&r)) {
        if (r.bytes > 0) per_range(r.data, r.rank, r.start, r.bytes);
        if (!r.last) continue;
        engine.chunk_done(reader.releaser(r, &broken));
        if (broken.load(std::memory_order_relaxed)) break;
      }
      engine.drain();
    } catch (const Error& e) {
      try {
        engine.drain();
      } catch (...) {
      }
      ring->set_error(e.code(), e.what());
      release_rest();
      throw;
    }
    if (broken.load()) {
      release_rest();
      ring->check_seat();
      throw Error(Errc::kCorrupt, "a slot was overwritten while this consumer read it; the sync is incomplete");
    }
    state = State::kIdle;
    Seat& s = view.seat(static_cast<std::uint32_t>(ring->seat()));
    s.syncs_done.fetch_add(1, std::memory_order_relaxed);
    s.bytes_done.fetch_add(info.payload_bytes, std::memory_order_relaxed);
  }

  // The sync's pieces by rank, in sub-stream order: (offset, tensor, shard).
  struct PieceRef {
    std::uint64_t offset, nbytes;
    std::uint32_t tensor, shard;
  };
  std::vector<std::vector<PieceRef>> by_rank;
  void index_pieces();


  // Calls fn(piece, offset in piece, src, bytes) for the pieces of rank
  // `rank`'s sub-stream bytes [start, start + bytes) (at `data`).
  template <class F>
  void pieces(std::vector<std::size_t>& cursor, std::uint32_t rank, std::uint64_t start, std::uint64_t bytes,
              const std::byte* data, F&& fn) {
    const auto& ps = by_rank[rank];
    std::size_t& t = cursor[rank];
    const std::uint64_t end = start + bytes;
    while (t < ps.size() && ps[t].offset + ps[t].nbytes <= start) ++t;
    for (std::size_t j = t; j < ps.size() && ps[j].offset < end; ++j) {
      const PieceRef& p = ps[j];
      if (p.nbytes == 0) continue;
      const std::uint64_t a = p.offset > start ? p.offset : start;
      const std::uint64_t b = p.offset + p.nbytes < end ? p.offset + p.nbytes : end;
      if (a >= b) continue;
      fn(p, a - p.offset, data + (a - start), b - a);
    }
  }

  // Copies what `dsts` (with `sels`) want of the sync through `e`: for each
  // piece, the blocks of its intersection with the selection, clipped to the
  // bytes of each range as it arrives.
  // `collect` (read_delta_device): delta pieces' blobs are copied by the
  // engine to device memory, piece (tensor t, shard k) at collect->base +
  // collect->at[t][k], instead of applied; with `mirror` (one rank) the
  // buffer mirrors the stream instead (at = the pieces' stream offsets) and
  // each range is copied whole, one copy instead of one per piece.
  struct Collect {
    std::byte* base = nullptr;
    std::vector<std::vector<std::uint64_t>> at;
    bool mirror = false;
    std::uint64_t bytes = 0;  // of the buffer, with mirror
  };
  void read_planned(ConsumerEngine& e, std::span<void* const> dsts, std::span<const Selection> sels, bool device,
                    bool follow, const Collect* collect = nullptr);

  // Applies a delta piece's blob to `dst` (the tensor's host destination,
  // laid out as `sel`). (read_into_device() collects the blobs instead:
  // read_delta_device.)
  void apply_blob(const PieceRef& p, const Selection& sel, void* dst, std::span<const std::byte> blob);

  // A read into `dsts` that delta syncs may later build on: a delta sync
  // is read only into the destinations the last complete read filled (else
  // kNeedsFullSync, after asking for a full sync); a complete read makes
  // these destinations the base; a failed one leaves them unknown.
  template <class F>
  void read_tracked(std::span<void* const> dsts, std::span<const Selection> sels, bool device, F&& read) {
    if (state != State::kManifest) {
      read();  // throws: no sync to read
      return;
    }
    if (!delta_region) {
      read();
      set_report(dsts, sels, false);
      return;
    }
    const auto ranges = ranges_of(dsts, sels);
    if (info.delta() && find_applied(info.base_version, dsts, sels, device) == nullptr) {
      request_full(info.version);
      release_rest();
      forget(ranges);
      throw Error(Errc::kNeedsFullSync,
                  "sync " + std::to_string(info.version) + " of '" + name + "' is a delta against version " +
                      std::to_string(info.base_version) + ", and these destinations are not the ones a complete "
                      "read of that version filled (other buffers, selections or device): a full sync was "
                      "requested; call wait_sync() again and read that one");
    }
    // A delta piece the selection holds only part of cannot be checked (its
    // blob's checksum covers the whole piece): refused before a byte is
    // written, unless checks are off (protocol.md §12.1).
    if (info.delta() && opts.verify_checksums) {
      if (std::string why = unverifiable_piece(dsts, sels); !why.empty()) {
        request_full(info.version);
        release_rest();  // the destinations still hold the base: their record stays
        throw Error(Errc::kNeedsFullSync,
                    "sync " + std::to_string(info.version) + " of '" + name + "' is a delta, and " + why +
                        ": the blob's checksum covers the whole piece, so the result could not be verified and "
                        "nothing was written. A full sync was requested; call wait_sync() again and read that one. "
                        "To take deltas, read whole pieces (a selection that holds every piece it touches), or "
                        "open the consumer with verify_checksums = false to apply them unchecked, at your own risk");
      }
    }
    const std::uint64_t v = info.version;
    const bool was_delta = info.delta();
    forget(ranges);
    try {
      read();
    } catch (...) {
      request_full(v);  // the destinations now hold neither version
      throw;
    }
    applied.push_back(Applied{v, {dsts.begin(), dsts.end()}, {sels.begin(), sels.end()}, device, ranges});
    if (applied.size() > limits::kMaxDeltaGroups) applied.erase(applied.begin());
    set_report(dsts, sels, was_delta);
  }
  // Of a delta sync read into `dsts` laid out as `sels`: which delta piece
  // the selection holds only part of (it selects some of its elements, not
  // all), said as "the selection of 'T' holds only part of rank r's piece
  // ...", or empty when every piece it touches is held whole (each can then
  // be checked where it lands) or the arguments are wrong (the read reports
  // them).
  std::string unverifiable_piece(std::span<void* const> dsts, std::span<const Selection> sels) const;
  // The report of a completed read: of a delta sync, the payload is every
  // blob read whole plus what the read copied of the pieces sent as their
  // bytes (a c128 tensor's, or its part in the selection).
  void set_report(std::span<void* const> dsts, std::span<const Selection> sels, bool was_delta);
  void read_delta_device(std::span<void* const> dsts, std::span<const Selection> sels, void* stream);

  void check_dsts(std::size_t n) const {
    if (n != info.tensors.size())
      throw Error(Errc::kInvalidArgument, "got " + std::to_string(n) + " destinations for a sync of " +
                                              std::to_string(info.tensors.size()) + " tensors (pass nullptr to skip one)");
  }
};

}  // namespace shmcast
