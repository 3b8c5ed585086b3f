// The device slots' VMM wrapper (lib/core/engine/cuda_vmm.{hpp,cpp}) on any machine:
// every case runs in a forked child whose SHMCAST_LIBCUDA points at
// fake_vmm_libcuda.so, which emulates the CUDA VMM API with memfds and
// refuses what the driver refuses (a call without a context, a map outside
// a reservation or larger than the allocation, access on an unmapped range,
// freeing a reservation still mapped). So the wrapper's order of calls, its
// rounding, its refusals (kUnsupported with the way out) and its cleanup
// after a failure are checked in CI; tests/gpu/test_vmm.cpp does the same
// on a real GPU. fake_vmm_live() (live handles, reservations, mappings) must
// come back to 0.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstdlib>

#include "engine/cuda_vmm.hpp"
#include "protocol/fd_channel.hpp"
#include "fdchan_support.hpp"

using namespace shmcast;
using namespace shmcast::detail;
using namespace std::chrono_literals;
using shmcast_test::Child;
using shmcast_test::code_of;
using shmcast_test::SharedFlags;

namespace {

constexpr std::uint64_t kMiB = 1ull << 20;

int live() {
  void* h = ::dlopen(SHMCAST_FAKE_VMM_LIBCUDA, RTLD_NOW | RTLD_NOLOAD);
  if (h == nullptr) return -1000;
  auto f = reinterpret_cast<int (*)()>(::dlsym(h, "fake_vmm_live"));
  const int n = f != nullptr ? f() : -1000;
  ::dlclose(h);
  return n;
}

void use_fake() {
  ::setenv("SHMCAST_LIBCUDA", SHMCAST_FAKE_VMM_LIBCUDA, 1);
  ::setenv("FAKE_DEVICES", "2", 1);
}

// fn in a forked child using the fake driver; its exit code (0: pass).
int in_child(const std::function<int()>& fn) {
  Child c = Child::spawn([&] {
    use_fake();
    return fn();
  });
  return c.wait(60s);
}

#define CHECK(cond)                                                          \
  do {                                                                       \
    if (!(cond)) {                                                           \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      return __LINE__;                                                       \
    }                                                                        \
  } while (0)

bool says(const std::function<void()>& fn, Errc want, const char* text) {
  try {
    fn();
  } catch (const Error& e) {
    std::fprintf(stderr, "[%s] %s\n", errc_name(e.code()), e.what());
    return e.code() == want && std::string(e.what()).find(text) != std::string::npos;
  }
  return false;
}

}  // namespace

int allocate_export_import_release() {
  CHECK(vmm::granularity(0) == 2 * kMiB);
  const vmm::Uuid u0 = vmm::device_uuid(0), u1 = vmm::device_uuid(1);
  CHECK(u0 != u1);
  CHECK(vmm::device_with_uuid(u1) == 1);
  CHECK(vmm::uuid_text(u0).rfind("GPU-66616b65", 0) == 0);  // "fake"
  const vmm::MemInfo before = vmm::mem_info(0);
  {
    vmm::Mapping a = vmm::Mapping::allocate(0, 3 * kMiB);
    CHECK(a.bytes() == 4 * kMiB);  // rounded up to the granularity
    CHECK(a.device() == 0 && a.owner_device() == 0 && !a.imported());
    std::memset(a.data(), 0x5a, a.bytes());
    const int fd = a.export_fd();
    CHECK(fd >= 0 && (::fcntl(fd, F_GETFD) & FD_CLOEXEC));
    vmm::Mapping b = vmm::Mapping::import(fd, a.bytes(), u0, 0);
    ::close(fd);
    CHECK(b.imported() && b.bytes() == a.bytes() && b.data() != a.data());
    CHECK(static_cast<unsigned char*>(b.data())[a.bytes() - 1] == 0x5a);
    static_cast<unsigned char*>(b.data())[7] = 0x11;
    CHECK(static_cast<unsigned char*>(a.data())[7] == 0x11);  // one memory
    vmm::Mapping moved = std::move(b);
    CHECK(b.empty() && !moved.empty());
    CHECK(vmm::mem_info(0).free == before.free - 8 * kMiB);  // the fake counts both handles
  }
  CHECK(live() == 0);
  // 100 cycles leave nothing behind.
  for (int i = 0; i < 100; ++i) {
    vmm::Mapping a = vmm::Mapping::allocate(0, 2 * kMiB);
    const int fd = a.export_fd();
    vmm::Mapping b = vmm::Mapping::import(fd, a.bytes(), u0, 1);
    ::close(fd);
  }
  CHECK(live() == 0);
  CHECK(vmm::mem_info(0).free == before.free);
  return 0;
}

TEST(VmmFake, AllocateExportImportRelease) { EXPECT_EQ(in_child(allocate_export_import_release), 0); }

