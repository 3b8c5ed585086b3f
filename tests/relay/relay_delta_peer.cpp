// The trainer and the workers of the relay's delta tests (test_relay_delta):
// a delta producer (ProducerOptions::delta, host copy engine: the host
// codec) and consumers that check every version bit-exactly.
//
//   relay_delta_peer produce NAME --versions N --go PREFIX --report FILE [--seed S] [--fraction F]
//   relay_delta_peer consume NAME --versions N --report FILE [--seed S] [--skip-every K] [--fraction F]
//                            [--corrupt-ok 1]
//   either role: [--buckets B]
//
// Version 1 fills every tensor with random bytes; version v > 1 changes a
// random 0.5-30 % of each tensor's elements (random positions, new random
// values) of version v - 1: both roles compute version v from the seed
// alone (--fraction F: F of each tensor's elements every time, so that every
// version the producer may send as a delta is one). Tensors: bf16, f16, f32,
// fp8 e4m3, i64, c128 (sent whole in a delta sync) and an empty one, in
// several slots.
// produce: creates the region, reports "ready", then for each version v
// waits for the file PREFIX.v, sends it and reports "sent v full|delta
// LOGICAL PAYLOAD" (Producer::last_sync).
// consume: reports "attached", then "ok v full|delta LOGICAL PAYLOAD" for
// each version it read (Consumer::last_sync; into the same buffers every
// time, so that deltas apply) once every byte matched version v, "bad v"
// when not (exit 12). --skip-every K: versions divisible by K are skipped
// (wait_sync, then skip(): the next delta cannot apply), reported "skipped
// v". --corrupt-ok 1: a read that fails with Corrupt (a delta blob
// rejected, or its result's checksum not the delta's) is reported "corrupt v
// <message>" and the worker goes on (the consumer asked for a full sync);
// without it the worker exits 20 + the error's code. It ends once it has
// seen version N.
// --buckets B (both roles alike): each version is an update sent as B syncs
// (buckets), tensor i in bucket i * B / 8: version v's buckets are syncs
// (v - 1) * B + 1 .. v * B. The producer reports "sent v.b KIND ..." per
// bucket, the consumer "ok v.b KIND ..." per bucket read (into the same
// buffers as every other read of that bucket) and "skipped v.b".
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "shmcast/shmcast.hpp"

using namespace shmcast;
using namespace std::chrono_literals;

namespace {

struct Args {
  std::string role, name, report, go;
  int versions = 10, skip_every = 0, buckets = 0;
  std::uint64_t seed = 11;
  double fraction = 0;  // 0: 0.5-30 % at random
  bool corrupt_ok = false;
};

void report(const Args& a, const std::string& line) {
  std::ofstream f(a.report, std::ios::app);
  f << line << "\n";
}

std::uint64_t mix(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

std::vector<TensorSpec> specs() {
  return {{"embed.bf16", DType::kBF16, {700, 1024}},   {"attn.f32", DType::kF32, {333, 701}},
          {"mlp.fp8", DType::kF8E4M3FN, {1000, 515}},   {"norm.f16", DType::kF16, {4097}},
          {"steps.i64", DType::kI64, {10001}},          {"rot.c128", DType::kC128, {77}},
          {"empty.bf16", DType::kBF16, {0, 8}},         {"head.bf16", DType::kBF16, {64, 4096}}};
}

// The tensors' bytes at version 1, then advanced one version at a time.
struct Model {
  std::uint64_t seed, version = 0;
  double fraction = 0;
  std::vector<TensorSpec> t = specs();
  std::vector<std::vector<std::uint8_t>> data;
  explicit Model(std::uint64_t s, double f = 0) : seed(s), fraction(f) {
    data.resize(t.size());
    for (std::size_t i = 0; i < t.size(); ++i) data[i].resize(t[i].nbytes());
  }
  void advance() {
    ++version;
    for (std::size_t i = 0; i < t.size(); ++i) {
      std::vector<std::uint8_t>& d = data[i];
      const std::size_t w = dtype_size(t[i].dtype), n = d.size() / w;
      std::uint64_t s = mix(seed * 1000003 + version * 131 + i);
      if (version == 1) {
        for (std::size_t b = 0; b < d.size(); ++b) d[b] = static_cast<std::uint8_t>(mix(s + b) >> 17);
        continue;
      }
      // 0.5 % .. 30 % of the elements, at random positions.
      const double frac =
          fraction > 0 ? fraction : 0.005 + 0.295 * static_cast<double>(mix(s) % 10000) / 10000.0;
      const auto changes = static_cast<std::size_t>(frac * static_cast<double>(n));
      for (std::size_t k = 0; k < changes; ++k) {
        s = mix(s);
        const std::size_t e = s % n;
        for (std::size_t b = 0; b < w; ++b) d[e * w + b] = static_cast<std::uint8_t>(mix(s + b + 1) >> 23);
      }
    }
  }
};

bool wait_file(const std::string& path, std::chrono::seconds timeout) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  struct stat st {};
  while (::stat(path.c_str(), &st) != 0) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(2ms);
  }
  return true;
}

