// shmcast/probe.hpp: read-only inspection of regions, for tools such as
// shmcast-inspect. Nothing here writes a byte of a region, takes a lock or
// claims a seat.
//
// The region file is hostile input. A path is opened one way only
// (O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | O_NOCTTY, then fstat on
// the descriptor): a symlink is never followed and a FIFO, socket or device
// swapped in under the name never blocks. A file that the library's trust
// rule refuses (another user's, or writable by users outside the caller's
// groups) is reported and its bytes are never read. Every byte looked at is
// first copied into private memory, by a copy that survives SIGBUS (a file
// truncated under the reader) or by pread; every count, offset and size is
// checked before it is used.
//
// Everything returned is plain data: a snapshot, stale as soon as it is
// taken. The numbers are the region's own (docs/protocol.md names them).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "shmcast/shmcast.hpp"

namespace shmcast::probe {

// The region layout version this library reads and writes.
SHMCAST_API std::uint32_t layout_version() noexcept;

// ---------------------------------------------------------------- states

enum class Alive : std::uint8_t { kYes, kNo, kUnknown };

// What a region file is, as a whole.
enum class State : std::uint8_t {
  kCreating,        // its creator is still initialising it
  kReady,           // valid, producer alive (or its liveness unknown)
  kClosed,          // the producer closed it cleanly
  kDead,            // the producer died (or died while creating it)
  kCorrupt,         // our magic, bad header
  kForeign,         // not a shmcast region (or not a regular file, or a bad name)
  kNewerVersion,    // made by a newer shmcast
  kOlderVersion,    // made by an older shmcast
  kTruncated,       // the file size disagrees with the header
  kUnreadable,      // the OS refused to open or map it
  kUntrustedOwner,  // another user's file, or writable by others: not read
};
// The header and every field of Region below `header_valid` are meaningful
// (ready, closed, dead).
SHMCAST_API bool state_is_valid(State s) noexcept;
// corrupt, foreign, newer/older-version, truncated, unreadable, untrusted-owner.
SHMCAST_API bool state_is_damaged(State s) noexcept;

enum class InitState : std::uint8_t { kCreating, kReady, kClosed, kInvalid };
enum class SyncStatus : std::uint8_t { kNone, kWriting, kPublished, kAborted, kUnknown };
enum class SeatState : std::uint8_t { kFree, kActive, kEvicted, kInvalid };
enum class SlotState : std::uint8_t {
  kEmpty,     // never filled
  kFilling,   // the producer is writing it
  kHeld,      // published; a live enrolled consumer has not released it
  kReleased,  // published and released by every live enrolled consumer
};
enum class ManifestStatus : std::uint8_t {
  kNone,      // no sync announced yet, or the header is not valid
  kOk,        // decoded and its hash matches the sync record
  kChanging,  // the producer kept rewriting it while it was read
  kInvalid,   // it fails validation (reason says why)
  kSkipped,   // not asked for (Options::decode_manifest)
};

// Lower-case names, as shmcast-inspect prints them: "creating", "ready",
// ..., "newer-version", "untrusted-owner"; "free", "active", "evicted",
// "invalid"; "empty", "filling", "held", "released"; "none", "ok", ...
SHMCAST_API const char* state_name(State s) noexcept;
SHMCAST_API const char* state_name(InitState s) noexcept;
SHMCAST_API const char* state_name(SyncStatus s) noexcept;
SHMCAST_API const char* state_name(SeatState s) noexcept;
SHMCAST_API const char* state_name(SlotState s) noexcept;
SHMCAST_API const char* state_name(ManifestStatus s) noexcept;
// "host" or "device".
SHMCAST_API const char* slot_memory_name(SlotMemory m) noexcept;

// ---------------------------------------------------------------- snapshots

// Who owns a file and who may write it.
struct Owner {
  bool known = false;
  std::uint32_t uid = 0, gid = 0;
  std::string user, group;  // empty when the id has no name
  std::uint32_t mode = 0;   // permission bits (st_mode & 07777)
  bool trusted = false;     // the library's trust rule accepts it (trust_problem is empty)
  std::string trust_problem;  // why not, naming the owner and mode
};

// The immutable part of the header, as the file holds it: raw numbers,
// validated only when Region::header_valid.
struct FixedHeader {
  std::uint64_t magic = 0;
  bool shmcast_magic = false;  // magic is shmcast's
  std::uint32_t layout_version = 0;
  std::uint32_t header_bytes = 0;
  std::uint64_t total_bytes = 0;
  std::uint64_t features = 0;
  bool checksums = false;  // the per-slot checksum feature bit
  bool store = false;      // a store region (RegionMode::kStore): slots are banks, each holding one version
  bool delta = false;      // a region with delta syncs (ProducerOptions::delta, feature bit 2)
  bool device_slots = false;  // slots in GPU memory (SlotMemory::kDevice, feature bit 3, layout 4)
  std::uint32_t max_consumers = 0;
  std::uint32_t slot_count = 0;
  std::uint64_t slot_bytes = 0;
  std::uint64_t seats_offset = 0, slots_offset = 0, manifest_offset = 0, manifest_bytes = 0, data_offset = 0;
  std::uint64_t created_unix_ns = 0;
  std::uint32_t world_size = 0;  // producer ranks (layout 2)
  std::uint64_t ranks_offset = 0;
};

// A process as the region records it.
struct Identity {
  std::uint32_t pid = 0;          // in the writer's PID namespace
  std::uint64_t start_time = 0;   // clock ticks since boot
  std::uint64_t pidns = 0;        // inode of its /proc/self/ns/pid
};

// The sync record, copied under its seqlock.
struct SyncRecord {
  bool stable = false;  // the seqlock gave a consistent copy (else a best-effort one)
  std::uint64_t version = 0, first_seq = 0, chunks = 0, stream_bytes = 0, manifest_used = 0, manifest_hash = 0;
  bool aborted = false;
  // A store region whose producer died inside its record flip: the record
  // was rebuilt from the newest complete bank, as a consumer does
  // (docs/protocol.md §11); `stable` is false.
  bool recovered = false;
};

struct Seat {
  std::uint32_t index = 0;
  std::uint64_t word = 0;  // generation << 32 | state
  SeatState state = SeatState::kFree;
  std::uint32_t state_raw = 0;
  std::uint64_t generation = 0;
  Identity consumer;
  Alive alive = Alive::kUnknown;  // its lock byte is held
  std::uint64_t attach_unix_ns = 0;
  std::uint64_t released_seq = 0, acked_version = 0, syncs_done = 0, bytes_done = 0;
  std::uint64_t hold_seq = 0;  // store regions: the chunk (version's bank) it holds, 0 = none
  std::uint32_t error_code = 0;  // an Errc, 0 = none
  std::string error_text;
  std::uint64_t included_gen = 0;
  bool enrolled = false;  // active and enrolled by the producer for its generation
  std::uint64_t first_seq = 0, first_version = 0;
  std::uint32_t evict_reason = 0;  // an Errc
  std::uint64_t lag_chunks = 0;    // published chunks this (enrolled, not dead) seat has not released
};

struct Slot {
  std::uint32_t index = 0;
  std::uint64_t seq = 0, version = 0, bytes = 0, checksum = 0;
  SlotState state = SlotState::kEmpty;
  std::uint32_t holders = 0;  // live enrolled seats that have not released it
};

// The manifest of the sync in the record. Every entry and every piece is
// validated; only the first Options::manifest_limit entries are decoded into
// `tensors`.
struct Manifest {
  ManifestStatus status = ManifestStatus::kNone;
  std::string reason;
  // When kOk:
  std::uint64_t version = 0, tensor_count = 0, stream_bytes = 0;
  // The sync's size, named as in SyncReport (Producer::last_sync): the
  // tensors' bytes, and the bytes their pieces take in the stream (the
  // blobs of a delta sync; a full sync: logical_bytes).
  std::uint64_t logical_bytes = 0, payload_bytes = 0;
  // A delta sync (docs/protocol.md §12): the version its delta pieces apply
  // to; 0: a full sync.
  std::uint64_t base_version = 0;
  bool delta() const noexcept { return base_version != 0; }
  std::uint32_t world_size = 1;  // producer ranks that wrote the sync
  // Each with its pieces (TensorInfo::shards: nbytes logical, wire_bytes and
  // base_version as the manifest gives them).
  std::vector<TensorInfo> tensors;
};

struct Region {
  std::string name;
  std::string path;
  bool valid_name = true;
  State state = State::kUnreadable;
  std::string reason;     // why the state is what it is, when not ready
  std::string file_type;  // regular / symlink / fifo / directory / socket / char-device / block-device / unknown
  Owner owner;

