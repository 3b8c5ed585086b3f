// Quantize-on-send on a GPU (engine/fp8_cuda.hpp, issue 44 item 3): the
// kernels give the host path's bits (quant_host.cpp) and the independent
// reference's (quant_ref.hpp), for random shapes with partial edge blocks,
// zero blocks, denormals, large magnitudes, three dtypes, both variants,
// pieces cut anywhere; a NaN is found; a sync of CUDA tensors through host
// slots and device slots arrives bit-exact in a consumer process. Each CUDA
// user is a forked child (the gtest process never initialises CUDA). Skips
// without a GPU or without the kernels (a build without nvcc).
//
// SHMCAST_FP8_BENCH=1 runs Fp8Gpu.Bench too (tests/gpu/fp8_device.sh):
// Qwen2.5-3B shapes on one GPU, BF16 against FP8 syncs.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "engine/fp8_cuda.hpp"
#include "engine/quant.hpp"
#include "gpu_support.hpp"
#include "quant_ref.hpp"
#include "shmcast/shmcast.hpp"

using namespace shmcast;
using namespace shmcast_test;
using namespace shmcast_gpu;
using namespace std::chrono_literals;
namespace q = shmcast::detail::quant;

namespace {

bool kernels_in_child() {
  static int cached = -1;
  if (cached < 0) {
    Child c = Child::spawn([] { return q::cuda_quantize_available(nullptr) ? 0 : 1; });
    cached = c.wait(60s) == 0 ? 1 : 0;
  }
  return cached == 1;
}

#define REQUIRE_FP8_KERNELS()                                                                   \
  do {                                                                                          \
    SHMCAST_REQUIRE_GPU();                                                                      \
    if (!kernels_in_child()) GTEST_SKIP() << "no FP8 kernels (built without nvcc, or no GPU)"; \
  } while (0)

// A [rows, cols] matrix of `dt` with blocks of very different magnitudes.
std::vector<std::byte> source(DType dt, std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const std::size_t es = dtype_size(dt);
  const std::int64_t bc = (cols + 127) / 128;
  std::vector<float> scale(static_cast<std::size_t>(((rows + 127) / 128) * bc));
  for (float& s : scale) {
    const int k = static_cast<int>(rng() % 5);
    s = k == 0 ? 0.0f
               : k == 1 ? (dt == DType::kF32 ? 1e-41f : dt == DType::kBF16 ? 1e-39f : 3e-7f)
                        : k == 2 ? (dt == DType::kF32 ? 1e30f : dt == DType::kBF16 ? 1e35f : 1e4f)
                                 : std::ldexp(1.0f, static_cast<int>(rng() % 24) - 20);
  }
  std::vector<std::byte> out(static_cast<std::size_t>(rows * cols) * es);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      const float x = normal(rng) * scale[(r / 128) * bc + c / 128];
      std::byte* p = out.data() + static_cast<std::size_t>(r * cols + c) * es;
      if (dt == DType::kF32) {
        std::memcpy(p, &x, 4);
      } else if (dt == DType::kBF16) {
        std::uint32_t b;
        std::memcpy(&b, &x, 4);
        const std::uint16_t h = static_cast<std::uint16_t>(b >> 16);
        std::memcpy(p, &h, 2);
      } else {
        const _Float16 h = static_cast<_Float16>(x);
        std::memcpy(p, &h, 2);
      }
    }
  return out;
}

