#include <cstring>

#include "engine.hpp"

namespace shmcast::detail {

void gather_host(std::byte* dst, const std::byte* base, const Strided2D& l, std::uint64_t offset, std::uint64_t n) {
  if (l.rows == 0) {
    std::memcpy(dst, base + offset, n);
    return;
  }
  while (n > 0) {
    const std::uint64_t row = offset / l.row_bytes, col = offset % l.row_bytes;
    const std::uint64_t take = l.row_bytes - col < n ? l.row_bytes - col : n;
    std::memcpy(dst, base + row * l.pitch_bytes + col, take);
    dst += take;
    offset += take;
    n -= take;
  }
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
