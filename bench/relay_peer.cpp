// shmcast-relay-bench-peer: the trainer, the workers and the per-hop cost
// probe of bench/relay_bench.py (which starts the relays and reads these
// reports). One process per role; every node is its own SHMCAST_DIR.
//
//   produce NAME --bytes B --tensors T --slot-bytes S --syncs N --go PREFIX --seed X --report FILE
//     sync v (1..N) waits for the file PREFIX.v, then fills its tensors with
//     fresh random bytes (content.hpp, outside the timer) and sends them;
//     reports "begin v <CLOCK_MONOTONIC ns>" just before begin_sync and
//     "end v <ns>" after end_sync.
//   consume NAME --syncs N --seed X --report FILE
//     reports "end v <ns>" when read_into() returned (the sync is in this
//     process's memory), then checks every byte (after the timer) and
//     reports "ok v" or "bad v <blocks>".
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
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <sys/stat.h>
#include <thread>
#include <vector>

#include "content.hpp"
#include "shmcast/shmcast.hpp"

using namespace shmcast;
using namespace std::chrono_literals;

namespace {

std::int64_t now_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

struct Args {
  std::string role, name, go, report;
  std::uint64_t bytes = 512ull << 20, slot_bytes = 32ull << 20, seed = 1, reps = 10;
  int tensors = 16, syncs = 11, threads = 1;
};

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
  Producer p = Producer::create(a.name, o);
  std::vector<TensorSpec> specs;
  const std::uint64_t each = a.bytes / static_cast<std::uint64_t>(a.tensors) / 2 * 2;
  for (int t = 0; t < a.tensors; ++t)
    specs.push_back({"model.layers." + std::to_string(t) + ".weight", DType::kBF16,
                     {static_cast<std::int64_t>(each / 2)}});
  std::vector<std::vector<std::byte>> data(specs.size());
  for (auto& d : data) d.resize(each);
  say(a, "ready");
  p.wait_for_consumers(1, 120s);
  for (int v = 1; v <= a.syncs; ++v) {
    if (!wait_file(a.go + "." + std::to_string(v))) return 3;
    for (std::size_t t = 0; t < data.size(); ++t)
      bench::content::fill(data[t].data(), each, bench::content::key(a.seed, static_cast<std::uint64_t>(v), t));
    say(a, "begin " + std::to_string(v) + " " + std::to_string(now_ns()));
    p.begin_sync(specs);
    for (std::size_t t = 0; t < data.size(); ++t) p.write(t, data[t].data());
    p.end_sync();
    say(a, "end " + std::to_string(v) + " " + std::to_string(now_ns()));
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
  std::vector<std::vector<std::byte>> got;
  for (int i = 0; i < a.syncs; ++i) {
    const SyncInfo& s = c.wait_sync(600s);
    if (got.size() != s.tensors.size()) {
      got.assign(s.tensors.size(), {});
      for (std::size_t t = 0; t < s.tensors.size(); ++t) got[t].assign(s.tensors[t].nbytes, std::byte{0});
    }
    std::vector<void*> dst;
    for (auto& g : got) dst.push_back(g.data());
    c.read_into(dst);
    const std::int64_t t_end = now_ns();
    say(a, "end " + std::to_string(s.version) + " " + std::to_string(t_end));
    std::uint64_t bad = 0;
    for (std::size_t t = 0; t < got.size(); ++t)
      bad += bench::content::count_bad(got[t].data(), got[t].size(), bench::content::key(a.seed, s.version, t));
    say(a, bad == 0 ? "ok " + std::to_string(s.version) : "bad " + std::to_string(s.version) + " " + std::to_string(bad));
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
    else {
      std::fprintf(stderr, "shmcast-relay-bench-peer: unknown option %s\n", k.c_str());
      return 2;
    }
  }
  try {
    if (a.role == "produce") return produce(a);
    if (a.role == "consume") return consume(a);
    if (a.role == "costs") return costs(a);
  } catch (const Error& e) {
    std::fprintf(stderr, "shmcast-relay-bench-peer %s: %s\n", a.role.c_str(), e.what());
    return 20 + static_cast<int>(e.code());
  }
  return 2;
}
