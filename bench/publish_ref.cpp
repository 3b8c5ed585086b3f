// shmcast-publish-ref: the helpers of bench/publish_bench.sh.
//
//   shmcast-publish-ref gen DIR [--layers 36] [--shards 1]   a Qwen2.5-3B-shaped bf16 checkpoint
//                                                            (36 layers: 434 tensors, 6,171,877,376
//                                                            bytes) of random bytes
//   shmcast-publish-ref memcpy BYTES [--reps 10]             single-thread memcpy of BYTES
//   shmcast-publish-ref evict PATH...                        drop files (or a directory's files)
//                                                            from the page cache (fadvise DONTNEED)
//   shmcast-publish-ref consume REGION [--prefault BYTES]    one consumer: receive the next sync
//                                                            into host memory, report its times
//
// Every command prints one JSON document on stdout.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "shmcast/shmcast.hpp"

using json = nlohmann::json;
namespace fs = std::filesystem;
using clk = std::chrono::steady_clock;

namespace {

double since(clk::time_point t) { return std::chrono::duration<double>(clk::now() - t).count(); }

struct Spec {
  std::string name;
  std::vector<std::int64_t> shape;
  std::uint64_t bytes;
};

// Qwen2.5-3B (bf16, tied embeddings) with `layers` layers, in the order the
// reference writer uses (by name).
std::vector<Spec> qwen(int layers) {
  const std::int64_t H = 2048, I = 11008, KV = 256, V = 151936;
  std::vector<Spec> v;
  auto add = [&](std::string n, std::vector<std::int64_t> s) {
    std::uint64_t e = 2;
    for (auto d : s) e *= static_cast<std::uint64_t>(d);
    v.push_back({std::move(n), std::move(s), e});
  };
  add("model.embed_tokens.weight", {V, H});
  for (int l = 0; l < layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "self_attn.q_proj.weight", {H, H});
    add(p + "self_attn.q_proj.bias", {H});
    add(p + "self_attn.k_proj.weight", {KV, H});
    add(p + "self_attn.k_proj.bias", {KV});
    add(p + "self_attn.v_proj.weight", {KV, H});
    add(p + "self_attn.v_proj.bias", {KV});
    add(p + "self_attn.o_proj.weight", {H, H});
    add(p + "mlp.gate_proj.weight", {I, H});
    add(p + "mlp.up_proj.weight", {I, H});
    add(p + "mlp.down_proj.weight", {H, I});
    add(p + "input_layernorm.weight", {H});
    add(p + "post_attention_layernorm.weight", {H});
  }
  add("model.norm.weight", {H});
  std::sort(v.begin(), v.end(), [](const Spec& a, const Spec& b) { return a.name < b.name; });
  return v;
}

void fill_random(std::uint8_t* p, std::size_t n, std::uint64_t& x) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(p + i, &x, 8);
  }
  for (; i < n; ++i) p[i] = static_cast<std::uint8_t>(x >> (i % 8));
}

void write_all(int fd, const void* data, std::size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      throw std::runtime_error(std::string("write: ") + std::strerror(errno));
    }
    p += w;
    n -= static_cast<std::size_t>(w);
  }
}