  std::uint64_t size = 0;  // fstat (lstat when not opened)
  std::uint64_t inode = 0;
  double age_s = 0;    // since the file's last change (ctime or mtime)
  bool young = false;  // age_s < Options::grace_s
  Alive any_lock = Alive::kUnknown;  // some process holds a lock on the file

  bool have_fixed = false;  // the file holds the fixed header's bytes
  FixedHeader fixed;
  // Lifecycle: when have_header (a whole header with our magic and version).
  bool have_header = false;
  InitState init_state = InitState::kCreating;
  std::uint32_t init_state_raw = 0;
  std::uint32_t error_code = 0;  // producer-side Errc, 0 = none
  std::string error_text;
  Identity producer;
  Alive producer_alive = Alive::kUnknown;
  std::uint64_t generation = 0, evictions = 0, published_seq = 0, syncs_done = 0, bytes_done = 0, last_sync_ns = 0,
                last_end_unix_ns = 0;
  // Where the slots live (layout 4), from the header's feature bit and its
  // device-slots block (no GPU is touched): when have_header, as the file
  // holds them; validated (the block against the geometry) when
  // header_valid. Device slots are one CUDA allocation on the producer's
  // GPU, served to consumers over a Unix socket next to the region file.
  SlotMemory slot_memory = SlotMemory::kHost;
  std::string slot_gpu_uuid;  // kDevice: the GPU holding them, "GPU-xxxxxxxx-xxxx-..." as nvidia-smi -L prints it
  std::uint64_t slot_device_bytes = 0;  // kDevice: the allocation (slot_count x slot_bytes rounded up to the GPU's
                                        // granularity)
  std::string slot_socket;       // kDevice: the socket's path, dir/shmcast-slots.<name> (long names shortened)
  std::string slot_socket_type;  // kDevice: what lstat finds there (a file type name as file_type; "socket" when
                                 // served or left by a dead producer), "" when nothing is; never followed

