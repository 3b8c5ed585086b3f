// api/ (layer 6): delta syncs of a producer (ProducerOptions::delta; ring
// regions of one rank). docs/protocol.md §12 is the blob format, §9 the
// full-sync requests.
//
// The producer keeps a base: the bytes of every tensor as it last sent
// them, in host memory. A sync is decided at begin_sync():
//   - full (a keyframe) when there is no valid base (the first sync, or the
//     last one was aborted), the tensors changed (names, dtypes, shapes), a
//     consumer asked for one (Seat::full_after), or keyframe_every says so:
//     it goes out as today (begin_ring at once), and each tensor's bytes are
//     copied into the base as they are written;
//   - else staged: each write() compares the tensor with its base as raw
//     words and encodes the changed elements into a private blob, updating
//     the base (delta::plan, delta::encode); nothing is announced yet.
//     end_sync() then announces the blobs as the sync's pieces (each naming
//     the base version) and streams them through the ring, or, when a
//     consumer asked for a full sync meanwhile or the blobs would take more
//     than delta_max_ratio of the full size, streams the base (which now
//     holds the new bytes) as a full sync.
// An aborted sync leaves the base ahead of what consumers hold: the next
// sync is full.
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

bool detail::same_tensor_set(const std::vector<TensorSpec>& a, const std::vector<TensorSpec>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].name != b[i].name || a[i].dtype != b[i].dtype || a[i].shape != b[i].shape ||
        a[i].shard_dim != b[i].shard_dim || a[i].shard_start != b[i].shard_start ||
        a[i].shard_length != b[i].shard_length)
      return false;
  return true;
}

// Whether a live seat asked for a full sync after a version the last full
// sync does not cover (protocol.md §9); *after (when given): the latest
// such version.
bool Producer::Impl::seat_wants_full(std::uint64_t* after) const {
  bool want = false;
  for (std::uint32_t i = 0; i < view.geo().max_consumers; ++i) {
    const Seat& s = view.seat(i);
    if (seat_state(s.word.load(std::memory_order_acquire)) != kSeatActive) continue;
    const std::uint64_t a = s.full_after.load(std::memory_order_acquire);
    if (a < delta.last_full) continue;
    if (after == nullptr) return true;
    want = true;
    *after = std::max(*after, a);
  }
  return want;
}

// Why this sync must be full (a keyframe), or "" when it may be a delta;
// resets the per-sync state, and (the tensors changed) the base.
std::string Producer::Impl::keyframe_reason() {
  DeltaState& d = delta;
  if (opts.world_size == 1 && !same_tensor_set(specs, d.specs)) switch_group();
  std::string why;
  if (!d.valid)
    why = d.base_version == 0 ? "first sync" : "the last sync was aborted";
  else if (!same_tensor_set(specs, d.specs))
    why = "the tensors changed";
  else if (opts.keyframe_every > 0 && d.deltas_since_full + 1 >= opts.keyframe_every)
    why = "keyframe_every";
  else if (seat_wants_full())
    why = "a consumer asked for a full sync";
  d.valid = false;  // until this sync completes
  d.wire = 0;
  d.logical = 0;
  d.force_full = false;
  for (const TensorSpec& t : specs) d.logical += t.local_nbytes();
  if (!why.empty() && !same_tensor_set(specs, d.specs)) {
    for (DeltaState::Base& b : d.base)
      if (b.dev != nullptr) d.codec->release(b.dev);
    d.base.clear();
    d.base.resize(specs.size());
    d.base_bytes = 0;
    d.specs = specs;
  }
  return why;
}

