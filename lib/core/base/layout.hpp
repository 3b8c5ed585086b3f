// base/ (layer 2): the versioned on-shm layout. docs/protocol.md specifies these
// bytes; keep the two in step. Offsets only, never pointers: every process
// maps the region at a different address.
//
// The region is untrusted input. Nothing here is used before
// validate_header() has checked it, and every offset or size read from the
// region afterwards is checked again where it is used.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "shmcast/shmcast.hpp"

namespace shmcast::detail {

inline constexpr std::uint64_t kMagic = 0x0054534143'4d4853ull;  // "SHMCAST\0" (LE)
// 2: producer ranks (sharded syncs); 3: rounds with identity; 4: device slots
// (the DeviceSlots block at header offset 640, kFeatureDeviceSlots)
inline constexpr std::uint32_t kLayoutVersion = 4;
inline constexpr std::uint64_t kHeaderBytes = 4096;
inline constexpr std::uint64_t kSeatBytes = 512;
inline constexpr std::uint64_t kSlotDescBytes = 64;
inline constexpr std::uint64_t kRankSeatBytes = 512;
inline constexpr std::uint64_t kDataAlign = limits::kDataAlign;      // huge-page / DMA friendly
inline constexpr std::uint64_t kTensorAlign = limits::kTensorAlign;  // start of each tensor in the stream
inline constexpr std::uint32_t kMaxConsumers = limits::kMaxConsumers;
inline constexpr std::uint32_t kMaxSlots = limits::kMaxSlots;
inline constexpr std::uint64_t kMaxSlotBytes = limits::kMaxSlotBytes;
inline constexpr std::uint64_t kMinManifestBytes = limits::kMinManifestBytes;
inline constexpr std::uint64_t kMaxManifestBytes = limits::kMaxManifestBytes;
inline constexpr std::size_t kErrorTextBytes = 256;
inline constexpr std::uint64_t kMaxStreamBytes = limits::kMaxStreamBytes;
inline constexpr std::uint32_t kMaxTensors = limits::kMaxTensors;
inline constexpr std::uint32_t kMaxRanks = limits::kMaxRanks;

// Feature bits (Header::features). A reader rejects bits it does not know.
inline constexpr std::uint64_t kFeatureChecksums = 1ull << 0;  // SlotDesc::checksum valid
// Store mode: the region keeps the newest complete version for readers that
// come at any time. Two slots ("banks") of slot_bytes, one sync = one chunk
// filling one bank (seq alternates them), a manifest area per bank, one
// producer rank; readers hold a bank through Seat::hold_seq (docs/protocol.md §9).
inline constexpr std::uint64_t kFeatureStore = 1ull << 1;
// Delta syncs: the producer may send a piece as a delta blob against the
// piece as an earlier version held it (ManifestPiece::base_version,
// docs/protocol.md §12); consumers ask for full syncs through
// Seat::full_after. A reader that does not know the bit must not open the
// region: it would copy blobs as tensor bytes.
inline constexpr std::uint64_t kFeatureDelta = 1ull << 2;
// Device slots: the K slots of S bytes are GPU memory (one CUDA VMM
// allocation of Header::device_slots.alloc_bytes on the GPU named by its
// UUID), served to consumers as a POSIX fd over the region's fd channel
// (docs/protocol.md §13); the region file holds no slot data (total_bytes ==
// data_offset). Ring regions (of one producer rank or several: ranks 1..
// fetch the fd like consumers), without checksums or deltas (a reader
// refuses any other combination).
inline constexpr std::uint64_t kFeatureDeviceSlots = 1ull << 3;
inline constexpr std::uint64_t kKnownFeatures = kFeatureChecksums | kFeatureStore | kFeatureDelta | kFeatureDeviceSlots;

enum InitState : std::uint32_t {
  kInitCreating = 0,  // file exists, creator still writing
  kInitReady = 1,     // header valid, consumers may attach
  kInitClosed = 2,    // producer closed cleanly; no more syncs
};

enum SeatState : std::uint32_t {
  kSeatFree = 0,
  kSeatActive = 1,   // claimed by a consumer
  kSeatEvicted = 2,  // the producer gave up on this consumer
};

// Lock bytes (fcntl OFD locks on the region file). A process holds a write
// lock on its byte for as long as it is attached; the kernel drops it when
// the process dies, whatever PID namespace it is in.
inline constexpr std::int64_t kProducerLockByte = 0;  // the producer, or rank 0 of a sharded one
inline constexpr std::int64_t seat_lock_byte(std::uint32_t seat) { return 1 + seat; }
// Producer rank r >= 1 of a sharded producer (rank 0 holds kProducerLockByte).
inline constexpr std::int64_t rank_lock_byte(std::uint32_t rank) {
  return rank == 0 ? kProducerLockByte : 1 + std::int64_t{kMaxConsumers} + rank;
}
// Held by a producer that takes over a stale region, from before it locks
// byte 0 of the old file until the old name is gone: a rank that sees byte 0
// held but this byte free knows the lock on byte 0 is the region's own rank
// 0, not a takeover in progress (docs/protocol.md §8).
inline constexpr std::int64_t kTakeoverLockByte = 1 + std::int64_t{kMaxConsumers} + kMaxRanks;

// A futex word and a count of its sleepers ("wake only when someone waits").
struct alignas(8) Bell {
  std::atomic<std::uint32_t> word;
  std::atomic<std::uint32_t> waiters;
};
static_assert(sizeof(Bell) == 8);

struct Identity {
  std::atomic<std::uint32_t> pid;    // in the writer's PID namespace
  std::uint32_t reserved;
  std::atomic<std::uint64_t> start_time;  // /proc/pid/stat field 22 (clock ticks since boot)
  std::atomic<std::uint64_t> pidns;       // inode of /proc/self/ns/pid
};
static_assert(sizeof(Identity) == 24);

// The sync record: what the producer announces. Written under a seqlock:
// `announce.word` is odd while the producer writes the record, even when it
// is stable; consumers sleep on it.
struct SyncRecord {
  Bell announce;                            // +0
  std::atomic<std::uint64_t> version;       // +8
  std::atomic<std::uint64_t> first_seq;     // +16 first chunk of the sync
  std::atomic<std::uint64_t> chunks;        // +24
  std::atomic<std::uint64_t> stream_bytes;  // +32
  std::atomic<std::uint64_t> manifest_used; // +40 bytes of manifest area in use
  std::atomic<std::uint64_t> manifest_hash; // +48 XXH3-64 of those bytes
  std::atomic<std::uint32_t> aborted;       // +56 1 when the producer aborted it
  std::uint32_t reserved;                   // +60
};
static_assert(sizeof(SyncRecord) == 64);

// The immutable geometry: [0, 128). Plain bytes, no atomics, so a reader can
// take a private snapshot (memcpy) and validate that instead of bytes a
// hostile writer could change under it.
struct HeaderFixed {
  std::uint64_t magic;            // 0
  std::uint32_t layout_version;   // 8
  std::uint32_t header_bytes;     // 12
  std::uint64_t total_bytes;      // 16 == file size
  std::uint64_t features;         // 24
  std::uint32_t max_consumers;    // 32 N
  std::uint32_t slot_count;       // 36 K
  std::uint64_t slot_bytes;       // 40 S
  std::uint64_t seats_offset;     // 48
  std::uint64_t slots_offset;     // 56 slot descriptors
  std::uint64_t manifest_offset;  // 64
  std::uint64_t manifest_bytes;   // 72
  std::uint64_t data_offset;      // 80 slot k's data at data_offset + k * S
  std::uint64_t created_unix_ns;  // 88
  std::uint32_t world_size;       // 96 producer ranks R (1: one producer)
  std::uint32_t reserved0;        // 100
  std::uint64_t ranks_offset;     // 104 rank seats, then rank lists (R > 1)
  std::uint8_t reserved1[16];     // 112
};
static_assert(sizeof(HeaderFixed) == 128);

// Where the slots live when they are GPU memory (kFeatureDeviceSlots).
// Plain bytes, snapshotted with the fixed header.
struct DeviceSlotsFixed {
  std::uint8_t gpu_uuid[16];      // 0 the GPU that holds the allocation (cuDeviceGetUuid)
  std::uint64_t alloc_bytes;      // 16 the allocation: >= slot_count * slot_bytes, a multiple of 2 MiB
  std::uint64_t nonce;            // 24 random, never 0: the fd channel's message must carry it
  std::uint8_t reserved[32];      // 32
};
static_assert(sizeof(DeviceSlotsFixed) == 64);
// The most an allocation may exceed slot_count * slot_bytes (rounding up
// to the GPU's granularity, a few MiB at most in practice).
inline constexpr std::uint64_t kMaxDeviceSlotSlack = 1ull << 30;

struct alignas(64) Header {
  // ---- [0, 128) geometry: immutable once init_state is kInitReady
  HeaderFixed fixed;

