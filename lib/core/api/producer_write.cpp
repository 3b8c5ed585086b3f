// api/ (layer 6): a sync of every producer mode, and the ring's write path.
// begin_sync's checks (shared by every mode) and the begin of a ring region
// of one rank; write() (write_tensor: claims slots, copies through the
// engine, publishes each chunk once complete; progressive fill for host
// copies); end_sync (the sharded waits are in producer_ranks.cpp) and
// abort. Runs on the caller's thread; the engine's completion threads only
// run the publish callbacks of complete_below.
#include <xxhash.h>

#include <functional>
#include <string_view>

#include "api/producer_impl.hpp"
#include "base/checks.hpp"
#include "base/text.hpp"
#include "engine/engine.hpp"
#include "engine/quant.hpp"
#include "protocol/manifest.hpp"
#include "protocol/ring.hpp"
#include "protocol/rounds.hpp"
#include "shm/doorbell.hpp"
#include "shm/region.hpp"
#include "shmcast/shmcast.hpp"

namespace shmcast {

using namespace detail;

namespace {
constexpr std::uint64_t kFillStep = 2ull << 20;  // progressive-fill granularity
}  // namespace

// begin_sync() of every mode: the checks they share, the tensors packed
// into this rank's stream, then the mode's own begin (sharded: the round,
// producer_ranks.cpp; store: producer_store.cpp; else begin_ring below).
std::uint64_t Producer::Impl::begin_sync(std::span<const TensorSpec> tensors, std::uint64_t want) {
  // send()'s and prepare_device()'s scales are for this call only, whether
  // it begins the sync or throws: a later sync never takes them (the
  // caller may have changed the tensors in place since).
  const bool pre = std::exchange(quant.pre_pending, false);
  const bool dpre = std::exchange(quant.dpre_pending, false);
  require_open();
  if (in_sync) throw Error(Errc::kInvalidArgument, "begin_sync() while a sync is in progress: end_sync() it first");
  // Sharded: the sync's round (its version); a refusal from here on still
  // takes the round (drop_round), so the ranks stay in step.
  std::uint64_t n = 0, used = 0;
  if (world > 1) {
    if (const std::string why = rounds::next_round(round, want, &n); !why.empty())
      throw Error(Errc::kInvalidArgument, "begin_sync(): " + why);
    settle_dropped();  // the reason of a round it dropped is read before its list area is written again
  } else if (want != 0 && want <= version) {
    throw Error(Errc::kInvalidArgument, "begin_sync() version " + std::to_string(want) +
                                            " is not greater than the last, " + std::to_string(version));
  }
  try {
    if (tensors.size() > kMaxTensors)  // before any per-tensor work
      throw Error(Errc::kInvalidArgument, "more than " + std::to_string(kMaxTensors) + " tensors in one sync");
    if (quantizing()) {
      // The manifest carries each selected tensor as FP8 plus its scales
      // (producer_quant.cpp); the caller still writes its own list.
      quant.use_pre = pre;  // send()'s scales, for this sync only
      quant.use_dpre = dpre;  // prepare_device()'s, likewise
      if (quant.gpu && !quant.use_dpre) {
        // The last sync's quantize kernels read their multipliers until
        // they have run: only then may this sync's reuse the room.
        try {
          engine->drain();
        } catch (const Error&) {  // that sync reported its copy error already
        }
        quant.gpu->reset();
      }
      quant.wire = quant_specs(tensors);
      quant.user.assign(tensors.begin(), tensors.end());
      quant.logical = 0;
      for (const TensorSpec& t : tensors) quant.logical += validate_spec(t).empty() ? t.local_nbytes() : 0;
      tensors = quant.wire;
    }
    // A region file cut by another process would SIGBUS us on its missing
    // pages: refuse cleanly when it happened between syncs (docs/reliability.md).
    if (const std::uint64_t now = view.file().size_now(); now != view.geo().total_bytes)
      throw Error(Errc::kCorrupt, "region file " + path + " is " + std::to_string(now) + " bytes, not " +
                                      std::to_string(view.geo().total_bytes) +
                                      ": another process truncated or resized it; close this producer and create "
                                      "the region again");
    if (tensors.size() > kMaxTensors)  // the wire list: quantizing adds the scales
      throw Error(Errc::kInvalidArgument, "more than " + std::to_string(kMaxTensors) +
                                              " tensors in one sync (with their FP8 scales)");
    dup_names.reset(tensors.size());
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const std::string why = validate_spec(tensors[i]);
      if (!why.empty()) throw Error(Errc::kInvalidArgument, "tensor " + std::to_string(i) + " ('" + tensors[i].name + "'): " + why);
      if (!dup_names.insert(tensors[i].name))
        throw Error(Errc::kInvalidArgument, "tensor name '" + tensors[i].name + "' appears twice in one sync");
    }
    if (world == 1) {
      for (const TensorSpec& t : tensors)
        if (t.shard_dim != -1)
          throw Error(Errc::kInvalidArgument, "'" + t.name + "' is a shard, but this producer has one rank: create "
                                              "every rank with rank/world_size, or send the whole tensor");
    }
    const std::uint64_t need = manifest_size(tensors);
    if (std::string why = manifest_room_problem(tensors, view.geo().manifest_bytes); !why.empty())
      throw Error(Errc::kInvalidArgument, why);
    if (std::uint64_t total; !detail::payload_bytes(tensors, &total))
      throw Error(Errc::kInvalidArgument, "one sync may carry at most 64 TiB");
    specs.assign(tensors.begin(), tensors.end());
    stream_bytes = pack(specs, view.geo().slot_bytes, &offsets, &payload_bytes);
    if (stream_bytes > kMaxStreamBytes)  // with alignment padding: what consumers check
      throw Error(Errc::kInvalidArgument, "the sync's stream (tensors and alignment) exceeds 64 TiB");
    if (world > 1) {
      // This rank's list of pieces, in the one-rank manifest format.
      used = encode_manifest(specs, offsets, n, stream_bytes, payload_bytes, view.rank_list(rank),
                             view.room(view.rank_list(rank), need));
      if (used == 0)
        throw Error(Errc::kInvalidArgument, "this rank's list of pieces does not fit in manifest_bytes");
    }
  } catch (const Error& e) {
    if (world > 1) drop_round(n, e.code(), e.what());
    throw;
  } catch (const std::exception& e) {
    if (world > 1) drop_round(n, Errc::kSystem, e.what());
    throw;
  }
  if (world > 1) return opts.delta ? begin_delta_sharded(n, used) : begin_sharded(n, used);
  if (view.geo().store) return begin_store(want);
  if (opts.delta) {
    fwd.active = fwd.requested;  // begin_forwarded() (producer_forward.cpp)
    return fwd.active ? begin_forward(want) : begin_delta(want);
  }
  return begin_ring(want);
}

