// shmcast-bench, CUDA mode: the producer and consumer roles (each its own
// process, CUDA initialised after exec) and the single-process copy ceilings.
// The producer fills its device tensors with sync i's bytes before sync i and
// the consumer checks every byte it received on the device after its timer
// stopped (cuda_kernels.cu).
#include <sys/mman.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "bench.hpp"
#include "content.hpp"
#include "cuda_kernels.hpp"

namespace bench {

using namespace std::chrono_literals;

namespace {

void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
  }
}

constexpr std::uint64_t kAlign = 256;

std::uint64_t align_up(std::uint64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// Offsets of each tensor in one device allocation (256-byte aligned).
std::uint64_t layout(const std::vector<shmcast::TensorSpec>& specs, std::vector<std::uint64_t>* offs) {
  std::uint64_t at = 0;
  offs->clear();
  for (const auto& s : specs) {
    offs->push_back(at);
    at = align_up(at + s.nbytes());
  }
  return at ? at : kAlign;
}

void fill_key(std::byte* dst, std::uint64_t n, std::uint64_t key, cudaStream_t s) {
  ck(kernels::fill(dst, n, key, s), "fill kernel");
}

void wait_all(Ctl* ctl, const char* what, int i, bool ready) {
  const std::uint32_t n = ctl->cfg.consumers;
  wait_for(ctl, what, 120, [&] {
    for (std::uint32_t k = 0; k < n; ++k)
      if ((ready ? ctl->t_ready[k][i] : ctl->t_done[k][i]).load(std::memory_order_acquire) == 0) return false;
    return true;
  });
}

}  // namespace

bool bench_has_cuda() { return true; }

int cuda_producer(Ctl* ctl) {
  const Config& c = ctl->cfg;
  RoleResult& r = ctl->producer;
  ck(cudaSetDevice(c.producer_device), "cudaSetDevice (producer)");
  const auto specs = manifest_by_name(c.manifest);
  std::vector<std::uint64_t> offs;
  const std::int64_t t0 = now_ns();
  const std::uint64_t total = layout(specs, &offs);
  void* slab = nullptr;
  ck(cudaMalloc(&slab, total), "cudaMalloc (source tensors)");
  std::byte* base = static_cast<std::byte*>(slab);
  cudaStream_t stream = nullptr, fill = nullptr;
  ck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  ck(cudaStreamCreateWithFlags(&fill, cudaStreamNonBlocking), "cudaStreamCreate");
  r.setup_s = static_cast<double>(now_ns() - t0) * 1e-9;

  shmcast::Producer p = shmcast::Producer::create(c.region, producer_options(c, shmcast::Pin::kYes, shmcast::CopyEngine::kCuda));
  r.create_s = p.create_seconds();
  r.pin_s = p.pin_seconds();
  r.pinned = p.pinned();
  r.region_bytes = p.region_bytes();
  ctl->region_ready.store(1, std::memory_order_release);
  p.wait_for_consumers(c.consumers, 60s);
  for (int i = 0; i < c.syncs(); ++i) {
    // Fresh bytes for this sync, on the device, outside the timed region.
    for (std::size_t t = 0; t < specs.size(); ++t)
      fill_key(base + offs[t], specs[t].nbytes(), content::key(c.seed, static_cast<std::uint64_t>(i), t), fill);
    ck(cudaStreamSynchronize(fill), "cudaStreamSynchronize (fill)");
    wait_all(ctl, "consumers ready", i, true);
    ctl->t_start[i].store(now_ns(), std::memory_order_release);
    p.begin_sync(specs);
    for (std::size_t t = 0; t < specs.size(); ++t) p.write_device(t, base + offs[t], stream);
    p.end_sync();
    ctl->t_prod_end[i].store(now_ns(), std::memory_order_release);
    wait_all(ctl, "consumers done", i, false);
  }
  p.wait_drained(60s);
  p.close();
  cudaStreamDestroy(stream);
  cudaStreamDestroy(fill);
  cudaFree(slab);
  return 0;
}

