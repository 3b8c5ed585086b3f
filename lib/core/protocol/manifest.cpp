#include "protocol/manifest.hpp"

#include "base/checks.hpp"
#include "base/name_set.hpp"
#include "base/text.hpp"
#include "protocol/delta.hpp"

#include <cstring>
#include <functional>
#include <string_view>
#include <algorithm>
#include <unordered_map>

namespace shmcast::detail {

namespace {

std::string at(std::size_t i, const std::string& what) { return "tensor " + std::to_string(i) + ": " + what; }

// Well-formed UTF-8 (RFC 3629: no overlong forms, no surrogates, <= U+10FFFF).
bool valid_utf8(std::string_view s) {
  std::size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
    std::size_t n;
    std::uint32_t cp;
    if ((c & 0xe0) == 0xc0) n = 1, cp = c & 0x1f;
    else if ((c & 0xf0) == 0xe0) n = 2, cp = c & 0x0f;
    else if ((c & 0xf8) == 0xf0) n = 3, cp = c & 0x07;
    else return false;
    if (n >= s.size() - i) return false;  // truncated sequence
    for (std::size_t k = 1; k <= n; ++k) {
      const auto d = static_cast<unsigned char>(s[i + k]);
      if ((d & 0xc0) != 0x80) return false;
      cp = (cp << 6) | (d & 0x3f);
    }
    static constexpr std::uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
    i += n + 1;
  }
  return true;
}

}  // namespace

// The rules every tensor name follows, on both sides of the region.
std::string name_problem(std::string_view name) {
  if (name.empty()) return "empty tensor name";
  if (name.size() > kMaxNameBytes) return "tensor name longer than " + std::to_string(kMaxNameBytes) + " bytes";
  // ASCII without a NUL, 8 bytes at a time (almost every name; a sync may
  // have a million): no byte with its top bit set, none zero.
  constexpr std::uint64_t kHigh = 0x8080808080808080ull, kOnes = 0x0101010101010101ull;
  std::size_t i = 0;
  std::uint64_t bad = 0;
  for (; i + 8 <= name.size() && bad == 0; i += 8) {
    std::uint64_t x;
    std::memcpy(&x, name.data() + i, 8);
    bad = (x | ((x - kOnes) & ~x)) & kHigh;
  }
  for (; i < name.size() && bad == 0; ++i) bad = name[i] == 0 || static_cast<unsigned char>(name[i]) >= 0x80;
  if (bad == 0) return {};
  if (name.find('\0') != std::string_view::npos) return "tensor name contains a NUL byte";
  if (!valid_utf8(name)) return "tensor name is not valid UTF-8";
  return {};
}

namespace {

}  // namespace

std::string validate_spec(const TensorSpec& s) {
  if (std::string why = name_problem(s.name); !why.empty()) return why;
  if (dtype_size(s.dtype) == 0) return "unknown dtype " + std::to_string(static_cast<int>(s.dtype));
  if (s.shape.size() > static_cast<std::size_t>(kMaxDims)) return "more than 8 dimensions";
  if (s.dtype == DType::kRaw && s.shape.size() != 1) return "raw tensors must have shape {nbytes}";
  std::uint64_t n;
  if (!shape_bytes(s.dtype, s.shape.data(), s.shape.size(), &n)) return "negative dimension or size overflow";
  if (n > kMaxStreamBytes) return "tensor larger than 64 TiB";
  if (s.shard_dim != -1) {
    if (s.shard_dim < 0 || static_cast<std::size_t>(s.shard_dim) >= s.shape.size())
      return "shard_dim " + std::to_string(s.shard_dim) + " is not a dimension of the shape (or -1 for whole)";
    const std::int64_t extent = s.shape[static_cast<std::size_t>(s.shard_dim)];
    if (s.shard_start < 0 || s.shard_length < 0 || s.shard_start > extent || s.shard_length > extent - s.shard_start)
      return "shard [" + std::to_string(s.shard_start) + ", +" + std::to_string(s.shard_length) +
             ") lies outside dimension " + std::to_string(s.shard_dim) + " of size " + std::to_string(extent);
  } else if (s.shard_start != 0 || s.shard_length != 0) {
    return "shard_start/shard_length set on a whole tensor (shard_dim -1)";
  }
  return {};
}


