// shmcast-bench: throughput and latency of shmcast between real processes.
//
//   shmcast-bench                          # --mode auto: cuda with a GPU, else host
//   shmcast-bench --mode host --json       # 4 GiB through 2 x 64 MiB slots, 1 consumer
//   shmcast-bench --mode cuda              # Qwen2.5-3B bf16 (6.17 GB, 434 tensors), same GPU
//   shmcast-bench --mode cuda --sweep-slots 64M,128M,256M,512M,1G
//
// See bench.hpp for how the processes are driven and timed, and
// docs/benchmarks.md for results.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "bench.hpp"

extern char** environ;

namespace bench {

using namespace std::chrono_literals;
using json = nlohmann::json;

std::int64_t now_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return std::int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

void wait_for(Ctl* ctl, const char* what, double timeout_s, const std::function<bool()>& pred) {
  const std::int64_t deadline = now_ns() + static_cast<std::int64_t>(timeout_s * 1e9);
  int spins = 0;
  while (!pred()) {
    if (ctl->abort.load(std::memory_order_acquire)) throw std::runtime_error(std::string("aborted while waiting for ") + what);
    if (now_ns() > deadline) throw std::runtime_error(std::string("timed out waiting for ") + what);
    if (++spins < 1000)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(20us);
  }
}

std::uint64_t hash_host(const void* p, std::uint64_t n) { return XXH3_64bits(p, n); }

namespace {

// ------------------------------------------------------------------ helpers

std::uint64_t parse_size(const std::string& s) {
  std::size_t pos = 0;
  const double v = std::stod(s, &pos);
  std::string suf = s.substr(pos);
  std::transform(suf.begin(), suf.end(), suf.begin(), [](unsigned char c) { return std::toupper(c); });
  if (!suf.empty() && suf.back() == 'B') suf.pop_back();
  if (suf.size() == 2 && suf[1] == 'I') suf.pop_back();  // KiB, MiB, GiB
  double mul = 1;
  if (suf.empty()) mul = 1;
  else if (suf == "K") mul = 1024.0;
  else if (suf == "M") mul = 1024.0 * 1024;
  else if (suf == "G") mul = 1024.0 * 1024 * 1024;
  else throw std::invalid_argument("bad size '" + s + "' (use e.g. 64M, 1G, 4096)");
  return static_cast<std::uint64_t>(v * mul);
}

std::string size_text(std::uint64_t b) {
  char buf[64];
  if (b >= (1ull << 30) && b % (1ull << 30) == 0) std::snprintf(buf, sizeof buf, "%lluG", (unsigned long long)(b >> 30));
  else if (b >= (1ull << 20) && b % (1ull << 20) == 0) std::snprintf(buf, sizeof buf, "%lluM", (unsigned long long)(b >> 20));
  else if (b >= (1ull << 10) && b % (1ull << 10) == 0) std::snprintf(buf, sizeof buf, "%lluK", (unsigned long long)(b >> 10));
  else std::snprintf(buf, sizeof buf, "%llu", (unsigned long long)b);
  return buf;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t i = static_cast<std::size_t>(std::ceil(q * static_cast<double>(v.size()))) - 1;
  return v[std::min(i, v.size() - 1)];
}

void fill_pattern(std::uint8_t* p, std::size_t n, std::uint64_t seed) {
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(p + i, &x, 8);
  }
  for (; i < n; ++i) p[i] = static_cast<std::uint8_t>(x >> (8 * (i % 8)));
}

// Anonymous memory, faulted in (the first touch is not what we measure).
// Ordinary 4 KiB pages, like malloc'd tensors and the /dev/shm region, unless
// --huge-pages asks for transparent huge pages (MADV_HUGEPAGE).
bool g_huge_pages = false;
struct HostBuf {
  std::uint8_t* p = nullptr;
  std::size_t n = 0;
  explicit HostBuf(std::size_t bytes) : n(bytes) {
    void* m = ::mmap(nullptr, n ? n : 1, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (m == MAP_FAILED) throw std::runtime_error("mmap of " + std::to_string(n) + " bytes failed");
    p = static_cast<std::uint8_t*>(m);
    if (g_huge_pages) ::madvise(p, n, MADV_HUGEPAGE);
    std::memset(p, 0x5A, n);
  }
  ~HostBuf() {
    if (p) ::munmap(p, n ? n : 1);
  }
  HostBuf(const HostBuf&) = delete;
  HostBuf& operator=(const HostBuf&) = delete;
};

std::vector<shmcast::TensorSpec> host_manifest(const Config& c) {
  std::vector<shmcast::TensorSpec> v;
  std::uint64_t left = c.bytes;
  for (int i = 0; left > 0; ++i) {
    const std::uint64_t n = std::min(left, c.tensor_bytes);
    v.push_back({"t." + std::to_string(i), shmcast::DType::kU8, {static_cast<std::int64_t>(n)}});
    left -= n;
  }
  return v;
}

}  // namespace

// ------------------------------------------------------------------ host roles

int host_producer(Ctl* ctl) {
  const Config& c = ctl->cfg;
  RoleResult& r = ctl->producer;
  const auto specs = host_manifest(c);
  const std::int64_t t0 = now_ns();
  std::vector<std::unique_ptr<HostBuf>> src;
  std::vector<const void*> ptrs;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    src.push_back(std::make_unique<HostBuf>(specs[i].nbytes()));
    fill_pattern(src.back()->p, src.back()->n, 1000 + i);
    ptrs.push_back(src.back()->p);
    ctl->src_hash[i] = hash_host(src.back()->p, src.back()->n);
  }
  ctl->tensors = static_cast<std::uint32_t>(specs.size());
  ctl->src_hashes_ready.store(1, std::memory_order_release);
  r.setup_s = static_cast<double>(now_ns() - t0) * 1e-9;

