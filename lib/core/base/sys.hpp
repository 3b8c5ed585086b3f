// System calls: the one EINTR rule. A call that a signal interrupts before
// it did anything is made again, with the same arguments; every other result
// (success, another error, a short read or write) goes back to the caller,
// errno intact.
//
// For calls of the -1-and-errno convention (open, read, write, pread,
// pwrite, fcntl, ...). Calls that return the error number instead
// (posix_fallocate) or -errno in a completion (io_uring) keep their own
// check where they are made.
#pragma once

#include <cerrno>

namespace shmcast::detail {

// Calls f() until it does not fail with EINTR; returns its last result.
template <class F>
auto retry_eintr(F&& f) -> decltype(f()) {
  for (;;) {
    auto r = f();
    if (!(r == -1 && errno == EINTR)) return r;
  }
}

}  // namespace shmcast::detail
