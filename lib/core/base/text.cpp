#include "base/text.hpp"

#include <cstdio>

namespace shmcast::detail {

std::string human_bytes(std::uint64_t b) {
  char buf[64];
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  if (u == 0)
    std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(b));
  else if (v < 10.0)
    std::snprintf(buf, sizeof buf, "%.1f %s", v, units[u]);
  else
    std::snprintf(buf, sizeof buf, "%.0f %s", v, units[u]);
  return buf;
}

std::string gpu_uuid_text(std::span<const std::uint8_t, 16> u) {
  char b[64];
  std::snprintf(b, sizeof b, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1],
                u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
  return b;
}

}  // namespace shmcast::detail
