// The relay's public helpers (shmcast/relay.hpp): addresses, the key file,
// the default status path. Used by the tool before a Relay exists, and by
// Relay::Impl's constructor.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "base/sys.hpp"
#include "owner.hpp"
#include "shmcast/files.hpp"
#include "shmcast/relay.hpp"

namespace shmcast::relay {

using detail::retry_eintr;

std::string Address::str() const {
  if (host.find(':') != std::string::npos) return "[" + host + "]:" + std::to_string(port);
  return host + ":" + std::to_string(port);
}

Address parse_address(std::string_view s) {
  Address a;
  std::string_view host, port;
  if (!s.empty() && s.front() == '[') {
    const auto close = s.find(']');
    if (close == std::string_view::npos || close + 1 >= s.size() || s[close + 1] != ':')
      throw Error(Errc::kInvalidArgument, "bad address '" + std::string(s) + "': use [V6ADDR]:PORT");
    host = s.substr(1, close - 1);
    port = s.substr(close + 2);
  } else {
    const auto colon = s.rfind(':');
    if (colon == std::string_view::npos || s.find(':') != colon)
      throw Error(Errc::kInvalidArgument, "bad address '" + std::string(s) + "': use HOST:PORT");
    host = s.substr(0, colon);
    port = s.substr(colon + 1);
  }
  if (host.empty() || port.empty() || port.size() > 5 ||
      !std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; }) ||
      std::stoul(std::string(port)) > 65535)
    throw Error(Errc::kInvalidArgument, "bad address '" + std::string(s) + "': use HOST:PORT with a port of 0..65535");
  a.host = std::string(host);
  a.port = static_cast<std::uint16_t>(std::stoul(std::string(port)));
  return a;
}

