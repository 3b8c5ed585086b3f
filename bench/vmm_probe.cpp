// shmcast-vmm-probe: how fast device-to-device copies go into and out of
// device slots' memory as a consumer sees it: a VMM allocation
// (cuMemCreate, POSIX-fd handle type) made by another process, its fd
// passed over the fd channel (SCM_RIGHTS), imported and mapped here
// (lib/core/engine/cuda_vmm.hpp, lib/core/protocol/fd_channel.hpp: the library's own code).
// In the same run, the reference: the same copy between two plain
// cudaMalloc buffers of this GPU, and with --consumer on another GPU than
// --owner, the plain peer copies both ways.
//
//   shmcast-vmm-probe [--bytes 1G] [--reps 10] [--warmup 2] [--owner 0] [--consumer 0] [--json]
//
// Each figure: --reps timed copies of --bytes (one cudaMemcpyAsync each,
// timed with CUDA events around it, after --warmup untimed ones), as GB/s
// (10^9 bytes copied per second: bytes / time, each byte read once and
// written once), min/median/max. Every copy's bytes are checked once at the
// end (the slot's and the destination's against the source pattern); exit 1
// on a mismatch. The owner (a forked child) fills the slot first; the
// consumer checks the head and tail it sees.
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "engine/cuda_vmm.hpp"
#include "protocol/fd_channel.hpp"
#include "support.hpp"

using namespace shmcast;
using namespace shmcast::detail;
using namespace std::chrono_literals;

namespace {

struct Opts {
  std::uint64_t bytes = 1ull << 30;
  int reps = 10, warmup = 2, owner = 0, consumer = 0;
  bool json = false;
};

std::uint64_t parse_size(const char* s) {
  char* end = nullptr;
  double v = std::strtod(s, &end);
  switch (end != nullptr ? *end : 0) {
    case 'k': case 'K': v *= 1024; break;
    case 'm': case 'M': v *= 1024 * 1024; break;
    case 'g': case 'G': v *= 1024.0 * 1024 * 1024; break;
    default: break;
  }
  return static_cast<std::uint64_t>(v);
}

void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s (%s)\n", what, cudaGetErrorName(e), cudaGetErrorString(e));
    std::exit(2);
  }
}

struct Stats {
  std::string name;
  double min = 0, median = 0, max = 0;
};

Stats time_copies(const std::string& name, void* dst, const void* src, std::uint64_t bytes, const Opts& o,
                  cudaStream_t st) {
  cudaEvent_t a, b;
  ck(cudaEventCreate(&a), "cudaEventCreate");
  ck(cudaEventCreate(&b), "cudaEventCreate");
  std::vector<double> gbs;
  for (int i = 0; i < o.warmup + o.reps; ++i) {
    ck(cudaEventRecord(a, st), "cudaEventRecord");
    ck(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, st), name.c_str());
    ck(cudaEventRecord(b, st), "cudaEventRecord");
    ck(cudaEventSynchronize(b), "cudaEventSynchronize");
    float ms = 0;
    ck(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
    if (i >= o.warmup) gbs.push_back(static_cast<double>(bytes) / (static_cast<double>(ms) * 1e6));
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(gbs.begin(), gbs.end());
  Stats s{name, gbs.front(), gbs[gbs.size() / 2], gbs.back()};
  if (gbs.size() % 2 == 0) s.median = (gbs[gbs.size() / 2 - 1] + gbs[gbs.size() / 2]) / 2;
  return s;
}

bool device_equals(const void* dev, const std::vector<std::uint8_t>& want) {
  std::vector<std::uint8_t> got(want.size());
  ck(cudaMemcpy(got.data(), dev, want.size(), cudaMemcpyDefault), "cudaMemcpy D2H");
  return got == want;
}

}  // namespace

