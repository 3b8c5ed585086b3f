// Unit tests of the read-only probe (lib/core/probe, shmcast/probe.hpp), in
// process: real regions made with the public Producer API in a private
// directory, and crafted or corrupt files (empty, truncated, foreign, a
// newer or older layout, a broken header, hostile manifest fields, a
// symlink, a FIFO, a directory, a world-writable file). shmcast-inspect's
// own tests (tests/tool) run the tool on top of this.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include <xxhash.h>

#include <chrono>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "base/layout.hpp"
#include "shmcast/probe.hpp"
#include "shmcast/shmcast.hpp"
#include "region_edit.hpp"
#include "support.hpp"

using namespace shmcast;
using namespace std::chrono_literals;
namespace fs = std::filesystem;
namespace P = shmcast::probe;

namespace {

constexpr std::uint64_t kSlot = 2ull << 20;

// A private region directory, exported as SHMCAST_DIR for the library.
struct TempDir : shmcast_test::RegionDir {
  TempDir() : RegionDir("probetest") {}
};

ProducerOptions small_opts() {
  ProducerOptions o;
  o.slot_bytes = kSlot;
  o.slots = 2;
  o.max_consumers = 4;
  o.pin = Pin::kNo;
  o.consumer_timeout = 20s;
  o.manifest_bytes = 1 << 20;  // the tests copy whole region files (the default reserves 1 GiB of holes)
  return o;
}

// Three tensors: "w.a" f32 {4, 8}, "w.b" bf16 {16}, "c" u8 {100}.
std::vector<TensorSpec> three_specs() {
  return {{"w.a", DType::kF32, {4, 8}}, {"w.b", DType::kBF16, {16}}, {"c", DType::kU8, {100}}};
}

std::uint64_t send_three(Producer& p) {
  const std::vector<TensorSpec> specs = three_specs();
  std::vector<std::vector<std::byte>> data;
  std::vector<const void*> ptrs;
  for (const TensorSpec& s : specs) data.emplace_back(s.nbytes(), std::byte{7});
  for (auto& d : data) ptrs.push_back(d.data());
  return p.send(specs, ptrs);
}

P::Region probe_in(const TempDir& dir, const std::string& name, bool manifest = true, std::size_t limit = 0,
                double grace_s = 60) {
  P::Options o;
  o.decode_manifest = manifest;
  o.manifest_limit = limit;
  o.grace_s = grace_s;
  return P::probe_region(dir.path, name, o);
}

std::string read_file(const std::string& path) {
  std::string s;
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return s;
  char buf[65536];
  for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) > 0;) s.append(buf, static_cast<std::size_t>(n));
  ::close(fd);
  return s;
}

// Writes `bytes` to a new file (mode 0600).
void write_file(const std::string& path, const std::string& bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0) << path;
  ASSERT_EQ(::write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  ::close(fd);
}

// A copy of region `from` as region `to` (no process holds its locks), with
// `edit` applied to its bytes first.
void copy_region(const TempDir& dir, const std::string& from, const std::string& to,
                 const std::function<void(std::string&)>& edit = {}) {
  std::string bytes = read_file(dir.file(from));
  ASSERT_GE(bytes.size(), detail::kHeaderBytes);
  if (edit) edit(bytes);
  write_file(dir.file(to), bytes);
}

detail::HeaderFixed* fixed_of(std::string& bytes) { return reinterpret_cast<detail::HeaderFixed*>(bytes.data()); }

using shmcast_test::rewrite_manifest;

