// GPU tier: delta syncs (ProducerOptions::delta) between processes with
// device tensors, from one producer and from two sharded ranks. The producer's bases live on its GPU and its deltas are
// encoded there (the CUDA codec); a device consumer applies them on its GPU
// (read_into_device), a host consumer on the host (read_into); both must be
// bit-exact at every version. Skips without a GPU or without the delta
// kernels.
#include <gtest/gtest.h>

#include "delta_sync_support.hpp"
#include "engine/delta_cuda.hpp"
#include "gpu_support.hpp"
#include "protocol/rounds.hpp"

using namespace shmcast;
using namespace shmcast_test;
using namespace shmcast_gpu;
using namespace delta_sync_test;
using namespace std::chrono_literals;

namespace {

// Whether the codec's kernels can run, probed in a forked child: CUDA is
// never initialised in this process, which forks the roles.
bool codec_in_child() {
  Child probe = Child::spawn([] {
    std::string why;
    return shmcast::detail::delta::cuda_codec_available(&why) ? 0 : 1;
  });
  return probe.wait(60s) == 0;
}

#define REQUIRE_DELTA_GPU()                                                                     \
  do {                                                                                          \
    SHMCAST_REQUIRE_GPU();                                                                      \
    if (!codec_in_child()) GTEST_SKIP() << "no CUDA delta codec (built without nvcc, or no GPU)"; \
  } while (0)

constexpr std::uint64_t kVersions = 20;

ProducerOptions opts() {
  ProducerOptions o;
  o.slot_bytes = 2ull << 20;
  o.slots = 2;
  o.max_consumers = 4;
  o.pin = Pin::kYes;
  o.engine = CopyEngine::kCuda;
  o.delta = true;
  o.consumer_timeout = 60s;
  return o;
}

ConsumerOptions copts() {
  ConsumerOptions o;
  o.pin = Pin::kYes;
  o.open_timeout = 60s;
  o.chunk_timeout = 60s;
  return o;
}

// Tensor i of the model is written from the GPU, except tensor 3 (from the
// host: its base stays on the host).
int producer(const std::string& name, int consumers) {
  Producer p = Producer::create(name, opts());
  p.wait_for_consumers(static_cast<std::uint32_t>(consumers), 60s);
  cudaStream_t s = nullptr;
  ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  Model m(true);
  std::vector<DevBuf> dev;
  for (const auto& d : m.data) dev.emplace_back(d.size());
  for (std::uint64_t v = 1; v <= kVersions; ++v) {
    if (v > 1) m.step(v);
    for (std::size_t i = 0; i < dev.size(); ++i) dev[i].upload(m.data[i].data(), m.data[i].size());
    // (cudaMemcpy from pageable memory may return before its DMA lands; `s`
    // does not wait for the legacy stream.)
    ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    if (p.begin_sync(m.specs) != v) return 21;
    for (std::size_t i = 0; i < dev.size(); ++i) {
      if (i == 3)
        p.write(i, m.data[i].data());
      else
        p.write_device(i, dev[i].p, s);
    }
    p.end_sync();
    const SyncReport r = p.last_sync();
    if (r.delta != (v > 1)) {
      std::fprintf(stderr, "version %llu went %s\n", (unsigned long long)v, r.delta ? "delta" : "full");
      return 22;
    }
    if (v > 1 && r.payload_bytes * 2 > r.logical_bytes) return 23;
  }
  if (p.delta_base_bytes() != m.bytes()) return 24;
  p.wait_drained(60s);
  cudaStreamDestroy(s);
  return 0;
}

int device_consumer(const std::string& name) {
  Consumer c = Consumer::open(name, copts());
  cudaStream_t s = nullptr;
  ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  Model want(true);
  std::vector<DevBuf> dst;
  std::vector<void*> ptrs;
  for (const auto& d : want.data) {
    dst.emplace_back(d.size());
    ptrs.push_back(dst.back().p);
  }
  for (std::uint64_t v = 1; v <= kVersions; ++v) {
    if (c.wait_sync(60s).version != v) return 31;
    if (v > 1) want.step(v);
    c.read_into_device(ptrs, s);
    ck(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    for (std::size_t i = 0; i < want.data.size(); ++i) {
      const long long d = first_diff(download(ptrs[i], want.data[i].size()), want.data[i]);
      if (d >= 0) {
        std::fprintf(stderr, "device consumer: version %llu tensor %zu differs at byte %lld\n",
                     (unsigned long long)v, i, d);
        return 32;
      }
    }
    if (c.last_sync().delta != (v > 1)) return 33;
  }
  cudaStreamDestroy(s);
  return 0;
}

int host_consumer(const std::string& name) {
  Consumer c = Consumer::open(name, copts());
  Model want(true);
  Dsts got(want);
  for (std::uint64_t v = 1; v <= kVersions; ++v) {
    if (c.wait_sync(60s).version != v) return 41;
    if (v > 1) want.step(v);
    c.read_into(got.ptrs);
    if (!got.equals(want)) return 42;
  }
  return 0;
}

}  // namespace

TEST(DeltaSyncGpu, DeviceProducerDeviceAndHostConsumersBitExact) {
  REQUIRE_DELTA_GPU();
  const std::string name = unique_name("gpudelta");
  RegionGuard guard{name};
  Child prod = Child::spawn([&] { return producer(name, 2); });
  Child dev = Child::spawn([&] { return device_consumer(name); });
  Child host = Child::spawn([&] { return host_consumer(name); });
  EXPECT_EQ(prod.wait(240s), 0);
  EXPECT_EQ(dev.wait(240s), 0);
  EXPECT_EQ(host.wait(240s), 0);
}

// On the GPU too: a destination changed behind the consumer's back fails
// the applied result's checksum (Corrupt), other destinations are refused
// (NeedsFullSync), and the full sync each asks for repairs the weights.
// (Which version answers a request depends on timing: the consumer follows
// the versions it is given.)
TEST(DeltaSyncGpu, WrongBaseAndOtherDestinationsOnTheDevice) {
  REQUIRE_DELTA_GPU();
  const std::string name = unique_name("gpudeltabad");
  RegionGuard guard{name};
  constexpr std::uint64_t kLast = 10;
  Child prod = Child::spawn([&] {
    Producer p = Producer::create(name, opts());
    p.wait_for_consumers(1, 60s);
    Model m(false);
    std::vector<DevBuf> dev;
    for (const auto& d : m.data) dev.emplace_back(d.size());
    for (std::uint64_t v = 1; v <= kLast; ++v) {
      if (v > 1) m.step(v);
      for (std::size_t i = 0; i < dev.size(); ++i) dev[i].upload(m.data[i].data(), m.data[i].size());
      ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      p.begin_sync(m.specs);
      for (std::size_t i = 0; i < dev.size(); ++i) p.write_device(i, dev[i].p, nullptr);
      p.end_sync();
      if (v == 1 && p.last_sync().delta) return 51;
      if (v == 2 && !p.last_sync().delta) return 52;
    }
    p.wait_drained(60s);
    return 0;
  });
  Child cons = Child::spawn([&] {
    Consumer c = Consumer::open(name, copts());
    Model want(false);
    std::uint64_t have = 1;
    auto follow = [&](std::uint64_t v) {
      while (have < v) want.step(++have);
    };
    std::vector<DevBuf> a, b;
    std::vector<void*> pa, pb;
    for (const auto& d : want.data) {
      a.emplace_back(d.size());
      pa.push_back(a.back().p);
      b.emplace_back(d.size());
      pb.push_back(b.back().p);
    }
    auto exact = [&](const std::vector<void*>& ptrs) {
      ck(cudaDeviceSynchronize(), "sync");
      for (std::size_t i = 0; i < want.data.size(); ++i)
        if (first_diff(download(ptrs[i], want.data[i].size()), want.data[i]) >= 0) return false;
      return true;
    };
    c.wait_sync(60s);
    c.read_into_device(pa, nullptr);
    if (!exact(pa)) return 60;
    // A delta (version 2), but a byte of the base was changed behind our back.
    ck(cudaMemset(static_cast<char*>(pa[0]) + 100, 0x5a, 1), "cudaMemset");
    if (c.wait_sync(60s).version != 2 || !c.sync().delta()) return 61;
    if (code_of([&] { c.read_into_device(pa, nullptr); }) != Errc::kCorrupt) return 62;
    // The next sync this consumer gets is full (deltas on a base it lacks are let go).
    follow(c.wait_sync(60s).version);
    if (c.sync().delta()) return 63;
    c.read_into_device(pa, nullptr);
    if (!exact(pa)) return 64;
    // Then deltas again, applied on the device.
    follow(c.wait_sync(60s).version);
    if (!c.sync().delta()) return 65;
    c.read_into_device(pa, nullptr);
    if (!exact(pa)) return 66;
    // A delta into other buffers: refused; the next one this consumer gets is full.
    follow(c.wait_sync(60s).version);
    if (!c.sync().delta()) return 67;
    if (code_of([&] { c.read_into_device(pb, nullptr); }) != Errc::kNeedsFullSync) return 68;
    follow(c.wait_sync(60s).version);
    if (c.sync().delta()) return 69;
    c.read_into_device(pb, nullptr);
    if (!exact(pb)) return 70;
    while (have < kLast) {
      follow(c.wait_sync(60s).version);
      c.read_into_device(pb, nullptr);
      if (!exact(pb)) return 71;
    }
    return 0;
  });
  EXPECT_EQ(prod.wait(120s), 0);
  EXPECT_EQ(cons.wait(120s), 0);
}

// Two sharded ranks, each writing its rows of two tensors from its GPU (its
// base: its shards only, encoded on the GPU); a device consumer reads the
// whole tensors: bit-exact at every version, every version after the first
// a delta on both ranks.
// Two ranks encode their shards on the GPU (cut along `dim`: 0, or 1 as
// row-parallel layers are, their pieces then landing strided in a whole
// tensor); a consumer applies them on its GPU. With `change_after`, the
// consumer changes its destination of "n" in place after reading that
// version: the next delta must fail (kCorrupt, the CUDA codec checks every
// piece where it lands), the version after it is full and bit-exact.
void sharded_on_gpu(int dim, std::uint64_t change_after) {
  const std::string name = unique_name("gpudeltash");
  RegionGuard guard{name};
  constexpr int kRanks = 2;
  constexpr std::uint64_t kLast = 8;
  struct T {
    const char* name;
    DType dt;
    std::int64_t rows, cols;
  };
  static const T kT[] = {{"w", DType::kBF16, 512, 1536}, {"n", DType::kF32, 300, 700}};
  // The whole tensors at version v: 2 % of the elements changed per version.
  auto weights = [](std::uint64_t v) {
    std::vector<std::vector<std::uint8_t>> out;
    for (std::size_t i = 0; i < 2; ++i) {
      const std::size_t z = dtype_size(kT[i].dt);
      const std::uint64_t n = static_cast<std::uint64_t>(kT[i].rows * kT[i].cols);
      std::vector<std::uint8_t> d(n * z);
      fill_pattern(d.data(), d.size(), 0x5eed + i);
      for (std::uint64_t u = 2; u <= v; ++u) {
        std::mt19937_64 rng(u * 131 + i);
        for (std::uint64_t j = 0; j < n / 50; ++j) {
          const std::uint64_t e = rng() % n;
          d[e * z] ^= static_cast<std::uint8_t>(rng() | 1);
        }
      }
      out.push_back(std::move(d));
    }
    return out;
  };
  auto rows_of = [](std::int64_t rows, int r) {
    const std::int64_t c = (rows + kRanks - 1) / kRanks, start = std::min(rows, c * r);
    return std::pair<std::int64_t, std::int64_t>{start, std::min(rows, start + c) - start};
  };
  // Rank r's piece of tensor i's bytes `full`, contiguous.
  auto piece_of = [&](std::size_t i, const std::vector<std::uint8_t>& full, int r) {
    const std::size_t z = dtype_size(kT[i].dt);
    const auto [start, len] = rows_of(dim == 0 ? kT[i].rows : kT[i].cols, r);
    const std::size_t row = static_cast<std::size_t>(kT[i].cols) * z;
    if (dim == 0)
      return std::vector<std::uint8_t>(full.begin() + static_cast<std::ptrdiff_t>(start * row),
                                       full.begin() + static_cast<std::ptrdiff_t>((start + len) * row));
    std::vector<std::uint8_t> out;
    for (std::int64_t y = 0; y < kT[i].rows; ++y) {
      const auto a = full.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(y) * row + start * z);
      out.insert(out.end(), a, a + len * static_cast<std::ptrdiff_t>(z));
    }
    return out;
  };
  auto rank = [&](int r) {
    ProducerOptions o = opts();
    o.rank = static_cast<std::uint32_t>(r);
    o.world_size = kRanks;
    o.slots = 4;
    o.rank_timeout = 60s;
    Producer p = Producer::create(name, o);
    if (r == 0) p.wait_for_consumers(1, 60s);
    cudaStream_t s = nullptr;
    ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    std::vector<TensorSpec> specs;
    std::vector<DevBuf> dev;
    std::uint64_t mine = 0;
    for (const T& t : kT) {
      const auto [start, len] = rows_of(dim == 0 ? t.rows : t.cols, r);
      TensorSpec sp{t.name, t.dt, {t.rows, t.cols}};
      sp.shard_dim = dim;
      sp.shard_start = start;
      sp.shard_length = len;
      specs.push_back(sp);
      const std::uint64_t bytes = sp.local_nbytes();
      dev.emplace_back(static_cast<std::size_t>(bytes));
      mine += bytes;
    }
    for (std::uint64_t v = 1; v <= kLast; ++v) {
      const auto w = weights(v);
      for (std::size_t i = 0; i < 2; ++i) {
        const std::vector<std::uint8_t> mine_i = piece_of(i, w[i], r);
        dev[i].upload(mine_i.data(), mine_i.size());
      }
      ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      if (p.begin_sync(specs, v) != v) return 81;
      for (std::size_t i = 0; i < 2; ++i) p.write_device(i, dev[i].p, s);
      p.end_sync();
      if (change_after == 0 && p.last_sync().delta != (v > 1)) {
        std::fprintf(stderr, "rank %d version %llu went %s\n", r, (unsigned long long)v,
                     p.last_sync().delta ? "delta" : "full");
        return 82;
      }
    }
    if (p.delta_base_bytes() != mine) return 83;
    if (r == 0) p.wait_drained(60s);
    cudaStreamDestroy(s);
    return 0;
  };
  Child r0 = Child::spawn([&] { return rank(0); });
  Child r1 = Child::spawn([&] { return rank(1); });
  Child cons = Child::spawn([&] {
    Consumer c = Consumer::open(name, copts());
    std::vector<DevBuf> dst;
    std::vector<void*> ptrs;
    for (const T& t : kT) {
      dst.emplace_back(static_cast<std::size_t>(t.rows * t.cols) * dtype_size(t.dt));
      ptrs.push_back(dst.back().p);
    }
    bool failed = false;
    std::uint64_t first_after = 0;
    for (;;) {
      const SyncInfo& s = c.wait_sync(60s);
      const std::uint64_t v = s.version;
      const bool delta = s.delta();
      try {
        c.read_into_device(ptrs, nullptr);
      } catch (const Error& e) {
        if (change_after == 0 || failed || v != change_after + 1 || e.code() != Errc::kCorrupt) {
          std::fprintf(stderr, "version %llu: %s\n", (unsigned long long)v, e.what());
          return 94;
        }
        failed = true;
        continue;
      }
      ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      if (change_after != 0 && v == change_after + 1) {
        std::fprintf(stderr, "version %llu (%s) was applied to a changed destination and reported good\n",
                     (unsigned long long)v, delta ? "delta" : "full");
        return 95;
      }
      const auto w = weights(v);
      for (std::size_t i = 0; i < 2; ++i) {
        const long long d = first_diff(download(ptrs[i], w[i].size()), w[i]);
        if (d >= 0) {
          std::fprintf(stderr, "version %llu tensor %zu differs at byte %lld\n", (unsigned long long)v, i, d);
          return 92;
        }
      }
      if (c.last_sync().delta != delta) return 93;
      if (change_after == 0 && delta != (v > 1)) return 93;
      if (failed && first_after == 0) {
        first_after = v;
        if (delta) return 96;  // the first version read after the failure is full: it asked for one
      }
      if (v == change_after) {
        std::vector<std::uint8_t> junk(w[1].size());
        for (std::size_t b = 0; b < junk.size(); ++b) junk[b] = static_cast<std::uint8_t>(w[1][b] ^ 0x40);
        ck(cudaMemcpy(ptrs[1], junk.data(), junk.size(), cudaMemcpyHostToDevice), "cudaMemcpy");
      }
      if (v >= kLast) return change_after != 0 && !failed ? 97 : 0;
    }
  });
  EXPECT_EQ(r0.wait(240s), 0);
  EXPECT_EQ(r1.wait(240s), 0);
  EXPECT_EQ(cons.wait(240s), 0);
}

