#include "admission.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <cstring>

namespace shmcast::relay {

Admission::Verdict Admission::admit(const std::string& source, std::uint64_t id, std::int64_t now_ns,
                                    std::uint64_t* evicted) {
  const std::size_t from = pending_from(source);
  Verdict v = Verdict::kAdmitted;
  if (by_id_.size() >= max_total_ || from >= max_per_source_) {
    // The victim's source: the newcomer's own when its cap is full (one
    // address competes only with itself), else the source that holds the
    // most pending connections (ties: the one with the oldest), so that a
    // peer with one pending connection is evicted only when every source
    // holds one.
    std::string victim_source = source;
    if (from < max_per_source_) {
      std::size_t most = 0;
      for (const auto& [vid, e] : by_id_) {  // oldest first
        const std::size_t n = pending_from(e.source);
        if (n > most) {
          most = n;
          victim_source = e.source;
        }
      }
    }
    auto victim = by_id_.end();
    for (auto it = by_id_.begin(); it != by_id_.end(); ++it)
      if (it->second.source == victim_source) {
        victim = it;
        break;
      }
    if (victim == by_id_.end()) {
      ++refused_;
      return Verdict::kRefused;
    }
    *evicted = victim->first;
    release(victim->first);
    ++evicted_;
    v = Verdict::kEvicted;
  }
  by_id_.emplace(id, Entry{source, now_ns});
  ++by_source_[source];
  return v;
}

void Admission::release(std::uint64_t id) {
  auto it = by_id_.find(id);
  if (it == by_id_.end()) return;
  auto s = by_source_.find(it->second.source);
  if (s != by_source_.end() && --s->second == 0) by_source_.erase(s);
  by_id_.erase(it);
}

std::size_t Admission::pending_from(const std::string& source) const {
  auto it = by_source_.find(source);
  return it == by_source_.end() ? 0 : it->second;
}

std::string source_key(const sockaddr_storage& ss) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    ::inet_ntop(AF_INET, &a->sin_addr, buf, sizeof buf);
    return buf;
  }
  if (ss.ss_family == AF_INET6) {
    in6_addr a = reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_addr;
    if (IN6_IS_ADDR_V4MAPPED(&a)) {
      in_addr v4{};
      std::memcpy(&v4, a.s6_addr + 12, 4);
      ::inet_ntop(AF_INET, &v4, buf, sizeof buf);
      return buf;
    }
    std::memset(a.s6_addr + 8, 0, 8);
    ::inet_ntop(AF_INET6, &a, buf, sizeof buf);
    return std::string(buf) + "/64";
  }
  return "?";
}

std::uint64_t next_conn_id(std::uint64_t* counter, const std::function<bool(std::uint64_t)>& in_use) {
  for (;;) {
    const std::uint64_t id = (*counter)++;
    if (id != 0 && !in_use(id)) return id;
  }
}

}  // namespace shmcast::relay
