// The safetensors reader: valid files parse to what was written; every kind
// of malformed header is refused with kCorrupt and a message naming the
// fault (one test per fault); checkpoints open from a file, a directory or
// an index, and the index must agree with its shards.
#include <sys/stat.h>

#include <span>

#include "st_support.hpp"

using namespace st_test;
namespace sf = shmcast::safetensors;
using shmcast::Errc;

namespace {

sf::FileHeader parse(const std::vector<std::uint8_t>& b) {
  return sf::parse_header(std::as_bytes(std::span(b)), b.size(), "test.safetensors");
}

// Parsing must throw kCorrupt with `needle` in the message.
void expect_corrupt(const std::vector<std::uint8_t>& bytes, const std::string& needle) {
  try {
    parse(bytes);
    ADD_FAILURE() << "accepted; expected an error containing: " << needle;
  } catch (const shmcast::Error& e) {
    EXPECT_EQ(e.code(), Errc::kCorrupt) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("test.safetensors"), std::string::npos) << e.what();
  }
}

void expect_header_corrupt(const std::string& header, std::uint64_t data, const std::string& needle) {
  expect_corrupt(raw_file(header, data), needle);
}

void expect_index_corrupt(const std::string& text, const std::string& needle) {
  try {
    sf::parse_index(text, "idx.json");
    ADD_FAILURE() << "accepted; expected an error containing: " << needle;
  } catch (const shmcast::Error& e) {
    EXPECT_EQ(e.code(), Errc::kCorrupt) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

template <class F>
shmcast::Error expect_error(F&& f) {
  try {
    f();
  } catch (const shmcast::Error& e) {
    return e;
  }
  ADD_FAILURE() << "no error";
  return shmcast::Error(Errc::kSystem, "none");
}

}  // namespace

// ---------------------------------------------------------------- valid headers

TEST(SafetensorsParse, OneTensor) {
  const auto t = make_tensor("w", "F32", {2, 3}, 1);
  const auto bytes = file_bytes({t}, {{"format", "pt"}});
  const sf::FileHeader h = parse(bytes);
  ASSERT_EQ(h.tensors.size(), 1u);
  EXPECT_EQ(h.tensors[0].name, "w");
  EXPECT_EQ(h.tensors[0].dtype, "F32");
  EXPECT_EQ(h.tensors[0].shape, (std::vector<std::int64_t>{2, 3}));
  EXPECT_EQ(h.tensors[0].nbytes, 24u);
  EXPECT_EQ(h.data_start % 8, 0u);
  EXPECT_EQ(h.tensors[0].offset, h.data_start);
  EXPECT_EQ(h.file_bytes, bytes.size());
  EXPECT_EQ(h.metadata.at("format"), "pt");
}

TEST(SafetensorsParse, EmptyHeaderAndNoData) {
  const sf::FileHeader h = parse(raw_file("{}      ", 0));
  EXPECT_TRUE(h.tensors.empty());
  EXPECT_EQ(h.data_start, 16u);
}

TEST(SafetensorsParse, UnsortedEntriesComeBackInOffsetOrder) {
  // Names sort opposite to their offsets.
  const std::string hdr =
      R"({"a":{"dtype":"U8","shape":[3],"data_offsets":[5,8]},"b":{"dtype":"U8","shape":[2],"data_offsets":[3,5]},)"
      R"("c":{"dtype":"U8","shape":[3],"data_offsets":[0,3]}})";
  const sf::FileHeader h = parse(raw_file(hdr, 8));
  ASSERT_EQ(h.tensors.size(), 3u);
  EXPECT_EQ(h.tensors[0].name, "c");
  EXPECT_EQ(h.tensors[1].name, "b");
  EXPECT_EQ(h.tensors[2].name, "a");
  EXPECT_EQ(h.tensors[2].offset, h.data_start + 5);
}

TEST(SafetensorsParse, ScalarsAndEmptyTensors) {
  const auto bytes = file_bytes({make_tensor("scalar", "F64", {}, 1), make_tensor("empty", "BF16", {0, 5}, 2),
                                 make_tensor("empty2", "I8", {0}, 3), make_tensor("last", "U8", {3}, 4)});
  const sf::FileHeader h = parse(bytes);
  ASSERT_EQ(h.tensors.size(), 4u);
  EXPECT_EQ(h.tensors[0].name, "scalar");
  EXPECT_EQ(h.tensors[0].nbytes, 8u);
  EXPECT_TRUE(h.tensors[0].shape.empty());
  EXPECT_EQ(h.tensors[1].nbytes, 0u);
  EXPECT_EQ(h.tensors[2].nbytes, 0u);
}

TEST(SafetensorsParse, EveryDtype) {
  const char* names[] = {"BOOL", "U8",  "I8",  "I16", "I32",     "I64",     "U16",     "U32", "U64", "F16",
                         "BF16", "F32", "F64", "C64", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4",  "F6_E2M3", "F6_E3M2"};
  std::vector<Tensor> ts;
  int i = 0;
  for (const char* n : names) ts.push_back(make_tensor(std::string("t") + n, n, {2, 4}, static_cast<std::uint64_t>(i++)));
  const sf::FileHeader h = parse(file_bytes(ts));
  ASSERT_EQ(h.tensors.size(), ts.size());
  EXPECT_EQ(h.tensors[h.tensors.size() - 1].nbytes + 0, h.tensors.back().nbytes);
  shmcast::DType d;
  EXPECT_TRUE(sf::to_shmcast("BF16", &d));
  EXPECT_EQ(d, shmcast::DType::kBF16);
  EXPECT_TRUE(sf::to_shmcast("F8_E4M3", &d));
  EXPECT_EQ(d, shmcast::DType::kF8E4M3FN);
  EXPECT_TRUE(sf::to_shmcast("F8_E8M0", &d));
  EXPECT_EQ(d, shmcast::DType::kF8E8M0FNU);
  EXPECT_FALSE(sf::to_shmcast("F4", &d));
  EXPECT_FALSE(sf::to_shmcast("bf16", &d));
  EXPECT_EQ(sf::dtype_bits("F6_E3M2"), 6u);
  // Every shmcast dtype with a safetensors name maps back to itself.
  for (const char* n : names) {
    if (!sf::to_shmcast(n, &d)) continue;
    EXPECT_EQ(sf::from_shmcast(d), n);
  }
  EXPECT_EQ(sf::from_shmcast(shmcast::DType::kC128), "");
}

TEST(SafetensorsParse, JsonEscapesInNames) {
  const std::string hdr = R"({"a\"b\\c\u00e9":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})";
  const sf::FileHeader h = parse(raw_file(hdr, 1));
  ASSERT_EQ(h.tensors.size(), 1u);
  EXPECT_EQ(h.tensors[0].name, "a\"b\\c\xc3\xa9");
}

