// shmcast relay: the network thread (UCX: listener, connections, chunk
// fan-out), the source reader (a Consumer of the source region, sending
// slots in place) and the region writer (the Producer of a downstream
// node's region). docs/relay.md describes the protocol and the faults.
//
// This file: Relay::Impl's lifecycle (construction, run(), shutdown) and
// the network thread's main loop and timers; relay_impl.hpp says where the
// rest is.
#include "relay_impl.hpp"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace shmcast::relay {

Relay::Impl::Impl(RelayOptions opts)
    : o(std::move(opts)),
      admission(std::max<std::uint32_t>(o.max_pending, 1), std::max<std::uint32_t>(o.max_pending_per_source, 1)),
      rlog([this](const std::string& line) { log(line); }, 10, 10'000'000'000) {
  if (std::string why = validate_name(o.region); !why.empty())
    throw Error(Errc::kBadName, why + ": '" + o.region + "'");
  source = o.from.empty();
  if (source && o.listen.empty())
    throw Error(Errc::kInvalidArgument, "a source relay (no --from) needs --listen HOST:PORT for its downstream "
                                        "relays");
  if (o.key.size() < 16) throw Error(Errc::kInvalidArgument, "the relay key must have at least 16 bytes");
  if (!source) from_addr = parse_address(o.from);
  if (!source && from_addr.host.find(':') != std::string::npos) {
    socklen_t len = 0;
    (void)ucx::resolve(from_addr, false, &len);  // a numeric IPv6 address: refused now if UCX cannot take it
  }
  if (!o.listen.empty()) (void)parse_address(o.listen);
  if (o.buffers < 2) throw Error(Errc::kInvalidArgument, "buffers must be at least 2");
  if (o.fragment_bytes < wire::kMinFragBytes || o.fragment_bytes > wire::kMaxFragBytes ||
      (o.fragment_bytes & (o.fragment_bytes - 1)) != 0)
    throw Error(Errc::kInvalidArgument, "fragment_bytes must be a power of two from 64 KiB to 2 MiB, not " +
                                            std::to_string(o.fragment_bytes));
  if (o.max_pending == 0 || o.max_pending_per_source == 0)
    throw Error(Errc::kInvalidArgument, "max_pending and max_pending_per_source must be at least 1");
  if (o.max_lag.count() <= 0) throw Error(Errc::kInvalidArgument, "max_lag must be positive");
  if (o.first_response_timeout.count() <= 0)
    throw Error(Errc::kInvalidArgument, "first_response_timeout must be positive");
  status_path = o.status_path.empty() ? default_status_path(o.region) : o.status_path;
  if (status_path == "-") status_path.clear();
  first_status();
  wake_fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd < 0) throw Error(Errc::kSystem, std::string("eventfd: ") + std::strerror(errno), errno);
}

Relay::Impl::~Impl() {
  verifier.reset();  // its thread wakes the network thread through wake_fd
  // run() may have failed before shutdown(): no progress thread may
  // outlive the sink, the ops or the wake fd.
  if (lw) lw->stop_progress();
  if (up.w) up.w->stop_progress();
  for (Retired& r : retired)
    if (r.w) r.w->stop_progress();
  if (wake_fd >= 0) ::close(wake_fd);
  if (listen_fd >= 0) ::close(listen_fd);
}

void Relay::Impl::wake() noexcept {
  const std::uint64_t one = 1;
  [[maybe_unused]] ssize_t r = ::write(wake_fd, &one, sizeof one);
}

void Relay::Impl::set_fatal(const Error& e) {
  {
    std::lock_guard<std::mutex> g(fatal_mu);
    if (!fatal) fatal = e;
  }
  stopping = true;
  wake();
  wcv.notify_all();
  cmd_cv.notify_all();
}

void Relay::Impl::run() {
  if (o.limit_ucx_log) limit_ucx_log();
  // UCX's own TCP listeners (one per worker and interface) bind only to
  // the interfaces this relay was asked to use, unless UCX_NET_DEVICES
  // says otherwise.
  std::string devices;
  if (std::getenv("UCX_NET_DEVICES") == nullptr) {
    const ucx::NetDevices nd = ucx::relay_net_devices(o.listen, o.from);
    devices = nd.devices;
    if (devices.empty())
      log("UCX may use every network interface (" + nd.why + "); set UCX_NET_DEVICES to restrict it");
    else
      log("UCX uses the network devices " + devices + " (UCX_NET_DEVICES to change)");
  }
  ctx = std::make_unique<ucx::Context>(devices);
  if (!o.listen.empty()) {
    lw = new_worker();
    start_listener();
  }
  if (source) {
    reader = std::thread([this] { reader_main(); });
  } else {
    writer = std::thread([this] { writer_main(); });
    set_state("connecting");
  }
  try {
    loop();
  } catch (const Error& e) {
    set_fatal(e);
  } catch (const std::exception& e) {
    set_fatal(Error(Errc::kSystem, e.what()));
  }
  shutdown();
  std::lock_guard<std::mutex> g(fatal_mu);
  if (fatal) {
    note_error(fatal->what());
    write_status(true);
    throw *fatal;
  }
}

