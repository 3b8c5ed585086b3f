// Helpers for the fault matrix (tests/fault): outcome accounting that every
// fault test prints as one `FAULT-MATRIX {json}` line and appends to
// fault-matrix.jsonl in the test's working directory, plus the process
// choreography the matrix shares (epoch-tagged pattern syncs that any
// consumer can verify without talking to the producer).
//
// Conventions (as in tests/multiprocess): children are forked with
// shmcast_test::Child, always waited with a deadline (a child still running
// at the deadline is SIGKILLed and counted as a hang), exit 0 on success,
// 20 + Errc on a shmcast::Error, 12 on a data mismatch.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "base/layout.hpp"
#include "support.hpp"

namespace fault {

using namespace shmcast;
using namespace shmcast_test;
using namespace std::chrono_literals;

inline constexpr std::uint64_t kSlot = 2ull << 20;
inline constexpr int kMismatchExit = 12;

// Trials per randomized fault: SHMCAST_FAULT_TRIALS overrides the default;
// else SHMCAST_FAULT_TRIALS_PERCENT (1-100) runs that share of it, at least 2
// (scripts/under-load.sh and the ASan stage run a quarter: every trial is the
// same fault with new random choices, and the tiers stage runs them all;
// docs/reliability.md, "CI time").
inline int trials(int dflt) {
  const char* s = std::getenv("SHMCAST_FAULT_TRIALS");
  if (s && *s) {
    const int n = std::atoi(s);
    if (n > 0) return n;
  }
  const char* pct = std::getenv("SHMCAST_FAULT_TRIALS_PERCENT");
  if (pct && *pct) {
    const int p = std::atoi(pct);
    if (p > 0 && p < 100) {
      const int n = (dflt * p + 99) / 100;
      return n < 2 ? (dflt < 2 ? dflt : 2) : n;
    }
  }
  return dflt;
}

// Seed for the random choices of one test run: SHMCAST_FAULT_SEED, else the
// time. Printed in the summary so a failing run can be replayed.
inline std::uint64_t run_seed() {
  const char* s = std::getenv("SHMCAST_FAULT_SEED");
  if (s && *s) return std::strtoull(s, nullptr, 10);
  return static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
}

inline std::string exit_name(int rc) {
  if (rc == -1) return "hang";
  if (rc == 0) return "ok";
  if (rc == kMismatchExit) return "mismatch";
  if (rc >= 128) return std::string("signal:") + std::to_string(rc - 128);
  if (rc > 20 && rc < 20 + 40) return errc_name(static_cast<Errc>(rc - 20));
  return "exit:" + std::to_string(rc);
}

// Outcome counts of one fault. hangs/crashes/mismatches/unreusable must end at 0.
struct Matrix {
  std::string fault;
  std::uint64_t seed = 0;
  int trials = 0;
  int hangs = 0;          // a child ran past its deadline
  int crashes = 0;        // a child died of a signal we did not send
  int mismatches = 0;     // a consumer reported success with wrong bytes
  int unexpected = 0;     // an exit code outside the documented outcomes
  int unreusable = 0;     // the name could not be used by a fresh pair afterwards
  long long syncs_verified = 0;  // syncs received bit-exact by consumers
  std::map<std::string, int> outcomes;  // "role:outcome" -> count

  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now(), last = t0;

  // The seed first, so that a run that times out can be replayed.
  explicit Matrix(std::string f, std::uint64_t s = 0) : fault(std::move(f)), seed(s) {
    std::printf("FAULT-MATRIX-START fault=%s seed=%llu\n", fault.c_str(), static_cast<unsigned long long>(seed));
    std::fflush(stdout);
  }

  // Counts a trial and prints its time: the output of a run stopped by its
  // timeout shows the pace it kept (slow trials, or one stuck).
  void trial_done() {
    ++trials;
    const auto now = std::chrono::steady_clock::now();
    const auto ms = [](auto d) { return static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(d).count()); };
    std::printf("FAULT-TRIAL fault=%s done=%d trial_ms=%lld total_ms=%lld\n", fault.c_str(), trials, ms(now - last),
                ms(now - t0));
    std::fflush(stdout);
    last = now;
  }

  void note(const std::string& role, const std::string& outcome) { ++outcomes[role + ":" + outcome]; }

