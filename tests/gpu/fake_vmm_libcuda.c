/* A stand-in for libcuda.so.1 that emulates the CUDA virtual memory
 * management API with memfds, so that lib/core/engine/cuda_vmm.cpp (device slots'
 * memory) runs on machines without a GPU (test_vmm_fake, with
 * SHMCAST_LIBCUDA pointing here). "Device memory" is host memory:
 *
 *   cuMemCreate          a memfd named "fakevmm-dev<N>" of the size
 *   cuMemAddressReserve  an inaccessible anonymous mapping (PROT_NONE)
 *   cuMemMap             the memfd mapped over part of a reservation (still PROT_NONE)
 *   cuMemSetAccess       PROT_READ|PROT_WRITE on a mapped range
 *   cuMemUnmap           back to an inaccessible reservation
 *   cuMemExport/Import   dup of the memfd / a handle on the fd received
 *
 * and it refuses what the real driver refuses, as far as its documentation
 * says: sizes that are no multiple of the granularity, a call without a
 * current context, a map outside a reservation or over a mapped range, a
 * map larger than the allocation, access set on an unmapped range, freeing
 * a reservation that still has mappings, unknown handles. Counters of live
 * handles, reservations and mappings are readable with fake_vmm_live() (the
 * test dlopens this library again to call it).
 *
 * Environment: FAKE_DEVICES (default 2), FAKE_PEER (0: no peer access
 * between different devices; default 1), FAKE_VMM (0: the devices lack the
 * VMM API; default 1), FAKE_UUID_SALT (a process with another salt sees
 * other GPUs; default 0), FAKE_GRANULARITY (default 2 MiB).
 * Every other driver function the library resolves is here and returns
 * CUDA_ERROR_NOT_SUPPORTED. */
#define _GNU_SOURCE
#include <cuda.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static int env_int(const char* name, int dflt) {
  const char* s = getenv(name);
  return s != NULL && *s != 0 ? atoi(s) : dflt;
}
static size_t gran(void) { return (size_t)env_int("FAKE_GRANULARITY", 2 << 20); }
static int ndev(void) { return env_int("FAKE_DEVICES", 2); }

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

typedef struct {
  int fd;
  size_t size;
  int device;
  int live;
} Alloc;
typedef struct {
  uintptr_t va;
  size_t size;
  int live;
} Range;

#define MAXN 4096
static Alloc allocs[MAXN];
static Range reservations[MAXN];
static Range mappings[MAXN];

int fake_vmm_live(void) {
  int n = 0;
  pthread_mutex_lock(&mu);
  for (int i = 0; i < MAXN; ++i) n += allocs[i].live + reservations[i].live + mappings[i].live;
  pthread_mutex_unlock(&mu);
  return n;
}

/* ---- contexts: one per device, a per-thread stack */
static _Thread_local CUcontext ctx_stack[16];
static _Thread_local int ctx_depth;
static CUcontext ctx_of(int dev) { return (CUcontext)(uintptr_t)(0x1000 + 16 * dev); }
static int dev_of_ctx(CUcontext c) { return (int)(((uintptr_t)c - 0x1000) / 16); }
static int have_ctx(void) { return ctx_depth > 0; }

