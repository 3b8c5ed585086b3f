// engine/ (layer 5): quantize-on-send on CUDA devices (fp8_cuda.hpp): loads
// kFp8Ptx (kernels/fp8.cu compiled to PTX at build time) once per context
// with cuModuleLoadDataEx through the dlopened driver, and launches its two
// kernels on the caller's stream.
#include "engine/fp8_cuda.hpp"

#include <cuda.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine/cuda_driver.hpp"
#include "engine/engine.hpp"
#include "shmcast/shmcast.hpp"

namespace shmcast::detail::quant {

extern const unsigned char kFp8Ptx[];
extern const std::size_t kFp8PtxBytes;

namespace {

constexpr const char* kNoKernels =
    "this shmcast was built with CUDA but without nvcc, so it has no FP8 quantize kernels: rebuild with nvcc on "
    "PATH (or CUDAToolkit_ROOT set), or send the tensors from host memory";
constexpr unsigned kThreads = 256;

[[noreturn]] void fail(const cu::Api& d, CUresult e, const std::string& what) {
  throw Error(Errc::kCuda, "CUDA FP8 quantize: " + what + " failed: " + cu::error_text(d, e));
}
#define SHMCAST_QCK(d, call, what)                  \
  do {                                              \
    const CUresult e_ = (call);                     \
    if (e_ != CUDA_SUCCESS) fail((d), e_, (what));  \
  } while (0)

const cu::Api& driver() {
  if (kFp8PtxBytes == 0) throw Error(Errc::kCudaUnavailable, kNoKernels);
  std::string why;
  const cu::Api* d = cu::load(&why);
  if (d == nullptr) throw Error(Errc::kCudaUnavailable, "CUDA is unavailable: " + why);
  return *d;
}

CUdeviceptr dptr(const void* p) { return static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(p)); }

struct Module {
  CUfunction scales = nullptr, quantize = nullptr;
};

// Where block `i` (row-major, bcols a row) of `m` is, for the NaN message.
std::string bad_block(const Matrix& m, std::int64_t bcols, std::uint64_t i) {
  const std::int64_t br = static_cast<std::int64_t>(i / static_cast<std::uint64_t>(bcols)),
                     bc = static_cast<std::int64_t>(i % static_cast<std::uint64_t>(bcols));
  return "NaN or Inf in the block at rows [" + std::to_string(br * quantize::kBlock) + ", " +
         std::to_string(std::min(m.rows, (br + 1) * quantize::kBlock)) + "), columns [" +
         std::to_string(bc * quantize::kBlock) + ", " + std::to_string(std::min(m.cols, (bc + 1) * quantize::kBlock)) +
         ")";
}

// Loads the PTX into `ctx` (current) once per process; never unloaded.
const Module& module_for(const cu::Api& d, CUcontext ctx) {
  static std::mutex* const mu = new std::mutex;  // leaked: used until exit
  static auto* const mods = new std::unordered_map<CUcontext, Module>;
  std::lock_guard<std::mutex> lock(*mu);
  const auto it = mods->find(ctx);
  if (it != mods->end()) return it->second;
  char log[4096] = {0};
  CUjit_option opts[2] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
  void* vals[2] = {log, reinterpret_cast<void*>(static_cast<std::uintptr_t>(sizeof log - 1))};
  CUmodule m = nullptr;
  const CUresult e = d.cuModuleLoadDataEx(&m, kFp8Ptx, 2, opts, vals);
  if (e != CUDA_SUCCESS)
    throw Error(Errc::kCudaUnavailable, "CUDA FP8 quantize: loading its kernels (cuModuleLoadDataEx of the built-in "
                                        "PTX) failed: " + cu::error_text(d, e) +
                                            "; the driver may be older than the nvcc that built shmcast" +
                                            (log[0] != 0 ? "; JIT log: " + std::string(log) : std::string()));
  Module mod;
  SHMCAST_QCK(d, d.cuModuleGetFunction(&mod.scales, m, "shmcast_fp8_block_scales"), "cuModuleGetFunction");
  SHMCAST_QCK(d, d.cuModuleGetFunction(&mod.quantize, m, "shmcast_fp8_quantize"), "cuModuleGetFunction");
  return mods->emplace(ctx, mod).first->second;
}

}  // namespace

bool cuda_quantize_available(std::string* why) {
  if (kFp8PtxBytes == 0) {
    if (why) *why = kNoKernels;
    return false;
  }
  return cuda_present(why);
}