// A ring region of one rank: the manifest is rewritten in place and
// announced at once; the chunks follow as write() fills them.
std::uint64_t Producer::Impl::begin_ring(std::uint64_t want, std::span<const ManifestPiece> pieces) {
  // Nobody may still be reading the manifest area we are about to rewrite.
  if (last_completed > 0) ring->wait_acks(last_completed);
  sync_start_ns = mono_ns();
  version = want != 0 ? want : version + 1;
  writer = ChunkWriter(&*ring, &view, version, next_seq, stream_bytes, checksums);
  ring->begin_announce();  // consumers copying the old manifest will see it change
  const std::uint64_t one_rank[1] = {stream_bytes};
  const std::uint64_t room =
      view.room(view.manifest(), pieces.empty() ? manifest_size(specs) : manifest_size(specs, pieces.size(), 1));
  const std::uint64_t used =
      pieces.empty() ? encode_manifest(specs, offsets, version, stream_bytes, payload_bytes, view.manifest(), room)
                     : encode_manifest(specs, pieces, one_rank, version, payload_bytes, view.manifest(), room);
  RecordSnapshot rec{};
  rec.version = version;
  rec.first_seq = next_seq;
  rec.chunks = writer.chunks();
  rec.stream_bytes = stream_bytes;
  rec.manifest_used = used;
  rec.manifest_hash = XXH3_64bits(view.manifest(), used);
  view.header().error_code.store(0, std::memory_order_relaxed);
  view.header().error_text[0] = 0;
  layout = SyncLayout{version, rec.first_seq, rec.chunks, stream_bytes, payload_bytes, offsets};
  layout.rank_chunks = rec.chunks;
  sync_payload = payload_bytes;
  first_seq = rec.first_seq;
  rank_chunks = rec.chunks;
  ring->set_sync(version, rec.first_seq);
  ring->enroll(version, rec.first_seq);
  ring->announce(rec);
  in_sync = true;
  next_tensor = 0;
  part_done = 0;
  lent_chunks = false;
  return version;
}