  shmcast::Producer p = shmcast::Producer::create(c.region, producer_options(c, shmcast::Pin::kNo));
  r.create_s = p.create_seconds();
  r.region_bytes = p.region_bytes();
  ctl->region_ready.store(1, std::memory_order_release);
  p.wait_for_consumers(c.consumers, 60s);

  for (int i = 0; i < c.syncs(); ++i) {
    wait_for(ctl, "consumers ready", 120, [&] {
      for (std::uint32_t k = 0; k < c.consumers; ++k)
        if (ctl->t_ready[k][i].load(std::memory_order_acquire) == 0) return false;
      return true;
    });
    ctl->t_start[i].store(now_ns(), std::memory_order_release);
    p.send(specs, ptrs);
    ctl->t_prod_end[i].store(now_ns(), std::memory_order_release);
    wait_for(ctl, "consumers done", 120, [&] {
      for (std::uint32_t k = 0; k < c.consumers; ++k)
        if (ctl->t_done[k][i].load(std::memory_order_acquire) == 0) return false;
      return true;
    });
  }

  // Round trip of a small sync: publish -> consumer read -> release seen here.
  if (c.roundtrip_iters > 0) {
    std::vector<shmcast::TensorSpec> rt{{"rt", shmcast::DType::kU8, {static_cast<std::int64_t>(c.roundtrip_bytes)}}};
    std::vector<std::uint8_t> buf(c.roundtrip_bytes, 7);
    const void* bp = buf.data();
    const int warm = std::min(200, c.roundtrip_iters);
    std::vector<double> us;
    us.reserve(static_cast<std::size_t>(c.roundtrip_iters));
    for (int j = 0; j < warm + c.roundtrip_iters; ++j) {
      const std::int64_t a = now_ns();
      p.send(rt, std::span<const void* const>(&bp, 1));
      p.wait_drained(10s);
      const std::int64_t b = now_ns();
      if (j >= warm) us.push_back(static_cast<double>(b - a) * 1e-3);
    }
    r.rt_median_us = median(us);
    r.rt_p99_us = percentile(us, 0.99);
    r.rt_min_us = *std::min_element(us.begin(), us.end());
    double sum = 0;
    for (double x : us) sum += x;
    r.rt_mean_us = sum / static_cast<double>(us.size());
    r.rt_count = static_cast<std::int32_t>(us.size());
  }
  p.wait_drained(60s);
  p.close();
  return 0;
}

int host_consumer(Ctl* ctl, int index) {
  const Config& c = ctl->cfg;
  RoleResult& r = ctl->consumer[index];
  const auto specs = host_manifest(c);
  const std::int64_t t0 = now_ns();
  std::vector<std::unique_ptr<HostBuf>> dst;
  std::vector<void*> ptrs;
  for (const auto& s : specs) {
    dst.push_back(std::make_unique<HostBuf>(s.nbytes()));
    ptrs.push_back(dst.back()->p);
  }
  r.setup_s = static_cast<double>(now_ns() - t0) * 1e-9;
  shmcast::ConsumerOptions o;
  o.pin = shmcast::Pin::kNo;
  // Open once the region exists, so that open_seconds() is the open itself.
  wait_for(ctl, "the region", 120, [&] { return ctl->region_ready.load(std::memory_order_acquire) != 0; });
  shmcast::Consumer con = shmcast::Consumer::open(c.region, o);
  r.create_s = con.open_seconds();
  for (int i = 0; i < c.syncs(); ++i) {
    const bool last_verify = c.verify && i == c.syncs() - 1;
    if (last_verify)
      for (auto& d : dst) std::memset(d->p, 0xEE, d->n);
    ctl->t_ready[index][i].store(now_ns(), std::memory_order_release);
    con.wait_sync(120s);
    con.read_into(ptrs);
    ctl->t_done[index][i].store(now_ns(), std::memory_order_release);
    if (last_verify) {
      wait_for(ctl, "source hashes", 60, [&] { return ctl->src_hashes_ready.load(std::memory_order_acquire) != 0; });
      for (std::size_t t = 0; t < specs.size(); ++t) {
        if (hash_host(dst[t]->p, dst[t]->n) != ctl->src_hash[t]) {
          if (r.mismatches++ == 0) std::snprintf(r.first_bad, sizeof r.first_bad, "%s", specs[t].name.c_str());
        }
      }
      r.verified = 1;
    }
  }
  if (c.roundtrip_iters > 0) {
    std::vector<std::uint8_t> buf(c.roundtrip_bytes);
    void* bp = buf.data();
    const int warm = std::min(200, c.roundtrip_iters);
    for (int j = 0; j < warm + c.roundtrip_iters; ++j) {
      con.wait_sync(60s);
      con.read_into(std::span<void* const>(&bp, 1));
    }
  }
  con.close();
  return 0;
}

