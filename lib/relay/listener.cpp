// The relay's downstream side, on the network thread: the control channels'
// listening socket, accepting connections (Admission: how many handshakes
// may be pending), the key handshake, the UCX data listener and the proof
// of the session key on each data connection, and dropping downstreams.
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
// downstream proved the key, it opens its data connection to the relay's
// data listener and proves the session key there (accept_data_conns).
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
  start_data_listener(ss, len);
  status_dirty = true;
}

// The data listener: on the --listen address, any free port, for the
// relay's life (relay_impl.hpp says why it is never closed earlier).
void Relay::Impl::start_data_listener(const sockaddr_storage& at, socklen_t len) {
  sockaddr_storage here = at;
  if (here.ss_family == AF_INET) reinterpret_cast<sockaddr_in*>(&here)->sin_port = 0;
  else if (here.ss_family == AF_INET6) reinterpret_cast<sockaddr_in6*>(&here)->sin6_port = 0;
  data_larg = std::make_unique<ListenArg>(ListenArg{&sink});
  ucp_listener_params_t lp{};
  lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&here);
  lp.sockaddr.addrlen = len;
  lp.conn_handler.cb = on_data_conn;
  lp.conn_handler.arg = data_larg.get();
  if (const ucs_status_t ls = ucp_listener_create(lw->get(), &lp, &data_listener); ls != UCS_OK) {
    data_listener = nullptr;
    throw Error(Errc::kSystem, "cannot open the data listener on " + ucx::sockaddr_str(here) + ": " +
                                   ucx::status_str(ls));
  }
  ucp_listener_attr_t la{};
  la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  if (ucp_listener_query(data_listener, &la) != UCS_OK) {
    ucp_listener_destroy(data_listener);  // just opened: no connection is under way on it yet
    data_listener = nullptr;
    throw Error(Errc::kSystem, "cannot query the data listener's port (UCX)");
  }
  data_port = ucx::sockaddr_port(la.sockaddr);
  log("data connections on " + ucx::sockaddr_str(la.sockaddr) + " (each proves its session key)");
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
    // The key is proven: the welcome names the data listener, on the
    // address the downstream reached. Its data connection must prove the
    // session key there before any chunk goes to it (accept_data_conns).
    sockaddr_storage here{};
    socklen_t hlen = sizeof here;
    if (::getsockname(d.sock.fd(), reinterpret_cast<sockaddr*>(&here), &hlen) != 0) {
      drop_down(d, std::string("getsockname: ") + std::strerror(errno));
      return;
    }
    if (here.ss_family == AF_INET) reinterpret_cast<sockaddr_in*>(&here)->sin_port = htons(data_port);
    else if (here.ss_family == AF_INET6) reinterpret_cast<sockaddr_in6*>(&here)->sin6_port = htons(data_port);
    const std::string data_addr = ucx::sockaddr_str(here);
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

