// shmcast-delta-bench: the delta codec on one tensor (lib/core/protocol/delta*.{hpp,cpp}).
//
//   shmcast-delta-bench                       # host, 256 MiB of bf16, 0.5/2/10/30 % changed, 10 reps
//   shmcast-delta-bench --mode cuda --mib 1024
//   shmcast-delta-bench --mode both --json
//
// For each change fraction: plan (compare and checksum), encode (write the
// blob, update the base), apply (whole tensor, no verification) and verify
// (the result's checksum), each min/median/max of --reps repetitions (on
// the GPU also the producer's whole sequence: plan, reading the blob's size
// back, encode, on the host clock), with
// the payload ratio (blob bytes / raw bytes), and next to them a copy of the
// raw bytes measured right before, in the same run: single-thread memcpy and
// a memcpy on the codec's thread count (host), a device-to-device copy
// (CUDA). Throughputs are raw (logical) bytes per second.
//
// Every repetition gets fresh changes (new random positions and values,
// derived from the seed, the fraction and the repetition, made outside the
// timer), and after its timers stop every byte is checked: the base after
// encode and the destination after apply must equal the new tensor
// (`verified: N/N`; a mismatch exits 1). On the GPU the first repetition's
// blob is also compared with the host codec's, byte for byte.
//
// --shard-cols C (host): also a Shard(1) piece, as a row-parallel layer's
// rank holds it: the tensor seen as [bytes / (C w), C] elements, the piece
// its first C / 2 columns, applied to the whole tensor (strided rows):
// apply unchecked (no check: what a strided piece got before) and apply
// with the check read back through the map, in the same repetition
// (`shard1_apply_gbs`, `shard1_apply_checked_gbs`, of the piece's bytes).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "protocol/delta.hpp"
#include "engine/delta_cuda.hpp"

#ifdef SHMCAST_DELTA_BENCH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace {

namespace dl = shmcast::detail::delta;
using json = nlohmann::json;
using Bytes = std::vector<std::uint8_t>;

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Stat {
  double min = 0, median = 0, max = 0;
};
Stat stat_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return {v.front(), n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]), v.back()};
}

// GB/s of `bytes` at each time, as a stat (min/median/max of the rates).
Stat rate(std::uint64_t bytes, const std::vector<double>& secs) {
  std::vector<double> r;
  for (double s : secs) r.push_back(static_cast<double>(bytes) / s / 1e9);
  return stat_of(r);
}

json to_json(const Stat& s) { return {{"min", s.min}, {"median", s.median}, {"max", s.max}}; }

std::string fmt(const Stat& s) {
  char b[96];
  std::snprintf(b, sizeof b, "%7.2f [%6.2f, %6.2f]", s.median, s.min, s.max);
  return b;
}

void fill_random(Bytes& v, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (std::size_t i = 0; i < v.size(); i += 8) {
    const std::uint64_t x = rng();
    std::memcpy(&v[i], &x, std::min<std::size_t>(8, v.size() - i));
  }
}

// next = base with elements changed at random positions (geometric gaps:
// each element changed with probability frac), each a non-zero xor.
void make_next(const Bytes& base, Bytes& next, std::uint32_t w, double frac, std::uint64_t seed) {
  std::memcpy(next.data(), base.data(), base.size());
  if (frac <= 0) return;
  std::mt19937_64 rng(seed);
  const std::uint64_t n = base.size() / w;
  std::geometric_distribution<std::uint64_t> gap(frac);
  for (std::uint64_t e = gap(rng); e < n; e += 1 + gap(rng)) {
    std::uint64_t x = 0;
    while (x == 0) x = rng() & (w == 8 ? ~0ull : (1ull << (8 * w)) - 1);
    for (std::uint32_t i = 0; i < w; ++i) next[e * w + i] ^= static_cast<std::uint8_t>(x >> (8 * i));
  }
}

void copy_threads(std::uint8_t* dst, const std::uint8_t* src, std::uint64_t bytes, unsigned threads) {
  if (threads <= 1) {
    std::memcpy(dst, src, bytes);
    return;
  }
  std::vector<std::thread> pool;
  const std::uint64_t per = (bytes / threads + 63) & ~63ull;
  for (unsigned t = 0; t < threads; ++t) {
    const std::uint64_t a = std::min<std::uint64_t>(bytes, t * per), e = std::min<std::uint64_t>(bytes, a + per);
    pool.emplace_back([=] { std::memcpy(dst + a, src + a, e - a); });
  }
  for (auto& th : pool) th.join();
}