// ---------------------------------------------------------------- malformed headers, one fault each

TEST(SafetensorsMalformed, FileShorterThanTheLength) {
  expect_corrupt({1, 0, 0}, "shorter than the 8-byte header length");
}

TEST(SafetensorsMalformed, EmptyFile) { expect_corrupt({}, "shorter than the 8-byte header length"); }

TEST(SafetensorsMalformed, LengthPastEndOfFile) {
  auto b = raw_file("{}", 0);
  b[0] = 3;  // says 3, 2 follow
  expect_corrupt(b, "only 2 bytes follow");
}

TEST(SafetensorsMalformed, LengthAboveTheLimit) {
  // The file claims to be large enough; the limit is checked before any read.
  std::vector<std::uint8_t> b(8);
  const std::uint64_t n = sf::kMaxHeaderBytes + 1;
  for (int i = 0; i < 8; ++i) b[i] = static_cast<std::uint8_t>(n >> (8 * i));
  EXPECT_THROW(
      {
        try {
          sf::parse_header(std::as_bytes(std::span(b)), 1ull << 40, "test.safetensors");
        } catch (const shmcast::Error& e) {
          EXPECT_EQ(e.code(), Errc::kCorrupt);
          EXPECT_NE(std::string(e.what()).find("limit"), std::string::npos) << e.what();
          throw;
        }
      },
      shmcast::Error);
}

TEST(SafetensorsMalformed, LengthMaxU64DoesNotWrap) {
  std::vector<std::uint8_t> b(64, 0xff);
  expect_corrupt(b, "limit");
}

