// GPU tier: the CUDA delta codec (delta_cuda.hpp, kernels/delta.cu) against
// the host codec (delta.hpp), which tests/unit/test_delta.cpp checks against
// references: the GPU's blob must be the host's byte for byte, its base
// updated to the new bytes, its apply the host's apply (whole tensors and
// slices), its checksum the host's, and it must reject every malformed blob
// the host rejects without writing the destination. Every test skips when
// no CUDA device is usable, or when the build has no delta kernels (no nvcc).
//
// CUDA is initialised in this process only after gpu_present() probed in a
// forked child (gpu_support.hpp); nothing here forks afterwards.
#include <gtest/gtest.h>

#include "protocol/delta.hpp"
#include "engine/delta_cuda.hpp"
#include "delta_support.hpp"
#include "gpu_support.hpp"

using namespace shmcast;
using namespace shmcast_gpu;
using namespace delta_test;
namespace dl = shmcast::detail::delta;

namespace {

#define REQUIRE_DELTA_GPU()                                                                 \
  do {                                                                                      \
    SHMCAST_REQUIRE_GPU();                                                                  \
    std::string why_;                                                                       \
    if (!dl::cuda_codec_available(&why_)) GTEST_SKIP() << "no CUDA delta codec: " << why_; \
  } while (0)

struct Stream {
  cudaStream_t s = nullptr;
  Stream() { ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate"); }
  ~Stream() { cudaStreamDestroy(s); }
};

DevBuf upload(const Bytes& b) {
  DevBuf d(b.size() == 0 ? 8 : b.size());  // never a null pointer: the codec checks alignment
  d.upload(b.data(), b.size());
  // cudaMemcpy from pageable memory may return before its DMA lands, and
  // the codec runs on a non-blocking stream, which does not wait for the
  // legacy one: wait here.
  ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  return d;
}

template <class F>
Errc error_of(F&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.code();
  }
  return static_cast<Errc>(0);
}

// GPU plan + encode of base -> next; checks the base became next; returns the blob.
Bytes gpu_blob(dl::CudaCodec& codec, const Bytes& base, const Bytes& next, std::uint32_t w, cudaStream_t s,
               bool in_place) {
  const std::uint64_t n = base.size() / w;
  DevBuf db = upload(base), dn = upload(next);
  Bytes blob;
  if (in_place) {
    // The head planned straight into an output buffer of the largest size.
    DevBuf out(dl::max_blob_bytes(w, n));
    codec.plan(db.p, dn.p, w, n, out.p, s);
    const dl::Header h = codec.read_header(out.p, s);
    const std::uint64_t size = dl::head_bytes(n) + h.payload_bytes;
    codec.encode(db.p, dn.p, w, n, out.p, out.p, out.n, s);
    codec.finish(s);
    blob = download(out.p, size);
  } else {
    DevBuf head(dl::head_bytes(n));
    codec.plan(db.p, dn.p, w, n, head.p, s);
    const dl::Header h = codec.read_header(head.p, s);
    const std::uint64_t size = dl::head_bytes(n) + h.payload_bytes;
    DevBuf out(size);
    codec.encode(db.p, dn.p, w, n, head.p, out.p, size, s);
    codec.finish(s);
    blob = download(out.p, size);
  }
  EXPECT_EQ(first_diff(download(db.p, base.size()), next), -1) << "the device base is not next after encode";
  return blob;
}

// GPU apply of `blob` to `dst_init` through `m`; returns the destination.
Bytes gpu_apply(dl::CudaCodec& codec, const Bytes& blob, std::uint32_t w, const dl::SliceMap& m, const Bytes& dst_init,
                bool verify, cudaStream_t s) {
  DevBuf dblob = upload(blob), ddst = upload(dst_init);
  codec.apply(dblob.p, blob.size(), w, m, ddst.p, dst_init.size(), verify, s);
  codec.finish(s);
  return download(ddst.p, dst_init.size());
}

}  // namespace

