// The multiprocess transfers' shared roles: test_transfer.cpp, and
// test_shared_consumer.cpp (tests whose consumer has two threads over the
// library's state: TSan builds that binary, not test_multiprocess).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "support.hpp"

namespace transfer_test {

using namespace shmcast;
using namespace shmcast_test;
using namespace std::chrono_literals;

// These children move and check every byte of several random syncs: CPU
// volume that a loaded machine (tests at nice 10 beside stress-ng) stretches
// past Child::wait's 30 s. Every wait inside the library keeps its own
// deadline; this one only bounds the work.
inline constexpr std::chrono::seconds kBulkWait{120};

inline constexpr std::uint64_t kSlot = 2ull << 20;

inline ProducerOptions small_opts(std::uint32_t slots = 2) {
  ProducerOptions o;
  o.slot_bytes = kSlot;
  o.slots = slots;
  o.max_consumers = 4;
  o.pin = Pin::kNo;
  o.consumer_timeout = 20s;
  return o;
}

// Producer side: send `syncs` syncs of random manifests with patterned data.
inline int run_producer(const std::string& name, int syncs, std::uint32_t consumers, std::uint64_t seed, int count,
                 std::uint32_t slots = 2) {
  Producer p = Producer::create(name, small_opts(slots));
  p.wait_for_consumers(consumers, 20s);
  for (int s = 0; s < syncs; ++s) {
    auto specs = random_manifest(seed + s, kSlot, count);
    std::vector<std::vector<std::uint8_t>> data(specs.size());
    std::vector<const void*> ptrs;
    const std::uint64_t version = static_cast<std::uint64_t>(s) + 1;
    for (std::size_t i = 0; i < specs.size(); ++i) {
      data[i].resize(specs[i].nbytes());
      fill_pattern(data[i].data(), data[i].size(), seed_of(version, i));
      ptrs.push_back(data[i].data());
    }
    if (p.send(specs, ptrs) != version) return 3;
  }
  p.wait_drained(20s);
  return 0;
}

}  // namespace transfer_test
