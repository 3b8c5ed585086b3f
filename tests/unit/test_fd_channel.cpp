// The fd channel (lib/core/protocol/fd_channel.{hpp,cpp}) in one process: the
// descriptor's bytes and every way a message can be bad, the socket's name,
// the peer rule, and a server and a client over memfds (the stand-ins for
// VMM fds), including broken servers crafted byte by byte. Every refused
// message must leave no received descriptor open (/proc/self/fd is counted).
// The real processes, other uids and the seccomp profile are in the
// multiprocess, attack and seccomp tiers.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <chrono>

#include "protocol/fd_channel.hpp"
#include "fdchan_support.hpp"
#include "shm/region.hpp"

using namespace shmcast;
using namespace shmcast::detail;
using namespace fdchan_test;
using namespace std::chrono_literals;
using shmcast_test::code_of;

namespace {

FdSetInfo sample_info(std::size_t n = 3) {
  FdSetInfo i;
  i.kind = FdKind::kCudaVmm;
  i.region_nonce = 0x1122334455667788ull;
  for (std::size_t k = 0; k < 16; ++k) i.device_uuid[k] = static_cast<std::uint8_t>(0xa0 + k);
  for (std::size_t k = 0; k < n; ++k) i.sizes.push_back((k + 1) << 21);
  return i;
}

std::string decode_problem(const std::vector<std::byte>& m) {
  FdSetInfo out;
  return decode_fd_message(m, &out);
}

template <class T>
void poke(std::vector<std::byte>& m, std::size_t off, T v) {
  std::memcpy(&m[off], &v, sizeof v);
}

// Memfds of `bytes` with patterns seed + i, closed at scope exit.
struct Memfds {
  std::vector<int> fds;
  Memfds(std::size_t n, std::size_t bytes, std::uint64_t seed) {
    for (std::size_t i = 0; i < n; ++i) fds.push_back(make_memfd(bytes, seed + i));
  }
  ~Memfds() {
    for (int fd : fds) ::close(fd);
  }
};

FdSetInfo host_info(std::size_t n, std::size_t bytes, std::uint64_t nonce) {
  FdSetInfo i;
  i.kind = FdKind::kHostMemory;
  i.region_nonce = nonce;
  i.sizes.assign(n, bytes);
  return i;
}

FdFetchOptions fetch_options(std::uint64_t nonce, Duration timeout = 20s) {
  FdFetchOptions o;
  o.kind = FdKind::kHostMemory;
  o.region_nonce = nonce;
  o.timeout = timeout;
  return o;
}

FdServerOptions quiet(std::vector<std::string>* lines) {
  FdServerOptions o;
  o.on_event = [lines](const std::string& l) { lines->push_back(l); };
  return o;
}

}  // namespace

// ---------------------------------------------------------------- message

TEST(FdMessage, RoundTrips) {
  const FdSetInfo in = sample_info(5);
  const std::vector<std::byte> m = encode_fd_message(in);
  ASSERT_EQ(m.size(), 64u + 5 * 8);
  // The bytes docs/protocol.md gives.
  std::uint32_t magic;
  std::memcpy(&magic, m.data(), 4);
  EXPECT_EQ(magic, 0x44464353u);
  EXPECT_EQ(std::memcmp(m.data(), "SCFD", 4), 0);
  FdSetInfo out;
  ASSERT_EQ(decode_fd_message(m, &out), "");
  EXPECT_EQ(out.kind, in.kind);
  EXPECT_EQ(out.region_nonce, in.region_nonce);
  EXPECT_EQ(out.device_uuid, in.device_uuid);
  EXPECT_EQ(out.sizes, in.sizes);
  // The largest message.
  const std::vector<std::byte> big = encode_fd_message(sample_info(kMaxChannelFds));
  EXPECT_EQ(big.size(), kMaxFdMessageBytes);
  EXPECT_EQ(decode_problem(big), "");
}

