// Quantize-on-send (ProducerOptions::quantize, docs/protocol.md §14): a
// producer given bf16/f32 weights sends the selected ones as block FP8 plus
// their scales; consumers, with no option, read them bit-exact against the
// independent reference (quant_ref.hpp). Real consumer processes, a tensor
// whose FP8 bytes cross a slot boundary inside a 128-row block, NaN and
// filter refusals, delta syncs of the FP8 bytes, a late joiner of a store
// region.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <tuple>

#include "quant_ref.hpp"
#include "shmcast/shmcast.hpp"
#include "support.hpp"

using namespace shmcast;
using namespace shmcast_test;
using namespace std::chrono_literals;

namespace {

// A small model's tensors, filled from a seed (the child recomputes them).
struct Model {
  std::vector<TensorSpec> specs;
  std::vector<std::vector<std::byte>> data;
  explicit Model(std::uint64_t seed) {
    add("model.layers.0.mlp.down_proj.weight", DType::kBF16, {2000, 1500});  // FP8 bytes cross the 2 MiB slot
    add("model.layers.0.input_layernorm.weight", DType::kBF16, {1500});
    add("model.embed_tokens.weight", DType::kBF16, {256, 128});
    add("model.layers.0.mlp.gate.weight", DType::kBF16, {128, 256});  // the router: not quantized
    add("model.layers.0.self_attn.o_proj.weight", DType::kF32, {129, 300});
    add("lm_head.weight", DType::kBF16, {256, 128});
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 0.02f);
    for (std::size_t i = 0; i < specs.size(); ++i) {
      std::vector<std::byte>& d = data[i];
      const std::size_t es = dtype_size(specs[i].dtype);
      for (std::size_t at = 0; at < d.size(); at += es) {
        float x = normal(rng) * ((at / es) % 997 == 0 ? 1000.0f : 1.0f);
        if (es == 4) {
          std::memcpy(&d[at], &x, 4);
        } else {
          std::uint32_t b;
          std::memcpy(&b, &x, 4);
          const std::uint16_t h = static_cast<std::uint16_t>(b >> 16);
          std::memcpy(&d[at], &h, 2);
        }
      }
    }
  }
  void add(std::string name, DType dt, std::vector<std::int64_t> shape) {
    TensorSpec t;
    t.name = std::move(name);
    t.dtype = dt;
    t.shape = std::move(shape);
    data.emplace_back(t.nbytes());
    specs.push_back(std::move(t));
  }
  std::vector<const void*> ptrs() const {
    std::vector<const void*> p;
    for (const auto& d : data) p.push_back(d.data());
    return p;
  }
  std::uint64_t bytes() const {
    std::uint64_t n = 0;
    for (const auto& d : data) n += d.size();
    return n;
  }
};

bool quantized(std::size_t i) { return i == 0 || i == 4; }

// What a consumer must see for `m`: per manifest tensor, name, dtype, shape, bytes.
struct Expected {
  std::string name;
  DType dtype;
  std::vector<std::int64_t> shape;
  std::vector<std::byte> bytes;
};
std::vector<Expected> expected(const Model& m, bool ue8m0) {
  std::vector<Expected> out;
  for (std::size_t i = 0; i < m.specs.size(); ++i) {
    const TensorSpec& t = m.specs[i];
    if (!quantized(i)) {
      out.push_back({t.name, t.dtype, t.shape, m.data[i]});
      continue;
    }
    const quant_ref::Result r = quant_ref::per_block(m.data[i].data(), t.dtype, t.shape[0], t.shape[1], ue8m0);
    Expected q{t.name, DType::kF8E4M3FN, t.shape, std::vector<std::byte>(r.q.size())};
    std::memcpy(q.bytes.data(), r.q.data(), r.q.size());
    Expected s{t.name + "_scale_inv", DType::kF32, {(t.shape[0] + 127) / 128, (t.shape[1] + 127) / 128},
               std::vector<std::byte>(r.scale_inv.size() * 4)};
    std::memcpy(s.bytes.data(), r.scale_inv.data(), s.bytes.size());
    out.push_back(std::move(q));
    out.push_back(std::move(s));
  }
  return out;
}