namespace {

// ------------------------------------------------------------------ orchestration

struct CtlBlock {
  int fd = -1;
  Ctl* ctl = nullptr;
  CtlBlock() {
    fd = ::memfd_create("shmcast-bench-ctl", 0);  // no CLOEXEC: the roles inherit it
    if (fd < 0) throw std::runtime_error(std::string("memfd_create: ") + std::strerror(errno));
    if (::ftruncate(fd, sizeof(Ctl)) != 0) throw std::runtime_error("ftruncate of the control block failed");
    void* m = ::mmap(nullptr, sizeof(Ctl), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) throw std::runtime_error("mmap of the control block failed");
    ctl = new (m) Ctl();
  }
  ~CtlBlock() {
    if (ctl) ::munmap(ctl, sizeof(Ctl));
    if (fd >= 0) ::close(fd);
  }
};

Ctl* attach_ctl(int fd) {
  void* m = ::mmap(nullptr, sizeof(Ctl), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) throw std::runtime_error("cannot map the control block (fd " + std::to_string(fd) + ")");
  return static_cast<Ctl*>(m);
}

pid_t spawn_role(const std::string& role, int fd, int index) {
  std::vector<std::string> args = {"shmcast-bench", "--role", role, "--ctl-fd", std::to_string(fd), "--index",
                                   std::to_string(index)};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv.data(), environ);
  if (rc != 0) throw std::runtime_error("posix_spawn of the " + role + " failed: " + std::strerror(rc));
  return pid;
}

struct RunResult {
  Config cfg;
  bool ok = false;
  std::string error;
  std::uint64_t payload = 0;
  std::uint32_t tensors = 0;
  std::vector<double> e2e_s, prod_s;
  double seconds = 0, gbps = 0, prod_gbps = 0, min_s = 0, max_s = 0;
  RoleResult producer;
  std::vector<RoleResult> consumers;
  bool bit_exact = false, verified = false;
  std::string first_bad;
};

void copy_role(RoleResult& to, const RoleResult& from) { to = from; }

