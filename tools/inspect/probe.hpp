// shmcast-inspect: read-only probing of region files.
//
// Everything here treats the region file as hostile input. A region path is
// opened one way only (open_region_file: O_NOFOLLOW | O_NONBLOCK, then fstat
// on the descriptor), read-only; no lock is ever taken and no byte is ever
// written. A file owned by another user, or writable by users the caller
// does not trust, is reported as untrusted and its bytes are never read.
// Every byte the tool looks at is first copied out of the mapping into
// private memory by a copy that survives SIGBUS (guarded_copy: a file
// truncated under us), or read with pread; every count, offset and size is
// checked against the mapped size before it is used.
#pragma once

#include <sys/stat.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "layout.hpp"
#include "liveness.hpp"
#include "ring.hpp"
#include "shmcast/shmcast.hpp"

namespace shmcast::inspect {

using detail::Alive;

// Region states, as printed and as they appear in JSON.
inline constexpr const char* kStateCreating = "creating";        // creator still initialising
inline constexpr const char* kStateReady = "ready";              // valid, producer alive (or unknown)
inline constexpr const char* kStateClosed = "closed";            // producer closed it cleanly
inline constexpr const char* kStateDead = "dead";                // producer died (or creation died)
inline constexpr const char* kStateCorrupt = "corrupt";          // our magic, bad header
inline constexpr const char* kStateForeign = "foreign";          // not a shmcast region
inline constexpr const char* kStateNewer = "newer-version";      // made by a newer shmcast
inline constexpr const char* kStateOlder = "older-version";      // made by an older shmcast
inline constexpr const char* kStateTruncated = "truncated";      // file size disagrees with the header
inline constexpr const char* kStateUnreadable = "unreadable";    // the OS refused to open or map it
inline constexpr const char* kStateUntrusted = "untrusted-owner";  // another user's file, or writable by others

// True for the states in which the header was validated and every field of
// RegionReport below `header_valid` is meaningful.
bool state_is_valid(const std::string& state);
// True for corrupt, foreign, newer/older-version, truncated, unreadable and
// untrusted-owner: show exits 4 and dump refuses them.
bool state_is_damaged(const std::string& state);

struct SeatReport {
  std::uint32_t index = 0;
  std::uint64_t word = 0;
  std::string state;  // free / active / evicted / invalid
  std::uint64_t generation = 0;
  std::uint32_t pid = 0;
  std::uint64_t start_time = 0;
  std::uint64_t pidns = 0;
  Alive alive = Alive::kUnknown;  // the seat's lock byte is held
  std::uint64_t attach_unix_ns = 0;
  std::uint64_t released_seq = 0;
  std::uint64_t acked_version = 0;
  std::uint64_t syncs_done = 0;
  std::uint64_t bytes_done = 0;
  std::uint32_t error_code = 0;
  std::string error_text;
  std::uint64_t included_gen = 0;
  bool enrolled = false;  // active and enrolled by the producer for its generation
  std::uint64_t first_seq = 0;
  std::uint64_t first_version = 0;
  std::uint32_t evict_reason = 0;
  std::uint64_t lag_chunks = 0;  // published chunks this (enrolled) seat has not released
};

struct SlotReport {
  std::uint32_t index = 0;
  std::uint64_t seq = 0;
  std::uint64_t version = 0;
  std::uint64_t bytes = 0;
  std::uint64_t checksum = 0;
  std::string state;        // empty / filling / published / held / released
  std::uint32_t holders = 0;  // live enrolled seats that have not released it
};

struct ManifestReport {
  std::string status = "none";  // none / ok / changing / invalid / skipped
  std::string reason;
  // Valid when status == "ok". Every entry was validated, but only the first
  // ProbeOptions::manifest_limit of them are decoded into `tensors`.
  std::uint64_t version = 0;
  std::uint64_t tensor_count = 0;
  std::uint64_t payload_bytes = 0;
  std::uint64_t stream_bytes = 0;
  std::uint32_t world_size = 1;  // producer ranks
  std::vector<TensorInfo> tensors;
};

// Who owns a region file and who may write it (from fstat, else lstat).
struct OwnerReport {
  bool known = false;
  std::uint32_t uid = 0, gid = 0;
  std::string user, group;  // empty when the id has no name
  std::uint32_t mode = 0;   // permission bits (st_mode & 07777)
  bool trusted = false;     // untrusted_why() was empty
};

struct RegionReport {
  std::string name;
  std::string path;
  bool valid_name = true;
  std::string state;
  std::string reason;  // why the state is what it is, when not ready
  std::string file_type;  // regular / symlink / fifo / directory / socket / char-device / block-device / unknown
  OwnerReport owner;

