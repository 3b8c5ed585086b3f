// shmcast-device-slots-bench: full syncs of Qwen2.5-3B shapes (bf16, 434
// tensors, 6.17 GB; --manifests names others, e.g. qwen3-30b-a3b:8,qwen3-30b-a3b-dense:8
// for a MoE model's first 8 layers against the same bytes in dense tensors) from a trainer process to one or two engine processes on
// the same GPU, through host slots (pinned region file: D2H then H2D) against
// device slots (ProducerOptions::slot_memory = SlotMemory::kDevice: the slots
// are GPU memory of the producer's GPU, shared over the region's fd channel;
// both copies are device-to-device). Needs a GPU and the CUDA build.
//
//   shmcast-device-slots-bench                                  # every phase, 10 reps
//   shmcast-device-slots-bench --phases device,host --reps 20 --slot-mib 256 --slots 2 --json out.json
//
// Phases, each with its own region and its own processes (CUDA engine, ring
// region of one rank, no checksums, no deltas):
//   host         host slots, 1 engine
//   device       device slots, 1 engine
//   fanout       device slots, --fanout-engines engines (2)
//   fanout-host  host slots, --fanout-engines engines (2)
// Before every sync the trainer fills each tensor with that sync's bytes (a
// kernel: a function of the phase, the sync and the tensor); every engine
// wipes its destinations before the sync and, once every engine has
// received it, checks every byte against the same function (verified n/n;
// any mismatch fails the run). None of this runs during a timed sync. The first sync of each phase is a
// warm-up, not timed.
//
// Per phase, min/median/max over --reps: sync time (the trainer's
// begin_sync to the last engine's read_into_device done and its stream
// synchronized; every process reads CLOCK_MONOTONIC), GB/s (the logical
// bytes of one sync, which every engine receives whole, over the sync
// time), the trainer's time (begin to end_sync). The GPU memory device
// slots cost: cudaMemGetInfo's free memory before and after the trainer's
// Producer::create (the engines have their buffers by then and nothing else
// allocates meanwhile) next to Producer::slot_device_bytes(); and the free
// memory the engines' Consumer::open took, seen by the trainer between its
// create and the engines' first "ready" (importing maps the producer's
// memory; their contexts exist before). The ceilings come from the same
// run (gpu_ceilings.hpp): a device-to-device copy of 1 GiB, and the host
// path's concurrent D2H + H2D of 1 GiB.
#include <cuda_runtime_api.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <new>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench.hpp"
#include "cuda_kernels.hpp"
#include "gpu_ceilings.hpp"
#include "shmcast/shmcast.hpp"

