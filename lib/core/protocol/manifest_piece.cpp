// The rules of one manifest piece against its tensor and its sync
// (protocol/manifest.hpp: piece_base_problem, piece_size_problem), for the
// readers that check a manifest a piece at a time.
#include "base/checks.hpp"
#include "protocol/delta.hpp"
#include "protocol/manifest.hpp"

namespace shmcast::detail {

std::string piece_base_problem(const ManifestPiece& p, std::uint64_t sync_version, std::uint64_t* base_version) {
  if (p.base_version == 0) return {};
  if (p.base_version >= sync_version) return "a delta against a version not before the sync's";
  if (*base_version != 0 && *base_version != p.base_version) return "delta pieces against different versions";
  *base_version = p.base_version;
  return {};
}

std::string piece_size_problem(const ManifestPiece& p, DType dtype, std::span<const std::int64_t> shape,
                               std::uint64_t tensor_nbytes, std::uint64_t* logical) {
  std::uint64_t nb = 0;
  if (p.dim == kWholePiece) {
    if (p.start != 0 || p.length != 0) return "a whole piece with a range";
    nb = tensor_nbytes;
    if (p.base_version == 0 && p.nbytes != nb) return "whole piece size disagrees with its tensor";
  } else {
    if (p.dim >= shape.size()) return "shard dim is not a dimension of its tensor";
    const std::int64_t extent = shape[p.dim];
    if (p.start < 0 || p.length < 0 || p.start > extent || p.length > extent - p.start)
      return "shard range lies outside its tensor";
    // Bytes of one index along the dim (the other dims whole), times the rows.
    std::uint64_t rb = dtype_size(dtype);
    for (std::size_t i = 0; i < shape.size(); ++i) {
      if (i == p.dim) continue;
      if (shape[i] < 0 || !checked_mul(rb, static_cast<std::uint64_t>(shape[i]), &rb))
        return "shard size disagrees with its range";
    }
    if (!checked_mul(rb, static_cast<std::uint64_t>(p.length), &nb) || (p.base_version == 0 && nb != p.nbytes))
      return "shard size disagrees with its range";
  }
  if (p.base_version != 0 && delta::elem_width(dtype) != dtype_size(dtype))
    return "a delta piece of a dtype that is sent as its bytes (elements of 1, 2, 4 or 8 bytes only)";
  if (p.base_version != 0 && !delta::piece_fits(dtype, nb, p.nbytes))
    return "a delta blob of impossible size for its piece";
  *logical = nb;
  return {};
}

}  // namespace shmcast::detail
