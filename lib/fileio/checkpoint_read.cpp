// Reading a checkpoint's tensors: read_tensors (into caller memory) and
// stream_tensors (through aligned staging windows, reads running ahead of
// the caller's use of each tensor).
//
// The I/O path is chosen once per call (ReadOptions::path): io_uring when it
// can be set up, else pread; with io_uring, O_DIRECT per file where the file
// system allows it and (kAuto) the page cache does not already hold most of
// the file; buffered otherwise.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "checkpoint.hpp"
#include "file_read.hpp"
#include "shmcast/safetensors.hpp"

namespace shmcast::safetensors {

std::string_view io_path_name(IoPath p) noexcept {
  switch (p) {
    case IoPath::kAuto: return "auto";
    case IoPath::kDirect: return "direct";
    case IoPath::kBuffered: return "buffered";
    case IoPath::kPread: return "pread";
  }
  return "?";
}

namespace {

using detail::ReadEngine;
using detail::ReadReq;

constexpr std::uint64_t kBlock = 4096;  // O_DIRECT alignment we use (at least the file system's)
constexpr std::uint64_t kRegisterPiece = 1ull << 30;  // one registered iovec at most

std::uint64_t align_down(std::uint64_t x, std::uint64_t a) { return x / a * a; }
std::uint64_t align_up(std::uint64_t x, std::uint64_t a) { return (x + a - 1) / a * a; }
bool pow2(std::uint64_t x) { return x && !(x & (x - 1)); }

void check_options(const ReadOptions& o) {
  auto bad = [](const std::string& m) { throw Error(Errc::kInvalidArgument, "ReadOptions: " + m); };
  if (o.queue_depth < 1 || o.queue_depth > 4096) bad("queue_depth must be 1..4096");
  if (!pow2(o.request_bytes) || o.request_bytes < kBlock || o.request_bytes > (64ull << 20))
    bad("request_bytes must be a power of two from 4 KiB to 64 MiB");
  if (o.window_bytes < o.request_bytes || o.window_bytes > (64ull << 30))
    bad("window_bytes must be at least request_bytes and at most 64 GiB");
  if (o.windows < 2 || o.windows > 64) bad("windows must be 2..64");
  if (o.pread_threads < 1 || o.pread_threads > 64) bad("pread_threads must be 1..64");
}

// Share of the file's pages in the page cache (0..1), or -1 when unknown.
double cached_fraction(int fd, std::uint64_t size) {
  if (size == 0) return 1.0;
  const long page = ::sysconf(_SC_PAGESIZE);
  void* m = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) return -1;
  const std::uint64_t pages = (size + page - 1) / page;
  std::vector<unsigned char> vec(std::min<std::uint64_t>(pages, 1u << 20));
  std::uint64_t resident = 0;
  bool ok = true;
  for (std::uint64_t p = 0; p < pages && ok; p += vec.size()) {
    const std::uint64_t n = std::min<std::uint64_t>(vec.size(), pages - p);
    if (::mincore(static_cast<char*>(m) + p * page, n * page, vec.data()) != 0) {
      ok = false;
      break;
    }
    for (std::uint64_t i = 0; i < n; ++i) resident += vec[i] & 1;
  }
  ::munmap(m, size);
  return ok ? static_cast<double>(resident) / static_cast<double>(pages) : -1;
}

// The O_DIRECT alignment the file system needs for this file (0: none
// offered), from statx where the kernel reports it.
std::uint64_t dio_alignment(int fd, std::string* why) {
#if defined(STATX_DIOALIGN)
  struct statx sx {};
  if (::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN)) {
    if (sx.stx_dio_offset_align == 0) {
      *why = "the file system does not support O_DIRECT";
      return 0;
    }
    const std::uint64_t a = std::max<std::uint64_t>({kBlock, sx.stx_dio_mem_align, sx.stx_dio_offset_align});
    if (a > kBlock) {
      *why = "the file system needs " + std::to_string(a) + "-byte O_DIRECT alignment";
      return 0;
    }
    return a;
  }
#endif
  (void)fd;
  (void)why;
  return kBlock;  // unknown: 4 KiB covers 512-byte and 4 KiB logical blocks
}

struct FileFds {
  int buffered = -1;  // the checkpoint's descriptor (not owned)
  int direct = -1;    // owned
  std::uint64_t size = 0;
  const std::string* what = nullptr;
};