detail::ManifestHeader* mhead(std::string& m) { return reinterpret_cast<detail::ManifestHeader*>(m.data()); }
detail::ManifestEntry* mentry(std::string& m, std::size_t i) {
  return reinterpret_cast<detail::ManifestEntry*>(m.data() + sizeof(detail::ManifestHeader) +
                                                  i * sizeof(detail::ManifestEntry));
}
std::uint64_t* mranks(std::string& m) {
  return reinterpret_cast<std::uint64_t*>(m.data() + sizeof(detail::ManifestHeader) +
                                          mhead(m)->tensor_count * sizeof(detail::ManifestEntry));
}
detail::ManifestPiece* mpiece(std::string& m, std::size_t k) {
  return reinterpret_cast<detail::ManifestPiece*>(reinterpret_cast<std::byte*>(mranks(m)) +
                                                  mhead(m)->world_size * 8 + k * sizeof(detail::ManifestPiece));
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

// ---------------------------------------------------------------- real regions

TEST(Probe, ReadyRegionWithItsManifest) {
  TempDir dir;
  Producer p = Producer::create("live", small_opts());
  ASSERT_EQ(send_three(p), 1u);
  const P::Region r = probe_in(dir, "live");
  EXPECT_EQ(r.state, P::State::kReady) << r.reason;
  EXPECT_TRUE(P::state_is_valid(r.state));
  EXPECT_FALSE(P::state_is_damaged(r.state));
  EXPECT_EQ(r.path, dir.file("live"));
  EXPECT_EQ(r.file_type, "regular");
  EXPECT_TRUE(r.owner.known);
  EXPECT_TRUE(r.owner.trusted) << r.owner.trust_problem;
  EXPECT_EQ(r.owner.uid, ::geteuid());
  EXPECT_EQ(r.owner.mode, 0600u);
  EXPECT_EQ(r.any_lock, P::Alive::kYes);
  ASSERT_TRUE(r.have_fixed && r.have_header && r.header_valid && r.have_record);
  EXPECT_TRUE(r.fixed.shmcast_magic);
  EXPECT_EQ(r.fixed.layout_version, P::layout_version());
  EXPECT_EQ(r.fixed.total_bytes, r.size);
  EXPECT_EQ(r.fixed.slot_count, 2u);
  EXPECT_EQ(r.fixed.slot_bytes, kSlot);
  EXPECT_EQ(r.fixed.max_consumers, 4u);
  EXPECT_EQ(r.fixed.world_size, 1u);
  EXPECT_FALSE(r.fixed.store);
  EXPECT_FALSE(r.fixed.delta);
  EXPECT_EQ(r.init_state, P::InitState::kReady);
  EXPECT_EQ(r.producer.pid, static_cast<std::uint32_t>(::getpid()));
  EXPECT_EQ(r.producer_alive, P::Alive::kYes);
  EXPECT_EQ(r.syncs_done, 1u);
  EXPECT_TRUE(r.record.stable);
  EXPECT_EQ(r.record.version, 1u);
  EXPECT_EQ(r.record.chunks, 1u);
  EXPECT_EQ(r.sync_status, P::SyncStatus::kPublished);
  EXPECT_EQ(r.chunks_published, 1u);
  ASSERT_EQ(r.seats.size(), 4u);
  for (const P::Seat& s : r.seats) EXPECT_EQ(s.state, P::SeatState::kFree);
  EXPECT_EQ(r.consumers_attached, 0u);
  ASSERT_EQ(r.slots.size(), 2u);
  EXPECT_EQ(r.slots[0].seq, 1u);
  EXPECT_EQ(r.slots[0].state, P::SlotState::kReleased);
  EXPECT_EQ(r.slots[1].state, P::SlotState::kEmpty);

  const P::Manifest& m = r.manifest;
  ASSERT_EQ(m.status, P::ManifestStatus::kOk) << m.reason;
  EXPECT_EQ(m.version, 1u);
  EXPECT_EQ(m.tensor_count, 3u);
  EXPECT_EQ(m.world_size, 1u);
  EXPECT_EQ(m.payload_bytes, 128u + 32u + 100u);
  EXPECT_EQ(m.logical_bytes, m.payload_bytes);
  EXPECT_FALSE(m.delta());
  EXPECT_EQ(m.base_version, 0u);
  ASSERT_EQ(m.tensors.size(), 3u);
  const std::vector<TensorSpec> specs = three_specs();
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(m.tensors[i].name, specs[i].name);
    EXPECT_EQ(m.tensors[i].dtype, specs[i].dtype);
    EXPECT_EQ(m.tensors[i].shape, specs[i].shape);
    EXPECT_EQ(m.tensors[i].nbytes, specs[i].nbytes());
    ASSERT_EQ(m.tensors[i].shards.size(), 1u);
    EXPECT_EQ(m.tensors[i].shards[0].dim, -1);
    EXPECT_EQ(m.tensors[i].shards[0].nbytes, specs[i].nbytes());
    EXPECT_EQ(m.tensors[i].shards[0].wire_bytes, specs[i].nbytes());
    EXPECT_EQ(m.tensors[i].shards[0].base_version, 0u);
    EXPECT_EQ(m.tensors[i].shards[0].stream_offset % limits::kTensorAlign, 0u);
  }
}

TEST(Probe, ManifestLimitSkipAndNoSync) {
  TempDir dir;
  Producer p = Producer::create("lim", small_opts());
  const P::Region none = probe_in(dir, "lim");
  EXPECT_EQ(none.state, P::State::kReady);
  EXPECT_EQ(none.sync_status, P::SyncStatus::kNone);
  EXPECT_EQ(none.manifest.status, P::ManifestStatus::kNone);
  ASSERT_EQ(send_three(p), 1u);
  const P::Region one = probe_in(dir, "lim", true, 1);
  ASSERT_EQ(one.manifest.status, P::ManifestStatus::kOk) << one.manifest.reason;
  EXPECT_EQ(one.manifest.tensor_count, 3u);
  ASSERT_EQ(one.manifest.tensors.size(), 1u);
  EXPECT_EQ(one.manifest.tensors[0].name, "w.a");
  EXPECT_EQ(one.manifest.payload_bytes, 260u);  // every piece counted, kept or not
  const P::Region skipped = probe_in(dir, "lim", false);
  EXPECT_EQ(skipped.manifest.status, P::ManifestStatus::kSkipped);
  EXPECT_TRUE(skipped.manifest.tensors.empty());
}

TEST(Probe, SeatsOfAnAttachedConsumer) {
  TempDir dir;
  Producer p = Producer::create("seat", small_opts());
  Consumer c = Consumer::open("seat");
  const P::Region r = probe_in(dir, "seat", false);
  EXPECT_EQ(r.consumers_attached, 1u);
  EXPECT_EQ(r.consumers_alive, 1u);
  std::size_t active = 0;
  for (const P::Seat& s : r.seats) {
    if (s.state != P::SeatState::kActive) continue;
    ++active;
    EXPECT_EQ(s.consumer.pid, static_cast<std::uint32_t>(::getpid()));
    EXPECT_EQ(s.alive, P::Alive::kYes);
    EXPECT_GT(s.attach_unix_ns, 0u);
  }
  EXPECT_EQ(active, 1u);
}

TEST(Probe, ClosedRegionAndDeadCopy) {
  TempDir dir;
  ProducerOptions o = small_opts();
  o.unlink_on_close = false;
  {
    Producer p = Producer::create("gone", o);
    ASSERT_EQ(send_three(p), 1u);
    // A copy no process holds the locks of: its producer is dead.
    copy_region(dir, "gone", "dead");
    p.close();
  }
  const P::Region closed = probe_in(dir, "gone");
  EXPECT_EQ(closed.state, P::State::kClosed) << closed.reason;
  EXPECT_EQ(closed.init_state, P::InitState::kClosed);
  EXPECT_EQ(closed.manifest.status, P::ManifestStatus::kOk) << closed.manifest.reason;
  const P::Region dead = probe_in(dir, "dead");
  EXPECT_EQ(dead.state, P::State::kDead) << dead.reason;
  EXPECT_EQ(dead.producer_alive, P::Alive::kNo);
  EXPECT_TRUE(has(dead.reason, "is gone")) << dead.reason;
  EXPECT_EQ(dead.manifest.status, P::ManifestStatus::kOk) << dead.manifest.reason;
  EXPECT_EQ(dead.any_lock, P::Alive::kNo);
}

