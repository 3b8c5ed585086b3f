// Quantize-on-send's figures on one GPU (issue 44 item 5; run by
// tests/gpu/fp8_device.sh with SHMCAST_FP8_BENCH=1, skipped otherwise):
// Qwen2.5-3B shapes (36 layers, hidden 2048, intermediate 11008, 2 KV heads
// of 128, tied 151936 x 2048 embedding), the trainer's tensors in bf16 on
// the GPU, one consumer process reading into its own GPU buffers. For BF16
// and FP8 syncs through host slots and device slots: the bytes through the
// region and the sync time (begin_sync until every slot was released,
// SHMCAST_FP8_BENCH_REPS reps after one warm-up: min / median / max); and
// the quantize kernels' rate against a D2D copy of the same bf16 bytes.
// One line per figure: "FP8BENCH {json}".
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <random>
#include <string>

#include "engine/fp8_cuda.hpp"
#include "gpu_support.hpp"
#include "shmcast/shmcast.hpp"

using namespace shmcast;
using namespace shmcast_test;
using namespace shmcast_gpu;
using namespace std::chrono_literals;
namespace q = shmcast::detail::quant;

namespace {

int reps() {
  const char* e = std::getenv("SHMCAST_FP8_BENCH_REPS");
  return e ? std::max(1, std::atoi(e)) : 10;
}

std::vector<TensorSpec> qwen25_3b() {
  std::vector<TensorSpec> m;
  auto add = [&](std::string n, std::vector<std::int64_t> s) { m.push_back(TensorSpec{std::move(n), DType::kBF16, std::move(s)}); };
  add("model.embed_tokens.weight", {151936, 2048});
  for (int l = 0; l < 36; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", {2048});
    add(p + "self_attn.q_proj.weight", {2048, 2048});
    add(p + "self_attn.q_proj.bias", {2048});
    add(p + "self_attn.k_proj.weight", {256, 2048});
    add(p + "self_attn.k_proj.bias", {256});
    add(p + "self_attn.v_proj.weight", {256, 2048});
    add(p + "self_attn.v_proj.bias", {256});
    add(p + "self_attn.o_proj.weight", {2048, 2048});
    add(p + "post_attention_layernorm.weight", {2048});
    add(p + "mlp.gate_proj.weight", {11008, 2048});
    add(p + "mlp.up_proj.weight", {11008, 2048});
    add(p + "mlp.down_proj.weight", {2048, 11008});
  }
  add("model.norm.weight", {2048});
  return m;
}

// bf16 values ~N(0, 0.02) in a 64 MiB pattern, copied over each tensor.
void fill(const std::vector<DevBuf>& bufs) {
  std::vector<std::uint16_t> pat(32u << 20);
  std::mt19937_64 rng(3);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  for (auto& h : pat) {
    const float x = normal(rng);
    std::uint32_t b;
    std::memcpy(&b, &x, 4);
    h = static_cast<std::uint16_t>(b >> 16);
  }
  for (const DevBuf& b : bufs)
    for (std::size_t at = 0; at < b.n; at += pat.size() * 2)
      ck(cudaMemcpy(static_cast<char*>(b.p) + at, pat.data(), std::min(b.n - at, pat.size() * 2), cudaMemcpyHostToDevice),
         "cudaMemcpy");
}

std::string stats(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  char s[160];
  std::snprintf(s, sizeof s, "\"min_s\": %.4f, \"median_s\": %.4f, \"max_s\": %.4f, \"reps\": %zu", v.front(),
                v[v.size() / 2], v.back(), v.size());
  return s;
}

int produce(const std::string& name, Quantize quant, SlotMemory slots) {
  ProducerOptions o;
  o.engine = CopyEngine::kCuda;
  o.slot_memory = slots;
  o.quantize = quant;
  o.consumer_timeout = 120s;
  Producer p = Producer::create(name, o);
  const std::vector<TensorSpec> specs = qwen25_3b();
  std::vector<DevBuf> bufs;
  for (const TensorSpec& t : specs) bufs.emplace_back(t.nbytes());
  fill(bufs);
  p.wait_for_consumers(1, 120s);
  std::vector<double> times;
  SyncReport r{};
  std::vector<const void*> ptrs;
  for (const DevBuf& b : bufs) ptrs.push_back(b.p);
  const char* fp8_staged = std::getenv("SHMCAST_FP8_STAGED");
  const bool prepare = fp8_staged == nullptr || std::string(fp8_staged) != "1";
  for (int i = 0; i <= reps(); ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    // As Python's send() of CUDA tensors: every scale before the sync (the
    // staged path, as before there was prepare_device(), makes its own).
    if (prepare) p.prepare_device(specs, ptrs, nullptr);
    p.begin_sync(specs);
    for (std::size_t k = 0; k < specs.size(); ++k) p.write_device(k, bufs[k].p, nullptr);
    p.end_sync();
    p.wait_drained(120s);
    if (i > 0) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    r = p.last_sync();
  }
  // SHMCAST_FP8_STAGED=1: the FP8 syncs quantize into a staging room and copy
  // (the path before the kernel wrote the slots), for a comparison in one run.
  const char* staged = std::getenv("SHMCAST_FP8_STAGED");
  std::printf("FP8BENCH {\"what\": \"sync\", \"quantize\": \"%s\", \"path\": \"%s\", \"slots\": \"%s\", "
              "\"logical_bytes\": %llu, \"payload_bytes\": %llu, %s}\n",
              std::string(quantize_name(quant)).c_str(),
              quant == Quantize::kNone ? "copy" : (staged != nullptr && std::string(staged) == "1" ? "staged" : "direct"),
              slots == SlotMemory::kDevice ? "device" : "host",
              static_cast<unsigned long long>(r.logical_bytes), static_cast<unsigned long long>(r.payload_bytes),
              stats(times).c_str());
  std::fflush(stdout);
  return 0;
}

int consume(const std::string& name) {
  ConsumerOptions o;
  o.open_timeout = 120s;
  o.chunk_timeout = 120s;
  Consumer c = Consumer::open(name, o);
  std::vector<DevBuf> dst;
  for (int i = 0; i <= reps(); ++i) {
    const SyncInfo& s = c.wait_sync(300s);
    if (dst.empty())
      for (const TensorInfo& t : s.tensors) dst.emplace_back(t.nbytes);
    std::vector<void*> ptrs;
    for (const DevBuf& b : dst) ptrs.push_back(b.p);
    c.read_into_device(ptrs, nullptr);
    ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  return 0;
}

int kernel_rate() {
  const std::int64_t rows = 11008, cols = 2048;  // gate_proj
  const std::uint64_t bytes = static_cast<std::uint64_t>(rows * cols) * 2;
  std::vector<DevBuf> src;
  src.emplace_back(bytes);
  fill(src);
  DevBuf copy(bytes), out(static_cast<std::size_t>(rows * cols));
  q::CudaQuantizer gpu;
  const q::Matrix m{static_cast<const std::byte*>(src[0].p), DType::kBF16, rows, cols, static_cast<std::uint64_t>(cols) * 2};
  std::vector<double> tq, tc;
  for (int i = 0; i <= 2 * reps(); ++i) {
    q::Scales s;
    auto t0 = std::chrono::steady_clock::now();
    (void)gpu.scales(m, Quantize::kFp8Block128, nullptr, &s);
    gpu.quantize(m, static_cast<std::byte*>(out.p), 0, static_cast<std::uint64_t>(rows * cols), nullptr);
    ck(cudaDeviceSynchronize(), "sync");
    auto t1 = std::chrono::steady_clock::now();
    ck(cudaMemcpy(copy.p, src[0].p, bytes, cudaMemcpyDeviceToDevice), "D2D");
    ck(cudaDeviceSynchronize(), "sync");
    auto t2 = std::chrono::steady_clock::now();
    if (i > 0) {
      tq.push_back(std::chrono::duration<double>(t1 - t0).count());
      tc.push_back(std::chrono::duration<double>(t2 - t1).count());
    }
  }
  std::sort(tq.begin(), tq.end());
  std::sort(tc.begin(), tc.end());
  std::printf("FP8BENCH {\"what\": \"kernel\", \"tensor\": \"[11008, 2048] bf16\", \"bf16_bytes\": %llu, "
              "\"quantize_GBps_median\": %.1f, \"d2d_copy_GBps_median\": %.1f, \"quantize\": {%s}, \"d2d\": {%s}}\n",
              static_cast<unsigned long long>(bytes), bytes / tq[tq.size() / 2] / 1e9, bytes / tc[tc.size() / 2] / 1e9,
              stats(tq).c_str(), stats(tc).c_str());
  std::fflush(stdout);
  return 0;
}

}  // namespace

TEST(Fp8Gpu, Bench) {
  if (std::getenv("SHMCAST_FP8_BENCH") == nullptr) GTEST_SKIP() << "set SHMCAST_FP8_BENCH=1 (tests/gpu/fp8_device.sh)";
  SHMCAST_REQUIRE_GPU();
  {
    Child k = Child::spawn(kernel_rate);
    EXPECT_EQ(k.wait(600s), 0);
  }
  // BF16, FP8 with the kernel writing the slots, FP8 through a staging room.
  for (SlotMemory slots : {SlotMemory::kHost, SlotMemory::kDevice})
    for (int which : {0, 1, 2}) {
      const Quantize quant = which == 0 ? Quantize::kNone : Quantize::kFp8Block128;
      RegionDir dir("fp8bench");
      const std::string name = unique_name("fp8bench");
      RegionGuard guard{name};
      Child prod = Child::spawn([&] {
        if (which == 2) ::setenv("SHMCAST_FP8_STAGED", "1", 1);  // read once, in this child
        return produce(name, quant, slots);
      });
      Child cons = Child::spawn([&] { return consume(name); });
      EXPECT_EQ(prod.wait(600s), 0);
      EXPECT_EQ(cons.wait(600s), 0);
    }
}
