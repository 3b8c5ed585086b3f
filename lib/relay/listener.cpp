// The relay's downstream side, on the network thread: the control channels'
// listening socket, accepting connections (Admission: how many handshakes
// may be pending), the key handshake, each downstream's UCX data listener
// and data endpoint, and dropping downstreams.
#include "relay_impl.hpp"

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "base/sys.hpp"

namespace shmcast::relay {

using detail::retry_eintr;

// The bytes of a control message; `session` empty: unauthenticated
// (handshake), else with its sequence number and MAC.
std::vector<std::uint8_t>& Relay::Impl::seal(Writer& msg, const std::string& session, std::uint64_t* seq,
                                             std::string_view dir) {
  auto& b = msg.buffer();
  if (!session.empty()) {
    msg.set_seq((*seq)++);
    const wire::Mac m = auth::message_mac(session, dir, b);
    b.insert(b.end(), m.begin(), m.end());
  }
  return b;
}

// Sends on a downstream's control channel (dropping it when it reads
// nothing: more than kMaxCtrlOut unread).
void Relay::Impl::send_down(Down& d, Writer& msg, bool authenticated) {
  if (d.state == Down::kClosing) return;
  if (!d.sock.send(seal(msg, authenticated ? d.session : std::string(), &d.send_seq, "down"), kMaxCtrlOut)) {
    drop_down(d, "reads none of its control messages (" + std::to_string(d.sock.pending_out()) + " bytes unread)");
    return;
  }
  if (!d.sock.flush()) drop_down(d, "control channel: " + d.sock.error());
}

// Downstream relays connect to the relay's own TCP socket (not to a UCX
// listener: UCX 1.13's TCP connection manager dies of an assertion when
// connections come and go fast, which any peer can make happen, and a
// UCX listener bound messages to ids its peers wrote). The key handshake
// and every control message travel on that connection; once the
// downstream proved the key, this relay opens a UCX listener for that
// connection's chunk bytes (on_up_message, accept_data_conns).
void Relay::Impl::start_listener() {
  if (o.listen.empty()) return;
  const Address a = parse_address(o.listen);
  socklen_t len = 0;
  const sockaddr_storage ss = ucx::resolve(a, true, &len);
  listen_fd = ctrl_listen(ss, len, a.str());
  sockaddr_storage bound{};
  socklen_t blen = sizeof bound;
  ::getsockname(listen_fd, reinterpret_cast<sockaddr*>(&bound), &blen);
  listen_str = a.host + ":" + std::to_string(ucx::sockaddr_port(bound));
  if (a.host.find(':') != std::string::npos)
    listen_str = "[" + a.host + "]:" + std::to_string(ucx::sockaddr_port(bound));
  log("listening on " + listen_str + " for downstream relays");
  status_dirty = true;
}

// The address of a peer, without the port.
std::string Relay::Impl::source_of(const sockaddr_storage& ss) {
  const std::string s = ucx::sockaddr_str(ss);
  const auto colon = s.rfind(':');
  return colon == std::string::npos ? s : s.substr(0, colon);
}

void Relay::Impl::accept_conns() {
  if (listen_fd < 0 || mono_ns() < accept_paused_until_ns) return;
  for (int i = 0; i < 256; ++i) {  // then the rest of the loop's work
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    const int fd = retry_eintr(
        [&] { return ::accept4(listen_fd, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_NONBLOCK | SOCK_CLOEXEC); });
    if (fd < 0) {
      if (errno == ECONNABORTED) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      const int err = errno;
      rlog.log("accept", std::string("accept: ") + std::strerror(err), mono_ns());
      // Out of descriptors (or kernel memory): the connection stays in the
      // backlog and the socket stays readable, so polling it would spin.
      // It is left alone for 100 ms (wait_events), while connections that
      // end free descriptors.
      if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM)
        accept_paused_until_ns = mono_ns() + 100'000'000;
      return;
    }
    CtrlSocket sock(fd);
    const std::string peer = ucx::sockaddr_str(ss), src = source_key(ss);
    if (stopping) continue;  // closed
    // At most o.max_pending handshakes at once, o.max_pending_per_source
    // from one address (an IPv6 /64): a newcomer beyond either takes the
    // place of an older one, which is closed (Admission; docs/relay.md,
    // "Limits").
    const std::uint64_t id = next_conn_id(&next_conn, [this](std::uint64_t id) { return downs.count(id) != 0; });
    std::uint64_t evict = 0;
    const Admission::Verdict verdict = admission.admit(src, id, mono_ns(), &evict);
    if (verdict == Admission::Verdict::kRefused) {
      ++rejected;
      status_dirty = true;
      rlog.log("reject", "connection from " + peer + " refused at once: " + std::to_string(admission.pending()) +
                             " handshakes pending (" + std::to_string(admission.pending_from(src)) +
                             " from its address; at most " + std::to_string(o.max_pending) + ", " +
                             std::to_string(o.max_pending_per_source) + " per address)",
               mono_ns());
      continue;
    }
    if (verdict == Admission::Verdict::kEvicted)
      if (auto v = downs.find(evict); v != downs.end()) {
        v->second->pending = false;  // Admission let it go already
        drop_down(*v->second, "evicted: it sent no response, and " + peer + " needs its pending slot");
      }
    ctrl_tune(fd);
    auto d = std::make_unique<Down>();
    d->id = id;
    d->sock = std::move(sock);
    d->peer = peer;
    d->source = source_of(ss);  // its exact address (its data connection must come from it)
    d->pending = true;
    d->tr.region = o.region;
    d->tr.conn = d->id;
    d->tr.server_nonce = auth::nonce();
    d->deadline_ns = mono_ns() + o.handshake_timeout.count();
    d->first_deadline_ns = mono_ns() + std::min(o.first_response_timeout, o.handshake_timeout).count();
    d->since_unix_ns = unix_ns();
    Down& dr = *d;
    downs.emplace(d->id, std::move(d));
    Writer w(Type::kChallenge);
    w.u32(wire::kProto).u64(dr.id).bytes(dr.tr.server_nonce).str(o.region);
    send_down(dr, w, false);
    rlog.log("accept", "connection " + std::to_string(dr.id) + " from " + dr.peer + ": challenge sent", mono_ns());
    status_dirty = true;
  }
}

