// shmcast-relay-bench-peer: the trainer, the workers and the per-hop cost
// probe of bench/relay_bench.py (which starts the relays and reads these
// reports). One process per role; every node is its own SHMCAST_DIR.
//
//   produce NAME --bytes B --tensors T --slot-bytes S --syncs N --go PREFIX --seed X --report FILE
//           [--manifest qwen2.5-3b] [--change F [--delta 1]]
//     sync v (1..N) waits for the file PREFIX.v, then fills its tensors with
//     fresh random bytes (content.hpp, outside the timer) and sends them;
//     reports "begin v <CLOCK_MONOTONIC ns>" just before begin_sync,
//     "written v <ns>" when the last write() returned (a delta producer has
//     then compared and encoded every tensor: its host codec's time) and
//     "end v <ns>" after end_sync, then "sync v full|delta <payload bytes>
//     <logical bytes>" (Producer::last_sync). First "logical <bytes>" (of
//     one sync) and "ready".
//     --manifest: the tensors of a named model's shapes (bf16, manifests.cpp)
//     instead of --tensors equal 1-D bf16 tensors of --bytes in all.
//     --change F: instead of fresh bytes, the tensors start from seeded bytes
//     and before each sync about F of their bf16 elements change, at seeded
//     random positions (mutate(), outside the timer): what a training step
//     does to bf16 weights. --delta 1: ProducerOptions::delta (the syncs go
//     out as deltas when they pay), else every sync is full.
//     --cuda 1: the trainer's tensors live in GPU memory (cudaMalloc on GPU
//     0), the producer uses the CUDA engine (CopyEngine::kCuda, pinned
//     slots) and sends them with write_device(): a delta producer compares
//     and encodes on the GPU in end_sync() (so "written" is when the last
//     write_device() was queued) and only its blobs cross PCIe. Their
//     content and changes come from kernels (cuda_kernels.cu: fill, and
//     mutate_u16 for --change: each element changes with probability F),
//     outside the timer. Needs the CUDA build (nvcc) and a GPU; without
//     either the process says why ("error ..." in the report) and exits 4.
//   consume NAME --syncs N --seed X --report FILE [--change F] [--cuda 1]
//     reports "end v <ns>" when read_into() returned (the sync is in this
//     process's memory), then checks every byte (after the timer) and
//     reports "sync v full|delta <payload> <logical>" (Consumer::last_sync)
//     and "ok v" or "bad v <blocks or tensors>". With --change F it reads
//     every sync into the same buffers (a delta applies in place), and its
//     reference (its own copy, from the seed) takes the same changes for
//     every version up to v; every byte is compared with it.
//   costs --bytes S --reps R [--threads T]
//     what a relay does per received chunk besides the network: memcpy into
//     the region and XXH3 of the chunk, on S-byte buffers; with T > 1 also
//     the machine's memory bandwidth for copies: T threads each copying its
//     own S-byte buffers at once (bytes copied per second, all threads; the
//     memory moves twice that). One JSON line.
// CLOCK_MONOTONIC is one clock for every process of the machine.
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <sys/stat.h>
#include <thread>
#include <vector>

#include "bench.hpp"
#include "content.hpp"
#include "shmcast/shmcast.hpp"

#if SHMCAST_RELAY_PEER_CUDA
#include <cuda_runtime_api.h>

#include <stdexcept>

#include "cuda_kernels.hpp"
#endif

using namespace shmcast;
using namespace std::chrono_literals;

