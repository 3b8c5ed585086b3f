// Quantize-on-send's host path (engine/quant.hpp): the e4m3fn conversion
// and the block scales, bit for bit against the independent reference
// (quant_ref.hpp) and against torch's documented edge cases; the default
// filter's rule.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "engine/quant.hpp"
#include "quant_ref.hpp"
#include "shmcast/shmcast.hpp"

using namespace shmcast;
namespace q = shmcast::detail::quant;

namespace {

float from_bits(std::uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

}  // namespace

// c10's fp8e4m3fn_from_fp32_value at its edges (values torch gives).
TEST(Fp8Convert, TorchEdgeCases) {
  struct Case {
    float in;
    std::uint8_t out;
  } cases[] = {
      {0.0f, 0x00},
      {-0.0f, 0x80},
      {1.0f, 0x38},
      {-2.0f, 0xc0},
      {448.0f, 0x7e},
      {-448.0f, 0xfe},
      {464.0f, 0x7e},                                    // the tie between 448 and the NaN code: even, 448
      {std::nextafter(464.0f, 1000.0f), 0x7f},           // above it: the NaN code
      {479.0f, 0x7f},
      {480.0f, 0x7f},
      {1e30f, 0x7f},
      {-1e30f, 0xff},
      {std::numeric_limits<float>::infinity(), 0x7f},
      {-std::numeric_limits<float>::infinity(), 0xff},
      {std::numeric_limits<float>::quiet_NaN(), 0x7f},
      {std::ldexp(1.0f, -9), 0x01},                      // the smallest subnormal
      {std::ldexp(1.0f, -10), 0x00},                     // half of it: a tie, to even (0)
      {std::ldexp(3.0f, -10), 0x02},                     // 1.5 ulp: a tie, to even (2)
      {std::ldexp(5.0f, -10), 0x02},                     // 2.5 ulp: to even (2)
      {std::nextafter(std::ldexp(1.0f, -10), 1.0f), 0x01},
      {std::ldexp(1.0f, -6), 0x08},                      // the smallest normal
      {std::ldexp(15.0f, -10), 0x08},                    // 7.5 ulp: to even (8, the normal)
      {1.0625f, 0x38},                                   // tie between 1 and 1.125: even (1)
      {1.1875f, 0x3a},                                   // tie between 1.125 and 1.25: even (1.25)
      {1e-45f, 0x00},                                    // a float32 denormal
      {240.0f, 0x77},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(q::to_e4m3fn(c.in), c.out) << c.in;
    EXPECT_EQ(quant_ref::to_e4m3(c.in), c.out) << c.in;  // the reference agrees with torch too
  }
}

// Every code's value, its midpoints with the next code and one ulp either
// side, and a sweep of float32 bit patterns up to 512 and beyond: the
// library's bit trick equals the search of the reference.
TEST(Fp8Convert, MatchesNearestEvenReference) {
  const auto& v = quant_ref::e4m3_values();
  std::vector<float> probes;
  for (std::size_t i = 0; i < v.size(); ++i) {
    probes.push_back(static_cast<float>(v[i]));
    const float mid = static_cast<float>((v[i] + (i + 1 < v.size() ? v[i + 1] : 480.0)) / 2);
    for (float p : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)}) probes.push_back(p);
  }
  for (std::uint32_t b = 0; b < 0x44000000u; b += 4093) probes.push_back(from_bits(b));
  for (std::uint32_t b = 0x7f800000u; b < 0x7f800010u; ++b) probes.push_back(from_bits(b));  // Inf, NaNs
  std::size_t n = 0;
  for (float p : probes)
    for (float s : {p, -p}) {
      ASSERT_EQ(q::to_e4m3fn(s), quant_ref::to_e4m3(s)) << s;
      ++n;
    }
  EXPECT_GT(n, 500000u);
}

