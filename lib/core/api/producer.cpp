// api/ (layer 6): the public Producer.
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <thread>
#include <unordered_set>

#include "base/checks.hpp"
#include "base/text.hpp"
#include "shm/doorbell.hpp"
#include "engine/engine.hpp"
#include "shm/liveness.hpp"
#include "protocol/manifest.hpp"
#include "shm/region.hpp"
#include "protocol/ring.hpp"
#include "protocol/rounds.hpp"
#include "shmcast/shmcast.hpp"

namespace shmcast {

using namespace detail;

namespace {
constexpr std::uint64_t kFillStep = 2ull << 20;  // progressive-fill granularity
}  // namespace

struct Producer::Impl {
  std::string name, path;
  ProducerOptions opts;
  RegionView view;
  std::optional<ProducerRing> ring;
  std::unique_ptr<ProducerEngine> engine;
  PinInfo pin;
  double create_s = 0;
  bool checksums = false;

  // sharded producers
  std::uint32_t rank = 0, world = 1;
  std::uint64_t round = 0;       // the last round this rank took (its id is that sync's version)
  std::uint64_t rank_chunks = 0; // chunks per rank of the sync in progress
  std::uint64_t first_seq = 0;   // of the sync in progress
  bool leader() const { return rank == 0; }
  std::uint64_t begin_sharded(std::uint64_t n, std::uint64_t used);
  std::uint64_t lead_round(std::uint64_t n, std::uint64_t used);
  std::uint64_t begin_store(std::uint64_t version);
  RecordSnapshot store_rec{};  // store regions: the record end_sync() announces

  // the sync in progress
  bool in_sync = false;
  bool abandon_won = false;  // sharded: this rank decided the sync's fate (abandoned); abort() writes the reason
  std::uint64_t version = 0;         // of the sync in progress or the last one
  std::uint64_t last_completed = 0;  // last sync that was not aborted
  std::uint64_t next_seq = 1;
  std::vector<TensorSpec> specs;
  std::vector<std::uint64_t> offsets;
  std::uint64_t stream_bytes = 0, payload_bytes = 0;  // this rank's
  std::uint64_t sync_payload = 0;  // the whole sync's (rank 0)
  std::size_t next_tensor = 0;
  std::uint64_t part_done = 0;
  bool lent = false;         // store regions: fill_spans() lent the bank to the caller
  bool lent_chunks = false;  // ring regions: lend_chunk() lent slots to the caller
  ChunkWriter writer;  // the sync's chunks
  SyncLayout layout;   // of the sync in progress or the last one begun
  std::int64_t sync_start_ns = 0;

  ~Impl() { close_quietly(); }

  void require_open() const {
    if (view.file().inherited()) throw_inherited("Producer", view.file());
    if (!view.mapped()) throw Error(Errc::kClosed, "this producer is closed");
  }

  // Hands chunks that end at or before stream byte `pos` to the engine,
  // which publishes each once its bytes are complete.
  void complete_below(std::uint64_t pos) {
    writer.complete_below(pos, [this](std::function<void()> publish) { engine->chunk_done(std::move(publish)); });
  }

  // A write that fails leaves nothing half-announced: the sync is aborted
  // (consumers get kAborted with the reason) before the error propagates.
  // Bytes [from, from + len) of the tensor (len kWhole: all of it); src
  // points at byte `from`.
  static constexpr std::uint64_t kWhole = ~0ull;
  void write_tensor(std::size_t index, const Buffer& src, void* stream, std::uint64_t from = 0,
                    std::uint64_t len = kWhole) {
    require_open();
    if (!in_sync) throw Error(Errc::kInvalidArgument, "write() outside a sync: call begin_sync() first");
    if (lent)
      throw Error(Errc::kInvalidArgument, "write() in a sync whose tensors were lent out by fill_spans(): fill the "
                                          "spans, then end_sync()");
    if (lent_chunks)
      throw Error(Errc::kInvalidArgument, "write() in a sync whose slots were lent out by lend_chunk(): fill them, "
                                          "publish_chunks(), then end_sync()");
    try {
      write_tensor_in_sync(index, src, stream, from, len);
    } catch (const Error& e) {
      abort(e.what(), e.code());
      throw;
    } catch (const std::exception& e) {
      abort(e.what());
      throw;
    }
  }

  void write_tensor_in_sync(std::size_t index, const Buffer& src, void* stream, std::uint64_t from, std::uint64_t len) {
    if (src.device && !engine->is_cuda())
      throw Error(Errc::kInvalidArgument, "write_device() on a producer with the host copy engine: create it with "
                                          "engine = CopyEngine::kCuda (or kAuto on a machine with a GPU), or copy "
                                          "the tensor to host memory and write() it");
    if (index != next_tensor) {
      if (index >= specs.size())
        throw Error(Errc::kInvalidArgument, "tensor index " + std::to_string(index) + " is out of range (the sync has " +
                                                std::to_string(specs.size()) + " tensors)");
      throw Error(Errc::kInvalidArgument, "tensors must be written in manifest order: expected index " +
                                              std::to_string(next_tensor) + " ('" +
                                              (next_tensor < specs.size() ? specs[next_tensor].name : "") + "'), got " +
                                              std::to_string(index));
    }
    const std::uint64_t n = specs[index].local_nbytes();
    if (from != part_done || (len != kWhole && len > n - from))
      throw Error(Errc::kInvalidArgument, "write_part() of '" + specs[index].name + "': bytes [" + std::to_string(from) +
                                              ", +" + std::to_string(len) + ") do not follow the " +
                                              std::to_string(part_done) + " written of its " + std::to_string(n));
    const std::uint64_t to = len == kWhole ? n : from + len;
    if (src.layout.rows != 0) {
      std::uint64_t total;
      if (__builtin_mul_overflow(src.layout.rows, src.layout.row_bytes, &total) || total != n ||
          src.layout.pitch_bytes < src.layout.row_bytes)
        throw Error(Errc::kInvalidArgument, "strided layout of '" + specs[index].name +
                                                "' does not match its size (rows x row_bytes must equal nbytes, "
                                                "pitch_bytes >= row_bytes)");
    }
    if (to > from && src.ptr == nullptr)
      throw Error(Errc::kInvalidArgument, "null source for tensor '" + specs[index].name + "'");
    const std::uint64_t off = offsets[index];
    if (src.device) engine->begin(stream);
    // Progressive fill only when every earlier byte of the chunk is final
    // once written: host copies, no async engine, no checksum to wait for.
    const bool follow = !src.device && !engine->is_cuda() && !checksums;
    std::uint64_t done = from;
    while (done < to) {
      const std::uint64_t pos = off + done;
      complete_below(pos);
      std::uint64_t room;
      std::byte* dst = writer.claim(pos, &room);
      const std::uint64_t len = (to - done) < room ? (to - done) : room;
      if (follow) {
        // Copy in cache-sized steps and mark each final, so consumers copy
        // the bytes out while they are still in the cache.
        for (std::uint64_t step = 0; step < len;) {
          const std::uint64_t n2 = len - step < kFillStep ? len - step : kFillStep;
          engine->copy(dst + step, src, done - from + step, n2);
          step += n2;
          writer.filled_to(pos + step);
        }
      } else {
        engine->copy(dst, src, done - from, len);
      }
      done += len;
    }
    part_done = to;
    if (to < n) return;
    part_done = 0;
    ++next_tensor;
    complete_below(next_tensor < specs.size() ? offsets[next_tensor] : stream_bytes);
  }