namespace {

std::int64_t now_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

struct Args {
  std::string role, name, go, report, manifest;
  std::uint64_t bytes = 512ull << 20, slot_bytes = 32ull << 20, seed = 1, reps = 10;
  int tensors = 16, syncs = 11, threads = 1;
  double change = 0;  // > 0: seeded changes of this fraction of the elements (else fresh bytes)
  bool delta = false;
  bool cuda = false;  // --cuda 1: device tensors, write_device / read_into_device
};

// Tensor t's key for the changes before sync v (v >= 1); its bytes before
// the first change: content::fill of key(seed, 0, t).
std::uint64_t change_key(const Args& a, std::uint64_t v, std::size_t t) {
  return bench::content::key(a.seed ^ 0xc4a6e5ull, v, t);
}

// About `fraction` of the bf16 elements of p[0, bytes) change: each region
// of 64 Ki elements takes round(fraction * its length) (rounded at random)
// XORs with a non-zero 16-bit value at positions drawn from (key, region).
// A pure function of (bytes before, fraction, key): the producer and every
// consumer's reference make the same change.
void mutate(void* p, std::uint64_t bytes, double fraction, std::uint64_t key) {
  using bench::content::kGolden;
  using bench::content::mix;
  auto* e = static_cast<std::uint16_t*>(p);
  const std::uint64_t n = bytes / 2;
  constexpr std::uint64_t kRegion = 1ull << 16;
  const std::uint64_t regions = (n + kRegion - 1) / kRegion;
  for (std::uint64_t r = 0; r < regions; ++r) {
    const std::uint64_t len = std::min(kRegion, n - r * kRegion);
    const std::uint64_t rk = mix(key ^ mix((r + 1) * kGolden));
    const double want = fraction * static_cast<double>(len);
    const double u = static_cast<double>(rk >> 11) * 0x1.0p-53;
    const std::uint64_t k = static_cast<std::uint64_t>(want + u);  // E[k] = want
    std::uint16_t* base = e + r * kRegion;
    for (std::uint64_t j = 0; j < k; ++j) {
      const std::uint64_t h = mix(rk + (j + 1) * kGolden);
      const std::uint64_t pos = static_cast<std::uint64_t>((static_cast<unsigned __int128>(h >> 16) * len) >> 48);
      base[pos] ^= static_cast<std::uint16_t>(h | 1);
    }
  }
}

// fn(t) for t in [0, count) on up to 8 threads (outside the timers: the
// changes and the checks of a sync's tensors).
template <class F>
void for_tensors(std::size_t count, F&& fn) {
  const std::size_t threads = std::min<std::size_t>({std::max(1u, std::thread::hardware_concurrency()), 8, count});
  std::atomic<std::size_t> next{0};
  auto work = [&] {
    for (std::size_t t; (t = next.fetch_add(1)) < count;) fn(t);
  };
  std::vector<std::thread> th;
  for (std::size_t i = 1; i < threads; ++i) th.emplace_back(work);
  work();
  for (auto& x : th) x.join();
}

std::vector<TensorSpec> tensor_specs(const Args& a) {
  if (!a.manifest.empty()) return bench::manifest_by_name(a.manifest);
  std::vector<TensorSpec> specs;
  const std::uint64_t each = a.bytes / static_cast<std::uint64_t>(a.tensors) / 2 * 2;
  for (int t = 0; t < a.tensors; ++t)
    specs.push_back({"model.layers." + std::to_string(t) + ".weight", DType::kBF16,
                     {static_cast<std::int64_t>(each / 2)}});
  return specs;
}

std::string sync_line(std::uint64_t v, const SyncReport& r) {
  return "sync " + std::to_string(v) + (r.delta ? " delta " : " full ") + std::to_string(r.payload_bytes) + " " +
         std::to_string(r.logical_bytes);
}

void say(const Args& a, const std::string& line) {
  std::ofstream f(a.report, std::ios::app);
  f << line << "\n";
}

bool wait_file(const std::string& path) {
  struct stat st {};
  const auto end = std::chrono::steady_clock::now() + 600s;
  while (::stat(path.c_str(), &st) != 0) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

int produce(const Args& a) {
  ProducerOptions o;
  o.slot_bytes = a.slot_bytes;
  o.slots = 2;
  o.pin = Pin::kNo;
  o.engine = CopyEngine::kHost;
  o.consumer_timeout = 120s;
  o.delta = a.delta;
  Producer p = Producer::create(a.name, o);
  const std::vector<TensorSpec> specs = tensor_specs(a);
  std::vector<std::vector<std::byte>> data(specs.size());
  std::uint64_t logical = 0;
  for (std::size_t t = 0; t < specs.size(); ++t) {
    data[t].resize(specs[t].nbytes());
    logical += specs[t].nbytes();
  }
  if (a.change > 0)
    for_tensors(data.size(), [&](std::size_t t) {
      bench::content::fill(data[t].data(), data[t].size(), bench::content::key(a.seed, 0, t));
    });
  say(a, "logical " + std::to_string(logical));
  say(a, "ready");
  p.wait_for_consumers(1, 120s);
  for (int v = 1; v <= a.syncs; ++v) {
    if (!wait_file(a.go + "." + std::to_string(v))) return 3;
    for_tensors(data.size(), [&](std::size_t t) {
      if (a.change > 0)
        mutate(data[t].data(), data[t].size(), a.change, change_key(a, static_cast<std::uint64_t>(v), t));
      else
        bench::content::fill(data[t].data(), data[t].size(),
                             bench::content::key(a.seed, static_cast<std::uint64_t>(v), t));
    });
    say(a, "begin " + std::to_string(v) + " " + std::to_string(now_ns()));
    p.begin_sync(specs);
    for (std::size_t t = 0; t < data.size(); ++t) p.write(t, data[t].data());
    const std::int64_t t_written = now_ns();
    p.end_sync();
    const std::int64_t t_end = now_ns();
    say(a, "written " + std::to_string(v) + " " + std::to_string(t_written));
    say(a, "end " + std::to_string(v) + " " + std::to_string(t_end));
    say(a, sync_line(static_cast<std::uint64_t>(v), p.last_sync()));
    if (v == 1 && a.delta) say(a, "delta_base_bytes " + std::to_string(p.delta_base_bytes()));
  }
  for (;;) std::this_thread::sleep_for(1s);  // until the bench ends it
}

int consume(const Args& a) {
  ConsumerOptions o;
  o.pin = Pin::kNo;
  o.open_timeout = 120s;
  o.chunk_timeout = 120s;
  Consumer c = Consumer::open(a.name, o);
  say(a, "attached");
  std::vector<std::vector<std::byte>> got, ref;
  std::uint64_t ref_version = 0;  // --change: the version ref holds
  for (int i = 0; i < a.syncs; ++i) {
    const SyncInfo& s = c.wait_sync(600s);
    if (got.size() != s.tensors.size()) {
      got.assign(s.tensors.size(), {});
      for (std::size_t t = 0; t < s.tensors.size(); ++t) got[t].assign(s.tensors[t].nbytes, std::byte{0});
    }
    std::vector<void*> dst;
    for (auto& g : got) dst.push_back(g.data());
    try {
      c.read_into(dst);
    } catch (const Error& e) {
      if (e.code() != Errc::kNeedsFullSync) throw;
      // Not applied (this consumer did not hold the delta's base): the
      // bench counts it as a failure of the sync.
      say(a, "needsfull " + std::to_string(s.version));
      continue;
    }
    const std::int64_t t_end = now_ns();
    say(a, "end " + std::to_string(s.version) + " " + std::to_string(t_end));
    say(a, sync_line(s.version, c.last_sync()));
    std::atomic<std::uint64_t> bad{0};
    if (a.change > 0) {
      const bool fresh = ref.empty();
      if (fresh) ref.resize(got.size());
      const std::uint64_t from = ref_version;
      for_tensors(got.size(), [&](std::size_t t) {
        if (fresh) {
          ref[t].resize(got[t].size());
          bench::content::fill(ref[t].data(), ref[t].size(), bench::content::key(a.seed, 0, t));
        }
        for (std::uint64_t v = from + 1; v <= s.version; ++v)
          mutate(ref[t].data(), ref[t].size(), a.change, change_key(a, v, t));
        if (std::memcmp(got[t].data(), ref[t].data(), got[t].size()) != 0) ++bad;
      });
      ref_version = s.version;
    } else {
      for (std::size_t t = 0; t < got.size(); ++t)
        bad += bench::content::count_bad(got[t].data(), got[t].size(), bench::content::key(a.seed, s.version, t));
    }
    say(a, bad == 0 ? "ok " + std::to_string(s.version)
                    : "bad " + std::to_string(s.version) + " " + std::to_string(bad.load()));
    if (bad != 0) return 12;
  }
  return 0;
}

int costs(const Args& a) {
  std::vector<std::byte> src(a.bytes), dst(a.bytes);
  bench::content::fill(src.data(), a.bytes, bench::content::key(a.seed, 0, 0));
  std::memset(dst.data(), 1, dst.size());
  std::vector<double> cp, hs;
  volatile std::uint64_t sink = 0;
  for (std::uint64_t r = 0; r < a.reps; ++r) {
    std::int64_t t0 = now_ns();
    std::memcpy(dst.data(), src.data(), a.bytes);
    std::int64_t t1 = now_ns();
    sink = sink + XXH3_64bits(dst.data(), a.bytes);
    std::int64_t t2 = now_ns();
    cp.push_back(static_cast<double>(a.bytes) / static_cast<double>(t1 - t0));
    hs.push_back(static_cast<double>(a.bytes) / static_cast<double>(t2 - t1));
  }
  std::sort(cp.begin(), cp.end());
  std::sort(hs.begin(), hs.end());
  auto med = [](const std::vector<double>& v) { return v[v.size() / 2]; };
  std::vector<double> par;
  if (a.threads > 1) {
    const auto T = static_cast<std::size_t>(a.threads);
    std::vector<std::vector<std::byte>> s2(T), d2(T);
    for (std::size_t t = 0; t < T; ++t) {
      s2[t] = src;
      d2[t].assign(a.bytes, std::byte{1});
    }
    for (std::uint64_t r = 0; r < a.reps; ++r) {
      std::vector<std::thread> th;
      const std::int64_t t0 = now_ns();
      for (std::size_t t = 0; t < T; ++t)
        th.emplace_back([&, t] { std::memcpy(d2[t].data(), s2[t].data(), a.bytes); });
      for (auto& x : th) x.join();
      const std::int64_t t1 = now_ns();
      par.push_back(static_cast<double>(a.bytes * T) / static_cast<double>(t1 - t0));
    }
    std::sort(par.begin(), par.end());
  }
  std::printf("{\"bytes\":%llu,\"reps\":%llu,\"memcpy_gbs\":{\"min\":%.3f,\"median\":%.3f,\"max\":%.3f},"
              "\"xxh3_gbs\":{\"min\":%.3f,\"median\":%.3f,\"max\":%.3f}",
              static_cast<unsigned long long>(a.bytes), static_cast<unsigned long long>(a.reps), cp.front(), med(cp),
              cp.back(), hs.front(), med(hs), hs.back());
  if (!par.empty())
    std::printf(",\"threads\":%d,\"memcpy_all_threads_gbs\":{\"min\":%.3f,\"median\":%.3f,\"max\":%.3f}", a.threads,
                par.front(), med(par), par.back());
  std::printf("}\n");
  return 0;
}


#if SHMCAST_RELAY_PEER_CUDA
// --cuda 1. The CUDA runtime's errors (no GPU included) end the process
// with their text, in the report too (main()).
void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("--cuda 1: ") + what + ": " + cudaGetErrorName(e) + " (" +
                             cudaGetErrorString(e) + ")");
}

