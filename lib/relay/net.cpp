// The relay's UCX plumbing: the callbacks UCX calls (on a worker's progress
// thread, or on the network thread itself; they only file into Impl::sink),
// requests (Op) and their completions, endpoint failures, the workers, and
// the limiter of UCX's own log. Everything but the callbacks and the log
// limiter runs on the network thread.
#include "relay_impl.hpp"

#include <ucs/debug/log_def.h>

#include <cstdio>
#include <map>
#include <mutex>
#include <string>
#include <utility>

namespace shmcast::relay {

namespace {

// UCX's own warnings and errors, at most kUcxBurst per source line and 10 s
// (a peer can make UCX log at will: a refused connection, a malformed
// packet, a message for an id nothing handles). Process-wide, once.
constexpr int kUcxBurst = 5;
constexpr std::int64_t kUcxWindowNs = 10'000'000'000;
struct UcxLogSite {
  std::int64_t window_start = 0;
  int printed = 0;
  std::uint64_t held = 0;
};
std::mutex g_ucx_log_mu;
std::map<std::pair<std::string, unsigned>, UcxLogSite>* g_ucx_log_sites = nullptr;

ucs_log_func_rc_t ucx_log_limiter(const char* file, unsigned line, const char*, ucs_log_level_t level,
                                  const ucs_log_component_config_t*, const char*, va_list) {
  if (level > UCS_LOG_LEVEL_WARN) return UCS_LOG_FUNC_RC_CONTINUE;  // diagnostics someone asked for
  const std::int64_t now = mono_ns();
  std::lock_guard<std::mutex> g(g_ucx_log_mu);
  UcxLogSite& site = (*g_ucx_log_sites)[{file ? file : "?", line}];
  if (now - site.window_start >= kUcxWindowNs) {
    if (site.held > 0)
      std::fprintf(stderr, "shmcast-relay: %llu more UCX messages from %s:%u left out in the last 10 s\n",
                   static_cast<unsigned long long>(site.held), file ? file : "?", line);
    site = UcxLogSite{now, 0, 0};
  }
  if (site.printed < kUcxBurst) {
    ++site.printed;
    return UCS_LOG_FUNC_RC_CONTINUE;  // UCX's handler prints it
  }
  ++site.held;
  return UCS_LOG_FUNC_RC_STOP;
}

}  // namespace

void on_data_conn(ucp_conn_request_h req, void* arg) {
  auto* a = static_cast<ListenArg*>(arg);
  std::lock_guard<std::mutex> g(a->sink->mu);
  a->sink->conns.push_back(req);
}

void op_send_cb(void*, ucs_status_t st, void* user) {
  auto* op = static_cast<Op*>(user);
  std::lock_guard<std::mutex> g(op->sink->mu);
  op->status = st;
  op->done.store(true, std::memory_order_release);
  op->sink->completed.push_back(op);
}
void op_recv_cb(void*, ucs_status_t st, const ucp_tag_recv_info_t* info, void* user) {
  auto* op = static_cast<Op*>(user);
  std::lock_guard<std::mutex> g(op->sink->mu);
  op->status = st;
  if (info) {
    op->length = info->length;
    op->sender_tag = info->sender_tag;
  }
  op->done.store(true, std::memory_order_release);
  op->sink->completed.push_back(op);
}

void op_stream_recv_cb(void*, ucs_status_t st, std::size_t length, void* user) {
  auto* op = static_cast<Op*>(user);
  std::lock_guard<std::mutex> g(op->sink->mu);
  op->status = st;
  op->length = length;
  op->done.store(true, std::memory_order_release);
  op->sink->completed.push_back(op);
}

void ep_error_cb(void* arg, ucp_ep_h, ucs_status_t st) {
  auto* a = static_cast<EpArg*>(arg);
  std::lock_guard<std::mutex> g(a->sink->mu);
  a->sink->failures.push_back(EpFailure{a->conn, a->gen, st});
}

void limit_ucx_log() {
  static std::once_flag once;
  std::call_once(once, [] {
    g_ucx_log_sites = new std::map<std::pair<std::string, unsigned>, UcxLogSite>();  // lives as long as UCX may log
    ucs_log_push_handler(ucx_log_limiter);
  });
}

Op* Relay::Impl::new_op(Op::Kind k, ucp_worker_h w) {
  auto op = std::make_unique<Op>();
  op->kind = k;
  op->sink = &sink;
  op->worker = w;
  Op* p = op.get();
  ops.emplace(p, std::move(op));
  return p;
}

// Files the result of an *_nbx call.
void Relay::Impl::track(Op* op, ucs_status_ptr_t r) {
  if (op->worker == (lw ? lw->get() : nullptr)) kick_lw = true;
  else kick_up = true;
  if (UCS_PTR_IS_ERR(r) || r == nullptr) {
    if (!op->done) {
      op->status = r == nullptr ? UCS_OK : UCS_PTR_STATUS(r);
      op->done = true;
      completed.push_back(op);
    }
  } else {
    op->req = r;
  }
  if (r == nullptr && (op->kind == Op::kDataRecv || op->kind == Op::kJunkRecv)) {
    op->length = op->info.length;
    op->sender_tag = op->info.sender_tag;
  }
}

ucp_request_param_t Relay::Impl::send_param(Op* op, ucp_mem_h memh) {
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.send = op_send_cb;
  p.user_data = op;
  if (memh) {
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    p.memh = memh;
  }
  return p;
}

// Receives always complete through the callback (UCP_OP_ATTR_FLAG_NO_IMM_CMPL):
// with Debian 12's UCX 1.13 a receive of a message that had already arrived
// (an eager fragment of a few KiB, sent before the receive was posted)
// completed at once without filling recv_info, so its length read as 0 and
// the node dropped a good sync ("fragment 0 of chunk 0 has 0 bytes").
ucp_request_param_t Relay::Impl::recv_param(Op* op, ucp_mem_h memh) {
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  p.cb.recv = op_recv_cb;
  p.user_data = op;
  p.op_attr_mask |= UCP_OP_ATTR_FIELD_RECV_INFO;
  p.recv_info.tag_info = &op->info;
  if (memh) {
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    p.memh = memh;
  }
  return p;
}

void Relay::Impl::close_ep(ucp_worker_h w, ucp_ep_h ep, bool force, std::uint64_t conn) {
  Op* op = new_op(Op::kClose, w);
  op->conn = conn;
  op->gen = up.gen;
  ucp_request_param_t p = send_param(op);
  p.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  track(op, ucp_ep_close_nbx(ep, &p));
}

void Relay::Impl::on_complete(Op* op) {
  switch (op->kind) {
    case Op::kDataSend: {
      release_buf(op->buf);
      if (auto f = fan.find(op->ord); f != fan.end()) {
        if (f->second.first_done_ns == 0 && op->status == UCS_OK) f->second.first_done_ns = mono_ns();
        if (--f->second.pending <= 0) fan.erase(f);
      }
      if (auto it = downs.find(op->conn); it != downs.end()) {
        Down& d = *it->second;
        --d.pending_data;
        d.pend.erase(op->ord);
        d.progress_ns = mono_ns();
        if (op->status == UCS_OK) {
          d.bytes_sent += op->bytes;
          std::lock_guard<std::mutex> g(smu);
          st.bytes_out += op->bytes;
        } else {
          drop_down(d, "chunk send failed: " + ucx::status_str(op->status));
        }
      }
      if (source)
        if (auto it = src_chunks.find(op->chunk);
            it != src_chunks.end() && it->second.pending > 0 && it->second.version == op->version) {
          --it->second.pending;
          maybe_release(it);
        }
      return;
    }
    case Op::kDataRecv: {
      release_buf(op->buf);  // the receive's
      if (op->gen != up.gen || !in.plan || op->serial != in.serial || op->pos >= in.chunks.size()) return;
      In::Chunk& ch = in.chunks[op->pos];
      if (op->frag >= ch.ops.size() || ch.ops[op->frag] != op) return;
      ch.ops[op->frag] = nullptr;
      --ch.left;
      if (op->status != UCS_OK) {
        ch.got[op->frag] = 2;
        ch.ok = false;
        // Only an abort (discard) cancels on purpose; anything else loses
        // the chunk, and the sync with it.
        if (op->status != UCS_ERR_CANCELED || !in.discard)
          fail_upstream("chunk receive failed: " + ucx::status_str(op->status));
        return;
      }
      if (op->length != op->bytes) {
        ch.got[op->frag] = 2;
        ch.ok = false;
        fail_upstream("fragment " + std::to_string(op->frag) + " of chunk " + std::to_string(op->chunk) + " has " +
                      std::to_string(op->length) + " bytes, expected " + std::to_string(op->bytes));
        return;
      }
      ch.got[op->frag] = 1;
      in.progress_ns = mono_ns();
      return;
    }
    case Op::kJunkRecv: {
      if (op->worker == (lw ? lw->get() : nullptr)) --lw_junk_busy;
      else if (op->gen == up.gen && up.junk_busy > 0) --up.junk_busy;
      return;
    }
    case Op::kProofRecv: on_data_proof(op); return;
    case Op::kProofSend: return;  // a failure ends the endpoint too (ep_error_cb)
    case Op::kClose: {  // a downstream's data endpoint is closed: service_downs() ends it
      if (op->conn & kDataConnBit) {  // an unproven data connection: its records go with it
        data_conns.erase(op->conn);
        return;
      }
      if (op->conn != 0)
        if (auto it = downs.find(op->conn); it != downs.end()) {
          it->second->ep = nullptr;
          it->second->ep_closing = false;
        }
      return;
    }
  }
}

// Moves what callbacks filed to the network thread's own lists.
void Relay::Impl::take_sink() {
  std::lock_guard<std::mutex> g(sink.mu);
  completed.insert(completed.end(), sink.completed.begin(), sink.completed.end());
  sink.completed.clear();
  ep_failures.insert(ep_failures.end(), sink.failures.begin(), sink.failures.end());
  sink.failures.clear();
}

void Relay::Impl::process_completions() {
  for (;;) {
    take_sink();
    if (completed.empty()) break;
    std::vector<Op*> list;
    list.swap(completed);
    for (Op* op : list) {
      auto it = ops.find(op);
      if (it == ops.end()) continue;
      std::unique_ptr<Op> own = std::move(it->second);
      ops.erase(it);
      try {
        on_complete(op);
      } catch (const wire::ProtocolError& e) {
        if (up.state != Up::kIdle) fail_upstream(std::string("protocol error: ") + e.what());
      }
      if (op->req) ucp_request_free(op->req);
    }
  }
}

void Relay::Impl::process_ep_failures() {
  take_sink();
  auto list = std::move(ep_failures);
  ep_failures.clear();
  for (const EpFailure& f : list) {
    const std::uint64_t conn = f.conn;
    const ucs_status_t status = f.status;
    if (conn == 0) {
      if (f.gen == up.gen && up.state != Up::kIdle)
        fail_upstream(up.state == Up::kAuthed ? "connection lost (" + ucx::status_str(status) + ")"
                                              : "cannot connect (" + ucx::status_str(status) + ")");
      continue;
    }
    if (conn & kDataConnBit) {
      close_data_conn(conn, "connection lost (" + ucx::status_str(status) + ") before it proved the key");
      continue;
    }
    if (auto it = downs.find(conn); it != downs.end())
      drop_down(*it->second, "connection lost (" + ucx::status_str(status) + ")");
  }
}

// A worker of its own for each direction; with progress threads, each is
// progressed by a thread of its own, which wakes this one.
std::unique_ptr<ucx::Worker> Relay::Impl::new_worker() {
  auto w = std::make_unique<ucx::Worker>(*ctx, o.progress_threads);
  if (w->threaded()) w->start_progress([this] { wake(); });
  return w;
}

void Relay::Impl::check_workers() {
  for (ucx::Worker* w : {lw.get(), up.w.get()})
    if (w)
      if (std::string f = w->failure(); !f.empty())
        throw Error(Errc::kSystem, "UCX progress thread: " + f);
}

void Relay::Impl::kick_workers() {
  if (kick_lw && lw) lw->kick();
  if (kick_up && up.w) up.w->kick();
  kick_lw = kick_up = false;
}

}  // namespace shmcast::relay