std::string kind(const SyncReport& r) {
  return std::string(r.delta ? "delta" : "full") + " " + std::to_string(r.logical_bytes) + " " +
         std::to_string(r.payload_bytes);
}

// The tensors of bucket b (--buckets B: tensor i is in bucket i * B / 8;
// without --buckets, one bucket of every tensor).
std::vector<std::size_t> bucket(const Args& a, std::size_t b) {
  std::vector<std::size_t> idx;
  const std::size_t n = specs().size();
  for (std::size_t i = 0; i < n; ++i)
    if (a.buckets == 0 || i * static_cast<std::size_t>(a.buckets) / n == b) idx.push_back(i);
  return idx;
}
std::uint64_t buckets(const Args& a) { return a.buckets > 0 ? static_cast<std::uint64_t>(a.buckets) : 1; }
// The report's name of version v's bucket b: "v", or "v.b" with --buckets.
std::string tag(const Args& a, std::uint64_t v, std::uint64_t b) {
  return std::to_string(v) + (a.buckets > 0 ? "." + std::to_string(b) : std::string());
}

int produce(const Args& a) {
  ProducerOptions o;
  o.slot_bytes = 2 << 20;
  o.pin = Pin::kNo;
  o.engine = CopyEngine::kHost;
  o.consumer_timeout = 60s;
  o.delta = true;
  Producer p = Producer::create(a.name, o);
  report(a, "ready");
  Model m(a.seed, a.fraction);
  const std::uint64_t B = buckets(a);
  for (int v = 1; v <= a.versions; ++v) {
    if (!wait_file(a.go + "." + std::to_string(v), 120s)) return 3;
    m.advance();
    for (std::uint64_t b = 0; b < B; ++b) {
      std::vector<TensorSpec> t;
      std::vector<const void*> src;
      for (std::size_t i : bucket(a, b)) {
        t.push_back(m.t[i]);
        src.push_back(m.data[i].data());
      }
      const std::uint64_t want = static_cast<std::uint64_t>(v - 1) * B + b + 1;
      if (p.send(t, src, want) != want) return 4;
      report(a, "sent " + tag(a, static_cast<std::uint64_t>(v), b) + " " + kind(p.last_sync()));
    }
  }
  for (;;) std::this_thread::sleep_for(1s);  // consumers downstream may still read
}

int consume(const Args& a) {
  ConsumerOptions o;
  o.pin = Pin::kNo;
  o.open_timeout = 120s;
  Consumer c = Consumer::open(a.name, o);
  report(a, "attached");
  Model m(a.seed, a.fraction);
  std::vector<std::vector<std::uint8_t>> got(m.t.size());
  for (std::size_t i = 0; i < m.t.size(); ++i) got[i].assign(m.data[i].size(), 0xEE);
  const std::uint64_t B = buckets(a), last = static_cast<std::uint64_t>(a.versions) * B;
  for (;;) {
    const SyncInfo& info = c.wait_sync(120s);
    const std::uint64_t s = info.version, v = (s - 1) / B + 1, b = (s - 1) % B;
    const std::vector<std::size_t> idx = bucket(a, b);
    if (info.tensors.size() != idx.size()) return 13;
    for (std::size_t k = 0; k < idx.size(); ++k)
      if (info.tensors[k].name != m.t[idx[k]].name) return 13;
    if (a.skip_every > 0 && v % static_cast<std::uint64_t>(a.skip_every) == 0 && b == 0) {
      c.skip();
      report(a, "skipped " + tag(a, v, b));
    } else {
      std::vector<void*> dst;
      for (std::size_t i : idx) dst.push_back(got[i].data());
      try {
        c.read_into(dst);
      } catch (const Error& e) {
        if (!a.corrupt_ok || e.code() != Errc::kCorrupt) throw;
        report(a, "corrupt " + tag(a, v, b) + " " + e.what());
        if (s >= last) return 0;
        continue;
      }
      while (m.version < v) m.advance();
      for (std::size_t i : idx)
        if (got[i] != m.data[i]) {
          report(a, "bad " + tag(a, v, b));
          return 12;
        }
      report(a, "ok " + tag(a, v, b) + " " + kind(c.last_sync()));
    }
    if (s >= last) return 0;
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) return 2;
  Args a;
  a.role = argv[1];
  a.name = argv[2];
  for (int i = 3; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--versions") a.versions = std::stoi(v);
    else if (k == "--go") a.go = v;
    else if (k == "--report") a.report = v;
    else if (k == "--seed") a.seed = std::stoull(v);
    else if (k == "--skip-every") a.skip_every = std::stoi(v);
    else if (k == "--fraction") a.fraction = std::stod(v);
    else if (k == "--corrupt-ok") a.corrupt_ok = v == "1";
    else if (k == "--buckets") a.buckets = std::stoi(v);
    else return 2;
  }
  if (a.report.empty() || a.buckets < 0 || a.buckets > 8) return 2;
  try {
    if (a.role == "produce") return produce(a);
    if (a.role == "consume") return consume(a);
  } catch (const Error& e) {
    std::fprintf(stderr, "relay_delta_peer %s: %s\n", a.role.c_str(), e.what());
    return 20 + static_cast<int>(e.code());
  }
  return 2;
}
