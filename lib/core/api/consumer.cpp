// api/ (layer 6): the public Consumer.
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <condition_variable>
#include <iterator>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "api/device_slots.hpp"
#include "base/checks.hpp"
#include "shm/doorbell.hpp"
#include "engine/engine.hpp"
#include "shm/liveness.hpp"
#include "protocol/delta.hpp"
#include "engine/cuda_vmm.hpp"
#include "engine/delta_cuda.hpp"
#include "protocol/manifest.hpp"
#include "shm/region.hpp"
#include "protocol/ring.hpp"
#include "protocol/selection.hpp"
#include "shmcast/shmcast.hpp"

namespace shmcast {

using namespace detail;

namespace {

// kViews: a store version handed out by views(), held until skip().
enum class State { kIdle, kManifest, kReading, kViews };

// visit_chunks(): hands each chunk to the caller with a release function the
// caller runs when it is done with the slot (from any thread). drain()
// waits for every one; afterwards (also after an error) a late call does
// nothing, since the reader it would release for is gone.
class DeferredEngine final : public ConsumerEngine {
 public:
  using Fn = std::function<void(std::uint64_t, const std::byte*, std::uint64_t, std::function<void()>)>;
  DeferredEngine(const Fn& fn, std::int64_t timeout_ns) : fn_(fn), timeout_ns_(timeout_ns) {}
  ~DeferredEngine() override { close(); }
  void copy(const Buffer&, std::uint64_t, const std::byte*, std::uint64_t) override {
    throw Error(Errc::kInvalidArgument, "visit_chunks() copies nothing");
  }
  // The next chunk's bytes (one range per chunk: no progressive fill).
  void set_chunk(std::uint64_t index, const std::byte* data, std::uint64_t bytes) {
    index_ = index;
    data_ = data;
    bytes_ = bytes;
  }
  void chunk_done(std::function<void()> release) override {
    std::shared_ptr<State> st = st_;
    {
      std::lock_guard<std::mutex> g(st->mu);
      ++st->held;
    }
    auto once = std::make_shared<std::atomic<bool>>(false);
    auto rel = std::make_shared<std::function<void()>>(std::move(release));
    fn_(index_, data_, bytes_, [st, once, rel] {
      if (once->exchange(true)) return;
      std::lock_guard<std::mutex> g(st->mu);
      if (st->closed) return;
      (*rel)();
      --st->held;
      st->cv.notify_all();
    });
  }
  // Every chunk handed out released, or kTimeout after chunk_timeout.
  void drain() override {
    std::unique_lock<std::mutex> g(st_->mu);
    if (st_->closed) return;  // drained (or timed out) already: the error path calls it again
    const bool ok = st_->cv.wait_for(g, std::chrono::nanoseconds(timeout_ns_), [&] { return st_->held == 0; });
    const std::uint64_t held = st_->held;
    st_->closed = true;
    if (!ok)
      throw Error(Errc::kTimeout, std::to_string(held) + " chunk(s) handed out by visit_chunks() were not released "
                                  "within chunk_timeout: call each chunk's release function once you are done with it");
  }
  void close() {
    std::lock_guard<std::mutex> g(st_->mu);
    st_->closed = true;
  }

 private:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    std::uint64_t held = 0;
    bool closed = false;
  };
  const Fn& fn_;
  std::int64_t timeout_ns_;
  std::shared_ptr<State> st_ = std::make_shared<State>();
  std::uint64_t index_ = 0, bytes_ = 0;
  const std::byte* data_ = nullptr;
};


}  // namespace

