// fault_checksum_cost: what per-slot checksums cost, for docs/reliability.md.
// Not a test (no timing is ever asserted). Producer and consumer are threads
// of this process over one region; the consumer copies every sync out with
// read_into. Prints one line:
//   CHECKSUM-COST {"xxh3_gbps":..,"off_gbps":..,"on_gbps":..,"cost_pct":..}
//
//   fault_checksum_cost [payload_mib=1024] [syncs=5] [slot_mib=64] [slots=4]
#include <xxhash.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "shmcast/shmcast.hpp"

using namespace shmcast;
using Clk = std::chrono::steady_clock;

namespace {

double seconds_since(Clk::time_point t0) { return std::chrono::duration<double>(Clk::now() - t0).count(); }

// Payload GB/s of `syncs` syncs of `payload` bytes (64 MiB tensors).
double transfer_gbps(bool checksums, std::uint64_t payload, int syncs, std::uint64_t slot, std::uint32_t slots) {
  const std::string name = "cost-" + std::to_string(::getpid()) + (checksums ? "-on" : "-off");
  ProducerOptions o;
  o.slot_bytes = slot;
  o.slots = slots;
  o.max_consumers = 1;
  o.pin = Pin::kNo;
  o.checksums = checksums;
  Producer p = Producer::create(name, o);
  const std::uint64_t tensor = 64ull << 20;
  std::vector<TensorSpec> specs;
  std::vector<std::vector<std::uint8_t>> data;
  std::vector<const void*> srcs;
  for (std::uint64_t off = 0, i = 0; off < payload; off += tensor, ++i) {
    const std::uint64_t n = payload - off < tensor ? payload - off : tensor;
    specs.push_back({"t" + std::to_string(i), DType::kU8, {static_cast<std::int64_t>(n)}});
    data.emplace_back(n, static_cast<std::uint8_t>(i));
    srcs.push_back(data.back().data());
  }
  std::thread reader([&] {
    ConsumerOptions co;
    co.pin = Pin::kNo;
    Consumer c = Consumer::open(name, co);
    std::vector<std::vector<std::uint8_t>> out;
    for (const auto& s : specs) out.emplace_back(s.nbytes());
    std::vector<void*> dst;
    for (auto& x : out) dst.push_back(x.data());
    for (int s = 0; s <= syncs; ++s) {  // one warm-up sync
      c.wait_sync(std::chrono::seconds(60));
      c.read_into(dst);
    }
  });
  p.wait_for_consumers(1, std::chrono::seconds(30));
  p.send(specs, srcs);  // warm-up: faults in slots and buffers
  p.wait_drained(std::chrono::seconds(60));
  const auto t0 = Clk::now();
  for (int s = 0; s < syncs; ++s) p.send(specs, srcs);
  p.wait_drained(std::chrono::seconds(60));
  const double secs = seconds_since(t0);
  reader.join();
  return static_cast<double>(payload) * syncs / secs / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  const std::uint64_t payload = (argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1024) << 20;
  const int syncs = argc > 2 ? std::atoi(argv[2]) : 5;
  const std::uint64_t slot = (argc > 3 ? std::strtoull(argv[3], nullptr, 10) : 64) << 20;
  const std::uint32_t slots = argc > 4 ? static_cast<std::uint32_t>(std::atoi(argv[4])) : 4;

  std::vector<std::uint8_t> buf(slot, 0x5a);
  volatile std::uint64_t sink = XXH3_64bits(buf.data(), buf.size());
  const auto t0 = Clk::now();
  const int reps = 16;
  for (int i = 0; i < reps; ++i) sink = sink + XXH3_64bits(buf.data(), buf.size());
  const double xxh3 = static_cast<double>(slot) * reps / seconds_since(t0) / 1e9;

  const double off = transfer_gbps(false, payload, syncs, slot, slots);
  const double on = transfer_gbps(true, payload, syncs, slot, slots);
  std::printf("CHECKSUM-COST {\"payload_mib\":%llu,\"syncs\":%d,\"slot_mib\":%llu,\"slots\":%u,"
              "\"xxh3_gbps\":%.2f,\"off_gbps\":%.2f,\"on_gbps\":%.2f,\"cost_pct\":%.1f}\n",
              static_cast<unsigned long long>(payload >> 20), syncs, static_cast<unsigned long long>(slot >> 20), slots,
              xxh3, off, on, (off - on) / off * 100.0);
  return 0;
}