TEST(DeltaSyncGpu, ShardedRanksEncodeTheirShardsOnTheGpu) {
  REQUIRE_DELTA_GPU();
  sharded_on_gpu(0, 0);
}

// Shard(1) pieces land strided in the consumer's whole tensors: applied
// and checked there on the GPU; a destination changed after version 4
// makes version 5 fail (kCorrupt) instead of returning wrong weights.
TEST(DeltaSyncGpu, ShardOnePiecesAreCheckedWhereTheyLandOnTheGpu) {
  REQUIRE_DELTA_GPU();
  sharded_on_gpu(1, 0);
  sharded_on_gpu(1, 4);
}

// A tensor changed on the GPU between the plan (the blobs' sizes, the
// announced manifest) and its encode: the sync is aborted before its last
// chunk is published, so a consumer that does not verify checksums never
// reads it as a success; the next sync is full and bit-exact. (The check
// used to run after the last write, whose chunk a fast consumer could
// already have read.)
// A MoE-like delta sync: 600 tensors from the GPU on one stream, whose
// blobs go out as the stream itself (a launch and a copy per chunk, not
// per tensor), beside a raw tensor from its device base and an empty one
// (a host blob). 1 MiB slots: blobs straddle chunks and are moved to the
// next one. Device and host consumers check every byte of six versions.
// Fails if the batched encode or the chunk-wise writes break a byte.
static Model many_model() {
  Model m(false);
  m.specs.clear();
  m.data.clear();
  std::mt19937_64 rng(99);
  for (int i = 0; i < 600; ++i) {
    const std::int64_t n = 1 + static_cast<std::int64_t>(rng() % 40000);
    m.specs.push_back({"expert." + std::to_string(i), i % 50 == 7 ? DType::kF32 : DType::kBF16, {n}});
  }
  m.specs.push_back({"rotary", DType::kC128, {10}});
  m.specs.push_back({"empty", DType::kBF16, {0, 4}});
  m.specs.push_back({"tail", DType::kBF16, {5}});
  for (const TensorSpec& t : m.specs) {
    m.data.emplace_back(t.nbytes());
    shmcast_test::fill_pattern(m.data.back().data(), m.data.back().size(), 0x77 + m.data.size());
  }
  return m;
}