TEST(DeltaGpu, EncodeIsTheHostBlobByteForByte) {
  REQUIRE_DELTA_GPU();
  Stream st;
  dl::CudaCodec codec;
  std::mt19937_64 rng(31);
  const std::uint64_t sizes[] = {0, 1, 2, 7, 63, 64, 65, 4095, 4096, 4097, 3 * 4096 + 17, 20000};
  const double fracs[] = {0.0, 0.005, 0.02, 0.3, 1.0};
  int cases = 0;
  for (std::uint32_t w : {1u, 2u, 4u, 8u})
    for (std::uint64_t n : sizes)
      for (double f : fracs) {
        SCOPED_TRACE("w=" + std::to_string(w) + " n=" + std::to_string(n) + " f=" + std::to_string(f));
        const Bytes base = random_bytes(n * w, rng);
        const Bytes next = mutate(base, w, f, rng);
        const Bytes want = host_blob(base, next, w);
        const Bytes got = gpu_blob(codec, base, next, w, st.s, cases % 3 == 0);
        ASSERT_EQ(got.size(), want.size());
        ASSERT_EQ(first_diff(got, want), -1);
        // The GPU applies the host's blob like the host.
        Bytes host_dst = base;
        dl::apply(as_span(want), w, n, host_dst.data(), host_dst.size(), true);
        ASSERT_EQ(first_diff(gpu_apply(codec, want, w, dl::whole_map(n), base, true, st.s), host_dst), -1);
        ++cases;
      }
  EXPECT_EQ(cases, 4 * 12 * 5);
}

TEST(DeltaGpu, BigTensorsCrossTheGridStride) {
  // More than 32768 blocks (the grid's cap) of fp8, 2 % changed; and 16 MiB
  // of bf16 at 30 %, on the legacy default stream.
  REQUIRE_DELTA_GPU();
  dl::CudaCodec codec;
  Stream st;
  std::mt19937_64 rng(7);
  {
    const std::uint64_t n = 32768ull * 4096 + 5000;
    const Bytes base = random_bytes(n, rng);
    const Bytes next = mutate(base, 1, 0.02, rng);
    const Bytes want = host_blob(base, next, 1);
    ASSERT_EQ(first_diff(gpu_blob(codec, base, next, 1, st.s, false), want), -1);
    ASSERT_EQ(first_diff(gpu_apply(codec, want, 1, dl::whole_map(n), base, true, st.s), next), -1);
  }
  {
    dl::CudaCodec on_default;
    const std::uint64_t n = 8ull << 20;
    const Bytes base = random_bytes(n * 2, rng);
    const Bytes next = mutate(base, 2, 0.3, rng);
    const Bytes want = host_blob(base, next, 2);
    ASSERT_EQ(first_diff(gpu_blob(on_default, base, next, 2, nullptr, true), want), -1);
    ASSERT_EQ(first_diff(gpu_apply(on_default, want, 2, dl::whole_map(n), base, true, nullptr), next), -1);
  }
}

// plan_batch: many tensors (every width, sizes around the block boundary,
// one past the grid's cap of 32768 blocks in all) planned in one batch get
// the host's blobs when encoded from the batch's heads; planned again in a
// smaller batch, the codec reuses its table.
TEST(DeltaGpu, PlanBatchPlansEveryTensorLikeTheHost) {
  REQUIRE_DELTA_GPU();
  Stream st;
  dl::CudaCodec codec;
  std::mt19937_64 rng(47);
  struct T {
    std::uint32_t w;
    std::uint64_t n;
    double f;
  };
  const std::vector<T> ts = {{2, 4096, 0.02},  {1, 65, 0.3},           {4, 0, 0.0},
                             {8, 4097, 1.0},   {2, 20000 * 4096, 0.02}, {2, 1, 0.0},
                             {4, 4096, 0.0},   {1, 13000 * 4096 + 3, 0.005}, {2, 3 * 4096 + 5, 0.1}};
  for (std::size_t count : {ts.size(), std::size_t{3}}) {
    SCOPED_TRACE("tensors: " + std::to_string(count));
    std::vector<Bytes> base, next;
    std::vector<DevBuf> db, dn, heads;
    std::vector<dl::CudaCodec::PlanItem> items;
    for (std::size_t k = 0; k < count; ++k) {
      const T& t = ts[k];
      base.push_back(random_bytes(t.n * t.w, rng));
      next.push_back(mutate(base.back(), t.w, t.f, rng));
      db.push_back(upload(base.back()));
      dn.push_back(upload(next.back()));
      heads.emplace_back(dl::head_bytes(t.n));
    }
    for (std::size_t k = 0; k < count; ++k) items.push_back({db[k].p, dn[k].p, ts[k].w, ts[k].n, heads[k].p});
    codec.plan_batch(items, st.s);
    for (std::size_t k = 0; k < count; ++k) {
      SCOPED_TRACE("tensor " + std::to_string(k));
      const T& t = ts[k];
      const dl::Header h = codec.read_header(heads[k].p, st.s);
      const std::uint64_t size = dl::head_bytes(t.n) + h.payload_bytes;
      DevBuf out(size);
      codec.encode(db[k].p, dn[k].p, t.w, t.n, heads[k].p, out.p, size, st.s);
      codec.finish(st.s);
      const Bytes want = host_blob(base[k], next[k], t.w);
      const Bytes got = download(out.p, size);
      ASSERT_EQ(got.size(), want.size());
      ASSERT_EQ(first_diff(got, want), -1);
      ASSERT_EQ(first_diff(download(db[k].p, base[k].size()), next[k]), -1);
    }
  }
  // The checks plan() makes, before anything is queued.
  DevBuf b(64), n(64), hd(dl::head_bytes(8));
  EXPECT_EQ(error_of([&] { codec.plan_batch({{b.p, n.p, 3, 8, hd.p}}, st.s); }), Errc::kInvalidArgument);
  EXPECT_EQ(error_of([&] { codec.plan_batch({{b.p, static_cast<char*>(n.p) + 4, 2, 8, hd.p}}, st.s); }),
            Errc::kInvalidArgument);
}

