// engine/ (layer 5): block-FP8 quantization on the host (quant_host.cpp), the
// host path of quantize-on-send (ProducerOptions::quantize, docs/protocol.md
// §14). The producer computes a tensor's block scales once per sync
// (block_scales), then quantizes it piece by piece straight into the slot
// bytes (quantize_elems): a slot boundary may fall anywhere, inside a
// 128-row block too, since each element needs only its block's multiplier.
//
// The format, as DeepGEMM's per_block_cast_to_fp8 defines it and vLLM's and
// SGLang's tests copy it (deepseek-ai/DeepGEMM, deep_gemm/utils/math.py at
// commit 38939a4c494ce6e904b54da94a1183955a5e9497: per_block_cast_to_fp8
// and ceil_to_ue8m0; its non-UE8M0 form there multiplies by 1 / (amax / 448),
// the form of DeepGEMM's earlier tests/test_core.py and of vLLM's and
// SGLang's test utilities, which issue 44 names, multiplies by 448 / amax):
//   amax      = max |x| over the 128 x 128 block, in float32, clamped >= 1e-4f
//   fp8-block128:       mult = (1.0f / amax) * 448.0f,    scale_inv = amax / 448.0f
//                       (float32; torch evaluates `448.0 / x_amax` as
//                       x_amax.reciprocal() * 448.0, Tensor.__rdiv__, so
//                       the multiplier is rounded twice; `x_amax / 448.0` is
//                       a true division on a CPU tensor, while torch on CUDA
//                       multiplies by float(1 / 448) instead, which can
//                       differ in the last bit: these bits are CPU torch's)
//   fp8-block128-ue8m0: scale = amax / 448.0f rounded up to a power of two
//                       (exponent bits + 1 when any mantissa bit is set,
//                       clamped to biased exponents [1, 254]),
//                       mult = 1.0f / scale (exact), scale_inv = scale
//   q         = e4m3fn(float(x) * mult), the product rounded to float32 first
// Edge blocks are padded with zeros, which change no amax.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "shmcast/shmcast.hpp"

namespace shmcast::detail::quant {

// torch's float -> float8_e4m3fn conversion (c10/util/Float8_e4m3fn.h,
// fp8e4m3fn_from_fp32_value): round to nearest even; a magnitude of 480 or
// more, Inf and NaN give the NaN code 0x7f with the input's sign, and so do
// magnitudes in (464, 480), which round up to that code (e4m3fn has no Inf).
std::uint8_t to_e4m3fn(float f) noexcept;
// The value of an e4m3fn code (NaN for 0x7f / 0xff).
float from_e4m3fn(std::uint8_t v) noexcept;
// A bf16, f16 or f32 element as float32 (exact).
float load(DType dtype, const std::byte* p) noexcept;
// Whether quantize-on-send takes this dtype as a source.
bool source_dtype(DType dtype) noexcept;

// A 2-D source in host memory: `rows` rows of `cols` elements, row r at
// base + r * pitch.
struct Matrix {
  const std::byte* base = nullptr;
  DType dtype = DType::kBF16;
  std::int64_t rows = 0, cols = 0;
  std::uint64_t pitch = 0;
};

// One tensor's block scales: brows x bcols blocks, row-major.
struct Scales {
  std::int64_t brows = 0, bcols = 0;
  std::vector<float> scale_inv;  // what the scales tensor carries
  std::vector<float> mult;       // what each element of the block is multiplied by
};

// Block scales made on the GPU before a sync (CudaQuantizer::scales_batch),
// per tensor: the scale_inv the scales tensor carries (host; mult left
// empty), and where its multipliers are in device memory (0: none).
struct DeviceScales {
  std::vector<Scales> host;
  std::vector<std::uint64_t> mult;
};

inline std::int64_t blocks(std::int64_t n) { return (n + quantize::kBlock - 1) / quantize::kBlock; }

// Computes the block scales of `m`. Returns "" or, for a NaN or Inf
// element, where the first one is ("NaN at [r, c]"): nothing can be sent.
std::string block_scales(const Matrix& m, Quantize q, Scales* out);
// Writes the e4m3fn codes of elements [first, first + n) of `m` (row-major
// flat indices) to dst.
void quantize_elems(std::byte* dst, const Matrix& m, const Scales& s, std::uint64_t first, std::uint64_t n);

}  // namespace shmcast::detail::quant
