// base/ (layer 0): the set of names behind the duplicate-name checks of a
// sync (the producer's begin_sync, the consumer's manifest decoder), for up
// to kMaxTensors names without an allocation per name: open addressing over
// string_views into the caller's memory, in a table kept from one sync to
// the next. The hash is seeded once per process from the kernel's random
// source, so names a hostile peer picks cannot be made to collide.
#pragma once

#include <sys/random.h>
#include <xxhash.h>

#include <algorithm>
#include <cstdint>
#include <string_view>
#include <vector>

#include "base/clock.hpp"

namespace shmcast::detail {

class NameSet {
 public:
  // Empties the set, with room for `n` names. The table grows to the
  // largest `n` seen and stays (half full at most).
  void reset(std::size_t n) {
    std::size_t want = 16;
    while (want < 2 * n) want <<= 1;
    if (slots_.size() < want) {
      slots_.assign(want, std::string_view());
    } else {
      std::fill_n(slots_.begin(), want, std::string_view());
    }
    mask_ = want - 1;
    size_ = 0;
    max_ = n;
  }
  // Adds `s` (not empty; its bytes stay put while the set is used); false
  // when it is in the set already. At most reset()'s `n` names.
  bool insert(std::string_view s) {
    if (size_ >= max_) reset_grow();
    for (std::size_t i = XXH3_64bits_withSeed(s.data(), s.size(), seed()) & mask_;; i = (i + 1) & mask_) {
      std::string_view& slot = slots_[i];
      if (slot.data() == nullptr) {
        slot = s;
        ++size_;
        return true;
      }
      if (slot == s) return false;
    }
  }

 private:
  // More names than reset() announced: a larger table with the same names.
  void reset_grow() {
    std::vector<std::string_view> had;
    for (std::size_t i = 0; i <= mask_; ++i)
      if (slots_[i].data() != nullptr) had.push_back(slots_[i]);
    reset(std::max<std::size_t>(8, 2 * max_));
    for (std::string_view s : had) insert(s);
  }
  static std::uint64_t seed() {
    static const std::uint64_t s = [] {
      std::uint64_t v = 0;
      if (::getrandom(&v, sizeof v, GRND_NONBLOCK) != static_cast<ssize_t>(sizeof v))
        v = static_cast<std::uint64_t>(mono_ns()) ^ reinterpret_cast<std::uintptr_t>(&v);
      return v;
    }();
    return s;
  }
  std::vector<std::string_view> slots_;
  std::size_t mask_ = 0, size_ = 0, max_ = 0;
};

}  // namespace shmcast::detail
