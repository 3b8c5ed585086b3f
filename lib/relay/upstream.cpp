// The relay's upstream connection (nodes with `from`), on the network
// thread: the control channel and its key handshake, the data endpoint,
// the upstream's control messages (queued for receive.cpp), junk on the
// upstream's worker, failures and reconnection with a backoff.
#include "relay_impl.hpp"

#include <poll.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <span>

namespace shmcast::relay {

// Connects the control channel (TCP) to the upstream; once both sides
// proved the key, the welcome names the address of a UCX listener the
// upstream opened for this connection's chunk bytes.
void Relay::Impl::connect_upstream() {
  ++up.gen;
  socklen_t len = 0;
  sockaddr_storage ss{};
  try {
    ss = ucx::resolve(from_addr, false, &len);
  } catch (const Error& e) {
    fail_upstream(e.what());  // a name that does not resolve yet (a Service being created): retry
    return;
  }
  up.w = new_worker();
  std::string err;
  const int fd = ctrl_connect(ss, len, &err);
  if (fd < 0) {
    fail_upstream("cannot connect to " + from_addr.str() + ": " + err);
    return;
  }
  up.sock = CtrlSocket(fd);
  up.tcp_up = false;
  up.state = Up::kConnecting;
  up.deadline_ns = mono_ns() + o.handshake_timeout.count();
  up.recv_seq = 0;
  up.send_seq = 0;
  up.session.clear();
  up.syncs_begun = 0;
  up.ctrl.clear();
  up.junk_busy = 0;
  ++up.connects;
  set_state("connecting");
}

// Ends the upstream connection: aborts the sync in progress here and
// downstream, cancels the receives, tears the worker down, and schedules a
// reconnection (`refusal`: after a refusal, more slowly).
void Relay::Impl::fail_upstream(const std::string& why, bool refusal) {
  log("upstream " + from_addr.str() + ": " + why);
  up.last_error = why;
  note_error("upstream: " + why);
  if (in.plan) {
    const std::string reason = "upstream relay lost mid-sync: " + why;
    if (!in.discard) {
      push_writer(WCmd{WCmd::kAbort, in.plan, -1, 0, nullptr, 0, 0, 0, reason});
      forward_abort(reason);
      std::lock_guard<std::mutex> g(smu);
      ++st.aborted;
    }
  }
  drop_in();
  teardown_upstream();
  up.state = Up::kIdle;
  if (refusal)
    up.backoff_ns = std::clamp<std::int64_t>(std::max<std::int64_t>(up.backoff_ns * 2, kRefusalBackoffMin),
                                             kRefusalBackoffMin,
                                             std::max<std::int64_t>(kRefusalBackoffMax, o.reconnect_max.count()));
  else
    up.backoff_ns = std::clamp<std::int64_t>(up.backoff_ns * 2, o.reconnect_min.count(), o.reconnect_max.count());
  up.retry_at_ns = mono_ns() + up.backoff_ns;
  set_state(refusal ? "refused" : "reconnecting");
}

// The upstream refused this relay, or did not prove the key. No refusal
// is proven: the upstream proves the key only to a relay that proved the
// same key first, so a peer without the key (one that took the upstream's
// port while it restarts) can send any refusal. The relay reports it (log,
// status file: upstream.refusals, upstream.last_refusal) and retries with
// a backoff, unless exit_on_refusal asks it to stop (run() throws
// kPermission: exit code 3).
void Relay::Impl::upstream_refused(const std::string& why) {
  ++up.refusals;
  up.last_refusal = why;
  status_dirty = true;
  if (o.exit_on_refusal) throw Error(Errc::kPermission, why);
  fail_upstream(why + " (not proven: a peer without the key can send this too; retrying, --exit-on-refusal to "
                      "exit instead)",
                true);
  // What the peer wrote stays in upstream.last_refusal (and the log):
  // last_error says what happened in the relay's own words.
  up.last_error = "refused this relay or did not prove the key (unproven: the peer's text is in "
                  "upstream.last_refusal); retrying";
  note_error("upstream " + from_addr.str() + ": " + up.last_error);
}

// Closes the control channel, cancels the upstream worker's receives and
// retires the worker: its requests finish through the usual completions
// (stale generation), then reap_retired() destroys it.
void Relay::Impl::teardown_upstream() {
  up.sock.close();
  if (!up.w) return;
  ucp_worker_h w = up.w->get();
  for (auto& [p, op] : ops)
    if (op->worker == w && op->req && !op->done && (op->kind == Op::kDataRecv || op->kind == Op::kJunkRecv)) {
      Op* o2 = op.get();
      up.w->cancel(op->req, [o2] { return !o2->done.load(std::memory_order_acquire); });
    }
  if (up.ep) close_ep(w, up.ep, true, 0);
  up.ep = nullptr;
  ++up.gen;
  retired.push_back(Retired{std::move(up.arg), std::move(up.w), mono_ns()});
  up.ctrl.clear();
  up.junk_busy = 0;
}

void Relay::Impl::reap_retired() {
  for (auto it = retired.begin(); it != retired.end();) {
    ucp_worker_h w = it->w->get();
    it->w->progress();
    const bool busy = std::any_of(ops.begin(), ops.end(), [&](const auto& kv) { return kv.second->worker == w; });
    if (busy && mono_ns() - it->since_ns < 10'000'000'000) {
      ++it;
      continue;
    }
    if (busy) {
      log("an ended upstream connection still has requests after 10 s: leaving its UCX worker behind");
      it->w->stop_progress();
      (void)it->w.release();
      (void)it->arg.release();
      // Its progress is stopped, so nothing lands in their buffers any
      // more: give the buffers (and this node's slots) back.
      for (auto& [p, op] : ops)
        if (op->worker == w) {
          op->worker = nullptr;
          release_buf(op->buf);
          op->buf = -1;
        }
    }
    it = retired.erase(it);
  }
}

void Relay::Impl::send_up(Writer& msg) {
  std::uint64_t dummy = 0;
  if (!up.sock.send(seal(msg, std::string(), &dummy, "up"), kMaxCtrlOut) || !up.sock.flush())
    fail_upstream("control channel: " + up.sock.error());
}

// The upstream's control channel: completes the connect, writes what is
// queued, reads and acts on its messages in order.
void Relay::Impl::service_up() {
  if (source || up.state == Up::kIdle || !up.sock.is_open()) return;
  if (!up.tcp_up) {
    pollfd p{up.sock.fd(), POLLOUT, 0};
    if (::poll(&p, 1, 0) <= 0) return;
    if (const std::string why = up.sock.connect_result(); !why.empty()) {
      if (why == "not connected yet") return;
      fail_upstream("cannot connect to " + from_addr.str() + ": " + why);
      return;
    }
    up.tcp_up = true;
  }
  if (up.sock.want_write() && !up.sock.flush()) {
    fail_upstream("control channel: " + up.sock.error());
    return;
  }
  const std::uint64_t gen = up.gen;
  std::vector<std::vector<std::uint8_t>> frames;
  const std::size_t cap =
      up.state == Up::kAuthed ? wire::control_cap(o.region_options.manifest_bytes) : wire::kHandshakeBytes;
  const bool ok = up.sock.receive(cap, &frames);
  for (auto& f : frames) {
    if (up.gen != gen || up.state == Up::kIdle) return;
    try {
      on_down_message(f);
    } catch (const wire::ProtocolError& e) {
      fail_upstream(std::string("protocol error: ") + e.what());
      return;
    }
  }
  if (!ok && up.gen == gen && up.state != Up::kIdle) {
    std::string why = up.sock.error();
    if (why.find("more than the") != std::string::npos)
      why += up.state == Up::kAuthed ? " (a sync's manifest must fit this node's region: raise --manifest-bytes)"
                                     : " (a handshake message)";
    fail_upstream(up.state == Up::kAuthed ? "connection lost: " + why : "during the handshake: " + why);
  }
}

// Tagged messages other than chunk bytes on the upstream's worker: junk
// (a peer that reached UCX's own port), drained a batch per pass. Junk
// is a tag without bit 63, or (once authenticated) a data tag whose serial
// is neither the current sync's nor that of a sync the upstream announced
// and this relay has not begun yet: its sync message still queued in
// up.ctrl, or one of the next kSyncsAhead, whose messages this relay has
// not read yet: a sync's fragments may come before its message (UCX and
// the control connection are not ordered), and syncs of empty tensors
// send no fragment, so the next sync with bytes may be several serials
// ahead (a busy node dropped such fragments as junk and stalled).
// Before that, every tagged message. UCX shows only the first message of
// a tag and mask: junk queued behind a fragment that is awaited is
// drained once that fragment is taken.
void Relay::Impl::drain_up_junk() {
  constexpr std::uint32_t kSyncsAhead = 64;
  if (!up.w || up.state == Up::kIdle) return;
  while (up.junk_busy < kJunkBatch) {
    ucp_tag_recv_info_t info{};
    ucp_tag_message_h m = ucp_tag_probe_nb(up.w->get(), 0, wire::kDataBit, 1, &info);
    if (m == nullptr) {
      m = ucp_tag_probe_nb(up.w->get(), wire::kDataBit, wire::kDataBit, 0, &info);
      if (m == nullptr) return;
      if (up.state == Up::kAuthed) {
        const std::uint32_t serial = static_cast<std::uint32_t>(info.sender_tag >> 32) & wire::kSerialMask;
        const std::uint32_t cur = wire::data_serial(up.tag_base, up.syncs_begun);
        if (((serial - cur) & wire::kSerialMask) <= up.ctrl.size() + kSyncsAhead) return;  // awaited, or soon
      }
      m = ucp_tag_probe_nb(up.w->get(), info.sender_tag, wire::kFullMask, 1, &info);
      if (m == nullptr) return;
    }
    Op* op = new_op(Op::kJunkRecv, up.w->get());
    op->gen = up.gen;
    op->msg.resize(64);
    ucp_request_param_t p = recv_param(op);
    ++up.junk_busy;
    track(op, ucp_tag_msg_recv_nbx(up.w->get(), op->msg.data(), op->msg.size(), m, &p));
    ++ignored;
    status_dirty = true;
    rlog.log("ignored", "a tagged message that is not chunk bytes of this sync on the upstream's worker: dropped",
             mono_ns());
  }
}

// Why chunks of `chunk_bytes` do not fit this node ("" when they do).
std::string Relay::Impl::chunk_room_problem(std::uint64_t chunk_bytes) const {
  wire::ChunkRoom room;
  room.buffers = o.buffers;
  room.region_slots = o.region_options.slot_bytes == 0 ? o.region_options.slots : 0;
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) room.memory_bytes = static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page);
  struct statvfs fs {};
  if (::statvfs(region_dir().c_str(), &fs) == 0) room.fs_bytes = static_cast<std::uint64_t>(fs.f_blocks) * fs.f_frsize;
  return wire::chunk_problem(chunk_bytes, room);
}