int gen(const std::string& dir, int layers, int shards, std::uint64_t seed) {
  const auto t0 = clk::now();
  fs::create_directories(dir);
  const std::vector<Spec> specs = qwen(layers);
  std::uint64_t total = 0;
  for (const Spec& s : specs) total += s.bytes;
  // Shards of about total / shards bytes, tensors in order.
  std::vector<std::vector<const Spec*>> parts(static_cast<std::size_t>(shards));
  std::uint64_t acc = 0;
  for (const Spec& s : specs) {
    auto k = static_cast<std::size_t>(acc * static_cast<std::uint64_t>(shards) / total);
    parts[std::min<std::size_t>(k, parts.size() - 1)].push_back(&s);
    acc += s.bytes;
  }
  std::vector<std::uint8_t> buf(64u << 20);
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  json weight_map = json::object();
  json files = json::array();
  for (int k = 0; k < shards; ++k) {
    char nm[64];
    if (shards == 1)
      std::snprintf(nm, sizeof nm, "model.safetensors");
    else
      std::snprintf(nm, sizeof nm, "model-%05d-of-%05d.safetensors", k + 1, shards);
    json h = json::object();
    h["__metadata__"] = {{"format", "pt"}};
    std::uint64_t off = 0;
    for (const Spec* s : parts[static_cast<std::size_t>(k)]) {
      h[s->name] = {{"dtype", "BF16"}, {"shape", s->shape}, {"data_offsets", {off, off + s->bytes}}};
      off += s->bytes;
      weight_map[s->name] = nm;
    }
    std::string text = h.dump();
    while (text.size() % 8) text.push_back(' ');
    const std::string path = dir + "/" + nm;
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) throw std::runtime_error("open " + path + ": " + std::strerror(errno));
    std::uint8_t len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<std::uint8_t>(static_cast<std::uint64_t>(text.size()) >> (8 * i));
    write_all(fd, len, 8);
    write_all(fd, text.data(), text.size());
    for (std::uint64_t left = off; left > 0;) {
      const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(left, buf.size()));
      fill_random(buf.data(), n, x);
      write_all(fd, buf.data(), n);
      left -= n;
    }
    if (::fsync(fd) != 0 || ::close(fd) != 0) throw std::runtime_error("fsync " + path);
    files.push_back(path);
  }
  if (shards > 1) {
    const json idx = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    std::FILE* f = std::fopen((dir + "/model.safetensors.index.json").c_str(), "w");
    if (!f) throw std::runtime_error("cannot write the index");
    const std::string t = idx.dump(2);
    std::fwrite(t.data(), 1, t.size(), f);
    std::fclose(f);
  }
  std::cout << json{{"command", "gen"}, {"dir", dir},         {"files", files},
                    {"tensors", specs.size()}, {"payload_bytes", total}, {"seconds", since(t0)}}
                   .dump()
            << std::endl;
  return 0;
}

void* prefaulted(std::uint64_t n) {
  void* m = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) throw std::runtime_error("mmap " + std::to_string(n) + " bytes failed");
  ::madvise(m, n, MADV_HUGEPAGE);
  std::memset(m, 1, n);
  return m;
}

json stats(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const double med = v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
  return {{"reps", v.size()}, {"min_s", v.front()}, {"median_s", med}, {"max_s", v.back()}, {"all_s", v}};
}

int memcpy_ref(std::uint64_t bytes, int reps) {
  auto* src = static_cast<std::uint8_t*>(prefaulted(bytes));
  auto* dst = static_cast<std::uint8_t*>(prefaulted(bytes));
  std::uint64_t x = 7;
  fill_random(src, static_cast<std::size_t>(bytes), x);
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = clk::now();
    std::memcpy(dst, src, bytes);
    t.push_back(since(t0));
  }
  if (std::memcmp(dst, src, bytes) != 0) throw std::runtime_error("memcpy check failed");
  json j = stats(t);
  j["command"] = "memcpy";
  j["bytes"] = bytes;
  j["gbps_median"] = static_cast<double>(bytes) / j["median_s"].get<double>() / 1e9;
  std::cout << j.dump() << std::endl;
  return 0;
}

int evict(const std::vector<std::string>& paths) {
  std::uint64_t files = 0, bytes = 0;
  auto one = [&](const fs::path& p) {
    const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    struct stat st {};
    ::fstat(fd, &st);
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
    files++;
    bytes += static_cast<std::uint64_t>(st.st_size);
  };
  for (const std::string& s : paths) {
    if (fs::is_directory(s)) {
      for (const auto& e : fs::directory_iterator(s))
        if (e.is_regular_file()) one(e.path());
    } else {
      one(s);
    }
  }
  std::cout << json{{"command", "evict"}, {"files", files}, {"bytes", bytes}}.dump() << std::endl;
  return 0;
}