// Other tensors than the last sync's (one rank): an update sent as several
// syncs (buckets) keeps a base per tensor set. The current set is parked
// when consumers hold it (its last sync completed) and no tensor of it is in
// the new set; a parked set of exactly these tensors comes back (its next
// sync may be a delta against its own last version); a parked set sharing a
// tensor with them is dropped (the tensors were regrouped: their bytes are in
// the new set's base from now on). At most kMaxDeltaGroups sets are kept, the
// least recently sent dropped first.
void Producer::Impl::switch_group() {
  DeltaState& d = delta;
  const TensorNames names(specs);
  auto shares = [&](const std::vector<TensorSpec>& set) { return names.shared_by(set); };
  auto release = [&](std::vector<DeltaState::Base>& base) {
    for (DeltaState::Base& b : base)
      if (b.dev != nullptr) d.codec->release(b.dev);
    base.clear();
  };
  if (d.valid && !d.specs.empty() && !shares(d.specs)) {
    d.parked_bytes += d.base_bytes;
    d.parked.push_back(DeltaState::Group{std::move(d.specs), std::move(d.base), d.base_bytes, d.valid, d.base_version,
                                         d.last_full, d.deltas_since_full});
  } else {
    release(d.base);
  }
  DeltaState::Group back;
  bool found = false;
  for (auto it = d.parked.begin(); it != d.parked.end();) {
    const bool same = !found && same_tensor_set(specs, it->specs);
    if (!same && !shares(it->specs)) {
      ++it;
      continue;
    }
    d.parked_bytes -= it->base_bytes;
    if (same) {
      back = std::move(*it);
      found = true;
    } else {
      release(it->base);
    }
    it = d.parked.erase(it);
  }
  while (!d.parked.empty() && d.parked.size() + 1 > limits::kMaxDeltaGroups) {
    d.parked_bytes -= d.parked.front().base_bytes;
    release(d.parked.front().base);
    d.parked.erase(d.parked.begin());
  }
  if (!found) {
    back.specs = specs;
    back.base.resize(specs.size());
  }
  d.specs = std::move(back.specs);
  d.base = std::move(back.base);
  d.base_bytes = back.base_bytes;
  d.valid = back.valid;
  d.base_version = back.base_version;
  d.last_full = back.last_full;
  d.deltas_since_full = back.deltas_since_full;
}

// A staged sync begins (version `want`, 0: the next): its tensors are
// gathered and encoded by write() (host) or end_sync() (GPU).
void Producer::Impl::stage(std::uint64_t want) {
  DeltaState& d = delta;
  d.staged = true;
  d.full = false;
  d.want = want;
  d.blobs.assign(specs.size(), {});
  d.pending.assign(specs.size(), {});
  d.raw_from_base.assign(specs.size(), false);
  sync_start_ns = mono_ns();
  in_sync = true;
  next_tensor = 0;
  part_done = 0;
  lent_chunks = false;
}

std::uint64_t Producer::Impl::begin_delta(std::uint64_t want) {
  DeltaState& d = delta;
  const std::string why = keyframe_reason();
  if (!why.empty()) {
    // A keyframe: the base takes the tensors' bytes as they are written.
    d.staged = false;
    d.full = true;
    wire_sizes.clear();
    return begin_ring(want);
  }
  // Staged: encoded by write() (host) or end_sync() (GPU), announced by end_sync().
  if (last_completed > 0) ring->wait_acks(last_completed);
  stage(want);
  return want != 0 ? want : version + 1;
}

// Whether the CUDA codec can run here (built with its kernels, a driver
// that loads them into the context of `stream`): else every base stays on
// the host (a GPU tensor is copied down and encoded on the host), so a
// delta producer still works, at PCIe speed.
bool Producer::Impl::codec_usable(void* stream) {
  if (delta.codec_ok < 0) {
    std::string why;
    delta.codec_ok = 0;
    if (delta::cuda_codec_available(&why)) {
      try {
        (void)codec().buffer(3, 256, stream);  // loads the kernels into the stream's context
        delta.codec_ok = 1;
      } catch (const Error&) {
      }
    }
  }
  return delta.codec_ok == 1;
}

delta::CudaCodec& Producer::Impl::codec() {
  if (!delta.codec) delta.codec = std::make_unique<delta::CudaCodec>();
  return *delta.codec;
}