namespace {

using json = nlohmann::json;
using bench::gpu::ck;
using bench::gpu::command_line;
using bench::gpu::fmt_stat;
using bench::gpu::mono_s;
using bench::gpu::stat;

struct Phase {
  std::string label;
  bool device = false;  // device slots
  int engines = 1;
  std::string manifest = "qwen2.5-3b";  // bench::manifest_by_name
};

struct Args {
  int reps = 10;
  std::uint64_t slot_bytes = 256ull << 20;
  std::uint32_t slots = 2;
  int timeout_s = 120;
  std::string dir;
};

// The bytes of tensor i in sync r of phase p (cuda_kernels.hpp: fill / count_bad).
std::uint64_t key_of(int phase, int rep, std::size_t i) {
  return 0xd5107000000000ull + static_cast<std::uint64_t>(phase) * 1000000000ull +
         static_cast<std::uint64_t>(rep) * 100000ull + i;
}

std::string role_file(const Args& a, const std::string& role) { return a.dir + "/" + role + ".json"; }

// Reads n bytes from fd (one per engine); false when an engine is gone.
bool read_n(int fd, int n) {
  for (char b; n > 0; --n)
    if (::read(fd, &b, 1) != 1) return false;
  return true;
}

// The trainer: waits until the engines have their buffers, creates the
// region (measuring the GPU memory that takes), then for each sync waits
// for every engine's "ready" byte, fills its tensors, and syncs.
int producer(const Phase& ph, int index, const Args& a, const std::string& region, int ready_fd) {
  json out;
  try {
    const auto specs = bench::manifest_by_name(ph.manifest);
    ck(cudaSetDevice(0), "cudaSetDevice");
    cudaStream_t s = nullptr;
    ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    std::vector<void*> src(specs.size());
    for (std::size_t i = 0; i < specs.size(); ++i) ck(cudaMalloc(&src[i], specs[i].nbytes()), "cudaMalloc");
    if (!read_n(ready_fd, ph.engines)) throw std::runtime_error("an engine is gone before the region exists");
    std::size_t free0 = 0, free1 = 0, free2 = 0, total = 0;
    ck(cudaDeviceSynchronize(), "sync");
    ck(cudaMemGetInfo(&free0, &total), "cudaMemGetInfo");
    shmcast::ProducerOptions o;
    o.slot_bytes = a.slot_bytes;
    o.slots = a.slots;
    o.pin = shmcast::Pin::kYes;
    o.engine = shmcast::CopyEngine::kCuda;
    o.consumer_timeout = std::chrono::seconds(a.timeout_s);
    if (ph.device) {
      o.slot_memory = shmcast::SlotMemory::kDevice;
      o.slot_device = 0;
    }
    const double tc = mono_s();
    shmcast::Producer p = shmcast::Producer::create(region, o);
    const double create_s = mono_s() - tc;
    ck(cudaMemGetInfo(&free1, &total), "cudaMemGetInfo");
    const bool got_device = p.slot_memory() == shmcast::SlotMemory::kDevice;
    if (got_device != ph.device)
      throw std::runtime_error(std::string("the region has ") + (got_device ? "device" : "host") + " slots");
    p.wait_for_consumers(static_cast<std::uint32_t>(ph.engines), std::chrono::seconds(a.timeout_s));
    json reps = json::array();
    for (int r = 0; r <= a.reps; ++r) {
      // After every engine is ready (done checking the last sync), so that
      // nothing else runs on the GPU during the timed sync.
      if (!read_n(ready_fd, ph.engines)) throw std::runtime_error("an engine is gone");
      if (r == 0) ck(cudaMemGetInfo(&free2, &total), "cudaMemGetInfo");  // the engines have opened the region
      for (std::size_t i = 0; i < specs.size(); ++i)
        ck(bench::kernels::fill(src[i], specs[i].nbytes(), key_of(index, r, i), s), "fill");
      ck(cudaStreamSynchronize(s), "sync");
      const double t0 = mono_s();
      p.begin_sync(specs);
      for (std::size_t i = 0; i < specs.size(); ++i) p.write_device(i, src[i], s);
      p.end_sync();
      const double t1 = mono_s();
      const shmcast::SyncReport rep = p.last_sync();
      reps.push_back({{"rep", r}, {"t0", t0}, {"t1", t1}, {"logical", rep.logical_bytes},
                      {"payload", rep.payload_bytes}});
    }
    p.wait_drained(std::chrono::seconds(a.timeout_s));
    out["reps"] = reps;
    out["slot_memory"] = got_device ? "device" : "host";
    out["slot_device"] = p.slot_device();
    out["slot_device_bytes"] = p.slot_device_bytes();
    out["gpu_bytes_create"] = static_cast<double>(free0) - static_cast<double>(free1);
    out["gpu_bytes_engines_open"] = static_cast<double>(free1) - static_cast<double>(free2);
    out["gpu_total_bytes"] = total;
    out["region_bytes"] = p.region_bytes();
    out["slot_bytes"] = p.slot_bytes();
    out["slots"] = p.slots();
    out["pinned"] = p.pinned();
    out["create_s"] = create_s;
  } catch (const std::exception& e) {
    out["error"] = std::string("trainer: ") + e.what();
  }
  std::ofstream(role_file(a, "producer")) << out.dump();
  return out.contains("error") ? 1 : 0;
}

// Engine e: allocates its destinations, says so, opens the region, and for
// each sync wipes its destinations, says "ready", receives, and checks every
// byte once every engine has received (done[r], shared by the engines: a
// check would slow down another engine's receive).
int consumer(const Phase& ph, int index, int e, const Args& a, const std::string& region, int ready_fd,
             std::atomic<int>* done) {
  json out;
  const std::string who = "engine " + std::to_string(e) + ": ";
  try {
    const auto specs = bench::manifest_by_name(ph.manifest);
    ck(cudaSetDevice(0), "cudaSetDevice");
    cudaStream_t s = nullptr;
    ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    std::vector<void*> dst(specs.size());
    for (std::size_t i = 0; i < specs.size(); ++i) ck(cudaMalloc(&dst[i], specs[i].nbytes()), "cudaMalloc");
    unsigned long long* bad = nullptr;
    ck(cudaMalloc(reinterpret_cast<void**>(&bad), sizeof *bad), "cudaMalloc");
    ck(cudaDeviceSynchronize(), "sync");
    const char alloc = 'a';
    if (::write(ready_fd, &alloc, 1) != 1) throw std::runtime_error("the trainer is gone");
    shmcast::ConsumerOptions o;
    o.pin = shmcast::Pin::kYes;
    o.open_timeout = std::chrono::seconds(a.timeout_s);
    o.chunk_timeout = std::chrono::seconds(a.timeout_s);
    if (ph.device) o.device = 0;
    shmcast::Consumer c = shmcast::Consumer::open(region, o);
    const bool got_device = c.slot_memory() == shmcast::SlotMemory::kDevice;
    if (got_device != ph.device)
      throw std::runtime_error(std::string("the region has ") + (got_device ? "device" : "host") + " slots");
    json reps = json::array();
    int verified = 0;
    for (int r = 0; r <= a.reps; ++r) {
      for (std::size_t i = 0; i < specs.size(); ++i)
        ck(cudaMemsetAsync(dst[i], 0xa5, specs[i].nbytes(), s), "memset");
      ck(cudaStreamSynchronize(s), "sync");
      const char b = 'r';
      if (::write(ready_fd, &b, 1) != 1) throw std::runtime_error("the trainer is gone");
      c.wait_sync(std::chrono::seconds(a.timeout_s));
      const double t_ann = mono_s();
      c.read_into_device(dst, s);
      ck(cudaStreamSynchronize(s), "sync");
      const double t2 = mono_s();
      done[r].fetch_add(1);
      for (const double until = t2 + a.timeout_s; done[r].load() < ph.engines;) {
        if (mono_s() > until) throw std::runtime_error("another engine did not finish sync " + std::to_string(r));
        ::usleep(50);
      }
      ck(cudaMemsetAsync(bad, 0, sizeof *bad, s), "memset");
      for (std::size_t i = 0; i < specs.size(); ++i)
        ck(bench::kernels::count_bad(dst[i], specs[i].nbytes(), key_of(index, r, i), bad, s), "count_bad");
      unsigned long long nbad = 0;
      ck(cudaMemcpyAsync(&nbad, bad, sizeof nbad, cudaMemcpyDeviceToHost, s), "D2H");
      ck(cudaStreamSynchronize(s), "sync");
      if (nbad == 0) ++verified;
      reps.push_back({{"rep", r}, {"t_announced", t_ann}, {"t_done", t2}, {"bad_words", nbad}});
    }
    out["reps"] = reps;
    out["verified"] = verified;
  } catch (const std::exception& ex) {
    out["error"] = who + ex.what();
  }
  std::ofstream(role_file(a, "engine" + std::to_string(e))) << out.dump();
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

void remove_role_files(const Args& a) {
  for (const char* f : {"producer", "engine0", "engine1", "engine2", "engine3"}) ::unlink(role_file(a, f).c_str());
}

json run_phase(const Phase& ph, const Args& a, int index) {
  const std::string region = "device-slots-bench-" + std::to_string(::getpid()) + "-" + std::to_string(index);
  json r{{"label", ph.label}, {"slot_memory", ph.device ? "device" : "host"}, {"engines", ph.engines},
         {"manifest", ph.manifest}};
  remove_role_files(a);
  int pipefd[2];
  if (::pipe(pipefd) != 0) {
    r["error"] = "pipe failed";
    return r;
  }
  // done[rep]: engines that received sync rep (shared with the engines).
  const std::size_t done_bytes = sizeof(std::atomic<int>) * static_cast<std::size_t>(a.reps + 1);
  void* shared = ::mmap(nullptr, done_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (shared == MAP_FAILED) {
    ::close(pipefd[0]);
    ::close(pipefd[1]);
    r["error"] = "mmap failed";
    return r;
  }
  auto* done = static_cast<std::atomic<int>*>(shared);
  for (int i = 0; i <= a.reps; ++i) new (&done[i]) std::atomic<int>(0);
  std::vector<pid_t> pids;
  for (int e = 0; e < ph.engines; ++e) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(pipefd[0]);
      ::_exit(consumer(ph, index, e, a, region, pipefd[1], done));
    }
    pids.push_back(pid);
  }
  const pid_t prod = ::fork();
  if (prod == 0) {
    ::close(pipefd[1]);
    ::_exit(producer(ph, index, a, region, pipefd[0]));
  }
  pids.push_back(prod);
  ::close(pipefd[0]);
  ::close(pipefd[1]);
  for (pid_t pid : pids) {
    int st = 0;
    ::waitpid(pid, &st, 0);
  }
  ::munmap(shared, done_bytes);
  shmcast::unlink_region(region);
  const json p = load(role_file(a, "producer"));
  std::vector<json> c;
  std::string errors = p.value("error", "");
  for (int e = 0; e < ph.engines; ++e) {
    c.push_back(load(role_file(a, "engine" + std::to_string(e))));
    if (c.back().contains("error")) errors += (errors.empty() ? "" : "; ") + c.back()["error"].get<std::string>();
  }
  if (!errors.empty()) {
    r["error"] = errors;
    return r;
  }
  std::vector<double> sync_s, prod_s, gbps;
  std::vector<std::vector<double>> engine_s(static_cast<std::size_t>(ph.engines));
  double logical = 0;
  for (int i = 1; i <= a.reps; ++i) {
    const json& pr = p["reps"][i];
    const double t0 = pr["t0"].get<double>();
    double last = t0;
    for (int e = 0; e < ph.engines; ++e) {
      const double done = c[static_cast<std::size_t>(e)]["reps"][i]["t_done"].get<double>();
      engine_s[static_cast<std::size_t>(e)].push_back(done - t0);
      last = std::max(last, done);
    }
    logical = pr["logical"].get<double>();
    sync_s.push_back(last - t0);
    gbps.push_back(logical / (last - t0) / 1e9);
    prod_s.push_back(pr["t1"].get<double>() - t0);
  }
  int verified = 0;
  json per_engine = json::array();
  for (int e = 0; e < ph.engines; ++e) {
    const json& ce = c[static_cast<std::size_t>(e)];
    verified += ce["verified"].get<int>();
    json bad = json::array();  // the words each sync got wrong, warm-up first
    for (const json& cr : ce["reps"]) bad.push_back(cr["bad_words"]);
    per_engine.push_back({{"sync_s", stat(engine_s[static_cast<std::size_t>(e)])},
                          {"verified", ce["verified"]},
                          {"bad_words_each", bad}});
  }
  r["sync_s"] = stat(sync_s);
  r["sync_s_each"] = sync_s;  // in rep order
  r["gbps"] = stat(gbps);
  r["producer_s"] = stat(prod_s);
  r["logical_bytes"] = logical;
  r["timed_syncs"] = a.reps;
  r["verified"] = verified;
  r["verified_of"] = (a.reps + 1) * ph.engines;
  r["per_engine"] = per_engine;
  for (const char* k : {"slot_device", "slot_device_bytes", "gpu_bytes_create", "gpu_bytes_engines_open", "gpu_total_bytes", "region_bytes",
                        "slot_bytes", "slots", "pinned", "create_s"})
    r[k] = p[k];
  return r;
}

double median_of(const json& r, const char* key) {
  if (!r.contains(key) || !r[key].contains("median")) return 0;
  return r[key]["median"].get<double>();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"shmcast-device-slots-bench: syncs of a model's tensors (Qwen2.5-3B by default) through host slots and device slots, trainer and "
               "engines on one GPU"};
  Args a;
  std::uint64_t slot_mib = 256;
  int fanout_engines = 2;
  std::vector<std::string> phase_names = {"host", "device", "fanout", "fanout-host"};
  std::vector<std::string> manifests = {"qwen2.5-3b"};
  std::string json_path;
  int ceiling_reps = 10;
  app.add_option("--reps", a.reps, "timed syncs per phase (after one warm-up)")->check(CLI::Range(1, 1000));
  app.add_option("--phases", phase_names, "phases to run, in this order: host, device, fanout, fanout-host")
      ->delimiter(',')
      ->check(CLI::IsMember({"host", "device", "fanout", "fanout-host"}));
  app.add_option("--manifests", manifests,
                 "tensor sets, each phase runs once per set in this order (qwen2.5-3b, qwen3-30b-a3b[:layers], "
                 "qwen3-30b-a3b-dense[:layers]); with two, the first's GB/s over the second's per phase")
      ->delimiter(',');
  app.add_option("--slot-mib", slot_mib, "slot size S in MiB")->check(CLI::Range(2, 1 << 20));
  app.add_option("--slots", a.slots, "slot count K")->check(CLI::Range(2, 64));
  app.add_option("--fanout-engines", fanout_engines, "engine processes of the fanout phases")
      ->check(CLI::Range(2, 4));
  app.add_option("--timeout", a.timeout_s, "seconds any one wait may take (open, sync, slot)")
      ->check(CLI::Range(5, 3600));
  app.add_option("--ceiling-reps", ceiling_reps, "repetitions of each ceiling")->check(CLI::Range(1, 1000));
  app.add_option("--json", json_path, "also write the results as JSON here");
  CLI11_PARSE(app, argc, argv);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // in order with stderr in a log; the roles _exit without flushing
  a.slot_bytes = slot_mib << 20;
  char tmpl[] = "/tmp/shmcast-dslb-XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) return 2;
  a.dir = tmpl;

