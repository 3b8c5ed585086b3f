// Fault matrix, part 7: another local user, a shared or world-writable
// volume. A region another uid made is never trusted; the name is opened
// once, by descriptor, never through a link or into a FIFO; a region whose
// liveness cannot be told is never replaced. The attackers run as other uids
// (setuid in a forked child: the tests need root, and skip without it).
#include <grp.h>
#include <linux/close_range.h>
#include <sys/stat.h>

#include <fstream>

#include "fault_support.hpp"

using namespace fault;

namespace {

constexpr uid_t kNobody = 65534;
constexpr uid_t kStranger = 65533;

// Becomes `uid` with no groups and no inherited region descriptors.
bool become(uid_t uid) {
  ::close_range(3, ~0u, 0);
  return ::setgroups(0, nullptr) == 0 && ::setgid(uid) == 0 && ::setuid(uid) == 0 && ::geteuid() == uid;
}

// A scratch region directory like a shared volume: mode 0777, no sticky
// bit. SHMCAST_DIR points at it for the test and its children.
struct SharedDir {
  std::string path;
  std::string old_env;
  bool had_env = false;
  explicit SharedDir(bool sticky = false) {
    char tmpl[] = "/dev/shm/shmcast-sec-XXXXXX";
    path = ::mkdtemp(tmpl);
    ::chmod(path.c_str(), sticky ? 01777 : 0777);
    if (const char* e = std::getenv("SHMCAST_DIR")) had_env = true, old_env = e;
    ::setenv("SHMCAST_DIR", path.c_str(), 1);
  }
  ~SharedDir() {
    if (had_env)
      ::setenv("SHMCAST_DIR", old_env.c_str(), 1);
    else
      ::unsetenv("SHMCAST_DIR");
    std::string cmd = "rm -rf '" + path + "'";
    if (std::system(cmd.c_str()) != 0) std::fprintf(stderr, "cannot remove %s\n", path.c_str());
  }
};

std::uint64_t inode_of(const std::string& p) {
  struct stat st {};
  return ::lstat(p.c_str(), &st) == 0 ? st.st_ino : 0;
}

#define NEED_ROOT() \
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run the attacker as another uid"

}  // namespace

// Item 1: uid 65534 plants a region under the name a root consumer will
// open, makes it 0666 and is ready to send. The consumer refuses it with
// kPermission naming the owner, and so does the real trainer.
TEST(Security, RegionOfAnotherUserIsRefused) {
  NEED_ROOT();
  Matrix m("security_foreign_region");
  for (const mode_t mode : {0666, 0600}) {
    SharedDir dir;
    const std::string name = unique_name("foreign");
    SharedFlags* f = SharedFlags::make();
    Child attacker = Child::spawn([&] {
      if (!become(kNobody)) return 60;
      Producer p = Producer::create(name, popts(1, 3000ms));
      ::chmod(region_path(name).c_str(), mode);
      f->v[0] = 1;
      // If a consumer does attach, hand it a weight of our choosing.
      try {
        p.wait_for_consumers(1, 3s);
        PatternSync s(1, 4096, 1);
        p.send(s.specs, s.ptrs);
        f->v[2] = 1;
      } catch (const Error&) {
      }
      f->wait(1, 1, 30s);
      return 0;
    });
    ASSERT_TRUE(f->wait(0, 1)) << "attacker did not start";
    const std::uint64_t ino = inode_of(region_path(name));
    try {
      Consumer c = Consumer::open(name, copts(2000ms));
      ADD_FAILURE() << "a root consumer attached to a region of uid 65534, mode " << std::oct << mode;
      ++m.unexpected;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::kPermission) << e.what();
      EXPECT_NE(std::string(e.what()).find("65534"), std::string::npos) << e.what();
      m.note(std::string("consumer_") + (mode == 0666 ? "0666" : "0600"), errc_name(e.code()));
    }
    // The real trainer arrives: it is told whose region sits on the name.
    try {
      Producer p = Producer::create(name, popts(1));
      ADD_FAILURE() << "the trainer took over a live region of another user";
      ++m.unexpected;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::kPermission) << e.what();
      EXPECT_NE(std::string(e.what()).find("65534"), std::string::npos) << e.what();
      m.note(std::string("producer_") + (mode == 0666 ? "0666" : "0600"), errc_name(e.code()));
    }
    EXPECT_EQ(inode_of(region_path(name)), ino) << "the other user's file was replaced";
    EXPECT_EQ(f->v[2].load(), 0) << "the attacker's sync was delivered";
    f->v[1] = 1;
    EXPECT_EQ(attacker.wait(20s), 0);
    m.trials += 2;
  }
  m.finish();
}