// Tensor i's base in host memory (its bytes unset), dropping a device one.
void Producer::Impl::base_on_host(std::size_t i) {
  DeltaState::Base& b = delta.base[i];
  const std::uint64_t n = specs[i].local_nbytes();
  if (b.dev != nullptr) {
    codec().release(b.dev);
    b.dev = nullptr;
    delta.base_bytes -= b.bytes;
    b.bytes = 0;
  }
  if (!b.host && n > 0) {
    b.host.reset(new std::byte[n]);
    b.bytes = n;
    delta.base_bytes += n;
  }
}

// Tensor i's base on the device of `stream` (its bytes unset), dropping a host one.
void Producer::Impl::base_on_device(std::size_t i, void* stream) {
  DeltaState::Base& b = delta.base[i];
  const std::uint64_t n = specs[i].local_nbytes();
  if (b.host) {
    b.host.reset();
    delta.base_bytes -= b.bytes;
    b.bytes = 0;
  }
  if (b.dev == nullptr && n > 0) {
    b.dev = codec().alloc(n, stream);
    b.bytes = n;
    delta.base_bytes += n;
  }
}

// The source of bytes [from, from + len) of a tensor as one contiguous host
// range: `src` itself when it is contiguous host memory, else gathered into
// `into` (strided rows, device memory through the engine).
const std::byte* Producer::Impl::delta_source(const Buffer& src, std::uint64_t from, std::uint64_t len,
                                              std::byte* into) {
  if (!src.device && src.layout.rows == 0) return static_cast<const std::byte*>(src.ptr);
  engine->copy(into, src, from, len);
  engine->drain();
  return into;
}

// A keyframe's write in a delta producer. From a GPU, contiguous: the base
// is on that GPU (a device-to-device copy on the caller's stream) and the
// tensor goes through the ring as any write_device(). Else the bytes go
// into a host base first, then from there through the ring.
void Producer::Impl::write_keyframe(std::size_t index, const Buffer& src, void* stream, std::uint64_t from,
                                    std::uint64_t len) {
  const std::uint64_t n = specs[index].local_nbytes();
  const std::uint64_t to = len == kWhole ? n : from + len;
  if (index != next_tensor || from != part_done || to > n || to <= from || src.ptr == nullptr ||
      (src.device && !engine->is_cuda())) {
    write_tensor_in_sync(index, src, stream, from, len);  // its checks throw (or an empty tensor goes)
    return;
  }
  if (src.device && src.layout.rows == 0 && codec_usable(stream)) {
    base_on_device(index, stream);
    codec().copy(static_cast<std::byte*>(delta.base[index].dev) + from, src.ptr, to - from, stream);
    write_tensor_in_sync(index, src, stream, from, len);
    return;
  }
  if (from == 0) base_on_host(index);
  std::byte* base = delta.base[index].host.get() + from;
  if (src.device) engine->begin(stream);
  const std::byte* p = delta_source(src, 0, to - from, base);
  if (p != base) std::memcpy(base, p, to - from);
  write_tensor_in_sync(index, Buffer{base, false, {}}, nullptr, from, to - from);
}

