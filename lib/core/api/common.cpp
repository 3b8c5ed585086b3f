// Errors, dtypes, names: the small public helpers.
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "base/checks.hpp"
#include "engine/engine.hpp"
#include "shm/region.hpp"
#include "shmcast/shmcast.hpp"

namespace shmcast {

const char* errc_name(Errc c) noexcept {
  switch (c) {
    case Errc::kInvalidArgument: return "InvalidArgument";
    case Errc::kBadName: return "BadName";
    case Errc::kExists: return "Exists";
    case Errc::kNotFound: return "NotFound";
    case Errc::kRegionFull: return "RegionFull";
    case Errc::kPermission: return "Permission";
    case Errc::kCorrupt: return "Corrupt";
    case Errc::kVersionMismatch: return "VersionMismatch";
    case Errc::kTimeout: return "Timeout";
    case Errc::kPeerDied: return "PeerDied";
    case Errc::kClosed: return "Closed";
    case Errc::kNoSeat: return "NoSeat";
    case Errc::kEvicted: return "Evicted";
    case Errc::kAborted: return "Aborted";
    case Errc::kChecksum: return "Checksum";
    case Errc::kCuda: return "Cuda";
    case Errc::kCudaUnavailable: return "CudaUnavailable";
    case Errc::kSystem: return "System";
    case Errc::kUnsupported: return "Unsupported";
    case Errc::kNeedsFullSync: return "NeedsFullSync";
  }
  return "Unknown";
}

Error::Error(Errc code, const std::string& message, int sys_errno)
    : std::runtime_error(std::string("shmcast ") + errc_name(code) + ": " + message), code_(code), errno_(sys_errno) {}

namespace {
struct DTypeRow {
  DType dt;
  std::size_t size;
  const char* name;
};
constexpr DTypeRow kDTypes[] = {
    {DType::kBool, 1, "bool"},        {DType::kU8, 1, "u8"},
    {DType::kI8, 1, "i8"},            {DType::kI16, 2, "i16"},
    {DType::kI32, 4, "i32"},          {DType::kI64, 8, "i64"},
    {DType::kU16, 2, "u16"},          {DType::kU32, 4, "u32"},
    {DType::kU64, 8, "u64"},          {DType::kF16, 2, "f16"},
    {DType::kBF16, 2, "bf16"},        {DType::kF32, 4, "f32"},
    {DType::kF64, 8, "f64"},          {DType::kF8E4M3FN, 1, "f8e4m3fn"},
    {DType::kF8E5M2, 1, "f8e5m2"},    {DType::kF8E4M3FNUZ, 1, "f8e4m3fnuz"},
    {DType::kF8E5M2FNUZ, 1, "f8e5m2fnuz"}, {DType::kC64, 8, "c64"},
    {DType::kC128, 16, "c128"},       {DType::kF8E8M0FNU, 1, "f8e8m0fnu"},
    {DType::kRaw, 1, "raw"},
};
}  // namespace

std::size_t dtype_size(DType dt) noexcept {
  for (const auto& r : kDTypes)
    if (r.dt == dt) return r.size;
  return 0;
}

std::string_view dtype_name(DType dt) noexcept {
  for (const auto& r : kDTypes)
    if (r.dt == dt) return r.name;
  return "unknown";
}

bool dtype_from_name(std::string_view name, DType* out) noexcept {
  for (const auto& r : kDTypes)
    if (name == r.name) {
      *out = r.dt;
      return true;
    }
  return false;
}

std::uint64_t TensorSpec::nbytes() const {
  if (dtype_size(dtype) == 0) throw Error(Errc::kInvalidArgument, "tensor '" + name + "' has an unknown dtype");
  std::uint64_t n = 0;
  if (!detail::shape_bytes(dtype, shape.data(), shape.size(), &n))
    throw Error(Errc::kInvalidArgument, "tensor '" + name + "' has a negative dimension or its size overflows");
  return n;
}

std::uint64_t TensorSpec::local_nbytes() const {
  const std::uint64_t n = nbytes();
  if (shard_dim < 0) return n;
  if (static_cast<std::size_t>(shard_dim) >= shape.size() || shard_length < 0 ||
      shard_length > shape[static_cast<std::size_t>(shard_dim)])
    throw Error(Errc::kInvalidArgument, "tensor '" + name + "': shard_dim/shard_length do not fit its shape");
  const auto extent = static_cast<std::uint64_t>(shape[static_cast<std::size_t>(shard_dim)]);
  return extent == 0 ? 0 : n / extent * static_cast<std::uint64_t>(shard_length);
}

std::ptrdiff_t SyncInfo::find(std::string_view n) const {
  for (std::size_t i = 0; i < tensors.size(); ++i)
    if (tensors[i].name == n) return static_cast<std::ptrdiff_t>(i);
  return -1;
}

std::string region_dir() {
  const char* d = std::getenv("SHMCAST_DIR");
  return detail::trim_dir((d && *d) ? d : "/dev/shm");
}

std::string validate_name(std::string_view name) {
  if (name.empty()) return "region name is empty";
  if (name.size() > 128) return "region name is longer than 128 characters";
  if (name[0] == '.' || name[0] == '-') return "region name must not start with '.' or '-'";
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                    c == '_' || c == '-';
    if (!ok) return "region name may only use letters, digits, '.', '_' and '-'";
  }
  return {};
}

std::string region_path(std::string_view name) { return detail::region_file(region_dir(), name); }

bool unlink_region(std::string_view name) {
  detail::require_valid_name(name);
  const std::string p = region_path(name);
  if (::unlink(p.c_str()) == 0) return true;
  if (errno == ENOENT) return false;
  detail::throw_errno(errno, "cannot remove " + p);
}

bool cuda_available() noexcept {
  try {
    return detail::cuda_present(nullptr);
  } catch (...) {
    return false;
  }
}

std::string cuda_unavailable_reason() {
  std::string why;
  if (detail::cuda_present(&why)) return {};
  return why;
}

}  // namespace shmcast