// The O_DIRECT descriptors of one call, closed however the call ends (also
// when opening a later one throws).
struct FileFdsList : std::vector<FileFds> {
  FileFdsList() = default;
  FileFdsList(const FileFdsList&) = delete;
  FileFdsList& operator=(const FileFdsList&) = delete;
  ~FileFdsList() {
    for (FileFds& f : *this)
      if (f.direct >= 0) ::close(f.direct);
  }
};

// Anonymous memory for the staging windows: page-aligned (O_DIRECT). Not
// prefaulted: its pages fault in as the first reads land in them, on the
// threads doing the reads, while the caller copies earlier windows out
// (prefaulting 780 MiB up front took 0.7 s on the development VM before the
// first read started). Not MADV_HUGEPAGE: with THP defrag=madvise (a common
// default) the kernel compacts memory synchronously for it, which took
// seconds on a loaded machine.
struct Staging {
  std::byte* base = nullptr;
  std::uint64_t bytes = 0;
  Staging() = default;
  explicit Staging(std::uint64_t n) : bytes(n) {
    void* m = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED)
      throw Error(Errc::kSystem, "cannot allocate " + std::to_string(n >> 20) +
                                     " MiB of staging windows: lower --window-mb or --windows", errno);
    base = static_cast<std::byte*>(m);
  }
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  ~Staging() {
    if (base) ::munmap(base, bytes);
  }
};

}  // namespace

struct Reader::Impl {
  ReadOptions opt;
  // Declared before the engine: the engine goes first, after the reads in
  // flight have landed in the staging memory.
  std::unique_ptr<Staging> staging;
  std::vector<std::uint64_t> registered_layout;  // staging base and buffer offsets/lengths registered
  std::unique_ptr<ReadEngine> engine;
  std::string engine_why;  // why not io_uring
  bool engine_made = false;

  void make_engine() {
    if (engine_made) return;
    bool want_uring = opt.path != IoPath::kPread;
    if (opt.path == IoPath::kAuto) {
      const char* env = std::getenv("SHMCAST_NO_URING");
      if (env && std::strcmp(env, "1") == 0) {
        want_uring = false;
        engine_why = "SHMCAST_NO_URING=1";
      }
    }
    if (want_uring) {
      std::string w;
      engine = ReadEngine::make_uring(opt.queue_depth, &w);
      if (!engine) {
        if (opt.path != IoPath::kAuto)
          throw Error(Errc::kPermission, std::string("io_uring is not available (") + w + "), so --io " +
                                             std::string(io_path_name(opt.path)) +
                                             " cannot be honoured: use --io auto or --io pread "
                                             "(IoPath::kAuto / kPread)");
        engine_why = w;
      }
    }
    if (!engine) engine = ReadEngine::make_pread(opt.pread_threads);
    engine_made = true;
  }
};

namespace {

// One call's descriptors and choices, on the Reader's engine.
struct Session {
  const ReadOptions& opt;
  ReadEngine* engine;
  FileFdsList files;
  std::string path;  // "direct", "buffered", "direct+buffered", "pread"
  std::string why;   // fallbacks, joined with "; "
  std::chrono::steady_clock::time_point t0;
  detail::ReadEngineStats base;  // the engine's counters at the start

  void note(const std::string& s) {
    if (s.empty()) return;
    if (why.find(s) != std::string::npos) return;
    why += (why.empty() ? "" : "; ") + s;
  }

