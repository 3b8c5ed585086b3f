// Shared by the fuzz harnesses (fuzz_*.cpp), their replay main and the seed
// generator: a private region directory, a region file the harness rewrites
// for every input, and the input formats.
//
// Every harness obeys one contract: for any input, the library either
// succeeds or throws shmcast::Error, promptly (all timeouts are 0), and never
// touches memory outside the region's validated geometry. Anything else
// (another exception, a sanitizer report, a trap, a hang) is a finding.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "base/layout.hpp"
#include "shmcast/shmcast.hpp"

namespace fuzz {

namespace d = shmcast::detail;

// ---------------------------------------------------------------- files

// A private SHMCAST_DIR that is removed at exit: under $SHMCAST_FUZZ_BASE
// (scripts/fuzz.sh points it at a directory it removes, so even a crashed
// run leaves nothing), else /dev/shm (a real tmpfs), else /tmp.
inline const std::string& private_dir() {
  static const std::string dir = [] {
    const char* env = std::getenv("SHMCAST_FUZZ_BASE");
    std::string base = env && *env ? env : ::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    std::string tmpl = base + "/shmcast-fuzz-XXXXXX";
    if (!::mkdtemp(tmpl.data())) {
      std::perror("mkdtemp");
      std::abort();
    }
    ::setenv("SHMCAST_DIR", tmpl.c_str(), 1);
    std::atexit([] {
      const char* d = std::getenv("SHMCAST_DIR");
      if (!d) return;
      const std::string p = std::string(d) + "/shmcast.fz";
      ::unlink(p.c_str());
      ::rmdir(d);
    });
    return tmpl;
  }();
  return dir;
}

inline constexpr const char* kName = "fz";

inline const std::string& region_file() {
  static const std::string p = private_dir() + "/shmcast." + kName;
  return p;
}

// Called once per process before the first input: no spinning in waits, so
// a timeout of 0 returns at once.
inline void init_env() {
  ::setenv("SHMCAST_SPIN_NS", "0", 1);
  (void)private_dir();
}

// The region file, kept open for the harness's whole life (fd 1: contents;
// fd 2: the producer lock, held as a live producer would hold it).
struct RegionFile {
  int fd = -1;
  int lock_fd = -1;
  bool locked = false;