// encode_table / encode_range: tensors of every width (one past the grid's
// cap of 32768 units, empty ones) encoded in three ranges of one table on
// the GPU get the host's blobs, their bases become next, and each job's
// pad after its blob is zeroed (and nothing past it written); a range
// outside the table and a range on another stream are refused.
TEST(DeltaGpu, EncodeRangesOfATableAreTheHostBlobs) {
  REQUIRE_DELTA_GPU();
  Stream st;
  dl::CudaCodec codec;
  std::mt19937_64 rng(53);
  struct T {
    std::uint32_t w;
    std::uint64_t n;
    double f;
  };
  const std::vector<T> ts = {{2, 4096, 0.02}, {1, 65, 0.3},  {4, 0, 0.0},           {8, 4097, 1.0},
                             {2, 1, 0.0},     {2, 9000 * 4096 + 7, 0.02}, {4, 4096, 0.0}, {2, 30000 * 4096, 0.01}};
  std::vector<Bytes> base, next;
  std::vector<DevBuf> db, dn, heads;
  std::vector<dl::CudaCodec::PlanItem> plans;
  for (const T& t : ts) {
    base.push_back(random_bytes(t.n * t.w, rng));
    next.push_back(mutate(base.back(), t.w, t.f, rng));
    db.push_back(upload(base.back()));
    dn.push_back(upload(next.back()));
    heads.emplace_back(dl::head_bytes(t.n));
  }
  for (std::size_t k = 0; k < ts.size(); ++k) plans.push_back({db[k].p, dn[k].p, ts[k].w, ts[k].n, heads[k].p});
  codec.plan_batch(plans, st.s);
  std::vector<std::uint64_t> sizes;
  for (std::size_t k = 0; k < ts.size(); ++k)
    sizes.push_back(dl::head_bytes(ts[k].n) + codec.read_header(heads[k].p, st.s).payload_bytes);
  // One buffer, laid out as a stream: each blob 256-aligned, pad k + 9 bytes after it, then 0xa5.
  std::vector<std::uint64_t> at;
  std::uint64_t total = 0;
  for (std::size_t k = 0; k < ts.size(); ++k) {
    at.push_back(total);
    total = (total + sizes[k] + k + 9 + 1 + 255) / 256 * 256;
  }
  const Bytes fill(total, 0xa5);
  DevBuf out = upload(fill);
  std::vector<dl::CudaCodec::EncodeItem> items;
  for (std::size_t k = 0; k < ts.size(); ++k)
    items.push_back({db[k].p, dn[k].p, ts[k].w, ts[k].n, heads[k].p, static_cast<char*>(out.p) + at[k], sizes[k],
                     k + 9});
  codec.encode_table(items, st.s);
  codec.encode_range(0, 2, st.s);
  codec.encode_range(2, 2, st.s);
  codec.encode_range(2, ts.size(), st.s);
  codec.finish(st.s);
  const Bytes got = download(out.p, total);
  for (std::size_t k = 0; k < ts.size(); ++k) {
    SCOPED_TRACE("tensor " + std::to_string(k));
    const Bytes want = host_blob(base[k], next[k], ts[k].w);
    ASSERT_EQ(want.size(), sizes[k]);
    ASSERT_EQ(first_diff(Bytes(got.begin() + at[k], got.begin() + at[k] + sizes[k]), want), -1);
    for (std::uint64_t q = 0; q < k + 9; ++q) ASSERT_EQ(got[at[k] + sizes[k] + q], 0) << "pad byte " << q;
    ASSERT_EQ(got[at[k] + sizes[k] + k + 9], 0xa5);
    ASSERT_EQ(first_diff(download(db[k].p, base[k].size()), next[k]), -1);
  }
  EXPECT_EQ(error_of([&] { codec.encode_range(3, ts.size() + 1, st.s); }), Errc::kInvalidArgument);
  Stream other;
  EXPECT_EQ(error_of([&] { codec.encode_range(0, 1, other.s); }), Errc::kInvalidArgument);
  DevBuf b(64), n(64), hd(dl::head_bytes(8)), o(64);
  EXPECT_EQ(error_of([&] { codec.encode_table({{b.p, n.p, 2, 8, hd.p, o.p, 8, 0}}, st.s); }),
            Errc::kInvalidArgument);  // out_bytes below the header and table
}

