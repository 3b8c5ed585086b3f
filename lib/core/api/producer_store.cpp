// api/ (layer 6): a producer's syncs whose bytes the caller writes in
// place. A store region (RegionMode::kStore): begin_sync fills the bank
// that readers do not hold, and fill_spans() lends it whole. A ring region
// of one rank: lend_chunk() lends slots, publish_chunks() publishes them.
// Runs on the caller's thread of the Producer.
#include <xxhash.h>

#include <span>
#include <vector>

#include "api/producer_impl.hpp"
#include "base/checks.hpp"
#include "base/text.hpp"
#include "protocol/manifest.hpp"
#include "protocol/ring.hpp"
#include "shm/region.hpp"
#include "shmcast/shmcast.hpp"

namespace shmcast {

using namespace detail;

// A store region: the sync is one chunk filling the bank that does not hold
// the version readers see; the record still announces that version until
// end_sync() has every byte of this one in place.
std::uint64_t Producer::Impl::begin_store(std::uint64_t want) {
  const std::uint64_t S = view.geo().slot_bytes;
  if (stream_bytes > S)
    throw Error(Errc::kInvalidArgument, "the sync needs " + human_bytes(stream_bytes) + " but the store region holds " +
                                            human_bytes(S) + " per version: create it with store_bytes >= " +
                                            std::to_string(stream_bytes) + " (store_bytes_needed)");
  const std::uint64_t v = want != 0 ? want : version + 1;
  const std::uint64_t seq = next_seq;
  writer = ChunkWriter(&*ring, &view, v, seq, stream_bytes, checksums, 0, 1, 1);
  version = v;
  in_sync = true;  // from here a failure aborts the sync (and keeps the bank for the next)
  try {
    // Waits for readers of the version two syncs back to let go of the
    // bank, then marks it being refilled; only then is its manifest rewritten.
    writer.claim_first();
    const std::uint64_t used = encode_manifest(specs, offsets, v, stream_bytes, payload_bytes, view.manifest_of(seq),
                                               view.room(view.manifest_of(seq), manifest_size(specs)));
    store_rec = RecordSnapshot{};
    store_rec.version = v;
    store_rec.first_seq = seq;
    store_rec.chunks = 1;
    store_rec.stream_bytes = stream_bytes;
    store_rec.manifest_used = used;
    store_rec.manifest_hash = XXH3_64bits(view.manifest_of(seq), used);
    // The bank describes its own version too (published with its seq), so
    // a reader can rebuild the record if this producer dies inside the
    // record flip (docs/protocol.md §11).
    SlotDesc& bank = view.slot(view.slot_of(seq));
    bank.manifest_used.store(used, std::memory_order_relaxed);
    bank.manifest_hash.store(store_rec.manifest_hash, std::memory_order_relaxed);
  } catch (const std::exception& e) {
    abort(e.what());
    throw;
  }
  sync_start_ns = mono_ns();
  layout = SyncLayout{v, seq, 1, stream_bytes, payload_bytes, offsets};
  layout.rank_chunks = 1;
  sync_payload = payload_bytes;
  first_seq = seq;
  rank_chunks = 1;
  next_tensor = 0;
  part_done = 0;
  lent = false;
  return v;
}

// fill_spans(): a store region's bank lent to the caller, one span per
// tensor; end_sync() publishes it.
std::vector<std::span<std::byte>> Producer::Impl::fill_spans() {
  require_open();
  if (quantizing())
    throw Error(Errc::kInvalidArgument, "fill_spans() on a quantizing producer: the region's bytes are FP8 the "
                                        "producer writes; use write()");
  if (!view.geo().store)
    throw Error(Errc::kInvalidArgument, "fill_spans() needs a store region: a ring region's slots hold only a "
                                        "part of the sync at a time; use write()");
  if (!in_sync) throw Error(Errc::kInvalidArgument, "fill_spans() outside a sync: call begin_sync() first");
  if (lent || next_tensor != 0 || part_done != 0)
    throw Error(Errc::kInvalidArgument, "fill_spans() after tensors of this sync were written or lent");
  std::byte* bank = view.slot_data(view.slot_of(first_seq));  // acquired by begin_sync()
  std::vector<std::span<std::byte>> out;
  out.reserve(specs.size());
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const std::uint64_t n = specs[i].local_nbytes();
    out.emplace_back(n == 0 ? nullptr : bank + offsets[i], n);
  }
  lent = true;
  next_tensor = specs.size();  // end_sync() publishes them all
  return out;
}

