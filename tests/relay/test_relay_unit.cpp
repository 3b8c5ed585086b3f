// What the relay needs from the core library (begin_sync with a version,
// write_part, Consumer::slot_bytes) and the relay's own pieces: the wire
// format, the key handshake's MACs, addresses and key loading, and what
// guards it against peers (admission, rate-limited logging, connection ids,
// data tags, limits on what a peer announces, control-channel framing, UCX's
// devices). One process; producer and consumer run in two threads.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

#include <ucp/api/ucp.h>

#include "admission.hpp"
#include "auth.hpp"
#include "ctrl.hpp"
#include "ratelog.hpp"
#include "shmcast/relay.hpp"
#include "ucx.hpp"
#include "support.hpp"
#include "wire.hpp"

using namespace shmcast;
using namespace shmcast_test;
using namespace std::chrono_literals;

namespace {

ProducerOptions small_options() {
  ProducerOptions o;
  o.slot_bytes = 2 << 20;
  o.slots = 2;
  o.pin = Pin::kNo;
  o.engine = CopyEngine::kHost;
  o.consumer_timeout = 20s;
  return o;
}

ConsumerOptions consumer_options() {
  ConsumerOptions o;
  o.pin = Pin::kNo;
  o.open_timeout = 10s;
  o.chunk_timeout = 20s;
  return o;
}

// Reads one sync in a thread; the result once joined.
struct Reader {
  std::thread t;
  std::uint64_t version = 0;
  std::vector<std::vector<std::uint8_t>> got;
  std::string error;
  std::atomic<bool> has_manifest{false};
  Reader(Consumer& c) {
    t = std::thread([this, &c] {
      try {
        const SyncInfo& s = c.wait_sync(20s);
        version = s.version;
        has_manifest = true;
        got.resize(s.tensors.size());
        std::vector<void*> dst;
        for (std::size_t i = 0; i < s.tensors.size(); ++i) {
          got[i].resize(s.tensors[i].nbytes);
          dst.push_back(got[i].data());
        }
        c.read_into(dst);
      } catch (const Error& e) {
        error = std::string(errc_name(e.code())) + ": " + e.what();
      }
    });
  }
  void join() { t.join(); }
  // Waits until wait_sync() returned (so an abort now reaches read_into).
  bool wait_manifest() {
    const auto end = std::chrono::steady_clock::now() + 20s;
    while (!has_manifest && std::chrono::steady_clock::now() < end) std::this_thread::sleep_for(1ms);
    return has_manifest;
  }
};

}  // namespace

TEST(RelayCore, BeginSyncTakesTheUpstreamVersion) {
  const std::string name = unique_name("ver");
  RegionGuard guard{name};
  Producer p = Producer::create(name, small_options());
  Consumer c = Consumer::open(name, consumer_options());
  EXPECT_EQ(c.slot_bytes(), p.slot_bytes());
  PatternSync s5(2, 1000, 57);
  {
    Reader r(c);
    EXPECT_EQ(p.begin_sync(s5.specs, 57), 57u);
    for (std::size_t i = 0; i < s5.specs.size(); ++i) p.write(i, s5.ptrs[i]);
    p.end_sync();
    r.join();
    EXPECT_EQ(r.error, "");
    EXPECT_EQ(r.version, 57u);
    EXPECT_TRUE(check_pattern(r.got, 57));
  }
  EXPECT_EQ(p.last_version(), 57u);
  // Not above the last: refused, nothing begun.
  try {
    p.begin_sync(s5.specs, 57);
    FAIL() << "version 57 twice was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kInvalidArgument);
  }
  EXPECT_THROW(p.begin_sync(s5.specs, 3), Error);
  // 0 (the default): last + 1.
  PatternSync s58(1, 10, 58);
  Reader r(c);
  EXPECT_EQ(p.begin_sync(s58.specs), 58u);
  p.write(0, s58.ptrs[0]);
  p.end_sync();
  r.join();
  EXPECT_EQ(r.version, 58u);
  EXPECT_TRUE(check_pattern(r.got, 58));
}

