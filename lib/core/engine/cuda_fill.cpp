// engine/ (layer 5): device fills into host slots through staging pieces
// (cuda_fill.hpp).
#include "engine/cuda_fill.hpp"

#include <algorithm>

namespace shmcast::detail::cuda {

FillStage::~FillStage() { release(); }

void FillStage::release() noexcept {
  if (ctx_ == nullptr) return;
  const cu::Api& d = lane_.api();
  try {
    CtxScope scope(d, ctx_);
    for (CUstream s : s_)
      if (s != nullptr) (void)d.cuStreamSynchronize(s);
    for (int k = 0; k < 2; ++k) {
      if (room_[k] != 0) (void)d.cuMemFree(room_[k]);
      if (done_[k] != nullptr) (void)d.cuEventDestroy(done_[k]);
      if (s_[k] != nullptr) (void)d.cuStreamDestroy(s_[k]);
      room_[k] = 0;
      done_[k] = nullptr;
      s_[k] = nullptr;
    }
  } catch (...) {
  }
  ctx_ = nullptr;
}

void FillStage::bind() {
  if (ctx_ == lane_.context()) return;
  release();  // the lane moved to another GPU (it drained first)
  const cu::Api& d = lane_.api();
  CtxScope scope(d, lane_.context());
  ctx_ = lane_.context();
  try {
    for (int k = 0; k < 2; ++k) {
      SHMCAST_CK(d.cuStreamCreate(&s_[k], CU_STREAM_NON_BLOCKING), "cuStreamCreate", "");
      SHMCAST_CK(d.cuEventCreate(&done_[k], CU_EVENT_DISABLE_TIMING), "cuEventCreate", "");
      SHMCAST_CK(d.cuMemAlloc(&room_[k], kPiece), "cuMemAlloc of a quantize staging piece",
                 "free GPU memory (it needs 16 MiB), or create the producer with device slots");
    }
  } catch (...) {
    release();
    throw;
  }
}

void FillStage::fill(std::byte* dst, const DeviceFill& f, std::uint64_t first, std::uint64_t n) {
  if (n == 0) return;
  bind();
  const cu::Api& d = lane_.api();
  CtxScope scope(d, ctx_);
  CUstream lane = lane_.next_stream();
  // After the caller's stream's work (the lane's order event, which begin()
  // recorded there), not behind the lane stream's tail: that would queue
  // every piece behind the copies of the tensor before...
  for (CUstream s : s_) SHMCAST_CK(d.cuStreamWaitEvent(s, lane_.order_event(), 0), "cuStreamWaitEvent", "");
  try {
    for (std::uint64_t at = 0; at < n;) {
      const std::uint64_t len = std::min(kPiece, n - at);
      const unsigned k = next_++ & 1u;
      // A room is rewritten only after its last copy, by its stream's order.
      f.launch(reinterpret_cast<std::byte*>(static_cast<std::uintptr_t>(room_[k])), first + at, len, s_[k]);
      SHMCAST_CK(d.cuMemcpyDtoHAsync(dst + at, room_[k], len, s_[k]), "cuMemcpyDtoHAsync into a slot", kTodoAsync);
      at += len;
    }
  } catch (...) {
    // What was queued still writes the slot and reads the multipliers: the
    // lane's drain (the abort that follows) must wait for it too.
    for (int k = 0; k < 2; ++k)
      if (d.cuEventRecord(done_[k], s_[k]) != CUDA_SUCCESS || d.cuStreamWaitEvent(lane, done_[k], 0) != CUDA_SUCCESS)
        (void)d.cuStreamSynchronize(s_[k]);
    throw;
  }
  // ...and before what the lane's stream does next (the chunk's event).
  for (int k = 0; k < 2; ++k) {
    SHMCAST_CK(d.cuEventRecord(done_[k], s_[k]), "cuEventRecord", "");
    SHMCAST_CK(d.cuStreamWaitEvent(lane, done_[k], 0), "cuStreamWaitEvent", "");
  }
}

}  // namespace shmcast::detail::cuda