TEST(DeltaSyncGpu, ManyTensorsOnOneStreamGoOutAsTheStreamBitExact) {
  REQUIRE_DELTA_GPU();
  const std::string name = unique_name("gpudeltamany");
  RegionGuard guard{name};
  constexpr std::uint64_t kLast = 6;
  Child prod = Child::spawn([&] {
    ProducerOptions o = opts();
    o.slot_bytes = 1ull << 20;
    Producer p = Producer::create(name, o);
    p.wait_for_consumers(2, 60s);
    cudaStream_t s = nullptr;
    ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    Model m = many_model();
    std::vector<DevBuf> dev;
    for (const auto& d : m.data) dev.emplace_back(d.size());
    for (std::uint64_t v = 1; v <= kLast; ++v) {
      if (v > 1) m.step(v, 0.05, 0.001);
      for (std::size_t i = 0; i < dev.size(); ++i) dev[i].upload(m.data[i].data(), m.data[i].size());
      ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      if (p.begin_sync(m.specs) != v) return 21;
      for (std::size_t i = 0; i < dev.size(); ++i) p.write_device(i, dev[i].p, s);
      p.end_sync();
      if (p.last_sync().delta != (v > 1)) {
        std::fprintf(stderr, "version %llu went %s\n", (unsigned long long)v, p.last_sync().delta ? "delta" : "full");
        return 22;
      }
    }
    p.wait_drained(60s);
    cudaStreamDestroy(s);
    return 0;
  });
  Child dev_cons = Child::spawn([&] {
    Consumer c = Consumer::open(name, copts());
    cudaStream_t s = nullptr;
    ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    Model want = many_model();
    std::vector<DevBuf> dst;
    std::vector<void*> ptrs;
    for (const auto& d : want.data) {
      dst.emplace_back(d.size());
      ptrs.push_back(dst.back().p);
    }
    for (std::uint64_t v = 1; v <= kLast; ++v) {
      if (c.wait_sync(60s).version != v) return 31;
      if (v > 1) want.step(v, 0.05, 0.001);
      c.read_into_device(ptrs, s);
      ck(cudaStreamSynchronize(s), "cudaStreamSynchronize");
      if (c.last_sync().delta != (v > 1)) return 32;
      for (std::size_t i = 0; i < want.data.size(); ++i) {
        if (want.data[i].empty()) continue;
        const long long d = first_diff(download(ptrs[i], want.data[i].size()), want.data[i]);
        if (d >= 0) {
          std::fprintf(stderr, "device consumer: version %llu tensor %zu differs at byte %lld\n",
                       (unsigned long long)v, i, d);
          return 33;
        }
      }
    }
    cudaStreamDestroy(s);
    return 0;
  });
  Child host_cons = Child::spawn([&] {
    Consumer c = Consumer::open(name, copts());
    Model want = many_model();
    Dsts got(want);
    for (std::uint64_t v = 1; v <= kLast; ++v) {
      if (c.wait_sync(60s).version != v) return 41;
      if (v > 1) want.step(v, 0.05, 0.001);
      c.read_into(got.ptrs);
      if (!got.equals(want)) return 42;
    }
    return 0;
  });
  EXPECT_EQ(prod.wait(240s), 0);
  EXPECT_EQ(dev_cons.wait(240s), 0);
  EXPECT_EQ(host_cons.wait(240s), 0);
}