TEST(RelayCore, WritePartFillsTensorsPieceByPiece) {
  const std::string name = unique_name("part");
  RegionGuard guard{name};
  Producer p = Producer::create(name, small_options());
  Consumer c = Consumer::open(name, consumer_options());
  // empty, 5 slots (split over chunks), small, empty
  const std::uint64_t big = 5 * (2ull << 20) + 12345;
  std::vector<TensorSpec> specs = {{"e0", DType::kU8, {0}},
                                   {"big", DType::kU8, {static_cast<std::int64_t>(big)}},
                                   {"small", DType::kU8, {777}},
                                   {"e1", DType::kF32, {0, 3}}};
  std::vector<std::vector<std::uint8_t>> data(specs.size());
  for (std::size_t i = 0; i < specs.size(); ++i) {
    data[i].resize(specs[i].nbytes());
    fill_pattern(data[i].data(), data[i].size(), seed_of(9, i));
  }
  Reader r(c);
  p.begin_sync(specs, 9);
  p.write_part(0, 0, nullptr, 0);
  // Odd pieces that cross slot boundaries, and an empty one.
  const std::uint64_t cuts[] = {0, 1, 3000001, 3000001, 4194304, 9999999, big};
  for (std::size_t k = 0; k + 1 < std::size(cuts); ++k)
    p.write_part(1, cuts[k], data[1].data() + cuts[k], cuts[k + 1] - cuts[k]);
  p.write(2, data[2].data());  // whole writes and parts mix
  p.write_part(3, 0, nullptr, 0);
  p.end_sync();
  r.join();
  ASSERT_EQ(r.error, "");
  EXPECT_TRUE(check_pattern(r.got, 9));
}

TEST(RelayCore, WritePartRefusesGapsAndAbortsTheSync) {
  const std::string name = unique_name("gap");
  RegionGuard guard{name};
  Producer p = Producer::create(name, small_options());
  Consumer c = Consumer::open(name, consumer_options());
  std::vector<TensorSpec> specs = {{"a", DType::kU8, {1000}}};
  std::vector<std::uint8_t> a(1000, 1);
  Reader r(c);
  p.begin_sync(specs, 4);
  p.write_part(0, 0, a.data(), 100);
  ASSERT_TRUE(r.wait_manifest());
  EXPECT_THROW(p.write_part(0, 200, a.data() + 200, 100), Error);  // a gap: the sync is aborted
  r.join();
  EXPECT_NE(r.error.find("Aborted"), std::string::npos) << r.error;
  // A fresh sync works; a whole write after a part of the same tensor does not.
  Reader r2(c);
  p.begin_sync(specs, 5);
  p.write_part(0, 0, a.data(), 10);
  ASSERT_TRUE(r2.wait_manifest());
  EXPECT_THROW(p.write(0, a.data()), Error);
  r2.join();
  EXPECT_NE(r2.error.find("Aborted"), std::string::npos) << r2.error;
}

TEST(RelayWire, SyncPlanRoundTripsAndIsChecked) {
  const relay::wire::SyncPlan p = relay::wire::plan_for(random_manifest(5, 2 << 20, 20), 12, 2 << 20, 256 << 10);
  const SyncLayout l = stream_layout(p.specs, p.chunk_bytes);
  relay::wire::Writer w(relay::wire::Type::kSync);
  relay::wire::encode_sync(w, p);
  std::vector<std::uint8_t> bytes = w.buffer();
  relay::wire::Reader r(bytes, false);
  const relay::wire::SyncPlan q = relay::wire::decode_sync(r);
  EXPECT_EQ(q.version, 12u);
  EXPECT_EQ(q.offsets, p.offsets);
  EXPECT_EQ(q.data_chunks, p.data_chunks);
  ASSERT_EQ(q.specs.size(), p.specs.size());
  for (std::size_t i = 0; i < q.specs.size(); ++i) {
    EXPECT_EQ(q.specs[i].name, p.specs[i].name);
    EXPECT_EQ(q.specs[i].shape, p.specs[i].shape);
  }
  // Every chunk that carries a tensor byte is listed, and only those.
  for (std::uint32_t c = 0; c < l.chunks; ++c) {
    bool used = false;
    for (std::size_t i = 0; i < p.specs.size(); ++i)
      used |= p.nbytes[i] > 0 && p.offsets[i] < (c + 1ull) * p.chunk_bytes &&
              p.offsets[i] + p.nbytes[i] > c * p.chunk_bytes;
    EXPECT_EQ(used, std::count(q.data_chunks.begin(), q.data_chunks.end(), c) == 1) << c;
  }
  // Fragments: 8 per full chunk, the last chunk's last one shorter, every
  // fragment of the sync a tag of its own, ordinals counted per position.
  EXPECT_EQ(q.frag_bytes, p.frag_bytes);
  ASSERT_EQ(q.frag_base.size(), q.data_chunks.size() + 1);
  std::set<std::uint32_t> tags;
  std::uint64_t covered = 0;
  for (std::size_t k = 0; k < q.data_chunks.size(); ++k) {
    const std::uint32_t c = q.data_chunks[k];
    EXPECT_EQ(q.frag_base[k + 1] - q.frag_base[k], q.frags(c));
    std::uint64_t len = 0;
    for (std::uint32_t j = 0; j < q.frags(c); ++j) {
      EXPECT_GT(q.frag_len(c, j), 0u);
      EXPECT_LE(q.frag_len(c, j), q.frag_bytes);
      len += q.frag_len(c, j);
      EXPECT_TRUE(tags.insert(q.frag_tag(c, j)).second) << c << "/" << j;
    }
    EXPECT_EQ(len, q.chunk_len(c));
    covered += len;
    if (q.chunk_len(c) == q.chunk_bytes) {
      EXPECT_EQ(q.frags(c), 8u);
    }
  }
  EXPECT_EQ(tags.size(), q.total_frags());
  EXPECT_GT(covered, 0u);
  // Fragment sizes that are not a power of two from 64 KiB to 2 MiB: refused.
  for (std::uint64_t f : {0ull, 4096ull, 3ull << 18, 4ull << 20}) {
    relay::wire::SyncPlan odd = p;
    odd.frag_bytes = f;
    relay::wire::Writer wf(relay::wire::Type::kSync);
    relay::wire::encode_sync(wf, odd);
    relay::wire::Reader rf(wf.buffer(), false);
    EXPECT_THROW(relay::wire::decode_sync(rf), relay::wire::ProtocolError) << f;
  }
  // A layout that is not shmcast's packing, a truncated message: refused.
  relay::wire::SyncPlan bad = p;
  bad.offsets.back() += 256;
  relay::wire::Writer w2(relay::wire::Type::kSync);
  relay::wire::encode_sync(w2, bad);
  relay::wire::Reader r2(w2.buffer(), false);
  EXPECT_THROW(relay::wire::decode_sync(r2), relay::wire::ProtocolError);
  bytes.resize(bytes.size() - 3);
  relay::wire::Reader r3(bytes, false);
  EXPECT_THROW(relay::wire::decode_sync(r3), relay::wire::ProtocolError);
}

