// The relay's incoming sync (nodes with `from`), on the network thread:
// the upstream's sync, chunk, end and abort messages, fragment receives into
// receive buffers or straight into this node's slots (lent by the writer),
// forwarding each fragment downstream as it arrives, checksums of direct
// chunks (Verifier), and chunks handed on to the region writer in order.
// Also the receive buffers themselves.
#include "relay_impl.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "base/text.hpp"

namespace shmcast::relay {

using detail::coarse_bytes;

// Acts on queued upstream control messages, in order.
void Relay::Impl::process_up_ctrl() {
  if (!up.ctrl.empty() && in.plan) in.progress_ns = mono_ns();
  while (!up.ctrl.empty()) {
    std::vector<std::uint8_t>& msg = up.ctrl.front();
    wire::Reader r(msg, true);
    switch (r.type()) {
      case Type::kSync: {
        if (in.plan) return;  // the previous sync is still being received
        auto plan = std::make_shared<SyncPlan>(wire::decode_sync(r));
        if (const std::string why = chunk_room_problem(plan->chunk_bytes); !why.empty()) {
          fail_upstream("cannot take the upstream's sync " + std::to_string(plan->version) + ": its " + why);
          return;
        }
        bool ready = false;
        try {
          ready = ensure_bufs(plan->chunk_bytes);  // false: the chunk size changed, wait for the buffers
        } catch (const Error& e) {  // an upstream's chunk size this node cannot hold
          fail_upstream(std::string("cannot take the upstream's sync: ") + e.what());
          return;
        }
        if (!ready) return;
        begin_in(plan);
        break;
      }
      case Type::kChunk: {
        const std::uint64_t v = r.u64();
        const std::uint32_t c = r.u32();
        const std::uint64_t len = r.u64(), sum = r.u64();
        r.expect_done();
        if (!in.plan || v != in.plan->version) throw wire::ProtocolError("chunk message outside its sync");
        const auto& dc = in.plan->data_chunks;
        const auto it = std::lower_bound(dc.begin(), dc.end(), c);
        if (it == dc.end() || *it != c || len != in.plan->chunk_len(c))
          throw wire::ProtocolError("chunk message for a chunk the sync does not have");
        In::Chunk& ch = in.chunks[static_cast<std::size_t>(it - dc.begin())];
        ch.have_sum = true;
        ch.sum = sum;
        ch.len = len;
        break;
      }
      case Type::kEnd: {
        const std::uint64_t v = r.u64();
        const std::uint64_t sent = r.u64();
        r.expect_done();
        if (!in.plan || v != in.plan->version || sent != in.plan->total_frags())
          throw wire::ProtocolError("end message does not match the sync");
        in.ended = true;
        break;
      }
      case Type::kAbort: {
        const std::uint64_t v = r.u64();
        const std::uint64_t sent = r.u64();
        const std::string why = r.str();
        r.expect_done();
        if (!in.plan || v != in.plan->version || sent > in.plan->total_frags())
          throw wire::ProtocolError("abort message does not match the sync");
        abort_in(sent, "upstream aborted sync " + std::to_string(v) + ": " + printable(why, 1000));
        break;
      }
      default: throw wire::ProtocolError(std::string("unexpected ") + wire::type_name(r.type()) + " message");
    }
    up.ctrl.pop_front();
  }
}

void Relay::Impl::begin_in(const std::shared_ptr<const SyncPlan>& plan) {
  in = In{};
  in.serial = ++in_serial;
  in.tag_serial = wire::data_serial(up.tag_base, ++up.syncs_begun);  // the upstream counts its syncs to us alike
  in.plan = plan;
  in.chunks.resize(plan->data_chunks.size());
  in.limit = plan->data_chunks.size();
  in.limit_frags = plan->total_frags();
  in.direct = o.direct_receive && local_slot_bytes(plan->chunk_bytes) == plan->chunk_bytes;
  in.start_ns = in.progress_ns = mono_ns();
  up.chunk_bytes = plan->chunk_bytes;
  push_writer(WCmd{WCmd::kBegin, plan, -1, 0, nullptr, 0, 0, plan->chunk_bytes, {}});
  const int n = forward_begin(plan);
  set_state("syncing");
  log("sync " + std::to_string(plan->version) + " from upstream: " + std::to_string(plan->specs.size()) +
      " tensors, " + coarse_bytes(plan->payload_bytes) + ", " + std::to_string(plan->data_chunks.size()) +
      " chunks of " + std::to_string(plan->total_frags()) + " fragments; forwarding to " + std::to_string(n) +
      " downstream" + (in.direct ? "; receiving into this node's slots" : ""));
}

// The upstream abandoned the sync after sending `sent` fragments: those
// still arrive (every message sent is received, so that no sender waits on
// a rendezvous for ever); receives for the others are cancelled.
void Relay::Impl::abort_in(std::uint64_t sent, const std::string& why) {
  log(why);
  if (!in.discard) {
    push_writer(WCmd{WCmd::kAbort, in.plan, -1, 0, nullptr, 0, 0, 0, why});
    forward_abort(why);
  }
  {
    std::lock_guard<std::mutex> g(smu);
    ++st.aborted;
    st.last_error = why;
  }
  in.aborted = true;
  in.discard = true;
  const auto& fb = in.plan->frag_base;  // positions with a fragment below `sent`
  in.limit =
      std::min(in.limit, static_cast<std::size_t>(std::lower_bound(fb.begin(), fb.end() - 1, sent) - fb.begin()));
  in.limit_frags = std::min(in.limit_frags, sent);
  for (std::size_t i = 0; i < in.posted; ++i) {
    In::Chunk& ch = in.chunks[i];
    for (std::size_t j = 0; j < ch.ops.size(); ++j)
      if (Op* op = ch.ops[j]; op && fb[i] + j >= sent && op->req && !op->done)
        up.w->cancel(op->req, [op] { return !op->done.load(std::memory_order_acquire); });
  }
}

// Forgets the sync being received; buffers of chunks received but not
// handed on return now, those of receives in flight when they finish.
void Relay::Impl::drop_in() {
  for (std::size_t i = in.processed; i < in.posted; ++i)
    if (in.chunks[i].buf >= 0) release_buf(in.chunks[i].buf);  // the chunk's; receives in flight keep theirs
  in = In{};
}

// Posts receives into free buffers, forwards fragments as they arrive,
// hands complete chunks on in order.
void Relay::Impl::pump_in() {
  if (!in.plan || up.state != Up::kAuthed) return;
  const SyncPlan& p = *in.plan;
  take_lend_replies();
  take_verified();
  // Direct receive: ask the writer to lend the slots of the next chunks,
  // as far ahead as this node's region allows (the writer publishes the
  // chunks handed to it in order, so chunk data_chunks[processed - 1] and
  // all before it are published by the time it reads the request).
  const std::uint64_t K = region_slots.load();
  while (in.direct && !in.discard && in.asked < in.limit && K > 0) {
    const std::uint64_t pub = in.processed > 0 ? p.data_chunks[in.processed - 1] + 1ull : 0;
    if (p.data_chunks[in.asked] >= pub + K) break;
    in.chunks[in.asked].lend = 1;
    push_writer(WCmd{WCmd::kLend, in.plan, -1, p.data_chunks[in.asked], nullptr, 0, 0, 0, {}, in.serial, in.asked});
    ++in.asked;
  }
  while (in.posted < in.limit) {
    const std::size_t pos = in.posted;
    In::Chunk& ch = in.chunks[pos];
    int b = -1;
    if (ch.lend == 1) break;  // the writer has not answered yet
    if (ch.lend == 2) {
      b = slot_buf(ch.slot_p, ch.slot_gen);
    } else {
      if (in.direct && pos >= in.asked && !in.discard) break;  // not asked yet
      b = free_buf();
      if (b < 0) break;
    }
    const std::uint32_t c = p.data_chunks[pos];
    Buffer& buf = bref(b);
    add_ref(b);  // the chunk's
    ch.buf = b;
    ch.len = p.chunk_len(c);
    const std::uint32_t nf = p.frags(c);
    ch.ops.assign(nf, nullptr);
    ch.got.assign(nf, 0);
    ch.left = nf;
    ++in.posted;
    for (std::uint32_t j = 0; j < nf; ++j) {
      if (p.frag_base[pos] + j >= in.limit_frags) {  // never sent (aborted)
        ch.got[j] = 2;
        ch.ok = false;
        --ch.left;
        continue;
      }
      Op* op = new_op(Op::kDataRecv, up.w->get());
      op->gen = up.gen;
      op->serial = in.serial;
      op->buf = b;
      op->pos = pos;
      op->chunk = c;
      op->frag = j;
      op->version = p.version;
      op->bytes = p.frag_len(c, j);
      add_ref(b);  // the receive's
      ch.ops[j] = op;
      ucp_request_param_t prm = recv_param(op, buf.reg.memh);
      track(op, ucp_tag_recv_nbx(up.w->get(), buf.p + static_cast<std::uint64_t>(j) * p.frag_bytes, op->bytes,
                                 wire::data_tag(in.tag_serial, p.frag_tag(c, j)), wire::kFullMask, &prm));
    }
  }
  while (!in.discard && in.fwd_pos < in.posted) {
    In::Chunk& ch = in.chunks[in.fwd_pos];
    if (in.fwd_frag >= ch.got.size()) {
      ++in.fwd_pos;
      in.fwd_frag = 0;
      continue;
    }
    if (ch.got[in.fwd_frag] != 1) break;
    const std::uint32_t c = p.data_chunks[in.fwd_pos];
    const Buffer& b = bref(ch.buf);
    forward_frag(c, in.fwd_frag, b.p + static_cast<std::uint64_t>(in.fwd_frag) * p.frag_bytes,
                 p.frag_len(c, in.fwd_frag), b.reg.memh, ch.buf);
    ++in.fwd_frag;
  }
  // Chunks received into slots are checked off this thread, as they complete.
  if (o.checksums && !in.discard) {
    for (std::size_t i = in.processed; i < in.posted; ++i) {
      In::Chunk& ch = in.chunks[i];
      if (ch.verify != 0 || ch.left > 0 || !ch.have_sum || !ch.ok || ch.buf < kSlotBase) continue;
      if (!verifier) verifier = std::make_unique<Verifier>([this] { wake(); });
      add_ref(ch.buf);  // the check's: the slot stays until its result is taken
      verifier->submit(Verifier::Job{in.serial, i, bref(ch.buf).p, ch.len, ch.sum, ch.buf, false});
      ch.verify = 1;
    }
  }
  while (in.processed < in.posted) {
    In::Chunk& ch = in.chunks[in.processed];
    if (ch.left > 0) break;
    if (!in.discard && !ch.have_sum) break;
    if (!in.discard && ch.verify == 1) break;  // being checked
    const std::uint32_t c = p.data_chunks[in.processed];
    if (!in.discard && ch.ok) {
      const Buffer& b = bref(ch.buf);
      forward_sum(c, ch.len, ch.sum);
      add_ref(ch.buf);  // the writer's
      push_writer(WCmd{WCmd::kChunk, in.plan, ch.buf, c, b.p, ch.len, ch.sum, p.chunk_bytes,
                       ch.verify == 3 ? "bad" : "", in.serial, in.processed, ch.verify == 2});
      std::lock_guard<std::mutex> g(smu);
      st.bytes_in += ch.len;
    }
    release_buf(ch.buf);  // the chunk's
    ch.buf = -1;
    ++in.processed;
  }
  if (in.processed == in.posted && in.posted >= in.limit && (in.ended || in.aborted)) {
    if (in.ended && !in.discard) {
      forward_end();
      push_writer(WCmd{WCmd::kEnd, in.plan, -1, 0, nullptr, 0, 0, 0, {}});
      const double s = static_cast<double>(mono_ns() - in.start_ns) * 1e-9;
      log("sync " + std::to_string(p.version) + " received and forwarded: " + coarse_bytes(p.payload_bytes) + " in " +
          std::to_string(s) + " s (" + fmt_gbs(p.payload_bytes, s) + ")");
      std::lock_guard<std::mutex> g(smu);
      ++st.syncs;
      st.last_version = p.version;
      st.last_bytes = p.payload_bytes;
      st.last_seconds = s;
      st.count(p);
    }
    in = In{};
    set_state("connected");
  }
}

void Relay::Impl::take_verified() {
  if (!verifier) return;
  for (const Verifier::Job& j : verifier->take()) {
    release_buf(j.buf);
    if (in.plan && j.serial == in.serial && j.pos < in.chunks.size() && in.chunks[j.pos].verify == 1)
      in.chunks[j.pos].verify = j.ok ? 2 : 3;
  }
}

void Relay::Impl::take_lend_replies() {
  std::vector<LendReply> got;
  {
    std::lock_guard<std::mutex> g(wmu);
    got.swap(lend_replies);
  }
  for (const LendReply& r : got) {
    if (!in.plan || r.serial != in.serial || r.pos >= in.chunks.size()) continue;  // a sync that is over
    In::Chunk& ch = in.chunks[r.pos];
    if (ch.lend != 1) continue;
    if (r.p) {
      ch.lend = 2;
      ch.slot_p = r.p;
      ch.slot_gen = r.gen;
    } else {
      ch.lend = 3;  // the local sync failed: receive buffers from here on
      in.direct = false;
    }
  }
}

void Relay::Impl::take_writer_returns() {
  std::vector<int> done;
  {
    std::lock_guard<std::mutex> g(wmu);
    done.swap(wdone);
  }
  for (int b : done) release_buf(b);
}

Buffer& Relay::Impl::bref(int b) {
  return b >= kSlotBase ? sbufs[static_cast<std::size_t>(b - kSlotBase)].b : bufs[static_cast<std::size_t>(b)];
}

void Relay::Impl::add_ref(int b) {
  if (b < 0) return;
  Buffer& buf = bref(b);
  ++buf.refs;
  if (b >= kSlotBase) slot_use.add(buf.p, 1);
}

void Relay::Impl::release_buf(int b) {
  if (b < 0) return;
  Buffer& buf = bref(b);
  if (buf.refs <= 0) return;
  --buf.refs;
  if (b >= kSlotBase) slot_use.add(buf.p, -1);
}

// The slot buffer for a lent slot at `p` of region generation `gen`
// (registered with UCX once per generation; older ones are dropped: the
// writer recreated the region only once none of them was in use).
int Relay::Impl::slot_buf(std::byte* p, std::uint64_t gen) {
  if (!sbufs.empty() && sbufs.front().gen != gen &&
      std::all_of(sbufs.begin(), sbufs.end(), [](const SlotBuf& sb) { return sb.b.refs == 0; })) {
    for (SlotBuf& sb : sbufs) ucx::unregister_memory(ctx->get(), &sb.b.reg);
    sbufs.clear();
  }
  for (std::size_t i = 0; i < sbufs.size(); ++i)
    if (sbufs[i].b.p == p && sbufs[i].gen == gen) return kSlotBase + static_cast<int>(i);
  SlotBuf sb;
  sb.gen = gen;
  sb.b.p = p;
  sb.b.cap = region_slot_bytes.load();
  sb.b.reg = ucx::register_memory(ctx->get(), p, sb.b.cap);
  sbufs.push_back(sb);
  return kSlotBase + static_cast<int>(sbufs.size() - 1);
}

int Relay::Impl::free_buf() const {
  for (std::size_t i = 0; i < bufs.size(); ++i)
    if (bufs[i].refs == 0) return static_cast<int>(i);
  return -1;
}

bool Relay::Impl::all_bufs_free() const {
  return std::all_of(bufs.begin(), bufs.end(), [](const Buffer& b) { return b.refs == 0; });
}

void Relay::Impl::free_bufs() {
  for (Buffer& b : bufs) {
    ucx::unregister_memory(ctx->get(), &b.reg);
    if (b.p) ::munmap(b.p, b.cap);
  }
  bufs.clear();
  buf_bytes = 0;
}

// (Re)allocates the receive buffers for chunks of `bytes`; false while
// some are still in use.
bool Relay::Impl::ensure_bufs(std::uint64_t bytes) {
  if (buf_bytes == bytes && !bufs.empty()) return true;
  if (!all_bufs_free()) return false;
  free_bufs();
  for (std::uint32_t i = 0; i < o.buffers; ++i) {
    Buffer b;
    b.cap = bytes;
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
      throw Error(Errc::kSystem, "cannot allocate " + std::to_string(o.buffers) + " receive buffers of " +
                                     coarse_bytes(bytes) + ": " + std::strerror(errno) + " (lower --buffers)",
                  errno);
    b.p = static_cast<std::byte*>(p);
    b.reg = ucx::register_memory(ctx->get(), p, bytes);
    bufs.push_back(b);
  }
  buf_bytes = bytes;
  log("receive buffers: " + std::to_string(o.buffers) + " x " + coarse_bytes(bytes) + ", registered with UCX");
  return true;
}

}  // namespace shmcast::relay