TEST(Probe, StoreRegionDecodesTheNewestBank) {
  TempDir dir;
  ProducerOptions o = small_opts();
  o.mode = RegionMode::kStore;
  o.store_bytes = kSlot;
  Producer p = Producer::create("store", o);
  ASSERT_EQ(send_three(p), 1u);
  ASSERT_EQ(send_three(p), 2u);
  const P::Region r = probe_in(dir, "store");
  EXPECT_EQ(r.state, P::State::kReady) << r.reason;
  EXPECT_TRUE(r.fixed.store);
  EXPECT_EQ(r.record.version, 2u);
  ASSERT_EQ(r.manifest.status, P::ManifestStatus::kOk) << r.manifest.reason;
  EXPECT_EQ(r.manifest.version, 2u);
  EXPECT_EQ(r.manifest.tensor_count, 3u);
}

TEST(Probe, NoFileThrowsNotFound) {
  TempDir dir;
  try {
    probe_in(dir, "absent");
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kNotFound);
  }
}

// ---------------------------------------------------------------- crafted files

TEST(Probe, EmptyAndShortFiles) {
  TempDir dir;
  write_file(dir.file("empty"), "");
  EXPECT_EQ(probe_in(dir, "empty").state, P::State::kCreating);  // young: its creator may still allocate it
  const P::Region old = probe_in(dir, "empty", true, 0, /*grace_s=*/0);
  EXPECT_EQ(old.state, P::State::kTruncated);
  EXPECT_EQ(old.reason, "the file is empty");
  write_file(dir.file("four"), "SHMC");
  const P::Region four = probe_in(dir, "four");
  EXPECT_EQ(four.state, P::State::kTruncated);
  EXPECT_TRUE(has(four.reason, "4 bytes, too few for a header")) << four.reason;
  EXPECT_FALSE(four.have_fixed);
}

TEST(Probe, ZerosAreACreatorThatDied) {
  TempDir dir;
  // A young file may be one whose creator is still at work; with no grace
  // period it is one whose creator died.
  write_file(dir.file("zeros"), std::string(detail::kHeaderBytes, '\0'));
  EXPECT_EQ(probe_in(dir, "zeros").state, P::State::kCreating);
  const P::Region dead = probe_in(dir, "zeros", true, 0, /*grace_s=*/0);
  EXPECT_EQ(dead.state, P::State::kDead);
  EXPECT_TRUE(has(dead.reason, "never written")) << dead.reason;
  write_file(dir.file("few"), std::string(512, '\0'));
  const P::Region few = probe_in(dir, "few", true, 0, 0);
  EXPECT_EQ(few.state, P::State::kTruncated);
  EXPECT_TRUE(has(few.reason, "bytes of zeros")) << few.reason;
}

TEST(Probe, ForeignMagic) {
  TempDir dir;
  write_file(dir.file("text"), std::string(8192, 'x'));
  const P::Region r = probe_in(dir, "text");
  EXPECT_EQ(r.state, P::State::kForeign);
  EXPECT_TRUE(P::state_is_damaged(r.state));
  EXPECT_TRUE(has(r.reason, "not a shmcast region (magic 0x7878787878787878)")) << r.reason;
  EXPECT_FALSE(r.fixed.shmcast_magic);
  EXPECT_FALSE(r.have_header);
}

TEST(Probe, BadHeadersOfARealRegion) {
  TempDir dir;
  Producer p = Producer::create("src", small_opts());
  ASSERT_EQ(send_three(p), 1u);
  copy_region(dir, "src", "magic", [](std::string& b) { fixed_of(b)->magic ^= 1; });
  copy_region(dir, "src", "newer", [](std::string& b) { fixed_of(b)->layout_version = detail::kLayoutVersion + 1; });
  copy_region(dir, "src", "older", [](std::string& b) { fixed_of(b)->layout_version = detail::kLayoutVersion - 1; });
  copy_region(dir, "src", "short", [](std::string& b) { b.resize(b.size() / 2); });
  copy_region(dir, "src", "headonly", [](std::string& b) { b.resize(detail::kHeaderBytes / 2); });
  copy_region(dir, "src", "slots", [](std::string& b) { fixed_of(b)->slot_count = 0; });
  copy_region(dir, "src", "geometry", [](std::string& b) { fixed_of(b)->seats_offset += 64; });

  EXPECT_EQ(probe_in(dir, "magic").state, P::State::kForeign);
  const P::Region newer = probe_in(dir, "newer");
  EXPECT_EQ(newer.state, P::State::kNewerVersion);
  EXPECT_TRUE(has(newer.reason, "this tool reads version " + std::to_string(detail::kLayoutVersion))) << newer.reason;
  EXPECT_FALSE(newer.have_header);
  EXPECT_EQ(probe_in(dir, "older").state, P::State::kOlderVersion);
  const P::Region shrt = probe_in(dir, "short");
  EXPECT_EQ(shrt.state, P::State::kTruncated);
  EXPECT_TRUE(has(shrt.reason, "the header says")) << shrt.reason;
  const P::Region head = probe_in(dir, "headonly");
  EXPECT_EQ(head.state, P::State::kTruncated);
  EXPECT_TRUE(has(head.reason, "fewer than the 4096-byte header")) << head.reason;
  for (const char* n : {"slots", "geometry"}) {
    const P::Region r = probe_in(dir, n);
    EXPECT_EQ(r.state, P::State::kCorrupt) << n << ": " << r.reason;
    EXPECT_FALSE(r.header_valid) << n;
    EXPECT_TRUE(r.seats.empty()) << n;
  }
}

