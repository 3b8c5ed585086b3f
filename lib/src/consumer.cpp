// Layer 6: the public Consumer.
#include <xxhash.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <optional>
#include <thread>

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

enum class State { kIdle, kManifest, kReading };

// A private copy of the immutable part of the header, taken once.
HeaderFixed snapshot_header(const std::byte* base) {
  HeaderFixed h;
  std::memcpy(&h, base, sizeof h);
  return h;
}

}  // namespace

struct Consumer::Impl {
  std::string name;
  ConsumerOptions opts;
  RegionView view;
  std::optional<ConsumerRing> ring;
  std::unique_ptr<ConsumerEngine> host_engine, cuda_engine;
  PinInfo pin;
  double open_s = 0;
  bool checksums = false;

  State state = State::kIdle;
  SyncInfo info;
  std::uint64_t last_version = 0;
  std::uint64_t next_chunk = 0;  // chunks of this sync already released

  ~Impl() { close_quietly(); }

  void require_open() const {
    if (view.file().inherited()) throw_inherited("Consumer", view.file());
    if (!view.mapped() || !ring) throw Error(Errc::kClosed, "this consumer is closed");
  }

  void close_quietly() noexcept {
    if (view.file().inherited()) {
      // A forked child's copy: the seat and the engines are the parent's.
      (void)cuda_engine.release();
      (void)host_engine.release();
      ring.reset();  // no side effects: leave() is never called here
      view.file().unmap();
      return;
    }
    if (!view.mapped()) return;
    try {
      if (cuda_engine) cuda_engine->drain();
    } catch (...) {
    }
    cuda_engine.reset();
    if (ring) ring->leave();
    ring.reset();
    if (pin.pinned) cuda_unpin(view.file().data(), view.file().size());
    pin.pinned = false;
    view.file().unmap();
  }

  // Releases every chunk of the current sync that has not been released.
  void release_rest() {
    if (state == State::kIdle) return;
    if (info.chunks > 0) ring->release(info.first_seq + info.chunks - 1);
    state = State::kIdle;
  }

  // Runs `per_range(data, start, bytes)` over the sync's bytes in stream
  // order (data points at stream byte `start`), chunk by chunk, then hands
  // each chunk's release to `engine`. With `follow`, a chunk is handed over
  // in several ranges as the producer fills it (host copies without
  // checksums), so the consumer copies bytes while they are still in the
  // CPU cache.
  template <class F>
  void for_each_chunk(ConsumerEngine& engine, F&& per_range, bool follow = false) {
    require_open();
    if (state != State::kManifest) throw Error(Errc::kInvalidArgument, "no sync to read: call wait_sync() first");
    state = State::kReading;
    ChunkReader reader(&*ring, &view, info.version, info.first_seq, info.chunks, info.stream_bytes, follow,
                       checksums && opts.verify_checksums, opts.chunk_timeout.count());
    // Set from the engine's completion thread (CUDA callbacks).
    std::atomic<bool> broken{false};
    try {
      ChunkReader::Range r;
      while (reader.next(&r)) {
        if (r.bytes > 0) per_range(r.data, r.start, r.bytes);
        if (!r.last) continue;
        engine.chunk_done(reader.releaser(r, &broken));
        if (broken.load(std::memory_order_relaxed)) break;
      }
      engine.drain();
    } catch (const Error& e) {
      try {
        engine.drain();
      } catch (...) {
      }
      ring->set_error(e.code(), e.what());
      release_rest();
      throw;
    }
    if (broken.load()) {
      release_rest();
      ring->check_seat();
      throw Error(Errc::kCorrupt, "a slot was overwritten while this consumer read it; the sync is incomplete");
    }
    state = State::kIdle;
    Seat& s = view.seat(static_cast<std::uint32_t>(ring->seat()));
    s.syncs_done.fetch_add(1, std::memory_order_relaxed);
    s.bytes_done.fetch_add(info.payload_bytes, std::memory_order_relaxed);
  }

