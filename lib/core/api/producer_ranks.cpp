// api/ (layer 6), sharded producers (world_size > 1): the rounds in which
// the ranks agree on each sync (docs/protocol.md §9; the steps are
// protocol/rounds.hpp). Rank 0 leads a round: it gathers every rank's list
// of pieces, merges them into the sync's manifest, announces it and answers
// the ranks; ranks 1.. post their list and join. At end_sync rank 0 waits
// for every rank's chunks, the others for rank 0 to complete the sync. Also
// drop_round and skip_sync (a rank that fails or skips a sync still takes
// its round) and abandon_reason. Runs on the caller's thread of each rank's
// Producer; the ranks are separate processes that share only the region.
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <utility>

#include "api/producer_impl.hpp"
#include "base/checks.hpp"
#include "base/text.hpp"
#include "protocol/manifest.hpp"
#include "protocol/ring.hpp"
#include "protocol/rounds.hpp"
#include "shm/doorbell.hpp"
#include "shm/liveness.hpp"
#include "shm/region.hpp"
#include "shmcast/shmcast.hpp"

namespace shmcast {

using namespace detail;

namespace {

// A failure code read from shared memory, or `otherwise` when it names none.
Errc errc_of(std::uint32_t v, Errc otherwise) {
  return v >= static_cast<std::uint32_t>(Errc::kInvalidArgument) && v <= static_cast<std::uint32_t>(Errc::kSystem)
             ? static_cast<Errc>(v)
             : otherwise;
}

}  // namespace

rounds::Words Producer::Impl::words() const {
  Header& h = view.header();
  return rounds::Words{&h.round_open, &h.round, &h.round_done, &view.rank_seat(0), world};
}

void Producer::Impl::hit(TestPoint at, std::uint64_t n, void* answer) {
  if (!test_point) return;
  const rounds::Words w = words();
  test_point(TestPointArgs{at, n, &w, answer});
}

// Sharded, sync `n` abandoned by another rank: its reason, which that
// rank (the only one that writes it: it won the abandon) publishes just
// after; waited for up to rank_timeout (a rank that died in between
// leaves none).
std::string Producer::Impl::abandon_reason(std::uint64_t n) {
  Header& h = view.header();
  if (h.error_code.load(std::memory_order_acquire) == 0) {
    hit(TestPoint::kAwaitReason, n);
    const std::int64_t deadline = mono_ns() + opts.rank_timeout.count();
    while (h.error_code.load(std::memory_order_acquire) == 0 && mono_ns() < deadline)
      std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  if (h.error_code.load(std::memory_order_acquire) == 0)
    return "the rank that abandoned it gave no reason within rank_timeout (it may have died)";
  return read_error_text(h.error_text);
}

// Rank 0 ends round `n` with a failure: every rank's begin_sync() of that
// round throws `code` (a rank that posts it later hears it at once).
void Producer::Impl::fail_round(std::uint64_t n, Errc code, const std::string& why) {
  rounds::fail(words(), n, code, why);
  detail::ring(view.header().rank_reply);
}

// A sharded begin_sync() (or skip_sync()) that fails on this rank before
// it posts its list still takes its round and fails it for every rank:
// rank 0 fails the round; a rank drops it (its post says so, its list
// area says why), which fails the round at rank 0 at once. So the ranks'
// rounds stay in step, and nothing of the failed round reaches the next.
void Producer::Impl::drop_round(std::uint64_t n, Errc code, const std::string& what) noexcept {
  round = n;
  // A region cut by another process is not written to (its pages may be
  // gone: SIGBUS); the other ranks see this rank fail some other way.
  if (view.file().size_now() != view.geo().total_bytes) return;
  const std::string why = "producer rank " + std::to_string(rank) + " could not begin sync round " +
                          std::to_string(n) + ": " + what;
  if (leader()) {
    rounds::open(words(), n);
    fail_round(n, code, why);
    return;
  }
  const std::uint64_t len = std::min<std::uint64_t>(why.size(), view.room(view.rank_list(rank), why.size()));
  std::memcpy(view.rank_list(rank), why.data(), len);
  rounds::drop(view.rank_seat(rank), n, code, len);
  dropped = n;
  detail::ring(view.header().rank_post);
}

// Ranks 1..: before this rank writes its list area again (its next round's
// list, or the reason it drops that one), rank 0 must have read the reason
// it left there for the round n it dropped: the rank waits until rank 0 has
// ended round n (Header::round), and no longer once rank 0 never will read
// it (it began a later round, closed the region, or died), nor past
// rank_timeout (then rank 0 names the failure without the reason). Without
// this wait a rank that raised before a sync and went on at once overwrote
// its reason with its next list, and rank 0 reported only "failed sync
// round N and went on".
void Producer::Impl::settle_dropped() noexcept {
  if (dropped == 0 || leader()) return;
  const std::uint64_t n = std::exchange(dropped, 0);
  if (view.file().size_now() != view.geo().total_bytes) return;  // cut: nothing is read from it
  const rounds::Words w = words();
  const Header& h = view.header();
  auto settled = [&] {
    return w.ended->load(std::memory_order_acquire) >= n || w.opened->load(std::memory_order_acquire) > n ||
           h.init_state.load(std::memory_order_acquire) == kInitClosed;
  };
  const std::int64_t deadline = mono_ns() + opts.rank_timeout.count();
  std::int64_t next_liveness = 0;
  while (!settled() && mono_ns() < deadline) {
    if (mono_ns() >= next_liveness) {
      if (rank_dead(view, 0)) return;
      next_liveness = mono_ns() + kLivenessPollNs;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

// Rank 0: takes every rank's list of round `n` (rounds::look), and decodes
// them; `used0` bytes of rank 0's own list are in its list area. Any post
// that says a rank left the round fails it at once; a missing rank fails
// it at rank_timeout (Timeout naming it) or when it dies (PeerDied).
std::vector<SyncInfo> Producer::Impl::gather(std::uint64_t n, std::uint64_t used0) {
  Header& h = view.header();
  const std::int64_t deadline = mono_ns() + opts.rank_timeout.count();
  const std::string round_n = "sync round " + std::to_string(n);
  auto fail = [&](Errc code, const std::string& why, const std::string& remedy) {
    fail_round(n, code, why);
    throw Error(code, why + remedy);
  };
  const std::string in_step = ": every rank must call begin_sync()/send() for every sync, within rank_timeout (" +
                              std::to_string(opts.rank_timeout.count() / 1000000) + " ms) of the others";
  // One look at every rank: the first rank whose list is missing, or -1.
  auto pass = [&]() -> int {
    int missing = -1;
    for (std::uint32_t k = 1; k < world; ++k) {
      RankSeat& rs = view.rank_seat(k);
      const rounds::Look l = rounds::look(rs, n);
      const std::string who = "producer rank " + std::to_string(k);
      switch (l.seen) {
        case rounds::Seen::kTaken:
          break;
        case rounds::Seen::kStale:
          rounds::refuse(rs, l.round, Errc::kInvalidArgument,
                         "rank 0 never began sync round " + std::to_string(l.round) + ": it is at " + round_n +
                             " (a rank skipped a sync, or the ranks name versions differently)");
          detail::ring(h.rank_reply);
          [[fallthrough]];
        case rounds::Seen::kMissing:
          if (missing < 0) missing = static_cast<int>(k);
          break;
        case rounds::Seen::kCorrupt:
          fail(Errc::kCorrupt,
               who + "'s post for " + round_n + " holds a state no rank writes: the region is corrupt; recreate it",
               "");
          break;
        case rounds::Seen::kGaveUp:
          fail(Errc::kTimeout,
               who + " gave up waiting for " + round_n + ": this rank (rank 0) began it more than rank_timeout late",
               in_step);
          break;
        case rounds::Seen::kDropped: {
          const std::uint64_t len = std::min<std::uint64_t>(rs.posted_bytes.load(std::memory_order_relaxed), 1024);
          std::string why(len, '\0');
          if (!view.copy_out(view.rank_list(k), len, why.data())) why.clear();
          why.resize(std::strlen(why.c_str()));
          if (why.empty()) why = who + " could not begin " + round_n;
          fail(errc_of(static_cast<std::uint32_t>(l.code), Errc::kAborted), why, "");
          break;
        }
        case rounds::Seen::kAhead:
          if (l.skipped)
            fail(Errc::kInvalidArgument,
                 who + " is at sync round " + std::to_string(l.round) + " and this rank (rank 0) at " +
                     std::to_string(n) + ": it never began round " + std::to_string(n) +
                     " (its caller skipped that sync, or the ranks name versions differently)",
                 in_step);
          if (l.code == Errc::kTimeout)
            fail(Errc::kTimeout,
                 who + " gave up waiting for " + round_n + " and went on to round " + std::to_string(l.round) +
                     ": this rank (rank 0) began it more than rank_timeout late",
                 in_step);
          fail(errc_of(static_cast<std::uint32_t>(l.code), Errc::kAborted),
               who + " failed " + round_n + " (" + errc_name(errc_of(static_cast<std::uint32_t>(l.code), Errc::kAborted)) +
                   ") and went on to round " + std::to_string(l.round),
               "");
      }
    }
    return missing;
  };
  std::vector<std::uint64_t> seen(world);
  auto changed = [&] {
    for (std::uint32_t j = 1; j < world; ++j)
      if (view.rank_seat(j).post.load(std::memory_order_acquire) != seen[j]) return true;
    return false;
  };
  for (;;) {
    // The posts as they are before the pass: a post that changes during
    // the pass, after its rank was looked at, ends the wait below at once.
    for (std::uint32_t j = 1; j < world; ++j) seen[j] = view.rank_seat(j).post.load(std::memory_order_acquire);
    const int k = pass();
    if (k < 0) break;
    for (std::uint32_t j = 1; j < world; ++j) {
      const bool attached = seat_state(view.rank_seat(j).word.load(std::memory_order_acquire)) == kSeatActive;
      if (attached && rounds::post_round(view.rank_seat(j).post.load(std::memory_order_acquire)) <= n &&
          rank_dead(view, j))
        fail(Errc::kPeerDied, rank_who(view, j) + " died before beginning " + round_n,
             ": restart the trainer's ranks together");
    }
    if (mono_ns() >= deadline) {
      const auto kr = static_cast<std::uint32_t>(k);
      const bool attached = seat_state(view.rank_seat(kr).word.load(std::memory_order_acquire)) == kSeatActive;
      fail(Errc::kTimeout,
           "producer rank " + std::to_string(k) +
               (attached ? " is attached but did not begin " : " never attached to the region for ") + round_n +
               " within rank_timeout (" + std::to_string(opts.rank_timeout.count() / 1000000) + " ms)",
           in_step);
    }
    (void)wait_until(h.rank_post, changed, deadline, kLivenessPollNs);
  }
  std::vector<SyncInfo> posts(world);
  std::vector<std::byte> bytes;
  for (std::uint32_t k = 0; k < world; ++k) {
    RankSeat& rs = view.rank_seat(k);
    const std::uint64_t used = k == 0 ? used0 : rs.posted_bytes.load(std::memory_order_relaxed);
    std::string why;
    if (used < sizeof(ManifestHeader) || used > view.geo().manifest_bytes) {
      why = "posted a list of bad size";
    } else {
      bytes.resize(used);
      // pread, not the mapping: a list a rank announced but never allocated
      // reads as zeros (and fails its hash) instead of faulting.
      if (!view.copy_out(view.rank_list(k), used, bytes.data())) std::fill(bytes.begin(), bytes.end(), std::byte{0});
      ManifestHeader mh;
      std::memcpy(&mh, bytes.data(), sizeof mh);
      // The copy is the rank's list of round n only if the post is still
      // ours: a rank that withdrew may be writing its next list.
      if (k != 0 && !rounds::still_taken(rs, n))
        fail(Errc::kTimeout,
             "producer rank " + std::to_string(k) + " gave up waiting for " + round_n +
                 " while rank 0 read its list: this rank (rank 0) answered too late",
             in_step);
      if (k != 0 && XXH3_64bits(bytes.data(), used) != rs.posted_hash.load(std::memory_order_relaxed))
        why = "posted a list that does not match its hash";
      else
        why = decode_manifest(bytes, n, mh.stream_bytes, view.geo().slot_bytes, &posts[k], true,
                              ManifestCheck::kRankPost);
    }
    if (!why.empty()) {
      why = "the list of pieces of producer rank " + std::to_string(k) + " is invalid: " + why;
      fail(Errc::kCorrupt, why, "");
    }
  }
  return posts;
}

// Ranks 1..: posts this rank's list of round `n` (`used` bytes in its list
// area) and waits for rank 0's answer. At rank_timeout without one, the
// rank withdraws its post (rank 0 can no longer take it) and throws
// Timeout naming rank 0; if rank 0 has begun the round by then, its answer
// is coming, and the rank waits once more (rank_timeout +
// consumer_timeout: rank 0 waits for the consumers to ack the last sync
// and for the other ranks) before it gives up the same way.
rounds::Answer Producer::Impl::join_round(std::uint64_t n, std::uint64_t used) {
  Header& h = view.header();
  RankSeat& rs = view.rank_seat(rank);
  rounds::post(rs, n, used, XXH3_64bits(view.rank_list(rank), used));
  detail::ring(h.rank_post);
  hit(TestPoint::kPosted, n);
  const std::string round_n = "sync round " + std::to_string(n);
  std::int64_t deadline = mono_ns() + opts.rank_timeout.count();
  bool extended = false;
  rounds::Answer a;
  for (;;) {
    switch (rounds::hear(rs, n, &a)) {
      case rounds::Heard::kGo:
        return a;
      case rounds::Heard::kFailed:
        throw Error(errc_of(static_cast<std::uint32_t>(a.status), Errc::kCorrupt), a.why);
      case rounds::Heard::kOver:
        throw Error(Errc::kTimeout, round_n + " is over: rank 0 ended it before this rank (producer rank " +
                                        std::to_string(rank) + ") began it, more than rank_timeout late (or the "
                                        "ranks name versions differently): every rank must call begin_sync()/send() "
                                        "for every sync");
      case rounds::Heard::kNothing:
        break;
    }
    const std::uint64_t seen = rs.reply_round.load(std::memory_order_acquire);
    (void)wait_until(h.rank_reply, [&] { return rs.reply_round.load(std::memory_order_acquire) != seen; },
                     deadline, kLivenessPollNs);
    if (rs.reply_round.load(std::memory_order_acquire) != seen) continue;
    if (h.init_state.load(std::memory_order_acquire) == kInitClosed)
      throw Error(Errc::kClosed, "producer rank 0 closed the region");
    if (rank_dead(view, 0))
      throw Error(Errc::kPeerDied, rank_who(view, 0) + " died: restart the trainer's ranks together");
    if (mono_ns() < deadline) continue;
    if (rounds::give_up(words(), rank, n, extended) == rounds::GiveUp::kBegun) {
      extended = true;
      deadline = mono_ns() + opts.rank_timeout.count() + opts.consumer_timeout.count();
      continue;
    }
    throw Error(Errc::kTimeout,
                extended ? "producer rank 0 began " + round_n + " but did not answer within rank_timeout + "
                               "consumer_timeout: is it stuck?"
                         : "producer rank 0 did not begin " + round_n + " within rank_timeout (" +
                               std::to_string(opts.rank_timeout.count() / 1000000) +
                               " ms): every rank must call begin_sync()/send() for every sync");
  }
}

// Rank 0: round `n` of a sharded sync (docs/protocol.md §9, "Rounds"):
// opens it, waits for the consumers of the last sync to ack its manifest,
// takes every rank's list, merges them into the sync's manifest, announces
// it (version n) and answers every rank. Any failure fails the round for
// every rank. Returns chunks per rank; sets version and first_seq.
std::uint64_t Producer::Impl::lead_round(std::uint64_t n, std::uint64_t used) {
  const std::uint64_t S = view.geo().slot_bytes;
  rounds::open(words(), n);
  rounds::post(view.rank_seat(0), n, used, XXH3_64bits(view.rank_list(0), used));  // for tools: nobody takes it
  // Nobody may still be reading the manifest area we are about to rewrite.
  if (last_completed > 0) {
    try {
      ring->wait_acks(last_completed);
    } catch (const Error& e) {
      fail_round(n, e.code(), e.what());
      throw;
    }
  }
  std::vector<SyncInfo> posts = gather(n, used);
  // Delta regions: one kind for the whole round (docs/protocol.md §12.1).
  std::uint64_t base = 0;
  if (opts.delta) {
    base = round_kind(&posts);
    (void)adopt_round_kind(base);  // this rank's own list is posts[0], laid out alike
  } else {
    for (std::uint32_t k = 0; k < world; ++k)
      for (const TensorInfo& t : posts[k].tensors)
        if (t.shards[0].base_version != 0) {
          const std::string w = "producer rank " + std::to_string(k) + " lists '" + t.name +
                                "' as a delta piece, but the region was created without delta syncs";
          fail_round(n, Errc::kInvalidArgument, w);
          throw Error(Errc::kInvalidArgument, w);
        }
  }
  std::vector<TensorSpec> tensors;
  std::vector<ManifestPiece> pieces;
  std::vector<std::uint64_t> rank_bytes;
  std::uint64_t payload = 0;
  std::string why = merge_posts(posts, &tensors, &pieces, &rank_bytes, &payload);
  std::vector<std::byte> manifest;
  const std::uint64_t size = manifest_size(tensors, pieces.size(), world);
  if (why.empty()) why = manifest_room_problem(tensors, view.geo().manifest_bytes, pieces.size(), world, "rank 0");
  std::uint64_t total = 0;
  for (std::uint64_t b : rank_bytes) total += b;
  SyncInfo check;
  if (why.empty()) {
    manifest.resize(size);
    encode_manifest(tensors, pieces, rank_bytes, n, payload, manifest.data(), size);
    // The same checks every consumer makes: the pieces tile each tensor.
    why = decode_manifest(manifest, n, total, S, &check);
  }
  if (!why.empty()) {
    fail_round(n, Errc::kInvalidArgument, "the ranks' pieces do not make one sync: " + why);
    throw Error(Errc::kInvalidArgument, "the ranks' pieces do not make one sync: " + why);
  }
  for (std::uint32_t k = 1; k < world; ++k)
    if (!rounds::still_taken(view.rank_seat(k), n)) {
      const std::string w = "producer rank " + std::to_string(k) + " gave up waiting for sync round " +
                            std::to_string(n) + " before rank 0 answered: rank 0 was more than rank_timeout late";
      fail_round(n, Errc::kTimeout, w);
      throw Error(Errc::kTimeout, w);
    }
  std::uint64_t chunks_per_rank = 0;
  for (std::uint64_t b : rank_bytes) chunks_per_rank = std::max(chunks_per_rank, chunk_count(b, S));
  sync_payload = payload;
  version = n;
  first_seq = next_seq;
  ring->begin_announce();
  std::memcpy(view.manifest(), manifest.data(), std::min(size, view.room(view.manifest(), size)));
  RecordSnapshot rec{};
  rec.version = version;
  rec.first_seq = first_seq;
  rec.chunks = chunks_per_rank * world;
  rec.stream_bytes = total;
  rec.manifest_used = size;
  rec.manifest_hash = XXH3_64bits(manifest.data(), size);
  view.header().error_code.store(0, std::memory_order_relaxed);
  view.header().error_text[0] = 0;
  ring->set_sync(version, first_seq);
  ring->enroll(version, first_seq);
  ring->announce(rec);
  hit(TestPoint::kBeforeGo, n);
  rounds::Answer go;
  go.round = n;
  go.version = version;
  go.first_seq = first_seq;
  go.rank_chunks = chunks_per_rank;
  go.base_version = base;
  rounds::go(words(), go);
  detail::ring(view.header().rank_reply);
  return chunks_per_rank;
}

// Round `n` of a sharded sync on this rank (`used` bytes of its list are in
// its list area): rank 0 leads it, the others join it; then the rank writes
// its chunks first_seq + j * R + rank.
std::uint64_t Producer::Impl::begin_sharded(std::uint64_t n, std::uint64_t used) {
  round = n;
  const std::uint64_t S = view.geo().slot_bytes;
  std::uint64_t chunks_per_rank = 0;
  if (!leader()) {
    rounds::Answer a = join_round(n, used);
    hit(TestPoint::kJoined, n, &a);
    // The others must not wait for this rank's chunks: the sync of round n
    // is abandoned (its fate decided), and its consumers' sync aborted.
    auto refuse = [&](Errc code, const std::string& why) {
      const rounds::Decision d = rounds::abandon_round(words(), n);
      if (d == rounds::Decision::kWon || d == rounds::Decision::kCorrupt) set_error_text(code, why);
      if (d != rounds::Decision::kOpposite) ring->abort(n);
      throw Error(code, why);
    };
    // Rank 0 answers go only to a list it took: this seat's post of round n
    // in state taken. Anything else means rank 0 agreed round n on another
    // process's list (the one this seat had before this process attached):
    // its layout is not this rank's pieces.
    if (view.rank_seat(rank).post.load(std::memory_order_acquire) !=
        rounds::post_word(n, rounds::PostState::kTaken))
      refuse(Errc::kAborted, "rank 0 answered sync round " + std::to_string(n) + " for producer rank " +
                                 std::to_string(rank) + " with a list this process did not post (the rank was "
                                 "restarted in the middle of the round): the sync is abandoned");
    version = a.version;
    first_seq = a.first_seq;
    chunks_per_rank = a.rank_chunks;
    // Delta regions: the round's kind (a list of blobs may have to go whole).
    if (const std::string bad = adopt_round_kind(a.base_version); !bad.empty())
      refuse(Errc::kCorrupt, bad + ": the region is corrupt");
    // What rank 0 gave must be this round's and fit this rank's own pieces.
    if (version != n || first_seq == 0 || chunk_count(stream_bytes, S) > chunks_per_rank ||
        chunks_per_rank > (1ull << 40)) {
      version = n;
      refuse(Errc::kCorrupt, "rank 0's answer to sync round " + std::to_string(n) +
                                 " does not fit this rank's pieces: the region is corrupt");
    }
  } else {
    chunks_per_rank = lead_round(n, used);
  }
  sync_start_ns = mono_ns();
  rank_chunks = chunks_per_rank;
  ring->set_sync(version, first_seq);
  writer = ChunkWriter(&*ring, &view, version, first_seq, stream_bytes, checksums, rank, world, chunks_per_rank);
  layout = SyncLayout{version, first_seq, chunks_per_rank * world, stream_bytes, payload_bytes, offsets};
  layout.rank = rank;
  layout.world_size = world;
  layout.rank_chunks = chunks_per_rank;
  in_sync = true;
  next_tensor = 0;
  part_done = 0;
  lent_chunks = false;
  return version;
}

// Rank 0, at end_sync: waits until every rank published its last chunk.
void Producer::Impl::await_ranks() {
  Header& h = view.header();
  if (rank_chunks == 0) return;
  auto last_seq = [&](std::uint32_t k) { return first_seq + (rank_chunks - 1) * world + k; };
  auto behind = [&]() -> int {
    for (std::uint32_t k = 1; k < world; ++k)
      if (view.rank_seat(k).published_seq.load(std::memory_order_acquire) < last_seq(k)) return static_cast<int>(k);
    return -1;
  };
  const std::int64_t budget = opts.rank_timeout.count() + opts.consumer_timeout.count();
  std::int64_t deadline = mono_ns() + budget;
  std::uint64_t progress = 0;
  for (;;) {
    const WaitResult w = wait_until(h.publish, [&] { return behind() < 0 || ring->aborted_now(); }, deadline,
                                    kLivenessPollNs);
    ring->check_aborted();
    const int k = behind();
    if (k < 0) return;
    const auto kr = static_cast<std::uint32_t>(k);
    if (rank_dead(view, kr))
      throw Error(Errc::kPeerDied, rank_who(view, kr) + " died in the middle of sync " + std::to_string(version));
    // A rank that gave up on the round before it heard the answer (or a
    // process that took its place since) will never write its chunks.
    if (!rounds::still_taken(view.rank_seat(kr), version)) {
      const std::uint64_t p = view.rank_seat(kr).post.load(std::memory_order_acquire);
      if (rounds::post_state(p) == rounds::PostState::kWithdrawn && rounds::post_round(p) == version)
        throw Error(Errc::kTimeout, "producer rank " + std::to_string(k) + " gave up waiting for sync round " +
                                        std::to_string(version) + " before rank 0's answer reached it: rank 0 "
                                        "answered more than rank_timeout late");
      throw Error(Errc::kPeerDied, "producer rank " + std::to_string(k) + " left sync " + std::to_string(version) +
                                       " (it was restarted, or closed): restart the trainer's ranks together");
    }
    std::uint64_t now = 0;
    for (std::uint32_t j = 1; j < world; ++j) now += view.rank_seat(j).published_seq.load(std::memory_order_relaxed);
    if (now != progress) {
      progress = now;
      deadline = mono_ns() + budget;
    } else if (w == WaitResult::kTimeout || mono_ns() >= deadline) {
      throw Error(Errc::kTimeout, rank_who(view, kr) + " published nothing of sync " + std::to_string(version) +
                                      " for rank_timeout + consumer_timeout: is it stuck?");
    }
  }
}

// Ranks 1.., at end_sync: every chunk of this rank is published; waits
// until rank 0 completed the sync (every rank's chunks are in: the sync
// is the consumers' now), so that a rank's end_sync() returns only for a
// sync that completed. The sync aborted (by any rank), rank 0 dead or the
// region closed: the error; no progress of any rank for rank_timeout +
// consumer_timeout: Timeout naming rank 0.
void Producer::Impl::await_done() {
  Header& h = view.header();
  const rounds::Words w = words();
  const std::int64_t budget = opts.rank_timeout.count() + opts.consumer_timeout.count();
  std::int64_t deadline = mono_ns() + budget;
  auto progress_now = [&] {
    std::uint64_t p = h.published_seq.load(std::memory_order_relaxed);
    for (std::uint32_t j = 1; j < world; ++j) p += view.rank_seat(j).published_seq.load(std::memory_order_relaxed);
    return p;
  };
  const std::string sync_n = "sync " + std::to_string(version);
  auto corrupt = [&] {
    return Error(Errc::kCorrupt, "the region's round_done names neither fate of " + sync_n +
                                     ": the region is corrupt; recreate it (restart the trainer's ranks)");
  };
  // The sync cannot complete any more (rank 0 closed or died, or nothing
  // moves): this rank abandons it, unless rank 0 completed it in between,
  // which is success (the consumers have it).
  auto lost = [&](Errc code, const std::string& why) {
    switch (rounds::abandon_round(w, version)) {
      case rounds::Decision::kOpposite:
        return;
      case rounds::Decision::kCorrupt:
        throw corrupt();
      case rounds::Decision::kSame:
        throw Error(Errc::kAborted, sync_n + " was abandoned by another rank: " + abandon_reason(version));
      case rounds::Decision::kWon:
        abandon_won = true;
        throw Error(code, why);
    }
  };
  std::uint64_t progress = progress_now();
  for (;;) {
    if (rounds::completed(w, version)) return;
    hit(TestPoint::kAwaitDoneUndecided, version);
    if (rounds::fate_corrupt(w, version)) throw corrupt();
    if (rounds::abandoned(w, version))
      throw Error(Errc::kAborted, sync_n + " was abandoned by another rank: " + abandon_reason(version));
    ring->check_aborted();
    if (h.init_state.load(std::memory_order_acquire) == kInitClosed)
      return lost(Errc::kClosed, "producer rank 0 closed the region in the middle of " + sync_n);
    if (rank_dead(view, 0))
      return lost(Errc::kPeerDied, rank_who(view, 0) + " died before " + sync_n +
                                       " was complete: the sync is lost; restart the trainer's ranks together");
    if (const std::uint64_t p = progress_now(); p != progress) {
      progress = p;
      deadline = mono_ns() + budget;
    } else if (mono_ns() >= deadline) {
      return lost(Errc::kTimeout, rank_who(view, 0) + " did not complete " + sync_n +
                                      " and no rank published anything for rank_timeout + consumer_timeout: is "
                                      "it stuck?");
    }
    auto ready = [&] {
      return rounds::completed(w, version) || rounds::fate_corrupt(w, version) || rounds::abandoned(w, version) ||
             ring->aborted_now() || h.init_state.load(std::memory_order_acquire) == kInitClosed;
    };
    (void)wait_until(h.rank_reply, ready, deadline, kLivenessPollNs);
  }
}

// end_sync() of a sharded rank, once its own chunks are handed to the
// engine and drained.
void Producer::Impl::end_sharded() {
  ring->check_aborted();
  // A rank's sync is done only when every rank's is: rank 0 waits for
  // the others' chunks, the others for rank 0 to say so.
  if (!leader()) {
    await_done();
    return;
  }
  await_ranks();
  // Every rank's chunks are in; each must be from the process whose
  // list rank 0 took (a process that took a seat since may have
  // written chunks laid out by its own pieces).
  for (std::uint32_t k = 1; k < world; ++k)
    if (!rounds::still_taken(view.rank_seat(k), version))
      throw Error(Errc::kPeerDied, "producer rank " + std::to_string(k) + " left sync " + std::to_string(version) +
                                       " before it was complete (it was restarted, or it gave up): restart the "
                                       "trainer's ranks together");
  hit(TestPoint::kBeforeComplete, version);
  switch (rounds::complete_round(words(), version)) {
    case rounds::Decision::kWon:
      break;
    case rounds::Decision::kCorrupt:
      throw Error(Errc::kCorrupt, "the region's round_done names neither fate of sync " + std::to_string(version) +
                                      ": the region is corrupt; recreate it");
    default:
      throw Error(Errc::kAborted,
                  "sync " + std::to_string(version) + " was abandoned by another rank: " + abandon_reason(version));
  }
  hit(TestPoint::kAfterComplete, version);
}

// skip_sync(): a sharded rank that will not send this sync still takes its
// round and drops it, so the ranks stay in step (drop_round).
void Producer::Impl::skip_sync(std::string_view why, std::uint64_t want) {
  quant.pre_pending = quant.dpre_pending = false;  // that step's scales are no later sync's
  require_open();
  if (in_sync) throw Error(Errc::kInvalidArgument, "skip_sync() during a sync: abort_sync() it instead");
  if (world == 1) return;  // one producer: no other rank to keep in step
  std::uint64_t n = 0;
  if (const std::string bad = rounds::next_round(round, want, &n); !bad.empty())
    throw Error(Errc::kInvalidArgument, "skip_sync(): " + bad);
  settle_dropped();
  drop_round(n, Errc::kAborted, std::string(why));
}

}  // namespace shmcast
