// GPU tier: device slots (SlotMemory::kDevice) between processes on a real
// GPU. The producer's slots are a VMM allocation on its GPU, fetched by the
// consumers over the fd channel at open; every copy is done by the GPU.
//
//  * bit-exact transfers: device sources (contiguous and strided) and a host
//    source, into device destinations (read_into_device, with and without
//    selections), host destinations (read_into) and the staging buffer
//    (read_to_staging), two consumers at once, over several versions that
//    span more chunks than slots;
//  * a producer SIGKILLed in the middle of a sync: the consumer gets
//    kPeerDied, never a hang or wrong bytes;
//  * a consumer that sees no GPU (CUDA_VISIBLE_DEVICES empty) is refused at
//    open with kUnsupported;
//  * 100 create / open / sync / close cycles leave the GPU's free memory
//    where it was (cuMemGetInfo).
// Skips without a GPU.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <thread>

#include "engine/cuda_vmm.hpp"
#include "gpu_support.hpp"

using namespace shmcast;
using namespace shmcast_test;
using namespace shmcast_gpu;
using namespace std::chrono_literals;

namespace {

constexpr std::uint64_t kSlot = 2ull << 20;

ProducerOptions popts(std::uint32_t slots = 3) {
  ProducerOptions o;
  o.slot_memory = SlotMemory::kDevice;
  o.slot_bytes = kSlot;
  o.slots = slots;
  o.max_consumers = 4;
  o.consumer_timeout = 60s;
  return o;
}

ConsumerOptions copts() {
  ConsumerOptions o;
  o.open_timeout = 60s;
  o.chunk_timeout = 60s;
  return o;
}

// Tensors of a sync: sizes that cross chunk boundaries, one empty, one
// odd-sized; tensor 1 is written from a strided source (a column block of
// a wider matrix), tensor 3 from host memory.
struct Model {
  std::vector<TensorSpec> specs;
  explicit Model() {
    specs.push_back(TensorSpec{"a", DType::kBF16, {3 * 1024, 1024}});      // 6 MiB: several chunks
    specs.push_back(TensorSpec{"strided", DType::kF32, {512, 300}});       // from a 512 x 512 fp32 matrix
    specs.push_back(TensorSpec{"empty", DType::kF32, {0}});
    specs.push_back(TensorSpec{"host", DType::kU8, {1234567}});
    specs.push_back(TensorSpec{"b", DType::kF16, {777, 1031}});
  }
  std::size_t bytes(std::size_t i) const { return specs[i].nbytes(); }
  std::vector<std::uint8_t> want(std::size_t i, std::uint64_t v) const { return pattern(bytes(i), v * 131 + i); }
};

constexpr std::uint64_t kPitchF32 = 512 * 4;

int producer(const std::string& name, int consumers, std::uint64_t versions, int die_at = 0) {
  Producer p = Producer::create(name, popts());
  if (p.slot_memory() != SlotMemory::kDevice) return 11;
  if (p.slot_device_bytes() < 3 * kSlot || p.slot_device() < 0) return 12;
  if (p.pinned()) return 13;
  p.wait_for_consumers(static_cast<std::uint32_t>(consumers), 60s);
  Model m;
  cudaStream_t s = nullptr;
  ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  std::vector<DevBuf> dev;
  for (std::size_t i = 0; i < m.specs.size(); ++i) dev.emplace_back(i == 1 ? 512 * kPitchF32 : m.bytes(i));
  for (std::uint64_t v = 1; v <= versions; ++v) {
    for (std::size_t i = 0; i < m.specs.size(); ++i) {
      const std::vector<std::uint8_t> w = m.want(i, v);
      if (i == 1) {
        ck(cudaMemcpy2D(dev[i].p, kPitchF32, w.data(), 300 * 4, 300 * 4, 512, cudaMemcpyHostToDevice), "2D upload");
      } else {
        dev[i].upload(w.data(), w.size());
      }
    }
    ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    if (p.begin_sync(m.specs) != v) return 21;
    std::vector<std::uint8_t> host = m.want(3, v);
    for (std::size_t i = 0; i < m.specs.size(); ++i) {
      if (die_at != 0 && v == static_cast<std::uint64_t>(die_at) && i == 1) ::raise(SIGKILL);  // mid-sync
      if (i == 1)
        p.write_device_strided(i, dev[i].p, Strided2D{512, 300 * 4, kPitchF32}, s);
      else if (i == 3)
        p.write(i, host.data());
      else
        p.write_device(i, dev[i].p, s);
    }
    p.end_sync();
  }
  p.wait_drained(60s);
  cudaStreamDestroy(s);
  return 0;
}

// Reads every version into device buffers (odd versions with a selection
// of rows of tensor 0), host buffers and the staging buffer in turn.
int consumer(const std::string& name, std::uint64_t versions) {
  Consumer c = Consumer::open(name, copts());
  if (c.slot_memory() != SlotMemory::kDevice) return 31;
  if (c.pinned()) return 32;
  Model m;
  cudaStream_t s = nullptr;
  ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  std::vector<DevBuf> dev;
  std::vector<void*> dptrs;
  std::vector<std::vector<std::uint8_t>> host;
  std::vector<void*> hptrs;
  for (std::size_t i = 0; i < m.specs.size(); ++i) {
    dev.emplace_back(m.bytes(i));
    dptrs.push_back(m.bytes(i) ? dev.back().p : nullptr);
    host.emplace_back(m.bytes(i));
    hptrs.push_back(host.back().data());
  }
  for (std::uint64_t v = 1; v <= versions; ++v) {
    if (c.wait_sync(60s).version != v) return 33;
    const int how = static_cast<int>(v % 3);
    if (v == 1) {
      // visit() hands slot bytes to host code: refused, the sync still readable.
      try {
        c.visit([](const Piece&) {});
        return 34;
      } catch (const Error& e) {
        if (e.code() != Errc::kUnsupported) return 35;
      }
    }
    if (how == 0) {
      c.read_into(hptrs);
      for (std::size_t i = 0; i < m.specs.size(); ++i)
        if (host[i] != m.want(i, v)) {
          std::fprintf(stderr, "host read: version %llu tensor %zu differs\n", (unsigned long long)v, i);
          return 37;
        }
    } else if (how == 1) {
      // Rows [100, 2100) of tensor 0 (crosses a chunk boundary), the rest whole.
      std::vector<Selection> sel(m.specs.size());
      sel[0] = Selection{0, 100, 2000};
      c.read_into_device(dptrs, s, sel);
      ck(cudaStreamSynchronize(s), "sync");
      const std::vector<std::uint8_t> w0 = m.want(0, v);
      const std::vector<std::uint8_t> got0 = download(dptrs[0], 2000 * 1024 * 2);
      if (!std::equal(got0.begin(), got0.end(), w0.begin() + 100 * 1024 * 2)) return 38;
      for (std::size_t i = 1; i < m.specs.size(); ++i)
        if (first_diff(download(dptrs[i], m.bytes(i)), m.want(i, v)) >= 0) return 39;
    } else {
      std::vector<void*> st = c.read_to_staging(0, s);
      ck(cudaStreamSynchronize(s), "sync");
      for (std::size_t i = 0; i < m.specs.size(); ++i)
        if (m.bytes(i) != 0 && first_diff(download(st[i], m.bytes(i)), m.want(i, v)) >= 0) return 40;
    }
  }
  cudaStreamDestroy(s);
  return 0;
}

}  // namespace

