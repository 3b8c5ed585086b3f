// api/ (layer 6): the public Producer. Its methods are thin: each checks
// what it must and calls into Producer::Impl (api/producer_impl.hpp, which
// lists the files that hold the rest); the getters. create() is in
// producer_create.cpp. Runs on the caller's thread.
#include <string>
#include <string_view>
#include <vector>

#include "api/producer_impl.hpp"
#include "base/checks.hpp"
#include "engine/engine.hpp"
#include "protocol/ring.hpp"
#include "shm/doorbell.hpp"
#include "shm/region.hpp"
#include "shmcast/shmcast.hpp"

namespace shmcast {

using namespace detail;

Producer::Producer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Producer::Producer(Producer&&) noexcept = default;
Producer& Producer::operator=(Producer&&) noexcept = default;
Producer::~Producer() = default;

void Producer::wait_for_consumers(std::uint32_t n, Duration timeout) {
  impl_->require_open();
  Header& h = impl_->view.header();
  const std::int64_t deadline = mono_ns() + timeout.count();
  for (;;) {
    const std::uint32_t have = impl_->ring->live_consumers();
    if (have >= n) return;
    auto ready = [&] { return impl_->ring->live_consumers() >= n; };
    if (wait_until(h.release, ready, deadline, kLivenessPollNs) == WaitResult::kTimeout)
      throw Error(Errc::kTimeout, std::to_string(have) + " of " + std::to_string(n) + " consumers attached to '" +
                                      impl_->name + "' before the timeout: are the consumers running, with the same "
                                      "SHMCAST_DIR?");
  }
}

std::uint32_t Producer::consumers() const {
  impl_->require_open();
  return impl_->ring->live_consumers();
}

std::uint64_t Producer::begin_sync(std::span<const TensorSpec> tensors, std::uint64_t version) {
  return impl_->begin_sync(tensors, version);
}

void Producer::write(std::size_t index, const void* src) {
  impl_->write_user(index, Buffer{const_cast<void*>(src), false, {}}, nullptr);
}

void Producer::write_strided(std::size_t index, const void* src, const Strided2D& layout) {
  impl_->write_user(index, Buffer{const_cast<void*>(src), false, layout}, nullptr);
}

void Producer::write_part(std::size_t index, std::uint64_t offset, const void* src, std::uint64_t bytes) {
  impl_->write_user(index, Buffer{const_cast<void*>(src), false, {}}, nullptr, offset, bytes);
}

void Producer::write_device(std::size_t index, const void* src, void* stream) {
  write_device_strided(index, src, Strided2D{}, stream);
}

void Producer::write_device_strided(std::size_t index, const void* src, const Strided2D& layout, void* stream) {
  impl_->write_user(index, Buffer{const_cast<void*>(src), true, layout}, stream);
}

std::vector<std::span<std::byte>> Producer::fill_spans() { return impl_->fill_spans(); }

std::span<std::byte> Producer::lend_chunk(std::uint64_t c) { return impl_->lend_chunk(c); }

void Producer::publish_chunks(std::uint64_t end) { impl_->publish_chunks(end); }

void Producer::end_sync() { impl_->end_sync(); }

void Producer::abort_sync(std::string_view why) {
  impl_->require_open();
  impl_->abort(why);
}

std::uint64_t Producer::send(std::span<const TensorSpec> tensors, std::span<const void* const> srcs) {
  return send(tensors, srcs, 0);
}

std::uint64_t Producer::send(std::span<const TensorSpec> tensors, std::span<const void* const> srcs,
                             std::uint64_t version) {
  if (srcs.size() != tensors.size()) {
    const std::string why = "send(): " + std::to_string(tensors.size()) + " tensors but " +
                            std::to_string(srcs.size()) + " sources";
    skip_sync(why, version);  // a sharded rank still takes its round: the ranks stay in step
    throw Error(Errc::kInvalidArgument, why);
  }
  if (impl_->quantizing()) {
    // The scales first: a NaN or Inf fails the send with nothing announced.
    try {
      impl_->prescale(tensors, srcs);
    } catch (const std::exception& e) {  // an Error, or an allocation that failed
      skip_sync(e.what(), version);      // a sharded rank still takes its round
      throw;
    }
  }
  const std::uint64_t v = begin_sync(tensors, version);
  try {
    for (std::size_t i = 0; i < tensors.size(); ++i) write(i, srcs[i]);
    end_sync();
  } catch (const Error& e) {
    impl_->abort(e.what(), e.code());
    throw;
  }
  return v;
}

void Producer::skip_sync(std::string_view why, std::uint64_t version) { impl_->skip_sync(why, version); }

void Producer::prepare_device(std::span<const TensorSpec> tensors, std::span<const void* const> srcs,
                              void* cuda_stream) {
  impl_->require_open();
  if (impl_->in_sync) throw Error(Errc::kInvalidArgument, "prepare_device() during a sync: call it before begin_sync()");
  if (srcs.size() != tensors.size())
    throw Error(Errc::kInvalidArgument, "prepare_device(): " + std::to_string(tensors.size()) + " tensors but " +
                                            std::to_string(srcs.size()) + " sources");
  if (!impl_->quantizing()) return;
  impl_->prescale_device(tensors, srcs, cuda_stream);
}

std::uint64_t Producer::last_round() const { return impl_->round; }

void Producer::wait_drained(Duration timeout) {
  impl_->require_open();
  if (impl_->in_sync) throw Error(Errc::kInvalidArgument, "wait_drained() during a sync");
  if (impl_->view.geo().store) return;  // readers hold a version, never the stream
  impl_->ring->wait_released(impl_->next_seq - 1, mono_ns() + timeout.count());
}

std::vector<std::string> Producer::take_events() { return impl_->ring ? impl_->ring->take_events() : std::vector<std::string>{}; }
const std::string& Producer::name() const { return impl_->name; }
const std::string& Producer::path() const { return impl_->path; }
std::uint64_t Producer::region_bytes() const { return impl_->view.geo().total_bytes; }
std::uint64_t Producer::slot_bytes() const { return impl_->view.geo().slot_bytes; }
std::uint32_t Producer::slots() const { return impl_->view.geo().slot_count; }
std::uint64_t Producer::last_version() const { return impl_->version; }
RegionMode Producer::mode() const { return impl_->view.geo().store ? RegionMode::kStore : RegionMode::kRing; }
const SyncLayout& Producer::last_layout() const { return impl_->layout; }
bool Producer::pinned() const { return impl_->pin.pinned; }
SlotMemory Producer::slot_memory() const {
  return impl_->view.geo().device_slots ? SlotMemory::kDevice : SlotMemory::kHost;
}
int Producer::slot_device() const { return impl_->slot_mem.empty() ? -1 : impl_->slot_mem.device(); }
std::uint64_t Producer::slot_device_bytes() const { return impl_->slot_mem.empty() ? 0 : impl_->slot_mem.bytes(); }
CopyEngine Producer::engine() const { return impl_->engine->is_cuda() ? CopyEngine::kCuda : CopyEngine::kHost; }
double Producer::pin_seconds() const { return impl_->pin.seconds; }
double Producer::create_seconds() const { return impl_->create_s; }
SyncReport Producer::last_sync() const { return impl_->report; }
std::uint64_t Producer::delta_base_bytes() const { return impl_->delta.base_bytes + impl_->delta.parked_bytes; }
void Producer::close() {
  if (impl_) impl_->close_quietly();
}

}  // namespace shmcast