  json out;
  out["command"] = command_line(argc, argv);
  out["reps"] = a.reps;
  out["slot_bytes"] = a.slot_bytes;
  out["slots"] = a.slots;
  out["manifests"] = manifests;
  std::printf("shmcast-device-slots-bench: trainer and engines on GPU 0, %u x %llu MiB slots, %d timed syncs per "
              "phase\n",
              a.slots, static_cast<unsigned long long>(slot_mib), a.reps);
  json mjson = json::array();
  try {
    for (const auto& m : bench::manifest_sizes(manifests))
      mjson.push_back({{"name", m.name}, {"tensors", m.tensors}, {"bytes", m.bytes}});
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shmcast-device-slots-bench: %s\n", e.what());
    ::rmdir(a.dir.c_str());
    return 2;
  }
  out["manifest_sizes"] = mjson;
  const json ceil = bench::gpu::ceilings(1ull << 30, ceiling_reps);
  if (ceil.contains("error")) {
    std::fprintf(stderr, "shmcast-device-slots-bench: measuring the ceilings failed (needs a GPU): %s\n",
                 ceil["error"].get<std::string>().c_str());
    out["error"] = "ceilings: " + ceil["error"].get<std::string>();
    if (!json_path.empty()) std::ofstream(json_path) << out.dump(2);
    ::rmdir(a.dir.c_str());
    return 2;
  }
  out["d2d_gbps"] = ceil.value("d2d_gbps", json{});
  out["host_both_gbps"] = ceil.value("host_both_gbps", json{});
  std::printf("ceiling: device-to-device copy of 1 GiB, GB/s: %s\n", fmt_stat(out["d2d_gbps"], 1, "%.0f").c_str());
  std::printf("ceiling: host path, a D2H and an H2D of 1 GiB at once, GB/s per direction: %s\n",
              fmt_stat(out["host_both_gbps"], 1, "%.1f").c_str());