TEST(DeviceSlotsGpu, TwoConsumersReadEveryVersionBitExact) {
  SHMCAST_REQUIRE_GPU();
  const std::string name = unique_name("devslots");
  RegionGuard guard{name};
  constexpr std::uint64_t kVersions = 12;
  Child prod = Child::spawn([&] { return producer(name, 2, kVersions); });
  Child c1 = Child::spawn([&] { return consumer(name, kVersions); });
  Child c2 = Child::spawn([&] { return consumer(name, kVersions); });
  EXPECT_EQ(prod.wait(240s), 0);
  EXPECT_EQ(c1.wait(240s), 0);
  EXPECT_EQ(c2.wait(240s), 0);
}

// A MoE-like sync through large device slots: 170 expert-sized tensors
// (3 MiB, some a few bytes more or less: pieces that end unaligned), all
// under 8 MiB, so every piece goes through the batch kernel, whose blocks
// are sized by each chunk's bytes (2 x 256 MiB slots: 128 KiB). Two
// versions, every byte checked on the device consumer. Fails if the
// batching splits, drops or misplaces a piece.
TEST(DeviceSlotsGpu, ManyExpertSizedPiecesInLargeSlotsBitExact) {
  SHMCAST_REQUIRE_GPU();
  const std::string name = unique_name("devslotsmoe");
  RegionGuard guard{name};
  constexpr std::uint64_t kVersions = 2, kBig = 256ull << 20;
  std::vector<TensorSpec> specs;
  for (int i = 0; i < 170; ++i) {
    const std::int64_t n = (3 << 20) + (i % 5 == 0 ? 3 : 0) - (i % 7 == 0 ? 5 : 0);
    specs.push_back(TensorSpec{"layer." + std::to_string(i / 32) + ".expert." + std::to_string(i), DType::kU8, {n}});
  }
  specs.push_back(TensorSpec{"norm", DType::kF32, {2048}});
  auto want = [](std::size_t i, std::uint64_t v, std::size_t n) { return pattern(n, v * 977 + i); };
  Child prod = Child::spawn([&] {
    ProducerOptions o = popts(2);
    o.slot_bytes = kBig;
    Producer p = Producer::create(name, o);
    if (p.slot_memory() != SlotMemory::kDevice) return 11;
    p.wait_for_consumers(1, 60s);
    cudaStream_t s = nullptr;
    ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    std::vector<DevBuf> dev;
    for (const TensorSpec& t : specs) dev.emplace_back(t.nbytes());
    for (std::uint64_t v = 1; v <= kVersions; ++v) {
      for (std::size_t i = 0; i < specs.size(); ++i) {
        const std::vector<std::uint8_t> w = want(i, v, specs[i].nbytes());
        dev[i].upload(w.data(), w.size());
      }
      ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      if (p.begin_sync(specs) != v) return 21;
      for (std::size_t i = 0; i < specs.size(); ++i) p.write_device(i, dev[i].p, s);
      p.end_sync();
    }
    p.wait_drained(60s);
    cudaStreamDestroy(s);
    return 0;
  });
  Child cons = Child::spawn([&] {
    Consumer c = Consumer::open(name, copts());
    if (c.slot_memory() != SlotMemory::kDevice) return 31;
    cudaStream_t s = nullptr;
    ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    std::vector<DevBuf> dev;
    std::vector<void*> ptrs;
    for (const TensorSpec& t : specs) {
      dev.emplace_back(t.nbytes());
      ptrs.push_back(dev.back().p);
    }
    for (std::uint64_t v = 1; v <= kVersions; ++v) {
      if (c.wait_sync(60s).version != v) return 32;
      c.read_into_device(ptrs, s);
      ck(cudaStreamSynchronize(s), "sync");
      for (std::size_t i = 0; i < specs.size(); ++i) {
        const long long d = first_diff(download(ptrs[i], specs[i].nbytes()), want(i, v, specs[i].nbytes()));
        if (d >= 0) {
          std::fprintf(stderr, "version %llu tensor %zu differs at byte %lld\n", (unsigned long long)v, i, d);
          return 33;
        }
      }
    }
    cudaStreamDestroy(s);
    return 0;
  });
  EXPECT_EQ(prod.wait(240s), 0);
  EXPECT_EQ(cons.wait(240s), 0);
}