// Connects the data endpoint to `addr` (HOST:PORT) and sends its proof of
// the session key on it; false when it failed the upstream connection.
bool Relay::Impl::connect_data(const std::string& addr) {
  sockaddr_storage ss{};
  socklen_t len = 0;
  try {
    ss = ucx::resolve(parse_address(addr), false, &len);
  } catch (const Error& e) {
    fail_upstream(std::string("the upstream's data address: ") + e.what());
    return false;
  }
  up.arg = std::make_unique<EpArg>(EpArg{&sink, 0, up.gen});
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                  UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&ss);
  ep.sockaddr.addrlen = len;
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = ep_error_cb;
  ep.err_handler.arg = up.arg.get();
  if (const ucs_status_t s = ucp_ep_create(up.w->get(), &ep, &up.ep); s != UCS_OK) {
    up.ep = nullptr;
    fail_upstream("cannot open the data connection to " + addr + ": " + ucx::status_str(s));
    return false;
  }
  // Its first bytes prove the session key (wire::kDataProofBytes): the
  // upstream sends no chunk on it before it checked them.
  Op* op = new_op(Op::kProofSend, up.w->get());
  op->gen = up.gen;
  const wire::Mac proof = auth::data_proof(up.session, up.tr.conn);
  op->msg.resize(wire::kDataProofBytes);
  std::memcpy(op->msg.data(), &up.tr.conn, 8);
  std::memcpy(op->msg.data() + 8, proof.data(), proof.size());
  ucp_request_param_t p = send_param(op);
  track(op, ucp_stream_send_nbx(up.ep, op->msg.data(), op->msg.size(), &p));
  return true;
}

