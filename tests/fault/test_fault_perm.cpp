// Fault matrix, part 4: another uid. A region created with the defaults is
// mode 0600 (0660 with group_access), owned by the producer's uid: a process
// of another uid can neither open, read, resize, remove nor replace it.
// Needs root (to setuid to nobody); skipped otherwise.
#include <grp.h>
#include <linux/close_range.h>
#include <sys/stat.h>

#include "fault_support.hpp"

using namespace fault;

namespace {

constexpr uid_t kNobody = 65534;
constexpr gid_t kNogroup = 65534;

// Runs the attacks as nobody; bit i set = attack i got through.
int attack_as_nobody(const std::string& name) {
  // A forked child inherits the test's descriptors of the region (and their
  // OFD locks): drop them, so this is a stranger with nothing but the name.
  ::close_range(3, ~0u, 0);
  if (::setgroups(0, nullptr) != 0 || ::setgid(kNogroup) != 0 || ::setuid(kNobody) != 0) return 60;
  if (::geteuid() != kNobody) return 61;
  const std::string path = region_path(name);
  int breaches = 0;
  // 1: attach as a consumer (needs read-write).
  try {
    Consumer c = Consumer::open(name, copts(300ms));
    breaches |= 1;
  } catch (const Error& e) {
    if (e.code() != Errc::kPermission || e.sys_errno() != EACCES) {
      std::fprintf(stderr, "open: %s\n", e.what());
      breaches |= 1;
    }
  }
  // 2, 3: read or write the bytes directly.
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd >= 0 || errno != EACCES) breaches |= 2;
  if (fd >= 0) ::close(fd);
  fd = ::open(path.c_str(), O_RDWR);
  if (fd >= 0 || errno != EACCES) breaches |= 4;
  if (fd >= 0) ::close(fd);
  // 4: resize it.
  if (::truncate(path.c_str(), 0) == 0 || errno != EACCES) breaches |= 8;
  // 5: remove the name (/dev/shm is sticky: only the owner may).
  try {
    if (unlink_region(name)) breaches |= 16;
  } catch (const Error& e) {
    if (e.code() != Errc::kPermission) breaches |= 16;
  }
  // 6: take the name over with a producer of its own.
  try {
    Producer p = Producer::create(name, popts(2));
    breaches |= 32;
  } catch (const Error& e) {
    if (e.code() != Errc::kPermission && e.code() != Errc::kExists) breaches |= 32;
  }
  return breaches;
}

}  // namespace

TEST(FaultMatrix, OtherUidCannotOpenReadOrChangeTheRegion) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to setuid to nobody";
  Matrix m("permissions_other_uid");
  const char* attacks[] = {"consumer_open", "read", "write", "truncate", "unlink", "replace"};
  for (const bool group_access : {false, true}) {
    const std::string name = unique_name("perm");
    RegionGuard guard{name};
    ProducerOptions o = popts(2);
    o.group_access = group_access;
    const mode_t old_umask = ::umask(0);  // the mode must not depend on the umask
    Producer p = Producer::create(name, o);
    ::umask(old_umask);
    struct stat st {};
    ASSERT_EQ(::stat(region_path(name).c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 07777, group_access ? 0660u : 0600u);
    EXPECT_EQ(st.st_uid, ::geteuid());
    const std::uint64_t size_before = static_cast<std::uint64_t>(st.st_size);

    const int rc = Child::spawn([&] { return attack_as_nobody(name); }).wait(60s);
    const std::string variant = group_access ? "0660:" : "0600:";
    if (rc < 0 || rc >= 60) {
      m.child(variant + "attacker", rc, {0});
    } else {
      for (int i = 0; i < 6; ++i) m.note(variant + attacks[i], (rc & (1 << i)) ? "BREACH" : "denied");
      if (rc != 0) ++m.unexpected;
    }
    // The region is untouched and still works.
    EXPECT_EQ(file_size(region_path(name)), size_before);
    ConsumerOptions co = copts(5000ms);
    co.group_access = group_access;  // a 0660 region is trusted only by consumers that ask for it
    Consumer c = Consumer::open(name, co);
    EpochSync s(1, 1, 3, 256 << 10);
    p.send(s.specs, s.ptrs);
    const SyncInfo& info = c.wait_sync(5s);
    if (read_and_check(c, info, false))
      ++m.syncs_verified;
    else
      ++m.mismatches;
    m.trials += 6;
  }
  m.finish();
}