  static RegionFile& get() {
    static RegionFile f = [] {
      RegionFile r;
      r.fd = ::open(region_file().c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
      r.lock_fd = ::open(region_file().c_str(), O_RDWR | O_CLOEXEC);
      if (r.fd < 0 || r.lock_fd < 0) {
        std::perror("open region file");
        std::abort();
      }
      return r;
    }();
    return f;
  }
  void hold_lock(bool on) {
    if (on == locked) return;
    struct flock fl {};
    fl.l_type = on ? F_WRLCK : F_UNLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = d::kProducerLockByte;
    fl.l_len = 1;
    if (::fcntl(lock_fd, F_OFD_SETLK, &fl) != 0) {
      std::perror("fcntl lock");
      std::abort();
    }
    locked = on;
  }
  // Empties the file and gives it `size` zero bytes (sparse).
  void reset(std::uint64_t size) {
    if (::ftruncate(fd, 0) != 0 || ::ftruncate(fd, static_cast<off_t>(size)) != 0) {
      std::perror("ftruncate");
      std::abort();
    }
  }
  void write(std::uint64_t offset, const void* p, std::size_t n) {
    if (n && ::pwrite(fd, p, n, static_cast<off_t>(offset)) != static_cast<ssize_t>(n)) {
      std::perror("pwrite");
      std::abort();
    }
  }
};

// Options that never wait.
inline shmcast::ConsumerOptions no_wait() {
  shmcast::ConsumerOptions o;
  o.open_timeout = std::chrono::nanoseconds(0);
  o.chunk_timeout = std::chrono::nanoseconds(0);
  o.pin = shmcast::Pin::kNo;
  return o;
}

// SHMCAST_FUZZ_VERBOSE=1: print how each input ended (corpus upkeep).
inline void outcome(const char* stage, const char* what) {
  static const bool on = std::getenv("SHMCAST_FUZZ_VERBOSE") != nullptr;
  if (on) std::printf("  %s: %s\n", stage, what);
}
inline void outcome(const char* stage, const shmcast::Error& e) { outcome(stage, e.what()); }

[[noreturn]] inline void finding(const char* what) {
  std::fprintf(stderr, "FUZZ FINDING: %s\n", what);
  std::fflush(stderr);
  __builtin_trap();
}

// ---------------------------------------------------------------- header target
//
// Input: the first bytes of the header page (zero-padded to 4096). Two bytes
// the library never reads steer the harness:
//   Header::producer.reserved (offset 140) bit 0: no live producer (lock not held)
//                                          bit 1: file size = input size, not total_bytes
// The file gets total_bytes bytes (sparse) when that is plausible (<= 2 GiB).
inline constexpr std::size_t kHeaderSteer = 140;
inline constexpr std::uint64_t kMaxSparseBytes = 2ull << 30;

// ---------------------------------------------------------------- region target
//
// A valid region (N = 2 seats, K = 2 slots of 2 MiB, a 1 MiB sparse manifest area) that a
// consumer opens; then the bytes a producer or another consumer could write
// are replaced by the input:
struct RegionInput {
  std::uint8_t flags;      // kFix* below
  std::uint8_t flags2;     // kFix2* below
  std::uint8_t reserved[6];
  std::uint8_t header[256];  // Header bytes [128, 384): lifecycle, sync record, publication, release
  std::uint8_t seat[192];    // the consumer's seat, bytes [0, 192)
  std::uint8_t slots[2 * 64];
  std::uint8_t patch[128];   // Header bytes [192, 320), written after wait_sync (kFixPatch)
  // then: the first bytes of the manifest area (up to kRegionManifestInput)
};
static_assert(sizeof(RegionInput) == 712);

enum : std::uint8_t {
  kFixHash = 1 << 0,      // manifest_hash = XXH3 of the manifest bytes in use
  kFixChecksums = 1 << 1, // slot checksums match the slot bytes
  kKeepSeatWord = 1 << 2, // keep the seat word the consumer wrote
  kFixEnroll = 1 << 3,    // included_gen, first_seq, first_version enroll the seat for the sync
  kUseVisit = 1 << 4,     // visit() instead of read_into()
  kChecksumFeature = 1 << 5,  // the header announces checksums
  kProducerDead = 1 << 6, // nobody holds the producer lock
  kFixPatch = 1 << 7,     // apply `patch` between wait_sync and the read
};
enum : std::uint8_t {
  kFix2EvenWord = 1 << 0,   // the seqlock word is even
  kFix2Slots = 1 << 1,      // slot descriptors hold the sync's chunks (seq, version, bytes)
  kFix2Published = 1 << 2,  // published_seq covers the sync
  kFix2Ready = 1 << 3,      // init_state = ready
};

inline constexpr std::uint32_t kRegionSeats = 2, kRegionSlots = 2;
inline constexpr std::uint64_t kRegionSlotBytes = 2ull << 20;
// The manifest area is a sparse reservation, as a producer's (docs/protocol.md
// §2.1): the harness writes only the input's manifest bytes (at most
// kRegionManifestInput); the rest of the area stays a hole that reads as
// zeros, so a record may announce a manifest that runs past what was written.
inline constexpr std::uint64_t kRegionManifestBytes = 1ull << 20, kRegionManifestInput = 4096;

inline d::Geometry region_geometry() {
  d::Geometry g{};
  d::compute_geometry(kRegionSeats, kRegionSlots, kRegionSlotBytes, kRegionManifestBytes, &g);
  return g;
}

inline d::HeaderFixed fixed_for(const d::Geometry& g, bool checksums) {
  return d::make_fixed_header(g, checksums ? d::kFeatureChecksums : 0);
}

// ---------------------------------------------------------------- manifest target
//
// Input: one byte that picks the slot size, then the manifest bytes. The
// expected version and stream size are the manifest's own (so the decoder's
// deeper checks are reachable).
inline constexpr std::uint64_t kManifestSlotSizes[4] = {2ull << 20, 4ull << 20, 64ull << 20, 1ull << 30};

}  // namespace fuzz
