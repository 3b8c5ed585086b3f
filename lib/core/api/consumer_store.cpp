// api/ (layer 6): a consumer of a store region (RegionMode::kStore): views()
// hands out the held version's tensors in place, read-only where the
// mapping allows, valid until skip() or the next wait_sync().
#include <cstddef>
#include <vector>

#include "api/consumer_impl.hpp"
#include "protocol/ring.hpp"
#include "shm/region.hpp"
#include "shmcast/shmcast.hpp"

namespace shmcast {

using namespace detail;
using State = Consumer::Impl::State;

std::vector<const std::byte*> Consumer::views() {
  Impl& m = *impl_;
  m.require_open();
  if (!m.view.geo().store)
    throw Error(Errc::kInvalidArgument, "views() needs a store region (RegionMode::kStore): a ring region's slots "
                                        "are reused while you read; use read_into() or visit()");
  if (m.state != State::kManifest && m.state != State::kViews)
    throw Error(Errc::kInvalidArgument, "no version to view: call wait_sync() first");
  refuse_delta(m, "views()");
  // Still ours? (A producer that evicted us may be rewriting the bank.)
  if (!m.ring->still_valid(m.view.slot_of(m.info.first_seq), m.info.first_seq)) {
    m.release_rest();
    m.ring->check_seat();
    throw Error(Errc::kEvicted, "the version was replaced before views() was called");
  }
  const std::byte* bank = m.view.slot_data(m.view.slot_of(m.info.first_seq));
  std::vector<const std::byte*> out;
  out.reserve(m.info.tensors.size());
  // decode_manifest checked every tensor against the stream (one rank: one whole piece each).
  for (const TensorInfo& t : m.info.tensors) out.push_back(t.nbytes == 0 ? nullptr : bank + t.stream_offset);
  m.state = State::kViews;
  return out;
}

bool Consumer::views_read_only() const { return impl_->read_only_views; }

bool Consumer::views_valid() const {
  const Impl& m = *impl_;
  if (!m.view.mapped() || !m.ring || m.state != State::kViews) return false;
  return m.ring->still_valid(m.view.slot_of(m.info.first_seq), m.info.first_seq);
}
}  // namespace shmcast