void cuda_device() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0)
    throw std::runtime_error(std::string("--cuda 1 needs a CUDA GPU: cudaGetDeviceCount: ") +
                             (e != cudaSuccess ? cudaGetErrorString(e) : "no device"));
  ck(cudaSetDevice(0), "cudaSetDevice(0)");
}

// Device buffers of n bytes rounded up to 8 (count_diff compares 8-byte
// words), the rounding zeroed: neither a read nor the kernels write it.
void* device_buffer(std::uint64_t n) {
  void* p = nullptr;
  const std::uint64_t r = (n + 7) / 8 * 8;
  ck(cudaMalloc(&p, std::max<std::uint64_t>(r, 8)), "cudaMalloc");
  if (r > n) ck(cudaMemset(static_cast<std::byte*>(p) + n, 0, r - n), "cudaMemset");
  return p;
}

// The content of tensor t before sync v: with --change, the seeded start
// (fill) and the changes of versions from+1..v (mutate_u16, each element
// with probability F); else the fresh bytes of (seed, v, t).
void change_device(const Args& a, void* p, std::uint64_t n, std::size_t t, std::uint64_t v, cudaStream_t s) {
  ck(bench::kernels::mutate_u16(p, n, a.change, change_key(a, v, t), s), "mutate_u16");
}