TEST(FdMessage, EncodeRefusesWhatNoConsumerTakes) {
  auto refused = [](FdSetInfo i) { return code_of([&] { encode_fd_message(i); }) == Errc::kInvalidArgument; };
  FdSetInfo i = sample_info(0);
  EXPECT_TRUE(refused(i));
  EXPECT_TRUE(refused(sample_info(kMaxChannelFds + 1)));
  i = sample_info();
  i.region_nonce = 0;
  EXPECT_TRUE(refused(i));
  i = sample_info();
  i.kind = static_cast<FdKind>(7);
  EXPECT_TRUE(refused(i));
  i = sample_info();
  i.sizes[1] = 0;
  EXPECT_TRUE(refused(i));
  i = sample_info();
  i.sizes[2] = kMaxChannelFdBytes + 1;
  EXPECT_TRUE(refused(i));
}

TEST(FdMessage, DecodeRefusesEveryBadField) {
  const std::vector<std::byte> good = encode_fd_message(sample_info(3));
  ASSERT_EQ(decode_problem(good), "");
  struct Case {
    const char* what;
    std::function<void(std::vector<std::byte>&)> bend;
    const char* says;
  };
  const std::vector<Case> cases = {
      {"empty", [](auto& m) { m.clear(); }, "less than its 64-byte header"},
      {"short header", [](auto& m) { m.resize(63); }, "less than its 64-byte header"},
      {"magic", [](auto& m) { m[0] = std::byte{'X'}; }, "bad magic"},
      {"version", [](auto& m) { poke<std::uint16_t>(m, 4, 2); }, "message version 2"},
      {"header size", [](auto& m) { poke<std::uint16_t>(m, 6, 128); }, "header size 128"},
      {"no fds", [](auto& m) { poke<std::uint32_t>(m, 8, 0); }, "fd count 0"},
      {"too many fds", [](auto& m) { poke<std::uint32_t>(m, 8, kMaxChannelFds + 1); }, "fd count 254"},
      {"count says more", [](auto& m) { poke<std::uint32_t>(m, 8, 4); }, "4 fds make 96"},
      {"count says fewer", [](auto& m) { poke<std::uint32_t>(m, 8, 2); }, "2 fds make 80"},
      {"trailing byte", [](auto& m) { m.push_back(std::byte{0}); }, "the message has 89 bytes"},
      {"missing byte", [](auto& m) { m.pop_back(); }, "the message has 87 bytes"},
      {"kind 0", [](auto& m) { poke<std::uint32_t>(m, 12, 0); }, "unknown fd kind 0"},
      {"kind 3", [](auto& m) { poke<std::uint32_t>(m, 12, 3); }, "unknown fd kind 3"},
      {"nonce 0", [](auto& m) { poke<std::uint64_t>(m, 16, 0); }, "region nonce 0"},
      {"reserved 40", [](auto& m) { m[40] = std::byte{1}; }, "reserved header byte 40"},
      {"reserved 63", [](auto& m) { m[63] = std::byte{0x80}; }, "reserved header byte 63"},
      {"size 0", [](auto& m) { poke<std::uint64_t>(m, 64 + 8, 0); }, "fd 1 has size 0"},
      {"size too large", [](auto& m) { poke<std::uint64_t>(m, 64 + 16, kMaxChannelFdBytes + 1); }, "fd 2 has size"},
      {"size huge", [](auto& m) { poke<std::uint64_t>(m, 64, ~0ull); }, "fd 0 has size"},
  };
  for (const Case& c : cases) {
    std::vector<std::byte> m = good;
    c.bend(m);
    const std::string why = decode_problem(m);
    EXPECT_NE(why.find(c.says), std::string::npos) << c.what << ": '" << why << "'";
  }
}

