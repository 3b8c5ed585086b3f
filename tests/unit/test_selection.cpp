// The consumer's copy plan for pieces and selections, against a reference
// that copies element by element: random shapes, pieces (whole or shards on
// any dim), selections on any dim, and the piece's bytes arriving in random
// ranges (chunk boundaries anywhere, even mid-row).
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "protocol/selection.hpp"

using namespace shmcast;
using namespace shmcast::detail;

namespace {

std::vector<std::int64_t> strides(const std::vector<std::int64_t>& shape) {
  std::vector<std::int64_t> s(shape.size(), 1);
  for (int d = static_cast<int>(shape.size()) - 2; d >= 0; --d) s[d] = s[d + 1] * shape[d + 1];
  return s;
}

}  // namespace

TEST(Selection, PlanMatchesElementwiseReferenceUnderAnyChunking) {
  std::mt19937_64 rng(7);
  int cases = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    const int nd = 1 + static_cast<int>(rng() % 4);
    TensorInfo t;
    t.dtype = (rng() % 2) ? DType::kF32 : DType::kU8;
    const std::uint64_t es = dtype_size(t.dtype);
    for (int d = 0; d < nd; ++d) t.shape.push_back(1 + static_cast<std::int64_t>(rng() % 6));
    std::int64_t numel = 1;
    for (auto x : t.shape) numel *= x;
    t.nbytes = static_cast<std::uint64_t>(numel) * es;
    // piece
    ShardInfo p;
    if (rng() % 3 == 0) {
      p.nbytes = t.nbytes;
    } else {
      p.dim = static_cast<int>(rng() % nd);
      const std::int64_t n = t.shape[p.dim];
      p.start = static_cast<std::int64_t>(rng() % (n + 1));
      p.length = static_cast<std::int64_t>(rng() % (n - p.start + 1));
      p.nbytes = t.nbytes / static_cast<std::uint64_t>(n) * static_cast<std::uint64_t>(p.length);
    }
    Selection sel;
    if (rng() % 3 != 0) {
      sel.dim = static_cast<int>(rng() % nd);
      const std::int64_t n = t.shape[sel.dim];
      sel.start = static_cast<std::int64_t>(rng() % (n + 1));
      sel.length = static_cast<std::int64_t>(rng() % (n - sel.start + 1));
    }
    ASSERT_EQ(selection_problem(t, sel), "");
    // Reference: every element of the piece that the selection holds.
    auto pshape = t.shape, qshape = t.shape;
    if (p.dim >= 0) pshape[p.dim] = p.length;
    if (sel.dim >= 0) qshape[sel.dim] = sel.length;
    const auto ps = strides(pshape), qs = strides(qshape);
    std::vector<std::uint8_t> piece(p.nbytes), want(selection_bytes(t, sel), 0xAB), got(want.size(), 0xAB);
    for (std::size_t i = 0; i < piece.size(); ++i) piece[i] = static_cast<std::uint8_t>(rng());
    std::vector<std::int64_t> idx(nd, 0);
    for (std::int64_t lin = 0; lin < numel; ++lin) {
      std::int64_t rest = lin;
      for (int d = nd - 1; d >= 0; --d) {
        idx[d] = rest % t.shape[d];
        rest /= t.shape[d];
      }
      bool in = true;
      std::int64_t po = 0, qo = 0;
      for (int d = 0; d < nd; ++d) {
        const std::int64_t pl = p.dim == d ? p.start : 0, ql = sel.dim == d ? sel.start : 0;
        if (idx[d] < pl || idx[d] >= pl + pshape[d] || idx[d] < ql || idx[d] >= ql + qshape[d]) in = false;
        po += (idx[d] - pl) * ps[d];
        qo += (idx[d] - ql) * qs[d];
      }
      if (in) std::memcpy(want.data() + qo * es, piece.data() + po * es, es);
    }
    std::vector<Block> blocks;
    plan_piece(t, p, sel, &blocks);
    // The piece's bytes arrive in random ranges.
    std::uint64_t at = 0;
    while (at < p.nbytes) {
      const std::uint64_t n = 1 + rng() % (p.nbytes - at + 3);
      const std::uint64_t end = std::min(p.nbytes, at + n);
      for (const Block& b : blocks)
        clip(b, at, end, [&](const Op& op) {
          for (std::uint64_t r = 0; r < op.rows; ++r) {
            ASSERT_GE(op.src + r * op.src_pitch, at);
            ASSERT_LE(op.src + r * op.src_pitch + op.width, end) << "a copy reads bytes outside its range";
            ASSERT_LE(op.dst + r * op.dst_pitch + op.width, got.size());
            std::memcpy(got.data() + op.dst + r * op.dst_pitch, piece.data() + op.src + r * op.src_pitch, op.width);
          }
        });
      at = end;
    }
    ASSERT_EQ(got, want) << "iter " << iter;
    ++cases;
  }
  EXPECT_EQ(cases, 3000);
}

TEST(Selection, BadSelectionsAreNamed) {
  TensorInfo t;
  t.dtype = DType::kF32;
  t.shape = {4, 6};
  t.nbytes = 96;
  EXPECT_NE(selection_problem(t, Selection{2, 0, 1}), "");
  EXPECT_NE(selection_problem(t, Selection{1, 5, 2}), "");
  EXPECT_NE(selection_problem(t, Selection{0, -1, 1}), "");
  EXPECT_NE(selection_problem(t, Selection{-1, 1, 0}), "");
  EXPECT_EQ(selection_problem(t, Selection{1, 6, 0}), "");
  EXPECT_EQ(selection_bytes(t, Selection{1, 2, 3}), 48u);
}

// The public face of the same check (what the Python binding exports):
// Selection::problem / nbytes give detail::'s answers, and nbytes refuses a
// selection that does not fit instead of reading past the shape.
TEST(Selection, PublicCheckIsTheSameRule) {
  TensorInfo t;
  t.name = "w";
  t.dtype = DType::kF32;
  t.shape = {4, 6};
  t.nbytes = 96;
  for (const Selection s : {Selection{}, Selection{0, 0, 4}, Selection{1, 6, 0}, Selection{1, 2, 3}, Selection{2, 0, 1},
                            Selection{1, 5, 2}, Selection{0, -1, 1}, Selection{-1, 1, 0}, Selection{-2, 0, 1}}) {
    EXPECT_EQ(s.problem(t), selection_problem(t, s));
    if (s.problem(t).empty()) {
      EXPECT_EQ(s.nbytes(t), selection_bytes(t, s));
    } else {
      try {
        (void)s.nbytes(t);
        ADD_FAILURE() << "nbytes() took a selection that does not fit";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), Errc::kInvalidArgument);
        EXPECT_NE(std::string(e.what()).find(s.problem(t)), std::string::npos) << e.what();
      }
    }
  }
}