// A staged write: tensor `index`'s bytes [from, to) are gathered (parts)
// and, once whole, encoded against the base: on the host now, or (a base
// on the GPU) recorded for end_sync(), which encodes every such tensor on
// its GPU.
void Producer::Impl::write_staged(std::size_t index, const Buffer& src, void* stream, std::uint64_t from,
                                  std::uint64_t len) {
  if (index != next_tensor)
    throw Error(Errc::kInvalidArgument, "tensors must be written in manifest order: expected index " +
                                            std::to_string(next_tensor) + ", got " + std::to_string(index));
  const TensorSpec& t = specs[index];
  const std::uint64_t n = t.local_nbytes();
  if (from != part_done || (len != kWhole && len > n - from))
    throw Error(Errc::kInvalidArgument, "write_part() of '" + t.name + "': bytes [" + std::to_string(from) + ", +" +
                                            std::to_string(len) + ") do not follow the " + std::to_string(part_done) +
                                            " written of its " + std::to_string(n));
  const std::uint64_t to = len == kWhole ? n : from + len;
  if (src.layout.rows != 0) {
    std::uint64_t total;
    if (__builtin_mul_overflow(src.layout.rows, src.layout.row_bytes, &total) || total != n ||
        src.layout.pitch_bytes < src.layout.row_bytes)
      throw Error(Errc::kInvalidArgument, "strided layout of '" + t.name +
                                              "' does not match its size (rows x row_bytes must equal nbytes, "
                                              "pitch_bytes >= row_bytes)");
  }
  if (to > from && src.ptr == nullptr) throw Error(Errc::kInvalidArgument, "null source for tensor '" + t.name + "'");
  if (src.device && !engine->is_cuda())
    throw Error(Errc::kInvalidArgument, "write_device() on a producer with the host copy engine: create it with "
                                        "engine = CopyEngine::kCuda (or kAuto on a machine with a GPU), or copy "
                                        "the tensor to host memory and write() it");
  DeltaState::Base& b = delta.base[index];
  if (b.dev != nullptr) {
    // A base on the GPU. A contiguous GPU source, 8-byte aligned: encoded
    // on the GPU by end_sync(). Anything else updates the base as it is:
    // a dtype sent as its bytes then goes from there, any other makes this
    // sync full (the base then holds the new bytes).
    if (from == 0 && to == n && src.device && src.layout.rows == 0 && delta_encodes(t.dtype) &&
        reinterpret_cast<std::uintptr_t>(src.ptr) % 8 == 0) {
      delta.pending[index] = DeltaState::Pending{src.ptr, stream};
      ++next_tensor;
      return;
    }
    if (src.device && src.layout.rows == 0) {
      codec().copy(static_cast<std::byte*>(b.dev) + from, src.ptr, to - from, stream);
      codec().wait(stream);
    } else {
      delta.scratch.resize(to - from);
      if (src.device) engine->begin(stream);
      const std::byte* p = delta_source(src, 0, to - from, delta.scratch.data());
      codec().upload(static_cast<std::byte*>(b.dev) + from, p, to - from, stream);
      codec().wait(stream);
    }
    if (delta_encodes(t.dtype)) {
      delta.force_full = true;
    } else if (to == n) {
      // A dtype sent as its bytes in every sync: from its base, which holds them now.
      delta.raw_from_base[index] = true;
      delta.wire += n;
    }
    part_done = to < n ? to : 0;
    if (to == n) ++next_tensor;
    return;
  }
  if (src.device) engine->begin(stream);
  const std::byte* next = nullptr;
  static const std::byte kEmpty[8] = {};
  if (n == 0) {
    next = kEmpty;  // an empty tensor: an empty blob
  } else if (from == 0 && to == n) {
    if (!src.device && src.layout.rows == 0) {
      next = static_cast<const std::byte*>(src.ptr);
    } else {
      delta.scratch.resize(n);
      next = delta_source(src, 0, n, delta.scratch.data());
    }
  } else {
    // Parts: gathered until the tensor is whole.
    delta.scratch.resize(n);
    const std::byte* p = delta_source(src, 0, to - from, delta.scratch.data() + from);
    if (p != delta.scratch.data() + from) std::memcpy(delta.scratch.data() + from, p, to - from);
    part_done = to;
    if (to < n) return;
    next = delta.scratch.data();
  }
  part_done = 0;
  std::vector<std::byte>& blob = delta.blobs[index];
  if (!b.host && n > 0) {  // (a tensor of the last full sync that was empty then cannot be: same shapes)
    throw Error(Errc::kInvalidArgument, "tensor '" + t.name + "' has no delta base: start a new producer");
  }
  if (!delta_encodes(t.dtype)) {
    // Sent as its bytes (a raw piece of the delta sync).
    blob.assign(next, next + n);
    if (n > 0) std::memcpy(b.host.get(), next, n);
  } else {
    const std::uint32_t w = delta::elem_width(t.dtype);
    std::byte empty_base[8] = {};
    std::byte* base = n == 0 ? empty_base : b.host.get();
    const delta::Plan p = delta::plan(base, next, w, n / w);
    blob.resize(p.blob_bytes());
    delta::encode(p, base, next, blob.data(), blob.size());
  }
  delta.wire += blob.size();
  ++next_tensor;
}

