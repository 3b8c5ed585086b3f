// protocol/ (layer 4): the slot ring protocol. One producer, up to N consumers, K slots
// of S bytes. Chunk sequence numbers start at 1; chunk `seq` lives in slot
// (seq - 1) % K. The producer may refill a slot with chunk `seq` only when
// every enrolled consumer has released chunk seq - K. One handshake per slot:
// the producer publishes a chunk (published_seq), consumers release it
// (Seat::released_seq), never per tensor.
//
// docs/protocol.md describes the same rules for people.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "base/checks.hpp"
#include "base/layout.hpp"
#include "shm/doorbell.hpp"
#include "shm/liveness.hpp"
#include "shm/region.hpp"
#include "shmcast/shmcast.hpp"

namespace shmcast::detail {

inline constexpr std::int64_t kLivenessPollNs = 50'000'000;  // check a peer every 50 ms while waiting

// An attached region with a validated, private copy of its geometry. Every
// address below is derived from that copy, never from the shared bytes.
class RegionView {
 public:
  RegionView() = default;
  RegionView(MappedFile file, const Geometry& g) : file_(std::move(file)), geo_(g) {}

  Header& header() const { return *reinterpret_cast<Header*>(file_.data()); }
  Seat& seat(std::uint32_t i) const {
    return *reinterpret_cast<Seat*>(file_.data() + geo_.seats_offset + std::uint64_t{i} * kSeatBytes);
  }
  SlotDesc& slot(std::uint32_t k) const {
    return *reinterpret_cast<SlotDesc*>(file_.data() + geo_.slots_offset + std::uint64_t{k} * kSlotDescBytes);
  }
  // Slot k's bytes: in the file, or (device slots) at the GPU address the
  // caller mapped them at (set_device_slots): a device pointer, never
  // dereferenced on the host.
  std::byte* slot_data(std::uint32_t k) const {
    return (device_slots_ != nullptr ? device_slots_ : file_.data() + geo_.data_offset) +
           std::uint64_t{k} * geo_.slot_bytes;
  }
  void set_device_slots(std::byte* base) { device_slots_ = base; }
  bool slots_on_device() const { return geo_.device_slots; }
  std::byte* manifest() const { return file_.data() + geo_.manifest_offset; }
  // The manifest area of chunk `seq`'s sync: the one area, or in a store
  // region the area of the slot (bank) that holds the chunk.
  std::byte* manifest_of(std::uint64_t seq) const {
    return geo_.store ? manifest() + std::uint64_t{slot_of(seq)} * geo_.manifest_bytes : manifest();
  }
  // Sharded producers (world_size > 1) only.
  RankSeat& rank_seat(std::uint32_t r) const {
    return *reinterpret_cast<RankSeat*>(file_.data() + geo_.ranks_offset + std::uint64_t{r} * kRankSeatBytes);
  }
  std::byte* rank_list(std::uint32_t r) const {
    return file_.data() + geo_.rank_lists_offset + std::uint64_t{r} * geo_.manifest_bytes;
  }
  std::uint32_t slot_of(std::uint64_t seq) const { return static_cast<std::uint32_t>((seq - 1) % geo_.slot_count); }
  // The sparse areas (layout.hpp, sparse_ranges) are holes until written.
  // room(): before writing `need` bytes to the area at `area` (a manifest
  // area or a rank list), allocates its first min(need, manifest_bytes)
  // bytes, page-rounded, unless this process did already; returns the bytes
  // that may be written there (the capacity to encode into). Throws
  // kRegionFull when the filesystem is full: never a SIGBUS.
  std::uint64_t room(std::byte* area, std::uint64_t need);
  // Copies `len` bytes at `area` (inside the region) into `dst` with pread
  // (MappedFile::read_at): bytes a peer announces but never allocated read
  // as zeros instead of faulting. False when the file was cut short.
  bool copy_out(const std::byte* area, std::uint64_t len, void* dst) const;

  const Geometry& geo() const { return geo_; }
  MappedFile& file() { return file_; }
  const MappedFile& file() const { return file_; }
  int fd() const { return file_.fd(); }
  bool mapped() const { return file_.data() != nullptr; }