namespace {

// A [rows, cols] source of `dt` with blocks of very different magnitudes:
// normal values, an all-zero block, float32 and bf16/f16 denormals, large
// magnitudes (f32 up to 1e30, bf16 up to 1e35, f16 up to 60000).
std::vector<std::byte> make_source(DType dt, std::int64_t rows, std::int64_t cols, std::mt19937_64& rng) {
  const std::size_t es = dtype_size(dt);
  std::vector<std::byte> out(static_cast<std::size_t>(rows * cols) * es);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const std::int64_t bc = (cols + 127) / 128;
  std::vector<float> scale(static_cast<std::size_t>(((rows + 127) / 128) * bc));
  const float big = dt == DType::kF32 ? 1e30f : (dt == DType::kBF16 ? 1e35f : 1e4f);
  const float tiny = dt == DType::kF32 ? 1e-41f : (dt == DType::kBF16 ? 1e-39f : 3e-7f);
  for (std::size_t i = 0; i < scale.size(); ++i) {
    switch (rng() % 6) {
      case 0: scale[i] = 0.0f; break;    // an all-zero block
      case 1: scale[i] = tiny; break;    // denormals of the source dtype
      case 2: scale[i] = big; break;     // large magnitudes
      case 3: scale[i] = 1e-5f; break;   // below the 1e-4 clamp
      default: scale[i] = std::ldexp(1.0f, static_cast<int>(rng() % (dt == DType::kF16 ? 24 : 40)) - 20); break;
    }
  }
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      const float x = normal(rng) * scale[(r / 128) * bc + c / 128];
      std::byte* p = out.data() + static_cast<std::size_t>(r * cols + c) * es;
      if (dt == DType::kF32) {
        std::memcpy(p, &x, 4);
      } else if (dt == DType::kBF16) {
        std::uint32_t b;
        std::memcpy(&b, &x, 4);
        const std::uint16_t h = static_cast<std::uint16_t>((b + 0x7fff + ((b >> 16) & 1)) >> 16);  // RNE
        std::memcpy(p, &h, 2);
      } else {
        const _Float16 h = static_cast<_Float16>(x);
        std::memcpy(p, &h, 2);
      }
    }
  return out;
}

}  // namespace

// Random shapes with partial edge blocks (and a 0-sized tensor), three
// source dtypes, both variants; each tensor quantized in random pieces
// whose boundaries fall anywhere (inside a 128-row block too), as slot
// boundaries do.
TEST(Fp8Block, MatchesReferenceRandomShapesAndPieces) {
  std::mt19937_64 rng(44);
  const std::pair<std::int64_t, std::int64_t> shapes[] = {{1, 1},   {127, 129}, {128, 128}, {300, 257},
                                                          {129, 700}, {0, 200},   {200, 0},   {513, 128}};
  for (DType dt : {DType::kBF16, DType::kF16, DType::kF32})
    for (bool ue8m0 : {false, true})
      for (auto [rows, cols] : shapes) {
        SCOPED_TRACE(std::string(dtype_name(dt)) + (ue8m0 ? " ue8m0 " : " ") + std::to_string(rows) + "x" +
                     std::to_string(cols));
        const std::vector<std::byte> src = make_source(dt, rows, cols, rng);
        const quant_ref::Result want = quant_ref::per_block(src.data(), dt, rows, cols, ue8m0);
        q::Matrix m{src.data(), dt, rows, cols, static_cast<std::uint64_t>(cols) * dtype_size(dt)};
        q::Scales s;
        ASSERT_EQ(q::block_scales(m, ue8m0 ? Quantize::kFp8Block128Ue8m0 : Quantize::kFp8Block128, &s), "");
        ASSERT_EQ(s.brows, (rows + 127) / 128);
        ASSERT_EQ(s.bcols, (cols + 127) / 128);
        ASSERT_EQ(s.scale_inv.size(), want.scale_inv.size());
        if (!want.scale_inv.empty())  // a 0-sized tensor has none (and memcmp no null pointers)
          EXPECT_EQ(std::memcmp(s.scale_inv.data(), want.scale_inv.data(), want.scale_inv.size() * 4), 0);
        std::vector<std::uint8_t> got(want.q.size(), 0xAA);
        const std::uint64_t n = got.size();
        for (std::uint64_t at = 0; at < n;) {
          const std::uint64_t len = std::min<std::uint64_t>(n - at, 1 + rng() % 40000);
          q::quantize_elems(reinterpret_cast<std::byte*>(got.data()) + at, m, s, at, len);
          at += len;
        }
        std::size_t diff = 0;
        for (std::size_t i = 0; i < n; ++i) diff += got[i] != want.q[i];
        EXPECT_EQ(diff, 0u);
        if (ue8m0)
          for (float f : s.scale_inv) {
            int e;
            EXPECT_EQ(std::frexp(f, &e), 0.5f) << f;  // a power of two
          }
      }
}

