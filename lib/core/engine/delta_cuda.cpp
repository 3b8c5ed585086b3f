// The CUDA delta codec's host side (built with SHMCAST_WITH_CUDA); see
// delta_cuda.hpp. Plain C++ against the driver API that cuda_driver.cpp
// loads at run time. The kernels are kDeltaPtx (kernels/delta.cu compiled to
// PTX at build time), loaded once per context with cuModuleLoadDataEx and
// kept for the life of the process, like the primary contexts they live in.
#include "engine/delta_cuda.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/cuda_driver.hpp"
#include "protocol/delta.hpp"
#include "protocol/delta_launch.hpp"
#include "engine/engine.hpp"
#include "shmcast/shmcast.hpp"

namespace shmcast::detail::delta {

extern const unsigned char kDeltaPtx[];
extern const std::size_t kDeltaPtxBytes;

namespace {

constexpr const char* kNoKernels =
    "this shmcast was built without the CUDA delta kernels (nvcc was not found at build time): rebuild with the CUDA "
    "toolkit's nvcc on PATH or CUDAToolkit_ROOT set (-DSHMCAST_DELTA_KERNELS=ON makes its absence an error), or use "
    "the host codec";

[[noreturn]] void bad_arg(const std::string& why) { throw Error(Errc::kInvalidArgument, "CUDA delta codec: " + why); }

[[noreturn]] void cuda_fail(const cu::Api& d, CUresult e, const std::string& what) {
  throw Error(Errc::kCuda, "CUDA delta codec: " + what + " failed: " + cu::error_text(d, e) +
                               (e == CUDA_ERROR_ILLEGAL_ADDRESS || e == CUDA_ERROR_LAUNCH_FAILED
                                    ? "; a kernel touched memory it should not: check the sizes and pointers passed "
                                      "(the CUDA context is unusable now: restart the process)"
                                    : ""));
}

#define SHMCAST_DCK(d, call, what)                        \
  do {                                                    \
    const CUresult e_ = (call);                           \
    if (e_ != CUDA_SUCCESS) cuda_fail((d), e_, (what));   \
  } while (0)

const cu::Api& driver() {
  if (kDeltaPtxBytes == 0) throw Error(Errc::kCudaUnavailable, kNoKernels);
  std::string why;
  const cu::Api* d = cu::load(&why);
  if (d == nullptr) throw Error(Errc::kCudaUnavailable, "CUDA is unavailable: " + why);
  return *d;
}

CUdeviceptr dptr(const void* p) { return static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(p)); }
std::uint64_t addr(const void* p) { return static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(p)); }

bool is_default_stream(CUstream s) { return s == nullptr || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD; }

// The context work on `s` runs in: the stream's, or for a default stream
// the calling thread's current one.
CUcontext context_of(const cu::Api& d, CUstream s) {
  CUcontext c = nullptr;
  if (is_default_stream(s)) {
    if (d.cuCtxGetCurrent(&c) != CUDA_SUCCESS || c == nullptr)
      bad_arg("no CUDA context is current on this thread for the default stream: make the device current "
              "(cudaSetDevice, torch.cuda.set_device) or pass a stream");
    return c;
  }
  const CUresult e = d.cuStreamGetCtx(s, &c);
  if (e != CUDA_SUCCESS || c == nullptr) cuda_fail(d, e, "cuStreamGetCtx (is the stream a live CUDA stream?)");
  return c;
}

// Pushes `ctx` for the scope unless it is current already.
class CtxScope {
 public:
  CtxScope(const cu::Api& d, CUcontext ctx) : d_(d) {
    CUcontext cur = nullptr;
    if (d_.cuCtxGetCurrent(&cur) == CUDA_SUCCESS && cur == ctx) return;
    SHMCAST_DCK(d_, d_.cuCtxPushCurrent(ctx), "cuCtxPushCurrent");
    pushed_ = true;
  }
  ~CtxScope() {
    CUcontext popped = nullptr;
    if (pushed_) (void)d_.cuCtxPopCurrent(&popped);
  }
  CtxScope(const CtxScope&) = delete;
  CtxScope& operator=(const CtxScope&) = delete;