 private:
  MappedFile file_;
  Geometry geo_{};
  std::byte* device_slots_ = nullptr;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> allocated_;  // area offset, bytes this process allocated
};

inline std::uint64_t RegionView::room(std::byte* area, std::uint64_t need) {
  const std::uint64_t off = static_cast<std::uint64_t>(area - file_.data());
  const std::uint64_t want = std::min(align_up(std::min(need, geo_.manifest_bytes), 4096), geo_.manifest_bytes);
  for (auto& [at, bytes] : allocated_) {
    if (at != off) continue;
    if (bytes < want) {
      file_.allocate(off, want);
      bytes = want;
    }
    return std::min(need, bytes);
  }
  file_.allocate(off, want);
  allocated_.emplace_back(off, want);
  return std::min(need, want);
}

inline bool RegionView::copy_out(const std::byte* area, std::uint64_t len, void* dst) const {
  return file_.read_at(static_cast<std::uint64_t>(area - file_.data()), dst, len) == 0;
}

// A private copy of a mapped region's immutable header (take it after
// init_state read kInitReady, with acquire).
HeaderFixed snapshot_header(const std::byte* base);
// The same for the device-slots block (check it with device_slots_problem).
DeviceSlotsFixed snapshot_device_slots(const std::byte* base);
// The geometry `snap` describes, validated against itself and the file:
// throws kVersionMismatch (another layout version) or kCorrupt.
Geometry checked_geometry(const MappedFile& f, const HeaderFixed& snap);

std::uint32_t seat_state(std::uint64_t word);
std::uint64_t seat_gen(std::uint64_t word);
std::uint64_t make_seat_word(std::uint64_t gen, std::uint32_t state);

// RecordSnapshot (the sync record taken under its seqlock) is in base/checks.hpp.
// Returns false when the producer is writing the record right now.
bool read_record(const Header& h, RecordSnapshot* out);

// Store regions: the record of a producer that died inside its record
// flip (the seqlock word odd for good), rebuilt from the banks
// (docs/protocol.md §11, "a torn record"). A bank whose descriptor holds
// seq == fill_seq != 0 in its own bank was published after every byte of
// its version, manifest included, was in place; its version, bytes,
// manifest_used and manifest_hash (stored before seq) describe that
// version. Takes the newest such bank whose manifest bytes match its hash,
// else the other one; `out->word` is the record's word now. False when no
// bank qualifies. Call it only once the producer is known dead: a live
// producer may be rewriting a bank. `base`: the mapped region.
bool recover_store_record(const std::byte* base, const Geometry& g, RecordSnapshot* out);

// Test-only fault injection: when set, ProducerRing::announce() calls it
// with i after its i-th store to the record (1: the seqlock word made odd,
// 2..8: version, first_seq, chunks, stream_bytes, manifest_used,
// manifest_hash, aborted; 9: the word even again) and with 0 before the
// first. A test's producer child raises SIGSTOP or SIGKILL there to die
// inside the flip. Null in production: one load of a pointer per store.
extern void (*g_announce_store_hook)(int store);

// Chunk c (0-based) of a sync covers stream bytes [c*S, min((c+1)*S, stream)).
inline std::uint64_t chunk_count(std::uint64_t stream_bytes, std::uint64_t slot_bytes) {
  return (stream_bytes + slot_bytes - 1) / slot_bytes;
}
// 0 for a chunk past the end (a rank with a shorter sub-stream than another
// publishes empty chunks to keep the ring's order).
inline std::uint64_t chunk_len(std::uint64_t c, std::uint64_t stream_bytes, std::uint64_t slot_bytes) {
  const std::uint64_t start = c * slot_bytes;
  if (start >= stream_bytes) return 0;
  return stream_bytes - start < slot_bytes ? stream_bytes - start : slot_bytes;
}

// Chunks of a sync whose ranks' sub-streams are `rank_bytes`: R times the
// longest one's (rank r's chunk j is seq first + j * R + r).
inline std::uint64_t sync_chunks(const std::vector<std::uint64_t>& rank_bytes, std::uint64_t slot_bytes) {
  std::uint64_t per_rank = 0;
  for (std::uint64_t b : rank_bytes) {
    const std::uint64_t c = chunk_count(b, slot_bytes);
    if (c > per_rank) per_rank = c;
  }
  return per_rank * rank_bytes.size();
}

// A dead or stopped producer rank, in words, for errors.
std::string rank_who(const RegionView& v, std::uint32_t rank);
// Whether producer rank `rank` (>= 1) is known dead.
bool rank_dead(const RegionView& v, std::uint32_t rank);

// ---------------------------------------------------------------- producer side

struct ProducerRingOptions {
  StallPolicy stall_policy;
  std::int64_t consumer_timeout_ns;
  std::uint32_t rank = 0;
  std::uint32_t world_size = 1;
  bool store = false;  // a store region: no enrollment, slots are held (Seat::hold_seq), not released
};

class ProducerRing {
 public:
  ProducerRing(RegionView* view, ProducerRingOptions opts) : v_(view), opts_(opts) {}