// A delta sync's plan: its pieces (blobs and tensors sent whole) packed as
// raw tensors of their sizes, its base version, its flags; what a peer may
// not announce is refused.
TEST(RelayWire, DeltaSyncPlanRoundTripsAndIsChecked) {
  std::vector<TensorSpec> specs = {{"a", DType::kBF16, {4096, 3}}, {"b", DType::kC128, {10}}, {"c", DType::kF32, {7}}};
  relay::wire::SyncPlan p;
  p.version = 9;
  p.base_version = 8;
  p.chunk_bytes = 2 << 20;
  p.frag_bytes = 256 << 10;
  p.specs = specs;
  p.nbytes = {5000, 160, 96};  // blob, the c128's bytes, blob
  p.is_delta = {1, 0, 1};
  std::vector<TensorSpec> packed;
  for (std::uint64_t n : p.nbytes) packed.push_back({"piece", DType::kRaw, {static_cast<std::int64_t>(n)}});
  const SyncLayout l = stream_layout(packed, p.chunk_bytes);
  p.offsets = l.offsets;
  p.stream_bytes = l.stream_bytes;
  p.payload_bytes = 4096 * 3 * 2 + 160 + 28;  // logical
  p.index_chunks();
  auto round = [](const relay::wire::SyncPlan& x) {
    relay::wire::Writer w(relay::wire::Type::kSync);
    relay::wire::encode_sync(w, x);
    relay::wire::Reader r(w.buffer(), false);
    return relay::wire::decode_sync(r);
  };
  const relay::wire::SyncPlan q = round(p);
  EXPECT_EQ(q.base_version, 8u);
  EXPECT_EQ(q.is_delta, p.is_delta);
  EXPECT_EQ(q.nbytes, p.nbytes);
  EXPECT_EQ(q.offsets, p.offsets);
  EXPECT_TRUE(q.delta());
  auto refused = [&](const relay::wire::SyncPlan& x) {
    EXPECT_THROW(round(x), relay::wire::ProtocolError);
  };
  relay::wire::SyncPlan b = p;
  b.base_version = 9;  // not below the version
  refused(b);
  b = p;
  b.is_delta[0] = 2;  // a flag other than 0 or 1
  refused(b);
  b = p;
  b.is_delta[1] = 1;  // c128 cannot be a delta piece
  refused(b);
  b = p;
  b.is_delta[2] = 0;  // sent whole, but not its size
  refused(b);
  b = p;
  b.payload_bytes += 1;  // not the tensors' logical size
  refused(b);
  b = p;
  b.offsets[1] += 256;  // not the packing of the pieces
  refused(b);
  b = p;
  b.nbytes[0] = 32;  // smaller than a blob header (and the layout no longer matches)
  refused(b);
}

