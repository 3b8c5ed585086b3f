// The CUDA engine's driver loader (lib/core/engine/cuda_driver.cpp) when CUDA is not
// usable: libcuda.so.1 missing, a driver too old, cuInit failing, a library
// lacking functions. Every case runs in a forked child with SHMCAST_LIBCUDA
// naming a file that does not exist or the stand-in fake_libcuda.so
// (fake_libcuda.c), so the tier runs on any machine, GPU or not. Each checks
// the reason (cuda_unavailable_reason), that Pin::kYes and device writes
// throw Errc::kCudaUnavailable with it, and that the host path still works.
#include <gtest/gtest.h>

#include <cstdlib>

#include "support.hpp"

using namespace shmcast;
using namespace shmcast_test;
using namespace std::chrono_literals;

namespace {

struct Case {
  std::string lib;                         // SHMCAST_LIBCUDA
  std::vector<std::pair<const char*, const char*>> env;  // extra variables for the fake
  std::vector<std::string> want;           // substrings of the reason
};

int run_case(const Case& c) {
  ::setenv("SHMCAST_LIBCUDA", c.lib.c_str(), 1);
  for (const auto& [k, v] : c.env) ::setenv(k, v, 1);
  if (cuda_available()) return 1;
  const std::string why = cuda_unavailable_reason();
  std::fprintf(stderr, "reason: %s\n", why.c_str());
  for (const std::string& w : c.want)
    if (why.find(w) == std::string::npos) {
      std::fprintf(stderr, "the reason lacks '%s'\n", w.c_str());
      return 2;
    }
  const std::string name = unique_name("drv");
  RegionGuard g{name};
  ProducerOptions o;
  o.slot_bytes = 1ull << 20;
  o.pin = Pin::kYes;
  try {
    Producer p = Producer::create(name, o);
    return 3;
  } catch (const Error& e) {
    if (e.code() != Errc::kCudaUnavailable) return 4;
    if (std::string(e.what()).find(why) == std::string::npos) return 5;
  }
  {
    // An explicit CUDA engine is refused with the same reason.
    ProducerOptions oc = o;
    oc.pin = Pin::kNo;
    oc.engine = CopyEngine::kCuda;
    try {
      Producer bad = Producer::create(name, oc);
      return 7;
    } catch (const Error& e) {
      std::fprintf(stderr, "CopyEngine::kCuda: [%s] %s\n", errc_name(e.code()), e.what());
      if (e.code() != Errc::kCudaUnavailable) return 8;
      if (std::string(e.what()).find(why) == std::string::npos) return 9;
    }
  }
  o.pin = Pin::kAuto;
  Producer p = Producer::create(name, o);
  if (p.pinned()) return 6;
  if (p.engine() != CopyEngine::kHost) return 10;  // kAuto without a usable driver
  const std::vector<TensorSpec> specs = {{"x", DType::kU8, {4096}}};
  p.begin_sync(specs);
  std::vector<std::uint8_t> host(4096, 7);
  p.write(0, host.data());  // the host path goes on
  p.end_sync();
  return 0;
}

int in_child(const Case& c) {
  Child ch = Child::spawn([&] { return run_case(c); });
  return ch.wait(60s);
}

}  // namespace

TEST(CudaDriver, MissingLibraryIsCudaUnavailable) {
  EXPECT_EQ(in_child({"/nonexistent/libcuda.so.1", {}, {"/nonexistent/libcuda.so.1", "could not be loaded",
                                                          "NVIDIA driver"}}),
            0);
}

TEST(CudaDriver, NotADriverLibrary) {
  // A real shared library without the driver's functions (libc).
  EXPECT_EQ(in_child({"libc.so.6", {}, {"libc.so.6", "not a usable CUDA driver library"}}), 0);
}

TEST(CudaDriver, TooOldDriver) {
  EXPECT_EQ(in_child({SHMCAST_FAKE_LIBCUDA, {{"FAKE_CUDA_VERSION", "9020"}}, {"too old", "CUDA 9.2", "CUDA 10.0"}}),
            0);
}

TEST(CudaDriver, CuInitFails) {
  EXPECT_EQ(in_child({SHMCAST_FAKE_LIBCUDA,
                      {{"FAKE_CUDA_VERSION", "12040"}, {"FAKE_CUINIT_RESULT", "100"}},
                      {"cuInit", "CUDA_ERROR_NO_DEVICE", "CUDA 12.4"}}),
            0);
}

TEST(CudaDriver, MissingFunctions) {
  EXPECT_EQ(in_child({SHMCAST_FAKE_LIBCUDA, {{"FAKE_CUDA_VERSION", "13000"}},
                      {"lacks cuDeviceGet", "more", "update the NVIDIA driver"}}),
            0);
}
