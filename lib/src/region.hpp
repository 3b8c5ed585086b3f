// Layer 1: the named region. A file in the region directory ($SHMCAST_DIR or
// /dev/shm), created O_EXCL with mode 0600 (0660 on request), fully
// allocated with posix_fallocate before it is mapped, so that a full tmpfs
// is an error at create time and never a SIGBUS later. Boost.Interprocess
// owns the shm object and the mapping.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace shmcast::detail {

class MappedFile {
 public:
  // Creates `path` exclusively and maps `bytes` of it read-write. Throws
  // shmcast::Error (kRegionFull with free vs needed bytes, kExists, ...).
  // With `lock_byte` >= 0 the OFD write lock on that byte is taken right
  // after the file exists, before it is allocated: a second creator racing
  // for the name then sees a live owner, never an abandoned file.
  static MappedFile create(const std::string& dir, std::string_view name, std::uint64_t bytes, bool group_access,
                           std::int64_t lock_byte = -1);
  // Opens an existing region file, read-write when `writable`. Maps the whole
  // file; a file of size 0 (being created) is returned unmapped with size() 0.
  static MappedFile open(const std::string& dir, std::string_view name, bool writable);

  MappedFile();
  MappedFile(MappedFile&&) noexcept;
  MappedFile& operator=(MappedFile&&) noexcept;
  ~MappedFile();

  std::byte* data() const { return base_; }
  std::uint64_t size() const { return size_; }
  // The file's size now (fstat), 0 when unknown. Differs from size() when
  // another process truncated or grew the file after it was mapped.
  std::uint64_t size_now() const;
  int fd() const;  // for OFD locks; valid while mapped
  const std::string& path() const { return path_; }
  std::uint64_t inode() const { return inode_; }

  void unmap();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::byte* base_ = nullptr;
  std::uint64_t size_ = 0;
  std::uint64_t inode_ = 0;
  std::string path_;
};

// Free bytes in the filesystem that holds `dir`, or -errno.
std::int64_t free_bytes(const std::string& dir);

// "1.0 GiB", "64 MiB"
std::string human_bytes(std::uint64_t bytes);

}  // namespace shmcast::detail