std::uint64_t pack(std::span<const TensorSpec> specs, std::uint64_t slot_bytes, std::vector<std::uint64_t>* offsets,
                   std::uint64_t* payload_bytes) {
  offsets->clear();
  offsets->reserve(specs.size());
  std::uint64_t pos = 0, payload = 0;
  for (const TensorSpec& s : specs) {
    const std::uint64_t n = s.local_nbytes();
    pos = align_up(pos, kTensorAlign);
    if (n > 0 && n <= slot_bytes) {
      const std::uint64_t room = slot_bytes - pos % slot_bytes;
      if (n > room) pos += room;  // never straddle when it fits in one slot
    }
    offsets->push_back(pos);
    pos += n;
    payload += n;
  }
  *payload_bytes = payload;
  return pos;
}

std::uint64_t manifest_size(std::span<const TensorSpec> specs, std::uint64_t pieces, std::uint32_t world_size) {
  std::uint64_t names = 0;
  for (const TensorSpec& s : specs) names += s.name.size();
  if (pieces == ~0ull) pieces = specs.size();
  return sizeof(ManifestHeader) + specs.size() * sizeof(ManifestEntry) + pieces * sizeof(ManifestPiece) +
         std::uint64_t{world_size} * 8 + names;
}

std::string manifest_room_problem(std::span<const TensorSpec> specs, std::uint64_t capacity, std::uint64_t pieces,
                                  std::uint32_t world_size, const char* who) {
  const std::uint64_t need = manifest_size(specs, pieces, world_size);
  if (need <= capacity) return {};
  const std::uint64_t fixed = sizeof(ManifestHeader) + std::uint64_t{world_size} * 8;
  const std::uint64_t n = specs.empty() ? 1 : specs.size();
  // The mean bytes of one tensor (its entry, pieces and name), rounded up.
  const std::uint64_t each = (need - fixed + n - 1) / n;
  const std::uint64_t fit = capacity > fixed ? (capacity - fixed) / each : 0;
  std::string s = "the manifest of " + std::to_string(specs.size()) + " tensors needs " + human_bytes(need) +
                  " but the region's manifest area holds " + human_bytes(capacity) + ", room for " +
                  std::to_string(fit) + " tensors like these (" + std::to_string(each) + " bytes each): ";
  if (capacity < kMaxManifestBytes)
    s += std::string("create ") + who + " with a larger manifest_bytes (the default, " + human_bytes(kMaxManifestBytes) +
         ", costs nothing until used)";
  else
    s += "send at most " + std::to_string(fit) + " tensors per sync, or shorter names";
  return s;
}

