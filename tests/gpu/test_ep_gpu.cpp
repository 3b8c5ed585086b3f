// GPU tier: expert-parallel ranks on one GPU (issue 43, Wanted 4), the GPU
// twin of ManyTensors.ExpertParallelRanksMixedWithTpAndReplicatedInOneSync.
// Two producer ranks on the same GPU: rank r owns experts [r*E/2, (r+1)*E/2)
// of every layer as whole tensors, written from its device memory; in the
// same sync a column-parallel matrix (cut along dim 0) and a row-parallel one
// (cut along dim 1: each rank's piece lands strided in the whole tensor) are
// TP-sliced across both ranks, and rank 0 alone sends a replicated norm. A
// consumer on the GPU reads every tensor into device memory (sync 1, 3), then
// a subset by name (sync 2: experts 5 and 69, one of each rank, in every
// layer, and the TP tensors; the rest nullptr), and checks every byte by
// name; destinations it did not ask for keep their sentinel. Skips without a
// GPU.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "gpu_support.hpp"

using namespace shmcast;
using namespace shmcast_test;
using namespace shmcast_gpu;
using namespace std::chrono_literals;

namespace {

constexpr int kRanks = 2, kExperts = 128, kLayers = 4;
constexpr std::uint64_t kSyncs = 3;
constexpr std::uint8_t kSentinel = 0xEE;

std::string expert(int l, int e, int m) {
  return "model.layers." + std::to_string(l) + ".mlp.experts." + std::to_string(e) + ".w" + std::to_string(m);
}

// The whole tensor `name` of `n` bytes at `version`.
std::vector<std::uint8_t> whole(const std::string& name, std::uint64_t n, std::uint64_t version) {
  return pattern(static_cast<std::size_t>(n), seed_of(version, std::hash<std::string>{}(name) % 100000));
}

// The TP tensors: {name, dtype, rows, cols, dim cut}.
struct Tp {
  const char* name;
  DType dt;
  std::int64_t rows, cols;
  int dim;
};
constexpr Tp kTp[] = {{"model.attn.q", DType::kBF16, 256, 512, 0}, {"model.attn.o", DType::kF32, 192, 320, 1}};

// Rank r's part of a TP tensor: its shard spec and its contiguous bytes.
std::pair<TensorSpec, std::vector<std::uint8_t>> tp_part(const Tp& t, int r, std::uint64_t version) {
  const std::size_t z = dtype_size(t.dt);
  const std::int64_t extent = t.dim == 0 ? t.rows : t.cols, len = extent / kRanks, start = len * r;
  TensorSpec s{t.name, t.dt, {t.rows, t.cols}};
  s.shard_dim = t.dim;
  s.shard_start = start;
  s.shard_length = len;
  const auto all = whole(t.name, static_cast<std::uint64_t>(t.rows * t.cols) * z, version);
  const std::size_t row = static_cast<std::size_t>(t.cols) * z;
  std::vector<std::uint8_t> mine;
  if (t.dim == 0) {
    mine.assign(all.begin() + static_cast<std::ptrdiff_t>(start * row),
                all.begin() + static_cast<std::ptrdiff_t>((start + len) * row));
  } else {
    for (std::int64_t y = 0; y < t.rows; ++y) {
      const auto a = all.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(y) * row + start * z);
      mine.insert(mine.end(), a, a + len * static_cast<std::ptrdiff_t>(z));
    }
  }
  return {s, mine};
}

int run_rank(const std::string& name, int r) {
  ProducerOptions o;
  o.slot_bytes = 1ull << 20;  // many chunks: pieces of both ranks cross slot boundaries
  o.slots = 2 * kRanks;
  o.max_consumers = 2;
  o.pin = Pin::kYes;
  o.world_size = kRanks;
  o.rank = static_cast<std::uint32_t>(r);
  o.consumer_timeout = 60s;
  o.rank_timeout = 60s;
  Producer p = Producer::create(name, o);
  if (!p.pinned()) return 20;
  if (r == 0) p.wait_for_consumers(1, 60s);
  cudaStream_t stream = nullptr;
  ck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  for (std::uint64_t v = 1; v <= kSyncs; ++v) {
    std::vector<TensorSpec> specs;
    std::vector<std::vector<std::uint8_t>> host;
    for (int l = 0; l < kLayers; ++l)
      for (int e = r * kExperts / kRanks; e < (r + 1) * kExperts / kRanks; ++e)
        for (int m = 0; m < 3; ++m) {
          // gate/up [48, 64], down [64, 48], bf16: 6 KiB each.
          specs.push_back({expert(l, e, m), DType::kBF16, m == 1 ? std::vector<std::int64_t>{64, 48}
                                                                 : std::vector<std::int64_t>{48, 64}});
          host.push_back(whole(specs.back().name, specs.back().nbytes(), v));
        }
    for (const Tp& t : kTp) {
      auto [s, bytes] = tp_part(t, r, v);
      specs.push_back(s);
      host.push_back(std::move(bytes));
    }
    if (r == 0) {
      specs.push_back({"model.norm", DType::kF32, {2048}});
      host.push_back(whole("model.norm", 8192, v));
    }
    // One device buffer holds the rank's tensors (256-byte aligned offsets).
    std::vector<std::size_t> off;
    std::size_t total = 0;
    for (const auto& h : host) {
      off.push_back(total);
      total += (h.size() + 255) / 256 * 256;
    }
    DevBuf dev(total);
    for (std::size_t i = 0; i < host.size(); ++i)
      ck(cudaMemcpy(static_cast<std::uint8_t*>(dev.p) + off[i], host[i].data(), host[i].size(), cudaMemcpyHostToDevice),
         "cudaMemcpy H2D");
    ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    if (p.begin_sync(specs, v) != v) return 21;
    for (std::size_t i = 0; i < specs.size(); ++i) p.write_device(i, static_cast<std::uint8_t*>(dev.p) + off[i], stream);
    p.end_sync();
  }
  if (r == 0) p.wait_drained(60s);
  cudaStreamDestroy(stream);
  return 0;
}

