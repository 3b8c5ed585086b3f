// The fd channel: how a producer hands file descriptors (the device slots'
// GPU memory, exported by the CUDA VMM API as POSIX fds) to the consumers of
// its region, without CUDA IPC handles and without pidfd_getfd: a Unix
// socket next to the region file, SCM_RIGHTS, and the region's trust rule
// checked on both ends with SO_PEERCRED. docs/protocol.md ("The fd channel")
// specifies the bytes; this header is the same thing in C++.
//
//   producer: FdServer::start(dir, name, fds, info, options)   a thread serves
//             every connecting process it trusts, then closes the connection
//   consumer: fetch_fds(dir, name, options)                     one connection,
//             one message, the fds (owned, close-on-exec)
//
// The channel does not care what the fds are: production sends VMM fds
// (FdKind::kCudaVmm), the tests memfds (FdKind::kHostMemory). The descriptor
// that travels with them says which, how large each is, on which GPU, and for
// which region (a nonce the consumer read from the region: fds served for
// another region are never taken).
//
// Socket: SOCK_SEQPACKET (connection-oriented like a stream socket, so
// SO_PEERCRED names the peer, but one message is delivered whole or not at
// all: the descriptor and its fds arrive in one recvmsg, never split).
//
// Fork: the server's descriptors (listening socket, wake-up eventfd, its
// copies of the fds) are closed in a forked child (liveness.hpp's fork
// registry), so a child never keeps the GPU memory or the socket alive; an
// FdServer inherited through fork does nothing in the child.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shm/region.hpp"
#include "shmcast/shmcast.hpp"

namespace shmcast::detail {

// A file descriptor this object owns: closed when it goes.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) noexcept : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.release()) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) reset(o.release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }
  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }
  int release() noexcept {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset(int fd = -1) noexcept;

 private:
  int fd_ = -1;
};

// What the fds are. The consumer names the kind it expects, so a memfd is
// never imported as GPU memory, nor the reverse.
enum class FdKind : std::uint32_t {
  kHostMemory = 1,  // memfds (the CPU tests)
  kCudaVmm = 2,     // cuMemExportToShareableHandle(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
};

// The descriptor that travels with the fds.
struct FdSetInfo {
  FdKind kind = FdKind::kHostMemory;
  std::uint64_t region_nonce = 0;              // which region they belong to (never 0)
  std::array<std::uint8_t, 16> device_uuid{};  // kCudaVmm: the GPU that holds them; zeros otherwise
  std::vector<std::uint64_t> sizes;            // bytes of each fd's allocation, one per fd, in fd order
};

// The message (docs/protocol.md): a 64-byte header, then one u64 size per fd.
inline constexpr std::uint32_t kFdMessageMagic = 0x44464353;  // "SCFD" in file order
inline constexpr std::uint16_t kFdMessageVersion = 1;
inline constexpr std::size_t kFdMessageHeaderBytes = 64;
inline constexpr std::uint32_t kMaxChannelFds = 253;  // SCM_MAX_FD: the most one message can carry
inline constexpr std::uint64_t kMaxChannelFdBytes = 1ull << 46;  // 64 TiB: one allocation
inline constexpr std::size_t kMaxFdMessageBytes = kFdMessageHeaderBytes + 8 * kMaxChannelFds;

// The refusal (docs/protocol.md 13.2): what a server sends, with no fds, to
// a process it trusts but cannot serve now; the client waits and connects
// again until its deadline, then names the cause. 64 bytes.
inline constexpr std::uint32_t kFdRefusalMagic = 0x52464353;  // "SCFR" in file order
enum class FdRefusal : std::uint32_t {
  kProcessLimit = 1,  // this process holds kFdUnreadPerProcess messages it has not read
  kUidLimit = 2,      // its uid's processes hold kFdUnreadPerUid
  kTotalLimit = 3,    // all clients hold the server's total
  kKernelInFlight = 4,  // sendmsg failed with ETOOMANYREFS: the producer's user has too many fds in flight
  kServerFdLimit = 5,   // accept failed with EMFILE/ENFILE: the producer is at its open-file limit
};
struct FdRefusalInfo {
  FdRefusal reason = FdRefusal::kTotalLimit;
  std::uint32_t held = 0;   // unread messages counted against the limit that refused (the server's, for 4 and 5)
  std::uint32_t limit = 0;  // that limit (0 for 4 and 5)
  std::int32_t top_pid = 0;   // the client holding the most unread messages (0: none)
  std::uint32_t top_uid = 0;
  std::uint32_t top_held = 0;
};
std::vector<std::byte> encode_fd_refusal(const FdRefusalInfo& r);
// Empty when `msg` is one well-formed refusal, filling *out; else what is wrong.
std::string decode_fd_refusal(std::span<const std::byte> msg, FdRefusalInfo* out);

// How many messages the server lets sit unread (sent, not yet received by
// the client, so their fds are in flight and charged by the kernel to the
// producer's user until then: past the producer's RLIMIT_NOFILE every
// sendmsg of that user fails with ETOOMANYREFS). The server keeps its end of
// each such connection (closing it would not return the fds: the message
// waits in the client's receive queue, which only the client can empty) and
// counts it until the client has read it or closed. Per process (SO_PEERCRED
// uid and pid), per uid, and in total; the total is further held to
// RLIMIT_NOFILE / (2 * (fds + 1)) at start (each unread message costs the
// server one descriptor and its fds in flight), at least 1; the other two
// never exceed the total. Beyond a limit a trusted client gets a refusal.
inline constexpr std::uint32_t kFdUnreadPerProcess = 4;
inline constexpr std::uint32_t kFdUnreadPerUid = 32;
inline constexpr std::uint32_t kFdUnreadTotal = 64;
// A message not read within this is the client's hoarding: logged, naming it.
inline constexpr std::chrono::seconds kFdTakeDeadline{5};