  // Enrolls every live attached consumer not yet enrolled (first_seq,
  // first_version); evicts dead seats. Returns how many are enrolled.
  std::uint32_t enroll(std::uint64_t version, std::uint64_t first_seq);
  // Waits until every consumer enrolled for `version` acked its manifest.
  void wait_acks(std::uint64_t version);
  // The sync this producer (rank) writes now: waits check it for an abort.
  void set_sync(std::uint64_t version, std::uint64_t first_seq) {
    sync_version_ = version;
    sync_first_seq_ = first_seq;
  }
  // No sync in progress (it ended, or failed): waits between syncs (the
  // next begin_sync's, wait_drained's) never see that sync's abort.
  void clear_sync() { set_sync(0, 0); }
  // Waits until the slot for `seq` may be refilled: every consumer released
  // the chunk it held and, with several ranks, that chunk's writer (another
  // rank) published it. Store regions: marks the slot as being refilled
  // (fill_seq), then waits until no live consumer holds its old chunk.
  void acquire(std::uint64_t seq);
  // Throws when the sync set_sync() named was aborted (by any rank): with
  // the aborting rank's code when it blames someone (kTimeout, kPeerDied:
  // every rank then reports the same culprit), else kAborted.
  void check_aborted() const;
  bool aborted_now() const;
  // Waits until every enrolled consumer released every chunk <= seq.
  void wait_released(std::uint64_t seq, std::int64_t deadline_ns);
  // Marks chunk `seq` as being rewritten (consumers that still read it see
  // the change), before any byte of it is written.
  void begin_fill(std::uint64_t seq);
  // Makes chunk `seq` visible to consumers. Safe to call from a CUDA host
  // callback thread: atomics and a futex wake only.
  void publish(std::uint64_t seq, std::uint64_t version, std::uint64_t bytes, std::uint64_t checksum);
  // The first `filled` bytes of chunk `seq` (being filled) are final.
  void progress(std::uint64_t seq, std::uint64_t filled);
  // Makes the sync record's seqlock odd: the record and the manifest area
  // are about to change. Call before rewriting the manifest.
  void begin_announce();
  // Writes the record and makes the seqlock even again.
  void announce(const RecordSnapshot& rec);
  void abort(std::uint64_t version);

  std::uint32_t live_consumers() const;
  std::vector<std::string> take_events() { return std::move(events_); }

 private:
  // First seat blocking `done(seat)`, or -1.
  int blocker(const std::function<bool(const Seat&)>& done) const;
  // `release_to` (a wait for consumers to release chunks <= it, several
  // ranks): a consumer held up by an unpublished chunk of this sync is not
  // to blame; that chunk's writer rank is (PeerDied when dead, Timeout at
  // the deadline; the consumer is never evicted for it).
  void wait_for(const std::function<bool(const Seat&)>& done, const char* what, std::int64_t deadline_ns,
                std::uint64_t release_to = 0);
  // The first chunk in (released, release_to] of this sync that is not
  // published, and its writer rank (-1: none; the consumer holds itself up).
  int unpublished_before(std::uint64_t released, std::uint64_t release_to, std::uint64_t* chunk) const;
  void evict(std::uint32_t i, std::uint64_t word, Errc reason, const std::string& why);
  bool enrolled(const Seat& s, std::uint64_t word) const;

