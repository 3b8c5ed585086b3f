// publish: a checkpoint as one sync of a region, through the public
// Producer API. A ring region: the reads fill staging windows
// (stream_tensors) and Producer::write copies each tensor from there into
// the slots, so the copy into the region runs while the next windows are
// being read. A store region: its bank holds the whole version, so the
// reads land in it directly (Producer::fill_spans, Reader::read_tensors).
#include <chrono>
#include <memory>

#include "checkpoint.hpp"
#include "shmcast/safetensors.hpp"

namespace shmcast::safetensors {

std::uint64_t manifest_bytes_for(const Checkpoint& ckpt) {
  const std::vector<TensorSpec> specs = ckpt.specs();
  std::uint64_t n = manifest_bytes_needed(specs);
  n = (n + 4095) / 4096 * 4096;
  return std::max<std::uint64_t>(n, 1ull << 20);
}

PublishStats publish(Producer& producer, const Checkpoint& ckpt, const PublishOptions& options, Reader* reader) {
  using clock = std::chrono::steady_clock;
  auto secs = [](clock::time_point a, clock::time_point b) { return std::chrono::duration<double>(b - a).count(); };
  const std::vector<TensorSpec> specs = ckpt.specs();
  std::unique_ptr<Reader> own;
  if (!reader) {
    own = std::make_unique<Reader>(options.read);
    reader = own.get();
  }
  PublishStats st;
  st.tensors = specs.size();
  st.payload_bytes = ckpt.payload_bytes();
  const auto t0 = clock::now();
  if (options.wait_consumers > 0) producer.wait_for_consumers(options.wait_consumers, options.wait_timeout);
  const auto t1 = clock::now();
  st.wait_s = secs(t0, t1);
  st.version = producer.begin_sync(specs);
  st.consumers = producer.consumers();
  try {
    if (producer.mode() == RegionMode::kStore) {
      // The bank holds the whole version: read every tensor straight into
      // it (one copy, no staging), then publish.
      const std::vector<std::span<std::byte>> spans = producer.fill_spans();
      std::vector<void*> dsts(spans.size());
      for (std::size_t i = 0; i < spans.size(); ++i) dsts[i] = spans[i].empty() ? nullptr : spans[i].data();
      st.read = reader->read_tensors(ckpt, dsts);
      if (options.stop && options.stop->load()) throw Error(Errc::kAborted, "publish was stopped");
      producer.end_sync();
      const auto t2s = clock::now();
      st.publish_s = secs(t1, t2s);
      st.drain_s = 0;  // a store region's readers never hold the producer
      return st;
    }
    st.read = reader->stream_tensors(
        ckpt,
        [&](std::size_t i, const std::byte* bytes) {
          if (options.stop && options.stop->load()) throw Error(Errc::kAborted, "publish was stopped");
          producer.write(i, bytes);
        });
    producer.end_sync();
  } catch (const std::exception& e) {
    // A write that threw has aborted the sync already (with its reason);
    // otherwise a read failed: consumers get kAborted with this reason.
    try {
      producer.abort_sync(std::string("shmcast-publish: ") + e.what());
    } catch (...) {
    }
    throw;
  }
  const auto t2 = clock::now();
  st.publish_s = secs(t1, t2);
  if (options.drain_timeout.count() > 0 && st.consumers > 0) producer.wait_drained(options.drain_timeout);
  st.drain_s = secs(t2, clock::now());
  return st;
}

}  // namespace shmcast::safetensors
