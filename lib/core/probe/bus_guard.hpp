// The probe's SIGBUS guard (shmcast/probe.hpp, "SIGBUS"): reads of a mapped
// region file that survive the file being truncated under the reader. Used
// by every part of the read-only probe (layer: probe/, beside api/) on the
// thread that probes, and by shmcast-inspect through the public
// guarded_copy().
//
// A region file can be truncated while it is mapped (someone runs
// `truncate`, or a hostile process). Touching a mapped page past the new end
// raises SIGBUS. Every read of the mapping goes through guarded_copy(), which
// turns that SIGBUS into a failed copy instead of a crash. Between sigsetjmp
// and the copy there are no C++ objects with destructors, so the long jump
// skips nothing. A SIGBUS anywhere else (library code that touches the
// mapping, as a consumer does) goes to the hook, never to the default action.
#pragma once

#include <setjmp.h>

#include <atomic>
#include <cstddef>

namespace shmcast::detail::probe_impl {

// Where the SIGBUS handler jumps while this thread is inside guarded().
extern thread_local sigjmp_buf* t_jump;

// Runs read() under the guard: false when a page faulted. read() must be a
// plain copy (memcpy, atomic loads): the long jump skips its frames.
template <class Read>
bool guarded(Read&& read) noexcept {
  sigjmp_buf jb;
  if (sigsetjmp(jb, 1) != 0) {
    t_jump = nullptr;
    return false;
  }
  t_jump = &jb;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  read();
  std::atomic_signal_fence(std::memory_order_seq_cst);
  t_jump = nullptr;
  return true;
}

bool guarded_copy(void* dst, const void* src, std::size_t n) noexcept;

}  // namespace shmcast::detail::probe_impl