// Reads the sync `c` waits for and compares it with `want`: "" or the first difference.
std::string read_and_check(Consumer& c, const std::vector<Expected>& want, Duration timeout = 30s * kSlowdown) {
  const SyncInfo& s = c.wait_sync(timeout);
  if (s.tensors.size() != want.size()) return "tensor count " + std::to_string(s.tensors.size());
  std::vector<std::vector<std::byte>> got(want.size());
  std::vector<void*> dsts;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const TensorInfo& t = s.tensors[i];
    if (t.name != want[i].name || t.dtype != want[i].dtype || t.shape != want[i].shape)
      return "tensor " + std::to_string(i) + " is '" + t.name + "' " + std::string(dtype_name(t.dtype));
    got[i].resize(t.nbytes);
    dsts.push_back(got[i].data());
  }
  c.read_into(dsts);
  for (std::size_t i = 0; i < want.size(); ++i)
    if (got[i] != want[i].bytes) return "bytes of '" + want[i].name + "' differ";
  return {};
}

ProducerOptions popts(Quantize q) {
  ProducerOptions o;
  o.slot_bytes = 2ull << 20;
  o.slots = 2;
  o.pin = Pin::kNo;
  o.engine = CopyEngine::kHost;
  o.quantize = q;
  o.consumer_timeout = 30s * kSlowdown;
  return o;
}

ConsumerOptions copts() {
  ConsumerOptions o;
  o.pin = Pin::kNo;
  o.open_timeout = 20s * kSlowdown;
  o.chunk_timeout = 30s * kSlowdown;
  return o;
}

}  // namespace

// Two consumer processes, both variants: the FP8 tensors and scales arrive
// bit-exact (the large tensor's bytes cross a slot boundary inside a
// 128-row block), the rest unchanged; last_sync() counts the caller's bytes
// and the bytes that crossed.
TEST(QuantSync, ConsumerProcessesGetFp8AndScalesBitExact) {
  for (Quantize q : {Quantize::kFp8Block128, Quantize::kFp8Block128Ue8m0}) {
    SCOPED_TRACE(std::string(quantize_name(q)));
    RegionDir dir("quant");
    const std::string name = unique_name("quant");
    RegionGuard guard{name};
    Producer p = Producer::create(name, popts(q));
    const bool ue8m0 = q == Quantize::kFp8Block128Ue8m0;
    std::vector<Child> kids;
    for (int k = 0; k < 2; ++k)
      kids.push_back(Child::spawn([&] {
        Consumer c = Consumer::open(name, copts());
        for (std::uint64_t v = 1; v <= 2; ++v) {
          const std::string why = read_and_check(c, expected(Model(v), ue8m0));
          if (!why.empty()) {
            std::fprintf(stderr, "version %llu: %s\n", static_cast<unsigned long long>(v), why.c_str());
            return 1;
          }
        }
        return 0;
      }));
    p.wait_for_consumers(2, 30s * kSlowdown);
    for (std::uint64_t v = 1; v <= 2; ++v) {
      const Model m(v);
      ASSERT_EQ(p.send(m.specs, m.ptrs()), v);
      const SyncReport r = p.last_sync();
      EXPECT_EQ(r.logical_bytes, m.bytes());
      std::uint64_t wire = 0;
      for (const Expected& e : expected(m, ue8m0)) wire += e.bytes.size();
      EXPECT_EQ(r.payload_bytes, wire);
      EXPECT_LT(r.payload_bytes * 100, r.logical_bytes * 52);
    }
    for (Child& k : kids) EXPECT_EQ(k.wait(std::chrono::seconds(60 * kSlowdown)), 0);
  }
}