// A region of device slots (layout 4), crafted without a GPU: where its
// slots live comes from the header's block, and what lies at its slot
// socket's name is reported without following it.
TEST(Probe, DeviceSlotsFromTheHeader) {
  TempDir dir;
  // 2 slots of 2 MiB, an allocation rounded up to 6 MiB.
  shmcast_test::CraftedDeviceRegion dev(dir.file("dev"), detail::kFeatureDeviceSlots,
                                        shmcast_test::device_block(6ull << 20));
  const P::Region r = probe_in(dir, "dev");
  EXPECT_EQ(r.state, P::State::kReady) << r.reason;
  ASSERT_TRUE(r.header_valid);
  EXPECT_EQ(r.producer_alive, P::Alive::kYes);
  EXPECT_TRUE(r.fixed.device_slots);
  EXPECT_FALSE(r.fixed.checksums || r.fixed.store || r.fixed.delta);
  EXPECT_EQ(r.fixed.total_bytes, r.fixed.data_offset);  // no slot bytes in the file
  EXPECT_EQ(r.size, r.fixed.data_offset);
  EXPECT_EQ(r.slot_memory, SlotMemory::kDevice);
  EXPECT_STREQ(P::slot_memory_name(r.slot_memory), "device");
  EXPECT_EQ(r.slot_gpu_uuid, shmcast_test::kDeviceBlockUuid);
  EXPECT_EQ(r.slot_device_bytes, 6ull << 20);
  EXPECT_EQ(r.slots.size(), 2u);  // the descriptors are in the file
  const std::string sock = dir.path + "/shmcast-slots.dev";
  EXPECT_EQ(r.slot_socket, sock);
  EXPECT_EQ(r.slot_socket_type, "");  // no socket: no producer served it here

  // A socket left at the name (a dead producer's, or a live one's).
  const int s = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  ASSERT_GE(s, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  ASSERT_LT(sock.size(), sizeof a.sun_path);
  std::memcpy(a.sun_path, sock.c_str(), sock.size() + 1);
  ASSERT_EQ(::bind(s, reinterpret_cast<const sockaddr*>(&a), sizeof a), 0) << std::strerror(errno);
  EXPECT_EQ(probe_in(dir, "dev").slot_socket_type, "socket");
  ::close(s);
  ASSERT_EQ(::unlink(sock.c_str()), 0);
  // A link at the name is reported as one, never followed.
  ASSERT_EQ(::symlink(dir.file("dev").c_str(), sock.c_str()), 0);
  EXPECT_EQ(probe_in(dir, "dev").slot_socket_type, "symlink");

  // A region of host slots says so, with no GPU fields.
  Producer p = Producer::create("host", small_opts());
  const P::Region h = probe_in(dir, "host");
  ASSERT_TRUE(h.header_valid);
  EXPECT_FALSE(h.fixed.device_slots);
  EXPECT_EQ(h.slot_memory, SlotMemory::kHost);
  EXPECT_STREQ(P::slot_memory_name(h.slot_memory), "host");
  EXPECT_EQ(h.slot_gpu_uuid, "");
  EXPECT_EQ(h.slot_device_bytes, 0u);
  EXPECT_EQ(h.slot_socket, "");
}

// Device-slot blocks no producer writes: corrupt, the block's fields still
// shown as the file holds them.
TEST(Probe, BadDeviceSlotBlocksAreCorrupt) {
  TempDir dir;
  struct Bad {
    const char* name;
    std::uint64_t features;
    detail::DeviceSlotsFixed block;
    const char* why;
  };
  detail::DeviceSlotsFixed nonce = shmcast_test::device_block(4ull << 20);
  nonce.nonce = 0;
  detail::DeviceSlotsFixed uuid = shmcast_test::device_block(4ull << 20);
  std::memset(uuid.gpu_uuid, 0, sizeof uuid.gpu_uuid);
  detail::DeviceSlotsFixed reserved = shmcast_test::device_block(4ull << 20);
  reserved.reserved[5] = 1;
  const Bad bad[] = {
      {"small", detail::kFeatureDeviceSlots, shmcast_test::device_block(2ull << 20),
       "device slot allocation of 2097152 bytes for 4194304 bytes of slots"},
      {"odd", detail::kFeatureDeviceSlots, shmcast_test::device_block((4ull << 20) + 4096),
       "device slot allocation of 4198400 bytes"},
      {"nonce", detail::kFeatureDeviceSlots, nonce, "without a channel nonce"},
      {"uuid", detail::kFeatureDeviceSlots, uuid, "without a GPU UUID"},
      {"reserved", detail::kFeatureDeviceSlots, reserved, "reserved bytes"},
      {"checksums", detail::kFeatureDeviceSlots | detail::kFeatureChecksums, shmcast_test::device_block(4ull << 20),
       "device slots with checksums"},
  };
  for (const Bad& b : bad) {
    shmcast_test::CraftedDeviceRegion c(dir.file(b.name), b.features, b.block);
    const P::Region r = probe_in(dir, b.name);
    EXPECT_EQ(r.state, P::State::kCorrupt) << b.name << ": " << r.reason;
    EXPECT_TRUE(has(r.reason, b.why)) << b.name << ": " << r.reason;
    EXPECT_FALSE(r.header_valid) << b.name;
    EXPECT_TRUE(r.have_header) << b.name;
    EXPECT_EQ(r.slot_memory, SlotMemory::kDevice) << b.name;
    EXPECT_EQ(r.slot_device_bytes, b.block.alloc_bytes) << b.name;
  }
  // The block in a region of host slots (a real one, edited).
  Producer p = Producer::create("src", small_opts());
  copy_region(dir, "src", "hostblock", [](std::string& bytes) {
    const detail::DeviceSlotsFixed blk = shmcast_test::device_block(4ull << 20);
    std::memcpy(bytes.data() + offsetof(detail::Header, device_slots), &blk, sizeof blk);
  });
  const P::Region h = probe_in(dir, "hostblock");
  EXPECT_EQ(h.state, P::State::kCorrupt) << h.reason;
  EXPECT_TRUE(has(h.reason, "not zero in a region of host slots")) << h.reason;
  EXPECT_EQ(h.slot_memory, SlotMemory::kHost);
  EXPECT_EQ(h.slot_gpu_uuid, "");
}

TEST(Probe, PathsThatAreNotRegularFiles) {
  TempDir dir;
  write_file(dir.path + "/target", std::string(8192, '\0'));
  ASSERT_EQ(::symlink((dir.path + "/target").c_str(), dir.file("link").c_str()), 0);
  ASSERT_EQ(::mkfifo(dir.file("fifo").c_str(), 0600), 0);
  ASSERT_EQ(::mkdir(dir.file("dir").c_str(), 0700), 0);
  struct Want {
    const char* name;
    const char* type;
    const char* phrase;
  };
  for (const Want& w : {Want{"link", "symlink", "symbolic link"}, Want{"fifo", "fifo", "a FIFO"},
                        Want{"dir", "directory", "a directory"}}) {
    const P::Region r = probe_in(dir, w.name);  // a FIFO must not block
    EXPECT_EQ(r.state, P::State::kForeign) << w.name;
    EXPECT_EQ(r.file_type, w.type) << w.name;
    EXPECT_TRUE(has(r.reason, w.phrase)) << w.name << ": " << r.reason;
    EXPECT_FALSE(r.have_fixed) << w.name;
  }
  const P::FileCheck link = P::check_file(dir.file("link"));
  EXPECT_EQ(link.error, ELOOP);
  EXPECT_FALSE(link.regular);
  const P::FileCheck fifo = P::check_file(dir.file("fifo"));
  EXPECT_EQ(fifo.error, 0);
  EXPECT_FALSE(fifo.regular);
  EXPECT_EQ(fifo.file_type, "fifo");
  const P::FileCheck missing = P::check_file(dir.file("nothing"));
  EXPECT_EQ(missing.error, ENOENT);
}

TEST(Probe, BadNameAndUntrustedMode) {
  TempDir dir;
  write_file(dir.file("bad name"), std::string(8192, '\0'));
  const P::Region bad = probe_in(dir, "bad name");
  EXPECT_EQ(bad.state, P::State::kForeign);
  EXPECT_FALSE(bad.valid_name);
  EXPECT_TRUE(has(bad.reason, "not a valid region name")) << bad.reason;

  Producer p = Producer::create("src", small_opts());
  copy_region(dir, "src", "world");
  ASSERT_EQ(::chmod(dir.file("world").c_str(), 0666), 0);
  const P::Region world = probe_in(dir, "world");
  EXPECT_EQ(world.state, P::State::kUntrustedOwner);
  EXPECT_FALSE(world.owner.trusted);
  EXPECT_TRUE(has(world.reason, "its contents are not read")) << world.reason;
  EXPECT_FALSE(world.have_fixed);
  const P::FileCheck c = P::check_file(dir.file("world"));
  EXPECT_TRUE(c.regular);
  EXPECT_FALSE(c.owner.trusted);
  const P::FileCheck live = P::check_file(dir.file("src"));
  EXPECT_TRUE(live.regular);
  EXPECT_EQ(live.any_lock, P::Alive::kYes);
  EXPECT_TRUE(live.owner.trusted);
}

TEST(Probe, ScanDirListsEveryEntry) {
  TempDir dir;
  Producer p = Producer::create("b", small_opts());
  write_file(dir.file("a"), "");
  ASSERT_EQ(::mkfifo(dir.file("c").c_str(), 0600), 0);
  write_file(dir.path + "/unrelated", "");
  EXPECT_EQ(P::scan_dir(dir.path), (std::vector<std::string>{"a", "b", "c"}));
  try {
    P::scan_dir(dir.path + "/none");
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kNotFound);
  }
  EXPECT_EQ(P::region_file(dir.path, "x"), dir.path + "/shmcast.x");
  EXPECT_EQ(P::resolve_dir(dir.path + "//"), dir.path);
  EXPECT_EQ(P::resolve_dir(""), region_dir());
}

