// Reading tensors: every I/O path (io_uring O_DIRECT, io_uring buffered,
// pread) forced in turn and asserted from the stats, the automatic choice
// (cached -> buffered, evicted -> O_DIRECT, SHMCAST_NO_URING -> pread), and
// every byte compared with what was written.
#include <sys/mman.h>

#include <cstdlib>
#include <numeric>

#include "st_support.hpp"

using namespace st_test;
namespace sf = shmcast::safetensors;
using shmcast::Errc;

namespace {

// A checkpoint whose tensors straddle blocks and windows: sizes from 0 to a
// few hundred KiB, odd offsets, one tensor larger than the test's window.
std::vector<Tensor> awkward_tensors(std::uint64_t seed) {
  std::vector<Tensor> ts;
  const std::int64_t sizes[] = {1, 4095, 4096, 4097, 0, 12345, 70000, 3, 300000, 8191, 65536, 1, 100003};
  int i = 0;
  for (std::int64_t n : sizes) {
    ts.push_back(make_tensor("t" + std::to_string(i), "U8", {n}, seed + static_cast<std::uint64_t>(i)));
    ++i;
  }
  ts.push_back(make_tensor("bf", "BF16", {33, 65}, seed + 99));
  return ts;
}

// Equal bytes (memcmp must not see the null data() of an empty vector).
bool same(const void* got, const std::vector<std::uint8_t>& want) {
  return want.empty() || std::memcmp(got, want.data(), want.size()) == 0;
}

bool uring_available() {
  // io_uring_setup succeeds here? A read forced through io_uring tells.
  TempDir d;
  write_file(d / "p.safetensors", file_bytes({make_tensor("w", "U8", {8}, 1)}));
  const sf::Checkpoint c = sf::open_checkpoint((d / "p.safetensors").string());
  std::vector<std::uint8_t> buf(8);
  std::vector<void*> dst = {buf.data()};
  sf::ReadOptions o;
  o.path = sf::IoPath::kBuffered;
  try {
    sf::read_tensors(c, dst, o);
    return true;
  } catch (const shmcast::Error&) {
    return false;
  }
}

sf::ReadOptions small(sf::IoPath p) {
  sf::ReadOptions o;
  o.path = p;
  o.request_bytes = 16 << 10;
  o.window_bytes = 64 << 10;  // the 300000-byte tensor gets a window of its own
  o.windows = 3;
  o.queue_depth = 8;
  return o;
}

// read_tensors into destinations of every alignment; returns the stats.
sf::ReadStats check_read_tensors(const sf::Checkpoint& c, const std::vector<Tensor>& ts, const sf::ReadOptions& o,
                                 bool aligned) {
  // One buffer per tensor; aligned: placed so that dst - offset is a
  // multiple of 4096 (O_DIRECT can land there); else deliberately off by 1.
  std::vector<void*> mem;
  std::vector<void*> dst;
  for (std::size_t i = 0; i < ts.size(); ++i) {
    const std::uint64_t off = c.tensors()[i].offset;
    const std::size_t n = ts[i].data.size() + 2 * 4096;
    void* m = std::aligned_alloc(4096, (n + 4095) / 4096 * 4096);
    mem.push_back(m);
    auto* p = static_cast<std::uint8_t*>(m) + (off % 4096) + (aligned ? 0 : 1);
    std::memset(m, 0xEE, n);
    dst.push_back(p);
  }
  const sf::ReadStats s = sf::read_tensors(c, dst, o);
  for (std::size_t i = 0; i < ts.size(); ++i) {
    EXPECT_TRUE(same(dst[i], ts[i].data)) << ts[i].name;
    std::free(mem[i]);
  }
  return s;
}

sf::ReadStats check_stream(const sf::Checkpoint& c, const std::vector<Tensor>& ts, const sf::ReadOptions& o) {
  std::vector<int> seen(ts.size(), 0);
  std::size_t next = 0;
  const sf::ReadStats s = sf::stream_tensors(
      c,
      [&](std::size_t i, const std::byte* bytes) {
        EXPECT_EQ(i, next++);  // file order
        seen[i]++;
        EXPECT_TRUE(same(bytes, ts[i].data)) << ts[i].name;
      },
      o);
  for (std::size_t i = 0; i < ts.size(); ++i) EXPECT_EQ(seen[i], 1) << ts[i].name;
  return s;
}

class ReadPaths : public ::testing::Test {
 protected:
  void SetUp() override {
    ts_ = awkward_tensors(5);
    path_ = d_ / "x.safetensors";
    write_file(path_, file_bytes(ts_));
  }
  TempDir d_;
  fs::path path_;
  std::vector<Tensor> ts_;
};

}  // namespace

