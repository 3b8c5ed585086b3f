// Manifest: packing rules and a decoder that treats its input as hostile.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>

#include "base/name_set.hpp"
#include "protocol/manifest.hpp"

using namespace shmcast;
using namespace shmcast::detail;

namespace {
constexpr std::uint64_t S = 1 << 20;

std::vector<TensorSpec> sample() {
  return {{"a", DType::kF32, {3, 5}}, {"empty", DType::kBF16, {0}}, {"big", DType::kU8, {3 * S + 17}},
          {"scalar", DType::kI64, {}}, {"fits", DType::kU8, {S}}, {"b", DType::kBool, {7}}};
}

struct Encoded {
  std::vector<std::byte> bytes;
  std::vector<std::uint64_t> offsets;
  std::uint64_t stream = 0, payload = 0;
};

Encoded encode(const std::vector<TensorSpec>& specs, std::uint64_t version = 9) {
  Encoded e;
  e.stream = pack(specs, S, &e.offsets, &e.payload);
  e.bytes.resize(manifest_size(specs));
  EXPECT_EQ(encode_manifest(specs, e.offsets, version, e.stream, e.payload, e.bytes.data(), e.bytes.size()),
            e.bytes.size());
  return e;
}
}  // namespace

TEST(Pack, AlignsEveryTensorAndNeverStraddlesWhenItFits) {
  auto specs = sample();
  std::vector<std::uint64_t> off;
  std::uint64_t payload = 0;
  const std::uint64_t stream = pack(specs, S, &off, &payload);
  for (std::size_t i = 0; i < specs.size(); ++i) {
    EXPECT_EQ(off[i] % kTensorAlign, 0u);
    const std::uint64_t n = specs[i].nbytes();
    if (n > 0 && n <= S) {
      EXPECT_EQ(off[i] / S, (off[i] + n - 1) / S) << specs[i].name;
    }
    if (i > 0) {
      EXPECT_GE(off[i], off[i - 1] + specs[i - 1].nbytes());
    }
  }
  EXPECT_EQ(payload, 60u + 0 + 3 * S + 17 + 8 + S + 7);
  EXPECT_GE(stream, off.back() + 7);
}

TEST(Pack, AWholeSlotTensorStartsOnABoundary) {
  std::vector<TensorSpec> specs = {{"x", DType::kU8, {10}}, {"y", DType::kU8, {static_cast<std::int64_t>(S)}}};
  std::vector<std::uint64_t> off;
  std::uint64_t payload;
  pack(specs, S, &off, &payload);
  EXPECT_EQ(off[1], S);
}

TEST(Manifest, RoundTrips) {
  auto specs = sample();
  Encoded e = encode(specs);
  SyncInfo info;
  ASSERT_EQ(decode_manifest(e.bytes, 9, e.stream, S, &info), "");
  ASSERT_EQ(info.tensors.size(), specs.size());
  for (std::size_t i = 0; i < specs.size(); ++i) {
    EXPECT_EQ(info.tensors[i].name, specs[i].name);
    EXPECT_EQ(info.tensors[i].dtype, specs[i].dtype);
    EXPECT_EQ(info.tensors[i].shape, specs[i].shape);
    EXPECT_EQ(info.tensors[i].nbytes, specs[i].nbytes());
    EXPECT_EQ(info.tensors[i].stream_offset, e.offsets[i]);
  }
  EXPECT_EQ(info.find("big"), 2);
  EXPECT_EQ(info.find("nope"), -1);
}

TEST(Manifest, RejectsWrongVersionOrStream) {
  Encoded e = encode(sample());
  SyncInfo info;
  EXPECT_NE(decode_manifest(e.bytes, 8, e.stream, S, &info), "");
  EXPECT_NE(decode_manifest(e.bytes, 9, e.stream + 1, S, &info), "");
}