// The producer is SIGKILLed after announcing a sync and writing part of it:
// the consumer gets kPeerDied (its mapping stays valid: no crash, no hang).
TEST(DeviceSlotsGpu, ProducerKilledMidSyncIsPeerDied) {
  SHMCAST_REQUIRE_GPU();
  const std::string name = unique_name("devslotskill");
  RegionGuard guard{name};
  Child prod = Child::spawn([&] { return producer(name, 1, 3, 2); });
  Child cons = Child::spawn([&] {
    Consumer c = Consumer::open(name, copts());
    Model m;
    std::vector<DevBuf> dev;
    std::vector<void*> dptrs;
    for (std::size_t i = 0; i < m.specs.size(); ++i) {
      dev.emplace_back(m.bytes(i));
      dptrs.push_back(m.bytes(i) ? dev.back().p : nullptr);
    }
    if (c.wait_sync(60s).version != 1) return 51;
    c.read_into_device(dptrs, nullptr);
    ck(cudaDeviceSynchronize(), "sync");
    for (std::size_t i = 0; i < m.specs.size(); ++i)
      if (first_diff(download(dptrs[i], m.bytes(i)), m.want(i, 1)) >= 0) return 52;
    try {
      if (c.wait_sync(60s).version != 2) return 53;
      c.read_into_device(dptrs, nullptr);
      return 54;  // version 2 never completes
    } catch (const Error& e) {
      if (e.code() != Errc::kPeerDied) {
        std::fprintf(stderr, "got %s\n", e.what());
        return 55;
      }
    }
    return 0;
  });
  EXPECT_NE(prod.wait(120s), 0);  // killed
  EXPECT_EQ(cons.wait(120s), 0);
}

