/* A fault for the relay tests, LD_PRELOADed into one relay: one bit of
 * payload flipped on its way to the network, below TCP's own checksum (what
 * a bad NIC, a DMA fault or a broken offload does). The relay's per-chunk
 * XXH3 across the hop must catch it.
 *
 * UCX's TCP transport sends a fragment as sendmsg() with its headers and the
 * fragment's bytes (straight from the region's slot, in pieces of 64 KiB less
 * the headers) as separate iovecs. While the file named by
 * SHMCAST_TEST_FLIP_FILE exists, the next sendmsg() that carries an iovec of
 * at least 16 KiB (payload; the relay's control messages go out with send()
 * on its own socket, and UCX's own messages are smaller) claims it (unlink:
 * once, whatever the thread) and goes out with
 * the first byte of that iovec flipped, from a copy: the slot itself, which
 * the sender's own node reads, is not touched. Once that byte is on the
 * wire, the file PATH.sent says so (the test checks it: a flip that never
 * happened cannot pass for one that was caught). A sendmsg() that ends
 * before that byte re-creates the file, so the next one tries again.
 * Without the variable, every call goes straight through.
 *
 * With gcc's sanitizers (shared runtimes) the shim comes first and calls on
 * into their interceptors. A build whose sanitizer runtime is linked into
 * the executable (clang's default) intercepts sendmsg() before the shim:
 * then no flip goes out and the test fails, saying so; it never passes. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

enum { kPayload = 16 * 1024, kMaxIov = 64 };

typedef ssize_t (*sendmsg_fn)(int, const struct msghdr*, int);

static sendmsg_fn real_sendmsg;

__attribute__((constructor)) static void find_real(void) { real_sendmsg = (sendmsg_fn)dlsym(RTLD_NEXT, "sendmsg"); }

static void touch(const char* path, const char* text) {
  const int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return;
  if (text && write(fd, text, strlen(text)) < 0) {
  }
  close(fd);
}

ssize_t sendmsg(int fd, const struct msghdr* m, int flags) {
  const sendmsg_fn real = real_sendmsg;
  const char* arm = getenv("SHMCAST_TEST_FLIP_FILE");
  if (!arm || !m || m->msg_iovlen == 0 || m->msg_iovlen > kMaxIov) return real(fd, m, flags);
  size_t b = m->msg_iovlen, before = 0;
  for (size_t i = 0, off = 0; i < m->msg_iovlen; off += m->msg_iov[i].iov_len, ++i) {
    if (m->msg_iov[i].iov_len >= kPayload) {
      b = i;
      before = off;
      break;
    }
  }
  const int saved = errno;
  if (b == m->msg_iovlen || unlink(arm) != 0) {
    errno = saved;
    return real(fd, m, flags);
  }
  const size_t len = m->msg_iov[b].iov_len;
  unsigned char* copy = malloc(len);
  if (!copy) {
    touch(arm, NULL);
    errno = saved;
    return real(fd, m, flags);
  }
  memcpy(copy, m->msg_iov[b].iov_base, len);
  copy[0] ^= 0x10;
  struct iovec iov[kMaxIov];
  memcpy(iov, m->msg_iov, m->msg_iovlen * sizeof iov[0]);
  iov[b].iov_base = copy;
  struct msghdr mm = *m;
  mm.msg_iov = iov;
  errno = saved;
  const ssize_t r = real(fd, &mm, flags);
  const int err = errno;
  free(copy);
  if (r > 0 && (size_t)r > before) {
    char sent[128];
    snprintf(sent, sizeof sent, "flipped bit 4 of byte 0 of a %zu-byte payload iovec\n", len);
    char path[4096];
    snprintf(path, sizeof path, "%s.sent", arm);
    touch(path, sent);
  } else {
    touch(arm, NULL);  /* that byte did not go: arm again */
  }
  errno = err;
  return r;
}