int cuda_consumer(Ctl* ctl, int index) {
  const Config& c = ctl->cfg;
  RoleResult& r = ctl->consumer[index];
  ck(cudaSetDevice(c.consumer_device), "cudaSetDevice (consumer)");
  const auto specs = manifest_by_name(c.manifest);
  std::vector<std::uint64_t> offs;
  const std::uint64_t total = layout(specs, &offs);
  std::byte* base = nullptr;
  std::vector<void*> dsts;
  if (!c.staging) {
    void* slab = nullptr;
    ck(cudaMalloc(&slab, total), "cudaMalloc (destination tensors)");
    base = static_cast<std::byte*>(slab);
    for (std::size_t i = 0; i < specs.size(); ++i) dsts.push_back(base + offs[i]);
  }
  // One mismatch counter per tensor, on the device.
  unsigned long long* bad_d = nullptr;
  ck(cudaMalloc(reinterpret_cast<void**>(&bad_d), specs.size() * sizeof(unsigned long long)), "cudaMalloc (counters)");
  std::vector<unsigned long long> bad_h(specs.size());
  cudaStream_t stream = nullptr;
  ck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  shmcast::ConsumerOptions o;
  o.pin = shmcast::Pin::kYes;
  // Open once the region exists, so that open_seconds() is the open itself.
  wait_for(ctl, "the region", 120, [&] { return ctl->region_ready.load(std::memory_order_acquire) != 0; });
  shmcast::Consumer con = shmcast::Consumer::open(c.region, o);
  r.create_s = con.open_seconds();
  r.pin_s = con.pin_seconds();
  r.pinned = con.pinned();
  std::vector<void*> got;
  for (int i = 0; i < c.syncs(); ++i) {
    ck(cudaMemsetAsync(bad_d, 0, specs.size() * sizeof(unsigned long long), stream), "cudaMemsetAsync (counters)");
    ck(cudaStreamSynchronize(stream), "cudaStreamSynchronize (counters)");
    ctl->t_ready[index][i].store(now_ns(), std::memory_order_release);
    const shmcast::SyncInfo& info = con.wait_sync(120s);
    if (info.tensors.size() != specs.size()) throw std::runtime_error("manifest differs from the expected one");
    if (c.staging)
      got = con.read_to_staging(c.consumer_device, stream);
    else
      con.read_into_device(dsts, stream);
    ck(cudaStreamSynchronize(stream), "cudaStreamSynchronize (after read)");
    ctl->t_done[index][i].store(now_ns(), std::memory_order_release);
    // Every byte of this sync, on the device, after the timer stopped.
    const std::vector<void*>& ptrs = c.staging ? got : dsts;
    if (ptrs.size() != specs.size()) throw std::runtime_error("read returned the wrong number of tensors");
    if (index == 0 && i == corrupt_sync() && specs[0].nbytes() > 0) {  // self-test of the checker
      std::uint8_t b = 0;
      auto* at = static_cast<std::uint8_t*>(ptrs[0]) + specs[0].nbytes() / 3;
      ck(cudaMemcpy(&b, at, 1, cudaMemcpyDeviceToHost), "cudaMemcpy (corrupt)");
      b ^= 1;
      ck(cudaMemcpy(at, &b, 1, cudaMemcpyHostToDevice), "cudaMemcpy (corrupt)");
    }
    for (std::size_t t = 0; t < specs.size(); ++t)
      ck(kernels::count_bad(ptrs[t], specs[t].nbytes(), content::key(c.seed, static_cast<std::uint64_t>(i), t), bad_d + t,
                            stream),
         "check kernel");
    ck(cudaMemcpyAsync(bad_h.data(), bad_d, specs.size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost, stream),
       "cudaMemcpyAsync (counters)");
    ck(cudaStreamSynchronize(stream), "cudaStreamSynchronize (check)");
    std::int32_t bad = 0;
    for (std::size_t t = 0; t < specs.size(); ++t) {
      if (bad_h[t] != 0) {
        if (r.mismatches == 0 && bad == 0)
          std::snprintf(r.first_bad, sizeof r.first_bad, "sync %d, tensor %s (%llu words differ)", i,
                        specs[t].name.c_str(), bad_h[t]);
        ++bad;
      }
    }
    ctl->sync_bad[index][i] = bad;
    r.mismatches += bad;
    ++r.checked;
    if (bad == 0) ++r.verified;
  }
  con.close();
  cudaStreamDestroy(stream);
  cudaFree(bad_d);
  if (base) cudaFree(base);
  return 0;
}