TEST(FdMessage, RefusalRoundTripsAndIsCheckedLikeTheMessage) {
  FdRefusalInfo r;
  r.reason = FdRefusal::kUidLimit;
  r.held = 32;
  r.limit = 32;
  r.top_pid = 4242;
  r.top_uid = 1000;
  r.top_held = 4;
  const std::vector<std::byte> m = encode_fd_refusal(r);
  ASSERT_EQ(m.size(), kFdMessageHeaderBytes);
  FdRefusalInfo back;
  ASSERT_EQ(decode_fd_refusal(m, &back), "");
  EXPECT_EQ(back.reason, r.reason);
  EXPECT_EQ(back.held, 32u);
  EXPECT_EQ(back.limit, 32u);
  EXPECT_EQ(back.top_pid, 4242);
  EXPECT_EQ(back.top_uid, 1000u);
  EXPECT_EQ(back.top_held, 4u);
  FdSetInfo info;
  EXPECT_NE(decode_fd_message(m, &info), "") << "a refusal is never taken for the message";
  auto bent = [&](std::size_t at, std::byte v) {
    std::vector<std::byte> b = m;
    b[at] = v;
    return decode_fd_refusal(b, &back);
  };
  EXPECT_NE(bent(0, std::byte{'X'}), "");
  EXPECT_NE(bent(4, std::byte{2}), "");
  EXPECT_NE(bent(8, std::byte{0}), "");  // reason 0
  EXPECT_NE(bent(8, std::byte{6}), "");  // reason 6
  EXPECT_NE(bent(32, std::byte{1}), "");
  EXPECT_NE(bent(63, std::byte{1}), "");
  std::vector<std::byte> longer = m;
  longer.push_back(std::byte{0});
  EXPECT_NE(decode_fd_refusal(longer, &back), "");
}

// ---------------------------------------------------------------- names and rules

TEST(FdChannel, SocketNameIsNoRegionFileAndFitsAnAddress) {
  EXPECT_EQ(slot_socket_file("/dev/shm/", "actor-0"), "/dev/shm/shmcast-slots.actor-0");
  // Region "x.slots" has the file shmcast.x.slots: the socket of region x
  // must be something else, and no region file starts like a socket.
  EXPECT_NE(slot_socket_file("/d", "x"), region_file("/d", "x.slots"));
  EXPECT_NE(slot_socket_name("x").rfind(std::string(kRegionFilePrefix), 0), 0u);
  const std::string a(128, 'a');
  std::string b = a;
  b.back() = 'b';
  const std::string na = slot_socket_name(a), nb = slot_socket_name(b);
  EXPECT_NE(na, nb);
  EXPECT_LE(na.size(), 80u);
  EXPECT_NE(na.find('~'), std::string::npos);  // no region name has one: no clash with a plain name
  EXPECT_EQ(slot_socket_name(std::string(64, 'c')), "shmcast-slots." + std::string(64, 'c'));
  EXPECT_NE(slot_socket_name(std::string(65, 'c')).find('~'), std::string::npos);
}

TEST(FdChannel, PeerRuleIsTheRegionRule) {
  const std::uint32_t me = ::geteuid();
  const std::uint32_t other = me == 65534 ? 65533 : 65534;
  TrustPolicy none;
  EXPECT_EQ(peer_trust_problem({1, me, 5, {}}, none, -1), "");
  const std::string why = peer_trust_problem({42, other, 7, {}}, none, -1);
  EXPECT_NE(why.find("process 42"), std::string::npos) << why;
  EXPECT_NE(why.find("uid " + std::to_string(other)), std::string::npos) << why;
  EXPECT_NE(why.find("group_access is off"), std::string::npos) << why;
  // A trusted uid.
  EXPECT_EQ(peer_trust_problem({1, other, 7, {}}, TrustPolicy{false, {other}}, -1), "");
  // The group rule: only with group_access, and only the region's group
  // (primary or supplementary).
  const TrustPolicy group{true, {}};
  EXPECT_EQ(peer_trust_problem({1, other, 4242, {}}, group, 4242), "");
  EXPECT_EQ(peer_trust_problem({1, other, 7, {1, 4242}}, group, 4242), "");
  EXPECT_NE(peer_trust_problem({1, other, 7, {1, 2}}, group, 4242).find("not in the region's group 4242"),
            std::string::npos);
  EXPECT_NE(peer_trust_problem({1, other, 4242, {4242}}, none, 4242), "");
  EXPECT_NE(peer_trust_problem({1, other, 4242, {}}, group, -1), "");
  // The owner rule the consumer applies to the server is the file rule's.
  EXPECT_TRUE(uid_trusted(me, none));
  EXPECT_FALSE(uid_trusted(other, none));
  EXPECT_TRUE(uid_trusted(other, TrustPolicy{false, {other}}));
  EXPECT_EQ(trust_problem("f", other, 0, 0600, TrustPolicy{false, {other}}), "");
}

