// Tests of quantize-on-send: an independent reference of the block-FP8
// format, written from its definition (issue 44's formula, x * (448 / amax),
// as CPU torch evaluates it: vLLM's and SGLang's test utilities; DeepGEMM's
// current per_block_cast_to_fp8 divides by amax / 448), not from the library's
// code: the e4m3fn conversion picks the nearest of the 127 finite values
// by search (ties to the even code), the UE8M0 scale comes from frexp, and
// the blocks are walked over a zero-padded copy.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "shmcast/shmcast.hpp"

namespace quant_ref {

// The 127 non-negative finite e4m3fn values, by code 0x00..0x7e.
inline const std::vector<double>& e4m3_values() {
  static const std::vector<double> v = [] {
    std::vector<double> out;
    for (int code = 0; code < 0x7f; ++code) {
      const int e = code >> 3, m = code & 7;
      out.push_back(e == 0 ? m / 512.0 : (1.0 + m / 8.0) * std::pow(2.0, e - 7));
    }
    return out;
  }();
  return v;
}

// torch's float -> float8_e4m3fn: the nearest value, ties to the even code;
// above 464 (the midpoint between 448 and the NaN code's place, 480) the NaN
// code, as for Inf and NaN; the sign kept.
inline std::uint8_t to_e4m3(float f) {
  const std::uint8_t sign = std::signbit(f) ? 0x80 : 0;
  const double a = std::fabs(static_cast<double>(f));
  if (std::isnan(f) || a > 464.0) return sign | 0x7f;
  const auto& v = e4m3_values();
  const auto hi = std::lower_bound(v.begin(), v.end(), a);  // first value >= a
  int code;
  if (hi == v.begin()) {
    code = 0;
  } else if (hi == v.end()) {
    code = 0x7e;
  } else {
    const int up = static_cast<int>(hi - v.begin()), down = up - 1;
    const double du = v[up] - a, dd = a - v[down];
    code = du < dd ? up : (dd < du ? down : (up % 2 == 0 ? up : down));
  }
  return sign | static_cast<std::uint8_t>(code);
}

inline float bf16_value(std::uint16_t h) {
  const std::uint32_t b = static_cast<std::uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

inline float element(shmcast::DType dt, const std::byte* p) {
  if (dt == shmcast::DType::kF32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  std::uint16_t h;
  std::memcpy(&h, p, 2);
  if (dt == shmcast::DType::kBF16) return bf16_value(h);
  _Float16 x;
  std::memcpy(&x, &h, 2);
  return static_cast<float>(x);
}

struct Result {
  std::vector<std::uint8_t> q;   // [rows, cols]
  std::vector<float> scale_inv;  // [ceil(rows/128), ceil(cols/128)]
};

// per_block_cast_to_fp8 of a [rows, cols] matrix (contiguous).
inline Result per_block(const void* data, shmcast::DType dt, std::int64_t rows, std::int64_t cols, bool ue8m0) {
  const std::int64_t pr = (rows + 127) / 128 * 128, pc = (cols + 127) / 128 * 128;
  const std::size_t es = shmcast::dtype_size(dt);
  std::vector<float> padded(static_cast<std::size_t>(pr * pc), 0.0f);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c)
      padded[r * pc + c] = element(dt, static_cast<const std::byte*>(data) + (r * cols + c) * es);
  Result out;
  const std::int64_t br = pr / 128, bc = pc / 128;
  out.scale_inv.resize(static_cast<std::size_t>(br * bc));
  std::vector<float> mult(out.scale_inv.size());
  for (std::int64_t i = 0; i < br; ++i)
    for (std::int64_t j = 0; j < bc; ++j) {
      float amax = 0.0f;
      for (std::int64_t r = 0; r < 128; ++r)
        for (std::int64_t c = 0; c < 128; ++c) amax = std::max(amax, std::fabs(padded[(i * 128 + r) * pc + j * 128 + c]));
      amax = std::max(amax, 1e-4f);  // .clamp(1e-4): the bound as float32
      float m, s;
      if (ue8m0) {
        const float sf = amax / 448.0f;
        int e;
        const float frac = std::frexp(sf, &e);     // sf = frac * 2^e, frac in [0.5, 1)
        s = frac == 0.5f ? sf : std::ldexp(1.0f, e);  // the least power of two >= sf
        m = 1.0f / s;
      } else {
        volatile float recip = 1.0f / amax;  // x_amax.reciprocal(), then * 448.0
        m = recip * 448.0f;
        s = amax / 448.0f;
      }
      out.scale_inv[i * bc + j] = s;
      mult[i * bc + j] = m;
    }
  out.q.resize(static_cast<std::size_t>(rows * cols));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      volatile float v = padded[r * pc + c] * mult[(r / 128) * bc + c / 128];
      out.q[r * cols + c] = to_e4m3(v);
    }
  return out;
}

}  // namespace quant_ref
