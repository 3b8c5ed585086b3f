// engine/ (layer 5): block-FP8 quantization on the host (quant.hpp says the
// format and where it comes from).
#include <cfloat>
#include <cmath>
#include <cstring>

#include "engine/quant.hpp"

namespace shmcast::detail::quant {

namespace {

std::uint32_t bits_of(float f) noexcept {
  std::uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}
float float_of(std::uint32_t b) noexcept {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

float half_to_float(std::uint16_t h) noexcept {
  const float sign = (h & 0x8000u) ? -1.0f : 1.0f;
  const int exp = (h >> 10) & 0x1f;
  const int man = h & 0x3ff;
  if (exp == 0) return sign * std::ldexp(static_cast<float>(man), -24);
  if (exp == 31) return man == 0 ? sign * INFINITY : NAN;
  return sign * std::ldexp(static_cast<float>(man + 1024), exp - 25);
}

template <DType D>
inline float element(const std::byte* row, std::int64_t c) noexcept {
  if constexpr (D == DType::kF32) {
    float f;
    std::memcpy(&f, row + c * 4, 4);
    return f;
  } else {
    std::uint16_t h;
    std::memcpy(&h, row + c * 2, 2);
    if constexpr (D == DType::kBF16)
      return float_of(static_cast<std::uint32_t>(h) << 16);
    else
      return half_to_float(h);
  }
}

template <DType D>
std::string amax_of(const Matrix& m, std::int64_t bcols, float* amax) {
  for (std::int64_t r = 0; r < m.rows; ++r) {
    const std::byte* row = m.base + static_cast<std::uint64_t>(r) * m.pitch;
    float* am = amax + (r / quantize::kBlock) * bcols;
    for (std::int64_t c = 0; c < m.cols; ++c) {
      const float a = std::fabs(element<D>(row, c));
      if (!(a <= FLT_MAX))
        return std::string(std::isnan(a) ? "NaN" : "Inf") + " at [" + std::to_string(r) + ", " + std::to_string(c) +
               "]";
      float& slot = am[c / quantize::kBlock];
      if (a > slot) slot = a;
    }
  }
  return {};
}

template <DType D>
void quantize_rows(std::byte* dst, const Matrix& m, const Scales& s, std::uint64_t first, std::uint64_t n) {
  const std::uint64_t cols = static_cast<std::uint64_t>(m.cols);
  auto* out = reinterpret_cast<std::uint8_t*>(dst);
  while (n > 0) {
    const std::uint64_t r = first / cols, c0 = first % cols;
    const std::uint64_t take = cols - c0 < n ? cols - c0 : n;
    const std::byte* row = m.base + r * m.pitch;
    const float* mult = s.mult.data() + (r / quantize::kBlock) * static_cast<std::uint64_t>(s.bcols);
    for (std::uint64_t k = 0; k < take; ++k) {
      const std::uint64_t c = c0 + k;
      // float32 product, rounded, then converted: torch's order.
      const float v = element<D>(row, static_cast<std::int64_t>(c)) * mult[c / quantize::kBlock];
      out[k] = to_e4m3fn(v);
    }
    out += take;
    first += take;
    n -= take;
  }
}

}  // namespace

std::uint8_t to_e4m3fn(float f) noexcept {
  std::uint32_t b = bits_of(f);
  const std::uint32_t sign = b & 0x80000000u;
  b ^= sign;
  std::uint8_t code;
  if (b >= 0x43F00000u) {  // 480.0f and up, Inf, NaN: the NaN code
    code = 0x7f;
  } else if (b < 0x3C800000u) {  // below 2^-6, e4m3fn's smallest normal: a subnormal (or 0)
    // 2^14 + |f|: the float adder rounds |f| to a multiple of 2^-9 (ties to
    // even) into the low mantissa bits; take them out again.
    code = static_cast<std::uint8_t>(bits_of(float_of(b) + 16384.0f) - 0x46800000u);
  } else {
    // Rebias the exponent (127 -> 7) and round the 23-bit mantissa to 3
    // bits, ties to even (add 0x7FFFF, and one more when the kept bit is odd).
    const std::uint32_t odd = (b >> 20) & 1u;
    b += 0xC407FFFFu + odd;
    code = static_cast<std::uint8_t>(b >> 20);
  }
  return static_cast<std::uint8_t>(code | (sign >> 24));
}

float from_e4m3fn(std::uint8_t v) noexcept {
  const float sign = (v & 0x80) ? -1.0f : 1.0f;
  const int e = (v >> 3) & 15, m = v & 7;
  if (e == 15 && m == 7) return NAN;
  if (e == 0) return sign * std::ldexp(static_cast<float>(m), -9);
  return sign * std::ldexp(static_cast<float>(8 + m), e - 10);
}

bool source_dtype(DType dtype) noexcept {
  return dtype == DType::kBF16 || dtype == DType::kF16 || dtype == DType::kF32;
}

float load(DType dtype, const std::byte* p) noexcept {
  switch (dtype) {
    case DType::kF32: return element<DType::kF32>(p, 0);
    case DType::kF16: return element<DType::kF16>(p, 0);
    default: return element<DType::kBF16>(p, 0);
  }
}

std::string block_scales(const Matrix& m, Quantize q, Scales* out) {
  out->brows = blocks(m.rows);
  out->bcols = blocks(m.cols);
  const std::size_t nb = static_cast<std::size_t>(out->brows * out->bcols);
  std::vector<float> amax(nb, 0.0f);
  std::string bad;
  switch (m.dtype) {
    case DType::kF32: bad = amax_of<DType::kF32>(m, out->bcols, amax.data()); break;
    case DType::kF16: bad = amax_of<DType::kF16>(m, out->bcols, amax.data()); break;
    default: bad = amax_of<DType::kBF16>(m, out->bcols, amax.data()); break;
  }
  if (!bad.empty()) return bad;
  out->scale_inv.resize(nb);
  out->mult.resize(nb);
  for (std::size_t i = 0; i < nb; ++i) {
    const float a = amax[i] < 1e-4f ? 1e-4f : amax[i];
    if (q == Quantize::kFp8Block128Ue8m0) {
      const std::uint32_t b = bits_of(a / 448.0f);
      std::uint32_t e = ((b >> 23) & 0xffu) + ((b & 0x7fffffu) != 0 ? 1u : 0u);
      e = e < 1 ? 1 : (e > 254 ? 254 : e);
      const float scale = float_of(e << 23);
      out->scale_inv[i] = scale;
      out->mult[i] = 1.0f / scale;
    } else {
      // torch evaluates `448.0 / x_amax` as x_amax.reciprocal() * 448.0
      // (Tensor.__rdiv__): two float32 roundings, not one division. And
      // `x_amax / 448.0` on a CPU tensor is a true division.
      out->scale_inv[i] = a / 448.0f;
      const float recip = 1.0f / a;
      out->mult[i] = recip * 448.0f;
    }
  }
  return {};
}

void quantize_elems(std::byte* dst, const Matrix& m, const Scales& s, std::uint64_t first, std::uint64_t n) {
  if (n == 0) return;
  switch (m.dtype) {
    case DType::kF32: quantize_rows<DType::kF32>(dst, m, s, first, n); break;
    case DType::kF16: quantize_rows<DType::kF16>(dst, m, s, first, n); break;
    default: quantize_rows<DType::kBF16>(dst, m, s, first, n); break;
  }
}

}  // namespace shmcast::detail::quant
