// Thin helpers over the UCP API: a context, workers with a wake-up file
// descriptor (and, optionally, a progress thread of their own), socket
// addresses and memory registration. Called from the relay's network thread,
// except a threaded worker's own progress thread.
#pragma once

#include <sys/socket.h>
#include <ucp/api/ucp.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>

#include "shmcast/relay.hpp"

namespace shmcast::relay::ucx {

// Throws Error(kSystem) naming `what` when `st` is not UCS_OK.
void check(ucs_status_t st, const std::string& what);
std::string status_str(ucs_status_t st);

class Context {
 public:
  Context();  // tag matching + wake-up; UCX_* environment variables apply
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;
  ucp_context_h get() const { return h_; }

 private:
  ucp_context_h h_ = nullptr;
};

class Worker {
 public:
  // threaded: UCS_THREAD_MODE_MULTI, for start_progress().
  explicit Worker(const Context& ctx, bool threaded = false);
  ~Worker();  // stop_progress(), then destroys the worker
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;
  ucp_worker_h get() const { return h_; }
  int fd() const { return efd_; }
  // Progresses until nothing more happens; returns how many events ran.
  unsigned progress();
  // Arms the wake-up fd: true when it may be slept on, false when events
  // are pending (progress again first).
  bool arm();

  // Threaded workers: a thread that progresses the worker (sleeping on its
  // fd when idle) and calls on_events() after every progress that ran
  // something. With TCP, UCX copies to and from the sockets inside
  // progress: this moves that work off the relay's network thread, one
  // thread per worker (per direction on a middle relay). UCX callbacks then
  // run on this thread. The network thread calls kick() after posting
  // requests so that a sleeping progress thread picks them up.
  void start_progress(std::function<void()> on_events);
  void stop_progress();
  void kick();
  bool threaded() const { return threaded_; }
  // The progress thread's error, if it stopped on one ("" otherwise).
  std::string failure() const;

 private:
  ucp_worker_h h_ = nullptr;
  int efd_ = -1;
  bool threaded_ = false;
  int stop_fd_ = -1;
  std::atomic<bool> stop_{false}, failed_{false};
  std::string failure_;
  std::thread t_;
};

// getaddrinfo for `a` (numeric or a name); passive: for a listener.
sockaddr_storage resolve(const Address& a, bool passive, socklen_t* len);
std::string sockaddr_str(const sockaddr_storage& ss);
std::uint16_t sockaddr_port(const sockaddr_storage& ss);

// Memory registered with UCX, so RDMA transports read or write it in place.
struct Registration {
  ucp_mem_h memh = nullptr;
  void* base = nullptr;
  std::size_t bytes = 0;
};
Registration register_memory(ucp_context_h ctx, void* base, std::size_t bytes);
void unregister_memory(ucp_context_h ctx, Registration* r);

}  // namespace shmcast::relay::ucx
