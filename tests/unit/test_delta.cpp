// The host delta codec (lib/core/protocol/delta.{hpp,cpp}, docs/protocol.md "Delta
// encoding"): randomized round trips against the new bytes themselves for
// every element width, change fraction and awkward size; slices against an
// element-by-element reference; every class of malformed blob rejected with
// the destination untouched; the content checksum against a reference
// written from the spec.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <random>
#include <thread>

#include "protocol/delta.hpp"
#include "delta_support.hpp"

using namespace shmcast;
using namespace shmcast::detail;
using namespace shmcast::detail::delta;

using namespace delta_test;

namespace {

struct Encoded {
  Plan plan;
  Bytes blob;
};

// Plans and encodes base -> next; checks that the base became next.
Encoded encode_pair(const Bytes& base, const Bytes& next, std::uint32_t w) {
  Bytes b = base;
  Encoded e;
  e.plan = plan(b.data(), next.data(), w, base.size() / w);
  e.blob.assign(e.plan.blob_bytes(), 0xee);
  encode(e.plan, b.data(), next.data(), e.blob.data(), e.blob.size());
  EXPECT_EQ(b, next) << "encode must leave the base equal to next";
  return e;
}

void expect_code(Errc code, const std::function<void()>& fn, const std::string& what) {
  try {
    fn();
    ADD_FAILURE() << what << ": no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << what << ": " << e.what();
  }
}

}  // namespace

// ---------------------------------------------------------------- round trips

TEST(Delta, RoundTripEveryWidthFractionAndAwkwardSize) {
  std::mt19937_64 rng(31);
  const std::uint64_t sizes[] = {0, 1, 2, 7, 63, 64, 65, 4095, 4096, 4097, 3 * 4096 + 17, 20000};
  const double fracs[] = {0.0, 0.005, 0.02, 0.3, 1.0};
  int cases = 0;
  for (std::uint32_t w : {1u, 2u, 4u, 8u})
    for (std::uint64_t n : sizes)
      for (double f : fracs) {
        const Bytes base = random_bytes(n * w, rng);
        const Bytes next = mutate(base, w, f, rng);
        const Encoded e = encode_pair(base, next, w);
        const Header h = header_of(e.blob);
        SCOPED_TRACE("w=" + std::to_string(w) + " n=" + std::to_string(n) + " f=" + std::to_string(f));
        EXPECT_EQ(h.changed, changed_elements(base, next, w));
        EXPECT_EQ(h.checksum, reference_checksum(next));
        EXPECT_EQ(e.blob.size(), head_bytes(n) + h.payload_bytes);
        EXPECT_LE(e.blob.size(), max_blob_bytes(w, n));
        Bytes dst = base;
        apply(as_span(e.blob), w, n, dst.data(), dst.size(), true);
        ASSERT_EQ(dst, next);
        // Encoding is deterministic.
        EXPECT_EQ(encode_pair(base, next, w).blob, e.blob);
        ++cases;
      }
  EXPECT_EQ(cases, 4 * 12 * 5);
}

TEST(Delta, EachBlockTakesTheSmallestKindAndTwoPercentBf16IsSmall) {
  // 2 % of bf16 elements at random positions: sparse blocks, the blob well
  // under 0.12 of the raw bytes (the bound).
  std::mt19937_64 rng(2);
  const std::uint64_t n = 64 * 4096;
  const Bytes base = random_bytes(n * 2, rng);
  const Encoded two = encode_pair(base, mutate(base, 2, 0.02, rng), 2);
  EXPECT_LT(static_cast<double>(two.blob.size()) / static_cast<double>(n * 2), 0.06);
  for (std::uint64_t b = 0; b < two.plan.blocks(); ++b) EXPECT_EQ(kind_of(entry_of(two.blob, b).count, 4096, 2), kSparse);
  // 30 %: bitmaps; everything: dense; nothing: header and table only.
  const Encoded thirty = encode_pair(base, mutate(base, 2, 0.3, rng), 2);
  for (std::uint64_t b = 0; b < thirty.plan.blocks(); ++b)
    EXPECT_EQ(kind_of(entry_of(thirty.blob, b).count, 4096, 2), kBitmap);
  Bytes all = base;
  for (auto& x : all) x = static_cast<std::uint8_t>(~x);
  const Encoded dense = encode_pair(base, all, 2);
  EXPECT_EQ(dense.blob.size(), max_blob_bytes(2, n));
  EXPECT_EQ(encode_pair(base, base, 2).blob.size(), head_bytes(n));
  // The rule itself: the smallest area, ties to dense then bitmap.
  for (std::uint64_t w : {1, 2, 4, 8})
    for (std::uint64_t len : {1ull, 50ull, 64ull, 100ull, 4096ull})
      for (std::uint64_t c = 1; c <= len; c += 1 + c / 8) {
        const std::uint64_t s = sparse_bytes(c, w), m = bitmap_bytes(c, len, w), d = dense_bytes(len, w);
        const std::uint32_t k = kind_of(c, len, w);
        EXPECT_EQ(area_bytes(k, c, len, w), std::min({s, m, d}));
        if (d == std::min({s, m, d})) {
          EXPECT_EQ(k, kDense);
        }
      }
}