// A consumer that sees no GPU is refused at open, with kUnsupported that
// names the fix (host slots); the producer is unaffected.
TEST(DeviceSlotsGpu, ConsumerThatSeesNoGpuIsRefusedAtOpen) {
  SHMCAST_REQUIRE_GPU();
  const std::string name = unique_name("devslotsnogpu");
  RegionGuard guard{name};
  int up[2], down[2];
  ASSERT_EQ(::pipe(up), 0);
  ASSERT_EQ(::pipe(down), 0);
  Child prod = Child::spawn([&] {
    ::close(up[0]);
    ::close(down[1]);
    Producer p = Producer::create(name, popts());
    char x = 1;
    if (::write(up[1], &x, 1) != 1) return 1;
    (void)!::read(down[0], &x, 1);  // until the test is done with the consumer
    return 0;
  });
  ::close(up[1]);
  ::close(down[0]);
  char x = 0;
  ASSERT_EQ(::read(up[0], &x, 1), 1) << "the producer did not start";
  Child cons = Child::spawn([&] {
    ::setenv("CUDA_VISIBLE_DEVICES", "", 1);
    try {
      Consumer c = Consumer::open(name, copts());
      return 61;
    } catch (const Error& e) {
      if (e.code() != Errc::kUnsupported) {
        std::fprintf(stderr, "got %s\n", e.what());
        return 62;
      }
      if (std::string(e.what()).find("host slots") == std::string::npos) return 63;
    }
    return 0;
  });
  EXPECT_EQ(cons.wait(120s), 0);
  ::close(down[1]);
  ::close(up[0]);
  EXPECT_EQ(prod.wait(120s), 0);
}

// 100 cycles of create, open, one sync, close (producer and consumer in one
// process, so that a leak of either side stays visible): the GPU's free
// memory afterwards is what it was after the first cycle. Each cycle
// allocates 128 MiB of slots, so one leaked allocation (or a mapping that
// keeps it) would show 100 times over.
TEST(DeviceSlotsGpu, HundredOpenCloseCyclesLeakNoGpuMemory) {
  SHMCAST_REQUIRE_GPU();
  Child c = Child::spawn([&] {
    ck(cudaSetDevice(0), "cudaSetDevice");
    ck(cudaFree(nullptr), "init");
    const std::vector<TensorSpec> specs{TensorSpec{"w", DType::kU8, {32ull << 20}}};
    DevBuf src(32ull << 20), dst(32ull << 20);
    const std::vector<std::uint8_t> w = pattern(32ull << 20, 7);
    src.upload(w.data(), w.size());
    ck(cudaDeviceSynchronize(), "sync");
    std::uint64_t before = 0;
    for (int cycle = 0; cycle <= 100; ++cycle) {
      if (cycle == 1) before = shmcast::detail::vmm::mem_info(0).free;  // after a warm-up cycle
      const std::string name = unique_name("devslotsleak");
      ProducerOptions o = popts(2);
      o.slot_bytes = 64ull << 20;
      o.slot_device = 0;
      Producer p = Producer::create(name, o);
      ConsumerOptions co = copts();
      co.device = 0;
      Consumer cons = Consumer::open(name, co);
      const void* srcs[1] = {src.p};
      p.begin_sync(specs);
      p.write_device(0, srcs[0], nullptr);
      p.end_sync();
      if (cons.wait_sync(60s).version != 1) return 71;
      void* d[1] = {dst.p};
      cons.read_into_device(d, nullptr);
      ck(cudaDeviceSynchronize(), "sync");
      if (cycle % 25 == 0 && first_diff(download(dst.p, w.size()), w) >= 0) return 72;
      cons.close();
      p.close();
    }
    const std::uint64_t after = shmcast::detail::vmm::mem_info(0).free;
    std::fprintf(stderr, "free GPU memory: %llu before, %llu after 100 cycles\n", (unsigned long long)before,
                 (unsigned long long)after);
    // Within 16 MiB (the driver's own bookkeeping moves a little).
    return after + (16ull << 20) >= before ? 0 : 73;
  });
  EXPECT_EQ(c.wait(600s), 0);
}