std::uint64_t encode_manifest(std::span<const TensorSpec> tensors, std::span<const ManifestPiece> pieces,
                              std::span<const std::uint64_t> rank_bytes, std::uint64_t sync_version,
                              std::uint64_t payload_bytes, std::byte* out, std::uint64_t capacity) {
  const auto R = static_cast<std::uint32_t>(rank_bytes.size());
  const std::uint64_t total = manifest_size(tensors, pieces.size(), R);
  if (total > capacity) return 0;
  ManifestHeader h{};
  h.magic = kManifestMagic;
  h.format = kManifestVersion;
  h.sync_version = sync_version;
  h.tensor_count = static_cast<std::uint32_t>(tensors.size());
  h.entry_bytes = sizeof(ManifestEntry);
  const std::uint64_t ranks_at = sizeof(ManifestHeader) + tensors.size() * sizeof(ManifestEntry);
  const std::uint64_t pieces_at = ranks_at + std::uint64_t{R} * 8;
  h.names_offset = pieces_at + pieces.size() * sizeof(ManifestPiece);
  h.names_bytes = total - h.names_offset;
  h.stream_bytes = 0;
  for (std::uint64_t b : rank_bytes) h.stream_bytes += b;
  h.payload_bytes = payload_bytes;
  h.world_size = R;
  h.piece_count = static_cast<std::uint32_t>(pieces.size());
  std::memcpy(out, &h, sizeof h);
  // Each entry's stream_offset is the offset of its first piece.
  std::vector<std::uint64_t> first(tensors.size(), ~0ull);
  for (const ManifestPiece& p : pieces)
    if (p.tensor < first.size() && first[p.tensor] == ~0ull) first[p.tensor] = p.offset;
  std::uint64_t name_pos = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const TensorSpec& s = tensors[i];
    ManifestEntry e{};
    e.name_offset = static_cast<std::uint32_t>(name_pos);
    e.name_bytes = static_cast<std::uint32_t>(s.name.size());
    e.dtype = static_cast<std::uint16_t>(s.dtype);
    e.ndim = static_cast<std::uint16_t>(s.shape.size());
    e.nbytes = s.nbytes();
    e.stream_offset = first[i] == ~0ull ? 0 : first[i];
    for (std::size_t d = 0; d < s.shape.size(); ++d) e.shape[d] = s.shape[d];
    std::memcpy(out + sizeof h + i * sizeof e, &e, sizeof e);
    std::memcpy(out + h.names_offset + name_pos, s.name.data(), s.name.size());
    name_pos += s.name.size();
  }
  if (!pieces.empty()) std::memcpy(out + pieces_at, pieces.data(), pieces.size() * sizeof(ManifestPiece));
  if (R > 0) std::memcpy(out + ranks_at, rank_bytes.data(), std::uint64_t{R} * 8);
  return total;
}

std::uint64_t encode_manifest(std::span<const TensorSpec> specs, std::span<const std::uint64_t> offsets,
                              std::uint64_t sync_version, std::uint64_t stream_bytes, std::uint64_t payload_bytes,
                              std::byte* out, std::uint64_t capacity) {
  std::vector<ManifestPiece> pieces(specs.size());
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const TensorSpec& s = specs[i];
    ManifestPiece& p = pieces[i];
    p.tensor = static_cast<std::uint32_t>(i);
    p.rank = 0;
    p.dim = s.shard_dim < 0 ? kWholePiece : static_cast<std::uint16_t>(s.shard_dim);
    p.start = s.shard_dim < 0 ? 0 : s.shard_start;
    p.length = s.shard_dim < 0 ? 0 : s.shard_length;
    p.offset = offsets[i];
    p.nbytes = s.local_nbytes();
  }
  const std::uint64_t rank_bytes[1] = {stream_bytes};
  return encode_manifest(specs, pieces, rank_bytes, sync_version, payload_bytes, out, capacity);
}

std::string manifest_header_problem(const ManifestHeader& h, std::uint64_t used, std::uint64_t expect_version,
                                    std::uint64_t expect_stream_bytes) {
  if (h.magic != kManifestMagic) return "bad manifest magic";
  if (h.format != kManifestVersion) return "unknown manifest format " + std::to_string(h.format);
  if (h.entry_bytes != sizeof(ManifestEntry)) return "bad manifest entry size";
  if (h.sync_version != expect_version) return "manifest is for another sync version";
  if (h.stream_bytes != expect_stream_bytes) return "manifest stream size disagrees with the sync record";
  if (h.world_size < 1 || h.world_size > kMaxRanks) return "bad world size " + std::to_string(h.world_size);
  const std::uint64_t room = used - sizeof h;
  if (h.tensor_count > room / sizeof(ManifestEntry)) return "tensor count exceeds the manifest";
  if (h.tensor_count > kMaxTensors) return "more than " + std::to_string(kMaxTensors) + " tensors";
  if (h.piece_count > kMaxTensors) return "more than " + std::to_string(kMaxTensors) + " pieces";
  if (h.stream_bytes > kMaxStreamBytes) return "stream larger than 64 TiB";
  const std::uint64_t names_at = sizeof h + std::uint64_t{h.tensor_count} * sizeof(ManifestEntry) +
                                 std::uint64_t{h.world_size} * 8 + std::uint64_t{h.piece_count} * sizeof(ManifestPiece);
  if (names_at > used) return "rank table and pieces run past the manifest";
  if (h.names_offset != names_at) return "names blob is not where the pieces end";
  if (h.names_bytes > used - names_at) return "names blob runs past the manifest";
  // The names blob ends the manifest: a size announced past it would have a
  // reader copy bytes no field describes.
  if (h.names_bytes != used - names_at) return "bytes after the names blob";
  return {};
}

