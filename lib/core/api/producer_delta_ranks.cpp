// api/ (layer 6): delta syncs of a sharded producer (ProducerOptions::delta,
// world_size > 1), moved whole out of producer_delta.cpp, which holds the
// base, keyframes and one rank's staged syncs. docs/protocol.md §12.1,
// "Sharded producers".
#include <algorithm>
#include <cstring>

#include "api/producer_impl.hpp"
#include "base/checks.hpp"
#include "protocol/delta.hpp"
#include "protocol/manifest.hpp"
#include "protocol/ring.hpp"
#include "shm/region.hpp"
#include "shmcast/shmcast.hpp"

namespace shmcast {

using namespace detail;

// ---- sharded producers (world > 1): each rank keeps the base of its own
// pieces and encodes them; the ranks agree each round's kind through rank 0
// (docs/protocol.md §12.1, "Sharded producers").

// begin_sync() of a sharded delta rank, round `n` (its full list, `used`
// bytes, is in its list area). A keyframe on this rank posts that list at
// once (begin_sharded) and is written as any keyframe; else the sync is
// staged as with one rank, and end_sync() posts the list of its blobs.
std::uint64_t Producer::Impl::begin_delta_sharded(std::uint64_t n, std::uint64_t used) {
  DeltaState& d = delta;
  const std::string why = keyframe_reason();
  bool encodable = false;
  for (const TensorSpec& t : specs) encodable = encodable || delta_encodes(t.dtype);
  if (!why.empty()) {
    d.staged = false;
    d.full = true;
    d.posted = encodable ? DeltaState::Posted::kFull : DeltaState::Posted::kNeutral;
    wire_sizes.clear();
    return begin_sharded(n, used);
  }
  round = n;  // taken: a failure before the post drops it (abort)
  stage(n);
  return n;
}

// end_sync() of a staged sharded sync: encodes the tensors from GPUs,
// posts this rank's list (its blobs, or, when they would not pay or a
// base changed outside the codec, its tensors whole), takes rank 0's
// answer (whose kind may be full even for a list of blobs: the rank then
// lays its tensors out whole and sends them from its base, which holds
// the new bytes) and writes its chunks.
void Producer::Impl::end_staged_sharded() {
  DeltaState& d = delta;
  const std::uint64_t S = view.geo().slot_bytes;
  std::vector<Buffer> sources(specs.size());
  for (std::size_t i = 0; i < specs.size(); ++i)
    sources[i] = d.raw_from_base[i] ? Buffer{d.base[i].dev, true, {}} : Buffer{d.blobs[i].data(), false, {}};
  const bool encoded = !d.force_full && encode_pending(&sources);
  if (!encoded) {
    // Tensors recorded from GPUs were not encoded: their bases take the bytes now.
    for (std::size_t i = 0; i < specs.size(); ++i) {
      const DeltaState::Pending& p = d.pending[i];
      if (p.src == nullptr) continue;
      codec().copy(d.base[i].dev, p.src, specs[i].local_nbytes(), p.stream);
      codec().wait(p.stream);
    }
  }
  const bool pays =
      encoded && static_cast<double>(d.wire) <= opts.delta_max_ratio * static_cast<double>(d.logical);
  bool encodable = false;
  for (const TensorSpec& t : specs) encodable = encodable || delta_encodes(t.dtype);
  std::uint64_t used = 0;
  if (pays) {
    // The blobs as this rank's pieces.
    const std::uint64_t wire = pack_blobs();
    std::vector<ManifestPiece> pieces(specs.size());
    for (std::size_t i = 0; i < specs.size(); ++i) {
      const TensorSpec& t = specs[i];
      ManifestPiece& p = pieces[i];
      p.tensor = static_cast<std::uint32_t>(i);
      p.dim = t.shard_dim < 0 ? kWholePiece : static_cast<std::uint16_t>(t.shard_dim);
      p.start = t.shard_dim < 0 ? 0 : t.shard_start;
      p.length = t.shard_dim < 0 ? 0 : t.shard_length;
      p.offset = offsets[i];
      p.nbytes = wire_sizes[i];
      p.base_version = delta_encodes(t.dtype) ? d.base_version : 0;
    }
    payload_bytes = wire;
    const std::uint64_t one_rank[1] = {stream_bytes};
    used = encode_manifest(specs, pieces, one_rank, round, payload_bytes, view.rank_list(rank),
                           view.room(view.rank_list(rank), manifest_size(specs, pieces.size(), 1)));
    d.posted = encodable ? DeltaState::Posted::kDelta : DeltaState::Posted::kNeutral;
    d.full = false;
  } else {
    wire_sizes.clear();
    stream_bytes = pack(specs, S, &offsets, &payload_bytes);
    used = encode_manifest(specs, offsets, round, stream_bytes, payload_bytes, view.rank_list(rank),
                           view.room(view.rank_list(rank), manifest_size(specs)));
    d.posted = encodable ? DeltaState::Posted::kFull : DeltaState::Posted::kNeutral;
    d.full = true;
  }
  if (used == 0) throw Error(Errc::kInvalidArgument, "this rank's list of pieces does not fit in manifest_bytes");
  // Posted from here on: a failure is the round's (begin_sharded fails or
  // abandons it for every rank), no longer this rank's drop.
  d.staged = false;
  in_sync = false;
  const std::uint64_t logical = [&] {
    std::uint64_t n = 0;
    for (const TensorSpec& t : specs) n += t.local_nbytes();
    return n;
  }();
  begin_sharded(round, used);  // rank 0's answer: its kind is adopted (adopt_round_kind)
  layout.payload_bytes = logical;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    if (!d.full) {
      write_tensor_in_sync(i, sources[i], nullptr, 0, kWhole);
      continue;
    }
    const DeltaState::Base& b = d.base[i];
    write_tensor_in_sync(i, b.dev != nullptr ? Buffer{b.dev, true, {}} : Buffer{b.host.get(), false, {}}, nullptr, 0,
                         kWhole);
  }
}

