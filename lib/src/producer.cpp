// Layer 6: the public Producer.
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cstring>
#include <optional>
#include <thread>
#include <unordered_set>

#include "checks.hpp"
#include "doorbell.hpp"
#include "engine.hpp"
#include "liveness.hpp"
#include "manifest.hpp"
#include "region.hpp"
#include "ring.hpp"
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
  std::uint64_t round = 0;       // syncs begun (rank 0 answers each round)
  std::uint64_t rank_chunks = 0; // chunks per rank of the sync in progress
  std::uint64_t first_seq = 0;   // of the sync in progress
  bool leader() const { return rank == 0; }
  std::uint64_t begin_sharded();
  std::uint64_t begin_store(std::uint64_t version);
  RecordSnapshot store_rec{};  // store regions: the record end_sync() announces

  // the sync in progress
  bool in_sync = false;
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

  // ---- sharded producers: the round in which rank 0 merges the ranks' posts

  // Rank 0 gives up on round `r`: every rank's begin_sync() throws `code`.
  void fail_round(std::uint64_t r, Errc code, const std::string& why) {
    for (std::uint32_t k = 1; k < world; ++k) {
      RankSeat& rs = view.rank_seat(k);
      write_error_text(rs.error_text, why);
      rs.reply_status.store(static_cast<std::uint32_t>(code), std::memory_order_relaxed);
      rs.reply_round.store(r, std::memory_order_release);
    }
    view.header().round.store(r, std::memory_order_release);
    detail::ring(view.header().rank_reply);
  }

  // A sharded begin_sync() that fails on this rank before it posts its list
  // (an invalid spec, a manifest too large) still takes its round and fails
  // it for every rank: rank 0 answers the round with the error; a rank posts
  // an empty list (posted_bytes 0) with the reason, which fails the round at
  // rank 0 at once. Otherwise this rank's round count would fall behind the
  // others' and every later round would wait for a round nobody posts.
  void drop_round(const Error& e) noexcept {
    const std::uint64_t r = ++round;
    const std::string why = "producer rank " + std::to_string(rank) + " could not begin sync round " +
                            std::to_string(r) + ": " + e.what();
    if (leader()) {
      fail_round(r, e.code(), why);
      return;
    }
    RankSeat& rs = view.rank_seat(rank);
    write_error_text(rs.error_text, why);
    rs.error_code.store(static_cast<std::uint32_t>(e.code()), std::memory_order_relaxed);
    rs.posted_bytes.store(0, std::memory_order_relaxed);
    rs.posted_hash.store(0, std::memory_order_relaxed);
    rs.posted_round.store(r, std::memory_order_release);
    detail::ring(view.header().rank_post);
  }

  // Writes this rank's list of pieces for round `r` into its list area.
  void post(std::uint64_t r, std::uint64_t used) {
    RankSeat& rs = view.rank_seat(rank);
    rs.posted_bytes.store(used, std::memory_order_relaxed);
    rs.posted_hash.store(XXH3_64bits(view.rank_list(rank), used), std::memory_order_relaxed);
    rs.posted_round.store(r, std::memory_order_release);
    detail::ring(view.header().rank_post);
  }

  // Rank 0: waits for every rank's post of round `r` and decodes them.
  std::vector<SyncInfo> gather(std::uint64_t r) {
    Header& h = view.header();
    const std::int64_t deadline = mono_ns() + opts.rank_timeout.count();
    auto missing = [&]() -> int {
      for (std::uint32_t k = 1; k < world; ++k)
        if (view.rank_seat(k).posted_round.load(std::memory_order_acquire) != r) return static_cast<int>(k);
      return -1;
    };
    for (;;) {
      const WaitResult w = wait_until(h.rank_post, [&] { return missing() < 0; }, deadline, kLivenessPollNs);
      const int k = missing();
      if (k < 0) break;
      const auto kr = static_cast<std::uint32_t>(k);
      const bool attached = seat_state(view.rank_seat(kr).word.load(std::memory_order_acquire)) == kSeatActive;
      if (attached && rank_dead(view, kr)) {
        const std::string why = rank_who(view, kr) + " died before beginning sync round " + std::to_string(r);
        fail_round(r, Errc::kPeerDied, why);
        throw Error(Errc::kPeerDied, why + ": restart the trainer's ranks together");
      }
      if (w == WaitResult::kTimeout || mono_ns() >= deadline) {
        const std::string why = "producer rank " + std::to_string(k) +
                                (attached ? " is attached but did not begin the sync"
                                          : " never attached to the region") +
                                " within rank_timeout (" + std::to_string(opts.rank_timeout.count() / 1000000) + " ms)";
        fail_round(r, Errc::kTimeout, why);
        throw Error(Errc::kTimeout, why + ": every rank must call begin_sync()/send() for every sync");
      }
    }
    std::vector<SyncInfo> posts(world);
    std::vector<std::byte> bytes;
    for (std::uint32_t k = 0; k < world; ++k) {
      RankSeat& rs = view.rank_seat(k);
      const std::uint64_t used = rs.posted_bytes.load(std::memory_order_relaxed);
      std::string why;
      if (used == 0 && k != 0) {  // the rank's begin_sync() failed before it posted (drop_round)
        why = read_error_text(rs.error_text);
        fail_round(r, Errc::kInvalidArgument, why);
        throw Error(Errc::kInvalidArgument, why);
      }
      if (used < sizeof(ManifestHeader) || used > view.geo().manifest_bytes) {
        why = "posted a list of bad size";
      } else {
        bytes.resize(used);
        std::memcpy(bytes.data(), view.rank_list(k), used);
        ManifestHeader mh;
        std::memcpy(&mh, bytes.data(), sizeof mh);
        if (XXH3_64bits(bytes.data(), used) != rs.posted_hash.load(std::memory_order_relaxed))
          why = "posted a list that does not match its hash";
        else
          why = decode_manifest(bytes, r, mh.stream_bytes, view.geo().slot_bytes, &posts[k], true,
                                ManifestCheck::kRankPost);
      }
      if (!why.empty()) {
        why = "the list of pieces of producer rank " + std::to_string(k) + " is invalid: " + why;
        fail_round(r, Errc::kCorrupt, why);
        throw Error(Errc::kCorrupt, why);
      }
    }
    return posts;
  }

  // Ranks 1..: waits for rank 0's answer to round `r`.
  void await_reply(std::uint64_t r) {
    Header& h = view.header();
    RankSeat& rs = view.rank_seat(rank);
    const std::int64_t deadline = mono_ns() + opts.rank_timeout.count();
    for (;;) {
      auto ready = [&] { return rs.reply_round.load(std::memory_order_acquire) >= r; };
      const WaitResult w = wait_until(h.rank_reply, ready, deadline, kLivenessPollNs);
      if (ready()) break;
      if (h.init_state.load(std::memory_order_acquire) == kInitClosed)
        throw Error(Errc::kClosed, "producer rank 0 closed the region");
      if (rank_dead(view, 0))
        throw Error(Errc::kPeerDied, rank_who(view, 0) + " died: restart the trainer's ranks together");
      if (w == WaitResult::kTimeout || mono_ns() >= deadline)
        throw Error(Errc::kTimeout, "producer rank 0 did not begin sync round " + std::to_string(r) +
                                        " within rank_timeout: every rank must call begin_sync()/send() for every sync");
    }
    if (rs.reply_round.load(std::memory_order_acquire) != r)
      throw Error(Errc::kCorrupt, "rank 0 answered another round than this rank's: the ranks are out of step");
    if (const std::uint32_t st = rs.reply_status.load(std::memory_order_relaxed); st != 0)
      throw Error(static_cast<Errc>(st), read_error_text(rs.error_text));
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

  void abort(std::string_view why) {
    if (!in_sync) return;
    set_error_text(Errc::kAborted, std::string(why));
    try {
      engine->drain();
    } catch (...) {
    }
    ring->abort(version);
    // A store region announced nothing: the next sync refills the same bank
    // (the other one holds the version readers see).
    if (!view.geo().store) next_seq = writer.next_seq();
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

namespace {

// A region of this name exists. Takes it over when its producer is proven
// dead (its lock byte is free and we now hold it, so no one can revive it),
// by removing the name; throws kExists or kPermission when it is alive, not
// ours, or its liveness cannot be told. Returns false when the name vanished.
bool take_over_stale(const std::string& dir, std::string_view name, bool replace_stale, bool group_access) {
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
  const int rc = lock_byte(old.fd(), kProducerLockByte);
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
  if (!old.unlink_if_same() && old.still_at_path())
    throw Error(Errc::kPermission, "cannot replace stale region " + old.path() + ": " + std::strerror(errno), errno);
  return true;
}

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

// Rank r >= 1 of a sharded producer: attaches to the region rank 0 created.
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
          if (peer_alive(f.fd(), kProducerLockByte, live.producer) != Alive::kNo) {
            m->checksums = (snap.features & kFeatureChecksums) != 0;
            m->path = f.path();
            m->view = RegionView(std::move(f), g);
            break;
          }
          waiting = "a live rank 0 (the region's rank 0 is dead)";
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
  const int rc = lock_byte(m->view.fd(), rank_lock_byte(o.rank));
  if (rc == -EAGAIN)
    throw Error(Errc::kExists, "producer rank " + std::to_string(o.rank) + " of region '" + std::string(name) +
                                   "' is already attached by a live process: give each rank its own rank number");
  if (rc != 0) throw Error(Errc::kSystem, std::string("cannot lock the rank's byte: ") + std::strerror(-rc), -rc);
  RankSeat& rs = m->view.rank_seat(o.rank);
  const std::uint64_t old = rs.word.load(std::memory_order_acquire);
  rs.published_seq.store(0, std::memory_order_relaxed);
  rs.error_code.store(0, std::memory_order_relaxed);
  rs.attach_unix_ns.store(static_cast<std::uint64_t>(unix_ns()), std::memory_order_relaxed);
  write_identity(rs.who, self_identity());
  // Join at the next round rank 0 has not answered yet.
  m->round = m->view.header().round.load(std::memory_order_acquire);
  rs.posted_round.store(m->round, std::memory_order_relaxed);
  rs.reply_round.store(m->round, std::memory_order_relaxed);
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
        take_over_stale(dir, name, o.replace_stale, o.group_access);
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
  if (version != 0 && m.world > 1)
    throw Error(Errc::kInvalidArgument, "begin_sync() with a version on a sharded producer: rank 0 numbers the syncs");
  if (version != 0 && version <= m.version)
    throw Error(Errc::kInvalidArgument, "begin_sync() version " + std::to_string(version) +
                                            " is not greater than the last, " + std::to_string(m.version));
  // Sharded: a refusal here still takes the round (drop_round), so the ranks stay in step.
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
  } catch (const Error& e) {
    if (m.world > 1) m.drop_round(e);
    throw;
  }
  if (m.world > 1) return m.begin_sharded();
  if (m.view.geo().store) return m.begin_store(version);

  // Nobody may still be reading the manifest area we are about to rewrite.
  if (m.last_completed > 0) m.ring->wait_acks(m.last_completed);
  m.sync_start_ns = mono_ns();
  m.version = version != 0 ? version : m.version + 1;
  m.writer = ChunkWriter(&*m.ring, &m.view, m.version, m.next_seq, m.stream_bytes, m.checksums);
  m.ring->begin_announce();  // consumers copying the old manifest will see it change
  const std::uint64_t used = encode_manifest(m.specs, m.offsets, m.version, m.stream_bytes, m.payload_bytes,
                                             m.view.manifest(), m.view.geo().manifest_bytes);
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

std::uint64_t Producer::Impl::begin_sharded() {
  const std::uint64_t r = round + 1;
  const std::uint64_t S = view.geo().slot_bytes;
  // This rank's list of pieces, in the one-rank manifest format.
  const std::uint64_t used = encode_manifest(specs, offsets, r, stream_bytes, payload_bytes, view.rank_list(rank),
                                             view.geo().manifest_bytes);
  if (used == 0) {
    const Error e(Errc::kInvalidArgument, "this rank's list of pieces does not fit in manifest_bytes");
    drop_round(e);
    throw e;
  }
  round = r;
  post(r, used);
  std::uint64_t first = 0, chunks_per_rank = 0;
  if (!leader()) {
    await_reply(r);
    const RankSeat& rs = view.rank_seat(rank);
    version = rs.reply_version.load(std::memory_order_relaxed);
    first = rs.reply_first_seq.load(std::memory_order_relaxed);
    chunks_per_rank = rs.reply_rank_chunks.load(std::memory_order_relaxed);
    // What rank 0 gave must fit this rank's own pieces.
    if (first == 0 || chunk_count(stream_bytes, S) > chunks_per_rank || chunks_per_rank > (1ull << 40))
      throw Error(Errc::kCorrupt, "rank 0's answer does not fit this rank's pieces: the region is corrupt");
  } else {
    const std::vector<SyncInfo> posts = gather(r);
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
      encode_manifest(tensors, pieces, rank_bytes, version + 1, payload, manifest.data(), size);
      // The same checks every consumer makes: the pieces tile each tensor.
      why = decode_manifest(manifest, version + 1, total, S, &check);
    }
    if (!why.empty()) {
      fail_round(r, Errc::kInvalidArgument, "the ranks' pieces do not make one sync: " + why);
      throw Error(Errc::kInvalidArgument, "the ranks' pieces do not make one sync: " + why);
    }
    for (std::uint64_t b : rank_bytes) chunks_per_rank = std::max(chunks_per_rank, chunk_count(b, S));
    sync_payload = payload;
    if (last_completed > 0) {
      try {
        ring->wait_acks(last_completed);
      } catch (const Error& e) {
        fail_round(r, e.code(), e.what());
        throw;
      }
    }
    version = version + 1;
    first = next_seq;
    ring->begin_announce();
    std::memcpy(view.manifest(), manifest.data(), size);
    RecordSnapshot rec{};
    rec.version = version;
    rec.first_seq = first;
    rec.chunks = chunks_per_rank * world;
    rec.stream_bytes = total;
    rec.manifest_used = size;
    rec.manifest_hash = XXH3_64bits(manifest.data(), size);
    view.header().error_code.store(0, std::memory_order_relaxed);
    view.header().error_text[0] = 0;
    ring->set_sync(version, first);
    ring->enroll(version, first);
    ring->announce(rec);
    for (std::uint32_t k = 1; k < world; ++k) {
      RankSeat& rs = view.rank_seat(k);
      rs.reply_status.store(0, std::memory_order_relaxed);
      rs.reply_version.store(version, std::memory_order_relaxed);
      rs.reply_first_seq.store(first, std::memory_order_relaxed);
      rs.reply_rank_chunks.store(chunks_per_rank, std::memory_order_relaxed);
      rs.error_text[0] = 0;
      rs.reply_round.store(r, std::memory_order_release);
    }
    view.header().round.store(r, std::memory_order_release);
    detail::ring(view.header().rank_reply);
  }
  sync_start_ns = mono_ns();
  first_seq = first;
  rank_chunks = chunks_per_rank;
  ring->set_sync(version, first);
  writer = ChunkWriter(&*ring, &view, version, first, stream_bytes, checksums, rank, world, chunks_per_rank);
  layout = SyncLayout{version, first, chunks_per_rank * world, stream_bytes, payload_bytes, offsets};
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
      if (m.leader()) m.await_ranks();
    }
  } catch (const std::exception& e) {
    m.abort(e.what());
    throw;
  }
  m.next_seq = m.writer.next_seq();
  m.in_sync = false;
  m.last_completed = m.version;
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
  if (srcs.size() != tensors.size())
    throw Error(Errc::kInvalidArgument, "send(): " + std::to_string(tensors.size()) + " tensors but " +
                                            std::to_string(srcs.size()) + " sources");
  const std::uint64_t v = begin_sync(tensors);
  try {
    for (std::size_t i = 0; i < tensors.size(); ++i) write(i, srcs[i]);
    end_sync();
  } catch (const Error& e) {
    impl_->abort(e.what());
    throw;
  }
  return v;
}

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