TEST(SafetensorsMalformed, LengthZero) {
  auto b = raw_file("", 8);
  expect_corrupt(b, "too short for a JSON object");
}

TEST(SafetensorsMalformed, DoesNotStartWithBrace) { expect_header_corrupt(" {}     ", 0, "does not start with '{'"); }

TEST(SafetensorsMalformed, TopLevelArray) { expect_header_corrupt("[]      ", 0, "does not start with '{'"); }

TEST(SafetensorsMalformed, TruncatedJson) {
  expect_header_corrupt(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1])", 1, "malformed JSON");
}

TEST(SafetensorsMalformed, TrailingGarbageAfterJson) { expect_header_corrupt("{}x     ", 0, "malformed JSON"); }

TEST(SafetensorsMalformed, NulPadding) {
  std::string h = "{}";
  h.append(6, '\0');
  expect_header_corrupt(h, 0, "NUL byte");
}

TEST(SafetensorsMalformed, NulHidesTrailingGarbage) {
  // A JSON parser that stops at NUL would accept this.
  std::string h = "{}";
  h.push_back('\0');
  h += "garbage";
  expect_header_corrupt(h, 0, "NUL byte");
}

TEST(SafetensorsMalformed, InvalidUtf8) {
  expect_header_corrupt("{\"\xff\xfe\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1, "malformed JSON");
}

TEST(SafetensorsMalformed, LoneSurrogateEscape) {
  expect_header_corrupt(R"({"\ud800":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", 1, "malformed JSON");
}

TEST(SafetensorsMalformed, Comments) {
  expect_header_corrupt(R"({/*x*/"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", 1, "malformed JSON");
}

TEST(SafetensorsMalformed, DuplicateTensorName) {
  expect_header_corrupt(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                        R"("a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                        2, "twice in one object");
}

TEST(SafetensorsMalformed, DuplicateFieldInEntry) {
  expect_header_corrupt(R"({"a":{"dtype":"U8","dtype":"I8","shape":[1],"data_offsets":[0,1]}})", 1, "twice in one object");
}

TEST(SafetensorsMalformed, DuplicateMetadataKey) {
  expect_header_corrupt(R"({"__metadata__":{"k":"1","k":"2"}})", 0, "twice in one object");
}

TEST(SafetensorsMalformed, DuplicateMetadataObject) {
  expect_header_corrupt(R"({"__metadata__":{},"__metadata__":{}})", 0, "twice in one object");
}

TEST(SafetensorsMalformed, NestedTooDeep) {
  expect_header_corrupt(R"({"a":{"dtype":"U8","shape":[[1]],"data_offsets":[0,1]}})", 1, "nested deeper");
}

TEST(SafetensorsMalformed, DeepNestingDoesNotRecurse) {
  std::string h = "{\"a\":";
  h += std::string(100000, '[');
  h += std::string(100000, ']');
  h += "}";
  expect_header_corrupt(h, 0, "nested deeper");
}

TEST(SafetensorsMalformed, MetadataNotAnObject) { expect_header_corrupt(R"({"__metadata__":["x"]})", 0, "__metadata__"); }

TEST(SafetensorsMalformed, MetadataNull) { expect_header_corrupt(R"({"__metadata__":null})", 0, "__metadata__"); }

TEST(SafetensorsMalformed, MetadataValueNotString) {
  expect_header_corrupt(R"({"__metadata__":{"total":5}})", 0, "is not a string");
}

TEST(SafetensorsMalformed, EntryNotAnObject) { expect_header_corrupt(R"({"a":[0,1]})", 1, "is not an object"); }

TEST(SafetensorsMalformed, UnknownField) {
  expect_header_corrupt(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":1}})", 1, "unknown field");
}

TEST(SafetensorsMalformed, MissingDtype) {
  expect_header_corrupt(R"({"a":{"shape":[1],"data_offsets":[0,1]}})", 1, "lacks dtype");
}

TEST(SafetensorsMalformed, MissingShape) {
  expect_header_corrupt(R"({"a":{"dtype":"U8","data_offsets":[0,1]}})", 1, "lacks shape");
}

TEST(SafetensorsMalformed, MissingOffsets) {
  expect_header_corrupt(R"({"a":{"dtype":"U8","shape":[1]}})", 1, "lacks data_offsets");
}

TEST(SafetensorsMalformed, DtypeNotAString) {
  expect_header_corrupt(R"({"a":{"dtype":8,"shape":[1],"data_offsets":[0,1]}})", 1, "dtype is not a string");
}

TEST(SafetensorsMalformed, UnknownDtype) {
  expect_header_corrupt(R"({"a":{"dtype":"F128","shape":[1],"data_offsets":[0,16]}})", 16, "unknown dtype");
}

TEST(SafetensorsMalformed, LowercaseDtype) {
  expect_header_corrupt(R"({"a":{"dtype":"bf16","shape":[1],"data_offsets":[0,2]}})", 2, "unknown dtype");
}

TEST(SafetensorsMalformed, ShapeNotAnArray) {
  expect_header_corrupt(R"({"a":{"dtype":"U8","shape":1,"data_offsets":[0,1]}})", 1, "shape is not an array");
}

TEST(SafetensorsMalformed, NegativeDimension) {
  expect_header_corrupt(R"({"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}})", 1, "integers >= 0");
}

