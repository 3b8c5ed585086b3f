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

}  // namespace shmcast::detail
