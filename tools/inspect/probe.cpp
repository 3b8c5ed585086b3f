#include "probe.hpp"

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
#include <stdexcept>
#include <thread>

#include "doorbell.hpp"
#include "manifest.hpp"

namespace shmcast::inspect {

using namespace shmcast::detail;

namespace {

// ---------------------------------------------------------------- SIGBUS guard
//
// A region file can be truncated while we have it mapped (someone runs
// `truncate`, or a hostile process). Touching a mapped page past the new end
// raises SIGBUS. Every read of the mapping goes through guarded_copy(), which
// turns that SIGBUS into a failed copy instead of a crash. Between sigsetjmp
// and the copy there are no C++ objects with destructors, so the long jump
// skips nothing. A SIGBUS anywhere else (library code that touches the
// mapping, as dump's consumer does) goes to the hook, never to the default
// action.

thread_local sigjmp_buf* t_jump = nullptr;
std::atomic<BusHook> g_bus_hook{nullptr};

void on_sigbus(int, siginfo_t*, void*) {
  sigjmp_buf* j = t_jump;
  if (j != nullptr) siglongjmp(*j, 1);
  if (BusHook hook = g_bus_hook.load(std::memory_order_relaxed)) hook();
  static const char msg[] =
      "shmcast-inspect: a region file was truncated while it was mapped (SIGBUS); nothing was changed\n";
  (void)!::write(STDERR_FILENO, msg, sizeof msg - 1);
  ::_exit(1);
}

// read_record() on the live header, under the guard. Returns false when the
// page faulted; *stable says whether the seqlock gave a consistent copy.
bool guarded_record(const Header* live, RecordSnapshot* out, bool* stable) {
  sigjmp_buf jb;
  if (sigsetjmp(jb, 1) != 0) {
    t_jump = nullptr;
    return false;
  }
  t_jump = &jb;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  *stable = read_record(*live, out);
  std::atomic_signal_fence(std::memory_order_seq_cst);
  t_jump = nullptr;
  return true;
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
  if (!guarded_copy(raw, reinterpret_cast<const std::byte*>(&live->sync), sizeof raw)) return false;
  const SyncRecord& r = *reinterpret_cast<const SyncRecord*>(raw);
  out->word = r.announce.word.load(std::memory_order_relaxed);
  out->version = r.version.load(std::memory_order_relaxed);
  out->first_seq = r.first_seq.load(std::memory_order_relaxed);
  out->chunks = r.chunks.load(std::memory_order_relaxed);
  out->stream_bytes = r.stream_bytes.load(std::memory_order_relaxed);
  out->manifest_used = r.manifest_used.load(std::memory_order_relaxed);
  out->manifest_hash = r.manifest_hash.load(std::memory_order_relaxed);
  out->aborted = r.aborted.load(std::memory_order_relaxed) != 0;
  *stable = false;
  return true;
}

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

std::string fmt(const char* f, unsigned long long a, unsigned long long b = 0) {
  char buf[256];
  std::snprintf(buf, sizeof buf, f, a, b);
  return buf;
}

std::string bounded_text(const char* p, std::size_t cap) { return std::string(p, ::strnlen(p, cap)); }

std::string seat_state_name(std::uint32_t s) {
  switch (s) {
    case kSeatFree: return "free";
    case kSeatActive: return "active";
    case kSeatEvicted: return "evicted";
    default: return "invalid(" + std::to_string(s) + ")";
  }
}

std::int64_t now_unix_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void set_times(RegionReport* r, const struct stat& st, const ProbeOptions& opts) {
  const std::int64_t c = std::int64_t{st.st_ctim.tv_sec} * 1000000000 + st.st_ctim.tv_nsec;
  const std::int64_t m = std::int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec;
  const std::int64_t last = std::max(c, m);
  const std::int64_t age = now_unix_ns() - last;
  r->age_s = age > 0 ? static_cast<double>(age) * 1e-9 : 0.0;
  r->young = r->age_s < opts.grace_s;
  r->size = static_cast<std::uint64_t>(st.st_size);
  r->inode = st.st_ino;
}

// ---------------------------------------------------------------- manifest
//
// The manifest is read with pread in bounded pieces, never through the
// mapping and never whole: memory stays bounded however large it is (a
// 256 MiB manifest of millions of tensors), and a file cut under us gives a
// short read, not SIGBUS. Every byte is hashed and every entry validated (by
// the library's decode_manifest, one window of entries at a time), but only
// the first `limit` entries are kept and decoded.

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
      const ssize_t k = ::pread(fd_, p + got, n - got, static_cast<off_t>(off_ + pos_ + got));
      if (k < 0 && errno == EINTR) continue;
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
std::string stream_manifest(int fd, std::uint64_t moff, const RecordSnapshot& rec, std::uint64_t slot_bytes,
                            std::size_t limit, ManifestReport* m, std::uint64_t* hash, bool* shrank) {
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
  std::uint64_t sum = 0, per_rank = 0;
  for (std::uint64_t b : rank_bytes) {
    if (b > kMaxStreamBytes) sum = ~0ull;
    if (sum != ~0ull) sum += b;
    per_rank = std::max(per_rank, chunk_count(b, slot_bytes));
  }
  if (why.empty() && sum != h.stream_bytes) why = "the ranks' sub-streams do not add up to the stream size";
  if (why.empty() && rec.chunks != per_rank * h.world_size)
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
  // The names it prints follow the library's rules (the others' structure
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

void decode_current_manifest(RegionReport* r, int fd, const std::byte* base, std::uint64_t size, std::size_t limit) {
  const Header* live = reinterpret_cast<const Header*>(base);
  const Geometry& g = r->geo;
  ManifestReport& m = r->manifest;
  std::string last_why;
  for (int attempt = 0; attempt < 20; ++attempt) {
    if (attempt > 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    RecordSnapshot rec{};
    bool stable = false;
    if (!read_record_any(live, &rec, &stable)) {
      m.status = "invalid";
      m.reason = "the file shrank while it was read";
      return;
    }
    if (rec.version == 0) {
      m.status = "none";
      m.reason = "no sync has been announced yet";
      return;
    }
    if (rec.manifest_used < sizeof(ManifestHeader) || rec.manifest_used > g.manifest_bytes) {
      m.status = "invalid";
      m.reason = fmt("sync record says the manifest uses %llu bytes; the area holds %llu", rec.manifest_used,
                     g.manifest_bytes);
      return;
    }
    if (rec.first_seq == 0 || rec.stream_bytes > (1ull << 50) || rec.chunks > (1ull << 46)) {
      m.status = "invalid";
      m.reason = "sync record is inconsistent (first chunk, chunk count, stream size)";
      return;
    }
    if (g.manifest_offset > size || rec.manifest_used > size - g.manifest_offset) {
      m.status = "invalid";
      m.reason = "manifest runs past the end of the file";
      return;
    }
    ManifestReport got;
    std::uint64_t hash = 0;
    bool shrank = false;
    const std::string why = stream_manifest(fd, g.manifest_offset, rec, g.slot_bytes, limit, &got, &hash, &shrank);
    if (shrank) {
      m.status = "invalid";
      m.reason = why;
      return;
    }
    RecordSnapshot again{};
    bool stable2 = false;
    if (!read_record_any(live, &again, &stable2)) {
      m.status = "invalid";
      m.reason = "the file shrank while it was read";
      return;
    }
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
    if (!why.empty()) {
      m.status = "invalid";
      m.reason = why;
      return;
    }
    m = std::move(got);
    m.status = "ok";
    m.reason.clear();
    return;
  }
  m.status = "changing";
  m.reason = last_why;
}

}  // namespace

bool state_is_valid(const std::string& s) { return s == kStateReady || s == kStateClosed || s == kStateDead; }

bool state_is_damaged(const std::string& s) {
  return s == kStateCorrupt || s == kStateForeign || s == kStateNewer || s == kStateOlder || s == kStateTruncated ||
         s == kStateUnreadable || s == kStateUntrusted;
}

bool guarded_copy(void* dst, const std::byte* src, std::size_t n) {
  sigjmp_buf jb;
  if (sigsetjmp(jb, 1) != 0) {
    t_jump = nullptr;
    return false;
  }
  t_jump = &jb;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  std::memcpy(dst, src, n);
  std::atomic_signal_fence(std::memory_order_seq_cst);
  t_jump = nullptr;
  return true;
}

void set_bus_hook(BusHook hook) { g_bus_hook.store(hook, std::memory_order_relaxed); }

int open_region_file(const std::string& path, struct stat* st, int* err) {
  *err = 0;
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  } while (fd < 0 && errno == EINTR);
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

const char* file_type_name(mode_t mode) {
  if (S_ISREG(mode)) return "regular";
  if (S_ISLNK(mode)) return "symlink";
  if (S_ISFIFO(mode)) return "fifo";
  if (S_ISDIR(mode)) return "directory";
  if (S_ISSOCK(mode)) return "socket";
  if (S_ISCHR(mode)) return "char-device";
  if (S_ISBLK(mode)) return "block-device";
  return "unknown";
}

namespace {

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

const char* type_phrase(mode_t mode) {
  if (S_ISLNK(mode)) return "a symbolic link (never followed)";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "not a regular file";
}

void fill_owner(RegionReport* r, const struct stat& st) {
  OwnerReport& o = r->owner;
  o.known = true;
  o.uid = st.st_uid;
  o.gid = st.st_gid;
  o.user = user_name(st.st_uid);
  o.group = group_name(st.st_gid);
  o.mode = st.st_mode & 07777;
  o.trusted = untrusted_why(st).empty();
  r->file_type = file_type_name(st.st_mode);
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

}  // namespace

std::string mode_text(std::uint32_t mode) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "%04o", static_cast<unsigned>(mode & 07777));
  return buf;
}

// The library's trust rule (region.hpp), for a reader that is in the
// file's group if the group may write it.
std::string untrusted_why(const struct stat& st) {
  return detail::trust_problem("the file", st.st_uid, st.st_gid, st.st_mode, detail::TrustPolicy{true, {}});
}

void install_bus_guard() {
  struct sigaction sa {};
  sa.sa_sigaction = on_sigbus;
  sa.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGBUS, &sa, nullptr);
}

Alive any_lock_held(int fd) {
  struct flock fl {};
  fl.l_type = F_RDLCK;  // conflicts with any write lock; needs only read access
  fl.l_whence = SEEK_SET;
  fl.l_start = 0;
  fl.l_len = 0;  // the whole file
  fl.l_pid = 0;
  int rc;
  do {
    rc = ::fcntl(fd, F_OFD_GETLK, &fl);
  } while (rc < 0 && errno == EINTR);
  if (rc < 0) return Alive::kUnknown;
  return fl.l_type == F_UNLCK ? Alive::kNo : Alive::kYes;
}

std::vector<std::string> scan_dir(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) throw std::runtime_error("cannot read region directory " + dir + ": " + std::strerror(errno));
  std::vector<std::string> names;
  errno = 0;
  while (const struct dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n.size() > 8 && n.compare(0, 8, "shmcast.") == 0) names.push_back(n.substr(8));
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

RegionReport probe(const std::string& dir, const std::string& name, const ProbeOptions& opts) {
  RegionReport r;
  r.name = name;
  r.path = dir + "/shmcast." + name;

  // lstat first, so that a symlink, FIFO or device is reported without
  // being opened at all; the descriptor's fstat below is what counts.
  struct stat lst {};
  if (::lstat(r.path.c_str(), &lst) != 0) {
    const int e = errno;
    if (e == ENOENT) throw Error(Errc::kNotFound, "no region at " + r.path, e);
    r.state = kStateUnreadable;
    r.reason = std::string("lstat: ") + std::strerror(e);
    return r;
  }
  set_times(&r, lst, opts);
  fill_owner(&r, lst);
  auto not_regular = [&](const struct stat& st) {
    fill_owner(&r, st);
    r.state = kStateForeign;
    r.reason = type_phrase(st.st_mode);
    return r;
  };
  if (!S_ISREG(lst.st_mode)) return not_regular(lst);
  const std::string bad = validate_name(name);
  if (!bad.empty()) {
    r.valid_name = false;
    r.state = kStateForeign;
    r.reason = "file name is not a valid region name: " + bad;
    return r;
  }
  auto untrusted = [&](const std::string& why) {
    r.state = kStateUntrusted;
    r.reason = why + "; its contents are not read";
    return r;
  };
  if (const std::string why = untrusted_why(lst); !why.empty()) return untrusted(why);

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
    r.state = kStateUnreadable;
    r.reason = "cannot open " + r.path + ": " + std::strerror(err);
    return r;
  }
  set_times(&r, st, opts);
  fill_owner(&r, st);
  if (const std::string why = untrusted_why(st); !why.empty()) return untrusted(why);
  r.any_lock = any_lock_held(f.fd);
  const std::uint64_t size = static_cast<std::uint64_t>(st.st_size);
  r.size = size;
  if (size > 0) {
    void* m = ::mmap(nullptr, static_cast<std::size_t>(size), PROT_READ, MAP_SHARED, f.fd, 0);
    if (m == MAP_FAILED) {
      r.state = kStateUnreadable;
      r.reason = std::string("cannot map ") + r.path + ": " + std::strerror(errno);
      return r;
    }
    f.base = static_cast<const std::byte*>(m);
    f.len = static_cast<std::size_t>(size);
  }
  const std::byte* base = f.base;

