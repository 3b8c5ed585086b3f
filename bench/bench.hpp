// shmcast-bench internals shared by the orchestrator (main.cpp) and the
// producer / consumer roles (host: main.cpp, CUDA: cuda_roles.cpp).
//
// The orchestrator re-executes itself (posix_spawn of /proc/self/exe) once
// per role: `--role producer|consumer --ctl-fd N --index i`. The roles share
// nothing with the orchestrator but a small control block in a memfd (the fd
// is inherited across exec): the run's configuration, per-sync CLOCK_MONOTONIC
// timestamps, setup times, verification results and error text.
//
// Every sync carries fresh random bytes (content.hpp: a function of the run's
// seed, the sync and the tensor) and every sync is checked, every byte, by
// every consumer; both happen outside the timed region. Timing across
// processes:
//   producer  fills its tensors with sync i's bytes (untimed), waits until
//             every consumer marked itself ready for sync i, takes
//             t_start[i], sends, takes t_prod_end[i] (end_sync returned),
//             waits until every consumer marked sync i done;
//   consumer  marks ready[c][i], wait_sync, reads (CUDA: then
//             cudaStreamSynchronize of its stream), takes t_done[c][i], then
//             compares what it received with sync i's bytes (untimed) and
//             records the result in sync_bad[c][i] before marking ready for
//             sync i + 1.
// End-to-end time of sync i = max over consumers of t_done[c][i] - t_start[i].
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "shmcast/shmcast.hpp"

