// A source relay (no `from`): its reader thread, the Consumer of the source
// region, which hands each sync's slots to the network thread in place
// (commands under cmd_mu), and the network thread's side of those commands
// (handle_cmds: fan-out, slot registrations, releasing slots once every
// downstream has them).
#include "relay_impl.hpp"

#include <xxhash.h>

#include <algorithm>

#include "base/text.hpp"

namespace shmcast::relay {

using detail::coarse_bytes;

// Network thread: acts on the reader's requests.
void Relay::Impl::handle_cmds() {
  std::deque<SrcCmd> list;
  {
    std::lock_guard<std::mutex> g(cmd_mu);
    list.swap(cmds);
  }
  for (SrcCmd& c : list) {
    switch (c.t) {
      case SrcCmd::kOpened:
        src_slot_bytes = c.len;
        reply(c.ticket, 0);
        break;
      case SrcCmd::kBegin: reply(c.ticket, forward_begin(c.plan)); break;
      case SrcCmd::kChunk: {
        ucp_mem_h memh = nullptr;
        try {
          memh = slot_registration(c.base);
        } catch (const Error& e) {
          log(std::string("cannot register a slot with UCX (sending it unregistered): ") + e.what());
        }
        SrcChunk& sc = src_chunks[c.chunk];
        sc = SrcChunk{0, false, out.plan ? out.plan->version : 0, std::move(c.release)};
        sc.pending = forward_chunk(c.chunk, c.base, memh);
        std::lock_guard<std::mutex> g(smu);
        st.bytes_in += c.len;
        break;
      }
      case SrcCmd::kSum:
        forward_sum(c.chunk, c.len, c.sum);
        if (auto it = src_chunks.find(c.chunk); it != src_chunks.end()) {
          it->second.sum_sent = true;
          maybe_release(it);
        }
        break;
      case SrcCmd::kEnd: forward_end(); break;
      case SrcCmd::kAbort: {
        forward_abort(c.why);
        std::lock_guard<std::mutex> g(smu);
        st.last_error = c.why;
        break;
      }
      case SrcCmd::kClosed:
        for (auto& [base, reg] : slot_regs) ucx::unregister_memory(ctx->get(), &reg);
        slot_regs.clear();
        src_slot_bytes = 0;
        reply(c.ticket, 0);
        break;
    }
  }
}

ucp_mem_h Relay::Impl::slot_registration(const std::byte* base) {
  auto it = slot_regs.find(base);
  if (it != slot_regs.end()) return it->second.memh;
  ucx::Registration r = ucx::register_memory(ctx->get(), const_cast<std::byte*>(base), src_slot_bytes);
  slot_regs.emplace(base, r);
  return r.memh;
}

void Relay::Impl::maybe_release(std::map<std::uint32_t, SrcChunk>::iterator it) {
  if (it->second.pending > 0 || !it->second.sum_sent) return;
  if (it->second.release) it->second.release();
  src_chunks.erase(it);
}

// Shutdown: whatever is still out (its sends are finished or cancelled).
void Relay::Impl::release_src_chunks() {
  for (auto& [c, sc] : src_chunks)
    if (sc.release) sc.release();
  src_chunks.clear();
}

void Relay::Impl::reply(std::uint64_t ticket, std::int64_t value) {
  {
    std::lock_guard<std::mutex> g(cmd_mu);
    replied_ticket = ticket;
    reply_value = value;
  }
  cmd_cv.notify_all();
}

// Reader thread: posts a command; with `wait`, blocks for its reply.
std::int64_t Relay::Impl::post(SrcCmd c, bool wait) {
  std::unique_lock<std::mutex> g(cmd_mu);
  const std::uint64_t t = next_ticket++;
  c.ticket = wait ? t : 0;
  cmds.push_back(std::move(c));
  g.unlock();
  wake();
  if (!wait) return 0;
  g.lock();
  while (replied_ticket < t) {
    if (net_done) throw Error(Errc::kAborted, "the relay is stopping");
    cmd_cv.wait_for(g, 100ms);
  }
  return reply_value;
}

void Relay::Impl::reader_main() {
  ConsumerOptions co;
  co.pin = Pin::kNo;
  co.open_timeout = 1s;
  // Slots handed to the network stay held until every downstream has them
  // or was dropped (peer_timeout): visit_chunks() must not give them back
  // to the producer (nor the region be unmapped) before.
  co.chunk_timeout = std::max<Duration>(60s, o.peer_timeout + 10s);
  while (!stopping) {
    std::optional<Consumer> cons;
    set_state("attaching");
    try {
      cons.emplace(Consumer::open(o.region, co));
    } catch (const Error& e) {
      if (e.code() == Errc::kNotFound || e.code() == Errc::kPeerDied || e.code() == Errc::kClosed ||
          e.code() == Errc::kTimeout)
        continue;  // the producer is not there (yet): keep waiting
      if (e.code() == Errc::kNoSeat) {
        note_error(e.what());
        std::this_thread::sleep_for(200ms);
        continue;
      }
      set_fatal(e);
      return;
    }
    if (cons->slot_memory() == SlotMemory::kDevice) {
      // The relay sends slots from host memory (visit_chunks): it cannot
      // forward a region whose slots are GPU memory. Say so now, not at
      // the first sync.
      set_fatal(Error(Errc::kUnsupported, "region '" + o.region + "' keeps its slots in GPU memory (device slots); "
                                          "a relay sends slots from host memory: create the producer with host "
                                          "slots (slot_memory = kHost) to relay it"));
      return;
    }
    const std::uint64_t S = cons->slot_bytes();
    log("attached to region " + o.region + " as consumer (seat " + std::to_string(cons->seat()) + ", slots of " +
        coarse_bytes(S) + ")");
    {
      std::lock_guard<std::mutex> g(smu);
      st.region_ready = true;
      st.region_slot_bytes = S;
    }
    try {
      post(SrcCmd{SrcCmd::kOpened, nullptr, 0, nullptr, S, 0, 0, {}, {}}, true);
      set_state("idle");
      read_syncs(*cons, S);
    } catch (const Error& e) {
      if (e.code() != Errc::kAborted || !stopping) log(std::string("source region: ") + e.what());
    }
    {
      std::lock_guard<std::mutex> g(smu);
      st.region_ready = false;
    }
    try {
      post(SrcCmd{SrcCmd::kClosed, nullptr, 0, nullptr, 0, 0, 0, {}, {}}, true);
    } catch (const Error&) {
    }
    cons.reset();
  }
}

// Forwards syncs until the consumer must be reopened (an Error escapes).
// A delta region's delta syncs go as they are (their blobs), when their
// base is the last sync of the same tensors this relay passed on whole
// (`held`); else the relay lets the delta go and asks the region for a full
// sync. Each node downstream checks the base again against its own region.
void Relay::Impl::read_syncs(Consumer& cons, std::uint64_t S) {
  cons.forward_syncs();
  HeldBases held;  // per tensor set, the last version sent whole to the downstreams
  // The region's producer makes every sync after `asked` full (for each
  // tensor set, its next one): a downstream's request for a full sync after
  // a version up to `asked` is answered by those (0: not asked yet).
  std::uint64_t asked = 0;
  auto ask_full = [&](const std::string& why) {
    if (!cons.delta()) return;
    cons.request_full_sync();
    asked = std::max<std::uint64_t>(cons.last_version(), 1);
    log("asked region " + o.region + " for a full sync: " + why);
    std::lock_guard<std::mutex> g(smu);
    ++st.full_requests;
    status_dirty = true;
  };
  while (!stopping) {
    // A request for a full sync after a version the last request
    // covers is already answered (its duplicates come from a node that
    // asks once per sync until a full one arrives: buckets, or syncs
    // already on their way); one for any later sync (0) never is.
    if (std::uint64_t after = 0; src_want_full.take(&after) && (after == 0 || after > asked))
      ask_full("a downstream relay asked for one");
    const SyncInfo* info = nullptr;
    try {
      info = &cons.wait_sync(200ms);
    } catch (const Error& e) {
      if (e.code() == Errc::kTimeout) continue;
      throw;  // PeerDied, Closed, Evicted, Corrupt...: reattach
    }
    if (info->world_size > 1) {
      cons.skip();
      log("sync " + std::to_string(info->version) + " skipped: it comes from " +
          std::to_string(info->world_size) + " sharded producer ranks, and the relay forwards syncs of one "
          "producer (publish the full tensors from one rank into the region the relay reads)");
      std::lock_guard<std::mutex> g(smu);
      ++st.skipped;
      continue;
    }
    std::vector<TensorSpec> specs;
    for (const TensorInfo& t : info->tensors) specs.push_back(TensorSpec{t.name, t.dtype, t.shape});
    const std::uint64_t set = HeldBases::key(specs);
    if (info->delta() && info->base_version != held.version(set)) {
      const std::uint64_t v = info->version, base = info->base_version;
      cons.skip();
      held.forget(set);
      {
        std::lock_guard<std::mutex> g(smu);
        ++st.skipped;
        ++st.delta_skipped;
      }
      ask_full("delta sync " + std::to_string(v) + " builds on version " + std::to_string(base) +
               ", which this relay did not pass on whole");
      continue;
    }
    auto plan = std::make_shared<SyncPlan>();
    plan->version = info->version;
    plan->base_version = info->base_version;
    plan->chunk_bytes = S;
    plan->frag_bytes = o.fragment_bytes;
    plan->stream_bytes = info->stream_bytes;
    plan->payload_bytes = info->payload_bytes;
    plan->specs = std::move(specs);
    for (const TensorInfo& t : info->tensors) {
      plan->offsets.push_back(t.stream_offset);
      // One rank: one whole piece each. A delta piece's stream bytes are its blob.
      const bool blob = !t.shards.empty() && t.shards[0].base_version != 0;
      plan->nbytes.push_back(blob ? t.shards[0].wire_bytes : t.nbytes);
      if (info->delta()) plan->is_delta.push_back(blob ? 1 : 0);
    }
    plan->index_chunks();
    const std::int64_t active = post(SrcCmd{SrcCmd::kBegin, plan, 0, nullptr, 0, 0, 0, {}, {}}, true);
    if (active == 0) {
      cons.skip();
      // Nobody downstream holds anything: a relay that joins asks for a
      // full sync itself (kWantFull), so a delta's base is not checked here.
      held.hold(set, plan->version);
      log("sync " + std::to_string(plan->version) + " skipped: no downstream relay is connected and ready");
      std::lock_guard<std::mutex> g(smu);
      ++st.skipped;
      continue;
    }
    set_state("syncing");
    try {
      // Each slot goes whole, straight from the region, and is released
      // once every downstream has it; the next ones go meanwhile.
      cons.visit_chunks([&](std::uint64_t c, const std::byte* base, std::uint64_t, std::function<void()> release) {
        const auto cu = static_cast<std::uint32_t>(c);
        if (!std::binary_search(plan->data_chunks.begin(), plan->data_chunks.end(), cu)) {
          release();  // padding only: not sent
          return;
        }
        if (stopping) {
          release();
          throw Error(Errc::kAborted, "the relay is stopping");
        }
        post_chunk(cu, base, plan->chunk_len(cu), std::move(release));
      });
      post(SrcCmd{SrcCmd::kEnd, plan, 0, nullptr, 0, 0, 0, {}, {}}, false);
      held.hold(set, plan->version);
      set_state("idle");
    } catch (const Error& e) {
      held.forget(set);
      post(SrcCmd{SrcCmd::kAbort, plan, 0, nullptr, 0, 0, 0, std::string("source sync aborted: ") + e.what(), {}},
           false);
      log("sync " + std::to_string(plan->version) + " aborted at the source: " + e.what());
      if (e.code() == Errc::kAborted || e.code() == Errc::kTimeout || e.code() == Errc::kChecksum) {
        set_state("idle");
        continue;  // the producer lives on: next sync
      }
      throw;
    }
  }
}

// Sends chunk c from the slot; the checksum is computed while the bytes
// travel. The network thread calls `release` once every downstream has
// them (or at shutdown).
void Relay::Impl::post_chunk(std::uint32_t c, const std::byte* base, std::uint64_t len, std::function<void()> release) {
  {
    std::lock_guard<std::mutex> g(cmd_mu);
    if (net_done) {
      release();
      throw Error(Errc::kAborted, "the relay is stopping");
    }
    cmds.push_back(SrcCmd{SrcCmd::kChunk, nullptr, c, base, len, 0, 0, {}, std::move(release)});
  }
  wake();
  const std::uint64_t sum = o.checksums ? XXH3_64bits(base, len) : 0;
  {
    std::lock_guard<std::mutex> g(cmd_mu);
    cmds.push_back(SrcCmd{SrcCmd::kSum, nullptr, c, nullptr, len, sum, 0, {}, {}});
  }
  wake();
}

}  // namespace shmcast::relay
