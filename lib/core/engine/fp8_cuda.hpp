// engine/ (layer 5): quantize-on-send on CUDA devices: the block scales and
// the e4m3fn codes of a GPU tensor, made by kernels (kernels/fp8.cu, carried
// as PTX and loaded through the dlopened driver, cuda_driver.hpp) with the
// same bits as the host path (quant_host.cpp).
//
// A quantizer is bound to the context of the first stream it is used with
// and owns device memory there (the scales, a flag, one tensor's staging
// room); not thread-safe. Calls enqueue on the caller's stream (a
// cudaStream_t of the device's primary context; nullptr: the legacy default
// stream); scales() waits for it, as its caller must know of a NaN before it
// writes anything.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "engine/engine.hpp"
#include "engine/quant.hpp"

namespace shmcast::detail::quant {

// Whether GPU quantization can run here: built with its kernels, a driver
// and a device present. `why` says why not.
bool cuda_quantize_available(std::string* why);

class CudaQuantizer {
 public:
  CudaQuantizer();
  ~CudaQuantizer();  // frees its device memory (the caller waited for the work it enqueued)
  CudaQuantizer(const CudaQuantizer&) = delete;
  CudaQuantizer& operator=(const CudaQuantizer&) = delete;

  // The block scales of `m` (m.base: device memory) into `out` (host
  // copies of scale_inv and mult), on `stream`, which it then waits for.
  // Returns "" or where a NaN or Inf is ("NaN or Inf in the block at rows
  // [r0, r1), columns [c0, c1)").
  std::string scales(const Matrix& m, Quantize q, void* stream, Scales* out);
  // The block scales of many tensors (nullptr: none) before a sync: every
  // tensor's kernel on `stream`, then one wait. Each one's multipliers stay
  // on the device until reset() (out->mult). Returns "" or, for the first
  // tensor with a NaN or Inf, where ("NaN or Inf in the block at ...") with
  // its index in *bad.
  std::string scales_batch(const std::vector<const Matrix*>& ms, Quantize q, void* stream, DeviceScales* out,
                           std::size_t* bad);
  // Enqueues the codes of elements [first, first + n) of `m` into `dst`
  // (device memory, or pinned host memory the device maps) on `stream`,
  // with the scales of the last scales() call (of the same matrix).
  void quantize(const Matrix& m, std::byte* dst, std::uint64_t first, std::uint64_t n, void* stream);
  // Device memory of at least `bytes` in the quantizer's context, valid
  // until the next call: room for one tensor's FP8 bytes.
  std::byte* staging(std::uint64_t bytes);
  // The multipliers of every scales() call stay on the device, each in its
  // own room, until reset(): kernels enqueued on other streams (fill()) may
  // still read them while later tensors' scales are made. Call reset() only
  // when all of those have run (the engine drained), e.g. at a sync's start.
  void reset();
  // A DeviceFill (engine.hpp) that quantizes `m` with the scales of the
  // last scales() call, straight into the slot bytes the engine hands it,
  // on the engine's stream (of the quantizer's context). Valid while `m`'s
  // memory is and until reset().
  class Fill final : public DeviceFill {
   public:
    Fill(CudaQuantizer& q, const Matrix& m);
    // With the multipliers scales_batch() left at `mult` (bcols a row).
    Fill(CudaQuantizer& q, const Matrix& m, std::uint64_t mult, std::int64_t bcols);
    void launch(std::byte* dst, std::uint64_t first, std::uint64_t n, void* stream) const override;

   private:
    CudaQuantizer* q_;
    Matrix m_;
    std::uint64_t mult_;  // CUdeviceptr of this tensor's multipliers
    std::int64_t bcols_;
  };

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace shmcast::detail::quant
