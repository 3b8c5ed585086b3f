// The manifest stream of the read-only probe (manifest_stream.hpp).
//
// The manifest is read with pread in bounded pieces, never through the
// mapping and never whole: memory stays bounded however large it is (a
// 256 MiB manifest of millions of tensors), and a file cut under us gives a
// short read, not SIGBUS. Every byte is hashed and every entry validated
// with decode_manifest's per-entry and header rules (protocol/manifest.hpp)
// as its bytes go by; only the first `limit` entries are kept and decoded.
// Every piece is checked against its tensor too (sizes, ranges, a delta
// blob's size: piece_size_problem), and the pieces' logical bytes against
// the tensors': a piece of a tensor not kept takes its entry from a second
// read of the entries, a block of kBlock entries at a time, each block
// checked against the hash of its bytes as the stream went by, so it is the
// entry that was validated (a block that differs: the manifest changed
// under the read, and it is read again). The rules that need all of a
// tensor's pieces at once (duplicate names, a whole piece beside others,
// tiling) are the consumer's alone.
#include "probe/manifest_stream.hpp"

#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "base/checks.hpp"
#include "base/sys.hpp"
#include "probe/record.hpp"
#include "protocol/manifest.hpp"
#include "protocol/ring.hpp"

namespace shmcast::detail::probe_impl {

namespace P = shmcast::probe;

namespace {

constexpr std::size_t kReadPiece = 1u << 20;  // bytes per pread of the manifest
constexpr std::size_t kWindow = 4096;         // entries (and pieces) per pread
constexpr std::size_t kBlock = 64;            // entries per block read again for a piece (divides kWindow)
static_assert(kWindow % kBlock == 0);

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

struct NameWant {
  std::uint64_t start, bytes;
  std::size_t tensor;  // index into the kept tensors
};

// The entries of the tensors not kept, read again a block at a time for
// their pieces. Memory: one block, and one hash per block of the manifest
// (kMaxTensors / kBlock at most).
class EntryBlocks {
 public:
  EntryBlocks(int fd, std::uint64_t entries_off, std::uint64_t count)
      : fd_(fd), off_(entries_off), count_(count), hashes_((count + kBlock - 1) / kBlock) {}
  // The stream's bytes of entries [first, first + n) (first a multiple of kBlock).
  void saw(std::uint64_t first, const ManifestEntry* e, std::size_t n) {
    for (std::size_t k = 0; k < n; k += kBlock)
      hashes_[(first + k) / kBlock] = XXH3_64bits(e + k, std::min(kBlock, n - k) * sizeof(ManifestEntry));
  }
  enum class Got { kOk, kShrank, kChanged };
  // Entry i, as the stream saw it.
  Got get(std::uint64_t i, const ManifestEntry** out) {
    const std::uint64_t b = i / kBlock;
    if (b != block_) {
      const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(kBlock, count_ - b * kBlock));
      const std::size_t len = n * sizeof(ManifestEntry);
      char* p = reinterpret_cast<char*>(buf_);
      std::size_t got = 0;
      while (got < len) {
        const ssize_t k = retry_eintr(
            [&] { return ::pread(fd_, p + got, len - got, static_cast<off_t>(off_ + b * kBlock * sizeof(ManifestEntry) + got)); });
        if (k <= 0) return Got::kShrank;
        got += static_cast<std::size_t>(k);
      }
      block_ = ~0ull;
      if (XXH3_64bits(buf_, len) != hashes_[b]) return Got::kChanged;
      block_ = b;
    }
    *out = &buf_[i - b * kBlock];
    return Got::kOk;
  }