  // Everything below: when header_valid (the geometry was validated).
  bool header_valid = false;
  bool have_record = false;  // false only when the file shrank under us
  SyncRecord record;
  SyncStatus sync_status = SyncStatus::kNone;
  std::uint64_t chunks_published = 0;
  std::vector<Seat> seats;
  std::vector<Slot> slots;
  std::uint32_t consumers_attached = 0;  // seats in state active
  std::uint32_t consumers_alive = 0;     // ... whose lock byte is held
  Manifest manifest;
};

struct Options {
  bool decode_manifest = false;
  std::size_t manifest_limit = 0;  // entries to decode (all are validated); 0: all
  double grace_s = 60;  // a file younger than this in state creating is left alone
};

// ---------------------------------------------------------------- calls

// `dir` without trailing slashes, or region_dir() when `dir` is empty.
SHMCAST_API std::string resolve_dir(std::string_view dir);
// The file of region `name` in `dir`: dir/shmcast.<name>.
SHMCAST_API std::string region_file(std::string_view dir, std::string_view name);
// Names of the regions in `dir` (the part after "shmcast."), sorted. Entries
// that are not regular files or valid names are listed too: probe_region()
// reports them. Throws kNotFound / kPermission / kSystem when the directory
// cannot be read.
SHMCAST_API std::vector<std::string> scan_dir(const std::string& dir);

// Probes one region. Never throws for anything the file contains; a region
// that cannot be opened is kUnreadable. Throws kNotFound only when there is
// no file.
SHMCAST_API Region probe_region(const std::string& dir, std::string_view name, const Options& options = {});

// A file opened the probe's way, checked, and closed again: for a tool that
// must see that a name still holds the file it probed before it acts.
struct FileCheck {
  int error = 0;         // errno of a failed open or fstat, else 0
  bool regular = false;  // it opened and is a regular file (the rest is filled whenever fstat ran)
  std::string file_type;
  std::uint64_t inode = 0;
  Owner owner;
  Alive any_lock = Alive::kUnknown;  // some process holds a lock on it (regular files only)
};
SHMCAST_API FileCheck check_file(const std::string& path);

// ---------------------------------------------------------------- SIGBUS

// A mapped region file that another process truncates raises SIGBUS in
// whoever touches its missing pages. A tool that reads region memory (such
// as the pieces Consumer::visit hands out) copies it with guarded_copy().
//
// Installs the process's SIGBUS handler that guarded_copy relies on. Call
// once, early.
SHMCAST_API void install_bus_guard();
// Copies n bytes out of a region mapping: false when a page faulted (the
// file was truncated under us). Needs install_bus_guard().
SHMCAST_API bool guarded_copy(void* dst, const void* src, std::size_t n) noexcept;
// A SIGBUS outside guarded_copy never kills the process by the signal: the
// handler calls `hook` (async-signal-safe, must end the process with _exit),
// or without one prints a message and _exits 1.
using BusHook = void (*)();
SHMCAST_API void set_bus_hook(BusHook hook) noexcept;

// ---------------------------------------------------------------- text

// The library's byte counts as people read them: "1.0 GiB", "64 MiB".
SHMCAST_API std::string human_bytes(std::uint64_t bytes);

}  // namespace shmcast::probe