  // Accounts a child's exit: `expected` lists the acceptable codes (beyond
  // them, hang/crash/mismatch/unexpected are counted). `sent` is the signal
  // we sent this child, if any.
  void child(const std::string& role, int rc, std::initializer_list<int> expected, int sent = 0) {
    note(role, exit_name(rc));
    if (rc == -1) {
      ++hangs;
      return;
    }
    if (rc >= 128) {
      if (sent == 0 || rc != 128 + sent) ++crashes;
      return;
    }
    if (rc == kMismatchExit) {
      ++mismatches;
      return;
    }
    for (int e : expected)
      if (rc == e) return;
    ++unexpected;
  }

  std::string json() const {
    std::ostringstream o;
    o << "{\"fault\":\"" << fault << "\",\"seed\":" << seed << ",\"trials\":" << trials << ",\"hangs\":" << hangs
      << ",\"crashes\":" << crashes << ",\"mismatches\":" << mismatches << ",\"unexpected\":" << unexpected
      << ",\"unreusable\":" << unreusable << ",\"syncs_verified\":" << syncs_verified << ",\"outcomes\":{";
    bool first = true;
    for (const auto& [k, v] : outcomes) {
      o << (first ? "" : ",") << "\"" << k << "\":" << v;
      first = false;
    }
    o << "}}";
    return o.str();
  }

  // Prints the summary line, appends it to fault-matrix.jsonl and asserts
  // the invariants of the matrix.
  void finish() const {
    const std::string j = json();
    std::printf("FAULT-MATRIX %s\n", j.c_str());
    std::fflush(stdout);
    std::ofstream("fault-matrix.jsonl", std::ios::app) << j << "\n";
    EXPECT_EQ(hangs, 0) << j;
    EXPECT_EQ(crashes, 0) << j;
    EXPECT_EQ(mismatches, 0) << j;
    EXPECT_EQ(unexpected, 0) << j;
    EXPECT_EQ(unreusable, 0) << j;
  }
};

inline int code(Errc e) { return 20 + static_cast<int>(e); }

inline ProducerOptions popts(std::uint32_t consumers, std::chrono::milliseconds consumer_timeout = 20000ms,
                             StallPolicy policy = StallPolicy::kFail, std::uint32_t slots = 2,
                             bool checksums = false) {
  ProducerOptions o;
  o.slot_bytes = kSlot;
  o.slots = slots;
  o.max_consumers = consumers;
  o.manifest_bytes = 64 << 10;
  o.pin = Pin::kNo;
  o.consumer_timeout = consumer_timeout;
  o.stall_policy = policy;
  o.checksums = checksums;
  return o;
}

inline ConsumerOptions copts(std::chrono::milliseconds open_timeout = 20000ms,
                             std::chrono::milliseconds chunk_timeout = 20000ms) {
  ConsumerOptions c;
  c.pin = Pin::kNo;
  c.open_timeout = open_timeout;
  c.chunk_timeout = chunk_timeout;
  return c;
}

// ---- epoch-tagged syncs: tensor i of sync `version` from producer `epoch`
// is named "e<epoch>.<i>" and filled with pattern seed (epoch, version, i),
// so a consumer can check any sync it receives from any producer.
inline std::uint64_t epoch_seed(std::uint64_t epoch, std::uint64_t version, std::size_t i) {
  return epoch * 0x100000001B3ull + version * 1000003ull + i;
}

struct EpochSync {
  std::vector<TensorSpec> specs;
  std::vector<std::vector<std::uint8_t>> data;
  std::vector<const void*> ptrs;
  // `rng_seed` picks the shapes: 1..6 tensors from 0 bytes to 2.5 slots.
  EpochSync(std::uint64_t epoch, std::uint64_t version, std::uint64_t rng_seed, std::uint64_t max_bytes = 5 * kSlot / 2) {
    std::mt19937_64 rng(rng_seed);
    const int n = 1 + static_cast<int>(rng() % 6);
    for (int i = 0; i < n; ++i) {
      std::uint64_t bytes;
      switch (rng() % 4) {
        case 0: bytes = rng() % 512; break;
        case 1: bytes = rng() % (max_bytes < kSlot ? max_bytes : kSlot); break;
        case 2: bytes = rng() % max_bytes; break;
        default: bytes = rng() % (max_bytes < (64 << 10) ? max_bytes : (64 << 10)); break;
      }
      specs.push_back({"e" + std::to_string(epoch) + "." + std::to_string(i), DType::kU8,
                       {static_cast<std::int64_t>(bytes)}});
      data.emplace_back(bytes);
      fill_pattern(data.back().data(), bytes, epoch_seed(epoch, version, static_cast<std::size_t>(i)));
      ptrs.push_back(data.back().data());
    }
  }
};

