// shmcast-per-tensor-bench: the cost of a tensor (issue 43, Wanted 2). The
// same bytes as `--tensors` tensors of `--tensor-bytes` and as `--dense`
// tensors, alternating in one run (host slots, host engine, CPU memory), a
// producer thread and a consumer thread of one process:
//   producer: begin_sync -> write each -> end_sync
//   consumer: wait_sync -> read_into
// Prints min/median/max of each side and case, and the per-tensor cost:
// (median many - median dense) / (tensors - dense), per side. Every byte the
// consumer reads is checked after its timer stops. The consumer's timer
// starts before the producer begins, so its figure holds the producer's
// time too; --consumer-after starts it once end_sync has returned (the
// sync must fit in the slots): the consumer's own cost.
//
//   shmcast-per-tensor-bench [--tensors 100000] [--tensor-bytes 4096] [--dense 16] [--reps 10]
//                            [--consumer-after] [--json FILE]
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <thread>
#include <unistd.h>
#include <vector>

#include "shmcast/shmcast.hpp"

using namespace std::chrono_literals;

namespace {

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Case {
  std::vector<shmcast::TensorSpec> specs;
  std::vector<const void*> src;
  std::vector<void*> dst;
};

// `n` tensors that split `bytes` of src/dst evenly (the last takes the rest).
Case make_case(std::uint32_t n, std::uint64_t bytes, std::uint8_t* src, std::uint8_t* dst) {
  Case c;
  const std::uint64_t each = bytes / n;
  for (std::uint32_t i = 0; i < n; ++i) {
    const std::uint64_t len = i + 1 == n ? bytes - each * i : each;
    c.specs.push_back({"model.layers." + std::to_string(i / 384) + ".mlp.experts." + std::to_string(i / 3 % 128) +
                           ".w" + std::to_string(i % 3) + ".weight",
                       shmcast::DType::kU8, {static_cast<std::int64_t>(len)}});
    c.src.push_back(src + each * i);
    c.dst.push_back(dst + each * i);
  }
  return c;
}

struct Stats {
  double min, median, max;
};
Stats stats(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v.front(), v[v.size() / 2], v.back()};
}

}  // namespace