// ---------------------------------------------------------------- a server and a client

TEST(FdChannel, ServesMemfdsBitExact) {
  ScratchDir d;
  ASSERT_FALSE(d.path.empty());
  Memfds m(3, 1 << 16, 100);
  std::vector<std::string> lines;
  FdServer s = FdServer::start(d.path, "serve", m.fds, host_info(3, 1 << 16, 77), quiet(&lines));
  struct stat st {};
  ASSERT_EQ(::lstat(s.path().c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_EQ(st.st_uid, ::geteuid());
  for (int round = 0; round < 2; ++round) {
    FdFetchOptions o = fetch_options(77);
    o.expect_fds = 3;
    o.expect_bytes = 1 << 16;
    o.expect_pid = ::getpid();
    FetchedFds got = fetch_fds(d.path, "serve", o);
    ASSERT_EQ(got.fds.size(), 3u);
    EXPECT_EQ(got.server_pid, ::getpid());
    EXPECT_EQ(got.server_uid, ::geteuid());
    for (std::size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(memfd_problem(got.fds[i].get(), 1 << 16, 100 + i), "") << i;
      EXPECT_EQ(::fcntl(got.fds[i].get(), F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
    }
  }
  // No private directory is left behind.
  EXPECT_EQ(std::system(("test -z \"$(ls -A " + d.path + " | grep -v shmcast-slots.serve)\"").c_str()), 0);
  s.stop();
  EXPECT_EQ(s.served(), 2u);  // read after stop(): the server thread has finished
  EXPECT_EQ(s.refused(), 0u);
  EXPECT_NE(::lstat(s.path().c_str(), &st), 0) << "stop() removes the socket";
  s.stop();  // idempotent
  EXPECT_TRUE(lines.empty());
}

TEST(FdChannel, ServerKeepsItsOwnCopies) {
  ScratchDir d;
  std::vector<std::string> lines;
  FdServer s;
  {
    Memfds m(2, 4096, 9);
    s = FdServer::start(d.path, "copies", m.fds, host_info(2, 4096, 5), quiet(&lines));
  }  // the caller's fds are closed
  FetchedFds got = fetch_fds(d.path, "copies", fetch_options(5));
  ASSERT_EQ(got.fds.size(), 2u);
  EXPECT_EQ(memfd_problem(got.fds[1].get(), 4096, 10), "");
}

TEST(FdChannel, GroupAccessMakesTheSocketGroupReadable) {
  ScratchDir d;
  Memfds m(1, 4096, 1);
  std::vector<std::string> lines;
  FdServerOptions o = quiet(&lines);
  o.trust.group_access = true;
  o.region_gid = ::getegid();
  FdServer s = FdServer::start(d.path, "grp", m.fds, host_info(1, 4096, 3), o);
  struct stat st {};
  ASSERT_EQ(::lstat(s.path().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0660u);
}

TEST(FdChannel, ClientChecksKindNonceCountsAndSizes) {
  ScratchDir d;
  Memfds m(2, 8192, 1);
  std::vector<std::string> lines;
  const int before = open_fds();
  FdServer s = FdServer::start(d.path, "chk", m.fds, host_info(2, 8192, 1234), quiet(&lines));
  auto code = [&](FdFetchOptions o) { return code_of([&] { fetch_fds(d.path, "chk", o); }); };
  FdFetchOptions o = fetch_options(1235);
  EXPECT_EQ(code(o), Errc::kCorrupt) << "another region's nonce";
  o = fetch_options(1234);
  o.kind = FdKind::kCudaVmm;
  EXPECT_EQ(code(o), Errc::kCorrupt) << "memfds are never taken as GPU memory";
  o = fetch_options(1234);
  o.expect_fds = 3;
  EXPECT_EQ(code(o), Errc::kCorrupt);
  o = fetch_options(1234);
  o.expect_bytes = 4096;
  EXPECT_EQ(code(o), Errc::kCorrupt);
  o = fetch_options(1234);
  o.expect_pid = ::getpid() + 1;
  EXPECT_EQ(code(o), Errc::kPermission);
  o = fetch_options(0);
  EXPECT_EQ(code(o), Errc::kInvalidArgument);
  EXPECT_EQ(code_of([&] { fetch_fds(d.path, "bad name", fetch_options(1)); }), Errc::kBadName);
  s.stop();  // its thread and connections gone: only what the client kept could be left
  EXPECT_EQ(open_fds(), before) << "a refused message leaves no descriptor open (nor does the server)";
}

TEST(FdChannel, LongDirectoryAndNameStillWork) {
  ScratchDir d;
  std::string long_dir = d.path + "/" + std::string(60, 'd') + "/" + std::string(60, 'e');
  ASSERT_EQ(std::system(("mkdir -p '" + long_dir + "'").c_str()), 0);
  const std::string name(128, 'n');
  Memfds m(1, 4096, 4);
  std::vector<std::string> lines;
  FdServer s = FdServer::start(long_dir, name, m.fds, host_info(1, 4096, 8), quiet(&lines));
  EXPECT_GT(s.path().size(), 108u);  // longer than any sun_path
  FetchedFds got = fetch_fds(long_dir, name, fetch_options(8));
  ASSERT_EQ(got.fds.size(), 1u);
  EXPECT_EQ(memfd_problem(got.fds[0].get(), 4096, 4), "");
}

TEST(FdChannel, SecondServerOfALiveOneIsRefused) {
  ScratchDir d;
  Memfds m(1, 4096, 4);
  std::vector<std::string> lines;
  FdServer s = FdServer::start(d.path, "twice", m.fds, host_info(1, 4096, 8), quiet(&lines));
  try {
    FdServer t = FdServer::start(d.path, "twice", m.fds, host_info(1, 4096, 9), quiet(&lines));
    FAIL() << "a second server took a live server's name";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kExists) << e.what();
    EXPECT_NE(std::string(e.what()).find("live server"), std::string::npos) << e.what();
  }
  // The first one still serves.
  EXPECT_EQ(fetch_fds(d.path, "twice", fetch_options(8)).fds.size(), 1u);
}

TEST(FdChannel, StaleSocketOfThisUidIsTakenOver) {
  ScratchDir d;
  const std::string path = slot_socket_file(d.path, "stale");
  {
    const int l = listen_at(path);  // a server that died: its socket is left, nobody listens
    ASSERT_GE(l, 0);
    ::close(l);
  }
  struct stat old {};
  ASSERT_EQ(::lstat(path.c_str(), &old), 0);
  Memfds m(1, 4096, 6);
  std::vector<std::string> lines;
  FdServer s = FdServer::start(d.path, "stale", m.fds, host_info(1, 4096, 2), quiet(&lines));
  struct stat now {};
  ASSERT_EQ(::lstat(path.c_str(), &now), 0);
  EXPECT_NE(now.st_ino, old.st_ino);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("removed the stale slot socket"), std::string::npos) << lines[0];
  EXPECT_EQ(memfd_problem(fetch_fds(d.path, "stale", fetch_options(2)).fds.at(0).get(), 4096, 6), "");
  // Not without replace_stale.
  s.stop();
  const int l = listen_at(path);
  ::close(l);
  FdServerOptions keep = quiet(&lines);
  keep.replace_stale = false;
  EXPECT_EQ(code_of([&] { FdServer::start(d.path, "stale", m.fds, host_info(1, 4096, 2), keep); }), Errc::kExists);
}

TEST(FdChannel, ServerLeavesWhatIsNotItsSocketAlone) {
  ScratchDir d;
  Memfds m(1, 4096, 6);
  std::vector<std::string> lines;
  const std::string path = slot_socket_file(d.path, "planted");
  auto start = [&] { FdServer::start(d.path, "planted", m.fds, host_info(1, 4096, 2), quiet(&lines)); };
  // A regular file.
  { std::FILE* f = std::fopen(path.c_str(), "w"); std::fputs("keep", f); std::fclose(f); }
  EXPECT_EQ(code_of(start), Errc::kExists);
  struct stat st {};
  ASSERT_EQ(::lstat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  ::unlink(path.c_str());
  // A FIFO: never opened for reading, so never blocks.
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  EXPECT_EQ(code_of(start), Errc::kExists);
  ASSERT_EQ(::lstat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
  ::unlink(path.c_str());
  // A symlink, dangling or to a socket: never followed, never removed.
  const std::string target = d.path + "/elsewhere";
  ASSERT_EQ(::symlink(target.c_str(), path.c_str()), 0);
  EXPECT_EQ(code_of(start), Errc::kPermission);
  EXPECT_NE(::lstat(target.c_str(), &st), 0) << "nothing was created through the link";
  const int l = listen_at(target);  // a dead socket behind the link
  ::close(l);
  EXPECT_EQ(code_of(start), Errc::kPermission);
  ASSERT_EQ(::lstat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISLNK(st.st_mode));
  ASSERT_EQ(::lstat(target.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  // Nothing of ours is left behind (no private directory).
  EXPECT_EQ(std::system(("test $(ls -A " + d.path + " | wc -l) -eq 2").c_str()), 0);
}

TEST(FdChannel, StopRemovesOnlyItsOwnSocket) {
  ScratchDir d;
  Memfds m(1, 4096, 6);
  std::vector<std::string> lines;
  FdServer s = FdServer::start(d.path, "own", m.fds, host_info(1, 4096, 2), quiet(&lines));
  const std::string path = s.path();
  ASSERT_EQ(::unlink(path.c_str()), 0);
  { std::FILE* f = std::fopen(path.c_str(), "w"); std::fclose(f); }  // someone else's file at the name now
  s.stop();
  struct stat st {};
  ASSERT_EQ(::lstat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
}

TEST(FdChannel, ClientRefusesALinkOrAFifoAtOnce) {
  ScratchDir d;
  const std::string path = slot_socket_file(d.path, "link");
  const std::string real = d.path + "/real";
  const int l = listen_at(real);  // a live socket of a trusted uid behind the link
  ASSERT_GE(l, 0);
  ASSERT_EQ(::symlink(real.c_str(), path.c_str()), 0);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(code_of([&] { fetch_fds(d.path, "link", fetch_options(1, 60s)); }), Errc::kPermission);
  ::unlink(path.c_str());
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  EXPECT_EQ(code_of([&] { fetch_fds(d.path, "link", fetch_options(1, 60s)); }), Errc::kPermission);
  // Refused at once, not at the deadline (a generous bound, far below it).
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 30s);
  ::close(l);
}

TEST(FdChannel, ClientWaitsThenTimesOutOrSeesTheProducerGone) {
  ScratchDir d;
  // Nothing there: kTimeout at the deadline.
  EXPECT_EQ(code_of([&] { fetch_fds(d.path, "none", fetch_options(1, 200ms)); }), Errc::kTimeout);
  // peer_gone: kPeerDied at once, with the caller's reason.
  FdFetchOptions o = fetch_options(1, 60s);
  o.peer_gone = [] { return std::string("the producer's lock is free"); };
  try {
    fetch_fds(d.path, "none", o);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kPeerDied);
    EXPECT_NE(std::string(e.what()).find("the producer's lock is free"), std::string::npos) << e.what();
  }
  // A socket nobody listens on (a dead producer's): kPeerDied at the deadline.
  const int l = listen_at(slot_socket_file(d.path, "dead"));
  ::close(l);
  EXPECT_EQ(code_of([&] { fetch_fds(d.path, "dead", fetch_options(1, 200ms)); }), Errc::kPeerDied);
  // The socket appears while the client waits: it is served.
  Memfds m(1, 4096, 6);
  std::vector<std::string> lines;
  FdServer late;
  std::thread t([&] {
    std::this_thread::sleep_for(50ms);  // not a handshake: the client must wait either way
    late = FdServer::start(d.path, "late", m.fds, host_info(1, 4096, 2), quiet(&lines));
  });
  EXPECT_EQ(fetch_fds(d.path, "late", fetch_options(2, 60s)).fds.size(), 1u);
  t.join();
}

// ---------------------------------------------------------------- broken servers

TEST(FdChannel, BadMessagesAreRefusedAndTheirFdsClosed) {
  ScratchDir d;
  Memfds m(4, 4096, 3);
  const std::vector<std::byte> good = encode_fd_message(host_info(2, 4096, 55));
  struct Case {
    const char* what;
    std::vector<std::byte> bytes;
    std::vector<int> fds;
    Errc want;
    bool send = true;
  };
  std::vector<std::byte> garbage(100, std::byte{0x5a});
  std::vector<std::byte> too_long(kMaxFdMessageBytes + 100, std::byte{0});
  std::vector<std::byte> other_nonce = encode_fd_message(host_info(2, 4096, 56));
  std::vector<std::byte> vmm = good;
  poke<std::uint32_t>(vmm, 12, 2);
  const std::vector<Case> cases = {
      {"fewer fds than the descriptor", good, {m.fds[0]}, Errc::kCorrupt},
      {"more fds than the descriptor", good, {m.fds[0], m.fds[1], m.fds[2]}, Errc::kCorrupt},
      {"no fds", good, {}, Errc::kCorrupt},
      {"garbage with fds", garbage, {m.fds[0], m.fds[1]}, Errc::kCorrupt},
      {"longer than any message", too_long, {m.fds[0], m.fds[1]}, Errc::kCorrupt},
      {"another region", other_nonce, {m.fds[0], m.fds[1]}, Errc::kCorrupt},
      {"another kind", vmm, {m.fds[0], m.fds[1]}, Errc::kCorrupt},
      {"closes without a word (refused us, still listening)", {}, {}, Errc::kPermission, false},
  };
  for (const Case& c : cases) {
    const std::string name = "bad";
    const int before = open_fds();
    {
      RawServer srv(slot_socket_file(d.path, name), c.bytes, c.fds, c.send);
      ASSERT_GE(srv.listen_fd, 0);
      EXPECT_EQ(code_of([&] { fetch_fds(d.path, name, fetch_options(55, 20s)); }), c.want) << c.what;
    }  // the raw server's thread and sockets are gone: what is left open, the client kept
    ::unlink(slot_socket_file(d.path, name).c_str());
    EXPECT_EQ(open_fds(), before) << c.what << ": a descriptor of the refused message stayed open";
  }
  // The control case: the same raw server with a good message is accepted.
  RawServer ok(slot_socket_file(d.path, "good"), good, {m.fds[0], m.fds[1]});
  FetchedFds got = fetch_fds(d.path, "good", fetch_options(55));
  ASSERT_EQ(got.fds.size(), 2u);
  EXPECT_EQ(memfd_problem(got.fds[1].get(), 4096, 4), "");
}

TEST(FdChannel, ServerThatSendsNothingIsATimeout) {
  ScratchDir d;
  // Accepts nothing: the connection waits in its queue until the deadline.
  const int l = listen_at(slot_socket_file(d.path, "mute"));
  ASSERT_GE(l, 0);
  int connected = 0;
  FdFetchOptions o = fetch_options(1, 300ms);
  o.on_connected = [&] { ++connected; };
  EXPECT_EQ(code_of([&] { fetch_fds(d.path, "mute", o); }), Errc::kTimeout);
  EXPECT_EQ(connected, 1);
  ::close(l);
}

TEST(FdChannel, ServerStopsPromptlyWithClientsQueued) {
  ScratchDir d;
  Memfds m(1, 4096, 6);
  std::vector<std::string> lines;
  FdServer s = FdServer::start(d.path, "stop", m.fds, host_info(1, 4096, 2), quiet(&lines));
  // Clients that never read: this process holds kFdUnreadPerProcess
  // messages, its other connections get refusals.
  std::vector<int> idle;
  for (int i = 0; i < 32; ++i) {
    const int c = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::memcpy(a.sun_path, s.path().c_str(), s.path().size());
    ASSERT_EQ(::connect(c, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    idle.push_back(c);
  }
  // So this process gets no more (its limit is reached), and is told why.
  try {
    fetch_fds(d.path, "stop", fetch_options(2, 300ms));
    ADD_FAILURE() << "a process holding its limit of unread messages got one more";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kTimeout) << e.what();
    EXPECT_NE(std::string(e.what()).find("limit of slot messages sent and not yet read is reached (4 unread by "
                                         "this process, the limit 4)"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(s.unread(), kFdUnreadPerProcess);
  s.stop();  // returns (the eventfd wakes the thread); a hang fails the test's timeout
  for (int c : idle) ::close(c);
}
