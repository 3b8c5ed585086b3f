#include <cstring>

#include "engine/engine.hpp"

namespace shmcast::detail {

namespace {

// Calls run(at, len) for each piece of bytes [offset, offset + n) of a
// tensor laid out as `l` that is contiguous in the tensor's memory, in
// order: `at` is where the piece starts there.
template <class Run>
void for_each_run(const Strided2D& l, std::uint64_t offset, std::uint64_t n, Run&& run) {
  if (l.rows == 0) {
    run(offset, n);
    return;
  }
  while (n > 0) {
    const std::uint64_t row = offset / l.row_bytes, col = offset % l.row_bytes;
    const std::uint64_t take = l.row_bytes - col < n ? l.row_bytes - col : n;
    run(row * l.pitch_bytes + col, take);
    offset += take;
    n -= take;
  }
}

}  // namespace

void gather_host(std::byte* dst, const std::byte* base, const Strided2D& l, std::uint64_t offset, std::uint64_t n) {
  for_each_run(l, offset, n, [&](std::uint64_t at, std::uint64_t len) {
    std::memcpy(dst, base + at, len);
    dst += len;
  });
}

void scatter_host(std::byte* base, const Strided2D& l, std::uint64_t offset, const std::byte* src, std::uint64_t n) {
  for_each_run(l, offset, n, [&](std::uint64_t at, std::uint64_t len) {
    std::memcpy(base + at, src, len);
    src += len;
  });
}

namespace {

class HostProducerEngine final : public ProducerEngine {
 public:
  void copy(std::byte* dst, const Buffer& src, std::uint64_t offset, std::uint64_t n) override {
    if (src.device) throw Error(Errc::kInvalidArgument, "device source given to the host engine");
    gather_host(dst, static_cast<const std::byte*>(src.ptr), src.layout, offset, n);
  }
  void chunk_done(std::function<void()> publish) override { publish(); }
};

class HostConsumerEngine final : public ConsumerEngine {
 public:
  void copy(const Buffer& dst, std::uint64_t offset, const std::byte* src, std::uint64_t n) override {
    if (dst.device) throw Error(Errc::kInvalidArgument, "device destination given to the host engine");
    std::memcpy(static_cast<std::byte*>(dst.ptr) + offset, src, n);
  }
  void chunk_done(std::function<void()> release) override { release(); }
};

}  // namespace

std::unique_ptr<ProducerEngine> make_host_producer_engine() { return std::make_unique<HostProducerEngine>(); }
std::unique_ptr<ConsumerEngine> make_host_consumer_engine() { return std::make_unique<HostConsumerEngine>(); }

}  // namespace shmcast::detail