  std::uint64_t size = 0;  // fstat (lstat when not opened)
  std::uint64_t inode = 0;
  double age_s = 0;          // since the file's last status change (ctime)
  bool young = false;        // age_s < the grace period
  Alive any_lock = Alive::kUnknown;  // some process holds a lock on the file

  // HeaderFixed snapshot: valid when have_fixed (file >= 128 bytes).
  bool have_fixed = false;
  detail::HeaderFixed fixed{};
  // Lifecycle fields: valid when have_header (file >= 4096 bytes, our magic).
  bool have_header = false;
  std::uint32_t init_state = 0;
  std::uint32_t error_code = 0;
  std::string error_text;
  std::uint32_t producer_pid = 0;
  std::uint64_t producer_start_time = 0;
  std::uint64_t producer_pidns = 0;
  Alive producer_alive = Alive::kUnknown;
  std::uint64_t generation = 0, evictions = 0, published_seq = 0, syncs_done = 0, bytes_done = 0,
                last_sync_ns = 0, last_end_unix_ns = 0;

  // Everything below: valid when header_valid (validate_header passed).
  bool header_valid = false;
  detail::Geometry geo{};
  bool have_record = false;    // false only when the file shrank under us
  bool record_stable = false;  // the seqlock gave a consistent copy (see read_record_any)
  detail::RecordSnapshot record{};
  std::string sync_status;  // none / writing / published / aborted / unknown
  std::uint64_t chunks_published = 0;
  std::vector<SeatReport> seats;
  std::vector<SlotReport> slots;
  std::uint32_t consumers_attached = 0;  // seats in state active
  std::uint32_t consumers_alive = 0;     // ... whose lock byte is held
  ManifestReport manifest;
};

struct ProbeOptions {
  bool decode_manifest = false;
  std::size_t manifest_limit = 0;  // manifest entries to decode (all are validated); 0: all
  double grace_s = 60;  // a file younger than this in state "creating" is left alone
};

// Installs the SIGBUS handler the guarded copies rely on. Call once.
void install_bus_guard();

// The one SIGBUS-safe copy: copies n bytes out of a mapping, false when a
// page faulted (the file was truncated under us). Needs install_bus_guard().
bool guarded_copy(void* dst, const std::byte* src, std::size_t n);

// A SIGBUS outside guarded_copy (in library code that touches a mapping)
// never kills the tool by the signal: the handler calls `hook` (which must be
// async-signal-safe and end the process with _exit), or without one prints
// a message and _exits 1.
using BusHook = void (*)();
void set_bus_hook(BusHook hook);

// The one way a region path is opened: O_RDONLY | O_NOFOLLOW | O_CLOEXEC |
// O_NONBLOCK | O_NOCTTY, then fstat on the descriptor. So a symlink is never
// followed and a FIFO, socket or device swapped in under the name never
// blocks. Returns the descriptor of a regular file; otherwise -1, with
// *err the errno of the failed open (ELOOP for a symlink, ENXIO for a
// socket, ...) or 0 when it opened something that is not a regular file
// (the descriptor is closed). *st is filled whenever fstat ran.
int open_region_file(const std::string& path, struct stat* st, int* err);

// Permission bits as four octal digits: "0640".
std::string mode_text(std::uint32_t mode);

// "regular", "symlink", "fifo", "directory", "socket", "char-device", ...
const char* file_type_name(mode_t mode);

// Why the caller must not trust the bytes of a file with this owner and
// mode, or "" when it may: the file must belong to the caller's effective
// uid, must not be writable by others, and may be group-writable only when
// its group is one of the caller's groups (a region created with
// group_access is mode 0660).
std::string untrusted_why(const struct stat& st);

// Names of the regions in `dir` (the part after "shmcast."), sorted. Entries
// that are not regular files or whose names are not valid region names are
// returned too: probe() reports them. Throws std::runtime_error when the
// directory cannot be read.
std::vector<std::string> scan_dir(const std::string& dir);

// Probes one region. Never throws for anything the file contains; a region
// that cannot be opened at all is reported as "unreadable". Throws
// shmcast::Error(kNotFound) only when the file does not exist.
RegionReport probe(const std::string& dir, const std::string& name, const ProbeOptions& opts);

// Whole-file OFD lock probe on an open fd: kYes when any process holds a
// write lock on any byte of the file.
Alive any_lock_held(int fd);

}  // namespace shmcast::inspect
