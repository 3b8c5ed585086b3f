#include "ctrl.hpp"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "base/sys.hpp"
#include "shmcast/shmcast.hpp"

namespace shmcast::relay {

CtrlSocket& CtrlSocket::operator=(CtrlSocket&& o) noexcept {
  if (this != &o) {
    close();
    fd_ = o.fd_;
    o.fd_ = -1;
    in_ = std::move(o.in_);
    out_ = std::move(o.out_);
    out_off_ = o.out_off_;
    o.out_off_ = 0;
    err_ = std::move(o.err_);
  }
  return *this;
}

void CtrlSocket::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

bool CtrlSocket::send(std::span<const std::uint8_t> msg, std::size_t max_out) {
  if (fd_ < 0 || msg.size() > 0xffffffffu || pending_out() + 4 + msg.size() > max_out) return false;
  if (out_off_ == out_.size()) {
    out_.clear();
    out_off_ = 0;
  }
  const std::uint32_t n = static_cast<std::uint32_t>(msg.size());
  const auto* np = reinterpret_cast<const std::uint8_t*>(&n);
  out_.insert(out_.end(), np, np + 4);
  out_.insert(out_.end(), msg.begin(), msg.end());
  return true;
}

bool CtrlSocket::flush() {
  while (fd_ >= 0 && out_off_ < out_.size()) {
    const ssize_t n = detail::retry_eintr(
        [&] { return ::send(fd_, out_.data() + out_off_, out_.size() - out_off_, MSG_NOSIGNAL | MSG_DONTWAIT); });
    if (n > 0) {
      out_off_ += static_cast<std::size_t>(n);
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    err_ = std::string("send: ") + (n < 0 ? std::strerror(errno) : "wrote nothing");
    return false;
  }
  if (out_off_ == out_.size() && out_.capacity() > (1u << 20)) {
    std::vector<std::uint8_t>().swap(out_);  // a large message went: give its memory back
    out_off_ = 0;
  }
  return fd_ >= 0;
}

bool CtrlSocket::receive(std::size_t max_frame, std::vector<std::vector<std::uint8_t>>* frames, std::size_t budget) {
  if (fd_ < 0) {
    err_ = "closed";
    return false;
  }
  std::size_t got = 0;
  bool more = true;
  while (more && got < budget) {
    // 64 KiB at a time: memory follows the bytes that arrived, never the
    // length a peer announced.
    const std::size_t want = 64u << 10;
    const std::size_t old = in_.size();
    in_.resize(old + want);
    const ssize_t n = detail::retry_eintr([&] { return ::recv(fd_, in_.data() + old, want, MSG_DONTWAIT); });
    if (n > 0) {
      in_.resize(old + static_cast<std::size_t>(n));
      got += static_cast<std::size_t>(n);
    } else {
      in_.resize(old);
      if (n == 0) {
        err_ = "the peer closed the connection";
        more = false;
        got = budget;  // stop, then report once the frames are out
      } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
        more = false;
      } else {
        err_ = std::string("recv: ") + std::strerror(errno);
        return false;
      }
    }
    // Complete frames out.
    std::size_t at = 0;
    while (in_.size() - at >= 4) {
      std::uint32_t len = 0;
      std::memcpy(&len, in_.data() + at, 4);
      if (len > max_frame) {
        err_ = "a control message of " + std::to_string(len) + " bytes, more than the " + std::to_string(max_frame) +
               " taken here";
        in_.erase(in_.begin(), in_.begin() + static_cast<std::ptrdiff_t>(at));
        return false;
      }
      if (in_.size() - at - 4 < len) break;
      frames->emplace_back(in_.begin() + static_cast<std::ptrdiff_t>(at + 4),
                           in_.begin() + static_cast<std::ptrdiff_t>(at + 4 + len));
      at += 4 + len;
    }
    if (at > 0) in_.erase(in_.begin(), in_.begin() + static_cast<std::ptrdiff_t>(at));
    if (!err_.empty()) return false;
  }
  return true;
}

std::string CtrlSocket::connect_result() const {
  int e = 0;
  socklen_t len = sizeof e;
  if (::getsockopt(fd_, SOL_SOCKET, SO_ERROR, &e, &len) != 0) return std::strerror(errno);
  if (e != 0) return std::strerror(e);
  sockaddr_storage peer{};
  socklen_t plen = sizeof peer;
  if (::getpeername(fd_, reinterpret_cast<sockaddr*>(&peer), &plen) != 0) return "not connected yet";
  return "";
}

void ctrl_tune(int fd) {
  const int one = 1, idle = 10, intvl = 5, cnt = 4;
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  (void)::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
}

int ctrl_listen(const sockaddr_storage& addr, socklen_t len, const std::string& what) {
  const int fd = ::socket(addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) throw Error(Errc::kSystem, "cannot listen on " + what + ": socket: " + std::strerror(errno), errno);
  // A relay restarted on its port listens again at once, while the old
  // connections linger in TIME_WAIT.
  const int one = 1;
  (void)::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&addr), len) != 0 || ::listen(fd, 1024) != 0) {
    const int e = errno;
    ::close(fd);
    throw Error(Errc::kSystem,
                "cannot listen on " + what + ": " + std::strerror(e) + (e == EADDRINUSE ? " (the port is in use)" : ""),
                e);
  }
  return fd;
}

int ctrl_connect(const sockaddr_storage& addr, socklen_t len, std::string* err) {
  const int fd = ::socket(addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    *err = std::string("socket: ") + std::strerror(errno);
    return -1;
  }
  ctrl_tune(fd);
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), len) != 0 && errno != EINPROGRESS) {
    *err = std::strerror(errno);
    ::close(fd);
    return -1;
  }
  return fd;
}

}  // namespace shmcast::relay