  if (size == 0) {
    if (r.young || r.any_lock == Alive::kYes) {
      r.state = kStateCreating;
      r.reason = "the file is empty: its creator has not allocated it yet";
    } else {
      r.state = kStateTruncated;
      r.reason = "the file is empty";
    }
    return r;
  }
  if (size < sizeof(std::uint64_t)) {
    r.state = kStateTruncated;
    r.reason = fmt("the file has %llu bytes, too few for a header", size);
    return r;
  }

  AlignedBytes hbuf(kHeaderBytes);
  const std::size_t hn = static_cast<std::size_t>(std::min<std::uint64_t>(size, kHeaderBytes));
  if (!guarded_copy(hbuf.data(), base, hn)) {
    r.state = kStateTruncated;
    r.reason = "the file shrank while it was read";
    return r;
  }
  std::uint64_t magic = 0;
  std::memcpy(&magic, hbuf.data(), sizeof magic);
  std::uint32_t init_raw = 0;
  if (hn >= offsetof(Header, init_state) + sizeof(std::uint32_t))
    std::memcpy(&init_raw, hbuf.data() + offsetof(Header, init_state), sizeof init_raw);
  if (size >= sizeof(HeaderFixed)) {
    r.have_fixed = true;
    std::memcpy(&r.fixed, hbuf.data(), sizeof r.fixed);
  }

