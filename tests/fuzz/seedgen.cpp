// fuzz_seedgen: writes the seed corpus (tests/fuzz/corpus/<target>/) from
// valid encodings made by the library's own encoders, plus a few near-misses
// (one field wrong) that point the fuzzer at each check. Deterministic.
//
//   fuzz_seedgen <corpus dir>      e.g. fuzz_seedgen tests/fuzz/corpus
//
// Re-run it when a format changes, and commit the result.
#include <xxhash.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <vector>

#include "protocol/delta.hpp"
#include "fuzz_support.hpp"
#include "protocol/manifest.hpp"
#include "protocol/ring.hpp"
#include "wire.hpp"

using namespace fuzz;
using shmcast::DType;
using shmcast::TensorSpec;
namespace fs = std::filesystem;

namespace {

fs::path g_root;
int g_files = 0;
std::uint64_t g_bytes = 0;

void emit(const std::string& target, const std::string& name, const void* p, std::size_t n) {
  const fs::path dir = g_root / target;
  fs::create_directories(dir);
  std::ofstream(dir / name, std::ios::binary).write(static_cast<const char*>(p), static_cast<std::streamsize>(n));
  ++g_files;
  g_bytes += n;
}

// ---------------------------------------------------------------- header

constexpr std::size_t kHeaderSeedBytes = 320;  // geometry, lifecycle, sync record, publication

std::vector<std::uint8_t> header_seed(std::uint32_t n, std::uint32_t k, std::uint64_t s, std::uint64_t m, bool sums) {
  d::Geometry g{};
  if (!d::compute_geometry(n, k, s, m, &g).empty()) std::abort();
  std::vector<std::uint8_t> page(kHeaderSeedBytes, 0);
  const d::HeaderFixed h = fixed_for(g, sums);
  std::memcpy(page.data(), &h, sizeof h);
  const std::uint32_t ready = d::kInitReady;
  std::memcpy(page.data() + offsetof(d::Header, init_state), &ready, 4);
  return page;
}

template <class T>
void put(std::vector<std::uint8_t>& v, std::size_t off, T x) {
  std::memcpy(v.data() + off, &x, sizeof x);
}

void header_corpus() {
  struct G {
    const char* name;
    std::uint32_t n, k;
    std::uint64_t s, m;
    bool sums;
  };
  const G geos[] = {
      {"min", 1, 2, 2 << 20, 4096, false},         {"n4k2", 4, 2, 2 << 20, 1 << 20, true},
      {"n8k3", 8, 3, 4 << 20, 64 << 10, false},    {"n64k16", 64, 16, 2 << 20, 4096, true},
      {"n2k64", 2, 64, 2 << 20, 8192, false},      {"big_slots", 2, 2, 256ull << 20, 4096, false},
  };
  for (const G& g : geos) {
    auto p = header_seed(g.n, g.k, g.s, g.m, g.sums);
    emit("header", std::string("valid_") + g.name, p.data(), p.size());
  }
  auto base = header_seed(4, 2, 2 << 20, 1 << 20, false);
  auto v = base;
  put<std::uint32_t>(v, offsetof(d::Header, init_state), d::kInitCreating);
  emit("header", "creating", v.data(), v.size());
  v = base;
  put<std::uint32_t>(v, offsetof(d::Header, init_state), d::kInitClosed);
  emit("header", "closed", v.data(), v.size());
  v = base;
  v[kHeaderSteer] = 1;
  emit("header", "producer_dead", v.data(), v.size());
  v = base;
  v[kHeaderSteer] = 2;
  emit("header", "short_file", v.data(), v.size());
  v = base;
  put<std::uint32_t>(v, offsetof(d::HeaderFixed, layout_version), d::kLayoutVersion + 1);
  emit("header", "version_plus_one", v.data(), v.size());
  v = base;
  put<std::uint64_t>(v, offsetof(d::HeaderFixed, features), 2);
  emit("header", "unknown_feature", v.data(), v.size());
  v = base;
  put<std::uint64_t>(v, offsetof(d::HeaderFixed, data_offset), 1ull << 50);
  emit("header", "bad_data_offset", v.data(), v.size());
  v = base;
  put<std::uint64_t>(v, offsetof(d::HeaderFixed, slot_bytes), (2 << 20) + 1);
  emit("header", "unaligned_slot", v.data(), v.size());
  v = base;
  put<std::uint64_t>(v, offsetof(d::HeaderFixed, total_bytes), 4096);
  emit("header", "tiny_total", v.data(), v.size());
  // An announced sync in a valid header: wait_sync() gets to the manifest.
  v = base;
  const std::size_t r = offsetof(d::Header, sync);
  put<std::uint32_t>(v, r + 0, 2);
  put<std::uint64_t>(v, r + 8, 1);
  put<std::uint64_t>(v, r + 16, 1);
  put<std::uint64_t>(v, r + 24, 1);
  put<std::uint64_t>(v, r + 32, 256);
  put<std::uint64_t>(v, r + 40, 64);
  put<std::uint64_t>(v, offsetof(d::Header, published_seq), 1);
  emit("header", "announced", v.data(), v.size());
  emit("header", "empty", "", 0);
  std::vector<std::uint8_t> zeros(4096, 0);
  emit("header", "zero_page", zeros.data(), zeros.size());
}

// ---------------------------------------------------------------- manifest

std::vector<std::uint8_t> encoded(const std::vector<TensorSpec>& specs, std::uint64_t slot, std::uint64_t version,
                                  std::uint64_t* stream_out = nullptr) {
  std::vector<std::uint64_t> offsets;
  std::uint64_t payload = 0;
  const std::uint64_t stream = d::pack(specs, slot, &offsets, &payload);
  const std::uint64_t n = d::manifest_size(specs);
  std::vector<std::uint8_t> out(n);
  d::encode_manifest(specs, offsets, version, stream, payload, reinterpret_cast<std::byte*>(out.data()), n);
  if (stream_out) *stream_out = stream;
  return out;
}

std::vector<TensorSpec> random_specs(std::uint64_t seed, std::uint64_t slot, int count) {
  std::mt19937_64 rng(seed);
  const DType types[] = {DType::kBF16, DType::kF32, DType::kU8, DType::kI64, DType::kBool, DType::kF8E4M3FN, DType::kC128};
  std::vector<TensorSpec> v;
  for (int i = 0; i < count; ++i) {
    TensorSpec s;
    s.name = "layers." + std::to_string(i) + ".weight";
    s.dtype = types[rng() % 7];
    const std::uint64_t es = shmcast::dtype_size(s.dtype);
    std::uint64_t bytes = (rng() % 3 == 0) ? rng() % (3 * slot) : rng() % 8192;
    const std::uint64_t elems = bytes / es;
    s.shape = elems % 2 == 0 && elems ? std::vector<std::int64_t>{2, static_cast<std::int64_t>(elems / 2)}
                                      : std::vector<std::int64_t>{static_cast<std::int64_t>(elems)};
    v.push_back(s);
  }
  return v;
}

void manifest_seed(const std::string& name, std::uint8_t selector, const std::vector<TensorSpec>& specs) {
  auto m = encoded(specs, kManifestSlotSizes[selector & 3], 7);
  m.insert(m.begin(), selector);
  emit("manifest", name, m.data(), m.size());
}

void manifest_corpus() {
  manifest_seed("one_f32", 0, {{"w", DType::kF32, {2, 3}}});
  manifest_seed("scalar_and_empty", 0, {{"step", DType::kI64, {}}, {"empty", DType::kF32, {0, 5}}, {"b", DType::kBool, {1}}});
  manifest_seed("raw_split", 0, {{"blob", DType::kRaw, {5 << 20}}, {"tail", DType::kU8, {100}}});
  manifest_seed("eight_dims", 1, {{"x", DType::kBF16, {1, 2, 1, 2, 1, 2, 1, 2}}});
  manifest_seed("long_name", 0, {{std::string(1024, 'n'), DType::kU8, {1}}});
  manifest_seed("utf8_name", 2, {{"\xc3\xa9t\xc3\xa9.\xe2\x88\x91", DType::kF16, {3}}});
  manifest_seed("no_tensors", 0, {});
  std::vector<TensorSpec> all;
  for (int dt = 1; dt <= 255; ++dt)
    if (shmcast::dtype_size(static_cast<DType>(dt)))
      all.push_back({"dt" + std::to_string(dt), static_cast<DType>(dt), {dt == 255 ? 17 : 3}});
  manifest_seed("all_dtypes", 0, all);
  manifest_seed("random_small", 0, random_specs(1, 2 << 20, 5));
  manifest_seed("random_many", 3, random_specs(2, 1ull << 30, 40));
  manifest_seed("random_slot_boundaries", 0, random_specs(3, 2 << 20, 12));
  // Near-miss: a valid manifest checked against the wrong version/stream.
  manifest_seed("expect_mismatch", 4, {{"w", DType::kF32, {2, 3}}});
  // Near-misses of the names rules (names end to end in entry order, the
  // blob ends the manifest) and the name length limit.
  auto miss = [](const std::string& name, const std::vector<TensorSpec>& specs,
                 const std::function<void(std::vector<std::uint8_t>&)>& edit) {
    auto m = encoded(specs, kManifestSlotSizes[0], 7);
    edit(m);
    m.insert(m.begin(), 0);
    emit("manifest", name, m.data(), m.size());
  };
  const std::vector<TensorSpec> two = {{"abcd", DType::kU8, {1}}, {"bcde", DType::kU8, {1}}};
  auto entry_at = [](std::size_t i) { return sizeof(d::ManifestHeader) + i * sizeof(d::ManifestEntry); };
  miss("miss_names_overlap", two, [&](auto& m) { put<std::uint32_t>(m, entry_at(1) + offsetof(d::ManifestEntry, name_offset), 1); });
  miss("miss_names_gap", two, [&](auto& m) { put<std::uint32_t>(m, entry_at(1) + offsetof(d::ManifestEntry, name_bytes), 3); });
  miss("miss_bytes_after_names", two, [](auto& m) { m.push_back(0); });
  miss("miss_name_1025", {{std::string(1024, 'n'), DType::kU8, {1}}},
       [&](auto& m) { put<std::uint32_t>(m, entry_at(0) + offsetof(d::ManifestEntry, name_bytes), 1025); m.push_back('n'); });
  // Counts at the limit and one past it, over a manifest too short for them.
  miss("miss_tensor_count_max", two, [](auto& m) { put<std::uint32_t>(m, offsetof(d::ManifestHeader, tensor_count), shmcast::limits::kMaxTensors); });
  miss("miss_piece_count_wraps", two, [](auto& m) { put<std::uint32_t>(m, offsetof(d::ManifestHeader, piece_count), ~0u); });
}

// ---------------------------------------------------------------- region

struct RegionSeed {
  RegionInput in{};
  std::vector<std::uint8_t> manifest;
};

// A consistent sync of `specs`: the record, enrollment, slots and hash are
// left to the harness's fix-up flags, so the fuzzer keeps them consistent
// while it mutates the rest.
RegionSeed region_sync(const std::vector<TensorSpec>& specs, bool sums, bool visit) {
  RegionSeed r;
  std::uint64_t stream = 0;
  r.manifest = encoded(specs, kRegionSlotBytes, 1, &stream);
  r.in.flags = kFixHash | kKeepSeatWord | kFixEnroll | kFixChecksums | (sums ? kChecksumFeature : 0) |
               (visit ? kUseVisit : 0);
  r.in.flags2 = kFix2EvenWord | kFix2Slots | kFix2Published | kFix2Ready;
  std::uint8_t* rec = r.in.header + (offsetof(d::Header, sync) - 128);
  const std::uint32_t word = 2;
  const std::uint64_t v = 1, first = 1, chunks = d::chunk_count(stream, kRegionSlotBytes), used = r.manifest.size();
  std::memcpy(rec + 0, &word, 4);
  std::memcpy(rec + 8, &v, 8);
  std::memcpy(rec + 16, &first, 8);
  std::memcpy(rec + 24, &chunks, 8);
  std::memcpy(rec + 32, &stream, 8);
  std::memcpy(rec + 40, &used, 8);
  return r;
}

void emit_region(const std::string& name, const RegionSeed& r) {
  std::vector<std::uint8_t> bytes(sizeof r.in + r.manifest.size());
  std::memcpy(bytes.data(), &r.in, sizeof r.in);
  std::memcpy(bytes.data() + sizeof r.in, r.manifest.data(), r.manifest.size());
  emit("region", name, bytes.data(), bytes.size());
}

void region_corpus() {
  const std::vector<TensorSpec> small = {{"a", DType::kF32, {4, 4}}, {"b", DType::kU8, {1000}}, {"c", DType::kI64, {}}};
  const std::vector<TensorSpec> two_chunks = {{"big", DType::kU8, {3 << 20}}, {"x", DType::kBF16, {7}}};
  emit_region("read_into_small", region_sync(small, false, false));
  emit_region("visit_small", region_sync(small, false, true));
  emit_region("checksums_small", region_sync(small, true, false));
  emit_region("two_chunks", region_sync(two_chunks, true, false));
  emit_region("random", region_sync(random_specs(4, kRegionSlotBytes, 8), false, true));
  RegionSeed r = region_sync(small, false, false);
  std::uint8_t* rec = r.in.header + (offsetof(d::Header, sync) - 128);
  rec[56] = 1;  // aborted
  emit_region("aborted", r);
  r = region_sync(small, false, false);
  r.in.flags2 &= static_cast<std::uint8_t>(~kFix2Ready);
  r.in.header[0] = d::kInitClosed;
  emit_region("closed", r);
  r = region_sync(small, false, false);
  r.in.flags |= kProducerDead;
  emit_region("producer_dead", r);
  r = region_sync(small, false, false);
  r.in.flags2 &= static_cast<std::uint8_t>(~kFix2Published);
  emit_region("nothing_published", r);
  r = region_sync(small, true, false);
  r.in.flags &= static_cast<std::uint8_t>(~kFixChecksums);
  r.in.slots[24] ^= 1;  // a wrong checksum
  emit_region("bad_checksum", r);
  r = region_sync(small, false, false);
  r.in.flags &= static_cast<std::uint8_t>(~kKeepSeatWord);
  emit_region("seat_taken", r);
  // Progressive fill: chunk 1 is being filled (not published), its first
  // 2000 bytes final; read_into (no checksums) copies them out early.
  for (const std::uint64_t filled : {std::uint64_t{2000}, std::uint64_t{1} << 40}) {
    r = region_sync(two_chunks, false, false);
    r.in.flags2 &= static_cast<std::uint8_t>(~kFix2Published);
    const std::uint64_t fill_seq = 1;
    std::memcpy(r.in.slots + offsetof(d::SlotDesc, fill_seq), &fill_seq, 8);
    std::memcpy(r.in.slots + offsetof(d::SlotDesc, filled), &filled, 8);
    emit_region(filled == 2000 ? "progressive_fill" : "progressive_fill_past_chunk", r);
  }
  // The sparse manifest area (docs/protocol.md §2.1): the record announces
  // more bytes than were written; the rest reads as zeros (a hole), hashed
  // as such (kFixHash). 8 KiB past the manifest: bytes after the names.
  r = region_sync(small, false, false);
  std::uint64_t used = r.manifest.size() + 8192;
  std::memcpy(r.in.header + (offsetof(d::Header, sync) - 128) + 40, &used, 8);
  emit_region("sparse_used_past_written", r);
  // Only a header was written, claiming as many entries as fit the area
  // and a names blob to its end: the entries are zeros.
  r = region_sync(small, false, false);
  used = kRegionManifestBytes;
  std::memcpy(r.in.header + (offsetof(d::Header, sync) - 128) + 40, &used, 8);
  d::ManifestHeader mh;
  std::memcpy(&mh, r.manifest.data(), sizeof mh);
  mh.tensor_count = mh.piece_count = 4096;
  mh.names_offset = sizeof mh + 8 + 4096ull * (sizeof(d::ManifestEntry) + sizeof(d::ManifestPiece));
  mh.names_bytes = used - mh.names_offset;
  r.manifest.assign(sizeof mh, 0);
  std::memcpy(r.manifest.data(), &mh, sizeof mh);
  emit_region("sparse_header_only", r);
}

// ---------------------------------------------------------------- safetensors
//
// Selector byte 0: a whole .safetensors file; 1: an index.json.

void st_seed(const std::string& name, const std::string& header, std::size_t data_bytes) {
  std::vector<std::uint8_t> v(1 + 8, 0);
  const std::uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) v[1 + i] = static_cast<std::uint8_t>(n >> (8 * i));
  v.insert(v.end(), header.begin(), header.end());
  for (std::size_t i = 0; i < data_bytes; ++i) v.push_back(static_cast<std::uint8_t>(i * 7));
  emit("safetensors", name, v.data(), v.size());
}