inline std::uint64_t epoch_of(const SyncInfo& info) {
  if (info.tensors.empty()) return 0;
  const std::string& n = info.tensors[0].name;
  if (n.size() < 2 || n[0] != 'e') return 0;
  return std::strtoull(n.c_str() + 1, nullptr, 10);
}

// Receives the sync announced by wait_sync into fresh buffers (read_into, or
// visit when `use_visit`) and checks every byte. Returns true when exact.
inline bool read_and_check(Consumer& c, const SyncInfo& info, bool use_visit) {
  const std::uint64_t epoch = epoch_of(info);
  std::vector<std::vector<std::uint8_t>> got;
  for (const auto& t : info.tensors) got.emplace_back(t.nbytes, 0xEE);
  if (use_visit) {
    c.visit([&](const Piece& p) {
      if (p.bytes) std::memcpy(got[p.tensor].data() + p.offset, p.data, p.bytes);
    });
  } else {
    std::vector<void*> dst;
    for (auto& g : got) dst.push_back(g.data());
    c.read_into(dst);
  }
  for (std::size_t i = 0; i < got.size(); ++i) {
    std::vector<std::uint8_t> want(got[i].size());
    fill_pattern(want.data(), want.size(), epoch_seed(epoch, info.version, i));
    if (want != got[i]) return false;
  }
  return true;
}

// Counters in shared memory for the children of one trial.
struct Board {
  std::atomic<int> attached[8];
  std::atomic<int> verified[8];   // syncs verified per consumer
  std::atomic<int> in_visit[8];   // consumer is inside a visit callback
  std::atomic<int> done[8];       // consumer is done (test-defined)
  std::atomic<int> mismatches;
  std::atomic<int> producer_syncs;
  std::atomic<int> producer_state;  // test-defined
  std::atomic<int> go;
  std::atomic<int> errors_seen[64];  // by Errc, across consumers
  static Board* make() {
    void* m = ::mmap(nullptr, sizeof(Board), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    return new (m) Board{};
  }
  static void destroy(Board* b) { ::munmap(b, sizeof(Board)); }
  int total_verified() const {
    int n = 0;
    for (const auto& v : verified) n += v.load();
    return n;
  }
};

template <class Pred>
bool wait_for(Pred&& p, std::chrono::milliseconds timeout = 30s) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (!p()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

// After a fault: can a fresh producer/consumer pair (in this process) sync
// bit-exact on `name`? Replaces a stale region when its producer is dead.
inline bool fresh_pair_syncs(const std::string& name, std::string* why = nullptr) {
  try {
    Producer p = Producer::create(name, popts(2, 5000ms));
    Consumer c = Consumer::open(name, copts(5000ms, 5000ms));
    EpochSync s(9999, 1, 7, 256 << 10);  // fits the 2 slots: send does not block
    p.send(s.specs, s.ptrs);
    const SyncInfo& info = c.wait_sync(5s);
    const bool ok = read_and_check(c, info, false);
    c.close();
    p.close();
    if (!ok && why) *why = "wrong bytes";
    return ok && ::access(region_path(name).c_str(), F_OK) != 0;  // close() removed the name
  } catch (const std::exception& e) {
    if (why) *why = e.what();
    return false;
  }
}

inline void write_file(const std::string& path, std::size_t offset, const void* bytes, std::size_t n) {
  int fd = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0) << path;
  ASSERT_EQ(::pwrite(fd, bytes, n, static_cast<off_t>(offset)), static_cast<ssize_t>(n));
  ::close(fd);
}

inline std::uint64_t file_size(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return 0;
  return static_cast<std::uint64_t>(st.st_size);
}

}  // namespace fault