CUresult cuDriverGetVersion(int* v) {
  *v = env_int("FAKE_CUDA_VERSION", 13000);
  return CUDA_SUCCESS;
}
CUresult cuInit(unsigned int flags) {
  (void)flags;
  return CUDA_SUCCESS;
}
CUresult cuGetErrorName(CUresult e, const char** s) {
  switch (e) {
    case CUDA_ERROR_INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; break;
    case CUDA_ERROR_INVALID_CONTEXT: *s = "CUDA_ERROR_INVALID_CONTEXT"; break;
    case CUDA_ERROR_INVALID_DEVICE: *s = "CUDA_ERROR_INVALID_DEVICE"; break;
    case CUDA_ERROR_NOT_SUPPORTED: *s = "CUDA_ERROR_NOT_SUPPORTED"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *s = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    default: *s = "CUDA_ERROR_UNKNOWN";
  }
  return CUDA_SUCCESS;
}
CUresult cuGetErrorString(CUresult e, const char** s) {
  (void)e;
  *s = "fake_vmm_libcuda refused the call";
  return CUDA_SUCCESS;
}
CUresult cuDeviceGetCount(int* n) {
  *n = ndev();
  return CUDA_SUCCESS;
}
CUresult cuDeviceGet(CUdevice* d, int ordinal) {
  if (ordinal < 0 || ordinal >= ndev()) return CUDA_ERROR_INVALID_DEVICE;
  *d = ordinal;
  return CUDA_SUCCESS;
}
CUresult cuDeviceGetAttribute(int* v, CUdevice_attribute a, CUdevice d) {
  if (d < 0 || d >= ndev()) return CUDA_ERROR_INVALID_DEVICE;
  if (a == CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED ||
      a == CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)
    *v = env_int("FAKE_VMM", 1);
  else
    *v = 0;
  return CUDA_SUCCESS;
}
CUresult cuDeviceGetUuid(CUuuid* u, CUdevice d) {
  if (d < 0 || d >= ndev()) return CUDA_ERROR_INVALID_DEVICE;
  memset(u->bytes, 0, sizeof u->bytes);
  memcpy(u->bytes, "fakeGPU", 7);
  u->bytes[8] = (char)env_int("FAKE_UUID_SALT", 0);
  u->bytes[15] = (char)d;
  return CUDA_SUCCESS;
}
CUresult cuDeviceCanAccessPeer(int* can, CUdevice d, CUdevice peer) {
  if (d < 0 || d >= ndev() || peer < 0 || peer >= ndev()) return CUDA_ERROR_INVALID_DEVICE;
  *can = d != peer && env_int("FAKE_PEER", 1) != 0;
  return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice d) {
  if (d < 0 || d >= ndev()) return CUDA_ERROR_INVALID_DEVICE;
  *c = ctx_of(d);
  return CUDA_SUCCESS;
}
CUresult cuCtxGetCurrent(CUcontext* c) {
  *c = ctx_depth > 0 ? ctx_stack[ctx_depth - 1] : NULL;
  return CUDA_SUCCESS;
}
CUresult cuCtxPushCurrent(CUcontext c) {
  if (ctx_depth >= 16) return CUDA_ERROR_INVALID_VALUE;
  ctx_stack[ctx_depth++] = c;
  return CUDA_SUCCESS;
}
CUresult cuCtxPopCurrent(CUcontext* c) {
  if (ctx_depth == 0) return CUDA_ERROR_INVALID_CONTEXT;
  *c = ctx_stack[--ctx_depth];
  return CUDA_SUCCESS;
}
CUresult cuCtxGetDevice(CUdevice* d) {
  if (!have_ctx()) return CUDA_ERROR_INVALID_CONTEXT;
  *d = dev_of_ctx(ctx_stack[ctx_depth - 1]);
  return CUDA_SUCCESS;
}
CUresult cuMemGetInfo(size_t* free_bytes, size_t* total) {
  if (!have_ctx()) return CUDA_ERROR_INVALID_CONTEXT;
  size_t used = 0;
  pthread_mutex_lock(&mu);
  for (int i = 0; i < MAXN; ++i) used += allocs[i].live ? allocs[i].size : 0;
  pthread_mutex_unlock(&mu);
  *total = (size_t)80 << 30;
  *free_bytes = *total - used;
  return CUDA_SUCCESS;
}

/* ---- the VMM API */
static int valid_prop(const CUmemAllocationProp* p) {
  return p != NULL && p->type == CU_MEM_ALLOCATION_TYPE_PINNED && p->location.type == CU_MEM_LOCATION_TYPE_DEVICE &&
         p->location.id >= 0 && p->location.id < ndev() &&
         (p->requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) != 0 && env_int("FAKE_VMM", 1) != 0;
}

CUresult cuMemGetAllocationGranularity(size_t* g, const CUmemAllocationProp* p, CUmemAllocationGranularity_flags o) {
  (void)o;
  if (!valid_prop(p)) return CUDA_ERROR_INVALID_VALUE;
  *g = gran();
  return CUDA_SUCCESS;
}

static int new_alloc(int fd, size_t size, int device) {
  for (int i = 0; i < MAXN; ++i)
    if (!allocs[i].live) {
      allocs[i] = (Alloc){fd, size, device, 1};
      return i;
    }
  return -1;
}
static Alloc* alloc_of(CUmemGenericAllocationHandle h) {
  if (h == 0 || h > MAXN || !allocs[h - 1].live) return NULL;
  return &allocs[h - 1];
}