std::string entry_name_problem(const ManifestEntry& e, std::uint64_t names_bytes, std::uint64_t* names_next) {
  if (e.name_bytes == 0 || e.name_bytes > kMaxNameBytes) return "bad name length";
  if (std::uint64_t{e.name_offset} + e.name_bytes > names_bytes) return "name runs past the names blob";
  // Names lie end to end in entry order, so the decoded names take no more
  // bytes than the blob (names laid over each other would turn 1 MiB of
  // blob into 1 GiB of distinct names).
  if (e.name_offset != *names_next) return "name does not follow the one before it";
  *names_next += e.name_bytes;
  return {};
}

std::string names_end_problem(std::uint64_t names_next, std::uint64_t names_bytes) {
  return names_next == names_bytes ? std::string() : "names blob holds bytes no name uses";
}

std::string manifest_prefix_problem(const std::function<bool(std::uint64_t, std::size_t, void*)>& read,
                                    std::uint64_t used, std::uint64_t expect_version,
                                    std::uint64_t expect_stream_bytes) {
  if (used < sizeof(ManifestHeader)) return "manifest shorter than its header";
  ManifestHeader h;
  if (!read(0, sizeof h, &h)) return "the region file ends inside the manifest (truncated)";
  if (std::string why = manifest_header_problem(h, used, expect_version, expect_stream_bytes); !why.empty())
    return why;
  constexpr std::uint32_t kWindow = 4096;  // entries per read: 384 KiB
  std::vector<ManifestEntry> win(std::min(kWindow, h.tensor_count));
  std::uint64_t logical = 0, names_next = 0;
  for (std::uint32_t first = 0; first < h.tensor_count; first += kWindow) {
    const std::uint32_t n = std::min(kWindow, h.tensor_count - first);
    if (!read(sizeof h + std::uint64_t{first} * sizeof(ManifestEntry), n * sizeof(ManifestEntry), win.data()))
      return "the region file ends inside the manifest (truncated)";
    for (std::uint32_t k = 0; k < n; ++k) {
      std::string why = entry_name_problem(win[k], h.names_bytes, &names_next);
      if (why.empty()) why = entry_shape_problem(win[k], &logical);
      if (!why.empty()) return at(first + k, why);
    }
  }
  return names_end_problem(names_next, h.names_bytes);
}

std::string entry_shape_problem(const ManifestEntry& e, std::uint64_t* logical) {
  if (e.ndim > kMaxDims) return "more than 8 dimensions";
  std::uint64_t n;
  if (!shape_bytes(static_cast<DType>(e.dtype), e.shape, e.ndim, &n)) return "unknown dtype or bad shape";
  if (n != e.nbytes) return "byte size disagrees with dtype and shape";
  if (n > kMaxStreamBytes || __builtin_add_overflow(*logical, n, logical)) return "too large";
  return {};
}

TensorInfo entry_tensor(const ManifestEntry& e) {
  TensorInfo t;
  entry_tensor_into(e, &t);
  return t;
}

void entry_tensor_into(const ManifestEntry& e, TensorInfo* t) {
  std::string name = std::move(t->name);
  std::vector<std::int64_t> shape = std::move(t->shape);
  std::vector<ShardInfo> shards = std::move(t->shards);
  *t = TensorInfo{};
  name.clear();
  shards.clear();
  shape.assign(e.shape, e.shape + e.ndim);
  t->name = std::move(name);
  t->shape = std::move(shape);
  t->shards = std::move(shards);
  t->dtype = static_cast<DType>(e.dtype);
  t->nbytes = e.nbytes;
  t->stream_offset = e.stream_offset;
}

