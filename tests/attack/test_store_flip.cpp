// A store producer killed inside its record flip (issue 27, item 10). The
// producer of a store region announces a complete version by rewriting the
// sync record under its seqlock (ProducerRing::announce): word odd, seven
// fields, word even. A producer that dies in between leaves the word odd
// for good and the record torn. Before the fix a late reader then could not
// open the region at all (PeerDied at its open timeout), although both banks
// still held complete versions.
//
// Each case stops the producer child at one store of the flip (the test-only
// hook g_announce_store_hook raises SIGSTOP there), checks that a reader
// takes nothing while the producer lives (it may still finish the flip),
// SIGKILLs it, and then a late joiner in this process must get a version,
// bit-exact: the new one once its bank is published (every point of the
// flip), the previous one before the flip began (store 0).
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "base/layout.hpp"
#include "protocol/ring.hpp"
#include "support.hpp"

using namespace shmcast;
using namespace shmcast_test;
using namespace std::chrono_literals;

namespace {

constexpr int kTensors = 3;
constexpr std::uint64_t kTensorBytes = 300000;
constexpr std::uint64_t kSeedOld = 41, kSeedNew = 42;

ProducerOptions store_opts(bool checksums) {
  ProducerOptions o;
  o.mode = RegionMode::kStore;
  o.store_bytes = 2 << 20;
  o.pin = Pin::kNo;
  o.engine = CopyEngine::kHost;
  o.checksums = checksums;
  o.max_consumers = 4;
  return o;
}

ConsumerOptions copts(std::chrono::milliseconds open_timeout) {
  ConsumerOptions o;
  o.pin = Pin::kNo;
  o.open_timeout = open_timeout;
  return o;
}

int g_stop_at = -1;
void stop_at(int store) {
  if (store == g_stop_at) ::raise(SIGSTOP);
}

// Waits until `pid` stops (true) or exits (false, *status set), with a deadline.
bool wait_stopped(pid_t pid, int* status, std::chrono::seconds timeout) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    const pid_t r = ::waitpid(pid, status, WNOHANG | WUNTRACED);
    if (r == pid) return WIFSTOPPED(*status);
    std::this_thread::sleep_for(1ms);
  }
  return false;
}

// The version a fresh consumer reads, checked bit-exact against pattern
// `seed` through read_into() and views(); 0 when it reads none (the error
// in *why).
std::uint64_t late_joiner_reads(const std::string& name, std::uint64_t seed, std::string* why) {
  try {
    Consumer c = Consumer::open(name, copts(3000ms));
    const SyncInfo& s = c.wait_sync(0ms);
    const std::uint64_t version = s.version;
    if (s.tensors.size() != kTensors) {
      *why = "version " + std::to_string(version) + " has " + std::to_string(s.tensors.size()) + " tensors";
      return 0;
    }
    std::vector<std::vector<std::uint8_t>> got(kTensors, std::vector<std::uint8_t>(kTensorBytes));
    std::vector<void*> dsts;
    for (auto& g : got) dsts.push_back(g.data());
    c.read_into(dsts);
    if (!check_pattern(got, seed)) {
      *why = "version " + std::to_string(version) + " read_into: bytes differ from pattern " + std::to_string(seed);
      return 0;
    }
    // The same version through zero-copy views.
    Consumer v = Consumer::open(name, copts(3000ms));
    if (v.wait_sync(0ms).version != version) {
      *why = "a second reader got another version";
      return 0;
    }
    const std::vector<const std::byte*> ptrs = v.views();
    for (int i = 0; i < kTensors; ++i)
      if (std::memcmp(ptrs[static_cast<std::size_t>(i)], got[static_cast<std::size_t>(i)].data(), kTensorBytes) != 0) {
        *why = "views() differ from read_into()";
        return 0;
      }
    if (!v.views_valid()) {
      *why = "views() not valid";
      return 0;
    }
    // Nothing newer can come from a dead producer: PeerDied, at once.
    const auto t0 = std::chrono::steady_clock::now();
    try {
      c.wait_sync(20s);
      *why = "a newer version from a dead producer";
      return 0;
    } catch (const Error& e) {
      if (e.code() != Errc::kPeerDied) {
        *why = std::string("waiting for a newer version: ") + errc_name(e.code()) + ": " + e.what();
        return 0;
      }
    }
    if (std::chrono::steady_clock::now() - t0 > 10s) {  // not the 20 s wait: at once, with margin for load
      *why = "PeerDied took more than 10 s";
      return 0;
    }
    return version;
  } catch (const Error& e) {
    *why = std::string(errc_name(e.code())) + ": " + e.what();
    return 0;
  }
}

struct Flip {
  int store;        // the hook's index (docs in ring.hpp): 0 before the flip, 1..8 inside, 9 after
  bool checksums;
  bool first_sync;  // the killed flip announces the region's first version
};

void PrintTo(const Flip& f, std::ostream* os) {
  *os << "store " << f.store << (f.checksums ? ", checksums" : "") << (f.first_sync ? ", first sync" : "");
}

std::string flip_name(const ::testing::TestParamInfo<Flip>& i) {
  return "Store" + std::to_string(i.param.store) + (i.param.checksums ? "Checksums" : "NoChecksums") +
         (i.param.first_sync ? "FirstSync" : "");
}