// The tensors write_staged() recorded from GPUs: every one planned on its
// GPU into one head buffer, the blob sizes read back at once, and their
// places in one device buffer (out_at, d.out_bytes; d.out is allocated by
// the caller, or laid out as the stream by mirror_blobs()). end_staged()
// then encodes them into it just before the ring copies them out (device
// to slot: only the blobs cross PCIe), so the copies of the first blobs
// overlap the encoding of the later ones. False, with nothing encoded and no base changed, when
// the planned blobs (with the host's) would take more than delta_max_ratio
// of the tensors: the sync then goes full.
bool Producer::Impl::plan_pending() {
  DeltaState& d = delta;
  d.heads = nullptr;
  d.out = nullptr;
  std::uint64_t heads = 0;
  void* stream = nullptr;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    DeltaState::Pending& p = d.pending[i];
    if (p.src == nullptr) continue;
    if (stream == nullptr) stream = p.stream;
    const std::uint32_t w = delta::elem_width(specs[i].dtype);
    p.head_at = heads;
    heads += align_up(delta::head_bytes(specs[i].local_nbytes() / w), 256);
  }
  if (heads == 0) return true;
  delta::CudaCodec& c = codec();
  auto* head = static_cast<std::byte*>(c.buffer(0, heads, stream));
  // Tensors written on one stream (the usual case) are planned in one
  // batch: two launches in all (two per tensor cost Qwen2.5-3B's 434 tensors
  // 7.7 ms on an H200 against about 3 for the bytes alone); else each on
  // its own stream.
  std::vector<delta::CudaCodec::PlanItem> items;
  bool one_stream = true;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const DeltaState::Pending& p = d.pending[i];
    if (p.src == nullptr) continue;
    const std::uint32_t w = delta::elem_width(specs[i].dtype);
    items.push_back({d.base[i].dev, p.src, w, specs[i].local_nbytes() / w, head + p.head_at});
    one_stream = one_stream && p.stream == stream;
  }
  if (one_stream) {
    c.plan_batch(items, stream);
  } else {
    std::size_t k = 0;
    for (std::size_t i = 0; i < specs.size(); ++i) {
      const DeltaState::Pending& p = d.pending[i];
      if (p.src == nullptr) continue;
      const delta::CudaCodec::PlanItem& it = items[k++];
      c.plan(it.base, it.next, it.w, it.n, it.head, p.stream);
    }
  }
  // Every tensor's header (its payload size) in one copy back.
  std::vector<std::byte> host_heads(heads);
  for (std::size_t i = 0; i < specs.size(); ++i)
    if (d.pending[i].src != nullptr && d.pending[i].stream != stream) c.wait(d.pending[i].stream);
  c.download(host_heads.data(), head, heads, stream);
  c.wait(stream);
  std::uint64_t outs = 0, planned = 0;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    DeltaState::Pending& p = d.pending[i];
    if (p.src == nullptr) continue;
    delta::Header h;
    std::memcpy(&h, host_heads.data() + p.head_at, sizeof h);
    const std::uint32_t w = delta::elem_width(specs[i].dtype);
    p.blob = delta::head_bytes(specs[i].local_nbytes() / w) + h.payload_bytes;
    p.out_at = outs;
    outs += align_up(p.blob, 256);
    planned += p.blob;
  }
  if (static_cast<double>(d.wire + planned) > opts.delta_max_ratio * static_cast<double>(d.logical)) return false;
  d.heads = head;
  d.out_bytes = outs;
  d.wire += planned;
  return true;
}

// Tensor i's blob (planned by plan_pending), encoded on its stream into
// d.out: the ring's copy of it, queued next on the same stream, waits for it.
Buffer Producer::Impl::encode_one(std::size_t i) {
  DeltaState& d = delta;
  const DeltaState::Pending& p = d.pending[i];
  const std::uint32_t w = delta::elem_width(specs[i].dtype);
  codec().encode(d.base[i].dev, p.src, w, specs[i].local_nbytes() / w, d.heads + p.head_at, d.out + p.out_at, p.blob,
                 p.stream);
  return Buffer{d.out + p.out_at, true, {}};
}