int run_consumer(const std::string& name) {
  ConsumerOptions co;
  co.pin = Pin::kYes;
  co.open_timeout = 60s;
  co.chunk_timeout = 60s;
  Consumer c = Consumer::open(name, co);
  if (!c.pinned()) return 30;
  cudaStream_t stream = nullptr;
  ck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  constexpr std::size_t kWant = std::size_t{kLayers} * kExperts * 3 + 3;
  for (std::uint64_t v = 1; v <= kSyncs; ++v) {
    const SyncInfo& s = c.wait_sync(60s);
    if (s.version != v) {
      std::fprintf(stderr, "got version %llu, want %llu\n", (unsigned long long)s.version, (unsigned long long)v);
      return 31;
    }
    if (s.tensors.size() != kWant) {
      std::fprintf(stderr, "sync %llu has %zu tensors, want %zu\n", (unsigned long long)v, s.tensors.size(), kWant);
      return 32;
    }
    std::vector<std::size_t> off;
    std::size_t total = 0;
    for (const auto& t : s.tensors) {
      off.push_back(total);
      total += (t.nbytes + 255) / 256 * 256;
    }
    DevBuf dst(total);
    ck(cudaMemset(dst.p, kSentinel, total), "cudaMemset");
    ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    std::vector<void*> ptrs(s.tensors.size(), nullptr);
    std::size_t asked = 0;
    for (std::size_t i = 0; i < s.tensors.size(); ++i) {
      const std::string& n = s.tensors[i].name;
      if (v == 2 && n.find(".experts.5.") == std::string::npos && n.find(".experts.69.") == std::string::npos &&
          n.rfind("model.attn.", 0) != 0)
        continue;
      ptrs[i] = static_cast<std::uint8_t*>(dst.p) + off[i];
      ++asked;
    }
    c.read_into_device(ptrs, stream);
    ck(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    const auto got = download(dst.p, total);
    for (std::size_t i = 0; i < s.tensors.size(); ++i) {
      const auto& t = s.tensors[i];
      const std::vector<std::uint8_t> have(got.begin() + static_cast<std::ptrdiff_t>(off[i]),
                                           got.begin() + static_cast<std::ptrdiff_t>(off[i] + t.nbytes));
      const std::vector<std::uint8_t> want =
          ptrs[i] ? whole(t.name, t.nbytes, v) : std::vector<std::uint8_t>(t.nbytes, kSentinel);
      const long long d = first_diff(want, have);
      if (d >= 0) {
        std::fprintf(stderr, "sync %llu %s (%s, %llu bytes) differs at byte %lld\n", (unsigned long long)v,
                     t.name.c_str(), ptrs[i] ? "read" : "not asked for", (unsigned long long)t.nbytes, d);
        return 33;
      }
    }
    const std::size_t want_asked = v == 2 ? std::size_t{kLayers} * 2 * 3 + 2 : kWant;
    if (asked != want_asked) {
      std::fprintf(stderr, "sync %llu: asked for %zu tensors, want %zu\n", (unsigned long long)v, asked, want_asked);
      return 34;
    }
  }
  cudaStreamDestroy(stream);
  return 0;
}

}  // namespace

TEST(GpuExpertParallel, TwoRanksOnOneGpuMixedWithTpAndReplicatedBitExact) {
  SHMCAST_REQUIRE_GPU();
  const std::string name = unique_name("gpuep");
  RegionGuard guard{name};
  Child cons = Child::spawn([&] { return run_consumer(name); });
  Child r1 = Child::spawn([&] { return run_rank(name, 1); });
  Child r0 = Child::spawn([&] { return run_rank(name, 0); });
  EXPECT_EQ(r0.wait(180s), 0);
  EXPECT_EQ(r1.wait(180s), 0);
  EXPECT_EQ(cons.wait(180s), 0);
}
