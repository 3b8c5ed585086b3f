// Layer 4: the slot ring protocol. One producer, up to N consumers, K slots
// of S bytes. Chunk sequence numbers start at 1; chunk `seq` lives in slot
// (seq - 1) % K. The producer may refill a slot with chunk `seq` only when
// every enrolled consumer has released chunk seq - K. One handshake per slot:
// the producer publishes a chunk (published_seq), consumers release it
// (Seat::released_seq), never per tensor.
//
// docs/protocol.md describes the same rules for people.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "doorbell.hpp"
#include "layout.hpp"
#include "liveness.hpp"
#include "region.hpp"
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
  std::byte* slot_data(std::uint32_t k) const { return file_.data() + geo_.data_offset + std::uint64_t{k} * geo_.slot_bytes; }
  std::byte* manifest() const { return file_.data() + geo_.manifest_offset; }
  std::uint32_t slot_of(std::uint64_t seq) const { return static_cast<std::uint32_t>((seq - 1) % geo_.slot_count); }

  const Geometry& geo() const { return geo_; }
  MappedFile& file() { return file_; }
  const MappedFile& file() const { return file_; }
  int fd() const { return file_.fd(); }
  bool mapped() const { return file_.data() != nullptr; }

 private:
  MappedFile file_;
  Geometry geo_{};
};

std::uint32_t seat_state(std::uint64_t word);
std::uint64_t seat_gen(std::uint64_t word);
std::uint64_t make_seat_word(std::uint64_t gen, std::uint32_t state);

// Snapshot of the sync record taken under its seqlock.
struct RecordSnapshot {
  std::uint32_t word;  // even
  std::uint64_t version, first_seq, chunks, stream_bytes, manifest_used, manifest_hash;
  bool aborted;
};
// Returns false when the producer is writing the record right now.
bool read_record(const Header& h, RecordSnapshot* out);

// Chunk c (0-based) of a sync covers stream bytes [c*S, min((c+1)*S, stream)).
inline std::uint64_t chunk_count(std::uint64_t stream_bytes, std::uint64_t slot_bytes) {
  return (stream_bytes + slot_bytes - 1) / slot_bytes;
}
inline std::uint64_t chunk_len(std::uint64_t c, std::uint64_t stream_bytes, std::uint64_t slot_bytes) {
  const std::uint64_t start = c * slot_bytes;
  return stream_bytes - start < slot_bytes ? stream_bytes - start : slot_bytes;
}

// ---------------------------------------------------------------- producer side

struct ProducerRingOptions {
  StallPolicy stall_policy;
  std::int64_t consumer_timeout_ns;
};

class ProducerRing {
 public:
  ProducerRing(RegionView* view, ProducerRingOptions opts) : v_(view), opts_(opts) {}

  // Enrolls every live attached consumer not yet enrolled (first_seq,
  // first_version); evicts dead seats. Returns how many are enrolled.
  std::uint32_t enroll(std::uint64_t version, std::uint64_t first_seq);
  // Waits until every consumer enrolled for `version` acked its manifest.
  void wait_acks(std::uint64_t version);
  // Waits until the slot for `seq` may be refilled.
  void acquire(std::uint64_t seq);
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
  void wait_for(const std::function<bool(const Seat&)>& done, const char* what, std::int64_t deadline_ns);
  void evict(std::uint32_t i, std::uint64_t word, Errc reason, const std::string& why);
  bool enrolled(const Seat& s, std::uint64_t word) const;

  RegionView* v_;
  ProducerRingOptions opts_;
  std::vector<std::string> events_;
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
  // in. Throws kClosed, kPeerDied, kEvicted, kTimeout.
  RecordSnapshot wait_announce(std::uint64_t after_version, std::int64_t deadline_ns);
  // After copying the manifest of `rec`: true when the record (and so the
  // manifest area, which the producer rewrites only with the record odd) did
  // not change since `rec` was read.
  bool record_unchanged(const RecordSnapshot& rec) const;
  void ack(std::uint64_t version);
  // Waits until chunk `seq` of sync `version` is published; checks its slot
  // descriptor and returns the slot index.
  // With `partial`, also returns early when more than *partial bytes of the
  // chunk are final before it is published: then *partial is raised to that
  // count and *complete is false. Bytes past *partial are not yet valid.
  std::uint32_t wait_chunk(std::uint64_t seq, std::uint64_t version, std::uint64_t expect_bytes,
                           std::int64_t deadline_ns, std::uint64_t* partial = nullptr, bool* complete = nullptr);
  // After reading a slot: true when it still holds `seq` and this consumer
  // still owns its seat (so what was read is what was published).
  bool still_valid(std::uint32_t slot, std::uint64_t seq) const;
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

}  // namespace shmcast::detail