// A region of our own uid made writable by others is refused too; a uid
// listed in trusted_uids is accepted (and then reads bit-exact).
TEST(Security, ModeAndTrustedUidsDecide) {
  NEED_ROOT();
  SharedDir dir;
  {
    const std::string name = unique_name("mode");
    Producer p = Producer::create(name, popts(1));
    ::chmod(region_path(name).c_str(), 0646);
    try {
      Consumer c = Consumer::open(name, copts(500ms));
      ADD_FAILURE() << "a world-writable region was trusted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::kPermission) << e.what();
      EXPECT_NE(std::string(e.what()).find("0646"), std::string::npos) << e.what();
    }
  }
  const std::string name = unique_name("trusted");
  SharedFlags* f = SharedFlags::make();
  Child owner = Child::spawn([&] {
    if (!become(kNobody)) return 60;
    Producer p = Producer::create(name, popts(1, 10000ms));
    f->v[0] = 1;
    p.wait_for_consumers(1, 20s);
    PatternSync s(3, 100000, 1);
    p.send(s.specs, s.ptrs);
    p.wait_drained(20s);
    return 0;
  });
  ASSERT_TRUE(f->wait(0, 1));
  ConsumerOptions o = copts(5000ms);
  o.trusted_uids = {kNobody};
  Consumer c = Consumer::open(name, o);
  const SyncInfo& info = c.wait_sync(20s);
  std::vector<std::vector<std::uint8_t>> got(info.tensors.size());
  std::vector<void*> dst;
  for (std::size_t i = 0; i < got.size(); ++i) {
    got[i].resize(info.tensors[i].nbytes);
    dst.push_back(got[i].data());
  }
  c.read_into(dst);
  EXPECT_TRUE(check_pattern(got, 1));
  EXPECT_EQ(owner.wait(20s), 0);
}

// Item 2: in a 0777 directory without the sticky bit, another user renames
// each new region file away and plants a symlink to a root-owned file under
// its name. The producer works on the descriptor it created, so the target
// is never allocated or written.
TEST(Security, CreateNeverFollowsASymlinkPlantedInARace) {
  NEED_ROOT();
  SharedDir dir;
  const std::string target = dir.path + "-target";
  {
    std::ofstream(target) << "precious";
  }
  ::chmod(target.c_str(), 0644);
  const std::string name = unique_name("race");
  const std::string path = dir.path + "/shmcast." + name;
  SharedFlags* f = SharedFlags::make();
  Child racer = Child::spawn([&] {
    if (!become(kNobody)) return 60;
    f->v[0] = 1;
    long swaps = 0;
    for (int i = 0; f->v[1].load() == 0; ++i) {
      const std::string away = dir.path + "/away." + std::to_string(i % 4);
      if (::rename(path.c_str(), away.c_str()) == 0) {
        ::symlink(target.c_str(), path.c_str());
        ++swaps;
      }
    }
    f->v[2] = static_cast<int>(swaps > 0);
    return 0;
  });
  ASSERT_TRUE(f->wait(0, 1));
  const int trials = fault::trials(300);
  int created = 0, refused = 0;
  for (int t = 0; t < trials; ++t) {
    try {
      ProducerOptions o = popts(1);
      o.unlink_on_close = true;
      Producer p = Producer::create(name, o);
      ++created;
    } catch (const Error& e) {
      ++refused;  // a link or someone's file on the name: refused, fine
    }
    ::unlink(path.c_str());
  }
  f->v[1] = 1;
  EXPECT_EQ(racer.wait(20s), 0);
  struct stat st {};
  ASSERT_EQ(::stat(target.c_str(), &st), 0);
  EXPECT_EQ(st.st_size, 8) << "the producer allocated a file it reached through a symlink";
  std::string content;
  std::getline(std::ifstream(target), content);
  EXPECT_EQ(content, "precious");
  std::printf("symlink race: %d trials, %d created, %d refused, racer swapped: %d\n", trials, created, refused,
              f->v[2].load());
  ::unlink(target.c_str());
  // A link planted before anyone came is refused, for both sides (the
  // racer may have left one of its own on the name: replace it).
  ::unlink(path.c_str());
  ASSERT_EQ(::symlink(target.c_str(), path.c_str()), 0);
  try {
    Producer p = Producer::create(name, popts(1));
    ADD_FAILURE() << "created through a symlink";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kPermission) << e.what();
  }
  try {
    Consumer c = Consumer::open(name, copts(200ms));
    ADD_FAILURE() << "opened through a symlink";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kPermission) << e.what();
  }
}

// Item 3: a producer that cannot open another user's live 0600 region
// (EACCES) cannot tell whether it is alive: it must leave it alone.
TEST(Security, UnknownLivenessIsNotDeath) {
  NEED_ROOT();
  SharedDir dir;  // 0777, not sticky: the OS would let anyone remove the name
  const std::string name = unique_name("unknown");
  SharedFlags* f = SharedFlags::make();
  Child owner = Child::spawn([&] {
    if (!become(kNobody)) return 60;
    Producer p = Producer::create(name, popts(1));
    f->v[0] = 1;
    f->wait(1, 1, 30s);
    // Still ours, still on the name.
    struct stat st {};
    return ::stat(p.path().c_str(), &st) == 0 && st.st_uid == kNobody ? 0 : 1;
  });
  ASSERT_TRUE(f->wait(0, 1));
  const std::uint64_t ino = inode_of(region_path(name));
  const int rc = Child::spawn([&] {
                   if (!become(kStranger)) return 60;
                   try {
                     Producer p = Producer::create(name, popts(1));
                     return 1;  // replaced a live region of someone else
                   } catch (const Error& e) {
                     std::fprintf(stderr, "stranger: %s\n", e.what());
                     if (e.code() != Errc::kPermission) return 2;
                     if (std::string(e.what()).find("65534") == std::string::npos) return 3;
                     return 0;
                   }
                 }).wait(20s);
  EXPECT_EQ(rc, 0) << "1: replaced, 2: wrong code, 3: owner not named";
  EXPECT_EQ(inode_of(region_path(name)), ino);
  f->v[1] = 1;
  EXPECT_EQ(owner.wait(20s), 0);
}