TEST(RelayAuth, ProofsDependOnKeyNoncesAndSide) {
  relay::auth::Transcript t;
  t.region = "actor-0";
  t.conn = 3;
  t.server_nonce = relay::auth::nonce();
  t.client_nonce = relay::auth::nonce();
  EXPECT_NE(t.server_nonce, t.client_nonce);
  const std::string k1 = "0123456789abcdef-one", k2 = "0123456789abcdef-two";
  const auto c1 = relay::auth::client_proof(k1, t);
  EXPECT_TRUE(relay::auth::equal(c1, relay::auth::client_proof(k1, t)));
  EXPECT_FALSE(relay::auth::equal(c1, relay::auth::client_proof(k2, t)));
  EXPECT_FALSE(relay::auth::equal(c1, relay::auth::server_proof(k1, t)));  // no reflection
  relay::auth::Transcript t2 = t;
  t2.server_nonce[0] ^= 1;
  EXPECT_FALSE(relay::auth::equal(c1, relay::auth::client_proof(k1, t2)));
  t2 = t;
  t2.region = "actor-1";
  EXPECT_FALSE(relay::auth::equal(c1, relay::auth::client_proof(k1, t2)));
  // RFC 4231 test case 2 through the same HMAC (one part is length-prefixed,
  // so compare against OpenSSL directly instead): keys matter, sizes matter.
  const std::uint8_t a[] = {1, 2}, b[] = {3};
  const std::uint8_t ab[] = {1, 2, 3};
  EXPECT_FALSE(relay::auth::equal(relay::auth::hmac(k1, {a, b}), relay::auth::hmac(k1, {ab})));
}

