// Host side of content.hpp: fresh random bytes per sync at memcpy speed.
#include "content.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>

namespace bench::content {

namespace {

constexpr std::uint64_t kPoolWords = (1ull << 20) / 8;  // 1 MiB

struct Pool {
  std::uint64_t w[kPoolWords];
  Pool() {
    for (std::uint64_t i = 0; i < kPoolWords; ++i) w[i] = mix((i + 1) * kGolden ^ 0x5eedf00dull);
  }
};

const std::uint64_t* pool() {
  static const Pool* p = new Pool();  // built once, never freed (used until exit)
  return p->w;
}

// The block parameters: a 64-bit XOR word and the pool rotation.
struct Block {
  std::uint64_t x, off;
};
Block block(std::uint64_t key, std::uint64_t b) {
  const std::uint64_t x = mix(key + (b + 1) * kGolden);
  return {x, mix(x ^ 0x0ff5e7ull) % kPoolWords};
}

void put(std::uint64_t* __restrict d, const std::uint64_t* __restrict s, std::uint64_t n, std::uint64_t x) {
  for (std::uint64_t i = 0; i < n; ++i) d[i] = s[i] ^ x;
}
std::uint64_t diff(const std::uint64_t* __restrict d, const std::uint64_t* __restrict s, std::uint64_t n,
                   std::uint64_t x) {
  std::uint64_t acc = 0;
  for (std::uint64_t i = 0; i < n; ++i) acc |= d[i] ^ s[i] ^ x;
  return acc;
}
// Unaligned variants (never used by the bench's own buffers, which are page
// or 16-byte aligned; kept so that any pointer works).
void put_u(std::uint8_t* d, const std::uint64_t* s, std::uint64_t n, std::uint64_t x) {
  for (std::uint64_t i = 0; i < n; ++i) {
    const std::uint64_t v = s[i] ^ x;
    std::memcpy(d + 8 * i, &v, 8);
  }
}
std::uint64_t diff_u(const std::uint8_t* d, const std::uint64_t* s, std::uint64_t n, std::uint64_t x) {
  std::uint64_t acc = 0;
  for (std::uint64_t i = 0; i < n; ++i) {
    std::uint64_t v;
    std::memcpy(&v, d + 8 * i, 8);
    acc |= v ^ s[i] ^ x;
  }
  return acc;
}

// Word w of the stream (for the partial last word).
std::uint64_t word(std::uint64_t key, std::uint64_t w) {
  const Block bl = block(key, w / kPoolWords);
  return pool()[(w % kPoolWords + bl.off) % kPoolWords] ^ bl.x;
}

}  // namespace

void fill(void* p, std::uint64_t n, std::uint64_t key) {
  auto* d = static_cast<std::uint8_t*>(p);
  const std::uint64_t* P = pool();
  const std::uint64_t words = n / 8;
  const bool aligned = reinterpret_cast<std::uintptr_t>(d) % 8 == 0;
  for (std::uint64_t b = 0; b * kPoolWords < words; ++b) {
    const Block bl = block(key, b);
    const std::uint64_t len = std::min(kPoolWords, words - b * kPoolWords);
    const std::uint64_t a = std::min(len, kPoolWords - bl.off);
    std::uint8_t* at = d + 8 * b * kPoolWords;
    if (aligned) {
      auto* w = reinterpret_cast<std::uint64_t*>(at);
      put(w, P + bl.off, a, bl.x);
      if (len > a) put(w + a, P, len - a, bl.x);
    } else {
      put_u(at, P + bl.off, a, bl.x);
      if (len > a) put_u(at + 8 * a, P, len - a, bl.x);
    }
  }
  if (n % 8) {
    const std::uint64_t v = word(key, words);
    std::memcpy(d + 8 * words, &v, n % 8);  // little-endian: the word's first bytes
  }
}

std::uint64_t count_bad(const void* p, std::uint64_t n, std::uint64_t key) {
  const auto* d = static_cast<const std::uint8_t*>(p);
  const std::uint64_t* P = pool();
  const std::uint64_t words = n / 8;
  const bool aligned = reinterpret_cast<std::uintptr_t>(d) % 8 == 0;
  std::uint64_t bad = 0;
  for (std::uint64_t b = 0; b * kPoolWords < words; ++b) {
    const Block bl = block(key, b);
    const std::uint64_t len = std::min(kPoolWords, words - b * kPoolWords);
    const std::uint64_t a = std::min(len, kPoolWords - bl.off);
    const std::uint8_t* at = d + 8 * b * kPoolWords;
    std::uint64_t acc;
    if (aligned) {
      const auto* w = reinterpret_cast<const std::uint64_t*>(at);
      acc = diff(w, P + bl.off, a, bl.x);
      if (len > a) acc |= diff(w + a, P, len - a, bl.x);
    } else {
      acc = diff_u(at, P + bl.off, a, bl.x);
      if (len > a) acc |= diff_u(at + 8 * a, P, len - a, bl.x);
    }
    if (acc) ++bad;
  }
  if (n % 8) {
    const std::uint64_t v = word(key, words);
    if (std::memcmp(d + 8 * words, &v, n % 8) != 0) ++bad;
  }
  return bad;
}

std::uint64_t fresh_seed() {
  std::uint64_t s = 0;
  std::ifstream f("/dev/urandom", std::ios::binary);
  if (f) f.read(reinterpret_cast<char*>(&s), sizeof s);
  return mix(s ^ static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
}

}  // namespace bench::content