TEST(Manifest, RejectsTruncation) {
  Encoded e = encode(sample());
  SyncInfo info;
  for (std::size_t n : {std::size_t{0}, std::size_t{10}, std::size_t{64}, e.bytes.size() - 1}) {
    std::span<const std::byte> cut(e.bytes.data(), n);
    EXPECT_NE(decode_manifest(cut, 9, e.stream, S, &info), "") << n;
  }
}

TEST(Manifest, RejectsHugeTensorCount) {
  Encoded e = encode(sample());
  ManifestHeader h;
  std::memcpy(&h, e.bytes.data(), sizeof h);
  h.tensor_count = 0xffffffffu;
  std::memcpy(e.bytes.data(), &h, sizeof h);
  SyncInfo info;
  EXPECT_NE(decode_manifest(e.bytes, 9, e.stream, S, &info), "");
}

TEST(Manifest, RejectsEntryFieldCorruption) {
  const auto specs = sample();
  const Encoded base = encode(specs);
  // Corrupt each field of entry 2 ("big") in turn.
  for (int field = 0; field < 7; ++field) {
    Encoded e = base;
    ManifestEntry ent;
    std::byte* at = e.bytes.data() + sizeof(ManifestHeader) + 2 * sizeof(ManifestEntry);
    std::memcpy(&ent, at, sizeof ent);
    switch (field) {
      case 0: ent.name_offset = 1u << 30; break;
      case 1: ent.name_bytes = 0; break;
      case 2: ent.dtype = 999; break;
      case 3: ent.ndim = 9; break;
      case 4: ent.nbytes += 1; break;
      case 5: ent.stream_offset = base.stream; break;
      case 6: ent.shape[0] = -1; break;
    }
    std::memcpy(at, &ent, sizeof ent);
    SyncInfo info;
    EXPECT_NE(decode_manifest(e.bytes, 9, e.stream, S, &info), "") << "field " << field;
  }
}

namespace {

// Why an accepted manifest does not describe a consistent packing of a
// stream of `stream` bytes in slots of `slot` bytes ("" when it does): the
// contract of decode_manifest (the same checks as tests/fuzz/fuzz_manifest).
std::string inconsistency(const SyncInfo& info, std::uint64_t version, std::uint64_t stream, std::uint64_t slot) {
  if (info.version != version || info.stream_bytes != stream) return "sync fields disagree";
  std::uint64_t end_prev = 0, payload = 0;
  for (const TensorInfo& t : info.tensors) {
    if (t.name.empty() || t.name.size() > kMaxNameBytes) return "bad name length";
    if (t.shape.size() > static_cast<std::size_t>(kMaxDims)) return "too many dims";
    std::uint64_t n = dtype_size(t.dtype);
    if (n == 0) return "unknown dtype";
    for (std::int64_t dim : t.shape)
      if (dim < 0 || __builtin_mul_overflow(n, static_cast<std::uint64_t>(dim), &n)) return "bad shape";
    if (n != t.nbytes) return "nbytes is not dtype x shape";
    if (t.stream_offset % kTensorAlign) return "misaligned tensor";
    if (t.stream_offset < end_prev) return "overlapping tensors";
    if (t.nbytes > stream || t.stream_offset > stream - t.nbytes) return "tensor past the stream";
    if (t.nbytes > 0 && t.nbytes <= slot && t.stream_offset / slot != (t.stream_offset + t.nbytes - 1) / slot)
      return "tensor straddles a slot";
    end_prev = t.stream_offset + t.nbytes;
    payload += t.nbytes;
  }
  if (payload != info.payload_bytes) return "payload is not the sum of the tensors";
  return "";
}

}  // namespace