// A downstream leaves the listener's pending handshakes (it proved the
// key, or it ends).
void Relay::Impl::leave_pending(Down& d) {
  if (!d.pending) return;
  d.pending = false;
  admission.release(d.id);
}

// Ends a downstream connection: its control channel closes once what was
// queued on it went out (at most 1 s: a refusal reaches its peer), its
// data endpoint closes (`force`: at once, cancelling sends in flight).
void Relay::Impl::drop_down(Down& d, const std::string& why, bool force) {
  if (d.state == Down::kClosing) return;
  const std::string line = "downstream " + std::to_string(d.id) + " (" + d.peer + ") dropped: " + why;
  // Connections that never proved the key are anyone's: their drops are
  // rate-limited; an authenticated downstream's always print.
  if (d.state == Down::kHandshake) {
    ++unproven;
    rlog.log("drop", line, mono_ns());
  } else {
    log(line);
  }
  if (d.state == Down::kActive) {
    std::lock_guard<std::mutex> g(smu);
    st.last_error = "downstream " + d.peer + ": " + why;
  }
  leave_pending(d);
  close_data_listener(d);
  d.state = Down::kClosing;
  d.closing_ns = mono_ns();
  if (force || !d.sock.want_write()) d.sock.close();
  if (d.ep && !d.ep_closing) {
    d.ep_closing = true;
    close_ep(lw->get(), d.ep, force, d.id);
  }
  status_dirty = true;
}

void Relay::Impl::refuse(Down& d, const std::string& why) {
  ++refused;
  Writer w(Type::kRefused);
  w.str(why);
  send_down(d, w, false);
  // A connection that never proved the key is anyone's: what it sent (a
  // region name) goes to the rate-limited log, never to the status file's
  // last_error (the refused count says it happened).
  status_dirty = true;
  drop_down(d, "refused: " + why, false);
}

