/* A stand-in for libcuda.so.1 that can pin (test_cuda_pin): every function
 * the loader resolves exists, one device, a primary context, and
 * cuMemHostRegister / cuMemHostUnregister that record what they were asked
 * for and behave as the driver does towards read-only host memory:
 *  - CU_MEMHOSTREGISTER_READ_ONLY on a device without
 *    CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED: CUDA_ERROR_NOT_SUPPORTED;
 *  - a range with a page mapped without write access, registered without
 *    that flag: CUDA_ERROR_INVALID_VALUE (the driver pins with write access).
 * FAKE_CUDA_RO_REGISTER (default 1) is the attribute's value. Copies,
 * streams and allocations are refused: the test only pins.
 * fake_cuda_registrations() lets the test read the live registrations. */
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_REGS 64

struct reg {
  uintptr_t base;
  size_t bytes;
  unsigned flags;
};
static struct reg regs[MAX_REGS];
static int nregs;

static int env_int(const char* name, int dflt) {
  const char* s = getenv(name);
  return s != NULL && *s != 0 ? atoi(s) : dflt;
}

/* Every page of [p, p + n) is mapped with write access (/proc/self/maps). */
static int writable(uintptr_t p, size_t n) {
  FILE* f = fopen("/proc/self/maps", "r");
  if (f == NULL) return 0;
  uintptr_t at = p, end = p + n;
  char line[512];
  while (at < end && fgets(line, sizeof line, f) != NULL) {
    unsigned long lo = 0, hi = 0;
    char perms[8] = {0};
    if (sscanf(line, "%lx-%lx %7s", &lo, &hi, perms) != 3) continue;
    if (hi <= at || lo > at) continue;
    if (perms[1] != 'w') break;
    at = hi;
  }
  fclose(f);
  return at >= end;
}

int fake_cuda_registrations(uintptr_t* base, size_t* bytes, unsigned* flags, int max) {
  for (int i = 0; i < nregs && i < max; ++i) {
    base[i] = regs[i].base;
    bytes[i] = regs[i].bytes;
    flags[i] = regs[i].flags;
  }
  return nregs;
}

CUresult cuDriverGetVersion(int* v) {
  *v = 13000;
  return CUDA_SUCCESS;
}
CUresult cuInit(unsigned int flags) {
  (void)flags;
  return CUDA_SUCCESS;
}
CUresult cuGetErrorName(CUresult e, const char** s) {
  *s = e == CUDA_ERROR_NOT_SUPPORTED ? "CUDA_ERROR_NOT_SUPPORTED"
       : e == CUDA_ERROR_INVALID_VALUE ? "CUDA_ERROR_INVALID_VALUE"
                                       : "CUDA_ERROR_UNKNOWN";
  return CUDA_SUCCESS;
}
CUresult cuGetErrorString(CUresult e, const char** s) {
  *s = e == CUDA_ERROR_NOT_SUPPORTED ? "operation not supported" : "fake driver";
  return CUDA_SUCCESS;
}
CUresult cuDeviceGet(CUdevice* d, int ordinal) {
  if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
  *d = 0;
  return CUDA_SUCCESS;
}
CUresult cuDeviceGetCount(int* n) {
  *n = 1;
  return CUDA_SUCCESS;
}
CUresult cuDeviceGetAttribute(int* v, CUdevice_attribute a, CUdevice d) {
  (void)d;
  if (a == CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED)
    *v = env_int("FAKE_CUDA_RO_REGISTER", 1);
  else
    *v = 0;
  return CUDA_SUCCESS;
}
static int ctx_token;
CUresult cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice d) {
  (void)d;
  *c = (CUcontext)&ctx_token;
  return CUDA_SUCCESS;
}
CUresult cuCtxGetCurrent(CUcontext* c) {
  *c = NULL;
  return CUDA_SUCCESS;
}
CUresult cuCtxPushCurrent(CUcontext c) {
  (void)c;
  return CUDA_SUCCESS;
}
CUresult cuCtxPopCurrent(CUcontext* c) {
  if (c != NULL) *c = (CUcontext)&ctx_token;
  return CUDA_SUCCESS;
}
CUresult cuCtxGetDevice(CUdevice* d) {
  *d = 0;
  return CUDA_SUCCESS;
}

CUresult cuMemHostRegister(void* p, size_t n, unsigned int flags) {
  if ((flags & CU_MEMHOSTREGISTER_READ_ONLY) && !env_int("FAKE_CUDA_RO_REGISTER", 1)) return CUDA_ERROR_NOT_SUPPORTED;
  if (!(flags & CU_MEMHOSTREGISTER_READ_ONLY) && !writable((uintptr_t)p, n)) return CUDA_ERROR_INVALID_VALUE;
  if (nregs == MAX_REGS) return CUDA_ERROR_OUT_OF_MEMORY;
  for (int i = 0; i < nregs; ++i)
    if ((uintptr_t)p < regs[i].base + regs[i].bytes && regs[i].base < (uintptr_t)p + n)
      return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
  regs[nregs].base = (uintptr_t)p;
  regs[nregs].bytes = n;
  regs[nregs].flags = flags;
  ++nregs;
  return CUDA_SUCCESS;
}
CUresult cuMemHostUnregister(void* p) {
  for (int i = 0; i < nregs; ++i)
    if (regs[i].base == (uintptr_t)p) {
      regs[i] = regs[--nregs];
      return CUDA_SUCCESS;
    }
  return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
}

