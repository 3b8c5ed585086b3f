// api/ (layer 6): a consumer's host reads. read_into (host destinations,
// out of host slots by memcpy or out of device slots by D2H copies), visit
// and visit_chunks (the slot bytes handed to host code), and read_planned,
// the copies of every read (read_into_device's too): each piece's blocks of
// the selection, clipped to the ranges as they arrive, a delta piece's blob
// gathered and applied (consumer_delta.cpp).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>

#include "api/consumer_impl.hpp"
#include "base/checks.hpp"
#include "engine/engine.hpp"
#include "protocol/manifest.hpp"
#include "protocol/selection.hpp"
#include "shmcast/shmcast.hpp"

namespace shmcast {

using namespace detail;
using State = Consumer::Impl::State;

namespace {

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

void Consumer::Impl::read_planned(ConsumerEngine& e, std::span<void* const> dsts, std::span<const Selection> sels,
                                  bool device, bool follow, const Collect* collect) {
  check_dsts(dsts.size());
  if (!sels.empty() && sels.size() != info.tensors.size())
    throw Error(Errc::kInvalidArgument, "got " + std::to_string(sels.size()) + " selections for a sync of " +
                                            std::to_string(info.tensors.size()) + " tensors (or none)");
  const Selection whole{};
  // One flat plan, no allocation per tensor (a sync may have 100,000):
  // piece k of tensor t is piece first[t] + k, its blocks are
  // blocks[ends[piece], ends[piece + 1]).
  const std::size_t tensors = info.tensors.size();
  std::vector<std::size_t> first(tensors + 1, 0);
  for (std::size_t t = 0; t < tensors; ++t) first[t + 1] = first[t] + info.tensors[t].shards.size();
  std::vector<std::size_t> ends(first[tensors] + 1, 0);
  std::vector<Block> blocks;
  blocks.reserve(first[tensors]);
  for (std::size_t t = 0; t < tensors; ++t) {
    const TensorInfo& ti = info.tensors[t];
    if (dsts[t] != nullptr) {
      const Selection& sel = sels.empty() ? whole : sels[t];
      if (std::string why = selection_problem(ti, sel); !why.empty())
        throw Error(Errc::kInvalidArgument, "selection of '" + ti.name + "': " + why);
    }
    for (std::size_t k = 0; k < ti.shards.size(); ++k) {
      if (dsts[t] != nullptr) plan_piece(ti, ti.shards[k], sels.empty() ? whole : sels[t], &blocks);
      ends[first[t] + k + 1] = blocks.size();
    }
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
                 const std::size_t piece = first[p.tensor] + p.shard;
                 for (std::size_t i = ends[piece]; i < ends[piece + 1]; ++i)
                   clip(blocks[i], off, off + n, [&](const Op& op) {
                     if (op.rows == 1)
                       e.copy(buf, op.dst, base + op.src, op.width);
                     else
                       e.copy2d(buf, op.dst, op.dst_pitch, base + op.src, op.src_pitch, op.width, op.rows);
                   });
               });
      },
      follow);
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
// visit() and visit_chunks() hand slot bytes to host code.
void refuse_device_slots(Consumer::Impl& m, const char* what) {
  if (!m.view.geo().device_slots) return;
  throw Error(Errc::kUnsupported, std::string(what) + " hands slot bytes to host code, and the slots of '" + m.name +
                                      "' are GPU memory: use read_into() (host destinations), read_into_device() or "
                                      "read_to_staging(), or a region of host slots");
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
}  // namespace shmcast