Ceilings measure_ceilings(int pdev, int cdev, std::uint64_t bytes, int reps) {
  Ceilings out;
  out.bytes = bytes;
  out.reps = reps;
  void* host = nullptr;
  void* dsrc = nullptr;
  void* ddst = nullptr;
  cudaStream_t s1 = nullptr, s2 = nullptr, s3 = nullptr;
  cudaEvent_t e0 = nullptr, e1 = nullptr, e2 = nullptr, e3 = nullptr;
  bool registered = false;
  try {
    cudaDeviceProp prop{};
    ck(cudaGetDeviceProperties(&prop, pdev), "cudaGetDeviceProperties");
    out.device_name = prop.name;
    ck(cudaGetDeviceProperties(&prop, cdev), "cudaGetDeviceProperties");
    out.consumer_device_name = prop.name;
    // Shared anonymous memory (shmem, like /dev/shm), pinned like the region.
    host = ::mmap(nullptr, 2 * bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (host == MAP_FAILED) {
      host = nullptr;
      throw std::runtime_error("mmap of the ceiling buffer failed");
    }
    std::memset(host, 0x33, 2 * bytes);
    ck(cudaSetDevice(pdev), "cudaSetDevice");
    const auto t0 = std::chrono::steady_clock::now();
    ck(cudaHostRegister(host, 2 * bytes, cudaHostRegisterDefault | cudaHostRegisterPortable), "cudaHostRegister");
    registered = true;
    out.pin_s_per_gib = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() /
                        (2.0 * static_cast<double>(bytes) / static_cast<double>(1ull << 30));
    std::byte* hA = static_cast<std::byte*>(host);
    std::byte* hB = hA + bytes;
    ck(cudaMalloc(&dsrc, bytes), "cudaMalloc");
    fill_key(static_cast<std::byte*>(dsrc), bytes, content::key(1, 0, 0), nullptr);
    ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize (fill)");
    ck(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking), "cudaStreamCreate");
    ck(cudaEventCreate(&e0), "cudaEventCreate");
    ck(cudaEventCreate(&e1), "cudaEventCreate");
    ck(cudaSetDevice(cdev), "cudaSetDevice");
    ck(cudaMalloc(&ddst, bytes), "cudaMalloc");
    ck(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking), "cudaStreamCreate");
    ck(cudaStreamCreateWithFlags(&s3, cudaStreamNonBlocking), "cudaStreamCreate");
    ck(cudaEventCreate(&e2), "cudaEventCreate");
    ck(cudaEventCreate(&e3), "cudaEventCreate");
    ck(cudaSetDevice(pdev), "cudaSetDevice");
    const double B = static_cast<double>(bytes);
    auto gb = [&](double ms) { return B / (ms * 1e-3) * 1e-9; };
    std::vector<double> d2h, h2d, both, bd, bh;
    for (int i = 0; i <= reps; ++i) {
      float ms = 0;
      ck(cudaEventRecord(e0, s1), "cudaEventRecord");
      ck(cudaMemcpyAsync(hA, dsrc, bytes, cudaMemcpyDeviceToHost, s1), "cudaMemcpyAsync D2H");
      ck(cudaEventRecord(e1, s1), "cudaEventRecord");
      ck(cudaEventSynchronize(e1), "cudaEventSynchronize");
      ck(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
      if (i > 0) d2h.push_back(gb(ms));
    }
    {
      cudaEvent_t a = nullptr, b = nullptr;
      ck(cudaSetDevice(cdev), "cudaSetDevice");
      ck(cudaEventCreate(&a), "cudaEventCreate");
      ck(cudaEventCreate(&b), "cudaEventCreate");
      for (int i = 0; i <= reps; ++i) {
        float ms = 0;
        ck(cudaEventRecord(a, s2), "cudaEventRecord");
        ck(cudaMemcpyAsync(ddst, hB, bytes, cudaMemcpyHostToDevice, s2), "cudaMemcpyAsync H2D");
        ck(cudaEventRecord(b, s2), "cudaEventRecord");
        ck(cudaEventSynchronize(b), "cudaEventSynchronize");
        ck(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
        if (i > 0) h2d.push_back(gb(ms));
      }
      cudaEventDestroy(a);
      cudaEventDestroy(b);
      ck(cudaSetDevice(pdev), "cudaSetDevice");
    }
    for (int i = 0; i <= reps; ++i) {
      if (pdev == cdev) {
        float m1 = 0, m2 = 0;
        ck(cudaEventRecord(e0, s1), "cudaEventRecord");
        ck(cudaStreamWaitEvent(s2, e0, 0), "cudaStreamWaitEvent");
        ck(cudaMemcpyAsync(hA, dsrc, bytes, cudaMemcpyDeviceToHost, s1), "cudaMemcpyAsync D2H");
        ck(cudaMemcpyAsync(ddst, hB, bytes, cudaMemcpyHostToDevice, s2), "cudaMemcpyAsync H2D");
        ck(cudaEventRecord(e1, s1), "cudaEventRecord");
        ck(cudaEventRecord(e2, s2), "cudaEventRecord");
        ck(cudaEventSynchronize(e1), "cudaEventSynchronize");
        ck(cudaEventSynchronize(e2), "cudaEventSynchronize");
        ck(cudaEventElapsedTime(&m1, e0, e1), "cudaEventElapsedTime");
        ck(cudaEventElapsedTime(&m2, e0, e2), "cudaEventElapsedTime");
        if (i > 0) {
          bd.push_back(gb(m1));
          bh.push_back(gb(m2));
          both.push_back(gb(std::max(m1, m2)));
        }
      } else {  // two devices: events cannot span them; host clock around both
        ck(cudaStreamSynchronize(s1), "cudaStreamSynchronize");
        ck(cudaStreamSynchronize(s2), "cudaStreamSynchronize");
        const std::int64_t a = now_ns();
        ck(cudaMemcpyAsync(hA, dsrc, bytes, cudaMemcpyDeviceToHost, s1), "cudaMemcpyAsync D2H");
        ck(cudaMemcpyAsync(ddst, hB, bytes, cudaMemcpyHostToDevice, s2), "cudaMemcpyAsync H2D");
        ck(cudaStreamSynchronize(s1), "cudaStreamSynchronize");
        const std::int64_t b1 = now_ns();
        ck(cudaStreamSynchronize(s2), "cudaStreamSynchronize");
        const std::int64_t b2 = now_ns();
        if (i > 0) {
          const double ms1 = static_cast<double>(b1 - a) * 1e-6, ms2 = static_cast<double>(b2 - a) * 1e-6;
          bd.push_back(gb(ms1));
          bh.push_back(gb(ms2));
          both.push_back(gb(std::max(ms1, ms2)));
        }
      }
    }
    // The H2D split in halves over two streams: alone, then against the D2H.
    if (pdev == cdev) {
      const std::uint64_t half = (bytes / 2 + 4095) & ~std::uint64_t{4095};
      auto h2d_split = [&] {
        ck(cudaStreamWaitEvent(s2, e0, 0), "cudaStreamWaitEvent");
        ck(cudaStreamWaitEvent(s3, e0, 0), "cudaStreamWaitEvent");
        ck(cudaMemcpyAsync(ddst, hB, half, cudaMemcpyHostToDevice, s2), "cudaMemcpyAsync H2D");
        ck(cudaMemcpyAsync(static_cast<std::byte*>(ddst) + half, hB + half, bytes - half, cudaMemcpyHostToDevice, s3),
           "cudaMemcpyAsync H2D");
        ck(cudaEventRecord(e3, s3), "cudaEventRecord");
        ck(cudaStreamWaitEvent(s2, e3, 0), "cudaStreamWaitEvent");
        ck(cudaEventRecord(e2, s2), "cudaEventRecord");
      };
      std::vector<double> h2, b2, b2d, b2h;
      for (int i = 0; i <= reps; ++i) {
        float m = 0;
        ck(cudaEventRecord(e0, s1), "cudaEventRecord");
        h2d_split();
        ck(cudaEventSynchronize(e2), "cudaEventSynchronize");
        ck(cudaEventElapsedTime(&m, e0, e2), "cudaEventElapsedTime");
        if (i > 0) h2.push_back(gb(m));
      }
      for (int i = 0; i <= reps; ++i) {
        float m1 = 0, m2 = 0;
        ck(cudaEventRecord(e0, s1), "cudaEventRecord");
        ck(cudaMemcpyAsync(hA, dsrc, bytes, cudaMemcpyDeviceToHost, s1), "cudaMemcpyAsync D2H");
        ck(cudaEventRecord(e1, s1), "cudaEventRecord");
        h2d_split();
        ck(cudaEventSynchronize(e1), "cudaEventSynchronize");
        ck(cudaEventSynchronize(e2), "cudaEventSynchronize");
        ck(cudaEventElapsedTime(&m1, e0, e1), "cudaEventElapsedTime");
        ck(cudaEventElapsedTime(&m2, e0, e2), "cudaEventElapsedTime");
        if (i > 0) {
          b2d.push_back(gb(m1));
          b2h.push_back(gb(m2));
          b2.push_back(gb(std::max(m1, m2)));
        }
      }
      out.h2d2 = stat_of(h2);
      out.both2 = stat_of(b2);
      out.both2_d2h = stat_of(b2d);
      out.both2_h2d = stat_of(b2h);
    }
    out.d2h = stat_of(d2h);
    out.h2d = stat_of(h2d);
    out.both = stat_of(both);
    out.both_d2h = stat_of(bd);
    out.both_h2d = stat_of(bh);
    out.ok = true;
  } catch (const std::exception& e) {
    out.error = e.what();
  }
  if (e0) cudaEventDestroy(e0);
  if (e1) cudaEventDestroy(e1);
  if (e2) cudaEventDestroy(e2);
  if (e3) cudaEventDestroy(e3);
  if (s3) cudaStreamDestroy(s3);
  if (s1) cudaStreamDestroy(s1);
  if (s2) cudaStreamDestroy(s2);
  if (dsrc) cudaFree(dsrc);
  if (ddst) cudaFree(ddst);
  if (registered) cudaHostUnregister(host);
  if (host) ::munmap(host, 2 * bytes);
  (void)cudaGetLastError();
  return out;
}

}  // namespace bench
