#include "base/layout.hpp"

#include "base/checks.hpp"

namespace shmcast::detail {

std::string compute_geometry(std::uint32_t max_consumers, std::uint32_t slots, std::uint64_t slot_bytes,
                             std::uint64_t manifest_bytes, Geometry* out, std::uint32_t world_size, bool store,
                             bool device_slots) {
  if (max_consumers < 1 || max_consumers > kMaxConsumers)
    return printf_u64("max_consumers is %llu; it must be 1..%llu", max_consumers, kMaxConsumers);
  if (slots < 2 || slots > kMaxSlots) return printf_u64("slots is %llu; it must be 2..%llu", slots, kMaxSlots);
  if (slot_bytes == 0 || slot_bytes > kMaxSlotBytes)
    return printf_u64("slot_bytes is %llu; it must be 1..%llu", slot_bytes, kMaxSlotBytes);
  if (manifest_bytes < kMinManifestBytes || manifest_bytes > kMaxManifestBytes)
    return printf_u64("manifest_bytes is %llu; it must be %llu..1 GiB", manifest_bytes, kMinManifestBytes);
  if (world_size < 1 || world_size > kMaxRanks)
    return printf_u64("world_size is %llu; it must be 1..%llu", world_size, kMaxRanks);
  // Every rank keeps two chunks in flight, or a rank's next chunk would wait
  // for the slot of its own chunk still being written (docs/protocol.md §5).
  if (world_size > 1 && slots < 2 * world_size)
    return printf_u64("slots is %llu; a producer of %llu ranks needs at least 2 per rank", slots, world_size);
  if (store && (slots != 2 || world_size != 1))
    return printf_u64("a store region has 2 slots and 1 producer rank, not %llu and %llu", slots, world_size);
  if (device_slots && store) return "device slots need a ring region (a store region keeps its versions on the host)";
  Geometry g{};
  g.store = store;
  g.device_slots = device_slots;
  g.world_size = world_size;
  g.max_consumers = max_consumers;
  g.slot_count = slots;
  g.slot_bytes = align_up(slot_bytes, kDataAlign);
  g.manifest_bytes = align_up(manifest_bytes, 4096);
  g.seats_offset = kHeaderBytes;
  g.slots_offset = g.seats_offset + std::uint64_t{max_consumers} * kSeatBytes;
  g.manifest_offset = align_up(g.slots_offset + std::uint64_t{slots} * kSlotDescBytes, 4096);
  // Store mode: one manifest area per slot (bank).
  g.ranks_offset = g.manifest_offset + g.manifest_bytes * (store ? 2 : 1);
  g.rank_lists_offset = g.ranks_offset + (world_size > 1 ? std::uint64_t{world_size} * kRankSeatBytes : 0);
  const std::uint64_t lists = world_size > 1 ? std::uint64_t{world_size} * g.manifest_bytes : 0;
  g.rank_lists_offset = align_up(g.rank_lists_offset, 4096);
  g.data_offset = align_up(g.rank_lists_offset + lists, kDataAlign);
  std::uint64_t data = 0;
  if (!checked_mul(g.slot_bytes, slots, &data) || data > (1ull << 46))
    return printf_u64("slots x slot_bytes = %llu x %llu is too large", slots, g.slot_bytes);
  g.total_bytes = g.data_offset + (device_slots ? 0 : data);
  *out = g;
  return {};
}

SparseRanges sparse_ranges(const Geometry& g) {
  SparseRanges r;
  r.range[r.count++] = {g.manifest_offset, g.ranks_offset};
  if (g.world_size > 1) r.range[r.count++] = {g.rank_lists_offset, g.rank_lists_offset + std::uint64_t{g.world_size} * g.manifest_bytes};
  return r;
}

HeaderFixed make_fixed_header(const Geometry& g, std::uint64_t features) {
  HeaderFixed h{};
  h.magic = kMagic;
  h.layout_version = kLayoutVersion;
  h.header_bytes = kHeaderBytes;
  h.total_bytes = g.total_bytes;
  h.features = features;
  h.max_consumers = g.max_consumers;
  h.slot_count = g.slot_count;
  h.slot_bytes = g.slot_bytes;
  h.seats_offset = g.seats_offset;
  h.slots_offset = g.slots_offset;
  h.manifest_offset = g.manifest_offset;
  h.manifest_bytes = g.manifest_bytes;
  h.data_offset = g.data_offset;
  h.world_size = g.world_size;
  h.ranks_offset = g.ranks_offset;
  return h;
}

std::string validate_header(const HeaderFixed& h, std::uint64_t file_bytes, bool* version_mismatch) {
  *version_mismatch = false;
  if (h.magic != kMagic) return "not a shmcast region (bad magic)";
  if (h.layout_version != kLayoutVersion) {
    *version_mismatch = true;
    return printf_u64("region layout version is %llu, this shmcast speaks version %llu", h.layout_version,
                      kLayoutVersion);
  }
  if (h.header_bytes != kHeaderBytes)
    return printf_u64("header_bytes is %llu, expected %llu", h.header_bytes, kHeaderBytes);
  if (h.features & ~kKnownFeatures) {
    *version_mismatch = true;  // a newer shmcast's region: reading it as ours would misread it
    return printf_u64("unknown feature bits 0x%llx (a newer shmcast made the region: use the same shmcast on both "
                      "sides)", h.features & ~kKnownFeatures);
  }
  if (h.total_bytes != file_bytes)
    return printf_u64("header says %llu bytes but the file has %llu (truncated or resized)", h.total_bytes, file_bytes);
  // Recompute the geometry from the creation parameters and demand an exact
  // match: every offset is then known-good and derived, not trusted.
  Geometry g{};
  std::string why = compute_geometry(h.max_consumers, h.slot_count, h.slot_bytes, h.manifest_bytes, &g, h.world_size,
                                     (h.features & kFeatureStore) != 0, (h.features & kFeatureDeviceSlots) != 0);
  if (!why.empty()) return "bad geometry: " + why;
  if (g.slot_bytes != h.slot_bytes) return "slot_bytes is not 2 MiB aligned";
  if (g.manifest_bytes != h.manifest_bytes) return "manifest_bytes is not 4 KiB aligned";
  if (h.seats_offset != g.seats_offset || h.slots_offset != g.slots_offset ||
      h.manifest_offset != g.manifest_offset || h.data_offset != g.data_offset || h.ranks_offset != g.ranks_offset)
    return "section offsets do not match the geometry";
  if (g.total_bytes != h.total_bytes)
    return printf_u64("total_bytes %llu, geometry needs %llu", h.total_bytes, g.total_bytes);
  return {};
}

std::string device_slots_problem(const DeviceSlotsFixed& d, const Geometry& g, std::uint64_t features) {
  const bool on = (features & kFeatureDeviceSlots) != 0;
  if (!on) {
    const auto* b = reinterpret_cast<const unsigned char*>(&d);
    for (std::size_t i = 0; i < sizeof d; ++i)
      if (b[i] != 0) return "the device-slots block is not zero in a region of host slots";
    return {};
  }
  if (!g.device_slots) return "device slots in a region whose geometry has host slots";
  if ((features & (kFeatureChecksums | kFeatureDelta | kFeatureStore)) != 0)
    return "device slots with checksums, deltas or a store, which no shmcast producer makes";
  const std::uint64_t need = g.slot_bytes * g.slot_count;  // compute_geometry bounded it
  if (d.alloc_bytes < need || d.alloc_bytes - need > kMaxDeviceSlotSlack || d.alloc_bytes % (2ull << 20) != 0)
    return printf_u64("device slot allocation of %llu bytes for %llu bytes of slots", d.alloc_bytes, need);
  if (d.nonce == 0) return "device slots without a channel nonce";
  bool uuid = false;
  for (std::uint8_t c : d.gpu_uuid) uuid = uuid || c != 0;
  if (!uuid) return "device slots without a GPU UUID";
  for (std::uint8_t c : d.reserved)
    if (c != 0) return "reserved bytes of the device-slots block are not zero";
  return {};
}

}  // namespace shmcast::detail
