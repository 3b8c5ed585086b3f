// api/ (layer 6), private: mapping a region's device slots in a process
// that did not allocate them (a consumer, or producer rank 1..): the one
// procedure both use (docs/protocol.md §13.4, §13.5).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "base/layout.hpp"
#include "engine/cuda_vmm.hpp"
#include "protocol/ring.hpp"
#include "shm/region.hpp"

namespace shmcast::detail {

// Fetches the allocation that block `d` (already checked with
// device_slots_problem) names from the fd channel of region `name` in `dir`
// (the server checked with `trust`, and to be the region's producer when
// this process shares its PID namespace; the message's kind, nonce, count,
// size and GPU UUID checked against the block), maps it for `device`, and
// points `view`'s slots at it. `who` names the server in errors ("the
// producer", "rank 0"). Waits for the socket until `deadline` (at least
// 1 s). Throws fetch_fds' errors, kCorrupt (another GPU), and
// Mapping::import's (kUnsupported when `device` cannot reach the GPU).
vmm::Mapping map_device_slots(RegionView& view, const DeviceSlotsFixed& d, const std::string& dir,
                              std::string_view name, const TrustPolicy& trust, std::int64_t deadline, int device,
                              const std::string& who);

}  // namespace shmcast::detail