// A sharded producer with device slots: rank 1 fetches rank 0's allocation
// over the fd channel and writes its shards into it (both ranks on this
// GPU); a consumer reads the whole tensors and a TP slice that crosses the
// ranks' boundary, bit-exact.
TEST(DeviceSlotsGpu, ShardedRanksWriteIntoRankZerosSlots) {
  SHMCAST_REQUIRE_GPU();
  const std::string name = unique_name("devslotsrank");
  RegionGuard guard{name};
  constexpr std::uint64_t kVersions = 6;
  constexpr std::int64_t kRows = 4096, kCols = 512;  // bf16: 4 MiB, 2 MiB per rank
  auto whole = [](std::uint64_t v) { return pattern(kRows * kCols * 2, v * 977); };
  auto bias = [](std::uint64_t v) { return pattern(3000, v * 31 + 5); };
  auto rank = [&](std::uint32_t r) {
    ProducerOptions o = popts(4);
    o.rank = r;
    o.world_size = 2;
    o.rank_timeout = 60s;
    Producer p = Producer::create(name, o);
    if (p.slot_memory() != SlotMemory::kDevice || p.slot_device_bytes() < 4 * kSlot) return 81;
    if (r == 0) p.wait_for_consumers(1, 60s);
    const std::int64_t half = kRows / 2;
    std::vector<TensorSpec> specs{TensorSpec{"w", DType::kBF16, {kRows, kCols}, 0, r * half, half}};
    if (r == 0) specs.push_back(TensorSpec{"bias", DType::kU8, {3000}});
    DevBuf shard(half * kCols * 2), b(3000);
    for (std::uint64_t v = 1; v <= kVersions; ++v) {
      const std::vector<std::uint8_t> w = whole(v);
      shard.upload(w.data() + r * half * kCols * 2, half * kCols * 2);
      if (r == 0) b.upload(bias(v).data(), 3000);
      ck(cudaDeviceSynchronize(), "sync");
      if (p.begin_sync(specs, v) != v) return 82;
      p.write_device(0, shard.p, nullptr);
      if (r == 0) p.write_device(1, b.p, nullptr);
      p.end_sync();
    }
    if (r == 0) p.wait_drained(60s);
    // Closing gives up this rank's mapping at once (rank 0's allocation, a
    // rank's import of it), not when the object goes.
    p.close();
    if (p.slot_device_bytes() != 0) return 83;
    return 0;
  };
  Child r0 = Child::spawn([&] { return rank(0); });
  Child r1 = Child::spawn([&] { return rank(1); });
  Child cons = Child::spawn([&] {
    Consumer c = Consumer::open(name, copts());
    if (c.slot_memory() != SlotMemory::kDevice) return 91;
    DevBuf w(kRows * kCols * 2), b(3000);
    std::vector<std::uint8_t> hb(3000);
    for (std::uint64_t v = 1; v <= kVersions; ++v) {
      const SyncInfo& si = c.wait_sync(60s);
      if (si.version != v || si.world_size != 2 || si.tensors.size() != 2) return 92;
      const std::vector<std::uint8_t> want = whole(v);
      // Rows [1000, 3000) of w: half from each rank.
      std::vector<Selection> sel(2);
      sel[0] = Selection{0, 1000, 2000};
      const std::uint64_t row = kCols * 2;
      if (v % 3 == 1) {  // whole, on the device
        void* d[2] = {w.p, b.p};
        c.read_into_device(d, nullptr);
        ck(cudaDeviceSynchronize(), "sync");
        if (first_diff(download(w.p, want.size()), want) >= 0) return 93;
        if (first_diff(download(b.p, 3000), bias(v)) >= 0) return 94;
      } else if (v % 3 == 2) {  // the slice on the device, no bias
        void* d[2] = {w.p, nullptr};
        c.read_into_device(d, nullptr, sel);
        ck(cudaDeviceSynchronize(), "sync");
        const std::vector<std::uint8_t> got = download(w.p, 2000 * row);
        if (!std::equal(got.begin(), got.end(), want.begin() + 1000 * row)) return 95;
      } else {  // the slice and the bias into host memory
        std::vector<std::uint8_t> hw(2000 * row);
        void* d[2] = {hw.data(), hb.data()};
        c.read_into(d, sel);
        if (!std::equal(hw.begin(), hw.end(), want.begin() + 1000 * row)) return 96;
        if (hb != bias(v)) return 97;
      }
    }
    return 0;
  });
  EXPECT_EQ(r0.wait(240s), 0);
  EXPECT_EQ(r1.wait(240s), 0);
  EXPECT_EQ(cons.wait(240s), 0);
}