// A control message from the upstream, on its control channel.
void Relay::Impl::on_down_message(std::vector<std::uint8_t>& msg) {
  const std::string from = "upstream " + from_addr.str();
  switch (up.state) {
    case Up::kConnecting: {
      wire::Reader r(msg, false);
      if (r.type() == Type::kRefused) {
        upstream_refused(from + " refused this relay: " + printable(r.str(wire::kHandshakeBytes)));
        return;
      }
      if (r.type() != Type::kChallenge) throw wire::ProtocolError("expected a challenge");
      const std::uint32_t proto = r.u32();
      if (proto != wire::kProto) {
        upstream_refused(from + " speaks relay protocol " + std::to_string(proto) + ", this relay " +
                         std::to_string(wire::kProto) + ": run the same shmcast version on every node");
        return;
      }
      up.tr.conn = r.u64();
      r.bytes(&up.tr.server_nonce);
      const std::string region = r.str(256);
      r.expect_done();
      if (region != o.region) {
        upstream_refused(from + " serves region '" + printable(region) + "', not '" + o.region + "'");
        return;
      }
      up.tr.region = o.region;
      up.tr.client_nonce = auth::nonce();
      Writer w(Type::kResponse);
      w.bytes(up.tr.client_nonce).bytes(auth::client_proof(o.key, up.tr)).str(o.region);
      send_up(w);
      if (up.state == Up::kIdle) return;
      up.state = Up::kAwaitWelcome;
      set_state("authenticating");
      return;
    }
    case Up::kAwaitWelcome: {
      wire::Reader r0(msg, false);
      if (r0.type() == Type::kRefused) {
        upstream_refused(from + " refused this relay: " + printable(r0.str(wire::kHandshakeBytes)));
        return;
      }
      if (r0.type() != Type::kWelcome) throw wire::ProtocolError("expected a welcome");
      up.session = auth::session_key(o.key, up.tr);
      std::optional<wire::Reader> r;
      try {
        r.emplace(verified(msg));
      } catch (const wire::ProtocolError&) {
        upstream_refused(from + " did not prove the key (its welcome fails the MAC): not accepting its data");
        return;
      }
      wire::Mac proof{};
      r->bytes(&proof);
      const std::uint64_t chunk_bytes = r->u64();
      (void)r->u32();  // flags: the upstream's checksum setting (each hop checks what it receives)
      const std::string data_addr = r->str(256);
      r->expect_done();
      if (!auth::equal(proof, auth::server_proof(o.key, up.tr))) {
        upstream_refused(from + " did not prove the key: not accepting its data");
        return;
      }
      if (chunk_bytes != 0)
        if (const std::string why = chunk_room_problem(chunk_bytes); !why.empty()) {
          fail_upstream("the upstream's " + why);
          return;
        }
      // The data connection, to the listener the upstream opened for it
      // (its address is in the welcome, which the session key covers).
      if (!connect_data(data_addr)) return;
      up.state = Up::kAuthed;
      up.backoff_ns = 0;
      up.since_unix_ns = unix_ns();
      up.last_error.clear();
      up.tag_base = auth::data_tag_base(up.session);
      if (chunk_bytes != 0) {
        up.chunk_bytes = chunk_bytes;
        push_writer(WCmd{WCmd::kOpen, nullptr, -1, 0, nullptr, 0, 0, chunk_bytes, {}});
      }
      log("connected to upstream " + from_addr.str() + " (connection " + std::to_string(up.tr.conn) +
          "): key proven both ways");
      // A node that (re)joins holds no version the upstream's deltas build
      // on: it asks for a full sync first (a no-op for a region without
      // deltas), answered by any later full sync: it saw none of them.
      want_full_up.add(0);
      set_state("connected");
      return;
    }
    case Up::kAuthed: {
      (void)verified(msg);  // checks the MAC and the sequence number now, in arrival order
      up.ctrl.push_back(std::move(msg));
      return;
    }
    case Up::kIdle: return;
  }
}