  if (magic != kMagic) {
    if (magic == 0 && init_raw == kInitCreating) {
      // A creator allocates the file (all zeros), takes its lock, then
      // writes the header: this is one that has not got that far.
      if (r.young || r.any_lock == Alive::kYes) {
        r.state = kStateCreating;
        r.reason = "the header is not written yet";
      } else if (size < kHeaderBytes) {
        r.state = kStateTruncated;  // creators allocate the whole file first: this is not one
        r.reason = fmt("the file has %llu bytes of zeros, fewer than the %llu-byte header", size, kHeaderBytes);
      } else {
        r.state = kStateDead;
        r.reason = "the header was never written: its creator died while creating it";
      }
      return r;
    }
    r.state = kStateForeign;
    char buf[96];
    std::snprintf(buf, sizeof buf, "not a shmcast region (magic 0x%016llx)", static_cast<unsigned long long>(magic));
    r.reason = buf;
    return r;
  }
  if (!r.have_fixed) {
    r.state = kStateTruncated;
    r.reason = fmt("the file has %llu bytes, fewer than the %llu-byte header", size, kHeaderBytes);
    return r;
  }
  if (r.fixed.layout_version != kLayoutVersion) {
    r.state = r.fixed.layout_version > kLayoutVersion ? kStateNewer : kStateOlder;
    r.reason = fmt("layout version %llu; this tool reads version %llu", r.fixed.layout_version, kLayoutVersion);
    // Byte 0 is the producer's lock byte in every layout so far; informative only.
    r.producer_alive = lock_held(f.fd, kProducerLockByte);
    return r;
  }
  if (size < kHeaderBytes) {
    r.state = kStateTruncated;
    r.reason = fmt("the file has %llu bytes, fewer than the %llu-byte header", size, kHeaderBytes);
    return r;
  }

