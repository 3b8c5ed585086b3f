// The no-GPU path (runs in CI: CUDA toolkit, no GPU; also in builds without
// CUDA). CUDA entry points give a clear Error, and the host path keeps working
// in the same producer and consumer. Skips where a GPU is usable.
#include <gtest/gtest.h>

#include "protocol/delta.hpp"
#include "engine/delta_cuda.hpp"
#include "support.hpp"

using namespace shmcast;
using namespace shmcast_test;
using namespace std::chrono_literals;

namespace {

bool gpu_present() {
  static int cached = -1;
  if (cached < 0) {
    // Probed in a child so that this process never initialises CUDA.
    Child c = Child::spawn([] { return cuda_available() ? 0 : 1; });
    cached = c.wait(60s) == 0 ? 1 : 0;
  }
  return cached == 1;
}

bool clear_cuda_error(const Error& e) {
  const std::string what = e.what();
  return (e.code() == Errc::kCudaUnavailable || e.code() == Errc::kCuda) && what.find("CUDA") != std::string::npos &&
         what.size() > 20;
}

}  // namespace

TEST(NoGpu, ReasonIsReported) {
  if (gpu_present()) GTEST_SKIP() << "a GPU is present";
  Child c = Child::spawn([] {
    if (cuda_available()) return 1;
    const std::string why = cuda_unavailable_reason();
    std::fprintf(stderr, "cuda_unavailable_reason: %s\n", why.c_str());
    if (why.empty()) return 2;
    return 0;
  });
  EXPECT_EQ(c.wait(60s), 0);
}

TEST(NoGpu, WriteDeviceIsRefusedAndHostPathStillWorks) {
  if (gpu_present()) GTEST_SKIP() << "a GPU is present";
  const std::string name = unique_name("nogpu");
  RegionGuard g{name};
  const std::vector<TensorSpec> specs = {{"w", DType::kF32, {1024}}};
  Child prod = Child::spawn([&] {
    ProducerOptions o;
    o.slot_bytes = 2ull << 20;
    o.pin = Pin::kAuto;  // quietly unpinned without a GPU
    o.consumer_timeout = 20s;
    {
      // An explicit CUDA engine needs a GPU: refused at create, nothing left behind.
      ProducerOptions oc = o;
      oc.engine = CopyEngine::kCuda;
      try {
        Producer bad = Producer::create(name, oc);
        return 15;
      } catch (const Error& e) {
        std::fprintf(stderr, "CopyEngine::kCuda: [%s] %s\n", errc_name(e.code()), e.what());
        if (!clear_cuda_error(e)) return 16;
      }
    }
    Producer p = Producer::create(name, o);
    if (p.pinned()) return 10;
    if (p.engine() != CopyEngine::kHost) return 17;  // kAuto without a GPU
    p.wait_for_consumers(1, 20s);
    p.begin_sync(specs);
    float dummy[1024] = {};
    try {
      p.write_device(0, dummy, nullptr);
      return 11;
    } catch (const Error& e) {
      std::fprintf(stderr, "write_device: [%s] %s\n", errc_name(e.code()), e.what());
      if (e.code() != Errc::kInvalidArgument || std::string(e.what()).find("CopyEngine::kCuda") == std::string::npos)
        return 12;
    }
    // The failed write aborted that sync; the next one goes from host memory.
    p.begin_sync(specs);
    std::vector<float> host(1024);
    for (int i = 0; i < 1024; ++i) host[i] = static_cast<float>(i) * 0.5f;
    p.write(0, host.data());  // the sync goes on from host memory
    p.end_sync();
    p.wait_drained(20s);
    return 0;
  });
  Child cons = Child::spawn([&] {
    ConsumerOptions o;
    o.pin = Pin::kAuto;
    Consumer c = Consumer::open(name, o);
    if (c.pinned()) return 20;
    c.wait_sync(20s);  // sync 1 (aborted by the producer's failed write_device) or sync 2
    std::vector<float> got(1024, -1.f);
    void* dst = got.data();
    try {
      c.read_into_device(std::span<void* const>(&dst, 1), nullptr);
      return 21;
    } catch (const Error& e) {
      std::fprintf(stderr, "read_into_device: [%s] %s\n", errc_name(e.code()), e.what());
      if (!clear_cuda_error(e)) return 22;
    }
    try {
      c.read_to_staging(0, nullptr);
      return 23;
    } catch (const Error& e) {
      if (!clear_cuda_error(e)) return 24;
    }
    for (;;) {
      try {
        c.read_into(std::span<void* const>(&dst, 1));  // the host path still works
        break;
      } catch (const Error& e) {
        if (e.code() != Errc::kAborted) return 26;
        if (c.wait_sync(20s).version != 2) return 27;
      }
    }
    for (int i = 0; i < 1024; ++i)
      if (got[i] != static_cast<float>(i) * 0.5f) return 25;
    return 0;
  });
  EXPECT_EQ(cons.wait(60s), 0);
  EXPECT_EQ(prod.wait(60s), 0);
}

TEST(NoGpu, PinYesFailsWithCudaUnavailable) {
  if (gpu_present()) GTEST_SKIP() << "a GPU is present";
  const std::string name = unique_name("nogpu-pin");
  RegionGuard g{name};
  Child c = Child::spawn([&] {
    ProducerOptions o;
    o.slot_bytes = 2ull << 20;
    o.pin = Pin::kYes;
    try {
      Producer p = Producer::create(name, o);
      return 1;
    } catch (const Error& e) {
      std::fprintf(stderr, "Pin::kYes: [%s] %s\n", errc_name(e.code()), e.what());
      if (e.code() != Errc::kCudaUnavailable) return 2;
      if (std::string(e.what()).find("CUDA") == std::string::npos) return 3;
    }
    // The failed create left nothing behind: the name can be created again.
    o.pin = Pin::kNo;
    Producer p = Producer::create(name, o);
    return p.pinned() ? 4 : 0;
  });
  EXPECT_EQ(c.wait(60s), 0);
}

TEST(NoGpu, CudaDeltaCodecIsCudaUnavailableWithTheReason) {
  if (gpu_present()) GTEST_SKIP() << "a GPU is present";
  Child c = Child::spawn([] {
    namespace dl = shmcast::detail::delta;
    std::string why;
    if (dl::cuda_codec_available(&why)) return 1;
    std::fprintf(stderr, "cuda_codec_available: %s\n", why.c_str());
    if (why.find("CUDA") == std::string::npos) return 2;
    dl::CudaCodec codec;
    alignas(8) static std::uint8_t a[64], b[64], head[128];
    try {
      codec.plan(a, b, 2, 32, head, nullptr);
      return 3;
    } catch (const Error& e) {
      std::fprintf(stderr, "CudaCodec::plan: [%s] %s\n", errc_name(e.code()), e.what());
      if (e.code() != Errc::kCudaUnavailable) return 4;
      if (std::string(e.what()).find("CUDA") == std::string::npos) return 5;
    }
    // The host codec is there all the same.
    b[3] = 1;
    const dl::Plan p = dl::plan(a, b, 2, 32);
    return p.changed == 1 ? 0 : 6;
  });
  EXPECT_EQ(c.wait(60s), 0);
}
