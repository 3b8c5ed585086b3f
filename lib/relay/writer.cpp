// The relay's region writer (nodes with `from`): a thread of its own that
// is the Producer of this node's region. The network thread queues commands
// (push_writer, under wmu); the writer creates the region, writes or
// publishes each chunk, lends slots for direct receives, and hands buffers
// back (wdone, lend_replies). A Hasher thread checks chunks while they are
// copied.
#include "relay_impl.hpp"

#include <xxhash.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <span>
#include <thread>

#include "base/text.hpp"

namespace shmcast::relay {

namespace {

// Slot sizes are multiples of kDataAlign (Producer::create rounds them up).
std::uint64_t align_slot(std::uint64_t n) {
  return (n + limits::kDataAlign - 1) / limits::kDataAlign * limits::kDataAlign;
}

// A thread that computes XXH3-64 of one buffer at a time while the region
// writer copies it: the writer's per-chunk cost is then the slower of the
// two passes, not their sum.
class Hasher {
 public:
  Hasher() : t_([this] { run(); }) {}
  Hasher(const Hasher&) = delete;
  Hasher& operator=(const Hasher&) = delete;
  ~Hasher() {
    {
      std::lock_guard<std::mutex> g(mu_);
      exit_ = true;
    }
    cv_.notify_all();
    t_.join();
  }
  // Starts hashing [p, p + n); the caller must wait() before the bytes may
  // go (Job does it on every path). A job still running is waited for first.
  void start(const std::byte* p, std::uint64_t n) {
    {
      std::unique_lock<std::mutex> g(mu_);
      cv_.wait(g, [this] { return !busy_; });
      p_ = p;
      n_ = n;
      busy_ = true;
    }
    cv_.notify_all();
  }
  // A hash in flight over a buffer: the destructor waits for it, so no path
  // (an exception from the copy included) hands the buffer back while it is
  // still being read.
  class Job {
   public:
    Job(Hasher& h, const std::byte* p, std::uint64_t n) : h_(h) { h_.start(p, n); }
    Job(const Job&) = delete;
    Job& operator=(const Job&) = delete;
    ~Job() {
      if (!done_) (void)h_.wait();
    }
    std::uint64_t sum() {
      done_ = true;
      return h_.wait();
    }

   private:
    Hasher& h_;
    bool done_ = false;
  };
  std::uint64_t wait() {
    std::unique_lock<std::mutex> g(mu_);
    cv_.wait(g, [this] { return !busy_; });
    return sum_;
  }