  // ---- [128, 192) lifecycle
  std::atomic<std::uint32_t> init_state;  // 128 written last at create
  std::atomic<std::uint32_t> error_code;  // 132 producer-side error (Errc), 0 = none
  Identity producer;                      // 136
  std::atomic<std::uint64_t> generation;  // 160 bumped by every producer that creates
  std::atomic<std::uint64_t> evictions;   // 168 seats the producer evicted
  std::atomic<std::uint64_t> round;       // 176 last round rank 0 ended: answered or failed (R > 1)
  std::atomic<std::uint64_t> round_open;  // 184 the round rank 0 has begun (R > 1)

  // ---- [192, 256) sync record (producer writes, consumers read)
  SyncRecord sync;                        // 192

  // ---- [256, 320) chunk publication (producer writes)
  std::atomic<std::uint64_t> published_seq;  // 256 every chunk <= this is filled
  Bell publish;                              // 264
  std::atomic<std::uint64_t> syncs_done;     // 272 syncs the producer finished
  std::atomic<std::uint64_t> bytes_done;     // 280 payload bytes of those
  std::atomic<std::uint64_t> last_sync_ns;   // 288 duration of the last sync
  std::atomic<std::uint64_t> last_end_unix_ns;  // 296
  std::uint8_t reserved2[16];                // 304

