// engine/ (layer 5): the CUDA producer engine's device fills into host slots
// (engine.hpp DeviceFill: quantize-on-send from GPU tensors). The kernel
// writes a device staging piece and a DMA copies it into the pinned slot:
// the GPU's own stores into mapped host memory reached 25 GB/s over PCIe on
// an H100, the copy engine twice that (docs/benchmarks.md, 2026-12-07). Two
// streams of the lane's context take the pieces (at most kPiece bytes) in
// turn, each with its own staging room, so one piece's kernel runs while
// the other's copy does; the lane's stream waits for both before the chunk
// is published (cuda_lane.hpp: chunk_done records on the lane's streams).
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>

#include "engine/cuda_lane.hpp"
#include "engine/engine.hpp"

namespace shmcast::detail::cuda {

class FillStage {
 public:
  static constexpr std::uint64_t kPiece = 8ull << 20;

  explicit FillStage(Lane& lane) : lane_(lane) {}
  ~FillStage();  // waits for its streams, then frees
  FillStage(const FillStage&) = delete;
  FillStage& operator=(const FillStage&) = delete;

  // Bytes [first, first + n) of the fill's tensor into host memory at
  // `dst` (a pinned slot), after the caller's stream's work as of the
  // lane's last begin(stream) (its order event): call begin() before each
  // tensor's fills, as the producer's writes do.
  void fill(std::byte* dst, const DeviceFill& f, std::uint64_t first, std::uint64_t n);

 private:
  void bind();  // streams, events and rooms in the lane's current context
  void release() noexcept;

  Lane& lane_;
  CUcontext ctx_ = nullptr;
  CUstream s_[2] = {nullptr, nullptr};
  CUdeviceptr room_[2] = {0, 0};
  CUevent done_[2] = {nullptr, nullptr};
  unsigned next_ = 0;
};

}  // namespace shmcast::detail::cuda