std::string rank_bytes_problem(std::span<const std::uint64_t> rank_bytes, std::uint64_t stream_bytes) {
  std::uint64_t sum = 0;
  for (std::uint64_t b : rank_bytes)
    if (b > kMaxStreamBytes || __builtin_add_overflow(sum, b, &sum)) return "a rank's sub-stream is too large";
  if (sum != stream_bytes) return "the ranks' sub-streams do not add up to the stream size";
  return {};
}

std::string decode_manifest(std::span<const std::byte> bytes, std::uint64_t expect_version,
                            std::uint64_t expect_stream_bytes, std::uint64_t slot_bytes, SyncInfo* out,
                            bool check_names, ManifestCheck mode, NameSet* names_scratch) {
  const bool partial = mode == ManifestCheck::kRankPost;
  if (bytes.size() < sizeof(ManifestHeader)) return "manifest shorter than its header";
  ManifestHeader h;
  std::memcpy(&h, bytes.data(), sizeof h);
  if (std::string why = manifest_header_problem(h, bytes.size(), expect_version, expect_stream_bytes); !why.empty())
    return why;
  const std::uint64_t ranks_at = sizeof h + std::uint64_t{h.tensor_count} * sizeof(ManifestEntry);
  const std::uint64_t pieces_at = ranks_at + std::uint64_t{h.world_size} * 8;
  const char* names = reinterpret_cast<const char*>(bytes.data() + h.names_offset);  // where the header says, checked

  // Decoded in place: *out's vectors, and its tensors' names, shapes and
  // shard lists, keep their memory (a consumer decodes into the SyncInfo
  // of the sync before last: the same manifest again allocates nothing).
  SyncInfo& info = *out;
  {
    std::vector<TensorInfo> tensors = std::move(info.tensors);
    std::vector<std::uint64_t> rank_bytes = std::move(info.rank_bytes);
    info = SyncInfo{};
    // Memory of a much larger manifest (a hostile one's, say) is let go.
    if (tensors.capacity() > 4 * std::size_t{h.tensor_count} + 1024) tensors = {};
    info.tensors = std::move(tensors);
    info.rank_bytes = std::move(rank_bytes);
  }
  info.version = h.sync_version;
  info.stream_bytes = h.stream_bytes;
  info.world_size = h.world_size;
  info.rank_bytes.resize(h.world_size);
  std::memcpy(info.rank_bytes.data(), bytes.data() + ranks_at, std::uint64_t{h.world_size} * 8);
  if (std::string why = rank_bytes_problem(info.rank_bytes, h.stream_bytes); !why.empty()) return why;
  NameSet own;
  NameSet& seen = names_scratch != nullptr ? *names_scratch : own;
  if (check_names) seen.reset(h.tensor_count);
  info.tensors.resize(h.tensor_count);
  std::uint64_t logical = 0, names_next = 0;
  for (std::uint32_t i = 0; i < h.tensor_count; ++i) {
    ManifestEntry e;
    std::memcpy(&e, bytes.data() + sizeof h + std::uint64_t{i} * sizeof e, sizeof e);
    if (std::string why = entry_name_problem(e, h.names_bytes, &names_next); !why.empty()) return at(i, why);
    const std::string_view name(names + e.name_offset, e.name_bytes);
    if (check_names) {
      if (std::string why = name_problem(name); !why.empty()) return at(i, why);
      if (!seen.insert(name)) return at(i, "name appears twice in the manifest");
    }
    if (std::string why = entry_shape_problem(e, &logical); !why.empty()) return at(i, why);
    TensorInfo& t = info.tensors[i];
    entry_tensor_into(e, &t);
    if (check_names) {
      if (t.name.capacity() > 4 * name.size() + 64) t.name = std::string();  // a long name's memory
      t.name.assign(name);
    }
  }
  if (std::string why = names_end_problem(names_next, h.names_bytes); !why.empty()) return why;
  // Pieces: sorted by (rank, offset), aligned, inside their rank's
  // sub-stream, no overlap, no straddling when they fit in a slot.
  std::uint64_t payload = 0, wire = 0, end_prev = 0;
  std::uint32_t rank_prev = 0;
  for (std::uint32_t k = 0; k < h.piece_count; ++k) {
    ManifestPiece p;
    std::memcpy(&p, bytes.data() + pieces_at + std::uint64_t{k} * sizeof p, sizeof p);
    // Named only in an error (made per piece, it cost a sync of many tensors).
    const auto where = [k] { return "piece " + std::to_string(k); };
    if (std::string why = piece_problem(p, h.tensor_count, info.rank_bytes, slot_bytes, &rank_prev, &end_prev);
        !why.empty())
      return where() + ": " + why;
    TensorInfo& t = info.tensors[p.tensor];
    ShardInfo sh;
    sh.rank = p.rank;
    sh.stream_offset = p.offset;
    sh.wire_bytes = p.nbytes;
    sh.base_version = p.base_version;
    // A delta piece (§12): its stream bytes are a blob; its logical size
    // follows from its tensor and range. Every delta piece of a sync names
    // the same, earlier, version.
    if (std::string why = piece_base_problem(p, h.sync_version, &info.base_version); !why.empty())
      return where() + ": " + why;
    if (std::string why = piece_size_problem(p, t.dtype, t.shape, t.nbytes, &sh.nbytes); !why.empty())
      return where() + ": " + why;
    if (p.dim != kWholePiece) {
      sh.dim = p.dim;
      sh.start = p.start;
      sh.length = p.length;
    }
    if (!checked_add(payload, sh.nbytes, &payload) || !checked_add(wire, p.nbytes, &wire))
      return where() + ": the pieces' sizes overflow";
    t.shards.push_back(sh);
  }
  if (wire != h.payload_bytes) return "payload size disagrees with the pieces";
  for (std::uint32_t i = 0; i < h.tensor_count; ++i) {
    TensorInfo& t = info.tensors[i];
    if (t.shards.empty()) return at(i, "has no piece");
    if (t.shards[0].stream_offset != t.stream_offset) return at(i, "stream offset disagrees with its first piece");
    if (partial) {
      if (t.shards.size() != 1) return at(i, "more than one piece in a rank's post");
      continue;
    }
    if (t.shards.size() == 1 && t.shards[0].dim < 0) continue;
    // Shards along one dim that tile [0, extent) exactly, sorted by start
    // in place (already in order when rank r holds the r-th slice).
    const int dim = t.shards[0].dim;
    for (const ShardInfo& sh : t.shards) {
      if (sh.dim < 0) return at(i, "a whole piece beside other pieces");
      if (sh.dim != dim) return at(i, "shards along different dims");
    }
    const auto by_start = [](const ShardInfo& a, const ShardInfo& b) { return a.start < b.start; };
    if (!std::is_sorted(t.shards.begin(), t.shards.end(), by_start))
      std::stable_sort(t.shards.begin(), t.shards.end(), by_start);
    std::int64_t next = 0;
    for (const ShardInfo& sh : t.shards) {
      if (sh.start != next) return at(i, sh.start < next ? "shards overlap" : "shards leave a gap");
      next += sh.length;
    }
    if (next != t.shape[static_cast<std::size_t>(dim)]) return at(i, "shards do not cover the tensor");
  }
  if (!partial && payload != logical) return "payload size disagrees with the tensors";
  info.payload_bytes = payload;
  info.wire_bytes = wire;
  return {};
}