// ---------------------------------------------------------------- hostile manifests

// Each edit of the current sync's manifest (re-hashed, so the probe sees a
// manifest the producer vouched for) and the reason the probe must give.
TEST(Probe, HostileManifestFields) {
  TempDir dir;
  Producer p = Producer::create("m", small_opts());
  ASSERT_EQ(send_three(p), 1u);
  const std::string path = dir.file("m");
  const std::string good = [&] {
    std::string m;
    rewrite_manifest(path, [&](std::string& b) { m = b; });
    return m;
  }();
  struct Case {
    const char* what;
    std::function<void(std::string&)> edit;
    const char* reason;
  };
  const std::vector<Case> cases = {
      {"magic", [](std::string& m) { mhead(m)->magic ^= 1; }, "bad manifest magic"},
      {"format", [](std::string& m) { mhead(m)->format = 99; }, "unknown manifest format 99"},
      {"entry size", [](std::string& m) { mhead(m)->entry_bytes = 95; }, "bad manifest entry size"},
      {"version", [](std::string& m) { mhead(m)->sync_version = 7; }, "manifest is for another sync version"},
      {"stream", [](std::string& m) { mhead(m)->stream_bytes += 256; }, "stream size disagrees with the sync record"},
      {"world", [](std::string& m) { mhead(m)->world_size = 0; }, "bad world size"},
      {"count", [](std::string& m) { mhead(m)->tensor_count = 1000000; }, "tensor count exceeds the manifest"},
      // The consumer's limits (decode_manifest's rules, which the probe shares).
      {"pieces", [](std::string& m) { mhead(m)->piece_count = (1u << 20) + 1; }, "more than 1048576 pieces"},
      {"names at", [](std::string& m) { mhead(m)->names_offset += 8; }, "names blob is not where the pieces end"},
      {"names len", [](std::string& m) { mhead(m)->names_bytes += 4096; }, "names blob runs past the manifest"},
      {"name len", [](std::string& m) { mentry(m, 1)->name_bytes = 0; }, "tensor 1: bad name length"},
      {"name far", [](std::string& m) { mentry(m, 2)->name_offset = 1u << 30; }, "tensor 2: name runs past the names blob"},
      {"ndim", [](std::string& m) { mentry(m, 0)->ndim = 9; }, "tensor 0: more than 8 dimensions"},
      {"dtype", [](std::string& m) { mentry(m, 1)->dtype = 999; }, "tensor 1: unknown dtype or bad shape"},
      {"shape", [](std::string& m) { mentry(m, 0)->shape[0] = -4; }, "tensor 0: unknown dtype or bad shape"},
      {"nbytes", [](std::string& m) { mentry(m, 2)->nbytes += 1; }, "tensor 2: byte size disagrees with dtype and shape"},
      {"rank bytes", [](std::string& m) { mranks(m)[0] += 256; }, "sub-streams do not add up to the stream size"},
      {"huge rank", [](std::string& m) { mranks(m)[0] = ~0ull; }, "sub-stream"},
      {"piece tensor", [](std::string& m) { mpiece(m, 0)->tensor = 3; }, "piece 0: bad tensor index"},
      {"piece rank", [](std::string& m) { mpiece(m, 1)->rank = 1; }, "piece 1: bad rank"},
      {"piece align", [](std::string& m) { mpiece(m, 1)->offset += 1; }, "piece 1: misaligned offset"},
      {"piece overlap", [](std::string& m) { mpiece(m, 2)->offset = 0; }, "piece 2: overlaps the previous piece"},
      {"piece past", [](std::string& m) { mpiece(m, 2)->nbytes = 1ull << 40; }, "piece 2: runs past its rank's sub-stream"},
      {"payload", [](std::string& m) { mhead(m)->payload_bytes += 1; }, "payload size disagrees with the pieces"},
      // Each piece against its tensor (piece_size_problem, decode_manifest's rules).
      {"piece range", [](std::string& m) { mpiece(m, 0)->length = 4; }, "piece 0: a whole piece with a range"},
      {"piece size",
       [](std::string& m) {
         mpiece(m, 2)->nbytes -= 1;
         mhead(m)->payload_bytes -= 1;
       },
       "piece 2: whole piece size disagrees with its tensor"},
      {"piece dim", [](std::string& m) { mpiece(m, 0)->dim = 2; }, "piece 0: shard dim is not a dimension of its tensor"},
      {"shard range",
       [](std::string& m) {
         mpiece(m, 0)->dim = 0;
         mpiece(m, 0)->start = 2;
         mpiece(m, 0)->length = 3;
       },
       "piece 0: shard range lies outside its tensor"},
      {"shard size",
       [](std::string& m) {
         mpiece(m, 0)->dim = 0;
         mpiece(m, 0)->length = 2;
       },
       "piece 0: shard size disagrees with its range"},
      {"half a tensor",  // each piece its range's size, but the tensor half covered
       [](std::string& m) {
         mpiece(m, 0)->dim = 0;
         mpiece(m, 0)->length = 2;
         mpiece(m, 0)->nbytes = 64;
         mhead(m)->payload_bytes -= 64;
       },
       "payload size disagrees with the tensors"},
      {"delta here", [](std::string& m) { mpiece(m, 1)->base_version = 1; }, "piece 1: a delta against a version not"},
      {"name nul",
       [](std::string& m) { m[mhead(m)->names_offset + mentry(m, 0)->name_offset] = '\0'; },
       "tensor 0: tensor name contains a NUL byte"},
      {"name utf8",
       [](std::string& m) { m[mhead(m)->names_offset + mentry(m, 2)->name_offset] = '\xff'; },
       "tensor 2: tensor name is not valid UTF-8"},
  };
  for (const Case& c : cases) {
    rewrite_manifest(path, [&](std::string& m) {
      m = good;
      c.edit(m);
    });
    const P::Region r = probe_in(dir, "m");
    EXPECT_EQ(r.state, P::State::kReady) << c.what;
    EXPECT_EQ(r.manifest.status, P::ManifestStatus::kInvalid) << c.what << ": " << r.manifest.reason;
    EXPECT_TRUE(has(r.manifest.reason, c.reason)) << c.what << ": " << r.manifest.reason;
    EXPECT_TRUE(r.manifest.tensors.empty()) << c.what;
  }
  // A kept name is checked, one past the limit is not read at all.
  rewrite_manifest(path, [&](std::string& m) {
    m = good;
    m[mhead(m)->names_offset + mentry(m, 2)->name_offset] = '\0';
  });
  EXPECT_EQ(probe_in(dir, "m", true, 2).manifest.status, P::ManifestStatus::kOk);
  EXPECT_EQ(probe_in(dir, "m", true, 3).manifest.status, P::ManifestStatus::kInvalid);
  // Bytes that do not match the record's hash: the producer may be writing
  // the next manifest.
  rewrite_manifest(path, [&](std::string& m) { m = good; });
  rewrite_manifest(path, [](std::string& m) { mentry(m, 0)->dtype = 999; }, /*rehash=*/false);
  const P::Region changing = probe_in(dir, "m");
  EXPECT_EQ(changing.manifest.status, P::ManifestStatus::kChanging);
  EXPECT_TRUE(has(changing.manifest.reason, "hash")) << changing.manifest.reason;
  // Restored, it decodes again.
  rewrite_manifest(path, [&](std::string& m) { m = good; });
  EXPECT_EQ(probe_in(dir, "m").manifest.status, P::ManifestStatus::kOk);
}