  // Calls fn(tensor index, offset in tensor, src, bytes) for the pieces of
  // chunk [start, start + bytes).
  template <class F>
  void pieces(std::size_t* cursor, std::uint64_t start, std::uint64_t bytes, const std::byte* data, F&& fn) {
    const auto& ts = info.tensors;
    std::size_t& t = *cursor;
    const std::uint64_t end = start + bytes;
    while (t < ts.size() && ts[t].stream_offset + ts[t].nbytes <= start) ++t;
    for (std::size_t j = t; j < ts.size() && ts[j].stream_offset < end; ++j) {
      const TensorInfo& ti = ts[j];
      if (ti.nbytes == 0) continue;
      const std::uint64_t a = ti.stream_offset > start ? ti.stream_offset : start;
      const std::uint64_t b = ti.stream_offset + ti.nbytes < end ? ti.stream_offset + ti.nbytes : end;
      if (a >= b) continue;
      fn(j, a - ti.stream_offset, data + (a - start), b - a);
    }
  }

  void check_dsts(std::size_t n) const {
    if (n != info.tensors.size())
      throw Error(Errc::kInvalidArgument, "got " + std::to_string(n) + " destinations for a sync of " +
                                              std::to_string(info.tensors.size()) + " tensors (pass nullptr to skip one)");
  }
};

Consumer::Consumer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Consumer::Consumer(Consumer&&) noexcept = default;
Consumer& Consumer::operator=(Consumer&&) noexcept = default;
Consumer::~Consumer() = default;

