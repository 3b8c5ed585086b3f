#include "ratelog.hpp"

namespace shmcast::relay {

void RateLog::roll(const std::string& topic, Topic& t, std::int64_t now_ns, bool force) {
  if (!force && now_ns - t.window_start < window_ns_) return;
  if (t.held > 0)
    sink_("(" + std::to_string(t.held) + " more '" + topic + "' lines left out in the last " +
          std::to_string((now_ns - t.window_start) / 1000000000) + " s)");
  t.window_start = now_ns;
  t.printed = 0;
  t.held = 0;
}

bool RateLog::log(const std::string& topic, const std::string& line, std::int64_t now_ns) {
  std::lock_guard<std::mutex> g(mu_);
  auto [it, fresh] = topics_.try_emplace(topic);
  Topic& t = it->second;
  if (fresh) t.window_start = now_ns;
  roll(topic, t, now_ns);
  if (t.printed < burst_) {
    ++t.printed;
    sink_(line);
    return true;
  }
  ++t.held;
  ++suppressed_;
  return false;
}

void RateLog::flush(std::int64_t now_ns, bool all) {
  std::lock_guard<std::mutex> g(mu_);
  for (auto& [topic, t] : topics_) roll(topic, t, now_ns, all);
}

std::uint64_t RateLog::suppressed() const {
  std::lock_guard<std::mutex> g(mu_);
  return suppressed_;
}

}  // namespace shmcast::relay