TEST(Delta, LargeTensorsUseThreadsAndStayExact) {
  // 16 MiB of bf16: plan, encode and checksum use 2 threads where the
  // machine has them; apply too at 100 % (a dense payload of 16 MiB).
  std::mt19937_64 rng(8);
  const std::uint64_t n = (16ull << 20) / 2;
  ASSERT_GE(threads_for(n * 2), std::min(2u, std::max(1u, std::thread::hardware_concurrency())));
  const Bytes base = random_bytes(n * 2, rng);
  for (double f : {0.02, 1.0}) {
    const Bytes next = mutate(base, 2, f, rng);
    const Encoded e = encode_pair(base, next, 2);
    Bytes dst = base;
    apply(as_span(e.blob), 2, n, dst.data(), dst.size(), true);
    EXPECT_EQ(dst, next) << f;
    EXPECT_EQ(checksum(next.data(), next.size()), reference_checksum(next));
  }
}

TEST(Delta, PinnedLayoutOfASmallBlob) {
  // n = 4096 + 40 bf16 elements: block 0 has elements 5 and 4000 changed
  // (sparse), block 1 (40 elements) has all 40 changed (dense, 80 bytes +
  // 0 padding).
  const std::uint64_t n = 4096 + 40;
  Bytes base(n * 2, 0), next(n * 2, 0);
  for (std::uint64_t e = 0; e < n; ++e) base[2 * e] = static_cast<std::uint8_t>(e), next[2 * e] = base[2 * e];
  next[2 * 5 + 1] = 0xab;
  next[2 * 4000 + 1] = 0xcd;
  for (std::uint64_t e = 4096; e < n; ++e) next[2 * e + 1] = 1;
  const Encoded e = encode_pair(base, next, 2);
  const Header h = header_of(e.blob);
  EXPECT_EQ(h.magic, 0x4c444353u);
  EXPECT_EQ(std::memcmp(e.blob.data(), "SCDL", 4), 0);
  EXPECT_EQ(h.format, 1);
  EXPECT_EQ(h.elem_bytes, 2);
  EXPECT_EQ(h.block_elems, 4096u);
  EXPECT_EQ(h.elems, n);
  EXPECT_EQ(h.blocks, 2u);
  EXPECT_EQ(h.changed, 42u);
  EXPECT_EQ(h.payload_bytes, 32u + 80u);  // sparse: 4 + 12 pad, 4 + 12 pad; dense: 80
  EXPECT_EQ(e.blob.size(), 64u + 2 * 16 + 112);
  EXPECT_EQ(entry_of(e.blob, 0).offset, 0u);
  EXPECT_EQ(entry_of(e.blob, 0).count, 2u);
  EXPECT_EQ(entry_of(e.blob, 1).offset, 32u);
  EXPECT_EQ(entry_of(e.blob, 1).count, 40u);
  const std::uint8_t* p = e.blob.data() + 96;
  const std::uint8_t sparse[32] = {5, 0, 0xa0, 0x0f, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                   5, 0xab, 0xa0, 0xcd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  EXPECT_EQ(std::memcmp(p, sparse, 32), 0);
  EXPECT_EQ(std::memcmp(p + 32, next.data() + 2 * 4096, 80), 0);
}

// ---------------------------------------------------------------- slices

TEST(Delta, SlicesPiecesAndSelectionsMatchTheElementwiseReference) {
  std::mt19937_64 rng(11);
  int cases = 0, verified = 0;
  for (int iter = 0; iter < 400; ++iter) {
    const std::uint32_t w = 1u << (rng() % 4);
    const std::vector<std::int64_t> shape = random_shape(rng, iter % 4 == 0);
    std::int64_t total = 1;
    for (auto x : shape) total *= x;
    const Selection piece = random_rows(rng, shape, 3), sel = random_rows(rng, shape, 3);
    const Bytes full_old = random_bytes(static_cast<std::size_t>(total) * w, rng);
    const double fracs[] = {0.02, 0.3, 1.0, 0.0};
    const Bytes full_new = mutate(full_old, w, fracs[iter % 4], rng);
    const Bytes p_old = piece_bytes(shape, w, full_old, piece), p_new = piece_bytes(shape, w, full_new, piece);
    const Encoded e = encode_pair(p_old, p_new, w);
    const SliceMap m = slice_map(shape, w, piece, sel);
    ASSERT_EQ(m.n, p_old.size() / w);
    // The destination holds the old tensor's selection.
    Bytes dst = reference_slice(shape, w, full_old, full_old, Selection{}, sel);
    ASSERT_EQ(m.dst_elems * w, dst.size());
    const bool verify = holds_piece(m) && rng() % 2 == 0;
    apply(as_span(e.blob), w, m, dst.data(), dst.size(), verify);
    ASSERT_EQ(dst, reference_slice(shape, w, full_old, full_new, piece, sel))
        << "iter " << iter << " piece dim " << piece.dim << " [" << piece.start << ", +" << piece.length << ") sel dim "
        << sel.dim << " [" << sel.start << ", +" << sel.length << ")";
    verified += verify ? 1 : 0;
    ++cases;
  }
  EXPECT_EQ(cases, 400);
  EXPECT_GT(verified, 20);
}

TEST(Delta, TensorParallelSlicesAlongDimZeroAndOne) {
  // A [96, 200] bf16 weight in two shards along dim 0 (sharded producers);
  // TP consumers take dim-0 and dim-1 halves; 30 % changed so both bitmap
  // and dense blocks cross rows.
  std::mt19937_64 rng(5);
  const std::vector<std::int64_t> shape = {96, 200};
  const Bytes old_full = random_bytes(96 * 200 * 2, rng);
  const Bytes new_full = mutate(old_full, 2, 0.3, rng);
  for (const Selection piece : {Selection{0, 0, 50}, Selection{0, 50, 46}})
    for (const Selection sel : {Selection{-1, 0, 0}, Selection{0, 48, 48}, Selection{1, 0, 100}, Selection{1, 100, 100}}) {
      const Encoded e =
          encode_pair(piece_bytes(shape, 2, old_full, piece), piece_bytes(shape, 2, new_full, piece), 2);
      const SliceMap m = slice_map(shape, 2, piece, sel);
      Bytes dst = reference_slice(shape, 2, old_full, old_full, Selection{}, sel);
      apply(as_span(e.blob), 2, m, dst.data(), dst.size(), false);
      EXPECT_EQ(dst, reference_slice(shape, 2, old_full, new_full, piece, sel));
    }
  // A dim-1 piece (column shard) into a whole destination lands in strided
  // rows: verified there, run by run. A selection that holds part of the
  // piece cannot verify it (the checksum covers the whole piece).
  const Selection col{1, 20, 30};
  const SliceMap m = slice_map(shape, 2, col, Selection{});
  EXPECT_FALSE(covers_piece(m));
  EXPECT_TRUE(holds_piece(m));
  const Encoded e = encode_pair(piece_bytes(shape, 2, old_full, col), piece_bytes(shape, 2, new_full, col), 2);
  Bytes dst = old_full;
  apply(as_span(e.blob), 2, m, dst.data(), dst.size(), true);
  EXPECT_EQ(dst, reference_slice(shape, 2, old_full, new_full, col, Selection{}));
  const SliceMap part = slice_map(shape, 2, col, Selection{0, 0, 48});
  EXPECT_FALSE(holds_piece(part));
  Bytes half = reference_slice(shape, 2, old_full, old_full, Selection{}, Selection{0, 0, 48});
  expect_code(Errc::kInvalidArgument, [&] { apply(as_span(e.blob), 2, part, half.data(), half.size(), true); },
              "verify on part of a piece");
}

// A piece whose elements land strided in the destination (a tensor sharded
// along a dim >= 1, read whole; or a selection along another dim that holds
// the whole piece) is checked where it lands: checksum(map) is the piece's
// content checksum, and a destination that no longer holds the base (one
// unchanged element of the piece altered, as an engine that transformed
// its weights in place leaves it) is kCorrupt. Before, such pieces were
// never checked: the wrong weights were applied and reported as a delta.
TEST(Delta, StridedPiecesAreVerifiedWhereTheyLand) {
  std::mt19937_64 rng(41);
  int strided = 0, caught = 0;
  for (int iter = 0; iter < 300; ++iter) {
    const std::uint32_t w = 1u << (rng() % 4);
    std::vector<std::int64_t> shape = random_shape(rng, iter % 3 == 0);
    if (shape.size() < 2) shape.insert(shape.begin(), 1 + static_cast<std::int64_t>(rng() % 7));
    std::int64_t total = 1;
    for (auto x : shape) total *= x;
    // A piece along a dim >= 1; the selection the whole tensor, or rows
    // along another dim holding the piece (a dim-0 selection of every row).
    Selection piece;
    piece.dim = 1 + static_cast<int>(rng() % (shape.size() - 1));
    const std::int64_t ext = shape[piece.dim];
    piece.start = static_cast<std::int64_t>(rng() % ext);
    piece.length = 1 + static_cast<std::int64_t>(rng() % (ext - piece.start));
    const Selection sel = iter % 4 == 0 ? Selection{0, 0, shape[0]} : Selection{};
    const SliceMap m = slice_map(shape, w, piece, sel);
    ASSERT_TRUE(holds_piece(m)) << "iter " << iter;
    const Bytes full_old = random_bytes(static_cast<std::size_t>(total) * w, rng);
    const Bytes full_new = mutate(full_old, w, iter % 2 == 0 ? 0.02 : 0.3, rng);
    const Bytes p_old = piece_bytes(shape, w, full_old, piece), p_new = piece_bytes(shape, w, full_new, piece);
    const Encoded e = encode_pair(p_old, p_new, w);
    const Bytes d_old = reference_slice(shape, w, full_old, full_old, Selection{}, sel);
    const Bytes want = reference_slice(shape, w, full_old, full_new, piece, sel);
    ASSERT_EQ(checksum(m, d_old.data(), w), reference_checksum(p_old)) << "iter " << iter;
    ASSERT_EQ(checksum(m, want.data(), w), reference_checksum(p_new)) << "iter " << iter;
    Bytes dst = d_old;
    apply(as_span(e.blob), w, m, dst.data(), dst.size(), true);
    ASSERT_EQ(dst, want) << "iter " << iter;
    strided += covers_piece(m) ? 0 : 1;
    // An element of the piece the delta leaves alone, altered in the
    // destination: the result is not the producer's, and the check says so
    // (unless the blob rewrites that element's whole block, a dense one:
    // then the result is right). Never a wrong result reported good.
    std::vector<std::uint64_t> same;
    for (std::uint64_t k = 0; k < m.n; ++k)
      if (std::memcmp(&p_old[k * w], &p_new[k * w], w) == 0) same.push_back(k);
    if (same.empty()) continue;
    std::uint64_t at = 0;
    map_run(m, same[rng() % same.size()], &at);
    dst = d_old;
    dst[at * w] ^= 0x5a;
    try {
      apply(as_span(e.blob), w, m, dst.data(), dst.size(), true);
      ASSERT_EQ(dst, want) << "iter " << iter << ": a wrong result reported good";
    } catch (const Error& x) {
      ASSERT_EQ(x.code(), Errc::kCorrupt) << x.what();
      ++caught;
    }
  }
  EXPECT_GT(strided, 150);
  EXPECT_GT(caught, 150);
}

TEST(Delta, SliceArgumentsAreChecked) {
  const std::vector<std::int64_t> shape = {4, 6};
  expect_code(Errc::kInvalidArgument, [&] { slice_map(shape, 3, {}, {}); }, "width 3");
  expect_code(Errc::kInvalidArgument, [&] { slice_map(shape, 2, Selection{2, 0, 1}, {}); }, "piece dim 2");
  expect_code(Errc::kInvalidArgument, [&] { slice_map(shape, 2, {}, Selection{1, 4, 3}); }, "selection past the dim");
  expect_code(Errc::kInvalidArgument, [&] { slice_map(std::vector<std::int64_t>{-1, 2}, 2, {}, {}); }, "negative");
  const SliceMap scalar = slice_map(std::vector<std::int64_t>{}, 4, {}, {});
  EXPECT_EQ(scalar.n, 1u);
  EXPECT_TRUE(scalar.identity);
  // A selection that misses the piece maps nothing; the blob still applies.
  const SliceMap none = slice_map(shape, 1, Selection{0, 0, 2}, Selection{0, 2, 2});
  EXPECT_EQ(none.n, 12u);
  Bytes oldp(12, 1), newp(12, 2), dst(12, 7);
  const Encoded e = encode_pair(oldp, newp, 1);
  apply(as_span(e.blob), 1, none, dst.data(), dst.size(), false);
  EXPECT_EQ(dst, Bytes(12, 7));
  expect_code(Errc::kInvalidArgument, [&] { apply(as_span(e.blob), 1, none, dst.data(), 11, false); }, "dst size");
}

// ---------------------------------------------------------------- encode misuse

TEST(Delta, EncodeRefusesAPlanThatNoLongerMatchesAndWrongSizes) {
  std::mt19937_64 rng(3);
  Bytes base = random_bytes(3 * 4096 * 2, rng);
  Bytes next = mutate(base, 2, 0.02, rng);
  const Plan p = plan(base.data(), next.data(), 2, 3 * 4096);
  Bytes out(p.blob_bytes());
  expect_code(Errc::kInvalidArgument, [&] { encode(p, base.data(), next.data(), out.data(), out.size() - 1); },
              "short output");
  next[2 * 4097] ^= 0x40;  // one more change in block 1 after planning
  next[2 * 4098] ^= 0x40;
  expect_code(Errc::kInvalidArgument, [&] { encode(p, base.data(), next.data(), out.data(), out.size()); },
              "inputs changed since plan");
  expect_code(Errc::kInvalidArgument, [&] { plan(base.data(), next.data(), 3, 10); }, "width 3");
  expect_code(Errc::kInvalidArgument, [&] { plan(base.data(), next.data(), 8, 1ull << 60); }, "too large");
}

// ---------------------------------------------------------------- malformed blobs

TEST(Delta, SampleHasEveryKindAndPadding) {
  const Sample s = make_sample();
  EXPECT_EQ(kind_of(entry_of(s.blob, 0).count, 4096, 2), kSparse);
  EXPECT_EQ(kind_of(entry_of(s.blob, 1).count, 4096, 2), kBitmap);
  EXPECT_EQ(kind_of(entry_of(s.blob, 2).count, 4096, 2), kDense);
  EXPECT_EQ(kind_of(entry_of(s.blob, 3).count, 50, 2), kBitmap);
  EXPECT_EQ(bitmap_head_bytes(50), 16u);  // 8 bytes of bitmap, 8 of padding
  Bytes dst = s.base;
  apply(as_span(s.blob), 2, s.n, dst.data(), dst.size(), true);
  EXPECT_EQ(dst, s.next);
}

TEST(Delta, EveryMalformedBlobClassIsRejectedAndWritesNothing) {
  const Sample s = make_sample();
  const std::vector<Damage> cases = damages(s);
  EXPECT_EQ(cases.size(), 33u);
  for (const Damage& c : cases) {
    Bytes blob = s.blob;
    c.apply(blob);
    Bytes dst = s.base;
    expect_code(Errc::kCorrupt, [&] { apply(as_span(blob), 2, s.n, dst.data(), dst.size(), false); }, c.name);
    EXPECT_EQ(dst, s.base) << c.name << ": the destination was written";
  }
  // A dense block's padding: one of 41 elements (82 bytes, padded to 96).
  Bytes base(41 * 2, 1), next(41 * 2, 2);
  Bytes blob = encode_pair(base, next, 2).blob;
  ASSERT_EQ(blob.size(), 64u + 16 + 96);
  blob[64 + 16 + 85] = 1;
  Bytes dst = base;
  expect_code(Errc::kCorrupt, [&] { apply(as_span(blob), 2, 41, dst.data(), dst.size(), false); }, "dense padding");
  EXPECT_EQ(dst, base);
  // A blob for another tensor (width or count) is refused too.
  expect_code(Errc::kCorrupt, [&] { apply(as_span(s.blob), 4, s.n / 2, dst.data(), s.n * 2, false); }, "width");
}

TEST(Delta, ChecksumCatchesTheWrongBase) {
  const Sample s = make_sample();
  Bytes dst = s.base;
  dst[2 * 5001 + 1] ^= 0x10;  // not the base the delta was made from (an element the delta leaves alone)
  expect_code(Errc::kCorrupt, [&] { apply(as_span(s.blob), 2, s.n, dst.data(), dst.size(), true); }, "wrong base");
  Bytes again = s.base;
  again[2 * 5001 + 1] ^= 0x10;
  apply(as_span(s.blob), 2, s.n, again.data(), again.size(), false);  // without verification it applies
  EXPECT_NE(again, s.next);
  // A damaged value (the structure intact) is caught the same way.
  Bytes blob = s.blob;
  blob[head_bytes(s.n) + entry_of(blob, 2).offset + 10] ^= 4;
  Bytes d2 = s.base;
  expect_code(Errc::kCorrupt, [&] { apply(as_span(blob), 2, s.n, d2.data(), d2.size(), true); }, "damaged value");
}

TEST(Delta, AnEmptyTensorIsVerifiedToo) {
  // Found by fuzz_delta: the checksum of 0 bytes is checksum_final(0, 0),
  // and a blob that says otherwise fails verification like any other.
  const Bytes none;
  Bytes blob = encode_pair(none, none, 2).blob;
  Bytes dst;
  apply(as_span(blob), 2, 0, dst.data(), 0, true);
  blob[46] ^= 1;
  expect_code(Errc::kCorrupt, [&] { apply(as_span(blob), 2, 0, dst.data(), 0, true); }, "empty, wrong checksum");
  apply(as_span(blob), 2, 0, dst.data(), 0, false);
}

// ---------------------------------------------------------------- checksum

TEST(Delta, ChecksumMatchesTheSpecAndSeesFlipsSwapsAndLength) {
  std::mt19937_64 rng(17);
  for (std::size_t n : {0, 1, 7, 8, 9, 1000, 4099}) {
    const Bytes d = random_bytes(n, rng);
    EXPECT_EQ(checksum(d.data(), d.size()), reference_checksum(d)) << n;
  }
  const Bytes d = random_bytes(1003, rng);
  const std::uint64_t c = checksum(d.data(), d.size());
  // Every single-bit flip, at every byte of the tail and a spread of others.
  for (std::size_t byte = 0; byte < d.size(); byte += (byte < 16 || byte > 990) ? 1 : 37)
    for (int bit = 0; bit < 8; ++bit) {
      Bytes e = d;
      e[byte] ^= static_cast<std::uint8_t>(1u << bit);
      EXPECT_NE(checksum(e.data(), e.size()), c) << byte << "." << bit;
    }
  // Swapped words (content moved, none changed).
  for (std::size_t i : {0u, 3u, 60u})
    for (std::size_t j : {1u, 7u, 124u}) {
      Bytes e = d;
      std::swap_ranges(e.begin() + 8 * i, e.begin() + 8 * i + 8, e.begin() + 8 * j);
      if (e == d) continue;
      EXPECT_NE(checksum(e.data(), e.size()), c) << i << " <-> " << j;
    }
  // Swapped elements inside a word, and a trailing zero byte.
  Bytes e = d;
  std::swap(e[0], e[1]);
  if (e != d) {
    EXPECT_NE(checksum(e.data(), e.size()), c);
  }
  Bytes longer = d;
  longer.push_back(0);
  EXPECT_NE(checksum(longer.data(), longer.size()), c);
  const Bytes zeros(16, 0);
  EXPECT_NE(checksum(zeros.data(), 8), checksum(zeros.data(), 16));
}