  // ---- our magic and version, a whole header: read the lifecycle fields
  // from the private copy.
  const Header& h = *reinterpret_cast<const Header*>(hbuf.data());
  r.have_header = true;
  r.init_state = init_raw;
  r.error_code = h.error_code.load(std::memory_order_relaxed);
  r.error_text = bounded_text(h.error_text, kErrorTextBytes);
  r.producer_pid = h.producer.pid.load(std::memory_order_relaxed);
  r.producer_start_time = h.producer.start_time.load(std::memory_order_relaxed);
  r.producer_pidns = h.producer.pidns.load(std::memory_order_relaxed);
  r.generation = h.generation.load(std::memory_order_relaxed);
  r.evictions = h.evictions.load(std::memory_order_relaxed);
  r.published_seq = h.published_seq.load(std::memory_order_relaxed);
  r.syncs_done = h.syncs_done.load(std::memory_order_relaxed);
  r.bytes_done = h.bytes_done.load(std::memory_order_relaxed);
  r.last_sync_ns = h.last_sync_ns.load(std::memory_order_relaxed);
  r.last_end_unix_ns = h.last_end_unix_ns.load(std::memory_order_relaxed);
  r.producer_alive = peer_alive(f.fd, kProducerLockByte, h.producer);

  if (r.init_state == kInitCreating) {
    if (r.young || r.producer_alive == Alive::kYes) {
      r.state = kStateCreating;
      r.reason = "the producer is still initialising the header";
    } else {
      r.state = kStateDead;
      r.reason = "initialisation never finished: its creator died while creating it";
    }
    return r;
  }
  if (r.fixed.total_bytes != size) {
    r.state = kStateTruncated;
    r.reason = fmt("the header says %llu bytes but the file has %llu", r.fixed.total_bytes, size);
    return r;
  }
  bool version_mismatch = false;
  const std::string why = validate_header(r.fixed, size, &version_mismatch);
  if (!why.empty()) {
    r.state = kStateCorrupt;
    r.reason = why;
    return r;
  }
  if (r.init_state != kInitReady && r.init_state != kInitClosed) {
    r.state = kStateCorrupt;
    r.reason = fmt("init_state is %llu (expected 0, 1 or 2)", r.init_state);
    return r;
  }
  Geometry g{};
  if (!compute_geometry(r.fixed.max_consumers, r.fixed.slot_count, r.fixed.slot_bytes, r.fixed.manifest_bytes, &g,
                        r.fixed.world_size)
           .empty() ||
      g.total_bytes != size) {
    r.state = kStateCorrupt;
    r.reason = "geometry does not match the file";
    return r;
  }
  r.geo = g;
  r.header_valid = true;
  if (r.init_state == kInitClosed) {
    r.state = kStateClosed;
    r.reason = "the producer closed the region";
  } else if (r.producer_alive == Alive::kNo) {
    r.state = kStateDead;
    r.reason = "producer pid " + std::to_string(r.producer_pid) + " is gone";
  } else {
    r.state = kStateReady;
    if (r.producer_alive == Alive::kUnknown) r.reason = "producer liveness unknown (lock probe failed)";
  }

