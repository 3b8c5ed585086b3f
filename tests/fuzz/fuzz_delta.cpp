// libFuzzer target: the host delta decoder (delta::apply, delta.cpp), which
// takes blobs out of a region another process writes. Input: one selector
// byte, then the blob.
//   selector bits 0-1: element width 1 << bits
//   bit 2: take the width from the blob's header when it is a valid one
//   The element count is the header's `elems` (at most kMaxElems; larger
//   counts are cut to their low 16 bits, so the header check sees a
//   mismatch), or 100 when the blob has no header.
//
// Contract: apply() accepts the blob or throws Error(kCorrupt), leaving the
// destination untouched when it throws; an accepted blob changes at most
// `changed` elements, applies the same into a slice as into the whole
// tensor, is re-encoded by our encoder into a blob that makes the same
// result, and passes verification exactly when the result's checksum is the
// header's.
#include <vector>

#include "protocol/delta.hpp"
#include "fuzz_support.hpp"

using namespace fuzz;
namespace dl = shmcast::detail::delta;

namespace {

constexpr std::uint64_t kMaxElems = 1u << 16;

std::vector<std::uint8_t> base_pattern(std::uint64_t bytes) {
  std::vector<std::uint8_t> v(bytes);
  std::uint64_t x = 0x243f6a8885a308d3ull;
  for (std::uint64_t i = 0; i < bytes; ++i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    v[i] = static_cast<std::uint8_t>(x >> 56);
  }
  return v;
}

bool rejects(const std::span<const std::byte> blob, std::uint32_t w, const dl::SliceMap& m, std::uint8_t* dst,
             std::uint64_t bytes, bool verify) {
  try {
    dl::apply(blob, w, m, dst, bytes, verify);
    return false;
  } catch (const shmcast::Error& e) {
    if (e.code() != shmcast::Errc::kCorrupt) finding("apply threw an error other than Corrupt");
    return true;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  std::uint32_t w = 1u << (data[0] & 3);
  const std::span<const std::byte> blob(reinterpret_cast<const std::byte*>(data + 1), size - 1);
  std::uint64_t n = 100;
  dl::Header h{};
  if (blob.size() >= sizeof h) {
    std::memcpy(&h, blob.data(), sizeof h);
    n = h.elems <= kMaxElems ? h.elems : (h.elems & 0xffff);
    if ((data[0] & 4) && dl::valid_width(h.elem_bytes)) w = h.elem_bytes;
  }
  const std::vector<std::uint8_t> base = base_pattern(n * w);
  std::vector<std::uint8_t> dst = base;
  if (rejects(blob, w, dl::whole_map(n), dst.data(), dst.size(), false)) {
    if (dst != base) finding("a rejected blob wrote the destination");
    return 0;
  }
  // Accepted: the header and table are sound, and only the elements the
  // table names may move: a sparse or bitmap block's `count`, a dense
  // block's every element (it carries the whole block, and a crafted one
  // may carry other values than the base's where its count says unchanged).
  std::uint64_t moved = 0, may_move = 0;
  for (std::uint64_t e = 0; e < n; ++e) moved += std::memcmp(&dst[e * w], &base[e * w], w) != 0 ? 1 : 0;
  for (std::uint64_t b = 0; b < dl::block_count(n); ++b) {
    dl::Entry en;
    std::memcpy(&en, blob.data() + dl::kHeaderBytes + dl::kEntryBytes * b, sizeof en);
    const std::uint64_t len = dl::block_len(n, b);
    may_move += dl::kind_of(en.count, len, w) == dl::kDense ? len : en.count;
  }
  if (moved > may_move) finding("more elements changed than the table names");

  // Verification agrees with the checksum of the result.
  std::vector<std::uint8_t> again = base;
  const bool verified = !rejects(blob, w, dl::whole_map(n), again.data(), again.size(), true);
  if (verified != (dl::checksum(dst.data(), dst.size()) == h.checksum)) finding("verify disagrees with the checksum");
  if (again != dst) finding("applying twice gave two results");

  // A slice gets the same elements: rows [r0, r0 + rl) of [rows, cols] along
  // dim 0, and columns [1, cols - 1) along dim 1.
  std::uint64_t rows = 1;
  for (std::uint64_t f : {7u, 5u, 3u, 2u})
    if (n % f == 0) {
      rows = f;
      break;
    }
  const std::int64_t R = static_cast<std::int64_t>(rows), C = static_cast<std::int64_t>(n / rows);
  const std::vector<std::int64_t> shape = {R, C};
  const shmcast::Selection sels[2] = {{0, R / 3, R - R / 3}, {1, C > 1 ? 1 : 0, C > 2 ? C - 2 : 0}};
  for (const shmcast::Selection& sel : sels) {
    const dl::SliceMap m = dl::slice_map(shape, w, shmcast::Selection{}, sel);
    std::vector<std::uint8_t> part(m.dst_elems * w), want(m.dst_elems * w);
    for (std::int64_t r = 0, q = 0; r < R; ++r)
      for (std::int64_t c = 0; c < C; ++c) {
        const bool in = sel.dim == 0 ? (r >= sel.start && r < sel.start + sel.length)
                                     : (c >= sel.start && c < sel.start + sel.length);
        if (!in) continue;
        const std::uint64_t e = static_cast<std::uint64_t>(r * C + c);
        std::memcpy(&part[static_cast<std::size_t>(q) * w], &base[e * w], w);
        std::memcpy(&want[static_cast<std::size_t>(q) * w], &dst[e * w], w);
        ++q;
      }
    if (rejects(blob, w, m, part.data(), part.size(), false)) finding("a slice rejected what the whole accepted");
    if (part != want) finding("a slice got other elements than the whole");
  }

  // Our encoder, from the same base to the result, makes a blob that gives
  // the same result.
  std::vector<std::uint8_t> b2 = base;
  const dl::Plan p = dl::plan(b2.data(), dst.data(), w, n);
  if (p.changed != moved) finding("plan counted other changes");
  std::vector<std::uint8_t> blob2(p.blob_bytes());
  dl::encode(p, b2.data(), dst.data(), blob2.data(), blob2.size());
  if (b2 != dst) finding("encode left the base unlike next");
  std::vector<std::uint8_t> third = base;
  dl::apply({reinterpret_cast<const std::byte*>(blob2.data()), blob2.size()}, w, n, third.data(), third.size(), true);
  if (third != dst) finding("re-encoded blob gave another result");
  return 0;
}