// A manifest of more entries than one read window (4096): the index in a
// reason counts from the first entry, and the kept entries span windows.
TEST(Probe, LargeManifestAcrossWindows) {
  TempDir dir;
  ProducerOptions o = small_opts();
  o.manifest_bytes = 2ull << 20;
  Producer p = Producer::create("many", o);
  constexpr int kCount = 9000;
  std::vector<TensorSpec> specs;
  for (int i = 0; i < kCount; ++i) specs.push_back({"t." + std::to_string(i), DType::kU8, {16}});
  std::vector<std::byte> data(16);
  std::vector<const void*> ptrs(kCount, data.data());
  ASSERT_EQ(p.send(specs, ptrs), 1u);
  const P::Region all = probe_in(dir, "many");
  ASSERT_EQ(all.manifest.status, P::ManifestStatus::kOk) << all.manifest.reason;
  ASSERT_EQ(all.manifest.tensors.size(), static_cast<std::size_t>(kCount));
  EXPECT_EQ(all.manifest.tensors[4096].name, "t.4096");
  EXPECT_EQ(all.manifest.tensors[8999].name, "t.8999");
  const P::Region few = probe_in(dir, "many", true, 5000);
  ASSERT_EQ(few.manifest.status, P::ManifestStatus::kOk) << few.manifest.reason;
  ASSERT_EQ(few.manifest.tensors.size(), 5000u);
  EXPECT_EQ(few.manifest.tensors[4999].name, "t.4999");
  EXPECT_EQ(few.manifest.tensor_count, static_cast<std::uint64_t>(kCount));
  // A piece of a tensor far past the limit is checked against its entry,
  // read again from its block.
  rewrite_manifest(dir.file("many"), [](std::string& m) { mpiece(m, 8500)->length = 16; });
  const P::Region range = probe_in(dir, "many", true, 10);
  EXPECT_EQ(range.manifest.status, P::ManifestStatus::kInvalid);
  EXPECT_TRUE(has(range.manifest.reason, "piece 8500: a whole piece with a range")) << range.manifest.reason;
  rewrite_manifest(dir.file("many"), [](std::string& m) {
    mpiece(m, 8500)->length = 0;
    mpiece(m, 8999)->nbytes = 8;
    mhead(m)->payload_bytes -= 8;
  });
  const P::Region size = probe_in(dir, "many", true, 10);
  EXPECT_EQ(size.manifest.status, P::ManifestStatus::kInvalid);
  EXPECT_TRUE(has(size.manifest.reason, "piece 8999: whole piece size disagrees")) << size.manifest.reason;
  rewrite_manifest(dir.file("many"), [](std::string& m) {
    mpiece(m, 8999)->nbytes = 16;
    mhead(m)->payload_bytes += 8;
  });
  ASSERT_EQ(probe_in(dir, "many", true, 10).manifest.status, P::ManifestStatus::kOk);
  rewrite_manifest(dir.file("many"), [](std::string& m) { mentry(m, 8500)->ndim = 9; });
  const P::Region bad = probe_in(dir, "many", true, 10);
  EXPECT_EQ(bad.manifest.status, P::ManifestStatus::kInvalid);
  EXPECT_TRUE(has(bad.manifest.reason, "tensor 8500: more than 8 dimensions")) << bad.manifest.reason;
}