  RegionView* v_;
  ProducerRingOptions opts_;
  std::vector<std::string> events_;
  std::uint64_t sync_version_ = 0, sync_first_seq_ = 0;
};

// Producer side of one sync's chunk stream: acquires slots in order
// (waiting for consumers to release them), marks progressive fill, and
// hands each finished chunk's publish step to the caller's `defer` (the copy
// engine runs it once the chunk's bytes are complete: at once on the host,
// from a completion callback on CUDA).
class ChunkWriter {
 public:
  ChunkWriter() = default;
  // Rank `rank` of `world_size` writes its sub-stream of `stream_bytes` as
  // `rank_chunks` chunks: its chunk c is seq first_seq + c * world_size + rank.
  ChunkWriter(ProducerRing* ring, RegionView* view, std::uint64_t version, std::uint64_t first_seq,
              std::uint64_t stream_bytes, bool checksums, std::uint32_t rank = 0, std::uint32_t world_size = 1,
              std::uint64_t rank_chunks = ~0ull);

  std::uint64_t chunks() const { return chunks_; }  // this rank's
  std::uint64_t next_seq() const { return first_seq_ + chunks_ * R_; }  // after the whole sync
  std::uint64_t seq_of(std::uint64_t c) const { return first_seq_ + c * R_ + rank_; }
  std::uint64_t slot_bytes() const { return S_; }
  std::uint64_t published() const { return published_; }  // chunks handed to publish, in order
  std::uint64_t acquired() const { return acquired_; }    // chunks claimed, in order
  // Acquires this rank's first chunk now (a store region's one chunk: its
  // bank's manifest may be rewritten only once it is acquired).
  void claim_first() {
    if (chunks_ > 0) claim_chunk(0);
  }
  // Slot memory for stream byte `pos` (< stream bytes) and, in *room, how
  // many bytes of its chunk follow it. Acquires that chunk and every one
  // before it first (each acquisition may wait for consumers).
  std::byte* claim(std::uint64_t pos, std::uint64_t* room);
  // Stream bytes [chunk start, pos) of the chunk holding byte pos - 1 are
  // final: a host reader may copy them out before the chunk is published.
  void filled_to(std::uint64_t pos);
  // Every chunk that ends at or before stream byte `pos` is written:
  // defer(publish) for each not yet handed over, in order.
  template <class Defer>
  void complete_below(std::uint64_t pos, Defer&& defer) {
    const std::uint64_t c_end = pos >= stream_ ? chunks_ : pos / S_;
    while (published_ < c_end) {
      claim_chunk(published_);  // a chunk no tensor touched (all padding) still goes through the ring
      defer(publisher(published_));
      ++published_;
    }
  }

 private:
  void claim_chunk(std::uint64_t c);
  std::function<void()> publisher(std::uint64_t c) const;

  ProducerRing* ring_ = nullptr;
  RegionView* v_ = nullptr;
  std::uint64_t version_ = 0, first_seq_ = 0, stream_ = 0, S_ = 1, chunks_ = 0;
  std::uint64_t rank_ = 0, R_ = 1;
  std::uint64_t acquired_ = 0, published_ = 0;
  bool checksums_ = false;
};

// ---------------------------------------------------------------- consumer side

class ConsumerRing {
 public:
  explicit ConsumerRing(RegionView* view) : v_(view) {}

  // Claims a free (or dead) seat: takes its lock byte, resets it, marks it
  // active. Throws kNoSeat when every seat is held by a live consumer.
  void claim();
  void leave();
  int seat() const { return seat_; }