TEST(SafetensorsMalformed, FractionalDimension) {
  expect_header_corrupt(R"({"a":{"dtype":"U8","shape":[1.5],"data_offsets":[0,1]}})", 1, "integers >= 0");
}

TEST(SafetensorsMalformed, DimensionAsString) {
  expect_header_corrupt(R"({"a":{"dtype":"U8","shape":["1"],"data_offsets":[0,1]}})", 1, "integers >= 0");
}

TEST(SafetensorsMalformed, DimensionBeyondU64) {
  expect_header_corrupt(R"({"a":{"dtype":"U8","shape":[18446744073709551616],"data_offsets":[0,1]}})", 1,
                        "integers >= 0");
}

TEST(SafetensorsMalformed, DimensionBeyondI64) {
  expect_header_corrupt(R"({"a":{"dtype":"U8","shape":[9223372036854775808],"data_offsets":[0,1]}})", 1,
                        "more elements than 2^64");
}

TEST(SafetensorsMalformed, ElementCountOverflows) {
  expect_header_corrupt(R"({"a":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,1]}})", 1,
                        "more elements than 2^64");
}

TEST(SafetensorsMalformed, ByteCountOverflows) {
  // 2^61 elements fit u64, 2^61 * 64 bits do not.
  expect_header_corrupt(R"({"a":{"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,1]}})", 1,
                        "larger than 2^64 bits");
}

TEST(SafetensorsMalformed, ZeroDimensionDoesNotHideOverflow) {
  // [0, huge, huge]: 0 elements, no overflow: valid and empty.
  const sf::FileHeader h = parse(raw_file(
      R"({"a":{"dtype":"U8","shape":[0,4294967296,4294967296],"data_offsets":[0,0]}})", 0));
  EXPECT_EQ(h.tensors.at(0).nbytes, 0u);
}

TEST(SafetensorsMalformed, SubByteDtypeNotWholeBytes) {
  expect_header_corrupt(R"({"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}})", 2, "not a whole number of bytes");
}

TEST(SafetensorsMalformed, OffsetsNotAPair) {
  expect_header_corrupt(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1,2]}})", 2, "not [begin, end]");
}

TEST(SafetensorsMalformed, OffsetsNotArray) {
  expect_header_corrupt(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":{"0":1}}})", 1, "not [begin, end]");
}

TEST(SafetensorsMalformed, NegativeOffset) {
  expect_header_corrupt(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[-1,0]}})", 1, "integers >= 0");
}

TEST(SafetensorsMalformed, OffsetsReversed) {
  expect_header_corrupt(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[1,0]}})", 1, "end before they begin");
}

TEST(SafetensorsMalformed, OffsetsPastTheData) {
  expect_header_corrupt(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", 3, "past the data section");
}

TEST(SafetensorsMalformed, HugeOffsetsDoNotWrap) {
  expect_header_corrupt(
      R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[18446744073709551615,18446744073709551615]}})", 1,
      "end past the data section");
}