 private:
  const cu::Api& d_;
  bool pushed_ = false;
};

// The kernels of one context.
struct Module {
  CUfunction count[4], encode[4], validate[4], apply[4];
  CUfunction scan, checksum, finish, reset;
  CUfunction batch_reset, batch_validate, batch_apply, batch_checksum, batch_finish;
  CUfunction batch_count, batch_scan, batch_encode;
  CUfunction copy_pieces;
};

#if CUDA_VERSION >= 11010
constexpr CUresult kUnsupportedPtx = CUDA_ERROR_UNSUPPORTED_PTX_VERSION;
#else
constexpr CUresult kUnsupportedPtx = static_cast<CUresult>(222);  // CUDA_ERROR_UNSUPPORTED_PTX_VERSION, CUDA 11.1
#endif

int width_index(std::uint32_t w) { return w == 1 ? 0 : w == 2 ? 1 : w == 4 ? 2 : 3; }

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
  const CUresult e = d.cuModuleLoadDataEx(&m, kDeltaPtx, 2, opts, vals);
  if (e != CUDA_SUCCESS) {
    std::string msg = "CUDA delta codec: loading its kernels (cuModuleLoadDataEx of the built-in PTX) failed: " +
                      cu::error_text(d, e);
    if (e == kUnsupportedPtx)
      msg += "; the NVIDIA driver (CUDA " + cu::version_text(d.driver_version) +
             ") is older than the nvcc that built shmcast: update the driver, or rebuild shmcast with an older CUDA "
             "toolkit";
    if (log[0] != 0) msg += "; JIT log: " + std::string(log);
    throw Error(e == kUnsupportedPtx || e == CUDA_ERROR_NO_BINARY_FOR_GPU ? Errc::kCudaUnavailable
                                                                                           : Errc::kCuda,
                msg);
  }
  Module mod{};
  auto get = [&](CUfunction* f, const std::string& name) {
    SHMCAST_DCK(d, d.cuModuleGetFunction(f, m, name.c_str()), "cuModuleGetFunction(" + name + ")");
  };
  const char* widths[4] = {"w1", "w2", "w4", "w8"};
  for (int i = 0; i < 4; ++i) {
    get(&mod.count[i], std::string("shmcast_delta_count_") + widths[i]);
    get(&mod.encode[i], std::string("shmcast_delta_encode_") + widths[i]);
    get(&mod.validate[i], std::string("shmcast_delta_validate_") + widths[i]);
    get(&mod.apply[i], std::string("shmcast_delta_apply_") + widths[i]);
  }
  get(&mod.scan, "shmcast_delta_scan");
  get(&mod.checksum, "shmcast_delta_checksum");
  get(&mod.finish, "shmcast_delta_finish");
  get(&mod.reset, "shmcast_delta_reset");
  get(&mod.batch_reset, "shmcast_batch_reset");
  get(&mod.batch_validate, "shmcast_batch_validate");
  get(&mod.batch_apply, "shmcast_batch_apply");
  get(&mod.batch_checksum, "shmcast_batch_checksum");
  get(&mod.batch_finish, "shmcast_batch_finish");
  get(&mod.batch_count, "shmcast_batch_count");
  get(&mod.batch_scan, "shmcast_batch_scan");
  get(&mod.batch_encode, "shmcast_batch_encode");
  get(&mod.copy_pieces, "shmcast_copy_pieces");
  return mods->emplace(ctx, mod).first->second;
}

void require_width(std::uint32_t w) {
  if (!valid_width(w)) bad_arg("element width " + std::to_string(w) + " is not 1, 2, 4 or 8 bytes");
}

void require_aligned(const void* p, std::uint64_t a, const char* what) {
  if (addr(p) % a != 0)
    bad_arg(std::string(what) + " is not " + std::to_string(a) + "-byte aligned (use a tensor with its own storage, "
            "or the host codec)");
}