  // Waits for the next sync (> after_version) that this consumer is enrolled
  // in. Throws kClosed, kPeerDied, kEvicted, kTimeout. Store regions: the
  // newest stored version when it is > after_version, whatever the
  // producer's state; else waits for one (kClosed, kPeerDied when none can come).
  RecordSnapshot wait_announce(std::uint64_t after_version, std::int64_t deadline_ns);
  // Store regions: holds the bank of the version `rec` announces (the
  // producer will not refill it until unhold()). False when the producer has
  // already begun to replace it, once the record has moved on (waited for
  // without spinning): read the record again. A record that does not move
  // by `deadline_ns` is kTimeout; one whose producer is gone, kCorrupt.
  bool hold(const RecordSnapshot& rec, std::int64_t deadline_ns);
  void unhold();
  // After copying the manifest of `rec`: true when the record (and so the
  // manifest area, which the producer rewrites only with the record odd) did
  // not change since `rec` was read.
  bool record_unchanged(const RecordSnapshot& rec) const;
  void ack(std::uint64_t version);
  // Waits until chunk `seq` of sync `version` is published, then checks its
  // slot descriptor. With `follow`, also returns early, unpublished, as soon
  // as more than `have` of its bytes are final (progressive fill).
  struct ChunkWait {
    std::uint32_t slot;
    bool published;
    std::uint64_t final_bytes;  // == expect_bytes when published
  };
  // `writer`: the producer rank that writes chunk `seq` (sharded producers),
  // checked for death while waiting; -1 for a one-rank producer.
  ChunkWait wait_chunk(std::uint64_t seq, std::uint64_t version, std::uint64_t expect_bytes, std::int64_t deadline_ns,
                       bool follow, std::uint64_t have, int writer = -1);
  // A chunk a reader may take next: chunk `seq` of `expect_bytes`, of which
  // `have` were handed out already (follow), written by producer rank
  // `writer` (-1: a one-rank producer). `readable` false: a chunk the ring
  // cannot hold for this reader yet (past its window); it is never looked
  // at, only its writer is watched (a dead writer that still owes a chunk
  // has lost the sync).
  struct Candidate {
    std::uint64_t seq;
    std::uint64_t expect_bytes;
    std::uint64_t have;
    int writer;
    bool readable = true;
  };
  using CandidateList = std::function<void(std::vector<Candidate>*)>;
  struct AnyWait {
    Candidate chosen;
    ChunkWait wait;
  };
  // Waits, on the publish bell and without spinning past the bell's short
  // spin, until one of the readable chunks `list` names is published or,
  // with `follow`, has more than `have` bytes final; of those ready at once,
  // the lowest seq. `list` is called again at every check (a release from a
  // completion thread may have widened the caller's window) and may be
  // empty for a while (every chunk the caller may see is being copied).
  // Every writer named is checked for death at each liveness check;
  // Aborted, PeerDied, Closed, Timeout (at `deadline_ns`) and the slot
  // descriptor checks are wait_chunk's.
  AnyWait wait_any(std::uint64_t version, std::int64_t deadline_ns, bool follow, const CandidateList& list);
  // After reading a slot: true when it still holds `seq` and this consumer
  // still owns its seat (so what was read is what was published).
  bool still_valid(std::uint32_t slot, std::uint64_t seq) const;
  // Releases chunks <= seq (store regions: drops the hold). Cumulative and
  // monotone: released_seq never goes down, whichever thread calls it with
  // whichever seq (a completion thread and the reader's error path may race).
  void release(std::uint64_t seq);
  void set_error(Errc code, const std::string& text);

  // Throws the error that describes why this consumer can no longer go on,
  // if any (evicted, producer dead, closed).
  void check_seat() const;
  void check_producer(bool allow_closed) const;

