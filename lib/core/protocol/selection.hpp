// protocol/ (used by the consumer and the delta codec): which bytes of a
// tensor's pieces a consumer copies, and where they go. A piece (a whole
// tensor, or a shard: rows along one dim, stored contiguously) and a
// selection (the whole tensor, or rows along one dim, delivered contiguously)
// are boxes of the logical tensor; their intersection is copied as 2D blocks
// (rows of `width` bytes at constant pitches on both sides), never through a
// staging copy.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shmcast/shmcast.hpp"

namespace shmcast::detail {

struct Block {
  std::uint64_t src = 0;        // offset in the piece's bytes
  std::uint64_t dst = 0;        // offset in the destination (the selection's bytes)
  std::uint64_t width = 0;      // bytes per row
  std::uint64_t rows = 0;
  std::uint64_t src_pitch = 0;  // bytes between row starts in the piece
  std::uint64_t dst_pitch = 0;  // ... in the destination
};

// Checks a selection against a tensor; empty string when valid.
std::string selection_problem(const TensorInfo& t, const Selection& sel);
// Bytes of tensor `t` that selection `sel` covers (its destination's size).
std::uint64_t selection_bytes(const TensorInfo& t, const Selection& sel);
// Appends the blocks that copy piece `p` ∩ `sel` (valid, checked above).
void plan_piece(const TensorInfo& t, const ShardInfo& p, const Selection& sel, std::vector<Block>* out);

// One copy of a clipped block: `rows` rows (1: a plain run of `width` bytes).
struct Op {
  std::uint64_t src, dst, width, rows, src_pitch, dst_pitch;
};
// The parts of block `b` whose source bytes lie in [a, e) (piece offsets),
// in source order: at most a partial head row, a run of whole rows, a
// partial tail row.
template <class F>
void clip(const Block& b, std::uint64_t a, std::uint64_t e, F&& fn) {
  if (b.rows == 0 || b.width == 0 || e <= a) return;
  if (b.rows == 1) {
    const std::uint64_t lo = a > b.src ? a : b.src, hi = e < b.src + b.width ? e : b.src + b.width;
    if (lo < hi) fn(Op{lo, b.dst + (lo - b.src), hi - lo, 1, 0, 0});
    return;
  }
  const std::uint64_t sp = b.src_pitch;
  // Rows whose span [src + i*sp, + width) meets [a, e).
  std::uint64_t i0 = a <= b.src ? 0 : (a - b.src) / sp;
  if (i0 < b.rows && b.src + i0 * sp + b.width <= a) ++i0;
  if (e <= b.src) return;
  std::uint64_t i1 = (e - b.src - 1) / sp + 1;  // rows starting before e
  if (i1 > b.rows) i1 = b.rows;
  if (i0 >= i1) return;
  auto row_part = [&](std::uint64_t i) {
    const std::uint64_t rs = b.src + i * sp, re = rs + b.width;
    const std::uint64_t lo = a > rs ? a : rs, hi = e < re ? e : re;
    if (lo < hi) fn(Op{lo, b.dst + i * b.dst_pitch + (lo - rs), hi - lo, 1, 0, 0});
  };
  std::uint64_t first_full = i0, end_full = i1;
  if (b.src + i0 * sp < a) {  // head row starts before a
    row_part(i0);
    first_full = i0 + 1;
  }
  if (end_full > first_full && b.src + (end_full - 1) * sp + b.width > e) --end_full;  // tail row ends after e
  if (first_full < end_full)
    fn(Op{b.src + first_full * sp, b.dst + first_full * b.dst_pitch, b.width, end_full - first_full, sp, b.dst_pitch});
  if (end_full < i1 && end_full >= first_full) row_part(end_full);
}

}  // namespace shmcast::detail
