// The CUDA driver API, loaded at run time (built with SHMCAST_WITH_CUDA).
//
// libshmcast links no CUDA library. The first CUDA call dlopen()s
// libcuda.so.1 (the NVIDIA driver's library; $SHMCAST_LIBCUDA names another
// file, for tests), checks the driver's version, calls cuInit(0) and resolves
// every function below with dlsym. So one build runs on machines with and
// without a GPU, next to any CUDA runtime (torch's, the application's): a
// cudaStream_t is a CUstream, and the runtime and this library share the
// device's primary context.
//
// Only cuda.h is needed at build time, for the types and prototypes. Each
// pointer is declared with decltype of the prototype that cuda.h declares for
// the name, and resolved by the symbol that name expands to (cuda.h #defines
// versioned names: cuMemHostRegister is cuMemHostRegister_v2, cuCtxPushCurrent
// is cuCtxPushCurrent_v2, ...), so prototype and symbol always agree. No
// per-thread-default-stream variants (_ptsz): stream 0 is the legacy default
// stream, as for a runtime built without --default-stream per-thread.
#pragma once

#include <cuda.h>

#include <string>

namespace shmcast::detail::cu {

// Resolved after cuInit (the first three are resolved before it). The module
// and launch functions run the delta codec's kernels (delta_cuda.cpp).
#define SHMCAST_CU_FUNCTIONS(X) \
  X(cuGetErrorName)             \
  X(cuGetErrorString)           \
  X(cuDriverGetVersion)         \
  X(cuInit)                     \
  X(cuDeviceGet)                \
  X(cuDeviceGetCount)           \
  X(cuDeviceGetAttribute)       \
  X(cuDevicePrimaryCtxRetain)   \
  X(cuCtxGetCurrent)            \
  X(cuCtxPushCurrent)           \
  X(cuCtxPopCurrent)            \
  X(cuCtxGetDevice)             \
  X(cuStreamGetCtx)             \
  X(cuStreamCreate)             \
  X(cuStreamDestroy)            \
  X(cuStreamSynchronize)        \
  X(cuStreamWaitEvent)          \
  X(cuEventCreate)              \
  X(cuEventRecord)              \
  X(cuEventSynchronize)         \
  X(cuEventQuery)               \
  X(cuEventDestroy)             \
  X(cuLaunchHostFunc)           \
  X(cuMemcpyDtoHAsync)          \
  X(cuMemcpyHtoDAsync)          \
  X(cuMemcpy2DAsync)            \
  X(cuMemcpyDtoDAsync)          \
  X(cuMemHostRegister)          \
  X(cuMemHostUnregister)        \
  X(cuMemAlloc)                 \
  X(cuMemFree)                  \
  X(cuModuleLoadDataEx)         \
  X(cuModuleGetFunction)        \
  X(cuLaunchKernel)             \
  X(cuMemGetInfo)               \
  X(cuDeviceCanAccessPeer)

// The virtual memory management API and the GPU's UUID, for device slots
// (cuda_vmm.{hpp,cpp}): resolved after the functions above, but optional,
// so that a driver older than CUDA 11.4 (cuDeviceGetUuid_v2; the VMM API
// came with 10.2) still runs the host path. Api::vmm_missing says which are
// absent. Names checked against cuda.h 13.0: cuDeviceGetUuid is
// cuDeviceGetUuid_v2, the others are not versioned.
#define SHMCAST_CU_VMM_FUNCTIONS(X)      \
  X(cuDeviceGetUuid)                     \
  X(cuMemGetAllocationGranularity)       \
  X(cuMemCreate)                         \
  X(cuMemRelease)                        \
  X(cuMemAddressReserve)                 \
  X(cuMemAddressFree)                    \
  X(cuMemMap)                            \
  X(cuMemUnmap)                          \
  X(cuMemSetAccess)                      \
  X(cuMemExportToShareableHandle)        \
  X(cuMemImportFromShareableHandle)

// One pointer per function, named as in cuda.h (the member's name expands
// like the function's: api.cuMemAlloc(...) calls cuMemAlloc_v2).
struct Api {
#define SHMCAST_CU_MEMBER(name) decltype(&::name) name = nullptr;
  SHMCAST_CU_FUNCTIONS(SHMCAST_CU_MEMBER)
  SHMCAST_CU_VMM_FUNCTIONS(SHMCAST_CU_MEMBER)
#undef SHMCAST_CU_MEMBER
  int driver_version = 0;   // cuDriverGetVersion: 1000 * major + 10 * minor
  std::string library;      // the file that was loaded
  std::string vmm_missing;  // the SHMCAST_CU_VMM_FUNCTIONS it lacks ("" when it has them all)
};

// The oldest driver whose CUDA version has every function above
// (cuLaunchHostFunc came with CUDA 10.0).
inline constexpr int kMinDriverVersion = 10000;

// The loaded driver, or nullptr with `why` (when non-null) saying why not:
// libcuda.so.1 missing, too old, or cuInit failing (no device, driver and
// kernel module mismatch, ...). Loads once per process; thread-safe. After a
// success the pointer stays valid for the life of the process (the library
// is never unloaded).
const Api* load(std::string* why);

// "CUDA_ERROR_INVALID_VALUE (invalid argument)".
std::string error_text(const Api& api, CUresult e);

// "13.0" for 13000.
std::string version_text(int v);

// Throws Error(kCuda) "CUDA: <what> failed: <error_text>[; <todo>]" unless
// `e` is CUDA_SUCCESS.
void check(const Api& api, CUresult e, const std::string& what, const char* todo = "");

// The primary context of device ordinal `dev` (the one the CUDA runtime, and
// so torch, uses), retained on first use and kept for the life of the
// process, as the runtime keeps it. Thread-safe.
CUcontext primary_context(const Api& api, int dev);

// Makes `ctx` the calling thread's current context for the scope (pushes it
// unless it is current already), then restores the caller's.
class CtxScope {
 public:
  CtxScope(const Api& api, CUcontext ctx);
  ~CtxScope();
  CtxScope(const CtxScope&) = delete;
  CtxScope& operator=(const CtxScope&) = delete;

 private:
  const Api& api_;
  bool pushed_ = false;
};

}  // namespace shmcast::detail::cu
