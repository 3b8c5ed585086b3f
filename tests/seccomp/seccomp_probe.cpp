// seccomp_probe NAME: issues one raw syscall chosen so that the result tells
// whether a seccomp filter let it through, and reports it.
//
// stdout: "probe=NAME result=ok" or "probe=NAME result=errno errno=EPERM (N)"
// exit:   0 when the syscall succeeded, else the errno value; 255 on bad usage.
//
// Arguments are picked so an unfiltered call fails harmlessly or succeeds
// without side effects, and a filtered one shows the filter's errno:
//   pidfd_getfd(-1, 0, 0)  -> EBADF when allowed, EPERM when filtered
//   clone3(NULL, 0)        -> EINVAL when allowed, ENOSYS from docker-default
#include <fcntl.h>
#include <linux/futex.h>
#include <linux/io_uring.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string_view>

namespace {

constexpr int kExitUsage = 255;

long probe_pidfd_getfd() { return syscall(SYS_pidfd_getfd, -1, 0, 0); }
long probe_pidfd_open() { return syscall(SYS_pidfd_open, getpid(), 0); }
long probe_clone3() { return syscall(SYS_clone3, nullptr, 0); }

long probe_io_uring_setup() {
  io_uring_params params{};
  return syscall(SYS_io_uring_setup, 1, &params);
}

long probe_futex() {
  int word = 0;
  return syscall(SYS_futex, &word, FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
}

long probe_mmap() {
  const long r =
      syscall(SYS_mmap, nullptr, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return r == -1 ? -1 : 0;
}

long probe_memfd_create() { return syscall(SYS_memfd_create, "seccomp_probe", MFD_CLOEXEC); }

// fallocate/ftruncate need a file: a memfd, made with libc (so a filtered
// memfd_create shows up as that syscall's errno, not as a crash).
long with_memfd(long (*op)(int)) {
  const int fd = memfd_create("seccomp_probe", MFD_CLOEXEC);
  return fd < 0 ? -1 : op(fd);
}

long probe_fallocate() {
  return with_memfd([](int fd) { return syscall(SYS_fallocate, fd, 0, 0L, 4096L); });
}

long probe_ftruncate() {
  return with_memfd([](int fd) { return syscall(SYS_ftruncate, fd, 4096L); });
}

long probe_openat() { return syscall(SYS_openat, AT_FDCWD, "/dev/null", O_RDONLY | O_CLOEXEC); }
long probe_eventfd2() { return syscall(SYS_eventfd2, 0, EFD_CLOEXEC); }
long probe_socket_unix() { return syscall(SYS_socket, AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0); }

// AF_VSOCK (40) is the one family docker-default denies.
long probe_socket_vsock() { return syscall(SYS_socket, AF_VSOCK, SOCK_STREAM | SOCK_CLOEXEC, 0); }

// Reads a byte of our own memory.
long probe_process_vm_readv() {
  char src = 'x', dst = 0;
  iovec local{&dst, 1}, remote{&src, 1};
  return syscall(SYS_process_vm_readv, getpid(), &local, 1, &remote, 1, 0);
}

struct Probe {
  std::string_view name;
  long (*run)();
};

constexpr Probe kProbes[] = {
    {"pidfd_getfd", probe_pidfd_getfd},
    {"pidfd_open", probe_pidfd_open},
    {"io_uring_setup", probe_io_uring_setup},
    {"clone3", probe_clone3},
    {"futex", probe_futex},
    {"mmap", probe_mmap},
    {"memfd_create", probe_memfd_create},
    {"fallocate", probe_fallocate},
    {"ftruncate", probe_ftruncate},
    {"openat", probe_openat},
    {"eventfd2", probe_eventfd2},
    {"socket_unix", probe_socket_unix},
    {"socket_vsock", probe_socket_vsock},
    {"process_vm_readv", probe_process_vm_readv},
};

int usage() {
  std::fprintf(stderr, "usage: seccomp_probe NAME\nNAME is one of:");
  for (const Probe& p : kProbes)
    std::fprintf(stderr, " %.*s", static_cast<int>(p.name.size()), p.name.data());
  std::fprintf(stderr, "\n");
  return kExitUsage;
}

int report(std::string_view name, long ret, int err) {
  const int n = static_cast<int>(name.size());
  if (ret != -1) {
    std::printf("probe=%.*s result=ok\n", n, name.data());
    return 0;
  }
  const char* ename = strerrorname_np(err);
  std::printf("probe=%.*s result=errno errno=%s (%d)\n", n, name.data(), ename ? ename : "?", err);
  return err;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) return usage();
  const std::string_view name = argv[1];
  for (const Probe& p : kProbes) {
    if (p.name != name) continue;
    errno = 0;
    const long ret = p.run();
    const int err = errno;
    const int rc = report(name, ret, err);
    std::fflush(stdout);
    return rc;
  }
  std::fprintf(stderr, "seccomp_probe: unknown probe \"%s\"\n", argv[1]);
  return usage();
}