std::uint64_t tensor_bytes(std::uint32_t w, std::uint64_t n) {
  std::uint64_t bytes = 0;
  if (__builtin_mul_overflow(n, static_cast<std::uint64_t>(w), &bytes) || bytes > limits::kMaxStreamBytes)
    bad_arg(std::to_string(n) + " elements of " + std::to_string(w) + " bytes exceed the 64 TiB tensor limit");
  return bytes;
}

}  // namespace

bool cuda_codec_available(std::string* why) {
  if (kDeltaPtxBytes == 0) {
    if (why) *why = kNoKernels;
    return false;
  }
  return cuda_present(why);
}

bool copy_pieces_ready(std::string* why) {
  try {
    const cu::Api& d = driver();
    CUcontext ctx = nullptr;
    if (d.cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || ctx == nullptr) {
      if (why) *why = "no current CUDA context";
      return false;
    }
    (void)module_for(d, ctx);
    return true;
  } catch (const Error& e) {
    if (why) *why = e.what();
    return false;
  }
}

void launch_copy_pieces(const void* pieces, std::uint64_t n, void* stream) {
  if (n == 0) return;
  const cu::Api& d = driver();
  CUcontext ctx = nullptr;
  SHMCAST_DCK(d, d.cuCtxGetCurrent(&ctx), "cuCtxGetCurrent");
  const Module& m = module_for(d, ctx);
  CopyPiecesArgs args{addr(pieces), n};
  void* params[1] = {&args};
  const unsigned grid = static_cast<unsigned>(n < 65535 ? n : 65535);
  const CUresult e = d.cuLaunchKernel(m.copy_pieces, grid, 1, 1, 256, 1, 1, 0, static_cast<CUstream>(stream), params,
                                      nullptr);
  if (e != CUDA_SUCCESS) cuda_fail(d, e, "launching the copy_pieces kernel");
}

struct CudaCodec::Impl {
  const cu::Api* d = nullptr;
  CUcontext ctx = nullptr;
  const Module* mod = nullptr;
  CUdeviceptr scratch = 0;
  CUdeviceptr bufs[4] = {};
  std::uint64_t buf_bytes[4] = {};
  std::vector<CUdeviceptr> owned;  // alloc()
  std::vector<ApplyJob> batch;     // apply_batch()'s table, as last uploaded
  std::vector<PlanJob> plan_jobs;  // plan_batch()'s, as last uploaded
  CUdeviceptr plan_dev = 0;        // its copy on the device
  std::uint64_t plan_cap = 0;
  std::vector<EncodeJob> enc_jobs;  // encode_table()'s, as last uploaded
  CUdeviceptr enc_dev = 0;          // its copy on the device, uploaded on enc_stream
  std::uint64_t enc_cap = 0;
  CUstream enc_stream = nullptr;