struct Options {
  std::string mode = "host";
  std::uint64_t mib = 256;
  std::uint32_t width = 2;
  std::vector<double> fractions = {0.005, 0.02, 0.10, 0.30};
  int reps = 10;
  std::uint64_t seed = 1;
  bool json_out = false;
  std::uint64_t shard_cols = 0;  // > 0: the Shard(1) figures
};

// Rows of `cols` elements of w bytes; the piece: columns [0, cols / 2), contiguous.
Bytes first_columns(const Bytes& full, std::uint32_t w, std::uint64_t cols) {
  const std::uint64_t row = cols * w, half = cols / 2 * w, rows = full.size() / row;
  Bytes out(rows * half);
  for (std::uint64_t r = 0; r < rows; ++r) std::memcpy(&out[r * half], &full[r * row], half);
  return out;
}

int g_failures = 0;

json run_host(const Options& o) {
  const std::uint64_t bytes = o.mib << 20, n = bytes / o.width;
  const unsigned threads = dl::threads_for(2 * bytes);
  Bytes base(bytes), next(bytes), work(bytes), dst(bytes), blob(dl::max_blob_bytes(o.width, n)), scratch(bytes);
  fill_random(base, o.seed);
  json out = json::array();
  if (!o.json_out)
    std::printf("host: %llu MiB of %u-byte elements, %u codec threads, %d reps; GB/s of raw bytes, median [min, max]\n",
                static_cast<unsigned long long>(o.mib), o.width, threads, o.reps);
  for (double f : o.fractions) {
    // The ceilings, right before this configuration.
    std::vector<double> cp1, cpt;
    for (int r = 0; r < o.reps; ++r) {
      double t0 = now_s();
      std::memcpy(scratch.data(), base.data(), bytes);
      cp1.push_back(now_s() - t0);
      t0 = now_s();
      copy_threads(scratch.data(), base.data(), bytes, threads);
      cpt.push_back(now_s() - t0);
    }
    std::vector<double> t_plan, t_enc, t_apply, t_verify, ratio;
    int verified = 0;
    for (int r = 0; r < o.reps; ++r) {
      make_next(base, next, o.width, f, o.seed * 1000003 + static_cast<std::uint64_t>(f * 1e6) * 101 + r);
      std::memcpy(work.data(), base.data(), bytes);
      std::memcpy(dst.data(), base.data(), bytes);
      double t0 = now_s();
      const dl::Plan p = dl::plan(work.data(), next.data(), o.width, n);
      double t1 = now_s();
      dl::encode(p, work.data(), next.data(), blob.data(), p.blob_bytes());
      double t2 = now_s();
      const std::span<const std::byte> b(reinterpret_cast<const std::byte*>(blob.data()), p.blob_bytes());
      dl::apply(b, o.width, n, dst.data(), bytes, false);
      double t3 = now_s();
      const std::uint64_t c = dl::checksum(dst.data(), bytes);
      double t4 = now_s();
      t_plan.push_back(t1 - t0);
      t_enc.push_back(t2 - t1);
      t_apply.push_back(t3 - t2);
      t_verify.push_back(t4 - t3);
      ratio.push_back(static_cast<double>(p.blob_bytes()) / static_cast<double>(bytes));
      const bool ok = std::memcmp(work.data(), next.data(), bytes) == 0 && std::memcmp(dst.data(), next.data(), bytes) == 0 &&
                      c == p.checksum;
      verified += ok ? 1 : 0;
    }
    if (verified != o.reps) ++g_failures;
    std::vector<double> t_pe;
    for (int r = 0; r < o.reps; ++r) t_pe.push_back(t_plan[r] + t_enc[r]);
    // A Shard(1) piece into the whole tensor: unchecked, then checked.
    std::vector<double> t_s1, t_s1c;
    std::uint64_t s1_bytes = 0;
    if (o.shard_cols >= 2) {
      const std::uint64_t cols = o.shard_cols, rows = n / cols;
      const std::vector<std::int64_t> shape = {static_cast<std::int64_t>(rows), static_cast<std::int64_t>(cols)};
      const shmcast::Selection piece{1, 0, static_cast<std::int64_t>(cols / 2)};
      const dl::SliceMap m = dl::slice_map(shape, o.width, piece, shmcast::Selection{});
      const std::uint64_t tensor = rows * cols * o.width;
      s1_bytes = m.n * o.width;
      int ok = 0;
      for (int r = 0; r < o.reps; ++r) {
        make_next(base, next, o.width, f, o.seed * 7 + static_cast<std::uint64_t>(f * 1e6) * 13 + r);
        Bytes pb = first_columns(base, o.width, cols);
        const Bytes pn = first_columns(next, o.width, cols);
        const dl::Plan p = dl::plan(pb.data(), pn.data(), o.width, m.n);
        dl::encode(p, pb.data(), pn.data(), blob.data(), p.blob_bytes());
        const std::span<const std::byte> b(reinterpret_cast<const std::byte*>(blob.data()), p.blob_bytes());
        for (int checked = 0; checked < 2; ++checked) {
          std::memcpy(dst.data(), base.data(), tensor);
          const double t0 = now_s();
          dl::apply(b, o.width, m, dst.data(), tensor, checked != 0);
          (checked ? t_s1c : t_s1).push_back(now_s() - t0);
          ok += first_columns(dst, o.width, cols) == pn ? 1 : 0;
        }
      }
      if (ok != 2 * o.reps) ++g_failures;
    }
    const Stat pr = stat_of(ratio);
    json j = {{"path", "host"},
              {"fraction", f},
              {"bytes", bytes},
              {"width", o.width},
              {"threads", threads},
              {"reps", o.reps},
              {"payload_ratio", to_json(pr)},
              {"plan_gbs", to_json(rate(bytes, t_plan))},
              {"encode_gbs", to_json(rate(bytes, t_enc))},
              {"plan_encode_gbs", to_json(rate(bytes, t_pe))},
              {"apply_gbs", to_json(rate(bytes, t_apply))},
              {"verify_gbs", to_json(rate(bytes, t_verify))},
              {"memcpy_1t_gbs", to_json(rate(bytes, cp1))},
              {"memcpy_threads_gbs", to_json(rate(bytes, cpt))},
              {"verified", verified}};
    if (!t_s1.empty()) {
      j["shard1_cols"] = o.shard_cols;
      j["shard1_piece_bytes"] = s1_bytes;
      j["shard1_apply_gbs"] = to_json(rate(s1_bytes, t_s1));
      j["shard1_apply_checked_gbs"] = to_json(rate(s1_bytes, t_s1c));
    }
    out.push_back(j);
    if (o.json_out) continue;
    std::printf("  %5.1f %%  payload/raw %.4f [%.4f, %.4f]  verified %d/%d\n", f * 100, pr.median, pr.min, pr.max,
                verified, o.reps);
    std::printf("     plan %s   encode %s   plan+encode %s\n", fmt(rate(bytes, t_plan)).c_str(),
                fmt(rate(bytes, t_enc)).c_str(), fmt(rate(bytes, t_pe)).c_str());
    std::printf("    apply %s   verify %s\n", fmt(rate(bytes, t_apply)).c_str(), fmt(rate(bytes, t_verify)).c_str());
    std::printf("   memcpy %s (1 thread)   %s (%u threads)\n", fmt(rate(bytes, cp1)).c_str(),
                fmt(rate(bytes, cpt)).c_str(), threads);
    if (!t_s1.empty())
      std::printf("  shard(1) piece (%llu cols, half): apply %s   apply+check %s\n",
                  static_cast<unsigned long long>(o.shard_cols), fmt(rate(s1_bytes, t_s1)).c_str(),
                  fmt(rate(s1_bytes, t_s1c)).c_str());
  }
  return out;
}