Consumer Consumer::open(std::string_view name, const ConsumerOptions& o) {
  const std::int64_t t0 = mono_ns();
  std::string why = validate_name(name);
  if (!why.empty()) throw Error(Errc::kBadName, why + ": '" + std::string(name) + "'");
  const std::string dir = region_dir();
  const std::int64_t deadline = t0 + o.open_timeout.count();
  auto impl = std::make_unique<Impl>();
  impl->name = std::string(name);
  impl->opts = o;
  const TrustPolicy trust{o.group_access, o.trusted_uids};
  std::string waiting_for = "the region to appear";
  Errc waiting_code = Errc::kNotFound;
  for (;;) {
    try {
      MappedFile f = MappedFile::open(dir, name, true);
      // Another user's region is never read: its owner could hand us any
      // tensors, or cut the file under us.
      if (std::string distrust = trust_problem(f, trust); !distrust.empty())
        throw Error(Errc::kPermission, distrust);
      if (f.size() >= kHeaderBytes) {
        const Header& live = *reinterpret_cast<const Header*>(f.data());
        // init_state first (acquire), then the snapshot: when init_state
        // reads kInitReady the snapshot holds the producer's whole geometry.
        const std::uint32_t init = live.init_state.load(std::memory_order_acquire);
        const HeaderFixed snap = snapshot_header(f.data());
        // A creator that has allocated the file but not yet written its
        // header leaves it all zero: that is "being created", not corrupt.
        if ((snap.magic == kMagic || snap.magic == 0) && init == kInitCreating) {
          waiting_for = "the producer to finish creating the region";
          waiting_code = Errc::kNotFound;
        } else {
          bool version_mismatch = false;
          why = validate_header(snap, f.size(), &version_mismatch);
          if (version_mismatch) throw Error(Errc::kVersionMismatch, f.path() + ": " + why + "; upgrade the older side");
          if (!why.empty()) throw Error(Errc::kCorrupt, f.path() + ": " + why);
          const Alive a = peer_alive(f.fd(), kProducerLockByte, live.producer);
          if (init == kInitReady && a != Alive::kNo) {
            Geometry g{};
            compute_geometry(snap.max_consumers, snap.slot_count, snap.slot_bytes, snap.manifest_bytes, &g);
            impl->checksums = (snap.features & kFeatureChecksums) != 0;
            impl->view = RegionView(std::move(f), g);
            break;
          }
          waiting_for = init == kInitClosed ? "a new producer (the region is closed)"
                                            : "a new producer (the region's producer is dead)";
          waiting_code = init == kInitClosed ? Errc::kClosed : Errc::kPeerDied;
        }
      } else {
        // The creator takes the producer lock as soon as the file exists,
        // then sets the whole size at once (posix_fallocate): size 0 is a
        // region being created, a short non-empty file was cut. (The size
        // seen at open may predate the allocation: re-read it.)
        const bool held = lock_held(f.fd(), kProducerLockByte) == Alive::kYes;
        const std::uint64_t size_now = f.size_now();
        if (size_now >= kHeaderBytes) {
          waiting_for = "the producer to allocate the region";  // it just did: look again
          waiting_code = Errc::kNotFound;
        } else if (size_now > 0) {
          const std::string cut = f.path() + " has " + std::to_string(size_now) +
                                  " bytes, less than a region header (truncated?)";
          if (held) throw Error(Errc::kCorrupt, cut + " while its producer is alive");
          waiting_for = "the producer to allocate the region (" + cut + ")";
          waiting_code = Errc::kCorrupt;
        } else {
          waiting_for = "the producer to allocate the region";
          waiting_code = Errc::kNotFound;
        }
      }
    } catch (const Error& e) {
      if (e.code() != Errc::kNotFound) throw;
    }
    if (mono_ns() >= deadline)
      throw Error(waiting_code, "gave up waiting for " + waiting_for + " at " + region_path(name) +
                                    ": is the producer running, with the same SHMCAST_DIR?");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  impl->ring.emplace(&impl->view);
  impl->ring->claim();
  impl->host_engine = make_host_consumer_engine();
  if (o.pin != Pin::kNo) {
    impl->pin = cuda_pin(impl->view.file().data(), impl->view.file().size());
    if (!impl->pin.pinned && o.pin == Pin::kYes)
      throw Error(Errc::kCudaUnavailable, "cannot pin region '" + impl->name + "': " + impl->pin.why);
  }
  impl->open_s = static_cast<double>(mono_ns() - t0) * 1e-9;
  return Consumer(std::move(impl));
}

const SyncInfo& Consumer::wait_sync(Duration timeout) {
  Impl& m = *impl_;
  m.require_open();
  if (m.state != State::kIdle) m.release_rest();  // the previous sync was not read: skip it
  const std::int64_t deadline = mono_ns() + timeout.count();
  const Geometry& g = m.view.geo();
  RecordSnapshot rec{};
  auto corrupt = [&](const std::string& why) {
    m.ring->set_error(Errc::kCorrupt, why);
    return Error(Errc::kCorrupt, "sync " + std::to_string(rec.version) + " of '" + m.name + "': " + why);
  };
  std::vector<std::byte> bytes;
  for (;;) {
    rec = m.ring->wait_announce(m.last_version, deadline);
    // Refuse a file cut since it was mapped before touching the manifest or
    // slots (its missing pages would raise SIGBUS): docs/reliability.md.
    if (const std::uint64_t now = m.view.file().size_now(); now != g.total_bytes)
      throw Error(Errc::kCorrupt, "region file " + m.view.file().path() + " is " + std::to_string(now) +
                                      " bytes, not " + std::to_string(g.total_bytes) +
                                      ": another process truncated or resized it; open the region again");
    if (rec.manifest_used < sizeof(ManifestHeader) || rec.manifest_used > g.manifest_bytes)
      throw corrupt("manifest size " + std::to_string(rec.manifest_used) + " is out of bounds");
    if (rec.first_seq == 0 || rec.first_seq > (1ull << 62) ||
        rec.chunks != chunk_count(rec.stream_bytes, g.slot_bytes) || rec.stream_bytes > kMaxStreamBytes)
      throw corrupt("sync record is inconsistent (first chunk, chunk count, stream size)");
    bytes.resize(rec.manifest_used);
    std::memcpy(bytes.data(), m.view.manifest(), bytes.size());
    // The manifest is covered by the record's seqlock: a producer that
    // aborted this sync and began the next may have rewritten it while we
    // copied. Then the copy is not corrupt, just stale: look again.
    if (!m.ring->record_unchanged(rec)) {
      if (mono_ns() >= deadline)
        throw Error(Errc::kTimeout, "the producer kept rewriting the manifest (syncs begun and aborted) until the "
                                    "timeout: no sync could be read");
      continue;
    }
    if (XXH3_64bits(bytes.data(), bytes.size()) != rec.manifest_hash) {
      m.ring->check_seat();
      throw corrupt("manifest bytes do not match their hash");
    }
    break;
  }
  SyncInfo info;
  const std::string why = decode_manifest(bytes, rec.version, rec.stream_bytes, g.slot_bytes, &info);
  if (!why.empty()) throw corrupt(why);
  info.first_seq = rec.first_seq;
  info.chunks = rec.chunks;
  m.info = std::move(info);
  m.ring->ack(rec.version);
  // Chunks before this sync are not ours to read (earlier or aborted syncs).
  if (rec.first_seq > 1) m.ring->release(rec.first_seq - 1);
  m.last_version = rec.version;
  m.state = State::kManifest;
  return m.info;
}

void Consumer::read_into(std::span<void* const> dsts) {
  Impl& m = *impl_;
  m.require_open();
  m.check_dsts(dsts.size());
  std::size_t cursor = 0;
  ConsumerEngine& e = *m.host_engine;
  const bool follow = !(m.checksums && m.opts.verify_checksums);  // a checksum needs the whole chunk first
  m.for_each_chunk(
      e,
      [&](const std::byte* data, std::uint64_t start, std::uint64_t bytes) {
        m.pieces(&cursor, start, bytes, data,
                 [&](std::size_t j, std::uint64_t off, const std::byte* src, std::uint64_t n) {
                   if (dsts[j]) e.copy(Buffer{dsts[j], false, {}}, off, src, n);
                 });
      },
      follow);
}

void Consumer::visit(const std::function<void(const Piece&)>& fn) {
  Impl& m = *impl_;
  m.require_open();
  if (m.state == State::kManifest) {
    for (std::size_t j = 0; j < m.info.tensors.size(); ++j)
      if (m.info.tensors[j].nbytes == 0) fn(Piece{j, 0, nullptr, 0, 0, false});
  }
  std::size_t cursor = 0;
  std::vector<Piece> chunk;
  m.for_each_chunk(*m.host_engine, [&](const std::byte* data, std::uint64_t start, std::uint64_t bytes) {
    chunk.clear();
    m.pieces(&cursor, start, bytes, data, [&](std::size_t j, std::uint64_t off, const std::byte* src, std::uint64_t n) {
      chunk.push_back(Piece{j, off, src, n, m.info.tensors[j].nbytes});
    });
    if (!chunk.empty()) chunk.back().chunk_end = true;
    for (const Piece& p : chunk) fn(p);
  });
}

void Consumer::skip() {
  impl_->require_open();
  impl_->release_rest();
}

void Consumer::read_into_device(std::span<void* const> dsts, void* stream) {
  Impl& m = *impl_;
  m.require_open();
  m.check_dsts(dsts.size());
  if (!m.cuda_engine) m.cuda_engine = make_cuda_consumer_engine();
  ConsumerEngine& e = *m.cuda_engine;
  e.begin(stream);
  std::size_t cursor = 0;
  m.for_each_chunk(e, [&](const std::byte* data, std::uint64_t start, std::uint64_t bytes) {
    m.pieces(&cursor, start, bytes, data, [&](std::size_t j, std::uint64_t off, const std::byte* src, std::uint64_t n) {
      if (dsts[j]) e.copy(Buffer{dsts[j], true, {}}, off, src, n);
    });
  });
  e.end(stream);
}

std::vector<void*> Consumer::read_to_staging(int device, void* stream) {
  Impl& m = *impl_;
  m.require_open();
  if (m.state != State::kManifest) throw Error(Errc::kInvalidArgument, "no sync to read: call wait_sync() first");
  if (!m.cuda_engine) m.cuda_engine = make_cuda_consumer_engine();
  ConsumerEngine& e = *m.cuda_engine;
  std::byte* base = e.staging(device, m.info.stream_bytes);
  e.begin(stream);
  // One H2D per slot: the staging buffer mirrors the stream.
  m.for_each_chunk(e, [&](const std::byte* data, std::uint64_t start, std::uint64_t bytes) {
    e.copy(Buffer{base, true, {}}, start, data, bytes);
  });
  e.end(stream);
  std::vector<void*> out;
  out.reserve(m.info.tensors.size());
  for (const TensorInfo& t : m.info.tensors) out.push_back(base + t.stream_offset);
  return out;
}

const SyncInfo& Consumer::sync() const { return impl_->info; }
std::uint64_t Consumer::last_version() const { return impl_->last_version; }
std::uint64_t Consumer::slot_bytes() const { return impl_->view.geo().slot_bytes; }
int Consumer::seat() const { return impl_->ring ? impl_->ring->seat() : -1; }
const std::string& Consumer::name() const { return impl_->name; }
bool Consumer::pinned() const { return impl_->pin.pinned; }
double Consumer::pin_seconds() const { return impl_->pin.seconds; }
double Consumer::open_seconds() const { return impl_->open_s; }
void Consumer::close() {
  if (impl_) impl_->close_quietly();
}

}  // namespace shmcast