void index_seed(const std::string& name, const std::string& text) {
  std::vector<std::uint8_t> v(1, 1);
  v.insert(v.end(), text.begin(), text.end());
  emit("safetensors", name, v.data(), v.size());
}

void safetensors_corpus() {
  auto e = [](const std::string& n, const std::string& dt, const std::string& shape, std::uint64_t b,
              std::uint64_t end) {
    return "\"" + n + "\":{\"dtype\":\"" + dt + "\",\"shape\":" + shape + ",\"data_offsets\":[" +
           std::to_string(b) + "," + std::to_string(end) + "]}";
  };
  st_seed("valid_one", "{" + e("w", "F32", "[2,2]", 0, 16) + "}", 16);
  st_seed("valid_empty", "{}      ", 0);
  st_seed("valid_meta_unsorted",
          "{\"__metadata__\":{\"format\":\"pt\",\"k\":\"v\"}," + e("b", "BF16", "[3,2]", 4, 16) + "," +
              e("a", "U8", "[4]", 0, 4) + "," + e("c", "F8_E4M3", "[2]", 16, 18) + "}",
          18);
  st_seed("valid_scalar_empty",
          "{" + e("s", "F64", "[]", 0, 8) + "," + e("z", "I32", "[0,3]", 8, 8) + "," + e("f4", "F4", "[4]", 8, 10) + "}",
          10);
  st_seed("valid_every_dtype",
          "{" + e("a", "BOOL", "[1]", 0, 1) + "," + e("b", "I8", "[1]", 1, 2) + "," + e("c", "I16", "[1]", 2, 4) + "," +
              e("d", "U16", "[1]", 4, 6) + "," + e("e", "F16", "[1]", 6, 8) + "," + e("f", "I32", "[1]", 8, 12) + "," +
              e("g", "U32", "[1]", 12, 16) + "," + e("h", "F32", "[1]", 16, 20) + "," + e("i", "I64", "[1]", 20, 28) +
              "," + e("j", "U64", "[1]", 28, 36) + "," + e("k", "F64", "[1]", 36, 44) + "," +
              e("l", "C64", "[1]", 44, 52) + "," + e("m", "F8_E5M2", "[1]", 52, 53) + "," +
              e("n", "F8_E8M0", "[1]", 53, 54) + "," + e("o", "F6_E2M3", "[4]", 54, 57) + "}",
          57);
  // Near misses: one fault each.
  st_seed("overlap", "{" + e("a", "U8", "[4]", 0, 4) + "," + e("b", "U8", "[4]", 2, 6) + "}", 6);
  st_seed("gap", "{" + e("a", "U8", "[2]", 0, 2) + "," + e("b", "U8", "[2]", 3, 5) + "}", 5);
  st_seed("trailing", "{" + e("a", "U8", "[2]", 0, 2) + "}", 3);
  st_seed("size_mismatch", "{" + e("a", "F32", "[2]", 0, 4) + "}", 4);
  st_seed("unknown_dtype", "{" + e("a", "F128", "[1]", 0, 16) + "}", 16);
  st_seed("duplicate_name", "{" + e("a", "U8", "[1]", 0, 1) + "," + e("a", "U8", "[1]", 1, 2) + "}", 2);
  st_seed("negative_dim", "{" + e("a", "U8", "[-1]", 0, 1) + "}", 1);
  st_seed("overflow_dims", "{" + e("a", "U8", "[4294967296,4294967296]", 0, 1) + "}", 1);
  st_seed("deep", "{\"a\":[[[[[1]]]]]}", 0);
  st_seed("not_brace", " {}     ", 0);
  st_seed("f4_odd", "{" + e("a", "F4", "[3]", 0, 2) + "}", 2);
  st_seed("metadata_number", "{\"__metadata__\":{\"n\":1}}", 0);
  st_seed("nul_hides_garbage", std::string("{}\0garbage", 10), 0);
  st_seed("unknown_field", "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1],\"x\":0}}", 1);
  {
    // A length that points past the end of the file.
    std::vector<std::uint8_t> v = {0, 0xff, 0xff, 0, 0, 0, 0, 0, 0, '{', '}'};
    emit("safetensors", "length_past_end", v.data(), v.size());
  }
  index_seed("index_valid",
             "{\"metadata\":{\"total_size\":16},\"weight_map\":{\"a\":\"model-00001-of-00002.safetensors\","
             "\"b\":\"model-00002-of-00002.safetensors\"}}");
  index_seed("index_traversal", "{\"weight_map\":{\"a\":\"../x.safetensors\"}}");
  index_seed("index_not_string", "{\"weight_map\":{\"a\":1}}");
  index_seed("index_no_map", "{\"metadata\":{}}");
}