TEST_F(ReadPaths, DirectIoUring) {
  if (!uring_available()) GTEST_SKIP() << "io_uring is not available here";
  if (!supports_direct(d_.path)) GTEST_SKIP() << d_.path << " does not support O_DIRECT";
  const sf::Checkpoint c = sf::open_checkpoint(path_.string());
  sf::ReadStats s = check_stream(c, ts_, small(sf::IoPath::kDirect));
  EXPECT_EQ(s.path, "direct");
  EXPECT_GT(s.direct_bytes, c.payload_bytes());  // every byte (and alignment overhead) through O_DIRECT
  EXPECT_TRUE(s.registered_buffers) << s.fallback_reason;
  EXPECT_EQ(s.queue_depth, 8u);
  EXPECT_GE(s.staging_bytes, 3u * 64 * 1024);
  EXPECT_EQ(s.fallback_reason.find("finished buffered"), std::string::npos) << s.fallback_reason;
  s = check_read_tensors(c, ts_, small(sf::IoPath::kDirect), true);
  EXPECT_EQ(s.path, "direct");
  EXPECT_GT(s.direct_bytes, 0u);  // the block-aligned middles of the tensors
  s = check_read_tensors(c, ts_, small(sf::IoPath::kDirect), false);
  EXPECT_EQ(s.direct_bytes, 0u);  // misaligned destinations go through the page cache
}

TEST_F(ReadPaths, DirectWithoutRegisteredBuffers) {
  if (!uring_available()) GTEST_SKIP() << "io_uring is not available here";
  if (!supports_direct(d_.path)) GTEST_SKIP() << d_.path << " does not support O_DIRECT";
  const sf::Checkpoint c = sf::open_checkpoint(path_.string());
  sf::ReadOptions o = small(sf::IoPath::kDirect);
  o.register_buffers = false;
  o.queue_depth = 1;
  const sf::ReadStats s = check_stream(c, ts_, o);
  EXPECT_EQ(s.path, "direct");
  EXPECT_FALSE(s.registered_buffers);
}

TEST_F(ReadPaths, BufferedIoUring) {
  if (!uring_available()) GTEST_SKIP() << "io_uring is not available here";
  const sf::Checkpoint c = sf::open_checkpoint(path_.string());
  sf::ReadStats s = check_stream(c, ts_, small(sf::IoPath::kBuffered));
  EXPECT_EQ(s.path, "buffered");
  EXPECT_EQ(s.direct_bytes, 0u);
  EXPECT_EQ(s.bytes, c.payload_bytes());  // buffered windows read only the tensors' bytes
  s = check_read_tensors(c, ts_, small(sf::IoPath::kBuffered), false);
  EXPECT_EQ(s.path, "buffered");
  EXPECT_EQ(s.bytes, c.payload_bytes());
}

TEST_F(ReadPaths, Pread) {
  const sf::Checkpoint c = sf::open_checkpoint(path_.string());
  sf::ReadOptions o = small(sf::IoPath::kPread);
  o.pread_threads = 3;
  sf::ReadStats s = check_stream(c, ts_, o);
  EXPECT_EQ(s.path, "pread");
  EXPECT_EQ(s.queue_depth, 3u);
  EXPECT_FALSE(s.registered_buffers);
  EXPECT_EQ(s.bytes, c.payload_bytes());
  s = check_read_tensors(c, ts_, o, true);
  EXPECT_EQ(s.path, "pread");
  EXPECT_EQ(s.direct_bytes, 0u);
}

TEST_F(ReadPaths, AutoIsBufferedForACachedFileAndDirectForAnEvictedOne) {
  if (!uring_available()) GTEST_SKIP() << "io_uring is not available here";
  if (!supports_direct(d_.path)) GTEST_SKIP() << d_.path << " does not support O_DIRECT";
  {
    const sf::Checkpoint c = sf::open_checkpoint(path_.string());
    (void)check_stream(c, ts_, small(sf::IoPath::kPread));  // now it is in the page cache
    const sf::ReadStats s = check_stream(c, ts_, small(sf::IoPath::kAuto));
    EXPECT_EQ(s.path, "buffered");
    EXPECT_NE(s.fallback_reason.find("page cache"), std::string::npos) << s.fallback_reason;
  }
  evict(path_);
  const sf::Checkpoint c = sf::open_checkpoint(path_.string());  // reads only the header
  evict(path_);
  const sf::ReadStats s = check_stream(c, ts_, small(sf::IoPath::kAuto));
  EXPECT_EQ(s.path, "direct") << s.fallback_reason;
}

