// Loads libcuda.so.1 at run time; see cuda_driver.hpp.
#include "engine/cuda_driver.hpp"

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "shmcast/shmcast.hpp"

namespace shmcast::detail::cu {

namespace {

#define SHMCAST_CU_STR2(x) #x
#define SHMCAST_CU_STR(x) SHMCAST_CU_STR2(x)  // the name after cuda.h's #defines

constexpr const char* kDefaultLibrary = "libcuda.so.1";
constexpr const char* kDriverHint =
    "is the NVIDIA driver installed and a GPU visible (nvidia-smi should list it; in a container, run it with --gpus "
    "or the NVIDIA container runtime)?";

struct State {
  Api api;
  const Api* ok = nullptr;
  std::string why;
};

template <class F>
bool resolve(void* handle, const char* symbol, F& out) {
  static_assert(sizeof(F) == sizeof(void*));
  ::dlerror();
  void* p = ::dlsym(handle, symbol);
  if (p == nullptr) return false;
  std::memcpy(&out, &p, sizeof p);
  return true;
}

void load_into(State& s) {
  const char* env = std::getenv("SHMCAST_LIBCUDA");
  const std::string lib = env != nullptr && *env != 0 ? env : kDefaultLibrary;
  Api& a = s.api;
  a.library = lib;
  // Never closed: the driver's threads run code from it until exit.
  void* h = ::dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) {
    const char* e = ::dlerror();
    s.why = "the NVIDIA driver's CUDA library " + lib + " could not be loaded (" + (e != nullptr ? e : "no reason") +
            "): " + kDriverHint;
    return;
  }
  if (!resolve(h, SHMCAST_CU_STR(cuDriverGetVersion), a.cuDriverGetVersion) ||
      !resolve(h, SHMCAST_CU_STR(cuInit), a.cuInit) ||
      !resolve(h, SHMCAST_CU_STR(cuGetErrorName), a.cuGetErrorName) ||
      !resolve(h, SHMCAST_CU_STR(cuGetErrorString), a.cuGetErrorString)) {
    s.why = lib + " is not a usable CUDA driver library (it lacks cuDriverGetVersion, cuInit or cuGetErrorName): " +
            kDriverHint;
    return;
  }
  int v = 0;
  CUresult r = a.cuDriverGetVersion(&v);
  if (r != CUDA_SUCCESS) {
    s.why = "cuDriverGetVersion failed: " + error_text(a, r) + "; " + kDriverHint;
    return;
  }
  a.driver_version = v;
  if (v < kMinDriverVersion) {
    s.why = "the NVIDIA driver is too old: it supports CUDA " + version_text(v) + ", shmcast needs CUDA " +
            version_text(kMinDriverVersion) + " or newer (update the NVIDIA driver)";
    return;
  }
  r = a.cuInit(0);
  if (r != CUDA_SUCCESS) {
    s.why = "no usable CUDA device: cuInit failed: " + error_text(a, r) + " (driver for CUDA " + version_text(v) +
            ", " + lib + ")";
    if (r == CUDA_ERROR_NO_DEVICE)
      s.why += "; check CUDA_VISIBLE_DEVICES, and in a container run it with --gpus or the NVIDIA container runtime";
    else
      s.why += std::string("; ") + kDriverHint + " Does nvidia-smi work (driver and kernel module of one version)?";
    return;
  }
  std::string missing;
  int n_missing = 0;
  auto note = [&](const char* name) {
    if (++n_missing <= 4) missing += std::string(missing.empty() ? "" : ", ") + name;
  };
#define SHMCAST_CU_RESOLVE(name) \
  if (a.name == nullptr && !resolve(h, SHMCAST_CU_STR(name), a.name)) note(SHMCAST_CU_STR(name));
  SHMCAST_CU_FUNCTIONS(SHMCAST_CU_RESOLVE)
#undef SHMCAST_CU_RESOLVE
  if (n_missing > 0) {
    if (n_missing > 4) missing += " and " + std::to_string(n_missing - 4) + " more";
    s.why = "the NVIDIA driver (CUDA " + version_text(v) + ", " + lib + ") lacks " + missing +
            ": it is too old or not a complete CUDA driver (update the NVIDIA driver)";
    return;
  }
#define SHMCAST_CU_RESOLVE_VMM(name)                                                              \
  if (a.name == nullptr && !resolve(h, SHMCAST_CU_STR(name), a.name))                              \
    a.vmm_missing += std::string(a.vmm_missing.empty() ? "" : ", ") + SHMCAST_CU_STR(name);
  SHMCAST_CU_VMM_FUNCTIONS(SHMCAST_CU_RESOLVE_VMM)
#undef SHMCAST_CU_RESOLVE_VMM
  s.ok = &a;
}

}  // namespace

const Api* load(std::string* why) {
  // Leaked on purpose: engines and CUDA callbacks may still use it while
  // static objects are destroyed at exit.
  static State* const state = [] {
    auto* s = new State;
    load_into(*s);
    return s;
  }();
  if (state->ok == nullptr && why != nullptr) *why = state->why;
  return state->ok;
}

std::string error_text(const Api& api, CUresult e) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (api.cuGetErrorName == nullptr || api.cuGetErrorName(e, &name) != CUDA_SUCCESS || name == nullptr)
    return "CUresult " + std::to_string(static_cast<int>(e));
  std::string out = name;
  if (api.cuGetErrorString != nullptr && api.cuGetErrorString(e, &text) == CUDA_SUCCESS && text != nullptr)
    out += std::string(" (") + text + ")";
  return out;
}

std::string version_text(int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); }

void check(const Api& api, CUresult e, const std::string& what, const char* todo) {
  if (e == CUDA_SUCCESS) return;
  std::string msg = "CUDA: " + what + " failed: " + error_text(api, e);
  if (todo != nullptr && *todo != 0) msg += std::string("; ") + todo;
  throw Error(Errc::kCuda, msg);
}

CUcontext primary_context(const Api& d, int dev) {
  static std::mutex* const mu = new std::mutex;  // leaked: used until exit
  static auto* const ctxs = new std::unordered_map<int, CUcontext>;
  std::lock_guard<std::mutex> lock(*mu);
  const auto it = ctxs->find(dev);
  if (it != ctxs->end()) return it->second;
  CUdevice h = 0;
  check(d, d.cuDeviceGet(&h, dev), "cuDeviceGet(" + std::to_string(dev) + ")");
  CUcontext c = nullptr;
  check(d, d.cuDevicePrimaryCtxRetain(&c, h), "cuDevicePrimaryCtxRetain (device " + std::to_string(dev) + ")",
        "is the GPU in exclusive-process mode and used by another process, or out of memory?");
  ctxs->emplace(dev, c);
  return c;
}

CtxScope::CtxScope(const Api& d, CUcontext ctx) : api_(d) {
  CUcontext cur = nullptr;
  if (api_.cuCtxGetCurrent(&cur) == CUDA_SUCCESS && cur == ctx) return;
  check(api_, api_.cuCtxPushCurrent(ctx), "cuCtxPushCurrent");
  pushed_ = true;
}

CtxScope::~CtxScope() {
  CUcontext popped = nullptr;
  if (pushed_) (void)api_.cuCtxPopCurrent(&popped);
}

}  // namespace shmcast::detail::cu