// lend_chunk() would hand host code a span of GPU memory: refused
// (kUnsupported) before anything is claimed, and the sync goes on with
// write_device(); a consumer reads it bit-exact.
TEST(DeviceSlotsGpu, LendChunkIsRefused) {
  SHMCAST_REQUIRE_GPU();
  const std::string name = unique_name("devslotslend");
  RegionGuard guard{name};
  Child c = Child::spawn([&] {
    ck(cudaSetDevice(0), "cudaSetDevice");
    const std::vector<TensorSpec> specs{TensorSpec{"w", DType::kU8, {3 * kSlot + 5}}};
    const std::vector<std::uint8_t> w = pattern(3 * kSlot + 5, 11);
    DevBuf src(w.size()), dst(w.size());
    src.upload(w.data(), w.size());
    ck(cudaDeviceSynchronize(), "sync");
    Producer p = Producer::create(name, popts(2));
    Consumer cons = Consumer::open(name, copts());
    p.begin_sync(specs);
    try {
      (void)p.lend_chunk(0);
      return 51;
    } catch (const Error& e) {
      if (e.code() != Errc::kUnsupported) return 52;
    }
    std::thread reader([&] {
      cons.wait_sync(60s);
      void* d[1] = {dst.p};
      cons.read_into_device(d, nullptr);
    });
    p.write_device(0, src.p, nullptr);
    p.end_sync();
    reader.join();
    ck(cudaDeviceSynchronize(), "sync");
    return first_diff(download(dst.p, w.size()), w) >= 0 ? 53 : 0;
  });
  EXPECT_EQ(c.wait(120s), 0);
}

// Something that is not a socket at the slot socket's name (here a FIFO):
// create() fails with kExists and leaves no region file behind for a
// consumer to find (it would be a file without a header).
TEST(DeviceSlotsGpu, SocketNameTakenLeavesNoRegion) {
  SHMCAST_REQUIRE_GPU();
  const std::string name = unique_name("devslotsfifo");
  RegionGuard guard{name};
  const std::string path = region_path(name);
  const std::string sock = path.substr(0, path.rfind('/')) + "/shmcast-slots." + name;
  ASSERT_EQ(::mkfifo(sock.c_str(), 0600), 0) << sock;
  Child c = Child::spawn([&] {
    try {
      Producer p = Producer::create(name, popts());
      return 1;
    } catch (const Error& e) {
      if (e.code() != Errc::kExists) {
        std::fprintf(stderr, "got %s\n", e.what());
        return 2;
      }
    }
    return ::access(path.c_str(), F_OK) == 0 ? 3 : 0;
  });
  EXPECT_EQ(c.wait(120s), 0);
  ::unlink(sock.c_str());
}
