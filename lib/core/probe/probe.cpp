// The read-only probe (shmcast/probe.hpp). The work is done here among the
// library's own types; the public functions at the end hand out plain
// copies.
#include "shmcast/probe.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <grp.h>
#include <pwd.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>

#include "base/checks.hpp"
#include "base/sys.hpp"
#include "base/text.hpp"
#include "base/layout.hpp"
#include "shm/liveness.hpp"
#include "protocol/manifest.hpp"
#include "shm/region.hpp"
#include "protocol/ring.hpp"

namespace shmcast::detail {

namespace {

namespace P = shmcast::probe;

// ---------------------------------------------------------------- SIGBUS guard
//
// A region file can be truncated while it is mapped (someone runs
// `truncate`, or a hostile process). Touching a mapped page past the new end
// raises SIGBUS. Every read of the mapping goes through guarded_copy(), which
// turns that SIGBUS into a failed copy instead of a crash. Between sigsetjmp
// and the copy there are no C++ objects with destructors, so the long jump
// skips nothing. A SIGBUS anywhere else (library code that touches the
// mapping, as a consumer does) goes to the hook, never to the default action.

thread_local sigjmp_buf* t_jump = nullptr;
std::atomic<P::BusHook> g_bus_hook{nullptr};

void on_sigbus(int, siginfo_t*, void*) {
  sigjmp_buf* j = t_jump;
  if (j != nullptr) siglongjmp(*j, 1);
  if (P::BusHook hook = g_bus_hook.load(std::memory_order_relaxed)) hook();
  static const char msg[] = "shmcast: a region file was truncated while it was mapped (SIGBUS); nothing was changed\n";
  (void)!::write(STDERR_FILENO, msg, sizeof msg - 1);
  ::_exit(1);
}

// Runs read() under the guard: false when a page faulted. read() must be a
// plain copy (memcpy, atomic loads): the long jump skips its frames.
template <class Read>
bool guarded(Read&& read) noexcept {
  sigjmp_buf jb;
  if (sigsetjmp(jb, 1) != 0) {
    t_jump = nullptr;
    return false;
  }
  t_jump = &jb;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  read();
  std::atomic_signal_fence(std::memory_order_seq_cst);
  t_jump = nullptr;
  return true;
}

bool guarded_copy(void* dst, const void* src, std::size_t n) noexcept {
  return guarded([&] { std::memcpy(dst, src, n); });
}

// read_record() on the live header, under the guard. Returns false when the
// page faulted; *stable says whether the seqlock gave a consistent copy.
bool guarded_record(const Header* live, RecordSnapshot* out, bool* stable) {
  return guarded([&] { *stable = read_record(*live, out); });
}

// The sync record. read_record() fails while the seqlock word is odd; the
// word is also a futex bell, and some library paths ring it outside a write
// (ProducerRing::evict, Producer close), which leaves it odd until the next
// announce, or for good after a close. So: try the seqlock for about 2 ms,
// then settle for an unlocked copy and say so (*stable = false). Callers
// that use the record to locate bytes re-validate what they read.
bool read_record_any(const Header* live, RecordSnapshot* out, bool* stable) {
  for (int attempt = 0; attempt < 20; ++attempt) {
    if (!guarded_record(live, out, stable)) return false;
    if (*stable) return true;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  alignas(64) std::byte raw[sizeof(SyncRecord)];
  if (!guarded_copy(raw, &live->sync, sizeof raw)) return false;
  copy_record(*reinterpret_cast<const SyncRecord*>(raw), out);
  *stable = false;
  return true;
}

// The record as read_record_any() gives it; for a store region whose
// producer is dead and whose seqlock word stays odd (it died inside the
// record flip), the record a consumer rebuilds from the banks
// (recover_store_record, docs/protocol.md §11), *recovered set.
bool read_record_or_recover(const Header* live, const Geometry& g, bool producer_dead, RecordSnapshot* out,
                            bool* stable, bool* recovered) {
  *recovered = false;
  if (!read_record_any(live, out, stable)) return false;
  if (*stable || !g.store || !producer_dead) return true;
  RecordSnapshot rec{};
  bool got = false;
  if (!guarded([&] { got = recover_store_record(reinterpret_cast<const std::byte*>(live), g, &rec); })) return false;
  if (got) {
    *out = rec;
    *recovered = true;
  }
  return true;
}

// ---------------------------------------------------------------- plain copies

P::Alive pub(Alive a) {
  switch (a) {
    case Alive::kYes: return P::Alive::kYes;
    case Alive::kNo: return P::Alive::kNo;
    default: return P::Alive::kUnknown;
  }
}

P::Identity pub(const Identity& id) {
  P::Identity out;
  out.pid = id.pid.load(std::memory_order_relaxed);
  out.start_time = id.start_time.load(std::memory_order_relaxed);
  out.pidns = id.pidns.load(std::memory_order_relaxed);
  return out;
}

P::FixedHeader pub(const HeaderFixed& f) {
  P::FixedHeader h;
  h.magic = f.magic;
  h.shmcast_magic = f.magic == kMagic;
  h.layout_version = f.layout_version;
  h.header_bytes = f.header_bytes;
  h.total_bytes = f.total_bytes;
  h.features = f.features;
  h.checksums = (f.features & kFeatureChecksums) != 0;
  h.store = (f.features & kFeatureStore) != 0;
  h.max_consumers = f.max_consumers;
  h.slot_count = f.slot_count;
  h.slot_bytes = f.slot_bytes;
  h.seats_offset = f.seats_offset;
  h.slots_offset = f.slots_offset;
  h.manifest_offset = f.manifest_offset;
  h.manifest_bytes = f.manifest_bytes;
  h.data_offset = f.data_offset;
  h.world_size = f.world_size;
  h.ranks_offset = f.ranks_offset;
  h.created_unix_ns = f.created_unix_ns;
  return h;
}

P::SyncRecord pub(const RecordSnapshot& r, bool stable) {
  P::SyncRecord out;
  out.stable = stable;
  out.version = r.version;
  out.first_seq = r.first_seq;
  out.chunks = r.chunks;
  out.stream_bytes = r.stream_bytes;
  out.manifest_used = r.manifest_used;
  out.manifest_hash = r.manifest_hash;
  out.aborted = r.aborted;
  return out;
}

P::InitState init_state_of(std::uint32_t s) {
  switch (s) {
    case kInitCreating: return P::InitState::kCreating;
    case kInitReady: return P::InitState::kReady;
    case kInitClosed: return P::InitState::kClosed;
    default: return P::InitState::kInvalid;
  }
}

P::SeatState seat_state_of(std::uint32_t s) {
  switch (s) {
    case kSeatFree: return P::SeatState::kFree;
    case kSeatActive: return P::SeatState::kActive;
    case kSeatEvicted: return P::SeatState::kEvicted;
    default: return P::SeatState::kInvalid;
  }
}

// ---------------------------------------------------------------- helpers

// 64-byte aligned private buffer, zero-filled.
struct AlignedBytes {
  struct Free {
    void operator()(std::byte* p) const { std::free(p); }
  };
  std::unique_ptr<std::byte[], Free> p;
  std::size_t n = 0;
  explicit AlignedBytes(std::size_t bytes) : n(bytes) {
    const std::size_t rounded = (bytes + 63) / 64 * 64;
    p.reset(static_cast<std::byte*>(std::aligned_alloc(64, rounded == 0 ? 64 : rounded)));
    if (!p) throw std::bad_alloc();
    std::memset(p.get(), 0, rounded == 0 ? 64 : rounded);
  }
  std::byte* data() const { return p.get(); }
};

std::int64_t now_unix_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void set_times(P::Region* r, const struct stat& st, const P::Options& opts) {
  const std::int64_t c = std::int64_t{st.st_ctim.tv_sec} * 1000000000 + st.st_ctim.tv_nsec;
  const std::int64_t m = std::int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec;
  const std::int64_t last = std::max(c, m);
  const std::int64_t age = now_unix_ns() - last;
  r->age_s = age > 0 ? static_cast<double>(age) * 1e-9 : 0.0;
  r->young = r->age_s < opts.grace_s;
  r->size = static_cast<std::uint64_t>(st.st_size);
  r->inode = st.st_ino;
}

// What a file is: its type's name ("fifo") and, for a file that is not a
// regular one, the phrase a report says ("a FIFO").
struct FileKind {
  const char* name;
  const char* phrase;
};

FileKind file_kind(mode_t mode) {
  if (S_ISREG(mode)) return {"regular", "a regular file"};
  if (S_ISLNK(mode)) return {"symlink", "a symbolic link (never followed)"};
  if (S_ISFIFO(mode)) return {"fifo", "a FIFO"};
  if (S_ISDIR(mode)) return {"directory", "a directory"};
  if (S_ISSOCK(mode)) return {"socket", "a socket"};
  if (S_ISCHR(mode)) return {"char-device", "a character device"};
  if (S_ISBLK(mode)) return {"block-device", "a block device"};
  return {"unknown", "not a regular file"};
}

std::string user_name(uid_t uid) {
  struct passwd pw {}, *res = nullptr;
  char buf[4096];
  if (::getpwuid_r(uid, &pw, buf, sizeof buf, &res) != 0 || res == nullptr) return {};
  return res->pw_name;
}

std::string group_name(gid_t gid) {
  struct group gr {}, *res = nullptr;
  char buf[4096];
  if (::getgrgid_r(gid, &gr, buf, sizeof buf, &res) != 0 || res == nullptr) return {};
  return res->gr_name;
}

// The library's trust rule (region.hpp), for a reader that is in the
// file's group if the group may write it.
P::Owner owner_of(const struct stat& st) {
  P::Owner o;
  o.known = true;
  o.uid = st.st_uid;
  o.gid = st.st_gid;
  o.user = user_name(st.st_uid);
  o.group = group_name(st.st_gid);
  o.mode = st.st_mode & 07777;
  o.trust_problem = trust_problem("the file", st.st_uid, st.st_gid, st.st_mode, TrustPolicy{true, {}});
  o.trusted = o.trust_problem.empty();
  return o;
}

void fill_owner(P::Region* r, const struct stat& st) {
  r->owner = owner_of(st);
  r->file_type = file_kind(st.st_mode).name;
}

// The one way a region path is opened: O_RDONLY | O_NOFOLLOW | O_CLOEXEC |
// O_NONBLOCK | O_NOCTTY, then fstat on the descriptor. Returns the
// descriptor of a regular file; otherwise -1, with *err the errno of the
// failed open (ELOOP for a symlink, ENXIO for a socket, ...) or 0 when it
// opened something that is not a regular file (then closed). *st is filled
// whenever fstat ran.
int open_region_file(const std::string& path, struct stat* st, int* err) {
  *err = 0;
  const int fd =
      retry_eintr([&] { return ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | O_NOCTTY); });
  if (fd < 0) {
    *err = errno;
    return -1;
  }
  if (::fstat(fd, st) != 0) {
    *err = errno;
    ::close(fd);
    return -1;
  }
  if (!S_ISREG(st->st_mode)) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// The read-only mapping of a region file and its descriptor.
struct ReadOnlyMap {
  int fd = -1;
  const std::byte* base = nullptr;
  std::size_t len = 0;
  ReadOnlyMap() = default;
  ReadOnlyMap(const ReadOnlyMap&) = delete;
  ReadOnlyMap& operator=(const ReadOnlyMap&) = delete;
  ~ReadOnlyMap() {
    if (base != nullptr) ::munmap(const_cast<std::byte*>(base), len);
    if (fd >= 0) ::close(fd);
  }
};

// ---------------------------------------------------------------- manifest
//
// The manifest is read with pread in bounded pieces, never through the
// mapping and never whole: memory stays bounded however large it is (a
// 256 MiB manifest of millions of tensors), and a file cut under us gives a
// short read, not SIGBUS. Every byte is hashed and every entry validated (by
// decode_manifest, one window of entries at a time), but only the first
// `limit` entries are kept and decoded.

constexpr std::size_t kReadPiece = 1u << 20;  // bytes per pread of the manifest
constexpr std::size_t kWindow = 4096;         // entries validated per decode_manifest call

// Sequential, hashed reads of [off, off + len) of a file.
class HashedReader {
 public:
  HashedReader(int fd, std::uint64_t off, std::uint64_t len) : fd_(fd), off_(off), len_(len) {
    state_ = XXH3_createState();
    if (state_ == nullptr) throw std::bad_alloc();
    XXH3_64bits_reset(state_);
  }
  ~HashedReader() { XXH3_freeState(state_); }
  HashedReader(const HashedReader&) = delete;
  HashedReader& operator=(const HashedReader&) = delete;

  std::uint64_t pos() const { return pos_; }
  std::uint64_t left() const { return len_ - pos_; }
  // Reads the next n bytes into dst (n <= left()). False on a short read:
  // the file shrank.
  bool read(void* dst, std::size_t n) {
    char* p = static_cast<char*>(dst);
    std::size_t got = 0;
    while (got < n) {
      const ssize_t k = retry_eintr([&] { return ::pread(fd_, p + got, n - got, static_cast<off_t>(off_ + pos_ + got)); });
      if (k <= 0) return false;
      got += static_cast<std::size_t>(k);
    }
    XXH3_64bits_update(state_, p, n);
    pos_ += n;
    return true;
  }
  std::uint64_t digest() const { return XXH3_64bits_digest(state_); }

 private:
  int fd_;
  std::uint64_t off_, len_, pos_ = 0;
  XXH3_state_t* state_ = nullptr;
};

// "tensor K: why" from a window starting at entry `first` -> "tensor first+K: why".
std::string shift_index(const std::string& why, std::uint64_t first) {
  const std::string pre = "tensor ";
  if (why.compare(0, pre.size(), pre) != 0) return why;
  char* end = nullptr;
  const unsigned long long k = std::strtoull(why.c_str() + pre.size(), &end, 10);
  if (end == why.c_str() + pre.size()) return why;
  return pre + std::to_string(first + k) + end;
}

struct NameWant {
  std::uint64_t start, bytes;
  std::size_t tensor;  // index into the kept tensors
};

// One pass over the manifest of `rec`: hashes all of it into *hash and
// validates it. Returns "" when valid (m filled), else why not; *shrank is
// set when the file ended early.
// `store`: a store region's record (one chunk holding the whole stream).
std::string stream_manifest(int fd, std::uint64_t moff, const RecordSnapshot& rec, std::uint64_t slot_bytes,
                            std::size_t limit, P::Manifest* m, std::uint64_t* hash, bool* shrank, bool store) {
  HashedReader rd(fd, moff, rec.manifest_used);
  std::string why;
  auto done = [&](std::string w) {
    // Hash the rest so the caller can tell "changing" from "invalid".
    std::vector<char> buf(std::min<std::uint64_t>(kReadPiece, rd.left()));
    while (rd.left() > 0) {
      const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(buf.size(), rd.left()));
      if (!rd.read(buf.data(), n)) {
        *shrank = true;
        return std::string("the file shrank while it was read");
      }
    }
    *hash = rd.digest();
    return w;
  };
  ManifestHeader h{};
  if (!rd.read(&h, sizeof h)) {
    *shrank = true;
    return "the file shrank while it was read";
  }
  // The structure the windows below rely on (decode_manifest checks the same
  // on a whole manifest).
  const std::uint64_t used = rec.manifest_used;
  if (h.magic != kManifestMagic) return done("bad manifest magic");
  if (h.format != kManifestVersion) return done("unknown manifest format " + std::to_string(h.format));
  if (h.entry_bytes != sizeof(ManifestEntry)) return done("bad manifest entry size");
  if (h.tensor_count > (used - sizeof h) / sizeof(ManifestEntry)) return done("tensor count exceeds the manifest");
  if (h.world_size < 1 || h.world_size > kMaxRanks) return done("bad world size");
  const std::uint64_t names_at = sizeof h + std::uint64_t{h.tensor_count} * sizeof(ManifestEntry) +
                                 std::uint64_t{h.world_size} * 8 + std::uint64_t{h.piece_count} * sizeof(ManifestPiece);
  if (names_at > used) return done("rank table and pieces run past the manifest");
  if (h.names_offset != names_at) return done("names blob is not where the pieces end");
  if (h.names_bytes > used - names_at) return done("names blob runs past the manifest");

  const std::size_t keep = limit == 0 ? h.tensor_count : std::min<std::uint64_t>(limit, h.tensor_count);
  std::vector<TensorInfo> kept;
  std::vector<NameWant> wants;
  kept.reserve(keep);
  wants.reserve(keep);
  std::vector<ManifestEntry> win(std::min<std::uint64_t>(kWindow, h.tensor_count));
  std::vector<std::byte> synth;
  std::uint64_t end_prev = 0, payload = 0;
  std::uint64_t first = 0;
  do {
    const std::size_t w = static_cast<std::size_t>(std::min<std::uint64_t>(kWindow, h.tensor_count - first));
    if (w > 0 && !rd.read(win.data(), w * sizeof(ManifestEntry))) {
      *shrank = true;
      return "the file shrank while it was read";
    }
    if (!why.empty()) continue;  // only hashing now
    // The window as a manifest of its own, names replaced by a blank blob as
    // long as the longest name (decode_manifest checks only their lengths
    // and bounds; their real bounds are checked here).
    std::uint64_t blob = 0;
    for (std::size_t k = 0; k < w; ++k) {
      const ManifestEntry& e = win[k];
      if (e.name_bytes <= kMaxNameBytes) blob = std::max<std::uint64_t>(blob, e.name_bytes);
    }
    // Entries only (the pieces are checked below, as they stream by).
    ManifestHeader wh = h;
    wh.tensor_count = static_cast<std::uint32_t>(w);
    wh.world_size = 1;
    wh.piece_count = 0;
    wh.names_offset = sizeof wh + w * sizeof(ManifestEntry) + 8;
    wh.names_bytes = blob;
    synth.assign(wh.names_offset + blob, std::byte{0});
    std::memcpy(synth.data(), &wh, sizeof wh);
    for (std::size_t k = 0; k < w; ++k) {
      ManifestEntry e = win[k];
      e.name_offset = 0;
      std::memcpy(synth.data() + sizeof wh + k * sizeof e, &e, sizeof e);
    }
    std::memcpy(synth.data() + sizeof wh + w * sizeof(ManifestEntry), &h.stream_bytes, 8);
    SyncInfo part;
    why = decode_manifest(synth, rec.version, rec.stream_bytes, slot_bytes, &part, /*check_names=*/false,
                          ManifestCheck::kEntries);
    if (!why.empty()) {
      why = shift_index(why, first);
      continue;
    }
    for (std::size_t k = 0; k < w && why.empty(); ++k) {
      const ManifestEntry& e = win[k];
      if (std::uint64_t{e.name_offset} + e.name_bytes > h.names_bytes)
        why = "tensor " + std::to_string(first + k) + ": name runs past the names blob";
    }
    if (!why.empty()) continue;
    for (std::size_t k = 0; k < w && kept.size() < keep; ++k) {
      part.tensors[k].name.clear();
      wants.push_back({win[k].name_offset, win[k].name_bytes, kept.size()});
      kept.push_back(std::move(part.tensors[k]));
    }
  } while ((first += kWindow) < h.tensor_count);
  // The ranks' sub-streams, then the pieces (structure; the kept tensors
  // take theirs).
  std::vector<std::uint64_t> rank_bytes(h.world_size);
  if (!rd.read(rank_bytes.data(), rank_bytes.size() * 8)) {
    *shrank = true;
    return "the file shrank while it was read";
  }
  std::uint64_t sum = 0;
  for (std::uint64_t b : rank_bytes) {
    if (b > kMaxStreamBytes) sum = ~0ull;
    if (sum != ~0ull) sum += b;
  }
  if (why.empty() && sum != h.stream_bytes) why = "the ranks' sub-streams do not add up to the stream size";
  if (why.empty() && (store ? rec.chunks != 1 || h.stream_bytes > slot_bytes
                            : rec.chunks != sync_chunks(rank_bytes, slot_bytes)))
    why = "sync record's chunk count disagrees with the ranks' sub-streams";
  std::vector<ManifestPiece> pwin(std::min<std::uint64_t>(kWindow, h.piece_count));
  std::uint32_t rank_prev = 0;
  for (std::uint64_t at = 0; at < h.piece_count; at += kWindow) {
    const std::size_t w = static_cast<std::size_t>(std::min<std::uint64_t>(kWindow, h.piece_count - at));
    if (!rd.read(pwin.data(), w * sizeof(ManifestPiece))) {
      *shrank = true;
      return "the file shrank while it was read";
    }
    for (std::size_t k = 0; k < w && why.empty(); ++k) {
      const ManifestPiece& p = pwin[k];
      if (std::string bad = piece_problem(p, h.tensor_count, rank_bytes, slot_bytes, &rank_prev, &end_prev); !bad.empty()) {
        why = "piece " + std::to_string(at + k) + ": " + bad;
        break;
      }
      payload += p.nbytes;
      if (p.tensor < kept.size()) {
        ShardInfo sh;
        sh.rank = p.rank;
        sh.dim = p.dim == kWholePiece ? -1 : p.dim;
        sh.start = p.start;
        sh.length = p.length;
        sh.stream_offset = p.offset;
        sh.nbytes = p.nbytes;
        kept[p.tensor].shards.push_back(sh);
      }
    }
  }
  if (why.empty() && payload != h.payload_bytes) why = "payload size disagrees with the pieces";

  // The names blob, in pieces; the kept entries take their names as their
  // bytes go by.
  std::sort(wants.begin(), wants.end(), [](const NameWant& a, const NameWant& b) { return a.start < b.start; });
  for (NameWant& nw : wants) kept[nw.tensor].name.resize(nw.bytes);
  std::vector<char> piece(std::min<std::uint64_t>(kReadPiece, h.names_bytes));
  std::vector<std::size_t> active;
  std::size_t next = 0;
  for (std::uint64_t at = 0; at < h.names_bytes;) {
    const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(piece.size(), h.names_bytes - at));
    if (!rd.read(piece.data(), n)) {
      *shrank = true;
      return "the file shrank while it was read";
    }
    const std::uint64_t end = at + n;
    if (why.empty()) {
      while (next < wants.size() && wants[next].start < end) active.push_back(next++);
      std::size_t still = 0;
      for (std::size_t i : active) {
        const NameWant& nw = wants[i];
        const std::uint64_t lo = std::max(nw.start, at), hi = std::min(nw.start + nw.bytes, end);
        if (hi > lo) std::memcpy(kept[nw.tensor].name.data() + (lo - nw.start), piece.data() + (lo - at), hi - lo);
        if (nw.start + nw.bytes > end) active[still++] = i;
      }
      active.resize(still);
    }
    at = end;
  }
  // The names it hands out follow the library's rules (the others' structure
  // was checked above; their bytes are never read).
  for (std::size_t t = 0; t < kept.size() && why.empty(); ++t)
    if (std::string bad = name_problem(kept[t].name); !bad.empty()) why = "tensor " + std::to_string(t) + ": " + bad;
  why = done(why);
  if (!why.empty()) return why;
  m->version = h.sync_version;
  m->tensor_count = h.tensor_count;
  m->payload_bytes = payload;
  m->stream_bytes = h.stream_bytes;
  m->world_size = h.world_size;
  m->tensors = std::move(kept);
  return {};
}

void decode_current_manifest(P::Region* r, const Geometry& g, int fd, const std::byte* base, std::uint64_t size,
                             std::size_t limit) {
  const Header* live = reinterpret_cast<const Header*>(base);
  P::Manifest& m = r->manifest;
  auto invalid = [&](std::string why) {
    m.status = P::ManifestStatus::kInvalid;
    m.reason = std::move(why);
  };
  std::string last_why;
  for (int attempt = 0; attempt < 20; ++attempt) {
    if (attempt > 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    RecordSnapshot rec{};
    bool stable = false, recovered = false;
    const bool dead = r->producer_alive == P::Alive::kNo;
    if (!read_record_or_recover(live, g, dead, &rec, &stable, &recovered))
      return invalid("the file shrank while it was read");
    if (rec.version == 0) {
      m.status = P::ManifestStatus::kNone;
      m.reason = "no sync has been announced yet";
      return;
    }
    if (std::string why = record_problem(rec, g); !why.empty()) return invalid(why);
    // A store region: the manifest of the bank that holds the record's chunk.
    const std::uint64_t moff = g.manifest_offset + (g.store ? (rec.first_seq - 1) % 2 * g.manifest_bytes : 0);
    if (moff > size || rec.manifest_used > size - moff) return invalid("manifest runs past the end of the file");
    P::Manifest got;
    std::uint64_t hash = 0;
    bool shrank = false;
    const std::string why = stream_manifest(fd, moff, rec, g.slot_bytes, limit, &got, &hash, &shrank, g.store);
    if (shrank) return invalid(why);
    RecordSnapshot again{};
    bool stable2 = false, recovered2 = false;
    if (!read_record_or_recover(live, g, dead, &again, &stable2, &recovered2))
      return invalid("the file shrank while it was read");
    if (stable2 != stable || again.word != rec.word || again.version != rec.version ||
        again.manifest_hash != rec.manifest_hash) {
      last_why = "a new sync was announced while the manifest was read";
      continue;
    }
    if (hash != rec.manifest_hash) {
      // The producer writes the next manifest before it announces it, so
      // between syncs the bytes may belong to the next one.
      last_why = "the manifest bytes do not match the sync record's hash (the producer may be writing the next "
                 "manifest, or the area is corrupt)";
      continue;
    }
    if (!why.empty()) return invalid(why);
    m = std::move(got);
    m.status = P::ManifestStatus::kOk;
    m.reason.clear();
    return;
  }
  m.status = P::ManifestStatus::kChanging;
  m.reason = last_why;
}

// ---------------------------------------------------------------- probe

// Seats, slot descriptors and the sync record of a region whose header was
// validated (geometry `g`), from private copies. False when the file shrank.
bool read_tables(P::Region& r, const Geometry& g, int fd, const std::byte* base, std::uint64_t size) {
  const std::uint64_t seats_len = std::uint64_t{g.max_consumers} * kSeatBytes;
  const std::uint64_t slots_len = std::uint64_t{g.slot_count} * kSlotDescBytes;
  if (g.seats_offset + seats_len > size || g.slots_offset + slots_len > size) {
    r.state = P::State::kCorrupt;
    r.reason = "seat or slot tables run past the end of the file";
    return false;
  }
  AlignedBytes sbuf(seats_len), dbuf(slots_len);
  if (!guarded_copy(sbuf.data(), base + g.seats_offset, seats_len) ||
      !guarded_copy(dbuf.data(), base + g.slots_offset, slots_len)) {
    r.state = P::State::kTruncated;
    r.reason = "the file shrank while it was read";
    return false;
  }

  // The sync record, under its seqlock, from the live header.
  RecordSnapshot rec{};
  bool stable = false, recovered = false;
  r.have_record = read_record_or_recover(reinterpret_cast<const Header*>(base), g,
                                         r.producer_alive == P::Alive::kNo, &rec, &stable, &recovered);
  if (r.have_record) {
    r.record = pub(rec, stable);
    r.record.recovered = recovered;
  }
  if (!r.have_record) {
    r.sync_status = P::SyncStatus::kUnknown;
  } else if (rec.version == 0) {
    r.sync_status = P::SyncStatus::kNone;
  } else if (rec.aborted) {
    r.sync_status = P::SyncStatus::kAborted;
  } else if (rec.chunks == 0 || (rec.first_seq > 0 && r.published_seq >= rec.first_seq + rec.chunks - 1)) {
    r.sync_status = P::SyncStatus::kPublished;
  } else {
    r.sync_status = P::SyncStatus::kWriting;
  }
  if (r.have_record && rec.first_seq > 0 && r.published_seq >= rec.first_seq)
    r.chunks_published = std::min(r.published_seq - rec.first_seq + 1, rec.chunks);

  r.seats.reserve(g.max_consumers);
  for (std::uint32_t i = 0; i < g.max_consumers; ++i) {
    const Seat& s = *reinterpret_cast<const Seat*>(sbuf.data() + std::uint64_t{i} * kSeatBytes);
    P::Seat sr;
    sr.index = i;
    sr.word = s.word.load(std::memory_order_relaxed);
    sr.state_raw = seat_state(sr.word);
    sr.state = seat_state_of(sr.state_raw);
    sr.generation = seat_gen(sr.word);
    sr.consumer = pub(s.consumer);
    sr.alive = pub(lock_held(fd, seat_lock_byte(i)));
    sr.attach_unix_ns = s.attach_unix_ns.load(std::memory_order_relaxed);
    sr.released_seq = s.released_seq.load(std::memory_order_relaxed);
    sr.hold_seq = s.hold_seq.load(std::memory_order_relaxed);
    sr.acked_version = s.acked_version.load(std::memory_order_relaxed);
    sr.syncs_done = s.syncs_done.load(std::memory_order_relaxed);
    sr.bytes_done = s.bytes_done.load(std::memory_order_relaxed);
    sr.error_code = s.error_code.load(std::memory_order_relaxed);
    sr.error_text = read_error_text(s.error_text);
    sr.included_gen = s.included_gen.load(std::memory_order_relaxed);
    sr.first_seq = s.first_seq.load(std::memory_order_relaxed);
    sr.first_version = s.first_version.load(std::memory_order_relaxed);
    sr.evict_reason = s.evict_reason.load(std::memory_order_relaxed);
    const bool active = sr.state_raw == kSeatActive;
    sr.enrolled = active && sr.included_gen == sr.generation;
    if (active) {
      ++r.consumers_attached;
      if (sr.alive == P::Alive::kYes) ++r.consumers_alive;
    }
    if (sr.enrolled && sr.alive != P::Alive::kNo) {
      const std::uint64_t done = std::max(sr.released_seq, sr.first_seq > 0 ? sr.first_seq - 1 : 0);
      sr.lag_chunks = r.published_seq > done ? r.published_seq - done : 0;
    }
    r.seats.push_back(std::move(sr));
  }

  r.slots.reserve(g.slot_count);
  for (std::uint32_t k = 0; k < g.slot_count; ++k) {
    const SlotDesc& d = *reinterpret_cast<const SlotDesc*>(dbuf.data() + std::uint64_t{k} * kSlotDescBytes);
    P::Slot sl;
    sl.index = k;
    sl.seq = d.seq.load(std::memory_order_relaxed);
    sl.version = d.version.load(std::memory_order_relaxed);
    sl.bytes = d.bytes.load(std::memory_order_relaxed);
    sl.checksum = d.checksum.load(std::memory_order_relaxed);
    if (sl.seq == 0) {
      sl.state = (sl.version == 0 && sl.bytes == 0) ? P::SlotState::kEmpty : P::SlotState::kFilling;
    } else {
      for (const P::Seat& s : r.seats) {
        if (s.alive == P::Alive::kNo) continue;
        if (r.fixed.store ? s.state == P::SeatState::kActive && s.hold_seq == sl.seq  // a reader holds the version
                          : s.enrolled && s.first_seq <= sl.seq && s.released_seq < sl.seq)
          ++sl.holders;
      }
      sl.state = sl.holders > 0 ? P::SlotState::kHeld : P::SlotState::kReleased;
    }
    r.slots.push_back(std::move(sl));
  }
  return true;
}

P::Region probe_region(const std::string& dir, std::string_view name, const P::Options& opts) {
  P::Region r;
  r.name = std::string(name);
  r.path = region_file(dir, name);
  // The report with its state and the reason for it.
  auto verdict = [&r](P::State state, std::string why) {
    r.state = state;
    r.reason = std::move(why);
    return r;
  };

  // lstat first, so that a symlink, FIFO or device is reported without
  // being opened at all; the descriptor's fstat below is what counts.
  struct stat lst {};
  if (::lstat(r.path.c_str(), &lst) != 0) {
    const int e = errno;
    if (e == ENOENT) throw Error(Errc::kNotFound, "no region at " + r.path, e);
    return verdict(P::State::kUnreadable, std::string("lstat: ") + std::strerror(e));
  }
  set_times(&r, lst, opts);
  fill_owner(&r, lst);
  auto not_regular = [&](const struct stat& st) {
    fill_owner(&r, st);
    return verdict(P::State::kForeign, file_kind(st.st_mode).phrase);
  };
  if (!S_ISREG(lst.st_mode)) return not_regular(lst);
  const std::string bad = validate_name(name);
  if (!bad.empty()) {
    r.valid_name = false;
    return verdict(P::State::kForeign, "file name is not a valid region name: " + bad);
  }
  auto untrusted = [&](const std::string& why) {
    return verdict(P::State::kUntrustedOwner, why + "; its contents are not read");
  };
  if (!r.owner.trusted) return untrusted(r.owner.trust_problem);

  ReadOnlyMap f;
  struct stat st {};
  int err = 0;
  f.fd = open_region_file(r.path, &st, &err);
  if (f.fd < 0) {
    if (err == ENOENT) throw Error(Errc::kNotFound, "no region at " + r.path, err);
    if (err == 0) return not_regular(st);  // swapped under the name since the lstat
    struct stat again {};
    if ((err == ELOOP || err == ENXIO) && ::lstat(r.path.c_str(), &again) == 0 && !S_ISREG(again.st_mode))
      return not_regular(again);
    return verdict(P::State::kUnreadable, "cannot open " + r.path + ": " + std::strerror(err));
  }
  set_times(&r, st, opts);
  fill_owner(&r, st);
  if (!r.owner.trusted) return untrusted(r.owner.trust_problem);
  r.any_lock = pub(any_lock_held(f.fd));
  const std::uint64_t size = static_cast<std::uint64_t>(st.st_size);
  r.size = size;
  if (size > 0) {
    void* m = ::mmap(nullptr, static_cast<std::size_t>(size), PROT_READ, MAP_SHARED, f.fd, 0);
    if (m == MAP_FAILED)
      return verdict(P::State::kUnreadable, std::string("cannot map ") + r.path + ": " + std::strerror(errno));
    f.base = static_cast<const std::byte*>(m);
    f.len = static_cast<std::size_t>(size);
  }
  const std::byte* base = f.base;

  if (size == 0) {
    if (r.young || r.any_lock == P::Alive::kYes)
      return verdict(P::State::kCreating, "the file is empty: its creator has not allocated it yet");
    return verdict(P::State::kTruncated, "the file is empty");
  }
  if (size < sizeof(std::uint64_t))
    return verdict(P::State::kTruncated, printf_u64("the file has %llu bytes, too few for a header", size));

  AlignedBytes hbuf(kHeaderBytes);
  const std::size_t hn = static_cast<std::size_t>(std::min<std::uint64_t>(size, kHeaderBytes));
  if (!guarded_copy(hbuf.data(), base, hn)) return verdict(P::State::kTruncated, "the file shrank while it was read");
  std::uint64_t magic = 0;
  std::memcpy(&magic, hbuf.data(), sizeof magic);
  std::uint32_t init_raw = 0;
  if (hn >= offsetof(Header, init_state) + sizeof(std::uint32_t))
    std::memcpy(&init_raw, hbuf.data() + offsetof(Header, init_state), sizeof init_raw);
  HeaderFixed fixed{};
  if (size >= sizeof(HeaderFixed)) {
    r.have_fixed = true;
    std::memcpy(&fixed, hbuf.data(), sizeof fixed);
    r.fixed = pub(fixed);
  }

  if (magic != kMagic) {
    if (magic == 0 && init_raw == kInitCreating) {
      // A creator allocates the file (all zeros), takes its lock, then
      // writes the header: this is one that has not got that far.
      if (r.young || r.any_lock == P::Alive::kYes) return verdict(P::State::kCreating, "the header is not written yet");
      if (size < kHeaderBytes)  // creators allocate the whole file first: this is not one
        return verdict(P::State::kTruncated, printf_u64("the file has %llu bytes of zeros, fewer than the %llu-byte "
                                                        "header", size, kHeaderBytes));
      return verdict(P::State::kDead, "the header was never written: its creator died while creating it");
    }
    return verdict(P::State::kForeign, printf_u64("not a shmcast region (magic 0x%016llx)", magic));
  }
  const std::string too_short =
      printf_u64("the file has %llu bytes, fewer than the %llu-byte header", size, kHeaderBytes);
  if (!r.have_fixed) return verdict(P::State::kTruncated, too_short);
  if (fixed.layout_version != kLayoutVersion) {
    r.state = fixed.layout_version > kLayoutVersion ? P::State::kNewerVersion : P::State::kOlderVersion;
    r.reason = printf_u64("layout version %llu; this tool reads version %llu", fixed.layout_version, kLayoutVersion);
    // Byte 0 is the producer's lock byte in every layout so far; informative only.
    r.producer_alive = pub(lock_held(f.fd, kProducerLockByte));
    return r;
  }
  if (size < kHeaderBytes) return verdict(P::State::kTruncated, too_short);

  // ---- our magic and version, a whole header: read the lifecycle fields
  // from the private copy.
  const Header& h = *reinterpret_cast<const Header*>(hbuf.data());
  r.have_header = true;
  r.init_state_raw = init_raw;
  r.init_state = init_state_of(init_raw);
  r.error_code = h.error_code.load(std::memory_order_relaxed);
  r.error_text = read_error_text(h.error_text);
  r.producer = pub(h.producer);
  r.generation = h.generation.load(std::memory_order_relaxed);
  r.evictions = h.evictions.load(std::memory_order_relaxed);
  r.published_seq = h.published_seq.load(std::memory_order_relaxed);
  r.syncs_done = h.syncs_done.load(std::memory_order_relaxed);
  r.bytes_done = h.bytes_done.load(std::memory_order_relaxed);
  r.last_sync_ns = h.last_sync_ns.load(std::memory_order_relaxed);
  r.last_end_unix_ns = h.last_end_unix_ns.load(std::memory_order_relaxed);
  r.producer_alive = pub(peer_alive(f.fd, kProducerLockByte, h.producer));

  if (init_raw == kInitCreating) {
    if (r.young || r.producer_alive == P::Alive::kYes)
      return verdict(P::State::kCreating, "the producer is still initialising the header");
    return verdict(P::State::kDead, "initialisation never finished: its creator died while creating it");
  }
  if (fixed.total_bytes != size)
    return verdict(P::State::kTruncated,
                   printf_u64("the header says %llu bytes but the file has %llu", fixed.total_bytes, size));
  bool version_mismatch = false;
  if (std::string why = validate_header(fixed, size, &version_mismatch); !why.empty())
    return verdict(P::State::kCorrupt, why);
  if (init_raw != kInitReady && init_raw != kInitClosed)
    return verdict(P::State::kCorrupt, printf_u64("init_state is %llu (expected 0, 1 or 2)", init_raw));
  Geometry g{};
  if (!compute_geometry(fixed.max_consumers, fixed.slot_count, fixed.slot_bytes, fixed.manifest_bytes, &g,
                       fixed.world_size, (fixed.features & kFeatureStore) != 0).empty() ||
      g.total_bytes != size)
    return verdict(P::State::kCorrupt, "geometry does not match the file");
  r.header_valid = true;
  if (init_raw == kInitClosed) {
    r.state = P::State::kClosed;
    r.reason = "the producer closed the region";
  } else if (r.producer_alive == P::Alive::kNo) {
    r.state = P::State::kDead;
    r.reason = "producer pid " + std::to_string(r.producer.pid) + " is gone";
  } else {
    r.state = P::State::kReady;
    if (r.producer_alive == P::Alive::kUnknown) r.reason = "producer liveness unknown (lock probe failed)";
  }

  if (!read_tables(r, g, f.fd, base, size)) {
    r.header_valid = false;
    return r;
  }
  if (opts.decode_manifest)
    decode_current_manifest(&r, g, f.fd, base, size, opts.manifest_limit);
  else
    r.manifest.status = P::ManifestStatus::kSkipped;
  return r;
}

}  // namespace

}  // namespace shmcast::detail

