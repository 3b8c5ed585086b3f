#include "admission.hpp"

namespace shmcast::relay {

bool Admission::admit(const std::string& source) {
  auto it = by_source_.find(source);
  const std::size_t from = it == by_source_.end() ? 0 : it->second;
  if (total_ >= max_total_ || from >= max_per_source_) {
    ++refused_;
    return false;
  }
  ++total_;
  ++by_source_[source];
  return true;
}

void Admission::release(const std::string& source) {
  auto it = by_source_.find(source);
  if (it == by_source_.end() || it->second == 0 || total_ == 0) return;
  --total_;
  if (--it->second == 0) by_source_.erase(it);
}

std::size_t Admission::pending_from(const std::string& source) const {
  auto it = by_source_.find(source);
  return it == by_source_.end() ? 0 : it->second;
}

std::uint64_t next_conn_id(std::uint64_t* counter, const std::function<bool(std::uint64_t)>& in_use) {
  for (;;) {
    const std::uint64_t id = (*counter)++;
    if (id != 0 && !in_use(id)) return id;
  }
}

}  // namespace shmcast::relay
