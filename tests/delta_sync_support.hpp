// Delta syncs' tests (tests/multiprocess/test_delta_sync.cpp, the GPU
// tier's test_delta_sync_gpu.cpp): weights that change between versions
// the same way in every process, and a consumer's kept destinations.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "shmcast/shmcast.hpp"
#include "support.hpp"

namespace delta_sync_test {

using namespace shmcast;

// Weights that change between versions: each version changes a random
// 0.5-30 % of each tensor's elements (a fixed fraction per version and
// tensor), at random positions, to random other bits. Deterministic in the
// version, so a consumer process computes what it must receive.
struct Model {
  std::vector<TensorSpec> specs;
  std::vector<std::vector<std::uint8_t>> data;

  explicit Model(bool big, std::int64_t extra_rows = 0) {
    const std::int64_t rows = big ? 2048 : 256;
    specs = {
        {"layer.0.w", DType::kBF16, {rows, 1500}},
        {"layer.0.norm", DType::kF32, {300, 333}},
        {"fp8.scale", DType::kF8E4M3FN, {5000}},
        {"steps", DType::kI64, {1000}},
        {"rotary", DType::kC128, {10}},
        {"empty", DType::kBF16, {0, 4}},
        {"layer.1.w", DType::kF16, {rows / 2, 777}},
    };
    if (extra_rows > 0) specs.push_back({"embed", DType::kBF16, {extra_rows, 2048}});
    for (const TensorSpec& s : specs) {
      data.emplace_back(s.nbytes());
      shmcast_test::fill_pattern(data.back().data(), data.back().size(), 0x5eed + data.size());
    }
  }
  // The content of version v from that of v - 1.
  void step(std::uint64_t v, double max_fraction = 0.30, double min_fraction = 0.005) {
    for (std::size_t i = 0; i < specs.size(); ++i) {
      const std::size_t z = dtype_size(specs[i].dtype);
      // Each version's fractions as these tests have always drawn them; the
      // positions from a faster stream.
      const double f = min_fraction + (max_fraction - min_fraction) *
                                          static_cast<double>(std::mt19937_64(v * 7919 + i)() % 10001) / 10000.0;
      shmcast_test::SplitMix rng{v * 7919 + i};
      shmcast_test::change_elements(data[i].data(), data[i].size(), z, f, rng);
    }
  }
  // Every element changed (deltas cannot pay).
  void step_all(std::uint64_t v) {
    for (auto& d : data)
      for (std::size_t b = 0; b < d.size(); ++b) d[b] = static_cast<std::uint8_t>(~d[b] ^ (v + b));
  }
  std::vector<const void*> ptrs() const {
    std::vector<const void*> p;
    for (const auto& d : data) p.push_back(d.data());
    return p;
  }
  std::uint64_t bytes() const {
    std::uint64_t n = 0;
    for (const auto& d : data) n += d.size();
    return n;
  }
};

// A consumer's destinations for a Model, kept across syncs.
struct Dsts {
  std::vector<std::vector<std::uint8_t>> buf;
  std::vector<void*> ptrs;
  explicit Dsts(const Model& m) {
    for (const auto& d : m.data) buf.emplace_back(d.size());
    for (auto& b : buf) ptrs.push_back(b.data());
  }
  bool equals(const Model& m) const { return buf == m.data; }
};

}  // namespace delta_sync_test