  // ---- seats and slot descriptors, from private copies (bounds: the
  // geometry was validated against the mapped size, checked again here).
  const std::uint64_t seats_len = std::uint64_t{g.max_consumers} * kSeatBytes;
  const std::uint64_t slots_len = std::uint64_t{g.slot_count} * kSlotDescBytes;
  if (g.seats_offset + seats_len > size || g.slots_offset + slots_len > size) {
    r.state = kStateCorrupt;
    r.reason = "seat or slot tables run past the end of the file";
    r.header_valid = false;
    return r;
  }
  AlignedBytes sbuf(seats_len), dbuf(slots_len);
  if (!guarded_copy(sbuf.data(), base + g.seats_offset, seats_len) ||
      !guarded_copy(dbuf.data(), base + g.slots_offset, slots_len)) {
    r.state = kStateTruncated;
    r.reason = "the file shrank while it was read";
    r.header_valid = false;
    return r;
  }

  // The sync record, under its seqlock, from the live header.
  r.have_record = read_record_any(reinterpret_cast<const Header*>(base), &r.record, &r.record_stable);
  const RecordSnapshot& rec = r.record;
  if (!r.have_record) {
    r.sync_status = "unknown";
  } else if (rec.version == 0) {
    r.sync_status = "none";
  } else if (rec.aborted) {
    r.sync_status = "aborted";
  } else if (rec.chunks == 0 || (rec.first_seq > 0 && r.published_seq >= rec.first_seq + rec.chunks - 1)) {
    r.sync_status = "published";
  } else {
    r.sync_status = "writing";
  }
  if (r.have_record && rec.first_seq > 0 && r.published_seq >= rec.first_seq)
    r.chunks_published = std::min(r.published_seq - rec.first_seq + 1, rec.chunks);

