// Fault matrix, part 3: the region file itself.
//
//  * a consumer opening while the producer creates the region;
//  * the name unlinked while producer and consumers are attached;
//  * a region of another layout version (or otherwise foreign header);
//  * a full /dev/shm (statvfs pre-check, a failing posix_fallocate, a real
//    small tmpfs when this process may mount one);
//  * a truncated region file: at open time (clean Errc::kCorrupt) and
//    between syncs (clean kCorrupt at the next begin_sync / wait_sync).
//    Truncating a file that a live process is touching at that moment
//    raises SIGBUS in that process; the library does not handle SIGBUS
//    (docs/reliability.md, "Truncation policy").
#include <sched.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/statvfs.h>

#include "fault_support.hpp"

using namespace fault;
namespace d = shmcast::detail;

namespace {

// Runs fn in a child and returns its exit code (or -1 on a hang).
int in_child(const std::function<int()>& fn, std::chrono::milliseconds deadline = 60s) {
  Child c = Child::spawn(fn);
  return c.wait(deadline);
}

int open_code(const std::string& name, std::chrono::milliseconds open_timeout) {
  try {
    Consumer c = Consumer::open(name, copts(open_timeout, 2000ms));
    return 0;
  } catch (const Error& e) {
    return errc_exit(e);
  }
}

// A region left behind by a producer that closed without unlinking.
void make_stale_region(const std::string& name) {
  ProducerOptions o = popts(2);
  o.unlink_on_close = false;
  Producer p = Producer::create(name, o);
  p.close();
}

d::Geometry geometry_of(const ProducerOptions& o) {
  d::Geometry g{};
  d::compute_geometry(o.max_consumers, o.slots, o.slot_bytes, o.manifest_bytes, &g);
  return g;
}

// Holds the OFD write lock on `byte` of `path` (as a live producer would).
struct LockHolder {
  int fd = -1;
  explicit LockHolder(const std::string& path, std::int64_t byte = d::kProducerLockByte) {
    fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    struct flock fl {};
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = byte;
    fl.l_len = 1;
    if (fd < 0 || ::fcntl(fd, F_OFD_SETLK, &fl) != 0) ADD_FAILURE() << "cannot lock " << path;
  }
  ~LockHolder() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

// ------------------------------------------------------------ create races

// The creator allocates the file (all zero) before it writes the header and
// sets init_state; a consumer that looks in between must wait, not report
// kCorrupt. Deterministic: the test plays the creator, stage by stage.
TEST(FaultMatrix, OpenDuringCreateWaitsForTheHeader) {
  Matrix m("open_during_create");
  const std::string name = unique_name("oc");
  RegionGuard guard{name};
  const ProducerOptions o = popts(2);
  const d::Geometry g = geometry_of(o);
  const std::string path = region_path(name);
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  // Stage 1: created, size 0.
  m.child("consumer@size0", in_child([&] { return open_code(name, 100ms); }), {code(Errc::kNotFound)});
  // Stage 2: allocated, header still zero.
  ASSERT_EQ(::posix_fallocate(fd, 0, static_cast<off_t>(g.total_bytes)), 0);
  m.child("consumer@zero_header", in_child([&] { return open_code(name, 100ms); }), {code(Errc::kNotFound)});
  // Stage 3: a consumer waits while the creator writes the geometry, takes
  // the lock and publishes init_state.
  Board* b = Board::make();
  Child waiter = Child::spawn([&] {
    b->attached[0].store(1);
    return open_code(name, 20000ms);
  });
  wait_for([&] { return b->attached[0].load() == 1; });
  std::this_thread::sleep_for(20ms);
  const d::HeaderFixed h = d::make_fixed_header(g, 0);
  // Magic first, the rest a little later: the consumer must not judge a
  // half-written header either.
  ASSERT_EQ(::pwrite(fd, &h, 8, 0), 8);
  std::this_thread::sleep_for(20ms);
  ASSERT_EQ(::pwrite(fd, &h, sizeof h, 0), static_cast<ssize_t>(sizeof h));
  LockHolder lock(path);
  const std::uint32_t ready = d::kInitReady;
  ASSERT_EQ(::pwrite(fd, &ready, 4, offsetof(d::Header, init_state)), 4);
  m.child("consumer@creating", waiter.wait(30s), {0});
  ::close(fd);
  Board::destroy(b);
  m.trials = 3;
  m.finish();
}

// The real thing, randomized: consumers poll while a producer creates.
TEST(FaultMatrix, OpenRacingCreate) {
  Matrix m("open_racing_create", run_seed());
  std::mt19937_64 rng(m.seed);
  const int n = trials(40);
  for (int t = 0; t < n; ++t) {
    const std::string name = unique_name("rc");
    RegionGuard guard{name};
    Board* b = Board::make();
    const std::uint64_t ts = rng();
    auto consumer = [&](int i) {
      std::this_thread::sleep_for(std::chrono::microseconds((ts >> (8 * i)) % 5000));
      Consumer c = Consumer::open(name, copts());
      b->attached[i].store(1);
      const SyncInfo& info = c.wait_sync(20s);
      if (!read_and_check(c, info, false)) return kMismatchExit;
      b->verified[i].fetch_add(1);
      return 0;
    };
    // (Child objects are never copied: a copy's destructor would kill it.)
    Child c0 = Child::spawn([&] { return consumer(0); });
    Child c1 = Child::spawn([&] { return consumer(1); });
    Child c2 = Child::spawn([&] { return consumer(2); });
    Child prod = Child::spawn([&] {
      std::this_thread::sleep_for(std::chrono::microseconds((ts >> 32) % 5000));
      Producer p = Producer::create(name, popts(3));
      p.wait_for_consumers(3, 20s);
      EpochSync s(1, 1, ts);
      p.send(s.specs, s.ptrs);
      p.wait_drained(20s);
      return 0;
    });
    for (Child* c : {&c0, &c1, &c2}) m.child("consumer", c->wait(60s), {0});
    m.child("producer", prod.wait(60s), {0});
    m.syncs_verified += b->total_verified();
    Board::destroy(b);
    m.trial_done();
  }
  m.finish();
}

// ------------------------------------------------------------ unlink

// The name is removed mid-stream: attached peers keep their mapping and
// finish bit-exact; a new producer may create the same name meanwhile, and
// the old producer's close() must not remove the new region.
TEST(FaultMatrix, UnlinkWhileAttached) {
  Matrix m("unlink_attached", run_seed());
  std::mt19937_64 rng(m.seed);
  const int n = trials(10);
  constexpr int kSyncs = 12;
  int old_close_removed_new = 0;
  for (int t = 0; t < n; ++t) {
    const std::string name = unique_name("ul");
    RegionGuard guard{name};
    Board* b = Board::make();
    const std::uint64_t ts = rng();
    Child p1 = Child::spawn([&] {
      Producer p = Producer::create(name, popts(2));
      p.wait_for_consumers(2, 20s);
      for (std::uint64_t v = 1; v <= kSyncs; ++v) {
        EpochSync s(1, v, ts + v);
        p.send(s.specs, s.ptrs);
        b->producer_syncs.store(static_cast<int>(v));
      }
      p.wait_drained(20s);
      if (!wait_for([&] { return b->go.load() >= 1; }, 60s)) return 31;
      p.close();  // must leave the new producer's file alone
      return 0;
    });
    auto old_consumer = [&](int idx) {
      Consumer c = Consumer::open(name, copts());
      b->attached[idx].store(1);
      for (int i = 0; i < kSyncs; ++i) {
        const SyncInfo& info = c.wait_sync(20s);
        if (!read_and_check(c, info, idx == 1)) return kMismatchExit;
        b->verified[idx].fetch_add(1);
      }
      return 0;
    };
    Child c0 = Child::spawn([&] { return old_consumer(0); });
    Child c1 = Child::spawn([&] { return old_consumer(1); });
    const int at = 1 + static_cast<int>(ts % (kSyncs - 2));
    wait_for([&] { return b->producer_syncs.load() >= at; }, 20s);
    const bool removed = unlink_region(name);
    m.note("unlink", removed ? "removed" : "nothing_to_remove");
    m.child("old_consumer", c0.wait(60s), {0});
    m.child("old_consumer", c1.wait(60s), {0});
    // The name is free: a second producer takes it while the first lives.
    Child p2 = Child::spawn([&] {
      Producer p = Producer::create(name, popts(2));
      p.wait_for_consumers(1, 20s);
      EpochSync s(2, 1, ts);
      p.send(s.specs, s.ptrs);
      p.wait_drained(20s);
      if (!wait_for([&] { return b->go.load() >= 2; }, 60s)) return 31;
      return 0;
    });
    Child c2 = Child::spawn([&] {
      Consumer c = Consumer::open(name, copts());
      const SyncInfo& info = c.wait_sync(20s);
      if (epoch_of(info) != 2) return 40;
      if (!read_and_check(c, info, false)) return kMismatchExit;
      b->verified[2].fetch_add(1);
      return 0;
    });
    m.child("new_consumer", c2.wait(60s), {0});
    b->go.store(1);
    m.child("old_producer", p1.wait(60s), {0});
    if (::access(region_path(name).c_str(), F_OK) != 0) {
      ++old_close_removed_new;
      ++m.unexpected;
      m.note("old_producer", "removed_new_region");
    }
    b->go.store(2);
    m.child("new_producer", p2.wait(60s), {0});
    if (::access(region_path(name).c_str(), F_OK) == 0) {
      ++m.unexpected;
      m.note("new_producer", "left_its_name");
    }
    m.syncs_verified += b->total_verified();
    std::string why;
    if (!fresh_pair_syncs(name, &why)) {
      ++m.unreusable;
      ADD_FAILURE() << why;
    }
    Board::destroy(b);
    m.trial_done();
  }
  m.finish();
  EXPECT_EQ(old_close_removed_new, 0);
}

// ------------------------------------------------------------ wrong version

TEST(FaultMatrix, ForeignOrWrongVersionRegion) {
  Matrix m("wrong_version");
  struct Variant {
    const char* what;
    std::size_t offset;
    std::uint64_t value;
    std::size_t bytes;
    Errc expect;
  };
  const Variant variants[] = {
      {"layout_version+1", offsetof(d::HeaderFixed, layout_version), d::kLayoutVersion + 1, 4, Errc::kVersionMismatch},
      {"layout_version=0", offsetof(d::HeaderFixed, layout_version), 0, 4, Errc::kVersionMismatch},
      {"layout_version=max", offsetof(d::HeaderFixed, layout_version), 0xffffffffu, 4, Errc::kVersionMismatch},
      {"unknown_feature", offsetof(d::HeaderFixed, features), 1ull << 40, 8, Errc::kVersionMismatch},
      {"header_bytes", offsetof(d::HeaderFixed, header_bytes), 8192, 4, Errc::kCorrupt},
      {"bad_magic", offsetof(d::HeaderFixed, magic), 0x5245484f54ull, 8, Errc::kCorrupt},
  };
  for (const Variant& v : variants) {
    for (const bool live : {false, true}) {
      const std::string name = unique_name("wv");
      RegionGuard guard{name};
      make_stale_region(name);
      write_file(region_path(name), v.offset, &v.value, v.bytes);
      const std::string role = std::string(v.what) + (live ? "+live_holder" : "+no_holder");
      // A process of that other version holds the producer lock (or none).
      Board* b = Board::make();
      Child holder = Child::spawn([&] {
        if (!live) return 0;
        LockHolder lock(region_path(name));
        b->attached[0].store(1);
        ::pause();
        return 0;
      });
      if (live) wait_for([&] { return b->attached[0].load() == 1; });
      // A consumer fails at once with the typed error (never waits it out).
      m.child(role + ":consumer", in_child([&] { return open_code(name, 20000ms); }), {code(v.expect)});
      // A producer must not take over a name a live process holds...
      const int prc = in_child([&] {
        try {
          Producer p = Producer::create(name, popts(2));
          return 0;
        } catch (const Error& e) {
          return errc_exit(e);
        }
      });
      m.child(role + ":producer", prc, {live ? code(Errc::kExists) : 0});
      if (live) {
        holder.kill9();
        m.child("holder", holder.wait(10s), {}, SIGKILL);
      } else {
        m.child("holder", holder.wait(10s), {0});
      }
      // ...and once nobody holds it, the name is reusable.
      std::string why;
      if (!fresh_pair_syncs(name, &why)) {
        ++m.unreusable;
        ADD_FAILURE() << role << ": " << why;
      }
      Board::destroy(b);
      m.trial_done();
    }
  }
  m.finish();
}

// ------------------------------------------------------------ full /dev/shm

TEST(FaultMatrix, FullShmStatvfsPrecheck) {
  Matrix m("full_shm_precheck");
  const std::string name = unique_name("full");
  RegionGuard guard{name};
  struct statvfs vfs {};
  ASSERT_EQ(::statvfs(region_dir().c_str(), &vfs), 0);
  // Two slots of just over half the filesystem's whole size each: more than
  // it can ever have free, so the pre-check refuses whatever other processes
  // free meanwhile. (Asking just over the free space, as before, let a
  // region that another test removed between the two statvfs calls pass
  // the pre-check: posix_fallocate then filled the filesystem until it
  // failed, and a process beside it that wrote there got ENOSPC or SIGBUS.)
  const std::uint64_t size = static_cast<std::uint64_t>(vfs.f_blocks) * vfs.f_frsize;
  ProducerOptions o = popts(2);
  o.slot_bytes = d::align_up(size / 2 + (4 << 20), d::kDataAlign);
  if (o.slot_bytes > d::kMaxSlotBytes) {
    o.slot_bytes = d::kMaxSlotBytes;
    o.slots = static_cast<std::uint32_t>(size / d::kMaxSlotBytes + 2);
  }
  if (o.slots > d::kMaxSlots) GTEST_SKIP() << "region directory too large to fill with one request";
  for (int i = 0; i < 3; ++i) {
    try {
      Producer p = Producer::create(name, o);
      m.note("producer", "created");
      ++m.unexpected;
    } catch (const Error& e) {
      m.note("producer", errc_name(e.code()));
      if (e.code() != Errc::kRegionFull) ++m.unexpected;
      if (std::string(e.what()).find("--shm-size") == std::string::npos) {
        ++m.unexpected;
        ADD_FAILURE() << "no hint in: " << e.what();
      }
    }
    if (::access(region_path(name).c_str(), F_OK) == 0) {
      m.note("producer", "left_a_file");
      ++m.unexpected;
    }
    m.trial_done();
  }
  if (!fresh_pair_syncs(name)) ++m.unreusable;
  m.finish();
}

// posix_fallocate itself fails (RLIMIT_FSIZE makes tmpfs refuse with EFBIG,
// as a full tmpfs refuses with ENOSPC): kRegionFull, and no file is left.
TEST(FaultMatrix, FullShmFallocateFails) {
  Matrix m("full_shm_fallocate");
  const std::string name = unique_name("fsz");
  RegionGuard guard{name};
  for (int i = 0; i < 3; ++i) {
    const int rc = in_child([&] {
      ::signal(SIGXFSZ, SIG_IGN);
      struct rlimit rl {1 << 20, 1 << 20};
      if (::setrlimit(RLIMIT_FSIZE, &rl) != 0) return 41;
      try {
        Producer p = Producer::create(name, popts(2));
        return 0;
      } catch (const Error& e) {
        return errc_exit(e);
      }
    });
    m.child("producer", rc, {code(Errc::kRegionFull)});
    if (::access(region_path(name).c_str(), F_OK) == 0) {
      m.note("producer", "left_a_file");
      ++m.unexpected;
    }
    m.trial_done();
  }
  if (!fresh_pair_syncs(name)) ++m.unreusable;
  m.finish();
}

// A real, small tmpfs filled up by another file (needs CAP_SYS_ADMIN for a
// private mount namespace: skipped elsewhere).
TEST(FaultMatrix, FullShmRealTmpfs) {
  Matrix m("full_shm_tmpfs");
  const int rc = in_child([&] {
    if (::unshare(CLONE_NEWNS) != 0) return 77;
    if (::mount("none", "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) return 77;
    char dir[] = "/tmp/shmcast-full-XXXXXX";
    if (!::mkdtemp(dir)) return 77;
    if (::mount("tmpfs", dir, "tmpfs", 0, "size=12m,mode=1777") != 0) return 77;
    ::setenv("SHMCAST_DIR", dir, 1);
    const std::string filler = std::string(dir) + "/filler";
    int fd = ::open(filler.c_str(), O_RDWR | O_CREAT, 0600);
    if (fd < 0 || ::posix_fallocate(fd, 0, 8 << 20) != 0) return 42;
    ::close(fd);
    int result = 0;
    try {
      Producer p = Producer::create("full", popts(2));  // needs 6 MiB, 4 MiB free
      result = 43;
    } catch (const Error& e) {
      if (e.code() != Errc::kRegionFull) result = errc_exit(e);
    }
    if (result == 0 && ::access((std::string(dir) + "/shmcast.full").c_str(), F_OK) == 0) result = 44;
    // Space freed: the same name works.
    ::unlink(filler.c_str());
    if (result == 0 && !fresh_pair_syncs("full")) result = 45;
    ::umount(dir);
    ::rmdir(dir);
    return result;
  });
  if (rc == 77) GTEST_SKIP() << "cannot mount a private tmpfs here";
  m.child("producer", rc, {0});
  m.trials = 1;
  m.finish();
}

// ------------------------------------------------------------ truncation

// Open-time check: whatever size the file was cut to, a consumer gets a
// clean kCorrupt, never SIGBUS. The one exception is 0 bytes: the creator
// takes the producer lock as soon as the file exists and allocates it after,
// so a 0-byte file (locked or not) is what a region being created looks
// like; the consumer waits for it and reports kNotFound at its deadline.
TEST(FaultMatrix, TruncatedBeforeOpen) {
  Matrix m("truncated_before_open");
  const ProducerOptions o = popts(2);
  const std::uint64_t total = geometry_of(o).total_bytes;
  const std::uint64_t sizes[] = {0,           1,         100,        d::kHeaderBytes - 1, d::kHeaderBytes,
                                 8192,        1u << 20,  total / 2,  total - 4096,        total - 1,
                                 total + 4096};
  for (const bool producer_alive : {true, false}) {
    for (std::uint64_t size : sizes) {
      const std::string name = unique_name("tr");
      RegionGuard guard{name};
      Board* b = Board::make();
      Child prod = Child::spawn([&] {
        Producer p = Producer::create(name, o);
        b->producer_state.store(1);
        ::pause();  // never touches the region again: killed below
        return 0;
      });
      wait_for([&] { return b->producer_state.load() == 1; });
      if (!producer_alive) {
        prod.kill9();
        prod.wait(10s);
      }
      ASSERT_EQ(::truncate(region_path(name).c_str(), static_cast<off_t>(size)), 0);
      const std::string role = std::string(producer_alive ? "live" : "dead") + "@" + std::to_string(size);
      const int rc = in_child([&] { return open_code(name, 300ms); });
      if (size == 0)
        m.child(role, rc, {code(Errc::kNotFound)});
      else
        m.child(role, rc, {code(Errc::kCorrupt)});
      if (producer_alive) {
        prod.kill9();
        m.child("producer", prod.wait(10s), {}, SIGKILL);
      }
      std::string why;
      if (!fresh_pair_syncs(name, &why)) {
        ++m.unreusable;
        ADD_FAILURE() << role << ": " << why;
      }
      Board::destroy(b);
      m.trial_done();
    }
  }
  m.finish();
}

// Cut between syncs (header and manifest still backed): the producer's next
// begin_sync and a consumer's next wait_sync report kCorrupt instead of
// touching the missing pages.
TEST(FaultMatrix, TruncatedBetweenSyncs) {
  Matrix m("truncated_between_syncs");
  const ProducerOptions o = popts(2);
  const std::uint64_t total = geometry_of(o).total_bytes;
  for (int variant = 0; variant < 2; ++variant) {
    const std::string name = unique_name("tb");
    RegionGuard guard{name};
    Board* b = Board::make();
    // variant 0: truncate after sync 1, then the producer begins sync 2.
    // variant 1: the producer announces sync 2, then truncate, then the
    // consumer asks for it.
    Child prod = Child::spawn([&] {
      Producer p = Producer::create(name, o);
      p.wait_for_consumers(1, 20s);
      EpochSync s1(1, 1, 1, 256 << 10);
      p.send(s1.specs, s1.ptrs);
      p.wait_drained(20s);
      EpochSync s2(1, 2, 2, 256 << 10);
      if (variant == 1) p.begin_sync(s2.specs);
      b->producer_state.store(1);
      if (!wait_for([&] { return b->go.load() >= 1; }, 30s)) return 31;
      if (variant == 1) {
        ::pause();
        return 0;
      }
      try {
        p.begin_sync(s2.specs);
        return 0;
      } catch (const Error& e) {
        return errc_exit(e);
      }
    });
    Child cons = Child::spawn([&] {
      Consumer c = Consumer::open(name, copts());
      const SyncInfo& info = c.wait_sync(20s);
      if (!read_and_check(c, info, false)) return kMismatchExit;
      b->verified[0].fetch_add(1);
      if (!wait_for([&] { return b->go.load() >= 2; }, 30s)) return 31;
      try {
        c.wait_sync(variant == 1 ? 20s : 300ms);
        return 0;
      } catch (const Error& e) {
        return errc_exit(e);
      }
    });
    wait_for([&] { return b->producer_state.load() == 1; });
    ASSERT_EQ(::truncate(region_path(name).c_str(), static_cast<off_t>(total / 2)), 0);
    b->go.store(1);
    if (variant == 0) {
      m.child("producer_begin_sync", prod.wait(30s), {code(Errc::kCorrupt)});
      b->go.store(2);
      // The producer process has exited (waited above) after closing the
      // region on its way out (Producer's destructor), and it never
      // announced sync 2: the consumer must be told kClosed, nothing else.
      m.child("consumer_wait_sync", cons.wait(30s), {code(Errc::kClosed)});
    } else {
      b->go.store(2);
      m.child("consumer_wait_sync", cons.wait(30s), {code(Errc::kCorrupt)});
      prod.kill9();
      m.child("producer", prod.wait(10s), {}, SIGKILL);
    }
    m.syncs_verified += b->total_verified();
    std::string why;
    if (!fresh_pair_syncs(name, &why)) {
      ++m.unreusable;
      ADD_FAILURE() << why;
    }
    Board::destroy(b);
    m.trial_done();
  }
  m.finish();
}