TEST_F(ReadPaths, EnvironmentSelectsPreadInAuto) {
  ::setenv("SHMCAST_NO_URING", "1", 1);
  const sf::Checkpoint c = sf::open_checkpoint(path_.string());
  const sf::ReadStats s = check_stream(c, ts_, small(sf::IoPath::kAuto));
  ::unsetenv("SHMCAST_NO_URING");
  EXPECT_EQ(s.path, "pread");
  EXPECT_NE(s.fallback_reason.find("SHMCAST_NO_URING"), std::string::npos) << s.fallback_reason;
}

TEST_F(ReadPaths, ShardedAcrossFilesWithManyRequestsInFlight) {
  TempDir d;
  const auto all = make_sharded(d.path, 4, 5, 77);
  const sf::Checkpoint c = sf::open_checkpoint(d.path.string());
  for (sf::IoPath p : {sf::IoPath::kAuto, sf::IoPath::kPread}) {
    sf::ReadOptions o = small(p);
    o.window_bytes = 4096;  // many small windows, several files in flight
    o.request_bytes = 4096;
    o.windows = 8;
    o.queue_depth = 64;
    (void)check_stream(c, all, o);
    (void)check_read_tensors(c, all, o, true);
  }
}

TEST_F(ReadPaths, NullDestinationsAreSkipped) {
  const sf::Checkpoint c = sf::open_checkpoint(path_.string());
  std::vector<std::uint8_t> one(ts_[1].data.size());
  std::vector<void*> dst(ts_.size(), nullptr);
  dst[1] = one.data();
  (void)sf::read_tensors(c, dst, small(sf::IoPath::kAuto));
  EXPECT_EQ(one, ts_[1].data);
  dst.pop_back();
  EXPECT_THROW(sf::read_tensors(c, dst, {}), shmcast::Error);
}

TEST_F(ReadPaths, TruncatedAfterValidationIsAnError) {
  const sf::Checkpoint c = sf::open_checkpoint(path_.string());
  fs::resize_file(path_, fs::file_size(path_) - 1000);
  for (sf::IoPath p : {sf::IoPath::kAuto, sf::IoPath::kBuffered, sf::IoPath::kPread}) {
    if (p == sf::IoPath::kBuffered && !uring_available()) continue;
    try {
      (void)check_stream(c, ts_, small(p));
      ADD_FAILURE() << "a truncated file was read without an error (" << sf::io_path_name(p) << ")";
    } catch (const shmcast::Error& e) {
      EXPECT_EQ(e.code(), Errc::kCorrupt) << e.what();
      EXPECT_NE(std::string(e.what()).find("truncated"), std::string::npos) << e.what();
    }
  }
}

TEST_F(ReadPaths, AnExceptionFromTheCallbackStopsCleanly) {
  const sf::Checkpoint c = sf::open_checkpoint(path_.string());
  int calls = 0;
  EXPECT_THROW(sf::stream_tensors(
                   c,
                   [&](std::size_t, const std::byte*) {
                     if (++calls == 3) throw std::runtime_error("stop");
                   },
                   small(sf::IoPath::kAuto)),
               std::runtime_error);
  EXPECT_EQ(calls, 3);
}

TEST_F(ReadPaths, BadOptionsAreRefused) {
  const sf::Checkpoint c = sf::open_checkpoint(path_.string());
  auto bad = [&](auto tweak) {
    sf::ReadOptions o;
    tweak(o);
    try {
      sf::stream_tensors(c, [](std::size_t, const std::byte*) {}, o);
      ADD_FAILURE() << "accepted";
    } catch (const shmcast::Error& e) {
      EXPECT_EQ(e.code(), Errc::kInvalidArgument) << e.what();
    }
  };
  bad([](sf::ReadOptions& o) { o.request_bytes = 5000; });
  bad([](sf::ReadOptions& o) { o.request_bytes = 1024; });
  bad([](sf::ReadOptions& o) { o.queue_depth = 0; });
  bad([](sf::ReadOptions& o) { o.windows = 1; });
  bad([](sf::ReadOptions& o) { o.window_bytes = 4096; });  // smaller than request_bytes
  bad([](sf::ReadOptions& o) { o.pread_threads = 0; });
}