int main(int argc, char** argv) {
  std::uint32_t tensors = 100000, dense = 16;
  std::uint64_t tensor_bytes = 4096;
  int reps = 10;
  std::string json_path;
  bool consumer_after = false;
  CLI::App app{"shmcast-per-tensor-bench: per-tensor cost of a sync, many tensors vs the same bytes in a few"};
  app.add_option("--tensors", tensors, "tensors of the many case (default 100000)");
  app.add_option("--tensor-bytes", tensor_bytes, "bytes of each (default 4096)");
  app.add_option("--dense", dense, "tensors of the dense case, same bytes (default 16)");
  app.add_option("--reps", reps, "syncs of each case (default 10)");
  app.add_option("--json", json_path, "write the results here too");
  app.add_flag("--consumer-after", consumer_after,
               "start the consumer's timer once the producer's end_sync returned (the sync must fit in the slots)");
  CLI11_PARSE(app, argc, argv);
  if (tensors <= dense || dense == 0 || reps < 1 || tensor_bytes == 0) {
    std::fprintf(stderr, "need --tensors > --dense > 0, --reps >= 1, --tensor-bytes > 0\n");
    return 2;
  }
  const std::uint64_t bytes = std::uint64_t{tensors} * tensor_bytes;
  std::vector<std::uint8_t> src(bytes), dst(bytes);
  Case cases[2] = {make_case(dense, bytes, src.data(), dst.data()), make_case(tensors, bytes, src.data(), dst.data())};

  const std::string region = "per-tensor-bench-" + std::to_string(::getpid());
  shmcast::ProducerOptions po;  // default slots and manifest_bytes
  po.pin = shmcast::Pin::kNo;
  po.engine = shmcast::CopyEngine::kHost;
  shmcast::Producer p = shmcast::Producer::create(region, po);
  std::atomic<int> turn{0};  // sync k may start when turn == 2k (consumer ready), done when 2k+1
  std::atomic<int> sent{0};  // syncs whose end_sync returned
  std::vector<double> cons_s[2];
  std::atomic<int> bad{0};
  std::thread consumer([&] {
    shmcast::ConsumerOptions co;
    co.pin = shmcast::Pin::kNo;
    shmcast::Consumer c = shmcast::Consumer::open(region, co);
    for (int k = 0; k < 2 * reps; ++k) {
      const int which = k % 2;
      std::memset(dst.data(), 0, dst.size());
      turn.store(2 * k + 1, std::memory_order_release);
      if (consumer_after)
        while (sent.load(std::memory_order_acquire) != k + 1) std::this_thread::yield();
      const std::int64_t t0 = now_ns();
      c.wait_sync(120s);
      c.read_into(cases[which].dst);
      cons_s[which].push_back(static_cast<double>(now_ns() - t0) * 1e-9);
      if (std::memcmp(dst.data(), src.data(), bytes) != 0) bad.fetch_add(1);
      turn.store(2 * k + 2, std::memory_order_release);
    }
  });
  p.wait_for_consumers(1, 60s);
  std::vector<double> prod_s[2];
  for (int k = 0; k < 2 * reps; ++k) {
    const int which = k % 2;
    for (std::uint64_t i = 0; i < bytes; i += 4096) src[i] = static_cast<std::uint8_t>(k * 31 + i / 4096);
    while (turn.load(std::memory_order_acquire) != 2 * k + 1) std::this_thread::yield();
    std::this_thread::sleep_for(2ms);  // the consumer is inside wait_sync
    const Case& c = cases[which];
    const std::int64_t t0 = now_ns();
    p.begin_sync(c.specs);
    for (std::size_t i = 0; i < c.specs.size(); ++i) p.write(i, c.src[i]);
    p.end_sync();
    prod_s[which].push_back(static_cast<double>(now_ns() - t0) * 1e-9);
    sent.store(k + 1, std::memory_order_release);
    while (turn.load(std::memory_order_acquire) != 2 * k + 2) std::this_thread::yield();
  }
  consumer.join();
  p.close();

  nlohmann::json out;
  out["tensors"] = tensors;
  out["tensor_bytes"] = tensor_bytes;
  out["dense"] = dense;
  out["reps"] = reps;
  out["consumer_after"] = consumer_after;
  out["bad_syncs"] = bad.load();
  std::printf("%u x %llu B vs %u tensors of the same %.1f MB, %d reps each, alternating (s: min / median / max)\n",
              tensors, static_cast<unsigned long long>(tensor_bytes), dense, static_cast<double>(bytes) * 1e-6, reps);
  const char* side_names[2] = {"producer begin_sync->end_sync", "consumer wait_sync->read_into"};
  for (int side = 0; side < 2; ++side) {
    const std::vector<double>* s = side == 0 ? prod_s : cons_s;
    const Stats d = stats(s[0]), m = stats(s[1]);
    const double per_us = (m.median - d.median) / static_cast<double>(tensors - dense) * 1e6;
    std::printf("  %-32s dense %.4f / %.4f / %.4f   many %.4f / %.4f / %.4f   per tensor %.3f us\n", side_names[side],
                d.min, d.median, d.max, m.min, m.median, m.max, per_us);
    nlohmann::json j;
    j["dense_s"] = {d.min, d.median, d.max};
    j["many_s"] = {m.min, m.median, m.max};
    j["per_tensor_us"] = per_us;
    out[side == 0 ? "producer" : "consumer"] = j;
  }
  if (bad.load() != 0) std::printf("  %d syncs read WRONG bytes\n", bad.load());
  if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
  return bad.load() == 0 ? 0 : 1;
}
