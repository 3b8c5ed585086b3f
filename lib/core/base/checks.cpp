#include "base/checks.hpp"

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "base/layout.hpp"

namespace shmcast::detail {

void require_valid_name(std::string_view name) {
  if (std::string why = validate_name(name); !why.empty())
    throw Error(Errc::kBadName, why + ": '" + std::string(name) + "'");
}

std::string printf_u64(const char* format, unsigned long long a, unsigned long long b) {
  char buf[256];
  std::snprintf(buf, sizeof buf, format, a, b);
  return buf;
}

Errc errc_for_errno(int e) noexcept {
  switch (e) {
    case EEXIST: return Errc::kExists;
    case ENOENT: return Errc::kNotFound;
    case EACCES:
    case EPERM: return Errc::kPermission;
    case ENOSPC:
    case ENOMEM: return Errc::kRegionFull;
    default: return Errc::kSystem;
  }
}

void throw_errno(int e, const std::string& what) {
  std::string msg = what + ": " + std::strerror(e);
  if (e == EACCES || e == EPERM)
    msg += " (regions are created mode 0600: open it as the user that created it, or create it with group_access)";
  throw Error(errc_for_errno(e), msg, e);
}

void write_error_text(char (&dst)[kErrorTextBytes], std::string_view text) noexcept {
  const std::size_t n = text.size() < kErrorTextBytes - 1 ? text.size() : kErrorTextBytes - 1;
  std::memcpy(dst, text.data(), n);
  dst[n] = 0;
}

std::string read_error_text(const char (&src)[kErrorTextBytes]) {
  return std::string(src, ::strnlen(src, kErrorTextBytes));
}

bool shape_bytes(DType dt, const std::int64_t* shape, std::size_t ndim, std::uint64_t* out) noexcept {
  std::uint64_t n = dtype_size(dt);
  if (n == 0) return false;
  for (std::size_t i = 0; i < ndim; ++i)
    if (shape[i] < 0 || !checked_mul(n, static_cast<std::uint64_t>(shape[i]), &n)) return false;
  *out = n;
  return true;
}

bool payload_bytes(std::span<const TensorSpec> tensors, std::uint64_t* out) {
  std::uint64_t total = 0;
  for (const TensorSpec& t : tensors)
    if (!checked_add(total, t.local_nbytes(), &total) || total > kMaxStreamBytes) return false;
  *out = total;
  return true;
}

void copy_record(const SyncRecord& r, RecordSnapshot* out) noexcept {
  out->word = r.announce.word.load(std::memory_order_relaxed);
  out->version = r.version.load(std::memory_order_relaxed);
  out->first_seq = r.first_seq.load(std::memory_order_relaxed);
  out->chunks = r.chunks.load(std::memory_order_relaxed);
  out->stream_bytes = r.stream_bytes.load(std::memory_order_relaxed);
  out->manifest_used = r.manifest_used.load(std::memory_order_relaxed);
  out->manifest_hash = r.manifest_hash.load(std::memory_order_relaxed);
  out->aborted = r.aborted.load(std::memory_order_relaxed) != 0;
}

std::string record_problem(const RecordSnapshot& rec, const Geometry& g) {
  if (rec.manifest_used < sizeof(ManifestHeader) || rec.manifest_used > g.manifest_bytes)
    return "the sync record's manifest size " + std::to_string(rec.manifest_used) +
           " is out of bounds (the manifest area holds " + std::to_string(g.manifest_bytes) + " bytes)";
  // The chunk count is checked against the manifest's rank table once it is
  // decoded (R * the longest sub-stream's chunks).
  if (rec.first_seq == 0 || rec.first_seq > (1ull << 62) || rec.stream_bytes > kMaxStreamBytes ||
      rec.chunks > (1ull << 46))
    return "sync record is inconsistent (first chunk, chunk count, stream size)";
  return {};
}

}  // namespace shmcast::detail