// The message checked against the session key; a Reader over its body.
wire::Reader Relay::Impl::verified(const std::vector<std::uint8_t>& msg) {
  if (msg.size() < wire::kHeaderBytes + wire::kMacBytes) throw wire::ProtocolError("control message too short");
  wire::Mac got{};
  std::memcpy(got.data(), msg.data() + msg.size() - wire::kMacBytes, wire::kMacBytes);
  const wire::Mac want = auth::message_mac(
      up.session, "down", std::span<const std::uint8_t>(msg.data(), msg.size() - wire::kMacBytes));
  if (!auth::equal(got, want)) throw wire::ProtocolError("control message fails its MAC");
  wire::Reader r(msg, true);
  if (r.seq() != up.recv_seq) throw wire::ProtocolError("control message out of sequence (replayed?)");
  ++up.recv_seq;
  return r;
}

// Sends a full-sync request upstream (kWantFull) when one is pending and
// the upstream connection is authenticated; else it waits for that.
void Relay::Impl::send_want_full() {
  std::uint64_t after = 0;
  if (source || up.state != Up::kAuthed || !want_full_up.take(&after)) return;
  Writer w(Type::kWantFull);
  w.u64(after).u8(0);  // after version (0: any), flags (none yet)
  std::uint64_t seq = up.send_seq;
  if (!up.sock.send(seal(w, up.session, &seq, "up"), kMaxCtrlOut) || !up.sock.flush()) {
    want_full_up.add(after);
    fail_upstream("control channel: " + up.sock.error());
    return;
  }
  up.send_seq = seq;
  std::lock_guard<std::mutex> g(smu);
  ++st.full_requests;
  status_dirty = true;
}

}  // namespace shmcast::relay