TEST(DeltaSyncGpu, ATensorChangedBetweenPlanAndEncodeAbortsTheSync) {
  REQUIRE_DELTA_GPU();
  const std::string name = unique_name("gpudeltaplan");
  RegionGuard guard{name};
  constexpr std::uint64_t kLast = 5, kBad = 3;
  auto* seen = static_cast<std::atomic<int>*>(
      ::mmap(nullptr, sizeof(std::atomic<int>), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(seen, MAP_FAILED);
  new (seen) std::atomic<int>(0);
  Child prod = Child::spawn([&] {
    Producer p = Producer::create(name, opts());
    p.wait_for_consumers(1, 60s);
    Model m(false);
    std::vector<DevBuf> dev;
    for (const auto& d : m.data) dev.emplace_back(d.size());
    void* victim = dev[0].p;
    shmcast::detail::test_point = [victim, seen](const shmcast::detail::TestPointArgs& a) {
      if (a.at != shmcast::detail::TestPoint::kDeltaPlanned || a.round != kBad) return;
      // The consumer is waiting for this sync's chunks (bounded: it may be late).
      for (int i = 0; i < 20000 && seen->load() == 0; ++i) ::usleep(1000);
      ck(cudaMemset(victim, 0x5a, 65536), "cudaMemset");  // 32768 bf16 elements: counts change
      ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    };
    for (std::uint64_t v = 1; v <= kLast; ++v) {
      if (v > 1) m.step(v);
      for (std::size_t i = 0; i < dev.size(); ++i) dev[i].upload(m.data[i].data(), m.data[i].size());
      ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      if (p.begin_sync(m.specs) != v) return 70;
      for (std::size_t i = 0; i < dev.size(); ++i) p.write_device(i, dev[i].p, nullptr);
      if (v == kBad) {
        const Errc e = code_of([&] { p.end_sync(); });
        if (e != Errc::kInvalidArgument) {
          std::fprintf(stderr, "end_sync of the changed tensor's sync: errc %d\n", static_cast<int>(e));
          return 71;
        }
        continue;
      }
      p.end_sync();
      if (v == 2 && !p.last_sync().delta) return 72;
      if (v == kBad + 1 && p.last_sync().delta) return 73;  // after the abort: full
    }
    p.wait_drained(60s);
    return 0;
  });
  Child cons = Child::spawn([&] {
    ConsumerOptions o = copts();
    o.verify_checksums = false;  // only the abort keeps the bad sync out
    Consumer c = Consumer::open(name, o);
    Model want(false);
    std::uint64_t have = 1;
    std::vector<DevBuf> dst;
    std::vector<void*> ptrs;
    for (const auto& d : want.data) {
      dst.emplace_back(d.size());
      ptrs.push_back(dst.back().p);
    }
    std::uint64_t v = 0;
    while (v < kLast) {
      v = c.wait_sync(60s).version;
      while (have < v) want.step(++have);
      if (v == kBad) {
        seen->store(1);
        const Errc e = code_of([&] { c.read_into_device(ptrs, nullptr); });
        if (e == static_cast<Errc>(0)) return 81;  // the aborted sync read as a success
        continue;
      }
      try {
        c.read_into_device(ptrs, nullptr);
      } catch (const Error& e) {
        if (e.code() != Errc::kNeedsFullSync) throw;
        continue;  // a delta on a base this consumer lacks (after the bad sync): the next is full
      }
      ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      for (std::size_t i = 0; i < want.data.size(); ++i)
        if (first_diff(download(ptrs[i], want.data[i].size()), want.data[i]) >= 0) {
          std::fprintf(stderr, "version %llu tensor %zu differs\n", (unsigned long long)v, i);
          return 82;
        }
    }
    return 0;
  });
  EXPECT_EQ(prod.wait(120s), 0);
  EXPECT_EQ(cons.wait(120s), 0);
  ::munmap(seen, sizeof(std::atomic<int>));
}