TEST(RelayConfig, AddressesAndKeys) {
  EXPECT_EQ(relay::parse_address("10.0.0.1:7000").host, "10.0.0.1");
  EXPECT_EQ(relay::parse_address("node-3.svc:0").port, 0);
  EXPECT_EQ(relay::parse_address("[::1]:9").host, "::1");
  EXPECT_EQ(relay::parse_address("[::1]:9").str(), "[::1]:9");
  for (const char* bad : {"host", ":7000", "host:", "host:70000", "::1:7", "host:7x"})
    EXPECT_THROW(relay::parse_address(bad), Error) << bad;
  // UCX 1.13's TCP transport overruns a heap buffer on IPv6 connections: a
  // relay given an IPv6 address refuses it there instead of crashing later.
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  relay::RelayOptions ro;
  ro.region = "r";
  ro.from = "[::1]:9";
  ro.key = "0123456789abcdef0123";
  ro.status_path = "-";
  if (major == 1 && minor <= 13) {
    EXPECT_THROW(relay::Relay{ro}, Error);
  }

  const std::string dir = std::filesystem::temp_directory_path() / ("relay-key-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string f = dir + "/key";
  std::ofstream(f) << "a-key-of-more-than-16-bytes\n";
  ::chmod(f.c_str(), 0600);
  EXPECT_EQ(relay::load_key(f), "a-key-of-more-than-16-bytes");
  ::chmod(f.c_str(), 0644);
  try {
    relay::load_key(f);
    FAIL() << "a world-readable key file was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kPermission);
  }
  // Someone else controls it: group-writable, or another owner (issue 27,
  // item 7; a real-process test is in test_relay_attack.cpp).
  ::chmod(f.c_str(), 0660);
  try {
    relay::load_key(f);
    FAIL() << "a group-writable key file was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kPermission);
    EXPECT_NE(std::string(e.what()).find("written by its group"), std::string::npos) << e.what();
  }
  ::chmod(f.c_str(), 0640);
  if (::geteuid() == 0) {
    ASSERT_EQ(::chown(f.c_str(), 65534, 65534), 0);
    try {
      relay::load_key(f);
      FAIL() << "a key file of another uid was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::kPermission);
      EXPECT_NE(std::string(e.what()).find("owned by uid 65534"), std::string::npos) << e.what();
    }
    ASSERT_EQ(::chown(f.c_str(), 0, 0), 0);
    EXPECT_EQ(relay::load_key(f), "a-key-of-more-than-16-bytes");  // root's, 0640: taken
  }
  ::chmod(f.c_str(), 0600);
  std::ofstream(f) << "short";
  EXPECT_THROW(relay::load_key(f), Error);
  ::setenv("SHMCAST_RELAY_KEY", "from-the-environment-0123", 1);
  EXPECT_EQ(relay::load_key(""), "from-the-environment-0123");
  ::unsetenv("SHMCAST_RELAY_KEY");
  EXPECT_THROW(relay::load_key(""), Error);
  std::filesystem::remove_all(dir);
}

// Issue 27, item 3: at most N pending handshakes in total and M per source
// address; a released one makes room again; never more are pending.
TEST(RelayGuard, AdmissionCapsPendingHandshakesInTotalAndPerSource) {
  relay::Admission a(5, 2);
  std::uint64_t ev = 0, id = 0;
  using V = relay::Admission::Verdict;
  EXPECT_EQ(a.admit("10.0.0.1", ++id, 0, &ev), V::kAdmitted);
  EXPECT_EQ(a.admit("10.0.0.1", ++id, 0, &ev), V::kAdmitted);
  EXPECT_EQ(a.admit("10.0.0.1", ++id, 0, &ev), V::kEvicted);  // per source: its own oldest goes
  EXPECT_EQ(ev, 1u);
  EXPECT_EQ(a.pending_from("10.0.0.1"), 2u);
  EXPECT_EQ(a.admit("10.0.0.2", ++id, 0, &ev), V::kAdmitted);
  EXPECT_EQ(a.admit("10.0.0.2", ++id, 0, &ev), V::kAdmitted);
  EXPECT_EQ(a.admit("10.0.0.3", ++id, 0, &ev), V::kAdmitted);
  EXPECT_EQ(a.pending(), 5u);
  a.release(2);
  EXPECT_EQ(a.pending_from("10.0.0.1"), 1u);
  EXPECT_EQ(a.admit("10.0.0.4", ++id, 0, &ev), V::kAdmitted);
  a.release(9999);  // never admitted: ignored
  EXPECT_EQ(a.pending(), 5u);
  EXPECT_EQ(a.evicted(), 1u);
  EXPECT_EQ(a.refused(), 0u);
}

// Review of issue 27, M2: when a cap is full the newcomer is not refused
// (idle connections would keep a keyed peer out): it takes the place of the
// oldest pending connection of its own source when that cap is full, else
// of the oldest of the source that holds the most, so a peer with one
// pending connection is evicted only when every source holds one. Before
// the fix the newcomer was refused (Admission had no eviction).
TEST(RelayGuard, AdmissionEvictsTheOldestIdleConnectionInsteadOfRefusingTheNewcomer) {
  using V = relay::Admission::Verdict;
  relay::Admission a(4, 3);
  std::uint64_t ev = 0;
  ASSERT_EQ(a.admit("10.0.0.9", 1, 0, &ev), V::kAdmitted);  // the keyed peer, first
  ASSERT_EQ(a.admit("10.0.0.1", 2, 0, &ev), V::kAdmitted);
  ASSERT_EQ(a.admit("10.0.0.1", 3, 0, &ev), V::kAdmitted);
  ASSERT_EQ(a.admit("10.0.0.2", 4, 0, &ev), V::kAdmitted);
  // Full in total: the newcomer (another source) takes the place of
  // 10.0.0.1's oldest (it holds the most), not of 1 (older, but alone).
  EXPECT_EQ(a.admit("10.0.0.3", 5, 0, &ev), V::kEvicted);
  EXPECT_EQ(ev, 2u);
  // Now 9, 1, 2, 3 hold one each: the oldest of all goes.
  EXPECT_EQ(a.admit("10.0.0.4", 6, 0, &ev), V::kEvicted);
  EXPECT_EQ(ev, 1u);
  EXPECT_EQ(a.pending(), 4u);
  EXPECT_EQ(a.evicted(), 2u);
  // A flood from one source only ever evicts its own.
  relay::Admission b(10, 2);
  ASSERT_EQ(b.admit("10.0.0.9", 10, 0, &ev), V::kAdmitted);
  for (std::uint64_t id = 11; id < 100; ++id) {
    const V v = b.admit("10.0.0.1", id, 0, &ev);
    EXPECT_NE(v, V::kRefused);
    if (v == V::kEvicted) EXPECT_NE(ev, 10u);
  }
  EXPECT_EQ(b.pending_from("10.0.0.9"), 1u);
  EXPECT_EQ(b.pending_from("10.0.0.1"), 2u);
  // Many sources filling the total cap never evict a lone connection while
  // some source holds two.
  relay::Admission t(8, 4);
  ASSERT_EQ(t.admit("10.0.0.9", 200, 0, &ev), V::kAdmitted);
  for (std::uint64_t id = 201; id < 400; ++id) {
    const V v = t.admit("10.0.1." + std::to_string(id % 3), id, 0, &ev);
    if (v == V::kEvicted) EXPECT_NE(ev, 200u);
  }
  EXPECT_EQ(t.pending_from("10.0.0.9"), 1u);
  // A released (authenticated) connection is never evicted.
  relay::Admission r(1, 1);
  ASSERT_EQ(r.admit("10.0.0.1", 1, 0, &ev), V::kAdmitted);
  r.release(1);
  EXPECT_EQ(r.admit("10.0.0.1", 2, 0, &ev), V::kAdmitted);
}

// Review of issue 27, M2: the per-source cap counts an IPv6 /64 as one
// source (one host holds a whole /64); IPv4 and IPv4-mapped addresses count
// one each. Before the fix each IPv6 address was its own source.
TEST(RelayGuard, AdmissionSourceIsTheIpv4AddressOrTheIpv6Slash64) {
  auto v6 = [](const char* text) {
    sockaddr_storage ss{};
    auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
    a->sin6_family = AF_INET6;
    a->sin6_port = htons(4242);
    EXPECT_EQ(::inet_pton(AF_INET6, text, &a->sin6_addr), 1) << text;
    return ss;
  };
  sockaddr_storage v4{};
  reinterpret_cast<sockaddr_in*>(&v4)->sin_family = AF_INET;
  reinterpret_cast<sockaddr_in*>(&v4)->sin_port = htons(4242);
  ::inet_pton(AF_INET, "192.0.2.7", &reinterpret_cast<sockaddr_in*>(&v4)->sin_addr);
  EXPECT_EQ(relay::source_key(v4), "192.0.2.7");
  EXPECT_EQ(relay::source_key(v6("2001:db8:1:2::1")), "2001:db8:1:2::/64");
  EXPECT_EQ(relay::source_key(v6("2001:db8:1:2:ffff:1:2:3")), "2001:db8:1:2::/64");
  EXPECT_NE(relay::source_key(v6("2001:db8:1:3::1")), "2001:db8:1:2::/64");
  EXPECT_EQ(relay::source_key(v6("::ffff:192.0.2.7")), "192.0.2.7");
}

// Issue 27, item 3: a topic prints `burst` lines per window, then counts;
// the count comes out when the window ends (or at flush(all)).
TEST(RelayGuard, RateLogPrintsABurstThenCountsWhatItLeftOut) {
  std::vector<std::string> out;
  relay::RateLog r([&](const std::string& l) { out.push_back(l); }, 3, 1000);
  for (int i = 0; i < 10; ++i) r.log("accept", "line " + std::to_string(i), 0);
  r.log("reject", "other topic", 0);
  EXPECT_EQ(out.size(), 4u);
  EXPECT_EQ(r.suppressed(), 7u);
  r.flush(500);  // the window has not ended
  EXPECT_EQ(out.size(), 4u);
  r.log("accept", "next window", 1000);
  ASSERT_EQ(out.size(), 6u);
  EXPECT_NE(out[4].find("7 more 'accept' lines left out"), std::string::npos) << out[4];
  EXPECT_EQ(out[5], "next window");
  for (int i = 0; i < 5; ++i) r.log("accept", "x", 1100);
  r.flush(1200, true);
  EXPECT_NE(out.back().find("3 more 'accept' lines left out"), std::string::npos) << out.back();
}

// Issue 27, item 8: connection ids are 64 bits: past 2^24 they go on
// (protocol 2 wrapped them there and reused live ones); an id in use is
// skipped, 0 never given; the proofs bind the whole id.
TEST(RelayGuard, ConnectionIdsNeverWrapNorRepeat) {
  std::uint64_t counter = (1ull << 24) - 2;
  std::set<std::uint64_t> live = {1ull << 24};
  std::vector<std::uint64_t> got;
  for (int i = 0; i < 4; ++i) {
    got.push_back(relay::next_conn_id(&counter, [&](std::uint64_t id) { return live.count(id) != 0; }));
    live.insert(got.back());
  }
  EXPECT_EQ(got, (std::vector<std::uint64_t>{(1ull << 24) - 2, (1ull << 24) - 1, (1ull << 24) + 1, (1ull << 24) + 2}));
  std::uint64_t zero = 0;
  EXPECT_EQ(relay::next_conn_id(&zero, [](std::uint64_t) { return false; }), 1u);
  relay::auth::Transcript t;
  t.region = "r";
  t.conn = 1;
  relay::auth::Transcript t2 = t;
  t2.conn = 1 + (1ull << 24);
  EXPECT_FALSE(relay::auth::equal(relay::auth::client_proof("0123456789abcdef-key", t),
                                  relay::auth::client_proof("0123456789abcdef-key", t2)));
}

// Issue 27, item 8: a fragment's tag carries its connection's sync serial,
// not the version: consecutive syncs never share a tag (whatever their
// versions, 2^24 apart or equal after a trainer restart), data tags are
// told from anything else by their top bit, and the serials start where the
// session key says (a peer without it cannot guess them).
TEST(RelayWire, DataTagsNeverCollideAcrossSyncs) {
  const auto plan_a = relay::wire::plan_for(random_manifest(3, 2 << 20, 8), 5, 2 << 20, 256 << 10);
  const auto plan_b = relay::wire::plan_for(random_manifest(3, 2 << 20, 8), 5 + (1ull << 24), 2 << 20, 256 << 10);
  for (std::uint32_t base : {0u, 12345u, relay::wire::kSerialMask}) {
    std::set<std::uint64_t> tags;
    std::size_t n = 0;
    for (std::uint64_t sync = 1; sync <= 3; ++sync) {
      const std::uint32_t serial = relay::wire::data_serial(base, sync);
      const auto& p = sync == 2 ? plan_b : plan_a;
      for (std::uint32_t c : p.data_chunks)
        for (std::uint32_t j = 0; j < p.frags(c); ++j) {
          const std::uint64_t tag = relay::wire::data_tag(serial, p.frag_tag(c, j));
          EXPECT_NE(tag & relay::wire::kDataBit, 0u);
          tags.insert(tag);
          ++n;
        }
    }
    EXPECT_EQ(tags.size(), n) << "base " << base;  // no tag shared between the three syncs
  }
  const std::string s1 = relay::auth::session_key("0123456789abcdef-key", relay::auth::Transcript{"r", 1, {}, {}});
  relay::auth::Transcript t{"r", 1, {}, {}};
  t.client_nonce[0] = 1;
  const std::string s2 = relay::auth::session_key("0123456789abcdef-key", t);
  EXPECT_NE(relay::auth::data_tag_base(s1), relay::auth::data_tag_base(s2));
  EXPECT_LE(relay::auth::data_tag_base(s1), relay::wire::kSerialMask);
}

// Issue 27, item 8: what an (authenticated) upstream may announce is
// bounded: chunks by a documented maximum (1 GiB) and by what this node
// holds (buffers and region slots against its memory, the region against
// its file system); control messages by the region's manifest room.
TEST(RelayWire, ChunkAndControlSizesAreBounded) {
  relay::wire::ChunkRoom room;
  room.buffers = 4;
  room.region_slots = 4;
  room.memory_bytes = 16ull << 30;
  room.fs_bytes = 8ull << 30;
  EXPECT_EQ(relay::wire::chunk_problem(256ull << 20, room), "");
  EXPECT_NE(relay::wire::chunk_problem(64ull << 30, room).find("maximum"), std::string::npos);
  EXPECT_NE(relay::wire::chunk_problem(3ull << 20, room).find("multiple of 2 MiB"), std::string::npos);
  EXPECT_NE(relay::wire::chunk_problem(0, room), "");
  room.memory_bytes = 4ull << 30;  // 8 x 1 GiB do not fit
  EXPECT_NE(relay::wire::chunk_problem(1ull << 30, room).find("memory"), std::string::npos);
  room.memory_bytes = 64ull << 30;
  room.fs_bytes = 2ull << 30;  // a region of 4 x 1 GiB does not fit
  EXPECT_NE(relay::wire::chunk_problem(1ull << 30, room).find("file system"), std::string::npos);
  room.region_slots = 0;  // --slot-bytes: the region does not follow the chunk
  EXPECT_EQ(relay::wire::chunk_problem(1ull << 30, room), "");
  // A sync message announcing 64 GiB chunks is refused as it is decoded.
  relay::wire::SyncPlan p = relay::wire::plan_for(random_manifest(5, 2 << 20, 4), 1, 2 << 20, 1 << 20);
  p.chunk_bytes = 64ull << 30;
  relay::wire::Writer w(relay::wire::Type::kSync);
  relay::wire::encode_sync(w, p);
  relay::wire::Reader r(w.buffer(), false);
  EXPECT_THROW(relay::wire::decode_sync(r), relay::wire::ProtocolError);
  // Control messages: the region's manifest room plus 64 KiB, at most
  // the largest manifest plus 64 KiB (protocol 2 took 2 GiB).
  EXPECT_EQ(relay::wire::control_cap(1 << 20), (1u << 20) + (64u << 10));
  EXPECT_EQ(relay::wire::control_cap(0), relay::wire::control_cap(ProducerOptions{}.manifest_bytes));
  EXPECT_EQ(relay::wire::control_cap(~0ull), relay::wire::kMaxControlBytes);
  EXPECT_LT(relay::wire::kMaxControlBytes, 2ull << 30);
}

// Issue 27, item 1: the control channel frames messages; a frame announced
// larger than taken ends the connection without allocating it, a closed
// peer is reported, and what arrived before is delivered.
TEST(RelayCtrl, FramesAreBoundedAndDelivered) {
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv), 0);
  relay::CtrlSocket a(sv[0]), b(sv[1]);
  const std::vector<std::uint8_t> m1(100, 1), m2(5000, 2);
  ASSERT_TRUE(a.send(m1, 1 << 20));
  ASSERT_TRUE(a.send(m2, 1 << 20));
  EXPECT_FALSE(a.send(std::vector<std::uint8_t>(2 << 20, 0), 1 << 20));  // the peer would hold too much unread
  ASSERT_TRUE(a.flush());
  std::vector<std::vector<std::uint8_t>> frames;
  ASSERT_TRUE(b.receive(8192, &frames));
  ASSERT_EQ(frames.size(), 2u);
  EXPECT_EQ(frames[0], m1);
  EXPECT_EQ(frames[1], m2);
  // 4 GiB announced: refused at once.
  const std::uint32_t huge = 0xffffffffu;
  ASSERT_EQ(::send(a.fd(), &huge, 4, 0), 4);
  frames.clear();
  EXPECT_FALSE(b.receive(8192, &frames));
  EXPECT_NE(b.error().find("more than the 8192"), std::string::npos) << b.error();
  EXPECT_TRUE(frames.empty());
  // A frame, then the peer closes: the frame, then the close.
  int sv2[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv2), 0);
  relay::CtrlSocket c(sv2[0]), d(sv2[1]);
  ASSERT_TRUE(c.send(m1, 1 << 20));
  ASSERT_TRUE(c.flush());
  c.close();
  frames.clear();
  EXPECT_FALSE(d.receive(8192, &frames));
  ASSERT_EQ(frames.size(), 1u);
  EXPECT_NE(d.error().find("closed"), std::string::npos) << d.error();
}