struct CudaQuantizer::Impl {
  const cu::Api* d = nullptr;
  CUcontext ctx = nullptr;
  const Module* mod = nullptr;
  CUdeviceptr scale_inv = 0, bad = 0, stage = 0;
  std::uint64_t scale_room = 0, stage_room = 0;
  // The multipliers: every scales() call's in a room of its own until
  // reset() (fp8_cuda.hpp). Blocks are only added during a sync (kernels
  // may read the earlier ones); reset() makes one of their total size.
  std::vector<std::pair<CUdeviceptr, std::uint64_t>> arena;
  std::uint64_t arena_used = 0;  // in arena.back()
  CUdeviceptr mult = 0;          // the last scales() call's
  std::int64_t bcols = 0;

  CUdeviceptr take(std::uint64_t bytes) {
    bytes = (bytes + 255) & ~std::uint64_t{255};
    if (arena.empty() || arena.back().second - arena_used < bytes) {
      const std::uint64_t want = std::max<std::uint64_t>({bytes, 1ull << 20, arena.empty() ? 0 : 2 * arena.back().second});
      CUdeviceptr p = 0;
      SHMCAST_QCK(*d, d->cuMemAlloc(&p, want), "cuMemAlloc(" + std::to_string(want) + " bytes)");
      arena.emplace_back(p, want);
      arena_used = 0;
    }
    const CUdeviceptr p = arena.back().first + arena_used;
    arena_used += bytes;
    return p;
  }
  void reset() {
    arena_used = 0;
    mult = 0;
    if (arena.size() <= 1) return;
    std::uint64_t total = 0;
    for (const auto& [p, n] : arena) {
      total += n;
      (void)d->cuMemFree(p);
    }
    arena.clear();
    CUdeviceptr p = 0;
    SHMCAST_QCK(*d, d->cuMemAlloc(&p, total), "cuMemAlloc(" + std::to_string(total) + " bytes)");
    arena.emplace_back(p, total);
  }

  // Binds to the stream's context on first use; every later call must use
  // a stream of the same context.
  void bind(void* stream) {
    if (d == nullptr) d = &driver();
    CUcontext c = nullptr;
    if (stream != nullptr)
      SHMCAST_QCK(*d, d->cuStreamGetCtx(static_cast<CUstream>(stream), &c), "cuStreamGetCtx");
    else
      SHMCAST_QCK(*d, d->cuCtxGetCurrent(&c), "cuCtxGetCurrent");
    if (c == nullptr) throw Error(Errc::kCuda, "CUDA FP8 quantize: no CUDA context for the stream");
    if (ctx == nullptr) {
      ctx = c;
      cu::CtxScope scope(*d, ctx);
      mod = &module_for(*d, ctx);
      SHMCAST_QCK(*d, d->cuMemAlloc(&bad, 8), "cuMemAlloc");
    } else if (c != ctx) {
      throw Error(Errc::kInvalidArgument, "CUDA FP8 quantize: a stream of another context than the first one's");
    }
  }
  void grow(CUdeviceptr* p, std::uint64_t* room, std::uint64_t bytes) {
    if (bytes <= *room) return;
    if (*p != 0) (void)d->cuMemFree(*p);
    *p = 0;
    *room = 0;
    SHMCAST_QCK(*d, d->cuMemAlloc(p, bytes), "cuMemAlloc(" + std::to_string(bytes) + " bytes)");
    *room = bytes;
  }
  ~Impl() {
    if (d == nullptr || ctx == nullptr) return;
    try {
      cu::CtxScope scope(*d, ctx);
      for (CUdeviceptr p : {scale_inv, bad, stage})
        if (p != 0) (void)d->cuMemFree(p);
      for (const auto& [p, n] : arena) (void)d->cuMemFree(p);
    } catch (...) {
    }
  }
};

CudaQuantizer::CudaQuantizer() : impl_(std::make_unique<Impl>()) {}
CudaQuantizer::~CudaQuantizer() = default;

