// Thin helpers over the UCP API: a context, workers with a wake-up file
// descriptor, socket addresses and memory registration. Everything here is
// called from the relay's network thread only.
#pragma once

#include <sys/socket.h>
#include <ucp/api/ucp.h>

#include <cstdint>
#include <string>

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
  explicit Worker(const Context& ctx);
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;
  ucp_worker_h get() const { return h_; }
  int fd() const { return efd_; }
  // Progresses until nothing more happens; returns how many events ran.
  unsigned progress();
  // Arms the wake-up fd: true when it may be slept on, false when events
  // are pending (progress again first).
  bool arm();

 private:
  ucp_worker_h h_ = nullptr;
  int efd_ = -1;
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