// ---------------------------------------------------------------- delta syncs

namespace {

// bf16 bits: the tensor "w" {256, 512} and "n" f32 {1000}, with a consumer
// that reads each version into the same buffers (so the producer's next
// sync may be a delta).
struct DeltaRig {
  std::vector<TensorSpec> specs{{"w", DType::kBF16, {256, 512}}, {"n", DType::kF32, {1000}}};
  std::vector<std::vector<std::uint8_t>> src, dst;
  Producer producer;
  Consumer consumer;

  explicit DeltaRig(const std::string& name) : producer(Producer::create(name, options())), consumer(open(name)) {
    for (std::size_t i = 0; i < specs.size(); ++i) {
      src.emplace_back(specs[i].nbytes());
      shmcast_test::fill_pattern(src.back().data(), src.back().size(), 0xde17a + i);
      dst.emplace_back(specs[i].nbytes());
    }
  }
  static ProducerOptions options() {
    ProducerOptions o = small_opts();
    o.delta = true;
    o.engine = CopyEngine::kHost;
    return o;
  }
  static Consumer open(const std::string& name) {
    ConsumerOptions co;
    co.pin = Pin::kNo;
    co.open_timeout = 10s;
    return Consumer::open(name, co);
  }
  std::uint64_t logical() const { return specs[0].nbytes() + specs[1].nbytes(); }
  // Changes `count` elements of "w" (then sends).
  void change(int count, std::uint64_t seed) {
    for (int k = 0; k < count; ++k) src[0][2 * ((seed * 7919 + k * 4099) % (256 * 512))] ^= 0x5a;
  }
  // Sends the sources; the consumer reads them and must get them bit-exact.
  std::uint64_t sync() {
    std::vector<const void*> ptrs{src[0].data(), src[1].data()};
    const std::uint64_t v = producer.send(specs, ptrs);
    consumer.wait_sync(10s);
    std::vector<void*> out{dst[0].data(), dst[1].data()};
    consumer.read_into(out);
    EXPECT_EQ(dst, src) << "version " << v;
    return v;
  }
};

}  // namespace