struct Consumer::Impl {
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
                              bool device) const {
    for (const Applied& a : applied) {
      if (a.version != version || a.device != device ||
          !std::equal(dsts.begin(), dsts.end(), a.dsts.begin(), a.dsts.end()))
        continue;
      if (sels.size() != a.sels.size()) continue;
      bool same = true;
      for (std::size_t i = 0; i < sels.size() && same; ++i)
        same = sels[i].dim == a.sels[i].dim && sels[i].start == a.sels[i].start && sels[i].length == a.sels[i].length;
      if (same) return &a;
    }
    return nullptr;
  }
  // The byte ranges that a read of the current sync into `dsts` writes.
  std::vector<std::pair<std::uintptr_t, std::uint64_t>> ranges_of(std::span<void* const> dsts,
                                                                  std::span<const Selection> sels) const {
    std::vector<std::pair<std::uintptr_t, std::uint64_t>> out;
    for (std::size_t t = 0; t < info.tensors.size() && t < dsts.size(); ++t) {
      if (dsts[t] == nullptr) continue;
      const TensorInfo& ti = info.tensors[t];
      const std::uint64_t n = sels.empty() ? ti.nbytes : sels[t].nbytes(ti);
      out.emplace_back(reinterpret_cast<std::uintptr_t>(dsts[t]), std::max<std::uint64_t>(n, 1));
    }
    return out;
  }
  // Forgets every record whose destinations overlap `ranges`: the ranges
  // sorted and merged once, then each record range found by a binary search
  // (an update of B buckets of T tensors in all costs B x T log, not T^2).
  void forget(const std::vector<std::pair<std::uintptr_t, std::uint64_t>>& ranges) {
    if (applied.empty()) return;
    std::vector<std::pair<std::uintptr_t, std::uintptr_t>> q;  // [start, end), sorted, disjoint
    q.reserve(ranges.size());
    for (const auto& [s, n] : ranges) q.emplace_back(s, s + n);
    std::sort(q.begin(), q.end());
    std::size_t k = 0;
    for (std::size_t i = 1; i < q.size(); ++i) {
      if (q[i].first <= q[k].second) q[k].second = std::max(q[k].second, q[i].second);
      else q[++k] = q[i];
    }
    if (!q.empty()) q.resize(k + 1);
    auto hit = [&](std::uintptr_t s, std::uintptr_t e) {
      auto it = std::upper_bound(q.begin(), q.end(), s,
                                 [](std::uintptr_t v, const auto& r) { return v < r.first; });  // first start > s
      if (it != q.begin() && std::prev(it)->second > s) return true;
      return it != q.end() && it->first < e;
    };
    auto overlaps = [&](const Applied& a) {
      return std::any_of(a.ranges.begin(), a.ranges.end(), [&](const auto& r) { return hit(r.first, r.first + r.second); });
    };
    applied.erase(std::remove_if(applied.begin(), applied.end(), overlaps), applied.end());
  }

  ~Impl() { close_quietly(); }

  void require_open() const {
    if (view.file().inherited()) throw_inherited("Consumer", view.file());
    if (!view.mapped() || !ring) throw Error(Errc::kClosed, "this consumer is closed");
  }

  void close_quietly() noexcept {
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
    if (pin.pinned) cuda_unpin(view.file().data(), view.file().size());
    pin.pinned = false;
    view.file().unmap();
  }

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
  void index_pieces() {
    by_rank.assign(info.world_size, {});
    for (std::uint32_t t = 0; t < info.tensors.size(); ++t) {
      const auto& sh = info.tensors[t].shards;
      for (std::uint32_t k = 0; k < sh.size(); ++k)
        by_rank[sh[k].rank].push_back(PieceRef{sh[k].stream_offset, sh[k].wire_bytes, t, k});
    }
    for (auto& v : by_rank)
      std::sort(v.begin(), v.end(), [](const PieceRef& a, const PieceRef& b) { return a.offset < b.offset; });
  }

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
                    bool follow, const Collect* collect = nullptr) {
    check_dsts(dsts.size());
    if (!sels.empty() && sels.size() != info.tensors.size())
      throw Error(Errc::kInvalidArgument, "got " + std::to_string(sels.size()) + " selections for a sync of " +
                                              std::to_string(info.tensors.size()) + " tensors (or none)");
    const Selection whole{};
    std::vector<std::vector<std::vector<Block>>> plan(info.tensors.size());
    for (std::size_t t = 0; t < info.tensors.size(); ++t) {
      if (dsts[t] == nullptr) continue;
      const TensorInfo& ti = info.tensors[t];
      const Selection& sel = sels.empty() ? whole : sels[t];
      if (std::string why = selection_problem(ti, sel); !why.empty())
        throw Error(Errc::kInvalidArgument, "selection of '" + ti.name + "': " + why);
      plan[t].resize(ti.shards.size());
      for (std::size_t k = 0; k < ti.shards.size(); ++k) plan_piece(ti, ti.shards[k], sel, &plan[t][k]);
    }
    std::vector<std::size_t> cursor(info.world_size, 0);
    // Per rank: a delta piece's blob gathered across chunks, and its bytes
    // so far (the ranks' chunks interleave; each rank's come in order).
    std::vector<std::vector<std::byte>> blobs(info.world_size);
    std::vector<std::uint64_t> blobs_have(info.world_size, 0);
    for_each_chunk(
        e,
        [&](const std::byte* data, std::uint32_t rank, std::uint64_t start, std::uint64_t bytes) {
          if (collect != nullptr && collect->mirror) {
            if (start > collect->bytes || bytes > collect->bytes - start)
              throw Error(Errc::kCorrupt, "a range of the sync lies outside its stream");
            e.copy(Buffer{collect->base, true, {}}, start, data, bytes);
          }
          pieces(cursor, rank, start, bytes, data,
                 [&](const PieceRef& p, std::uint64_t off, const std::byte* src, std::uint64_t n) {
                   void* dst = dsts[p.tensor];
                   if (dst == nullptr) return;
                   const ShardInfo& sh = info.tensors[p.tensor].shards[p.shard];
                   if (sh.base_version != 0) {
                     if (device && collect == nullptr)  // never: device reads of deltas collect
                       throw Error(Errc::kInvalidArgument, "a delta read into device memory must collect its blobs");
                     if (collect != nullptr && collect->mirror) return;  // copied with its range
                     if (collect != nullptr) {
                       e.copy(Buffer{collect->base, true, {}}, collect->at[p.tensor][p.shard] + off, src, n);
                       return;
                     }
                     // A delta blob: applied once whole (in place when one range holds it).
                     const Selection& sel = sels.empty() ? whole : sels[p.tensor];
                     if (off == 0 && n == sh.wire_bytes) {
                       apply_blob(p, sel, dst, std::span<const std::byte>(src, n));
                       return;
                     }
                     // One rank's pieces: their ranges come in order, one piece at a time.
                     std::vector<std::byte>& blob = blobs[rank];
                     std::uint64_t& blob_have = blobs_have[rank];
                     if (off == 0) blob.resize(sh.wire_bytes);
                     if (off != blob_have || off + n > blob.size())
                       throw Error(Errc::kCorrupt, "a delta blob's bytes came out of order");
                     std::memcpy(blob.data() + off, src, n);
                     blob_have = off + n == sh.wire_bytes ? 0 : off + n;
                     if (off + n == sh.wire_bytes) apply_blob(p, sel, dst, blob);
                     return;
                   }
                   const Buffer buf{dst, device, {}};
                   const std::byte* base = src - off;  // the piece's first byte (maybe in an earlier slot)
                   for (const Block& b : plan[p.tensor][p.shard])
                     clip(b, off, off + n, [&](const Op& op) {
                       if (op.rows == 1)
                         e.copy(buf, op.dst, base + op.src, op.width);
                       else
                         e.copy2d(buf, op.dst, op.dst_pitch, base + op.src, op.src_pitch, op.width, op.rows);
                     });
                 });
        },
        follow);
  }

  // Applies a delta piece's blob to `dst` (the tensor's host destination,
  // laid out as `sel`). (read_into_device() collects the blobs instead:
  // read_delta_device.)
  void apply_blob(const PieceRef& p, const Selection& sel, void* dst, std::span<const std::byte> blob) {
    const TensorInfo& ti = info.tensors[p.tensor];
    const ShardInfo& sh = ti.shards[p.shard];
    const std::uint32_t w = delta::elem_width(ti.dtype);
    const Selection piece{sh.dim, sh.start, sh.length};
    const delta::SliceMap map = delta::slice_map(ti.shape, w, piece, sel);
    const std::uint64_t dst_bytes = sel.nbytes(ti);
    const bool verify = opts.verify_checksums && delta::covers_piece(map);
    delta::apply(blob, w, map, dst, dst_bytes, verify);
  }

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
  // The report of a completed read: of a delta sync, the payload is every
  // blob read whole plus what the read copied of the pieces sent as their
  // bytes (a c128 tensor's, or its part in the selection).
  void set_report(std::span<void* const> dsts, std::span<const Selection> sels, bool was_delta) {
    SyncReport r;
    r.version = info.version;
    r.delta = was_delta;
    const Selection whole{};
    std::vector<Block> blocks;
    for (std::size_t t = 0; t < info.tensors.size() && t < dsts.size(); ++t) {
      if (dsts[t] == nullptr) continue;
      const TensorInfo& ti = info.tensors[t];
      const Selection& sel = sels.empty() ? whole : sels[t];
      r.logical_bytes += sel.nbytes(ti);
      if (!was_delta) continue;
      for (const ShardInfo& sh : ti.shards) {
        if (sh.base_version != 0) {
          r.payload_bytes += sh.wire_bytes;
          continue;
        }
        blocks.clear();
        plan_piece(ti, sh, sel, &blocks);
        for (const Block& b : blocks) r.payload_bytes += b.width * b.rows;
      }
    }
    if (!was_delta) r.payload_bytes = r.logical_bytes;
    report = r;
  }
  void read_delta_device(std::span<void* const> dsts, std::span<const Selection> sels, void* stream);

  void check_dsts(std::size_t n) const {
    if (n != info.tensors.size())
      throw Error(Errc::kInvalidArgument, "got " + std::to_string(n) + " destinations for a sync of " +
                                              std::to_string(info.tensors.size()) + " tensors (pass nullptr to skip one)");
  }
};

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
          const Alive a = peer_alive(f.fd(), kProducerLockByte, live.producer);
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
          if ((init == kInitReady && a != Alive::kNo) || kept) {
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
                                              : "a new producer (the region's producer is dead)";
            waiting_code = init == kInitClosed ? Errc::kClosed : Errc::kPeerDied;
          }
        }
      } else {
        // The creator takes the producer lock as soon as the file exists,
        // then sets the whole size at once (posix_fallocate): size 0 is a
        // region being created, a short non-empty file was cut. (The size
        // seen at open may predate the allocation: re-read it.)
        const bool held = lock_held(f.fd(), kProducerLockByte) == Alive::kYes;
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
    impl->pin = cuda_pin(file.data(), file.size(), read_only_from);
    if (impl->pin.pinned && read_only_from < file.size() && !impl->pin.read_only) impl->read_only_views = false;
    if (!impl->pin.pinned && o.pin == Pin::kYes)
      throw Error(Errc::kCudaUnavailable, "cannot pin region '" + impl->name + "': " + impl->pin.why);
  }
  impl->open_s = static_cast<double>(mono_ns() - t0) * 1e-9;
  return Consumer(std::move(impl));
}