// 20,000 manifests with 1-8 random bytes overwritten. Every outcome must be
// a rejection with a reason, a typed shmcast::Error, or an acceptance of a
// manifest that still describes a consistent packing (a changed name, say);
// nothing else may escape. Both outcomes must occur (the corpus reaches the
// checks and the decoder does not refuse everything), and the decoder keeps
// no state: the intact manifest decodes exactly as before afterwards, into
// the same SyncInfo that held the rejected ones.
TEST(Manifest, RandomBytesNeverCrash) {
  std::mt19937_64 rng(1);
  const auto specs = sample();
  const Encoded base = encode(specs);
  int rejected = 0, accepted = 0, typed_errors = 0, other_exceptions = 0, inconsistent = 0;
  SyncInfo info;
  for (int i = 0; i < 20000; ++i) {
    Encoded e = base;
    const int flips = 1 + static_cast<int>(rng() % 8);
    for (int f = 0; f < flips; ++f) e.bytes[rng() % e.bytes.size()] = static_cast<std::byte>(rng());
    std::string why;
    try {
      why = decode_manifest(e.bytes, 9, e.stream, S, &info);
    } catch (const Error&) {
      ++typed_errors;
      continue;
    } catch (const std::exception& ex) {
      ++other_exceptions;
      ADD_FAILURE() << "decode_manifest threw " << ex.what() << " (iteration " << i << ")";
      continue;
    }
    if (!why.empty()) {
      ++rejected;
      continue;
    }
    ++accepted;
    const std::string bad = inconsistency(info, 9, e.stream, S);
    if (!bad.empty()) {
      ++inconsistent;
      ADD_FAILURE() << "accepted an inconsistent manifest: " << bad << " (iteration " << i << ")";
    }
  }
  std::printf("MANIFEST-RANDOM rejected=%d accepted=%d typed_errors=%d\n", rejected, accepted, typed_errors);
  EXPECT_EQ(rejected + accepted + typed_errors, 20000);
  EXPECT_EQ(other_exceptions, 0);
  EXPECT_EQ(inconsistent, 0);
  EXPECT_GT(rejected, 20000 / 2) << "most random corruption must be caught";
  EXPECT_GT(accepted, 0) << "no corruption was ever accepted: does the decoder refuse valid manifests?";
  // The intact manifest still decodes to the original sync.
  ASSERT_EQ(decode_manifest(base.bytes, 9, base.stream, S, &info), "");
  ASSERT_EQ(info.tensors.size(), specs.size());
  for (std::size_t i = 0; i < specs.size(); ++i) {
    EXPECT_EQ(info.tensors[i].name, specs[i].name);
    EXPECT_EQ(info.tensors[i].dtype, specs[i].dtype);
    EXPECT_EQ(info.tensors[i].shape, specs[i].shape);
    EXPECT_EQ(info.tensors[i].nbytes, specs[i].nbytes());
    EXPECT_EQ(info.tensors[i].stream_offset, base.offsets[i]);
  }
  EXPECT_EQ(info.payload_bytes, base.payload);
  EXPECT_EQ(inconsistency(info, 9, base.stream, S), "");
}

TEST(Spec, ValidatesNamesDtypesAndShapes) {
  EXPECT_EQ(validate_spec({"ok", DType::kF32, {2, 2}}), "");
  EXPECT_NE(validate_spec({"", DType::kF32, {2}}), "");
  EXPECT_NE(validate_spec({std::string(2000, 'x'), DType::kF32, {2}}), "");
  EXPECT_NE(validate_spec({"neg", DType::kF32, {-1}}), "");
  EXPECT_NE(validate_spec({"ov", DType::kF64, {1ll << 40, 1ll << 40}}), "");
  EXPECT_NE(validate_spec({"dims", DType::kF32, {1, 1, 1, 1, 1, 1, 1, 1, 1}}), "");
  EXPECT_NE(validate_spec({"dt", static_cast<DType>(77), {1}}), "");
}

TEST(DTypes, NamesRoundTrip) {
  for (DType d : {DType::kBool, DType::kBF16, DType::kF8E4M3FN, DType::kC128, DType::kRaw}) {
    DType back;
    ASSERT_TRUE(dtype_from_name(dtype_name(d), &back));
    EXPECT_EQ(back, d);
  }
  DType x;
  EXPECT_FALSE(dtype_from_name("float99", &x));
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
}