// Hands chunks that end at or before stream byte `pos` to the engine,
// which publishes each once its bytes are complete.
void Producer::Impl::complete_below(std::uint64_t pos) {
  writer.complete_below(pos, [this](std::function<void()> publish) { engine->chunk_done(std::move(publish)); });
}

// A write that fails leaves nothing half-announced: the sync is aborted
// (consumers get kAborted with the reason) before the error propagates.
// Bytes [from, from + len) of the tensor (len kWhole: all of it); src
// points at byte `from`.
void Producer::Impl::write_tensor(std::size_t index, const Buffer& src, void* stream, std::uint64_t from,
                                  std::uint64_t len) {
  require_open();
  if (!in_sync) throw Error(Errc::kInvalidArgument, "write() outside a sync: call begin_sync() first");
  if (lent)
    throw Error(Errc::kInvalidArgument, "write() in a sync whose tensors were lent out by fill_spans(): fill the "
                                        "spans, then end_sync()");
  if (lent_chunks)
    throw Error(Errc::kInvalidArgument, "write() in a sync whose slots were lent out by lend_chunk(): fill them, "
                                        "publish_chunks(), then end_sync()");
  try {
    if (delta.staged)
      write_staged(index, src, stream, from, len);
    else if (opts.delta && delta.full && !fwd.active)
      write_keyframe(index, src, stream, from, len);
    else
      write_tensor_in_sync(index, src, stream, from, len);
  } catch (const Error& e) {
    abort(e.what(), e.code());
    throw;
  } catch (const std::exception& e) {
    abort(e.what());
    throw;
  }
}

