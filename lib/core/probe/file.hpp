// The region file as the read-only probe (probe/, shmcast-inspect's thread
// that probes) sees it before it reads a byte: the one way a path is
// opened, its kind, its owner under the library's trust rule, its
// read-only mapping, and private aligned buffers for the copies.
#pragma once

#include <sys/stat.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "shm/liveness.hpp"
#include "shmcast/probe.hpp"

namespace shmcast::detail::probe_impl {

namespace P = shmcast::probe;

// 64-byte aligned private buffer, zero-filled.
struct AlignedBytes {
  struct Free {
    void operator()(std::byte* p) const { std::free(p); }
  };
  std::unique_ptr<std::byte[], Free> p;
  std::size_t n = 0;
  explicit AlignedBytes(std::size_t bytes);
  std::byte* data() const { return p.get(); }
};

// What a file is: its type's name ("fifo") and, for a file that is not a
// regular one, the phrase a report says ("a FIFO").
struct FileKind {
  const char* name;
  const char* phrase;
};
FileKind file_kind(mode_t mode);

// The library's trust rule (region.hpp), for a reader that is in the
// file's group if the group may write it.
P::Owner owner_of(const struct stat& st);

P::Alive pub(Alive a);

// The one way a region path is opened: O_RDONLY | O_NOFOLLOW | O_CLOEXEC |
// O_NONBLOCK | O_NOCTTY, then fstat on the descriptor. Returns the
// descriptor of a regular file; otherwise -1, with *err the errno of the
// failed open (ELOOP for a symlink, ENXIO for a socket, ...) or 0 when it
// opened something that is not a regular file (then closed). *st is filled
// whenever fstat ran.
int open_region_file(const std::string& path, struct stat* st, int* err);

// The read-only mapping of a region file and its descriptor.
struct ReadOnlyMap {
  int fd = -1;
  const std::byte* base = nullptr;
  std::size_t len = 0;
  ReadOnlyMap() = default;
  ReadOnlyMap(const ReadOnlyMap&) = delete;
  ReadOnlyMap& operator=(const ReadOnlyMap&) = delete;
  ~ReadOnlyMap();
};

}  // namespace shmcast::detail::probe_impl
