// Multi-process transfers: real forked producer and consumer processes that
// share nothing but the region name.
#include <gtest/gtest.h>

#include "support.hpp"

using namespace shmcast;
using namespace shmcast_test;
using namespace std::chrono_literals;

namespace {

constexpr std::uint64_t kSlot = 2ull << 20;

ProducerOptions small_opts(std::uint32_t slots = 2) {
  ProducerOptions o;
  o.slot_bytes = kSlot;
  o.slots = slots;
  o.max_consumers = 4;
  o.pin = Pin::kNo;
  o.consumer_timeout = 20s;
  return o;
}

// Producer side: send `syncs` syncs of random manifests with patterned data.
int run_producer(const std::string& name, int syncs, std::uint32_t consumers, std::uint64_t seed, int count,
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

// Consumer side: receive `syncs` syncs and check every byte.
int run_consumer(const std::string& name, int syncs, std::uint64_t seed, int count, bool use_visit) {
  ConsumerOptions co;
  co.pin = Pin::kNo;
  Consumer c = Consumer::open(name, co);
  for (int s = 0; s < syncs; ++s) {
    const SyncInfo& info = c.wait_sync(20s);
    auto specs = random_manifest(seed + s, kSlot, count);
    if (info.tensors.size() != specs.size()) return 10;
    std::vector<std::vector<std::uint8_t>> got(specs.size());
    std::vector<void*> dst;
    for (std::size_t i = 0; i < specs.size(); ++i) {
      if (info.tensors[i].name != specs[i].name || info.tensors[i].nbytes != specs[i].nbytes() ||
          info.tensors[i].shape != specs[i].shape || info.tensors[i].dtype != specs[i].dtype)
        return 11;
      got[i].assign(specs[i].nbytes(), 0xEE);
      dst.push_back(got[i].data());
    }
    if (use_visit) {
      c.visit([&](const Piece& p) {
        if (p.bytes > 0) std::memcpy(got[p.tensor].data() + p.offset, p.data, p.bytes);  // zero-size: data is null
      });
    } else {
      c.read_into(dst);
    }
    for (std::size_t i = 0; i < specs.size(); ++i) {
      std::vector<std::uint8_t> want(specs[i].nbytes());
      fill_pattern(want.data(), want.size(), seed_of(info.version, i));
      if (want != got[i]) {
        std::fprintf(stderr, "sync %llu tensor %zu (%s) differs\n", (unsigned long long)info.version, i,
                     specs[i].name.c_str());
        return 12;
      }
    }
  }
  return 0;
}

}  // namespace

TEST(Transfer, OneConsumerRandomManifestsBitExact) {
  const std::string name = unique_name("one");
  RegionGuard g{name};
  Child prod = Child::spawn([&] { return run_producer(name, 5, 1, 42, 40); });
  Child cons = Child::spawn([&] { return run_consumer(name, 5, 42, 40, false); });
  EXPECT_EQ(cons.wait(), 0);
  EXPECT_EQ(prod.wait(), 0);
}

TEST(Transfer, ThreeConsumersBitExact) {
  const std::string name = unique_name("three");
  RegionGuard g{name};
  Child prod = Child::spawn([&] { return run_producer(name, 4, 3, 7, 30); });
  Child c1 = Child::spawn([&] { return run_consumer(name, 4, 7, 30, false); });
  Child c2 = Child::spawn([&] { return run_consumer(name, 4, 7, 30, true); });
  Child c3 = Child::spawn([&] { return run_consumer(name, 4, 7, 30, false); });
  EXPECT_EQ(c1.wait(), 0);
  EXPECT_EQ(c2.wait(), 0);
  EXPECT_EQ(c3.wait(), 0);
  EXPECT_EQ(prod.wait(), 0);
}