int produce_cuda(const Args& a) {
  cuda_device();
  cudaStream_t s = nullptr;
  ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  const std::vector<TensorSpec> specs = tensor_specs(a);
  std::vector<void*> src(specs.size());
  std::uint64_t logical = 0;
  for (std::size_t t = 0; t < specs.size(); ++t) {
    src[t] = device_buffer(specs[t].nbytes());
    logical += specs[t].nbytes();
    if (a.change > 0)
      ck(bench::kernels::fill(src[t], specs[t].nbytes(), bench::content::key(a.seed, 0, t), s), "fill");
  }
  ck(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  ProducerOptions o;
  o.slot_bytes = a.slot_bytes;
  o.slots = 2;
  // Unpinned: on the GPU machine cuMemHostRegister refused the bench's node
  // regions (CUDA_ERROR_INVALID_VALUE, 2026-12-03); the link, not PCIe, bounds these syncs.
  o.pin = Pin::kNo;
  o.engine = CopyEngine::kCuda;
  o.consumer_timeout = 120s;
  o.delta = a.delta;
  Producer p = Producer::create(a.name, o);
  say(a, "logical " + std::to_string(logical));
  say(a, "ready");
  p.wait_for_consumers(1, 120s);
  for (int v = 1; v <= a.syncs; ++v) {
    if (!wait_file(a.go + "." + std::to_string(v))) return 3;
    const auto uv = static_cast<std::uint64_t>(v);
    for (std::size_t t = 0; t < specs.size(); ++t) {
      if (a.change > 0)
        change_device(a, src[t], specs[t].nbytes(), t, uv, s);
      else
        ck(bench::kernels::fill(src[t], specs[t].nbytes(), bench::content::key(a.seed, uv, t), s), "fill");
    }
    ck(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    say(a, "begin " + std::to_string(v) + " " + std::to_string(now_ns()));
    p.begin_sync(specs);
    for (std::size_t t = 0; t < specs.size(); ++t) p.write_device(t, src[t], s);
    const std::int64_t t_written = now_ns();
    p.end_sync();
    const std::int64_t t_end = now_ns();
    say(a, "written " + std::to_string(v) + " " + std::to_string(t_written));
    say(a, "end " + std::to_string(v) + " " + std::to_string(t_end));
    say(a, sync_line(uv, p.last_sync()));
    if (v == 1 && a.delta) say(a, "delta_base_bytes " + std::to_string(p.delta_base_bytes()));
  }
  for (;;) std::this_thread::sleep_for(1s);  // until the bench ends it
}

int consume_cuda(const Args& a) {
  cuda_device();
  cudaStream_t s = nullptr;
  ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  unsigned long long* bad_dev = nullptr;
  ck(cudaMalloc(reinterpret_cast<void**>(&bad_dev), sizeof *bad_dev), "cudaMalloc");
  ConsumerOptions o;
  o.pin = Pin::kNo;  // as the trainer's
  o.open_timeout = 120s;
  o.chunk_timeout = 120s;
  Consumer c = Consumer::open(a.name, o);
  say(a, "attached");
  std::vector<void*> got, ref;
  std::vector<std::uint64_t> bytes;
  std::uint64_t ref_version = 0;  // --change: the version ref holds
  for (int i = 0; i < a.syncs; ++i) {
    const SyncInfo& info = c.wait_sync(600s);
    if (got.empty()) {
      for (const auto& ti : info.tensors) {
        bytes.push_back(ti.nbytes);
        got.push_back(device_buffer(ti.nbytes));
        if (a.change > 0) ref.push_back(device_buffer(ti.nbytes));
      }
      for (std::size_t t = 0; t < ref.size(); ++t)
        ck(bench::kernels::fill(ref[t], bytes[t], bench::content::key(a.seed, 0, t), s), "fill");
      ck(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    } else if (got.size() != info.tensors.size()) {
      throw std::runtime_error("sync " + std::to_string(info.version) + " has " + std::to_string(info.tensors.size()) +
                               " tensors, the first had " + std::to_string(got.size()));
    }
    const std::uint64_t version = info.version;
    try {
      c.read_into_device(got, s);
      ck(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    } catch (const Error& e) {
      if (e.code() != Errc::kNeedsFullSync) throw;
      say(a, "needsfull " + std::to_string(version));
      continue;
    }
    const std::int64_t t_end = now_ns();
    say(a, "end " + std::to_string(version) + " " + std::to_string(t_end));
    say(a, sync_line(version, c.last_sync()));
    // Every byte, on the GPU, after the timer.
    ck(cudaMemsetAsync(bad_dev, 0, sizeof *bad_dev, s), "cudaMemsetAsync");
    for (std::size_t t = 0; t < got.size(); ++t) {
      if (a.change > 0) {
        for (std::uint64_t v = ref_version + 1; v <= version; ++v) change_device(a, ref[t], bytes[t], t, v, s);
        ck(bench::kernels::count_diff(got[t], ref[t], (bytes[t] + 7) / 8 * 8, bad_dev, s), "count_diff");
      } else {
        ck(bench::kernels::count_bad(got[t], bytes[t], bench::content::key(a.seed, version, t), bad_dev, s),
           "count_bad");
      }
    }
    if (a.change > 0) ref_version = version;
    unsigned long long bad = 0;
    ck(cudaMemcpyAsync(&bad, bad_dev, sizeof bad, cudaMemcpyDeviceToHost, s), "cudaMemcpyAsync");
    ck(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    say(a, bad == 0 ? "ok " + std::to_string(version) : "bad " + std::to_string(version) + " " + std::to_string(bad));
    if (bad != 0) return 12;
  }
  return 0;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return 2;
  Args a;
  a.role = argv[1];
  int i = 2;
  if (a.role != "costs") {
    if (argc < 3) return 2;
    a.name = argv[2];
    i = 3;
  }
  for (; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--bytes") a.bytes = std::stoull(v);
    else if (k == "--tensors") a.tensors = std::stoi(v);
    else if (k == "--slot-bytes") a.slot_bytes = std::stoull(v);
    else if (k == "--syncs") a.syncs = std::stoi(v);
    else if (k == "--go") a.go = v;
    else if (k == "--seed") a.seed = std::stoull(v);
    else if (k == "--reps") a.reps = std::stoull(v);
    else if (k == "--threads") a.threads = std::max(1, std::stoi(v));
    else if (k == "--report") a.report = v;
    else if (k == "--manifest") a.manifest = v;
    else if (k == "--change") a.change = std::stod(v);
    else if (k == "--delta") a.delta = v == "1";
    else if (k == "--cuda") a.cuda = v == "1";
    else {
      std::fprintf(stderr, "shmcast-relay-bench-peer: unknown option %s\n", k.c_str());
      return 2;
    }
  }
  try {
    if (a.cuda && a.role != "costs") {
#if SHMCAST_RELAY_PEER_CUDA
      if (a.role == "produce") return produce_cuda(a);
      if (a.role == "consume") return consume_cuda(a);
#else
      const std::string why =
          "--cuda 1: this shmcast-relay-bench-peer was built without CUDA (configure with -DSHMCAST_WITH_CUDA=ON "
          "and nvcc, e.g. -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc)";
      std::fprintf(stderr, "shmcast-relay-bench-peer %s: %s\n", a.role.c_str(), why.c_str());
      if (!a.report.empty()) say(a, "error " + why);
      return 4;
#endif
    }
    if (a.role == "produce") return produce(a);
    if (a.role == "consume") return consume(a);
    if (a.role == "costs") return costs(a);
  } catch (const Error& e) {
    std::fprintf(stderr, "shmcast-relay-bench-peer %s: %s\n", a.role.c_str(), e.what());
    if (!a.report.empty()) say(a, std::string("error ") + e.what());
    return 20 + static_cast<int>(e.code());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shmcast-relay-bench-peer %s: %s\n", a.role.c_str(), e.what());
    if (!a.report.empty()) say(a, std::string("error ") + e.what());
    return 4;
  }
  return 2;
}
