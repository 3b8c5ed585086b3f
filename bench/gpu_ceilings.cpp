// See gpu_ceilings.hpp.
#include "gpu_ceilings.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <stdexcept>

namespace bench::gpu {

using json = nlohmann::json;

void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

double mono_s() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

json stat(std::vector<double> v) {
  if (v.empty()) return json{{"n", 0}};
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return json{{"n", n}, {"min", v.front()}, {"median", n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2])},
              {"max", v.back()}};
}

std::string command_line(int argc, char** argv) {
  std::string c;
  for (int i = 0; i < argc; ++i) c += (i ? " " : "") + std::string(argv[i]);
  return c;
}

std::string fmt_stat(const json& s, double scale, const char* f) {
  if (!s.contains("median")) return "-";
  char b[128];
  std::string spec = std::string(f) + " (" + f + " .. " + f + ")";
  std::snprintf(b, sizeof b, spec.c_str(), s["median"].get<double>() * scale, s["min"].get<double>() * scale,
                s["max"].get<double>() * scale);
  return b;
}

namespace {

// The host path's ceiling: a D2H and an H2D of `bytes` each, at once, on
// two streams, between device buffers and pinned host buffers; GB/s per
// direction (bytes / the time both take), per rep.
json host_ceiling(std::uint64_t bytes, int reps) {
  json out;
  try {
    void *dev_a = nullptr, *dev_b = nullptr, *host_a = nullptr, *host_b = nullptr;
    ck(cudaMalloc(&dev_a, bytes), "cudaMalloc");
    ck(cudaMalloc(&dev_b, bytes), "cudaMalloc");
    ck(cudaHostAlloc(&host_a, bytes, cudaHostAllocDefault), "cudaHostAlloc");
    ck(cudaHostAlloc(&host_b, bytes, cudaHostAllocDefault), "cudaHostAlloc");
    cudaStream_t d2h = nullptr, h2d = nullptr;
    ck(cudaStreamCreateWithFlags(&d2h, cudaStreamNonBlocking), "stream");
    ck(cudaStreamCreateWithFlags(&h2d, cudaStreamNonBlocking), "stream");
    std::vector<double> g;
    for (int i = 0; i <= reps; ++i) {
      ck(cudaDeviceSynchronize(), "sync");
      const double t0 = mono_s();
      ck(cudaMemcpyAsync(host_a, dev_a, bytes, cudaMemcpyDeviceToHost, d2h), "D2H");
      ck(cudaMemcpyAsync(dev_b, host_b, bytes, cudaMemcpyHostToDevice, h2d), "H2D");
      ck(cudaStreamSynchronize(d2h), "sync");
      ck(cudaStreamSynchronize(h2d), "sync");
      if (i > 0) g.push_back(static_cast<double>(bytes) / (mono_s() - t0) / 1e9);  // the first warms up
    }
    out = stat(g);
    cudaFreeHost(host_a);
    cudaFreeHost(host_b);
    cudaFree(dev_a);
    cudaFree(dev_b);
  } catch (const std::exception& e) {
    out = json{{"error", e.what()}};
  }
  return out;
}

}  // namespace

json ceilings(std::uint64_t bytes, int reps) {
  int fd[2];
  if (::pipe(fd) != 0) return json{{"error", "pipe"}};
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fd[0]);
    json out;
    try {
      void *a = nullptr, *b = nullptr;
      ck(cudaMalloc(&a, bytes), "cudaMalloc");
      ck(cudaMalloc(&b, bytes), "cudaMalloc");
      ck(cudaMemset(a, 1, bytes), "memset");
      ck(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice), "warm-up");
      std::vector<double> g;
      for (int i = 0; i < reps; ++i) {
        ck(cudaDeviceSynchronize(), "sync");
        const double t0 = mono_s();
        ck(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice), "cudaMemcpy D2D");
        ck(cudaDeviceSynchronize(), "sync");
        g.push_back(static_cast<double>(bytes) / (mono_s() - t0) / 1e9);
      }
      out["d2d_gbps"] = stat(g);
      cudaFree(a);
      cudaFree(b);
      out["host_both_gbps"] = host_ceiling(bytes, reps);
    } catch (const std::exception& e) {
      out = json{{"error", e.what()}};
    }
    const std::string s = out.dump();
    (void)!::write(fd[1], s.data(), s.size());
    ::_exit(0);
  }
  ::close(fd[1]);
  std::string s;
  char buf[4096];
  for (ssize_t n; (n = ::read(fd[0], buf, sizeof buf)) > 0;) s.append(buf, static_cast<std::size_t>(n));
  ::close(fd[0]);
  int st = 0;
  ::waitpid(pid, &st, 0);
  try {
    return json::parse(s);
  } catch (...) {
    return json{{"error", "no result"}};
  }
}

}  // namespace bench::gpu
