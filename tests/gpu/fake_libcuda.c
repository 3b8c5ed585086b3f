/* A stand-in for libcuda.so.1 (test_cuda_driver): the four functions the
 * loader resolves before cuInit, with the driver version and cuInit's result
 * taken from the environment (FAKE_CUDA_VERSION, default 13000;
 * FAKE_CUINIT_RESULT, default 0 = CUDA_SUCCESS). Nothing else: a loader that
 * gets past cuInit finds every other function missing. */
#include <stdlib.h>

typedef int CUresult;

static int env_int(const char* name, int dflt) {
  const char* s = getenv(name);
  return s != NULL && *s != 0 ? atoi(s) : dflt;
}

CUresult cuDriverGetVersion(int* v) {
  *v = env_int("FAKE_CUDA_VERSION", 13000);
  return 0;
}

CUresult cuInit(unsigned int flags) {
  (void)flags;
  return env_int("FAKE_CUINIT_RESULT", 0);
}

CUresult cuGetErrorName(CUresult e, const char** s) {
  if (e == 100) *s = "CUDA_ERROR_NO_DEVICE";
  else if (e == 35) *s = "CUDA_ERROR_INSUFFICIENT_DRIVER";
  else *s = "CUDA_ERROR_UNKNOWN";
  return 0;
}

CUresult cuGetErrorString(CUresult e, const char** s) {
  if (e == 100) *s = "no CUDA-capable device is detected";
  else if (e == 35) *s = "CUDA driver version is insufficient for CUDA runtime version";
  else *s = "unknown error";
  return 0;
}