/* Not used by pinning: refused. */
CUresult cuStreamGetCtx(CUstream s, CUcontext* c) {
  (void)s;
  (void)c;
  return CUDA_ERROR_NOT_SUPPORTED;
}
CUresult cuStreamCreate(CUstream* s, unsigned int f) {
  (void)s;
  (void)f;
  return CUDA_ERROR_NOT_SUPPORTED;
}
CUresult cuStreamDestroy(CUstream s) {
  (void)s;
  return CUDA_ERROR_NOT_SUPPORTED;
}
CUresult cuStreamSynchronize(CUstream s) {
  (void)s;
  return CUDA_ERROR_NOT_SUPPORTED;
}
CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned int f) {
  (void)s;
  (void)e;
  (void)f;
  return CUDA_ERROR_NOT_SUPPORTED;
}
CUresult cuEventCreate(CUevent* e, unsigned int f) {
  (void)e;
  (void)f;
  return CUDA_ERROR_NOT_SUPPORTED;
}
CUresult cuEventRecord(CUevent e, CUstream s) {
  (void)e;
  (void)s;
  return CUDA_ERROR_NOT_SUPPORTED;
}
CUresult cuEventSynchronize(CUevent e) {
  (void)e;
  return CUDA_ERROR_NOT_SUPPORTED;
}
CUresult cuEventQuery(CUevent e) {
  (void)e;
  return CUDA_ERROR_NOT_SUPPORTED;
}
CUresult cuEventDestroy(CUevent e) {
  (void)e;
  return CUDA_ERROR_NOT_SUPPORTED;
}
CUresult cuLaunchHostFunc(CUstream s, CUhostFn fn, void* data) {
  (void)s;
  (void)fn;
  (void)data;
  return CUDA_ERROR_NOT_SUPPORTED;
}
CUresult cuMemcpyDtoHAsync(void* dst, CUdeviceptr src, size_t n, CUstream s) {
  (void)dst;
  (void)src;
  (void)n;
  (void)s;
  return CUDA_ERROR_NOT_SUPPORTED;
}
CUresult cuMemcpyHtoDAsync(CUdeviceptr dst, const void* src, size_t n, CUstream s) {
  (void)dst;
  (void)src;
  (void)n;
  (void)s;
  return CUDA_ERROR_NOT_SUPPORTED;
}
CUresult cuMemcpyDtoDAsync(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st) {
  (void)d;
  (void)s;
  (void)n;
  (void)st;
  return CUDA_ERROR_NOT_SUPPORTED;
}
CUresult cuMemcpy2DAsync(const CUDA_MEMCPY2D* c, CUstream s) {
  (void)c;
  (void)s;
  return CUDA_ERROR_NOT_SUPPORTED;
}
CUresult cuMemAlloc(CUdeviceptr* p, size_t n) {
  (void)p;
  (void)n;
  return CUDA_ERROR_NOT_SUPPORTED;
}
CUresult cuMemFree(CUdeviceptr p) {
  (void)p;
  return CUDA_ERROR_NOT_SUPPORTED;
}
/* The delta codec's module functions, the memory query and peer access:
 * the loader requires them (cuda_driver.hpp); this driver only pins. */
CUresult cuModuleLoadDataEx(CUmodule* m, const void* image, unsigned int n, CUjit_option* o, void** v) {
  (void)m;
  (void)image;
  (void)n;
  (void)o;
  (void)v;
  return CUDA_ERROR_NOT_SUPPORTED;
}
CUresult cuModuleGetFunction(CUfunction* f, CUmodule m, const char* name) {
  (void)f;
  (void)m;
  (void)name;
  return CUDA_ERROR_NOT_SUPPORTED;
}
CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by,
                        unsigned int bz, unsigned int shared, CUstream s, void** params, void** extra) {
  (void)f;
  (void)gx;
  (void)gy;
  (void)gz;
  (void)bx;
  (void)by;
  (void)bz;
  (void)shared;
  (void)s;
  (void)params;
  (void)extra;
  return CUDA_ERROR_NOT_SUPPORTED;
}
CUresult cuMemGetInfo(size_t* free_bytes, size_t* total) {
  if (free_bytes != NULL) *free_bytes = (size_t)1 << 30;
  if (total != NULL) *total = (size_t)1 << 30;
  return CUDA_SUCCESS;
}
CUresult cuDeviceCanAccessPeer(int* can, CUdevice d, CUdevice peer) {
  (void)d;
  (void)peer;
  *can = 0;
  return CUDA_SUCCESS;
}
