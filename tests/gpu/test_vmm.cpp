// GPU tier: the device slots' memory (lib/core/engine/cuda_vmm.hpp) between real
// processes on a real GPU. A producer process allocates with cuMemCreate
// (POSIX-fd handle type), exports the fd and serves it over the fd channel
// (lib/core/protocol/fd_channel.hpp); a consumer process fetches, imports and maps it,
// copies device to device out of it and into it, bit-exact both ways, and
// releases it. The GPU memory goes back once the last importer unmapped,
// and 100 alloc/export/import/release cycles leave cuMemGetInfo where it was
// (within the allocation granularity). A consumer on a second GPU maps the
// slots with peer access, or is refused with kUnsupported when there is
// none. Every CUDA call runs in a forked child (the gtest process never
// initialises CUDA); every test skips when no CUDA device is usable.
#include <gtest/gtest.h>

#include <cstdlib>

#include "engine/cuda_vmm.hpp"
#include "protocol/fd_channel.hpp"
#include "fdchan_support.hpp"
#include "gpu_support.hpp"

using namespace shmcast;
using namespace shmcast::detail;
using namespace shmcast_gpu;
using namespace std::chrono_literals;
using shmcast_test::Child;
using shmcast_test::SharedFlags;

namespace {

constexpr std::uint64_t kMiB = 1ull << 20;

#define CHECK(cond)                                                                    \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);    \
      return __LINE__;                                                                 \
    }                                                                                  \
  } while (0)

// Flags (SharedFlags::v): 0 served (the nonce), 1 consumer done (the nonce),
// 2 consumer ready, 3 producer released, 4 consumer released, 5 the
// consumer's verdict on access (1 mapped, 2 refused with kUnsupported).
struct Scene {
  fdchan_test::ScratchDir dir;
  std::string name = "vmm-" + std::to_string(::getpid());
  SharedFlags* flags = SharedFlags::make();
};

FdServer serve(const Scene& s, const std::vector<vmm::Mapping>& slots, std::uint64_t nonce) {
  FdSetInfo info;
  info.kind = FdKind::kCudaVmm;
  info.region_nonce = nonce;
  info.device_uuid = vmm::device_uuid(slots.at(0).device());
  std::vector<int> fds;
  for (const vmm::Mapping& m : slots) {
    fds.push_back(m.export_fd());
    info.sizes.push_back(m.bytes());
  }
  FdServer server = FdServer::start(s.dir.path, s.name, fds, info);
  for (int fd : fds) ::close(fd);  // the server holds its own copies
  return server;
}

std::vector<vmm::Mapping> fetch_and_map(const Scene& s, std::uint64_t nonce, std::uint32_t count, int device) {
  FdFetchOptions o;
  o.kind = FdKind::kCudaVmm;
  o.region_nonce = nonce;
  o.expect_fds = count;
  o.timeout = 60s;
  FetchedFds got = fetch_fds(s.dir.path, s.name, o);
  std::vector<vmm::Mapping> slots;
  for (std::size_t i = 0; i < got.fds.size(); ++i)
    slots.push_back(vmm::Mapping::import(got.fds[i].get(), got.info.sizes[i], got.info.device_uuid, device));
  return slots;  // the fds close here: the mappings hold the memory
}

int device_count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

// Producer: one slot of `bytes` on GPU 0, holding pattern(bytes, 1); waits
// for the consumer, then checks the second half holds pattern(bytes/2, 2).
int share_producer(Scene& s, std::uint64_t bytes) {
  ck(cudaSetDevice(0), "cudaSetDevice");
  std::vector<vmm::Mapping> slots;
  slots.push_back(vmm::Mapping::allocate(0, bytes));
  CHECK(slots[0].bytes() == bytes);  // a multiple of the granularity already
  const std::vector<std::uint8_t> mine = pattern(bytes, 1);
  ck(cudaMemcpy(slots[0].data(), mine.data(), bytes, cudaMemcpyHostToDevice), "fill the slot");
  FdServer server = serve(s, slots, 1);
  s.flags->v[0] = 1;
  CHECK(s.flags->wait(1, 1, 120s));
  if (s.flags->v[5].load() == 1) {
    const std::vector<std::uint8_t> back = download(static_cast<std::uint8_t*>(slots[0].data()) + bytes / 2, bytes / 2);
    CHECK(first_diff(back, pattern(bytes / 2, 2)) == -1);
  }
  server.stop();
  slots.clear();
  return 0;
}