// ---------------------------------------------------------------- relay wire

namespace w = shmcast::relay::wire;

void wire_seed(const std::string& name, std::uint8_t sel, std::vector<std::uint8_t> msg) {
  msg.insert(msg.begin(), sel);
  emit("relay_wire", name, msg.data(), msg.size());
}

std::vector<std::uint8_t> sync_msg(const w::SyncPlan& p, bool mac) {
  w::Writer wr(w::Type::kSync);
  w::encode_sync(wr, p);
  std::vector<std::uint8_t> b = wr.buffer();
  if (mac) b.insert(b.end(), w::kMacBytes, 0xab);
  return b;
}

void relay_wire_corpus() {
  const std::uint64_t two = 2ull << 20;
  wire_seed("sync_one_f32", 0, sync_msg(w::plan_for({{"w", DType::kF32, {2, 3}}}, 1, two, 1 << 20), false));
  wire_seed("sync_with_mac", 1, sync_msg(w::plan_for({{"w", DType::kBF16, {4096, 300}}}, 7, two, 256 << 10), true));
  wire_seed("sync_empty_and_scalar", 0,
            sync_msg(w::plan_for({{"step", DType::kI64, {}}, {"empty", DType::kF32, {0, 5}}}, 2, two, 64 << 10), false));
  wire_seed("sync_no_tensors", 0, sync_msg(w::plan_for({}, 3, two, 2 << 20), false));
  wire_seed("sync_random", 0, sync_msg(w::plan_for(random_specs(4, two, 12), 9, two, 1 << 20), false));
  wire_seed("sync_random_big_chunks", 1,
            sync_msg(w::plan_for(random_specs(5, 64ull << 20, 20), 11, 64ull << 20, 2 << 20), true));
  wire_seed("sync_long_name_eight_dims", 0,
            sync_msg(w::plan_for({{std::string(1024, 'n'), DType::kU8, {1, 2, 1, 2, 1, 2, 1, 2}}}, 1, two, 1 << 20), false));
  // Near misses, one check each.
  {
    w::SyncPlan p = w::plan_for(random_specs(6, two, 6), 4, two, 1 << 20);
    p.offsets.back() += 256;  // not shmcast's packing
    wire_seed("near_layout", 0, sync_msg(p, false));
    p = w::plan_for(random_specs(6, two, 6), 4, two, 3 << 18);  // fragment size not a power of two
    wire_seed("near_frag_size", 0, sync_msg(p, false));
    p = w::plan_for(random_specs(6, two, 6), 0, two, 1 << 20);  // version 0
    wire_seed("near_version0", 0, sync_msg(p, false));
    std::vector<std::uint8_t> b = sync_msg(w::plan_for(random_specs(7, two, 4), 5, two, 1 << 20), false);
    b.resize(b.size() - 5);  // truncated
    wire_seed("near_truncated", 0, b);
    b = sync_msg(w::plan_for({{"w", DType::kF32, {2}}}, 5, two, 1 << 20), false);
    const std::uint32_t many = 1u << 20;  // a count the message cannot hold
    std::memcpy(b.data() + w::kHeaderBytes + 40, &many, 4);
    wire_seed("near_count", 0, b);
  }
  // Other messages: the reads they are made of.
  {
    w::Writer wr(w::Type::kChallenge);
    w::Nonce n{};
    wr.u32(w::kProto).u64(1).bytes(n).str("region");
    wire_seed("challenge", 2, wr.buffer());
    w::Writer ab(w::Type::kAbort);
    ab.u64(3).u64(17).str("the trainer aborted");
    std::vector<std::uint8_t> b = ab.buffer();
    b.insert(b.end(), w::kMacBytes, 0);
    wire_seed("abort_with_mac", 3, b);
    std::vector<std::uint8_t> bad = ab.buffer();
    bad[0] ^= 1;
    wire_seed("bad_magic", 0, bad);
  }
}