TEST(SafetensorsMalformed, SizeDisagreesWithShape) {
  expect_header_corrupt(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", 4, "needs 8");
}

TEST(SafetensorsMalformed, Overlap) {
  expect_header_corrupt(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                        R"("b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
                        6, "overlaps");
}

TEST(SafetensorsMalformed, SameRangeTwice) {
  expect_header_corrupt(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                        R"("b":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})",
                        4, "overlaps");
}

TEST(SafetensorsMalformed, EmptyTensorInsideAnother) {
  expect_header_corrupt(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                        R"("b":{"dtype":"U8","shape":[0],"data_offsets":[2,2]}})",
                        4, "overlaps");
}

TEST(SafetensorsMalformed, GapBetweenTensors) {
  expect_header_corrupt(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                        R"("b":{"dtype":"U8","shape":[2],"data_offsets":[3,5]}})",
                        5, "belong to no tensor");
}

TEST(SafetensorsMalformed, GapAtTheStart) {
  expect_header_corrupt(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}})", 3, "belong to no tensor");
}

TEST(SafetensorsMalformed, TrailingBytesAfterTheData) {
  expect_header_corrupt(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", 3, "longer than its header says");
}

TEST(SafetensorsMalformed, DataButNoTensors) { expect_header_corrupt("{}", 5, "longer than its header says"); }

TEST(SafetensorsMalformed, ParseNeedsTheWholeHeader) {
  const auto b = file_bytes({make_tensor("w", "U8", {4}, 1)});
  const std::vector<std::uint8_t> head(b.begin(), b.begin() + 10);
  const shmcast::Error e =
      expect_error([&] { sf::parse_header(std::as_bytes(std::span(head)), b.size(), "test.safetensors"); });
  EXPECT_EQ(e.code(), Errc::kInvalidArgument);
}

// ---------------------------------------------------------------- index files

TEST(SafetensorsIndex, Valid) {
  const auto m = sf::parse_index(
      R"({"metadata":{"total_size":10,"nested":{"a":[1,2]}},"weight_map":{"a":"s1.safetensors","b":"s2.safetensors"}})");
  ASSERT_EQ(m.size(), 2u);
  EXPECT_EQ(m.at("b"), "s2.safetensors");
}

TEST(SafetensorsIndex, NotJson) { expect_index_corrupt("{", "malformed JSON"); }
TEST(SafetensorsIndex, NotAnObject) { expect_index_corrupt("[]", "not a JSON object"); }
TEST(SafetensorsIndex, NoWeightMap) { expect_index_corrupt(R"({"metadata":{}})", "no \"weight_map\""); }
TEST(SafetensorsIndex, WeightMapNotObject) { expect_index_corrupt(R"({"weight_map":[]})", "not an object"); }
TEST(SafetensorsIndex, MetadataNotObject) {
  expect_index_corrupt(R"({"metadata":3,"weight_map":{}})", "\"metadata\" is not an object");
}
TEST(SafetensorsIndex, ShardNotString) { expect_index_corrupt(R"({"weight_map":{"a":1}})", "not a string"); }
TEST(SafetensorsIndex, ShardWithSlash) {
  expect_index_corrupt(R"({"weight_map":{"a":"../evil.safetensors"}})", "not a plain file name");
}
TEST(SafetensorsIndex, AbsoluteShard) {
  expect_index_corrupt(R"({"weight_map":{"a":"/etc/passwd"}})", "not a plain file name");
}
TEST(SafetensorsIndex, DotDotShard) { expect_index_corrupt(R"({"weight_map":{"a":".."}})", "not a plain file name"); }
TEST(SafetensorsIndex, DotShard) { expect_index_corrupt(R"({"weight_map":{"a":"."}})", "not a plain file name"); }
TEST(SafetensorsIndex, EmptyShard) { expect_index_corrupt(R"({"weight_map":{"a":""}})", "not a plain file name"); }
TEST(SafetensorsIndex, NulInShard) {
  expect_index_corrupt(R"({"weight_map":{"a":"x\u0000.safetensors"}})", "not a plain file name");
}
TEST(SafetensorsIndex, LongShardName) {
  expect_index_corrupt(R"({"weight_map":{"a":")" + std::string(256, 'x') + "\"}}", "not a plain file name");
}
TEST(SafetensorsIndex, DuplicateTensor) {
  expect_index_corrupt(R"({"weight_map":{"a":"s1","a":"s2"}})", "twice in one object");
}
TEST(SafetensorsIndex, NulByte) {
  expect_index_corrupt(std::string("{\"weight_map\":{}}\0xx", 20), "NUL byte");
}
TEST(SafetensorsIndex, TooLarge) {
  std::string big(sf::kMaxIndexBytes + 1, ' ');
  big[0] = '{';
  expect_index_corrupt(big, "limit");
}