// Tensor names are UTF-8 on both sides: the producer refuses other bytes at
// begin_sync, and a region carrying them (hostile, or from a buggy writer)
// is Corrupt at decode, so no consumer (Python included) sees them.
TEST(Manifest, NamesMustBeUtf8OnBothSides) {
  const std::string bad[] = {"w\xff", "\xc0\xaf", "\xed\xa0\x80", "a\xe2\x82", "\xf4\x90\x80\x80"};
  for (const std::string& n : bad) {
    EXPECT_NE(validate_spec({n, DType::kU8, {4}}), "") << "accepted a non-UTF-8 name";
    // A writer that skipped the check: the decoder refuses the manifest.
    auto specs = sample();
    specs[0].name = n;
    Encoded e = encode(specs);
    SyncInfo info;
    const std::string why = decode_manifest(e.bytes, 9, e.stream, S, &info);
    EXPECT_NE(why.find("UTF-8"), std::string::npos) << why;
  }
  for (const std::string& n : {std::string("model.layers.0.mlp.weight"), std::string("\xc3\xa9t\xc3\xa9"),
                               std::string("\xf0\x9f\x98\x80")})
    EXPECT_EQ(validate_spec({n, DType::kU8, {4}}), "") << n;
}

// Duplicate names would make a name lookup (and a safetensors dump) ambiguous.
TEST(Manifest, DuplicateNamesAreCorrupt) {
  auto specs = sample();
  specs[3].name = specs[1].name;
  Encoded e = encode(specs);
  SyncInfo info;
  const std::string why = decode_manifest(e.bytes, 9, e.stream, S, &info);
  EXPECT_NE(why.find("twice"), std::string::npos) << why;
}

// Counts and sizes are bounded before anything is allocated.
TEST(Manifest, CountAndStreamAreBounded) {
  Encoded e = encode(sample());
  ManifestHeader h;
  std::memcpy(&h, e.bytes.data(), sizeof h);
  ManifestHeader big = h;
  big.stream_bytes = kMaxStreamBytes + 1;
  std::memcpy(e.bytes.data(), &big, sizeof big);
  SyncInfo info;
  EXPECT_NE(decode_manifest(e.bytes, 9, big.stream_bytes, S, &info), "");
  // A count the bytes could hold but past the limit.
  std::vector<std::byte> huge(sizeof(ManifestHeader) + (std::uint64_t{kMaxTensors} + 1) * sizeof(ManifestEntry));
  ManifestHeader many = h;
  many.tensor_count = kMaxTensors + 1;
  many.names_offset = huge.size();
  many.names_bytes = 0;
  std::memcpy(huge.data(), &many, sizeof many);
  const std::string why = decode_manifest(huge, 9, h.stream_bytes, S, &info);
  EXPECT_NE(why.find("more than"), std::string::npos) << why;
  EXPECT_NE(validate_spec({"t", DType::kU8, {static_cast<std::int64_t>(kMaxStreamBytes + 1)}}), "");
}