// Issue 27, item 6: UCX's devices are the interfaces that carry the asked
// addresses (plus RDMA devices); an address on no interface restricts
// nothing (and says why).
TEST(RelayUcx, DevicesAreTheInterfacesOfTheAskedAddresses) {
  auto ip = [](const char* s) {
    in_addr a{};
    ::inet_pton(AF_INET, s, &a);
    return a.s_addr;
  };
  const std::vector<std::pair<std::string, in_addr_t>> ifs = {
      {"lo", ip("127.0.0.1")}, {"eth0", ip("10.0.0.5")}, {"eth1", ip("10.1.0.5")}};
  std::string why;
  EXPECT_EQ(relay::ucx::pick_devices(ifs, {ip("127.0.0.1")}, {}, &why), "lo");
  EXPECT_EQ(relay::ucx::pick_devices(ifs, {ip("10.0.0.5"), ip("10.1.0.5")}, {"mlx5_0:1"}, &why),
            "eth0,eth1,mlx5_0:1");
  EXPECT_EQ(relay::ucx::pick_devices(ifs, {ip("10.0.0.5"), ip("10.0.0.5")}, {}, &why), "eth0");
  EXPECT_EQ(relay::ucx::pick_devices(ifs, {ip("192.168.9.9")}, {}, &why), "");
  EXPECT_NE(why.find("192.168.9.9"), std::string::npos) << why;
  EXPECT_EQ(relay::ucx::pick_devices(ifs, {}, {}, &why), "");
  // The relay's own pick: loopback for a loopback listen address and
  // upstream; a wildcard listen address restricts nothing.
  EXPECT_EQ(relay::ucx::relay_net_devices("127.0.0.1:7000", "127.0.0.1:7001").devices.substr(0, 2), "lo");
  const auto any = relay::ucx::relay_net_devices("0.0.0.0:7000", "");
  EXPECT_EQ(any.devices, "");
  EXPECT_NE(any.why.find("every interface"), std::string::npos) << any.why;
}
