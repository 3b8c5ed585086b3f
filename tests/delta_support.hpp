// Helpers for the delta codec's tests (tests/unit/test_delta.cpp on the
// host, tests/gpu/test_delta_gpu.cpp on a GPU): random tensors with a given
// fraction of changed elements, a sample blob with every block kind and
// every padding, the malformed-blob classes made from it, and references for
// slices and the checksum written from docs/protocol.md §12.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "protocol/delta.hpp"

namespace delta_test {

namespace dl = shmcast::detail::delta;
using Bytes = std::vector<std::uint8_t>;
using shmcast::Selection;

inline std::span<const std::byte> as_span(const Bytes& b) {
  return {reinterpret_cast<const std::byte*>(b.data()), b.size()};
}

inline Bytes random_bytes(std::size_t n, std::mt19937_64& rng) {
  Bytes v(n);
  for (std::size_t i = 0; i < n; i += 8) {
    const std::uint64_t x = rng();
    std::memcpy(&v[i], &x, std::min<std::size_t>(8, n - i));
  }
  return v;
}

// next = base with each element changed with probability `frac` (a random
// non-zero xor, so a changed element always differs).
inline Bytes mutate(const Bytes& base, std::uint32_t w, double frac, std::mt19937_64& rng) {
  Bytes next = base;
  std::bernoulli_distribution pick(frac);
  const std::size_t n = base.size() / w;
  for (std::size_t e = 0; e < n; ++e) {
    if (!pick(rng)) continue;
    std::uint64_t x = 0;
    while (x == 0) x = rng() & (w == 8 ? ~0ull : (1ull << (8 * w)) - 1);
    for (std::uint32_t i = 0; i < w; ++i) next[e * w + i] ^= static_cast<std::uint8_t>(x >> (8 * i));
  }
  return next;
}

inline std::uint64_t changed_elements(const Bytes& a, const Bytes& b, std::uint32_t w) {
  std::uint64_t c = 0;
  for (std::size_t e = 0; e < a.size() / w; ++e) c += std::memcmp(&a[e * w], &b[e * w], w) != 0 ? 1 : 0;
  return c;
}

// The checksum, straight from docs/protocol.md, one word at a time.
inline std::uint64_t reference_checksum(const std::uint8_t* d, std::size_t size) {
  auto mix = [](std::uint64_t z) {
    z ^= z >> 30;
    z *= 0xbf58476d1ce4e5b9ull;
    z ^= z >> 27;
    z *= 0x94d049bb133111ebull;
    z ^= z >> 31;
    return z;
  };
  std::uint64_t s = 0;
  for (std::size_t i = 0; i * 8 < size; ++i) {
    std::uint64_t x = 0;
    for (std::size_t k = 0; k < 8 && i * 8 + k < size; ++k) x |= static_cast<std::uint64_t>(d[i * 8 + k]) << (8 * k);
    s += mix(x ^ (0x9e3779b97f4a7c15ull * (i + 1)));
  }
  return mix(s ^ mix(size + 0x6a09e667f3bcc909ull));
}
inline std::uint64_t reference_checksum(const Bytes& d) { return reference_checksum(d.data(), d.size()); }

// The host codec's blob of base -> next.
inline Bytes host_blob(const Bytes& base, const Bytes& next, std::uint32_t w) {
  Bytes b = base;
  const dl::Plan p = dl::plan(b.data(), next.data(), w, base.size() / w);
  Bytes blob(p.blob_bytes(), 0xee);
  dl::encode(p, b.data(), next.data(), blob.data(), blob.size());
  return blob;
}

inline dl::Header header_of(const Bytes& blob) {
  dl::Header h;
  std::memcpy(&h, blob.data(), sizeof h);
  return h;
}
inline dl::Entry entry_of(const Bytes& blob, std::uint64_t b) {
  dl::Entry e;
  std::memcpy(&e, blob.data() + dl::kHeaderBytes + b * dl::kEntryBytes, sizeof e);
  return e;
}

inline std::vector<std::int64_t> strides_of(const std::vector<std::int64_t>& shape) {
  std::vector<std::int64_t> s(shape.size(), 1);
  for (int d = static_cast<int>(shape.size()) - 2; d >= 0; --d) s[d] = s[d + 1] * shape[d + 1];
  return s;
}

// Element by element: a destination laid out as `sel` holding `full_new`'s
// elements where the logical position is in `piece`, `full_old`'s elsewhere.
inline Bytes reference_slice(const std::vector<std::int64_t>& shape, std::uint32_t w, const Bytes& full_old,
                             const Bytes& full_new, const Selection& piece, const Selection& sel) {
  auto qshape = shape;
  if (sel.dim >= 0) qshape[sel.dim] = sel.length;
  std::int64_t qn = 1;
  for (auto x : qshape) qn *= x;
  Bytes out(static_cast<std::size_t>(qn) * w);
  const auto fs = strides_of(shape), qs = strides_of(qshape);
  std::int64_t total = 1;
  for (auto x : shape) total *= x;
  std::vector<std::int64_t> c(shape.size());
  for (std::int64_t e = 0; e < total; ++e) {
    std::int64_t r = e;
    for (std::size_t d = 0; d < shape.size(); ++d) c[d] = r / fs[d], r %= fs[d];
    auto in = [&](const Selection& s) { return s.dim < 0 || (c[s.dim] >= s.start && c[s.dim] < s.start + s.length); };
    if (!in(sel)) continue;
    std::int64_t q = 0;
    for (std::size_t d = 0; d < shape.size(); ++d)
      q += (c[d] - (static_cast<int>(d) == sel.dim ? sel.start : 0)) * qs[d];
    const Bytes& src = in(piece) ? full_new : full_old;
    std::memcpy(&out[static_cast<std::size_t>(q) * w], &src[static_cast<std::size_t>(e) * w], w);
  }
  return out;
}

// A piece's own bytes (its rows, contiguous) out of the logical tensor.
inline Bytes piece_bytes(const std::vector<std::int64_t>& shape, std::uint32_t w, const Bytes& full,
                         const Selection& piece) {
  return reference_slice(shape, w, Bytes(full.size(), 0), full, Selection{}, piece);
}

// A random shape (1 to 3 dims; with `long_rows` 1 or 2 dims and a last dim
// up to 5000, so pieces span several blocks) and a random piece or
// selection of it (the whole tensor one time in `whole_one_in`).
inline std::vector<std::int64_t> random_shape(std::mt19937_64& rng, bool long_rows) {
  const int nd = 1 + static_cast<int>(rng() % (long_rows ? 2 : 3));
  std::vector<std::int64_t> shape;
  for (int d = 0; d < nd; ++d)
    shape.push_back(1 + static_cast<std::int64_t>(rng() % (long_rows && d == nd - 1 ? 5000 : 24)));
  return shape;
}
inline Selection random_rows(std::mt19937_64& rng, const std::vector<std::int64_t>& shape, int whole_one_in) {
  Selection s;
  if (rng() % whole_one_in == 0) return s;
  s.dim = static_cast<int>(rng() % shape.size());
  const std::int64_t ext = shape[s.dim];
  s.start = static_cast<std::int64_t>(rng() % (ext + 1));
  s.length = static_cast<std::int64_t>(rng() % (ext - s.start + 1));
  return s;
}

// A blob with every kind and every padding: w = 2, n = 3 * 4096 + 50.
// Block 0 sparse (3 changes), block 1 bitmap (500), block 2 dense (every
// element), block 3 (50 elements) bitmap (20: an 8-byte bitmap padded to 16).
struct Sample {
  static constexpr std::uint32_t w = 2;
  std::uint64_t n = 3 * 4096 + 50;
  Bytes base, next, blob;
};

inline Sample make_sample() {
  Sample s;
  std::mt19937_64 rng(99);
  s.base = random_bytes(s.n * 2, rng);
  s.next = s.base;
  auto change = [&](std::uint64_t e) { s.next[2 * e] = static_cast<std::uint8_t>(~s.next[2 * e]); };
  change(7);
  change(100);
  change(4000);
  for (std::uint64_t j = 0; j < 500; ++j) change(4096 + j * 8);
  for (std::uint64_t j = 0; j < 4096; ++j) change(2 * 4096 + j);
  for (std::uint64_t j = 0; j < 20; ++j) change(3 * 4096 + j * 2 + 1);
  s.blob = host_blob(s.base, s.next, 2);
  return s;
}

// One class of malformed blob: the sample's blob, damaged.
struct Damage {
  const char* name;
  std::function<void(Bytes&)> apply;
};

inline std::vector<Damage> damages(const Sample& s) {
  const std::uint64_t head = dl::head_bytes(s.n);
  const Bytes blob = s.blob;
  auto area = [head, blob](std::uint64_t b) { return head + entry_of(blob, b).offset; };
  auto put64 = [](Bytes& v, std::uint64_t off, std::uint64_t x) { std::memcpy(&v[off], &x, 8); };
  auto put32 = [](Bytes& v, std::uint64_t off, std::uint32_t x) { std::memcpy(&v[off], &x, 4); };
  auto put16 = [](Bytes& v, std::uint64_t off, std::uint16_t x) { std::memcpy(&v[off], &x, 2); };
  auto entry = [](std::uint64_t b) { return dl::kHeaderBytes + b * dl::kEntryBytes; };
  const std::uint32_t c0 = entry_of(blob, 0).count, c1 = entry_of(blob, 1).count;
  const std::uint64_t n = s.n;
  return {
      {"empty", [](Bytes& v) { v.clear(); }},
      {"shorter than the header", [](Bytes& v) { v.resize(63); }},
      {"shorter than the table", [=](Bytes& v) { v.resize(head - 1); }},
      {"one byte short", [](Bytes& v) { v.pop_back(); }},
      {"one byte long", [](Bytes& v) { v.push_back(0); }},
      {"magic", [](Bytes& v) { v[0] ^= 1; }},
      {"format", [=](Bytes& v) { put16(v, 4, 2); }},
      {"element width", [=](Bytes& v) { put16(v, 6, 4); }},
      {"block size", [=](Bytes& v) { put32(v, 8, 2048); }},
      {"reserved0", [=](Bytes& v) { put32(v, 12, 1); }},
      {"element count", [=](Bytes& v) { put64(v, 16, n + 1); }},
      {"block count", [=](Bytes& v) { put64(v, 24, 5); }},
      {"payload size", [=](Bytes& v) { put64(v, 32, header_of(v).payload_bytes - 16); }},
      {"reserved1", [=](Bytes& v) { put64(v, 56, 1); }},
      {"changed total", [=](Bytes& v) { put64(v, 48, header_of(v).changed + 1); }},
      {"entry reserved", [=](Bytes& v) { put32(v, entry(1) + 12, 1); }},
      {"count past the block", [=](Bytes& v) { put32(v, entry(3) + 8, 51); }},
      {"count changes the area size", [=](Bytes& v) { put32(v, entry(0) + 8, c0 + 20); }},
      {"first offset not 0", [=](Bytes& v) { put64(v, entry(0), 16); }},
      {"offset off by 16", [=](Bytes& v) { put64(v, entry(2), entry_of(v, 2).offset + 16); }},
      {"offset past the payload", [=](Bytes& v) { put64(v, entry(3), 1ull << 40); }},
      {"count 0 with an area", [=](Bytes& v) { put32(v, entry(0) + 8, 0); }},
      {"sparse indices decreasing", [=](Bytes& v) { put16(v, area(0), 200); }},
      {"sparse index repeated", [=](Bytes& v) { put16(v, area(0) + 2, 7); }},
      {"sparse index past the block", [=](Bytes& v) { put16(v, area(0) + 4, 4096); }},
      {"sparse index padding", [=](Bytes& v) { v[area(0) + 2 * c0] = 1; }},
      {"sparse value padding", [=](Bytes& v) { v[area(0) + 16 + 2 * c0] = 1; }},
      {"bitmap bit removed", [=](Bytes& v) { v[area(1)] ^= 1; }},
      {"bitmap bit added", [=](Bytes& v) { v[area(1)] ^= 2; }},
      {"bitmap value padding", [=](Bytes& v) { v[area(1) + 512 + 2 * c1] = 1; }},
      {"bitmap bit past a short block", [=](Bytes& v) { v[area(3) + 6] |= 0x80; }},  // element 55 of 50
      {"bitmap head padding", [=](Bytes& v) { v[area(3) + 8] = 1; }},
      {"bitmap value padding (short block)", [=](Bytes& v) { v[area(3) + 16 + 40] = 1; }},
  };
}

}  // namespace delta_test
