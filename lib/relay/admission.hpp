// Admission of connections that have not proven the key yet (a listener's
// pending handshakes): at most `max_total` at once, and at most
// `max_per_source` from one source address. A connection beyond either is
// refused at once, so that a flood of keyless connections holds a bounded
// number of file descriptors and handshakes (docs/relay.md, "Limits").
// Network thread only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>

namespace shmcast::relay {

class Admission {
 public:
  Admission(std::size_t max_total, std::size_t max_per_source) : max_total_(max_total), max_per_source_(max_per_source) {}
  // True (and counted) when a pending connection from `source` (an address,
  // without the port) fits; false when it must be refused.
  bool admit(const std::string& source);
  // A pending connection from `source` authenticated, or ended.
  void release(const std::string& source);
  std::size_t pending() const { return total_; }
  std::size_t pending_from(const std::string& source) const;
  std::uint64_t refused() const { return refused_; }

 private:
  std::size_t max_total_, max_per_source_, total_ = 0;
  std::uint64_t refused_ = 0;
  std::unordered_map<std::string, std::size_t> by_source_;
};

// The next connection id from `*counter`: 64 bits, so ids never wrap in the
// life of a relay; one still in use (`in_use`) is skipped all the same, and 0
// (the upstream's) is never given.
std::uint64_t next_conn_id(std::uint64_t* counter, const std::function<bool(std::uint64_t)>& in_use);

}  // namespace shmcast::relay
