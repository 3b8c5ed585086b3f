// engine/ (layer 5): the copies of a CUDA lane (cuda_lane.hpp): one
// contiguous range (copy_one), rows of a pitched layout (copy_rows), a piece
// of a Strided2D tensor, a large one split across the copy streams
// (copy_async); and, for device slots, the small device-to-device pieces a
// lane gathers and copies in one kernel launch (add_small, flush_small:
// split into CUDA blocks of a size chosen for the whole batch).
#include <cstdint>
#include <string>
#include <vector>

#include "engine/cuda_driver.hpp"
#include "engine/cuda_lane.hpp"
#include "engine/delta_cuda.hpp"
#include "engine/engine.hpp"
#include "protocol/delta_launch.hpp"

namespace shmcast::detail::cuda {

namespace {

constexpr std::uint64_t kSplitMin = 8ull << 20;  // split pieces of at least this size
constexpr std::uint64_t kBatchBytes = 8ull << 20;  // device slots: batch copies under this size (Lane::batch_bytes)

}  // namespace

std::uint64_t Lane::batch_bytes() {
  static const std::uint64_t v = env_number("SHMCAST_CUDA_BATCH_BYTES", kBatchBytes, 0, ~std::uint64_t{0});
  return v;
}
std::uint64_t Lane::piece_bytes() {
  static const std::uint64_t v = env_number("SHMCAST_CUDA_PIECE_BYTES", 0, 4u << 10, 64ull << 20, 16);
  return v;
}

bool Lane::add_small(std::byte* dst, const std::byte* src, std::uint64_t bytes) {
  if (bytes >= batch_bytes() || !batch_on_) return false;
  if (small_ok_ < 0) {
    CtxScope scope(d_, ctx_);
    small_ok_ = delta::copy_pieces_ready(nullptr) ? 1 : 0;
  }
  if (small_ok_ == 0) return false;
  if (bytes == 0) return true;
  small_.push_back(delta::CopyPiece{dptr(src), dptr(dst), bytes});
  small_bytes_ += bytes;
  if (small_.size() >= kSmallBatch) flush_small();
  return true;
}

void Lane::flush_small() {
  if (small_.empty()) return;
  // The gathered pieces leave the lane before anything here can throw: a
  // failed flush drops them (its error fails the sync they belong to),
  // never leaves them for the next flush, which would copy an old sync's
  // pieces (slots since reused, destinations since freed) into the next.
  std::vector<delta::CopyPiece> whole, batch;
  whole.swap(small_);
  const std::uint64_t total = small_bytes_;
  small_bytes_ = 0;
  batch.swap(split_);  // the last table's storage
  batch.clear();
  // Split into CUDA blocks of a size chosen for the whole batch
  // (copy_block_bytes: larger blocks for a larger batch).
  delta::split_copy_pieces(whole, delta::copy_block_bytes(total, piece_bytes()), &batch);
  CtxScope scope(d_, ctx_);
  const std::uint64_t bytes = batch.size() * sizeof(delta::CopyPiece);
  if (bytes > desc_cap_) {
    // The old table may still be read by a queued launch.
    if (desc_ != 0) {
      SHMCAST_CK(d_.cuStreamSynchronize(copy_[0]), "cuStreamSynchronize", kTodoAsync);
      (void)d_.cuMemFree(desc_);
      desc_ = 0;
      desc_cap_ = 0;
    }
    const std::uint64_t cap = bytes < (64u << 10) ? (64u << 10) : bytes;
    SHMCAST_CK(d_.cuMemAlloc(&desc_, cap), "cuMemAlloc of the copy table", "");
    desc_cap_ = cap;
  }
  // From pageable memory the upload returns once the table was read, and
  // it runs on stream 0 after the launch that read the previous table.
  SHMCAST_CK(d_.cuMemcpyHtoDAsync(desc_, batch.data(), bytes, copy_[0]), "cuMemcpyHtoDAsync of the copy table",
             kTodoAsync);
  delta::launch_copy_pieces(reinterpret_cast<const void*>(static_cast<std::uintptr_t>(desc_)), batch.size(),
                            copy_[0]);
  split_.swap(batch);  // the storage of both, for the next flush
  whole.clear();
  small_.swap(whole);
}

void copy_one(Lane& lane, std::byte* s, std::byte* t, std::uint64_t bytes, const Sides& k, CUstream stream) {
  const cu::Api& d = lane.api();
  CUresult e;
  const char* what;
  if (k.slot_dev && k.tensor_dev) {
    if (k.to_slot ? lane.add_small(s, t, bytes) : lane.add_small(t, s, bytes)) return;
    e = k.to_slot ? d.cuMemcpyDtoDAsync(dptr(s), dptr(t), bytes, stream)
                  : d.cuMemcpyDtoDAsync(dptr(t), dptr(s), bytes, stream);
    what = "cuMemcpyDtoDAsync";
  } else if (k.slot_dev) {  // a host tensor, device slots
    e = k.to_slot ? d.cuMemcpyHtoDAsync(dptr(s), t, bytes, stream) : d.cuMemcpyDtoHAsync(t, dptr(s), bytes, stream);
    what = k.to_slot ? "cuMemcpyHtoDAsync" : "cuMemcpyDtoHAsync";
  } else {  // host slots, a device tensor
    e = k.to_slot ? d.cuMemcpyDtoHAsync(s, dptr(t), bytes, stream) : d.cuMemcpyHtoDAsync(dptr(t), s, bytes, stream);
    what = k.to_slot ? "cuMemcpyDtoHAsync" : "cuMemcpyHtoDAsync";
  }
  if (e != CUDA_SUCCESS) throw_cuda(e, std::string(what) + " of " + std::to_string(bytes) + " bytes", kTodoArgs);
}

void copy_rows(std::byte* slot, std::uint64_t sp, std::byte* t, std::uint64_t tp, std::uint64_t w,
               std::uint64_t rows, const Sides& k, Lane& lane, CUstream stream) {
  const cu::Api& d = lane.api();
  const std::uint64_t max_pitch = lane.max_pitch();
  const bool fits = max_pitch == 0 || (sp <= max_pitch && tp <= max_pitch);
  CUresult e = CUDA_ERROR_INVALID_VALUE;
  if (fits) {
    CUDA_MEMCPY2D c{};
    c.WidthInBytes = w;
    c.Height = rows;
    // The slot's side and the tensor's, as source and destination.
    std::byte* src = k.to_slot ? t : slot;
    std::byte* dst = k.to_slot ? slot : t;
    const bool src_dev = k.to_slot ? k.tensor_dev : k.slot_dev;
    const bool dst_dev = k.to_slot ? k.slot_dev : k.tensor_dev;
    c.srcPitch = k.to_slot ? tp : sp;
    c.dstPitch = k.to_slot ? sp : tp;
    c.srcMemoryType = src_dev ? CU_MEMORYTYPE_DEVICE : CU_MEMORYTYPE_HOST;
    c.dstMemoryType = dst_dev ? CU_MEMORYTYPE_DEVICE : CU_MEMORYTYPE_HOST;
    if (src_dev)
      c.srcDevice = dptr(src);
    else
      c.srcHost = src;
    if (dst_dev)
      c.dstDevice = dptr(dst);
    else
      c.dstHost = dst;
    e = d.cuMemcpy2DAsync(&c, stream);
  }
  if (fits && e != CUDA_ERROR_INVALID_VALUE) {
    if (e != CUDA_SUCCESS)
      throw_cuda(e, std::string("cuMemcpy2DAsync ") + (k.to_slot ? "to" : "from") + " the slots of " +
                        std::to_string(rows) + " rows of " + std::to_string(w) + " bytes (pitches " +
                        std::to_string(sp) + ", " + std::to_string(tp) + ")",
                 kTodoArgs);
    return;
  }
  for (std::uint64_t r = 0; r < rows; ++r) copy_one(lane, slot + r * sp, t + r * tp, w, k, stream);
}

void copy_async(std::byte* slot, std::byte* tensor, const Strided2D& l, std::uint64_t offset, std::uint64_t n,
                const Sides& k, Lane& lane) {
  auto one = [&](std::byte* s, std::byte* t, std::uint64_t bytes, CUstream stream) {
    copy_one(lane, s, t, bytes, k, stream);
  };
  if (n == 0) return;
  if (l.rows == 0 || l.pitch_bytes == l.row_bytes) {
    const int streams = lane.streams();
    if (streams == 1 || n < kSplitMin) {
      one(slot, tensor + offset, n, lane.next_stream());
      return;
    }
    // Split a large piece across the copy streams (4 KiB-aligned parts).
    const std::uint64_t part = (n / streams + 4095) & ~std::uint64_t{4095};
    for (int i = 0; i < streams; ++i) {
      const std::uint64_t a = part * static_cast<std::uint64_t>(i);
      if (a >= n) break;
      const std::uint64_t len = n - a < part ? n - a : part;
      one(slot + a, tensor + offset + a, len, lane.stream(i));
    }
    return;
  }
  CUstream stream = lane.next_stream();
  std::uint64_t row = offset / l.row_bytes, col = offset % l.row_bytes;
  if (col != 0) {  // head: the rest of a partial row
    const std::uint64_t take = l.row_bytes - col < n ? l.row_bytes - col : n;
    one(slot, tensor + row * l.pitch_bytes + col, take, stream);
    slot += take;
    n -= take;
    ++row;
  }
  const std::uint64_t full = n / l.row_bytes;
  if (full == 1) {
    one(slot, tensor + row * l.pitch_bytes, l.row_bytes, stream);
  } else if (full > 1) {
    copy_rows(slot, l.row_bytes, tensor + row * l.pitch_bytes, l.pitch_bytes, l.row_bytes, full, k, lane, stream);
  }
  slot += full * l.row_bytes;
  n -= full * l.row_bytes;
  row += full;
  if (n > 0) one(slot, tensor + row * l.pitch_bytes, n, stream);  // tail: a partial row
}

}  // namespace shmcast::detail::cuda
