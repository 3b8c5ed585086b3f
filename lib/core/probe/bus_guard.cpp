// The probe's SIGBUS guard (bus_guard.hpp): the handler, the hook and the
// public install_bus_guard / guarded_copy / set_bus_hook of
// shmcast/probe.hpp. Process-wide: the handler serves every thread; the
// jump target is per thread.
#include "probe/bus_guard.hpp"

#include <signal.h>
#include <unistd.h>

#include <cstring>

#include "shmcast/probe.hpp"

namespace shmcast::detail::probe_impl {

namespace P = shmcast::probe;

thread_local sigjmp_buf* t_jump = nullptr;

namespace {

std::atomic<P::BusHook> g_bus_hook{nullptr};

void on_sigbus(int, siginfo_t*, void*) {
  sigjmp_buf* j = t_jump;
  if (j != nullptr) siglongjmp(*j, 1);
  if (P::BusHook hook = g_bus_hook.load(std::memory_order_relaxed)) hook();
  static const char msg[] = "shmcast: a region file was truncated while it was mapped (SIGBUS); nothing was changed\n";
  (void)!::write(STDERR_FILENO, msg, sizeof msg - 1);
  ::_exit(1);
}

}  // namespace

bool guarded_copy(void* dst, const void* src, std::size_t n) noexcept {
  return guarded([&] { std::memcpy(dst, src, n); });
}

}  // namespace shmcast::detail::probe_impl

namespace shmcast::probe {

void install_bus_guard() {
  struct sigaction sa {};
  sa.sa_sigaction = detail::probe_impl::on_sigbus;
  sa.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGBUS, &sa, nullptr);
}

bool guarded_copy(void* dst, const void* src, std::size_t n) noexcept {
  return detail::probe_impl::guarded_copy(dst, src, n);
}

void set_bus_hook(BusHook hook) noexcept { detail::probe_impl::g_bus_hook.store(hook, std::memory_order_relaxed); }

}  // namespace shmcast::probe