 private:
  int fd_;
  std::uint64_t off_, count_;
  std::vector<std::uint64_t> hashes_;
  ManifestEntry buf_[kBlock];
  std::uint64_t block_ = ~0ull;
};

// One pass over the manifest of `rec`: hashes all of it into *hash and
// validates it. Returns "" when valid (m filled), else why not; *shrank is
// set when the file ended early.
// `store`: a store region's record (one chunk holding the whole stream).
// `delta_region`: the region has the delta feature (a delta piece elsewhere
// is refused, as consumers refuse it). *changed is set when an entry read
// again differs from the stream's.
std::string stream_manifest(int fd, std::uint64_t moff, const RecordSnapshot& rec, std::uint64_t slot_bytes,
                            std::size_t limit, P::Manifest* m, std::uint64_t* hash, bool* shrank, bool* changed,
                            bool store, bool delta_region) {
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
  // The header, the entries, the rank table and the pieces by
  // decode_manifest's rules; the name rules for the kept entries only.
  const std::uint64_t used = rec.manifest_used;
  if (std::string bad = manifest_header_problem(h, used, rec.version, rec.stream_bytes); !bad.empty())
    return done(bad);

  const std::size_t keep = limit == 0 ? h.tensor_count : std::min<std::uint64_t>(limit, h.tensor_count);
  std::vector<TensorInfo> kept;
  std::vector<NameWant> wants;
  kept.reserve(keep);
  wants.reserve(keep);
  std::vector<ManifestEntry> win(std::min<std::uint64_t>(kWindow, h.tensor_count));
  std::uint64_t end_prev = 0, payload = 0, logical = 0, pieces_logical = 0, base_version = 0, names_next = 0;
  // Only when some entries are not kept.
  std::optional<EntryBlocks> blocks;
  if (keep < h.tensor_count) blocks.emplace(fd, moff + sizeof h, h.tensor_count);
  for (std::uint64_t first = 0; first < h.tensor_count; first += kWindow) {
    const std::size_t w = static_cast<std::size_t>(std::min<std::uint64_t>(kWindow, h.tensor_count - first));
    if (!rd.read(win.data(), w * sizeof(ManifestEntry))) {
      *shrank = true;
      return "the file shrank while it was read";
    }
    if (blocks) blocks->saw(first, win.data(), w);
    for (std::size_t k = 0; k < w && why.empty(); ++k) {
      const ManifestEntry& e = win[k];
      std::string bad = entry_name_problem(e, h.names_bytes, &names_next);
      if (bad.empty()) bad = entry_shape_problem(e, &logical);
      if (!bad.empty()) {
        why = "tensor " + std::to_string(first + k) + ": " + bad;
        break;
      }
      if (kept.size() < keep) {
        wants.push_back({e.name_offset, e.name_bytes, kept.size()});
        kept.push_back(entry_tensor(e));
      }
    }
  }
  // The ranks' sub-streams, then the pieces (structure; the kept tensors
  // take theirs).
  std::vector<std::uint64_t> rank_bytes(h.world_size);
  if (!rd.read(rank_bytes.data(), rank_bytes.size() * 8)) {
    *shrank = true;
    return "the file shrank while it was read";
  }
  if (why.empty()) why = names_end_problem(names_next, h.names_bytes);
  if (why.empty()) why = rank_bytes_problem(rank_bytes, h.stream_bytes);
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
      std::string bad = piece_problem(p, h.tensor_count, rank_bytes, slot_bytes, &rank_prev, &end_prev);
      if (bad.empty()) bad = piece_base_problem(p, h.sync_version, &base_version);
      if (bad.empty() && p.base_version != 0 && !delta_region) bad = "a delta piece in a region created without deltas";
      // Its tensor: kept, or its entry read again.
      std::uint64_t nb = 0;
      if (bad.empty() && p.tensor < kept.size()) {
        const TensorInfo& t = kept[p.tensor];
        bad = piece_size_problem(p, t.dtype, t.shape, t.nbytes, &nb);
      } else if (bad.empty() && blocks) {  // (without blocks every tensor is kept: piece_problem checked the index)
        const ManifestEntry* e = nullptr;
        switch (blocks->get(p.tensor, &e)) {
          case EntryBlocks::Got::kShrank:
            *shrank = true;
            return "the file shrank while it was read";
          case EntryBlocks::Got::kChanged:
            *changed = true;
            return done("the manifest changed while it was read");
          case EntryBlocks::Got::kOk:
            bad = piece_size_problem(p, static_cast<DType>(e->dtype), std::span<const std::int64_t>(e->shape, e->ndim),
                                     e->nbytes, &nb);
            break;
        }
      }
      if (!bad.empty()) {
        why = "piece " + std::to_string(at + k) + ": " + bad;
        break;
      }
      payload += p.nbytes;
      if (!checked_add(pieces_logical, nb, &pieces_logical)) {  // many delta pieces of a huge tensor
        why = "payload size disagrees with the tensors";
        break;
      }
      if (p.tensor < kept.size()) {
        ShardInfo sh;
        sh.rank = p.rank;
        sh.dim = p.dim == kWholePiece ? -1 : p.dim;
        sh.start = p.start;
        sh.length = p.length;
        sh.stream_offset = p.offset;
        sh.nbytes = nb;
        sh.wire_bytes = p.nbytes;
        sh.base_version = p.base_version;
        kept[p.tensor].shards.push_back(sh);
      }
    }
  }
  if (why.empty() && payload != h.payload_bytes) why = "payload size disagrees with the pieces";
  if (why.empty() && pieces_logical != logical) why = "payload size disagrees with the tensors";

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
  m->logical_bytes = logical;
  m->payload_bytes = payload;
  m->base_version = base_version;
  m->stream_bytes = h.stream_bytes;
  m->world_size = h.world_size;
  m->tensors = std::move(kept);
  return {};
}

}  // namespace

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
    bool shrank = false, changed = false;
    const std::string why = stream_manifest(fd, moff, rec, g.slot_bytes, limit, &got, &hash, &shrank, &changed,
                                            g.store, r->fixed.delta);
    if (shrank) return invalid(why);
    if (changed) {
      last_why = why;
      continue;
    }
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

}  // namespace shmcast::detail::probe_impl
