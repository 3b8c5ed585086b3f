// Checkpoint::Impl: the validated headers and the descriptors they were read
// through. The data is later read from these very descriptors (or from an
// O_DIRECT descriptor of the same inode, checked by device and inode), so a
// file swapped after validation is never read.
#pragma once

#include <sys/types.h>

#include <string>
#include <unordered_map>
#include <vector>

#include "shmcast/safetensors.hpp"

namespace shmcast::safetensors {

struct Checkpoint::Impl {
  std::string path;
  bool sharded = false;
  bool allow_symlinks = false;
  std::vector<CheckpointFile> files;
  std::vector<TensorEntry> tensors;
  std::unordered_map<std::string, std::size_t> by_name;
  std::uint64_t payload = 0;

  // Per file: the buffered descriptor (O_RDONLY|O_CLOEXEC), and how to open
  // the same file again (for O_DIRECT): openat(dirfd, rel, nofollow?).
  std::vector<int> fds;
  std::vector<int> dirfds;  // AT_FDCWD or a directory descriptor (owned when owns_dirfd)
  std::vector<std::string> rel;
  std::vector<bool> nofollow;
  std::vector<dev_t> dev;
  std::vector<ino_t> ino;
  int dirfd = -1;  // owned

  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl();
};

}  // namespace shmcast::safetensors