  // ---- [320, 384) consumer -> producer (consumers ring it on release/ack/attach)
  Bell release;                              // 320
  Bell rank_post;                            // 328 ranks -> rank 0: a rank list was posted
  Bell rank_reply;                           // 336 rank 0 -> ranks: a round was answered or completed
  std::atomic<std::uint64_t> round_done;     // 344 fate of the last sync round: round << 1 (completed) | 1 (abandoned)
  std::uint8_t reserved3[32];                // 352

  // ---- [384, 640) producer error text, NUL-terminated
  char error_text[kErrorTextBytes];          // 384

  // ---- [640, 704) device slots (kFeatureDeviceSlots; all zero otherwise):
  // immutable once init_state is kInitReady, like `fixed`
  DeviceSlotsFixed device_slots;             // 640

  std::uint8_t reserved4[kHeaderBytes - 704];
};

struct alignas(64) Seat {
  // ---- [0, 64) ownership; word = generation << 32 | SeatState
  std::atomic<std::uint64_t> word;           // 0
  Identity consumer;                         // 8
  std::atomic<std::uint64_t> attach_unix_ns; // 32
  std::uint8_t reserved0[24];                // 40

  // ---- [64, 128) written by the consumer
  std::atomic<std::uint64_t> released_seq;   // 64 every chunk <= this is released
  std::atomic<std::uint64_t> acked_version;  // 72 manifest of this sync copied
  std::atomic<std::uint64_t> syncs_done;     // 80
  std::atomic<std::uint64_t> bytes_done;     // 88
  std::atomic<std::uint32_t> error_code;     // 96 consumer-side error (Errc), 0 = none
  std::uint32_t reserved1;                   // 100
  // Store mode: the chunk (bank content) this consumer reads or views, 0 =
  // none. The producer does not refill a bank a live consumer holds.
  std::atomic<std::uint64_t> hold_seq;       // 104
  // Delta regions: this consumer cannot apply a delta and asks for a full
  // sync after version full_after (monotone; 0 = no request unless the
  // producer has sent no full sync yet). docs/protocol.md §9.
  std::atomic<std::uint64_t> full_after;     // 112
  std::uint8_t reserved2[8];                 // 120