// Every tensor from a GPU planned and encoded at once, then the kernels'
// status checked (sharded ranks: their list is posted only once each blob
// is final). `sources[i]` becomes the blob of tensor i. False as
// plan_pending() (nothing encoded, no base changed).
bool Producer::Impl::encode_pending(std::vector<Buffer>* sources) {
  if (!plan_pending()) return false;
  for (const DeltaState::Pending& p : delta.pending)
    if (p.src != nullptr) {
      delta.out = static_cast<std::byte*>(codec().buffer(1, delta.out_bytes, p.stream));
      break;
    }
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const DeltaState::Pending& p = delta.pending[i];
    if (p.src == nullptr) continue;
    (*sources)[i] = encode_one(i);
    delta.blobs[i].clear();
  }
  check_encodes();  // waits; throws what the kernels found
  return true;
}

// end_sync() of a staged sync: encodes the tensors from GPUs, then
// announces the blobs (or, when they would not pay or a consumer asked for
// a full sync meanwhile, the base, which now holds the new bytes) and
// streams them through the ring.
void Producer::Impl::end_staged() {
  if (world > 1) return end_staged_sharded();
  DeltaState& d = delta;
  std::vector<Buffer> sources(specs.size());
  for (std::size_t i = 0; i < specs.size(); ++i)
    sources[i] = d.raw_from_base[i] ? Buffer{d.base[i].dev, true, {}} : Buffer{d.blobs[i].data(), false, {}};
  const bool planned = !d.force_full && plan_pending();
  in_sync = false;  // begin_ring sets it again
  d.staged = false;
  // Out of the sync until begin_ring(), where abort() does nothing: a throw
  // meanwhile (a device buffer that cannot be allocated) needs nothing
  // more, as keyframe_reason() cleared d.valid at begin_sync() and only
  // delta_done() sets it: the next sync is full (test:
  // DeltaSync.AThrowOutOfTheSyncInEndSyncMakesTheNextSyncFull).
  const bool no_pay =
      !planned || static_cast<double>(d.wire) > opts.delta_max_ratio * static_cast<double>(d.logical);
  if (d.force_full || no_pay || seat_wants_full()) {
    // Tensors recorded from GPUs were not encoded: their bases take the bytes now.
    for (std::size_t i = 0; i < specs.size(); ++i) {
      const DeltaState::Pending& p = d.pending[i];
      if (p.src == nullptr) continue;
      codec().copy(d.base[i].dev, p.src, specs[i].local_nbytes(), p.stream);
      codec().wait(p.stream);
    }
    d.full = true;
    wire_sizes.clear();
    begin_ring(d.want);
    for (std::size_t i = 0; i < specs.size(); ++i) {
      const DeltaState::Base& b = d.base[i];
      write_tensor_in_sync(i, b.dev != nullptr ? Buffer{b.dev, true, {}} : Buffer{b.host.get(), false, {}}, nullptr,
                           0, kWhole);
    }
    d.blobs.clear();
    return;
  }
  // The blobs as the stream's pieces.
  const std::uint64_t wire = pack_blobs();
  if (test_point) test_point(TestPointArgs{TestPoint::kDeltaOutOfSync, version, nullptr, nullptr});
  const bool mirror = mirror_blobs();
  if (!mirror)
    for (const DeltaState::Pending& p : d.pending)
      if (p.src != nullptr) {
        d.out = static_cast<std::byte*>(codec().buffer(1, d.out_bytes, p.stream));
        break;
      }
  std::vector<ManifestPiece> pieces(specs.size());
  for (std::size_t i = 0; i < specs.size(); ++i) {
    ManifestPiece& p = pieces[i];
    p.tensor = static_cast<std::uint32_t>(i);
    p.dim = kWholePiece;
    p.offset = offsets[i];
    p.nbytes = wire_sizes[i];
    p.base_version = delta_encodes(specs[i].dtype) ? d.base_version : 0;
  }
  // A set whose tensors all go as their bytes (c128 only) has no blob: its
  // manifest names no base (a full sync, as consumers read it), and so the
  // report and the keyframe schedule (delta_done) say full too.
  d.full = std::none_of(pieces.begin(), pieces.end(), [](const ManifestPiece& p) { return p.base_version != 0; });
  const std::uint64_t logical = payload_bytes;
  payload_bytes = wire;
  begin_ring(d.want, pieces);
  layout.payload_bytes = logical;
  if (test_point) test_point(TestPointArgs{TestPoint::kDeltaPlanned, version, nullptr, nullptr});
  if (mirror) return write_mirrored();
  // Each GPU tensor's blob is encoded just before its write, except from
  // the write that completes the sync's last chunk (the first whose end
  // reaches stream_bytes: empty tensors may follow it) on: every encode
  // left is queued and what the kernels found (a tensor changed since the
  // plan) is read before that write, so a fault throws while no consumer
  // can have the whole sync, and end_sync() aborts it.
  const std::size_t n = specs.size();
  std::size_t last = n;
  for (std::size_t i = 0; i < n && last == n; ++i)
    if ((i + 1 < n ? offsets[i + 1] : stream_bytes) >= stream_bytes) last = i;
  try {
    for (std::size_t i = 0; i < n; ++i) {
      if (i == last) {
        for (std::size_t j = i; j < n; ++j)
          if (d.pending[j].src != nullptr) sources[j] = encode_one(j);
        check_encodes();
      } else if (i < last && d.pending[i].src != nullptr) {
        sources[i] = encode_one(i);
      }
      write_tensor_in_sync(i, sources[i], d.pending[i].src != nullptr ? d.pending[i].stream : nullptr, 0, kWhole);
    }
  } catch (...) {
    // The kernels' status is not left for a later sync's check to find.
    try {
      check_encodes();
    } catch (...) {
    }
    throw;
  }
}