// A NaN in a tensor to quantize: send() fails naming the tensor and the
// place, with nothing announced (the consumer sees no sync, and the next
// good one arrives whole). Through begin_sync() and write(), the write
// fails the same way and aborts the sync; the next one arrives whole.
TEST(QuantSync, NanFailsTheSendNamingTheTensor) {
  RegionDir dir("quant");
  const std::string name = unique_name("quantnan");
  RegionGuard guard{name};
  Producer p = Producer::create(name, popts(Quantize::kFp8Block128));
  Consumer c = Consumer::open(name, copts());
  const Model m1(1);
  p.send(m1.specs, m1.ptrs());
  ASSERT_EQ(read_and_check(c, expected(m1, false)), "");
  Model bad(2);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(&bad.data[4][(3 * 300 + 5) * 4], &nan, 4);
  try {
    p.send(bad.specs, bad.ptrs());
    FAIL() << "send() of a NaN went through";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("'model.layers.0.self_attn.o_proj.weight' holds NaN at [3, 5]"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(p.last_version(), 1u);
  EXPECT_THROW(
      {
        try {
          c.wait_sync(300ms);
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), Errc::kTimeout);
          throw;
        }
      },
      Error);
  const Model m3(3);
  EXPECT_EQ(p.send(m3.specs, m3.ptrs()), 2u);
  ASSERT_EQ(read_and_check(c, expected(m3, false)), "");
  // begin_sync + write: the write of the NaN tensor fails, naming it, and
  // aborts the sync (the consumer, which had not started it, skips it).
  p.begin_sync(bad.specs);
  for (std::size_t i = 0; i < 4; ++i) p.write(i, bad.data[i].data());
  try {
    p.write(4, bad.data[4].data());
    FAIL() << "write() of a NaN went through";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("o_proj.weight' holds NaN at [3, 5]"), std::string::npos) << e.what();
  }
  EXPECT_THROW(p.end_sync(), Error);  // nothing in progress any more
  // The consumer lets the aborted sync go while the next one is sent.
  const Model m4(4);
  std::thread sender([&] { p.send(m4.specs, m4.ptrs()); });
  EXPECT_EQ(read_and_check(c, expected(m4, false)), "");
  sender.join();
}

// A filter that selects a 1-D tensor, or an integer one, is refused at
// begin_sync() (kInvalidArgument naming it); the producer goes on.
TEST(QuantSync, FilterSelectingNon2DOrNonFloatIsRefused) {
  RegionDir dir("quant");
  const std::string name = unique_name("quantfilter");
  RegionGuard guard{name};
  ProducerOptions o = popts(Quantize::kFp8Block128);
  std::string pick = "model.layers.0.input_layernorm.weight";
  o.quantize_filter = [&pick](const TensorSpec& t) { return t.name == pick || default_quantize_filter(t); };
  Producer p = Producer::create(name, o);
  Model m(1);
  try {
    p.send(m.specs, m.ptrs());
    FAIL() << "a 1-D tensor was quantized";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("'model.layers.0.input_layernorm.weight'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("only 2-D bf16, f16 or f32"), std::string::npos) << e.what();
  }
  m.add("step", DType::kI32, {256, 256});
  pick = "step";
  EXPECT_THROW(p.begin_sync(m.specs), Error);
  EXPECT_THROW((void)p.manifest_specs(m.specs), Error);  // what begin_sync() refuses
  EXPECT_EQ(p.last_version(), 0u);
  pick = "";
  m.add("model.layers.0.mlp.down_proj.weight_scale_inv", DType::kF32, {16, 12});  // would collide
  EXPECT_THROW(p.begin_sync(m.specs), Error);
  m.specs.pop_back();
  m.data.pop_back();
  Consumer c = Consumer::open(name, copts());
  // manifest_specs(): the manifest that send() then writes (a control plane
  // announces its names first).
  std::vector<Expected> want = expected(m, false);
  const std::vector<TensorSpec> wire = p.manifest_specs(m.specs);
  ASSERT_EQ(wire.size(), want.size());
  for (std::size_t i = 0; i < wire.size(); ++i) {
    EXPECT_EQ(wire[i].name, want[i].name) << i;
    EXPECT_EQ(wire[i].dtype, want[i].dtype) << want[i].name;
    EXPECT_EQ(wire[i].shape, want[i].shape) << want[i].name;
  }
  EXPECT_EQ(p.send(m.specs, m.ptrs()), 1u);
  EXPECT_EQ(read_and_check(c, want), "");
}

// prepare_device() (the GPU sources' scales before a sync) where it cannot
// run: a host-engine producer refuses it, naming the engine; a size mismatch
// and a call during a sync are refused; without quantize it does nothing. A
// refusal announces nothing: the next send() (after a sync begun and
// aborted, version 1) is version 2 and arrives.
TEST(QuantSync, PrepareDeviceIsRefusedWhereItCannotRun) {
  RegionDir dir("quant");
  const std::string name = unique_name("quantprep");
  RegionGuard guard{name};
  Producer p = Producer::create(name, popts(Quantize::kFp8Block128));
  Model m(1);
  const std::vector<const void*> ptrs = m.ptrs();
  try {
    p.prepare_device(m.specs, ptrs, nullptr);
    FAIL() << "a host-engine producer prepared device scales";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("host copy engine"), std::string::npos) << e.what();
  }
  EXPECT_EQ(code_of([&] { p.prepare_device(m.specs, std::span<const void* const>(ptrs).first(1), nullptr); }),
            Errc::kInvalidArgument);
  p.begin_sync(m.specs);
  EXPECT_EQ(code_of([&] { p.prepare_device(m.specs, ptrs, nullptr); }), Errc::kInvalidArgument);
  p.abort_sync("test");
  {
    const std::string plain_name = unique_name("quantprep-none");
    RegionGuard g2{plain_name};
    Producer none = Producer::create(plain_name, popts(Quantize::kNone));
    none.prepare_device(m.specs, ptrs, nullptr);  // no quantize: nothing to do
  }
  Consumer c = Consumer::open(name, copts());
  EXPECT_EQ(p.send(m.specs, ptrs), 2u);
  EXPECT_EQ(read_and_check(c, expected(m, false)), "");
}

