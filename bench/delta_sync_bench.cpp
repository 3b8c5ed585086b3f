// shmcast-delta-sync-bench: full and delta syncs of Qwen2.5-3B shapes (bf16,
// 434 tensors, 6.17 GB) between two processes on one GPU: the trainer
// (write_device from its tensors) and the engine (read_into_device into its
// own). Needs a GPU and the CUDA build.
//
//   shmcast-delta-sync-bench                                   # 10 reps, 2 % changed, sweep 0.5-50 %
//   shmcast-delta-sync-bench --reps 10 --fraction 0.02 --sweep 0.005,0.02,0.1,0.2,0.3,0.5 --json out.json
//   shmcast-delta-sync-bench --phases full,delta --manifests qwen3-30b-a3b:8,qwen3-30b-a3b-dense:8
//                            # a MoE model's first 8 layers against the same bytes in dense tensors
//
// Phases, each with its own region and its own pair of processes:
//   full     ProducerOptions::delta off: every sync moves every byte
//   delta    delta on, --fraction of the elements changed before each sync
//   sweep    delta on with delta_max_ratio 1 (deltas forced), at each
//            --sweep fraction: where deltas stop paying (break-even)
//   auto     delta on with the default delta_max_ratio (0.4), at each --sweep
//            fraction: which kind the producer picks on its own
// Before every sync the trainer changes about that fraction of each
// tensor's elements (random positions and values, a kernel, outside the
// timer), and the engine applies the same change to a reference copy after
// the sync and compares every byte (verified n/n; a mismatch fails the run).
// The first sync of each phase (a full one) is a warm-up, not timed.
//
// Per phase, min/median/max over --reps: sync time (trainer's begin_sync to
// the engine's read_into_device done and its stream synchronized; both
// processes read CLOCK_MONOTONIC), the trainer's time (begin to end_sync),
// payload/logical bytes; when the sync was announced (the engine's
// wait_sync returned; a delta sync is announced once planned), from the
// trainer's begin_sync; and the trainer's GPU memory for deltas (its base
// and codec buffers: cuMemGetInfo before and after the first sync). The
// ceilings come from the same run: a device-to-device copy of 1 GiB and the
// host path's concurrent D2H + H2D (shmcast-bench's measure_ceilings).
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "bench.hpp"
#include "cuda_kernels.hpp"
#include "gpu_ceilings.hpp"
#include "shmcast/shmcast.hpp"