std::string piece_problem(const ManifestPiece& p, std::uint32_t tensor_count, std::span<const std::uint64_t> rank_bytes,
                          std::uint64_t slot_bytes, std::uint32_t* rank_prev, std::uint64_t* end_prev) {
  if (p.tensor >= tensor_count) return "bad tensor index";
  if (p.rank >= rank_bytes.size()) return "bad rank";
  if (p.rank < *rank_prev) return "pieces are not sorted by rank";
  if (p.rank != *rank_prev) *end_prev = 0;
  *rank_prev = p.rank;
  if (p.offset % kTensorAlign != 0) return "misaligned offset";
  if (p.offset < *end_prev) return "overlaps the previous piece";
  const std::uint64_t rank_len = rank_bytes[p.rank];
  if (p.nbytes > rank_len || p.offset > rank_len - p.nbytes) return "runs past its rank's sub-stream";
  if (p.nbytes > 0 && p.nbytes <= slot_bytes && p.offset / slot_bytes != (p.offset + p.nbytes - 1) / slot_bytes)
    return "straddles a slot boundary";
  *end_prev = p.offset + p.nbytes;
  return {};
}

std::string merge_posts(std::span<const SyncInfo> posts, std::vector<TensorSpec>* tensors,
                        std::vector<ManifestPiece>* pieces, std::vector<std::uint64_t>* rank_bytes,
                        std::uint64_t* payload_bytes) {
  std::unordered_map<std::string_view, std::uint32_t> index;
  tensors->clear();
  pieces->clear();
  rank_bytes->clear();
  std::uint64_t payload = 0;
  for (std::size_t r = 0; r < posts.size(); ++r) {
    const SyncInfo& post = posts[r];
    rank_bytes->push_back(post.stream_bytes);
    for (const TensorInfo& t : post.tensors) {
      auto [it, fresh] = index.try_emplace(t.name, static_cast<std::uint32_t>(tensors->size()));
      if (fresh) {
        tensors->push_back(TensorSpec{t.name, t.dtype, t.shape});
      } else {
        const TensorSpec& have = (*tensors)[it->second];
        if (have.dtype != t.dtype || have.shape != t.shape)
          return "rank " + std::to_string(r) + " sends '" + t.name + "' as " + std::string(dtype_name(t.dtype)) +
                 " with another dtype or shape than an earlier rank: every rank must give a tensor's full (logical) "
                 "shape and dtype";
      }
      const ShardInfo& sh = t.shards[0];
      ManifestPiece p{};
      p.tensor = it->second;
      p.rank = static_cast<std::uint16_t>(r);
      p.dim = sh.dim < 0 ? kWholePiece : static_cast<std::uint16_t>(sh.dim);
      p.start = sh.start;
      p.length = sh.length;
      p.offset = sh.stream_offset;
      p.nbytes = sh.wire_bytes;
      p.base_version = sh.base_version;
      pieces->push_back(p);
      payload += sh.wire_bytes;
    }
  }
  // Names must stay alive past `index`: they live in `posts`.
  *payload_bytes = payload;
  return {};
}

}  // namespace shmcast::detail

