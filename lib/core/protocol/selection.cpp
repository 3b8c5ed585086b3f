#include "protocol/selection.hpp"

namespace shmcast::detail {

std::string selection_problem(const TensorInfo& t, const Selection& sel) {
  if (sel.dim == -1) {
    if (sel.start != 0 || sel.length != 0) return "a whole-tensor selection (dim -1) with a start or length";
    return {};
  }
  if (sel.dim < 0 || static_cast<std::size_t>(sel.dim) >= t.shape.size())
    return "dim " + std::to_string(sel.dim) + " is not a dimension of a " + std::to_string(t.shape.size()) +
           "-d tensor";
  const std::int64_t extent = t.shape[static_cast<std::size_t>(sel.dim)];
  if (sel.start < 0 || sel.length < 0 || sel.start > extent || sel.length > extent - sel.start)
    return "rows [" + std::to_string(sel.start) + ", +" + std::to_string(sel.length) + ") lie outside dim " +
           std::to_string(sel.dim) + " of size " + std::to_string(extent);
  return {};
}

std::uint64_t selection_bytes(const TensorInfo& t, const Selection& sel) {
  if (sel.dim < 0) return t.nbytes;
  const auto extent = static_cast<std::uint64_t>(t.shape[static_cast<std::size_t>(sel.dim)]);
  return extent == 0 ? 0 : t.nbytes / extent * static_cast<std::uint64_t>(sel.length);
}

void plan_piece(const TensorInfo& t, const ShardInfo& p, const Selection& sel, std::vector<Block>* out) {
  const std::size_t n = t.shape.size();
  const std::uint64_t es = dtype_size(t.dtype);
  if (n == 0) {  // a scalar: one piece, one element
    if (t.nbytes > 0) out->push_back(Block{0, 0, t.nbytes, 1, t.nbytes, t.nbytes});
    return;
  }
  // Boxes: [lo, hi) per dim of the piece (P), the selection (Q) and both (B).
  std::int64_t plo[kMaxDims], phi[kMaxDims], qlo[kMaxDims], qhi[kMaxDims], blo[kMaxDims], bhi[kMaxDims];
  for (std::size_t d = 0; d < n; ++d) {
    plo[d] = qlo[d] = 0;
    phi[d] = qhi[d] = t.shape[d];
  }
  if (p.dim >= 0) plo[p.dim] = p.start, phi[p.dim] = p.start + p.length;
  if (sel.dim >= 0) qlo[sel.dim] = sel.start, qhi[sel.dim] = sel.start + sel.length;
  for (std::size_t d = 0; d < n; ++d) {
    blo[d] = plo[d] > qlo[d] ? plo[d] : qlo[d];
    bhi[d] = phi[d] < qhi[d] ? phi[d] : qhi[d];
    if (bhi[d] <= blo[d]) return;  // nothing in common (or an empty tensor)
  }
  auto full = [&](std::size_t d) { return blo[d] == plo[d] && bhi[d] == phi[d] && blo[d] == qlo[d] && bhi[d] == qhi[d]; };
  // k: the innermost dim the box does not cover whole on both sides.
  int k = -1;
  for (int d = static_cast<int>(n) - 1; d >= 0; --d)
    if (!full(static_cast<std::size_t>(d))) {
      k = d;
      break;
    }
  if (k < 0) {  // the piece is exactly the selection
    out->push_back(Block{0, 0, p.nbytes, 1, p.nbytes, p.nbytes});
    return;
  }
  const auto K = static_cast<std::size_t>(k);
  std::uint64_t inner = es;
  for (std::size_t d = K + 1; d < n; ++d) inner *= static_cast<std::uint64_t>(t.shape[d]);
  const std::uint64_t width = static_cast<std::uint64_t>(bhi[K] - blo[K]) * inner;
  const std::uint64_t sp = static_cast<std::uint64_t>(phi[K] - plo[K]) * inner;
  const std::uint64_t dp = static_cast<std::uint64_t>(qhi[K] - qlo[K]) * inner;
  // j: the next restricted dim outside k (at most one: only the piece's and
  // the selection's dims are restricted); the dims between are whole.
  int j = -1;
  for (int d = k - 1; d >= 0; --d)
    if (!full(static_cast<std::size_t>(d))) {
      j = d;
      break;
    }
  std::uint64_t mid = 1;  // rows per index of dim j
  for (int d = j + 1; d < k; ++d) mid *= static_cast<std::uint64_t>(t.shape[static_cast<std::size_t>(d)]);
  const std::uint64_t col_src = static_cast<std::uint64_t>(blo[K] - plo[K]) * inner;
  const std::uint64_t col_dst = static_cast<std::uint64_t>(blo[K] - qlo[K]) * inner;
  if (j < 0) {
    Block b{col_src, col_dst, width, mid, sp, dp};
    if (width == sp && width == dp) b = Block{col_src, col_dst, width * mid, 1, width * mid, width * mid};
    out->push_back(b);
    return;
  }
  const auto J = static_cast<std::size_t>(j);
  std::uint64_t outer = 1;  // whole dims outside j
  for (std::size_t d = 0; d < J; ++d) outer *= static_cast<std::uint64_t>(t.shape[d]);
  const std::uint64_t rows = static_cast<std::uint64_t>(bhi[J] - blo[J]) * mid;
  const std::uint64_t src_block = static_cast<std::uint64_t>(phi[J] - plo[J]) * mid * sp;  // one index of dims < j
  const std::uint64_t dst_block = static_cast<std::uint64_t>(qhi[J] - qlo[J]) * mid * dp;
  const std::uint64_t row_src = static_cast<std::uint64_t>(blo[J] - plo[J]) * mid * sp;
  const std::uint64_t row_dst = static_cast<std::uint64_t>(blo[J] - qlo[J]) * mid * dp;
  for (std::uint64_t o = 0; o < outer; ++o) {
    Block b{o * src_block + row_src + col_src, o * dst_block + row_dst + col_dst, width, rows, sp, dp};
    if (width == sp && width == dp) b = Block{b.src, b.dst, width * rows, 1, width * rows, width * rows};
    out->push_back(b);
  }
}

}  // namespace shmcast::detail

namespace shmcast {

std::string Selection::problem(const TensorInfo& t) const { return detail::selection_problem(t, *this); }

std::uint64_t Selection::nbytes(const TensorInfo& t) const {
  if (std::string why = detail::selection_problem(t, *this); !why.empty())
    throw Error(Errc::kInvalidArgument, "selection of tensor '" + t.name + "': " + why);
  return detail::selection_bytes(t, *this);
}

}  // namespace shmcast