  Session(const Checkpoint::Impl& c, Reader::Impl& r)
      : opt(r.opt), t0(std::chrono::steady_clock::now()) {
    r.make_engine();
    engine = r.engine.get();
    base = engine->stats();
    note(r.engine_why);
    const ReadOptions& o = r.opt;
    files.resize(c.fds.size());
    std::size_t ndirect = 0;
    for (std::size_t i = 0; i < c.fds.size(); ++i) {
      FileFds& f = files[i];
      f.buffered = c.fds[i];
      f.size = c.files[i].header.file_bytes;
      f.what = &c.files[i].path;
      if (!engine->uring() || o.path == IoPath::kBuffered) continue;
      if (o.path == IoPath::kAuto) {
        const double cached = cached_fraction(f.buffered, f.size);
        if (cached >= 0.5) {
          note("page cache holds most of the checkpoint: buffered reads");
          continue;
        }
      }
      std::string w;
      if (dio_alignment(f.buffered, &w) == 0) {
        if (o.path == IoPath::kDirect)
          throw Error(Errc::kInvalidArgument, *f.what + ": " + w + ": use --io buffered or auto");
        note(w);
        continue;
      }
      int flags = O_RDONLY | O_CLOEXEC | O_DIRECT | O_NONBLOCK | O_NOCTTY;
      if (c.nofollow[i]) flags |= O_NOFOLLOW;
      const int fd = ::openat(c.dirfds[i], c.rel[i].c_str(), flags);
      if (fd < 0) {
        const int e = errno;
        const std::string m = std::string("O_DIRECT open refused (") + std::strerror(e) + ")";
        if (o.path == IoPath::kDirect)
          throw Error(e == EINVAL ? Errc::kInvalidArgument : Errc::kSystem,
                      *f.what + ": " + m + ": the file system may not support O_DIRECT; use --io buffered or auto", e);
        note(m);
        continue;
      }
      struct stat st {};
      const int fl = ::fcntl(fd, F_GETFL);
      if (::fstat(fd, &st) != 0 || st.st_dev != c.dev[i] || st.st_ino != c.ino[i] || fl < 0 ||
          ::fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0) {
        ::close(fd);
        throw Error(Errc::kCorrupt, *f.what + " was replaced after its header was validated: load it again");
      }
      f.direct = fd;
      ++ndirect;
    }
    if (!engine->uring())
      path = "pread";
    else if (ndirect == files.size() && !files.empty())
      path = "direct";
    else if (ndirect == 0)
      path = "buffered";
    else
      path = "direct+buffered";
  }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  ReadStats stats(std::uint64_t staging) const {
    const detail::ReadEngineStats s = engine->stats();
    ReadStats r;
    r.path = path;
    r.fallback_reason = why;
    const std::uint64_t fallbacks = s.direct_fallbacks - base.direct_fallbacks;
    if (fallbacks)
      r.fallback_reason += std::string(r.fallback_reason.empty() ? "" : "; ") + std::to_string(fallbacks) +
                           " O_DIRECT read(s) finished buffered";
    r.bytes = s.bytes - base.bytes;
    r.direct_bytes = s.direct_bytes - base.direct_bytes;
    r.requests = s.requests - base.requests;
    r.staging_bytes = staging;
    r.registered_buffers = engine->registered() && path.find("direct") != std::string::npos;
    r.queue_depth = engine->uring() ? opt.queue_depth : opt.pread_threads;
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return r;
  }

  // Requests for file bytes [begin, end) into dst, split at request_bytes.
  // Direct when `direct` (begin and dst aligned; the last request is
  // rounded up, the bytes past the end of the file are not needed).
  void add(std::vector<ReadReq>& out, std::size_t file, std::uint64_t begin, std::uint64_t end, std::byte* dst,
           bool direct) {
    const FileFds& f = files[file];
    for (std::uint64_t off = begin; off < end; off += opt.request_bytes) {
      ReadReq r;
      r.buffered_fd = f.buffered;
      r.direct = direct;
      r.fd = direct ? f.direct : f.buffered;
      r.offset = off;
      r.need = std::min(end, off + opt.request_bytes) - off;
      r.need = std::min<std::uint64_t>(r.need, f.size > off ? f.size - off : 0);
      r.len = direct ? align_up(r.need, kBlock) : r.need;
      r.dst = dst + (off - begin);
      r.what = f.what;
      if (r.need == 0) continue;
      out.push_back(r);
    }
  }
};

}  // namespace

Reader::Reader(const ReadOptions& options) : impl_(std::make_unique<Impl>()) {
  check_options(options);
  impl_->opt = options;
}
Reader::Reader(Reader&&) noexcept = default;
Reader& Reader::operator=(Reader&&) noexcept = default;
Reader::~Reader() = default;
const ReadOptions& Reader::options() const { return impl_->opt; }