  // Binds to the stream's context on first use; makes it current for the scope.
  struct Use {
    Impl& i;
    CUstream s;
    CtxScope scope;
    Use(Impl& impl, void* stream)
        : i(impl.bind(static_cast<CUstream>(stream))), s(static_cast<CUstream>(stream)), scope(*impl.d, impl.ctx) {
      if (i.mod == nullptr) {  // first use: the kernels, and the status words zeroed before anything runs
        const Module* m = &module_for(*i.d, i.ctx);
        if (i.scratch == 0)
          SHMCAST_DCK(*i.d, i.d->cuMemAlloc(&i.scratch, sizeof(Scratch)), "cuMemAlloc of 32 bytes");
        launch(m->reset, 1, 1, ResetArgs{i.scratch, 1}, "reset");  // (i.mod is not set yet)
        SHMCAST_DCK(*i.d, i.d->cuStreamSynchronize(s), "waiting for the stream (cuStreamSynchronize)");
        i.mod = m;
      }
    }
    template <class A>
    void launch(CUfunction f, unsigned grid, unsigned block, const A& args, const char* what) {
      void* params[1] = {const_cast<A*>(&args)};
      const CUresult e = i.d->cuLaunchKernel(f, grid, 1, 1, block, 1, 1, 0, s, params, nullptr);
      if (e != CUDA_SUCCESS) cuda_fail(*i.d, e, std::string("launching the ") + what + " kernel");
    }
    // The launcher of delta_launch.hpp.
    template <class A>
    void launch(Kernel k, std::uint32_t w, unsigned grid, unsigned block, const A& args) {
      const Module& m = *i.mod;
      const int wi = width_index(w);
      switch (k) {
        case Kernel::kCount: return launch(m.count[wi], grid, block, args, "count");
        case Kernel::kScan: return launch(m.scan, grid, block, args, "scan");
        case Kernel::kEncode: return launch(m.encode[wi], grid, block, args, "encode");
        case Kernel::kValidate: return launch(m.validate[wi], grid, block, args, "validate");
        case Kernel::kApply: return launch(m.apply[wi], grid, block, args, "apply");
        case Kernel::kChecksum: return launch(m.checksum, grid, block, args, "checksum");
        case Kernel::kFinish: return launch(m.finish, grid, block, args, "checksum finish");
        case Kernel::kReset: return launch(m.reset, grid, block, args, "reset");
        case Kernel::kBatchReset: return launch(m.batch_reset, grid, block, args, "batch reset");
        case Kernel::kBatchValidate: return launch(m.batch_validate, grid, block, args, "batch validate");
        case Kernel::kBatchApply: return launch(m.batch_apply, grid, block, args, "batch apply");
        case Kernel::kBatchChecksum: return launch(m.batch_checksum, grid, block, args, "batch checksum");
        case Kernel::kBatchFinish: return launch(m.batch_finish, grid, block, args, "batch finish");
        case Kernel::kBatchCount: return launch(m.batch_count, grid, block, args, "batch count");
        case Kernel::kBatchScan: return launch(m.batch_scan, grid, block, args, "batch scan");
        case Kernel::kBatchEncode: return launch(m.batch_encode, grid, block, args, "batch encode");
      }
    }
  };

  Impl& bind(CUstream s) {
    if (d == nullptr) d = &driver();
    const CUcontext c = context_of(*d, s);
    if (ctx == nullptr) {
      ctx = c;
    } else if (c != ctx) {
      bad_arg("a stream of another CUDA context than this codec's first one: use one codec per device");
    }
    return *this;
  }

  ~Impl() {
    if (scratch != 0 && d != nullptr) {
      CUcontext cur = nullptr;
      const bool push = d->cuCtxGetCurrent(&cur) != CUDA_SUCCESS || cur != ctx;
      if (push && d->cuCtxPushCurrent(ctx) != CUDA_SUCCESS) return;
      (void)d->cuMemFree(scratch);
      for (CUdeviceptr b : bufs)
        if (b != 0) (void)d->cuMemFree(b);
      for (CUdeviceptr b : owned) (void)d->cuMemFree(b);
      if (plan_dev != 0) (void)d->cuMemFree(plan_dev);
      if (enc_dev != 0) (void)d->cuMemFree(enc_dev);
      CUcontext popped = nullptr;
      if (push) (void)d->cuCtxPopCurrent(&popped);
    }
  }
};

CudaCodec::CudaCodec() : impl_(std::make_unique<Impl>()) {}
CudaCodec::~CudaCodec() = default;

void CudaCodec::plan(const void* base, const void* next, std::uint32_t w, std::uint64_t n, void* head,
                     void* stream) {
  require_width(w);
  tensor_bytes(w, n);
  require_aligned(base, 8, "base");
  require_aligned(next, 8, "next");
  require_aligned(head, 8, "head");
  Impl::Use u(*impl_, stream);
  launch_plan(u, addr(base), addr(next), w, n, addr(head));
}