int kernels_match_host() {
  const std::pair<std::int64_t, std::int64_t> shapes[] = {{1, 1}, {127, 129}, {300, 257}, {1000, 1100}, {0, 300},
                                                          {2048, 256}};
  std::mt19937_64 rng(11);
  q::CudaQuantizer gpu;
  int bad = 0;
  for (DType dt : {DType::kBF16, DType::kF16, DType::kF32})
    for (Quantize v : {Quantize::kFp8Block128, Quantize::kFp8Block128Ue8m0})
      for (auto [rows, cols] : shapes) {
        const std::vector<std::byte> host = source(dt, rows, cols, rng());
        DevBuf dev(host.size());
        dev.upload(host.data(), host.size());
        const std::uint64_t pitch = static_cast<std::uint64_t>(cols) * dtype_size(dt);
        q::Matrix hm{host.data(), dt, rows, cols, pitch}, dm{static_cast<const std::byte*>(dev.p), dt, rows, cols, pitch};
        q::Scales hs, ds;
        if (!q::block_scales(hm, v, &hs).empty() || !gpu.scales(dm, v, nullptr, &ds).empty()) return 20;
        const std::uint64_t n = static_cast<std::uint64_t>(rows * cols);
        std::vector<std::uint8_t> want(n);
        q::quantize_elems(reinterpret_cast<std::byte*>(want.data()), hm, hs, 0, n);
        DevBuf out(n);
        for (std::uint64_t at = 0; at < n;) {  // pieces cut anywhere, as chunks are
          const std::uint64_t len = std::min<std::uint64_t>(n - at, 1 + rng() % 300000);
          gpu.quantize(dm, static_cast<std::byte*>(out.p) + at, at, len, nullptr);
          at += len;
        }
        ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
        const std::vector<std::uint8_t> got = download(out.p, n);
        const quant_ref::Result ref = quant_ref::per_block(host.data(), dt, rows, cols, v == Quantize::kFp8Block128Ue8m0);
        if (got != want || got != ref.q || ds.scale_inv != hs.scale_inv || ds.scale_inv != ref.scale_inv ||
            ds.mult != hs.mult) {
          std::fprintf(stderr, "%s %s %lldx%lld: codes %lld, scales differ %d\n", std::string(dtype_name(dt)).c_str(),
                       std::string(quantize_name(v)).c_str(), static_cast<long long>(rows),
                       static_cast<long long>(cols), first_diff(got, want), ds.scale_inv != hs.scale_inv ? 1 : 0);
          ++bad;
        }
      }
  // Pitched sources (a row's bytes, then padding): rows whose 16-byte groups
  // load aligned (pitch a multiple of 16) and rows that do not.
  for (auto [rows, cols, pad] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{256, 512, 32},
                                 {300, 257, 6}, {129, 1024, 2}}) {
    const DType dt = DType::kBF16;
    const std::uint64_t row_bytes = static_cast<std::uint64_t>(cols) * 2, pitch = row_bytes + static_cast<std::uint64_t>(pad);
    const std::vector<std::byte> dense = source(dt, rows, cols, rng());
    std::vector<std::byte> host(static_cast<std::size_t>(pitch * static_cast<std::uint64_t>(rows)), std::byte{0x7f});
    for (std::int64_t r = 0; r < rows; ++r)
      std::memcpy(host.data() + static_cast<std::uint64_t>(r) * pitch, dense.data() + static_cast<std::uint64_t>(r) * row_bytes, row_bytes);
    DevBuf dev(host.size());
    dev.upload(host.data(), host.size());
    q::Matrix hm{host.data(), dt, rows, cols, pitch}, dm{static_cast<const std::byte*>(dev.p), dt, rows, cols, pitch};
    q::Scales hs, ds;
    if (!q::block_scales(hm, Quantize::kFp8Block128, &hs).empty() ||
        !gpu.scales(dm, Quantize::kFp8Block128, nullptr, &ds).empty())
      return 22;
    const std::uint64_t n = static_cast<std::uint64_t>(rows * cols);
    std::vector<std::uint8_t> want(n);
    q::quantize_elems(reinterpret_cast<std::byte*>(want.data()), hm, hs, 0, n);
    DevBuf out(n + 1);
    for (std::uint64_t at = 0; at < n;) {  // one byte off the allocation's alignment, pieces cut anywhere
      const std::uint64_t len = std::min<std::uint64_t>(n - at, 1 + rng() % 70000);
      gpu.quantize(dm, static_cast<std::byte*>(out.p) + 1 + at, at, len, nullptr);
      at += len;
    }
    ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    std::vector<std::uint8_t> got = download(out.p, n + 1);
    got.erase(got.begin());
    const quant_ref::Result ref = quant_ref::per_block(dense.data(), dt, rows, cols, false);
    if (got != want || got != ref.q || ds.scale_inv != ref.scale_inv) {
      std::fprintf(stderr, "pitched bf16 %lldx%lld (+%lld): codes %lld\n", static_cast<long long>(rows),
                   static_cast<long long>(cols), static_cast<long long>(pad), first_diff(got, want));
      ++bad;
    }
  }
  // A NaN is found, and where.
  std::vector<std::byte> host = source(DType::kBF16, 300, 300, 5);
  const std::uint16_t nan = 0x7fc0;
  std::memcpy(&host[(200 * 300 + 150) * 2], &nan, 2);
  DevBuf dev(host.size());
  dev.upload(host.data(), host.size());
  q::Scales s;
  const std::string why =
      gpu.scales(q::Matrix{static_cast<const std::byte*>(dev.p), DType::kBF16, 300, 300, 600}, Quantize::kFp8Block128,
                 nullptr, &s);
  if (why != "NaN or Inf in the block at rows [128, 256), columns [128, 256)") {
    std::fprintf(stderr, "NaN: '%s'\n", why.c_str());
    ++bad;
  }
  return bad == 0 ? 0 : 21;
}

}  // namespace

