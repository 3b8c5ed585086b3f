// Layout: geometry arithmetic and header validation.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstring>

#include "base/layout.hpp"

using namespace shmcast::detail;

namespace {
HeaderFixed good_header(Geometry* g_out = nullptr) {
  Geometry g{};
  EXPECT_EQ(compute_geometry(8, 2, 64ull << 20, 1 << 20, &g), "");
  HeaderFixed h = make_fixed_header(g, 0);
  if (g_out) *g_out = g;
  return h;
}
}  // namespace

TEST(Layout, GeometryAlignsDataTo2MiB) {
  Geometry g{};
  ASSERT_EQ(compute_geometry(8, 3, 1000, 5000, &g), "");
  EXPECT_EQ(g.slot_bytes, 2ull << 20);
  EXPECT_EQ(g.data_offset % (2ull << 20), 0u);
  EXPECT_EQ(g.manifest_bytes % 4096, 0u);
  EXPECT_GE(g.manifest_offset, g.slots_offset + 3 * kSlotDescBytes);
  EXPECT_EQ(g.total_bytes, g.data_offset + 3 * g.slot_bytes);
}

TEST(Layout, GeometryRejectsBadParameters) {
  Geometry g{};
  EXPECT_NE(compute_geometry(0, 2, 1 << 20, 1 << 20, &g), "");
  EXPECT_NE(compute_geometry(65, 2, 1 << 20, 1 << 20, &g), "");
  EXPECT_NE(compute_geometry(8, 1, 1 << 20, 1 << 20, &g), "");
  EXPECT_NE(compute_geometry(8, 2, 0, 1 << 20, &g), "");
  EXPECT_NE(compute_geometry(8, 2, 1 << 20, 10, &g), "");
  EXPECT_NE(compute_geometry(8, 4096, 64ull << 30, 1 << 20, &g), "");  // overflow guard
}

TEST(Layout, ValidHeaderPasses) {
  HeaderFixed h = good_header();
  bool vm = true;
  EXPECT_EQ(validate_header(h, h.total_bytes, &vm), "");
  EXPECT_FALSE(vm);
}

TEST(Layout, BadMagicIsForeign) {
  HeaderFixed h = good_header();
  h.magic ^= 1;
  bool vm = false;
  EXPECT_NE(validate_header(h, h.total_bytes, &vm), "");
  EXPECT_FALSE(vm);
}

TEST(Layout, NewerVersionIsAVersionMismatch) {
  HeaderFixed h = good_header();
  h.layout_version = kLayoutVersion + 1;
  bool vm = false;
  EXPECT_NE(validate_header(h, h.total_bytes, &vm), "");
  EXPECT_TRUE(vm);
}

TEST(Layout, TruncatedFileIsRejected) {
  HeaderFixed h = good_header();
  bool vm = false;
  EXPECT_NE(validate_header(h, h.total_bytes - 4096, &vm), "");
}

TEST(Layout, EveryOffsetMustMatchTheGeometry) {
  bool vm = false;
  for (int field = 0; field < 5; ++field) {
    HeaderFixed h = good_header();
    switch (field) {
      case 0: h.seats_offset += 64; break;
      case 1: h.slots_offset -= 64; break;
      case 2: h.manifest_offset = 1ull << 60; break;
      case 3: h.data_offset += 4096; break;
      case 4: h.slot_bytes += 1; break;
    }
    EXPECT_NE(validate_header(h, h.total_bytes, &vm), "") << "field " << field;
  }
}

TEST(Layout, UnknownFeatureBitsAreRejected) {
  HeaderFixed h = good_header();
  h.features = 1ull << 40;
  bool vm = false;
  EXPECT_NE(validate_header(h, h.total_bytes, &vm), "");
}

// The store bit changes the geometry (two manifest areas) and allows only 2
// slots and 1 rank: a header that claims it with anything else, or a ring
// header with the bit set, is refused.
TEST(Layout, StoreBitIsCheckedAgainstTheGeometry) {
  Geometry g{};
  ASSERT_EQ(compute_geometry(4, 2, 4 << 20, 1 << 20, &g, 1, true), "");
  HeaderFixed store = make_fixed_header(g, kFeatureStore);
  bool vm = false;
  EXPECT_EQ(validate_header(store, store.total_bytes, &vm), "");
  EXPECT_EQ(g.ranks_offset, g.manifest_offset + 2 * g.manifest_bytes);
  HeaderFixed h = store;
  h.features = 0;  // the same bytes read as a ring region: offsets do not match
  EXPECT_NE(validate_header(h, h.total_bytes, &vm), "");
  Geometry g3{};
  ASSERT_EQ(compute_geometry(4, 3, 4 << 20, 1 << 20, &g3, 1, false), "");
  h = make_fixed_header(g3, kFeatureStore);  // 3 slots with the store bit
  EXPECT_NE(validate_header(h, h.total_bytes, &vm), "");
  EXPECT_NE(compute_geometry(4, 4, 4 << 20, 1 << 20, &g3, 2, true), "");  // 2 ranks
}

TEST(Layout, HugeCountsDoNotOverflow) {
  HeaderFixed h = good_header();
  h.slot_count = 0xffffffffu;
  h.max_consumers = 0xffffffffu;
  bool vm = false;
  EXPECT_NE(validate_header(h, h.total_bytes, &vm), "");
}

