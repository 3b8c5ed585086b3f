// Liveness of peers. Each attached process holds an fcntl OFD write lock on
// its own byte of the region file (layout.hpp: kProducerLockByte,
// seat_lock_byte). The kernel drops the lock when the last reference to the
// open file description goes, so a probe with F_OFD_GETLK answers "is the
// holder alive" without trusting a pid: it works across PID namespaces and
// is immune to pid reuse. The pid, start time and PID namespace are
// recorded too, for people and tools.
//
// Fork: an OFD lock would follow the descriptor (and any mapping of it) into
// a forked child, keeping a dead parent "alive". So every region descriptor
// is tracked here and closed in the child by a pthread_atfork handler, and
// mappings are MADV_DONTFORK (region.cpp): the child holds no reference.
//
// Calls return 0 or -errno.
#pragma once

#include <cstdint>

#include "base/layout.hpp"

namespace shmcast::detail {

struct SelfIdentity {
  std::uint32_t pid;
  std::uint64_t start_time;  // clock ticks since boot, /proc/self/stat field 22
  std::uint64_t pidns;       // inode of /proc/self/ns/pid, 0 if unknown
};

SelfIdentity self_identity();
void write_identity(Identity& dst, const SelfIdentity& me);

// Start time of `pid` in this PID namespace, or 0 when it has none.
std::uint64_t process_start_time(std::uint32_t pid);

// Takes the write lock on `byte` without blocking: 0, -EAGAIN when another
// open file description holds it, or another -errno.
int lock_byte(int fd, std::int64_t byte);
int unlock_byte(int fd, std::int64_t byte);

// Region descriptors to close in a forked child (see above). Hold a
// ForkGuard from the open() of a region descriptor to its track_fd(), from
// mmap() to madvise(MADV_DONTFORK), and from untrack_fd() to close(): the
// guard holds the lock the atfork prepare handler takes, so a fork() from
// another thread cannot fall between the two.
class ForkGuard {
 public:
  ForkGuard();
  ~ForkGuard();
  ForkGuard(const ForkGuard&) = delete;
  ForkGuard& operator=(const ForkGuard&) = delete;
};
void track_fd(int fd, const ForkGuard&);
void untrack_fd(int fd, const ForkGuard&);

enum class Alive { kYes, kNo, kUnknown };

// Is some other open file description holding the lock on `byte`?
Alive lock_held(int fd, std::int64_t byte);
// ... a write lock on any byte of the file (some participant is attached)?
Alive any_lock_held(int fd);

// Liveness of the process recorded in `id` whose lock byte is `byte`: the
// lock answers when it can; else pid + start time when the recorded PID
// namespace is ours.
Alive peer_alive(int fd, std::int64_t byte, const Identity& id);

// The producer (rank 0) of a region file opened by name, as a process about
// to join it must judge it (docs/protocol.md §8-9). kNo means "do not join
// now, look at the path again": lock byte 0 is free, or, after it,
// kTakeoverLockByte is held (a new producer replacing a stale file holds
// byte 0 itself; a create() that finds a live producer holds both for a
// moment). In that order: a takeover locks its byte before byte 0 and
// removes the name before it lets go of either, so byte 0 held and then the
// takeover byte free means the producer's own lock, or a takeover that has
// finished; the caller then checks that the path still names its file. Not
// for peers already attached (ring.cpp): a passing create() attempt would
// make a live producer look dead to them.
Alive producer_alive_for_join(int fd, const Identity& id);

}  // namespace shmcast::detail