TEST(Fp8Gpu, KernelsGiveTheHostPathsBits) {
  REQUIRE_FP8_KERNELS();
  Child c = Child::spawn(kernels_match_host);
  EXPECT_EQ(c.wait(300s), 0);
}

namespace {

struct Tensor {
  TensorSpec spec;
  std::vector<std::byte> host;
};

std::vector<Tensor> sync_model(std::uint64_t seed) {
  std::vector<Tensor> m;
  auto add = [&](std::string name, DType dt, std::int64_t rows, std::int64_t cols) {
    Tensor t;
    t.spec.name = std::move(name);
    t.spec.dtype = dt;
    t.spec.shape = cols > 0 ? std::vector<std::int64_t>{rows, cols} : std::vector<std::int64_t>{rows};
    t.host = cols > 0 ? source(dt, rows, cols, seed++) : std::vector<std::byte>(static_cast<std::size_t>(rows) * 2);
    m.push_back(std::move(t));
  };
  add("model.layers.0.mlp.down_proj.weight", DType::kBF16, 2000, 1500);
  add("model.layers.0.input_layernorm.weight", DType::kBF16, 1500, 0);
  add("model.layers.0.self_attn.o_proj.weight", DType::kF32, 129, 300);
  // Small tensors, several to a chunk: their kernels are still queued while
  // the next ones' scales are made (each keeps its own multipliers).
  for (int i = 0; i < 12; ++i)
    add("model.layers." + std::to_string(1 + i) + ".self_attn.q_proj.weight", i % 3 == 0 ? DType::kF16 : DType::kBF16,
        128 + 37 * i, 256 + 3 * i);
  return m;
}

constexpr std::uint64_t kSeeds[] = {1, 1000};  // one sync each, in this order

// A producer child sends sync_model from CUDA tensors; a consumer child reads.
int produce(const std::string& name, SlotMemory slots) {
  ProducerOptions o;
  o.slot_bytes = 2ull << 20;
  o.slots = 2;
  o.engine = CopyEngine::kCuda;
  o.slot_memory = slots;
  o.quantize = Quantize::kFp8Block128;
  o.consumer_timeout = 60s;
  Producer p = Producer::create(name, o);
  // Host slots must be pinned for the kernel's path (cuda_fill.hpp) to be
  // the one tested: an unpinned region takes the staged path instead.
  if (slots == SlotMemory::kHost && !p.pinned()) return 35;
  p.wait_for_consumers(1, 60s);
  for (std::uint64_t seed : kSeeds) {
    const std::vector<Tensor> m = sync_model(seed);
    std::vector<DevBuf> dev;
    std::vector<TensorSpec> specs;
    std::vector<const void*> ptrs;
    for (const Tensor& t : m) {
      dev.emplace_back(t.host.size());
      dev.back().upload(t.host.data(), t.host.size());
      specs.push_back(t.spec);
      ptrs.push_back(dev.back().p);
    }
    if (seed == kSeeds[0]) {
      // The first sync's scales all at once before it begins (Python's send()
      // does this); and before it, a NaN in one tensor fails prepare_device()
      // with nothing announced: the consumer's next sync is this one.
      std::vector<std::byte> bad = m[3].host;
      const std::uint16_t nan = 0x7fc0;
      std::memcpy(bad.data() + 2 * (100 * 256 + 7), &nan, 2);  // row 100 of its 128 x 256 (f16: a NaN too)
      DevBuf badbuf(bad.size());
      badbuf.upload(bad.data(), bad.size());
      std::vector<const void*> with_nan = ptrs;
      with_nan[3] = badbuf.p;
      try {
        p.prepare_device(specs, with_nan, nullptr);
        return 40;
      } catch (const Error& e) {
        if (e.code() != Errc::kInvalidArgument || std::string(e.what()).find(m[3].spec.name) == std::string::npos ||
            std::string(e.what()).find("nothing was sent") == std::string::npos) {
          std::fprintf(stderr, "prepare_device: %s\n", e.what());
          return 41;
        }
      }
      // A source not aligned to its elements is refused before any kernel
      // reads it (a misaligned load would fault this CUDA context).
      std::vector<const void*> shifted = ptrs;
      shifted[0] = static_cast<const std::byte*>(dev[0].p) + 1;
      try {
        p.prepare_device(specs, shifted, nullptr);
        return 42;
      } catch (const Error& e) {
        if (e.code() != Errc::kInvalidArgument || std::string(e.what()).find("not aligned") == std::string::npos) {
          std::fprintf(stderr, "prepare_device, misaligned: %s\n", e.what());
          return 43;
        }
      }
      p.prepare_device(specs, ptrs, nullptr);
    }
    p.begin_sync(specs);
    for (std::size_t i = 0; i < m.size(); ++i) p.write_device(i, dev[i].p, nullptr);
    p.end_sync();
    p.wait_drained(60s);
  }
  return 0;
}

int consume(const std::string& name) {
  ConsumerOptions o;
  o.open_timeout = 60s;
  Consumer c = Consumer::open(name, o);
  std::uint64_t want = 0;
  for (std::uint64_t seed : kSeeds) {
    const SyncInfo& s = c.wait_sync(60s);
    if (s.version != ++want) return 34;  // the refused sync took no version
    const std::vector<Tensor> m = sync_model(seed);
    std::vector<std::vector<std::byte>> got;
    std::vector<void*> dsts;
    for (const TensorInfo& t : s.tensors) {
      got.emplace_back(t.nbytes);
      dsts.push_back(got.back().data());
    }
    c.read_into(dsts);
    std::size_t at = 0;
    for (const Tensor& t : m) {
      if (!default_quantize_filter(t.spec)) {
        if (got[at++] != t.host) return 30;
        continue;
      }
      const quant_ref::Result r =
          quant_ref::per_block(t.host.data(), t.spec.dtype, t.spec.shape[0], t.spec.shape[1], false);
      if (s.tensors[at].dtype != DType::kF8E4M3FN || std::memcmp(got[at].data(), r.q.data(), r.q.size()) != 0) {
        std::fprintf(stderr, "sync %llu: '%s' differs\n", static_cast<unsigned long long>(seed), t.spec.name.c_str());
        return 31;
      }
      if (std::memcmp(got[at + 1].data(), r.scale_inv.data(), r.scale_inv.size() * 4) != 0) return 32;
      at += 2;
    }
    if (at != s.tensors.size()) return 33;
  }
  return 0;
}

void sync_through(SlotMemory slots) {
  RegionDir dir("fp8gpu");
  const std::string name = unique_name("fp8gpu");
  RegionGuard guard{name};
  Child prod = Child::spawn([&] { return produce(name, slots); });
  Child cons = Child::spawn([&] { return consume(name); });
  EXPECT_EQ(cons.wait(180s), 0);
  EXPECT_EQ(prod.wait(180s), 0);
}

}  // namespace

TEST(Fp8Gpu, CudaTensorsThroughHostSlotsBitExact) {
  REQUIRE_FP8_KERNELS();
  sync_through(SlotMemory::kHost);
}

TEST(Fp8Gpu, CudaTensorsThroughDeviceSlotsBitExact) {
  REQUIRE_FP8_KERNELS();
  sync_through(SlotMemory::kDevice);
}