// A quantized tensor's source must be aligned to its elements (the GPU
// kernel's loads would fault the caller's CUDA context otherwise; a host
// source is held to the same rule): a misaligned pointer or pitch is
// refused with kInvalidArgument before anything is read, the sync is
// aborted, and the next send() arrives.
TEST(QuantSync, MisalignedSourcesOfQuantizedTensorsAreRefused) {
  RegionDir dir("quant");
  const std::string name = unique_name("quantalign");
  RegionGuard guard{name};
  Producer p = Producer::create(name, popts(Quantize::kFp8Block128));
  Model m(1);
  const std::vector<const void*> ptrs = m.ptrs();
  ASSERT_TRUE(quantized(4) && m.specs[4].dtype == DType::kF32);
  std::vector<std::byte> shifted(m.data[4].size() + 8);
  std::memcpy(shifted.data() + 2, m.data[4].data(), m.data[4].size());
  const std::uint64_t row = static_cast<std::uint64_t>(m.specs[4].shape[1]) * 4;
  for (int k = 0; k < 2; ++k) {
    p.begin_sync(m.specs);
    for (std::size_t i = 0; i < 4; ++i) p.write(i, ptrs[i]);
    try {
      if (k == 0)
        p.write(4, shifted.data() + 2);  // 2 bytes past a float's alignment
      else  // rows 2 bytes wider than the elements they hold
        p.write_strided(4, m.data[4].data(), Strided2D{static_cast<std::uint64_t>(m.specs[4].shape[0]), row, row + 2});
      FAIL() << "a misaligned source was quantized (" << k << ")";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("not aligned to its 4-byte elements"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(code_of([&] { p.send(m.specs, std::vector<const void*>{ptrs[0], ptrs[1], ptrs[2], ptrs[3],
                                                                   shifted.data() + 2, ptrs[5]}); }),
            Errc::kInvalidArgument);  // send()'s scales before the sync: nothing announced
  Consumer c = Consumer::open(name, copts());
  EXPECT_EQ(p.send(m.specs, ptrs), 3u);  // versions 1 and 2 were aborted
  EXPECT_EQ(read_and_check(c, expected(m, false)), "");
}

// A send() made while a sync is open (refused: a sync is in progress) must
// not touch that sync's maps of caller tensors to manifest tensors (its
// scale pass once rewrote them, and the open sync's next write took the
// layer norm for a quantized tensor); an index past the caller's list is
// refused as out of range (not taken as a manifest index), which aborts
// the sync.
TEST(QuantSync, ASendOrAWrongIndexDuringASyncLeavesItsMapsAlone) {
  RegionDir dir("quant");
  const std::string name = unique_name("quantmaps");
  RegionGuard guard{name};
  Producer p = Producer::create(name, popts(Quantize::kFp8Block128));
  Consumer c = Consumer::open(name, copts());
  Model m(1);
  const std::vector<const void*> ptrs = m.ptrs();
  ASSERT_TRUE(quantized(0) && !quantized(1));
  EXPECT_EQ(p.begin_sync(m.specs), 1u);
  p.write(0, ptrs[0]);
  const std::vector<TensorSpec> other{m.specs[1], m.specs[0]};  // another selection order
  EXPECT_EQ(code_of([&] { p.send(other, std::vector<const void*>{ptrs[1], ptrs[0]}); }), Errc::kInvalidArgument);
  for (std::size_t i = 1; i < m.specs.size(); ++i) p.write(i, ptrs[i]);
  p.end_sync();
  EXPECT_EQ(read_and_check(c, expected(m, false)), "");
  EXPECT_EQ(p.begin_sync(m.specs), 2u);
  try {
    p.write(m.specs.size(), ptrs[0]);
    FAIL() << "an index past the caller's tensors was written";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("out of range"), std::string::npos) << e.what();
  }
  EXPECT_EQ(code_of([&] { p.write(0, ptrs[0]); }), Errc::kInvalidArgument);  // the sync was aborted
}

// send()'s scales are computed before its sync begins; when that
// begin_sync() then throws (a version not above the last), the scales must
// die with it: a later sync written by hand from the same pointers, after
// the tensors changed in place, computes its own. Reusing them quantized the
// new values with the old blocks' maxima (wrong codes, reported as success).
TEST(QuantSync, ScalesOfASendWhoseSyncNeverBeganAreNotReused) {
  RegionDir dir("quant");
  const std::string name = unique_name("quantstale");
  RegionGuard guard{name};
  Producer p = Producer::create(name, popts(Quantize::kFp8Block128));
  Consumer c = Consumer::open(name, copts());
  Model m(1);
  const std::vector<const void*> ptrs = m.ptrs();
  ASSERT_EQ(p.send(m.specs, ptrs, 5), 5u);
  ASSERT_EQ(read_and_check(c, expected(m, false)), "");
  auto become = [&m](std::uint64_t seed, float scale) {  // new values, same buffers
    Model n(seed);
    for (std::size_t i = 0; i < m.data.size(); ++i) {
      m.data[i] = n.data[i];
      if (m.specs[i].dtype != DType::kF32 || scale == 1.0f) continue;
      for (std::size_t at = 0; at < m.data[i].size(); at += 4) {
        float x;
        std::memcpy(&x, &m.data[i][at], 4);
        x *= scale;
        std::memcpy(&m.data[i][at], &x, 4);
      }
    }
  };
  become(2, 1.0f);
  EXPECT_EQ(code_of([&] { p.send(m.specs, ptrs, 3); }), Errc::kInvalidArgument);  // 3 is not above 5
  become(3, 64.0f);  // other maxima: the f32 tensor's blocks grow 64-fold
  p.begin_sync(m.specs, 6);
  for (std::size_t i = 0; i < m.specs.size(); ++i) p.write(i, ptrs[i]);
  p.end_sync();
  EXPECT_EQ(read_and_check(c, expected(m, false)), "");
}

// Delta syncs of FP8 bytes (ProducerOptions::delta with quantize): the
// codec sees the quantized bytes and scales, so a small change in the bf16
// weights goes out as a delta and the consumer's FP8 tensors and scales
// equal the reference quantization of the new weights.
TEST(QuantSync, DeltaSyncsCarryTheQuantizedBytes) {
  RegionDir dir("quant");
  const std::string name = unique_name("quantdelta");
  RegionGuard guard{name};
  ProducerOptions o = popts(Quantize::kFp8Block128);
  o.delta = true;
  Producer p = Producer::create(name, o);
  Consumer c = Consumer::open(name, copts());
  Model m(1);
  std::vector<std::vector<std::byte>> got;
  std::vector<void*> dsts;
  for (int step = 0; step < 4; ++step) {
    if (step > 0) {  // change a few hundred elements of the big weight, and one of its block maxima
      std::mt19937_64 rng(step);
      for (int k = 0; k < 300; ++k) {
        const std::size_t at = (rng() % (2000 * 1500)) * 2;
        m.data[0][at] = static_cast<std::byte>(rng());
      }
    }
    p.send(m.specs, m.ptrs());
    const SyncInfo& s = c.wait_sync(30s * kSlowdown);
    if (step == 0) {
      for (const TensorInfo& t : s.tensors) {
        got.emplace_back(t.nbytes);
        dsts.push_back(got.back().data());
      }
    }
    c.read_into(dsts);
    EXPECT_EQ(c.last_sync().delta, step > 0) << step;
    const std::vector<Expected> want = expected(m, false);
    ASSERT_EQ(want.size(), got.size());
    for (std::size_t i = 0; i < want.size(); ++i) EXPECT_EQ(got[i], want[i].bytes) << step << " " << want[i].name;
    if (step > 0) {
      EXPECT_LT(p.last_sync().payload_bytes, p.last_sync().logical_bytes / 10);
    }
  }
}

// A store region keeps the quantized version: a consumer that opens after
// the send (a late joiner) reads the FP8 tensors and scales.
TEST(QuantSync, LateJoinerOfAStoreRegionReadsFp8) {
  RegionDir dir("quant");
  const std::string name = unique_name("quantstore");
  RegionGuard guard{name};
  ProducerOptions o = popts(Quantize::kFp8Block128Ue8m0);
  const Model m(5);
  o.mode = RegionMode::kStore;
  o.store_bytes = store_bytes_needed(m.specs);
  Producer p = Producer::create(name, o);
  p.send(m.specs, m.ptrs());
  Child kid = Child::spawn([&] {
    Consumer c = Consumer::open(name, copts());
    const std::string why = read_and_check(c, expected(m, true));
    if (!why.empty()) std::fprintf(stderr, "%s\n", why.c_str());
    return why.empty() ? 0 : 1;
  });
  EXPECT_EQ(kid.wait(std::chrono::seconds(60 * kSlowdown)), 0);
}

namespace {

// Rank r of 2 of a sharded quantizing producer: "a.weight" [300, 256] split
// along dim 0 at `row_cut`, "b.weight" [256, 384] split along dim 1 at 256.
// Returns 0 when the sync went through, 2 when begin_sync() refused it with
// a message naming "a.weight" and the boundary, else 1.
int quant_rank(const std::string& name, int r, std::int64_t row_cut, const std::vector<std::byte>& a,
               const std::vector<std::byte>& b, SharedFlags* attached) {
  ProducerOptions o = popts(Quantize::kFp8Block128);
  o.slots = 4;
  o.rank = static_cast<std::uint32_t>(r);
  o.world_size = 2;
  o.rank_timeout = 30s * kSlowdown;
  Producer p = Producer::create(name, o);
  // Both ranks hold the region before either sends: a rank that fails its
  // send and exits must not remove the name before the other attached.
  attached->v[r].store(1);
  if (!attached->wait(1 - r, 1, 60s * kSlowdown)) return 3;
  if (r == 0) p.wait_for_consumers(1, 30s * kSlowdown);
  TensorSpec ta{"a.weight", DType::kBF16, {300, 256}, 0, r == 0 ? 0 : row_cut, r == 0 ? row_cut : 300 - row_cut};
  TensorSpec tb{"b.weight", DType::kBF16, {256, 384}, 1, r == 0 ? 0 : 256, r == 0 ? 256 : 128};
  std::vector<std::byte> pa(static_cast<std::size_t>(ta.shard_length) * 256 * 2);
  std::memcpy(pa.data(), a.data() + static_cast<std::size_t>(ta.shard_start) * 256 * 2, pa.size());
  std::vector<std::byte> pb(static_cast<std::size_t>(256 * tb.shard_length) * 2);
  for (std::int64_t row = 0; row < 256; ++row)
    std::memcpy(&pb[static_cast<std::size_t>(row * tb.shard_length) * 2],
                &b[static_cast<std::size_t>(row * 384 + tb.shard_start) * 2], static_cast<std::size_t>(tb.shard_length) * 2);
  const std::vector<TensorSpec> specs{ta, tb};
  const std::vector<const void*> srcs{pa.data(), pb.data()};
  try {
    p.send(specs, srcs);
  } catch (const Error& e) {
    const std::string w = e.what();
    const bool named = w.find("'a.weight'") != std::string::npos &&
                       w.find("boundary at " + std::to_string(row_cut)) != std::string::npos;
    if (!named) std::fprintf(stderr, "rank %d: %s\n", r, e.what());
    return named ? 2 : 1;
  }
  return 0;
}

std::vector<std::byte> bf16_matrix(std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
  std::vector<std::byte> out(static_cast<std::size_t>(rows * cols) * 2);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (std::size_t i = 0; i < out.size(); i += 2) {
    const float x = normal(rng) * ((i / 2) % 4099 == 0 ? 300.0f : 1.0f);
    std::uint32_t bits;
    std::memcpy(&bits, &x, 4);
    const std::uint16_t h = static_cast<std::uint16_t>(bits >> 16);
    std::memcpy(&out[i], &h, 2);
  }
  return out;
}

}  // namespace

// Sharded ranks quantize their own blocks: with shards on multiples of 128
// (the last one the tensor's partial edge) the consumer reads the whole
// tensors' FP8 bytes and scales as one producer would send them; a shard
// boundary inside a 128-row block is refused at the send on both ranks
// (rank 0's own shard ends at it, rank 1's starts there), naming the tensor
// and the boundary.
TEST(QuantSync, ShardedRanksQuantizeTheirBlocksAndRefuseAStraddlingBoundary) {
  RegionDir dir("quant");
  const std::vector<std::byte> a = bf16_matrix(300, 256, 1), b = bf16_matrix(256, 384, 2);
  SharedFlags* attached = SharedFlags::make();
  {
    const std::string name = unique_name("quantshard");
    RegionGuard guard{name};
    Child r0 = Child::spawn([&] { return quant_rank(name, 0, 128, a, b, attached); });
    Child r1 = Child::spawn([&] { return quant_rank(name, 1, 128, a, b, attached); });
    Consumer c = Consumer::open(name, copts());
    const SyncInfo& s = c.wait_sync(30s * kSlowdown);
    ASSERT_EQ(s.tensors.size(), 4u);
    std::vector<std::vector<std::byte>> got(4);
    std::vector<void*> dsts;
    for (std::size_t i = 0; i < 4; ++i) {
      got[i].resize(s.tensors[i].nbytes);
      dsts.push_back(got[i].data());
    }
    std::vector<std::string> names;
    for (const TensorInfo& t : s.tensors) names.push_back(t.name);
    c.read_into(dsts);
    for (const auto& [nm, src, rows, cols] :
         {std::tuple{std::string("a.weight"), &a, 300, 256}, std::tuple{std::string("b.weight"), &b, 256, 384}}) {
      const quant_ref::Result want = quant_ref::per_block(src->data(), DType::kBF16, rows, cols, false);
      const std::ptrdiff_t qi = s.find(nm), si = s.find(nm + "_scale_inv");
      ASSERT_GE(qi, 0);
      ASSERT_GE(si, 0);
      EXPECT_EQ(s.tensors[static_cast<std::size_t>(qi)].dtype, DType::kF8E4M3FN);
      EXPECT_EQ(std::memcmp(got[static_cast<std::size_t>(qi)].data(), want.q.data(), want.q.size()), 0) << nm;
      ASSERT_EQ(got[static_cast<std::size_t>(si)].size(), want.scale_inv.size() * 4) << nm;
      EXPECT_EQ(std::memcmp(got[static_cast<std::size_t>(si)].data(), want.scale_inv.data(), want.scale_inv.size() * 4), 0)
          << nm;
    }
    EXPECT_EQ(r0.wait(std::chrono::seconds(60 * kSlowdown)), 0);
    EXPECT_EQ(r1.wait(std::chrono::seconds(60 * kSlowdown)), 0);
  }
  {
    const std::string name = unique_name("quantstraddle");
    RegionGuard guard{name};
    attached->v[0].store(0);
    attached->v[1].store(0);
    Child r0 = Child::spawn([&] { return quant_rank(name, 0, 150, a, b, attached); });
    Child r1 = Child::spawn([&] { return quant_rank(name, 1, 150, a, b, attached); });
    Consumer c = Consumer::open(name, copts());
    EXPECT_EQ(r0.wait(std::chrono::seconds(60 * kSlowdown)), 2);
    EXPECT_EQ(r1.wait(std::chrono::seconds(60 * kSlowdown)), 2);
  }
}