  // ---- [128, 192) written by the producer
  std::atomic<std::uint64_t> included_gen;   // 128 seat generation the producer enrolled
  std::atomic<std::uint64_t> first_seq;      // 136 first chunk that seat must read
  std::atomic<std::uint64_t> first_version;  // 144 first sync it takes part in
  std::atomic<std::uint32_t> evict_reason;   // 152 Errc of the eviction
  std::uint32_t reserved3;                   // 156
  std::uint8_t reserved4[32];                // 160

  // ---- [192, 448) consumer error text
  char error_text[kErrorTextBytes];          // 192
  std::uint8_t reserved5[kSeatBytes - 448];
};

struct alignas(64) SlotDesc {
  std::atomic<std::uint64_t> seq;       // 0 chunk sequence held, 0 = never filled
  std::atomic<std::uint64_t> version;   // 8 sync the chunk belongs to
  std::atomic<std::uint64_t> bytes;     // 16 valid bytes from the slot's start
  std::atomic<std::uint64_t> checksum;  // 24 XXH3-64 of those bytes (kFeatureChecksums)
  // Progressive fill (host copies): while chunk `fill_seq` is being written,
  // its first `filled` bytes are final, so a consumer may copy them out
  // before the chunk is published (while they are still in cache).
  std::atomic<std::uint64_t> fill_seq;  // 32
  std::atomic<std::uint64_t> filled;    // 40
  // Store regions: the manifest of the version the bank holds, its size and
  // XXH3-64, stored before `seq` (release) like version and bytes. With
  // them the bank describes itself: a reader rebuilds the record from it
  // when a producer died inside its record flip (docs/protocol.md §11).
  // Ring regions (and store regions of older writers): 0.
  std::atomic<std::uint64_t> manifest_used;  // 48
  std::atomic<std::uint64_t> manifest_hash;  // 56
};

// One producer rank of a sharded producer (R > 1): ranks post their list of
// pieces for a round, rank 0 merges them into the sync's manifest and
// answers each rank with where its chunks go.
struct alignas(64) RankSeat {
  // ---- [0, 64) ownership, written by the rank
  std::atomic<std::uint64_t> word;           // 0 generation << 32 | SeatState (free / active)
  Identity who;                              // 8
  std::atomic<std::uint64_t> attach_unix_ns; // 32
  std::atomic<std::uint64_t> published_seq;  // 40 last chunk this rank published
  std::atomic<std::uint64_t> syncs_done;     // 48
  std::atomic<std::uint64_t> bytes_done;     // 56

  // ---- [64, 128) the rank's post, written by the rank (rank 0 CASes `post` to take it)
  std::atomic<std::uint64_t> post;           // 64 round << 3 | state (rounds.hpp: PostState)
  std::atomic<std::uint64_t> posted_bytes;   // 72 bytes in the rank's list area: its list, or why it dropped the round
  std::atomic<std::uint64_t> posted_hash;    // 80 XXH3-64 of them
  std::atomic<std::uint32_t> error_code;     // 88 the rank's last error (Errc), 0 = none
  std::atomic<std::uint32_t> left_code;      // 92 why the rank left round left_round on its own (Errc)
  std::atomic<std::uint64_t> left_round;     // 96 last round the rank gave up or dropped, 0 = none
  std::uint8_t reserved1[24];                // 104