// A sharded delta rank, told the kind of its round by rank 0 (`base`: 0
// full, else a delta against that version): a rank that listed blobs and
// hears full lays its tensors out whole (rank 0 laid its list out the same
// way: pack() of the same sizes) and sends them from its base. Returns why
// the answer cannot be this rank's (rank 0 never answers so), else "".
std::string Producer::Impl::adopt_round_kind(std::uint64_t base) {
  DeltaState& d = delta;
  const std::string round_n = "sync round " + std::to_string(round);
  if (!opts.delta)
    return base == 0 ? "" : "rank 0 answered " + round_n + " as a delta sync, but this rank was created without delta";
  d.round_full = base == 0;
  if (base == 0) {
    if (d.posted == DeltaState::Posted::kDelta) {
      wire_sizes.clear();
      stream_bytes = pack(specs, view.geo().slot_bytes, &offsets, &payload_bytes);
      d.full = true;
    }
    return "";
  }
  if (d.posted == DeltaState::Posted::kFull)
    return "rank 0 answered " + round_n + " as a delta against version " + std::to_string(base) +
           ", but this rank listed its tensors whole";
  if (d.posted == DeltaState::Posted::kDelta && base != d.base_version)
    return "rank 0 answered " + round_n + " as a delta against version " + std::to_string(base) +
           ", but this rank's base holds version " + std::to_string(d.base_version);
  return "";
}

// Rank 0 of a sharded delta region, round n: the round's kind from every
// rank's list. A delta (returns its base) only when every rank that lists
// pieces a delta can carry listed them as blobs, all against one base, the
// last sync rank 0 completed (the version the consumers and every rank's
// base hold), and no consumer asks for a full sync; else full (returns 0),
// and every list of blobs is laid out again as whole pieces, as its rank
// does when it hears full (pack() of the pieces' logical sizes).
std::uint64_t Producer::Impl::round_kind(std::vector<SyncInfo>* posts) {
  std::uint64_t base = 0;
  bool full = false;
  for (const SyncInfo& p : *posts)
    for (const TensorInfo& t : p.tensors) {
      const ShardInfo& sh = t.shards[0];
      if (sh.base_version != 0) {
        if (base == 0) base = sh.base_version;
        if (sh.base_version != base) full = true;
      } else if (delta_encodes(t.dtype)) {
        full = true;  // listed whole: that rank sends a full sync
      }
    }
  if (base == 0 || base != last_completed || seat_wants_full()) full = true;
  if (!full) return base;
  for (SyncInfo& p : *posts) {
    bool blobs = false;
    for (const TensorInfo& t : p.tensors) blobs = blobs || t.shards[0].base_version != 0;
    if (!blobs) continue;
    std::vector<TensorSpec> sizes(p.tensors.size());
    for (std::size_t i = 0; i < p.tensors.size(); ++i) {
      sizes[i].dtype = DType::kRaw;
      sizes[i].shape = {static_cast<std::int64_t>(p.tensors[i].shards[0].nbytes)};
    }
    std::vector<std::uint64_t> at;
    std::uint64_t payload = 0;
    p.stream_bytes = pack(sizes, view.geo().slot_bytes, &at, &payload);
    p.payload_bytes = payload;
    p.wire_bytes = payload;
    p.base_version = 0;
    for (std::size_t i = 0; i < p.tensors.size(); ++i) {
      TensorInfo& t = p.tensors[i];
      t.stream_offset = at[i];
      t.shards[0].stream_offset = at[i];
      t.shards[0].wire_bytes = t.shards[0].nbytes;
      t.shards[0].base_version = 0;
    }
  }
  return 0;
}

}  // namespace shmcast