// A strided source (rows further apart than their bytes) gives the same bits.
TEST(Fp8Block, PitchedRowsGiveTheSameBits) {
  std::mt19937_64 rng(7);
  const std::int64_t rows = 200, cols = 300, pitch_cols = 333;
  const std::vector<std::byte> dense = make_source(DType::kBF16, rows, cols, rng);
  std::vector<std::byte> pitched(static_cast<std::size_t>(rows * pitch_cols) * 2, std::byte{0x7f});
  for (std::int64_t r = 0; r < rows; ++r) std::memcpy(&pitched[r * pitch_cols * 2], &dense[r * cols * 2], cols * 2);
  const quant_ref::Result want = quant_ref::per_block(dense.data(), DType::kBF16, rows, cols, false);
  q::Matrix m{pitched.data(), DType::kBF16, rows, cols, static_cast<std::uint64_t>(pitch_cols) * 2};
  q::Scales s;
  ASSERT_EQ(q::block_scales(m, Quantize::kFp8Block128, &s), "");
  std::vector<std::uint8_t> got(want.q.size());
  q::quantize_elems(reinterpret_cast<std::byte*>(got.data()), m, s, 0, got.size());
  EXPECT_EQ(got, want.q);
  EXPECT_EQ(s.scale_inv, want.scale_inv);
}

// A NaN or an Inf is found, with where it is; nothing to quantize.
TEST(Fp8Block, NonFiniteIsReportedWithItsPlace) {
  std::vector<float> x(300 * 200, 1.0f);
  x[5 * 200 + 7] = std::numeric_limits<float>::quiet_NaN();
  q::Matrix m{reinterpret_cast<const std::byte*>(x.data()), DType::kF32, 300, 200, 200 * 4};
  q::Scales s;
  EXPECT_EQ(q::block_scales(m, Quantize::kFp8Block128, &s), "NaN at [5, 7]");
  x[5 * 200 + 7] = 1.0f;
  x[299 * 200 + 199] = -std::numeric_limits<float>::infinity();
  EXPECT_EQ(q::block_scales(m, Quantize::kFp8Block128Ue8m0, &s), "Inf at [299, 199]");
}

// What FP8 checkpoints quantize: 2-D linear weights of both dims >= 128,
// not embeddings, lm_head, norms, biases, routers or 1-D tensors.
TEST(QuantizeFilter, DefaultRule) {
  auto spec = [](std::string name, std::vector<std::int64_t> shape, DType dt = DType::kBF16) {
    TensorSpec t;
    t.name = std::move(name);
    t.dtype = dt;
    t.shape = std::move(shape);
    return t;
  };
  EXPECT_TRUE(default_quantize_filter(spec("model.layers.0.mlp.gate_proj.weight", {11008, 2048})));
  EXPECT_TRUE(default_quantize_filter(spec("model.layers.3.self_attn.q_proj.weight", {2048, 2048})));
  EXPECT_TRUE(default_quantize_filter(spec("model.layers.3.self_attn.k_proj.weight", {256, 2048}, DType::kF32)));
  EXPECT_TRUE(default_quantize_filter(spec("model.layers.1.mlp.experts.7.down_proj.weight", {2048, 768}, DType::kF16)));
  EXPECT_TRUE(default_quantize_filter(spec("weight", {128, 128})));
  EXPECT_FALSE(default_quantize_filter(spec("model.embed_tokens.weight", {151936, 2048})));
  EXPECT_FALSE(default_quantize_filter(spec("lm_head.weight", {151936, 2048})));
  EXPECT_FALSE(default_quantize_filter(spec("model.layers.0.input_layernorm.weight", {2048})));
  EXPECT_FALSE(default_quantize_filter(spec("model.norm.weight", {2048, 2048})));
  EXPECT_FALSE(default_quantize_filter(spec("model.layers.0.self_attn.q_norm.weight", {128, 128})));
  EXPECT_FALSE(default_quantize_filter(spec("model.layers.0.self_attn.q_proj.bias", {2048, 2048})));
  EXPECT_FALSE(default_quantize_filter(spec("model.layers.1.mlp.gate.weight", {128, 2048})));
  EXPECT_FALSE(default_quantize_filter(spec("model.layers.0.mlp.down_proj.weight", {127, 2048})));
  EXPECT_FALSE(default_quantize_filter(spec("model.layers.0.mlp.down_proj.weight", {2048, 2048, 1})));
  EXPECT_FALSE(default_quantize_filter(spec("model.layers.0.mlp.down_proj.weight", {2048, 2048}, DType::kI32)));
  EXPECT_FALSE(default_quantize_filter(spec("model.layers.0.mlp.down_proj.weight_scale_inv", {16, 16}, DType::kF32)));
  EXPECT_FALSE(default_quantize_filter(spec("xweight", {256, 256})));
}