// Whether this staged sync's blobs go out as the stream itself: the
// tensors encoded on the GPU all on one stream (the usual case), and the
// blobs made on the host (an empty tensor's) at most an eighth of the
// stream. Then d.out mirrors the stream (each piece at its stream offset)
// and write_mirrored() encodes and copies it a chunk at a time: a launch
// and a copy per chunk, not one of each per tensor (a MoE model's
// thousands of small tensors). Else each tensor's blob is encoded and
// written on its own (end_staged).
bool Producer::Impl::mirror_blobs() {
  DeltaState& d = delta;
  if (specs.empty() || d.pending.size() != specs.size()) return false;
  void* stream = nullptr;
  bool any = false;
  std::uint64_t host = 0;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const DeltaState::Pending& p = d.pending[i];
    if (p.src == nullptr) {
      if (!d.raw_from_base[i]) host += d.blobs[i].size();
      continue;
    }
    if (any && p.stream != stream) return false;
    stream = p.stream;
    any = true;
  }
  if (!any || host > stream_bytes / 8) return false;
  for (std::size_t i = 0; i < specs.size(); ++i) d.pending[i].out_at = offsets[i];
  d.out = static_cast<std::byte*>(codec().buffer(1, stream_bytes, stream));
  d.mirror_stream = stream;
  return true;
}

