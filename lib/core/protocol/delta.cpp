// The delta codec on the host; see delta.hpp and docs/protocol.md ("Delta
// encoding"). Every load from a tensor or a blob goes through memcpy, so no
// pointer needs any alignment.
#include "protocol/delta.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

#include "base/checks.hpp"
#include "protocol/delta_launch.hpp"
#include "protocol/selection.hpp"

namespace shmcast::detail::delta {

namespace {

using u8 = std::uint8_t;

constexpr std::uint64_t kBytesPerThread = 8ull << 20;
constexpr unsigned kMaxThreads = 8;

std::uint64_t load64(const u8* p) {
  std::uint64_t x;
  std::memcpy(&x, p, 8);
  return x;
}
// The first k (< 8) bytes at p as a little-endian word, zero-extended.
std::uint64_t load_partial(const u8* p, unsigned k) {
  std::uint64_t x = 0;
  for (unsigned i = 0; i < k; ++i) x |= static_cast<std::uint64_t>(p[i]) << (8 * i);
  return x;
}

[[noreturn]] void corrupt(const std::string& why) {
  throw Error(Errc::kCorrupt, "delta blob rejected: " + why +
                                  " (the delta is damaged or not one for this tensor: ask the producer for a full sync)");
}

[[noreturn]] void bad_arg(const std::string& why) { throw Error(Errc::kInvalidArgument, "delta codec: " + why); }

void require_width(std::uint32_t w) {
  if (!valid_width(w)) bad_arg("element width " + std::to_string(w) + " is not 1, 2, 4 or 8 bytes");
}

std::uint64_t checked_bytes(std::uint32_t w, std::uint64_t n) {
  std::uint64_t bytes = 0;
  if (!checked_mul(n, w, &bytes) || bytes > limits::kMaxStreamBytes)
    bad_arg(std::to_string(n) + " elements of " + std::to_string(w) + " bytes exceed the 64 TiB tensor limit");
  return bytes;
}

// Runs fn(first, last) over [0, count) split in `threads` contiguous ranges,
// the last one on the calling thread; rethrows the first exception. Falls
// back to fewer threads when one cannot be started.
template <class F>
void parallel_ranges(std::uint64_t count, unsigned threads, F&& fn) {
  if (threads <= 1 || count <= 1) {
    if (count > 0) fn(std::uint64_t{0}, count);
    return;
  }
  if (threads > count) threads = static_cast<unsigned>(count);
  std::vector<std::thread> pool;
  std::vector<std::exception_ptr> errors(threads);
  const std::uint64_t per = count / threads, extra = count % threads;
  auto range = [&](unsigned t, std::uint64_t* a, std::uint64_t* e) {
    *a = t * per + std::min<std::uint64_t>(t, extra);
    *e = *a + per + (t < extra ? 1 : 0);
  };
  unsigned started = 0;
  for (unsigned t = 0; t + 1 < threads; ++t) {
    std::uint64_t a, e;
    range(t, &a, &e);
    try {
      pool.emplace_back([&fn, &errors, t, a, e] {
        try {
          fn(a, e);
        } catch (...) {
          errors[t] = std::current_exception();
        }
      });
      ++started;
    } catch (const std::system_error&) {
      break;  // no more threads: the caller does the rest
    }
  }
  // The caller takes every range that has no thread.
  std::uint64_t a0, e0, a1, e1;
  range(started, &a0, &e0);
  range(threads - 1, &a1, &e1);
  try {
    fn(a0, e1);
  } catch (...) {
    errors[threads - 1] = std::current_exception();
  }
  for (auto& th : pool) th.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

// ---- plan: count and checksum one block

template <int W>
void count_block(const u8* base, const u8* next, std::uint64_t n, std::uint64_t b, std::uint32_t* count,
                 std::uint64_t* sum) {
  const std::uint64_t len = block_len(n, b);
  const std::uint64_t byte0 = b * kBlockElems * W, bytes = len * W, words = bytes / 8, word0 = byte0 / 8;
  std::uint32_t c = 0;
  std::uint64_t s = 0;
  const u8* pn = next + byte0;
  const u8* pb = base + byte0;
  for (std::uint64_t k = 0; k < words; ++k) {
    const std::uint64_t x = load64(pn + 8 * k), y = load64(pb + 8 * k);
    s += checksum_term(word0 + k, x);
    c += static_cast<std::uint32_t>(lanes_nonzero<W>(x ^ y));  // no branch: changes fall anywhere
  }
  if (const unsigned tail = static_cast<unsigned>(bytes % 8)) {
    const std::uint64_t x = load_partial(pn + 8 * words, tail), y = load_partial(pb + 8 * words, tail);
    s += checksum_term(word0 + words, x);
    c += static_cast<std::uint32_t>(lanes_nonzero<W>(x ^ y));
  }
  *count = c;
  *sum = s;
}

template <int W>
void count_range(const u8* base, const u8* next, std::uint64_t n, std::uint64_t b0, std::uint64_t b1,
                 std::uint32_t* counts, std::uint64_t* sum) {
  std::uint64_t s = 0;
  for (std::uint64_t b = b0; b < b1; ++b) {
    std::uint64_t bs = 0;
    count_block<W>(base, next, n, b, &counts[b], &bs);
    s += bs;
  }
  *sum = s;
}

// Calls fn(j) for every element j of block b whose word differs, in order.
template <int W, class F>
void for_changed(const u8* base, const u8* next, std::uint64_t n, std::uint64_t b, F&& fn) {
  const std::uint64_t len = block_len(n, b);
  const std::uint64_t byte0 = b * kBlockElems * W, bytes = len * W, words = (bytes + 7) / 8;
  constexpr unsigned per = 8 / W;
  for (std::uint64_t k = 0; k < words; ++k) {
    const unsigned have = static_cast<unsigned>(std::min<std::uint64_t>(8, bytes - 8 * k));
    const std::uint64_t x = have == 8 ? load64(next + byte0 + 8 * k) : load_partial(next + byte0 + 8 * k, have);
    const std::uint64_t y = have == 8 ? load64(base + byte0 + 8 * k) : load_partial(base + byte0 + 8 * k, have);
    // The changed lanes' top bits, lowest lane first.
    for (std::uint64_t m = lane_mask<W>(x ^ y); m != 0; m &= m - 1)
      fn(k * per + static_cast<unsigned>(__builtin_ctzll(m)) / (8 * W));
  }
}

// ---- encode one block

template <int W>
void encode_block(const Plan& p, u8* base, const u8* next, u8* payload, std::uint64_t b) {
  const std::uint64_t n = p.n, len = block_len(n, b), e0 = b * kBlockElems;
  const std::uint32_t count = p.counts[b];
  const std::uint32_t kind = kind_of(count, len, W);
  if (kind == kUnchanged) return;
  u8* area = payload + p.offsets[b];
  const std::uint64_t size = area_bytes(kind, count, len, W);
  std::memset(area, 0, size);  // padding (and the bitmap) start zero
  if (kind == kDense) {
    std::memcpy(area, next + e0 * W, len * W);
    std::memcpy(base + e0 * W, next + e0 * W, len * W);
    return;
  }
  u8* vals = area + (kind == kSparse ? align16(2 * std::uint64_t{count}) : bitmap_head_bytes(len));
  std::uint32_t k = 0;
  bool overflow = false;
  // for_changed compares whole words before it calls back, so the base may
  // take each new value at once.
  for_changed<W>(base, next, n, b, [&](std::uint64_t j) {
    if (k == count) {
      overflow = true;
      return;
    }
    if (kind == kSparse) {
      const auto idx = static_cast<std::uint16_t>(j);
      std::memcpy(area + 2 * std::uint64_t{k}, &idx, 2);
    } else {
      area[j / 8] = static_cast<u8>(area[j / 8] | (1u << (j % 8)));
    }
    std::memcpy(vals + std::uint64_t{k} * W, next + (e0 + j) * W, W);
    std::memcpy(base + (e0 + j) * W, next + (e0 + j) * W, W);
    ++k;
  });
  if (overflow || k != count)
    bad_arg("block " + std::to_string(b) + " has other changes than plan() counted: the tensors changed between "
            "plan() and encode() (the base is now partly updated: send a full sync)");
}

template <int W>
void encode_range(const Plan& p, u8* base, const u8* next, u8* payload, std::uint64_t b0, std::uint64_t b1) {
  for (std::uint64_t b = b0; b < b1; ++b) encode_block<W>(p, base, next, payload, b);
}

// ---- validate one block's area

// Empty when block b's area (the entry was checked) is well-formed.
std::string check_area(const u8* payload, const Entry& e, std::uint64_t n, std::uint64_t w, std::uint64_t b) {
  const std::uint64_t len = block_len(n, b);
  const std::uint32_t kind = kind_of(e.count, len, w);
  const u8* area = payload + e.offset;
  const std::uint64_t size = area_bytes(kind, e.count, len, w);
  auto zero = [&](std::uint64_t from, std::uint64_t to) {
    for (std::uint64_t i = from; i < to; ++i)
      if (area[i] != 0) return false;
    return true;
  };
  const std::string at = "block " + std::to_string(b);
  switch (kind) {
    case kSparse: {
      const std::uint64_t ib = 2 * std::uint64_t{e.count};
      std::uint64_t prev = 0;
      for (std::uint32_t k = 0; k < e.count; ++k) {
        std::uint16_t idx;
        std::memcpy(&idx, area + 2 * k, 2);
        if (idx >= len) return at + ": index " + std::to_string(idx) + " past its " + std::to_string(len) + " elements";
        if (k > 0 && idx <= prev) return at + ": indices not strictly increasing";
        prev = idx;
      }
      if (!zero(ib, align16(ib)) || !zero(align16(ib) + e.count * w, size)) return at + ": non-zero padding";
      return {};
    }
    case kBitmap: {
      const std::uint64_t words = (len + 63) / 64;
      std::uint64_t ones = 0;
      for (std::uint64_t k = 0; k < words; ++k) {
        std::uint64_t x = load64(area + 8 * k);
        const std::uint64_t valid = len - 64 * k >= 64 ? ~0ull : (1ull << (len - 64 * k)) - 1;
        if (x & ~valid) return at + ": bitmap bits past its " + std::to_string(len) + " elements";
        ones += static_cast<std::uint64_t>(popcount64(x));
      }
      if (ones != e.count)
        return at + ": bitmap has " + std::to_string(ones) + " bits for a count of " + std::to_string(e.count);
      const std::uint64_t head = bitmap_head_bytes(len);
      if (!zero(8 * words, head) || !zero(head + e.count * w, size)) return at + ": non-zero padding";
      return {};
    }
    case kDense:
      if (!zero(len * w, size)) return at + ": non-zero padding";
      return {};
    default:
      return {};
  }
}

// The header and table of `blob`, checked: the table copied into `table`.
Header validate_head(std::span<const std::byte> blob, std::uint32_t w, std::uint64_t n, std::vector<Entry>* table) {
  const Header h = read_header(blob, w, n);
  const std::uint64_t blocks = h.blocks;
  const u8* p = reinterpret_cast<const u8*>(blob.data());
  table->resize(blocks);
  if (blocks > 0) std::memcpy(table->data(), p + kHeaderBytes, blocks * kEntryBytes);
  std::uint64_t at = 0, changed = 0;
  for (std::uint64_t b = 0; b < blocks; ++b) {
    const Entry& e = (*table)[b];
    const std::uint64_t len = block_len(n, b);
    const std::string where = "table entry " + std::to_string(b);
    if (e.reserved != 0) corrupt(where + ": reserved field is not zero");
    if (e.count > len) corrupt(where + ": count " + std::to_string(e.count) + " exceeds its " + std::to_string(len) +
                               " elements");
    if (e.offset != at) corrupt(where + ": offset " + std::to_string(e.offset) + ", expected " + std::to_string(at));
    const std::uint64_t size = area_bytes(kind_of(e.count, len, w), e.count, len, w);
    if (size > h.payload_bytes - at) corrupt(where + ": its area runs past the payload");
    at += size;
    changed += e.count;
  }
  if (at != h.payload_bytes)
    corrupt("the blocks' areas end at " + std::to_string(at) + ", the payload is " + std::to_string(h.payload_bytes) +
            " bytes");
  if (changed != h.changed)
    corrupt("the counts add up to " + std::to_string(changed) + ", the header says " + std::to_string(h.changed));
  return h;
}

// ---- apply

// Calls fn(j0, dst_elem, count) for each run of elements [j0, j0 + count) of
// the piece range [e, end) that the map selects (contiguous in both).
template <class F>
void for_runs(const SliceMap& m, std::uint64_t e, std::uint64_t end, F&& fn) {
  if (m.identity) {
    if (e < end) fn(e, e, end - e);
    return;
  }
  while (e < end) {
    if (e < m.src0) {
      e = m.src0;
      continue;
    }
    const std::uint64_t t = e - m.src0, o = t / m.s_outer;
    if (o >= m.outer) return;
    const std::uint64_t t2 = t - o * m.s_outer, r = t2 / m.s_row;
    if (r >= m.rows) {
      e = m.src0 + (o + 1) * m.s_outer;
      continue;
    }
    const std::uint64_t c = t2 - r * m.s_row;
    if (c >= m.width) {
      e += m.s_row - c;
      continue;
    }
    const std::uint64_t run = std::min(m.width - c, end - e);
    fn(e, m.dst0 + o * m.d_outer + r * m.d_row + c, run);
    e += run;
  }
}

template <int W>
void apply_block(const u8* payload, const Entry& e, std::uint64_t n, std::uint64_t b, const SliceMap& m, u8* dst,
                 std::atomic<bool>* moved) {
  const std::uint64_t len = block_len(n, b), e0 = b * kBlockElems;
  const std::uint32_t kind = kind_of(e.count, len, W);
  const u8* area = payload + e.offset;
  auto put = [&](std::uint64_t j, const u8* val) {
    std::uint64_t d;
    if (map_element(m, e0 + j, &d)) std::memcpy(dst + d * W, val, W);
  };
  switch (kind) {
    case kSparse: {
      const u8* vals = area + align16(2 * std::uint64_t{e.count});
      for (std::uint32_t k = 0; k < e.count; ++k) {
        std::uint16_t idx;
        std::memcpy(&idx, area + 2 * k, 2);
        if (idx >= len) {  // validated, so the blob changed since
          moved->store(true, std::memory_order_relaxed);
          return;
        }
        put(idx, vals + std::uint64_t{k} * W);
      }
      return;
    }
    case kBitmap: {
      const u8* vals = area + bitmap_head_bytes(len);
      std::uint32_t k = 0;
      for (std::uint64_t wd = 0; wd < (len + 63) / 64; ++wd) {
        std::uint64_t x = load64(area + 8 * wd);
        const std::uint64_t valid = len - 64 * wd >= 64 ? ~0ull : (1ull << (len - 64 * wd)) - 1;
        x &= valid;
        while (x != 0) {
          const unsigned bit = static_cast<unsigned>(__builtin_ctzll(x));
          x &= x - 1;
          if (k == e.count) {
            moved->store(true, std::memory_order_relaxed);
            return;
          }
          put(64 * wd + bit, vals + std::uint64_t{k++} * W);
        }
      }
      return;
    }
    case kDense:
      for_runs(m, e0, e0 + len, [&](std::uint64_t j0, std::uint64_t d, std::uint64_t cnt) {
        std::memcpy(dst + d * W, area + (j0 - e0) * W, cnt * W);
      });
      return;
    default:
      return;
  }
}

template <int W>
void apply_range(const u8* payload, const std::vector<Entry>& table, std::uint64_t n, const SliceMap& m, u8* dst,
                 std::uint64_t b0, std::uint64_t b1, std::atomic<bool>* moved) {
  for (std::uint64_t b = b0; b < b1; ++b) apply_block<W>(payload, table[b], n, b, m, dst, moved);
}

template <class F>
void by_width(std::uint32_t w, F&& f) {
  switch (w) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    default: require_width(w);
  }
}

DType dtype_of_width(std::uint32_t w) {
  switch (w) {
    case 1: return DType::kU8;
    case 2: return DType::kU16;
    case 4: return DType::kU32;
    default: return DType::kU64;
  }
}

}  // namespace

// ---------------------------------------------------------------- sizes

std::uint64_t head_bytes(std::uint64_t n) { return head_bytes_for(block_count(n)); }

std::uint64_t max_blob_bytes(std::uint32_t w, std::uint64_t n) {
  require_width(w);
  checked_bytes(w, n);
  const std::uint64_t blocks = block_count(n);
  std::uint64_t total = head_bytes_for(blocks);
  if (blocks > 0) total += (blocks - 1) * dense_bytes(kBlockElems, w) + dense_bytes(block_len(n, blocks - 1), w);
  return total;
}

std::uint32_t elem_width(DType dtype) {
  const std::size_t z = dtype_size(dtype);
  if (z == 1 || z == 2 || z == 4 || z == 8) return static_cast<std::uint32_t>(z);
  return z > 8 && z % 8 == 0 ? 8 : 1;
}

bool piece_fits(DType dtype, std::uint64_t logical, std::uint64_t wire) {
  const std::uint32_t w = elem_width(dtype);
  if (logical % w != 0 || logical > limits::kMaxStreamBytes) return false;
  const std::uint64_t n = logical / w;
  return wire >= head_bytes(n) && wire <= max_blob_bytes(w, n);
}

unsigned threads_for(std::uint64_t bytes) {
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  const std::uint64_t by_size = bytes / kBytesPerThread;
  return static_cast<unsigned>(std::max<std::uint64_t>(1, std::min<std::uint64_t>({hw, kMaxThreads, by_size})));
}

// ---------------------------------------------------------------- checksum

std::uint64_t checksum(const void* data, std::uint64_t bytes) {
  if (bytes == 0) return checksum_final(0, 0);
  const u8* p = static_cast<const u8*>(data);
  const std::uint64_t words = bytes / 8;
  const unsigned threads = threads_for(bytes);
  std::vector<std::uint64_t> sums(threads, 0);
  std::atomic<unsigned> slot{0};
  parallel_ranges(words, threads, [&](std::uint64_t a, std::uint64_t e) {
    std::uint64_t s = 0;
    for (std::uint64_t i = a; i < e; ++i) s += checksum_term(i, load64(p + 8 * i));
    sums[slot.fetch_add(1, std::memory_order_relaxed)] = s;
  });
  std::uint64_t s = 0;
  for (std::uint64_t x : sums) s += x;
  if (const unsigned tail = static_cast<unsigned>(bytes % 8)) s += checksum_term(words, load_partial(p + 8 * words, tail));
  return checksum_final(s, bytes);
}

std::uint64_t checksum(const SliceMap& m, const void* dst, std::uint32_t w) {
  require_width(w);
  if (!map_holds_piece(m)) bad_arg("a piece's checksum needs a selection that holds the whole piece");
  const std::uint64_t bytes = checked_bytes(w, m.n);
  const u8* d = static_cast<const u8*>(dst);
  if (map_contiguous(m)) return checksum(m.n > 0 ? d + m.dst0 * w : nullptr, bytes);
  // Run by run (outer, then rows): run k holds the piece's bytes [k R, (k +
  // 1) R). Each word is summed by the run where it starts; one that crosses
  // into the next run is gathered through the map.
  const std::uint64_t R = m.width * w, runs = m.outer * m.rows;
  const unsigned threads = threads_for(bytes);
  std::vector<std::uint64_t> sums(threads, 0);
  std::atomic<unsigned> slot{0};
  parallel_ranges(runs, threads, [&](std::uint64_t k0, std::uint64_t k1) {
    std::uint64_t s = 0;
    for (std::uint64_t k = k0; k < k1; ++k) {
      const std::uint64_t o = k / m.rows, r = k - o * m.rows;
      const u8* run = d + (m.dst0 + o * m.d_outer + r * m.d_row) * w;
      const std::uint64_t first = k * R, end = first + R;
      std::uint64_t i = (first + 7) / 8;
      // The words inside the run, then the one that crosses into the next
      // run or is the piece's last, short one.
      for (const std::uint64_t whole = end / 8; i < whole; ++i) s += checksum_term(i, load64(run + (8 * i - first)));
      for (; 8 * i < end; ++i) {
        const std::uint64_t q = 8 * i - first;
        const unsigned len = static_cast<unsigned>(std::min<std::uint64_t>(8, bytes - 8 * i));
        std::uint64_t x;
        if (q + len <= R)
          x = len == 8 ? load64(run + q) : load_partial(run + q, len);
        else
          x = mapped_word(m, d, w, i, len);
        s += checksum_term(i, x);
      }
    }
    sums[slot.fetch_add(1, std::memory_order_relaxed)] = s;
  });
  std::uint64_t s = 0;
  for (std::uint64_t x : sums) s += x;
  return checksum_final(s, bytes);
}

// ---------------------------------------------------------------- encode

Plan plan(const void* base, const void* next, std::uint32_t w, std::uint64_t n) {
  require_width(w);
  const std::uint64_t bytes = checked_bytes(w, n);
  Plan p;
  p.w = w;
  p.n = n;
  const std::uint64_t blocks = block_count(n);
  p.counts.assign(blocks, 0);
  p.offsets.assign(blocks, 0);
  const unsigned threads = threads_for(2 * bytes);
  std::vector<std::uint64_t> sums(threads, 0);
  std::atomic<unsigned> slot{0};
  const u8* pb = static_cast<const u8*>(base);
  const u8* pn = static_cast<const u8*>(next);
  by_width(w, [&](auto W) {
    parallel_ranges(blocks, threads, [&](std::uint64_t b0, std::uint64_t b1) {
      std::uint64_t s = 0;
      count_range<W.value>(pb, pn, n, b0, b1, p.counts.data(), &s);
      sums[slot.fetch_add(1, std::memory_order_relaxed)] = s;
    });
  });
  std::uint64_t s = 0;
  for (std::uint64_t x : sums) s += x;
  p.checksum = checksum_final(s, bytes);
  std::uint64_t at = 0;
  for (std::uint64_t b = 0; b < blocks; ++b) {
    const std::uint64_t len = block_len(n, b);
    p.offsets[b] = at;
    at += area_bytes(kind_of(p.counts[b], len, w), p.counts[b], len, w);
    p.changed += p.counts[b];
  }
  p.payload_bytes = at;
  return p;
}

void encode(const Plan& p, void* base, const void* next, void* out, std::uint64_t out_bytes) {
  require_width(p.w);
  checked_bytes(p.w, p.n);
  const std::uint64_t blocks = block_count(p.n);
  if (p.counts.size() != blocks || p.offsets.size() != blocks) bad_arg("the plan does not match its element count");
  if (out_bytes != p.blob_bytes())
    bad_arg("the output holds " + std::to_string(out_bytes) + " bytes, the blob is " + std::to_string(p.blob_bytes()));
  u8* o = static_cast<u8*>(out);
  Header h{};
  h.magic = kMagic;
  h.format = kFormat;
  h.elem_bytes = static_cast<std::uint16_t>(p.w);
  h.block_elems = kBlockElems;
  h.elems = p.n;
  h.blocks = blocks;
  h.payload_bytes = p.payload_bytes;
  h.checksum = p.checksum;
  h.changed = p.changed;
  std::memcpy(o, &h, sizeof h);
  for (std::uint64_t b = 0; b < blocks; ++b) {
    const Entry e{p.offsets[b], p.counts[b], 0};
    std::memcpy(o + kHeaderBytes + b * kEntryBytes, &e, sizeof e);
  }
  u8* payload = o + head_bytes_for(blocks);
  u8* pb = static_cast<u8*>(base);
  const u8* pn = static_cast<const u8*>(next);
  // Threads by the bytes encode reads: the blocks that changed, both sides.
  std::uint64_t touched = 0;
  for (std::uint32_t c : p.counts) touched += c != 0 ? 1 : 0;
  const unsigned threads = threads_for(2 * touched * kBlockElems * p.w);
  by_width(p.w, [&](auto W) {
    parallel_ranges(blocks, threads, [&](std::uint64_t b0, std::uint64_t b1) {
      encode_range<W.value>(p, pb, pn, payload, b0, b1);
    });
  });
}

// ---------------------------------------------------------------- decode

Header read_header(std::span<const std::byte> blob, std::uint32_t w, std::uint64_t n) {
  require_width(w);
  checked_bytes(w, n);
  if (blob.size() < kHeaderBytes)
    corrupt(std::to_string(blob.size()) + " bytes cannot hold its " + std::to_string(kHeaderBytes) + "-byte header");
  Header h;
  std::memcpy(&h, blob.data(), sizeof h);
  if (h.magic != kMagic) corrupt("bad magic " + printf_u64("0x%08llx", h.magic));
  if (h.format != kFormat) corrupt("format " + std::to_string(h.format) + ", this build reads format 1");
  if (h.elem_bytes != w)
    corrupt("elements of " + std::to_string(h.elem_bytes) + " bytes, the tensor's are " + std::to_string(w));
  if (h.block_elems != kBlockElems) corrupt("blocks of " + std::to_string(h.block_elems) + " elements, not 4096");
  if (h.reserved0 != 0 || h.reserved1 != 0) corrupt("reserved header fields are not zero");
  if (h.elems != n) corrupt(std::to_string(h.elems) + " elements, the tensor has " + std::to_string(n));
  if (h.blocks != block_count(n))
    corrupt(std::to_string(h.blocks) + " blocks, " + std::to_string(n) + " elements make " +
            std::to_string(block_count(n)));
  const std::uint64_t head = head_bytes_for(h.blocks);
  if (blob.size() < head || h.payload_bytes != blob.size() - head)
    corrupt("a payload of " + std::to_string(h.payload_bytes) + " bytes in a blob of " + std::to_string(blob.size()) +
            " (header and table: " + std::to_string(head) + ")");
  return h;
}

SliceMap whole_map(std::uint64_t n) {
  SliceMap m{};
  m.n = m.dst_elems = n;
  m.outer = m.rows = 1;
  m.width = n;
  m.s_outer = m.s_row = n > 0 ? n : 1;
  m.d_outer = m.d_row = n;
  m.identity = 1;
  return m;
}

bool covers_piece(const SliceMap& m) { return map_contiguous(m); }

bool holds_piece(const SliceMap& m) { return map_holds_piece(m); }

SliceMap slice_map(std::span<const std::int64_t> shape, std::uint32_t w, const Selection& piece,
                   const Selection& sel) {
  require_width(w);
  if (shape.size() > static_cast<std::size_t>(kMaxDims)) bad_arg("more than 8 dimensions");
  TensorInfo t;
  t.dtype = dtype_of_width(w);
  t.shape.assign(shape.begin(), shape.end());
  if (!shape_bytes(t.dtype, t.shape.data(), t.shape.size(), &t.nbytes) || t.nbytes > limits::kMaxStreamBytes)
    bad_arg("the shape has a negative dimension or more than 64 TiB of elements");
  std::string why = selection_problem(t, piece);
  if (!why.empty()) bad_arg("the piece: " + why);
  why = selection_problem(t, sel);
  if (!why.empty()) bad_arg("the selection: " + why);
  ShardInfo p;
  p.dim = piece.dim;
  p.start = piece.start;
  p.length = piece.length;
  p.nbytes = selection_bytes(t, piece);
  const std::uint64_t n = p.nbytes / w, dst_elems = selection_bytes(t, sel) / w;
  if (piece.dim < 0 && sel.dim < 0) return whole_map(n);
  std::vector<Block> blocks;
  plan_piece(t, p, sel, &blocks);
  SliceMap m{};
  m.n = n;
  m.dst_elems = dst_elems;
  if (blocks.empty()) {  // nothing of the piece is selected
    m.s_outer = m.s_row = 1;
    return m;
  }
  const Block& b0 = blocks.front();
  m.src0 = b0.src / w;
  m.dst0 = b0.dst / w;
  m.width = b0.width / w;
  m.rows = b0.rows;
  m.s_row = b0.rows > 1 ? b0.src_pitch / w : m.width;
  m.d_row = b0.rows > 1 ? b0.dst_pitch / w : m.width;
  m.outer = blocks.size();
  m.s_outer = blocks.size() > 1 ? (blocks[1].src - b0.src) / w : std::max<std::uint64_t>(n, 1);
  m.d_outer = blocks.size() > 1 ? (blocks[1].dst - b0.dst) / w : 0;
  for (std::size_t o = 0; o < blocks.size(); ++o) {
    const Block& b = blocks[o];
    if (b.src != b0.src + o * m.s_outer * w || b.dst != b0.dst + o * m.d_outer * w || b.width != b0.width ||
        b.rows != b0.rows)
      bad_arg("internal: an irregular copy plan");  // plan_piece's blocks are regular by construction
  }
  if (m.s_row == 0) m.s_row = 1;
  if (m.outer == 1 && m.rows == 1 && m.width == n && m.src0 == 0 && m.dst0 == 0 && dst_elems == n) m.identity = 1;
  return m;
}

void apply(std::span<const std::byte> blob, std::uint32_t w, const SliceMap& m, void* dst, std::uint64_t dst_bytes,
           bool verify) {
  require_width(w);
  const std::uint64_t want = checked_bytes(w, m.dst_elems);
  if (dst_bytes != want)
    bad_arg("the destination holds " + std::to_string(dst_bytes) + " bytes, the selection " + std::to_string(want));
  if (verify && !holds_piece(m))
    bad_arg("a result can be verified only where the selection holds the whole piece");
  std::vector<Entry> table;
  const Header h = validate_head(blob, w, m.n, &table);
  const u8* payload = reinterpret_cast<const u8*>(blob.data()) + head_bytes_for(h.blocks);
  const std::uint64_t blocks = h.blocks;
  // Every area, before any write.
  const unsigned threads = threads_for(h.payload_bytes);
  {
    std::mutex mu;
    std::uint64_t first_bad = blocks;
    std::string why;
    parallel_ranges(blocks, threads, [&](std::uint64_t b0, std::uint64_t b1) {
      for (std::uint64_t b = b0; b < b1; ++b) {
        std::string r = check_area(payload, table[b], m.n, w, b);
        if (!r.empty()) {
          std::lock_guard<std::mutex> lock(mu);
          if (b < first_bad) first_bad = b, why = std::move(r);
          return;
        }
      }
    });
    if (first_bad < blocks) corrupt(why);
  }
  std::atomic<bool> moved{false};
  u8* d = static_cast<u8*>(dst);
  by_width(w, [&](auto W) {
    parallel_ranges(blocks, threads_for(2 * h.payload_bytes), [&](std::uint64_t b0, std::uint64_t b1) {
      apply_range<W.value>(payload, table, m.n, m, d, b0, b1, &moved);
    });
  });
  if (moved.load()) corrupt("it changed while it was applied (the destination is partly written)");
  if (verify) {  // an empty piece too: its checksum is checksum_final(0, 0)
    const std::uint64_t got = checksum(m, d, w);  // contiguous or strided, as the piece lands
    if (got != h.checksum)
      throw Error(Errc::kCorrupt, "delta result rejected: the checksum of the applied tensor is " +
                                      printf_u64("%016llx, the delta's %016llx", got, h.checksum) +
                                      " (the destination did not hold the delta's base, or bytes were damaged): ask "
                                      "the producer for a full sync");
  }
}

void apply(std::span<const std::byte> blob, std::uint32_t w, std::uint64_t n, void* dst, std::uint64_t dst_bytes,
           bool verify) {
  apply(blob, w, whole_map(n), dst, dst_bytes, verify);
}

void throw_for_status(std::uint32_t st) {
  if (st == 0) return;
  if (st & (kStPlanMismatch | kStOutTooSmall))
    throw Error(Errc::kInvalidArgument,
                std::string("CUDA delta codec: encode ") +
                    (st & kStOutTooSmall ? "had an output smaller than the planned blob, or a head that is not a plan "
                                           "of this tensor (nothing written)"
                                         : "found other changes than plan counted: the tensors changed between plan "
                                           "and encode (the base is partly updated: send a full sync)"));
  std::string why;
  auto add = [&](std::uint32_t bit, const char* text) {
    if (st & bit) why += std::string(why.empty() ? "" : "; ") + text;
  };
  add(kStBadHeader, "a header field is wrong (magic, format, width, block size, element or block count, payload size)");
  add(kStBadTable, "a table entry is wrong (reserved field, count, or offset)");
  add(kStBadIndices, "sparse indices not strictly increasing or past their block");
  add(kStBadBitmap, "a bitmap with bits past its block or another number of bits than its count");
  add(kStBadPadding, "a non-zero padding byte");
  add(kStBadChanged, "the counts do not add up to the header's");
  if (st & kStRejected)
    throw Error(Errc::kCorrupt, "delta blob rejected: " + why +
                                    " (the delta is damaged or not one for this tensor: ask the producer for a full "
                                    "sync; the destination was not written)");
  throw Error(Errc::kCorrupt,
              "delta result rejected: the checksum of the applied tensor is not the delta's (the destination did not "
              "hold the delta's base, or bytes were damaged): ask the producer for a full sync");
}

}  // namespace shmcast::detail::delta
