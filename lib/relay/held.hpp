// relay/: full-sync requests on their way upstream (WantFull), and the last
// version of each tensor set that passed a relay whole (HeldBases).
// A delta sync builds on the last sync of the same tensors (docs/protocol.md
// §12: an update sent as several syncs, buckets, has one base per bucket),
// so a relay passes a delta on only when it passed that version of those
// tensors on whole. At most kMaxDeltaGroups sets are remembered (the least
// recently held is forgotten first: its next delta becomes a full-sync
// request). Single-threaded: each user keeps its own.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "shmcast/shmcast.hpp"

namespace shmcast::relay {

// A full-sync request waiting to be passed on: after which version a full
// sync answers it (0: any later one). Requests merge: the later version
// wins, and 0 over any. Shared between threads.
class WantFull {
 public:
  void add(std::uint64_t after) {
    std::lock_guard<std::mutex> g(mu_);
    after_ = pending_ && (after_ == 0 || after == 0) ? 0 : (pending_ ? std::max(after_, after) : after);
    pending_ = true;
  }
  // Takes the pending request (false: none).
  bool take(std::uint64_t* after) {
    std::lock_guard<std::mutex> g(mu_);
    if (!pending_) return false;
    *after = after_;
    pending_ = false;
    return true;
  }

 private:
  std::mutex mu_;
  bool pending_ = false;
  std::uint64_t after_ = 0;
};

class HeldBases {
 public:
  // The identity of a tensor set: names, dtypes and shapes, in order.
  static std::uint64_t key(const std::vector<TensorSpec>& specs) {
    std::string s;
    for (const TensorSpec& t : specs) {
      s += t.name;
      s += '\0';
      s += std::to_string(static_cast<int>(t.dtype));
      for (std::int64_t d : t.shape) s += ',' + std::to_string(d);
      s += '\n';
    }
    return std::hash<std::string>{}(s);
  }
  // The version of `set` that passed whole (0: none).
  std::uint64_t version(std::uint64_t set) const {
    const auto it = held_.find(set);
    return it == held_.end() ? 0 : it->second.first;
  }
  void hold(std::uint64_t set, std::uint64_t v) {
    held_[set] = {v, ++tick_};
    if (held_.size() <= limits::kMaxDeltaGroups) return;
    auto oldest = held_.begin();
    for (auto it = held_.begin(); it != held_.end(); ++it)
      if (it->second.second < oldest->second.second) oldest = it;
    held_.erase(oldest);
  }
  void forget(std::uint64_t set) { held_.erase(set); }
  void clear() { held_.clear(); }

 private:
  std::unordered_map<std::uint64_t, std::pair<std::uint64_t, std::uint64_t>> held_;  // set -> {version, tick}
  std::uint64_t tick_ = 0;
};

}  // namespace shmcast::relay