// Names lie end to end in entry order and end the manifest: names laid
// over each other (more decoded name bytes than the blob holds), a blob
// with bytes no name uses, and bytes after the blob are refused.
TEST(Manifest, NamesLieEndToEndAndEndTheManifest) {
  const std::vector<TensorSpec> specs = {{"abcd", DType::kU8, {1}}, {"bcde", DType::kU8, {1}}};
  Encoded e = encode(specs);
  SyncInfo info;
  ASSERT_EQ(decode_manifest(e.bytes, 9, e.stream, S, &info), "");
  ManifestHeader h;
  std::memcpy(&h, e.bytes.data(), sizeof h);
  auto entry = [&](std::vector<std::byte>& b, std::size_t i) {
    return reinterpret_cast<ManifestEntry*>(b.data() + sizeof h + i * sizeof(ManifestEntry));
  };
  // Tensor 1's name "bcde" at offset 1 of "abcdbcde", overlapping tensor 0's.
  std::vector<std::byte> over = e.bytes;
  entry(over, 1)->name_offset = 1;
  std::string why = decode_manifest(over, 9, e.stream, S, &info);
  EXPECT_NE(why.find("tensor 1: name does not follow"), std::string::npos) << why;
  // A name one byte shorter: the blob's last byte is used by none.
  std::vector<std::byte> gap = e.bytes;
  entry(gap, 1)->name_bytes = 3;
  why = decode_manifest(gap, 9, e.stream, S, &info);
  EXPECT_NE(why.find("no name uses"), std::string::npos) << why;
  // One byte past the names blob.
  std::vector<std::byte> tail = e.bytes;
  tail.push_back(std::byte{0});
  why = decode_manifest(tail, 9, e.stream, S, &info);
  EXPECT_NE(why.find("after the names blob"), std::string::npos) << why;
}

// The consumer's check before it copies a manifest whole: the header and
// the entries, read a window at a time; a size announced past what was
// written (zeros) is refused after one window.
TEST(Manifest, PrefixCheckReadsOneWindowOfAManifestThatIsNotThere) {
  std::vector<TensorSpec> specs;
  for (int i = 0; i < 5000; ++i) specs.push_back({"t" + std::to_string(i), DType::kU8, {1}});
  Encoded e = encode(specs);
  std::uint64_t most = 0;
  auto reader = [&](const std::vector<std::byte>& b) {
    return [&b, &most](std::uint64_t off, std::size_t n, void* dst) {
      most = std::max<std::uint64_t>(most, n);
      if (off > b.size() || n > b.size() - off) return false;
      std::memcpy(dst, b.data() + off, n);
      return true;
    };
  };
  EXPECT_EQ(manifest_prefix_problem(reader(e.bytes), e.bytes.size(), 9, e.stream), "");
  EXPECT_EQ(most, 4096 * sizeof(ManifestEntry));
  // The header of a manifest of kMaxTensors entries, the rest zeros (holes).
  ManifestHeader h;
  std::memcpy(&h, e.bytes.data(), sizeof h);
  h.tensor_count = h.piece_count = kMaxTensors;
  h.names_offset = sizeof h + 8 + std::uint64_t{kMaxTensors} * (sizeof(ManifestEntry) + sizeof(ManifestPiece));
  const std::uint64_t used = kMaxManifestBytes;
  h.names_bytes = used - h.names_offset;
  std::vector<std::byte> head(sizeof h);
  std::memcpy(head.data(), &h, sizeof h);
  std::uint64_t reads = 0;
  const std::string why = manifest_prefix_problem(
      [&](std::uint64_t off, std::size_t n, void* dst) {
        ++reads;
        std::memset(dst, 0, n);
        if (off < head.size()) std::memcpy(dst, head.data() + off, std::min<std::uint64_t>(n, head.size() - off));
        return true;
      },
      used, 9, e.stream);
  EXPECT_NE(why.find("tensor 0: bad name length"), std::string::npos) << why;
  EXPECT_EQ(reads, 2u);
  // A file that ends inside the entries.
  std::vector<std::byte> cut(e.bytes.begin(), e.bytes.begin() + 1000);
  EXPECT_NE(manifest_prefix_problem(reader(cut), e.bytes.size(), 9, e.stream).find("truncated"), std::string::npos);
}