CUresult cuMemCreate(CUmemGenericAllocationHandle* h, size_t size, const CUmemAllocationProp* p,
                     unsigned long long flags) {
  if (!have_ctx()) return CUDA_ERROR_INVALID_CONTEXT;
  if (!valid_prop(p) || flags != 0 || size == 0 || size % gran() != 0) return CUDA_ERROR_INVALID_VALUE;
  char name[32];
  snprintf(name, sizeof name, "fakevmm-dev%d", p->location.id);
  const int fd = memfd_create(name, MFD_CLOEXEC);
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  if (ftruncate(fd, (off_t)size) != 0) {
    close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  pthread_mutex_lock(&mu);
  const int i = new_alloc(fd, size, p->location.id);
  pthread_mutex_unlock(&mu);
  if (i < 0) {
    close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  *h = (CUmemGenericAllocationHandle)(i + 1);
  return CUDA_SUCCESS;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
  pthread_mutex_lock(&mu);
  Alloc* a = alloc_of(h);
  if (a == NULL) {
    pthread_mutex_unlock(&mu);
    return CUDA_ERROR_INVALID_VALUE;
  }
  close(a->fd);  /* a mapping keeps the memory (the real driver's rule too) */
  a->live = 0;
  pthread_mutex_unlock(&mu);
  return CUDA_SUCCESS;
}

CUresult cuMemAddressReserve(CUdeviceptr* va, size_t size, size_t align, CUdeviceptr addr, unsigned long long flags) {
  if (size == 0 || size % gran() != 0 || (align != 0 && align % gran() != 0) || addr != 0 || flags != 0)
    return CUDA_ERROR_INVALID_VALUE;
  void* p = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  pthread_mutex_lock(&mu);
  int i = 0;
  while (i < MAXN && reservations[i].live) ++i;
  if (i < MAXN) reservations[i] = (Range){(uintptr_t)p, size, 1};
  pthread_mutex_unlock(&mu);
  if (i == MAXN) {
    munmap(p, size);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  *va = (CUdeviceptr)(uintptr_t)p;
  return CUDA_SUCCESS;
}

static int overlaps_mapping(uintptr_t va, size_t size) {
  for (int i = 0; i < MAXN; ++i)
    if (mappings[i].live && va < mappings[i].va + mappings[i].size && mappings[i].va < va + size) return 1;
  return 0;
}

CUresult cuMemAddressFree(CUdeviceptr va, size_t size) {
  pthread_mutex_lock(&mu);
  for (int i = 0; i < MAXN; ++i)
    if (reservations[i].live && reservations[i].va == (uintptr_t)va && reservations[i].size == size) {
      if (overlaps_mapping((uintptr_t)va, size)) break; /* still mapped: refused */
      reservations[i].live = 0;
      pthread_mutex_unlock(&mu);
      munmap((void*)(uintptr_t)va, size);
      return CUDA_SUCCESS;
    }
  pthread_mutex_unlock(&mu);
  return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemMap(CUdeviceptr va, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                  unsigned long long flags) {
  if (!have_ctx()) return CUDA_ERROR_INVALID_CONTEXT;
  pthread_mutex_lock(&mu);
  Alloc* a = alloc_of(h);
  int inside = 0;
  for (int i = 0; i < MAXN; ++i)
    if (reservations[i].live && (uintptr_t)va >= reservations[i].va &&
        (uintptr_t)va + size <= reservations[i].va + reservations[i].size)
      inside = 1;
  if (a == NULL || !inside || flags != 0 || offset != 0 || size == 0 || size % gran() != 0 || size > a->size ||
      overlaps_mapping((uintptr_t)va, size)) {
    pthread_mutex_unlock(&mu);
    return CUDA_ERROR_INVALID_VALUE;
  }
  void* p = mmap((void*)(uintptr_t)va, size, PROT_NONE, MAP_SHARED | MAP_FIXED, a->fd, 0);
  int i = 0;
  while (i < MAXN && mappings[i].live) ++i;
  if (p == MAP_FAILED || i == MAXN) {
    pthread_mutex_unlock(&mu);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  mappings[i] = (Range){(uintptr_t)va, size, 1};
  pthread_mutex_unlock(&mu);
  return CUDA_SUCCESS;
}

CUresult cuMemUnmap(CUdeviceptr va, size_t size) {
  pthread_mutex_lock(&mu);
  for (int i = 0; i < MAXN; ++i)
    if (mappings[i].live && mappings[i].va == (uintptr_t)va && mappings[i].size == size) {
      mappings[i].live = 0;
      mmap((void*)(uintptr_t)va, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
      pthread_mutex_unlock(&mu);
      return CUDA_SUCCESS;
    }
  pthread_mutex_unlock(&mu);
  return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemSetAccess(CUdeviceptr va, size_t size, const CUmemAccessDesc* desc, size_t count) {
  if (count == 0) return CUDA_ERROR_INVALID_VALUE;
  for (size_t k = 0; k < count; ++k)
    if (desc[k].location.type != CU_MEM_LOCATION_TYPE_DEVICE || desc[k].location.id < 0 ||
        desc[k].location.id >= ndev() || desc[k].flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
      return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  size_t covered = 0;
  for (int i = 0; i < MAXN; ++i)
    if (mappings[i].live && mappings[i].va >= (uintptr_t)va && mappings[i].va + mappings[i].size <= (uintptr_t)va + size)
      covered += mappings[i].size;
  pthread_mutex_unlock(&mu);
  if (covered != size) return CUDA_ERROR_INVALID_VALUE; /* access only on mapped memory */
  return mprotect((void*)(uintptr_t)va, size, PROT_READ | PROT_WRITE) == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemExportToShareableHandle(void* out, CUmemGenericAllocationHandle h, CUmemAllocationHandleType type,
                                      unsigned long long flags) {
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&mu);
  Alloc* a = alloc_of(h);
  const int fd = a != NULL ? dup(a->fd) : -1;
  pthread_mutex_unlock(&mu);
  if (fd < 0) return CUDA_ERROR_INVALID_VALUE;
  *(int*)out = fd;
  return CUDA_SUCCESS;
}

CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle* h, void* os, CUmemAllocationHandleType type) {
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_INVALID_VALUE;
  const int fd = (int)(uintptr_t)os;
  char link[64], target[256];
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  const ssize_t n = readlink(link, target, sizeof target - 1);
  struct stat st;
  if (n <= 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) return CUDA_ERROR_INVALID_VALUE;
  target[n] = 0;
  int device = -1;
  if (sscanf(target, "/memfd:fakevmm-dev%d", &device) != 1) return CUDA_ERROR_INVALID_VALUE; /* not "ours" */
  const int copy = fcntl(fd, F_DUPFD_CLOEXEC, 3);
  if (copy < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  pthread_mutex_lock(&mu);
  const int i = new_alloc(copy, (size_t)st.st_size, device);
  pthread_mutex_unlock(&mu);
  if (i < 0) {
    close(copy);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  *h = (CUmemGenericAllocationHandle)(i + 1);
  return CUDA_SUCCESS;
}

/* ---- the rest of what the library resolves: not emulated */
#define NS return CUDA_ERROR_NOT_SUPPORTED
CUresult cuStreamGetCtx(CUstream s, CUcontext* c) { (void)s; (void)c; NS; }
CUresult cuStreamCreate(CUstream* s, unsigned int f) { (void)s; (void)f; NS; }
CUresult cuStreamDestroy(CUstream s) { (void)s; NS; }
CUresult cuStreamSynchronize(CUstream s) { (void)s; NS; }
CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned int f) { (void)s; (void)e; (void)f; NS; }
CUresult cuEventCreate(CUevent* e, unsigned int f) { (void)e; (void)f; NS; }
CUresult cuEventRecord(CUevent e, CUstream s) { (void)e; (void)s; NS; }
CUresult cuEventSynchronize(CUevent e) { (void)e; NS; }
CUresult cuEventQuery(CUevent e) { (void)e; NS; }
CUresult cuEventDestroy(CUevent e) { (void)e; NS; }
CUresult cuLaunchHostFunc(CUstream s, CUhostFn fn, void* u) { (void)s; (void)fn; (void)u; NS; }
CUresult cuMemcpyDtoHAsync(void* d, CUdeviceptr s, size_t n, CUstream st) { (void)d; (void)s; (void)n; (void)st; NS; }
CUresult cuMemcpyHtoDAsync(CUdeviceptr d, const void* s, size_t n, CUstream st) { (void)d; (void)s; (void)n; (void)st; NS; }
CUresult cuMemcpy2DAsync(const CUDA_MEMCPY2D* c, CUstream s) { (void)c; (void)s; NS; }
CUresult cuMemcpyDtoDAsync(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st) { (void)d; (void)s; (void)n; (void)st; NS; }
CUresult cuMemHostRegister(void* p, size_t n, unsigned int f) { (void)p; (void)n; (void)f; NS; }
CUresult cuMemHostUnregister(void* p) { (void)p; NS; }
CUresult cuMemAlloc(CUdeviceptr* p, size_t n) { (void)p; (void)n; NS; }
CUresult cuMemFree(CUdeviceptr p) { (void)p; NS; }
CUresult cuModuleLoadDataEx(CUmodule* m, const void* image, unsigned int n, CUjit_option* o, void** v) {
  (void)m; (void)image; (void)n; (void)o; (void)v; NS;
}
CUresult cuModuleGetFunction(CUfunction* f, CUmodule m, const char* name) { (void)f; (void)m; (void)name; NS; }
CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by,
                        unsigned int bz, unsigned int shared, CUstream s, void** params, void** extra) {
  (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shared; (void)s; (void)params; (void)extra;
  NS;
}