namespace {

using json = nlohmann::json;
using namespace std::chrono_literals;
using bench::gpu::ceilings;
using bench::gpu::command_line;
using bench::gpu::ck;
using bench::gpu::fmt_stat;
using bench::gpu::mono_s;
using bench::gpu::stat;

struct Phase {
  std::string label;
  bool delta = false;
  double ratio = 0.5;  // delta_max_ratio
  double fraction = 0.02;
  std::string manifest = "qwen2.5-3b";  // bench::manifest_by_name
};

struct Args {
  int reps = 10;
  std::uint64_t slot_bytes = 256ull << 20;
  std::uint32_t slots = 2;
  std::string dir;
};

std::uint64_t key_of(int rep) { return 0x5eedull * 1000003ull + static_cast<std::uint64_t>(rep); }

// The trainer: creates the region, then for each rep changes its tensors,
// waits for the engine's "ready" byte, and syncs.
int producer(const Phase& ph, const Args& a, const std::string& region, int ready_fd) {
  json out;
  try {
    const auto specs = bench::manifest_by_name(ph.manifest);
    ck(cudaSetDevice(0), "cudaSetDevice");
    std::vector<void*> src(specs.size());
    cudaStream_t s = nullptr;
    ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    for (std::size_t i = 0; i < specs.size(); ++i) {
      ck(cudaMalloc(&src[i], specs[i].nbytes()), "cudaMalloc");
      ck(bench::kernels::fill(src[i], specs[i].nbytes(), 1000 + i, s), "fill");
    }
    ck(cudaStreamSynchronize(s), "sync");
    shmcast::ProducerOptions o;
    o.slot_bytes = a.slot_bytes;
    o.slots = a.slots;
    o.pin = shmcast::Pin::kYes;
    o.engine = shmcast::CopyEngine::kCuda;
    o.delta = ph.delta;
    o.delta_max_ratio = ph.ratio;
    o.consumer_timeout = 120s;
    shmcast::Producer p = shmcast::Producer::create(region, o);
    p.wait_for_consumers(1, 120s);
    std::size_t free0 = 0, free1 = 0, total = 0;
    ck(cudaMemGetInfo(&free0, &total), "cudaMemGetInfo");
    json reps = json::array();
    for (int r = 0; r <= a.reps; ++r) {
      if (r > 0) {
        for (std::size_t i = 0; i < specs.size(); ++i)
          ck(bench::kernels::mutate_u16(src[i], specs[i].nbytes(), ph.fraction, key_of(r) * 7919 + i, s), "mutate");
        ck(cudaStreamSynchronize(s), "sync");
      }
      char b;
      if (::read(ready_fd, &b, 1) != 1) throw std::runtime_error("the engine is gone");
      const double t0 = mono_s();
      p.begin_sync(specs);
      for (std::size_t i = 0; i < specs.size(); ++i) p.write_device(i, src[i], s);
      p.end_sync();
      const double t1 = mono_s();
      if (r == 0) ck(cudaMemGetInfo(&free1, &total), "cudaMemGetInfo");
      const shmcast::SyncReport rep = p.last_sync();
      reps.push_back({{"rep", r}, {"t0", t0}, {"t1", t1}, {"delta", rep.delta}, {"logical", rep.logical_bytes},
                      {"payload", rep.payload_bytes}});
    }
    p.wait_drained(120s);
    out["reps"] = reps;
    out["base_bytes"] = p.delta_base_bytes();
    out["gpu_bytes_first_sync"] = static_cast<double>(free0) - static_cast<double>(free1);
  } catch (const std::exception& e) {
    out["error"] = std::string("trainer: ") + e.what();
  }
  std::ofstream(a.dir + "/producer.json") << out.dump();
  return out.contains("error") ? 1 : 0;
}

// The engine: opens the region, and for each rep says "ready", receives,
// then checks every byte against its reference copy.
int consumer(const Phase& ph, const Args& a, const std::string& region, int ready_fd) {
  json out;
  try {
    const auto specs = bench::manifest_by_name(ph.manifest);
    ck(cudaSetDevice(0), "cudaSetDevice");
    cudaStream_t s = nullptr;
    ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    std::vector<void*> dst(specs.size()), ref(specs.size());
    for (std::size_t i = 0; i < specs.size(); ++i) {
      ck(cudaMalloc(&dst[i], specs[i].nbytes()), "cudaMalloc");
      ck(cudaMalloc(&ref[i], specs[i].nbytes()), "cudaMalloc");
      ck(bench::kernels::fill(ref[i], specs[i].nbytes(), 1000 + i, s), "fill");
    }
    unsigned long long* bad = nullptr;
    ck(cudaMalloc(reinterpret_cast<void**>(&bad), sizeof *bad), "cudaMalloc");
    shmcast::ConsumerOptions o;
    o.pin = shmcast::Pin::kYes;
    o.open_timeout = 120s;
    o.chunk_timeout = 120s;
    shmcast::Consumer c = shmcast::Consumer::open(region, o);
    json reps = json::array();
    int verified = 0;
    for (int r = 0; r <= a.reps; ++r) {
      const char b = 'r';
      if (::write(ready_fd, &b, 1) != 1) throw std::runtime_error("the trainer is gone");
      const shmcast::SyncInfo& info = c.wait_sync(120s);
      const double t_ann = mono_s();
      c.read_into_device(dst, s);
      ck(cudaStreamSynchronize(s), "sync");
      const double t2 = mono_s();
      const bool delta = info.delta();
      // The reference takes the same change; then every byte is compared.
      if (r > 0)
        for (std::size_t i = 0; i < specs.size(); ++i)
          ck(bench::kernels::mutate_u16(ref[i], specs[i].nbytes(), ph.fraction, key_of(r) * 7919 + i, s), "mutate");
      ck(cudaMemsetAsync(bad, 0, sizeof *bad, s), "memset");
      for (std::size_t i = 0; i < specs.size(); ++i)
        ck(bench::kernels::count_diff(dst[i], ref[i], specs[i].nbytes(), bad, s), "count_diff");
      unsigned long long nbad = 0;
      ck(cudaMemcpyAsync(&nbad, bad, sizeof nbad, cudaMemcpyDeviceToHost, s), "D2H");
      ck(cudaStreamSynchronize(s), "sync");
      if (nbad == 0) ++verified;
      reps.push_back({{"rep", r}, {"t_announced", t_ann}, {"t_done", t2}, {"delta", delta},
                      {"bad_words", nbad}});
    }
    out["reps"] = reps;
    out["verified"] = verified;
  } catch (const std::exception& e) {
    out["error"] = std::string("engine: ") + e.what();
  }
  std::ofstream(a.dir + "/consumer.json") << out.dump();
  return out.contains("error") ? 1 : 0;
}

json load(const std::string& path) {
  std::ifstream f(path);
  if (!f) return json{{"error", "no result file " + path}};
  try {
    return json::parse(f);
  } catch (const std::exception& e) {
    return json{{"error", std::string("bad result file: ") + e.what()}};
  }
}

json run_phase(const Phase& ph, const Args& a, int index) {
  const std::string region = "delta-sync-bench-" + std::to_string(::getpid()) + "-" + std::to_string(index);
  int pipefd[2];
  if (::pipe(pipefd) != 0) return json{{"label", ph.label}, {"error", "pipe failed"}};
  const pid_t cons = ::fork();
  if (cons == 0) {
    ::close(pipefd[0]);
    ::_exit(consumer(ph, a, region, pipefd[1]));
  }
  const pid_t prod = ::fork();
  if (prod == 0) {
    ::close(pipefd[1]);
    ::_exit(producer(ph, a, region, pipefd[0]));
  }
  ::close(pipefd[0]);
  ::close(pipefd[1]);
  int st = 0;
  ::waitpid(prod, &st, 0);
  ::waitpid(cons, &st, 0);
  shmcast::unlink_region(region);
  const json p = load(a.dir + "/producer.json"), c = load(a.dir + "/consumer.json");
  json r{{"label", ph.label}, {"delta", ph.delta}, {"delta_max_ratio", ph.ratio}, {"fraction", ph.fraction},
         {"manifest", ph.manifest}};
  if (p.contains("error") || c.contains("error")) {
    r["error"] = p.value("error", "") + " " + c.value("error", "");
    return r;
  }
  std::vector<double> sync_s, prod_s, ratio, announced_s;
  int deltas = 0, timed = 0;
  double logical = 0;
  for (int i = 1; i <= a.reps; ++i) {
    const json& pr = p["reps"][i];
    const json& cr = c["reps"][i];
    sync_s.push_back(cr["t_done"].get<double>() - pr["t0"].get<double>());
    prod_s.push_back(pr["t1"].get<double>() - pr["t0"].get<double>());
    announced_s.push_back(cr["t_announced"].get<double>() - pr["t0"].get<double>());
    logical = pr["logical"].get<double>();
    ratio.push_back(pr["payload"].get<double>() / logical);
    deltas += pr["delta"].get<bool>() ? 1 : 0;
    ++timed;
  }
  r["sync_s"] = stat(sync_s);
  r["producer_s"] = stat(prod_s);
  r["announced_s"] = stat(announced_s);
  r["payload_ratio"] = stat(ratio);
  r["logical_bytes"] = logical;
  r["delta_syncs"] = deltas;
  r["timed_syncs"] = timed;
  r["verified"] = c["verified"];
  r["verified_of"] = a.reps + 1;
  r["base_bytes"] = p["base_bytes"];
  r["gpu_bytes_first_sync"] = p["gpu_bytes_first_sync"];
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"shmcast-delta-sync-bench: full and delta syncs of a model's tensors (Qwen2.5-3B by default), trainer "
               "and engine on one GPU"};
  Args a;
  double fraction = 0.02;
  std::vector<double> sweep = {0.005, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5};
  std::string json_path;
  int ceiling_reps = 10;
  std::vector<std::string> manifests = {"qwen2.5-3b"};
  std::vector<std::string> phase_names = {"full", "delta", "sweep", "auto"};
  app.add_option("--reps", a.reps, "timed syncs per phase (after one warm-up)")->check(CLI::Range(1, 1000));
  app.add_option("--fraction", fraction, "changed elements per sync in the full and delta phases");
  app.add_option("--sweep", sweep, "fractions of the sweep and auto phases")->delimiter(',');
  app.add_option("--slot-bytes", a.slot_bytes, "slot size");
  app.add_option("--manifests", manifests,
                 "tensor sets, each phase runs once per set in this order (qwen2.5-3b, qwen3-30b-a3b[:layers], "
                 "qwen3-30b-a3b-dense[:layers]); with two, the first's sync time over the second's per phase")
      ->delimiter(',');
  app.add_option("--phases", phase_names, "phases to run: full, delta, sweep, auto")
      ->delimiter(',')
      ->check(CLI::IsMember({"full", "delta", "sweep", "auto"}));
  app.add_option("--json", json_path, "also write the results as JSON here");
  app.add_option("--ceiling-reps", ceiling_reps, "repetitions of each ceiling");
  CLI11_PARSE(app, argc, argv);
  char tmpl[] = "/tmp/shmcast-dsb-XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) return 2;
  a.dir = tmpl;