void CudaCodec::plan_batch(const std::vector<PlanItem>& items, void* stream) {
  if (items.empty()) return;
  for (const PlanItem& it : items) {  // every check plan() makes, before anything is queued
    require_width(it.w);
    tensor_bytes(it.w, it.n);
    require_aligned(it.base, 8, "base");
    require_aligned(it.next, 8, "next");
    require_aligned(it.head, 8, "head");
  }
  Impl::Use u(*impl_, stream);
  Impl& m = u.i;
  const std::uint64_t njobs = items.size(), bytes = njobs * sizeof(PlanJob);
  if (bytes > m.plan_cap) {
    if (m.plan_dev != 0) {  // a queued launch may still read the old table
      SHMCAST_DCK(*m.d, m.d->cuStreamSynchronize(u.s), "waiting for the stream (cuStreamSynchronize)");
      (void)m.d->cuMemFree(m.plan_dev);
      m.plan_dev = 0;
      m.plan_cap = 0;
    }
    const std::uint64_t cap = bytes + bytes / 4;
    SHMCAST_DCK(*m.d, m.d->cuMemAlloc(&m.plan_dev, cap), "cuMemAlloc of the plan table");
    m.plan_cap = cap;
  }
  std::vector<PlanJob>& jobs = m.plan_jobs;  // pageable: the upload reads it before it returns
  jobs.assign(njobs, PlanJob{});
  for (std::uint64_t k = 0; k < njobs; ++k) {
    const PlanItem& it = items[k];
    jobs[k] = PlanJob{addr(it.base), addr(it.next), addr(it.head), it.n, block_count(it.n), 0, it.w, 0};
  }
  const std::uint64_t units = number_plan_jobs(jobs.data(), njobs);
  SHMCAST_DCK(*m.d, m.d->cuMemcpyHtoDAsync(m.plan_dev, jobs.data(), bytes, u.s), "cuMemcpyHtoDAsync of the plan table");
  launch_plan_batch(u, m.plan_dev, njobs, units);
}

void CudaCodec::encode(void* base, const void* next, std::uint32_t w, std::uint64_t n, const void* head, void* out,
                       std::uint64_t out_bytes, void* stream) {
  require_width(w);
  tensor_bytes(w, n);
  require_aligned(base, 8, "base");
  require_aligned(next, 8, "next");
  require_aligned(head, 8, "head");
  require_aligned(out, 8, "out");
  const std::uint64_t blocks = block_count(n);
  if (out_bytes < head_bytes_for(blocks))
    bad_arg("the output holds " + std::to_string(out_bytes) + " bytes, less than the blob's header and table (" +
            std::to_string(head_bytes_for(blocks)) + ")");
  Impl::Use u(*impl_, stream);
  launch_encode(u, addr(base), addr(next), w, n, addr(head), addr(out), out_bytes, u.i.scratch);
}

void CudaCodec::encode_table(const std::vector<EncodeItem>& items, void* stream) {
  for (const EncodeItem& it : items) {  // every check encode() makes, before anything is queued
    require_width(it.w);
    tensor_bytes(it.w, it.n);
    require_aligned(it.base, 8, "base");
    require_aligned(it.next, 8, "next");
    require_aligned(it.head, 8, "head");
    require_aligned(it.out, 8, "out");
    const std::uint64_t hb = head_bytes_for(block_count(it.n));
    if (it.out_bytes < hb)
      bad_arg("the output holds " + std::to_string(it.out_bytes) + " bytes, less than the blob's header and table (" +
              std::to_string(hb) + ")");
  }
  Impl::Use u(*impl_, stream);
  Impl& m = u.i;
  // A launch queued on another stream may still read the old table.
  if (m.enc_dev != 0 && m.enc_stream != u.s && !m.enc_jobs.empty())
    SHMCAST_DCK(*m.d, m.d->cuStreamSynchronize(m.enc_stream), "waiting for the stream (cuStreamSynchronize)");
  m.enc_jobs.clear();
  m.enc_stream = u.s;
  const std::uint64_t njobs = items.size(), bytes = njobs * sizeof(EncodeJob);
  if (njobs == 0) return;
  if (bytes > m.enc_cap) {
    if (m.enc_dev != 0) {  // a queued launch may still read the old table
      SHMCAST_DCK(*m.d, m.d->cuStreamSynchronize(u.s), "waiting for the stream (cuStreamSynchronize)");
      (void)m.d->cuMemFree(m.enc_dev);
      m.enc_dev = 0;
      m.enc_cap = 0;
    }
    const std::uint64_t cap = bytes + bytes / 4;
    SHMCAST_DCK(*m.d, m.d->cuMemAlloc(&m.enc_dev, cap), "cuMemAlloc of the encode table");
    m.enc_cap = cap;
  }
  std::vector<EncodeJob> jobs(njobs);
  for (std::uint64_t k = 0; k < njobs; ++k) {
    const EncodeItem& it = items[k];
    jobs[k] = EncodeJob{addr(it.base), addr(it.next), addr(it.head), addr(it.out), it.out_bytes, it.n,
                        block_count(it.n), 0, it.pad, it.w, 0};
  }
  (void)number_encode_jobs(jobs.data(), njobs);
  // From pageable memory: the upload has read the table when it returns.
  SHMCAST_DCK(*m.d, m.d->cuMemcpyHtoDAsync(m.enc_dev, jobs.data(), bytes, u.s),
              "cuMemcpyHtoDAsync of the encode table");
  m.enc_jobs = std::move(jobs);
}