RunResult run_config(const Config& cfg, std::uint64_t payload, std::uint32_t tensors) {
  static int counter = 0;
  CtlBlock block;
  Ctl* ctl = block.ctl;
  ctl->cfg = cfg;
  std::snprintf(ctl->cfg.region, sizeof ctl->cfg.region, "shmcast-bench-%d-%d", static_cast<int>(::getpid()), counter++);
  shmcast::unlink_region(ctl->cfg.region);

  std::vector<std::pair<pid_t, std::string>> kids;
  kids.emplace_back(spawn_role("producer", block.fd, 0), "producer");
  for (std::uint32_t k = 0; k < cfg.consumers; ++k)
    kids.emplace_back(spawn_role("consumer", block.fd, static_cast<int>(k)), "consumer " + std::to_string(k));

  RunResult res;
  res.cfg = ctl->cfg;
  std::string failure;
  std::size_t alive = kids.size();
  std::vector<bool> reaped(kids.size(), false);
  const std::int64_t deadline = now_ns() + 600'000'000'000;
  while (alive > 0) {
    for (std::size_t i = 0; i < kids.size(); ++i) {
      if (reaped[i]) continue;
      int st = 0;
      if (::waitpid(kids[i].first, &st, WNOHANG) == kids[i].first) {
        reaped[i] = true;
        --alive;
        const bool good = WIFEXITED(st) && WEXITSTATUS(st) == 0;
        if (!good && failure.empty()) {
          const RoleResult& rr = i == 0 ? ctl->producer : ctl->consumer[i - 1];
          failure = kids[i].second + " failed (" +
                    (WIFEXITED(st) ? "exit " + std::to_string(WEXITSTATUS(st)) : "signal " + std::to_string(WTERMSIG(st))) +
                    ")" + (rr.error[0] ? std::string(": ") + rr.error : std::string());
          ctl->abort.store(1, std::memory_order_release);
        }
      }
    }
    if (alive == 0) break;
    if (now_ns() > deadline) {
      failure = "the run took more than 600 s";
      for (std::size_t i = 0; i < kids.size(); ++i)
        if (!reaped[i]) ::kill(kids[i].first, SIGKILL);
    }
    std::this_thread::sleep_for(5ms);
  }
  shmcast::unlink_region(ctl->cfg.region);
  copy_role(res.producer, ctl->producer);
  res.consumers.resize(cfg.consumers);
  for (std::uint32_t k = 0; k < cfg.consumers; ++k) copy_role(res.consumers[k], ctl->consumer[k]);
  if (!failure.empty()) {
    res.error = failure;
    return res;
  }
  res.payload = payload;
  res.tensors = tensors;
  for (int i = cfg.warmup; i < cfg.warmup + cfg.iters; ++i) {
    std::int64_t done = 0;
    for (std::uint32_t k = 0; k < cfg.consumers; ++k) done = std::max<std::int64_t>(done, ctl->t_done[k][i].load());
    res.e2e_s.push_back(static_cast<double>(done - ctl->t_start[i].load()) * 1e-9);
    res.prod_s.push_back(static_cast<double>(ctl->t_prod_end[i].load() - ctl->t_start[i].load()) * 1e-9);
  }
  res.seconds = median(res.e2e_s);
  res.min_s = *std::min_element(res.e2e_s.begin(), res.e2e_s.end());
  res.max_s = *std::max_element(res.e2e_s.begin(), res.e2e_s.end());
  res.gbps = static_cast<double>(payload) / res.seconds * 1e-9;
  res.prod_gbps = static_cast<double>(payload) / median(res.prod_s) * 1e-9;
  if (cfg.verify) {
    res.verified = true;
    res.bit_exact = true;
    for (std::uint32_t k = 0; k < cfg.consumers; ++k) {
      if (!ctl->consumer[k].verified || ctl->consumer[k].mismatches != 0) {
        res.bit_exact = false;
        if (res.first_bad.empty()) res.first_bad = ctl->consumer[k].first_bad;
      }
    }
  }
  res.ok = true;
  return res;
}

double per_gib(double seconds, std::uint64_t bytes) {
  return bytes ? seconds / (static_cast<double>(bytes) / static_cast<double>(1ull << 30)) : 0;
}

json run_json(const RunResult& r) {
  json j;
  j["slot_bytes"] = r.cfg.slot_bytes;
  j["slots"] = r.cfg.slots;
  j["ok"] = r.ok;
  if (!r.ok) {
    j["error"] = r.error;
    return j;
  }
  j["seconds"] = r.seconds;
  j["seconds_min"] = r.min_s;
  j["seconds_max"] = r.max_s;
  j["seconds_all"] = r.e2e_s;
  j["gbps"] = r.gbps;
  j["producer_gbps"] = r.prod_gbps;
  if (r.cfg.verify) j["bit_exact"] = r.bit_exact;
  if (!r.first_bad.empty()) j["first_mismatch"] = r.first_bad;
  const RoleResult& p = r.producer;
  json setup;
  setup["region_bytes"] = p.region_bytes;
  setup["producer_create_s"] = p.create_s;
  setup["producer_pin_s"] = p.pin_s;
  setup["producer_pinned"] = p.pinned != 0;
  setup["producer_create_pin_s_per_gib"] = per_gib(p.create_s + p.pin_s, p.region_bytes);
  setup["pin_s_per_gib"] = per_gib(p.pin_s, p.region_bytes);
  if (!r.consumers.empty()) {
    const RoleResult& c = r.consumers[0];
    setup["consumer_open_s"] = c.create_s;
    setup["consumer_pin_s"] = c.pin_s;
    setup["consumer_pinned"] = c.pinned != 0;
    setup["consumer_open_pin_s_per_gib"] = per_gib(c.create_s, p.region_bytes);  // open_seconds includes the pin
  }
  setup["producer_tensor_setup_s"] = p.setup_s;
  j["setup"] = setup;
  return j;
}

void print_row(const char* k, const std::string& v) { std::printf("  %-34s %s\n", k, v.c_str()); }
std::string fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

// ------------------------------------------------------------------ host mode

double memcpy_gbps(std::uint64_t bytes, int reps) {
  HostBuf a(bytes), b(bytes);
  fill_pattern(a.p, a.n, 3);
  std::vector<double> s;
  for (int i = 0; i < reps + 1; ++i) {
    const std::int64_t t0 = now_ns();
    std::memcpy(b.p, a.p, bytes);
    const std::int64_t t1 = now_ns();
    if (i > 0) s.push_back(static_cast<double>(t1 - t0) * 1e-9);
  }
  if (std::memcmp(a.p, b.p, 4096) != 0) throw std::runtime_error("memcpy check failed");
  return static_cast<double>(bytes) / median(s) * 1e-9;
}