namespace {

// The next sync this consumer takes part in, its manifest copied and
// checked: m.info, state kManifest.
void next_sync(Consumer::Impl& m, std::int64_t deadline) {
  const Geometry& g = m.view.geo();
  RecordSnapshot rec{};
  auto corrupt = [&](const std::string& why) {
    m.ring->set_error(Errc::kCorrupt, why);
    return Error(Errc::kCorrupt, "sync " + std::to_string(rec.version) + " of '" + m.name + "': " + why);
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
    bytes.resize(rec.manifest_used);
    std::memcpy(bytes.data(), m.view.manifest_of(rec.first_seq), bytes.size());
    // The manifest is covered by the record's seqlock: a producer that
    // aborted this sync and began the next may have rewritten it while we
    // copied. Then the copy is not corrupt, just stale: look again. (A held
    // store bank's manifest does not change.)
    if (!g.store && !m.ring->record_unchanged(rec)) {
      if (mono_ns() >= deadline)
        throw Error(Errc::kTimeout, "the producer kept rewriting the manifest (syncs begun and aborted) until the "
                                    "timeout: no sync could be read");
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
  SyncInfo info;
  std::string why = decode_manifest(bytes, rec.version, rec.stream_bytes, g.slot_bytes, &info);
  if (why.empty() && info.world_size != g.world_size)
    why = "manifest of " + std::to_string(info.world_size) + " ranks in a region of " + std::to_string(g.world_size);
  if (why.empty() && !g.store && rec.chunks != sync_chunks(info.rank_bytes, g.slot_bytes))
    why = "chunk count disagrees with the ranks' sub-streams";
  if (why.empty() && g.store && info.world_size != 1) why = "a store version of several ranks";
  if (!why.empty()) throw corrupt(why);
  info.first_seq = rec.first_seq;
  info.chunks = rec.chunks;
  m.info = std::move(info);
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

void Consumer::read_into(std::span<void* const> dsts) { read_into(dsts, {}); }

void Consumer::read_into(std::span<void* const> dsts, std::span<const Selection> selections) {
  Impl& m = *impl_;
  m.require_open();
  if (m.view.geo().device_slots) {  // D2H out of the GPU's slots
    m.read_tracked(dsts, selections, false, [&] { m.read_planned(*m.cuda_engine, dsts, selections, false, false); });
    return;
  }
  const bool follow = !(m.checksums && m.opts.verify_checksums);  // a checksum needs the whole chunk first
  m.read_tracked(dsts, selections, false, [&] { m.read_planned(*m.host_engine, dsts, selections, false, follow); });
}

namespace {
// visit(), visit_chunks() and read_to_staging() hand out the stream's bytes
// as tensors: a delta sync's blobs are not (wait_sync() gives such a reader,
// which never applies a sync, only full ones).
// visit() and visit_chunks() hand slot bytes to host code.
void refuse_device_slots(Consumer::Impl& m, const char* what) {
  if (!m.view.geo().device_slots) return;
  throw Error(Errc::kUnsupported, std::string(what) + " hands slot bytes to host code, and the slots of '" + m.name +
                                      "' are GPU memory: use read_into() (host destinations), read_into_device() or "
                                      "read_to_staging(), or a region of host slots");
}

void refuse_delta(Consumer::Impl& m, const char* what) {
  // A relay's consumer (forward_syncs()) passes a delta sync's chunks on as they are.
  if (m.state != State::kManifest || !m.info.delta()) return;
  if (m.forwarding && std::string_view(what) == "visit_chunks()") return;
  m.request_full(m.info.version);
  m.release_rest();
  throw Error(Errc::kNeedsFullSync, std::string(what) + " of a delta sync: its bytes are deltas, not tensors; use "
                                    "read_into() or read_into_device() (a full sync was requested)");
}
}  // namespace

void Consumer::visit(const std::function<void(const Piece&)>& fn) {
  Impl& m = *impl_;
  m.require_open();
  refuse_device_slots(m, "visit()");
  refuse_delta(m, "visit()");
  if (m.state == State::kManifest) {
    for (std::size_t j = 0; j < m.info.tensors.size(); ++j)
      if (m.info.tensors[j].nbytes == 0) fn(Piece{j, 0, nullptr, 0, 0, false});
  }
  std::vector<std::size_t> cursor(m.info.world_size, 0);
  std::vector<Piece> chunk;
  m.for_each_chunk(*m.host_engine, [&](const std::byte* data, std::uint32_t rank, std::uint64_t start,
                                       std::uint64_t bytes) {
    chunk.clear();
    m.pieces(cursor, rank, start, bytes, data,
             [&](const Impl::PieceRef& p, std::uint64_t off, const std::byte* src, std::uint64_t n) {
               Piece pc{p.tensor, off, src, n, m.info.tensors[p.tensor].nbytes};
               pc.shard = p.shard;
               chunk.push_back(pc);
             });
    if (!chunk.empty()) chunk.back().chunk_end = true;
    for (const Piece& p : chunk) fn(p);
  });
}

void Consumer::visit_chunks(
    const std::function<void(std::uint64_t, const std::byte*, std::uint64_t, std::function<void()>)>& fn) {
  Impl& m = *impl_;
  m.require_open();
  refuse_device_slots(m, "visit_chunks()");
  refuse_delta(m, "visit_chunks()");
  if (m.state == State::kManifest && m.info.world_size > 1)
    throw Error(Errc::kInvalidArgument, "visit_chunks() reads a sync of one producer rank; a sharded sync's chunks "
                                        "hold pieces of several ranks: use visit()");
  DeferredEngine e(fn, m.opts.chunk_timeout.count());
  const std::uint64_t S = m.view.geo().slot_bytes;
  const std::uint64_t stream = m.info.stream_bytes;
  std::uint64_t chunk = ~0ull;
  m.for_each_chunk(e, [&](const std::byte* data, std::uint32_t, std::uint64_t start, std::uint64_t) {
    if (start / S == chunk) return;  // a later range of the same chunk
    chunk = start / S;
    const std::uint64_t at = chunk * S;
    e.set_chunk(chunk, data - (start - at), std::min(S, stream - at));
  });
}

void Consumer::skip() {
  impl_->require_open();
  impl_->release_rest();
}

std::vector<const std::byte*> Consumer::views() {
  Impl& m = *impl_;
  m.require_open();
  if (!m.view.geo().store)
    throw Error(Errc::kInvalidArgument, "views() needs a store region (RegionMode::kStore): a ring region's slots "
                                        "are reused while you read; use read_into() or visit()");
  if (m.state != State::kManifest && m.state != State::kViews)
    throw Error(Errc::kInvalidArgument, "no version to view: call wait_sync() first");
  refuse_delta(m, "views()");
  // Still ours? (A producer that evicted us may be rewriting the bank.)
  if (!m.ring->still_valid(m.view.slot_of(m.info.first_seq), m.info.first_seq)) {
    m.release_rest();
    m.ring->check_seat();
    throw Error(Errc::kEvicted, "the version was replaced before views() was called");
  }
  const std::byte* bank = m.view.slot_data(m.view.slot_of(m.info.first_seq));
  std::vector<const std::byte*> out;
  out.reserve(m.info.tensors.size());
  // decode_manifest checked every tensor against the stream (one rank: one whole piece each).
  for (const TensorInfo& t : m.info.tensors) out.push_back(t.nbytes == 0 ? nullptr : bank + t.stream_offset);
  m.state = State::kViews;
  return out;
}

bool Consumer::views_read_only() const { return impl_->read_only_views; }

bool Consumer::views_valid() const {
  const Impl& m = *impl_;
  if (!m.view.mapped() || !m.ring || m.state != State::kViews) return false;
  return m.ring->still_valid(m.view.slot_of(m.info.first_seq), m.info.first_seq);
}

void Consumer::read_into_device(std::span<void* const> dsts, void* stream) { read_into_device(dsts, stream, {}); }

void Consumer::read_into_device(std::span<void* const> dsts, void* stream, std::span<const Selection> selections) {
  Impl& m = *impl_;
  m.require_open();
  m.check_dsts(dsts.size());
  if (!m.cuda_engine) m.cuda_engine = make_cuda_consumer_engine();
  ConsumerEngine& e = *m.cuda_engine;
  m.read_tracked(dsts, selections, true, [&] {
    if (m.state == State::kManifest && m.info.delta()) {
      m.read_delta_device(dsts, selections, stream);
      return;
    }
    e.begin(stream);
    m.read_planned(e, dsts, selections, true, false);
    e.end(stream);
  });
}

std::vector<void*> Consumer::read_to_staging(int device, void* stream) {
  Impl& m = *impl_;
  m.require_open();
  refuse_delta(m, "read_to_staging()");
  if (m.state != State::kManifest) throw Error(Errc::kInvalidArgument, "no sync to read: call wait_sync() first");
  if (!m.cuda_engine) m.cuda_engine = make_cuda_consumer_engine();
  ConsumerEngine& e = *m.cuda_engine;
  std::vector<void*> out;
  out.reserve(m.info.tensors.size());
  if (m.info.world_size == 1) {
    std::byte* base = e.staging(device, m.info.stream_bytes);
    e.begin(stream);
    // One H2D per slot: the staging buffer mirrors the stream.
    m.for_each_chunk(e, [&](const std::byte* data, std::uint32_t, std::uint64_t start, std::uint64_t bytes) {
      e.copy(Buffer{base, true, {}}, start, data, bytes);
    });
    e.end(stream);
    for (const TensorInfo& t : m.info.tensors) out.push_back(base + t.stream_offset);
    return out;
  }
  // Several ranks: each tensor assembled at its own place in the buffer.
  std::vector<std::uint64_t> at;
  std::uint64_t total = 0;
  for (const TensorInfo& t : m.info.tensors) {
    total = align_up(total, kTensorAlign);
    at.push_back(total);
    total += t.nbytes;
  }
  std::byte* base = e.staging(device, total);
  for (std::uint64_t a : at) out.push_back(base + a);
  e.begin(stream);
  m.read_planned(e, out, {}, true, false);
  e.end(stream);
  return out;
}

// read_into_device() of a delta sync: the CUDA engine copies each delta
// piece's blob from the slots into a device buffer (one H2D per range, the
// slots released as the copies complete) and every other piece (raw pieces
// of a delta sync) into its destination, as any read does; then the CUDA
// codec applies the blobs on `stream`, after those copies. Waits for
// `stream`, so a rejected blob or a checksum mismatch throws here
// (kCorrupt). Device memory: the sync's blobs (wire_bytes), kept by the codec.
void Consumer::Impl::read_delta_device(std::span<void* const> dsts, std::span<const Selection> sels, void* stream) {
  check_dsts(dsts.size());
  const Selection whole{};
  Collect col;
  col.at.resize(info.tensors.size());
  // One rank whose stream is mostly the blobs this read applies (every
  // delta piece wanted, raw pieces at most an eighth of the stream): the
  // buffer mirrors the stream and each range crosses in one copy (434
  // tensors: 2 copies, not 434); else the wanted blobs are packed.
  std::uint64_t raw = 0;
  bool all_wanted = true;
  for (std::size_t t = 0; t < info.tensors.size(); ++t)
    for (const ShardInfo& sh : info.tensors[t].shards) {
      if (sh.base_version == 0) raw += sh.wire_bytes;
      if (sh.base_version != 0 && dsts[t] == nullptr) all_wanted = false;
    }
  col.mirror = info.world_size == 1 && all_wanted && raw <= info.stream_bytes / 8;
  std::uint64_t total = col.mirror ? info.stream_bytes : 0;
  col.bytes = total;
  for (std::size_t t = 0; t < info.tensors.size(); ++t) {
    if (dsts[t] == nullptr) continue;
    const TensorInfo& ti = info.tensors[t];
    col.at[t].resize(ti.shards.size());
    for (std::size_t k = 0; k < ti.shards.size(); ++k) {
      if (ti.shards[k].base_version == 0) continue;
      if (col.mirror) {
        col.at[t][k] = ti.shards[k].stream_offset;
        continue;
      }
      col.at[t][k] = total;
      total += align_up(ti.shards[k].wire_bytes, 256);
    }
  }
  if (!codec) codec = std::make_unique<delta::CudaCodec>();
  col.base = total > 0 ? static_cast<std::byte*>(codec->buffer(0, total, stream)) : nullptr;
  // Every map and argument check before the first launch: nothing is
  // queued for a read that cannot complete.
  struct Apply {
    std::size_t t, k;
    std::uint32_t w;
    delta::SliceMap map;
    std::uint64_t dst_bytes;
  };
  std::vector<Apply> applies;
  for (std::size_t t = 0; t < info.tensors.size(); ++t) {
    if (dsts[t] == nullptr) continue;
    const TensorInfo& ti = info.tensors[t];
    const Selection& sel = sels.empty() ? whole : sels[t];
    const std::uint32_t w = delta::elem_width(ti.dtype);
    for (std::size_t k = 0; k < ti.shards.size(); ++k) {
      const ShardInfo& sh = ti.shards[k];
      if (sh.base_version == 0) continue;
      if (reinterpret_cast<std::uintptr_t>(dsts[t]) % w != 0)
        throw Error(Errc::kInvalidArgument, "the destination of '" + ti.name + "' is not aligned to its " +
                                                std::to_string(w) + "-byte elements");
      applies.push_back(
          Apply{t, k, w, delta::slice_map(ti.shape, w, Selection{sh.dim, sh.start, sh.length}, sel), sel.nbytes(ti)});
    }
  }
  ConsumerEngine& e = *cuda_engine;
  e.begin(stream);
  read_planned(e, dsts, sels, true, false, &col);
  e.end(stream);  // `stream` waits for the copies
  try {
    // Every piece in one batch (a launch per piece cost more than the bytes).
    std::vector<delta::CudaCodec::ApplyItem> items;
    items.reserve(applies.size());
    for (const Apply& a : applies)
      items.push_back({col.base + col.at[a.t][a.k], info.tensors[a.t].shards[a.k].wire_bytes, a.w, a.map, dsts[a.t],
                       a.dst_bytes, opts.verify_checksums && delta::covers_piece(a.map)});
    codec->apply_batch(items, stream);
    codec->finish(stream);
  } catch (...) {
    // Nothing of this read may land after the error (a full sync read next,
    // on another stream, must not be overwritten by it).
    try {
      codec->wait(stream);
    } catch (...) {
    }
    throw;
  }
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
