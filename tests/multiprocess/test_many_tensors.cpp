// Syncs of many tensors (mixture-of-experts checkpoints: tens of thousands
// of expert matrices) with the default manifest_bytes, in every host mode:
// ring, store, delta, sharded (issue 43). Each byte is checked. The tensors
// are small (the count is what is tested), and slot_bytes is a few MiB so
// the regions stay small on a shared machine: the slot size has no part in
// how many tensors a sync may hold.
//
// The manifest area is reserved sparsely: a region that served a small sync
// allocates a few pages of it, not the whole reserve.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <fcntl.h>

#include "base/layout.hpp"
#include "shmcast/shmcast.hpp"
#include "support.hpp"

using namespace shmcast;
using namespace shmcast_test;
using namespace std::chrono_literals;

namespace {

// `count` tensors named like an MoE checkpoint's, of 1..64 bytes (a mix of
// dtypes), filled with the pattern of (version, index).
struct ManySync {
  std::vector<TensorSpec> specs;
  std::vector<std::vector<std::uint8_t>> data;
  std::vector<const void*> ptrs;
  ManySync(std::uint32_t count, std::uint64_t version, std::uint32_t first = 0) {
    specs.reserve(count);
    data.reserve(count);
    for (std::uint32_t j = first; j < first + count; ++j) {
      const std::int64_t n = 1 + j % 16;
      const DType dt = j % 3 == 0 ? DType::kF32 : j % 3 == 1 ? DType::kBF16 : DType::kU8;
      specs.push_back({"model.layers." + std::to_string(j / 384) + ".mlp.experts." + std::to_string(j / 3 % 128) +
                           ".w" + std::to_string(j % 3) + ".weight",
                       dt, {n}});
      data.emplace_back(specs.back().nbytes());
      fill_pattern(data.back().data(), data.back().size(), seed_of(version, j));
      ptrs.push_back(data.back().data());
    }
  }
};

ProducerOptions many_opts() {
  ProducerOptions o;  // manifest_bytes: the default
  o.pin = Pin::kNo;
  o.engine = CopyEngine::kHost;
  o.slot_bytes = 4 << 20;
  o.consumer_timeout = 60s * kSlowdown;
  o.rank_timeout = 60s * kSlowdown;
  return o;
}

// The next sync, waiting as long as the producer has not finished sending
// it: `sent` (shared with the producer's process, nullptr: not known)
// counts its completed send()s. Building and encoding 100,000 tensors is
// CPU-bound work of another process, which beside stress-ng (scripts/soak)
// took longer than any fixed wait; once the producer has sent sync s, one
// more wait must see it. A backstop of 600 s (times kSlowdown) stays.
const SyncInfo& next_sync(Consumer& c, int s, const std::atomic<int>* sent) {
  const auto end = std::chrono::steady_clock::now() + 600s * kSlowdown;
  for (;;) {
    const bool was_sent = sent == nullptr || sent->load() > s;
    try {
      return c.wait_sync(was_sent ? 60s * kSlowdown : 10s);
    } catch (const Error& e) {
      if (e.code() != Errc::kTimeout || was_sent || std::chrono::steady_clock::now() > end) throw;
    }
  }
}

// Reads `syncs` syncs of `count` tensors and checks every byte of each
// against the pattern of its version. Exit code 0 when all match.
int read_many(const std::string& name, std::uint32_t count, int syncs, const std::atomic<int>* sent = nullptr) {
  ConsumerOptions co;
  co.pin = Pin::kNo;
  co.open_timeout = 30s * kSlowdown;
  Consumer c = Consumer::open(name, co);
  for (int s = 0; s < syncs; ++s) {
    const SyncInfo& info = next_sync(c, s, sent);
    if (info.tensors.size() != count) return 2;
    std::vector<std::uint8_t> all;
    std::vector<void*> dsts(count);
    std::uint64_t total = 0;
    for (const TensorInfo& t : info.tensors) total += t.nbytes;
    all.resize(total);
    std::uint64_t at = 0;
    for (std::uint32_t i = 0; i < count; ++i) {
      dsts[i] = all.data() + at;
      at += info.tensors[i].nbytes;
    }
    c.read_into(dsts);
    // The tensors are in the producer's order; index i is tensor j = i.
    std::vector<std::uint8_t> want;
    at = 0;
    for (std::uint32_t i = 0; i < count; ++i) {
      const std::uint64_t n = info.tensors[i].nbytes;
      want.resize(n);
      fill_pattern(want.data(), n, seed_of(info.version, i));
      if (std::memcmp(want.data(), all.data() + at, n) != 0) return 3;
      at += n;
    }
  }
  return 0;
}

// The producer sends `syncs` syncs of `count` tensors to one consumer.
void many_ring(std::uint32_t count, ProducerOptions o, int syncs = 1) {
  const std::string name = unique_name("many");
  RegionGuard g{name};
  Producer p = Producer::create(name, o);
  SharedFlags* flags = SharedFlags::make();  // v[0]: the producer's completed send()s
  Child cons = Child::spawn([&] { return read_many(name, count, syncs, &flags->v[0]); });
  p.wait_for_consumers(1, 30s * kSlowdown);
  for (int s = 1; s <= syncs; ++s) {
    ManySync m(count, static_cast<std::uint64_t>(s));
    ASSERT_EQ(p.send(m.specs, m.ptrs), static_cast<std::uint64_t>(s));
    flags->v[0].store(s);
  }
  EXPECT_EQ(cons.wait(120s), 0);
}

TEST(ManyTensors, Ring20kAnd100kWithDefaultManifestBytes) {
  many_ring(20000, many_opts());
  many_ring(100000, many_opts());
}

TEST(ManyTensors, Store100kWithDefaultManifestBytes) {
  ProducerOptions o = many_opts();
  o.mode = RegionMode::kStore;
  ManySync m(100000, 1);
  o.store_bytes = store_bytes_needed(m.specs);
  many_ring(100000, o);
}

TEST(ManyTensors, Delta100kWithDefaultManifestBytes) {
  ProducerOptions o = many_opts();
  o.delta = true;
  many_ring(100000, o, 2);  // a full sync, then a delta one
}

// Two ranks, each sending half of the tensors as whole tensors: rank 0 the
// first half, rank 1 the second; the consumer sees one sync of all of them.
TEST(ManyTensors, Sharded100kWithDefaultManifestBytes) {
  const std::uint32_t count = 100000;
  const std::string name = unique_name("many-sh");
  RegionGuard g{name};
  ProducerOptions o = many_opts();
  o.world_size = 2;
  o.slots = 4;
  Child cons = Child::spawn([&] { return read_many(name, count, 1); });
  Child r1 = Child::spawn([&] {
    ProducerOptions o1 = o;
    o1.rank = 1;
    Producer p = Producer::create(name, o1);
    ManySync m(count / 2, 1, count / 2);
    return p.send(m.specs, m.ptrs) == 1 ? 0 : 5;
  });
  Producer p = Producer::create(name, o);
  p.wait_for_consumers(1, 30s * kSlowdown);
  ManySync m(count / 2, 1, 0);
  EXPECT_EQ(p.send(m.specs, m.ptrs), 1u);
  EXPECT_EQ(r1.wait(120s), 0);
  EXPECT_EQ(cons.wait(120s), 0);
}

// A small sync allocates a page or two of the 1 GiB manifest reserve, not
// all of it: the file's allocated blocks stay near its dense part.
TEST(ManyTensors, SmallSyncAllocatesLittleOfTheManifestReserve) {
  const std::string name = unique_name("sparse");
  RegionGuard g{name};
  ProducerOptions o = many_opts();
  Producer p = Producer::create(name, o);
  ManySync m(10, 1);
  // A sync without consumers completes at once.
  ASSERT_EQ(p.send(m.specs, m.ptrs), 1u);
  struct stat st {};
  ASSERT_EQ(::stat((region_dir() + "/shmcast." + name).c_str(), &st), 0);
  const std::uint64_t allocated = static_cast<std::uint64_t>(st.st_blocks) * 512;
  EXPECT_GE(static_cast<std::uint64_t>(st.st_size), limits::kMaxManifestBytes);
  // Two 4 MiB slots, the header part, a page of manifest (rounded up to
  // huge pages where tmpfs uses them).
  EXPECT_LE(allocated, 2 * (4ull << 20) + (8ull << 20)) << "allocated " << allocated << " of " << st.st_size;
}

// Where a limit remains (a manifest_bytes the user chose), the sync is
// refused before anything is written, with the number of tensors that fit.
TEST(ManyTensors, TooSmallManifestBytesSaysHowManyFit) {
  const std::string name = unique_name("room");
  RegionGuard g{name};
  ProducerOptions o = many_opts();
  o.manifest_bytes = 1 << 20;
  Producer p = Producer::create(name, o);
  ManySync m(20000, 1);
  try {
    p.begin_sync(m.specs);
    FAIL() << "a manifest of 20000 tensors fit in 1 MiB";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kInvalidArgument);
    // The number it names is the most of these tensors that do fit.
    const std::string what = e.what();
    const std::size_t at = what.find("room for ");
    ASSERT_NE(at, std::string::npos) << what;
    const std::size_t fit = std::stoul(what.substr(at + 9));
    ASSERT_GT(fit, 1000u) << what;
    ASSERT_LT(fit, m.specs.size()) << what;
    EXPECT_LE(manifest_bytes_needed(std::span(m.specs).first(fit)), 1u << 20) << what;
    EXPECT_GT(manifest_bytes_needed(std::span(m.specs).first(fit * 101 / 100)), 1u << 20) << what;
  }
  EXPECT_EQ(p.last_version(), 0u);
  // The region is unchanged: a sync that fits goes out as version 1.
  ManySync small(100, 1);
  EXPECT_EQ(p.send(small.specs, small.ptrs), 1u);
}