// Control channels of downstream relays: reads their messages (only the
// handshake response is expected), writes what is queued, ends closed
// ones. A message on a connection's socket is that connection's: a check
// it fails ends that connection only.
void Relay::Impl::service_downs() {
  const std::int64_t now = mono_ns();
  for (auto it = downs.begin(); it != downs.end();) {
    Down& d = *it->second;
    if (d.state == Down::kClosing) {
      if (d.sock.is_open() && (!d.sock.want_write() || !d.sock.flush() || now - d.closing_ns > 1'000'000'000))
        d.sock.close();
      if (!d.sock.is_open() && d.ep == nullptr) {  // and its endpoint closed (Op::kClose)
        it = downs.erase(it);
        status_dirty = true;
        continue;
      }
      ++it;
      continue;
    }
    if (d.sock.want_write() && !d.sock.flush()) {
      drop_down(d, "control channel: " + d.sock.error());
      ++it;
      continue;
    }
    std::vector<std::vector<std::uint8_t>> frames;
    const bool ok = d.sock.receive(wire::kHandshakeBytes, &frames, 256u << 10);
    for (auto& f : frames) {
      if (d.state == Down::kClosing) break;
      on_up_message(d, f);
    }
    if (!ok && d.state != Down::kClosing)
      drop_down(d, d.state == Down::kHandshake ? "handshake: " + d.sock.error() : d.sock.error());
    ++it;
  }
}

// A control message on downstream connection `d`: only the handshake
// response is expected.
void Relay::Impl::on_up_message(Down& d, const std::vector<std::uint8_t>& msg) {
  if (d.state != Down::kHandshake) {
    // After the handshake a downstream sends only full-sync requests,
    // authenticated with its session key, in sequence.
    std::uint64_t after = 0;
    try {
      if (msg.size() < wire::kHeaderBytes + wire::kMacBytes) throw wire::ProtocolError("message too short");
      wire::Mac got{};
      std::memcpy(got.data(), msg.data() + msg.size() - wire::kMacBytes, wire::kMacBytes);
      const wire::Mac want = auth::message_mac(
          d.session, "up", std::span<const std::uint8_t>(msg.data(), msg.size() - wire::kMacBytes));
      if (!auth::equal(got, want)) throw wire::ProtocolError("a control message fails its MAC");
      wire::Reader r(msg, true);
      if (r.seq() != d.recv_seq) throw wire::ProtocolError("a control message out of sequence (replayed?)");
      ++d.recv_seq;
      if (r.type() != Type::kWantFull)
        throw wire::ProtocolError(std::string("a ") + wire::type_name(r.type()) + " message after the handshake");
      after = r.u64();  // a full sync of a later version answers it (0: any)
      (void)r.u8();     // flags
      r.expect_done();
    } catch (const wire::ProtocolError& e) {
      drop_down(d, std::string("protocol error: ") + e.what());
      return;
    }
    ++d.want_full;
    // The source asks its region; any other relay passes it upstream.
    if (source) src_want_full.add(after);
    else want_full_up.add(after);
    wake();
    return;
  }
  try {
    wire::Reader r(msg, false);
    if (r.type() != Type::kResponse) throw wire::ProtocolError(std::string("a ") + wire::type_name(r.type()) +
                                                               " message, not a response to the challenge");
    r.bytes(&d.tr.client_nonce);
    wire::Mac proof{};
    r.bytes(&proof);
    const std::string region = r.str(256);
    r.expect_done();
    if (region != o.region) {
      refuse(d, "this relay serves region '" + o.region + "', not '" + printable(region) + "'");
      return;
    }
    if (!auth::equal(proof, auth::client_proof(o.key, d.tr))) {
      rlog.log("refuse", "downstream " + d.peer + " did not prove the key: refused", mono_ns());
      refuse(d, "wrong key (the downstream's SHMCAST_RELAY_KEY / --key-file differs from this relay's)");
      return;
    }
    // The key is proven: a UCX listener for this connection's chunk
    // bytes, on the address the downstream reached, any port. It takes
    // one connection, from the downstream's address, and closes.
    sockaddr_storage here{};
    socklen_t hlen = sizeof here;
    if (::getsockname(d.sock.fd(), reinterpret_cast<sockaddr*>(&here), &hlen) != 0) {
      drop_down(d, std::string("getsockname: ") + std::strerror(errno));
      return;
    }
    if (here.ss_family == AF_INET) reinterpret_cast<sockaddr_in*>(&here)->sin_port = 0;
    else if (here.ss_family == AF_INET6) reinterpret_cast<sockaddr_in6*>(&here)->sin6_port = 0;
    d.larg = std::make_unique<ListenArg>(ListenArg{&sink, d.id});
    ucp_listener_params_t lp{};
    lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&here);
    lp.sockaddr.addrlen = hlen;
    lp.conn_handler.cb = on_data_conn;
    lp.conn_handler.arg = d.larg.get();
    if (const ucs_status_t ls = ucp_listener_create(lw->get(), &lp, &d.listener); ls != UCS_OK) {
      d.listener = nullptr;
      drop_down(d, "cannot open its data listener: " + ucx::status_str(ls));
      return;
    }
    ucp_listener_attr_t la{};
    la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    std::string data_addr;
    if (ucp_listener_query(d.listener, &la) == UCS_OK) data_addr = ucx::sockaddr_str(la.sockaddr);
    d.session = auth::session_key(o.key, d.tr);
    d.tag_base = auth::data_tag_base(d.session);
    Writer w(Type::kWelcome);
    w.bytes(auth::server_proof(o.key, d.tr)).u64(source ? src_slot_bytes : up.chunk_bytes);
    w.u32(o.checksums ? wire::kFlagChecksums : 0).str(data_addr);
    send_down(d, w);
    if (d.state == Down::kClosing) return;
    leave_pending(d);
    d.state = Down::kJoining;  // until its data connection arrives (same deadline)
    status_dirty = true;
  } catch (const wire::ProtocolError& e) {
    drop_down(d, e.what());
  }
}

// Closes a downstream's data listener; connection requests it filed that
// are not taken yet are refused first. Its connection handler runs inside
// the worker's progress: with progress held off, none is filed meanwhile.
void Relay::Impl::close_data_listener(Down& d) {
  if (!d.listener) return;
  lw->locked([&] {
    std::vector<ucp_conn_request_h> mine;
    {
      std::lock_guard<std::mutex> g(sink.mu);
      for (auto it = sink.conns.begin(); it != sink.conns.end();) {
        if (it->first == d.id) {
          mine.push_back(it->second);
          it = sink.conns.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (ucp_conn_request_h r : mine) ucp_listener_reject(d.listener, r);
    ucp_listener_destroy(d.listener);
  });
  d.listener = nullptr;
}

// Data connections: the first from a downstream's own address is its
// data endpoint; then its listener closes and it joins the next sync.
void Relay::Impl::accept_data_conns() {
  std::vector<std::pair<std::uint64_t, ucp_conn_request_h>> list;
  {
    std::lock_guard<std::mutex> g(sink.mu);
    list.swap(sink.conns);
  }
  for (std::size_t i = 0; i < list.size(); ++i) {
    const auto [id, req] = list[i];
    if (req == nullptr) continue;  // rejected below, with its listener's first
    auto it = downs.find(id);
    if (it == downs.end() || !it->second->listener) continue;  // its listener is gone, and the request with it
    Down& d = *it->second;
    ucp_conn_request_attr_t attr{};
    attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
    const bool known = ucp_conn_request_query(req, &attr) == UCS_OK;
    if (d.state != Down::kJoining || d.ep != nullptr || !known || source_of(attr.client_address) != d.source) {
      ucp_listener_reject(d.listener, req);
      rlog.log("reject", "data connection for downstream " + std::to_string(d.id) + " from " +
                             (known ? ucx::sockaddr_str(attr.client_address) : std::string("?")) +
                             " refused (not from " + d.source + ", or not awaited)",
               mono_ns());
      continue;
    }
    d.arg = std::make_unique<EpArg>(EpArg{&sink, d.id, 0});
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.conn_request = req;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = ep_error_cb;
    ep.err_handler.arg = d.arg.get();
    const ucs_status_t st = ucp_ep_create(lw->get(), &ep, &d.ep);
    // Later requests for this connection in the same batch are refused
    // before its listener goes (close_data_listener refuses only those
    // still in the sink): each request is answered, none left dangling.
    for (std::size_t k = i + 1; k < list.size(); ++k)
      if (list[k].first == d.id && list[k].second != nullptr) {
        ucp_listener_reject(d.listener, list[k].second);
        list[k].second = nullptr;
        rlog.log("reject", "data connection for downstream " + std::to_string(d.id) +
                               " refused (it has its data connection)",
                 mono_ns());
      }
    close_data_listener(d);
    if (st != UCS_OK) {
      d.ep = nullptr;
      drop_down(d, "cannot accept its data connection: " + ucx::status_str(st));
      continue;
    }
    d.state = Down::kReady;
    log("downstream " + std::to_string(d.id) + " (" + d.peer + ") authenticated; it joins at the next sync");
    status_dirty = true;
  }
}

// No tagged message comes to the downstream connections' worker: anything
// there is junk (a peer that reached UCX's own port). Drained, so that it
// does not pile up in UCX's unexpected queue.
void Relay::Impl::drain_lw_junk() {
  while (lw && lw_junk_busy < kJunkBatch) {  // a batch per pass
    ucp_tag_recv_info_t info{};
    ucp_tag_message_h m = ucp_tag_probe_nb(lw->get(), 0, 0, 1, &info);
    if (m == nullptr) return;
    Op* op = new_op(Op::kJunkRecv, lw->get());
    op->msg.resize(64);  // a larger one is received truncated (an error), and dropped all the same
    ucp_request_param_t p = recv_param(op);
    ++lw_junk_busy;
    track(op, ucp_tag_msg_recv_nbx(lw->get(), op->msg.data(), op->msg.size(), m, &p));
    ++ignored;
    status_dirty = true;
    rlog.log("ignored",
             "a tagged message of " + std::to_string(info.length) + " bytes on the downstream worker: dropped",
             mono_ns());
  }
}

}  // namespace shmcast::relay