// ---------------------------------------------------------------- checkpoints on disk

TEST(Checkpoint, SingleFile) {
  TempDir d;
  const std::vector<Tensor> ts = {make_tensor("b", "BF16", {4, 8}, 1), make_tensor("a", "F32", {3}, 2)};
  write_file(d / "x.safetensors", file_bytes(ts, {{"format", "pt"}}));
  const sf::Checkpoint c = sf::open_checkpoint((d / "x.safetensors").string());
  EXPECT_FALSE(c.sharded());
  ASSERT_EQ(c.tensors().size(), 2u);
  EXPECT_EQ(c.tensors()[0].name, "b");  // data order
  EXPECT_EQ(c.payload_bytes(), 64u + 12u);
  EXPECT_EQ(c.find("a"), 1);
  EXPECT_EQ(c.find("zz"), -1);
  const auto specs = c.specs();
  EXPECT_EQ(specs[0].dtype, shmcast::DType::kBF16);
  EXPECT_EQ(specs[1].shape, (std::vector<std::int64_t>{3}));
  EXPECT_EQ(c.files()[0].header.metadata.at("format"), "pt");
}

TEST(Checkpoint, DirectoryWithModelSafetensors) {
  TempDir d;
  write_file(d / "model.safetensors", file_bytes({make_tensor("w", "U8", {5}, 1)}));
  write_text(d / "config.json", "{}");
  const sf::Checkpoint c = sf::open_checkpoint(d.path.string());
  EXPECT_EQ(c.tensors().size(), 1u);
}

TEST(Checkpoint, ShardedDirectory) {
  TempDir d;
  const auto all = make_sharded(d.path, 3, 4, 10);
  const sf::Checkpoint c = sf::open_checkpoint(d.path.string());
  EXPECT_TRUE(c.sharded());
  ASSERT_EQ(c.files().size(), 3u);
  ASSERT_EQ(c.tensors().size(), all.size());
  for (std::size_t i = 0; i < all.size(); ++i) {
    EXPECT_EQ(c.tensors()[i].name, all[i].name);  // shard order, then data order
    EXPECT_EQ(c.tensors()[i].file, i / 4);
  }
}

TEST(Checkpoint, IndexPathItself) {
  TempDir d;
  make_sharded(d.path, 2, 2, 11);
  const sf::Checkpoint c = sf::open_checkpoint((d / "model.safetensors.index.json").string());
  EXPECT_EQ(c.tensors().size(), 4u);
}

TEST(Checkpoint, MissingPathIsNotFound) {
  const auto e = expect_error([] { sf::open_checkpoint("/nonexistent/shmcast/ckpt"); });
  EXPECT_EQ(e.code(), Errc::kNotFound);
}

TEST(Checkpoint, EmptyDirectoryIsNotFound) {
  TempDir d;
  const auto e = expect_error([&] { sf::open_checkpoint(d.path.string()); });
  EXPECT_EQ(e.code(), Errc::kNotFound);
  EXPECT_NE(std::string(e.what()).find("neither"), std::string::npos) << e.what();
}

TEST(Checkpoint, AmbiguousDirectory) {
  TempDir d;
  write_file(d / "a.safetensors", file_bytes({make_tensor("w", "U8", {1}, 1)}));
  write_file(d / "b.safetensors", file_bytes({make_tensor("w", "U8", {1}, 1)}));
  const auto e = expect_error([&] { sf::open_checkpoint(d.path.string()); });
  EXPECT_EQ(e.code(), Errc::kInvalidArgument);
}