// A hostile producer announces a manifest of 64 MiB over the unallocated
// reserve: the consumer copies it with pread (zeros, no fault), refuses it
// (Corrupt: the hash does not match) and allocates none of it. Through the
// mapping the copy would have allocated every page it read (and a full
// tmpfs would have been a SIGBUS).
TEST(ManyTensors, ManifestAnnouncedOverHolesIsRefusedWithoutAllocatingThem) {
  const std::string name = unique_name("holes");
  RegionGuard g{name};
  Producer p = Producer::create(name, many_opts());
  ConsumerOptions co;
  co.pin = Pin::kNo;
  co.open_timeout = 10s * kSlowdown;
  Consumer c = Consumer::open(name, co);
  ManySync m(10, 1);
  ASSERT_EQ(p.send(m.specs, m.ptrs), 1u);
  const std::string path = region_dir() + "/shmcast." + name;
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  const std::uint64_t used = 64ull << 20;
  ASSERT_EQ(::pwrite(fd, &used, 8, offsetof(detail::Header, sync) + offsetof(detail::SyncRecord, manifest_used)), 8);
  struct stat before {}, after {};
  ASSERT_EQ(::fstat(fd, &before), 0);
  try {
    c.wait_sync(10s * kSlowdown);
    FAIL() << "a manifest of zeros was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kCorrupt) << e.what();
  }
  ASSERT_EQ(::fstat(fd, &after), 0);
  ::close(fd);
  EXPECT_LT(static_cast<std::uint64_t>(after.st_blocks - before.st_blocks) * 512, 1ull << 20)
      << "the consumer allocated the holes it read";
}

