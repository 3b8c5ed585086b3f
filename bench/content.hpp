// What the bench sends: fresh random bytes for every sync, that the consumer
// checks byte for byte after the timer stopped.
//
// The bytes of tensor t in sync i are a pure function of (key(run seed, i, t),
// byte offset), so the consumer regenerates what it must have received and
// compares every byte, without a hash of the source crossing processes.
//
// Host: a 1 MiB random pool (it stays in L2) is laid down in 1 MiB blocks;
// block b starts at a random rotation of the pool and is XORed with a random
// 64-bit word, both drawn from (key, b). Filling and checking then run at the
// speed of a memcpy. Two syncs, and two blocks of one tensor, differ in
// their block words and rotations, so that any 8-byte word of theirs is equal
// only by chance (2^-64): a stale slot, a slot holding another chunk, or a
// chunk of an earlier sync is caught.
// CUDA (cuda_kernels.cu): word w of a tensor is mix(key + (w + 1) * golden),
// computed on the device by the producer (fill) and the consumer (check).
#pragma once

#include <cstdint>

namespace bench::content {

inline constexpr std::uint64_t kGolden = 0x9E3779B97F4A7C15ull;

// splitmix64's finaliser: a bijection of 64-bit words.
constexpr std::uint64_t mix(std::uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

// Per tensor and sync. `sync` numbers the big syncs from 0; round trips use
// kRoundTrip + j and idle round trips kRoundTripIdle + j.
inline constexpr std::uint64_t kRoundTrip = 1ull << 40;
inline constexpr std::uint64_t kRoundTripIdle = 2ull << 40;
constexpr std::uint64_t key(std::uint64_t run_seed, std::uint64_t sync, std::uint64_t tensor) {
  return mix(run_seed ^ mix(sync * kGolden + (tensor << 1 | 1)));
}

// Host: writes the n bytes of (key) at p.
void fill(void* p, std::uint64_t n, std::uint64_t key);
// Host: 0 when the n bytes at p are exactly those of (key); else the number
// of 1 MiB blocks that differ (at least 1).
std::uint64_t count_bad(const void* p, std::uint64_t n, std::uint64_t key);

// A seed for one bench run (so that two runs differ too).
std::uint64_t fresh_seed();

}  // namespace bench::content
