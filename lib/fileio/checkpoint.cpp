// open_checkpoint: find the files of a checkpoint, open each once (shards
// relative to the checkpoint directory, O_NOFOLLOW unless allowed), validate
// every header and the index against the shards.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>

#include "base/sys.hpp"
#include "checkpoint.hpp"
#include "shmcast/safetensors.hpp"

namespace shmcast::safetensors {

Checkpoint::Impl::~Impl() {
  for (int fd : fds)
    if (fd >= 0) ::close(fd);
  if (dirfd >= 0) ::close(dirfd);
}

Checkpoint::Checkpoint() : impl_(std::make_unique<Impl>()) {}
Checkpoint::Checkpoint(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Checkpoint::Checkpoint(Checkpoint&&) noexcept = default;
Checkpoint& Checkpoint::operator=(Checkpoint&&) noexcept = default;
Checkpoint::~Checkpoint() = default;

const std::string& Checkpoint::path() const { return impl_->path; }
bool Checkpoint::sharded() const { return impl_->sharded; }
const std::vector<CheckpointFile>& Checkpoint::files() const { return impl_->files; }
const std::vector<TensorEntry>& Checkpoint::tensors() const { return impl_->tensors; }
std::uint64_t Checkpoint::payload_bytes() const { return impl_->payload; }

std::ptrdiff_t Checkpoint::find(std::string_view name) const {
  const auto it = impl_->by_name.find(std::string(name));
  return it == impl_->by_name.end() ? -1 : static_cast<std::ptrdiff_t>(it->second);
}

std::vector<TensorSpec> Checkpoint::specs() const {
  std::vector<TensorSpec> out;
  out.reserve(impl_->tensors.size());
  for (const TensorEntry& t : impl_->tensors) {
    TensorSpec s;
    s.name = t.name;
    const std::string where = "tensor '" + t.name.substr(0, 200) + "' of " + impl_->files[t.file].path;
    if (!to_shmcast(t.dtype, &s.dtype))
      throw Error(Errc::kInvalidArgument, where + " has dtype " + t.dtype +
                                              ", which shmcast cannot carry (no sub-byte dtypes): convert the "
                                              "checkpoint, or leave that tensor out");
    if (t.shape.size() > static_cast<std::size_t>(kMaxDims))
      throw Error(Errc::kInvalidArgument, where + " has " + std::to_string(t.shape.size()) +
                                              " dimensions; shmcast carries at most " + std::to_string(kMaxDims));
    if (t.name.empty() || t.name.size() > kMaxNameBytes)
      throw Error(Errc::kInvalidArgument, where + " has a name of " + std::to_string(t.name.size()) +
                                              " bytes; shmcast names are 1.." + std::to_string(kMaxNameBytes) +
                                              " bytes");
    s.shape = t.shape;
    out.push_back(std::move(s));
  }
  return out;
}

namespace {

[[noreturn]] void sys_fail(const std::string& what, int e) {
  Errc code = Errc::kSystem;
  std::string hint;
  if (e == ENOENT || e == ENOTDIR) code = Errc::kNotFound;
  if (e == EACCES || e == EPERM) {
    code = Errc::kPermission;
    hint = ": check the file's mode and owner";
  }
  if (e == EMFILE || e == ENFILE) hint = ": too many open files; raise the limit (ulimit -n)";
  throw Error(code, what + ": " + std::strerror(e) + hint, e);
}

// pread of exactly n bytes; a file that ends early is corrupt (it shrank).
void pread_exact(int fd, void* dst, std::size_t n, std::uint64_t off, const std::string& what) {
  auto* p = static_cast<char*>(dst);
  while (n > 0) {
    const ssize_t r = detail::retry_eintr([&] { return ::pread(fd, p, n, static_cast<off_t>(off)); });
    if (r < 0) sys_fail("reading " + what, errno);
    if (r == 0)
      throw Error(Errc::kCorrupt, what + ": the file ended while its header was read (it is being written or "
                                         "was truncated): wait until it is complete");
    p += r;
    n -= static_cast<std::size_t>(r);
    off += static_cast<std::uint64_t>(r);
  }
}

struct Opened {
  int fd = -1;
  struct stat st {};
};

// Opens a regular file for reading without blocking on a FIFO and, with
// `nofollow`, without following a symlink in its last component.
Opened open_regular(int dirfd, const std::string& rel, bool nofollow, const std::string& what, bool is_shard) {
  Opened o;
  int flags = O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY;
  if (nofollow) flags |= O_NOFOLLOW;
  o.fd = ::openat(dirfd, rel.c_str(), flags);
  if (o.fd < 0) {
    const int e = errno;
    if (e == ELOOP && nofollow)
      throw Error(Errc::kPermission,
                  what + " is a symbolic link; shards are opened only as files inside the checkpoint directory. "
                         "For a Hugging Face cache snapshot (whose files link into ../../blobs), pass "
                         "--allow-symlinks (OpenOptions::allow_symlinks) to follow links you trust",
                  e);
    if (e == ENOENT && is_shard)
      throw Error(Errc::kNotFound, what + " does not exist, but the index names it: the download is incomplete "
                                          "or the index belongs to another checkpoint",
                  e);
    sys_fail("opening " + what, e);
  }
  if (::fstat(o.fd, &o.st) != 0) {
    const int e = errno;
    ::close(o.fd);
    sys_fail("fstat " + what, e);
  }
  if (!S_ISREG(o.st.st_mode)) {
    ::close(o.fd);
    throw Error(Errc::kInvalidArgument, what + " is not a regular file");
  }
  // Reads must block (io_uring honours O_NONBLOCK on regular files too).
  const int fl = ::fcntl(o.fd, F_GETFL);
  if (fl < 0 || ::fcntl(o.fd, F_SETFL, fl & ~O_NONBLOCK) != 0) {
    const int e = errno;
    ::close(o.fd);
    sys_fail("fcntl " + what, e);
  }
  return o;
}

FileHeader read_header(int fd, std::uint64_t size, const std::string& what) {
  std::byte first8[8];
  if (size < 8) return parse_header({}, size, what);  // throws: too short
  pread_exact(fd, first8, 8, 0, what);
  const std::uint64_t n = header_length(first8, size, what);
  std::vector<std::byte> buf(8 + n);
  std::memcpy(buf.data(), first8, 8);
  pread_exact(fd, buf.data() + 8, n, 8, what);
  return parse_header(buf, size, what);
}

std::string join(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  return dir.back() == '/' ? dir + name : dir + "/" + name;
}

// Adds file `rel` (opened through dirfd) to the checkpoint.
void add_file(Checkpoint::Impl& c, int dirfd, const std::string& rel, bool nofollow, const std::string& what,
              bool is_shard) {
  Opened o = open_regular(dirfd, rel, nofollow, what, is_shard);
  c.fds.push_back(o.fd);
  c.dirfds.push_back(dirfd);
  c.rel.push_back(rel);
  c.nofollow.push_back(nofollow);
  c.dev.push_back(o.st.st_dev);
  c.ino.push_back(o.st.st_ino);
  CheckpointFile f;
  f.path = what;
  f.header = read_header(o.fd, static_cast<std::uint64_t>(o.st.st_size), what);
  c.files.push_back(std::move(f));
}

bool ends_with(const std::string& s, std::string_view tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// Entries of a directory whose name ends with `tail` (regular files or links).
std::vector<std::string> list_matching(int dirfd, std::string_view tail) {
  std::vector<std::string> out;
  const int fd = ::openat(dirfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return out;
  DIR* d = ::fdopendir(fd);
  if (!d) {
    ::close(fd);
    return out;
  }
  while (const dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n != "." && n != ".." && ends_with(n, tail)) out.push_back(n);
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

void load_index(Checkpoint::Impl& c, int dirfd, const std::string& dir, const std::string& index_rel,
                bool index_nofollow) {
  const std::string index_what = join(dir, index_rel);
  Opened o = open_regular(dirfd, index_rel, index_nofollow, index_what, true);
  const std::uint64_t size = static_cast<std::uint64_t>(o.st.st_size);
  std::string text;
  try {
    if (size > kMaxIndexBytes)
      throw Error(Errc::kCorrupt, index_what + ": not a valid safetensors index: it is " + std::to_string(size) +
                                      " bytes, more than the " + std::to_string(kMaxIndexBytes) + "-byte limit");
    text.resize(size);
    pread_exact(o.fd, text.data(), size, 0, index_what);
  } catch (...) {
    ::close(o.fd);
    throw;
  }
  ::close(o.fd);
  const std::map<std::string, std::string> weight_map = parse_index(text, index_what);
  if (weight_map.empty())
    throw Error(Errc::kCorrupt, index_what + ": the index maps no tensor: regenerate it from the shards");
  std::set<std::string> shards;
  for (const auto& [name, shard] : weight_map) shards.insert(shard);
  c.sharded = true;
  for (const std::string& shard : shards) add_file(c, dirfd, shard, !c.allow_symlinks, join(dir, shard), true);
  // The index and the shards agree: each shard's tensors are exactly the
  // names the index maps to it.
  std::size_t seen = 0;
  for (const CheckpointFile& f : c.files) {
    const std::string shard = f.path.substr(f.path.rfind('/') + 1);
    for (const TensorEntry& t : f.header.tensors) {
      const auto it = weight_map.find(t.name);
      if (it == weight_map.end())
        throw Error(Errc::kCorrupt, index_what + ": shard " + shard + " holds tensor '" + t.name.substr(0, 200) +
                                        "', which the index does not list: the index and the shards disagree; "
                                        "regenerate the index or download both again");
      if (it->second != shard)
        throw Error(Errc::kCorrupt, index_what + ": tensor '" + t.name.substr(0, 200) + "' is in shard " + shard +
                                        " but the index maps it to " + it->second +
                                        ": the index and the shards disagree; regenerate the index or download "
                                        "both again");
      ++seen;
    }
  }
  if (seen != weight_map.size()) {
    // Some name the index maps is in no shard: find one for the message.
    std::set<std::string> present;
    for (const CheckpointFile& f : c.files)
      for (const TensorEntry& t : f.header.tensors) present.insert(t.name);
    for (const auto& [name, shard] : weight_map)
      if (!present.count(name))
        throw Error(Errc::kCorrupt, index_what + ": the index maps tensor '" + name.substr(0, 200) + "' to shard " +
                                        shard + ", which does not hold it: the index and the shards disagree; "
                                                "regenerate the index or download both again");
  }
}

}  // namespace

Checkpoint open_checkpoint(const std::string& path, const OpenOptions& options) {
  if (path.empty()) throw Error(Errc::kInvalidArgument, "the checkpoint path is empty");
  auto c = std::make_unique<Checkpoint::Impl>();
  c->path = path;
  c->allow_symlinks = options.allow_symlinks;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int e = errno;
    if (e == ENOENT) throw Error(Errc::kNotFound, "checkpoint " + path + " does not exist", e);
    sys_fail("checkpoint " + path, e);
  }
  if (S_ISDIR(st.st_mode)) {
    c->dirfd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (c->dirfd < 0) sys_fail("opening directory " + path, errno);
    // model.safetensors.index.json, else the one *.safetensors.index.json,
    // else model.safetensors, else the one *.safetensors.
    std::string index;
    struct stat ist {};
    if (::fstatat(c->dirfd, "model.safetensors.index.json", &ist, AT_SYMLINK_NOFOLLOW) == 0) {
      index = "model.safetensors.index.json";
    } else {
      const auto idx = list_matching(c->dirfd, ".safetensors.index.json");
      if (idx.size() == 1) index = idx[0];
      if (idx.size() > 1)
        throw Error(Errc::kInvalidArgument, path + " holds " + std::to_string(idx.size()) +
                                                " index files (" + idx[0] + ", " + idx[1] +
                                                ", ...): name the one to load");
    }
    if (!index.empty()) {
      load_index(*c, c->dirfd, path, index, !c->allow_symlinks);
    } else {
      std::string single;
      if (::fstatat(c->dirfd, "model.safetensors", &ist, AT_SYMLINK_NOFOLLOW) == 0) {
        single = "model.safetensors";
      } else {
        const auto files = list_matching(c->dirfd, ".safetensors");
        if (files.size() == 1) single = files[0];
        if (files.size() > 1)
          throw Error(Errc::kInvalidArgument,
                      path + " holds " + std::to_string(files.size()) + " .safetensors files (" + files[0] + ", " +
                          files[1] + ", ...) and no model.safetensors.index.json: name the file to load, or add "
                                     "the index");
      }
      if (single.empty())
        throw Error(Errc::kNotFound, path + " holds neither model.safetensors.index.json nor a .safetensors file");
      add_file(*c, c->dirfd, single, !c->allow_symlinks, join(path, single), false);
    }
  } else {
    const auto slash = path.rfind('/');
    const std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
    const std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
    if (ends_with(base, ".index.json")) {
      c->dirfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
      if (c->dirfd < 0) sys_fail("opening directory " + dir, errno);
      // The index itself is what the user named: follow it; its shards are
      // resolved in its directory.
      load_index(*c, c->dirfd, slash == std::string::npos ? std::string() : dir, base, false);
    } else {
      // The file the user named: symlinks in its path are the user's choice.
      add_file(*c, AT_FDCWD, path, false, path, false);
    }
  }
  for (std::uint32_t f = 0; f < c->files.size(); ++f)
    for (const TensorEntry& t : c->files[f].header.tensors) {
      TensorEntry e = t;
      e.file = f;
      if (!c->by_name.emplace(e.name, c->tensors.size()).second)
        throw Error(Errc::kCorrupt, "tensor '" + e.name.substr(0, 200) + "' appears in two files of " + path);
      c->payload += e.nbytes;
      c->tensors.push_back(std::move(e));
    }
  return Checkpoint(std::move(c));
}

}  // namespace shmcast::safetensors