// Expert parallelism (issue 43, Wanted 4): rank r of R owns experts
// [r*E/R, (r+1)*E/R) of every layer as whole tensors; an attention matrix is
// TP-sliced along dim 0 across the ranks; a norm is replicated (rank 0
// sends it). One sync carries all of it; a worker reads every tensor (sync
// 1), then a subset by name (sync 2: one expert's matrices and the TP
// tensor, nullptr for the rest), every byte checked by name.
namespace ep {
constexpr int R = 4, E = 16, L = 2;
std::vector<std::uint8_t> full_bytes(const std::string& name, std::uint64_t n, std::uint64_t version) {
  std::vector<std::uint8_t> b(n);
  fill_pattern(b.data(), n, seed_of(version, std::hash<std::string>{}(name) % 100000));
  return b;
}
std::string expert(int l, int e, int m) {
  return "model.layers." + std::to_string(l) + ".mlp.experts." + std::to_string(e) + ".w" + std::to_string(m);
}
// Rank r's specs and bytes for `version`.
void rank_sync(int r, std::uint64_t version, std::vector<TensorSpec>* specs, std::vector<std::vector<std::uint8_t>>* data) {
  for (int l = 0; l < L; ++l)
    for (int e = r * E / R; e < (r + 1) * E / R; ++e)
      for (int m = 0; m < 3; ++m) {
        specs->push_back({expert(l, e, m), DType::kBF16, {8, 4}});
        data->push_back(full_bytes(specs->back().name, 64, version));
      }
  // attn: f32 {8, 4}, rows [2r, 2r + 2) on rank r.
  TensorSpec t{"model.attn.q", DType::kF32, {8, 4}};
  t.shard_dim = 0;
  t.shard_start = 2 * r;
  t.shard_length = 2;
  specs->push_back(t);
  const auto all = full_bytes(t.name, 128, version);
  data->emplace_back(all.begin() + 32 * r, all.begin() + 32 * (r + 1));
  if (r == 0) {
    specs->push_back({"model.norm", DType::kF32, {4}});
    data->push_back(full_bytes("model.norm", 16, version));
  }
}
}  // namespace ep