class KilledInsideTheRecordFlip : public ::testing::TestWithParam<Flip> {};

// Runs a store producer that sends version 1 (pattern kSeedOld) unless the
// flip to kill is the first sync's, then stops at `store` of the flip of the
// next version (kSeedNew); SIGKILLs it there. Returns the dead child's status.
void producer_stopped_in_flip(const std::string& name, const Flip& f, bool check_no_version_while_alive) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    int rc = 0;
    try {
      Producer p = Producer::create(name, store_opts(f.checksums));
      if (!f.first_sync) {
        PatternSync old(kTensors, kTensorBytes, kSeedOld);
        p.send(old.specs, old.ptrs);
      }
      PatternSync next(kTensors, kTensorBytes, kSeedNew);
      g_stop_at = f.store;
      detail::g_announce_store_hook = stop_at;
      p.send(next.specs, next.ptrs);
      rc = 50;  // the hook never stopped us
    } catch (const std::exception& e) {
      std::fprintf(stderr, "producer: %s\n", e.what());
      rc = 51;
    }
    ::_exit(rc);
  }
  ASSERT_GT(pid, 0);
  int status = 0;
  const bool stopped = wait_stopped(pid, &status, 30s);
  if (!stopped) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
    FAIL() << "the producer did not stop at store " << f.store << " (status " << status << ")";
  }
  if (check_no_version_while_alive) {
    // The producer is alive (stopped) with the record odd: it may still
    // finish the flip, so a reader takes nothing yet. It opens (the
    // producer lives) and times out waiting for a stable record.
    Consumer c = Consumer::open(name, copts(3000ms));
    EXPECT_EQ(code_of([&] { c.wait_sync(100ms); }), Errc::kTimeout)
        << "a reader took a version from a live producer's torn record";
  }
  ::kill(pid, SIGKILL);
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;
}

}  // namespace

TEST_P(KilledInsideTheRecordFlip, ALateJoinerGetsACompleteVersionBitExact) {
  const Flip f = GetParam();
  const std::string name = unique_name("flip");
  RegionGuard g{name};
  const bool inside = f.store >= 1 && f.store <= 8;
  ASSERT_NO_FATAL_FAILURE(producer_stopped_in_flip(name, f, inside));
  std::string why;
  const std::uint64_t got_seed_new = late_joiner_reads(name, kSeedNew, &why);
  if (f.store == 0) {
    // Before the flip: the record still names the previous version (none
    // for the first sync: the region holds nothing it announced).
    if (f.first_sync) {
      EXPECT_EQ(got_seed_new, 0u) << "took an unannounced version from a region whose first flip never began";
      try {
        Consumer::open(name, copts(300ms));
        ADD_FAILURE() << "opened a store region that announced nothing, with a dead producer";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), Errc::kPeerDied) << e.what();
      }
      return;
    }
    std::string why_old;
    EXPECT_EQ(late_joiner_reads(name, kSeedOld, &why_old), 1u) << why_old;
    return;
  }
  // Inside the flip (and after it): the new version's bank was published
  // before the flip began, so it is the one kept.
  EXPECT_EQ(got_seed_new, f.first_sync ? 1u : 2u) << why;
}

std::vector<Flip> all_flips() {
  std::vector<Flip> v;
  for (bool sums : {false, true})
    for (int i = 0; i <= 9; ++i) v.push_back({i, sums, false});
  for (int i : {0, 1, 4, 8}) v.push_back({i, false, true});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Store, KilledInsideTheRecordFlip, ::testing::ValuesIn(all_flips()), flip_name);

// The torn record's newest bank damaged as well (its manifest no longer
// matches the hash its descriptor carries): the reader falls back to the
// previous version, bit-exact; with both banks damaged nothing is taken
// (PeerDied, as for a store that holds nothing) and nothing crashes.
TEST(StoreFlip, DamagedNewestBankFallsBackToThePreviousVersion) {
  const std::string name = unique_name("flip-damaged");
  RegionGuard g{name};
  ASSERT_NO_FATAL_FAILURE(producer_stopped_in_flip(name, Flip{4, true, false}, false));
  const int fd = ::open(region_path(name).c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  detail::HeaderFixed h{};
  ASSERT_EQ(::pread(fd, &h, sizeof h, 0), static_cast<ssize_t>(sizeof h));
  // Version 2 is chunk 2: bank 1. Flip a byte of its manifest.
  auto flip_manifest_byte = [&](std::uint32_t bank) {
    const off_t at = static_cast<off_t>(h.manifest_offset + bank * h.manifest_bytes + 70);
    unsigned char b = 0;
    ASSERT_EQ(::pread(fd, &b, 1, at), 1);
    b ^= 0x5a;
    ASSERT_EQ(::pwrite(fd, &b, 1, at), 1);
  };
  ASSERT_NO_FATAL_FAILURE(flip_manifest_byte(1));
  std::string why;
  EXPECT_EQ(late_joiner_reads(name, kSeedOld, &why), 1u) << why;
  ASSERT_NO_FATAL_FAILURE(flip_manifest_byte(0));
  try {
    Consumer::open(name, copts(300ms));
    ADD_FAILURE() << "opened a store region whose banks are both damaged";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::kPeerDied) << e.what();
  }
  ::close(fd);
}