// Delta pieces (§6, ManifestPiece::base_version): the piece's stream bytes
// are a blob of any size a blob of its piece can have; its logical size
// follows from the tensor. Every delta piece of a sync names one earlier
// version.
namespace {
Encoded encode_delta(const std::vector<TensorSpec>& specs, const std::vector<std::uint64_t>& wire,
                     const std::vector<std::uint64_t>& bases, std::uint64_t version) {
  std::vector<TensorSpec> packed(specs.size());
  for (std::size_t i = 0; i < specs.size(); ++i) packed[i] = TensorSpec{"", DType::kRaw, {static_cast<std::int64_t>(wire[i])}};
  Encoded e;
  std::uint64_t payload = 0;
  e.stream = pack(packed, S, &e.offsets, &payload);
  e.payload = payload;
  std::vector<ManifestPiece> pieces(specs.size());
  for (std::size_t i = 0; i < specs.size(); ++i) {
    pieces[i].tensor = static_cast<std::uint32_t>(i);
    pieces[i].dim = kWholePiece;
    pieces[i].offset = e.offsets[i];
    pieces[i].nbytes = wire[i];
    pieces[i].base_version = bases[i];
  }
  e.bytes.resize(manifest_size(specs));
  const std::uint64_t rank_bytes[1] = {e.stream};
  EXPECT_NE(encode_manifest(specs, pieces, rank_bytes, version, payload, e.bytes.data(), e.bytes.size()), 0u);
  return e;
}
}  // namespace

TEST(Manifest, DeltaPiecesDecodeWithTheirLogicalSize) {
  const std::vector<TensorSpec> specs = {{"a", DType::kBF16, {64, 100}}, {"b", DType::kC128, {3}}};
  const std::uint64_t blob = 64 + 16 * 2 + 32;  // header, 2 blocks' table, a payload
  Encoded e = encode_delta(specs, {blob, specs[1].nbytes()}, {7, 0}, 9);
  SyncInfo info;
  ASSERT_EQ(decode_manifest(e.bytes, 9, e.stream, S, &info), "");
  EXPECT_TRUE(info.delta());
  EXPECT_EQ(info.base_version, 7u);
  EXPECT_EQ(info.payload_bytes, specs[0].nbytes() + specs[1].nbytes());
  EXPECT_EQ(info.wire_bytes, blob + specs[1].nbytes());
  EXPECT_EQ(info.tensors[0].shards[0].nbytes, specs[0].nbytes());
  EXPECT_EQ(info.tensors[0].shards[0].wire_bytes, blob);
  EXPECT_EQ(info.tensors[0].shards[0].base_version, 7u);
  EXPECT_EQ(info.tensors[1].shards[0].base_version, 0u);
  EXPECT_EQ(info.tensors[1].shards[0].wire_bytes, specs[1].nbytes());
}

TEST(Manifest, DeltaPiecesAreChecked) {
  const std::vector<TensorSpec> specs = {{"a", DType::kBF16, {64, 100}}, {"b", DType::kF32, {10}}};
  const std::uint64_t a = 64 + 16 * 2, b = 64 + 16;
  SyncInfo info;
  // A base that is not before the sync.
  Encoded e = encode_delta(specs, {a, b}, {9, 9}, 9);
  EXPECT_NE(decode_manifest(e.bytes, 9, e.stream, S, &info), "");
  // Two bases in one sync.
  e = encode_delta(specs, {a, b}, {7, 8}, 9);
  EXPECT_NE(decode_manifest(e.bytes, 9, e.stream, S, &info), "");
  // A blob too short for its header and table, or longer than every block dense.
  e = encode_delta(specs, {a - 16, b}, {7, 7}, 9);
  EXPECT_NE(decode_manifest(e.bytes, 9, e.stream, S, &info), "");
  e = encode_delta(specs, {a + specs[0].nbytes() + 16, b}, {7, 7}, 9);
  EXPECT_NE(decode_manifest(e.bytes, 9, e.stream, S, &info), "");
  e = encode_delta(specs, {a, b}, {7, 7}, 9);
  EXPECT_EQ(decode_manifest(e.bytes, 9, e.stream, S, &info), "");
  // A dtype that is sent as its bytes (16-byte c128 elements) is never a delta piece.
  const std::vector<TensorSpec> c = {{"z", DType::kC128, {600}}};
  e = encode_delta(c, {64 + 16 * 2}, {7}, 9);
  EXPECT_NE(decode_manifest(e.bytes, 9, e.stream, S, &info), "");
}

