// Device slots (SlotMemory::kDevice) on a machine without a GPU (CI): what
// can be checked without GPU memory. The producer's refusals, a clear
// kCudaUnavailable at create, and consumers of crafted device-slot regions:
// kUnsupported at open (never later) when this process cannot map GPU
// memory, kCorrupt for a block no producer writes. The transfers themselves
// run on the GPU machine (tests/gpu/test_device_slots_gpu.cpp); the fd
// channel has its own tests (test_fd_channel.cpp, unit and seccomp tiers).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <functional>
#include <string>

#include "base/layout.hpp"
#include "shm/liveness.hpp"
#include "shmcast/shmcast.hpp"
#include "region_edit.hpp"
#include "support.hpp"

using namespace shmcast;
using namespace shmcast_test;
using namespace std::chrono_literals;
namespace d = shmcast::detail;

namespace {

Errc code_of(const std::function<void()>& fn, std::string* what = nullptr) {
  try {
    fn();
  } catch (const Error& e) {
    if (what) *what = e.what();
    return e.code();
  }
  return Errc{};
}

ProducerOptions dev_opts() {
  ProducerOptions o;
  o.slot_memory = SlotMemory::kDevice;
  o.slot_bytes = 2ull << 20;
  o.slots = 2;
  return o;
}

d::DeviceSlotsFixed good_block() { return device_block(2 * (2ull << 20)); }  // 2 x 2 MiB

// What fn() reports in a forked child: its return value (the exit code)
// and the text it writes to `what` (CUDA is never initialised in the test
// process, which forks).
int in_child(const std::function<int(std::string*)>& fn, std::string* what_out) {
  int pipefd[2];
  if (::pipe(pipefd) != 0) return -2;
  Child c = Child::spawn([&] {
    ::close(pipefd[0]);
    std::string what;
    const int rc = fn(&what);
    (void)!::write(pipefd[1], what.data(), what.size());
    return rc;
  });
  ::close(pipefd[1]);
  std::string what;
  char buf[512];
  for (ssize_t n; (n = ::read(pipefd[0], buf, sizeof buf)) > 0;) what.append(buf, static_cast<std::size_t>(n));
  ::close(pipefd[0]);
  if (what_out) *what_out = what;
  return c.wait(60s);
}

// Consumer::open's error code in a child (CUDA is never initialised in the
// test process, which forks).
int open_in_child(const std::string& name, std::string* what_out = nullptr) {
  return in_child(
      [&](std::string* what) {
        ConsumerOptions o;
        o.open_timeout = 2s;
        return static_cast<int>(code_of([&] { Consumer::open(name, o); }, what));
      },
      what_out);
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

// What device slots cannot be combined with is refused before anything is
// made, with the reason and the alternative.
TEST(DeviceSlots, CreateRefusesWhatDeviceSlotsCannotCarry) {
  RegionDir dir("devslots");
  std::string what;
  auto refused = [&](auto change) {
    ProducerOptions o = dev_opts();
    change(o);
    return code_of([&] { Producer::create(unique_name("ds"), o); }, &what);
  };
  EXPECT_EQ(refused([](ProducerOptions& o) { o.checksums = true; }), Errc::kInvalidArgument);
  EXPECT_TRUE(has(what, "checksums")) << what;
  EXPECT_EQ(refused([](ProducerOptions& o) { o.delta = true; }), Errc::kInvalidArgument);
  EXPECT_TRUE(has(what, "delta")) << what;
  EXPECT_EQ(refused([](ProducerOptions& o) { o.engine = CopyEngine::kHost; }), Errc::kInvalidArgument);
  EXPECT_EQ(refused([](ProducerOptions& o) {
              o.mode = RegionMode::kStore;
              o.store_bytes = 2ull << 20;
            }),
            Errc::kInvalidArgument);
  EXPECT_TRUE(has(what, "host slots")) << what;
  // Nothing was left behind by the refusals.
  EXPECT_TRUE(std::filesystem::is_empty(dir.path));
}

// Without a GPU: kCudaUnavailable at create, saying why, and no region or
// socket left for a consumer to find. (Skips on a machine with a GPU.)
TEST(DeviceSlots, CreateWithoutAGpuIsCudaUnavailableAndLeavesNothing) {
  RegionDir dir("devslots");
  const std::string name = unique_name("nogpu");
  std::string what;
  const int rc = in_child(
      [&](std::string* w) {
        if (cuda_available()) return 77;
        return static_cast<int>(code_of([&] { Producer::create(name, dev_opts()); }, w));
      },
      &what);
  if (rc == 77) GTEST_SKIP() << "this machine has a GPU: the GPU tier covers create";
  EXPECT_EQ(rc, static_cast<int>(Errc::kCudaUnavailable)) << what;
  EXPECT_FALSE(what.empty());
  EXPECT_TRUE(std::filesystem::is_empty(dir.path));
}

// A consumer that cannot map GPU memory (no GPU here) is refused at open
// with kUnsupported naming the GPU and the fix, not later, mid-sync. (On a
// machine with a GPU the crafted region has no fd channel: skipped, the GPU
// tier refuses a consumer that sees no GPU.)
TEST(DeviceSlots, ConsumerWithoutTheGpuIsRefusedAtOpen) {
  RegionDir dir("devslots");
  const std::string name = unique_name("refuse");
  CraftedDeviceRegion r(region_path(name), d::kFeatureDeviceSlots, good_block());
  Child probe = Child::spawn([] { return cuda_available() ? 1 : 0; });
  if (probe.wait(60s) == 1) GTEST_SKIP() << "this machine has a GPU";
  std::string what;
  EXPECT_EQ(open_in_child(name, &what), static_cast<int>(Errc::kUnsupported)) << what;
  EXPECT_TRUE(has(what, "GPU-10111213-1415-1617-1819-1a1b1c1d1e1f")) << what;
  EXPECT_TRUE(has(what, "host slots")) << what;
}

// Crafted blocks no producer writes are kCorrupt at open, GPU or not: the
// block checked against the geometry and the feature bits before anything
// is fetched.
TEST(DeviceSlots, CraftedBlocksAreCorrupt) {
  RegionDir dir("devslots");
  auto code = [&](std::uint64_t features, d::DeviceSlotsFixed b, bool device_geometry = true) {
    const std::string name = unique_name("crafted");
    CraftedDeviceRegion r(region_path(name), features, b, device_geometry);
    std::string what;
    const int rc = open_in_child(name, &what);
    return std::make_pair(rc, what);
  };
  const int corrupt = static_cast<int>(Errc::kCorrupt);
  d::DeviceSlotsFixed b = good_block();
  b.nonce = 0;
  EXPECT_EQ(code(d::kFeatureDeviceSlots, b).first, corrupt);
  b = good_block();
  b.alloc_bytes = 2ull << 20;  // less than the slots
  EXPECT_EQ(code(d::kFeatureDeviceSlots, b).first, corrupt);
  b = good_block();
  std::memset(b.gpu_uuid, 0, sizeof b.gpu_uuid);
  EXPECT_EQ(code(d::kFeatureDeviceSlots, b).first, corrupt);
  // Device slots with checksums, or with deltas: never made.
  EXPECT_EQ(code(d::kFeatureDeviceSlots | d::kFeatureChecksums, good_block()).first, corrupt);
  EXPECT_EQ(code(d::kFeatureDeviceSlots | d::kFeatureDelta, good_block()).first, corrupt);
  // A block in a region of host slots.
  EXPECT_EQ(code(0, good_block(), false).first, corrupt);
  // The bit with the host geometry (slot bytes in the file): the header
  // itself does not add up.
  EXPECT_EQ(code(d::kFeatureDeviceSlots, good_block(), false).first, corrupt);
}

// Sharded producers: every rank must ask for the slot memory rank 0 made
// the region with; a rank asking for host slots of a device-slot region is
// refused when it attaches, saying so.
TEST(DeviceSlots, RankWithOtherSlotMemoryIsRefused) {
  RegionDir dir("devslots");
  const std::string name = unique_name("rank");
  d::DeviceSlotsFixed b = good_block();
  b.alloc_bytes = 4 * (2ull << 20);  // 2 ranks: 4 slots
  CraftedDeviceRegion r(region_path(name), d::kFeatureDeviceSlots, b, true, 2);
  std::string what;
  const int rc = in_child(
      [&](std::string* w) {
        ProducerOptions o;
        o.engine = CopyEngine::kHost;
        o.rank = 1;
        o.world_size = 2;
        o.rank_timeout = 10s;
        return static_cast<int>(code_of([&] { Producer::create(name, o); }, w));
      },
      &what);
  EXPECT_EQ(rc, static_cast<int>(Errc::kInvalidArgument)) << what;
  EXPECT_TRUE(has(what, "slot_memory")) << what;
}