TEST(QuantizeFilter, Names) {
  for (Quantize v : {Quantize::kNone, Quantize::kFp8Block128, Quantize::kFp8Block128Ue8m0}) {
    Quantize back{};
    ASSERT_TRUE(quantize_from_name(quantize_name(v), &back));
    EXPECT_EQ(back, v);
  }
  Quantize x{};
  EXPECT_FALSE(quantize_from_name("fp8", &x));
  EXPECT_EQ(quantize_name(Quantize::kFp8Block128Ue8m0), "fp8-block128-ue8m0");
}

// torch evaluates `448.0 / x_amax` as x_amax.reciprocal() * 448.0, so the
// multiplier is rounded twice; a plain division gives other codes for these
// (amax, x) pairs of bf16 values. The golden products are torch 1.13's
// (x * (448.0 / amax) on CPU tensors, printed with float.hex()), the codes
// c10's rounding of them (ties and just past ties).
TEST(Fp8Block, MultiplierFollowsTorchsOrder) {
  struct Golden {
    std::uint16_t amax, x;
    float torch_product;
    std::uint8_t code;
  } golden[] = {
      {0x3f8a, 0x3c4f, 0x1.500002p+2f, 0x4b}, {0x3fb8, 0x3c0a, 0x1.500002p+1f, 0x43},
      {0x3fc0, 0x3c10, 0x1.500002p+1f, 0x43}, {0x3fc4, 0x3c05, 0x1.2ffffep+1f, 0x41},
      {0x3ff0, 0x3c34, 0x1.500002p+1f, 0x43}, {0x3ffc, 0x3c19, 0x1.100002p+1f, 0x41},
  };
  const std::int64_t n = std::size(golden);
  std::vector<std::uint16_t> w(static_cast<std::size_t>(128 * 128 * n), 0);  // [128, 128 n], one pair per block
  for (std::int64_t i = 0; i < n; ++i) {
    w[i * 128] = golden[i].amax;
    w[i * 128 + 1] = golden[i].x;
  }
  q::Matrix m{reinterpret_cast<const std::byte*>(w.data()), DType::kBF16, 128, 128 * n,
              static_cast<std::uint64_t>(128 * n) * 2};
  q::Scales s;
  ASSERT_EQ(q::block_scales(m, Quantize::kFp8Block128, &s), "");
  std::vector<std::uint8_t> got(w.size());
  q::quantize_elems(reinterpret_cast<std::byte*>(got.data()), m, s, 0, got.size());
  for (std::int64_t i = 0; i < n; ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(quant_ref::bf16_value(golden[i].x) * s.mult[i], golden[i].torch_product);
    EXPECT_EQ(q::to_e4m3fn(golden[i].torch_product), golden[i].code);
    EXPECT_EQ(got[i * 128 + 1], golden[i].code);
    EXPECT_EQ(got[i * 128], 0x7e);  // amax itself: 448
    EXPECT_EQ(s.scale_inv[i], quant_ref::bf16_value(golden[i].amax) / 448.0f);
  }
}
