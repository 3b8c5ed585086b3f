// Reading the sync record of a live region for the read-only probe
// (record.hpp): every touch of the mapping under the SIGBUS guard.
#include "probe/record.hpp"

#include <chrono>
#include <cstddef>
#include <thread>

#include "probe/bus_guard.hpp"
#include "protocol/ring.hpp"

namespace shmcast::detail::probe_impl {

namespace {

// read_record() on the live header, under the guard. Returns false when the
// page faulted; *stable says whether the seqlock gave a consistent copy.
bool guarded_record(const Header* live, RecordSnapshot* out, bool* stable) {
  return guarded([&] { *stable = read_record(*live, out); });
}

}  // namespace

bool read_record_any(const Header* live, RecordSnapshot* out, bool* stable) {
  for (int attempt = 0; attempt < 20; ++attempt) {
    if (!guarded_record(live, out, stable)) return false;
    if (*stable) return true;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  alignas(64) std::byte raw[sizeof(SyncRecord)];
  if (!guarded_copy(raw, &live->sync, sizeof raw)) return false;
  copy_record(*reinterpret_cast<const SyncRecord*>(raw), out);
  *stable = false;
  return true;
}

bool read_record_or_recover(const Header* live, const Geometry& g, bool producer_dead, RecordSnapshot* out,
                            bool* stable, bool* recovered) {
  *recovered = false;
  if (!read_record_any(live, out, stable)) return false;
  if (*stable || !g.store || !producer_dead) return true;
  RecordSnapshot rec{};
  bool got = false;
  if (!guarded([&] { got = recover_store_record(reinterpret_cast<const std::byte*>(live), g, &rec); })) return false;
  if (got) {
    *out = rec;
    *recovered = true;
  }
  return true;
}

}  // namespace shmcast::detail::probe_impl