  r.seats.reserve(g.max_consumers);
  for (std::uint32_t i = 0; i < g.max_consumers; ++i) {
    const Seat& s = *reinterpret_cast<const Seat*>(sbuf.data() + std::uint64_t{i} * kSeatBytes);
    SeatReport sr;
    sr.index = i;
    sr.word = s.word.load(std::memory_order_relaxed);
    sr.state = seat_state_name(seat_state(sr.word));
    sr.generation = seat_gen(sr.word);
    sr.pid = s.consumer.pid.load(std::memory_order_relaxed);
    sr.start_time = s.consumer.start_time.load(std::memory_order_relaxed);
    sr.pidns = s.consumer.pidns.load(std::memory_order_relaxed);
    sr.alive = lock_held(f.fd, seat_lock_byte(i));
    sr.attach_unix_ns = s.attach_unix_ns.load(std::memory_order_relaxed);
    sr.released_seq = s.released_seq.load(std::memory_order_relaxed);
    sr.acked_version = s.acked_version.load(std::memory_order_relaxed);
    sr.syncs_done = s.syncs_done.load(std::memory_order_relaxed);
    sr.bytes_done = s.bytes_done.load(std::memory_order_relaxed);
    sr.error_code = s.error_code.load(std::memory_order_relaxed);
    sr.error_text = bounded_text(s.error_text, kErrorTextBytes);
    sr.included_gen = s.included_gen.load(std::memory_order_relaxed);
    sr.first_seq = s.first_seq.load(std::memory_order_relaxed);
    sr.first_version = s.first_version.load(std::memory_order_relaxed);
    sr.evict_reason = s.evict_reason.load(std::memory_order_relaxed);
    sr.enrolled = seat_state(sr.word) == kSeatActive && sr.included_gen == sr.generation;
    if (seat_state(sr.word) == kSeatActive) {
      ++r.consumers_attached;
      if (sr.alive == Alive::kYes) ++r.consumers_alive;
    }
    if (sr.enrolled && sr.alive != Alive::kNo) {
      const std::uint64_t done = std::max(sr.released_seq, sr.first_seq > 0 ? sr.first_seq - 1 : 0);
      sr.lag_chunks = r.published_seq > done ? r.published_seq - done : 0;
    }
    r.seats.push_back(std::move(sr));
  }

  r.slots.reserve(g.slot_count);
  for (std::uint32_t k = 0; k < g.slot_count; ++k) {
    const SlotDesc& d = *reinterpret_cast<const SlotDesc*>(dbuf.data() + std::uint64_t{k} * kSlotDescBytes);
    SlotReport sl;
    sl.index = k;
    sl.seq = d.seq.load(std::memory_order_relaxed);
    sl.version = d.version.load(std::memory_order_relaxed);
    sl.bytes = d.bytes.load(std::memory_order_relaxed);
    sl.checksum = d.checksum.load(std::memory_order_relaxed);
    if (sl.seq == 0) {
      sl.state = (sl.version == 0 && sl.bytes == 0) ? "empty" : "filling";
    } else {
      for (const SeatReport& s : r.seats)
        if (s.enrolled && s.alive != Alive::kNo && s.first_seq <= sl.seq && s.released_seq < sl.seq) ++sl.holders;
      sl.state = sl.holders > 0 ? "held" : "released";
    }
    r.slots.push_back(std::move(sl));
  }

  if (opts.decode_manifest)
    decode_current_manifest(&r, f.fd, base, size, opts.manifest_limit);
  else
    r.manifest.status = "skipped";
  return r;
}

}  // namespace shmcast::inspect