int main(int argc, char** argv) {
  Opts o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--bytes") o.bytes = parse_size(next());
    else if (a == "--reps") o.reps = std::atoi(next());
    else if (a == "--warmup") o.warmup = std::atoi(next());
    else if (a == "--owner") o.owner = std::atoi(next());
    else if (a == "--consumer") o.consumer = std::atoi(next());
    else if (a == "--json") o.json = true;
    else {
      std::fprintf(stderr, "usage: %s [--bytes 1G] [--reps 10] [--warmup 2] [--owner 0] [--consumer 0] [--json]\n",
                   argv[0]);
      return 2;
    }
  }
  if (o.reps < 1 || o.bytes == 0) return 2;
  char tmpl[] = "/dev/shm/shmcast-vmm-probe-XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) return 2;
  const std::string dir = tmpl, name = "probe";
  shmcast_test::SharedFlags* flags = shmcast_test::SharedFlags::make();

  // The owner: a process of its own, forked before this one touches CUDA.
  shmcast_test::Child owner = shmcast_test::Child::spawn([&] {
    ck(cudaSetDevice(o.owner), "cudaSetDevice(owner)");
    std::vector<vmm::Mapping> slot;
    slot.push_back(vmm::Mapping::allocate(o.owner, o.bytes));
    ck(cudaMemset(slot[0].data(), 0x5a, slot[0].bytes()), "cudaMemset slot");
    ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    const int fd = slot[0].export_fd();
    FdSetInfo info;
    info.kind = FdKind::kCudaVmm;
    info.region_nonce = 1;
    info.device_uuid = vmm::device_uuid(o.owner);
    info.sizes = {slot[0].bytes()};
    FdServer server = FdServer::start(dir, name, std::vector<int>{fd}, info);
    ::close(fd);
    flags->v[0] = 1;
    if (!flags->wait(1, 1, 600s)) return 3;
    server.stop();
    slot.clear();
    return 0;
  });

  int rc = 0;
  {
    // Until the owner serves its slot, or exits (it failed: its reason is on stderr).
    const auto give_up = std::chrono::steady_clock::now() + 120s;
    while (flags->v[0].load() != 1) {
      if (::waitpid(owner.pid, &owner.status, WNOHANG) == owner.pid) {
        owner.waited = true;
        std::fprintf(stderr, "the owner process exited (%d) without serving its slot\n", owner.decode());
        return 2;
      }
      if (std::chrono::steady_clock::now() > give_up) {
        std::fprintf(stderr, "the owner process did not serve its slot within 120 s\n");
        return 2;
      }
      std::this_thread::sleep_for(1ms);
    }
    ck(cudaSetDevice(o.consumer), "cudaSetDevice(consumer)");
    FdFetchOptions fo;
    fo.kind = FdKind::kCudaVmm;
    fo.region_nonce = 1;
    fo.expect_fds = 1;
    fo.timeout = 60s;
    std::vector<vmm::Mapping> slot;
    try {
      FetchedFds got = fetch_fds(dir, name, fo);
      slot.push_back(vmm::Mapping::import(got.fds[0].get(), got.info.sizes[0], got.info.device_uuid, o.consumer));
    } catch (const Error& e) {
      std::fprintf(stderr, "%s\n", e.what());
      flags->v[1] = 1;
      return e.code() == Errc::kUnsupported ? 4 : 2;
    }
    const std::uint64_t n = o.bytes;  // the part timed (the slot may be larger: rounded up)
    std::vector<std::uint8_t> head(std::min<std::uint64_t>(n, 1 << 20), 0x5a);
    const bool filled = device_equals(slot[0].data(), head) &&
                        device_equals(static_cast<std::uint8_t*>(slot[0].data()) + n - head.size(), head);

    cudaStream_t st;
    ck(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "cudaStreamCreate");
    void *src = nullptr, *dst = nullptr, *peer = nullptr;
    ck(cudaMalloc(&src, n), "cudaMalloc src");
    ck(cudaMalloc(&dst, n), "cudaMalloc dst");
    std::vector<std::uint8_t> pat(n);
    shmcast_test::fill_pattern(pat.data(), n, 42);
    ck(cudaMemcpy(src, pat.data(), n, cudaMemcpyHostToDevice), "upload the pattern");

    std::vector<Stats> s;
    s.push_back(time_copies("d2d_plain", dst, src, n, o, st));
    if (o.owner != o.consumer) {
      ck(cudaSetDevice(o.owner), "cudaSetDevice(owner)");
      ck(cudaMalloc(&peer, n), "cudaMalloc on the owner GPU");
      ck(cudaSetDevice(o.consumer), "cudaSetDevice(consumer)");
      const cudaError_t e = cudaDeviceEnablePeerAccess(o.owner, 0);
      if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) ck(e, "cudaDeviceEnablePeerAccess");
      (void)cudaGetLastError();
      s.push_back(time_copies("peer_plain_into_owner_gpu", peer, src, n, o, st));
      s.push_back(time_copies("peer_plain_out_of_owner_gpu", dst, peer, n, o, st));
    }
    s.push_back(time_copies("into_vmm_slot", slot[0].data(), src, n, o, st));
    s.push_back(time_copies("out_of_vmm_slot", dst, slot[0].data(), n, o, st));
    const bool exact = device_equals(slot[0].data(), pat) && device_equals(dst, pat);

    cudaDeviceProp prop{};
    ck(cudaGetDeviceProperties(&prop, o.consumer), "cudaGetDeviceProperties");
    int driver = 0;
    cudaDriverGetVersion(&driver);
    if (!o.json) {
      std::printf("shmcast-vmm-probe: %s, driver CUDA %d.%d, owner GPU %d, consumer GPU %d, %llu bytes per copy, "
                  "%d reps (+%d warm-up), slot %s, filled by the owner: %s, copies bit-exact: %s\n",
                  prop.name, driver / 1000, driver % 1000 / 10, o.owner, o.consumer,
                  static_cast<unsigned long long>(n), o.reps, o.warmup, vmm::uuid_text(vmm::device_uuid(o.owner)).c_str(),
                  filled ? "yes" : "NO", exact ? "yes" : "NO");
      std::printf("%-30s %10s %10s %10s   (GB/s)\n", "copy", "min", "median", "max");
      for (const Stats& x : s) std::printf("%-30s %10.1f %10.1f %10.1f\n", x.name.c_str(), x.min, x.median, x.max);
      std::printf("into / d2d_plain (median): %.2f   out / d2d_plain (median): %.2f\n",
                  s[s.size() - 2].median / s[0].median, s.back().median / s[0].median);
    } else {
      std::printf("{\"gpu\": \"%s\", \"driver\": %d, \"owner\": %d, \"consumer\": %d, \"bytes\": %llu, \"reps\": %d, "
                  "\"warmup\": %d, \"filled\": %s, \"verified\": %s",
                  prop.name, driver, o.owner, o.consumer, static_cast<unsigned long long>(n), o.reps, o.warmup,
                  filled ? "true" : "false", exact ? "true" : "false");
      for (const Stats& x : s)
        std::printf(", \"%s_GBps\": {\"min\": %.1f, \"median\": %.1f, \"max\": %.1f}", x.name.c_str(), x.min,
                    x.median, x.max);
      std::printf("}\n");
    }
    if (!filled || !exact) rc = 1;
    cudaFree(src);
    cudaFree(dst);
    if (peer != nullptr) cudaFree(peer);
    slot.clear();
  }
  flags->v[1] = 1;
  const int orc = owner.wait(120s);
  if (orc != 0) {
    std::fprintf(stderr, "the owner process exited with %d\n", orc);
    rc = rc != 0 ? rc : 2;
  }
  ::rmdir(dir.c_str());
  return rc;
}
