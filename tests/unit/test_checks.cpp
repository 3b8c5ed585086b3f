// checks.hpp: the small rules several layers share (errno mapping, error
// text, checked sizes, sync-record sanity).
#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "base/checks.hpp"
#include "protocol/ring.hpp"

using namespace shmcast;
using namespace shmcast::detail;

TEST(Checks, ErrnoMapsToErrc) {
  EXPECT_EQ(errc_for_errno(EEXIST), Errc::kExists);
  EXPECT_EQ(errc_for_errno(ENOENT), Errc::kNotFound);
  EXPECT_EQ(errc_for_errno(EACCES), Errc::kPermission);
  EXPECT_EQ(errc_for_errno(EPERM), Errc::kPermission);
  EXPECT_EQ(errc_for_errno(ENOSPC), Errc::kRegionFull);
  EXPECT_EQ(errc_for_errno(ENOMEM), Errc::kRegionFull);
  EXPECT_EQ(errc_for_errno(EIO), Errc::kSystem);
  try {
    throw_errno(EACCES, "open x");
    FAIL() << "throw_errno returned";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kPermission);
    EXPECT_EQ(e.sys_errno(), EACCES);
    EXPECT_NE(std::string(e.what()).find("open x: "), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("group_access"), std::string::npos) << e.what();
  }
}

TEST(Checks, EveryErrcHasOneNameAndKeepsItsValue) {
  // Errc values are stored in regions (error_code, evict_reason,
  // reply_status) and read by tools: codes are only ever appended.
  EXPECT_EQ(static_cast<int>(Errc::kInvalidArgument), 1);
  EXPECT_EQ(static_cast<int>(Errc::kSystem), 18);
  EXPECT_EQ(static_cast<int>(Errc::kUnsupported), 19);
  EXPECT_EQ(static_cast<int>(Errc::kNeedsFullSync), 20);
  std::vector<std::string> names;
  for (int c = 1; c <= static_cast<int>(Errc::kNeedsFullSync); ++c) {
    const std::string n = errc_name(static_cast<Errc>(c));
    EXPECT_NE(n, "Unknown") << c;
    for (const std::string& m : names) EXPECT_NE(n, m) << c;
    names.push_back(n);
  }
  EXPECT_STREQ(errc_name(Errc::kUnsupported), "Unsupported");
  EXPECT_STREQ(errc_name(Errc::kNeedsFullSync), "NeedsFullSync");
  EXPECT_STREQ(errc_name(static_cast<Errc>(21)), "Unknown");
  const Error e(Errc::kUnsupported, "no peer access: use a host-slot region");
  EXPECT_EQ(std::string(e.what()), "shmcast Unsupported: no peer access: use a host-slot region");
}

TEST(Checks, ErrorTextIsBoundedAndTerminated) {
  char field[kErrorTextBytes];
  std::memset(field, 'x', sizeof field);
  write_error_text(field, "short");
  EXPECT_EQ(read_error_text(field), "short");
  const std::string longer(1000, 'y');
  write_error_text(field, longer);
  EXPECT_EQ(field[kErrorTextBytes - 1], '\0');
  EXPECT_EQ(read_error_text(field), std::string(kErrorTextBytes - 1, 'y'));
  // Hostile bytes without a NUL are read up to the field's end, not past it.
  std::memset(field, 'z', sizeof field);
  EXPECT_EQ(read_error_text(field), std::string(kErrorTextBytes, 'z'));
}

TEST(Checks, SizesRefuseOverflow) {
  std::uint64_t out = 0;
  EXPECT_TRUE(checked_mul(1ull << 31, 1ull << 32, &out));
  EXPECT_EQ(out, 1ull << 63);
  EXPECT_FALSE(checked_mul(1ull << 32, 1ull << 32, &out));
  EXPECT_FALSE(checked_add(std::numeric_limits<std::uint64_t>::max(), 1, &out));
  const std::int64_t shape[] = {3, 4, 5};
  ASSERT_TRUE(shape_bytes(DType::kBF16, shape, 3, &out));
  EXPECT_EQ(out, 120u);
  const std::int64_t negative[] = {3, -1};
  EXPECT_FALSE(shape_bytes(DType::kF32, negative, 2, &out));
  const std::int64_t huge[] = {1ll << 62, 1ll << 62};
  EXPECT_FALSE(shape_bytes(DType::kU8, huge, 2, &out));
  EXPECT_FALSE(shape_bytes(static_cast<DType>(99), shape, 3, &out));

  std::vector<TensorSpec> specs = {{"a", DType::kF32, {1024}}, {"b", DType::kU8, {7}}};
  ASSERT_TRUE(payload_bytes(specs, &out));
  EXPECT_EQ(out, 4096u + 7u);
  specs.push_back({"c", DType::kU8, {static_cast<std::int64_t>(kMaxStreamBytes)}});
  EXPECT_FALSE(payload_bytes(specs, &out));  // over one sync's limit
}

TEST(Checks, RecordProblemFindsInconsistentRecords) {
  Geometry g{};
  ASSERT_EQ(compute_geometry(2, 2, 2 << 20, 1 << 20, &g), "");
  RecordSnapshot rec{};
  rec.version = 1;
  rec.first_seq = 1;
  rec.stream_bytes = (2u << 20) + 1;
  rec.chunks = 2;
  rec.manifest_used = sizeof(ManifestHeader) + sizeof(ManifestEntry) + 1;
  EXPECT_EQ(record_problem(rec, g), "");
  RecordSnapshot bad = rec;
  bad.manifest_used = sizeof(ManifestHeader) - 1;
  EXPECT_NE(record_problem(bad, g), "");
  bad = rec;
  bad.manifest_used = g.manifest_bytes + 1;
  EXPECT_NE(record_problem(bad, g), "");
  bad = rec;
  bad.first_seq = 0;
  EXPECT_NE(record_problem(bad, g), "");
  bad = rec;
  bad.chunks = (1ull << 46) + 1;  // more chunks than any sync can have (the exact count is checked
                                  // against the manifest's rank table: sync_chunks)
  EXPECT_NE(record_problem(bad, g), "");
  EXPECT_EQ(sync_chunks({2 * g.slot_bytes + 1, g.slot_bytes}, g.slot_bytes), 6u);  // 2 ranks x 3
  bad = rec;
  bad.stream_bytes = ~0ull;  // would wrap the chunk count
  bad.chunks = 0;
  EXPECT_NE(record_problem(bad, g), "");
}