TEST(Checkpoint, ShardMissing) {
  TempDir d;
  make_sharded(d.path, 2, 2, 12);
  fs::remove(d / "model-00002-of-00002.safetensors");
  const auto e = expect_error([&] { sf::open_checkpoint(d.path.string()); });
  EXPECT_EQ(e.code(), Errc::kNotFound);
  EXPECT_NE(std::string(e.what()).find("model-00002-of-00002.safetensors"), std::string::npos) << e.what();
}

TEST(Checkpoint, IndexListsATensorNoShardHolds) {
  TempDir d;
  make_sharded(d.path, 2, 2, 13);
  auto idx = json::parse(read_file(d / "model.safetensors.index.json"));
  idx["weight_map"]["ghost"] = "model-00001-of-00002.safetensors";
  write_text(d / "model.safetensors.index.json", idx.dump());
  const auto e = expect_error([&] { sf::open_checkpoint(d.path.string()); });
  EXPECT_EQ(e.code(), Errc::kCorrupt);
  EXPECT_NE(std::string(e.what()).find("ghost"), std::string::npos) << e.what();
}

TEST(Checkpoint, ShardHoldsATensorTheIndexOmits) {
  TempDir d;
  make_sharded(d.path, 2, 2, 14);
  auto idx = json::parse(read_file(d / "model.safetensors.index.json"));
  idx["weight_map"].erase("layers.0.weight");
  write_text(d / "model.safetensors.index.json", idx.dump());
  const auto e = expect_error([&] { sf::open_checkpoint(d.path.string()); });
  EXPECT_EQ(e.code(), Errc::kCorrupt);
  EXPECT_NE(std::string(e.what()).find("does not list"), std::string::npos) << e.what();
}

TEST(Checkpoint, IndexMapsATensorToTheWrongShard) {
  TempDir d;
  make_sharded(d.path, 2, 2, 15);
  auto idx = json::parse(read_file(d / "model.safetensors.index.json"));
  idx["weight_map"]["layers.0.weight"] = "model-00002-of-00002.safetensors";
  write_text(d / "model.safetensors.index.json", idx.dump());
  const auto e = expect_error([&] { sf::open_checkpoint(d.path.string()); });
  EXPECT_EQ(e.code(), Errc::kCorrupt);
  EXPECT_NE(std::string(e.what()).find("disagree"), std::string::npos) << e.what();
}

TEST(Checkpoint, SameTensorInTwoShards) {
  TempDir d;
  write_file(d / "s1.safetensors", file_bytes({make_tensor("w", "U8", {1}, 1)}));
  write_file(d / "s2.safetensors", file_bytes({make_tensor("w", "U8", {1}, 2), make_tensor("x", "U8", {1}, 3)}));
  write_text(d / "model.safetensors.index.json", R"({"weight_map":{"w":"s1.safetensors","x":"s2.safetensors"}})");
  const auto e = expect_error([&] { sf::open_checkpoint(d.path.string()); });
  EXPECT_EQ(e.code(), Errc::kCorrupt);
}

TEST(Checkpoint, IndexWithPathTraversal) {
  TempDir d;
  fs::create_directory(d / "ckpt");
  write_file(d / "outside.safetensors", file_bytes({make_tensor("w", "U8", {1}, 1)}));
  write_text(d / "ckpt" / "model.safetensors.index.json", R"({"weight_map":{"w":"../outside.safetensors"}})");
  const auto e = expect_error([&] { sf::open_checkpoint((d / "ckpt").string()); });
  EXPECT_EQ(e.code(), Errc::kCorrupt);
  EXPECT_NE(std::string(e.what()).find("not a plain file name"), std::string::npos) << e.what();
}

TEST(Checkpoint, SymlinkedShardIsRefusedUnlessAllowed) {
  TempDir d;
  fs::create_directory(d / "ckpt");
  write_file(d / "outside.safetensors", file_bytes({make_tensor("w", "U8", {1}, 1)}));
  fs::create_symlink(d / "outside.safetensors", d / "ckpt" / "s1.safetensors");
  write_text(d / "ckpt" / "model.safetensors.index.json", R"({"weight_map":{"w":"s1.safetensors"}})");
  const auto e = expect_error([&] { sf::open_checkpoint((d / "ckpt").string()); });
  EXPECT_EQ(e.code(), Errc::kPermission);
  EXPECT_NE(std::string(e.what()).find("symbolic link"), std::string::npos) << e.what();
  EXPECT_NE(std::string(e.what()).find("--allow-symlinks"), std::string::npos) << e.what();
  sf::OpenOptions o;
  o.allow_symlinks = true;
  EXPECT_EQ(sf::open_checkpoint((d / "ckpt").string(), o).tensors().size(), 1u);
}

