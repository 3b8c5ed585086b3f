/* A slow-but-steady downstream for the relay tests, LD_PRELOADed into one
 * relay: it reads from the network at SHMCAST_TEST_RECV_BPS bytes per
 * second, steadily (a loaded node, a slower link), instead of as fast as
 * loopback goes.
 *
 * UCX's TCP transport (libucs) and the relay's control channel receive with
 * recv(). Each call here takes at most 16 KiB, and the caller then waits
 * until the bytes taken so far fit the rate (one schedule for the process,
 * whatever the thread), so the socket fills and TCP holds the sender back.
 * Run the relay with UCX_TCP_RCVBUF small too, and its upstream with
 * UCX_TCP_SNDBUF small, so that the kernel's buffers do not hide the pace
 * from the sender. MSG_PEEK reads are not counted. Without the variable,
 * every call goes straight through. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>

enum { kMaxPerCall = 16 * 1024 };

typedef ssize_t (*recv_fn)(int, void*, size_t, int);

static recv_fn real_recv;
static double rate;         /* bytes per second; 0: off */
static int64_t next_ns;     /* when the bytes taken so far are "due" */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

static int64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

__attribute__((constructor)) static void init(void) {
  real_recv = (recv_fn)dlsym(RTLD_NEXT, "recv");
  const char* r = getenv("SHMCAST_TEST_RECV_BPS");
  rate = r ? strtod(r, NULL) : 0;
}

ssize_t recv(int fd, void* buf, size_t len, int flags) {
  if (rate <= 0 || (flags & MSG_PEEK)) return real_recv(fd, buf, len, flags);
  if (len > kMaxPerCall) len = kMaxPerCall;
  const ssize_t n = real_recv(fd, buf, len, flags);
  if (n <= 0) return n;
  pthread_mutex_lock(&mu);
  const int64_t now = now_ns();
  if (next_ns < now) next_ns = now;
  next_ns += (int64_t)((double)n * 1e9 / rate);
  const int64_t until = next_ns;
  pthread_mutex_unlock(&mu);
  const struct timespec t = {(time_t)(until / 1000000000), (long)(until % 1000000000)};
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &t, NULL) != 0) {
  }
  return n;
}