  // ---- [128, 192) rank 0's answer, reply_round written last (release)
  std::atomic<std::uint64_t> reply_round;    // 128
  std::atomic<std::uint32_t> reply_status;   // 136 0 = go, else the Errc that failed the round
  std::uint32_t reserved2;                   // 140
  std::atomic<std::uint64_t> reply_version;  // 144 the sync's version
  std::atomic<std::uint64_t> reply_first_seq;// 152 the sync's first chunk
  std::atomic<std::uint64_t> reply_rank_chunks; // 160 chunks per rank (J): rank r's chunk j is seq first + j*R + r
  std::atomic<std::uint64_t> reply_base;     // 168 delta regions: the go's kind: 0 a full sync, else the base version of a delta sync
  std::uint8_t reserved3[16];                // 176

  // ---- [192, 448) error text (rank 0's reason for a failed round, or the rank's own)
  char error_text[kErrorTextBytes];          // 192
  std::uint8_t reserved4[kRankSeatBytes - 448];
};

// ---- the layout is part of the protocol: pin it down.
static_assert(sizeof(Header) == kHeaderBytes);
static_assert(sizeof(Seat) == kSeatBytes);
static_assert(sizeof(SlotDesc) == kSlotDescBytes);
static_assert(sizeof(RankSeat) == kRankSeatBytes);
static_assert(offsetof(RankSeat, post) == 64 && offsetof(RankSeat, reply_round) == 128);
static_assert(offsetof(RankSeat, left_code) == 92 && offsetof(RankSeat, left_round) == 96);
static_assert(offsetof(RankSeat, error_text) == 192 && offsetof(RankSeat, reply_base) == 168);
static_assert(offsetof(HeaderFixed, world_size) == 96 && offsetof(HeaderFixed, ranks_offset) == 104);
static_assert(offsetof(Header, round) == 176 && offsetof(Header, round_open) == 184);
static_assert(offsetof(Header, round_done) == 344);
static_assert(offsetof(Header, rank_post) == 328 && offsetof(Header, rank_reply) == 336);
static_assert(offsetof(Header, init_state) == 128);
static_assert(offsetof(Header, producer) == 136);
static_assert(offsetof(Header, generation) == 160);
static_assert(offsetof(Header, sync) == 192);
static_assert(offsetof(Header, published_seq) == 256);
static_assert(offsetof(Header, publish) == 264);
static_assert(offsetof(Header, release) == 320);
static_assert(offsetof(Header, error_text) == 384);
static_assert(offsetof(Header, device_slots) == 640);
static_assert(offsetof(Seat, released_seq) == 64);
static_assert(offsetof(Seat, hold_seq) == 104 && offsetof(Seat, full_after) == 112 && offsetof(Seat, included_gen) == 128);
static_assert(offsetof(Seat, error_text) == 192);
static_assert(offsetof(SlotDesc, fill_seq) == 32 && offsetof(SlotDesc, filled) == 40);
static_assert(offsetof(SlotDesc, manifest_used) == 48 && offsetof(SlotDesc, manifest_hash) == 56);
static_assert(std::atomic<std::uint32_t>::is_always_lock_free);
static_assert(std::atomic<std::uint64_t>::is_always_lock_free);
static_assert(sizeof(std::atomic<std::uint64_t>) == 8 && sizeof(std::atomic<std::uint32_t>) == 4);

// ---- the manifest area (written by the producer for each sync)
inline constexpr std::uint32_t kManifestMagic = 0x464d4353;  // "SCMF"
inline constexpr std::uint32_t kManifestVersion = 2;  // 2: pieces, producer ranks
inline constexpr std::uint16_t kWholePiece = 0xffff;  // ManifestPiece::dim of a whole tensor

struct ManifestHeader {
  std::uint32_t magic;          // 0
  std::uint32_t format;         // 4 kManifestVersion
  std::uint64_t sync_version;   // 8
  std::uint32_t tensor_count;   // 16
  std::uint32_t entry_bytes;    // 20 sizeof(ManifestEntry)
  std::uint64_t names_offset;   // 24 from the manifest start
  std::uint64_t names_bytes;    // 32
  std::uint64_t stream_bytes;   // 40 sum of the ranks' sub-streams
  std::uint64_t payload_bytes;  // 48
  std::uint32_t world_size;     // 56 producer ranks R
  std::uint32_t piece_count;    // 60
};
static_assert(sizeof(ManifestHeader) == 64);
// The manifest: header, entries[tensor_count], rank_bytes[world_size] (u64:
// each rank's sub-stream length), pieces[piece_count], names blob.

struct ManifestEntry {
  std::uint32_t name_offset;    // 0 into the names blob
  std::uint32_t name_bytes;     // 4
  std::uint16_t dtype;          // 8 shmcast::DType
  std::uint16_t ndim;           // 10 <= 8
  std::uint32_t reserved;       // 12
  std::uint64_t nbytes;         // 16
  std::uint64_t stream_offset;  // 24
  std::int64_t shape[8];        // 32
};
static_assert(sizeof(ManifestEntry) == 96);

// A piece: the bytes of one tensor that one rank writes. Either the whole
// tensor (dim == kWholePiece) or the rows [start, start + length) along
// `dim`, stored contiguously (the shape of that slice, row-major). A
// tensor's pieces are one whole piece, or shards along one dim that tile it.
struct ManifestPiece {
  std::uint32_t tensor;         // 0 index into the entries
  std::uint16_t rank;           // 4 < world_size
  std::uint16_t dim;            // 6 < ndim, or kWholePiece
  std::int64_t start;           // 8
  std::int64_t length;          // 16
  std::uint64_t offset;         // 24 in the rank's sub-stream
  std::uint64_t nbytes;         // 32 bytes in the sub-stream (a delta piece: its blob's)
  std::uint64_t base_version;   // 40 0: the piece's bytes; else a delta blob against version base_version
};
static_assert(sizeof(ManifestPiece) == 48);

// Geometry computed from creation parameters.
struct Geometry {
  std::uint32_t max_consumers;
  std::uint32_t slot_count;
  std::uint64_t slot_bytes;
  std::uint64_t manifest_bytes;
  std::uint64_t seats_offset;
  std::uint64_t slots_offset;
  std::uint64_t manifest_offset;
  std::uint64_t data_offset;
  std::uint64_t total_bytes;
  std::uint32_t world_size;
  std::uint64_t ranks_offset;     // R > 1: R rank seats, then R lists of manifest_bytes
  std::uint64_t rank_lists_offset;
  bool store = false;             // kFeatureStore: slot_count 2, world_size 1, a manifest area per slot
  bool device_slots = false;      // kFeatureDeviceSlots: no slot data in the file (total_bytes == data_offset)
};

constexpr std::uint64_t align_up(std::uint64_t v, std::uint64_t a) { return (v + a - 1) / a * a; }

// The ranges [from, to) of a region with geometry `g` that stay holes in
// the file until their writer allocates the part it writes: the manifest
// area(s) and the rank lists (docs/protocol.md §2, "Sparse areas"). The
// producer reserves room for the largest manifest there at no cost.
struct SparseRanges {
  std::pair<std::uint64_t, std::uint64_t> range[2];
  std::size_t count = 0;
};
SparseRanges sparse_ranges(const Geometry& g);

// Computes the geometry; returns an empty string or the reason it is invalid.
// `store`: a store-mode region (kFeatureStore).
std::string compute_geometry(std::uint32_t max_consumers, std::uint32_t slots, std::uint64_t slot_bytes,
                             std::uint64_t manifest_bytes, Geometry* out, std::uint32_t world_size = 1,
                             bool store = false, bool device_slots = false);

// The problem with a device-slots block `d` of a region with geometry `g`
// and feature bits `features`, or an empty string. Without the feature bit
// the block must be all zero.
std::string device_slots_problem(const DeviceSlotsFixed& d, const Geometry& g, std::uint64_t features);

// The fixed header a region with geometry `g` carries (created_unix_ns left 0).
HeaderFixed make_fixed_header(const Geometry& g, std::uint64_t features);

// Checks every immutable header field against itself and against the file
// size the opener saw. Returns an empty string when valid. `version_mismatch`
// is set when the magic is ours but the layout version is not.
std::string validate_header(const HeaderFixed& h, std::uint64_t file_bytes, bool* version_mismatch);

}  // namespace shmcast::detail