namespace shmcast {

std::uint64_t manifest_bytes_needed(std::span<const TensorSpec> tensors) { return detail::manifest_size(tensors); }

SyncLayout stream_layout(std::span<const TensorSpec> tensors, std::uint64_t slot_bytes) {
  if (slot_bytes == 0 || slot_bytes > limits::kMaxSlotBytes)
    throw Error(Errc::kInvalidArgument, "slot_bytes must be 1.." + std::to_string(limits::kMaxSlotBytes));
  if (tensors.size() > limits::kMaxTensors)
    throw Error(Errc::kInvalidArgument, "more than " + std::to_string(limits::kMaxTensors) + " tensors");
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (std::string why = detail::validate_spec(tensors[i]); !why.empty())
      throw Error(Errc::kInvalidArgument, "tensor " + std::to_string(i) + " ('" + tensors[i].name + "'): " + why);
    if (__builtin_add_overflow(total, tensors[i].nbytes(), &total) || total > limits::kMaxStreamBytes)
      throw Error(Errc::kInvalidArgument, "one sync may carry at most 64 TiB");
  }
  const std::uint64_t S = detail::align_up(slot_bytes, detail::kDataAlign);
  SyncLayout l;
  l.stream_bytes = detail::pack(tensors, S, &l.offsets, &l.payload_bytes);
  if (l.stream_bytes > limits::kMaxStreamBytes)
    throw Error(Errc::kInvalidArgument, "the sync's stream (tensors and alignment) exceeds 64 TiB");
  l.chunks = (l.stream_bytes + S - 1) / S;
  return l;
}

std::uint64_t store_bytes_needed(std::span<const TensorSpec> tensors) {
  // One chunk holds the whole version, so no tensor is moved to a slot
  // boundary: the layout is that of the largest slot.
  return stream_layout(tensors, limits::kMaxSlotBytes).stream_bytes;
}

}  // namespace shmcast
