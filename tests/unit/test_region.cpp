// The named region: names, modes, exclusivity, space checks, ring arithmetic.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <fcntl.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "shm/region.hpp"
#include "shmcast/files.hpp"
#include "protocol/ring.hpp"
#include "support.hpp"

using namespace shmcast;
using namespace shmcast_test;

TEST(Names, AcceptsOrdinaryNames) {
  EXPECT_EQ(validate_name("actor-0"), "");
  EXPECT_EQ(validate_name("a.b_c-9"), "");
}

TEST(Names, RejectsBadNames) {
  for (const char* bad : {"", ".hidden", "-x", "a/b", "../etc", "a b", "na\xc3\xafve", "x\n"})
    EXPECT_NE(validate_name(bad), "") << bad;
  EXPECT_NE(validate_name(std::string(129, 'a')), "");
}

TEST(Names, CreateWithBadNameThrowsBadName) {
  try {
    Producer::create("../escape");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kBadName);
  }
  try {
    Consumer::open("a/b");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kBadName);
  }
}

TEST(Region, CreatedMode0600AndExclusive) {
  const std::string name = unique_name("mode");
  RegionGuard g{name};
  ProducerOptions o;
  o.slot_bytes = 2 << 20;
  o.pin = Pin::kNo;
  Producer p = Producer::create(name, o);
  struct stat st {};
  ASSERT_EQ(::stat(region_path(name).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(static_cast<std::uint64_t>(st.st_size), p.region_bytes());
  // A second producer on the same name while the first is alive: kExists.
  try {
    Producer::create(name, o);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kExists);
  }
}

TEST(Region, GroupAccessGives0660) {
  const std::string name = unique_name("grp");
  RegionGuard g{name};
  ProducerOptions o;
  o.slot_bytes = 2 << 20;
  o.group_access = true;
  o.pin = Pin::kNo;
  Producer p = Producer::create(name, o);
  struct stat st {};
  ASSERT_EQ(::stat(region_path(name).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0660u);
}

TEST(Region, CloseUnlinksTheName) {
  const std::string name = unique_name("close");
  ProducerOptions o;
  o.slot_bytes = 2 << 20;
  o.pin = Pin::kNo;
  {
    Producer p = Producer::create(name, o);
    EXPECT_EQ(::access(region_path(name).c_str(), F_OK), 0);
  }
  EXPECT_NE(::access(region_path(name).c_str(), F_OK), 0);
}

TEST(Region, LargerThanFreeSpaceIsAClearErrorNotSigbus) {
  struct statvfs v {};
  ASSERT_EQ(::statvfs(region_dir().c_str(), &v), 0);
  const std::uint64_t total = static_cast<std::uint64_t>(v.f_blocks) * v.f_frsize;
  const std::string name = unique_name("full");
  RegionGuard g{name};
  ProducerOptions o;
  o.slot_bytes = 1ull << 30;
  o.slots = static_cast<std::uint32_t>(total / (1ull << 30) + 4);
  o.pin = Pin::kNo;
  try {
    Producer::create(name, o);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kRegionFull);
    const std::string msg = e.what();
    EXPECT_NE(msg.find("free"), std::string::npos) << msg;
    EXPECT_NE(msg.find("--shm-size"), std::string::npos) << msg;
  }
  EXPECT_NE(::access(region_path(name).c_str(), F_OK), 0) << "a failed create must not leave a file behind";
}

TEST(Region, DirectoryOverrideWithShmcastDir) {
  char tmpl[] = "/dev/shm/shmcast-dir-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  ::setenv("SHMCAST_DIR", tmpl, 1);
  const std::string name = unique_name("dir");
  {
    ProducerOptions o;
    o.slot_bytes = 2 << 20;
    o.pin = Pin::kNo;
    Producer p = Producer::create(name, o);
    EXPECT_EQ(p.path(), std::string(tmpl) + "/shmcast." + name);
    EXPECT_EQ(::access(p.path().c_str(), F_OK), 0);
  }
  ::unsetenv("SHMCAST_DIR");
  ::rmdir(tmpl);
}

TEST(Region, MissingDirectoryIsNotFound) {
  ::setenv("SHMCAST_DIR", "/nonexistent/shmcast-dir", 1);
  try {
    ProducerOptions o;
    o.pin = Pin::kNo;
    o.slot_bytes = 2 << 20;
    Producer::create("x", o);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kNotFound);
  }
  ::unsetenv("SHMCAST_DIR");
}

TEST(Region, OpenMissingRegionTimesOutWithNotFound) {
  ConsumerOptions co;
  co.open_timeout = std::chrono::milliseconds(50);
  co.pin = Pin::kNo;
  try {
    Consumer::open(unique_name("absent"), co);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kNotFound);
  }
}

