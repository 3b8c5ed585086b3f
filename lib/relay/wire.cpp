#include "wire.hpp"

#include <algorithm>

namespace shmcast::relay::wire {

const char* type_name(Type t) {
  switch (t) {
    case Type::kChallenge: return "challenge";
    case Type::kResponse: return "response";
    case Type::kWelcome: return "welcome";
    case Type::kRefused: return "refused";
    case Type::kSync: return "sync";
    case Type::kChunk: return "chunk";
    case Type::kEnd: return "end";
    case Type::kAbort: return "abort";
    case Type::kWantFull: return "want-full";
  }
  return "unknown";
}

std::uint64_t control_cap(std::uint64_t region_manifest_bytes) {
  const std::uint64_t m = region_manifest_bytes == 0 ? ProducerOptions{}.manifest_bytes : region_manifest_bytes;
  const std::uint64_t room = (std::min(m, limits::kMaxManifestBytes) + 4095) / 4096 * 4096 + kControlSlack;
  return std::min(room, kMaxControlBytes);
}

std::string chunk_problem(std::uint64_t chunk_bytes, const ChunkRoom& room) {
  auto fmt = [](std::uint64_t n) {
    return n % (1ull << 30) == 0 ? std::to_string(n >> 30) + " GiB"
                                 : n % (1ull << 20) == 0 ? std::to_string(n >> 20) + " MiB" : std::to_string(n) + " bytes";
  };
  if (chunk_bytes == 0 || chunk_bytes % limits::kDataAlign != 0)
    return "chunks of " + std::to_string(chunk_bytes) + " bytes are not a slot size (a multiple of 2 MiB)";
  if (chunk_bytes > kMaxChunkBytes)
    return "chunks of " + fmt(chunk_bytes) + " are larger than the relay's maximum of " + fmt(kMaxChunkBytes) +
           " (use smaller slots in the source region)";
  // Overflow-free: both factors are small (buffers, slots <= 4096; chunk <= 1 GiB).
  const std::uint64_t need = chunk_bytes * (room.buffers + room.region_slots);
  if (room.memory_bytes != 0 && need > room.memory_bytes)
    return "chunks of " + fmt(chunk_bytes) + " need " + fmt(need) + " here (" + std::to_string(room.buffers) +
           " receive buffers and " + std::to_string(room.region_slots) + " region slots), more than this node's " +
           fmt(room.memory_bytes) + " of memory (lower --buffers or --slots, or use --slot-bytes)";
  if (room.fs_bytes != 0 && chunk_bytes * room.region_slots > room.fs_bytes)
    return "a region of " + std::to_string(room.region_slots) + " slots of " + fmt(chunk_bytes) +
           " is larger than the file system of the region directory (" + fmt(room.fs_bytes) +
           "; lower --slots or use --slot-bytes)";
  return "";
}

Reader::Reader(std::span<const std::uint8_t> msg, bool has_mac) : p_(msg.data()), end_(msg.size()) {
  if (msg.size() < kHeaderBytes + (has_mac ? kMacBytes : 0)) throw ProtocolError("control message is too short");
  if (has_mac) end_ -= kMacBytes;
  std::uint32_t magic;
  std::uint16_t type;
  std::memcpy(&magic, p_, 4);
  std::memcpy(&type, p_ + 4, 2);
  std::memcpy(&seq_, p_ + 8, 8);
  if (magic != kMagic) throw ProtocolError("control message has a bad magic number (not a shmcast relay?)");
  if (type < static_cast<std::uint16_t>(Type::kChallenge) || type > static_cast<std::uint16_t>(Type::kWantFull))
    throw ProtocolError("unknown control message type " + std::to_string(type));
  type_ = static_cast<Type>(type);
}

std::string Reader::str(std::size_t max) {
  const std::uint32_t n = u32();
  if (n > max) throw ProtocolError(std::string(type_name(type_)) + " message has an oversized string");
  need(n);
  std::string s(reinterpret_cast<const char*>(p_ + at_), n);
  at_ += n;
  return s;
}

void SyncPlan::index_chunks() {
  data_chunks.clear();
  for (std::size_t i = 0; i < specs.size(); ++i) {
    if (nbytes[i] == 0) continue;
    const std::uint64_t first = offsets[i] / chunk_bytes, last = (offsets[i] + nbytes[i] - 1) / chunk_bytes;
    for (std::uint64_t c = first; c <= last; ++c)
      if (data_chunks.empty() || data_chunks.back() < c) data_chunks.push_back(static_cast<std::uint32_t>(c));
  }
  frag_base.assign(1, 0);
  for (std::uint32_t c : data_chunks) frag_base.push_back(frag_base.back() + frags(c));
}

SyncPlan plan_for(const std::vector<TensorSpec>& specs, std::uint64_t version, std::uint64_t chunk_bytes,
                  std::uint64_t frag_bytes) {
  SyncPlan p;
  p.version = version;
  p.chunk_bytes = chunk_bytes;
  p.frag_bytes = frag_bytes;
  p.specs = specs;
  const SyncLayout l = stream_layout(specs, chunk_bytes);
  p.offsets = l.offsets;
  p.stream_bytes = l.stream_bytes;
  p.payload_bytes = l.payload_bytes;
  for (const TensorSpec& t : specs) p.nbytes.push_back(t.nbytes());
  p.index_chunks();
  return p;
}

void encode_sync(Writer& w, const SyncPlan& p) {
  w.u64(p.version).u64(p.chunk_bytes).u64(p.frag_bytes).u64(p.stream_bytes).u64(p.payload_bytes);
  w.u32(static_cast<std::uint32_t>(p.specs.size()));
  for (std::size_t i = 0; i < p.specs.size(); ++i) {
    const TensorSpec& t = p.specs[i];
    w.str(t.name).u16(static_cast<std::uint16_t>(t.dtype)).u8(static_cast<std::uint8_t>(t.shape.size()));
    for (std::int64_t d : t.shape) w.i64(d);
    w.u64(p.nbytes[i]).u64(p.offsets[i]);
  }
  w.u64(p.base_version);
  if (p.base_version != 0)
    for (std::size_t i = 0; i < p.specs.size(); ++i) w.u8(p.is_delta[i]);
}

SyncPlan decode_sync(Reader& r) {
  SyncPlan p;
  p.version = r.u64();
  p.chunk_bytes = r.u64();
  p.frag_bytes = r.u64();
  p.stream_bytes = r.u64();
  p.payload_bytes = r.u64();
  const std::uint32_t n = r.u32();
  if (p.version == 0) throw ProtocolError("sync version 0");
  if (p.chunk_bytes == 0 || p.chunk_bytes > kMaxChunkBytes || p.chunk_bytes % (2u << 20) != 0)
    throw ProtocolError("sync chunk size " + std::to_string(p.chunk_bytes) +
                        " is not a slot size of at most 1 GiB (a multiple of 2 MiB)");
  if (p.frag_bytes < kMinFragBytes || p.frag_bytes > kMaxFragBytes || (p.frag_bytes & (p.frag_bytes - 1)) != 0)
    throw ProtocolError("sync fragment size " + std::to_string(p.frag_bytes) +
                        " is not a power of two between 64 KiB and 2 MiB");
  if (n > limits::kMaxTensors) throw ProtocolError("sync has too many tensors");
  // A tensor takes at least 23 bytes here (name length, dtype, rank, size,
  // offset): a count the message cannot hold is refused before anything is
  // allocated for it.
  constexpr std::size_t kMinTensorBytes = 4 + 2 + 1 + 8 + 8;
  if (n > r.left() / kMinTensorBytes)
    throw ProtocolError("sync message is truncated: " + std::to_string(n) + " tensors cannot fit in " +
                        std::to_string(r.left()) + " bytes");
  p.specs.resize(n);
  p.offsets.resize(n);
  p.nbytes.resize(n);
  for (std::uint32_t i = 0; i < n; ++i) {
    TensorSpec& t = p.specs[i];
    t.name = r.str(kMaxNameBytes);
    t.dtype = static_cast<DType>(r.u16());
    const std::uint8_t nd = r.u8();
    if (nd > kMaxDims) throw ProtocolError("tensor with more than " + std::to_string(kMaxDims) + " dimensions");
    t.shape.resize(nd);
    for (auto& d : t.shape) d = r.i64();
    p.nbytes[i] = r.u64();
    p.offsets[i] = r.u64();
  }
  p.base_version = r.u64();
  if (p.base_version != 0) {
    if (p.base_version >= p.version)
      throw ProtocolError("delta sync " + std::to_string(p.version) + " names base version " +
                          std::to_string(p.base_version) + ", not an earlier one");
    p.is_delta.resize(n);
    for (std::uint32_t i = 0; i < n; ++i) {
      p.is_delta[i] = r.u8();
      if (p.is_delta[i] > 1) throw ProtocolError("delta sync has a piece flag other than 0 or 1");
    }
  }
  r.expect_done();
  // The layout must be the one shmcast packs: then chunk c of the sender is
  // chunk c here, and every tensor lies inside the stream. A delta sync's
  // stream packs its pieces (blobs, or the bytes of a tensor sent whole) as
  // raw tensors of their sizes (docs/protocol.md §12.1); its payload is the
  // tensors' logical size.
  SyncLayout l;
  std::uint64_t logical = 0;
  try {
    std::vector<TensorSpec> packed;
    for (std::uint32_t i = 0; i < n; ++i) {
      const TensorSpec& t = p.specs[i];
      const std::uint64_t size = t.nbytes();
      logical += size;
      if (p.base_version != 0 && p.is_delta[i] != 0) {
        // A blob: at least its 64-byte header, of a dtype of 1-, 2-, 4- or
        // 8-byte elements. The node's producer checks the exact bounds
        // (Producer::begin_forwarded), the consumers every byte.
        const std::size_t w = dtype_size(t.dtype);
        if ((w != 1 && w != 2 && w != 4 && w != 8) || t.dtype == DType::kRaw || p.nbytes[i] < 64)
          throw ProtocolError("tensor '" + t.name + "' cannot be a delta piece of " + std::to_string(p.nbytes[i]) +
                              " bytes");
      } else if (size != p.nbytes[i]) {
        throw ProtocolError("tensor '" + t.name + "' size mismatch");
      }
      if (p.base_version != 0) {
        if (p.nbytes[i] > limits::kMaxStreamBytes) throw ProtocolError("tensor '" + t.name + "' piece is too large");
        packed.push_back(TensorSpec{"piece", DType::kRaw, {static_cast<std::int64_t>(p.nbytes[i])}});
      }
    }
    l = stream_layout(p.specs, p.chunk_bytes);  // checks every spec (names, dtypes, shapes)
    if (p.base_version != 0) l = stream_layout(packed, p.chunk_bytes);
  } catch (const Error& e) {
    throw ProtocolError(std::string("sync manifest is invalid: ") + e.what());
  }
  if (l.offsets != p.offsets || l.stream_bytes != p.stream_bytes || logical != p.payload_bytes)
    throw ProtocolError("sync layout differs from shmcast's packing of its manifest (different shmcast versions?)");
  p.index_chunks();
  if (!p.data_chunks.empty() &&
      (static_cast<std::uint64_t>(p.data_chunks.back()) + 1) * p.frags_per_chunk() > (1ull << 32))
    throw ProtocolError("sync has more fragments than a tag can number (use larger fragments)");
  return p;
}

}  // namespace shmcast::relay::wire