void CudaCodec::encode_range(std::size_t first, std::size_t last, void* stream) {
  Impl::Use u(*impl_, stream);
  Impl& m = u.i;
  if (first > last || last > m.enc_jobs.size())
    bad_arg("encode_range [" + std::to_string(first) + ", " + std::to_string(last) + ") is not within the " +
            std::to_string(m.enc_jobs.size()) + " items of the last encode_table()");
  if (first == last) return;
  if (u.s != m.enc_stream) bad_arg("encode_range() on another stream than its encode_table()");
  launch_encode_batch(u, m.enc_dev, m.enc_jobs.data(), first, last, u.i.scratch);
}

void CudaCodec::apply(const void* blob, std::uint64_t blob_bytes, std::uint32_t w, const SliceMap& map, void* dst,
                      std::uint64_t dst_bytes, bool verify, void* stream) {
  require_width(w);
  const std::uint64_t want = tensor_bytes(w, map.dst_elems);
  tensor_bytes(w, map.n);
  if (dst_bytes != want)
    bad_arg("the destination holds " + std::to_string(dst_bytes) + " bytes, the selection " + std::to_string(want));
  if (verify && !holds_piece(map))
    bad_arg("a result can be verified only where the selection holds the whole piece");
  if (verify && !covers_piece(map)) {  // strided: the batch's checksum reads the piece through its map
    apply_batch({ApplyItem{blob, blob_bytes, w, map, dst, dst_bytes, true}}, stream);
    return;
  }
  require_aligned(blob, 8, "blob");
  require_aligned(dst, w, "dst");
  const std::uint64_t blocks = block_count(map.n);
  if (blob_bytes < head_bytes_for(blocks))
    throw Error(Errc::kCorrupt, "delta blob rejected: " + std::to_string(blob_bytes) +
                                    " bytes cannot hold the header and table of " + std::to_string(map.n) +
                                    " elements (the delta is damaged or not one for this tensor: ask the producer "
                                    "for a full sync)");
  Impl::Use u(*impl_, stream);
  launch_apply(u, addr(blob), blob_bytes, w, map, addr(dst), verify, u.i.scratch);
}