void Relay::Impl::loop() {
  while (!stopping) {
    unsigned events = 0;
    if (lw && !lw->threaded()) events += lw->progress();
    if (up.w && !up.w->threaded()) events += up.w->progress();
    check_workers();
    take_sink();
    const bool had = !completed.empty() || !ep_failures.empty();
    service_downs();
    accept_data_conns();
    drain_lw_junk();
    service_up();
    drain_up_junk();
    process_completions();
    process_ep_failures();
    process_completions();
    accept_conns();
    if (source) handle_cmds();
    else {
      take_writer_returns();
      try {
        process_up_ctrl();
      } catch (const wire::ProtocolError& e) {
        fail_upstream(std::string("protocol error: ") + e.what());
      }
      pump_in();
      send_want_full();
    }
    process_completions();
    if (!retired.empty()) reap_retired();
    check_timers();
    write_status(false);
    kick_workers();
    if (events == 0 && !had && completed.empty() && sink.empty() && !(source && has_cmds())) wait_events();
  }
}

void Relay::Impl::wait_events() {
  std::vector<pollfd> fds;
  fds.push_back({wake_fd, POLLIN, 0});
  if (lw && !lw->threaded()) {
    if (!lw->arm()) return;
    fds.push_back({lw->fd(), POLLIN, 0});
  }
  if (up.w && !up.w->threaded()) {
    if (!up.w->arm()) return;
    fds.push_back({up.w->fd(), POLLIN, 0});
  }
  // The control channels.
  if (listen_fd >= 0 && mono_ns() >= accept_paused_until_ns) fds.push_back({listen_fd, POLLIN, 0});
  for (const auto& [id, d] : downs)
    if (d->sock.is_open())
      fds.push_back({d->sock.fd(), static_cast<short>(POLLIN | (d->sock.want_write() ? POLLOUT : 0)), 0});
  if (up.sock.is_open())
    fds.push_back({up.sock.fd(), static_cast<short>(POLLIN | (up.sock.want_write() || !up.tcp_up ? POLLOUT : 0)), 0});
  ::poll(fds.data(), fds.size(), 50);
  if (fds[0].revents & POLLIN) {
    std::uint64_t v;
    [[maybe_unused]] ssize_t r = ::read(wake_fd, &v, sizeof v);
  }
}

bool Relay::Impl::has_cmds() {
  std::lock_guard<std::mutex> g(cmd_mu);
  return !cmds.empty();
}

void Relay::Impl::check_timers() {
  const std::int64_t now = mono_ns();
  for (auto& [id, d] : downs) {
    if (d->state == Down::kHandshake && now > d->first_deadline_ns)
      drop_down(*d, "no response to the challenge within " +
                        std::to_string(o.first_response_timeout.count() / 1000000) + " ms (--first-response-timeout)");
    if (d->state == Down::kJoining && now > d->deadline_ns) drop_down(*d, "no data connection in time");
    if (d->state == Down::kActive && d->pending_data > 0 && now - d->progress_ns > o.peer_timeout.count())
      drop_down(*d, "took no chunk for " + std::to_string(o.peer_timeout.count() / 1000000) + " ms (stalled)");
  }
  check_lag(now);
  rlog.flush(now);
  if (!source) {
    // An upstream that sends nothing mid-sync (a stalled or broken relay;
    // the source itself gives up on its trainer after 60 s) is dropped:
    // the sync aborts here and downstream, and the relay reconnects.
    if (in.plan && up.state == Up::kAuthed && now - in.progress_ns > o.upstream_timeout.count())
      fail_upstream("sent nothing for " + std::to_string(o.upstream_timeout.count() / 1000000) +
                    " ms in the middle of sync " + std::to_string(in.plan->version) + " (stalled)");
    if (up.state == Up::kIdle && now >= up.retry_at_ns && !stopping) connect_upstream();
    if ((up.state == Up::kConnecting || up.state == Up::kAwaitWelcome) && now > up.deadline_ns)
      fail_upstream("no handshake from the upstream in time");
  }
}