TEST(ReadEmpty, CheckpointWithoutTensors) {
  TempDir d;
  write_file(d / "e.safetensors", raw_file("{}      ", 0));
  const sf::Checkpoint c = sf::open_checkpoint((d / "e.safetensors").string());
  int calls = 0;
  const sf::ReadStats s = sf::stream_tensors(c, [&](std::size_t, const std::byte*) { ++calls; });
  EXPECT_EQ(calls, 0);
  EXPECT_EQ(s.bytes, 0u);
}

TEST_F(ReadPaths, OneReaderServesManyCalls) {
  // The same Reader: the same checkpoint twice (staging and registration
  // kept), a larger one (staging grows, registered again), after a callback
  // threw mid-stream (the reads it had queued land before the next call
  // reuses the windows), and read_tensors in between.
  TempDir d2;
  std::vector<Tensor> big = awkward_tensors(9);
  big.push_back(make_tensor("huge", "U8", {900000}, 123));
  write_file(d2 / "big.safetensors", file_bytes(big));
  const sf::Checkpoint a = sf::open_checkpoint(path_.string());
  const sf::Checkpoint b = sf::open_checkpoint((d2 / "big.safetensors").string());
  const bool direct = uring_available() && supports_direct(d_.path) && supports_direct(d2.path);
  sf::ReadOptions o = small(direct ? sf::IoPath::kDirect : sf::IoPath::kPread);
  sf::Reader r(o);
  auto stream = [&](const sf::Checkpoint& c, const std::vector<Tensor>& ts) {
    std::size_t n = 0;
    const sf::ReadStats s = r.stream_tensors(c, [&](std::size_t i, const std::byte* bytes) {
      ++n;
      EXPECT_TRUE(same(bytes, ts[i].data)) << ts[i].name;
    });
    EXPECT_EQ(n, ts.size());
    return s;
  };
  const sf::ReadStats s1 = stream(a, ts_);
  const sf::ReadStats s2 = stream(a, ts_);
  EXPECT_EQ(s2.staging_bytes, s1.staging_bytes);
  EXPECT_EQ(s2.bytes, s1.bytes);  // per call, not cumulative
  const sf::ReadStats s3 = stream(b, big);
  EXPECT_GT(s3.staging_bytes, s1.staging_bytes);
  if (direct) {
    EXPECT_TRUE(s1.registered_buffers);
    EXPECT_TRUE(s3.registered_buffers) << s3.fallback_reason;
  }
  int calls = 0;
  EXPECT_THROW(r.stream_tensors(b,
                                [&](std::size_t, const std::byte*) {
                                  if (++calls == 2) throw std::runtime_error("stop");
                                }),
               std::runtime_error);
  (void)stream(b, big);
  (void)check_read_tensors(a, ts_, o, true);
  (void)stream(a, ts_);
}

TEST_F(ReadPaths, AFileReplacedAfterValidationIsNeverRead) {
  // Another file renamed over the checkpoint after open_checkpoint: the data
  // comes from the descriptor that was validated (the old bytes), and an
  // O_DIRECT reopen, which would find the new file, is refused.
  const sf::Checkpoint c = sf::open_checkpoint(path_.string());
  std::vector<Tensor> other = awkward_tensors(777);
  write_file(d_ / "other.safetensors", file_bytes(other));
  fs::rename(d_ / "other.safetensors", path_);
  (void)check_stream(c, ts_, small(sf::IoPath::kPread));  // the validated bytes, not the new file's
  if (!uring_available() || !supports_direct(d_.path)) GTEST_SKIP() << "no io_uring or no O_DIRECT here";
  try {
    (void)check_stream(c, ts_, small(sf::IoPath::kDirect));
    ADD_FAILURE() << "an O_DIRECT reopen read a file other than the validated one";
  } catch (const shmcast::Error& e) {
    EXPECT_EQ(e.code(), Errc::kCorrupt) << e.what();
    EXPECT_NE(std::string(e.what()).find("replaced"), std::string::npos) << e.what();
  }
}
