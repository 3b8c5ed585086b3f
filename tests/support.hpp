// Helpers shared by the test tiers: unique region names, forked children
// with a deadline, deterministic random tensors.
#pragma once

#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "shmcast/shmcast.hpp"

namespace shmcast_test {

// A private region directory under /dev/shm, exported as SHMCAST_DIR for the
// library while it lives, so that tests never see each other's regions.
struct RegionDir {
  std::string path;
  explicit RegionDir(const std::string& tag) {
    std::string templ = "/dev/shm/shmcast-" + tag + "-XXXXXX";
    if (::mkdtemp(templ.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path = templ;
    ::setenv("SHMCAST_DIR", path.c_str(), 1);
  }
  ~RegionDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
    ::unsetenv("SHMCAST_DIR");
  }
  RegionDir(const RegionDir&) = delete;
  RegionDir& operator=(const RegionDir&) = delete;
  std::string file(const std::string& name) const { return path + "/shmcast." + name; }
};

inline std::string unique_name(const std::string& tag) {
  static int n = 0;
  return "t-" + tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(n++);
}

// Removes the region on scope exit, whatever happened.
struct RegionGuard {
  std::string name;
  ~RegionGuard() {
    try {
      shmcast::unlink_region(name);
    } catch (...) {
    }
  }
};

// How much slower the sanitizer builds run these tests than the plain one
// (TSan about 5x, ASan about 2-3x on an idle 2-core machine). Deadlines that
// bound how long a test may run (never ones a test checks as behaviour) are
// multiplied by it, so that a busy CI machine keeps a margin of about 3x
// the sanitizer time on an idle one.
#if defined(__SANITIZE_THREAD__)
inline constexpr int kSlowdown = 6;
#elif defined(__SANITIZE_ADDRESS__)
inline constexpr int kSlowdown = 3;
#else
inline constexpr int kSlowdown = 1;
#endif

// A forked child running fn(); its exit code is fn's return value, 99 when
// it threw. Child processes never return into gtest.
struct Child {
  pid_t pid = -1;
  int status = -1;
  bool waited = false;

  Child() = default;
  // Moving hands the process over: the moved-from Child no longer kills it.
  Child(Child&& o) noexcept : pid(o.pid), status(o.status), waited(o.waited) { o.pid = -1; }
  Child& operator=(Child&&) = delete;

