// FileWriter: io_uring when allowed, pwrite otherwise; same bytes either way.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <random>
#include <vector>

#include "file_io.hpp"

using shmcast::detail::FileWriter;

namespace {

std::string temp_path(const char* tag) {
  return "/tmp/shmcast-fileio-" + std::string(tag) + "-" + std::to_string(::getpid());
}

std::vector<char> read_all(const std::string& path) {
  std::vector<char> out;
  int fd = ::open(path.c_str(), O_RDONLY);
  char buf[65536];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof buf)) > 0) out.insert(out.end(), buf, buf + n);
  ::close(fd);
  return out;
}

// Writes 200 pieces of random sizes in shuffled order, then checks the file.
void write_shuffled(bool allow_uring, std::string* backend) {
  const std::string path = temp_path(allow_uring ? "uring" : "pwrite");
  ::unlink(path.c_str());
  std::mt19937_64 rng(allow_uring ? 1 : 2);
  std::vector<char> want(3 << 20);
  for (auto& c : want) c = static_cast<char>(rng());
  std::vector<std::pair<std::size_t, std::size_t>> pieces;
  for (std::size_t off = 0; off < want.size();) {
    const std::size_t n = std::min<std::size_t>(1 + rng() % 40000, want.size() - off);
    pieces.push_back({off, n});
    off += n;
  }
  std::shuffle(pieces.begin(), pieces.end(), rng);
  FileWriter w;
  ASSERT_EQ(w.open(path, allow_uring), 0);
  *backend = w.backend();
  for (auto [off, n] : pieces) ASSERT_EQ(w.write_at(want.data() + off, n, off), 0);
  ASSERT_EQ(w.fsync(), 0);
  EXPECT_EQ(w.bytes_written(), want.size());
  ASSERT_EQ(w.close(), 0);
  EXPECT_EQ(read_all(path), want);
  ::unlink(path.c_str());
}

}  // namespace

TEST(FileWriter, PwriteBackendWritesEveryByte) {
  std::string backend;
  write_shuffled(false, &backend);
  EXPECT_EQ(backend, "pwrite");
}

TEST(FileWriter, DefaultBackendWritesEveryByte) {
  // io_uring where the kernel and seccomp allow it; pwrite elsewhere.
  std::string backend;
  write_shuffled(true, &backend);
  EXPECT_TRUE(backend == "io_uring" || backend == "pwrite") << backend;
}

TEST(FileWriter, RefusesToOverwrite) {
  const std::string path = temp_path("excl");
  FileWriter a;
  ASSERT_EQ(a.open(path), 0);
  FileWriter b;
  EXPECT_EQ(b.open(path), -EEXIST);
  a.close();
  ::unlink(path.c_str());
}

TEST(FileWriter, EnvironmentCanDisableUring) {
  ::setenv("SHMCAST_NO_URING", "1", 1);
  const std::string path = temp_path("env");
  FileWriter w;
  ASSERT_EQ(w.open(path), 0);
  EXPECT_STREQ(w.backend(), "pwrite");
  EXPECT_EQ(w.fallback_reason(), "disabled");
  w.close();
  ::unsetenv("SHMCAST_NO_URING");
  ::unlink(path.c_str());
}

TEST(FileWriter, WriteBeforeOpenIsEbadf) {
  FileWriter w;
  char c = 0;
  EXPECT_EQ(w.write_at(&c, 1, 0), -EBADF);
}