int consume(const std::string& region, double timeout_s, std::uint64_t prefault, int syncs) {
  using namespace std::chrono;
  const auto to = duration_cast<shmcast::Duration>(duration<double>(timeout_s));
  shmcast::ConsumerOptions co;
  co.pin = shmcast::Pin::kNo;
  co.open_timeout = to;
  co.chunk_timeout = to;
  // Destinations faulted in before the sync arrives (--prefault: the
  // payload size, known to the caller), so that the producer never waits
  // while this consumer takes page faults; a larger sync gets a new slab.
  std::uint64_t have = std::max<std::uint64_t>(prefault, 1);
  auto* slab = static_cast<std::uint8_t*>(prefaulted(have));
  shmcast::Consumer c = shmcast::Consumer::open(region, co);
  std::cerr << "consumer ready" << std::endl;
  for (int n = 0; n < syncs; ++n) {
    const auto t0 = clk::now();
    const shmcast::SyncInfo& info = c.wait_sync(to);
    const double wait_s = since(t0);
    if (info.payload_bytes > have) {
      slab = static_cast<std::uint8_t*>(prefaulted(info.payload_bytes));
      have = info.payload_bytes;
    }
    std::vector<void*> dst;
    std::uint64_t off = 0;
    for (const shmcast::TensorInfo& t : info.tensors) {
      dst.push_back(slab + off);
      off += t.nbytes;
    }
    const auto t1 = clk::now();
    c.read_into(dst);
    const double read_s = since(t1);
    std::cout << json{{"command", "consume"}, {"version", info.version}, {"tensors", info.tensors.size()},
                      {"bytes", info.payload_bytes}, {"wait_s", wait_s}, {"read_s", read_s}}
                     .dump()
              << std::endl;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"shmcast-publish-ref: helpers of bench/publish_bench.sh", "shmcast-publish-ref"};
  app.require_subcommand(1);
  std::string dir, region;
  int layers = 36, shards = 1, reps = 10;
  std::uint64_t seed = 1, bytes = 0;
  double timeout = 120;
  std::vector<std::string> paths;
  auto* g = app.add_subcommand("gen", "Write a Qwen2.5-3B-shaped bf16 checkpoint of random bytes");
  g->add_option("DIR", dir)->required();
  g->add_option("--layers", layers)->check(CLI::Range(0, 1000))->capture_default_str();
  g->add_option("--shards", shards)->check(CLI::Range(1, 1000))->capture_default_str();
  g->add_option("--seed", seed)->capture_default_str();
  auto* m = app.add_subcommand("memcpy", "Single-thread memcpy of BYTES between two prefaulted buffers");
  m->add_option("BYTES", bytes)->required();
  m->add_option("--reps", reps)->check(CLI::Range(1, 1000))->capture_default_str();
  auto* e = app.add_subcommand("evict", "Drop files from the page cache (fdatasync + fadvise DONTNEED)");
  e->add_option("PATH", paths)->required();
  auto* c = app.add_subcommand("consume", "Receive the next sync of REGION into host memory");
  c->add_option("REGION", region)->required();
  c->add_option("--timeout", timeout)->capture_default_str();
  c->add_option("--prefault", bytes, "Fault in this many bytes of destination before the sync arrives");
  c->add_option("--syncs", reps, "Syncs to receive")->check(CLI::Range(1, 1000000));
  CLI11_PARSE(app, argc, argv);
  try {
    if (g->parsed()) return gen(dir, layers, shards, seed);
    if (m->parsed()) return memcpy_ref(bytes, reps);
    if (e->parsed()) return evict(paths);
    if (c->parsed()) return consume(region, timeout, bytes, c->count("--syncs") ? reps : 1);
  } catch (const std::exception& ex) {
    std::cerr << "shmcast-publish-ref: " << ex.what() << "\n";
    return 1;
  }
  return 2;
}
