// base/ (layer 0): the set of names behind the duplicate-name checks of a
// sync (the producer's begin_sync, the consumer's manifest decoder), for up
// to kMaxTensors names without an allocation per name: open addressing over
// string_views into the caller's memory, in a table kept from one sync to
// the next. The hash (XXH3) is seeded once per process from the kernel's
// random source; it is not a keyed hash, so names a hostile peer crafts to
// collide are bounded another way: a name whose probe runs past kMaxProbe
// slots moves the set to an ordered tree (O(log n) comparisons a name) for
// the rest of that sync.
#pragma once

#include <sys/random.h>
#include <xxhash.h>

#include <algorithm>
#include <cstdint>
#include <set>
#include <string_view>
#include <vector>

#include "base/clock.hpp"

namespace shmcast::detail {

class NameSet {
 public:
  static constexpr std::size_t kMaxProbe = 64;
  explicit NameSet(std::size_t max_probe = kMaxProbe) : max_probe_(max_probe) {}

  // Empties the set, with room for `n` names. The table grows to the
  // largest `n` seen and stays (half full at most), unless it is both
  // large (16 MiB) and 16 times what `n` needs.
  void reset(std::size_t n) {
    std::size_t want = 16;
    while (want < 2 * n) want <<= 1;
    if (slots_.size() < want || (slots_.size() >= (std::size_t{1} << 20) && slots_.size() / 16 > want)) {
      slots_.assign(want, std::string_view());
      slots_.shrink_to_fit();
    } else {
      std::fill_n(slots_.begin(), want, std::string_view());
    }
    mask_ = want - 1;
    size_ = 0;
    max_ = n;
    tree_.clear();
    in_tree_ = false;
  }
  // Adds `s` (not empty; its bytes stay put while the set is used); false
  // when it is in the set already. More names than reset() announced grow
  // the table.
  bool insert(std::string_view s) {
    if (in_tree_) return tree_.insert(s).second;
    if (size_ >= max_) reset_grow();
    std::size_t i = XXH3_64bits_withSeed(s.data(), s.size(), seed()) & mask_;
    for (std::size_t probe = 0;; ++probe, i = (i + 1) & mask_) {
      std::string_view& slot = slots_[i];
      if (slot.data() == nullptr) {
        if (probe > max_probe_) break;  // a long run: names made to collide
        slot = s;
        ++size_;
        return true;
      }
      if (slot == s) return false;
    }
    // Every name so far into the tree, then this one.
    for (std::size_t k = 0; k <= mask_; ++k)
      if (slots_[k].data() != nullptr) tree_.insert(slots_[k]);
    in_tree_ = true;
    return tree_.insert(s).second;
  }
  // Whether the set left the table for the tree (tests).
  bool in_tree() const { return in_tree_; }

 private:
  // More names than reset() announced: a larger table with the same names.
  void reset_grow() {
    std::vector<std::string_view> had;
    for (std::size_t i = 0; i < slots_.size() && i <= mask_; ++i)
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
  std::size_t max_probe_, mask_ = 0, size_ = 0, max_ = 0;
  std::set<std::string_view> tree_;
  bool in_tree_ = false;
};

}  // namespace shmcast::detail