void Producer::Impl::write_tensor_in_sync(std::size_t index, const Buffer& src, void* stream, std::uint64_t from,
                                          std::uint64_t len) {
  if (src.device && !engine->is_cuda())
    throw Error(Errc::kInvalidArgument, "write_device() on a producer with the host copy engine: create it with "
                                        "engine = CopyEngine::kCuda (or kAuto on a machine with a GPU), or copy "
                                        "the tensor to host memory and write() it");
  if (index != next_tensor) {
    if (index >= specs.size())
      throw Error(Errc::kInvalidArgument, "tensor index " + std::to_string(index) + " is out of range (the sync has " +
                                              std::to_string(specs.size()) + " tensors)");
    throw Error(Errc::kInvalidArgument, "tensors must be written in manifest order: expected index " +
                                            std::to_string(next_tensor) + " ('" +
                                            (next_tensor < specs.size() ? specs[next_tensor].name : "") + "'), got " +
                                            std::to_string(index));
  }
  const std::uint64_t n = wire_sizes.empty() ? specs[index].local_nbytes() : wire_sizes[index];
  if (from != part_done || (len != kWhole && len > n - from))
    throw Error(Errc::kInvalidArgument, "write_part() of '" + specs[index].name + "': bytes [" + std::to_string(from) +
                                            ", +" + std::to_string(len) + ") do not follow the " +
                                            std::to_string(part_done) + " written of its " + std::to_string(n));
  const std::uint64_t to = len == kWhole ? n : from + len;
  if (src.layout.rows != 0) {
    std::uint64_t total;
    if (__builtin_mul_overflow(src.layout.rows, src.layout.row_bytes, &total) || total != n ||
        src.layout.pitch_bytes < src.layout.row_bytes)
      throw Error(Errc::kInvalidArgument, "strided layout of '" + specs[index].name +
                                              "' does not match its size (rows x row_bytes must equal nbytes, "
                                              "pitch_bytes >= row_bytes)");
  }
  if (to > from && src.ptr == nullptr)
    throw Error(Errc::kInvalidArgument, "null source for tensor '" + specs[index].name + "'");
  const std::uint64_t off = offsets[index];
  if (src.device) engine->begin(stream);
  // Bytes [at, at + n) of the tensor into slot memory: copied by the engine,
  // or (quantize-on-send) the e4m3fn codes of elements [at, at + n), written
  // here into the host slot.
  auto copy_in = [this](std::byte* d, const Buffer& b, std::uint64_t at, std::uint64_t n2) {
    if (b.qm != nullptr)
      quant::quantize_elems(d, *b.qm, *b.qs, at, n2);
    else
      engine->copy(d, b, at, n2);
  };
  // Progressive fill only when every earlier byte of the chunk is final
  // once written: host copies, no async engine, no checksum to wait for.
  const bool follow = !src.device && !engine->is_cuda() && !checksums;
  std::uint64_t done = from;
  while (done < to) {
    const std::uint64_t pos = off + done;
    complete_below(pos);
    std::uint64_t room;
    std::byte* dst = writer.claim(pos, &room);
    const std::uint64_t len = (to - done) < room ? (to - done) : room;
    if (follow) {
      // Copy in cache-sized steps and mark each final, so consumers copy
      // the bytes out while they are still in the cache.
      for (std::uint64_t step = 0; step < len;) {
        const std::uint64_t n2 = len - step < kFillStep ? len - step : kFillStep;
        copy_in(dst + step, src, done - from + step, n2);
        step += n2;
        writer.filled_to(pos + step);
      }
    } else {
      copy_in(dst, src, done - from, len);
    }
    done += len;
  }
  part_done = to;
  if (to < n) return;
  part_done = 0;
  ++next_tensor;
  complete_below(next_tensor < specs.size() ? offsets[next_tensor] : stream_bytes);
}

// Stream bytes [from, to) from `dev` (device memory laid out as the
// stream: a mirrored delta sync's blobs), after the work queued on
// `stream`: a copy per chunk.
void Producer::Impl::write_stream_range(const std::byte* dev, std::uint64_t from, std::uint64_t to, void* stream) {
  engine->begin(stream);
  const Buffer src{const_cast<std::byte*>(dev), true, {}};
  for (std::uint64_t pos = from; pos < to;) {
    complete_below(pos);
    std::uint64_t room;
    std::byte* dst = writer.claim(pos, &room);
    const std::uint64_t len = (to - pos) < room ? (to - pos) : room;
    engine->copy(dst, src, pos, len);
    pos += len;
  }
  complete_below(to);
}