TEST(RingMath, ChunksAndLengths) {
  using shmcast::detail::chunk_count;
  using shmcast::detail::chunk_len;
  EXPECT_EQ(chunk_count(0, 10), 0u);
  EXPECT_EQ(chunk_count(1, 10), 1u);
  EXPECT_EQ(chunk_count(10, 10), 1u);
  EXPECT_EQ(chunk_count(11, 10), 2u);
  EXPECT_EQ(chunk_len(0, 25, 10), 10u);
  EXPECT_EQ(chunk_len(2, 25, 10), 5u);
  EXPECT_EQ(chunk_len(1, 20, 10), 10u);
}

TEST(RingMath, SeatWordPacksGenerationAndState) {
  using namespace shmcast::detail;
  const std::uint64_t w = make_seat_word(77, kSeatEvicted);
  EXPECT_EQ(seat_gen(w), 77u);
  EXPECT_EQ(seat_state(w), kSeatEvicted);
}

TEST(Errors, CarryCodeAndAdvice) {
  Error e(Errc::kRegionFull, "need more", 28);
  EXPECT_EQ(e.code(), Errc::kRegionFull);
  EXPECT_EQ(e.sys_errno(), 28);
  EXPECT_NE(std::string(e.what()).find("RegionFull"), std::string::npos);
}

// ---------------------------------------------------------------- shmcast/files.hpp

namespace {

struct ScratchDir {
  std::string path;
  ScratchDir() {
    char templ[] = "/tmp/shmcast-files-XXXXXX";
    path = ::mkdtemp(templ);
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string file(const std::string& n) const { return path + "/" + n; }
};

std::string read_text(const std::string& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::size_t entries(const std::string& dir) {
  std::size_t n = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    (void)e;
    ++n;
  }
  return n;
}

}  // namespace

// The one rule every created file follows: a new name only (a link, a FIFO
// or a file at it is refused, never opened), the exact mode whatever the
// umask, set on the descriptor.
TEST(Files, CreateFileRefusesAnythingAtTheNameAndSetsTheExactMode) {
  ScratchDir d;
  const std::string target = d.file("target");
  std::ofstream(target) << "keep";
  ASSERT_EQ(::symlink(target.c_str(), d.file("link").c_str()), 0);
  ASSERT_EQ(::symlink("/nonexistent/x", d.file("dangling").c_str()), 0);
  ASSERT_EQ(::mkfifo(d.file("fifo").c_str(), 0600), 0);
  for (const char* n : {"link", "dangling", "fifo", "target"})
    EXPECT_EQ(code_of([&] { ::close(create_file(d.file(n), 0600)); }), Errc::kExists) << n;
  EXPECT_EQ(read_text(target), "keep");
  EXPECT_EQ(code_of([&] { ::close(create_file(d.file("missing/x"), 0600)); }), Errc::kNotFound);
  const mode_t old = ::umask(077);
  const int fd = create_file(d.file("new"), 0640);
  ::umask(old);
  struct stat st {};
  ASSERT_EQ(::fstat(fd, &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0640u);
  EXPECT_NE(::fcntl(fd, F_GETFD) & FD_CLOEXEC, 0);
  ::close(fd);
  std::string p1, p2;
  const int a = create_temp_file(d.path, ".x.tmp.", 0600, &p1), b = create_temp_file(d.path + "/", ".x.tmp.", 0600, &p2);
  EXPECT_NE(p1, p2);
  EXPECT_EQ(p1.rfind(d.path + "/.x.tmp.", 0), 0u) << p1;
  EXPECT_EQ(p1.size(), (d.path + "/.x.tmp.").size() + 12);
  ::close(a);
  ::close(b);
}

// replace_file() over a link replaces the name; the link's target is not
// written or chmodded, and no temporary file is left, also when it fails.
TEST(Files, ReplaceFileReplacesALinkAtTheNameNeverItsTarget) {
  ScratchDir d;
  const std::string target = d.file("target"), status = d.file("status.json");
  std::ofstream(target) << "keep";
  ASSERT_EQ(::chmod(target.c_str(), 0644), 0);
  ASSERT_EQ(::symlink(target.c_str(), status.c_str()), 0);
  ASSERT_EQ(::symlink(target.c_str(), (status + ".tmp").c_str()), 0);
  replace_file(status, "{\"v\":1}\n", 0600);
  replace_file(status, "{\"v\":2}\n", 0600);
  struct stat st {};
  ASSERT_EQ(::lstat(status.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_EQ(read_text(status), "{\"v\":2}\n");
  EXPECT_EQ(read_text(target), "keep");
  ASSERT_EQ(::stat(target.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0644u);
  EXPECT_EQ(entries(d.path), 3u);  // target, status.json, the untouched status.json.tmp link
  EXPECT_EQ(code_of([&] { replace_file(d.file("missing/status.json"), "x", 0600); }), Errc::kNotFound);
  EXPECT_EQ(code_of([&] { replace_file(d.path + "/", "x", 0600); }), Errc::kInvalidArgument);
  EXPECT_EQ(entries(d.path), 3u);
}