// Consumer on `device`: device-to-device copies out of the slot and into it.
int share_consumer(Scene& s, std::uint64_t bytes, int device) {
  ck(cudaSetDevice(device), "cudaSetDevice");
  CHECK(s.flags->wait(0, 1, 120s));
  std::vector<vmm::Mapping> slots;
  try {
    slots = fetch_and_map(s, 1, 1, device);
  } catch (const Error& e) {
    std::fprintf(stderr, "[%s] %s\n", errc_name(e.code()), e.what());
    if (e.code() != Errc::kUnsupported || device == 0) return 90;
    int can = 0;
    ck(cudaDeviceCanAccessPeer(&can, device, 0), "cudaDeviceCanAccessPeer");
    s.flags->v[5] = 2;
    s.flags->v[1] = 1;
    return can == 0 && std::string(e.what()).find("host-slot region") != std::string::npos ? 0 : 91;
  }
  CHECK(slots[0].bytes() == bytes && slots[0].device() == device && slots[0].owner_device() == 0);
  DevBuf out(bytes);
  ck(cudaMemcpy(out.p, slots[0].data(), bytes, cudaMemcpyDeviceToDevice), "D2D out of the slot");
  CHECK(first_diff(download(out.p, bytes), pattern(bytes, 1)) == -1);
  DevBuf in(bytes / 2);
  const std::vector<std::uint8_t> theirs = pattern(bytes / 2, 2);
  in.upload(theirs.data(), theirs.size());
  ck(cudaMemcpy(static_cast<std::uint8_t*>(slots[0].data()) + bytes / 2, in.p, bytes / 2, cudaMemcpyDeviceToDevice),
     "D2D into the slot");
  ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  slots.clear();
  s.flags->v[5] = 1;
  s.flags->v[1] = 1;
  return 0;
}

void run_share(int consumer_device) {
  Scene s;
  const std::uint64_t bytes = 64 * kMiB;
  Child p = Child::spawn([&] { return share_producer(s, bytes); });
  Child c = Child::spawn([&] { return share_consumer(s, bytes, consumer_device); });
  EXPECT_EQ(c.wait(180s), 0);
  EXPECT_EQ(p.wait(180s), 0);
}

}  // namespace

TEST(Vmm, SlotSharedWithAnotherProcessBitExactBothWays) {
  SHMCAST_REQUIRE_GPU();
  run_share(0);
}

// A consumer on GPU 1: peer access when the GPUs allow it, else kUnsupported
// at import, naming the host-slot region (both are passes; which one ran is
// in the log).
TEST(Vmm, ConsumerOnAnotherGpuMapsWithPeerAccessOrIsRefused) {
  SHMCAST_REQUIRE_GPU();
  Child probe = Child::spawn([] { return device_count(); });
  const int n = probe.wait(60s);
  if (n < 2) GTEST_SKIP() << "needs 2 GPUs (this machine has " << n << ")";
  run_share(1);
}