  void set_error_text(Errc code, const std::string& text) {
    Header& h = view.header();
    write_error_text(h.error_text, world > 1 ? "rank " + std::to_string(rank) + ": " + text : text);
    h.error_code.store(static_cast<std::uint32_t>(code), std::memory_order_release);
  }

  // ---- sharded producers: rounds (rounds.hpp, docs/protocol.md §9)

  rounds::Words words() const {
    Header& h = view.header();
    return rounds::Words{&h.round_open, &h.round, &h.round_done, &view.rank_seat(0), world};
  }

  // Tests: a pause point (rounds.hpp, TestPoint); nothing in a real process.
  void hit(TestPoint at, std::uint64_t n, void* answer = nullptr) {
    if (!test_point) return;
    const rounds::Words w = words();
    test_point(TestPointArgs{at, n, &w, answer});
  }

  // Sharded, sync `n` abandoned by another rank: its reason, which that
  // rank (the only one that writes it: it won the abandon) publishes just
  // after; waited for up to rank_timeout (a rank that died in between
  // leaves none).
  std::string abandon_reason(std::uint64_t n) {
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

  static Errc errc_of(std::uint32_t v, Errc otherwise) {
    return v >= static_cast<std::uint32_t>(Errc::kInvalidArgument) && v <= static_cast<std::uint32_t>(Errc::kSystem)
               ? static_cast<Errc>(v)
               : otherwise;
  }

  // Rank 0 ends round `n` with a failure: every rank's begin_sync() of that
  // round throws `code` (a rank that posts it later hears it at once).
  void fail_round(std::uint64_t n, Errc code, const std::string& why) {
    rounds::fail(words(), n, code, why);
    detail::ring(view.header().rank_reply);
  }

  // A sharded begin_sync() (or skip_sync()) that fails on this rank before
  // it posts its list still takes its round and fails it for every rank:
  // rank 0 fails the round; a rank drops it (its post says so, its list
  // area says why), which fails the round at rank 0 at once. So the ranks'
  // rounds stay in step, and nothing of the failed round reaches the next.
  void drop_round(std::uint64_t n, Errc code, const std::string& what) noexcept {
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
    const std::uint64_t len = std::min<std::uint64_t>(why.size(), view.geo().manifest_bytes);
    std::memcpy(view.rank_list(rank), why.data(), len);
    rounds::drop(view.rank_seat(rank), n, code, len);
    detail::ring(view.header().rank_post);
  }

  // Rank 0: takes every rank's list of round `n` (rounds::look), and decodes
  // them; `used0` bytes of rank 0's own list are in its list area. Any post
  // that says a rank left the round fails it at once; a missing rank fails
  // it at rank_timeout (Timeout naming it) or when it dies (PeerDied).
  std::vector<SyncInfo> gather(std::uint64_t n, std::uint64_t used0) {
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
            std::string why(reinterpret_cast<const char*>(view.rank_list(k)), len);
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
        std::memcpy(bytes.data(), view.rank_list(k), used);
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
  rounds::Answer join_round(std::uint64_t n, std::uint64_t used) {
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

  // Rank 0, at end_sync: waits until every rank published its last chunk.
  void await_ranks() {
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
  void await_done() {
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

  // Ends the sync in progress unfinished: consumers get Aborted with `why`,
  // the other ranks `code` when it names a culprit (Timeout, PeerDied), else
  // Aborted. The next sync starts clean: nothing here outlives this sync.
  void abort(std::string_view why, Errc code = Errc::kAborted) {
    if (!in_sync) return;
    if (world > 1) {
      // Sharded: the sync's fate is decided once; rank 0 may have completed
      // it already (every chunk is in), and then there is nothing to abort.
      const rounds::Decision d = abandon_won ? rounds::Decision::kWon : rounds::abandon_round(words(), version);
      abandon_won = false;
      if (d == rounds::Decision::kOpposite) {
        ring->clear_sync();
        next_seq = writer.next_seq();
        in_sync = false;
        return;
      }
      // Only the rank that abandoned the sync writes the reason (one text,
      // never two mixed); the others wait for it to be there before they
      // abort the consumers' sync.
      if (d == rounds::Decision::kWon) {
        hit(TestPoint::kAbandonWon, version);
        set_error_text(code, std::string(why));
      } else if (d == rounds::Decision::kCorrupt) {
        set_error_text(Errc::kCorrupt, std::string(why));
      } else {
        (void)abandon_reason(version);
      }
    } else {
      set_error_text(code, std::string(why));
    }
    try {
      engine->drain();
    } catch (...) {
    }
    ring->abort(version);
    // A store region announced nothing: the next sync refills the same bank
    // (the other one holds the version readers see).
    if (!view.geo().store) next_seq = writer.next_seq();
    ring->clear_sync();
    in_sync = false;
  }

  void leave_rank() noexcept {
    RankSeat& rs = view.rank_seat(rank);
    const std::uint64_t w = rs.word.load(std::memory_order_acquire);
    rs.word.store(make_seat_word(seat_gen(w), kSeatFree), std::memory_order_release);
    detail::ring(view.header().rank_post);
    unlock_byte(view.fd(), rank_lock_byte(rank));
  }

  void close_quietly() noexcept {
    if (view.file().inherited()) {
      // A forked child's copy: the parent's region, seat and engine are not
      // ours to close. Forget them without touching any of it.
      (void)engine.release();
      view.file().unmap();
      return;
    }
    if (!view.mapped()) return;
    try {
      abort("the producer closed in the middle of the sync");
    } catch (...) {
    }
    if (!leader()) {
      // A rank leaves; the region is rank 0's.
      engine.reset();
      if (pin.pinned) cuda_unpin(view.file().data(), view.file().size());
      pin.pinned = false;
      leave_rank();
      view.file().unmap();
      return;
    }
    Header& h = view.header();
    h.init_state.store(kInitClosed, std::memory_order_release);
    // The record is unchanged: a sync published before close stays readable.
    ring_keep_parity(h.sync.announce);
    detail::ring(h.publish);
    if (opts.unlink_on_close) view.file().unlink_if_same();
    engine.reset();
    if (pin.pinned) cuda_unpin(view.file().data(), view.file().size());  // unregister before unmap
    pin.pinned = false;
    unlock_byte(view.fd(), kProducerLockByte);
    view.file().unmap();
  }
};

// A region of this name exists. Takes it over when its producer is proven
// dead (its lock byte is free and we now hold it, so no one can revive it),
// by removing the name; throws kExists or kPermission when it is alive, not
// ours, or its liveness cannot be told. Returns false when the name vanished.
// While it holds byte 0 of the old file it also holds kTakeoverLockByte
// (taken first, released last), so a rank attaching meanwhile never takes
// this lock for a live rank 0 (attach_rank). `before_unlink` (tests): runs
// with both locks held, just before the name is removed.
bool detail::take_over_stale(const std::string& dir, std::string_view name, bool replace_stale, bool group_access,
                             const std::function<void()>& before_unlink) {
  MappedFile old;
  try {
    old = MappedFile::open_unmapped(dir, name, true);  // read-write: the lock probe below takes the lock
  } catch (const Error& e) {
    if (e.code() == Errc::kNotFound) return false;
    throw Error(e.code() == Errc::kPermission ? Errc::kPermission : Errc::kExists,
                "region '" + std::string(name) + "' exists but cannot be inspected, so it is left alone: " + e.what());
  }
  const std::string why = trust_problem(old, TrustPolicy{group_access, {}});
  if (!why.empty()) throw Error(Errc::kPermission, why + "; pick another region name, or have its owner remove it");
  int rc = lock_byte(old.fd(), kTakeoverLockByte);
  if (rc == -EAGAIN)
    throw Error(Errc::kExists, "region '" + std::string(name) + "' in " + dir +
                                   " is being taken over by another producer right now: pick another name, or stop "
                                   "that producer");
  if (rc == 0) rc = lock_byte(old.fd(), kProducerLockByte);
  if (rc == -EAGAIN)
    throw Error(Errc::kExists, "region '" + std::string(name) + "' in " + dir +
                                   " belongs to a live producer: pick another name, or stop that producer");
  if (rc != 0)
    throw Error(Errc::kExists, "region '" + std::string(name) + "' exists and the liveness of its producer cannot be "
                               "checked (" + std::strerror(-rc) + "): it is left alone; remove it with "
                               "`shmcast-inspect rm " + std::string(name) + "` if it is dead");
  if (!replace_stale)
    throw Error(Errc::kExists, "region '" + std::string(name) + "' exists (its producer is gone); remove it with "
                               "`shmcast-inspect rm " + std::string(name) + "` or set replace_stale");
  // The old producer is dead: take the name over. Attached consumers keep
  // the old mapping, see the producer died, and reopen.
  if (before_unlink) before_unlink();
  if (!old.unlink_if_same() && old.still_at_path())
    throw Error(Errc::kPermission, "cannot replace stale region " + old.path() + ": " + std::strerror(errno), errno);
  return true;
}

namespace {

void init_header(RegionView& v, std::uint64_t features) {
  Header& hdr = v.header();
  // The file is fresh from posix_fallocate, so every byte is zero already:
  // write the fixed header and the producer's identity, flip init_state last.
  hdr.fixed = make_fixed_header(v.geo(), features);
  hdr.fixed.created_unix_ns = static_cast<std::uint64_t>(unix_ns());
  write_identity(hdr.producer, self_identity());
  hdr.generation.store(1, std::memory_order_relaxed);
  if (v.geo().world_size > 1) {
    RankSeat& rs = v.rank_seat(0);
    write_identity(rs.who, self_identity());
    rs.attach_unix_ns.store(static_cast<std::uint64_t>(unix_ns()), std::memory_order_relaxed);
    rs.word.store(make_seat_word(1, kSeatActive), std::memory_order_relaxed);
  }
  std::atomic_thread_fence(std::memory_order_release);
  hdr.init_state.store(kInitReady, std::memory_order_release);
}

}  // namespace

Producer::Producer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Producer::Producer(Producer&&) noexcept = default;
Producer& Producer::operator=(Producer&&) noexcept = default;
Producer::~Producer() = default;

namespace {

// Why `f` (a ready region, header `h`) is not one a rank may join, or "":
// its rank 0 must hold lock byte 0 while no takeover holds
// kTakeoverLockByte, and the file must still be the one at the path. In
// that order: a takeover locks the takeover byte before byte 0 and removes
// the name before it lets go of either, so byte 0 held and then the
// takeover byte free means byte 0 is rank 0's own, or the takeover has
// finished, and then the path names another file.
std::string live_region_problem(const MappedFile& f, const Header& h) {
  if (peer_alive(f.fd(), kProducerLockByte, h.producer) == Alive::kNo) return "a live rank 0 (the region's rank 0 is dead)";
  if (lock_held(f.fd(), kTakeoverLockByte) == Alive::kYes)
    return "rank 0 to finish replacing the region (a new rank 0 is taking over the stale one)";
  if (!f.still_at_path()) return "rank 0 to create the region again (this file was removed or replaced)";
  return "";
}

// Rank r >= 1 of a sharded producer: attaches to the region rank 0 created,
// a live one: the file at the path whose rank 0 holds its lock (not a stale
// file a new rank 0 is replacing), checked again once this rank holds its
// own lock byte; else it waits and opens the path again, up to rank_timeout.
Producer::Impl* attach_rank(Producer::Impl* m, std::string_view name, const ProducerOptions& o) {
  const std::string dir = region_dir();
  const std::int64_t deadline = mono_ns() + o.rank_timeout.count();
  std::string waiting = "the region to appear";
  for (;;) {
    try {
      MappedFile f = MappedFile::open(dir, name, true);
      if (std::string why = trust_problem(f, TrustPolicy{o.group_access, {}}); !why.empty())
        throw Error(Errc::kPermission, why);
      if (f.size() >= kHeaderBytes) {
        const Header& live = *reinterpret_cast<const Header*>(f.data());
        const std::uint32_t init = live.init_state.load(std::memory_order_acquire);
        const HeaderFixed snap = snapshot_header(f.data());
        if (init == kInitReady) {
          const Geometry g = checked_geometry(f, snap);
          if (snap.world_size != o.world_size)
            throw Error(Errc::kInvalidArgument, "region '" + std::string(name) + "' was created by rank 0 for " +
                                                    std::to_string(snap.world_size) + " ranks, this rank says " +
                                                    std::to_string(o.world_size) + ": give every rank the same world_size");
          waiting = live_region_problem(f, live);
          if (waiting.empty()) {
            const int rc = lock_byte(f.fd(), rank_lock_byte(o.rank));
            if (rc == -EAGAIN)
              throw Error(Errc::kExists, "producer rank " + std::to_string(o.rank) + " of region '" +
                                             std::string(name) +
                                             "' is already attached by a live process: give each rank its own rank "
                                             "number");
            if (rc != 0)
              throw Error(Errc::kSystem, std::string("cannot lock the rank's byte: ") + std::strerror(-rc), -rc);
            // Again, now that this rank holds its byte: a takeover that began
            // meanwhile, or a file replaced meanwhile, is not joined.
            waiting = live_region_problem(f, live);
            if (waiting.empty()) {
              m->checksums = (snap.features & kFeatureChecksums) != 0;
              m->path = f.path();
              m->view = RegionView(std::move(f), g);
              break;
            }
            unlock_byte(f.fd(), rank_lock_byte(o.rank));
          }
        } else {
          waiting = init == kInitClosed ? "rank 0 to create the region again (it is closed)"
                                        : "rank 0 to finish creating the region";
        }
      }
    } catch (const Error& e) {
      if (e.code() != Errc::kNotFound) throw;
    }
    if (mono_ns() >= deadline)
      throw Error(Errc::kTimeout, "producer rank " + std::to_string(o.rank) + " gave up waiting for " + waiting + " at " +
                                      region_path(name) + " (rank_timeout): is rank 0 running, with the same SHMCAST_DIR?");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  RankSeat& rs = m->view.rank_seat(o.rank);
  const std::uint64_t old = rs.word.load(std::memory_order_acquire);
  rs.published_seq.store(0, std::memory_order_relaxed);
  rs.error_code.store(0, std::memory_order_relaxed);
  rs.attach_unix_ns.store(static_cast<std::uint64_t>(unix_ns()), std::memory_order_relaxed);
  write_identity(rs.who, self_identity());
  // Join the next round rank 0 has not ended yet, unless the seat's
  // previous process posted for it (rank 0 may have taken that list: the
  // round is in flight, and it is not this process's), which the seat then
  // drops (rounds::rejoin). reply_round stays: rank 0 only ever raises it,
  // and it is no higher than `round` (a later round rank 0 fails meanwhile
  // is answered to this seat too).
  m->round = rounds::rejoin(m->words(), o.rank, m->view.rank_list(o.rank), m->view.geo().manifest_bytes,
                            "producer rank " + std::to_string(o.rank) +
                                " was restarted in the middle of a sync round (its new process did not post its list)");
  rs.word.store(make_seat_word(seat_gen(old) + 1, kSeatActive), std::memory_order_seq_cst);
  detail::ring(m->view.header().rank_post);
  return m;
}

}  // namespace

Producer Producer::create(std::string_view name, const ProducerOptions& o) {
  const std::int64_t t0 = mono_ns();
  std::string why = validate_name(name);
  if (!why.empty()) throw Error(Errc::kBadName, why + ": '" + std::string(name) + "'");
  if (o.world_size < 1 || o.world_size > limits::kMaxRanks || o.rank >= o.world_size)
    throw Error(Errc::kInvalidArgument, "rank " + std::to_string(o.rank) + " of world_size " +
                                            std::to_string(o.world_size) + ": need 0 <= rank < world_size <= " +
                                            std::to_string(limits::kMaxRanks));
  if (o.consumer_timeout.count() <= 0) throw Error(Errc::kInvalidArgument, "consumer_timeout must be positive");
  if (o.rank_timeout.count() <= 0) throw Error(Errc::kInvalidArgument, "rank_timeout must be positive");
  const bool store = o.mode == RegionMode::kStore;
  if (store && o.world_size != 1)
    throw Error(Errc::kInvalidArgument, "a store region takes one producer rank (world_size 1): gather the "
                                        "shards on one rank, or use a ring region");
  auto impl = std::make_unique<Impl>();
  impl->name = std::string(name);
  impl->opts = o;
  impl->rank = o.rank;
  impl->world = o.world_size;
  // The engine (and a required pin's CUDA) before the region exists: a
  // create refused for want of a GPU leaves nothing a consumer could open.
  const bool cuda = o.engine == CopyEngine::kCuda || (o.engine == CopyEngine::kAuto && cuda_available());
  impl->engine = cuda ? make_cuda_producer_engine() : make_host_producer_engine();
  if (o.pin == Pin::kYes && !cuda_available())
    throw Error(Errc::kCudaUnavailable, "cannot pin region '" + impl->name + "': " + cuda_unavailable_reason());
  if (o.rank > 0) {
    attach_rank(impl.get(), name, o);
  } else {
    Geometry g{};
    if (store) {
      if (o.store_bytes == 0)
        throw Error(Errc::kInvalidArgument, "a store region needs store_bytes: the room for one version "
                                            "(store_bytes_needed(tensors))");
      why = compute_geometry(o.max_consumers, 2, o.store_bytes, o.manifest_bytes, &g, 1, true);
    } else {
      why = compute_geometry(o.max_consumers, o.slots, o.slot_bytes, o.manifest_bytes, &g, o.world_size);
    }
    if (!why.empty()) throw Error(Errc::kInvalidArgument, why);
    const std::string dir = region_dir();
    MappedFile file;
    for (int attempt = 0;; ++attempt) {
      try {
        file = MappedFile::create(dir, name, g.total_bytes, o.group_access, kProducerLockByte);
        break;
      } catch (const Error& e) {
        if (e.code() != Errc::kExists || attempt >= 2) throw;
        take_over_stale(dir, name, o.replace_stale, o.group_access);  // detail::
      }
    }
    impl->path = file.path();
    impl->checksums = o.checksums;
    impl->view = RegionView(std::move(file), g);
    init_header(impl->view, (o.checksums ? kFeatureChecksums : 0) | (store ? kFeatureStore : 0));
  }
  impl->ring.emplace(&impl->view, ProducerRingOptions{o.stall_policy, o.consumer_timeout.count(), o.rank, o.world_size,
                                                      impl->view.geo().store});
  impl->create_s = static_cast<double>(mono_ns() - t0) * 1e-9;
  if (o.pin != Pin::kNo) {
    impl->pin = cuda_pin(impl->view.file().data(), impl->view.file().size());
    if (!impl->pin.pinned && o.pin == Pin::kYes)
      throw Error(Errc::kCudaUnavailable, "cannot pin region '" + impl->name + "': " + impl->pin.why);
  }
  return Producer(std::move(impl));
}

void Producer::wait_for_consumers(std::uint32_t n, Duration timeout) {
  impl_->require_open();
  Header& h = impl_->view.header();
  const std::int64_t deadline = mono_ns() + timeout.count();
  for (;;) {
    const std::uint32_t have = impl_->ring->live_consumers();
    if (have >= n) return;
    auto ready = [&] { return impl_->ring->live_consumers() >= n; };
    if (wait_until(h.release, ready, deadline, kLivenessPollNs) == WaitResult::kTimeout)
      throw Error(Errc::kTimeout, std::to_string(have) + " of " + std::to_string(n) + " consumers attached to '" +
                                      impl_->name + "' before the timeout: are the consumers running, with the same "
                                      "SHMCAST_DIR?");
  }
}

std::uint32_t Producer::consumers() const {
  impl_->require_open();
  return impl_->ring->live_consumers();
}

std::uint64_t Producer::begin_sync(std::span<const TensorSpec> tensors, std::uint64_t version) {
  Impl& m = *impl_;
  m.require_open();
  if (m.in_sync) throw Error(Errc::kInvalidArgument, "begin_sync() while a sync is in progress: end_sync() it first");
  // Sharded: the sync's round (its version); a refusal from here on still
  // takes the round (drop_round), so the ranks stay in step.
  std::uint64_t n = 0, used = 0;
  if (m.world > 1) {
    if (const std::string why = rounds::next_round(m.round, version, &n); !why.empty())
      throw Error(Errc::kInvalidArgument, "begin_sync(): " + why);
  } else if (version != 0 && version <= m.version) {
    throw Error(Errc::kInvalidArgument, "begin_sync() version " + std::to_string(version) +
                                            " is not greater than the last, " + std::to_string(m.version));
  }
  try {
    // A region file cut by another process would SIGBUS us on its missing
    // pages: refuse cleanly when it happened between syncs (docs/reliability.md).
    if (const std::uint64_t now = m.view.file().size_now(); now != m.view.geo().total_bytes)
      throw Error(Errc::kCorrupt, "region file " + m.path + " is " + std::to_string(now) + " bytes, not " +
                                      std::to_string(m.view.geo().total_bytes) +
                                      ": another process truncated or resized it; close this producer and create "
                                      "the region again");
    std::unordered_set<std::string_view> names;
    names.reserve(tensors.size());
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const std::string why = validate_spec(tensors[i]);
      if (!why.empty()) throw Error(Errc::kInvalidArgument, "tensor " + std::to_string(i) + " ('" + tensors[i].name + "'): " + why);
      if (!names.insert(tensors[i].name).second)
        throw Error(Errc::kInvalidArgument, "tensor name '" + tensors[i].name + "' appears twice in one sync");
    }
    if (tensors.size() > kMaxTensors)
      throw Error(Errc::kInvalidArgument, "more than " + std::to_string(kMaxTensors) + " tensors in one sync");
    if (m.world == 1) {
      for (const TensorSpec& t : tensors)
        if (t.shard_dim != -1)
          throw Error(Errc::kInvalidArgument, "'" + t.name + "' is a shard, but this producer has one rank: create "
                                              "every rank with rank/world_size, or send the whole tensor");
    }
    const std::uint64_t need = manifest_size(tensors);
    if (need > m.view.geo().manifest_bytes)
      throw Error(Errc::kInvalidArgument, "the manifest of " + std::to_string(tensors.size()) + " tensors needs " +
                                              human_bytes(need) + " but the region holds " +
                                              human_bytes(m.view.geo().manifest_bytes) +
                                              ": create the producer with a larger manifest_bytes");
    if (std::uint64_t total; !payload_bytes(tensors, &total))
      throw Error(Errc::kInvalidArgument, "one sync may carry at most 64 TiB");
    m.specs.assign(tensors.begin(), tensors.end());
    m.stream_bytes = pack(m.specs, m.view.geo().slot_bytes, &m.offsets, &m.payload_bytes);
    if (m.stream_bytes > kMaxStreamBytes)  // with alignment padding: what consumers check
      throw Error(Errc::kInvalidArgument, "the sync's stream (tensors and alignment) exceeds 64 TiB");
    if (m.world > 1) {
      // This rank's list of pieces, in the one-rank manifest format.
      used = encode_manifest(m.specs, m.offsets, n, m.stream_bytes, m.payload_bytes, m.view.rank_list(m.rank),
                             m.view.geo().manifest_bytes);
      if (used == 0)
        throw Error(Errc::kInvalidArgument, "this rank's list of pieces does not fit in manifest_bytes");
    }
  } catch (const Error& e) {
    if (m.world > 1) m.drop_round(n, e.code(), e.what());
    throw;
  } catch (const std::exception& e) {
    if (m.world > 1) m.drop_round(n, Errc::kSystem, e.what());
    throw;
  }
  if (m.world > 1) return m.begin_sharded(n, used);
  if (m.view.geo().store) return m.begin_store(version);

  // Nobody may still be reading the manifest area we are about to rewrite.
  if (m.last_completed > 0) m.ring->wait_acks(m.last_completed);
  m.sync_start_ns = mono_ns();
  m.version = version != 0 ? version : m.version + 1;
  m.writer = ChunkWriter(&*m.ring, &m.view, m.version, m.next_seq, m.stream_bytes, m.checksums);
  m.ring->begin_announce();  // consumers copying the old manifest will see it change
  used = encode_manifest(m.specs, m.offsets, m.version, m.stream_bytes, m.payload_bytes, m.view.manifest(),
                         m.view.geo().manifest_bytes);
  RecordSnapshot rec{};
  rec.version = m.version;
  rec.first_seq = m.next_seq;
  rec.chunks = m.writer.chunks();
  rec.stream_bytes = m.stream_bytes;
  rec.manifest_used = used;
  rec.manifest_hash = XXH3_64bits(m.view.manifest(), used);
  m.view.header().error_code.store(0, std::memory_order_relaxed);
  m.view.header().error_text[0] = 0;
  m.layout = SyncLayout{m.version, rec.first_seq, rec.chunks, m.stream_bytes, m.payload_bytes, m.offsets};
  m.layout.rank_chunks = rec.chunks;
  m.sync_payload = m.payload_bytes;
  m.first_seq = rec.first_seq;
  m.rank_chunks = rec.chunks;
  m.ring->set_sync(m.version, rec.first_seq);
  m.ring->enroll(m.version, rec.first_seq);
  m.ring->announce(rec);
  m.in_sync = true;
  m.next_tensor = 0;
  m.part_done = 0;
  m.lent_chunks = false;
  return m.version;
}

// A store region: the sync is one chunk filling the bank that does not hold
// the version readers see; the record still announces that version until
// end_sync() has every byte of this one in place.
std::uint64_t Producer::Impl::begin_store(std::uint64_t want) {
  const std::uint64_t S = view.geo().slot_bytes;
  if (stream_bytes > S)
    throw Error(Errc::kInvalidArgument, "the sync needs " + human_bytes(stream_bytes) + " but the store region holds " +
                                            human_bytes(S) + " per version: create it with store_bytes >= " +
                                            std::to_string(stream_bytes) + " (store_bytes_needed)");
  const std::uint64_t v = want != 0 ? want : version + 1;
  const std::uint64_t seq = next_seq;
  writer = ChunkWriter(&*ring, &view, v, seq, stream_bytes, checksums, 0, 1, 1);
  version = v;
  in_sync = true;  // from here a failure aborts the sync (and keeps the bank for the next)
  try {
    // Waits for readers of the version two syncs back to let go of the
    // bank, then marks it being refilled; only then is its manifest rewritten.
    writer.claim_first();
    const std::uint64_t used = encode_manifest(specs, offsets, v, stream_bytes, payload_bytes, view.manifest_of(seq),
                                               view.geo().manifest_bytes);
    store_rec = RecordSnapshot{};
    store_rec.version = v;
    store_rec.first_seq = seq;
    store_rec.chunks = 1;
    store_rec.stream_bytes = stream_bytes;
    store_rec.manifest_used = used;
    store_rec.manifest_hash = XXH3_64bits(view.manifest_of(seq), used);
    // The bank describes its own version too (published with its seq), so
    // a reader can rebuild the record if this producer dies inside the
    // record flip (docs/protocol.md §11).
    SlotDesc& bank = view.slot(view.slot_of(seq));
    bank.manifest_used.store(used, std::memory_order_relaxed);
    bank.manifest_hash.store(store_rec.manifest_hash, std::memory_order_relaxed);
  } catch (const std::exception& e) {
    abort(e.what());
    throw;
  }
  sync_start_ns = mono_ns();
  layout = SyncLayout{v, seq, 1, stream_bytes, payload_bytes, offsets};
  layout.rank_chunks = 1;
  sync_payload = payload_bytes;
  first_seq = seq;
  rank_chunks = 1;
  next_tensor = 0;
  part_done = 0;
  lent = false;
  return v;
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
  const std::vector<SyncInfo> posts = gather(n, used);
  std::vector<TensorSpec> tensors;
  std::vector<ManifestPiece> pieces;
  std::vector<std::uint64_t> rank_bytes;
  std::uint64_t payload = 0;
  std::string why = merge_posts(posts, &tensors, &pieces, &rank_bytes, &payload);
  std::vector<std::byte> manifest;
  const std::uint64_t size = manifest_size(tensors, pieces.size(), world);
  if (why.empty() && size > view.geo().manifest_bytes)
    why = "the sync's manifest needs " + human_bytes(size) + " but the region holds " +
          human_bytes(view.geo().manifest_bytes) + ": create rank 0 with a larger manifest_bytes";
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
  std::memcpy(view.manifest(), manifest.data(), size);
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

void Producer::write(std::size_t index, const void* src) {
  impl_->write_tensor(index, Buffer{const_cast<void*>(src), false, {}}, nullptr);
}

void Producer::write_strided(std::size_t index, const void* src, const Strided2D& layout) {
  impl_->write_tensor(index, Buffer{const_cast<void*>(src), false, layout}, nullptr);
}

void Producer::write_part(std::size_t index, std::uint64_t offset, const void* src, std::uint64_t bytes) {
  impl_->write_tensor(index, Buffer{const_cast<void*>(src), false, {}}, nullptr, offset, bytes);
}

void Producer::write_device(std::size_t index, const void* src, void* stream) {
  write_device_strided(index, src, Strided2D{}, stream);
}

void Producer::write_device_strided(std::size_t index, const void* src, const Strided2D& layout, void* stream) {
  impl_->write_tensor(index, Buffer{const_cast<void*>(src), true, layout}, stream);
}

std::vector<std::span<std::byte>> Producer::fill_spans() {
  Impl& m = *impl_;
  m.require_open();
  if (!m.view.geo().store)
    throw Error(Errc::kInvalidArgument, "fill_spans() needs a store region: a ring region's slots hold only a "
                                        "part of the sync at a time; use write()");
  if (!m.in_sync) throw Error(Errc::kInvalidArgument, "fill_spans() outside a sync: call begin_sync() first");
  if (m.lent || m.next_tensor != 0 || m.part_done != 0)
    throw Error(Errc::kInvalidArgument, "fill_spans() after tensors of this sync were written or lent");
  std::byte* bank = m.view.slot_data(m.view.slot_of(m.first_seq));  // acquired by begin_sync()
  std::vector<std::span<std::byte>> out;
  out.reserve(m.specs.size());
  for (std::size_t i = 0; i < m.specs.size(); ++i) {
    const std::uint64_t n = m.specs[i].local_nbytes();
    out.emplace_back(n == 0 ? nullptr : bank + m.offsets[i], n);
  }
  m.lent = true;
  m.next_tensor = m.specs.size();  // end_sync() publishes them all
  return out;
}

std::span<std::byte> Producer::lend_chunk(std::uint64_t c) {
  Impl& m = *impl_;
  m.require_open();
  if (m.view.geo().store)
    throw Error(Errc::kInvalidArgument, "lend_chunk() needs a ring region: a store region lends its bank with "
                                        "fill_spans()");
  if (m.world > 1)
    throw Error(Errc::kInvalidArgument, "lend_chunk() is for a producer of one rank: sharded ranks write()");
  if (!m.in_sync) throw Error(Errc::kInvalidArgument, "lend_chunk() outside a sync: call begin_sync() first");
  if (!m.lent_chunks && (m.next_tensor != 0 || m.part_done != 0))
    throw Error(Errc::kInvalidArgument, "lend_chunk() after tensors of this sync were written: a sync is filled "
                                        "either by write() or by lend_chunk()");
  const std::uint64_t n = m.writer.chunks(), first = m.writer.published(), k = m.view.geo().slot_count;
  if (c >= n)
    throw Error(Errc::kInvalidArgument, "lend_chunk(" + std::to_string(c) + "): the sync has " + std::to_string(n) +
                                            " chunks");
  if (c < first)
    throw Error(Errc::kInvalidArgument, "lend_chunk(" + std::to_string(c) + "): that chunk is already published");
  if (c - first >= k)
    throw Error(Errc::kInvalidArgument, "lend_chunk(" + std::to_string(c) + "): at most slots() = " +
                                            std::to_string(k) + " chunks can be lent ahead of the first unpublished "
                                            "one (" + std::to_string(first) + "): publish_chunks() first");
  try {
    std::uint64_t room = 0;
    std::byte* p = m.writer.claim(c * m.view.geo().slot_bytes, &room);
    m.lent_chunks = true;
    m.next_tensor = m.specs.size();  // no write(); end_sync() publishes the rest
    return {p, room};
  } catch (const std::exception& e) {
    m.abort(e.what());
    throw;
  }
}

void Producer::publish_chunks(std::uint64_t end) {
  Impl& m = *impl_;
  m.require_open();
  if (!m.in_sync || !m.lent_chunks)
    throw Error(Errc::kInvalidArgument, "publish_chunks() with no chunk lent in this sync: call lend_chunk() first");
  const std::uint64_t n = m.writer.chunks();
  if (end > n)
    throw Error(Errc::kInvalidArgument, "publish_chunks(" + std::to_string(end) + "): the sync has " +
                                            std::to_string(n) + " chunks");
  if (end > m.writer.acquired())
    throw Error(Errc::kInvalidArgument, "publish_chunks(" + std::to_string(end) + "): chunk " +
                                            std::to_string(m.writer.acquired()) + " was never lent");
  try {
    m.complete_below(end == n ? m.stream_bytes : end * m.view.geo().slot_bytes);
  } catch (const std::exception& e) {
    m.abort(e.what());
    throw;
  }
}

void Producer::end_sync() {
  Impl& m = *impl_;
  m.require_open();
  if (!m.in_sync) throw Error(Errc::kInvalidArgument, "end_sync() without begin_sync()");
  if (m.next_tensor != m.specs.size())
    throw Error(Errc::kInvalidArgument, "end_sync() before every tensor was written: next is '" +
                                            m.specs[m.next_tensor].name + "' (index " +
                                            std::to_string(m.next_tensor) + ")");
  try {
    m.complete_below(m.stream_bytes);
    m.engine->drain();
    if (m.world > 1) {
      m.ring->check_aborted();
      // A rank's sync is done only when every rank's is: rank 0 waits for
      // the others' chunks, the others for rank 0 to say so.
      if (m.leader()) {
        m.await_ranks();
        // Every rank's chunks are in; each must be from the process whose
        // list rank 0 took (a process that took a seat since may have
        // written chunks laid out by its own pieces).
        for (std::uint32_t k = 1; k < m.world; ++k)
          if (!rounds::still_taken(m.view.rank_seat(k), m.version))
            throw Error(Errc::kPeerDied, "producer rank " + std::to_string(k) + " left sync " +
                                             std::to_string(m.version) + " before it was complete (it was restarted, "
                                             "or it gave up): restart the trainer's ranks together");
        m.hit(TestPoint::kBeforeComplete, m.version);
        switch (rounds::complete_round(m.words(), m.version)) {
          case rounds::Decision::kWon:
            break;
          case rounds::Decision::kCorrupt:
            throw Error(Errc::kCorrupt, "the region's round_done names neither fate of sync " +
                                            std::to_string(m.version) + ": the region is corrupt; recreate it");
          default:
            throw Error(Errc::kAborted, "sync " + std::to_string(m.version) + " was abandoned by another rank: " +
                                            m.abandon_reason(m.version));
        }
        m.hit(TestPoint::kAfterComplete, m.version);
      } else {
        m.await_done();
      }
    }
  } catch (const Error& e) {
    m.abort(e.what(), e.code());
    throw;
  } catch (const std::exception& e) {
    m.abort(e.what());
    throw;
  }
  m.next_seq = m.writer.next_seq();
  m.in_sync = false;
  m.last_completed = m.version;
  m.ring->clear_sync();
  if (m.world > 1 && m.leader()) detail::ring(m.view.header().rank_reply);  // complete: the others return
  // A store region: every byte is in place (the chunk is published), so the
  // record may now point readers at it.
  if (m.view.geo().store) m.ring->announce(m.store_rec);
  if (!m.leader()) {
    RankSeat& rs = m.view.rank_seat(m.rank);
    rs.syncs_done.fetch_add(1, std::memory_order_relaxed);
    rs.bytes_done.fetch_add(m.payload_bytes, std::memory_order_relaxed);
    return;
  }
  Header& h = m.view.header();
  h.syncs_done.fetch_add(1, std::memory_order_relaxed);
  h.bytes_done.fetch_add(m.sync_payload, std::memory_order_relaxed);
  h.last_sync_ns.store(static_cast<std::uint64_t>(mono_ns() - m.sync_start_ns), std::memory_order_relaxed);
  h.last_end_unix_ns.store(static_cast<std::uint64_t>(unix_ns()), std::memory_order_relaxed);
}

void Producer::abort_sync(std::string_view why) {
  impl_->require_open();
  impl_->abort(why);
}

std::uint64_t Producer::send(std::span<const TensorSpec> tensors, std::span<const void* const> srcs) {
  return send(tensors, srcs, 0);
}

std::uint64_t Producer::send(std::span<const TensorSpec> tensors, std::span<const void* const> srcs,
                             std::uint64_t version) {
  if (srcs.size() != tensors.size()) {
    const std::string why = "send(): " + std::to_string(tensors.size()) + " tensors but " +
                            std::to_string(srcs.size()) + " sources";
    skip_sync(why, version);  // a sharded rank still takes its round: the ranks stay in step
    throw Error(Errc::kInvalidArgument, why);
  }
  const std::uint64_t v = begin_sync(tensors, version);
  try {
    for (std::size_t i = 0; i < tensors.size(); ++i) write(i, srcs[i]);
    end_sync();
  } catch (const Error& e) {
    impl_->abort(e.what(), e.code());
    throw;
  }
  return v;
}

void Producer::skip_sync(std::string_view why, std::uint64_t version) {
  Impl& m = *impl_;
  m.require_open();
  if (m.in_sync) throw Error(Errc::kInvalidArgument, "skip_sync() during a sync: abort_sync() it instead");
  if (m.world == 1) return;  // one producer: no other rank to keep in step
  std::uint64_t n = 0;
  if (const std::string bad = rounds::next_round(m.round, version, &n); !bad.empty())
    throw Error(Errc::kInvalidArgument, "skip_sync(): " + bad);
  m.drop_round(n, Errc::kAborted, std::string(why));
}

std::uint64_t Producer::last_round() const { return impl_->round; }

void Producer::wait_drained(Duration timeout) {
  impl_->require_open();
  if (impl_->in_sync) throw Error(Errc::kInvalidArgument, "wait_drained() during a sync");
  if (impl_->view.geo().store) return;  // readers hold a version, never the stream
  impl_->ring->wait_released(impl_->next_seq - 1, mono_ns() + timeout.count());
}

std::vector<std::string> Producer::take_events() { return impl_->ring ? impl_->ring->take_events() : std::vector<std::string>{}; }
const std::string& Producer::name() const { return impl_->name; }
const std::string& Producer::path() const { return impl_->path; }
std::uint64_t Producer::region_bytes() const { return impl_->view.geo().total_bytes; }
std::uint64_t Producer::slot_bytes() const { return impl_->view.geo().slot_bytes; }
std::uint32_t Producer::slots() const { return impl_->view.geo().slot_count; }
std::uint64_t Producer::last_version() const { return impl_->version; }
RegionMode Producer::mode() const { return impl_->view.geo().store ? RegionMode::kStore : RegionMode::kRing; }
const SyncLayout& Producer::last_layout() const { return impl_->layout; }
bool Producer::pinned() const { return impl_->pin.pinned; }
CopyEngine Producer::engine() const { return impl_->engine->is_cuda() ? CopyEngine::kCuda : CopyEngine::kHost; }
double Producer::pin_seconds() const { return impl_->pin.seconds; }
double Producer::create_seconds() const { return impl_->create_s; }
void Producer::close() {
  if (impl_) impl_->close_quietly();
}

}  // namespace shmcast