// Version 3 (sharded rounds with identity): the round words and a rank's
// post sit where docs/protocol.md puts them, and the takeover's lock byte
// is no consumer's and no rank's. A version-2 region (rounds matched by
// count) is another version, refused as such. (Version 4 added the
// device-slots block and kept all of this.)
TEST(Layout, Version3RoundWordsAndTakeoverLockByte) {
  EXPECT_EQ(kLayoutVersion, 4u);
  EXPECT_EQ(offsetof(Header, round), 176u);
  EXPECT_EQ(offsetof(Header, round_open), 184u);
  EXPECT_EQ(offsetof(Header, round_done), 344u);
  EXPECT_EQ(offsetof(RankSeat, post), 64u);
  EXPECT_EQ(offsetof(RankSeat, left_code), 92u);
  EXPECT_EQ(offsetof(RankSeat, left_round), 96u);
  EXPECT_EQ(offsetof(RankSeat, reply_round), 128u);
  EXPECT_EQ(kTakeoverLockByte, 129);
  EXPECT_NE(kTakeoverLockByte, kProducerLockByte);
  for (std::uint32_t i = 0; i < kMaxConsumers; ++i) EXPECT_NE(seat_lock_byte(i), kTakeoverLockByte);
  for (std::uint32_t r = 1; r < kMaxRanks; ++r) EXPECT_NE(rank_lock_byte(r), kTakeoverLockByte);
  HeaderFixed h = good_header();
  h.layout_version = 2;
  bool vm = false;
  EXPECT_NE(validate_header(h, h.total_bytes, &vm), "");
  EXPECT_TRUE(vm);
}

// Version 4: device slots. The block sits at header offset 640; a region of
// device slots keeps no slot bytes in its file; the block is checked
// against the geometry and the feature bits (crafted blocks are refused).
TEST(Layout, Version4DeviceSlots) {
  EXPECT_EQ(offsetof(Header, device_slots), 640u);
  EXPECT_EQ(sizeof(DeviceSlotsFixed), 64u);
  Geometry host{}, dev{};
  ASSERT_EQ(compute_geometry(4, 3, 8ull << 20, 1 << 20, &host), "");
  ASSERT_EQ(compute_geometry(4, 3, 8ull << 20, 1 << 20, &dev, 1, false, true), "");
  EXPECT_TRUE(dev.device_slots);
  EXPECT_EQ(dev.data_offset, host.data_offset);
  EXPECT_EQ(dev.total_bytes, dev.data_offset);
  EXPECT_EQ(host.total_bytes, host.data_offset + 3 * (8ull << 20));
  Geometry g{};
  EXPECT_NE(compute_geometry(4, 2, 8ull << 20, 1 << 20, &g, 1, true, true), "");   // store
  EXPECT_EQ(compute_geometry(4, 4, 8ull << 20, 1 << 20, &g, 2, false, true), "");  // sharded: fine
  EXPECT_EQ(g.total_bytes, g.data_offset);

  // A header with the bit validates only with the device geometry.
  HeaderFixed h = make_fixed_header(dev, kFeatureDeviceSlots);
  bool vm = false;
  EXPECT_EQ(validate_header(h, dev.total_bytes, &vm), "");
  HeaderFixed wrong = make_fixed_header(host, kFeatureDeviceSlots);
  EXPECT_NE(validate_header(wrong, host.total_bytes, &vm), "");

  DeviceSlotsFixed d{};
  d.gpu_uuid[3] = 7;
  d.alloc_bytes = 3 * (8ull << 20);
  d.nonce = 42;
  EXPECT_EQ(device_slots_problem(d, dev, kFeatureDeviceSlots), "");
  EXPECT_NE(device_slots_problem(d, host, 0), "");  // a block in a host region
  EXPECT_EQ(device_slots_problem(DeviceSlotsFixed{}, host, 0), "");
  auto bad = [&](auto change) {
    DeviceSlotsFixed x = d;
    change(x);
    return device_slots_problem(x, dev, kFeatureDeviceSlots);
  };
  EXPECT_NE(bad([](DeviceSlotsFixed& x) { x.alloc_bytes -= 2ull << 20; }), "");  // smaller than the slots
  EXPECT_NE(bad([](DeviceSlotsFixed& x) { x.alloc_bytes += 4096; }), "");        // not 2 MiB granular
  EXPECT_NE(bad([](DeviceSlotsFixed& x) { x.alloc_bytes += 2ull << 30; }), "");  // too much slack
  EXPECT_NE(bad([](DeviceSlotsFixed& x) { x.nonce = 0; }), "");
  EXPECT_NE(bad([](DeviceSlotsFixed& x) { x.gpu_uuid[3] = 0; }), "");
  EXPECT_NE(bad([](DeviceSlotsFixed& x) { x.reserved[31] = 1; }), "");
  EXPECT_NE(device_slots_problem(d, dev, kFeatureDeviceSlots | kFeatureChecksums), "");
  EXPECT_NE(device_slots_problem(d, dev, kFeatureDeviceSlots | kFeatureDelta), "");
  EXPECT_EQ(bad([](DeviceSlotsFixed& x) { x.alloc_bytes += 2ull << 20; }), "");  // rounded up: fine
}