void CudaCodec::apply_batch(const std::vector<ApplyItem>& items, void* stream) {
  if (items.empty()) return;
  // Every check apply() makes, before anything is queued.
  for (const ApplyItem& it : items) {
    require_width(it.w);
    const std::uint64_t want = tensor_bytes(it.w, it.map.dst_elems);
    tensor_bytes(it.w, it.map.n);
    if (it.dst_bytes != want)
      bad_arg("the destination holds " + std::to_string(it.dst_bytes) + " bytes, the selection " +
              std::to_string(want));
    if (it.verify && !holds_piece(it.map))
      bad_arg("a result can be verified only where the selection holds the whole piece");
    require_aligned(it.blob, 8, "blob");
    require_aligned(it.dst, it.w, "dst");
    if (it.blob_bytes < head_bytes_for(block_count(it.map.n)))
      throw Error(Errc::kCorrupt, "delta blob rejected: " + std::to_string(it.blob_bytes) +
                                      " bytes cannot hold the header and table of " + std::to_string(it.map.n) +
                                      " elements (the delta is damaged or not one for this tensor: ask the producer "
                                      "for a full sync)");
  }
  Impl::Use u(*impl_, stream);
  const std::uint64_t njobs = items.size();
  const std::uint64_t table = (njobs * sizeof(ApplyJob) + 255) & ~std::uint64_t{255};
  auto* dev = static_cast<std::byte*>(buffer(2, table + njobs * sizeof(Scratch), stream));
  const std::uint64_t scratch0 = addr(dev + table);
  std::vector<ApplyJob>& jobs = u.i.batch;  // kept: the upload below reads it (pageable: before it returns)
  jobs.assign(njobs, ApplyJob{});
  for (std::uint64_t k = 0; k < njobs; ++k) {
    const ApplyItem& it = items[k];
    ApplyJob& j = jobs[k];
    j.blob = addr(it.blob);
    j.blob_bytes = it.blob_bytes;
    j.n = it.map.n;
    j.blocks = block_count(it.map.n);
    j.dst = addr(it.dst);
    j.scratch = scratch0 + k * sizeof(Scratch);
    j.w = it.w;
    j.verify = it.verify ? 1 : 0;
    j.map = it.map;
  }
  std::uint64_t units = 0, sum_units = 0;
  number_jobs(jobs.data(), njobs, &units, &sum_units);
  SHMCAST_DCK(*u.i.d, u.i.d->cuMemcpyHtoDAsync(addr(dev), jobs.data(), njobs * sizeof(ApplyJob), u.s),
              "cuMemcpyHtoDAsync of the apply table");
  launch_apply_batch(u, addr(dev), njobs, units, sum_units, u.i.scratch);
}

void CudaCodec::checksum(const void* data, std::uint64_t bytes, void* out, void* stream) {
  require_aligned(out, 8, "out");
  Impl::Use u(*impl_, stream);
  launch_checksum(u, addr(data), bytes, addr(out), 0, u.i.scratch, true);
}

void CudaCodec::finish(void* stream) {
  Impl::Use u(*impl_, stream);
  Scratch sc{};
  SHMCAST_DCK(*u.i.d, u.i.d->cuMemcpyDtoHAsync(&sc, u.i.scratch, sizeof sc, u.s), "cuMemcpyDtoHAsync of the status");
  launch_reset(u, u.i.scratch, true);
  SHMCAST_DCK(*u.i.d, u.i.d->cuStreamSynchronize(u.s), "waiting for the stream (cuStreamSynchronize)");
  throw_for_status(sc.status);
}

Header CudaCodec::read_header(const void* head, void* stream) {
  require_aligned(head, 8, "head");
  Impl::Use u(*impl_, stream);
  Header h{};
  SHMCAST_DCK(*u.i.d, u.i.d->cuMemcpyDtoHAsync(&h, dptr(head), sizeof h, u.s), "cuMemcpyDtoHAsync of the header");
  SHMCAST_DCK(*u.i.d, u.i.d->cuStreamSynchronize(u.s), "waiting for the stream (cuStreamSynchronize)");
  return h;
}

