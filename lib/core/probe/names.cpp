// The read-only probe's plain helpers (shmcast/probe.hpp): the layout
// version, the names of its states as shmcast-inspect prints them, the
// region directory and file names, and human_bytes. No region is touched.
#include <cstddef>
#include <string>

#include "base/layout.hpp"
#include "base/text.hpp"
#include "shm/region.hpp"
#include "shmcast/probe.hpp"

namespace shmcast::probe {

std::uint32_t layout_version() noexcept { return detail::kLayoutVersion; }

bool state_is_valid(State s) noexcept { return s == State::kReady || s == State::kClosed || s == State::kDead; }

bool state_is_damaged(State s) noexcept {
  return s == State::kCorrupt || s == State::kForeign || s == State::kNewerVersion || s == State::kOlderVersion ||
         s == State::kTruncated || s == State::kUnreadable || s == State::kUntrustedOwner;
}

namespace {

// Names of each enum's values, in the order of its values (0, 1, ...).
constexpr const char* kStateNames[] = {"creating",  "ready",      "closed",         "dead",
                                       "corrupt",   "foreign",    "newer-version",  "older-version",
                                       "truncated", "unreadable", "untrusted-owner"};
constexpr const char* kInitStateNames[] = {"creating", "ready", "closed", "invalid"};
constexpr const char* kSyncStatusNames[] = {"none", "writing", "published", "aborted", "unknown"};
constexpr const char* kSeatStateNames[] = {"free", "active", "evicted", "invalid"};
constexpr const char* kSlotStateNames[] = {"empty", "filling", "held", "released"};
constexpr const char* kManifestStatusNames[] = {"none", "ok", "changing", "invalid", "skipped"};

// The name of `e` in `names`, whose last entry names `Last`.
template <auto Last, std::size_t N>
const char* name_of(decltype(Last) e, const char* const (&names)[N]) noexcept {
  static_assert(N == static_cast<std::size_t>(Last) + 1, "one name for each value");
  const auto i = static_cast<std::size_t>(e);
  return i < N ? names[i] : "unknown";
}

}  // namespace

const char* state_name(State s) noexcept { return name_of<State::kUntrustedOwner>(s, kStateNames); }
const char* state_name(InitState s) noexcept { return name_of<InitState::kInvalid>(s, kInitStateNames); }
const char* state_name(SyncStatus s) noexcept { return name_of<SyncStatus::kUnknown>(s, kSyncStatusNames); }
const char* state_name(SeatState s) noexcept { return name_of<SeatState::kInvalid>(s, kSeatStateNames); }
const char* state_name(SlotState s) noexcept { return name_of<SlotState::kReleased>(s, kSlotStateNames); }
const char* state_name(ManifestStatus s) noexcept {
  return name_of<ManifestStatus::kSkipped>(s, kManifestStatusNames);
}

const char* slot_memory_name(SlotMemory m) noexcept { return m == SlotMemory::kDevice ? "device" : "host"; }

std::string resolve_dir(std::string_view dir) { return dir.empty() ? region_dir() : detail::trim_dir(dir); }

std::string region_file(std::string_view dir, std::string_view name) { return detail::region_file(dir, name); }

std::string human_bytes(std::uint64_t bytes) { return detail::human_bytes(bytes); }

}  // namespace shmcast::probe
