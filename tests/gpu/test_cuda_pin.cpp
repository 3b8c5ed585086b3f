// Pinning a store region's read-only banks, against a stand-in driver
// (fake_libcuda_pin.c), so it runs on any machine. A consumer maps the
// stored versions read-only (docs/reliability.md, issue 27 item 5); the
// driver pins such memory only with CU_MEMHOSTREGISTER_READ_ONLY, which a
// device may not support. Checked here: with support, the header and seats
// are registered as before and the banks with the read-only flag, and stay
// read-only (a write through views() faults); without it, the banks are
// made writable again and pinned without the flag (views_read_only() false),
// never left unpinned or half registered; a producer's pin is unchanged;
// close() unregisters everything. Every case runs in a forked child (the
// driver is loaded once per process). The real driver: test_gpu.cpp.
#include <gtest/gtest.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "base/layout.hpp"
#include "support.hpp"

using namespace shmcast;
using namespace shmcast_test;
using namespace std::chrono_literals;

namespace {

constexpr unsigned kReadOnlyFlag = 0x08;  // CU_MEMHOSTREGISTER_READ_ONLY
constexpr std::uint64_t kBytes = 1 << 20;

struct Reg {
  std::uintptr_t base;
  std::size_t bytes;
  unsigned flags;
};

std::vector<Reg> registrations() {
  void* h = ::dlopen(SHMCAST_FAKE_LIBCUDA_PIN, RTLD_NOW | RTLD_NOLOAD);
  if (h == nullptr) return {};
  using Fn = int (*)(std::uintptr_t*, std::size_t*, unsigned*, int);
  auto fn = reinterpret_cast<Fn>(::dlsym(h, "fake_cuda_registrations"));
  if (fn == nullptr) return {};
  std::uintptr_t b[64];
  std::size_t n[64];
  unsigned f[64];
  const int count = fn(b, n, f, 64);
  std::vector<Reg> v;
  for (int i = 0; i < count && i < 64; ++i) v.push_back({b[i], n[i], f[i]});
  std::sort(v.begin(), v.end(), [](const Reg& a, const Reg& c) { return a.base < c.base; });
  return v;
}

// The permissions of the mapping that holds `p` ("rw-s", "r--s"), "" if none.
std::string perms_at(const void* p) {
  std::ifstream maps("/proc/self/maps");
  const auto at = reinterpret_cast<std::uintptr_t>(p);
  for (std::string line; std::getline(maps, line);) {
    unsigned long lo = 0, hi = 0;
    char perms[8] = {0};
    if (std::sscanf(line.c_str(), "%lx-%lx %7s", &lo, &hi, perms) == 3 && lo <= at && at < hi) return perms;
  }
  return "";
}

std::uint64_t file_size(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? static_cast<std::uint64_t>(st.st_size) : 0;
}

std::uint64_t manifest_offset(const std::string& path) {
  detail::HeaderFixed h{};
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  const bool ok = ::pread(fd, &h, sizeof h, 0) == static_cast<ssize_t>(sizeof h);
  ::close(fd);
  return ok ? h.manifest_offset : 0;
}

// Where the pinned range starts: the slot data (docs/protocol.md §2.1; the
// manifest areas before it are sparse, and pinning them would allocate them).
std::uint64_t data_offset(const std::string& path) {
  detail::HeaderFixed h{};
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  const bool ok = ::pread(fd, &h, sizeof h, 0) == static_cast<ssize_t>(sizeof h);
  ::close(fd);
  return ok ? h.data_offset : 0;
}

ProducerOptions store_opts(Pin pin) {
  ProducerOptions o;
  o.mode = RegionMode::kStore;
  o.store_bytes = 2 << 20;
  o.pin = pin;
  o.engine = CopyEngine::kHost;
  return o;
}

ConsumerOptions pinned_copts() {
  ConsumerOptions o;
  o.pin = Pin::kYes;
  o.open_timeout = 10s;
  return o;
}

// Runs fn in a child whose driver is the stand-in, with `ro_register` as
// the device's read-only registration support.
int with_fake_driver(int ro_register, const std::function<int()>& fn) {
  Child c = Child::spawn([&] {
    ::setenv("SHMCAST_LIBCUDA", SHMCAST_FAKE_LIBCUDA_PIN, 1);
    ::setenv("FAKE_CUDA_RO_REGISTER", ro_register ? "1" : "0", 1);
    if (!cuda_available()) {
      std::fprintf(stderr, "the fake driver is not usable: %s\n", cuda_unavailable_reason().c_str());
      return 90;
    }
    return fn();
  });
  return c.wait(60s);
}

struct Stored {
  std::string name = unique_name("pin-ro");
  RegionGuard guard{name};
  Producer producer = Producer::create(name, store_opts(Pin::kNo));
  Stored() {
    PatternSync s(2, kBytes, 5);
    producer.send(s.specs, s.ptrs);
  }
};

int read_bit_exact(Consumer& c) {
  if (c.wait_sync(0ms).version != 1) return 60;
  std::vector<std::vector<std::uint8_t>> got(2, std::vector<std::uint8_t>(kBytes));
  std::vector<void*> dsts = {got[0].data(), got[1].data()};
  c.read_into(dsts);
  return check_pattern(got, 5) ? 0 : 61;
}

}  // namespace