 private:
  RegionView* v_;
  int seat_ = -1;
  std::uint64_t gen_ = 0;
};

// Consumer side of one sync's chunk stream: hands out the bytes of chunks as
// they become ready, as ranges, checking the slot descriptor and the
// checksum (when present) before the last range of a chunk. With `follow`, a
// chunk being filled is handed out in several ranges as the producer marks
// bytes final (host copies, no checksum). After the bytes of a chunk's last
// range are copied, the caller runs releaser(): it flags `broken` when the
// slot was overwritten during the copy and marks the chunk copied.
//
// Reading order. Each rank's chunks are handed out in that rank's order
// (rank r's chunk j before its chunk j + 1), but the ranks are not waited
// for in turn: of the ranks' next chunks, the reader takes whichever is
// ready first (the lowest seq when several are), so one rank's late chunk
// does not hold up another's published ones. Looking further into one
// rank's chunks would gain nothing: a rank publishes its chunks in order
// (ChunkWriter hands the publishes over in order; the CUDA engine runs them
// in order on one callback stream), and the caller's piece cursors walk
// each sub-stream forwards. The reader only looks at chunks the ring can
// hold for it: seq <= released + slots, where `released` is what this
// reader has released; a later chunk's slot still holds one of ours, which
// the producer may not refill. With `follow`, a chunk partly handed out
// stays its rank's candidate, and another rank's chunk may come between its
// parts. Each wait lasts at most the chunk timeout, from the call to next()
// that waits: Timeout when none of the chunks waited for arrives (or, with
// `follow`, grows) by then.
//
// Releasing. The seat's released_seq is cumulative (every chunk <= it is
// released), so it only advances over the prefix of chunks whose copies are
// complete: a chunk copied out of order waits, still held, until every
// chunk before it is copied too. The releasers may run in any order and on
// any thread (CUDA completions); the prefix is kept under a mutex.
//
// With one rank there is one candidate, the next chunk: the order is the
// ring's sequence order (out of order would gain nothing, for the reason
// above), and no chunk is released out of order.
class ChunkReader {
 public:
  struct Range {
    const std::byte* data;  // sub-stream byte `start` of rank `rank`, in slot memory
    std::uint64_t start;
    std::uint32_t rank;
    std::uint64_t bytes;
    bool last;             // the chunk's last range: release it after copying
    std::uint64_t seq;
    std::uint32_t slot;
  };
  // `rank_bytes`: each producer rank's sub-stream length (one entry: a
  // one-rank producer whose stream is its sub-stream). `chunks` is a
  // multiple of the rank count (R times the chunks of the longest sub-stream).
  ChunkReader(ConsumerRing* ring, RegionView* view, std::uint64_t version, std::uint64_t first_seq,
              std::uint64_t chunks, std::vector<std::uint64_t> rank_bytes, bool follow, bool verify_checksums,
              std::int64_t chunk_timeout_ns);
  // The next range, or false when every chunk was handed out. Throws the
  // ring's errors (Aborted, PeerDied, Timeout, Corrupt, Checksum, ...).
  bool next(Range* out);
  // Runs after the copies out of the chunk of `r` (a last range) complete.
  std::function<void()> releaser(const Range& r, std::atomic<bool>* broken) const;
  // Chunks <= this seq are copied and released (first_seq - 1 at first).
  std::uint64_t released() const;

 private:
  // The released prefix, shared with the releasers (which may outlive the
  // reader on a completion thread).
  struct Prefix {
    std::mutex mu;
    std::vector<std::uint8_t> copied;      // by seq % slots: copied, not yet released
    std::atomic<std::uint64_t> seq{0};     // every chunk <= seq is released
    std::uint64_t last = 0;                // the sync's last chunk
    void copied_chunk(ConsumerRing* ring, std::uint64_t s);
  };

  ConsumerRing* ring_;
  RegionView* v_;
  std::uint64_t version_, first_seq_, chunks_, S_, K_;
  std::vector<std::uint64_t> rank_bytes_;
  bool follow_, verify_;
  std::int64_t timeout_ns_;
  std::uint64_t R_, per_rank_;
  std::vector<std::uint64_t> next_j_;  // per rank: its next chunk to hand out
  std::vector<std::uint64_t> have_;    // per rank: bytes of that chunk handed out so far
  std::uint64_t handed_ = 0;           // chunks handed out whole
  std::shared_ptr<Prefix> prefix_;
};

}  // namespace shmcast::detail