TEST(Checkpoint, SymlinkedIndexInADirectoryIsRefused) {
  TempDir d;
  fs::create_directory(d / "ckpt");
  write_file(d / "ckpt" / "s1.safetensors", file_bytes({make_tensor("w", "U8", {1}, 1)}));
  write_text(d / "idx.json", R"({"weight_map":{"w":"s1.safetensors"}})");
  fs::create_symlink(d / "idx.json", d / "ckpt" / "model.safetensors.index.json");
  const auto e = expect_error([&] { sf::open_checkpoint((d / "ckpt").string()); });
  EXPECT_EQ(e.code(), Errc::kPermission);
}

TEST(Checkpoint, ShardThatIsAFifoDoesNotBlock) {
  TempDir d;
  ASSERT_EQ(::mkfifo((d / "s1.safetensors").c_str(), 0600), 0);
  write_text(d / "model.safetensors.index.json", R"({"weight_map":{"w":"s1.safetensors"}})");
  const auto e = expect_error([&] { sf::open_checkpoint(d.path.string()); });
  EXPECT_EQ(e.code(), Errc::kInvalidArgument);
  EXPECT_NE(std::string(e.what()).find("not a regular file"), std::string::npos) << e.what();
}

TEST(Checkpoint, ShardThatIsADirectory) {
  TempDir d;
  fs::create_directory(d / "s1.safetensors");
  write_text(d / "model.safetensors.index.json", R"({"weight_map":{"w":"s1.safetensors"}})");
  const auto e = expect_error([&] { sf::open_checkpoint(d.path.string()); });
  EXPECT_TRUE(e.code() == Errc::kInvalidArgument || e.code() == Errc::kSystem) << e.what();
}

TEST(Checkpoint, CorruptShardNamesTheShard) {
  TempDir d;
  make_sharded(d.path, 2, 2, 16);
  auto b = read_file(d / "model-00002-of-00002.safetensors");
  b.pop_back();  // the data section is one byte short
  write_file(d / "model-00002-of-00002.safetensors", b);
  const auto e = expect_error([&] { sf::open_checkpoint(d.path.string()); });
  EXPECT_EQ(e.code(), Errc::kCorrupt);
  EXPECT_NE(std::string(e.what()).find("model-00002-of-00002.safetensors"), std::string::npos) << e.what();
}

TEST(Checkpoint, EmptyIndex) {
  TempDir d;
  write_text(d / "model.safetensors.index.json", R"({"weight_map":{}})");
  const auto e = expect_error([&] { sf::open_checkpoint(d.path.string()); });
  EXPECT_EQ(e.code(), Errc::kCorrupt);
}

TEST(Checkpoint, SubByteDtypeOpensButCannotBePublished) {
  TempDir d;
  write_file(d / "x.safetensors", file_bytes({make_tensor("q", "F4", {8}, 1)}));
  const sf::Checkpoint c = sf::open_checkpoint((d / "x.safetensors").string());
  EXPECT_EQ(c.tensors().at(0).nbytes, 4u);
  const auto e = expect_error([&] { (void)c.specs(); });
  EXPECT_EQ(e.code(), Errc::kInvalidArgument);
  EXPECT_NE(std::string(e.what()).find("F4"), std::string::npos) << e.what();
}

TEST(Checkpoint, TooManyDimensionsCannotBePublished) {
  TempDir d;
  write_file(d / "x.safetensors", file_bytes({make_tensor("q", "U8", {1, 1, 1, 1, 1, 1, 1, 1, 2}, 1)}));
  const sf::Checkpoint c = sf::open_checkpoint((d / "x.safetensors").string());
  const auto e = expect_error([&] { (void)c.specs(); });
  EXPECT_EQ(e.code(), Errc::kInvalidArgument);
}