 private:
  void run() {
    std::unique_lock<std::mutex> g(mu_);
    for (;;) {
      cv_.wait(g, [this] { return busy_ || exit_; });
      if (exit_) return;
      const std::byte* p = p_;
      const std::uint64_t n = n_;
      g.unlock();
      const std::uint64_t sum = XXH3_64bits(p, n);
      g.lock();
      sum_ = sum;
      busy_ = false;
      cv_.notify_all();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  const std::byte* p_ = nullptr;
  std::uint64_t n_ = 0, sum_ = 0;
  bool busy_ = false, exit_ = false;
  std::thread t_;
};

}  // namespace

using detail::coarse_bytes;

// The writer thread's own state (on its stack in writer_main).
struct Relay::Impl::WriterState {
  std::optional<Producer> prod;
  std::uint64_t gen = 0;  // regions created
  bool direct = false;    // the sync in progress is received into lent slots
  bool lent = false;      // ...and a slot of it was lent (write_part is refused from then on)
  std::unique_ptr<Hasher> hasher;
  std::shared_ptr<const SyncPlan> plan;
  bool ok = false;  // the local sync is live
  std::size_t cursor = 0;
  // Delta syncs (docs/relay.md, "Delta syncs"). The region is a delta region
  // (a ring of host slots): every sync is published as it came
  // (Producer::begin_forwarded), a delta only on the version of the same
  // tensors this region completed last (`held`), so consumers here find its
  // base.
  bool delta_region = false;
  bool saw_delta = false;       // a delta sync came from upstream
  HeldBases held;               // per tensor set, the last sync this region completed, since it was created
  std::uint64_t set = 0;        // HeldBases::key of the sync in progress
  std::uint64_t last_seen = 0;  // the last sync begun upstream
  std::uint64_t asked_at = ~0ull;  // last_seen when a full sync was last asked for
};

void Relay::Impl::push_writer(WCmd c) {
  {
    std::lock_guard<std::mutex> g(wmu);
    wq.push_back(std::move(c));
  }
  wcv.notify_one();
}

void Relay::Impl::writer_main() {
  WriterState ws;
  for (;;) {
    std::optional<WCmd> c;
    {
      std::unique_lock<std::mutex> g(wmu);
      if (wq.empty() && !writer_exit) wcv.wait_for(g, 200ms);
      if (!wq.empty()) {
        c = std::move(wq.front());
        wq.pop_front();
      } else if (writer_exit) {
        break;
      }
    }
    if (c) {
      try {
        writer_do(ws, *c);
      } catch (const Error& e) {
        set_fatal(e);
      }
      if (c->t == WCmd::kChunk) {
        {
          std::lock_guard<std::mutex> g(wmu);
          wdone.push_back(c->buf);
        }
        wake();
      }
    }
    // Full syncs this node needs: a consumer here asked for one (it
    // attached late, skipped a version, was handed other destinations), or
    // a store region, which keeps full versions only, saw deltas. Asked once
    // per upstream sync, and not while a full sync is being published
    // (it answers the consumers enrolled in it).
    if (ws.prod && ws.asked_at != ws.last_seen && !(ws.ok && ws.plan && !ws.plan->delta())) {
      bool want = false;
      std::uint64_t after = 0;  // a store region: any full sync
      try {
        want = ws.delta_region ? ws.prod->full_sync_requested(&after) : ws.saw_delta;
      } catch (...) {
      }
      if (want) ask_full(ws, ws.delta_region ? "a consumer of this node's region asked for a full sync"
                                             : "this node's store region keeps full versions",
                         after);
    }
    // Live consumers of this node's region, for the status file.
    if (ws.prod) {
      std::uint32_t n = 0;
      try {
        n = ws.prod->consumers();
      } catch (...) {
      }
      std::lock_guard<std::mutex> g(smu);
      if (st.region_consumers != n) status_dirty = true;
      st.region_consumers = n;
    }
  }
  if (ws.prod) {
    try {
      if (ws.ok) ws.prod->abort_sync("the relay is stopping");
      ws.prod->close();
    } catch (...) {
    }
  }
}

std::uint64_t Relay::Impl::local_slot_bytes(std::uint64_t chunk_bytes) const {
  return align_slot(o.region_options.slot_bytes ? o.region_options.slot_bytes : chunk_bytes);
}

void Relay::Impl::ensure_region(WriterState& ws, std::uint64_t chunk_bytes, bool fresh) {
  const std::uint64_t want = local_slot_bytes(chunk_bytes);
  if (ws.prod && ws.prod->slot_bytes() == want && !fresh) return;
  if (ws.prod) {
    // No receive or forwarding send may still use the old slots.
    if (!slot_use.wait_free(nullptr, std::chrono::steady_clock::now() + o.peer_timeout + std::chrono::seconds(5)))
      throw Error(Errc::kTimeout, "the region cannot be recreated: network operations still use its slots after "
                                  "peer_timeout; restart the relay");
    ws.prod->close();
    ws.prod.reset();
  }
  ProducerOptions po = o.region_options;
  po.slot_bytes = want;
  // A ring of host slots passes delta syncs on (begin_forwarded); a store
  // region keeps full versions (docs/relay.md, "Delta syncs").
  po.delta = po.mode == RegionMode::kRing && po.world_size == 1 && po.slot_memory == SlotMemory::kHost;
  ws.prod.emplace(Producer::create(o.region, po));
  ws.delta_region = po.delta;
  ws.held.clear();
  ++ws.gen;
  region_slot_bytes = ws.prod->slot_bytes();
  region_slots = ws.prod->slots();
  wake();
  log(std::string(fresh ? "region recreated: " : "region created: ") + o.region + " in " + region_dir() + ", " +
      std::to_string(ws.prod->slots()) + " slots of " + coarse_bytes(ws.prod->slot_bytes()));
  std::lock_guard<std::mutex> g(smu);
  st.region_ready = true;
  st.region_slot_bytes = ws.prod->slot_bytes();
  status_dirty = true;
}

// Local failures (a stalled consumer here) end the local sync only; the
// chunks are forwarded regardless. Errors that retrying cannot fix escape.
void Relay::Impl::writer_do(WriterState& ws, const WCmd& c) {
  switch (c.t) {
    case WCmd::kOpen: ensure_region(ws, c.chunk_bytes, false); return;
    case WCmd::kBegin: {
      ensure_region(ws, c.chunk_bytes, false);
      if (c.plan->version <= ws.prod->last_version()) {
        log("upstream version " + std::to_string(c.plan->version) + " is not above this region's " +
            std::to_string(ws.prod->last_version()) + " (the source region restarted): recreating the region");
        ensure_region(ws, c.chunk_bytes, true);
      }
      ws.plan = c.plan;
      ws.cursor = 0;
      ws.ok = false;
      ws.direct = o.direct_receive && ws.prod->slot_bytes() == c.plan->chunk_bytes;
      ws.lent = false;
      ws.last_seen = c.plan->version;
      const SyncPlan& p = *c.plan;
      const std::uint64_t set = ws.set = HeldBases::key(p.specs);
      if (p.delta()) {
        ws.saw_delta = true;
        const std::uint64_t held = ws.held.version(set);
        if (!ws.delta_region || held != p.base_version) {
          // Never published on another base: let it go, ask for a full sync.
          const std::string why =
              "delta sync " + std::to_string(p.version) + " builds on version " + std::to_string(p.base_version) +
              (ws.delta_region ? ", which this node's region does not hold (it holds " +
                                     (held ? "version " + std::to_string(held) : std::string("none")) +
                                     " of these tensors)"
                               : ", and this node's store region keeps full versions");
          ws.held.forget(set);
          {
            std::lock_guard<std::mutex> g(smu);
            ++st.delta_skipped;
            status_dirty = true;
          }
          ask_full(ws, why, p.version);  // this node goes on from the syncs after it
          return;
        }
      }
      ws.held.forget(set);  // until this sync is complete here
      try {
        if (ws.delta_region)
          ws.prod->begin_forwarded(p.specs, p.version, p.base_version, p.delta() ? p.nbytes : std::vector<std::uint64_t>{},
                                   p.is_delta);
        else
          ws.prod->begin_sync(p.specs, p.version);
        ws.ok = true;
      } catch (const Error& e) {
        local_failure(e.what());
      }
      return;
    }
    case WCmd::kChunk: {
      if (!ws.ok || ws.plan != c.plan) return;
      const std::string bad = "chunk " + std::to_string(c.chunk) + " of sync " + std::to_string(c.plan->version) +
                              " fails its XXH3 checksum across the hop";
      try {
        if (ws.direct) {
          // Received straight into the slot lend_chunk() gave: verify,
          // then publish (consumers never see a chunk that fails).
          if (c.buf < kSlotBase) throw Error(Errc::kInvalidArgument, "chunk " + std::to_string(c.chunk) +
                                                                         " did not arrive in its slot");
          if (o.checksums && (!c.why.empty() || (!c.verified && XXH3_64bits(c.data, c.len) != c.sum)))
            throw Error(Errc::kChecksum, bad);
          ws.prod->publish_chunks(c.chunk + 1ull);
        } else if (!o.checksums) {
          write_chunk(ws, c, 0, c.len);
        } else if (ws.prod->slot_bytes() == c.plan->chunk_bytes) {
          // This chunk is exactly one slot here, published once the last
          // tensor byte in it is written (or with the next chunk's first).
          // Hash on the hasher thread while copying all but the last 4 KiB
          // of tensor bytes; write those only once the sum matched.
          if (!ws.hasher) ws.hasher = std::make_unique<Hasher>();
          Hasher::Job job(*ws.hasher, c.data, c.len);
          const std::uint64_t held = data_end(ws, c), tail = held > 4096 ? held - 4096 : 0;
          write_chunk(ws, c, 0, tail);
          if (job.sum() != c.sum) throw Error(Errc::kChecksum, bad);
          write_chunk(ws, c, tail, c.len);
        } else {
          if (XXH3_64bits(c.data, c.len) != c.sum) throw Error(Errc::kChecksum, bad);
          write_chunk(ws, c, 0, c.len);
        }
      } catch (const Error& e) {
        if (e.code() == Errc::kChecksum || e.code() == Errc::kInvalidArgument) ws.prod->abort_sync(e.what());
        ws.ok = false;  // write_part() and publish_chunks() aborted the sync already
        local_failure(e.what());
      }
      return;
    }
    case WCmd::kEnd: {
      if (!ws.ok || ws.plan != c.plan) return;
      try {
        const SyncPlan& p = *ws.plan;
        // A sync with no data chunk (only empty tensors) lent nothing.
        if (!ws.lent)
          for (; ws.cursor < p.specs.size(); ++ws.cursor) ws.prod->write_part(ws.cursor, 0, nullptr, 0);
        ws.prod->end_sync();
        ws.held.hold(ws.set, p.version);
        std::lock_guard<std::mutex> g(smu);
        ++st.region_syncs;
        st.region_version = p.version;
        status_dirty = true;
      } catch (const Error& e) {
        ws.prod->abort_sync(e.what());  // no sync may stay open: the next begin_sync would be refused
        local_failure(e.what());
      }
      ws.ok = false;
      return;
    }
    case WCmd::kAbort: {
      if (ws.ok && ws.prod) ws.prod->abort_sync(c.why);
      ws.ok = false;
      return;
    }
    case WCmd::kLend: {
      // The network thread receives chunk c.chunk straight into its slot.
      std::byte* got = nullptr;
      if (ws.ok && ws.plan == c.plan && ws.direct) {
        try {
          const std::span<std::byte> sp = ws.prod->lend_chunk(c.chunk);  // waits for this node's consumers
          // ...and for forwarding sends of the slot's previous chunk.
          if (!slot_use.wait_free(sp.data(), std::chrono::steady_clock::now() + o.peer_timeout +
                                                 std::chrono::seconds(5))) {
            const std::string why = "slot of chunk " + std::to_string(c.chunk) +
                                    " is still being forwarded downstream after peer_timeout";
            ws.prod->abort_sync(why);
            throw Error(Errc::kTimeout, why);
          }
          got = sp.data();
          ws.lent = true;
        } catch (const Error& e) {
          ws.ok = false;  // lend_chunk() aborted the sync already
          local_failure(e.what());
        }
      }
      {
        std::lock_guard<std::mutex> g(wmu);
        lend_replies.push_back(LendReply{c.serial, c.pos, got, ws.gen});
      }
      wake();
      return;
    }
  }
}

// Where the tensor bytes in chunk c.chunk end, relative to its start.
std::uint64_t Relay::Impl::data_end(const WriterState& ws, const WCmd& c) const {
  const SyncPlan& p = *ws.plan;
  const std::uint64_t base = static_cast<std::uint64_t>(c.chunk) * p.chunk_bytes, end = base + c.len;
  std::uint64_t last = 0;
  for (std::size_t j = ws.cursor; j < p.specs.size() && p.offsets[j] < end; ++j)
    if (p.nbytes[j] > 0) last = std::min(p.offsets[j] + p.nbytes[j], end) - base;
  return last;
}

// Writes bytes [from, to) of chunk c.chunk (pieces of it in order).
void Relay::Impl::write_chunk(WriterState& ws, const WCmd& c, std::uint64_t from, std::uint64_t to) {
  const SyncPlan& p = *ws.plan;
  const std::uint64_t base = static_cast<std::uint64_t>(c.chunk) * p.chunk_bytes;
  const std::uint64_t start = base + from, end = base + to;
  if (end <= start) return;
  for (std::size_t j = ws.cursor; j < p.specs.size(); ++j) {
    const std::uint64_t n = p.nbytes[j];
    if (n == 0) {
      ws.prod->write_part(j, 0, nullptr, 0);
      ws.cursor = j + 1;
      continue;
    }
    const std::uint64_t a = p.offsets[j], b = a + n;
    if (a >= end) break;
    const std::uint64_t lo = std::max(a, start), hi = std::min(b, end);
    ws.prod->write_part(j, lo - a, c.data + (lo - base), hi - lo);
    if (hi < b) break;  // the tensor goes on in the next chunk
    ws.cursor = j + 1;
  }
}

void Relay::Impl::local_failure(const std::string& why) {
  log("this node's region: sync failed: " + why);
  std::lock_guard<std::mutex> g(smu);
  ++st.region_failed;
  st.region_error = why;
  status_dirty = true;
}

// Asks the upstream for a full sync (kWantFull, sent by the network
// thread), at most once per upstream sync.
void Relay::Impl::ask_full(WriterState& ws, const std::string& why, std::uint64_t after) {
  if (ws.asked_at == ws.last_seen) return;
  ws.asked_at = ws.last_seen;
  log("asking the upstream for a full sync: " + why);
  want_full_up.add(after);
  wake();
}

}  // namespace shmcast::relay