int run_host(Config cfg, bool as_json, const std::vector<std::uint64_t>& sweep) {
  const double mgbps = memcpy_gbps(cfg.bytes, 3);
  const std::uint32_t ntensors = static_cast<std::uint32_t>(host_manifest(cfg).size());
  std::vector<std::uint64_t> slots = sweep.empty() ? std::vector<std::uint64_t>{cfg.slot_bytes} : sweep;
  std::vector<RunResult> runs;
  for (std::uint64_t s : slots) {
    Config c = cfg;
    c.slot_bytes = s;
    c.checksums = false;
    if (!runs.empty()) c.roundtrip_iters = 0;
    runs.push_back(run_config(c, cfg.bytes, ntensors));
    if (!runs.back().ok) {
      std::fprintf(stderr, "shmcast-bench: %s\n", runs.back().error.c_str());
      return 1;
    }
  }
  std::optional<RunResult> cs;
  if (cfg.checksums) {
    Config c = cfg;
    c.checksums = true;
    c.roundtrip_iters = 0;
    cs = run_config(c, cfg.bytes, ntensors);
    if (!cs->ok) {
      std::fprintf(stderr, "shmcast-bench: %s\n", cs->error.c_str());
      return 1;
    }
  }
  const RunResult& r = runs.front();
  const RoleResult& p = r.producer;
  if (as_json) {
    json j = run_json(r);
    j["mode"] = "host";
    j["bytes"] = cfg.bytes;
    j["tensors"] = ntensors;
    j["consumers"] = cfg.consumers;
    j["iters"] = cfg.iters;
    j["memcpy_gbps"] = mgbps;
    j["ratio"] = r.gbps / mgbps;
    j["roundtrip_bytes"] = cfg.roundtrip_bytes;
    j["roundtrip_iters"] = p.rt_count;
    j["roundtrip_us_median"] = p.rt_median_us;
    j["roundtrip_us_p99"] = p.rt_p99_us;
    j["roundtrip_us_min"] = p.rt_min_us;
    j["roundtrip_us_mean"] = p.rt_mean_us;
    j["create_s"] = p.create_s;
    j["create_s_per_gib"] = per_gib(p.create_s, p.region_bytes);
    j["cpus"] = std::thread::hardware_concurrency();
    j["huge_pages"] = g_huge_pages;
    if (cs) {
      j["checksums_gbps"] = cs->gbps;
      j["checksums_cost"] = 1.0 - cs->gbps / r.gbps;
    }
    if (!sweep.empty()) {
      json arr = json::array();
      for (const auto& x : runs) {
        json e = run_json(x);
        e["ratio"] = x.gbps / mgbps;
        arr.push_back(e);
      }
      j["sweep"] = arr;
    }
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("shmcast-bench --mode host: %s in %u tensors, %u consumer(s), %u x %s slots, median of %d syncs\n",
                size_text(cfg.bytes).c_str(), ntensors, cfg.consumers, r.cfg.slots, size_text(r.cfg.slot_bytes).c_str(),
                cfg.iters);
    print_row("end to end", fmt("%.3f s", r.seconds) + fmt("  (min %.3f", r.min_s) + fmt(", max %.3f)", r.max_s));
    print_row("throughput", fmt("%.2f GB/s", r.gbps));
    print_row("single-thread memcpy", fmt("%.2f GB/s", mgbps));
    print_row("ratio to memcpy", fmt("%.2f", r.gbps / mgbps));
    if (cs) print_row("with checksums (XXH3 per slot)", fmt("%.2f GB/s", cs->gbps) + fmt("  (cost %.0f%%)", 100.0 * (1.0 - cs->gbps / r.gbps)));
    if (p.rt_count > 0)
      print_row((size_text(cfg.roundtrip_bytes) + " sync round trip").c_str(),
                fmt("median %.1f us", p.rt_median_us) + fmt(", p99 %.1f us", p.rt_p99_us) +
                    fmt(", min %.1f us", p.rt_min_us) + " (" + std::to_string(p.rt_count) + " syncs)");
    print_row("create region", fmt("%.4f s", p.create_s) + " for " + size_text(p.region_bytes));
    if (r.cfg.verify) print_row("bit exact", r.bit_exact ? "yes" : "NO (" + r.first_bad + ")");
    if (!sweep.empty()) {
      std::printf("\n  %-10s %10s %10s %8s\n", "slot", "seconds", "GB/s", "ratio");
      for (const auto& x : runs)
        std::printf("  %-10s %10.4f %10.2f %8.2f\n", size_text(x.cfg.slot_bytes).c_str(), x.seconds, x.gbps, x.gbps / mgbps);
    }
  }
  for (const auto& x : runs)
    if (x.cfg.verify && !x.bit_exact) return 1;
  return 0;
}