ReadStats Reader::read_tensors(const Checkpoint& ckpt, std::span<void* const> dsts) {
  const Checkpoint::Impl& c = ckpt.impl();
  if (dsts.size() != c.tensors.size())
    throw Error(Errc::kInvalidArgument, "read_tensors: " + std::to_string(dsts.size()) + " destinations for " +
                                            std::to_string(c.tensors.size()) + " tensors");
  Session s(c, *impl_);
  std::vector<ReadReq> reqs;
  for (std::size_t i = 0; i < c.tensors.size(); ++i) {
    if (!dsts[i]) continue;
    const TensorEntry& t = c.tensors[i];
    auto* dst = static_cast<std::byte*>(dsts[i]);
    const std::uint64_t end = t.offset + t.nbytes;
    const FileFds& f = s.files[t.file];
    const auto addr = reinterpret_cast<std::uintptr_t>(dst);
    // O_DIRECT straight into dst for the blocks of the tensor whose place in
    // dst is block-aligned too; the partial blocks at its ends through the
    // page cache, also straight into dst.
    if (f.direct >= 0 && (addr - t.offset) % kBlock == 0) {
      const std::uint64_t a = align_up(t.offset, kBlock), b = align_down(end, kBlock);
      if (a < b) {
        s.add(reqs, t.file, t.offset, a, dst, false);
        s.add(reqs, t.file, a, b, dst + (a - t.offset), true);
        s.add(reqs, t.file, b, end, dst + (b - t.offset), false);
        continue;
      }
    }
    s.add(reqs, t.file, t.offset, end, dst, false);
  }
  // One batch: wait() returns only once every read of it has ended.
  s.engine->wait(s.engine->submit(std::move(reqs)));
  return s.stats(0);
}