#ifdef SHMCAST_DELTA_BENCH_CUDA
void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

json run_cuda(const Options& o) {
  std::string why;
  if (!dl::cuda_codec_available(&why)) throw std::runtime_error("no CUDA delta codec: " + why);
  const std::uint64_t bytes = o.mib << 20, n = bytes / o.width;
  const std::uint64_t head = dl::head_bytes(n), max_blob = dl::max_blob_bytes(o.width, n);
  Bytes base(bytes), next(bytes), got(bytes);
  fill_random(base, o.seed);
  void *d_base0, *d_base, *d_next, *d_head, *d_out, *d_dst, *d_sum;
  ck(cudaMalloc(&d_base0, bytes), "cudaMalloc");
  ck(cudaMalloc(&d_base, bytes), "cudaMalloc");
  ck(cudaMalloc(&d_next, bytes), "cudaMalloc");
  ck(cudaMalloc(&d_head, head), "cudaMalloc");
  ck(cudaMalloc(&d_out, max_blob), "cudaMalloc");
  ck(cudaMalloc(&d_dst, bytes), "cudaMalloc");
  ck(cudaMalloc(&d_sum, 8), "cudaMalloc");
  ck(cudaMemcpy(d_base0, base.data(), bytes, cudaMemcpyHostToDevice), "upload");
  cudaStream_t s;
  ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  cudaEvent_t ev[8];
  for (auto& e : ev) ck(cudaEventCreate(&e), "cudaEventCreate");
  auto ms = [&](int a, int b) {
    float x = 0;
    ck(cudaEventElapsedTime(&x, ev[a], ev[b]), "cudaEventElapsedTime");
    return static_cast<double>(x) / 1e3;
  };
  dl::CudaCodec codec;
  json out = json::array();
  if (!o.json_out)
    std::printf("cuda: %llu MiB of %u-byte elements, %d reps; GB/s of raw bytes, median [min, max]\n",
                static_cast<unsigned long long>(o.mib), o.width, o.reps);
  // Warm-up: loads (JIT-compiles) the kernels.
  codec.plan(d_base0, d_base0, o.width, n, d_head, s);
  codec.finish(s);
  for (double f : o.fractions) {
    std::vector<double> cp;
    for (int r = 0; r < o.reps; ++r) {
      ck(cudaEventRecord(ev[0], s), "record");
      ck(cudaMemcpyAsync(d_dst, d_base0, bytes, cudaMemcpyDeviceToDevice, s), "D2D");
      ck(cudaEventRecord(ev[1], s), "record");
      ck(cudaStreamSynchronize(s), "sync");
      cp.push_back(ms(0, 1));
    }
    std::vector<double> t_plan, t_pe, t_enc, t_apply, t_verify, ratio;
    int verified = 0;
    for (int r = 0; r < o.reps; ++r) {
      make_next(base, next, o.width, f, o.seed * 1000003 + static_cast<std::uint64_t>(f * 1e6) * 101 + r);
      ck(cudaMemcpy(d_next, next.data(), bytes, cudaMemcpyHostToDevice), "upload");
      ck(cudaMemcpy(d_base, d_base0, bytes, cudaMemcpyDeviceToDevice), "D2D");
      ck(cudaMemcpy(d_dst, d_base0, bytes, cudaMemcpyDeviceToDevice), "D2D");
      ck(cudaStreamSynchronize(s), "sync");
      // The producer's whole sequence on the host clock: plan, read the size
      // (one 64-byte D2H and a sync), encode, wait for it.
      const double h0 = now_s();
      ck(cudaEventRecord(ev[0], s), "record");
      codec.plan(d_base, d_next, o.width, n, d_head, s);
      ck(cudaEventRecord(ev[1], s), "record");
      const dl::Header h = codec.read_header(d_head, s);
      const std::uint64_t size = head + h.payload_bytes;
      ck(cudaEventRecord(ev[2], s), "record");
      codec.encode(d_base, d_next, o.width, n, d_head, d_out, size, s);
      ck(cudaEventRecord(ev[3], s), "record");
      ck(cudaEventSynchronize(ev[3]), "sync");
      const double h1 = now_s();
      codec.apply(d_out, size, o.width, dl::whole_map(n), d_dst, bytes, false, s);
      ck(cudaEventRecord(ev[4], s), "record");
      codec.checksum(d_dst, bytes, d_sum, s);
      ck(cudaEventRecord(ev[5], s), "record");
      codec.finish(s);
      t_plan.push_back(ms(0, 1));
      t_pe.push_back(h1 - h0);
      t_enc.push_back(ms(2, 3));
      t_apply.push_back(ms(3, 4));
      t_verify.push_back(ms(4, 5));
      ratio.push_back(static_cast<double>(size) / static_cast<double>(bytes));
      bool ok = true;
      ck(cudaMemcpy(got.data(), d_dst, bytes, cudaMemcpyDeviceToHost), "download");
      ok = ok && std::memcmp(got.data(), next.data(), bytes) == 0;
      ck(cudaMemcpy(got.data(), d_base, bytes, cudaMemcpyDeviceToHost), "download");
      ok = ok && std::memcmp(got.data(), next.data(), bytes) == 0;
      std::uint64_t sum = 0;
      ck(cudaMemcpy(&sum, d_sum, 8, cudaMemcpyDeviceToHost), "download");
      ok = ok && sum == h.checksum;
      if (r == 0) {  // the host codec's blob, byte for byte
        Bytes hb = base, blob(size), want;
        const dl::Plan p = dl::plan(hb.data(), next.data(), o.width, n);
        want.resize(p.blob_bytes());
        dl::encode(p, hb.data(), next.data(), want.data(), want.size());
        ck(cudaMemcpy(blob.data(), d_out, size, cudaMemcpyDeviceToHost), "download");
        ok = ok && blob == want;
      }
      verified += ok ? 1 : 0;
    }
    if (verified != o.reps) ++g_failures;
    const Stat pr = stat_of(ratio);
    json j = {{"path", "cuda"},
              {"fraction", f},
              {"bytes", bytes},
              {"width", o.width},
              {"reps", o.reps},
              {"payload_ratio", to_json(pr)},
              {"plan_gbs", to_json(rate(bytes, t_plan))},
              {"encode_gbs", to_json(rate(bytes, t_enc))},
              {"plan_encode_gbs", to_json(rate(bytes, t_pe))},
              {"apply_gbs", to_json(rate(bytes, t_apply))},
              {"verify_gbs", to_json(rate(bytes, t_verify))},
              {"d2d_copy_gbs", to_json(rate(bytes, cp))},
              {"verified", verified}};
    out.push_back(j);
    if (o.json_out) continue;
    std::printf("  %5.1f %%  payload/raw %.4f [%.4f, %.4f]  verified %d/%d\n", f * 100, pr.median, pr.min, pr.max,
                verified, o.reps);
    std::printf("     plan %s   encode %s   producer (plan, size, encode) %s\n", fmt(rate(bytes, t_plan)).c_str(),
                fmt(rate(bytes, t_enc)).c_str(), fmt(rate(bytes, t_pe)).c_str());
    std::printf("    apply %s   verify %s\n", fmt(rate(bytes, t_apply)).c_str(), fmt(rate(bytes, t_verify)).c_str());
    std::printf("  D2D copy %s\n", fmt(rate(bytes, cp)).c_str());
  }
  for (auto& e : ev) cudaEventDestroy(e);
  cudaStreamDestroy(s);
  for (void* p : {d_base0, d_base, d_next, d_head, d_out, d_dst, d_sum}) cudaFree(p);
  return out;
}
#else
json run_cuda(const Options&) {
  throw std::runtime_error("this shmcast-delta-bench was built without the CUDA runtime (no CUDA toolkit at build time)");
}
#endif

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"shmcast-delta-bench: the delta codec's encode and apply throughput and payload ratio"};
  app.add_option("--mode", o.mode, "host, cuda or both")->check(CLI::IsMember({"host", "cuda", "both"}));
  app.add_option("--mib", o.mib, "tensor size in MiB (256)");
  app.add_option("--width", o.width, "element width in bytes: 1, 2, 4 or 8 (2: bf16)")->check(CLI::IsMember({1, 2, 4, 8}));
  app.add_option("--fractions", o.fractions, "changed fractions (0.005 0.02 0.10 0.30)");
  app.add_option("--reps", o.reps, "repetitions per figure (10)")->check(CLI::Range(1, 1000));
  app.add_option("--seed", o.seed, "random seed (1)");
  app.add_flag("--json", o.json_out, "one JSON document on stdout");
  app.add_option("--shard-cols", o.shard_cols,
                 "host: also apply a Shard(1) piece (the first half of C columns) to the whole tensor, "
                 "unchecked and checked (0: off)");
  CLI11_PARSE(app, argc, argv);
  try {
    json all = json::array();
    if (o.mode == "host" || o.mode == "both")
      for (auto& j : run_host(o)) all.push_back(j);
    if (o.mode == "cuda" || o.mode == "both")
      for (auto& j : run_cuda(o)) all.push_back(j);
    if (o.json_out) std::printf("%s\n", all.dump(1).c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shmcast-delta-bench: %s\n", e.what());
    return 2;
  }
  if (g_failures != 0) {
    std::fprintf(stderr, "shmcast-delta-bench: %d configurations had repetitions that failed verification\n",
                 g_failures);
    return 1;
  }
  return 0;
}