// The producer releases its slot (and its fds) while a consumer still maps
// it: the memory stays taken until the consumer unmaps, then it is back.
TEST(Vmm, MemoryReturnsOnceTheLastImporterUnmapped) {
  SHMCAST_REQUIRE_GPU();
  Scene s;
  const std::uint64_t bytes = 1024 * kMiB;
  const std::uint64_t slack = 64 * kMiB;  // other processes' and the driver's small allocations
  Child p = Child::spawn([&] {
    ck(cudaSetDevice(0), "cudaSetDevice");
    ck(cudaFree(nullptr), "context");
    { vmm::Mapping warm = vmm::Mapping::allocate(0, 2 * kMiB); }  // the driver's first-use allocations
    CHECK(s.flags->wait(2, 1, 120s));                         // the consumer's context exists too
    const std::uint64_t f0 = vmm::mem_info(0).free;
    {
      std::vector<vmm::Mapping> slots;
      slots.push_back(vmm::Mapping::allocate(0, bytes));
      FdServer server = serve(s, slots, 7);
      s.flags->v[0] = 7;
      CHECK(s.flags->wait(1, 7, 120s));  // the consumer mapped it
    }  // server stopped (its fds closed), slot released
    const std::uint64_t f1 = vmm::mem_info(0).free;
    std::fprintf(stderr, "free: %llu before, %llu after the producer released (the consumer maps it)\n",
                 static_cast<unsigned long long>(f0), static_cast<unsigned long long>(f1));
    const auto taken = static_cast<std::int64_t>(f0) - static_cast<std::int64_t>(f1);
    CHECK(taken + static_cast<std::int64_t>(slack) >= static_cast<std::int64_t>(bytes));  // still taken
    s.flags->v[3] = 1;
    CHECK(s.flags->wait(4, 1, 120s));
    const std::uint64_t f2 = vmm::mem_info(0).free;
    std::fprintf(stderr, "free: %llu after the consumer unmapped\n", static_cast<unsigned long long>(f2));
    CHECK(f2 + slack >= f0 && f2 <= f0 + slack);  // back
    return 0;
  });
  Child c = Child::spawn([&] {
    ck(cudaSetDevice(0), "cudaSetDevice");
    ck(cudaFree(nullptr), "context");
    (void)vmm::granularity(0);
    s.flags->v[2] = 1;
    CHECK(s.flags->wait(0, 7, 120s));
    std::vector<vmm::Mapping> slots = fetch_and_map(s, 7, 1, 0);
    s.flags->v[1] = 7;
    CHECK(s.flags->wait(3, 1, 120s));
    slots.clear();
    s.flags->v[4] = 1;
    return 0;
  });
  EXPECT_EQ(c.wait(240s), 0);
  EXPECT_EQ(p.wait(240s), 0);
}

// 100 cycles of allocate, export, serve, fetch, import, copy, release across
// two processes: free GPU memory after them equals free memory before
// (measured after one warm-up cycle), within the allocation granularity.
TEST(Vmm, HundredCyclesLeakNoGpuMemory) {
  SHMCAST_REQUIRE_GPU();
  Scene s;
  constexpr int kCycles = 100;
  const std::uint64_t bytes = 32 * kMiB;
  constexpr std::uint64_t kCheck = 4096;
  Child p = Child::spawn([&] {
    ck(cudaSetDevice(0), "cudaSetDevice");
    const std::uint64_t g = vmm::granularity(0);
    std::uint64_t before = 0;
    for (int i = 0; i <= kCycles; ++i) {  // cycle 0 warms up
      if (i == 1) before = vmm::mem_info(0).free;
      const std::uint64_t nonce = static_cast<std::uint64_t>(i) + 1;
      std::vector<vmm::Mapping> slots;
      slots.push_back(vmm::Mapping::allocate(0, bytes));
      const std::vector<std::uint8_t> head = pattern(kCheck, nonce);
      ck(cudaMemcpy(slots[0].data(), head.data(), kCheck, cudaMemcpyHostToDevice), "fill");
      FdServer server = serve(s, slots, nonce);
      s.flags->v[0] = static_cast<int>(nonce);
      CHECK(s.flags->wait(1, static_cast<int>(nonce), 120s));
    }
    const std::uint64_t after = vmm::mem_info(0).free;
    std::fprintf(stderr, "free GPU memory: %llu before %d cycles, %llu after (granularity %llu)\n",
                 static_cast<unsigned long long>(before), kCycles, static_cast<unsigned long long>(after),
                 static_cast<unsigned long long>(g));
    CHECK(after + g >= before && after <= before + g);
    return 0;
  });
  Child c = Child::spawn([&] {
    ck(cudaSetDevice(0), "cudaSetDevice");
    DevBuf head(kCheck);  // allocated once: only the slots come and go
    for (int i = 0; i <= kCycles; ++i) {
      const std::uint64_t nonce = static_cast<std::uint64_t>(i) + 1;
      CHECK(s.flags->wait(0, static_cast<int>(nonce), 120s));
      {
        std::vector<vmm::Mapping> slots = fetch_and_map(s, nonce, 1, 0);
        ck(cudaMemcpy(head.p, slots[0].data(), kCheck, cudaMemcpyDeviceToDevice), "D2D");
        CHECK(first_diff(download(head.p, kCheck), pattern(kCheck, nonce)) == -1);
      }
      s.flags->v[1] = static_cast<int>(nonce);
    }
    return 0;
  });
  EXPECT_EQ(c.wait(280s), 0);
  EXPECT_EQ(p.wait(280s), 0);
}
