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

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "bench.hpp"
#include "content.hpp"

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

int corrupt_sync() {
  const char* e = std::getenv("SHMCAST_BENCH_CORRUPT");
  return e && *e ? std::atoi(e) : -1;
}

Stat stat_of(std::vector<double> v) {
  Stat s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  s.min = v.front();
  s.max = v.back();
  s.median = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  s.n = static_cast<int>(n);
  return s;
}

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

namespace {

std::uint64_t key_of(const Config& c, int sync, std::size_t tensor) {
  return content::key(c.seed, static_cast<std::uint64_t>(sync), tensor);
}

// Round trip j of the run: back to back first, then after idle gaps.
std::uint64_t roundtrip_key(const Config& c, int j) {
  const int b2b = c.roundtrip_warmup() + c.roundtrip_iters;
  return j < b2b ? content::key(c.seed, content::kRoundTrip + static_cast<std::uint64_t>(j), 0)
                 : content::key(c.seed, content::kRoundTripIdle + static_cast<std::uint64_t>(j - b2b), 0);
}

// Spins (no yield: the consumer must still be spinning in wait_sync when the
// back-to-back round trip starts) until pred(); sleeps after a second of it.
void spin_until(Ctl* ctl, const char* what, const std::function<bool()>& pred) {
  const std::int64_t t0 = now_ns();
  for (std::uint64_t n = 0; !pred(); ++n) {
    if ((n & 1023) == 0) {
      if (ctl->abort.load(std::memory_order_acquire)) throw std::runtime_error(std::string("aborted while waiting for ") + what);
      const std::int64_t t = now_ns();
      if (t - t0 > 60'000'000'000) throw std::runtime_error(std::string("timed out waiting for ") + what);
      if (t - t0 > 1'000'000'000) std::this_thread::sleep_for(50us);
    }
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
}

void summarize_us(std::vector<double> us, double* med, double* p99, double* mn, double* mx, double* mean,
                  std::int32_t* count) {
  if (us.empty()) return;
  *med = median(us);
  *p99 = percentile(us, 0.99);
  *mn = *std::min_element(us.begin(), us.end());
  *mx = *std::max_element(us.begin(), us.end());
  double sum = 0;
  for (double x : us) sum += x;
  *mean = sum / static_cast<double>(us.size());
  *count = static_cast<std::int32_t>(us.size());
}

}  // namespace

int host_producer(Ctl* ctl) {
  const Config& c = ctl->cfg;
  RoleResult& r = ctl->producer;
  const auto specs = host_manifest(c);
  const std::int64_t t0 = now_ns();
  std::vector<std::unique_ptr<HostBuf>> src;
  std::vector<const void*> ptrs;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    src.push_back(std::make_unique<HostBuf>(specs[i].nbytes()));
    ptrs.push_back(src.back()->p);
  }
  r.setup_s = static_cast<double>(now_ns() - t0) * 1e-9;

  shmcast::Producer p = shmcast::Producer::create(c.region, producer_options(c, shmcast::Pin::kNo, shmcast::CopyEngine::kHost));
  r.create_s = p.create_seconds();
  r.region_bytes = p.region_bytes();
  ctl->region_ready.store(1, std::memory_order_release);
  p.wait_for_consumers(c.consumers, 60s);

  for (int i = 0; i < c.syncs(); ++i) {
    // Fresh bytes for this sync, outside the timed region.
    for (std::size_t t = 0; t < specs.size(); ++t) content::fill(src[t]->p, src[t]->n, key_of(c, i, t));
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
  // Back to back (the consumer is still inside the doorbell's spin window when
  // the sync comes), then each after an idle gap longer than that window (the
  // consumer sleeps on the futex, as between training steps). Fresh bytes
  // every time; the consumer checks them before it waits for the next one.
  if (c.roundtrip_iters > 0) {
    std::vector<shmcast::TensorSpec> rt{{"rt", shmcast::DType::kU8, {static_cast<std::int64_t>(c.roundtrip_bytes)}}};
    std::vector<std::uint8_t> buf(c.roundtrip_bytes);
    const void* bp = buf.data();
    int j = 0;
    auto phase = [&](int warm, int iters, int gap_us, std::vector<double>& us) {
      us.reserve(static_cast<std::size_t>(iters));
      for (int k = 0; k < warm + iters; ++k, ++j) {
        content::fill(buf.data(), buf.size(), roundtrip_key(c, j));
        spin_until(ctl, "the consumer's round trip", [&] {
          for (std::uint32_t q = 0; q < c.consumers; ++q)
            if (ctl->rt_ready[q].load(std::memory_order_acquire) <= j) return false;
          return true;
        });
        if (gap_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(gap_us));
        const std::int64_t a = now_ns();
        p.send(rt, std::span<const void* const>(&bp, 1));
        p.wait_drained(10s);
        const std::int64_t b = now_ns();
        if (k >= warm) us.push_back(static_cast<double>(b - a) * 1e-3);
      }
    };
    std::vector<double> b2b, idle;
    phase(c.roundtrip_warmup(), c.roundtrip_iters, 0, b2b);
    phase(c.roundtrip_idle_warmup(), c.roundtrip_idle_iters, c.roundtrip_idle_gap_us, idle);
    summarize_us(b2b, &r.rt_median_us, &r.rt_p99_us, &r.rt_min_us, &r.rt_max_us, &r.rt_mean_us, &r.rt_count);
    summarize_us(idle, &r.rti_median_us, &r.rti_p99_us, &r.rti_min_us, &r.rti_max_us, &r.rti_mean_us, &r.rti_count);
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
    ctl->t_ready[index][i].store(now_ns(), std::memory_order_release);
    con.wait_sync(120s);
    con.read_into(ptrs);
    ctl->t_done[index][i].store(now_ns(), std::memory_order_release);
    if (index == 0 && i == corrupt_sync() && !dst.empty() && dst[0]->n > 0) dst[0]->p[dst[0]->n / 3] ^= 1;
    // Every byte of this sync, after the timer stopped.
    std::int32_t bad = 0;
    for (std::size_t t = 0; t < specs.size(); ++t) {
      if (content::count_bad(dst[t]->p, dst[t]->n, key_of(c, i, t)) != 0) {
        if (r.mismatches == 0 && bad == 0)
          std::snprintf(r.first_bad, sizeof r.first_bad, "sync %d, tensor %s", i, specs[t].name.c_str());
        ++bad;
      }
    }
    ctl->sync_bad[index][i] = bad;
    r.mismatches += bad;
    ++r.checked;
    if (bad == 0) ++r.verified;
  }
  if (c.roundtrip_iters > 0) {
    std::vector<std::uint8_t> buf(c.roundtrip_bytes);
    void* bp = buf.data();
    for (int j = 0; j < c.roundtrips_total(); ++j) {
      ctl->rt_ready[index].store(j + 1, std::memory_order_release);
      con.wait_sync(60s);
      con.read_into(std::span<void* const>(&bp, 1));
      ++r.rt_checked;
      if (content::count_bad(buf.data(), buf.size(), roundtrip_key(c, j)) == 0) {
        ++r.rt_verified;
      } else if (r.first_bad[0] == 0) {
        std::snprintf(r.first_bad, sizeof r.first_bad, "round trip %d", j);
      }
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
  Stat e2e;   // seconds per sync, end to end
  Stat gbps;  // payload / those seconds (min is the slowest sync)
  Stat prod_gbps;
  RoleResult producer;
  std::vector<RoleResult> consumers;
  // Verification: a sync counts as verified when every consumer found every
  // byte of it equal to what was sent.
  int timed_verified = 0, timed_total = 0, warm_verified = 0, warm_total = 0;
  int rt_verified = 0, rt_total = 0;  // round trips, summed over consumers
  bool bit_exact = false;             // all of the above
  std::string first_bad;
  // The ceiling measured for this configuration in the same run (GB/s):
  // host single-thread memcpy, cuda concurrent pinned D2H + H2D.
  Stat ceiling;
  std::optional<Ceilings> cuda;
};

Stat gbps_of(std::uint64_t payload, const std::vector<double>& secs) {
  std::vector<double> g;
  for (double s : secs) g.push_back(static_cast<double>(payload) / s * 1e-9);
  return stat_of(g);
}

RunResult run_config(const Config& cfg, std::uint64_t payload, std::uint32_t tensors) {
  static int counter = 0;
  CtlBlock block;
  Ctl* ctl = block.ctl;
  ctl->cfg = cfg;
  if (ctl->cfg.seed == 0) ctl->cfg.seed = content::fresh_seed();
  std::snprintf(ctl->cfg.region, sizeof ctl->cfg.region, "shmcast-bench-%d-%d", static_cast<int>(::getpid()), counter++);
  for (auto& row : ctl->sync_bad)
    for (auto& x : row) x = -1;
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
  res.producer = ctl->producer;
  res.consumers.resize(cfg.consumers);
  for (std::uint32_t k = 0; k < cfg.consumers; ++k) res.consumers[k] = ctl->consumer[k];
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
  res.e2e = stat_of(res.e2e_s);
  res.gbps = gbps_of(payload, res.e2e_s);
  res.prod_gbps = gbps_of(payload, res.prod_s);
  for (int i = 0; i < cfg.syncs(); ++i) {
    bool good = true;
    for (std::uint32_t k = 0; k < cfg.consumers; ++k) good = good && ctl->sync_bad[k][i] == 0;
    if (i < cfg.warmup) {
      ++res.warm_total;
      res.warm_verified += good;
    } else {
      ++res.timed_total;
      res.timed_verified += good;
    }
  }
  for (std::uint32_t k = 0; k < cfg.consumers; ++k) {
    res.rt_verified += ctl->consumer[k].rt_verified;
    res.rt_total += cfg.roundtrips_total();
    if (res.first_bad.empty()) res.first_bad = ctl->consumer[k].first_bad;
  }
  res.bit_exact = res.timed_verified == res.timed_total && res.warm_verified == res.warm_total &&
                  res.rt_verified == res.rt_total;
  res.ok = true;
  return res;
}

double per_gib(double seconds, std::uint64_t bytes) {
  return bytes ? seconds / (static_cast<double>(bytes) / static_cast<double>(1ull << 30)) : 0;
}

std::string frac(int a, int b) { return std::to_string(a) + "/" + std::to_string(b); }

void put_stat(json& j, const std::string& key, const Stat& s) {
  j[key] = s.median;
  j[key + "_min"] = s.min;
  j[key + "_max"] = s.max;
}

json ceilings_json(const Ceilings& c) {
  json j;
  j["bytes"] = c.bytes;
  j["reps"] = c.reps;
  put_stat(j, "d2h_gbps", c.d2h);
  put_stat(j, "h2d_gbps", c.h2d);
  put_stat(j, "concurrent_gbps", c.both);
  put_stat(j, "concurrent_d2h_gbps", c.both_d2h);
  put_stat(j, "concurrent_h2d_gbps", c.both_h2d);
  put_stat(j, "h2d_2streams_gbps", c.h2d2);
  put_stat(j, "concurrent_h2d_2streams_gbps", c.both2);
  put_stat(j, "concurrent_h2d_2streams_d2h_gbps", c.both2_d2h);
  put_stat(j, "concurrent_h2d_2streams_h2d_gbps", c.both2_h2d);
  j["pin_s_per_gib"] = c.pin_s_per_gib;
  return j;
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
  j["reps"] = r.cfg.iters;
  j["warmup"] = r.cfg.warmup;
  j["seed"] = r.cfg.seed;
  j["seconds"] = r.e2e.median;
  j["seconds_min"] = r.e2e.min;
  j["seconds_max"] = r.e2e.max;
  j["seconds_all"] = r.e2e_s;
  put_stat(j, "gbps", r.gbps);
  put_stat(j, "producer_gbps", r.prod_gbps);
  // Every timed sync (and warm-up, and round trip): fresh random bytes,
  // compared byte for byte by every consumer after the timer stopped.
  j["verified"] = frac(r.timed_verified, r.timed_total);
  j["verified_syncs"] = r.timed_verified;
  j["timed_syncs"] = r.timed_total;
  j["warmup_verified"] = frac(r.warm_verified, r.warm_total);
  if (r.rt_total > 0) j["roundtrip_verified"] = frac(r.rt_verified, r.rt_total);
  j["bit_exact"] = r.bit_exact;
  if (!r.first_bad.empty()) j["first_mismatch"] = r.first_bad;
  put_stat(j, "ceiling_gbps", r.ceiling);
  j["ratio"] = r.ceiling.median > 0 ? r.gbps.median / r.ceiling.median : 0.0;
  if (r.cuda) j["ceilings"] = ceilings_json(*r.cuda);
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
  setup["samples"] = 1;  // one producer and one open per configuration
  j["setup"] = setup;
  return j;
}

void print_row(const char* k, const std::string& v) { std::printf("  %-36s %s\n", k, v.c_str()); }
std::string fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}
// "6.12 (min 5.40, max 6.61)"
std::string stat_text(const char* f, const Stat& s) {
  return fmt(f, s.median) + " (min " + fmt(f, s.min) + ", max " + fmt(f, s.max) + ")";
}

std::string verified_text(const RunResult& r) {
  std::string t = frac(r.timed_verified, r.timed_total) + " timed syncs";
  if (r.warm_total) t += " + " + frac(r.warm_verified, r.warm_total) + " warm-up";
  if (r.rt_total) t += " + " + frac(r.rt_verified, r.rt_total) + " round trips";
  t += r.cfg.consumers > 1 ? ", every byte, every consumer" : ", every byte";
  if (!r.first_bad.empty()) t += "; FIRST MISMATCH: " + r.first_bad;
  return t;
}

// ------------------------------------------------------------------ host mode

// Single-thread memcpy of `bytes` between two faulted-in buffers, GB/s over
// `reps` copies after one untimed.
Stat memcpy_gbps(std::uint64_t bytes, int reps) {
  HostBuf a(bytes), b(bytes);
  content::fill(a.p, a.n, 3);
  std::vector<double> g;
  for (int i = 0; i < reps + 1; ++i) {
    const std::int64_t t0 = now_ns();
    std::memcpy(b.p, a.p, bytes);
    const std::int64_t t1 = now_ns();
    if (i > 0) g.push_back(static_cast<double>(bytes) / static_cast<double>(t1 - t0));
  }
  if (content::count_bad(b.p, b.n, 3) != 0) throw std::runtime_error("memcpy check failed");
  return stat_of(g);
}

int run_host(Config cfg, bool as_json, const std::vector<std::uint64_t>& sweep, int ceiling_reps) {
  const std::uint32_t ntensors = static_cast<std::uint32_t>(host_manifest(cfg).size());
  std::vector<std::uint64_t> slots = sweep.empty() ? std::vector<std::uint64_t>{cfg.slot_bytes} : sweep;
  // One configuration: its ceiling (memcpy of the same bytes) right before it.
  auto one = [&](Config c) {
    const Stat m = memcpy_gbps(c.bytes, ceiling_reps);
    RunResult r = run_config(c, c.bytes, ntensors);
    r.ceiling = m;
    return r;
  };
  std::vector<RunResult> runs;
  for (std::uint64_t s : slots) {
    Config c = cfg;
    c.slot_bytes = s;
    c.checksums = false;
    if (!runs.empty()) c.roundtrip_iters = 0;
    runs.push_back(one(c));
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
    cs = one(c);
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
    j["ceiling_reps"] = ceiling_reps;
    put_stat(j, "memcpy_gbps", r.ceiling);
    j["roundtrip_bytes"] = cfg.roundtrip_bytes;
    j["roundtrip_iters"] = p.rt_count;
    j["roundtrip_us_median"] = p.rt_median_us;
    j["roundtrip_us_p99"] = p.rt_p99_us;
    j["roundtrip_us_min"] = p.rt_min_us;
    j["roundtrip_us_max"] = p.rt_max_us;
    j["roundtrip_us_mean"] = p.rt_mean_us;
    j["roundtrip_idle_gap_us"] = cfg.roundtrip_idle_gap_us;
    j["roundtrip_idle_iters"] = p.rti_count;
    j["roundtrip_idle_us_median"] = p.rti_median_us;
    j["roundtrip_idle_us_p99"] = p.rti_p99_us;
    j["roundtrip_idle_us_min"] = p.rti_min_us;
    j["roundtrip_idle_us_max"] = p.rti_max_us;
    j["roundtrip_idle_us_mean"] = p.rti_mean_us;
    j["create_s"] = p.create_s;
    j["create_s_per_gib"] = per_gib(p.create_s, p.region_bytes);
    j["cpus"] = std::thread::hardware_concurrency();
    j["huge_pages"] = g_huge_pages;
    if (cs) {
      json e = run_json(*cs);
      put_stat(e, "memcpy_gbps", cs->ceiling);
      j["checksums"] = e;
      j["checksums_gbps"] = cs->gbps.median;
      j["checksums_cost"] = 1.0 - cs->gbps.median / r.gbps.median;
    }
    if (!sweep.empty()) {
      json arr = json::array();
      for (const auto& x : runs) {
        json e = run_json(x);
        put_stat(e, "memcpy_gbps", x.ceiling);
        arr.push_back(e);
      }
      j["sweep"] = arr;
    }
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("shmcast-bench --mode host: %s in %u tensors, %u consumer(s), %u x %s slots, %d timed syncs after %d "
                "warm-up, fresh random bytes each\n",
                size_text(cfg.bytes).c_str(), ntensors, cfg.consumers, r.cfg.slots, size_text(r.cfg.slot_bytes).c_str(),
                cfg.iters, cfg.warmup);
    print_row("end to end, s", stat_text("%.3f", r.e2e));
    print_row("throughput, GB/s", stat_text("%.2f", r.gbps));
    print_row("single-thread memcpy, GB/s", stat_text("%.2f", r.ceiling) + " over " + std::to_string(r.ceiling.n) +
                                                " copies of " + size_text(cfg.bytes) + ", just before");
    print_row("ratio to memcpy (median / median)", fmt("%.2f", r.gbps.median / r.ceiling.median));
    print_row("verified", verified_text(r));
    if (cs) {
      print_row("with checksums (XXH3 per slot), GB/s", stat_text("%.2f", cs->gbps));
      print_row("  its memcpy, GB/s", stat_text("%.2f", cs->ceiling) + fmt("; ratio %.2f", cs->gbps.median / cs->ceiling.median));
      print_row("  verified", verified_text(*cs));
    }
    if (p.rt_count > 0) {
      const std::string sz = size_text(cfg.roundtrip_bytes);
      print_row((sz + " round trip, back to back").c_str(),
                fmt("median %.1f us", p.rt_median_us) + fmt(", min %.1f", p.rt_min_us) + fmt(", p99 %.1f", p.rt_p99_us) +
                    fmt(", max %.1f", p.rt_max_us) + " (" + std::to_string(p.rt_count) + ")");
      print_row((sz + " round trip after " + std::to_string(cfg.roundtrip_idle_gap_us) + " us idle").c_str(),
                fmt("median %.1f us", p.rti_median_us) + fmt(", min %.1f", p.rti_min_us) +
                    fmt(", p99 %.1f", p.rti_p99_us) + fmt(", max %.1f", p.rti_max_us) + " (" +
                    std::to_string(p.rti_count) + ")");
    }
    print_row("create region (1 sample)", fmt("%.4f s", p.create_s) + " for " + size_text(p.region_bytes));
    if (!sweep.empty()) {
      std::printf("\n  %-8s %8s %8s %8s %8s %8s %8s %7s %s\n", "slot", "GB/s", "min", "max", "memcpy", "min", "max",
                  "ratio", "verified");
      for (const auto& x : runs)
        std::printf("  %-8s %8.2f %8.2f %8.2f %8.2f %8.2f %8.2f %7.2f %s\n", size_text(x.cfg.slot_bytes).c_str(),
                    x.gbps.median, x.gbps.min, x.gbps.max, x.ceiling.median, x.ceiling.min, x.ceiling.max,
                    x.gbps.median / x.ceiling.median, frac(x.timed_verified, x.timed_total).c_str());
    }
  }
  bool good = true;
  for (const auto& x : runs) good = good && x.bit_exact;
  if (cs) good = good && cs->bit_exact;
  if (!good) std::fprintf(stderr, "shmcast-bench: MISMATCH: a consumer received bytes that were not sent (%s)\n",
                          (runs.front().first_bad.empty() && cs ? cs->first_bad : runs.front().first_bad).c_str());
  return good ? 0 : 1;
}

// ------------------------------------------------------------------ cuda mode

int run_cuda(Config cfg, bool as_json, const std::vector<std::uint64_t>& sweep, std::uint64_t ceiling_bytes,
             int ceiling_reps) {
  if (!bench_has_cuda()) {
    std::fprintf(stderr, "shmcast-bench: --mode cuda needs a build with CUDA and nvcc (-DSHMCAST_WITH_CUDA=ON)\n");
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
  const auto ntensors = static_cast<std::uint32_t>(specs.size());
  // One configuration: the copy ceilings right before it, in this process.
  auto one = [&](Config c) {
    const Ceilings ceil = measure_ceilings(c.producer_device, c.consumer_device, ceiling_bytes, ceiling_reps);
    if (!ceil.ok) {
      RunResult r;
      r.cfg = c;
      r.error = "measuring the copy ceilings failed: " + ceil.error;
      return r;
    }
    RunResult r = run_config(c, payload, ntensors);
    r.cuda = ceil;
    r.ceiling = ceil.both;
    return r;
  };
  std::vector<std::uint64_t> slots = sweep.empty() ? std::vector<std::uint64_t>{cfg.slot_bytes} : sweep;
  std::vector<RunResult> runs;
  for (std::uint64_t s : slots) {
    Config c = cfg;
    c.slot_bytes = s;
    c.checksums = false;
    runs.push_back(one(c));
    if (!runs.back().ok) {
      std::fprintf(stderr, "shmcast-bench: slot %s: %s\n", size_text(s).c_str(), runs.back().error.c_str());
      if (sweep.empty()) return 1;
    }
  }
  std::optional<RunResult> cs;
  if (cfg.checksums) {
    Config c = cfg;
    c.checksums = true;
    cs = one(c);
  }
  const RunResult& r = runs.front();
  if (as_json) {
    json j = run_json(r);
    j["mode"] = "cuda";
    j["manifest"] = cfg.manifest;
    j["tensors"] = specs.size();
    j["bytes"] = payload;
    j["consumers"] = cfg.consumers;
    j["iters"] = cfg.iters;
    j["ceiling_reps"] = ceiling_reps;
    j["staging"] = cfg.staging;
    j["producer_device"] = cfg.producer_device;
    j["consumer_device"] = cfg.consumer_device;
    if (r.cuda) {
      j["device_name"] = r.cuda->device_name;
      if (cfg.consumer_device != cfg.producer_device) j["consumer_device_name"] = r.cuda->consumer_device_name;
    }
    const char* cbm = std::getenv("SHMCAST_CUDA_CALLBACKS");
    j["callbacks"] = cbm ? cbm : "side";
    const char* d2h = std::getenv("SHMCAST_CUDA_D2H_STREAMS");
    const char* h2d = std::getenv("SHMCAST_CUDA_H2D_STREAMS");
    j["d2h_streams_env"] = d2h ? d2h : "";
    j["h2d_streams_env"] = h2d ? h2d : "";
    if (cs) {
      json e = run_json(*cs);
      j["checksums"] = e;
      j["checksums_gbps"] = cs->ok ? cs->gbps.median : 0.0;
      if (!cs->ok) j["checksums_error"] = cs->error;
    }
    if (!sweep.empty()) {
      json arr = json::array();
      for (const auto& x : runs) arr.push_back(run_json(x));
      j["sweep"] = arr;
    }
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("shmcast-bench --mode cuda: %s, %zu tensors, %.3f GB; producer on GPU %d, %u consumer(s) on GPU %d (%s); "
                "%d timed syncs after %d warm-up, fresh random bytes each\n",
                cfg.manifest, specs.size(), static_cast<double>(payload) * 1e-9, cfg.producer_device, cfg.consumers,
                cfg.consumer_device, cfg.staging ? "staging buffer" : "per-tensor device buffers", cfg.iters, cfg.warmup);
    auto print_ceil = [&](const Ceilings& c) {
      std::printf("  single-process ceilings, GB/s (pinned, %s per copy, %d copies, just before):\n",
                  size_text(c.bytes).c_str(), c.reps);
      print_row("  D2H alone", stat_text("%.2f", c.d2h));
      print_row("  H2D alone", stat_text("%.2f", c.h2d));
      print_row("  D2H + H2D at once (each way)", stat_text("%.2f", c.both) + fmt("  (D2H %.2f", c.both_d2h.median) +
                                                      fmt(", H2D %.2f)", c.both_h2d.median));
      print_row("  H2D alone, 2 streams", stat_text("%.2f", c.h2d2));
      print_row("  D2H + H2D on 2 streams at once", stat_text("%.2f", c.both2));
    };
    if (r.ok) {
      std::printf("  device: %s\n", r.cuda->device_name.c_str());
      print_ceil(*r.cuda);
      std::printf("  two processes, %u x %s slots:\n", r.cfg.slots, size_text(r.cfg.slot_bytes).c_str());
      print_row("  end to end, s", stat_text("%.4f", r.e2e));
      print_row("  throughput, GB/s", stat_text("%.2f", r.gbps));
      print_row("  x concurrent ceiling (median/median)", fmt("%.3f", r.gbps.median / r.ceiling.median));
      print_row("  producer (send -> end_sync), GB/s", stat_text("%.2f", r.prod_gbps));
      print_row("  verified", verified_text(r));
      const RoleResult& p = r.producer;
      const RoleResult& c = r.consumers[0];
      print_row("  region", size_text(p.region_bytes));
      print_row("  producer create + pin (1 sample)", fmt("%.3f s", p.create_s) + fmt(" + %.3f s", p.pin_s) +
                                                        fmt(" = %.3f s/GiB", per_gib(p.create_s + p.pin_s, p.region_bytes)));
      print_row("  consumer open incl. pin (1 sample)", fmt("%.3f s", c.create_s) + fmt(" (pin %.3f s)", c.pin_s) +
                                                          fmt(" = %.3f s/GiB", per_gib(c.create_s, p.region_bytes)));
    }
    if (cs) {
      if (cs->ok)
        print_row("  with checksums, GB/s", stat_text("%.2f", cs->gbps) +
                                                 fmt("; x its ceiling %.3f", cs->gbps.median / cs->ceiling.median) +
                                                 "; verified " + frac(cs->timed_verified, cs->timed_total));
      else
        print_row("  with checksums", cs->error);
    }
    if (!sweep.empty()) {
      std::printf("\n  %-8s %6s %9s %8s %8s %9s %8s %9s %10s\n", "slot", "slots", "seconds", "GB/s", "min", "ceiling",
                  "x ceil", "verified", "pin s/GiB");
      for (const auto& x : runs) {
        if (!x.ok) {
          std::printf("  %-8s %6u  failed: %s\n", size_text(x.cfg.slot_bytes).c_str(), x.cfg.slots, x.error.c_str());
          continue;
        }
        std::printf("  %-8s %6u %9.4f %8.2f %8.2f %9.2f %8.3f %9s %10.3f\n", size_text(x.cfg.slot_bytes).c_str(),
                    x.cfg.slots, x.e2e.median, x.gbps.median, x.gbps.min, x.ceiling.median,
                    x.gbps.median / x.ceiling.median, frac(x.timed_verified, x.timed_total).c_str(),
                    per_gib(x.producer.pin_s, x.producer.region_bytes));
      }
    }
  }
  bool good = true;
  for (const auto& x : runs) good = good && x.ok && x.bit_exact;
  if (cs) good = good && cs->ok && cs->bit_exact;
  for (const auto& x : runs)
    if (x.ok && !x.bit_exact)
      std::fprintf(stderr, "shmcast-bench: MISMATCH (slot %s): %s\n", size_text(x.cfg.slot_bytes).c_str(),
                   x.first_bad.c_str());
  return good ? 0 : 1;
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
  CLI::App app{"shmcast-bench: throughput and round-trip latency of shmcast between processes. Every sync carries "
               "fresh random bytes and is checked, every byte, after its timer stopped; any mismatch exits 1."};
  std::string mode = "auto", slot = "", bytes = "4G", tensor = "256M", sweep_s, ceiling = "512M", manifest = "qwen2.5-3b";
  std::string role;
  int ctl_fd = -1, index = 0;
  Config cfg;
  bool as_json = false;
  int ceiling_reps = 0;
  app.add_option("--mode", mode, "auto (cuda with a GPU, else host), host or cuda")
      ->check(CLI::IsMember({"auto", "host", "cuda"}));
  app.add_flag("--json", as_json, "print one JSON object");
  app.add_option("--bytes", bytes, "host: bytes per sync (default 4G)");
  app.add_option("--tensor-bytes", tensor, "host: size of each tensor (default 256M)");
  app.add_option("--slot-bytes", slot, "slot size (default: host 64M, cuda the library default)");
  app.add_option("--slots", cfg.slots, "number of slots K (default 2)");
  app.add_option("--consumers", cfg.consumers, "consumer processes (default 1)")->check(CLI::Range(1, kMaxConsumers));
  app.add_option("--reps,--iters", cfg.iters, "timed syncs per configuration (min/median/max reported; default 10)")
      ->check(CLI::Range(1, kMaxSyncs - 8));
  app.add_option("--warmup", cfg.warmup, "untimed (but verified) syncs first (default 1)")->check(CLI::Range(0, 8));
  app.add_flag("--checksums", cfg.checksums, "also measure with per-slot XXH3 checksums");
  app.add_option("--roundtrip-iters", cfg.roundtrip_iters,
                 "host: back-to-back small-sync round trips (default 2000; 0 skips both round-trip figures)")
      ->check(CLI::Range(0, kMaxRoundTrips));
  app.add_option("--roundtrip-idle-iters", cfg.roundtrip_idle_iters,
                 "host: round trips each after an idle gap (default 1000; 0 skips)")
      ->check(CLI::Range(0, kMaxRoundTrips));
  app.add_option("--idle-gap-us", cfg.roundtrip_idle_gap_us,
                 "host: idle gap before each idle round trip, microseconds (default 2000; the doorbell spins 20)")
      ->check(CLI::Range(50, 1000000));
  app.add_option("--seed", cfg.seed, "seed of the random bytes (default: a fresh one per configuration)");
  app.add_option("--manifest", manifest,
                 "cuda: tensor set (qwen2.5-3b, qwen3-30b-a3b[:layers], qwen3-30b-a3b-dense[:layers]: the first N of "
                 "48 layers)");
  app.add_flag("--staging", cfg.staging, "cuda: consumer reads into the library's staging buffer");
  app.add_option("--producer-device", cfg.producer_device, "cuda: producer GPU (default 0)");
  app.add_option("--consumer-device", cfg.consumer_device, "cuda: consumer GPU (default 0: same GPU)");
  app.add_option("--sweep-slots", sweep_s, "run once per slot size, e.g. 64M,128M,256M,512M,1G");
  app.add_option("--ceiling-bytes", ceiling, "cuda: bytes per copy for the single-process ceilings (default 512M)");
  app.add_option("--ceiling-reps", ceiling_reps,
                 "repetitions of each ceiling copy, measured again for every configuration (default: --reps)")
      ->check(CLI::Range(1, 1000));
  bool huge = false;
  app.add_flag("--huge-pages", huge, "host: MADV_HUGEPAGE on the bench's own buffers (default: 4 KiB pages)");
  app.add_option("--role", role)->group("");
  app.add_option("--ctl-fd", ctl_fd)->group("");
  app.add_option("--index", index)->group("");
  CLI11_PARSE(app, argc, argv);

  if (!role.empty()) return run_role(role, ctl_fd, index);
  g_huge_pages = huge;
  cfg.huge_pages = huge;
  if (ceiling_reps <= 0) ceiling_reps = std::max(10, cfg.iters);

  try {
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
      if (cfg.roundtrip_bytes == 0) throw std::invalid_argument("round-trip bytes must be > 0");
      return run_host(cfg, as_json, sweep, ceiling_reps);
    }
    cfg.mode = Mode::kCuda;
    cfg.roundtrip_iters = 0;
    cfg.slot_bytes = slot.empty() ? shmcast::ProducerOptions{}.slot_bytes : parse_size(slot);
    return run_cuda(cfg, as_json, sweep, parse_size(ceiling), ceiling_reps);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shmcast-bench: %s\n", e.what());
    return 1;
  }
}
