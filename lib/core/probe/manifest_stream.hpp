// The manifest stream of the read-only probe (probe/, shmcast-inspect's
// thread that probes, `show --manifest`): the current sync's manifest read
// from the region file in bounded pieces, hashed and validated, its first
// entries decoded.
#pragma once

#include <cstddef>
#include <cstdint>

#include "base/layout.hpp"
#include "shmcast/probe.hpp"

namespace shmcast::detail::probe_impl {

// Fills r->manifest with the manifest of the sync in the region's record
// (geometry `g`, descriptor `fd`, mapping `base` of `size` bytes): kOk and
// the first `limit` entries (0: all), kNone, kChanging or kInvalid with the
// reason. Retries while the producer announces new syncs under it.
void decode_current_manifest(shmcast::probe::Region* r, const Geometry& g, int fd, const std::byte* base,
                             std::uint64_t size, std::size_t limit);

}  // namespace shmcast::detail::probe_impl