TEST(CudaPin, ConsumerPinsTheStoreBanksReadOnlyWhereTheDriverCan) {
  Stored st;
  const std::string path = region_path(st.name);
  const std::uint64_t size = file_size(path);
  const std::uint64_t page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  const std::uint64_t ro = (manifest_offset(path) + page - 1) / page * page;
  const std::uint64_t from = data_offset(path);
  ASSERT_GT(ro, 0u);
  ASSERT_GT(size, from);
  // Pinned: [from, size); plain below ro, read-only from ro.
  const std::uint64_t want_plain = ro > from ? ro - from : 0, want_ro = size - (ro > from ? ro : from);
  EXPECT_EQ(with_fake_driver(1, [&] {
              Consumer c = Consumer::open(st.name, pinned_copts());
              if (!c.pinned()) return 10;
              if (!c.views_read_only()) return 11;
              const std::vector<Reg> regs = registrations();
              // [from, ro) as before, [ro, size) with the read-only flag; nothing else.
              std::uint64_t plain = 0, read_only = 0;
              for (const Reg& r : regs) (r.flags & kReadOnlyFlag ? read_only : plain) += r.bytes;
              if (regs.empty() || plain != want_plain || read_only != want_ro) {
                std::fprintf(stderr, "%zu registrations: %llu plain, %llu read-only (want %llu, %llu)\n", regs.size(),
                             (unsigned long long)plain, (unsigned long long)read_only,
                             (unsigned long long)want_plain, (unsigned long long)want_ro);
                return 12;
              }
              if (regs.back().base + regs.back().bytes - regs.front().base != size - from) return 13;
              return read_bit_exact(c) != 0 ? 14 : 0;
            }),
            0);
  // Same, checked from the views: in a read-only registration, mapped read-only.
  EXPECT_EQ(with_fake_driver(1, [&] {
              Consumer c = Consumer::open(st.name, pinned_copts());
              c.wait_sync(0ms);
              const std::vector<const std::byte*> v = c.views();
              const auto at = reinterpret_cast<std::uintptr_t>(v[0]);
              bool in_ro = false;
              for (const Reg& r : registrations())
                in_ro |= (r.flags & kReadOnlyFlag) && r.base <= at && at < r.base + r.bytes;
              if (!in_ro) return 20;
              if (perms_at(v[0]).substr(0, 2) != "r-") return 21;
              c.close();
              if (!registrations().empty()) return 22;  // close() unregistered all of it
              return 0;
            }),
            0);
  // A write through views() of a pinned read-only bank faults.
  EXPECT_EQ(with_fake_driver(1, [&] {
              Consumer c = Consumer::open(st.name, pinned_copts());
              c.wait_sync(0ms);
              ::signal(SIGSEGV, SIG_DFL);  // die of the fault itself, sanitizer or not
              auto* p = const_cast<volatile std::uint8_t*>(reinterpret_cast<const volatile std::uint8_t*>(c.views()[0]));
              p[0] = static_cast<std::uint8_t>(p[0] + 1);
              return 30;
            }),
            128 + SIGSEGV);
}

TEST(CudaPin, WithoutReadOnlyRegistrationTheBanksArePinnedWritable) {
  Stored st;
  const std::uint64_t size = file_size(region_path(st.name)) - data_offset(region_path(st.name));  // pinned bytes
  EXPECT_EQ(with_fake_driver(0, [&] {
              Consumer c = Consumer::open(st.name, pinned_copts());
              if (!c.pinned()) return 10;  // pinned as before, not given up
              if (c.views_read_only()) return 11;
              std::uint64_t total = 0;
              for (const Reg& r : registrations()) {
                if (r.flags & kReadOnlyFlag) return 12;
                total += r.bytes;
              }
              if (total != size) return 13;
              return read_bit_exact(c) != 0 ? 14 : 0;
            }),
            0);
  EXPECT_EQ(with_fake_driver(0, [&] {
              Consumer c = Consumer::open(st.name, pinned_copts());
              c.wait_sync(0ms);
              if (perms_at(c.views()[0]).substr(0, 2) != "rw") return 20;
              c.close();
              return registrations().empty() ? 0 : 21;
            }),
            0);
  // Unpinned (Pin::kNo), the same consumer keeps the banks read-only.
  Consumer c = Consumer::open(st.name, [] {
    ConsumerOptions o;
    o.pin = Pin::kNo;
    return o;
  }());
  EXPECT_TRUE(c.views_read_only());
  c.wait_sync(0ms);
  EXPECT_EQ(perms_at(c.views()[0]).substr(0, 2), "r-");
}

// The producer pins all its slot data (not the sparse manifest areas before it).
TEST(CudaPin, ProducerPinsItsWholeSlotDataAsBefore) {
  const std::string name = unique_name("pin-prod");
  RegionGuard g{name};
  EXPECT_EQ(with_fake_driver(1, [&] {
              Producer p = Producer::create(name, store_opts(Pin::kYes));
              if (!p.pinned()) return 10;
              std::uint64_t total = 0;
              for (const Reg& r : registrations()) {
                if (r.flags & kReadOnlyFlag) return 11;
                total += r.bytes;
              }
              if (total != p.region_bytes() - data_offset(region_path(name))) return 12;
              p.close();
              return registrations().empty() ? 0 : 13;
            }),
            0);
}
