// Thin helpers over the UCP API: a context, workers with a wake-up file
// descriptor (and, optionally, a progress thread of their own), socket
// addresses and memory registration. Called from the relay's network thread,
// except a threaded worker's own progress thread.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "shmcast/relay.hpp"

namespace shmcast::relay::ucx {

// Throws Error(kSystem) naming `what` when `st` is not UCS_OK.
void check(ucs_status_t st, const std::string& what);
std::string status_str(ucs_status_t st);

class Context {
 public:
  // Tag matching, streams (a data connection's proof) and wake-up; UCX_* environment variables
  // apply. `net_devices` not empty: UCX's NET_DEVICES, unless the
  // environment sets UCX_NET_DEVICES.
  explicit Context(const std::string& net_devices = "");
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
  // Cancels a request this worker may complete at the same moment on its
  // progress thread. UCX (1.13) checks a request's completion before it
  // takes the worker's lock in ucp_request_cancel(), and asserts when the
  // request completed in between: progress and cancel are serialized here,
  // and `still_pending` (read under that lock) says whether to cancel.
  template <class F>
  void cancel(void* req, F still_pending) {
    std::lock_guard<std::mutex> g(progress_mu_);
    if (still_pending()) ucp_request_cancel(h_, req);
  }
  // Runs f() while no progress runs (so no callback of this worker: a
  // listener's connection handler runs inside progress too).
  template <class F>
  void locked(F f) {
    std::lock_guard<std::mutex> g(progress_mu_);
    f();
  }
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
  std::mutex progress_mu_;  // held around ucp_worker_progress and cancel()
  std::string failure_;
  std::thread t_;
};

// The network devices a relay lets UCX use by default: the interfaces that
// carry its listen address and the address it reaches its upstream from,
// plus every RDMA device (whose transports open no TCP port), so that UCX's
// own TCP listeners bind nowhere else. `devices` is empty when nothing is
// restricted (a wildcard listen address, an address on no interface, an
// upstream that does not resolve yet); `why` then says why.
struct NetDevices {
  std::string devices, why;
};
NetDevices relay_net_devices(const std::string& listen, const std::string& from);
// The pure part: interfaces (name, IPv4 address in network order), the
// local addresses wanted, RDMA device:port names. Empty (and `why`) when a
// wanted address is on no interface.
std::string pick_devices(const std::vector<std::pair<std::string, in_addr_t>>& ifs,
                         const std::vector<in_addr_t>& wanted, const std::vector<std::string>& rdma, std::string* why);

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