// A mirrored sync (mirror_blobs()): the pieces not encoded here put in
// place first (a raw tensor's bytes from its device base, a host blob
// uploaded), the encodes' table uploaded once; then per chunk, the blobs
// that start in it encoded in one launch and the chunk's bytes copied from
// d.out in one write. Every gap between pieces is zeroed (no bytes of an
// earlier use of the buffer go out). Before the write that completes the
// last chunk, every encode is queued and what the kernels found is read
// (as end_staged does per tensor), so a fault throws while no consumer can
// have the whole sync.
void Producer::Impl::write_mirrored() {
  DeltaState& d = delta;
  const std::size_t n = specs.size();
  void* const stream = d.mirror_stream;
  delta::CudaCodec& c = codec();
  std::vector<delta::CudaCodec::EncodeItem> items;
  std::vector<std::size_t> tensor_of;  // items[k] encodes tensor tensor_of[k]
  items.reserve(n);
  tensor_of.reserve(n);
  std::vector<std::byte> zeros;
  try {
    for (std::size_t i = 0; i < n; ++i) {
      const DeltaState::Pending& p = d.pending[i];
      const std::uint64_t size = wire_sizes[i], end = i + 1 < n ? offsets[i + 1] : stream_bytes;
      const std::uint64_t gap = end > offsets[i] + size ? end - offsets[i] - size : 0;
      std::byte* at = d.out + offsets[i];
      if (p.src != nullptr) {
        const std::uint32_t w = delta::elem_width(specs[i].dtype);
        items.push_back({d.base[i].dev, p.src, w, specs[i].local_nbytes() / w, d.heads + p.head_at, at, size, gap});
        tensor_of.push_back(i);
        continue;
      }
      if (d.raw_from_base[i])
        c.copy(at, d.base[i].dev, size, stream);
      else
        c.upload(at, d.blobs[i].data(), size, stream);  // pageable: taken when it returns
      if (gap > 0) {
        if (zeros.size() < gap) zeros.assign(gap, std::byte{0});
        c.upload(at + size, zeros.data(), gap, stream);
      }
    }
    c.encode_table(items, stream);
    const std::uint64_t chunk = view.geo().slot_bytes;
    std::size_t encoded = 0;
    for (std::uint64_t from = 0; from < stream_bytes; from += chunk) {
      const std::uint64_t to = stream_bytes - from < chunk ? stream_bytes : from + chunk;
      std::size_t upto = encoded;
      while (upto < items.size() && offsets[tensor_of[upto]] < to) ++upto;
      if (to == stream_bytes) upto = items.size();
      c.encode_range(encoded, upto, stream);
      encoded = upto;
      if (to == stream_bytes) check_encodes();
      write_stream_range(d.out, from, to, stream);
    }
    next_tensor = n;
  } catch (...) {
    // The kernels' status is not left for a later sync's check to find.
    try {
      check_encodes();
    } catch (...) {
    }
    throw;
  }
}

// Waits for every stream this sync encoded on, then throws what the
// kernels found. One status word serves them all: a finish() per stream
// could read it before another stream's encode set it, then clear it.
void Producer::Impl::check_encodes() {
  std::vector<void*> streams;
  for (const DeltaState::Pending& p : delta.pending)
    if (p.src != nullptr && std::find(streams.begin(), streams.end(), p.stream) == streams.end())
      streams.push_back(p.stream);
  if (streams.empty()) return;
  for (void* st : streams) codec().wait(st);
  codec().finish(streams.front());
}

// Lays a staged sync's blobs out as the stream (wire_sizes, offsets,
// stream_bytes): packed as raw tensors of their sizes. Returns the bytes.
std::uint64_t Producer::Impl::pack_blobs() {
  const DeltaState& d = delta;
  std::vector<TensorSpec> packed(specs.size());
  wire_sizes.resize(specs.size());
  for (std::size_t i = 0; i < specs.size(); ++i) {
    wire_sizes[i] = d.pending[i].src != nullptr ? d.pending[i].blob
                    : d.raw_from_base[i]         ? specs[i].local_nbytes()
                                                 : d.blobs[i].size();
    packed[i].dtype = DType::kRaw;
    packed[i].shape = {static_cast<std::int64_t>(wire_sizes[i])};
  }
  std::uint64_t wire = 0;
  stream_bytes = pack(packed, view.geo().slot_bytes, &offsets, &wire);
  return wire;
}

// After a completed sync: the base holds it.
void Producer::Impl::delta_done() {
  DeltaState& d = delta;
  d.valid = true;
  d.base_version = version;
  const bool full = world > 1 ? d.round_full : d.full;
  report = SyncReport{version, !full, d.logical, d.full ? d.logical : d.wire};
  if (full) {
    d.last_full = version;
    d.deltas_since_full = 0;
  } else {
    ++d.deltas_since_full;
  }
  d.blobs.clear();
  d.pending.clear();
  wire_sizes.clear();
}

}  // namespace shmcast