// Isolation (--max-lag): a downstream is dropped from the sync when it
// holds the source back, that is when it holds a fragment that another
// downstream has taken, in a place the relay needs back, and has taken no
// fragment itself for max_lag. The places: a source relay's slots (the
// source region's ring, K = 2 by default: its producer reuses each one as
// soon as every downstream has it), this node's slots (direct receive), and
// the receive buffers once none is free for the incoming sync. A downstream
// that is only slower than its siblings takes fragments all the while: it
// keeps its pace and is never dropped (the source then waits for it, so its
// siblings go at its pace while its pipeline is full). One that stops or
// crawls is dropped, reconnects and takes the next sync. Measuring lag
// against the fastest sibling (before issue 41) dropped a relay that was
// merely slower than its sibling on every sync.
void Relay::Impl::check_lag(std::int64_t now) {
  bool bufs_short = false, bufs_checked = false;
  for (auto& [id, d] : downs) {
    if ((d->state != Down::kActive && d->state != Down::kReady) || d->pend.empty()) continue;
    if (now - d->progress_ns <= o.max_lag.count()) continue;
    if (!bufs_checked) {
      bufs_short = !source && in.plan && !in.discard && in.posted < in.limit && free_buf() < 0;
      bufs_checked = true;
    }
    for (const std::uint64_t ord : d->pend) {
      const auto f = fan.find(ord);
      if (f == fan.end() || f->second.first_done_ns == 0) continue;  // nobody else has it either
      const int b = f->second.buf;
      if (!source && b < kSlotBase && !bufs_short) continue;  // a receive buffer, and others are free
      const char* what = source ? "a slot of the source region" : b >= kSlotBase ? "a slot of this node's region"
                                                                                  : "a receive buffer (none is free)";
      drop_down(*d, "held the source back: it has taken no fragment for " +
                        std::to_string((now - d->progress_ns) / 1000000) + " ms (--max-lag " +
                        std::to_string(o.max_lag.count() / 1000000) + " ms) while it holds " + what +
                        " that the other downstream relays took " +
                        std::to_string((now - f->second.first_done_ns) / 1000000) + " ms ago");
      break;
    }
  }
}

void Relay::Impl::shutdown() {
  stopping = true;
  // Abort what is in flight, close every connection, and let UCX finish
  // (or cancel) every request before memory goes away.
  if (!source && in.plan && !in.discard) {
    push_writer(WCmd{WCmd::kAbort, in.plan, -1, 0, nullptr, 0, 0, 0, "the relay is stopping"});
    forward_abort("the upstream relay is stopping");
  }
  if (source) {
    handle_cmds();
    if (out.plan) forward_abort("the source relay is stopping");
  }
  // The aborts went on the control channels: let them out (at most 1 s),
  // then close the channels and the data endpoints.
  for (auto& [id, d] : downs)
    if (d->state != Down::kClosing) drop_down(*d, "the relay is stopping", false);
  for (auto& [id, dc] : data_conns) close_data_conn(id, "the relay is stopping");
  const std::int64_t deadline = mono_ns() + 3'000'000'000;
  while ((!downs.empty() || !data_conns.empty()) && mono_ns() < deadline) {
    unsigned n = lw ? lw->progress() : 0;
    process_completions();
    service_downs();
    if (n == 0) std::this_thread::sleep_for(1ms);
  }
  if (listen_fd >= 0) ::close(listen_fd);
  listen_fd = -1;
  // The source's reader waits for its slots: what is still out, and what
  // it posted that this thread will not take any more.
  release_src_chunks();
  {
    std::lock_guard<std::mutex> g(cmd_mu);
    net_done = true;
    for (SrcCmd& c : cmds)
      if (c.release) c.release();
    cmds.clear();
  }
  cmd_cv.notify_all();
  if (reader.joinable()) reader.join();
  if (source) {
    for (auto& [base, reg] : slot_regs) ucx::unregister_memory(ctx->get(), &reg);
    slot_regs.clear();
  }
  teardown_upstream();
  while (!retired.empty()) {
    process_completions();
    reap_retired();
    if (!retired.empty()) std::this_thread::sleep_for(1ms);
  }
  // No callback may run once the ops are gone: stop the progress thread,
  // destroy the worker (which may still call back for requests it drops),
  // then free the ops. All before the writer closes this node's region:
  // a forwarding send may read from its slots until its worker is gone.
  if (lw) lw->stop_progress();
  stop_data_listener();  // right before lw (relay_impl.hpp, data_listener)
  for (auto& [p, op] : ops)
    if (op->done && op->req) {
      ucp_request_free(op->req);
      op->req = nullptr;
    }
  lw.reset();
  ops.clear();
  completed.clear();
  {
    std::lock_guard<std::mutex> g(sink.mu);
    sink.completed.clear();
  }
  if (verifier) {
    verifier.reset();  // no check may read a slot once the region can go
  }
  slot_use.stop();   // a lend waiting on a forwarding send that is gone
  {
    std::lock_guard<std::mutex> g(wmu);
    writer_exit = true;
  }
  wcv.notify_all();
  if (writer.joinable()) writer.join();
  take_writer_returns();
  if (ctx) {
    free_bufs();
    for (SlotBuf& sb : sbufs) ucx::unregister_memory(ctx->get(), &sb.b.reg);
    sbufs.clear();
  }
  ctx.reset();
  rlog.flush(mono_ns(), true);
  set_state(fatal ? "failed" : "stopped");
  write_status(true);
}

Relay::Relay(RelayOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
Relay::~Relay() = default;
void Relay::run() { impl_->run(); }
void Relay::stop() noexcept {
  impl_->stopping = true;
  impl_->wake();
}

}  // namespace shmcast::relay