// ------------------------------------------------------------------ cuda mode

int run_cuda(Config cfg, bool as_json, const std::vector<std::uint64_t>& sweep, std::uint64_t ceiling_bytes, int reps) {
  if (!bench_has_cuda()) {
    std::fprintf(stderr, "shmcast-bench: --mode cuda needs a build with CUDA (-DSHMCAST_WITH_CUDA=ON)\n");
    return 2;
  }
  if (!shmcast::cuda_available()) {
    std::fprintf(stderr, "shmcast-bench: --mode cuda needs a GPU: %s\n", shmcast::cuda_unavailable_reason().c_str());
    return 2;
  }
  const auto specs = manifest_by_name(cfg.manifest);
  std::uint64_t payload = 0;
  for (const auto& s : specs) payload += s.nbytes();
  if (specs.size() > static_cast<std::size_t>(kMaxTensors)) {
    std::fprintf(stderr, "shmcast-bench: manifest has too many tensors\n");
    return 1;
  }
  const Ceilings ceil = measure_ceilings(cfg.producer_device, cfg.consumer_device, ceiling_bytes, reps);
  if (!ceil.ok) {
    std::fprintf(stderr, "shmcast-bench: measuring the copy ceilings failed: %s\n", ceil.error.c_str());
    return 1;
  }
  std::vector<std::uint64_t> slots = sweep.empty() ? std::vector<std::uint64_t>{cfg.slot_bytes} : sweep;
  std::vector<RunResult> runs;
  for (std::uint64_t s : slots) {
    Config c = cfg;
    c.slot_bytes = s;
    c.checksums = false;
    runs.push_back(run_config(c, payload, static_cast<std::uint32_t>(specs.size())));
    if (!runs.back().ok) {
      std::fprintf(stderr, "shmcast-bench: slot %s: %s\n", size_text(s).c_str(), runs.back().error.c_str());
      if (sweep.empty()) return 1;
    }
  }
  std::optional<RunResult> cs;
  if (cfg.checksums) {
    Config c = cfg;
    c.checksums = true;
    cs = run_config(c, payload, static_cast<std::uint32_t>(specs.size()));
  }
  const double ceiling = ceil.both_gbps;
  auto ceil_json = [&] {
    json c;
    c["bytes"] = ceil.bytes;
    c["reps"] = ceil.reps;
    c["d2h_gbps"] = ceil.d2h_gbps;
    c["h2d_gbps"] = ceil.h2d_gbps;
    c["concurrent_gbps"] = ceil.both_gbps;
    c["concurrent_d2h_gbps"] = ceil.both_d2h_gbps;
    c["concurrent_h2d_gbps"] = ceil.both_h2d_gbps;
    c["h2d_2streams_gbps"] = ceil.h2d2_gbps;
    c["concurrent_h2d_2streams_gbps"] = ceil.both2_gbps;
    c["concurrent_h2d_2streams_d2h_gbps"] = ceil.both2_d2h_gbps;
    c["concurrent_h2d_2streams_h2d_gbps"] = ceil.both2_h2d_gbps;
    c["pin_s_per_gib"] = ceil.pin_s_per_gib;
    return c;
  };
  const RunResult& r = runs.front();
  if (as_json) {
    json j = run_json(r);
    j["mode"] = "cuda";
    j["manifest"] = cfg.manifest;
    j["tensors"] = specs.size();
    j["bytes"] = payload;
    j["consumers"] = cfg.consumers;
    j["iters"] = cfg.iters;
    j["staging"] = cfg.staging;
    j["producer_device"] = cfg.producer_device;
    j["consumer_device"] = cfg.consumer_device;
    j["device_name"] = ceil.device_name;
    if (cfg.consumer_device != cfg.producer_device) j["consumer_device_name"] = ceil.consumer_device_name;
    const char* cbm = std::getenv("SHMCAST_CUDA_CALLBACKS");
    j["callbacks"] = cbm ? cbm : "side";
    const char* d2h = std::getenv("SHMCAST_CUDA_D2H_STREAMS");
    const char* h2d = std::getenv("SHMCAST_CUDA_H2D_STREAMS");
    j["d2h_streams_env"] = d2h ? d2h : "";
    j["h2d_streams_env"] = h2d ? h2d : "";
    j["ceilings"] = ceil_json();
    j["ratio"] = r.ok ? r.gbps / ceiling : 0.0;
    if (cs) {
      j["checksums_gbps"] = cs->ok ? cs->gbps : 0.0;
      if (!cs->ok) j["checksums_error"] = cs->error;
    }
    if (!sweep.empty()) {
      json arr = json::array();
      for (const auto& x : runs) {
        json e = run_json(x);
        if (x.ok) e["ratio"] = x.gbps / ceiling;
        arr.push_back(e);
      }
      j["sweep"] = arr;
    }
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("shmcast-bench --mode cuda: %s, %zu tensors, %.3f GB; producer on GPU %d, %u consumer(s) on GPU %d (%s)\n",
                cfg.manifest, specs.size(), static_cast<double>(payload) * 1e-9, cfg.producer_device, cfg.consumers,
                cfg.consumer_device, cfg.staging ? "staging buffer" : "per-tensor device buffers");
    std::printf("  device: %s\n", ceil.device_name.c_str());
    std::printf("  single-process ceilings (pinned, %s per copy, median of %d):\n", size_text(ceil.bytes).c_str(), ceil.reps);
    print_row("  D2H alone", fmt("%.2f GB/s", ceil.d2h_gbps));
    print_row("  H2D alone", fmt("%.2f GB/s", ceil.h2d_gbps));
    print_row("  D2H + H2D at once (each way)", fmt("%.2f GB/s", ceil.both_gbps) + fmt("  (D2H %.2f", ceil.both_d2h_gbps) +
                                                   fmt(", H2D %.2f)", ceil.both_h2d_gbps));
    print_row("  H2D alone, 2 streams", fmt("%.2f GB/s", ceil.h2d2_gbps));
    print_row("  D2H + H2D on 2 streams at once", fmt("%.2f GB/s", ceil.both2_gbps) + fmt("  (D2H %.2f", ceil.both2_d2h_gbps) +
                                                      fmt(", H2D %.2f)", ceil.both2_h2d_gbps));
    if (r.ok) {
      std::printf("  two processes, %u x %s slots, median of %d syncs after %d warm-up:\n", r.cfg.slots,
                  size_text(r.cfg.slot_bytes).c_str(), cfg.iters, cfg.warmup);
      print_row("  end to end", fmt("%.4f s", r.seconds) + fmt("  (min %.4f", r.min_s) + fmt(", max %.4f)", r.max_s));
      print_row("  throughput", fmt("%.2f GB/s", r.gbps) + fmt("  = %.3f x concurrent ceiling", r.gbps / ceiling));
      print_row("  producer (send -> end_sync)", fmt("%.2f GB/s", r.prod_gbps));
      print_row("  bit exact", r.cfg.verify ? (r.bit_exact ? "yes" : "NO (" + r.first_bad + ")") : "not checked");
      const RoleResult& p = r.producer;
      const RoleResult& c = r.consumers[0];
      print_row("  region", size_text(p.region_bytes));
      print_row("  producer create + pin", fmt("%.3f s", p.create_s) + fmt(" + %.3f s", p.pin_s) +
                                              fmt(" = %.3f s/GiB", per_gib(p.create_s + p.pin_s, p.region_bytes)));
      print_row("  consumer open (incl. pin)", fmt("%.3f s", c.create_s) + fmt(" (pin %.3f s)", c.pin_s) +
                                                  fmt(" = %.3f s/GiB", per_gib(c.create_s, p.region_bytes)));
    }
    if (cs) print_row("  with checksums", cs->ok ? fmt("%.2f GB/s", cs->gbps) : cs->error);
    if (!sweep.empty()) {
      std::printf("\n  %-8s %6s %10s %10s %10s %9s %10s\n", "slot", "slots", "seconds", "GB/s", "x ceiling", "bit-exact",
                  "pin s/GiB");
      for (const auto& x : runs) {
        if (!x.ok) {
          std::printf("  %-8s %6u  failed: %s\n", size_text(x.cfg.slot_bytes).c_str(), x.cfg.slots, x.error.c_str());
          continue;
        }
        std::printf("  %-8s %6u %10.4f %10.2f %10.3f %9s %10.3f\n", size_text(x.cfg.slot_bytes).c_str(), x.cfg.slots,
                    x.seconds, x.gbps, x.gbps / ceiling, x.bit_exact ? "yes" : "NO",
                    per_gib(x.producer.pin_s, x.producer.region_bytes));
      }
    }
  }
  for (const auto& x : runs)
    if (!x.ok || (x.cfg.verify && !x.bit_exact)) return 1;
  return 0;
}

