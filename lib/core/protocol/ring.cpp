// Over 800 lines on purpose (below): the ring protocol (layer 4): the header snapshot, the chunk writer and the
// chunk reader over one region (ring.hpp, docs/protocol.md). One protocol, one
// file past 800 lines: the writer and the reader are the two halves of the
// same seqlock and slot-release orderings, and are read side by side.
#include "protocol/ring.hpp"

#include "base/checks.hpp"

#include <xxhash.h>

#include <atomic>
#include <cstring>

namespace shmcast::detail {

HeaderFixed snapshot_header(const std::byte* base) {
  HeaderFixed h;
  std::memcpy(&h, base, sizeof h);
  return h;
}

Geometry checked_geometry(const MappedFile& f, const HeaderFixed& snap) {
  bool version_mismatch = false;
  const std::string why = validate_header(snap, f.size(), &version_mismatch);
  if (version_mismatch) throw Error(Errc::kVersionMismatch, f.path() + ": " + why + "; upgrade the older side");
  if (!why.empty()) throw Error(Errc::kCorrupt, f.path() + ": " + why);
  Geometry g{};
  compute_geometry(snap.max_consumers, snap.slot_count, snap.slot_bytes, snap.manifest_bytes, &g, snap.world_size,
                   (snap.features & kFeatureStore) != 0, (snap.features & kFeatureDeviceSlots) != 0);
  return g;
}

DeviceSlotsFixed snapshot_device_slots(const std::byte* base) {
  DeviceSlotsFixed d;
  std::memcpy(&d, base + offsetof(Header, device_slots), sizeof d);
  return d;
}

std::uint32_t seat_state(std::uint64_t w) { return static_cast<std::uint32_t>(w & 0xffffffffu); }
std::uint64_t seat_gen(std::uint64_t w) { return w >> 32; }
std::uint64_t make_seat_word(std::uint64_t gen, std::uint32_t state) { return (gen << 32) | state; }

bool read_record(const Header& h, RecordSnapshot* out) {
  const SyncRecord& r = h.sync;
  const std::uint32_t w1 = r.announce.word.load(std::memory_order_acquire);
  if (w1 & 1u) return false;
  RecordSnapshot s;
  copy_record(r, &s);
  s.word = w1;
  std::atomic_thread_fence(std::memory_order_acquire);
  if (r.announce.word.load(std::memory_order_relaxed) != w1) return false;
  *out = s;
  return true;
}

bool recover_store_record(const std::byte* base, const Geometry& g, RecordSnapshot* out) {
  if (!g.store) return false;
  const Header& h = *reinterpret_cast<const Header*>(base);
  RecordSnapshot best{};
  bool found = false;
  for (std::uint32_t k = 0; k < g.slot_count; ++k) {
    const SlotDesc& d = *reinterpret_cast<const SlotDesc*>(base + g.slots_offset + std::uint64_t{k} * kSlotDescBytes);
    // seq (acquire) first: the fields stored before its release are then this fill's.
    const std::uint64_t seq = d.seq.load(std::memory_order_acquire);
    if (seq == 0 || seq > (1ull << 62) || (seq - 1) % g.slot_count != k) continue;
    if (d.fill_seq.load(std::memory_order_acquire) != seq) continue;  // being refilled
    RecordSnapshot r{};
    r.version = d.version.load(std::memory_order_relaxed);
    r.first_seq = seq;
    r.chunks = 1;
    r.stream_bytes = d.bytes.load(std::memory_order_relaxed);
    r.manifest_used = d.manifest_used.load(std::memory_order_relaxed);
    r.manifest_hash = d.manifest_hash.load(std::memory_order_relaxed);
    r.aborted = false;
    if (r.version == 0 || r.stream_bytes > g.slot_bytes || !record_problem(r, g).empty()) continue;
    const std::byte* manifest = base + g.manifest_offset + std::uint64_t{k} * g.manifest_bytes;
    if (XXH3_64bits(manifest, r.manifest_used) != r.manifest_hash) continue;
    if (!found || r.first_seq > best.first_seq) best = r;
    found = true;
  }
  if (!found) return false;
  best.word = h.sync.announce.word.load(std::memory_order_acquire);
  *out = best;
  return true;
}

namespace {

std::string seat_who(std::uint32_t i, const Seat& s) {
  return "consumer seat " + std::to_string(i) + " (pid " +
         std::to_string(s.consumer.pid.load(std::memory_order_relaxed)) + ")";
}

}  // namespace

std::string rank_who(const RegionView& v, std::uint32_t rank) {
  if (rank == 0)
    return "producer rank 0 (pid " + std::to_string(v.header().producer.pid.load(std::memory_order_relaxed)) + ")";
  return "producer rank " + std::to_string(rank) + " (pid " +
         std::to_string(v.rank_seat(rank).who.pid.load(std::memory_order_relaxed)) + ")";
}

bool rank_dead(const RegionView& v, std::uint32_t rank) {
  if (rank == 0) return peer_alive(v.fd(), kProducerLockByte, v.header().producer) == Alive::kNo;
  return peer_alive(v.fd(), rank_lock_byte(rank), v.rank_seat(rank).who) == Alive::kNo;
}

// ================================================================ producer

bool ProducerRing::enrolled(const Seat& s, std::uint64_t word) const {
  return seat_state(word) == kSeatActive && s.included_gen.load(std::memory_order_acquire) == seat_gen(word);
}

std::uint32_t ProducerRing::enroll(std::uint64_t version, std::uint64_t first_seq) {
  std::uint32_t n = 0;
  for (std::uint32_t i = 0; i < v_->geo().max_consumers; ++i) {
    Seat& s = v_->seat(i);
    const std::uint64_t w = s.word.load(std::memory_order_acquire);
    if (seat_state(w) != kSeatActive) continue;
    if (lock_held(v_->fd(), seat_lock_byte(i)) == Alive::kNo) {
      evict(i, w, Errc::kPeerDied, seat_who(i, s) + " died; its seat was released");
      continue;
    }
    if (s.included_gen.load(std::memory_order_acquire) != seat_gen(w)) {
      s.first_seq.store(first_seq, std::memory_order_relaxed);
      s.first_version.store(version, std::memory_order_relaxed);
      s.evict_reason.store(0, std::memory_order_relaxed);
      s.included_gen.store(seat_gen(w), std::memory_order_release);
    }
    ++n;
  }
  return n;
}

std::uint32_t ProducerRing::live_consumers() const {
  std::uint32_t n = 0;
  for (std::uint32_t i = 0; i < v_->geo().max_consumers; ++i) {
    const std::uint64_t w = v_->seat(i).word.load(std::memory_order_acquire);
    if (seat_state(w) == kSeatActive && lock_held(v_->fd(), seat_lock_byte(i)) != Alive::kNo) ++n;
  }
  return n;
}

void ProducerRing::evict(std::uint32_t i, std::uint64_t word, Errc reason, const std::string& why) {
  Seat& s = v_->seat(i);
  s.evict_reason.store(static_cast<std::uint32_t>(reason), std::memory_order_relaxed);
  std::uint64_t expect = word;
  if (s.word.compare_exchange_strong(expect, make_seat_word(seat_gen(word), kSeatEvicted), std::memory_order_acq_rel)) {
    v_->header().evictions.fetch_add(1, std::memory_order_relaxed);
    events_.push_back(why);
    // An evicted consumer that is still alive learns of it on its next wait.
    ring_keep_parity(v_->header().sync.announce);
    ring(v_->header().publish);
  }
}

int ProducerRing::blocker(const std::function<bool(const Seat&)>& done) const {
  for (std::uint32_t i = 0; i < v_->geo().max_consumers; ++i) {
    const Seat& s = v_->seat(i);
    const std::uint64_t w = s.word.load(std::memory_order_acquire);
    // A store region enrolls nobody: every active seat may hold a bank.
    if (opts_.store ? seat_state(w) != kSeatActive : !enrolled(s, w)) continue;
    if (!done(s)) return static_cast<int>(i);
  }
  return -1;
}

int ProducerRing::unpublished_before(std::uint64_t released, std::uint64_t release_to, std::uint64_t* chunk) const {
  const std::uint64_t first = sync_first_seq_, R = opts_.world_size;
  // A consumer that has not yet taken this sync (released < first - 1) is
  // behind on its own account: it releases the earlier syncs' chunks when it
  // takes this one.
  if (R <= 1 || sync_version_ == 0 || released + 1 < first) return -1;
  for (std::uint64_t x = released + 1; x <= release_to; ++x) {
    // The slot cannot hold a later chunk than x yet: writing x + K needs
    // every consumer to have released x.
    if (v_->slot(v_->slot_of(x)).seq.load(std::memory_order_acquire) == x) continue;
    *chunk = x;
    return static_cast<int>((x - first) % R);
  }
  return -1;
}

void ProducerRing::wait_for(const std::function<bool(const Seat&)>& done, const char* what,
                            std::int64_t deadline_ns, std::uint64_t release_to) {
  Header& h = v_->header();
  for (;;) {
    auto ready = [&] { return blocker(done) < 0 || (opts_.world_size > 1 && aborted_now()); };
    const WaitResult r = wait_until(h.release, ready, deadline_ns, kLivenessPollNs);
    check_aborted();
    if (r == WaitResult::kReady) return;
    // Some seat holds us up: dead ones are evicted, live ones get until the deadline.
    const int b = blocker(done);
    if (b < 0) return;
    if (opts_.world_size > 1 && opts_.rank != 0 && sync_version_ != 0 && rank_dead(*v_, 0))
      throw Error(Errc::kPeerDied, rank_who(*v_, 0) + " died in the middle of sync " +
                                       std::to_string(sync_version_) + ": restart the trainer's ranks together");
    const std::uint32_t i = static_cast<std::uint32_t>(b);
    Seat& s = v_->seat(i);
    const std::uint64_t w = s.word.load(std::memory_order_acquire);
    if (lock_held(v_->fd(), seat_lock_byte(i)) == Alive::kNo) {
      evict(i, w, Errc::kPeerDied, seat_who(i, s) + " died while the producer waited for it to " + what +
                                       "; its seat was released and the sync goes on without it");
      continue;
    }
    std::uint64_t chunk = 0;
    if (const int writer = release_to == 0 ? -1
                                           : unpublished_before(s.released_seq.load(std::memory_order_acquire),
                                                                release_to, &chunk);
        writer >= 0) {
      // The consumer waits for that chunk: the rank that owes it is late, not the consumer.
      const auto wr = static_cast<std::uint32_t>(writer);
      if (wr != opts_.rank && rank_dead(*v_, wr))
        throw Error(Errc::kPeerDied, rank_who(*v_, wr) + " died before publishing chunk " + std::to_string(chunk) +
                                         " of sync " + std::to_string(sync_version_) +
                                         ": restart the trainer's ranks together");
      if (r == WaitResult::kTimeout)
        throw Error(Errc::kTimeout,
                    (wr == opts_.rank ? "this rank's own copy of chunk " + std::to_string(chunk) + " (producer rank " +
                                            std::to_string(wr) + ")"
                                      : rank_who(*v_, wr) + ", which did not publish chunk " + std::to_string(chunk)) +
                        " of sync " + std::to_string(sync_version_) + " within consumer_timeout (" +
                        std::to_string(opts_.consumer_timeout_ns / 1000000) +
                        " ms), stalled the sync: the consumers wait for that chunk before they can release "
                        "others; is that rank stuck?");
      continue;
    }
    if (r == WaitResult::kTimeout) {
      const std::string why = seat_who(i, s) + " is alive but did not " + what + " within " +
                              std::to_string(opts_.consumer_timeout_ns / 1000000) + " ms";
      if (opts_.stall_policy == StallPolicy::kEvict) {
        evict(i, w, Errc::kTimeout, why + "; it was evicted (StallPolicy::kEvict)");
        continue;
      }
      throw Error(Errc::kTimeout, why + ": is it stopped or stuck? Raise consumer_timeout, or use "
                                        "StallPolicy::kEvict to drop stalled consumers");
    }
  }
}

void ProducerRing::wait_acks(std::uint64_t version) {
  auto done = [version](const Seat& s) {
    return s.first_version.load(std::memory_order_relaxed) > version ||
           s.acked_version.load(std::memory_order_acquire) >= version;
  };
  wait_for(done, "read the manifest", mono_ns() + opts_.consumer_timeout_ns);
}

void ProducerRing::wait_released(std::uint64_t seq, std::int64_t deadline_ns) {
  if (seq == 0) return;
  auto done = [seq](const Seat& s) {
    return s.first_seq.load(std::memory_order_relaxed) > seq || s.released_seq.load(std::memory_order_acquire) >= seq;
  };
  wait_for(done, "release its slots", deadline_ns, seq);
}

bool ProducerRing::aborted_now() const {
  const Header& h = v_->header();
  return sync_version_ != 0 && h.sync.aborted.load(std::memory_order_acquire) != 0 &&
         h.sync.version.load(std::memory_order_acquire) == sync_version_;
}

void ProducerRing::check_aborted() const {
  if (opts_.world_size <= 1 || !aborted_now()) return;
  const Header& h = v_->header();
  const auto code = static_cast<Errc>(h.error_code.load(std::memory_order_acquire));
  throw Error(code == Errc::kTimeout || code == Errc::kPeerDied ? code : Errc::kAborted,
              "sync " + std::to_string(sync_version_) + " was aborted by another rank: " +
                  read_error_text(h.error_text));
}

void ProducerRing::acquire(std::uint64_t seq) {
  const std::uint64_t k = v_->geo().slot_count;
  if (opts_.store) {
    // Dekker with ConsumerRing::hold(): the new fill_seq is stored before
    // the holds are read (both seq_cst); a consumer storing its hold reads
    // fill_seq after. Either we see its hold and wait, or it sees the bank
    // being replaced and backs off. The bank's bytes and its chunk's seq
    // stay as they were until the holders are gone (begin_fill).
    v_->slot(v_->slot_of(seq)).fill_seq.store(seq, std::memory_order_seq_cst);
    if (seq <= k) return;
    const std::uint64_t prev = seq - k;
    auto done = [prev](const Seat& s) { return s.hold_seq.load(std::memory_order_seq_cst) != prev; };
    wait_for(done, ("let go of the version in bank " + std::to_string(v_->slot_of(seq))).c_str(),
             mono_ns() + opts_.consumer_timeout_ns);
    return;
  }
  if (seq <= k) return;
  const std::uint64_t prev = seq - k;
  if (opts_.world_size > 1 && prev >= sync_first_seq_) {
    // The slot's previous chunk belongs to this sync and to another rank
    // (slots >= 2R): wait until that rank published it, so two ranks never
    // write one slot at once, even with no consumer to hold it back.
    const std::uint32_t writer = static_cast<std::uint32_t>((prev - sync_first_seq_) % opts_.world_size);
    const SlotDesc& d = v_->slot(v_->slot_of(prev));
    Header& h = v_->header();
    const std::int64_t deadline = mono_ns() + opts_.consumer_timeout_ns;
    for (;;) {
      auto ready = [&] { return d.seq.load(std::memory_order_acquire) == prev || aborted_now(); };
      const WaitResult r = wait_until(h.publish, ready, deadline, kLivenessPollNs);
      check_aborted();
      if (r == WaitResult::kReady) break;
      if (rank_dead(*v_, writer))
        throw Error(Errc::kPeerDied, rank_who(*v_, writer) + " died before publishing chunk " + std::to_string(prev) +
                                         " of sync " + std::to_string(sync_version_));
      if (r == WaitResult::kTimeout)
        throw Error(Errc::kTimeout, rank_who(*v_, writer) + " did not publish chunk " + std::to_string(prev) +
                                        " within consumer_timeout: is it stuck?");
    }
  }
  wait_released(prev, mono_ns() + opts_.consumer_timeout_ns);
}

void ProducerRing::begin_fill(std::uint64_t seq) {
  SlotDesc& d = v_->slot(v_->slot_of(seq));
  d.seq.store(0, std::memory_order_relaxed);
  d.filled.store(0, std::memory_order_relaxed);
  // Release: a reader that sees the new fill_seq (acquire) also sees
  // filled == 0, never the previous chunk's count (stale bytes as final).
  d.fill_seq.store(seq, std::memory_order_release);
  // Readers that copied this slot re-check seq afterwards (ConsumerRing::
  // still_valid); the fence orders the store before the data writes.
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

void ProducerRing::publish(std::uint64_t seq, std::uint64_t version, std::uint64_t bytes, std::uint64_t checksum) {
  SlotDesc& d = v_->slot(v_->slot_of(seq));
  d.version.store(version, std::memory_order_relaxed);
  d.bytes.store(bytes, std::memory_order_relaxed);
  d.checksum.store(checksum, std::memory_order_relaxed);
  d.seq.store(seq, std::memory_order_release);
  Header& h = v_->header();
  if (opts_.world_size > 1) {
    v_->rank_seat(opts_.rank).published_seq.store(seq, std::memory_order_release);
    // Ranks publish out of order: published_seq is the highest (for tools).
    std::uint64_t cur = h.published_seq.load(std::memory_order_relaxed);
    while (cur < seq && !h.published_seq.compare_exchange_weak(cur, seq, std::memory_order_release)) {
    }
  } else {
    h.published_seq.store(seq, std::memory_order_release);
  }
  ring(h.publish);
}

void ProducerRing::progress(std::uint64_t seq, std::uint64_t filled) {
  v_->slot(v_->slot_of(seq)).filled.store(filled, std::memory_order_release);
  ring(v_->header().publish);  // a syscall only when a consumer sleeps
}

void ProducerRing::begin_announce() {
  SyncRecord& r = v_->header().sync;
  const std::uint32_t w = r.announce.word.load(std::memory_order_relaxed);
  if ((w & 1u) == 0) r.announce.word.store(w + 1, std::memory_order_relaxed);  // odd: writing
  // Orders the odd word before every later store (record fields, manifest
  // bytes): a reader that sees any of those sees the word odd or changed.
  std::atomic_thread_fence(std::memory_order_release);
}

void (*g_announce_store_hook)(int) = nullptr;

void ProducerRing::announce(const RecordSnapshot& rec) {
  Header& h = v_->header();
  SyncRecord& r = h.sync;
  auto at = [](int i) {
    if (void (*hook)(int) = g_announce_store_hook) hook(i);
  };
  at(0);
  begin_announce();
  at(1);
  r.version.store(rec.version, std::memory_order_relaxed);
  at(2);
  r.first_seq.store(rec.first_seq, std::memory_order_relaxed);
  at(3);
  r.chunks.store(rec.chunks, std::memory_order_relaxed);
  at(4);
  r.stream_bytes.store(rec.stream_bytes, std::memory_order_relaxed);
  at(5);
  r.manifest_used.store(rec.manifest_used, std::memory_order_relaxed);
  at(6);
  r.manifest_hash.store(rec.manifest_hash, std::memory_order_relaxed);
  at(7);
  r.aborted.store(0, std::memory_order_relaxed);
  at(8);
  // Even again (+1 from odd): ring() bumps the word and wakes sleepers.
  ring(r.announce);
  at(9);
}

void ProducerRing::abort(std::uint64_t version) {
  Header& h = v_->header();
  if (h.sync.version.load(std::memory_order_relaxed) != version) return;
  h.sync.aborted.store(1, std::memory_order_release);
  ring_keep_parity(h.sync.announce);
  ring(h.publish);
  ring(h.release);     // other ranks waiting for consumers notice it too
  ring(h.rank_reply);  // and ranks waiting for rank 0 to complete the sync
}

// ================================================================ consumer

void ConsumerRing::claim() {
  const SelfIdentity me = self_identity();
  for (std::uint32_t i = 0; i < v_->geo().max_consumers; ++i) {
    const int rc = lock_byte(v_->fd(), seat_lock_byte(i));
    if (rc == -EAGAIN) continue;  // a live consumer holds it
    if (rc != 0) throw Error(Errc::kSystem, std::string("cannot lock a consumer seat: ") + std::strerror(-rc), -rc);
    // The lock is ours, so whoever had this seat is gone: take it over.
    Seat& s = v_->seat(i);
    const std::uint64_t old = s.word.load(std::memory_order_acquire);
    gen_ = seat_gen(old) + 1;
    s.released_seq.store(0, std::memory_order_relaxed);
    s.hold_seq.store(0, std::memory_order_relaxed);
    s.acked_version.store(0, std::memory_order_relaxed);
    s.syncs_done.store(0, std::memory_order_relaxed);
    s.bytes_done.store(0, std::memory_order_relaxed);
    s.error_code.store(0, std::memory_order_relaxed);
    s.error_text[0] = 0;
    // Delta regions: a consumer that attaches asks for a full sync after the
    // newest version announced (it holds none of them); protocol.md §9.
    s.full_after.store(v_->header().sync.version.load(std::memory_order_relaxed), std::memory_order_relaxed);
    s.attach_unix_ns.store(static_cast<std::uint64_t>(unix_ns()), std::memory_order_relaxed);
    write_identity(s.consumer, me);
    s.word.store(make_seat_word(gen_, kSeatActive), std::memory_order_seq_cst);
    seat_ = static_cast<int>(i);
    ring(v_->header().release);
    return;
  }
  throw Error(Errc::kNoSeat, "all " + std::to_string(v_->geo().max_consumers) +
                                 " consumer seats of the region are held by live consumers: close one, or "
                                 "create the region with a larger max_consumers");
}

void ConsumerRing::leave() {
  if (seat_ < 0) return;
  Seat& s = v_->seat(static_cast<std::uint32_t>(seat_));
  std::uint64_t w = s.word.load(std::memory_order_acquire);
  while (seat_gen(w) == gen_ && seat_state(w) != kSeatFree) {
    if (s.word.compare_exchange_weak(w, make_seat_word(gen_, kSeatFree), std::memory_order_acq_rel)) break;
  }
  unlock_byte(v_->fd(), seat_lock_byte(static_cast<std::uint32_t>(seat_)));
  ring(v_->header().release);
  seat_ = -1;
}

void ConsumerRing::check_seat() const {
  const Seat& s = v_->seat(static_cast<std::uint32_t>(seat_));
  const std::uint64_t w = s.word.load(std::memory_order_acquire);
  if (seat_gen(w) == gen_ && seat_state(w) == kSeatActive) return;
  const Errc why = static_cast<Errc>(s.evict_reason.load(std::memory_order_relaxed));
  throw Error(Errc::kEvicted, std::string("the producer evicted this consumer (") +
                                  (why == Errc::kTimeout ? "it stalled past the producer's consumer_timeout" : "seat lost") +
                                  "): open the region again to resume with the next sync");
}

void ConsumerRing::check_producer(bool allow_closed) const {
  const Header& h = v_->header();
  if (!allow_closed && h.init_state.load(std::memory_order_acquire) == kInitClosed)
    throw Error(Errc::kClosed, "the producer closed the region: no more syncs will come");
  if (peer_alive(v_->fd(), kProducerLockByte, h.producer) == Alive::kNo) {
    if (h.init_state.load(std::memory_order_acquire) == kInitClosed && allow_closed) return;
    throw Error(Errc::kPeerDied, "the producer (pid " + std::to_string(h.producer.pid.load()) +
                                     ") died: wait for it to restart and open the region again");
  }
}

RecordSnapshot ConsumerRing::wait_announce(std::uint64_t after_version, std::int64_t deadline_ns) {
  Header& h = v_->header();
  Seat& s = v_->seat(static_cast<std::uint32_t>(seat_));
  const bool store = v_->geo().store;
  std::uint32_t seen = 1;  // odd: never equal to a stable word, so look at once
  RecordSnapshot rec{};
  for (;;) {
    auto ready = [&] {
      const std::uint32_t w = h.sync.announce.word.load(std::memory_order_acquire);
      return ((w & 1u) == 0 && w != seen) || h.init_state.load(std::memory_order_acquire) == kInitClosed ||
             seat_state(s.word.load(std::memory_order_acquire)) != kSeatActive;
    };
    // A sync for us in the record now (the record is stable and new).
    auto take = [&] {
      // A store producer that died inside its record flip left the word
      // odd for good: the banks say which version is kept.
      if (!read_record(h, &rec) &&
          !(store && peer_alive(v_->fd(), kProducerLockByte, h.producer) == Alive::kNo &&
            recover_store_record(v_->file().data(), v_->geo(), &rec)))
        return false;
      seen = rec.word;
      if (store) return rec.version > after_version && !rec.aborted;  // what is stored, for everyone
      return rec.version > after_version && !rec.aborted && s.included_gen.load(std::memory_order_acquire) == gen_ &&
             s.first_version.load(std::memory_order_relaxed) <= rec.version;
    };
    // A stored version is there for the taking, producer or not.
    if (store) {
      check_seat();
      if (take()) return rec;
    }
    const WaitResult r = wait_until(h.sync.announce, ready, deadline_ns, kLivenessPollNs);
    check_seat();
    if (r == WaitResult::kReady && take()) return rec;
    try {
      check_producer(false);
    } catch (const Error&) {
      // The producer may have announced a sync, finished it and then died or
      // closed between the wait and the check: that sync is complete.
      if (take()) return rec;
      throw;
    }
    if (r == WaitResult::kTimeout || mono_ns() >= deadline_ns)
      throw Error(Errc::kTimeout, "no sync arrived within the timeout; the producer (pid " +
                                      std::to_string(h.producer.pid.load()) + ") is alive but has not sent one");
  }
}

bool ConsumerRing::record_unchanged(const RecordSnapshot& rec) const {
  // The copy's loads happen before the re-read of the word (seqlock reader).
  std::atomic_thread_fence(std::memory_order_acquire);
  return v_->header().sync.announce.word.load(std::memory_order_relaxed) == rec.word;
}

void ConsumerRing::ack(std::uint64_t version) {
  v_->seat(static_cast<std::uint32_t>(seat_)).acked_version.store(version, std::memory_order_release);
  ring(v_->header().release);
}

ConsumerRing::ChunkWait ConsumerRing::wait_chunk(std::uint64_t seq, std::uint64_t version, std::uint64_t expect_bytes,
                                                 std::int64_t deadline_ns, bool follow, std::uint64_t have, int writer) {
  const Candidate one{seq, expect_bytes, have, writer};
  return wait_any(version, deadline_ns, follow, [&](std::vector<Candidate>* out) { out->assign(1, one); }).wait;
}

ConsumerRing::AnyWait ConsumerRing::wait_any(std::uint64_t version, std::int64_t deadline_ns, bool follow,
                                             const CandidateList& list) {
  Header& h = v_->header();
  std::vector<Candidate> cands;
  // Published: the slot holds chunk seq (ranks publish out of order, so the
  // slot, not published_seq, tells).
  auto published = [&](const Candidate& c) {
    return v_->slot(v_->slot_of(c.seq)).seq.load(std::memory_order_acquire) == c.seq;
  };
  // Final bytes of a chunk still being filled, beyond what the caller has.
  auto more_filled = [&](const Candidate& c) -> std::uint64_t {
    const SlotDesc& fill = v_->slot(v_->slot_of(c.seq));
    if (!follow || fill.fill_seq.load(std::memory_order_acquire) != c.seq) return 0;
    std::uint64_t f = fill.filled.load(std::memory_order_acquire);
    if (f > c.expect_bytes) f = c.expect_bytes;  // untrusted: never past the chunk
    return f > c.have ? f : 0;
  };
  // The ready candidate with the lowest seq (published, or grown), asking
  // the caller for its list again.
  struct Pick {
    bool found = false, published = false;
    Candidate c{};
    std::uint64_t final_bytes = 0;
  };
  auto pick = [&]() -> Pick {
    list(&cands);
    Pick p;
    for (const Candidate& c : cands) {
      if (!c.readable || (p.found && c.seq >= p.c.seq)) continue;
      if (published(c)) {
        p = Pick{true, true, c, c.expect_bytes};
      } else if (const std::uint64_t f = more_filled(c); f != 0) {
        p = Pick{true, false, c, f};
      }
    }
    return p;
  };
  auto any_published = [&] {
    list(&cands);
    for (const Candidate& c : cands)
      if (c.readable && published(c)) return true;
    return false;
  };
  // Throws when the producer gave up on sync `version`: it aborted it, or it
  // has announced a newer sync since (only after publishing every chunk of
  // this one or aborting it), so the chunks waited for will never come.
  auto check_abandoned = [&] {
    // version is read first (acquire): a newer value makes every chunk the
    // producer published before announcing it visible to the re-check.
    const std::uint64_t current = h.sync.version.load(std::memory_order_acquire);
    if (any_published()) return;
    if (current > version || (current == version && h.sync.aborted.load(std::memory_order_acquire) != 0))
      throw Error(Errc::kAborted, std::string("the producer aborted sync ") + std::to_string(version) + ": " +
                                      read_error_text(h.error_text));
    if (current < version)
      throw Error(Errc::kCorrupt, "the sync record went back from version " + std::to_string(version) + " to " +
                                      std::to_string(current) + ": the region is corrupt");
  };
  auto ready = [&] {
    return pick().found || h.sync.aborted.load(std::memory_order_acquire) != 0 ||
           h.sync.version.load(std::memory_order_acquire) != version ||
           seat_state(v_->seat(static_cast<std::uint32_t>(seat_)).word.load(std::memory_order_acquire)) != kSeatActive;
  };
  Pick got;
  // A rank r > 0 that owes a chunk and has died (docs/protocol.md, "A rank
  // dies in the middle of a sync"): its sync cannot complete, but only rank
  // 0 decides its fate, and the region lives on. So the consumer waits for
  // rank 0 to abort it (Aborted above, the seat kept for the next sync),
  // whether or not another process has taken the dead rank's place by
  // then; only rank 0's death (check_producer) or the deadline end the wait
  // otherwise. (Throwing PeerDied here made the outcome a race: a consumer
  // that looked while the rank was dead got PeerDied, one that looked after
  // a new process took its seat got Aborted.)
  std::string dead_writer;
  for (;;) {
    const WaitResult r = wait_until(h.publish, ready, deadline_ns, kLivenessPollNs);
    check_seat();
    if (got = pick(); got.found) break;
    check_abandoned();
    try {
      check_producer(true);
    } catch (const Error&) {
      // Published, then the producer died, between the wait and the check.
      if (got = pick(); got.found && got.published) break;
      throw;
    }
    // Every rank that still owes a chunk (list() was called last by
    // check_abandoned: cands is current).
    for (const Candidate& c : cands)
      if (dead_writer.empty() && c.writer > 0 && rank_dead(*v_, static_cast<std::uint32_t>(c.writer)))
        dead_writer = rank_who(*v_, static_cast<std::uint32_t>(c.writer));
    if (h.init_state.load(std::memory_order_acquire) == kInitClosed)
      throw Error(Errc::kClosed, "the producer closed the region in the middle of sync " + std::to_string(version));
    // ready() may hold without any of the above (hostile bytes): the
    // deadline, not the wait result, ends the loop.
    if (r == WaitResult::kTimeout || mono_ns() >= deadline_ns) {
      std::string which;
      int n = 0;
      for (const Candidate& c : cands)
        if (c.readable) which += (n++ == 0 ? "" : ", ") + std::to_string(c.seq);
      if (n == 0)  // every chunk left is past the window: our own earlier copies never completed
        throw Error(Errc::kTimeout, "sync " + std::to_string(version) +
                                        ": this consumer's own copies of earlier chunks did not complete in time "
                                        "(a CUDA stream blocked behind other work?), so no further chunk could be "
                                        "read");
      if (!dead_writer.empty())
        throw Error(Errc::kTimeout, dead_writer + " died in the middle of sync " + std::to_string(version) +
                                        " and producer rank 0 did not abort the sync in time (chunks " + which +
                                        " never came): is rank 0 stuck outside the library?");
      throw Error(Errc::kTimeout, (n == 1 ? "chunk " : "chunks ") + which + " of sync " + std::to_string(version) +
                                      " did not arrive in time; the producer is alive but stalled");
    }
  }
  const std::uint64_t seq = got.c.seq;
  const std::uint32_t k = v_->slot_of(seq);
  if (!got.published) return {got.c, {k, false, got.final_bytes}};
  const SlotDesc& d = v_->slot(k);
  const std::uint64_t seen = d.seq.load(std::memory_order_acquire);
  if (seen != seq) {
    check_seat();
    // An aborted sync's unpublished chunks are skipped: the next sync's
    // chunks raise published_seq past them without ever filling them.
    const std::uint64_t current = h.sync.version.load(std::memory_order_acquire);
    if (current > version || (current == version && h.sync.aborted.load(std::memory_order_acquire) != 0))
      throw Error(Errc::kAborted, "the producer abandoned sync " + std::to_string(version) + " before chunk " +
                                      std::to_string(seq) + " was published");
    throw Error(Errc::kCorrupt, "slot " + std::to_string(k) + " holds chunk " + std::to_string(seen) + ", expected " +
                                    std::to_string(seq) + ": the region is corrupt or was overwritten");
  }
  if (d.version.load(std::memory_order_relaxed) != version ||
      d.bytes.load(std::memory_order_relaxed) != got.c.expect_bytes)
    throw Error(Errc::kCorrupt, "slot " + std::to_string(k) + " descriptor disagrees with the manifest (version " +
                                    std::to_string(d.version.load()) + ", " + std::to_string(d.bytes.load()) +
                                    " bytes; expected " + std::to_string(version) + ", " +
                                    std::to_string(got.c.expect_bytes) + ")");
  return {got.c, {k, true, got.c.expect_bytes}};
}

bool ConsumerRing::still_valid(std::uint32_t slot, std::uint64_t seq) const {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (v_->slot(slot).seq.load(std::memory_order_acquire) != seq) return false;
  const std::uint64_t w = v_->seat(static_cast<std::uint32_t>(seat_)).word.load(std::memory_order_acquire);
  return seat_gen(w) == gen_ && seat_state(w) == kSeatActive;
}

void ConsumerRing::release(std::uint64_t seq) {
  if (v_->geo().store) {
    unhold();
    return;
  }
  std::atomic<std::uint64_t>& rel = v_->seat(static_cast<std::uint32_t>(seat_)).released_seq;
  std::uint64_t cur = rel.load(std::memory_order_relaxed);
  while (cur < seq && !rel.compare_exchange_weak(cur, seq, std::memory_order_release, std::memory_order_relaxed)) {
  }
  ring(v_->header().release);
}

bool ConsumerRing::hold(const RecordSnapshot& rec, std::int64_t deadline_ns) {
  Seat& s = v_->seat(static_cast<std::uint32_t>(seat_));
  const SlotDesc& d = v_->slot(v_->slot_of(rec.first_seq));
  // Dekker with ProducerRing::acquire(): the hold is stored before fill_seq
  // is read (both seq_cst). A producer that began refilling the bank has
  // stored its fill_seq first: we see it and back off, or it sees the hold.
  s.hold_seq.store(rec.first_seq, std::memory_order_seq_cst);
  if (d.fill_seq.load(std::memory_order_seq_cst) == rec.first_seq &&
      d.seq.load(std::memory_order_acquire) == rec.first_seq)
    return true;
  unhold();
  // The producer announces a version before it refills the bank of the one
  // before, so a newer record is there or coming: wait for it to move on.
  Header& h = v_->header();
  auto moved = [&] { return h.sync.announce.word.load(std::memory_order_acquire) != rec.word; };
  const std::string bad =
      "the store region's record names version " + std::to_string(rec.version) + " in a bank that does not hold it";
  while (wait_until(h.sync.announce, moved, deadline_ns, kLivenessPollNs) != WaitResult::kReady) {
    check_seat();
    if (peer_alive(v_->fd(), kProducerLockByte, h.producer) == Alive::kNo && !moved())
      throw Error(Errc::kCorrupt, bad + " and its producer is gone: the region is corrupt; remove it "
                                        "(shmcast-inspect rm) and publish again");
    if (mono_ns() >= deadline_ns)
      throw Error(Errc::kTimeout, bad + ", and it did not change before the timeout: the region is corrupt, "
                                        "or its producer is stuck");
  }
  return false;
}

void ConsumerRing::unhold() {
  Seat& s = v_->seat(static_cast<std::uint32_t>(seat_));
  if (s.hold_seq.load(std::memory_order_relaxed) == 0) return;
  s.hold_seq.store(0, std::memory_order_release);
  ring(v_->header().release);
}

void ConsumerRing::set_error(Errc code, const std::string& text) {
  if (seat_ < 0) return;
  Seat& s = v_->seat(static_cast<std::uint32_t>(seat_));
  write_error_text(s.error_text, text);
  s.error_code.store(static_cast<std::uint32_t>(code), std::memory_order_release);
}

// ================================================================ chunk streams

ChunkWriter::ChunkWriter(ProducerRing* ring, RegionView* view, std::uint64_t version, std::uint64_t first_seq,
                         std::uint64_t stream_bytes, bool checksums, std::uint32_t rank, std::uint32_t world_size,
                         std::uint64_t rank_chunks)
    : ring_(ring),
      v_(view),
      version_(version),
      first_seq_(first_seq),
      stream_(stream_bytes),
      S_(view->geo().slot_bytes),
      chunks_(rank_chunks != ~0ull ? rank_chunks : chunk_count(stream_bytes, view->geo().slot_bytes)),
      rank_(rank),
      R_(world_size),
      checksums_(checksums) {}

void ChunkWriter::claim_chunk(std::uint64_t c) {
  while (acquired_ <= c) {
    const std::uint64_t seq = seq_of(acquired_);
    ring_->acquire(seq);
    ring_->begin_fill(seq);
    ++acquired_;
  }
}

std::byte* ChunkWriter::claim(std::uint64_t pos, std::uint64_t* room) {
  const std::uint64_t c = pos / S_;
  claim_chunk(c);
  const std::uint64_t in_chunk = pos - c * S_;
  *room = chunk_len(c, stream_, S_) - in_chunk;
  return v_->slot_data(v_->slot_of(seq_of(c))) + in_chunk;
}

void ChunkWriter::filled_to(std::uint64_t pos) {
  if (pos == 0) return;
  const std::uint64_t c = (pos - 1) / S_;
  ring_->progress(seq_of(c), pos - c * S_);
}

std::function<void()> ChunkWriter::publisher(std::uint64_t c) const {
  const std::uint64_t seq = seq_of(c);
  const std::uint64_t bytes = chunk_len(c, stream_, S_);
  const std::byte* data = v_->slot_data(v_->slot_of(seq));
  ProducerRing* r = ring_;
  const std::uint64_t ver = version_;
  const bool sum = checksums_;
  // Runs when the chunk's bytes are complete (a CUDA callback thread for
  // device copies): with checksums it hashes the whole slot first.
  return [r, seq, ver, bytes, data, sum] { r->publish(seq, ver, bytes, sum ? XXH3_64bits(data, bytes) : 0); };
}

ChunkReader::ChunkReader(ConsumerRing* ring, RegionView* view, std::uint64_t version, std::uint64_t first_seq,
                         std::uint64_t chunks, std::vector<std::uint64_t> rank_bytes, bool follow, bool verify_checksums,
                         std::int64_t chunk_timeout_ns)
    : ring_(ring),
      v_(view),
      version_(version),
      first_seq_(first_seq),
      chunks_(chunks),
      S_(view->geo().slot_bytes),
      K_(view->geo().slot_count),
      rank_bytes_(std::move(rank_bytes)),
      follow_(follow),
      verify_(verify_checksums),
      timeout_ns_(chunk_timeout_ns),
      R_(rank_bytes_.empty() ? 1 : rank_bytes_.size()),
      per_rank_(chunks_ / R_),
      next_j_(R_, 0),
      have_(R_, 0),
      prefix_(std::make_shared<Prefix>()) {
  if (rank_bytes_.empty() || chunks_ % R_ != 0)
    throw Error(Errc::kCorrupt, "sync " + std::to_string(version) + " has " + std::to_string(chunks_) +
                                    " chunks, not a multiple of its " + std::to_string(rank_bytes_.size()) + " ranks");
  prefix_->copied.assign(K_, 0);
  prefix_->seq.store(first_seq_ - 1, std::memory_order_relaxed);
  prefix_->last = first_seq_ + chunks_ - 1;
}

std::uint64_t ChunkReader::released() const { return prefix_->seq.load(std::memory_order_acquire); }

void ChunkReader::Prefix::copied_chunk(ConsumerRing* ring, std::uint64_t s) {
  std::lock_guard<std::mutex> g(mu);
  std::uint64_t p = seq.load(std::memory_order_relaxed);
  const std::uint64_t k = copied.size();
  // The reader hands out only chunks in (p, p + k]: each has its own entry.
  if (s <= p || s - p > k) return;
  copied[s % k] = 1;
  const std::uint64_t was = p;
  while (p < last && copied[(p + 1) % k] != 0) {
    copied[(p + 1) % k] = 0;
    ++p;
  }
  if (p == was) return;
  // The reader's window first, then the seat: a reader woken by the chunk
  // the producer writes into the freed slot (after it saw the seat) sees
  // the wider window.
  seq.store(p, std::memory_order_release);
  ring->release(p);
}

bool ChunkReader::next(Range* out) {
  if (handed_ >= chunks_) return false;
  // Every rank's next chunk; readable when the ring can hold it for us:
  // seq <= released + K (a later chunk's slot still holds one of ours,
  // which the producer may not refill). A chunk partly handed out (follow)
  // stays its rank's candidate until it is published.
  auto list = [this](std::vector<ConsumerRing::Candidate>* c) {
    c->clear();
    const std::uint64_t limit = prefix_->seq.load(std::memory_order_acquire) + K_;
    for (std::uint64_t r = 0; r < R_; ++r) {
      const std::uint64_t j = next_j_[r];
      if (j >= per_rank_) continue;
      const std::uint64_t seq = first_seq_ + j * R_ + r;
      c->push_back({seq, chunk_len(j, rank_bytes_[r], S_), have_[r], R_ > 1 ? static_cast<int>(r) : -1, seq <= limit});
    }
  };
  const ConsumerRing::AnyWait w = ring_->wait_any(version_, mono_ns() + timeout_ns_, follow_, list);
  const std::uint64_t seq = w.chosen.seq;
  const auto rank = static_cast<std::uint32_t>((seq - first_seq_) % R_);
  const std::uint64_t j = (seq - first_seq_) / R_;  // the rank's chunk
  const std::uint64_t bytes = w.chosen.expect_bytes;
  std::uint64_t& have = have_[rank];
  const std::byte* data = v_->slot_data(w.wait.slot);
  if (!w.wait.published) {
    *out = Range{data + have, j * S_ + have, rank, w.wait.final_bytes - have, false, seq, w.wait.slot};
    have = w.wait.final_bytes;
    return true;
  }
  if (verify_) {
    const std::uint64_t want = v_->slot(w.wait.slot).checksum.load(std::memory_order_relaxed);
    if (XXH3_64bits(data, bytes) != want) {
      if (!ring_->still_valid(w.wait.slot, seq)) ring_->check_seat();
      throw Error(Errc::kChecksum, "chunk " + std::to_string(seq) + " of sync " + std::to_string(version_) +
                                       " fails its checksum: its bytes changed between producer and consumer");
    }
  }
  *out = Range{data + have, j * S_ + have, rank, bytes - have, true, seq, w.wait.slot};
  ++next_j_[rank];
  have = 0;
  ++handed_;
  return true;
}

std::function<void()> ChunkReader::releaser(const Range& r, std::atomic<bool>* broken) const {
  ConsumerRing* ring = ring_;
  const std::uint32_t k = r.slot;
  const std::uint64_t seq = r.seq;
  std::shared_ptr<Prefix> prefix = prefix_;
  return [ring, k, seq, broken, prefix] {
    if (!ring->still_valid(k, seq)) broken->store(true, std::memory_order_relaxed);
    prefix->copied_chunk(ring, seq);
  };
}

}  // namespace shmcast::detail
