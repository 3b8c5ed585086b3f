// The relay's outgoing sync, on the network thread: a sync begins on every
// downstream that is ready, its fragments go to every active one (from this
// node's receive buffers or slots, or from the source region's slots), then
// its chunk sums and its end or abort.
#include "relay_impl.hpp"

#include "base/text.hpp"

namespace shmcast::relay {

using detail::coarse_bytes;

// Starts `plan` on every downstream that is ready; returns how many.
int Relay::Impl::forward_begin(const std::shared_ptr<const SyncPlan>& plan) {
  out.plan = plan;
  out.start_ns = mono_ns();
  int n = 0;
  for (auto& [id, d] : downs) {
    if (d->state != Down::kReady) continue;
    Writer w(Type::kSync);
    wire::encode_sync(w, *plan);
    send_down(*d, w);
    d->state = Down::kActive;
    d->version = plan->version;
    d->frags_sent = 0;
    d->serial = wire::data_serial(d->tag_base, ++d->syncs_begun);
    ++n;
  }
  status_dirty = true;
  return n;
}

// Posts fragment j of chunk `c` (bytes [p, p + len)) to every active
// downstream; returns the sends. Fragments go in order (In::fwd_*), so an
// abort can say how many each downstream was sent.
int Relay::Impl::forward_frag(std::uint32_t c, std::uint32_t j, const std::byte* p, std::uint64_t len, ucp_mem_h memh,
                               int buf) {
  int n = 0;
  if (!out.plan) return 0;
  const std::uint64_t ord = ++fan_seq;  // this fragment, for every downstream (lag isolation)
  for (auto& [id, d] : downs) {
    if (d->state != Down::kActive) continue;
    Op* op = new_op(Op::kDataSend, lw->get());
    op->conn = d->id;
    op->buf = buf;
    op->chunk = c;
    op->frag = j;
    op->version = out.plan->version;
    op->bytes = len;
    op->ord = ord;
    if (d->pending_data++ == 0) d->progress_ns = mono_ns();
    ++d->frags_sent;
    d->pend.insert(ord);
    FanFrag& ff = fan[ord];
    ++ff.pending;
    ff.buf = buf;
    ucp_request_param_t prm = send_param(op, memh);
    add_ref(buf);
    track(op, ucp_tag_send_nbx(d->ep, p, len, wire::data_tag(d->serial, out.plan->frag_tag(c, j)), &prm));
    ++n;
  }
  return n;
}

// Every fragment of chunk `c` at once (the source, from its slot).
int Relay::Impl::forward_chunk(std::uint32_t c, const std::byte* p, ucp_mem_h memh) {
  if (!out.plan) return 0;
  int n = 0;
  for (std::uint32_t j = 0, nf = out.plan->frags(c); j < nf; ++j)
    n += forward_frag(c, j, p + static_cast<std::uint64_t>(j) * out.plan->frag_bytes, out.plan->frag_len(c, j),
                      memh, -1);
  return n;
}

void Relay::Impl::forward_sum(std::uint32_t c, std::uint64_t len, std::uint64_t sum) {
  if (!out.plan) return;
  for (auto& [id, d] : downs) {
    if (d->state != Down::kActive) continue;
    Writer w(Type::kChunk);
    w.u64(out.plan->version).u32(c).u64(len).u64(sum);
    send_down(*d, w);
  }
}

void Relay::Impl::forward_end() {
  if (!out.plan) return;
  int n = 0;
  for (auto& [id, d] : downs) {
    if (d->state != Down::kActive) continue;
    Writer w(Type::kEnd);
    w.u64(out.plan->version).u64(d->frags_sent);
    send_down(*d, w);
    d->state = Down::kReady;
    ++d->syncs;
    ++n;
  }
  if (source) {
    const double s = static_cast<double>(mono_ns() - out.start_ns) * 1e-9;
    log("sync " + std::to_string(out.plan->version) + " sent to " + std::to_string(n) + " downstream: " +
        coarse_bytes(out.plan->payload_bytes) + " in " + std::to_string(s) + " s (" +
        fmt_gbs(out.plan->payload_bytes, s) + ")");
    std::lock_guard<std::mutex> g(smu);
    ++st.syncs;
    st.last_version = out.plan->version;
    st.last_bytes = out.plan->payload_bytes;
    st.last_seconds = s;
    st.count(*out.plan);
  }
  out.plan.reset();
  status_dirty = true;
}

void Relay::Impl::forward_abort(const std::string& why) {
  if (!out.plan) return;
  for (auto& [id, d] : downs) {
    if (d->state != Down::kActive) continue;
    Writer w(Type::kAbort);
    w.u64(out.plan->version).u64(d->frags_sent).str(why.substr(0, 1000));
    send_down(*d, w);
    d->state = Down::kReady;
  }
  if (source) {
    std::lock_guard<std::mutex> g(smu);
    ++st.aborted;
  }
  out.plan.reset();
  status_dirty = true;
}

}  // namespace shmcast::relay