int run_role(const std::string& role, int fd, int index) {
  Ctl* ctl = attach_ctl(fd);
  g_huge_pages = ctl->cfg.huge_pages;
  const bool producer = role == "producer";
  RoleResult& rr = producer ? ctl->producer : ctl->consumer[index];
  try {
    int rc;
    if (ctl->cfg.mode == Mode::kCuda)
      rc = producer ? cuda_producer(ctl) : cuda_consumer(ctl, index);
    else
      rc = producer ? host_producer(ctl) : host_consumer(ctl, index);
    rr.status = 1;
    return rc;
  } catch (const std::exception& e) {
    std::snprintf(rr.error, sizeof rr.error, "%s", e.what());
    rr.status = 2;
    ctl->abort.store(1);
    std::fprintf(stderr, "shmcast-bench %s: %s\n", role.c_str(), e.what());
    return 3;
  }
}

}  // namespace
}  // namespace bench

int main(int argc, char** argv) {
  using namespace bench;
  CLI::App app{"shmcast-bench: throughput and round-trip latency of shmcast between processes"};
  std::string mode = "auto", slot = "", bytes = "4G", tensor = "256M", sweep_s, ceiling = "512M", manifest = "qwen2.5-3b";
  std::string role;
  int ctl_fd = -1, index = 0;
  Config cfg;
  bool as_json = false, no_verify = false;
  int reps = 10;
  app.add_option("--mode", mode, "auto (cuda with a GPU, else host), host or cuda")
      ->check(CLI::IsMember({"auto", "host", "cuda"}));
  app.add_flag("--json", as_json, "print one JSON object");
  app.add_option("--bytes", bytes, "host: bytes per sync (default 4G)");
  app.add_option("--tensor-bytes", tensor, "host: size of each tensor (default 256M)");
  app.add_option("--slot-bytes", slot, "slot size (default: host 64M, cuda the library default)");
  app.add_option("--slots", cfg.slots, "number of slots K (default 2)");
  app.add_option("--consumers", cfg.consumers, "consumer processes (default 1)")->check(CLI::Range(1, kMaxConsumers));
  app.add_option("--iters", cfg.iters, "timed syncs (median reported; default 5)")->check(CLI::Range(1, 48));
  app.add_option("--warmup", cfg.warmup, "untimed syncs first (default 1)")->check(CLI::Range(0, 8));
  app.add_flag("--checksums", cfg.checksums, "also measure with per-slot XXH3 checksums");
  app.add_option("--roundtrip-iters", cfg.roundtrip_iters, "host: small-sync round trips (default 2000; 0 skips)")
      ->check(CLI::Range(0, kMaxRoundTrips));
  app.add_option("--manifest", manifest, "cuda: tensor set (qwen2.5-3b)");
  app.add_flag("--staging", cfg.staging, "cuda: consumer reads into the library's staging buffer");
  app.add_option("--producer-device", cfg.producer_device, "cuda: producer GPU (default 0)");
  app.add_option("--consumer-device", cfg.consumer_device, "cuda: consumer GPU (default 0: same GPU)");
  app.add_option("--sweep-slots", sweep_s, "run once per slot size, e.g. 64M,128M,256M,512M,1G");
  app.add_option("--ceiling-bytes", ceiling, "cuda: bytes per copy for the single-process ceilings (default 512M)");
  app.add_option("--ceiling-reps", reps, "cuda: repetitions of each ceiling copy (default 10)");
  app.add_flag("--no-verify", no_verify, "skip the bit-exactness check");
  bool huge = false;
  app.add_flag("--huge-pages", huge, "host: MADV_HUGEPAGE on the bench's own buffers (default: 4 KiB pages)");
  app.add_option("--role", role)->group("");
  app.add_option("--ctl-fd", ctl_fd)->group("");
  app.add_option("--index", index)->group("");
  CLI11_PARSE(app, argc, argv);

  if (!role.empty()) return run_role(role, ctl_fd, index);
  g_huge_pages = huge;
  cfg.huge_pages = huge;

  try {
    cfg.verify = !no_verify;
    cfg.bytes = parse_size(bytes);
    cfg.tensor_bytes = parse_size(tensor);
    std::snprintf(cfg.manifest, sizeof cfg.manifest, "%s", manifest.c_str());
    std::vector<std::uint64_t> sweep;
    if (!sweep_s.empty()) {
      std::size_t a = 0;
      while (a <= sweep_s.size()) {
        const std::size_t b = std::min(sweep_s.find(',', a), sweep_s.size());
        if (b > a) sweep.push_back(parse_size(sweep_s.substr(a, b - a)));
        a = b + 1;
      }
    }
    if (mode == "auto") mode = shmcast::cuda_available() ? "cuda" : "host";
    if (mode == "host") {
      cfg.mode = Mode::kHost;
      cfg.slot_bytes = slot.empty() ? (64ull << 20) : parse_size(slot);
      if (cfg.tensor_bytes == 0 || cfg.bytes == 0) throw std::invalid_argument("--bytes and --tensor-bytes must be > 0");
      return run_host(cfg, as_json, sweep);
    }
    cfg.mode = Mode::kCuda;
    cfg.roundtrip_iters = 0;
    cfg.slot_bytes = slot.empty() ? shmcast::ProducerOptions{}.slot_bytes : parse_size(slot);
    return run_cuda(cfg, as_json, sweep, parse_size(ceiling), reps);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shmcast-bench: %s\n", e.what());
    return 1;
  }
}