namespace {

std::string dir_of(const std::string& path) {
  const auto slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

const char* kind_of(mode_t m) {
  if (S_ISFIFO(m)) return "a FIFO (named pipe)";
  if (S_ISSOCK(m)) return "a socket";
  if (S_ISCHR(m) || S_ISBLK(m)) return "a device";
  if (S_ISDIR(m)) return "a directory";
  return "not a regular file";
}

// The file the key is read from: `path` itself, or, when `path` is a
// symbolic link, its target, but only when no one else can have put the
// link there: it is owned by this user or root, in a directory that others
// cannot change (no group or other write bit, or the sticky bit, which keeps
// others from replacing an entry they do not own). A Kubernetes Secret
// volume is such a directory: root's links (key -> ..data/key) in a sticky
// tmpfs. A link planted by another uid, or in a directory anyone may write,
// is refused, and so is anything that is not a regular file (a FIFO would
// block the open for ever).
std::string key_target(const std::string& path) {
  struct stat ls {};
  if (::lstat(path.c_str(), &ls) != 0)
    throw Error(errno == EACCES ? Errc::kPermission : Errc::kInvalidArgument,
                "cannot open key file " + path + ": " + std::strerror(errno), errno);
  if (!S_ISLNK(ls.st_mode)) return path;
  const std::string dir = dir_of(path);
  struct stat ds {};
  if (::stat(dir.c_str(), &ds) != 0)
    throw Error(Errc::kInvalidArgument, "cannot check the directory of key file " + path + ": " + std::strerror(errno),
                errno);
  if (ls.st_uid != ::geteuid() && ls.st_uid != 0)
    throw Error(Errc::kPermission, "key file " + path + " is a symbolic link owned by " + owner_text(ls.st_uid) +
                                       ", not by this user or root: refused (someone may be redirecting the key); "
                                       "give the path of the key file itself, owned by this user (0600)");
  if ((ds.st_mode & 0022) != 0 && (ds.st_mode & S_ISVTX) == 0)
    throw Error(Errc::kPermission, "key file " + path + " is a symbolic link in " + dir +
                                       ", which others may write (no sticky bit): refused (anyone there can "
                                       "redirect it); move the key into a directory only you can write and give "
                                       "its own path");
  char* real = ::realpath(path.c_str(), nullptr);
  if (real == nullptr)
    throw Error(Errc::kInvalidArgument, "cannot resolve key file " + path + ": " + std::strerror(errno), errno);
  std::string r(real);
  std::free(real);
  return r;
}

}  // namespace

std::string load_key(const std::string& key_file) {
  std::string key;
  if (!key_file.empty()) {
    const std::string target = key_target(key_file);
    const std::string shown = target == key_file ? key_file : key_file + " (-> " + target + ")";
    // As regions are opened: never through a link (the one above was
    // resolved), and never blocking (a FIFO).
    const int fd = ::open(target.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
      const int e = errno;
      if (e == ELOOP)
        throw Error(Errc::kPermission, "key file " + shown + " became a symbolic link while it was opened: refused "
                                           "(someone may be redirecting the key); check the directory",
                    e);
      throw Error(e == EACCES ? Errc::kPermission : Errc::kInvalidArgument,
                  "cannot open key file " + shown + ": " + std::strerror(e), e);
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      const mode_t m = st.st_mode;
      ::close(fd);
      throw Error(Errc::kInvalidArgument, "key file " + shown + " is " + kind_of(m) +
                                              ": refused; put the key in a regular file (0600) and give its path");
    }
    // Whoever may write the key can make this relay trust a peer of their
    // choosing: the file must be this user's (or root's), and no one else
    // may write it or, outside its group, read it.
    if (st.st_uid != ::geteuid() && st.st_uid != 0) {
      ::close(fd);
      throw Error(Errc::kPermission, "key file " + shown + " is owned by uid " + std::to_string(st.st_uid) +
                                         ", not by this user (uid " + std::to_string(::geteuid()) +
                                         ") or root: whoever owns it can change the key; chown it");
    }
    if ((st.st_mode & 0022) != 0) {
      ::close(fd);
      char mode[8];
      std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
      throw Error(Errc::kPermission, "key file " + shown + " (mode " + mode +
                                         ") can be written by its group or by others: chmod go-w it (0600, or 0440 "
                                         "with a group; Kubernetes: defaultMode: 0440 and fsGroup)");
    }
    if ((st.st_mode & 0007) != 0) {
      ::close(fd);
      throw Error(Errc::kPermission, "key file " + shown +
                                         " can be read or written by others: chmod o-rwx it (0600, or 0440 with a "
                                         "group; Kubernetes: defaultMode: 0440 and fsGroup)");
    }
    char buf[4096];
    for (;;) {
      const ssize_t n = retry_eintr([&] { return ::read(fd, buf, sizeof buf); });
      if (n < 0) {
        const int e = errno;
        ::close(fd);
        throw Error(Errc::kSystem, "cannot read key file " + key_file + ": " + std::strerror(e), e);
      }
      if (n == 0) break;
      key.append(buf, static_cast<std::size_t>(n));
      if (key.size() > (1u << 16)) {
        ::close(fd);
        throw Error(Errc::kInvalidArgument, "key file " + key_file + " is larger than 64 KiB");
      }
    }
    ::close(fd);
    if (!key.empty() && key.back() == '\n') key.pop_back();
    if (!key.empty() && key.back() == '\r') key.pop_back();
  } else if (const char* env = std::getenv("SHMCAST_RELAY_KEY"); env != nullptr) {
    key = env;
  } else {
    throw Error(Errc::kInvalidArgument, "no key: give --key-file FILE or set SHMCAST_RELAY_KEY (the same secret, of "
                                        "at least 16 bytes, on every node)");
  }
  if (key.size() < 16)
    throw Error(Errc::kInvalidArgument, "the relay key has " + std::to_string(key.size()) +
                                            " bytes; use at least 16 (e.g. `openssl rand -hex 32`)");
  return key;
}

std::string default_status_path(std::string_view name) {
  return region_dir() + "/shmcast-relay." + std::string(name) + ".json";
}

}  // namespace shmcast::relay