// ---------------------------------------------------------------- delta

namespace dl = shmcast::detail::delta;

// The blob of base -> next (w-byte elements), behind the selector byte.
std::vector<std::uint8_t> delta_blob(std::vector<std::uint8_t> base, const std::vector<std::uint8_t>& next,
                                     std::uint32_t w) {
  const dl::Plan p = dl::plan(base.data(), next.data(), w, base.size() / w);
  std::vector<std::uint8_t> blob(p.blob_bytes());
  dl::encode(p, base.data(), next.data(), blob.data(), blob.size());
  return blob;
}

void delta_seed(const std::string& name, std::uint8_t sel, std::vector<std::uint8_t> blob) {
  blob.insert(blob.begin(), sel);
  emit("delta", name, blob.data(), blob.size());
}

// The base fuzz_delta applies to (its base_pattern), so that seeds decode
// into real changes.
std::vector<std::uint8_t> delta_base(std::uint64_t bytes) {
  std::vector<std::uint8_t> v(bytes);
  std::uint64_t x = 0x243f6a8885a308d3ull;
  for (std::uint64_t i = 0; i < bytes; ++i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    v[i] = static_cast<std::uint8_t>(x >> 56);
  }
  return v;
}

void delta_corpus() {
  std::mt19937_64 rng(31);
  // Valid blobs: each width, a short block and a block and a half, few,
  // many and all elements changed (every seed at most 8 KiB, fuzz.sh's -max_len).
  const std::uint8_t wsel[9] = {0, 0, 1, 0, 2, 0, 0, 0, 3};
  for (std::uint32_t w : {1u, 2u, 4u, 8u})
    for (std::uint64_t n : {100ull, 4096ull + 50})
      for (double f : {0.0, 0.02, 0.3, 1.0}) {
        if (n * w * f > 6000) continue;
        const std::vector<std::uint8_t> base = delta_base(n * w);
        std::vector<std::uint8_t> next = base;
        std::bernoulli_distribution pick(f);
        for (std::uint64_t e = 0; e < n; ++e)
          if (pick(rng)) next[e * w + rng() % w] ^= static_cast<std::uint8_t>(1 + rng() % 255);
        const std::string name = "w" + std::to_string(w) + "_n" + std::to_string(n) + "_f" +
                                 std::to_string(static_cast<int>(f * 100));
        delta_seed(name, static_cast<std::uint8_t>(wsel[w] | (n == 100 ? 4 : 0)), delta_blob(base, next, w));
      }
  // Every kind in one blob (w = 1, n = 3 * 4096 + 50): sparse, bitmap,
  // dense, and a short bitmap block with head padding; then near misses.
  const std::uint64_t n = 3 * 4096 + 50;
  const std::vector<std::uint8_t> base = delta_base(n);
  std::vector<std::uint8_t> next = base;
  auto change = [&](std::uint64_t e) { next[e] = static_cast<std::uint8_t>(~next[e]); };
  change(7), change(100), change(4000);
  for (std::uint64_t j = 0; j < 500; ++j) change(4096 + 8 * j);
  for (std::uint64_t j = 0; j < 4096; ++j) change(2 * 4096 + j);
  for (std::uint64_t j = 0; j < 20; ++j) change(3 * 4096 + 2 * j + 1);
  const std::vector<std::uint8_t> all = delta_blob(base, next, 1);
  delta_seed("all_kinds", 0, all);
  const std::uint64_t head = dl::head_bytes(n);
  auto area = [&](std::uint64_t b) {
    dl::Entry e;
    std::memcpy(&e, all.data() + dl::kHeaderBytes + b * dl::kEntryBytes, sizeof e);
    return head + e.offset;
  };
  auto miss = [&](const std::string& name, std::uint64_t off, std::uint8_t x) {
    std::vector<std::uint8_t> v = all;
    v[off] ^= x;
    delta_seed("miss_" + name, 0, v);
  };
  miss("magic", 0, 1);
  miss("width", 6, 3);
  miss("elems", 16, 1);
  miss("payload", 32, 16);
  miss("changed", 48, 1);
  miss("entry_reserved", dl::kHeaderBytes + 12, 1);
  miss("entry_offset", dl::kHeaderBytes + 16, 16);
  miss("entry_count", dl::kHeaderBytes + 8, 1);
  miss("sparse_order", area(0), 0x80);
  miss("sparse_padding", area(0) + 6, 1);
  miss("bitmap_bit", area(1), 1);
  miss("bitmap_past_end", area(3) + 6, 0x80);
  miss("bitmap_padding", area(3) + 8, 1);
  miss("checksum", 40, 1);
  std::vector<std::uint8_t> cut = all;
  cut.resize(head - 8);
  delta_seed("miss_truncated", 0, cut);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: fuzz_seedgen <corpus dir>\n");
    return 2;
  }
  g_root = argv[1];
  header_corpus();
  manifest_corpus();
  region_corpus();
  safetensors_corpus();
  relay_wire_corpus();
  delta_corpus();
  std::printf("wrote %d seeds, %llu bytes, under %s\n", g_files, static_cast<unsigned long long>(g_bytes), argv[1]);
  return 0;
}