// The message for `info`. Throws kInvalidArgument for a descriptor no
// consumer would accept (no fds, too many, a size of 0 or over the limit, an
// unknown kind, nonce 0).
std::vector<std::byte> encode_fd_message(const FdSetInfo& info);
// Empty when `msg` is one well-formed message (magic, version, header size,
// fd count, length, kind, sizes, reserved bytes zero), filling *out; else
// what is wrong with it. Untrusted input: never reads past `msg`.
std::string decode_fd_message(std::span<const std::byte> msg, FdSetInfo* out);

// The socket's file name in the region directory: "shmcast-slots.<name>".
// Not "shmcast.<name>.slots", which is the file of a region named
// "<name>.slots". Names longer than 64 characters become their first 48
// characters, '~' and the XXH3-64 of the whole name in hex (a '~' is in no
// region name), so that the name fits a socket address.
std::string slot_socket_name(std::string_view name);
std::string slot_socket_file(std::string_view dir, std::string_view name);

struct FdServerOptions {
  // Who gets the fds besides processes of this effective uid: the uids in
  // trust.trusted_uids, and with trust.group_access the members of the
  // region's group `region_gid` (-1: none). group_access also makes the
  // socket mode 0660 instead of 0600.
  TrustPolicy trust;
  std::int64_t region_gid = -1;
  // Replace a socket of this uid at the name when no server listens on it
  // any more (its producer died); else kExists.
  bool replace_stale = true;
  // Refusals and failures of the server thread, one line each (rate-limited:
  // a flood of refused connections gives a few lines and a count). Called on
  // the server's thread; must not call stop(). Default: stderr.
  std::function<void(const std::string&)> on_event;
};

class FdServer {
 public:
  // Creates the socket <dir>/shmcast-slots.<name> (never through a link,
  // never over anything that is there unless it is a stale socket of ours:
  // see FdServerOptions::replace_stale), then serves `fds` with `info` on a
  // thread until stop(). The server keeps its own duplicates of `fds`; the
  // caller may close its own. Throws kBadName, kInvalidArgument (a bad
  // descriptor, or as many fds as info.sizes), kExists (a live server, or
  // something that is not our socket, at the name), kPermission, kSystem.
  static FdServer start(const std::string& dir, std::string_view name, std::span<const int> fds,
                        const FdSetInfo& info, const FdServerOptions& options = {});

  FdServer();
  FdServer(FdServer&&) noexcept;
  FdServer& operator=(FdServer&&) noexcept;
  ~FdServer();  // stop()

  // Stops serving at once (an eventfd wakes the thread: no polling
  // interval), closes the socket and removes its name if it is still this
  // server's socket (same device and inode), then closes the duplicates.
  // Connections already accepted have their message or nothing. Idempotent.
  void stop();

  const std::string& path() const;
  // Connections served (the message sent) and refused (untrusted, or a
  // refusal sent), so far; messages sent and not yet read, now.
  std::uint64_t served() const;
  std::uint64_t refused() const;
  std::uint32_t unread() const;

  struct Impl;

 private:
  explicit FdServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

struct FdFetchOptions {
  // Which servers to trust: the server's uid (SO_PEERCRED) must be this
  // process's effective uid or one of trust.trusted_uids (the rule a region
  // file's owner must pass).
  TrustPolicy trust;
  FdKind kind = FdKind::kHostMemory;  // what the caller will do with the fds
  std::uint64_t region_nonce = 0;     // the nonce of the region the caller opened
  std::uint32_t expect_fds = 0;       // when non-zero, exactly this many fds
  std::uint64_t expect_bytes = 0;     // when non-zero, each fd's size must be this
  // When non-zero, the server must be this process (as this process's PID
  // namespace sees it): the region's producer, when the caller can tell its
  // pid (same PID namespace).
  std::int32_t expect_pid = 0;
  // The whole fetch (waiting for the socket, connecting, the message).
  Duration timeout = std::chrono::seconds(30);
  // Asked while waiting: a non-empty reason when the producer is known dead
  // (its region's lock is free); the fetch then throws kPeerDied with it.
  std::function<std::string()> peer_gone;
  // Called once the connection is up and the server passed the checks,
  // before the message is awaited (tests use it as a handshake).
  std::function<void()> on_connected;
};

struct FetchedFds {
  FdSetInfo info;
  std::vector<UniqueFd> fds;  // one per info.sizes entry, close-on-exec
  std::int32_t server_pid = 0;
  std::uint32_t server_uid = 0;
};

// Connects to <dir>/shmcast-slots.<name>, checks the server before reading
// a byte (SO_PEERCRED: trusted uid, and expect_pid), receives the message
// and its fds, and checks them (decode_fd_message, kind, nonce, counts,
// sizes). Waits while the socket is absent or refuses connections (a
// producer starting or restarting), or while the server sends refusals (its
// limits of unread messages, ETOOMANYREFS, EMFILE), until the deadline. On any error every
// fd received is closed. Throws kPermission (an untrusted server, a link or
// a non-socket at the name, a server that refused this process), kTimeout,
// kPeerDied (the server vanished, or peer_gone said so), kCorrupt (a bad
// message, another region's fds), kTimeout (refused for its limits until the
// deadline), kSystem (this process's fd limit; the producer's, EMFILE; its
// user's fds in flight, ETOOMANYREFS: each named).
FetchedFds fetch_fds(const std::string& dir, std::string_view name, const FdFetchOptions& options);

}  // namespace shmcast::detail