  static Child spawn(const std::function<int()>& fn) {
    Child c;
    c.pid = ::fork();
    if (c.pid == 0) {
      int rc = 98;
      try {
        rc = fn();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "child %d: %s\n", ::getpid(), e.what());
        rc = 99;
      }
      std::fflush(stderr);
      ::_exit(rc);
    }
    return c;
  }
  // Exit code, or 128+signal; -1 if it did not end by the deadline (then it
  // is killed). The deadline is `timeout` times kSlowdown.
  int wait(std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
    if (waited) return decode();
    const auto end = std::chrono::steady_clock::now() + timeout * kSlowdown;
    while (std::chrono::steady_clock::now() < end) {
      pid_t r = ::waitpid(pid, &status, WNOHANG);
      if (r == pid) {
        waited = true;
        return decode();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    // What the process was doing, before the kill: a hang under load
    // (scripts/soak) is otherwise a bare count.
    if (timeout.count() > 0) std::fprintf(stderr, "%s", proc_report(pid).c_str());
    ::kill(pid, SIGKILL);
    // Bounded too: a process that SIGKILL does not end (stuck in the
    // kernel) is reported again and left, not waited for without end.
    const auto kill_end = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (::waitpid(pid, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() >= kill_end) {
        std::fprintf(stderr, "SIGKILL did not end it in 60 s: %s", proc_report(pid).c_str());
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    waited = true;
    return -1;
  }
  // Each thread's state and wait channel, and the kernel stack when it can
  // be read (root), of a process that did not end in time.
  static std::string proc_report(pid_t p) {
    auto first_line = [](const std::string& path) {
      std::FILE* f = std::fopen(path.c_str(), "r");
      if (!f) return std::string("?");
      char b[512] = {};
      const std::size_t n = std::fread(b, 1, sizeof b - 1, f);
      std::fclose(f);
      std::string l(b, n);
      if (auto e = l.find('\n'); e != std::string::npos) l.resize(e);
      return l;
    };
    const std::string dir = "/proc/" + std::to_string(p);
    std::string out = "child " + std::to_string(p) + " did not end in time:\n";
    std::error_code ec;
    std::filesystem::directory_iterator it(dir + "/task", ec), none;
    for (; !ec && it != none; it.increment(ec)) {
      const std::filesystem::directory_entry& t = *it;
      const std::string stat = first_line(t.path().string() + "/stat");
      const auto rp = stat.rfind(')');
      out += "  task " + t.path().filename().string() + " state " +
             (rp != std::string::npos && rp + 2 < stat.size() ? stat.substr(rp + 2, 1) : "?") + " wchan " +
             first_line(t.path().string() + "/wchan") + "\n";
      std::FILE* f = std::fopen((t.path().string() + "/stack").c_str(), "r");
      if (!f) continue;
      char line[256];
      for (int i = 0; i < 12 && std::fgets(line, sizeof line, f); ++i) out += std::string("    ") + line;
      std::fclose(f);
    }
    return out;
  }
  void kill9() { ::kill(pid, SIGKILL); }
  ~Child() {
    if (pid > 0 && !waited) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
    }
  }
  int decode() const {
    if (WIFEXITED(status)) return WEXITSTATUS(status);
    if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
    return -2;
  }
};

// splitmix64: a fast deterministic stream for test data.
struct SplitMix {
  std::uint64_t s;
  std::uint64_t operator()() {
    std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double unit() { return static_cast<double>((*this)() >> 11) * 0x1.0p-53; }  // [0, 1)
};

// Changes each `z`-byte element of d[0, bytes) with probability f, to other
// bits (XOR with a value whose low byte is odd), deterministic in `rng`. The
// changed elements are found by geometric gaps, so the cost is in the
// elements changed, not in the buffer: the delta tests' weights changed
// element by element with a draw each took most of their CPU (about 75 % of
// ShardedDelta's, more under ASan and qemu).
inline void change_elements(std::uint8_t* d, std::size_t bytes, std::size_t z, double f, SplitMix& rng) {
  const std::size_t n = z ? bytes / z : 0;
  if (n == 0 || !(f > 0)) return;
  const double l = f < 1 ? std::log1p(-f) : 0;  // < 0
  for (std::size_t e = 0; e < n; ++e) {
    if (f < 1) {
      const double g = std::floor(std::log(1.0 - rng.unit()) / l);  // elements left alone before the next change
      if (!(g < static_cast<double>(n - e))) return;
      e += static_cast<std::size_t>(g);
    }
    const std::uint64_t x = rng() | 1;  // never zero: the element changes
    for (std::size_t b = 0; b < z; ++b) d[e * z + b] ^= static_cast<std::uint8_t>(x >> (8 * (b % 8)));
  }
}

// Deterministic bytes for tensor i of sync `version` (so both sides can
// generate and compare without talking).
inline void fill_pattern(std::uint8_t* p, std::size_t n, std::uint64_t seed) {
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

inline std::vector<shmcast::TensorSpec> random_manifest(std::uint64_t seed, std::uint64_t slot_bytes, int count) {
  std::mt19937_64 rng(seed);
  std::vector<shmcast::TensorSpec> v;
  const shmcast::DType types[] = {shmcast::DType::kBF16, shmcast::DType::kF32, shmcast::DType::kU8,
                                  shmcast::DType::kI64, shmcast::DType::kBool};
  for (int i = 0; i < count; ++i) {
    shmcast::TensorSpec s;
    s.name = "layer." + std::to_string(i) + ".w";
    s.dtype = types[rng() % 5];
    const std::size_t es = shmcast::dtype_size(s.dtype);
    std::uint64_t bytes;
    switch (rng() % 6) {
      case 0: bytes = 0; break;
      case 1: bytes = rng() % 64; break;
      case 2: bytes = rng() % 4096; break;
      case 3: bytes = rng() % slot_bytes; break;
      case 4: bytes = slot_bytes + rng() % (2 * slot_bytes); break;
      default: bytes = rng() % (slot_bytes / 4); break;
    }
    const std::uint64_t elems = bytes / es;
    if (elems % 2 == 0 && elems > 0)
      s.shape = {2, static_cast<std::int64_t>(elems / 2)};
    else
      s.shape = {static_cast<std::int64_t>(elems)};
    v.push_back(s);
  }
  return v;
}

inline std::uint64_t seed_of(std::uint64_t version, std::size_t i) { return version * 1000003ull + i; }

}  // namespace shmcast_test

namespace shmcast_test {

// Flags in shared anonymous memory, visible across fork().
struct SharedFlags {
  std::atomic<int> v[16];
  static SharedFlags* make() {
    void* m = ::mmap(nullptr, sizeof(SharedFlags), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    return new (m) SharedFlags{};
  }
  bool wait(int i, int value, std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
    const auto end = std::chrono::steady_clock::now() + timeout;
    while (v[i].load() != value) {
      if (std::chrono::steady_clock::now() > end) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    return true;
  }
};

// One sync of `count` tensors of `bytes` each, patterned by seed_of(version, i).
struct PatternSync {
  std::vector<shmcast::TensorSpec> specs;
  std::vector<std::vector<std::uint8_t>> data;
  std::vector<const void*> ptrs;
  PatternSync(int count, std::uint64_t bytes, std::uint64_t version) {
    for (int i = 0; i < count; ++i) {
      specs.push_back({"t" + std::to_string(i), shmcast::DType::kU8, {static_cast<std::int64_t>(bytes)}});
      data.emplace_back(bytes);
      fill_pattern(data.back().data(), bytes, seed_of(version, static_cast<std::size_t>(i)));
      ptrs.push_back(data.back().data());
    }
  }
};

inline bool check_pattern(const std::vector<std::vector<std::uint8_t>>& got, std::uint64_t version) {
  for (std::size_t i = 0; i < got.size(); ++i) {
    std::vector<std::uint8_t> want(got[i].size());
    fill_pattern(want.data(), want.size(), seed_of(version, i));
    if (want != got[i]) return false;
  }
  return true;
}

inline int errc_exit(const shmcast::Error& e) { return 20 + static_cast<int>(e.code()); }

// The Errc that fn() throws (a value-initialized Errc when it throws none).
inline shmcast::Errc code_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const shmcast::Error& e) {
    return e.code();
  }
  return shmcast::Errc{};
}

}  // namespace shmcast_test