ReadStats Reader::stream_tensors(const Checkpoint& ckpt, const std::function<void(std::size_t, const std::byte*)>& fn) {
  const Checkpoint::Impl& c = ckpt.impl();
  const ReadOptions& options = impl_->opt;
  // Windows: runs of consecutive tensors of one file whose block-aligned span
  // fits window_bytes. A tensor larger than that is a window of its own, read
  // into the one big buffer (Producer::write takes a tensor whole, so its
  // bytes must be contiguous); only one such window is in flight at a time.
  struct Window {
    std::uint32_t file;
    std::uint64_t begin, end;  // block-aligned file range
    std::size_t first, last;   // tensors [first, last)
    bool big;
    int buf = -1;              // staging buffer: 0..windows-1 normal, windows: the big one
    std::uint64_t ticket = 0;
  };
  std::vector<Window> wins;
  std::uint64_t big_cap = 0;
  for (std::size_t i = 0; i < c.tensors.size();) {
    const TensorEntry& t = c.tensors[i];
    Window w{t.file, align_down(t.offset, kBlock), align_up(t.offset + t.nbytes, kBlock), i, i + 1, false};
    w.big = w.end - w.begin > options.window_bytes;
    if (!w.big)
      for (std::size_t j = i + 1; j < c.tensors.size(); ++j) {
        const TensorEntry& u = c.tensors[j];
        const std::uint64_t e = align_up(u.offset + u.nbytes, kBlock);
        if (u.file != t.file || e - w.begin > options.window_bytes) break;
        w.end = e;
        w.last = j + 1;
      }
    if (w.big) big_cap = std::max(big_cap, align_up(w.end - w.begin, options.request_bytes));
    wins.push_back(w);
    i = w.last;
  }
  Session s(c, *impl_);
  if (wins.empty()) return s.stats(0);
  // Buffers: up to `windows` normal ones, as large as the largest normal
  // window (at most window_bytes, rounded up to a request: every buffer
  // starts block-aligned), then the big one if needed.
  std::uint64_t span = 0;
  std::size_t normal_windows = 0;
  for (const Window& w : wins)
    if (!w.big) {
      span = std::max(span, w.end - w.begin);
      ++normal_windows;
    }
  const std::uint64_t cap = normal_windows ? align_up(std::max<std::uint64_t>(span, 1), options.request_bytes) : 0;
  const auto nnormal = static_cast<std::uint32_t>(std::min<std::size_t>(options.windows, normal_windows));
  std::vector<std::uint64_t> buf_off, buf_len;
  for (std::uint32_t b = 0; b < nnormal; ++b) {
    buf_off.push_back(b * cap);
    buf_len.push_back(cap);
  }
  if (big_cap) {
    buf_off.push_back(nnormal * cap);
    buf_len.push_back(big_cap);
  }
  const std::uint64_t need = nnormal * cap + big_cap;
  // The Reader's staging, kept from call to call; larger when this
  // checkpoint needs more (no read is in flight between calls).
  if (!impl_->staging || impl_->staging->bytes < need) {
    impl_->registered_layout.clear();
    impl_->staging.reset();
    impl_->staging = std::make_unique<Staging>(need);
  }
  std::byte* const base = impl_->staging->base;

  // Registered buffers (for O_DIRECT reads; buffered reads gain nothing from
  // them): the normal windows, read again and again, in pieces of at most
  // 1 GiB (request_bytes divides 1 GiB, so no read straddles two pieces).
  // Not the big buffer: registering pins (faults in) every page before the
  // first read, and a tensor that large is read once per checkpoint.
  // Registered again only when the layout changes.
  std::vector<int> first_piece;
  std::vector<iovec> iov;
  for (std::size_t b = 0; b < nnormal; ++b) {
    first_piece.push_back(static_cast<int>(iov.size()));
    for (std::uint64_t p = 0; p < buf_len[b]; p += kRegisterPiece)
      iov.push_back({base + buf_off[b] + p, static_cast<std::size_t>(std::min(kRegisterPiece, buf_len[b] - p))});
  }
  bool fixed = false;
  if (options.register_buffers && s.path.find("direct") != std::string::npos) {
    std::vector<std::uint64_t> layout = {reinterpret_cast<std::uint64_t>(base)};
    layout.insert(layout.end(), buf_off.begin(), buf_off.end());
    layout.insert(layout.end(), buf_len.begin(), buf_len.end());
    if (iov.empty()) {
      fixed = false;
    } else if (layout == impl_->registered_layout && s.engine->registered()) {
      fixed = true;
    } else {
      std::string w;
      fixed = s.engine->register_buffers(iov, &w);
      impl_->registered_layout = fixed ? layout : std::vector<std::uint64_t>{};
      if (!fixed) s.note(w);
    }
  }

  // Submission in window order, as buffers free up: reads run ahead of fn by
  // up to `windows` windows.
  std::vector<int> free_normal;
  for (std::uint32_t b = nnormal; b > 0; --b) free_normal.push_back(static_cast<int>(b - 1));
  bool big_free = true;
  std::size_t next = 0, done = 0;
  auto submit_ready = [&] {
    while (next < wins.size()) {
      Window& w = wins[next];
      if (w.big) {
        if (!big_free) return;
        big_free = false;
        w.buf = static_cast<int>(nnormal);
      } else {
        if (free_normal.empty()) return;
        w.buf = free_normal.back();
        free_normal.pop_back();
      }
      std::byte* buf = base + buf_off[static_cast<std::size_t>(w.buf)];
      const FileFds& f = s.files[w.file];
      std::vector<ReadReq> reqs;
      if (f.direct >= 0) {
        s.add(reqs, w.file, w.begin, w.end, buf, true);
      } else {
        // Buffered: only the bytes the tensors hold, at their place in the window.
        const std::uint64_t b = c.tensors[w.first].offset;
        const std::uint64_t e = c.tensors[w.last - 1].offset + c.tensors[w.last - 1].nbytes;
        s.add(reqs, w.file, b, e, buf + (b - w.begin), false);
      }
      if (fixed && !w.big)
        for (ReadReq& r : reqs)
          r.buf_index = first_piece[static_cast<std::size_t>(w.buf)] +
                        static_cast<int>(static_cast<std::uint64_t>(r.dst - buf) / kRegisterPiece);
      w.ticket = s.engine->submit(std::move(reqs));
      ++next;
    }
  };
  try {
    submit_ready();
    for (; done < wins.size(); ++done) {
      Window& w = wins[done];
      // Submitted by now: every earlier window has handed its buffer back.
      if (done >= next) throw Error(Errc::kSystem, "stream_tensors: a window was never submitted");
      s.engine->wait(w.ticket);
      const std::byte* buf = base + buf_off[static_cast<std::size_t>(w.buf)];
      for (std::size_t i = w.first; i < w.last; ++i) fn(i, buf + (c.tensors[i].offset - w.begin));
      if (w.big)
        big_free = true;
      else
        free_normal.push_back(w.buf);
      submit_ready();
    }
  } catch (...) {
    // The windows read ahead still land in the staging memory: wait for
    // them before it can be reused (or freed).
    for (std::size_t k = done; k < next; ++k) {
      try {
        s.engine->wait(wins[k].ticket);
      } catch (...) {
      }
    }
    throw;
  }
  return s.stats(need);
}

ReadStats read_tensors(const Checkpoint& ckpt, std::span<void* const> dsts, const ReadOptions& options) {
  Reader r(options);
  return r.read_tensors(ckpt, dsts);
}

ReadStats stream_tensors(const Checkpoint& ckpt, const std::function<void(std::size_t, const std::byte*)>& fn,
                         const ReadOptions& options) {
  Reader r(options);
  return r.stream_tensors(ckpt, fn);
}

void drop_page_cache(const Checkpoint& ckpt) noexcept {
  for (int fd : ckpt.impl().fds)
    if (fd >= 0) ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
}

}  // namespace shmcast::safetensors