// A region with delta syncs: the probe says so, and gives the kind, base
// version and sizes of the sync in the record (the first full, the next
// ones deltas of a few changed bf16 elements), with every delta piece
// checked against its tensor, kept or not.
TEST(Probe, DeltaSyncsKindBaseAndSizes) {
  TempDir dir;
  DeltaRig rig("delta");
  ASSERT_EQ(rig.sync(), 1u);
  const P::Region full = probe_in(dir, "delta");
  ASSERT_TRUE(full.header_valid);
  EXPECT_TRUE(full.fixed.delta);
  EXPECT_FALSE(full.fixed.store);
  const P::Manifest& fm = full.manifest;
  ASSERT_EQ(fm.status, P::ManifestStatus::kOk) << fm.reason;
  EXPECT_FALSE(fm.delta());
  EXPECT_EQ(fm.base_version, 0u);
  EXPECT_EQ(fm.logical_bytes, rig.logical());
  EXPECT_EQ(fm.payload_bytes, rig.logical());

  rig.change(12, 2);
  ASSERT_EQ(rig.sync(), 2u);
  const SyncReport sent = rig.producer.last_sync();
  ASSERT_TRUE(sent.delta);
  for (std::size_t limit : {0, 1}) {  // limit 1: "n"'s piece is checked against its entry read again
    const P::Region r = probe_in(dir, "delta", true, limit);
    const P::Manifest& m = r.manifest;
    ASSERT_EQ(m.status, P::ManifestStatus::kOk) << m.reason;
    EXPECT_EQ(m.version, 2u);
    EXPECT_TRUE(m.delta());
    EXPECT_EQ(m.base_version, 1u);
    EXPECT_EQ(m.logical_bytes, rig.logical());
    EXPECT_EQ(m.logical_bytes, sent.logical_bytes);
    EXPECT_EQ(m.payload_bytes, sent.payload_bytes);
    EXPECT_LT(m.payload_bytes * 10, m.logical_bytes);  // 12 changed elements of 128 Ki
    ASSERT_EQ(m.tensors.size(), limit == 0 ? 2u : 1u);
    const ShardInfo& w = m.tensors[0].shards.at(0);
    EXPECT_EQ(w.nbytes, rig.specs[0].nbytes());
    EXPECT_EQ(w.base_version, 1u);
    EXPECT_GT(w.wire_bytes, 0u);
    EXPECT_LT(w.wire_bytes, w.nbytes);
  }

  // A third version: a delta against the second.
  rig.change(3, 3);
  ASSERT_EQ(rig.sync(), 3u);
  const P::Region third = probe_in(dir, "delta");
  ASSERT_EQ(third.manifest.status, P::ManifestStatus::kOk) << third.manifest.reason;
  EXPECT_EQ(third.manifest.base_version, 2u);

  // Hostile delta pieces: reported as the manifest's problem, for kept
  // tensors and for the ones past the limit alike.
  const std::string path = dir.file("delta");
  const std::string good = [&] {
    std::string m;
    rewrite_manifest(path, [&](std::string& b) { m = b; });
    return m;
  }();
  {
    std::string m = good;  // every piece of the sync is a delta against version 2, "n"'s (unchanged) too
    ASSERT_EQ(mhead(m)->piece_count, 2u);
    ASSERT_EQ(mpiece(m, 0)->base_version, 2u);
    ASSERT_EQ(mpiece(m, 1)->base_version, 2u);
  }
  struct Case {
    const char* what;
    std::function<void(std::string&)> edit;
    const char* reason;
  };
  // A blob shorter than its header and table; the header's payload follows,
  // so only the piece rule can see it.
  auto blob = [](std::size_t k, std::uint64_t nbytes) {
    return [k, nbytes](std::string& m) {
      mhead(m)->payload_bytes = mhead(m)->payload_bytes - mpiece(m, k)->nbytes + nbytes;
      mpiece(m, k)->nbytes = nbytes;
    };
  };
  const std::vector<Case> cases = {
      {"tiny blob", blob(0, 8), "piece 0: a delta blob of impossible size for its piece"},
      {"tiny blob past the limit", blob(1, 8), "piece 1: a delta blob of impossible size for its piece"},
      {"base ahead", [](std::string& m) { mpiece(m, 0)->base_version = 3; }, "piece 0: a delta against a version not before"},
      {"two bases", [](std::string& m) { mpiece(m, 1)->base_version = 1; }, "piece 1: delta pieces against different versions"},
      {"whole with range", [](std::string& m) { mpiece(m, 1)->length = 7; }, "piece 1: a whole piece with a range"},
  };
  for (const Case& c : cases) {
    rewrite_manifest(path, [&](std::string& m) {
      m = good;
      c.edit(m);
    });
    for (std::size_t limit : {0, 1}) {
      const P::Region r = probe_in(dir, "delta", true, limit);
      EXPECT_EQ(r.state, P::State::kReady) << c.what;
      EXPECT_EQ(r.manifest.status, P::ManifestStatus::kInvalid) << c.what << ": " << r.manifest.reason;
      EXPECT_TRUE(has(r.manifest.reason, c.reason)) << c.what << ", limit " << limit << ": " << r.manifest.reason;
    }
  }
  rewrite_manifest(path, [&](std::string& m) { m = good; });
  ASSERT_EQ(probe_in(dir, "delta").manifest.status, P::ManifestStatus::kOk);
  // Delta pieces in a region created without deltas, as consumers refuse them.
  copy_region(dir, "delta", "nodelta", [](std::string& b) { fixed_of(b)->features &= ~detail::kFeatureDelta; });
  const P::Region plain = probe_in(dir, "nodelta");
  EXPECT_FALSE(plain.fixed.delta);
  EXPECT_EQ(plain.manifest.status, P::ManifestStatus::kInvalid);
  EXPECT_TRUE(has(plain.manifest.reason, "piece 0: a delta piece in a region created without deltas"))
      << plain.manifest.reason;
}

// ---------------------------------------------------------------- SIGBUS guard and names

TEST(Probe, GuardedCopySurvivesATruncatedMapping) {
  TempDir dir;
  P::install_bus_guard();
  const std::string path = dir.path + "/map";
  write_file(path, std::string(2 * 4096, 'a'));
  const int fd = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  void* m = ::mmap(nullptr, 2 * 4096, PROT_READ, MAP_SHARED, fd, 0);
  ASSERT_NE(m, MAP_FAILED);
  char out[4096];
  EXPECT_TRUE(P::guarded_copy(out, static_cast<char*>(m) + 4096, sizeof out));
  EXPECT_EQ(out[0], 'a');
  ASSERT_EQ(::ftruncate(fd, 4096), 0);
  EXPECT_FALSE(P::guarded_copy(out, static_cast<char*>(m) + 4096, sizeof out));
  EXPECT_TRUE(P::guarded_copy(out, m, sizeof out));  // the guard is re-armed after a fault
  ::munmap(m, 2 * 4096);
  ::close(fd);
}

TEST(Probe, NamesOfStatesAndBytes) {
  EXPECT_STREQ(P::state_name(P::State::kUntrustedOwner), "untrusted-owner");
  EXPECT_STREQ(P::state_name(P::State::kNewerVersion), "newer-version");
  EXPECT_STREQ(P::state_name(static_cast<P::State>(200)), "unknown");
  EXPECT_STREQ(P::state_name(P::InitState::kInvalid), "invalid");
  EXPECT_STREQ(P::state_name(P::SyncStatus::kPublished), "published");
  EXPECT_STREQ(P::state_name(P::SeatState::kEvicted), "evicted");
  EXPECT_STREQ(P::state_name(P::SlotState::kHeld), "held");
  EXPECT_STREQ(P::state_name(P::ManifestStatus::kSkipped), "skipped");
  EXPECT_EQ(P::human_bytes(64ull << 20), "64 MiB");
  EXPECT_EQ(P::layout_version(), detail::kLayoutVersion);
}