  std::vector<Phase> phases;
  for (const std::string& n : phase_names)
    for (const std::string& m : manifests) {
      if (n == "host") phases.push_back({n, false, 1, m});
      if (n == "device") phases.push_back({n, true, 1, m});
      if (n == "fanout") phases.push_back({n, true, fanout_engines, m});
      if (n == "fanout-host") phases.push_back({n, false, fanout_engines, m});
    }
  json results = json::array();
  int failures = 0;
  std::printf("%-11s %-6s %7s %24s %24s %22s %9s  %s\n", "phase", "slots", "engines", "sync ms med (min..max)",
              "GB/s med (min..max)", "trainer ms", "verified", "manifest");
  for (std::size_t i = 0; i < phases.size(); ++i) {
    const Phase& ph = phases[i];
    json r = run_phase(ph, a, static_cast<int>(i));
    if (r.contains("error")) {
      std::printf("%-11s %-6s %7d  error: %s\n", ph.label.c_str(), ph.device ? "device" : "host", ph.engines,
                  r["error"].get<std::string>().c_str());
      ++failures;
    } else {
      std::printf("%-11s %-6s %7d %24s %24s %22s %4d/%-4d  %s\n", ph.label.c_str(), ph.device ? "device" : "host",
                  ph.engines, fmt_stat(r["sync_s"], 1e3, "%.1f").c_str(), fmt_stat(r["gbps"], 1, "%.1f").c_str(),
                  fmt_stat(r["producer_s"], 1e3, "%.1f").c_str(), r["verified"].get<int>(),
                  r["verified_of"].get<int>(), ph.manifest.c_str());
      if (r["verified"].get<int>() != r["verified_of"].get<int>()) {
        std::printf("            MISMATCH: %d of %d received syncs had wrong bytes\n",
                    r["verified_of"].get<int>() - r["verified"].get<int>(), r["verified_of"].get<int>());
        ++failures;
      }
      if (ph.device)
        std::printf("            GPU memory: slot_device_bytes %.1f MiB; free memory taken by the trainer's create "
                    "%.1f MiB; by the engines' opens %.1f MiB\n",
                    r["slot_device_bytes"].get<double>() / (1 << 20), r["gpu_bytes_create"].get<double>() / (1 << 20),
                    r["gpu_bytes_engines_open"].get<double>() / (1 << 20));
    }
    std::fflush(stdout);
    results.push_back(r);
  }
  out["phases"] = results;
  // Ratios between this run's phases (medians).
  json ratios;
  auto med_of = [&](const std::string& label, const std::string& m) {
    for (const json& r : results)
      if (r["label"] == label && r["manifest"] == m) return median_of(r, "gbps");
    return 0.0;
  };
  auto med = [&](const std::string& label) { return med_of(label, manifests.front()); };
  const double d2d = median_of(out, "d2d_gbps");
  auto ratio = [&](const char* key, double num, double den, const char* what) {
    if (num <= 0 || den <= 0) return;
    ratios[key] = num / den;
    std::printf("%s: %.2f\n", what, num / den);
  };
  ratio("device_over_host", med("device"), med("host"), "device / host slots, GB/s (medians), 1 engine");
  ratio("fanout_over_fanout_host", med("fanout"), med("fanout-host"),
        "device / host slots, GB/s (medians), fanout");
  ratio("device_over_d2d", med("device"), d2d, "device slots, 1 engine / the D2D copy ceiling (medians)");
  ratio("fanout_over_device", med("fanout"), med("device"), "fanout / 1 engine, device slots, GB/s (medians)");
  if (manifests.size() >= 2) {
    json per;
    for (const std::string& n : phase_names) {
      const double x = med_of(n, manifests[0]), y = med_of(n, manifests[1]);
      if (x <= 0 || y <= 0) continue;
      per[n] = x / y;
      std::printf("%s: %s over %s, GB/s (medians): %.3f\n", n.c_str(), manifests[0].c_str(), manifests[1].c_str(),
                  x / y);
    }
    ratios["first_over_second_manifest"] = per;
  }
  out["ratios"] = ratios;
  if (!json_path.empty()) std::ofstream(json_path) << out.dump(2);
  remove_role_files(a);
  ::rmdir(a.dir.c_str());
  return failures == 0 ? 0 : 1;
}