int refusals_say_why_and_leak_nothing() {
  vmm::Mapping a = vmm::Mapping::allocate(0, 4 * kMiB);
  const int fd = a.export_fd();
  const vmm::Uuid u0 = vmm::device_uuid(0);
  const int held = live();
  CHECK(held == 3);  // handle, reservation, mapping
  // No peer access between the GPUs: refused at import, before the fd is touched.
  ::setenv("FAKE_PEER", "0", 1);
  CHECK(says([&] { vmm::Mapping::import(fd, a.bytes(), u0, 1); }, Errc::kUnsupported,
             "use a host-slot region"));
  CHECK(says([&] { vmm::Mapping::import(fd, a.bytes(), u0, 1); }, Errc::kUnsupported, "peer-to-peer"));
  { vmm::Mapping same = vmm::Mapping::import(fd, a.bytes(), u0, 0); }  // the same GPU still works
  ::setenv("FAKE_PEER", "1", 1);
  // The producer's GPU is not visible here.
  vmm::Uuid other = u0;
  other[8] = 9;
  CHECK(says([&] { vmm::Mapping::import(fd, a.bytes(), other, 0); }, Errc::kUnsupported,
             "not visible to this process"));
  // A size that is no multiple of the granularity, or larger than the allocation.
  CHECK(says([&] { vmm::Mapping::import(fd, a.bytes() + 4096, u0, 0); }, Errc::kCorrupt, "granularity"));
  CHECK(says([&] { vmm::Mapping::import(fd, 2 * a.bytes(), u0, 0); }, Errc::kCuda, "cuMemMap"));
  // A descriptor that is no CUDA allocation.
  const int plain = fdchan_test::make_memfd(4 * kMiB, 1);
  CHECK(says([&] { vmm::Mapping::import(plain, 4 * kMiB, u0, 0); }, Errc::kCuda,
             "cuMemImportFromShareableHandle"));
  ::close(plain);
  CHECK(live() == held);  // every failed import released what it had made
  // No such device.
  CHECK(says([&] { vmm::Mapping::import(fd, a.bytes(), u0, 5); }, Errc::kInvalidArgument,
             "no CUDA device 5"));
  CHECK(says([&] { vmm::Mapping::allocate(2, kMiB); }, Errc::kInvalidArgument, "CUDA_VISIBLE_DEVICES"));
  // A GPU without the VMM API.
  ::setenv("FAKE_VMM", "0", 1);
  CHECK(says([&] { vmm::Mapping::allocate(0, kMiB); }, Errc::kUnsupported, "use a host-slot region"));
  ::setenv("FAKE_VMM", "1", 1);
  ::close(fd);
  a.release();
  a.release();  // idempotent
  CHECK(live() == 0);
  return 0;
}

TEST(VmmFake, RefusalsSayWhyAndLeakNothing) { EXPECT_EQ(in_child(refusals_say_why_and_leak_nothing), 0); }

int inherited_mapping_is_left_to_the_parent() {
  vmm::Mapping a = vmm::Mapping::allocate(0, 2 * kMiB);
  Child grandchild = Child::spawn([&] {
    const int before = live();
    a.release();  // must not call the driver here
    return live() == before && before == 3 ? 0 : 1;
  });
  CHECK(grandchild.wait(30s) == 0);
  CHECK(live() == 3);
  a.release();
  CHECK(live() == 0);
  return 0;
}

TEST(VmmFake, InheritedMappingIsLeftToTheParent) { EXPECT_EQ(in_child(inherited_mapping_is_left_to_the_parent), 0); }

// A producer process allocates two slots, fills them and serves their fds;
// a consumer process on the other GPU fetches, imports, reads them and
// writes into the second; the producer sees its bytes.
TEST(VmmFake, SlotsTravelToAnotherProcessOverTheChannel) {
  fdchan_test::ScratchDir dir;
  const std::string name = "vmm-" + std::to_string(::getpid());
  SharedFlags* flags = SharedFlags::make();
  constexpr std::uint64_t kNonce = 0xfeed;
  constexpr std::uint64_t kSlot = 6 * kMiB;
  Child producer = Child::spawn([&] {
    use_fake();
    std::vector<vmm::Mapping> slots;
    std::vector<int> fds;
    FdSetInfo info;
    info.kind = FdKind::kCudaVmm;
    info.region_nonce = kNonce;
    info.device_uuid = vmm::device_uuid(0);
    for (int i = 0; i < 2; ++i) {
      slots.push_back(vmm::Mapping::allocate(0, kSlot));
      shmcast_test::fill_pattern(static_cast<std::uint8_t*>(slots.back().data()), kSlot, 10 + i);
      fds.push_back(slots.back().export_fd());
      info.sizes.push_back(slots.back().bytes());
    }
    FdServer server = FdServer::start(dir.path, name, fds, info);
    for (int fd : fds) ::close(fd);
    flags->v[0] = 1;  // serving
    if (!flags->wait(1, 1, 60s)) return 2;
    std::vector<std::uint8_t> want(kSlot);
    shmcast_test::fill_pattern(want.data(), kSlot, 99);
    if (std::memcmp(slots[1].data(), want.data(), kSlot) != 0) return 3;  // the consumer's bytes
    server.stop();
    slots.clear();
    return live() == 0 ? 0 : 4;
  });
  Child consumer = Child::spawn([&] {
    use_fake();
    if (!flags->wait(0, 1, 60s)) return 2;
    FdFetchOptions o;
    o.kind = FdKind::kCudaVmm;
    o.region_nonce = kNonce;
    o.expect_fds = 2;
    o.expect_bytes = kSlot;
    FetchedFds got = fetch_fds(dir.path, name, o);
    std::vector<vmm::Mapping> slots;
    for (std::size_t i = 0; i < got.fds.size(); ++i)
      slots.push_back(vmm::Mapping::import(got.fds[i].get(), got.info.sizes[i], got.info.device_uuid, 1));
    got.fds.clear();  // imported: the fds are no longer needed
    for (int i = 0; i < 2; ++i) {
      std::vector<std::uint8_t> want(kSlot);
      shmcast_test::fill_pattern(want.data(), kSlot, 10 + i);
      if (slots[i].owner_device() != 0 || std::memcmp(slots[i].data(), want.data(), kSlot) != 0) return 3;
    }
    shmcast_test::fill_pattern(static_cast<std::uint8_t*>(slots[1].data()), kSlot, 99);
    slots.clear();
    if (live() != 0) return 4;
    flags->v[1] = 1;
    return 0;
  });
  EXPECT_EQ(consumer.wait(60s), 0);
  EXPECT_EQ(producer.wait(60s), 0);
}
