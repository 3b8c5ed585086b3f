// Text for messages: byte counts as people read them, GPU UUIDs.
#pragma once

#include <cstdint>
#include <cstdio>
#include <span>
#include <string>

namespace shmcast::detail {

// "1.0 GiB", "64 MiB", "512 B"
std::string human_bytes(std::uint64_t bytes);

// A GPU's 16-byte UUID (cuDeviceGetUuid, the device-slots block of the
// region header) as nvidia-smi -L prints it: "GPU-2f6a7e4c-1b2d-...".
std::string gpu_uuid_text(std::span<const std::uint8_t, 16> uuid);

// "512 B", "64.0 MiB", "1.50 GiB": sizes of slots, chunks and syncs in the
// relay's log lines (no KiB; one decimal for MiB, two for GiB). Inline:
// shmcast_relay links libshmcast, whose detail:: symbols a shared build hides.
inline std::string coarse_bytes(std::uint64_t n) {
  char b[64];
  if (n >= (1ull << 30)) std::snprintf(b, sizeof b, "%.2f GiB", static_cast<double>(n) / (1ull << 30));
  else if (n >= (1ull << 20)) std::snprintf(b, sizeof b, "%.1f MiB", static_cast<double>(n) / (1ull << 20));
  else std::snprintf(b, sizeof b, "%llu B", static_cast<unsigned long long>(n));
  return b;
}

}  // namespace shmcast::detail