void* CudaCodec::buffer(int i, std::uint64_t bytes, void* stream) {
  if (i < 0 || i >= 4) bad_arg("codec buffer " + std::to_string(i) + " is not 0..3");
  Impl::Use u(*impl_, stream);
  Impl& m = u.i;
  if (m.bufs[i] != 0 && m.buf_bytes[i] >= bytes) return reinterpret_cast<void*>(static_cast<std::uintptr_t>(m.bufs[i]));
  if (m.bufs[i] != 0) {
    SHMCAST_DCK(*m.d, m.d->cuStreamSynchronize(u.s), "waiting for the stream (cuStreamSynchronize)");
    (void)m.d->cuMemFree(m.bufs[i]);
    m.bufs[i] = 0;
    m.buf_bytes[i] = 0;
  }
  const std::uint64_t want = bytes < 256 ? 256 : bytes + bytes / 8;  // some room to grow into
  const CUresult e = m.d->cuMemAlloc(&m.bufs[i], want);
  if (e != CUDA_SUCCESS)
    throw Error(Errc::kCuda, "cuMemAlloc of " + std::to_string(want) + " bytes for the delta codec failed: " +
                                 cu::error_text(*m.d, e) + " (free GPU memory, or turn deltas off)");
  m.buf_bytes[i] = want;
  return reinterpret_cast<void*>(static_cast<std::uintptr_t>(m.bufs[i]));
}

void* CudaCodec::alloc(std::uint64_t bytes, void* stream) {
  Impl::Use u(*impl_, stream);
  Impl& m = u.i;
  CUdeviceptr p = 0;
  const CUresult e = m.d->cuMemAlloc(&p, bytes < 256 ? 256 : bytes);
  if (e != CUDA_SUCCESS)
    throw Error(Errc::kCuda, "cuMemAlloc of " + std::to_string(bytes) + " bytes for a delta base failed: " +
                                 cu::error_text(*m.d, e) + " (a delta producer keeps a copy of each tensor it sends "
                                 "from a GPU on that GPU: free GPU memory, or turn deltas off)");
  m.owned.push_back(p);
  return reinterpret_cast<void*>(static_cast<std::uintptr_t>(p));
}

void CudaCodec::release(void* p) noexcept {
  if (p == nullptr || !impl_ || impl_->d == nullptr) return;
  Impl& m = *impl_;
  const CUdeviceptr d = dptr(p);
  const auto it = std::find(m.owned.begin(), m.owned.end(), d);
  if (it == m.owned.end()) return;
  m.owned.erase(it);
  CUcontext cur = nullptr;
  const bool push = m.d->cuCtxGetCurrent(&cur) != CUDA_SUCCESS || cur != m.ctx;
  if (push && m.d->cuCtxPushCurrent(m.ctx) != CUDA_SUCCESS) return;
  (void)m.d->cuMemFree(d);
  CUcontext popped = nullptr;
  if (push) (void)m.d->cuCtxPopCurrent(&popped);
}

void CudaCodec::upload(void* dev, const void* host, std::uint64_t bytes, void* stream) {
  if (bytes == 0) return;
  Impl::Use u(*impl_, stream);
  SHMCAST_DCK(*u.i.d, u.i.d->cuMemcpyHtoDAsync(dptr(dev), host, bytes, u.s), "cuMemcpyHtoDAsync");
}

void CudaCodec::download(void* host, const void* dev, std::uint64_t bytes, void* stream) {
  if (bytes == 0) return;
  Impl::Use u(*impl_, stream);
  SHMCAST_DCK(*u.i.d, u.i.d->cuMemcpyDtoHAsync(host, dptr(dev), bytes, u.s), "cuMemcpyDtoHAsync");
}

void CudaCodec::copy(void* dev_dst, const void* dev_src, std::uint64_t bytes, void* stream) {
  if (bytes == 0) return;
  Impl::Use u(*impl_, stream);
  SHMCAST_DCK(*u.i.d, u.i.d->cuMemcpyDtoDAsync(dptr(dev_dst), dptr(dev_src), bytes, u.s), "cuMemcpyDtoDAsync");
}

void CudaCodec::wait(void* stream) {
  Impl::Use u(*impl_, stream);
  SHMCAST_DCK(*u.i.d, u.i.d->cuStreamSynchronize(u.s), "waiting for the stream (cuStreamSynchronize)");
}

}  // namespace shmcast::detail::delta