TEST(DeltaGpu, SlicesApplyLikeTheHost) {
  REQUIRE_DELTA_GPU();
  Stream st;
  dl::CudaCodec codec;
  std::mt19937_64 rng(11);
  for (int iter = 0; iter < 120; ++iter) {
    const std::uint32_t w = 1u << (rng() % 4);
    const std::vector<std::int64_t> shape = random_shape(rng, iter % 4 == 0);
    std::int64_t total = 1;
    for (auto x : shape) total *= x;
    const Selection piece = random_rows(rng, shape, 3), sel = random_rows(rng, shape, 3);
    const Bytes full_old = random_bytes(static_cast<std::size_t>(total) * w, rng);
    const double fracs[] = {0.02, 0.3, 1.0, 0.0};
    const Bytes full_new = mutate(full_old, w, fracs[iter % 4], rng);
    const Bytes blob = host_blob(piece_bytes(shape, w, full_old, piece), piece_bytes(shape, w, full_new, piece), w);
    const dl::SliceMap m = dl::slice_map(shape, w, piece, sel);
    const Bytes dst0 = reference_slice(shape, w, full_old, full_old, Selection{}, sel);
    Bytes host_dst = dst0;
    const bool verify = dl::holds_piece(m) && iter % 2 == 0;  // strided pieces too (the batch checksum)
    dl::apply(as_span(blob), w, m, host_dst.data(), host_dst.size(), verify);
    const Bytes got = gpu_apply(codec, blob, w, m, dst0, verify, st.s);
    ASSERT_EQ(first_diff(got, host_dst), -1)
        << "iter " << iter << " w " << w << " piece dim " << piece.dim << " [" << piece.start << ", +" << piece.length
        << ") sel dim " << sel.dim << " [" << sel.start << ", +" << sel.length << ")";
  }
}

TEST(DeltaGpu, ChecksumIsTheHostsAtAnyAlignment) {
  REQUIRE_DELTA_GPU();
  Stream st;
  dl::CudaCodec codec;
  std::mt19937_64 rng(17);
  const Bytes d = random_bytes((3 << 20) + 13, rng);
  DevBuf dd = upload(d), out(8);
  for (std::size_t off : {0u, 1u, 2u, 4u, 7u})
    for (std::size_t len : {0u, 1u, 9u, 4096u, 100001u, static_cast<unsigned>(d.size() - 7)}) {
      codec.checksum(static_cast<std::uint8_t*>(dd.p) + off, len, out.p, st.s);
      codec.finish(st.s);
      std::uint64_t got = 0;
      ck(cudaMemcpy(&got, out.p, 8, cudaMemcpyDeviceToHost), "cudaMemcpy");
      EXPECT_EQ(got, dl::checksum(d.data() + off, len)) << off << " + " << len;
      EXPECT_EQ(got, reference_checksum(d.data() + off, len)) << off << " + " << len;
    }
}

