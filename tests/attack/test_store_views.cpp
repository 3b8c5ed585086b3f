// A store reader that writes through its zero-copy view (issue 27, item 5).
// A store region keeps one version for every reader; before the fix a
// reader's in-place write (Python: `view.tensors[0].mul_(-1000)` on a
// hold(); C++: a write through Consumer::views() after a const_cast)
// changed the bank for everyone: without checksums a late joiner received
// the changed bytes as a good version, with checksums every later reader
// got Checksum until the next send.
//
// Now consumers map the banks read-only: the C++ writer (a forked child)
// dies of SIGSEGV, the Python one gets shmcast.ReadOnly before any byte
// changes, and a late joiner in another process gets the producer's bytes,
// bit-exact, with and without checksums.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "support.hpp"

using namespace shmcast;
using namespace shmcast_test;
using namespace std::chrono_literals;

namespace {

constexpr int kTensors = 3;
constexpr std::uint64_t kTensorBytes = 256 * 1024;  // f32 [65536] each
constexpr std::uint64_t kSeed = 27;

struct Store {
  std::string name = unique_name("views");
  RegionGuard guard{name};
  Producer producer;
  explicit Store(bool checksums) : producer(make(name, checksums)) {
    PatternSync s(kTensors, kTensorBytes, kSeed);
    for (TensorSpec& t : s.specs) {
      t.dtype = DType::kF32;
      t.shape = {static_cast<std::int64_t>(kTensorBytes / 4)};
    }
    producer.send(s.specs, s.ptrs);
  }
  static Producer make(const std::string& name, bool checksums) {
    ProducerOptions o;
    o.mode = RegionMode::kStore;
    o.store_bytes = 4 << 20;
    o.pin = Pin::kNo;
    o.engine = CopyEngine::kHost;
    o.checksums = checksums;
    o.max_consumers = 4;
    return Producer::create(name, o);
  }
};

ConsumerOptions copts() {
  ConsumerOptions o;
  o.pin = Pin::kNo;
  o.open_timeout = 10s;
  return o;
}

// A late joiner in another process: 0 when it reads the producer's bytes,
// bit-exact (checksums verified when the region has them).
int late_joiner_exit(const std::string& name) {
  Child c = Child::spawn([&] {
    try {
      Consumer k = Consumer::open(name, copts());
      if (!k.views_read_only()) return 2;
      const SyncInfo& s = k.wait_sync(0ms);
      if (s.version != 1 || s.tensors.size() != kTensors) return 3;
      std::vector<std::vector<std::uint8_t>> got(kTensors, std::vector<std::uint8_t>(kTensorBytes));
      std::vector<void*> dsts;
      for (auto& g : got) dsts.push_back(g.data());
      k.read_into(dsts);
      return check_pattern(got, kSeed) ? 0 : 4;
    } catch (const Error& e) {
      std::fprintf(stderr, "late joiner: %s\n", e.what());
      return errc_exit(e);
    }
  });
  return c.wait(60s);
}

class StoreViewWrites : public ::testing::TestWithParam<bool> {};

std::string sums_name(const ::testing::TestParamInfo<bool>& i) { return i.param ? "Checksums" : "NoChecksums"; }

}  // namespace

// C++: a reader that casts away the const of views() and writes dies of
// SIGSEGV; nothing it tried reaches the bank.
TEST_P(StoreViewWrites, CppWriteThroughViewsFaultsAndTheVersionStaysIntact) {
  Store st(GetParam());
  Child writer = Child::spawn([&] {
    Consumer c = Consumer::open(st.name, copts());
    if (c.wait_sync(0ms).version != 1) return 10;
    const std::vector<const std::byte*> v = c.views();
    ::signal(SIGSEGV, SIG_DFL);  // die of the fault itself (a sanitizer's handler would report and exit 1)
    auto* p = const_cast<volatile std::uint8_t*>(reinterpret_cast<const volatile std::uint8_t*>(v[0]));
    for (std::uint64_t i = 0; i < kTensorBytes; i += 4096) p[i] = static_cast<std::uint8_t>(p[i] ^ 0xff);
    return 11;  // the writes went through
  });
  EXPECT_EQ(writer.wait(60s), 128 + SIGSEGV) << "a write through views() did not fault";
  EXPECT_EQ(late_joiner_exit(st.name), 0) << "the kept version changed";
}

// Python: view.tensors[0].mul_(-1000) (and the other in-place forms) on a
// hold() raise shmcast.ReadOnly; nothing reaches the bank. One interpreter
// reads both stores (with and without checksums): importing torch is most
// of the test's time, several minutes on a loaded 2-core machine.
TEST(StoreViewWritesPython, InPlaceOpOnAHeldViewRaisesAndTheVersionStaysIntact) {
#if !defined(SHMCAST_PYTHON) || !defined(SHMCAST_PYTHONPATH)
  GTEST_SKIP() << "the Python module is not built";
#else
  Store plain(false), summed(true);
  static const char* kScript = R"PY(
import sys
try:
    import torch
    import shmcast
except ImportError as e:
    print("skip:", e)
    sys.exit(77)
for name in sys.argv[1:]:
    c = shmcast.Consumer(name, pin=False)
    view = c.hold(timeout=0)
    t = view.tensors[0][1]
    before = t.clone()
    try:
        t.mul_(-1000)
    except getattr(shmcast, "ReadOnly", ()) as e:
        print("refused:", e)
    else:
        print("mul_ wrote into the view")
        sys.exit(3)
    for stmt in ("t += 1", "t[0] = 5", "torch.add(t, 1, out=t)", "t.copy_(torch.zeros_like(t))",
                 "t.data.zero_()", "view.tensors[1][1].view(-1)[:4].fill_(7)"):
        try:
            exec(stmt)
        except shmcast.ReadOnly:
            continue
        print("not refused:", stmt)
        sys.exit(4)
    if not torch.equal(t.view(torch.uint8), before.view(torch.uint8)):  # bytes: the pattern holds NaNs
        print("the view changed")
        sys.exit(5)
    w = t.clone()
    w.mul_(-1000)  # a copy is the reader's own
    view.release()
    c.close()
)PY";
  Child py = Child::spawn([&] {
    ::setenv("PYTHONPATH", SHMCAST_PYTHONPATH, 1);
    ::setenv("PYTHONDONTWRITEBYTECODE", "1", 1);
    ::execl(SHMCAST_PYTHON, SHMCAST_PYTHON, "-c", kScript, plain.name.c_str(), summed.name.c_str(),
            static_cast<char*>(nullptr));
    return 127;
  });
  const int rc = py.wait(540s);
  if (rc == 77) GTEST_SKIP() << "this Python lacks torch";
  EXPECT_EQ(rc, 0) << "the Python reader's in-place write was not refused (exit " << rc << ")";
  EXPECT_EQ(late_joiner_exit(plain.name), 0) << "the kept version changed (no checksums)";
  EXPECT_EQ(late_joiner_exit(summed.name), 0) << "the kept version changed (checksums)";
#endif
}

INSTANTIATE_TEST_SUITE_P(Store, StoreViewWrites, ::testing::Bool(), sums_name);