// Sharded producers send full syncs: rank 0 refuses a rank's list that
// holds a delta piece rather than publish it into a region without deltas.
// Ranks' delta pieces keep their base in the merged manifest (rank 0
// decides the round's kind from them: producer_delta.cpp, round_kind).
TEST(Manifest, MergeKeepsTheBaseOfRanksDeltaPieces) {
  SyncInfo post;
  post.stream_bytes = 256;
  TensorInfo t{"w", DType::kBF16, {8}, 16, 0, {}};
  ShardInfo sh;
  sh.nbytes = 16;
  sh.wire_bytes = 16;
  t.shards.push_back(sh);
  post.tensors.push_back(t);
  std::vector<SyncInfo> posts{post, post};
  std::vector<TensorSpec> tensors;
  std::vector<ManifestPiece> pieces;
  std::vector<std::uint64_t> rank_bytes;
  std::uint64_t payload = 0;
  EXPECT_EQ(merge_posts(posts, &tensors, &pieces, &rank_bytes, &payload), "");
  EXPECT_EQ(pieces[1].base_version, 0u);
  posts[1].tensors[0].shards[0].base_version = 3;
  ASSERT_EQ(merge_posts(posts, &tensors, &pieces, &rank_bytes, &payload), "");
  ASSERT_EQ(pieces.size(), 2u);
  EXPECT_EQ(pieces[0].base_version, 0u);
  EXPECT_EQ(pieces[1].base_version, 3u);
  EXPECT_EQ(pieces[1].rank, 1u);
}

// The decoder writes into its output in place, keeping its memory (the
// consumer decodes into the SyncInfo of the sync before last, with a kept
// NameSet): whatever that SyncInfo held before, a larger or smaller
// manifest, two ranks' shards out of start order, delta pieces, a manifest
// refused at its names or at its shards' tiling, the result is the fresh
// decode's, field for field.
namespace {
// Two ranks: "w" [8, 4] bf16 in two row shards, rank 0 holding rows [4, 8)
// and rank 1 rows [0, 4) (so the shards sort); "b" whole on rank 1.
// `gap`: rank 1's shard holds rows [0, 3) only.
Encoded encode_two_ranks(bool gap) {
  const std::vector<TensorSpec> specs = {{"w", DType::kBF16, {8, 4}}, {"b", DType::kF32, {6}}};
  std::vector<ManifestPiece> pieces(3);
  pieces[0] = ManifestPiece{};
  pieces[0].tensor = 0, pieces[0].rank = 0, pieces[0].dim = 0, pieces[0].start = 4, pieces[0].length = 4;
  pieces[0].offset = 0, pieces[0].nbytes = 32;
  pieces[1].tensor = 0, pieces[1].rank = 1, pieces[1].dim = 0, pieces[1].start = 0, pieces[1].length = gap ? 3 : 4;
  pieces[1].offset = 0, pieces[1].nbytes = gap ? 24 : 32;
  pieces[2].tensor = 1, pieces[2].rank = 1, pieces[2].dim = kWholePiece;
  pieces[2].offset = 256, pieces[2].nbytes = 24;
  Encoded e;
  const std::uint64_t rank_bytes[2] = {32, 280};
  e.stream = 312;
  e.payload = 32 + pieces[1].nbytes + 24;
  e.bytes.resize(manifest_size(specs, pieces.size(), 2));
  EXPECT_NE(encode_manifest(specs, pieces, rank_bytes, 9, e.payload, e.bytes.data(), e.bytes.size()), 0u);
  return e;
}
}  // namespace

