// api/ (layer 6): a consumer's delta syncs (a region with kFeatureDelta,
// docs/protocol.md §9, §12). Which destinations hold which version (the
// records read_tracked keeps: find_applied, ranges_of, forget); a delta
// piece's blob applied in place on the host (apply_blob) or, for
// read_into_device, collected into device memory and applied by the CUDA
// codec (read_delta_device); the report of a read (set_report); and the
// readers that never apply a delta (refuse_delta).
#include <algorithm>
#include <cstdint>
#include <iterator>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "api/consumer_impl.hpp"
#include "base/checks.hpp"
#include "base/layout.hpp"
#include "engine/delta_cuda.hpp"
#include "engine/engine.hpp"
#include "protocol/delta.hpp"
#include "protocol/manifest.hpp"
#include "protocol/selection.hpp"
#include "shmcast/shmcast.hpp"

namespace shmcast {

using namespace detail;
using State = Consumer::Impl::State;

const Consumer::Impl::Applied* Consumer::Impl::find_applied(std::uint64_t version, std::span<void* const> dsts,
                                                            std::span<const Selection> sels, bool device) const {
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
std::vector<std::pair<std::uintptr_t, std::uint64_t>> Consumer::Impl::ranges_of(std::span<void* const> dsts,
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
void Consumer::Impl::forget(const std::vector<std::pair<std::uintptr_t, std::uint64_t>>& ranges) {
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

std::string Consumer::Impl::unverifiable_piece(std::span<void* const> dsts, std::span<const Selection> sels) const {
  if (dsts.size() != info.tensors.size() || (!sels.empty() && sels.size() != info.tensors.size())) return {};
  const Selection whole{};
  for (std::size_t t = 0; t < info.tensors.size(); ++t) {
    if (dsts[t] == nullptr) continue;
    const TensorInfo& ti = info.tensors[t];
    const Selection& sel = sels.empty() ? whole : sels[t];
    if (sel.dim < 0 || !selection_problem(ti, sel).empty()) continue;  // whole tensors hold every piece
    const std::uint32_t w = delta::elem_width(ti.dtype);
    for (const ShardInfo& sh : ti.shards) {
      if (sh.base_version == 0) continue;  // sent as its bytes: nothing to apply
      const delta::SliceMap map = delta::slice_map(ti.shape, w, Selection{sh.dim, sh.start, sh.length}, sel);
      if (map.outer == 0 || delta::holds_piece(map)) continue;  // none of it selected, or all of it
      const std::string piece =
          sh.dim < 0 ? "the whole tensor"
                     : "rows [" + std::to_string(sh.start) + ", " + std::to_string(sh.start + sh.length) +
                           ") along dim " + std::to_string(sh.dim);
      return "the selection of '" + ti.name + "' (rows [" + std::to_string(sel.start) + ", " +
             std::to_string(sel.start + sel.length) + ") along dim " + std::to_string(sel.dim) +
             ") holds only part of rank " + std::to_string(sh.rank) + "'s piece (" + piece + ")";
    }
  }
  return {};
}

// Applies a delta piece's blob to `dst` (the tensor's host destination,
// laid out as `sel`). (read_into_device() collects the blobs instead:
// read_delta_device.)
void Consumer::Impl::apply_blob(const PieceRef& p, const Selection& sel, void* dst, std::span<const std::byte> blob) {
  const TensorInfo& ti = info.tensors[p.tensor];
  const ShardInfo& sh = ti.shards[p.shard];
  const std::uint32_t w = delta::elem_width(ti.dtype);
  const Selection piece{sh.dim, sh.start, sh.length};
  const delta::SliceMap map = delta::slice_map(ti.shape, w, piece, sel);
  const std::uint64_t dst_bytes = sel.nbytes(ti);
  const bool verify = opts.verify_checksums && delta::holds_piece(map);  // contiguous or strided
  delta::apply(blob, w, map, dst, dst_bytes, verify);
}

// The report of a completed read: of a delta sync, the payload is every
// blob read whole plus what the read copied of the pieces sent as their
// bytes (a c128 tensor's, or its part in the selection).
void Consumer::Impl::set_report(std::span<void* const> dsts, std::span<const Selection> sels, bool was_delta) {
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
                       a.dst_bytes, opts.verify_checksums && delta::holds_piece(a.map)});
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

namespace detail {
// visit(), visit_chunks() and read_to_staging() hand out the stream's bytes
// as tensors: a delta sync's blobs are not (wait_sync() gives such a reader,
// which never applies a sync, only full ones).
void refuse_delta(Consumer::Impl& m, const char* what) {
  // A relay's consumer (forward_syncs()) passes a delta sync's chunks on as they are.
  if (m.state != State::kManifest || !m.info.delta()) return;
  if (m.forwarding && std::string_view(what) == "visit_chunks()") return;
  m.request_full(m.info.version);
  m.release_rest();
  throw Error(Errc::kNeedsFullSync, std::string(what) + " of a delta sync: its bytes are deltas, not tensors; use "
                                    "read_into() or read_into_device() (a full sync was requested)");
}
}  // namespace detail

}  // namespace shmcast
