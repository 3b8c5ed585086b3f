#include "manifest.hpp"

#include <cstring>
#include <string_view>
#include <unordered_set>

namespace shmcast::detail {

namespace {

bool shape_bytes(DType dt, const std::int64_t* shape, std::size_t ndim, std::uint64_t* out) {
  std::uint64_t n = dtype_size(dt);
  if (n == 0) return false;
  for (std::size_t i = 0; i < ndim; ++i) {
    if (shape[i] < 0) return false;
    if (__builtin_mul_overflow(n, static_cast<std::uint64_t>(shape[i]), &n)) return false;
  }
  *out = n;
  return true;
}

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
  return {};
}

std::uint64_t pack(std::span<const TensorSpec> specs, std::uint64_t slot_bytes, std::vector<std::uint64_t>* offsets,
                   std::uint64_t* payload_bytes) {
  offsets->clear();
  offsets->reserve(specs.size());
  std::uint64_t pos = 0, payload = 0;
  for (const TensorSpec& s : specs) {
    const std::uint64_t n = s.nbytes();
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

std::uint64_t manifest_size(std::span<const TensorSpec> specs) {
  std::uint64_t names = 0;
  for (const TensorSpec& s : specs) names += s.name.size();
  return sizeof(ManifestHeader) + specs.size() * sizeof(ManifestEntry) + names;
}

std::uint64_t encode_manifest(std::span<const TensorSpec> specs, std::span<const std::uint64_t> offsets,
                              std::uint64_t sync_version, std::uint64_t stream_bytes, std::uint64_t payload_bytes,
                              std::byte* out, std::uint64_t capacity) {
  const std::uint64_t total = manifest_size(specs);
  if (total > capacity) return 0;
  ManifestHeader h{};
  h.magic = kManifestMagic;
  h.format = kManifestVersion;
  h.sync_version = sync_version;
  h.tensor_count = static_cast<std::uint32_t>(specs.size());
  h.entry_bytes = sizeof(ManifestEntry);
  h.names_offset = sizeof(ManifestHeader) + specs.size() * sizeof(ManifestEntry);
  h.names_bytes = total - h.names_offset;
  h.stream_bytes = stream_bytes;
  h.payload_bytes = payload_bytes;
  std::memcpy(out, &h, sizeof h);
  std::uint64_t name_pos = 0;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const TensorSpec& s = specs[i];
    ManifestEntry e{};
    e.name_offset = static_cast<std::uint32_t>(name_pos);
    e.name_bytes = static_cast<std::uint32_t>(s.name.size());
    e.dtype = static_cast<std::uint16_t>(s.dtype);
    e.ndim = static_cast<std::uint16_t>(s.shape.size());
    e.nbytes = s.nbytes();
    e.stream_offset = offsets[i];
    for (std::size_t d = 0; d < s.shape.size(); ++d) e.shape[d] = s.shape[d];
    std::memcpy(out + sizeof h + i * sizeof e, &e, sizeof e);
    std::memcpy(out + h.names_offset + name_pos, s.name.data(), s.name.size());
    name_pos += s.name.size();
  }
  return total;
}

std::string decode_manifest(std::span<const std::byte> bytes, std::uint64_t expect_version,
                            std::uint64_t expect_stream_bytes, std::uint64_t slot_bytes, SyncInfo* out,
                            bool check_names) {
  if (bytes.size() < sizeof(ManifestHeader)) return "manifest shorter than its header";
  ManifestHeader h;
  std::memcpy(&h, bytes.data(), sizeof h);
  if (h.magic != kManifestMagic) return "bad manifest magic";
  if (h.format != kManifestVersion) return "unknown manifest format " + std::to_string(h.format);
  if (h.entry_bytes != sizeof(ManifestEntry)) return "bad manifest entry size";
  if (h.sync_version != expect_version) return "manifest is for another sync version";
  if (h.stream_bytes != expect_stream_bytes) return "manifest stream size disagrees with the sync record";
  const std::uint64_t max_entries = (bytes.size() - sizeof h) / sizeof(ManifestEntry);
  if (h.tensor_count > max_entries) return "tensor count exceeds the manifest";
  if (h.tensor_count > kMaxTensors) return "more than " + std::to_string(kMaxTensors) + " tensors";
  if (h.stream_bytes > kMaxStreamBytes) return "stream larger than 64 TiB";
  const std::uint64_t names_at = sizeof h + std::uint64_t{h.tensor_count} * sizeof(ManifestEntry);
  if (h.names_offset != names_at) return "names blob is not where the entries end";
  if (h.names_bytes > bytes.size() - names_at) return "names blob runs past the manifest";
  const char* names = reinterpret_cast<const char*>(bytes.data() + names_at);

  SyncInfo info;
  info.version = h.sync_version;
  info.stream_bytes = h.stream_bytes;
  info.tensors.reserve(h.tensor_count);
  std::unordered_set<std::string_view> seen;
  if (check_names) seen.reserve(h.tensor_count);
  std::uint64_t end_prev = 0, payload = 0;
  for (std::uint32_t i = 0; i < h.tensor_count; ++i) {
    ManifestEntry e;
    std::memcpy(&e, bytes.data() + sizeof h + std::uint64_t{i} * sizeof e, sizeof e);
    if (e.name_bytes == 0 || e.name_bytes > kMaxNameBytes) return at(i, "bad name length");
    if (std::uint64_t{e.name_offset} + e.name_bytes > h.names_bytes) return at(i, "name runs past the names blob");
    const std::string_view name(names + e.name_offset, e.name_bytes);
    if (check_names) {
      if (std::string why = name_problem(name); !why.empty()) return at(i, why);
      if (!seen.insert(name).second) return at(i, "name appears twice in the manifest");
    }
    if (e.ndim > kMaxDims) return at(i, "more than 8 dimensions");
    const DType dt = static_cast<DType>(e.dtype);
    std::uint64_t n;
    if (!shape_bytes(dt, e.shape, e.ndim, &n)) return at(i, "unknown dtype or bad shape");
    if (n != e.nbytes) return at(i, "byte size disagrees with dtype and shape");
    if (e.stream_offset % kTensorAlign != 0) return at(i, "misaligned stream offset");
    if (e.stream_offset < end_prev) return at(i, "overlaps the previous tensor");
    if (e.nbytes > h.stream_bytes || e.stream_offset > h.stream_bytes - e.nbytes)
      return at(i, "runs past the end of the stream");
    if (e.nbytes > 0 && e.nbytes <= slot_bytes && e.stream_offset / slot_bytes != (e.stream_offset + e.nbytes - 1) / slot_bytes)
      return at(i, "straddles a slot boundary");
    end_prev = e.stream_offset + e.nbytes;
    payload += e.nbytes;
    TensorInfo t;
    if (check_names) t.name.assign(name);
    t.dtype = dt;
    t.shape.assign(e.shape, e.shape + e.ndim);
    t.nbytes = e.nbytes;
    t.stream_offset = e.stream_offset;
    info.tensors.push_back(std::move(t));
  }
  if (payload != h.payload_bytes) return "payload size disagrees with the entries";
  info.payload_bytes = payload;
  *out = std::move(info);
  return {};
}

}  // namespace shmcast::detail

namespace shmcast {

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

}  // namespace shmcast