TEST(Manifest, DecodingIntoAUsedSyncInfoGivesTheFreshResult) {
  std::vector<TensorSpec> many;
  for (int i = 0; i < 300; ++i)
    many.push_back({"model.layers." + std::to_string(i) + ".mlp.experts.weight", DType::kBF16, {3, i % 7}});
  auto bad = sample();
  bad[4].name = bad[0].name;  // refused at the fifth entry's name
  const std::vector<TensorSpec> dspecs = {{"a", DType::kBF16, {64, 100}}, {"b", DType::kF32, {10}}};
  const std::vector<Encoded> inputs = {encode(many),
                                       encode(sample(), 10),
                                       encode_two_ranks(false),
                                       encode_delta(dspecs, {64 + 16 * 2, 64 + 16}, {7, 7}, 9),
                                       encode(bad),
                                       encode_two_ranks(true),
                                       encode({{"x", DType::kU8, {5}}}),
                                       encode_two_ranks(false),
                                       encode(many)};
  const std::uint64_t versions[] = {9, 10, 9, 9, 9, 9, 9, 9, 9};
  const char* refusal[] = {"", "", "", "", "twice", "gap", "", "", ""};
  SyncInfo used;
  NameSet names;
  for (std::size_t k = 0; k < inputs.size(); ++k) {
    const Encoded& e = inputs[k];
    SyncInfo fresh;
    const std::string want = decode_manifest(e.bytes, versions[k], e.stream, S, &fresh);
    used.first_seq = 77;  // set by the consumer after a decode: the decoder clears them
    used.chunks = 5;
    const std::string got =
        decode_manifest(e.bytes, versions[k], e.stream, S, &used, true, ManifestCheck::kFull, &names);
    EXPECT_EQ(got, want) << k;
    if (*refusal[k] != 0) {
      EXPECT_NE(want.find(refusal[k]), std::string::npos) << k << ": " << want;
      continue;
    }
    ASSERT_EQ(want, "") << k;
    EXPECT_TRUE(used == fresh) << "input " << k;
    EXPECT_EQ(used.first_seq, 0u);
  }
  // The two-rank input's shards come sorted by start.
  SyncInfo two;
  ASSERT_EQ(decode_manifest(inputs[2].bytes, 9, inputs[2].stream, S, &two), "");
  ASSERT_EQ(two.tensors[0].shards.size(), 2u);
  EXPECT_EQ(two.tensors[0].shards[0].start, 0);
  EXPECT_EQ(two.tensors[0].shards[0].rank, 1u);
  EXPECT_EQ(two.tensors[0].shards[1].start, 4);
}

// The duplicate-name set: every duplicate found, across resets to larger
// and smaller counts, past the count reset() announced, before any reset,
// and once a long probe (here: any collision) moved it to its tree.
TEST(NameSet, FindsEveryDuplicateAcrossResets) {
  std::vector<std::string> names;
  for (int i = 0; i < 20000; ++i) names.push_back("layer." + std::to_string(i) + ".w");
  for (std::size_t max_probe : {NameSet::kMaxProbe, std::size_t{0}}) {
    NameSet set(max_probe);
    EXPECT_TRUE(set.insert("never reset"));
    EXPECT_FALSE(set.insert("never reset"));
    for (std::size_t n : {std::size_t{20000}, std::size_t{16}, std::size_t{3}, std::size_t{20000}}) {
      set.reset(n);
      EXPECT_FALSE(set.in_tree());
      const std::size_t count = n == 3 ? 500 : n;  // 3: announced fewer than it gets
      for (std::size_t i = 0; i < count; ++i) ASSERT_TRUE(set.insert(names[i])) << n << " " << i;
      for (std::size_t i = 0; i < count; ++i) {
        const std::string copy = names[i];  // equal bytes elsewhere: found by content
        ASSERT_FALSE(set.insert(copy)) << n << " " << i;
      }
      // With no probe allowed past the first slot, 500 names collide.
      if (max_probe == 0 && count >= 500) {
        EXPECT_TRUE(set.in_tree()) << n;
      }
    }
  }
}