namespace bench {

inline constexpr int kMaxSyncs = 128;
inline constexpr int kMaxConsumers = 16;
inline constexpr int kMaxTensors = static_cast<int>(shmcast::limits::kMaxTensors);  // a MoE manifest: 18,867 tensors
inline constexpr int kMaxRoundTrips = 100000;

enum class Mode : std::int32_t { kHost = 0, kCuda = 1 };

// Plain data: written by the orchestrator before the roles start.
struct Config {
  Mode mode = Mode::kHost;
  std::uint64_t bytes = 4ull << 30;         // host: total payload
  std::uint64_t tensor_bytes = 256ull << 20;  // host: size of each tensor
  std::uint64_t slot_bytes = 64ull << 20;
  std::uint32_t slots = 2;
  std::uint32_t consumers = 1;
  std::int32_t warmup = 1;
  std::int32_t iters = 10;              // timed syncs (--reps)
  std::int32_t roundtrip_iters = 2000;  // host only, back to back; 0 = skip both round-trip figures
  std::int32_t roundtrip_idle_iters = 1000;  // host only, each after an idle gap
  std::int32_t roundtrip_idle_gap_us = 2000;  // > the doorbell's 20 us spin window
  std::uint64_t roundtrip_bytes = 8192;
  std::uint64_t seed = 0;  // content.hpp: the run's bytes
  bool checksums = false;
  bool staging = false;  // cuda: read_to_staging instead of read_into_device
  bool huge_pages = false;  // host: MADV_HUGEPAGE on the bench's buffers
  std::int32_t producer_device = 0;
  std::int32_t consumer_device = 0;
  char region[128] = {};
  char manifest[64] = {};  // cuda: "qwen2.5-3b"
  int syncs() const { return warmup + iters; }
  int roundtrip_warmup() const { return roundtrip_iters > 0 ? std::min(200, roundtrip_iters) : 0; }
  int roundtrip_idle_warmup() const { return roundtrip_iters > 0 && roundtrip_idle_iters > 0 ? 10 : 0; }
  int roundtrips_total() const {
    return roundtrip_iters > 0 ? roundtrip_warmup() + roundtrip_iters + roundtrip_idle_warmup() + roundtrip_idle_iters
                               : 0;
  }
};

// The producer options every bench role uses, from the command line. The
// engine is explicit: host mode measures the memcpy engine (with progressive
// fill) even on a machine with a GPU, cuda mode the CUDA engine.
inline shmcast::ProducerOptions producer_options(const Config& c, shmcast::Pin pin, shmcast::CopyEngine engine) {
  shmcast::ProducerOptions o;
  o.engine = engine;
  o.slot_bytes = c.slot_bytes;
  o.slots = c.slots;
  o.max_consumers = c.consumers > 1 ? c.consumers : 1;
  o.checksums = c.checksums;
  o.pin = pin;
  return o;
}

struct RoleResult {
  std::int32_t status = 0;  // 0 running, 1 done, 2 failed (read after the role exits)
  char error[2048] = {};
  double setup_s = 0;       // allocating and filling the tensors
  double create_s = 0;      // Producer::create_seconds / Consumer::open_seconds
  double pin_s = 0;
  std::int32_t pinned = 0;
  std::uint64_t region_bytes = 0;
  // consumer: verification of every sync (warm-up and timed) and round trip
  std::int32_t checked = 0;     // syncs compared
  std::int32_t verified = 0;    // syncs whose every byte matched
  std::int32_t mismatches = 0;  // tensors that differed, over all syncs
  char first_bad[256] = {};
  std::int32_t rt_checked = 0, rt_verified = 0;
  // producer: round trips, microseconds; back to back and after an idle gap
  double rt_median_us = 0, rt_p99_us = 0, rt_min_us = 0, rt_max_us = 0, rt_mean_us = 0;
  std::int32_t rt_count = 0;
  double rti_median_us = 0, rti_p99_us = 0, rti_min_us = 0, rti_max_us = 0, rti_mean_us = 0;
  std::int32_t rti_count = 0;
};

struct Ctl {
  Config cfg;
  std::atomic<std::int32_t> abort{0};
  std::atomic<std::int64_t> t_start[kMaxSyncs];
  std::atomic<std::int64_t> t_prod_end[kMaxSyncs];
  std::atomic<std::int64_t> t_ready[kMaxConsumers][kMaxSyncs];
  std::atomic<std::int64_t> t_done[kMaxConsumers][kMaxSyncs];
  // Tensors that differed in sync i (written by consumer c after t_done; -1
  // until it compared them).
  std::int32_t sync_bad[kMaxConsumers][kMaxSyncs];
  // Round trips: consumer c is waiting for round trip j once rt_ready[c] >
  // j (it has read and checked round trip j - 1).
  std::atomic<std::int32_t> rt_ready[kMaxConsumers];
  std::atomic<std::int32_t> region_ready{0};  // the producer created the region
  RoleResult producer;
  RoleResult consumer[kMaxConsumers];
};

std::int64_t now_ns();
// Waits (sleeping in short steps) until pred() holds; throws on abort or
// after `timeout_s`.
void wait_for(Ctl* ctl, const char* what, double timeout_s, const std::function<bool()>& pred);

// Role bodies. Each returns 0 or throws; errors end up in RoleResult::error.
int host_producer(Ctl* ctl);
int host_consumer(Ctl* ctl, int index);
int cuda_producer(Ctl* ctl);
int cuda_consumer(Ctl* ctl, int index);

// Self-test of the checker: SHMCAST_BENCH_CORRUPT=i makes consumer 0 flip one
// bit of its first tensor after reading sync i (after its timer stopped,
// before it compares); the run must then report the mismatch and exit 1.
int corrupt_sync();

// Manifests for the CUDA mode.
std::vector<shmcast::TensorSpec> manifest_by_name(const std::string& name);

// The named manifests' sizes, in order: prints "manifest NAME: N tensors, B
// bytes (bf16)" for each; an unknown name throws std::invalid_argument with
// manifest_by_name's message.
struct ManifestSize {
  std::string name;
  std::size_t tensors = 0;
  std::uint64_t bytes = 0;
};
std::vector<ManifestSize> manifest_sizes(const std::vector<std::string>& names);
// Qwen3-30B-A3B's tensors (manifests.cpp), the first `layers` of its 48
// layers; `dense`: the same bytes with each layer's experts in 3 tensors.
std::vector<shmcast::TensorSpec> qwen3_30b_a3b(bool dense, int layers);

// min / median / max of repeated measurements.
struct Stat {
  double min = 0, median = 0, max = 0;
  int n = 0;
};
Stat stat_of(std::vector<double> v);

// Single-process copy ceilings for the CUDA mode, GB/s over `reps` copies.
struct Ceilings {
  bool ok = false;
  std::string error;
  std::string device_name, consumer_device_name;
  std::uint64_t bytes = 0;  // per direction, per copy
  int reps = 0;
  Stat d2h, h2d;
  Stat both_d2h, both_h2d;  // each direction while both run
  Stat both;                // bytes per direction / time for both (the ceiling)
  // The same with the H2D split in halves over two streams (two DMA engines).
  Stat h2d2, both2, both2_d2h, both2_h2d;
  double pin_s_per_gib = 0;
};
Ceilings measure_ceilings(int producer_device, int consumer_device, std::uint64_t bytes, int reps);
bool bench_has_cuda();


}  // namespace bench