// lend_chunk(): a ring region's slot for chunk `c` lent to the caller, at
// most slots() ahead of the first unpublished chunk; publish_chunks(end)
// publishes chunks before `end`.
std::span<std::byte> Producer::Impl::lend_chunk(std::uint64_t c) {
  require_open();
  if (quantizing())
    throw Error(Errc::kInvalidArgument, "lend_chunk() on a quantizing producer: the slots' bytes are FP8 the "
                                        "producer writes; use write()");
  if (view.geo().store)
    throw Error(Errc::kInvalidArgument, "lend_chunk() needs a ring region: a store region lends its bank with "
                                        "fill_spans()");
  if (world > 1)
    throw Error(Errc::kInvalidArgument, "lend_chunk() is for a producer of one rank: sharded ranks write()");
  if (opts.delta && !(in_sync && fwd.active))
    throw Error(Errc::kInvalidArgument, "lend_chunk() hands out the stream's chunks, but a delta producer encodes "
                                        "tensors: write() them");
  if (view.geo().device_slots)
    throw Error(Errc::kUnsupported, "lend_chunk() hands a slot to host code, and the slots of '" + name +
                                        "' are GPU memory (device slots): write() or write_device() the tensors, "
                                        "or create the producer with host slots (slot_memory = kHost)");
  if (!in_sync) throw Error(Errc::kInvalidArgument, "lend_chunk() outside a sync: call begin_sync() first");
  if (!lent_chunks && (next_tensor != 0 || part_done != 0))
    throw Error(Errc::kInvalidArgument, "lend_chunk() after tensors of this sync were written: a sync is filled "
                                        "either by write() or by lend_chunk()");
  const std::uint64_t n = writer.chunks(), first = writer.published(), k = view.geo().slot_count;
  if (c >= n)
    throw Error(Errc::kInvalidArgument, "lend_chunk(" + std::to_string(c) + "): the sync has " + std::to_string(n) +
                                            " chunks");
  if (c < first)
    throw Error(Errc::kInvalidArgument, "lend_chunk(" + std::to_string(c) + "): that chunk is already published");
  if (c - first >= k)
    throw Error(Errc::kInvalidArgument, "lend_chunk(" + std::to_string(c) + "): at most slots() = " +
                                            std::to_string(k) + " chunks can be lent ahead of the first unpublished "
                                            "one (" + std::to_string(first) + "): publish_chunks() first");
  try {
    std::uint64_t room = 0;
    std::byte* p = writer.claim(c * view.geo().slot_bytes, &room);
    lent_chunks = true;
    next_tensor = specs.size();  // no write(); end_sync() publishes the rest
    return {p, room};
  } catch (const std::exception& e) {
    abort(e.what());
    throw;
  }
}

void Producer::Impl::publish_chunks(std::uint64_t end) {
  require_open();
  if (!in_sync || !lent_chunks)
    throw Error(Errc::kInvalidArgument, "publish_chunks() with no chunk lent in this sync: call lend_chunk() first");
  const std::uint64_t n = writer.chunks();
  if (end > n)
    throw Error(Errc::kInvalidArgument, "publish_chunks(" + std::to_string(end) + "): the sync has " +
                                            std::to_string(n) + " chunks");
  if (end > writer.acquired())
    throw Error(Errc::kInvalidArgument, "publish_chunks(" + std::to_string(end) + "): chunk " +
                                            std::to_string(writer.acquired()) + " was never lent");
  try {
    complete_below(end == n ? stream_bytes : end * view.geo().slot_bytes);
  } catch (const std::exception& e) {
    abort(e.what());
    throw;
  }
}

}  // namespace shmcast