// Connection requests to the data listener. Each gets an endpoint, which
// proves nothing yet: a stream receive for its proof (on_data_proof) and a
// deadline (--handshake-timeout; --first-response-timeout when no
// downstream from its address awaits a data connection, so its proof
// cannot succeed), and no chunk goes to it. At most
// --max-pending-per-source unproven ones per address and --max-pending in
// all: a newcomer beyond a cap closes the oldest of its address (else the
// oldest of all), so a keyless peer on the downstream's own address cannot
// keep it out by connecting first and holding on.
// None is rejected (ucp_listener_reject): UCX 1.13 arms the rejected
// socket for writing while its async context is blocked, files the event
// as missed, closes the socket once the rejection is out, and then hands
// that stale event to the next connection accepted on the same descriptor
// number, which dies of an assertion (tcp_sockcm_ep.c:416; a keyless peer
// opening a few connections at once got there within a few hundred
// rejections). Closing an endpoint only shuts the socket down for writing.
void Relay::Impl::accept_data_conns() {
  std::vector<ucp_conn_request_h> list;
  {
    std::lock_guard<std::mutex> g(sink.mu);
    list.swap(sink.conns);
  }
  const std::int64_t now = mono_ns();
  for (ucp_conn_request_h req : list) {
    ucp_conn_request_attr_t attr{};
    attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
    const bool known = ucp_conn_request_query(req, &attr) == UCS_OK;
    const std::string peer = known ? ucx::sockaddr_str(attr.client_address) : std::string("?");
    const std::string src = known ? source_of(attr.client_address) : std::string();
    const bool awaited = known && std::any_of(downs.begin(), downs.end(), [&](const auto& kv) {
                           return kv.second->state == Down::kJoining && kv.second->ep == nullptr &&
                                  kv.second->source == src;
                         });
    // The caps: the oldest unproven connection of its address (or of all)
    // makes room.
    std::size_t from_src = 0, open = 0;
    std::uint64_t oldest_src = 0, oldest = 0;
    for (const auto& [id, dc] : data_conns) {
      if (dc.closing) continue;
      ++open;
      if (oldest == 0) oldest = id;  // ids grow: the first is the oldest
      if (dc.source == src && from_src++ == 0) oldest_src = id;
    }
    if (from_src >= o.max_pending_per_source)
      close_data_conn(oldest_src, "evicted: a newer data connection from its address needs its place");
    else if (open >= o.max_pending)
      close_data_conn(oldest, "evicted: a newer data connection needs its place");
    const std::uint64_t id = kDataConnBit | next_data_conn++;
    DataConn dc;
    dc.arg = std::make_unique<EpArg>(EpArg{&sink, id, 0});
    dc.source = src;
    dc.peer = peer;
    dc.since_ns = now;
    dc.deadline_ns = now + (awaited ? o.handshake_timeout : std::min(o.handshake_timeout, o.first_response_timeout)).count();
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.conn_request = req;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = ep_error_cb;
    ep.err_handler.arg = dc.arg.get();
    if (const ucs_status_t st = ucp_ep_create(lw->get(), &ep, &dc.ep); st != UCS_OK) {
      rlog.log("reject", "data connection from " + peer + " not accepted: " + ucx::status_str(st), now);
      continue;
    }
    DataConn& mine = data_conns.emplace(id, std::move(dc)).first->second;
    // Its proof: the first wire::kDataProofBytes of its stream.
    Op* op = new_op(Op::kProofRecv, lw->get());
    op->conn = id;
    op->msg.resize(wire::kDataProofBytes);
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    p.cb.recv_stream = op_stream_recv_cb;
    p.user_data = op;
    p.flags = UCP_STREAM_RECV_FLAG_WAITALL;
    track(op, ucp_stream_recv_nbx(mine.ep, op->msg.data(), op->msg.size(), &op->length, &p));
  }
  // Deadlines, for connections that never sent their proof.
  for (auto& [id, dc] : data_conns)
    if (!dc.closing && now > dc.deadline_ns)
      close_data_conn(id, "no proof of the session key within " +
                              std::to_string((dc.deadline_ns - dc.since_ns) / 1000000) + " ms");
}

// A data connection's proof arrived (or its receive ended): a connection
// id and data_proof(session, id). It becomes that downstream's data
// endpoint only when the downstream proved the key on its control
// channel, awaits its data connection, and is at the connection's address.
void Relay::Impl::on_data_proof(Op* op) {
  auto it = data_conns.find(op->conn);
  if (it == data_conns.end() || it->second.closing) return;
  DataConn& dc = it->second;
  if (op->status != UCS_OK || op->length != wire::kDataProofBytes) {
    close_data_conn(op->conn, op->status != UCS_OK ? "ended before its proof (" + ucx::status_str(op->status) + ")"
                                                   : "sent a short proof");
    return;
  }
  std::uint64_t conn = 0;
  wire::Mac got{};
  std::memcpy(&conn, op->msg.data(), 8);
  std::memcpy(got.data(), op->msg.data() + 8, wire::kMacBytes);
  auto d_it = downs.find(conn);
  if (d_it == downs.end() || d_it->second->state != Down::kJoining || d_it->second->ep != nullptr ||
      d_it->second->source != dc.source || !auth::equal(got, auth::data_proof(d_it->second->session, conn))) {
    close_data_conn(op->conn, "did not prove the session key of a downstream from its address that awaits it");
    return;
  }
  Down& d = *d_it->second;
  d.ep = dc.ep;
  {
    std::lock_guard<std::mutex> g(sink.mu);  // its error handler reads the id under this lock
    dc.arg->conn = d.id;
  }
  d.arg = std::move(dc.arg);
  data_conns.erase(it);
  d.state = Down::kReady;
  log("downstream " + std::to_string(d.id) + " (" + d.peer + ") authenticated, its data connection too; it joins "
      "at the next sync");
  status_dirty = true;
}

// Closes an unproven data connection; its records go once its endpoint is
// closed (Op::kClose), its proof's receive is cancelled with it.
void Relay::Impl::close_data_conn(std::uint64_t id, const std::string& why) {
  auto it = data_conns.find(id);
  if (it == data_conns.end() || it->second.closing) return;
  it->second.closing = true;
  ++unproven;
  status_dirty = true;
  rlog.log("drop", "data connection from " + it->second.peer + " closed: " + why, mono_ns());
  close_ep(lw->get(), it->second.ep, true, id);
}

// At shutdown, with lw's progress stopped (no connection handler runs):
// the requests not taken are rejected, then the listener goes, right
// before lw itself.
void Relay::Impl::stop_data_listener() {
  if (!data_listener) return;
  std::vector<ucp_conn_request_h> left;
  {
    std::lock_guard<std::mutex> g(sink.mu);
    left.swap(sink.conns);
  }
  for (ucp_conn_request_h r : left) ucp_listener_reject(data_listener, r);
  ucp_listener_destroy(data_listener);
  data_listener = nullptr;
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