std::string CudaQuantizer::scales(const Matrix& m, Quantize q, void* stream, Scales* out) {
  Impl& s = *impl_;
  s.bind(stream);
  const cu::Api& d = *s.d;
  cu::CtxScope scope(d, s.ctx);
  out->brows = blocks(m.rows);
  out->bcols = blocks(m.cols);
  const std::uint64_t nb = static_cast<std::uint64_t>(out->brows) * static_cast<std::uint64_t>(out->bcols);
  out->scale_inv.assign(nb, 0.0f);
  out->mult.assign(nb, 0.0f);
  s.bcols = out->bcols;
  if (nb == 0) return {};
  if (out->brows > 65535)
    throw Error(Errc::kUnsupported, "CUDA FP8 quantize: more than 65535 row blocks (8 M rows); send it from host memory");
  s.grow(&s.scale_inv, &s.scale_room, nb * 4);
  s.mult = s.take(nb * 4);
  CUstream st = static_cast<CUstream>(stream);
  static const unsigned long long kNone = ~0ull;  // outlives the copy
  SHMCAST_QCK(d, d.cuMemcpyHtoDAsync(s.bad, &kNone, 8, st), "cuMemcpyHtoDAsync");
  CUdeviceptr src = dptr(m.base), si = s.scale_inv, mu = s.mult, bad = s.bad;
  int dtype = static_cast<int>(m.dtype), ue8m0 = q == Quantize::kFp8Block128Ue8m0 ? 1 : 0;
  long long rows = m.rows, cols = m.cols;
  unsigned long long pitch = m.pitch;
  void* params[] = {&src, &dtype, &rows, &cols, &pitch, &ue8m0, &si, &mu, &bad};
  SHMCAST_QCK(d,
              d.cuLaunchKernel(s.mod->scales, static_cast<unsigned>(out->bcols), static_cast<unsigned>(out->brows), 1,
                               kThreads, 1, 1, 0, st, params, nullptr),
              "launching the block-scales kernel");
  unsigned long long first_bad = 0;
  SHMCAST_QCK(d, d.cuMemcpyDtoHAsync(out->scale_inv.data(), s.scale_inv, nb * 4, st), "cuMemcpyDtoHAsync");
  SHMCAST_QCK(d, d.cuMemcpyDtoHAsync(out->mult.data(), s.mult, nb * 4, st), "cuMemcpyDtoHAsync");
  SHMCAST_QCK(d, d.cuMemcpyDtoHAsync(&first_bad, s.bad, 8, st), "cuMemcpyDtoHAsync");
  SHMCAST_QCK(d, d.cuStreamSynchronize(st), "cuStreamSynchronize");
  if (first_bad == kNone) return {};
  return bad_block(m, out->bcols, first_bad - 1);
}

std::string CudaQuantizer::scales_batch(const std::vector<const Matrix*>& ms, Quantize q, void* stream,
                                        DeviceScales* out, std::size_t* bad) {
  Impl& s = *impl_;
  s.bind(stream);
  const cu::Api& d = *s.d;
  cu::CtxScope scope(d, s.ctx);
  const std::size_t n = ms.size();
  out->host.assign(n, Scales{});
  out->mult.assign(n, 0);
  std::vector<std::uint64_t> at(n, 0);
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (ms[i] == nullptr) continue;
    Scales& h = out->host[i];
    h.brows = blocks(ms[i]->rows);
    h.bcols = blocks(ms[i]->cols);
    if (h.brows > 65535)
      throw Error(Errc::kUnsupported, "CUDA FP8 quantize: more than 65535 row blocks (8 M rows); send it from host memory");
    at[i] = total;
    total += static_cast<std::uint64_t>(h.brows) * static_cast<std::uint64_t>(h.bcols);
  }
  // Every tensor's scale_inv, then one flag each (the least bad block + 1).
  const std::uint64_t flags_at = (total * 4 + 7) & ~std::uint64_t{7};
  s.grow(&s.scale_inv, &s.scale_room, flags_at + 8 * n + 8);
  CUstream st = static_cast<CUstream>(stream);
  std::vector<unsigned long long> flags(n, ~0ull);
  if (n > 0) SHMCAST_QCK(d, d.cuMemcpyHtoDAsync(s.scale_inv + flags_at, flags.data(), 8 * n, st), "cuMemcpyHtoDAsync");
  int ue8m0 = q == Quantize::kFp8Block128Ue8m0 ? 1 : 0;
  for (std::size_t i = 0; i < n; ++i) {
    const Scales& h = out->host[i];
    const std::uint64_t nb = static_cast<std::uint64_t>(h.brows) * static_cast<std::uint64_t>(h.bcols);
    if (ms[i] == nullptr || nb == 0) continue;
    const Matrix& m = *ms[i];
    out->mult[i] = s.take(nb * 4);
    CUdeviceptr src = dptr(m.base), si = s.scale_inv + at[i] * 4, mu = out->mult[i], fl = s.scale_inv + flags_at + 8 * i;
    int dtype = static_cast<int>(m.dtype);
    long long rows = m.rows, cols = m.cols;
    unsigned long long pitch = m.pitch;
    void* params[] = {&src, &dtype, &rows, &cols, &pitch, &ue8m0, &si, &mu, &fl};
    SHMCAST_QCK(d,
                d.cuLaunchKernel(s.mod->scales, static_cast<unsigned>(h.bcols), static_cast<unsigned>(h.brows), 1,
                                 kThreads, 1, 1, 0, st, params, nullptr),
                "launching the block-scales kernel");
  }
  std::vector<float> si(total);
  if (total > 0) SHMCAST_QCK(d, d.cuMemcpyDtoHAsync(si.data(), s.scale_inv, total * 4, st), "cuMemcpyDtoHAsync");
  if (n > 0) SHMCAST_QCK(d, d.cuMemcpyDtoHAsync(flags.data(), s.scale_inv + flags_at, 8 * n, st), "cuMemcpyDtoHAsync");
  SHMCAST_QCK(d, d.cuStreamSynchronize(st), "cuStreamSynchronize");
  for (std::size_t i = 0; i < n; ++i) {
    Scales& h = out->host[i];
    const std::uint64_t nb = static_cast<std::uint64_t>(h.brows) * static_cast<std::uint64_t>(h.bcols);
    h.scale_inv.assign(si.begin() + static_cast<std::ptrdiff_t>(at[i]), si.begin() + static_cast<std::ptrdiff_t>(at[i] + nb));
  }
  for (std::size_t i = 0; i < n; ++i)
    if (ms[i] != nullptr && flags[i] != ~0ull) {
      *bad = i;
      return bad_block(*ms[i], out->host[i].bcols, flags[i] - 1);
    }
  return {};
}