  json out;
  out["command"] = command_line(argc, argv);
  out["reps"] = a.reps;
  out["slot_bytes"] = a.slot_bytes;
  out["slots"] = a.slots;
  std::printf("shmcast-delta-sync-bench: trainer and engine on GPU 0, %d timed syncs per phase\n", a.reps);
  json mjson = json::array();
  try {
    for (const auto& m : bench::manifest_sizes(manifests))
      mjson.push_back({{"name", m.name}, {"tensors", m.tensors}, {"bytes", m.bytes}});
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shmcast-delta-sync-bench: %s\n", e.what());
    ::rmdir(a.dir.c_str());
    return 2;
  }
  out["manifests"] = mjson;
  const json ceil = ceilings(1ull << 30, ceiling_reps);
  out["d2d_gbps"] = ceil.value("d2d_gbps", json{{"error", ceil.value("error", "")}});
  out["host_both_gbps"] = ceil.value("host_both_gbps", json{{"error", ceil.value("error", "")}});
  std::printf("ceiling: device-to-device copy of 1 GiB, GB/s: %s\n", fmt_stat(out["d2d_gbps"], 1, "%.0f").c_str());
  std::printf("ceiling: host path, a D2H and an H2D of 1 GiB at once, GB/s per direction: %s\n",
              fmt_stat(out["host_both_gbps"], 1, "%.1f").c_str());