TEST(DeltaGpu, EveryMalformedBlobIsRejectedAndWritesNothing) {
  REQUIRE_DELTA_GPU();
  Stream st;
  dl::CudaCodec codec;
  const Sample s = make_sample();
  ASSERT_EQ(first_diff(gpu_apply(codec, s.blob, 2, dl::whole_map(s.n), s.base, true, st.s), s.next), -1);
  for (const Damage& c : damages(s)) {
    SCOPED_TRACE(c.name);
    Bytes blob = s.blob;
    c.apply(blob);
    Bytes host_dst = s.base;
    ASSERT_EQ(error_of([&] { dl::apply(as_span(blob), 2, s.n, host_dst.data(), host_dst.size(), false); }),
              Errc::kCorrupt);
    DevBuf dblob = upload(blob), ddst = upload(s.base);
    EXPECT_EQ(error_of([&] {
                codec.apply(dblob.p, blob.size(), 2, dl::whole_map(s.n), ddst.p, s.base.size(), false, st.s);
                codec.finish(st.s);
              }),
              Errc::kCorrupt);
    EXPECT_EQ(first_diff(download(ddst.p, s.base.size()), s.base), -1) << "the destination was written";
    // The codec is clean again after finish() threw.
    codec.finish(st.s);
  }
  // The wrong base fails verification; without it the blob applies.
  Bytes wrong = s.base;
  wrong[2 * 5001 + 1] ^= 0x10;
  EXPECT_EQ(error_of([&] { gpu_apply(codec, s.blob, 2, dl::whole_map(s.n), wrong, true, st.s); }), Errc::kCorrupt);
  Bytes host_wrong = wrong;
  dl::apply(as_span(s.blob), 2, s.n, host_wrong.data(), host_wrong.size(), false);
  EXPECT_EQ(first_diff(gpu_apply(codec, s.blob, 2, dl::whole_map(s.n), wrong, false, st.s), host_wrong), -1);
}

TEST(DeltaGpu, EncodeNoticesChangedInputsAndArgumentsAreChecked) {
  REQUIRE_DELTA_GPU();
  Stream st;
  dl::CudaCodec codec;
  std::mt19937_64 rng(3);
  const std::uint64_t n = 3 * 4096;
  const Bytes base = random_bytes(n * 2, rng);
  Bytes next = mutate(base, 2, 0.02, rng);
  DevBuf db = upload(base), dn = upload(next), head(dl::head_bytes(n));
  codec.plan(db.p, dn.p, 2, n, head.p, st.s);
  const dl::Header h = codec.read_header(head.p, st.s);
  const std::uint64_t size = dl::head_bytes(n) + h.payload_bytes;
  EXPECT_EQ(size, host_blob(base, next, 2).size());
  next[2 * 4097] ^= 0x40;  // two more changes in block 1 after planning
  next[2 * 4099] ^= 0x40;
  dn.upload(next.data(), next.size());
  DevBuf out(size);
  EXPECT_EQ(error_of([&] {
              codec.encode(db.p, dn.p, 2, n, head.p, out.p, size, st.s);
              codec.finish(st.s);
            }),
            Errc::kInvalidArgument);
  // An output smaller than the planned blob: refused on the device, nothing written.
  DevBuf small(size - 16);
  ck(cudaMemset(small.p, 0x5a, small.n), "cudaMemset");
  EXPECT_EQ(error_of([&] {
              codec.encode(db.p, dn.p, 2, n, head.p, small.p, small.n, st.s);
              codec.finish(st.s);
            }),
            Errc::kInvalidArgument);
  EXPECT_EQ(first_diff(download(small.p, small.n), Bytes(small.n, 0x5a)), -1);
  // Misaligned pointers and bad widths: at once.
  auto* b8 = static_cast<std::uint8_t*>(db.p);
  EXPECT_EQ(error_of([&] { codec.plan(b8 + 2, dn.p, 2, 100, head.p, st.s); }), Errc::kInvalidArgument);
  EXPECT_EQ(error_of([&] { codec.plan(db.p, dn.p, 3, 100, head.p, st.s); }), Errc::kInvalidArgument);
  EXPECT_EQ(error_of([&] {
              codec.apply(head.p, 10, 2, dl::whole_map(n), db.p, n * 2, false, st.s);
            }),
            Errc::kCorrupt);  // too short for its table
  EXPECT_EQ(error_of([&] {
              codec.apply(head.p, head.n, 2, dl::whole_map(n), b8 + 1, n * 2, false, st.s);
            }),
            Errc::kInvalidArgument);  // dst not element-aligned
}