namespace shmcast::probe {

std::uint32_t layout_version() noexcept { return detail::kLayoutVersion; }

bool state_is_valid(State s) noexcept { return s == State::kReady || s == State::kClosed || s == State::kDead; }

bool state_is_damaged(State s) noexcept {
  return s == State::kCorrupt || s == State::kForeign || s == State::kNewerVersion || s == State::kOlderVersion ||
         s == State::kTruncated || s == State::kUnreadable || s == State::kUntrustedOwner;
}

namespace {

// Names of each enum's values, in the order of its values (0, 1, ...).
constexpr const char* kStateNames[] = {"creating",  "ready",      "closed",         "dead",
                                       "corrupt",   "foreign",    "newer-version",  "older-version",
                                       "truncated", "unreadable", "untrusted-owner"};
constexpr const char* kInitStateNames[] = {"creating", "ready", "closed", "invalid"};
constexpr const char* kSyncStatusNames[] = {"none", "writing", "published", "aborted", "unknown"};
constexpr const char* kSeatStateNames[] = {"free", "active", "evicted", "invalid"};
constexpr const char* kSlotStateNames[] = {"empty", "filling", "held", "released"};
constexpr const char* kManifestStatusNames[] = {"none", "ok", "changing", "invalid", "skipped"};

// The name of `e` in `names`, whose last entry names `Last`.
template <auto Last, std::size_t N>
const char* name_of(decltype(Last) e, const char* const (&names)[N]) noexcept {
  static_assert(N == static_cast<std::size_t>(Last) + 1, "one name for each value");
  const auto i = static_cast<std::size_t>(e);
  return i < N ? names[i] : "unknown";
}

}  // namespace

const char* state_name(State s) noexcept { return name_of<State::kUntrustedOwner>(s, kStateNames); }
const char* state_name(InitState s) noexcept { return name_of<InitState::kInvalid>(s, kInitStateNames); }
const char* state_name(SyncStatus s) noexcept { return name_of<SyncStatus::kUnknown>(s, kSyncStatusNames); }
const char* state_name(SeatState s) noexcept { return name_of<SeatState::kInvalid>(s, kSeatStateNames); }
const char* state_name(SlotState s) noexcept { return name_of<SlotState::kReleased>(s, kSlotStateNames); }
const char* state_name(ManifestStatus s) noexcept {
  return name_of<ManifestStatus::kSkipped>(s, kManifestStatusNames);
}

std::string resolve_dir(std::string_view dir) { return dir.empty() ? region_dir() : detail::trim_dir(dir); }

std::string region_file(std::string_view dir, std::string_view name) { return detail::region_file(dir, name); }

std::vector<std::string> scan_dir(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    const int e = errno;
    throw Error(detail::errc_for_errno(e), "cannot read region directory " + dir + ": " + std::strerror(e), e);
  }
  const std::string_view prefix = detail::kRegionFilePrefix;
  std::vector<std::string> names;
  while (const struct dirent* e = ::readdir(d)) {
    const std::string_view n = e->d_name;
    if (n.size() > prefix.size() && n.substr(0, prefix.size()) == prefix) names.emplace_back(n.substr(prefix.size()));
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

Region probe_region(const std::string& dir, std::string_view name, const Options& options) {
  return detail::probe_region(dir, name, options);
}

FileCheck check_file(const std::string& path) {
  FileCheck c;
  struct stat st {};
  const int fd = detail::open_region_file(path, &st, &c.error);
  if (c.error == 0) {  // fstat ran
    c.file_type = detail::file_kind(st.st_mode).name;
    c.inode = st.st_ino;
    c.owner = detail::owner_of(st);
  }
  if (fd < 0) return c;
  c.regular = true;
  c.any_lock = detail::pub(detail::any_lock_held(fd));
  ::close(fd);
  return c;
}

void install_bus_guard() {
  struct sigaction sa {};
  sa.sa_sigaction = detail::on_sigbus;
  sa.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGBUS, &sa, nullptr);
}

bool guarded_copy(void* dst, const void* src, std::size_t n) noexcept { return detail::guarded_copy(dst, src, n); }

void set_bus_hook(BusHook hook) noexcept { detail::g_bus_hook.store(hook, std::memory_order_relaxed); }

std::string human_bytes(std::uint64_t bytes) { return detail::human_bytes(bytes); }

}  // namespace shmcast::probe
