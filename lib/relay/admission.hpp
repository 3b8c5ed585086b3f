// Admission of connections that have not proven the key yet (a listener's
// pending handshakes): at most `max_total` at once, and at most
// `max_per_source` from one source (an IPv4 address, or an IPv6 /64: one
// host owns a whole /64). Every pending connection is one that has not sent
// its response yet (one that sent it leaves, release(), once it is
// checked). A newcomer beyond a cap is not refused: it takes the place of
// the oldest pending connection of its own source when that cap is full,
// else of the oldest of the source holding the most pending connections;
// that one is evicted (the caller closes it). So a flood of keyless
// connections holds a bounded number of descriptors and handshakes, and
// idle connections cannot keep a keyed peer out: a peer's one pending
// connection is evicted only by newcomers from its own address, or when
// every source holds just one (docs/relay.md, "Limits"). Network thread
// only.
#pragma once

#include <sys/socket.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <unordered_map>

namespace shmcast::relay {

class Admission {
 public:
  Admission(std::size_t max_total, std::size_t max_per_source)
      : max_total_(max_total), max_per_source_(max_per_source) {}
  enum class Verdict { kAdmitted, kEvicted, kRefused };
  // Connection `id` from `source` (source_key) arrives at `now_ns`: admitted
  // (and counted); admitted in the place of the connection `*evicted`, which
  // the caller must end; or refused (only when no pending connection can
  // make room: a cap of 0).
  Verdict admit(const std::string& source, std::uint64_t id, std::int64_t now_ns, std::uint64_t* evicted);
  // Pending connection `id` proved the key, or ended (unknown ids: ignored).
  void release(std::uint64_t id);
  std::size_t pending() const { return by_id_.size(); }
  std::size_t pending_from(const std::string& source) const;
  std::uint64_t refused() const { return refused_; }
  std::uint64_t evicted() const { return evicted_; }

 private:
  struct Entry {
    std::string source;
    std::int64_t since_ns;
  };
  std::size_t max_total_, max_per_source_;
  std::uint64_t refused_ = 0, evicted_ = 0;
  std::map<std::uint64_t, Entry> by_id_;  // ids grow: the first is the oldest
  std::unordered_map<std::string, std::size_t> by_source_;
};

// The source a connection is counted under: its IPv4 address, or the /64 of
// its IPv6 address ("2001:db8:1:2::/64"; an IPv4-mapped one counts as IPv4).
std::string source_key(const sockaddr_storage& ss);

// The next connection id from `*counter`: 64 bits, so ids never wrap in the
// life of a relay; one still in use (`in_use`) is skipped all the same, and 0
// (the upstream's) is never given.
std::uint64_t next_conn_id(std::uint64_t* counter, const std::function<bool(std::uint64_t)>& in_use);

}  // namespace shmcast::relay