TEST(ManyTensors, ExpertParallelRanksMixedWithTpAndReplicatedInOneSync) {
  using namespace ep;
  const std::string name = unique_name("ep");
  RegionGuard g{name};
  ProducerOptions o = many_opts();
  o.world_size = R;
  o.slots = 2 * R;
  auto run_rank = [&](int r) {
    ProducerOptions ro = o;
    ro.rank = static_cast<std::uint32_t>(r);
    Producer p = Producer::create(name, ro);
    if (r == 0) p.wait_for_consumers(1, 30s * kSlowdown);
    for (std::uint64_t v = 1; v <= 2; ++v) {
      std::vector<TensorSpec> specs;
      std::vector<std::vector<std::uint8_t>> data;
      rank_sync(r, v, &specs, &data);
      std::vector<const void*> ptrs;
      for (auto& d : data) ptrs.push_back(d.data());
      if (p.send(specs, ptrs) != v) return 5;
    }
    p.wait_drained(30s * kSlowdown);
    return 0;
  };
  Child cons = Child::spawn([&] {
    ConsumerOptions co;
    co.pin = Pin::kNo;
    co.open_timeout = 30s * kSlowdown;
    Consumer c = Consumer::open(name, co);
    for (std::uint64_t v = 1; v <= 2; ++v) {
      const SyncInfo& s = c.wait_sync(60s * kSlowdown);
      if (s.tensors.size() != std::size_t{L} * E * 3 + 2) return 2;
      std::vector<std::vector<std::uint8_t>> got(s.tensors.size());
      std::vector<void*> dsts(s.tensors.size(), nullptr);
      for (std::size_t i = 0; i < s.tensors.size(); ++i) {
        const std::string& n = s.tensors[i].name;
        // Sync 2: a subset by name (expert 5 of every layer, and the TP tensor).
        if (v == 2 && n.find(".experts.5.") == std::string::npos && n != "model.attn.q") continue;
        got[i].assign(s.tensors[i].nbytes, 0xA5);
        dsts[i] = got[i].data();
      }
      c.read_into(dsts);
      int read = 0;
      for (std::size_t i = 0; i < s.tensors.size(); ++i) {
        if (dsts[i] == nullptr) continue;
        ++read;
        if (got[i] != full_bytes(s.tensors[i].name, s.tensors[i].nbytes, v)) return 3;
      }
      if (read != (v == 1 ? L * E * 3 + 2 : L * 3 + 1)) return 4;
    }
    return 0;
  });
  std::vector<std::unique_ptr<Child>> ranks;
  for (int r = 1; r < R; ++r) ranks.push_back(std::make_unique<Child>(Child::spawn([&, r] { return run_rank(r); })));
  EXPECT_EQ(run_rank(0), 0);
  for (auto& c : ranks) EXPECT_EQ(c->wait(120s), 0);
  EXPECT_EQ(cons.wait(120s), 0);
}

}  // namespace