void Producer::Impl::end_sync() {
  require_open();
  if (!in_sync) throw Error(Errc::kInvalidArgument, "end_sync() without begin_sync()");
  if (next_tensor != specs.size())
    throw Error(Errc::kInvalidArgument, "end_sync() before every tensor was written: next is '" +
                                            specs[next_tensor].name + "' (index " +
                                            std::to_string(next_tensor) + ")");
  try {
    if (delta.staged) end_staged();  // announces the sync and writes it (producer_delta.cpp)
    complete_below(stream_bytes);
    engine->drain();
    if (world > 1) end_sharded();  // waits for the other ranks (producer_ranks.cpp)
  } catch (const Error& e) {
    abort(e.what(), e.code());
    throw;
  } catch (const std::exception& e) {
    abort(e.what());
    throw;
  }
  next_seq = writer.next_seq();
  in_sync = false;
  last_completed = version;
  ring->clear_sync();
  if (world > 1 && leader()) detail::ring(view.header().rank_reply);  // complete: the others return
  // A store region: every byte is in place (the chunk is published), so the
  // record may now point readers at it.
  if (view.geo().store) ring->announce(store_rec);
  if (opts.delta && fwd.active)
    forward_done();
  else if (opts.delta)
    delta_done();
  else
    report = SyncReport{version, false, payload_bytes, payload_bytes};
  if (quantizing()) {
    report.logical_bytes = quant.logical;  // the caller's tensors (e.g. bf16); payload_bytes: what crossed
    quant.use_pre = false;
    quant.use_dpre = false;
  }
  if (!leader()) {
    RankSeat& rs = view.rank_seat(rank);
    rs.syncs_done.fetch_add(1, std::memory_order_relaxed);
    rs.bytes_done.fetch_add(payload_bytes, std::memory_order_relaxed);
    return;
  }
  Header& h = view.header();
  h.syncs_done.fetch_add(1, std::memory_order_relaxed);
  h.bytes_done.fetch_add(sync_payload, std::memory_order_relaxed);
  h.last_sync_ns.store(static_cast<std::uint64_t>(mono_ns() - sync_start_ns), std::memory_order_relaxed);
  h.last_end_unix_ns.store(static_cast<std::uint64_t>(unix_ns()), std::memory_order_relaxed);
}

void Producer::Impl::set_error_text(Errc code, const std::string& text) {
  Header& h = view.header();
  write_error_text(h.error_text, world > 1 ? "rank " + std::to_string(rank) + ": " + text : text);
  h.error_code.store(static_cast<std::uint32_t>(code), std::memory_order_release);
}

// Ends the sync in progress unfinished: consumers get Aborted with `why`,
// the other ranks `code` when it names a culprit (Timeout, PeerDied), else
// Aborted. The next sync starts clean: nothing here outlives this sync.
void Producer::Impl::abort(std::string_view why, Errc code) {
  if (!in_sync) return;
  quant.use_pre = false;
  quant.use_dpre = false;
  if (opts.delta) {
    delta.valid = false;  // the base may be ahead of what the consumers hold: the next sync is full
    if (delta.staged) {   // nothing was announced
      delta.staged = false;
      delta.blobs.clear();
      in_sync = false;
      // Sharded: nothing was posted either; the round is dropped, so the
      // other ranks fail it at once instead of waiting for this rank's list.
      if (world > 1) drop_round(round, code, std::string(why));
      return;
    }
  }
  if (world > 1) {
    // Sharded: the sync's fate is decided once; rank 0 may have completed
    // it already (every chunk is in), and then there is nothing to abort.
    const rounds::Decision d = abandon_won ? rounds::Decision::kWon : rounds::abandon_round(words(), version);
    abandon_won = false;
    if (d == rounds::Decision::kOpposite) {
      ring->clear_sync();
      next_seq = writer.next_seq();
      in_sync = false;
      return;
    }
    // Only the rank that abandoned the sync writes the reason (one text,
    // never two mixed); the others wait for it to be there before they
    // abort the consumers' sync.
    if (d == rounds::Decision::kWon) {
      hit(TestPoint::kAbandonWon, version);
      set_error_text(code, std::string(why));
    } else if (d == rounds::Decision::kCorrupt) {
      set_error_text(Errc::kCorrupt, std::string(why));
    } else {
      (void)abandon_reason(version);
    }
  } else {
    set_error_text(code, std::string(why));
  }
  try {
    engine->drain();
  } catch (...) {
  }
  ring->abort(version);
  // A store region announced nothing: the next sync refills the same bank
  // (the other one holds the version readers see).
  if (!view.geo().store) next_seq = writer.next_seq();
  ring->clear_sync();
  in_sync = false;
}

}  // namespace shmcast
