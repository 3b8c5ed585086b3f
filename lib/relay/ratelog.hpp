// Rate-limited logging: events that a peer can cause at will (connections,
// refusals, malformed messages, UCX's own warnings) print at most `burst`
// lines per topic and window; the rest are counted, and one line says how
// many were left out when the topic's next window begins (or at flush()).
// Thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>

namespace shmcast::relay {

class RateLog {
 public:
  using Sink = std::function<void(const std::string&)>;
  RateLog(Sink sink, std::uint32_t burst, std::int64_t window_ns)
      : sink_(std::move(sink)), burst_(burst), window_ns_(window_ns) {}
  // Prints `line` unless `topic` printed `burst` lines in its current
  // window; returns whether it printed.
  bool log(const std::string& topic, const std::string& line, std::int64_t now_ns);
  // Prints the count of lines left out for every topic whose window ended
  // (`all`: for every topic, as at exit).
  void flush(std::int64_t now_ns, bool all = false);
  // Lines left out so far, all topics (for tests and the status file).
  std::uint64_t suppressed() const;

 private:
  struct Topic {
    std::int64_t window_start = 0;
    std::uint32_t printed = 0;
    std::uint64_t held = 0;  // left out in this window
  };
  void roll(const std::string& topic, Topic& t, std::int64_t now_ns, bool force = false);
  Sink sink_;
  std::uint32_t burst_;
  std::int64_t window_ns_;
  mutable std::mutex mu_;
  std::map<std::string, Topic> topics_;
  std::uint64_t suppressed_ = 0;
};

}  // namespace shmcast::relay