namespace {

// The quantize kernel over elements [first, first + n) of `m` into `dst`,
// with the multipliers at `mult` (bcols a row): each thread makes 16
// bytes of output at a time (kernels/fp8.cu).
void launch_quantize(CudaQuantizer::Impl& s, const Matrix& m, CUdeviceptr mult, std::int64_t bcols_, std::byte* dst,
                     std::uint64_t first, std::uint64_t n, void* stream) {
  if (n == 0) return;
  s.bind(stream);
  const cu::Api& d = *s.d;
  cu::CtxScope scope(d, s.ctx);
  CUdeviceptr src = dptr(m.base), mu = mult, out = dptr(dst);
  int dtype = static_cast<int>(m.dtype);
  long long rows = m.rows, cols = m.cols, bcols = bcols_;
  unsigned long long pitch = m.pitch, f = first, count = n;
  void* params[] = {&src, &dtype, &rows, &cols, &pitch, &mu, &bcols, &out, &f, &count};
  const std::uint64_t groups = n / 16 + 2;  // the 16-byte groups, the head and the tail
  const std::uint64_t want = (groups + kThreads - 1) / kThreads;
  const unsigned grid = static_cast<unsigned>(std::min<std::uint64_t>(want, 8192));
  SHMCAST_QCK(d,
              d.cuLaunchKernel(s.mod->quantize, grid, 1, 1, kThreads, 1, 1, 0, static_cast<CUstream>(stream), params,
                               nullptr),
              "launching the quantize kernel");
}

}  // namespace

void CudaQuantizer::quantize(const Matrix& m, std::byte* dst, std::uint64_t first, std::uint64_t n, void* stream) {
  launch_quantize(*impl_, m, impl_->mult, impl_->bcols, dst, first, n, stream);
}

void CudaQuantizer::reset() {
  Impl& s = *impl_;
  if (s.ctx == nullptr) return;
  cu::CtxScope scope(*s.d, s.ctx);
  s.reset();
}

CudaQuantizer::Fill::Fill(CudaQuantizer& q, const Matrix& m)
    : q_(&q), m_(m), mult_(q.impl_->mult), bcols_(q.impl_->bcols) {
  if (q.impl_->ctx == nullptr) throw Error(Errc::kInvalidArgument, "CUDA FP8 quantize: a fill before scales()");
}

CudaQuantizer::Fill::Fill(CudaQuantizer& q, const Matrix& m, std::uint64_t mult, std::int64_t bcols)
    : q_(&q), m_(m), mult_(mult), bcols_(bcols) {
  if (q.impl_->ctx == nullptr) throw Error(Errc::kInvalidArgument, "CUDA FP8 quantize: a fill before scales_batch()");
}

void CudaQuantizer::Fill::launch(std::byte* dst, std::uint64_t first, std::uint64_t n, void* stream) const {
  launch_quantize(*q_->impl_, m_, static_cast<CUdeviceptr>(mult_), bcols_, dst, first, n, stream);
}

std::byte* CudaQuantizer::staging(std::uint64_t bytes) {
  Impl& s = *impl_;
  if (s.ctx == nullptr) throw Error(Errc::kInvalidArgument, "CUDA FP8 quantize: staging() before scales()");
  cu::CtxScope scope(*s.d, s.ctx);
  s.grow(&s.stage, &s.stage_room, bytes == 0 ? 1 : bytes);
  return reinterpret_cast<std::byte*>(static_cast<std::uintptr_t>(s.stage));
}

}  // namespace shmcast::detail::quant
