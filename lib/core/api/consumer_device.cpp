// api/ (layer 6): a consumer's reads into device memory through the CUDA
// engine: read_into_device (the caller's device buffers; a delta sync's
// blobs are applied on the GPU, consumer_delta.cpp) and read_to_staging
// (one device buffer the engine owns, the tensors at their places in it).
#include <cstdint>
#include <vector>

#include "api/consumer_impl.hpp"
#include "base/layout.hpp"
#include "engine/engine.hpp"
#include "protocol/manifest.hpp"
#include "shmcast/shmcast.hpp"

namespace shmcast {

using namespace detail;
using State = Consumer::Impl::State;

void Consumer::read_into_device(std::span<void* const> dsts, void* stream) { read_into_device(dsts, stream, {}); }

void Consumer::read_into_device(std::span<void* const> dsts, void* stream, std::span<const Selection> selections) {
  Impl& m = *impl_;
  m.require_open();
  m.check_dsts(dsts.size());
  if (!m.cuda_engine) m.cuda_engine = make_cuda_consumer_engine();
  ConsumerEngine& e = *m.cuda_engine;
  m.read_tracked(dsts, selections, true, [&] {
    if (m.state == State::kManifest && m.info.delta()) {
      m.read_delta_device(dsts, selections, stream);
      return;
    }
    e.begin(stream);
    m.read_planned(e, dsts, selections, true, false);
    e.end(stream);
  });
}

std::vector<void*> Consumer::read_to_staging(int device, void* stream) {
  Impl& m = *impl_;
  m.require_open();
  refuse_delta(m, "read_to_staging()");
  if (m.state != State::kManifest) throw Error(Errc::kInvalidArgument, "no sync to read: call wait_sync() first");
  if (!m.cuda_engine) m.cuda_engine = make_cuda_consumer_engine();
  ConsumerEngine& e = *m.cuda_engine;
  std::vector<void*> out;
  out.reserve(m.info.tensors.size());
  if (m.info.world_size == 1) {
    std::byte* base = e.staging(device, m.info.stream_bytes);
    e.begin(stream);
    // One H2D per slot: the staging buffer mirrors the stream.
    m.for_each_chunk(e, [&](const std::byte* data, std::uint32_t, std::uint64_t start, std::uint64_t bytes) {
      e.copy(Buffer{base, true, {}}, start, data, bytes);
    });
    e.end(stream);
    for (const TensorInfo& t : m.info.tensors) out.push_back(base + t.stream_offset);
    return out;
  }
  // Several ranks: each tensor assembled at its own place in the buffer.
  std::vector<std::uint64_t> at;
  std::uint64_t total = 0;
  for (const TensorInfo& t : m.info.tensors) {
    total = align_up(total, kTensorAlign);
    at.push_back(total);
    total += t.nbytes;
  }
  std::byte* base = e.staging(device, total);
  for (std::uint64_t a : at) out.push_back(base + a);
  e.begin(stream);
  m.read_planned(e, out, {}, true, false);
  e.end(stream);
  return out;
}
}  // namespace shmcast