  const double dflt = shmcast::ProducerOptions{}.delta_max_ratio;
  out["default_delta_max_ratio"] = dflt;
  std::vector<Phase> phases;
  for (const std::string& n : phase_names)
    for (const std::string& m : manifests) {
      if (n == "full") phases.push_back({"full", false, dflt, fraction, m});
      if (n == "delta") phases.push_back({"delta", true, dflt, fraction, m});
      if (n == "sweep")
        for (double f : sweep) phases.push_back({"sweep", true, 1.0, f, m});
      if (n == "auto")
        for (double f : sweep) phases.push_back({"auto", true, dflt, f, m});
    }
  json results = json::array();
  int failures = 0;
  std::printf("%-6s %8s %22s %22s %20s %7s %10s  %s\n", "phase", "changed", "sync ms med (min..max)",
              "trainer ms", "payload/logical", "deltas", "verified", "manifest");
  for (std::size_t i = 0; i < phases.size(); ++i) {
    json r = run_phase(phases[i], a, static_cast<int>(i));
    if (r.contains("error")) {
      std::printf("%-6s %7.1f%%  error: %s\n", phases[i].label.c_str(), 100 * phases[i].fraction,
                  r["error"].get<std::string>().c_str());
      ++failures;
    } else {
      std::printf("%-6s %7.1f%% %22s %22s %20s %3d/%-3d %4d/%-4d  %s\n", phases[i].label.c_str(),
                  100 * phases[i].fraction, fmt_stat(r["sync_s"], 1e3, "%.1f").c_str(),
                  fmt_stat(r["producer_s"], 1e3, "%.1f").c_str(), fmt_stat(r["payload_ratio"], 1, "%.3f").c_str(),
                  r["delta_syncs"].get<int>(), r["timed_syncs"].get<int>(), r["verified"].get<int>(),
                  r["verified_of"].get<int>(), phases[i].manifest.c_str());
      if (r["verified"].get<int>() != r["verified_of"].get<int>()) ++failures;
      if (phases[i].label == "delta" || phases[i].label == "full")
        std::printf("       sync announced (the engine's wait_sync returned) after the trainer's begin_sync, ms: %s\n",
                    fmt_stat(r["announced_s"], 1e3, "%.1f").c_str());
      if (phases[i].label == "delta")
        std::printf("       trainer's delta base %.2f GB; GPU memory taken by the first sync %.2f GB\n",
                    r["base_bytes"].get<double>() / 1e9, r["gpu_bytes_first_sync"].get<double>() / 1e9);
    }
    std::fflush(stdout);
    results.push_back(r);
  }
  out["phases"] = results;
  // Delta over full sync time at --fraction, in this run.
  auto med = [&](const char* label, const std::string& m) {
    for (const json& r : results)
      if (r["label"] == label && r["manifest"] == m && r.contains("sync_s") && r["sync_s"].contains("median"))
        return r["sync_s"]["median"].get<double>();
    return 0.0;
  };
  const double full_ms = med("full", manifests.front()), delta_ms = med("delta", manifests.front());
  if (full_ms > 0 && delta_ms > 0) {
    out["delta_over_full"] = delta_ms / full_ms;
    std::printf("delta / full sync time at %.1f %% changed (medians): %.3f\n", 100 * fraction, delta_ms / full_ms);
  }
  // The first manifest's throughput over the second's (same bytes: the
  // second's sync time over the first's), per phase.
  if (manifests.size() >= 2)
    for (const char* label : {"full", "delta"}) {
      const double x = med(label, manifests[0]), y = med(label, manifests[1]);
      if (x <= 0 || y <= 0) continue;
      out[std::string(label) + "_first_over_second_manifest"] = y / x;
      std::printf("%s at %.1f %%: %s over %s, GB/s (medians): %.3f\n", label, 100 * fraction, manifests[0].c_str(),
                  manifests[1].c_str(), y / x);
    }
  if (!json_path.empty()) std::ofstream(json_path) << out.dump(2);
  return failures == 0 ? 0 : 1;
}
