// A relay connection's control channel: a TCP socket of the relay's own
// (not UCX's), carrying framed control messages (a 32-bit length, then the
// message) both ways. The handshake and every control message travel here,
// so a message is bound to the connection it arrives on: there is no id for
// a sender to write. Chunk bytes travel over UCX (docs/relay.md).
// Non-blocking; one thread (the relay's network thread).
#pragma once

#include <sys/socket.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace shmcast::relay {

class CtrlSocket {
 public:
  CtrlSocket() = default;
  explicit CtrlSocket(int fd) : fd_(fd) {}
  ~CtrlSocket() { close(); }
  CtrlSocket(CtrlSocket&& o) noexcept { *this = std::move(o); }
  CtrlSocket& operator=(CtrlSocket&& o) noexcept;
  CtrlSocket(const CtrlSocket&) = delete;
  CtrlSocket& operator=(const CtrlSocket&) = delete;

  int fd() const { return fd_; }
  bool is_open() const { return fd_ >= 0; }
  void close();

  // Queues `msg` as one frame; false (nothing queued) when the bytes not
  // yet written would exceed `max_out` (a peer that does not read).
  bool send(std::span<const std::uint8_t> msg, std::size_t max_out);
  // Writes what the socket takes; false on an error (error() says).
  bool flush();
  bool want_write() const { return out_off_ < out_.size(); }
  std::size_t pending_out() const { return out_.size() - out_off_; }
  // Reads what arrived (at most `budget` bytes) and moves each complete
  // frame into `frames`. False when the peer closed the connection, on an
  // error, or on a frame announced larger than `max_frame` (error() says);
  // the frames completed before are kept. A frame's bytes are buffered only
  // as they arrive: an announced length allocates nothing.
  bool receive(std::size_t max_frame, std::vector<std::vector<std::uint8_t>>* frames,
               std::size_t budget = 4u << 20);
  const std::string& error() const { return err_; }
  // A non-blocking connect() finished: "" when connected, else why not.
  std::string connect_result() const;

 private:
  int fd_ = -1;
  std::vector<std::uint8_t> in_;
  std::vector<std::uint8_t> out_;
  std::size_t out_off_ = 0;
  std::string err_;
};

// Sockets for control channels (non-blocking, close-on-exec, TCP_NODELAY,
// keepalive: a peer that vanishes is noticed within about 30 s). Throw
// Error(kSystem) with `what` on failure.
int ctrl_listen(const sockaddr_storage& addr, socklen_t len, const std::string& what);
// Starts connecting (EINPROGRESS is fine); -1 and *err on failure.
int ctrl_connect(const sockaddr_storage& addr, socklen_t len, std::string* err);
void ctrl_tune(int fd);

}  // namespace shmcast::relay