// Item 4: a FIFO on the name (or a FIFO and a file swapped under it) never
// blocks the producer or a consumer: each call returns a clean error.
TEST(Security, FifoOnTheNameNeverBlocks) {
  SharedDir dir;
  const std::string name = unique_name("fifo");
  const std::string path = dir.path + "/shmcast." + name;
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  const int rc = Child::spawn([&] {
                   try {
                     Producer p = Producer::create(name, popts(1));
                     return 1;
                   } catch (const Error& e) {
                     if (e.code() != Errc::kCorrupt && e.code() != Errc::kExists) return 2;
                   }
                   try {
                     Consumer c = Consumer::open(name, copts(200ms));
                     return 3;
                   } catch (const Error& e) {
                     if (e.code() != Errc::kCorrupt) return 4;
                   }
                   return 0;
                 }).wait(10s);
  EXPECT_EQ(rc, 0) << "-1: blocked; 1/3: succeeded; 2/4: wrong error";
  ::unlink(path.c_str());

  // Swapped under the name while consumers and producers try to open it.
  SharedFlags* f = SharedFlags::make();
  Child swapper = Child::spawn([&] {
    while (f->v[0].load() == 0) {
      ::unlink(path.c_str());
      ::mkfifo(path.c_str(), 0600);
      ::unlink(path.c_str());
      const int fd = ::open(path.c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
      if (fd >= 0) ::close(fd);
    }
    return 0;
  });
  const int opener = Child::spawn([&] {
                       for (int i = 0; i < 300; ++i) {
                         try {
                           Consumer c = Consumer::open(name, copts(2ms));
                         } catch (const Error&) {
                         }
                         try {
                           ProducerOptions o = popts(1);
                           o.replace_stale = false;
                           Producer p = Producer::create(name, o);
                         } catch (const Error&) {
                         }
                       }
                       return 0;
                     }).wait(60s);
  f->v[0] = 1;
  EXPECT_EQ(opener, 0) << "an open blocked on a FIFO swapped under the name";
  EXPECT_EQ(swapper.wait(10s), 0);
}

// Item 6: abort_sync then begin_sync rewrites the manifest area while a
// consumer may still be copying the aborted sync's manifest. The consumer
// must see the record change and look again: never Corrupt.
TEST(Integrity, AbortThenBeginNeverCorruptsAManifestReader) {
  const std::string name = unique_name("abort-race");
  RegionGuard guard{name};
  const int cycles = fault::trials(100000);
  SharedFlags* f = SharedFlags::make();
  Child producer = Child::spawn([&] {
    ProducerOptions o = popts(1, 20000ms);
    Producer p = Producer::create(name, o);
    p.wait_for_consumers(1, 20s);
    // Big manifests widen the window in which a reader copies one.
    std::vector<TensorSpec> specs;
    for (int i = 0; i < 100; ++i) specs.push_back({"layer." + std::to_string(i) + ".weight", DType::kU8, {64}});
    for (int i = 0; i < cycles; ++i) {
      p.begin_sync(specs);
      p.abort_sync("race test");
    }
    f->v[0] = 1;
    PatternSync last(1, 4096, 1);
    last.specs[0].name = "done";
    p.send(last.specs, last.ptrs);
    p.wait_drained(20s);
    return 0;
  });
  Consumer c = Consumer::open(name, copts(20000ms));
  int corrupt = 0, received = 0, other = 0;
  for (;;) {
    try {
      const SyncInfo& info = c.wait_sync(30s);
      ++received;
      if (info.tensors.size() == 1 && info.tensors[0].name == "done") {
        std::vector<std::uint8_t> got(4096);
        void* d = got.data();
        c.read_into({&d, 1});
        break;
      }
      c.skip();
    } catch (const Error& e) {
      if (e.code() == Errc::kCorrupt) {
        ++corrupt;
        std::fprintf(stderr, "%s\n", e.what());
      } else {
        ++other;
        std::fprintf(stderr, "%s\n", e.what());
        if (e.code() == Errc::kTimeout || e.code() == Errc::kPeerDied || e.code() == Errc::kClosed) break;
      }
    }
  }
  std::printf("abort race: %d begin/abort cycles, %d manifests read, %d corrupt, %d other errors\n", cycles,
              received, corrupt, other);
  EXPECT_EQ(corrupt, 0);
  EXPECT_EQ(other, 0);
  EXPECT_EQ(producer.wait(60s), 0);
  EXPECT_EQ(f->v[0].load(), 1);
}
