// shmcast: move tensors between processes on one machine through a named,
// pinned POSIX shared-memory region. No CUDA IPC handles, no pidfd_getfd.
//
// This is the one public header. Everything a user calls is declared here:
//
//   Producer (the trainer)                 Consumer (each inference worker)
//   ----------------------                 --------------------------------
//   auto p = shmcast::Producer::create(    auto c = shmcast::Consumer::open("actor-0");
//       "actor-0", {.slot_bytes = 256<<20});
//   p.begin_sync(specs);                   const shmcast::SyncInfo& s = c.wait_sync(30s);
//   for (i...) p.write(i, host_ptr);       c.read_into(dst_ptrs);   // or c.visit(fn)
//   p.end_sync();
//
// With CUDA (built with SHMCAST_WITH_CUDA and a GPU present at run time):
//   p.write_device(i, dev_ptr, stream)     c.read_into_device(dst_ptrs, stream)
//
// Errors are reported by throwing shmcast::Error, whose code() tells what went
// wrong and whose what() tells the user what to do about it.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

// Symbols of the library's public API; everything else is hidden.
#if defined(SHMCAST_STATIC_DEFINE) || !defined(__GNUC__)
#define SHMCAST_API
#else
#define SHMCAST_API __attribute__((visibility("default")))
#endif

namespace shmcast {

inline constexpr int kVersionMajor = 0;
inline constexpr int kVersionMinor = 1;

// ---------------------------------------------------------------- errors

enum class Errc : int {
  kInvalidArgument = 1,  // bad call: wrong index, wrong order, bad option
  kBadName,              // region name fails validation
  kExists,               // a region of that name exists and its producer is alive
  kNotFound,             // no region of that name (yet)
  kRegionFull,           // not enough free space in the region directory
  kPermission,           // the OS refused (file mode, owner, seccomp)
  kCorrupt,              // region bytes fail validation: untrusted input rejected
  kVersionMismatch,      // region was made by an incompatible shmcast
  kTimeout,              // a deadline passed while the peer was still alive
  kPeerDied,             // the producer (or a needed consumer) died
  kClosed,               // the producer closed the region cleanly
  kNoSeat,               // all consumer seats are taken
  kEvicted,              // the producer evicted this consumer (it stalled)
  kAborted,              // the producer aborted the sync in progress
  kChecksum,             // slot checksum mismatch: bytes changed in flight
  kCuda,                 // a CUDA call failed
  kCudaUnavailable,      // built without CUDA, or no GPU present
  kSystem,               // unexpected OS error (errno attached)
  kUnsupported,          // this setup cannot do it (e.g. device slots on a GPU the consumer cannot
                         // reach); the message names the reason and the alternative
  kNeedsFullSync,        // a delta sync these destinations cannot take (not its base; with verify_checksums,
                         // a piece a selection holds only in part): a full sync was requested; wait for it
};

SHMCAST_API const char* errc_name(Errc code) noexcept;

class SHMCAST_API Error : public std::runtime_error {
 public:
  Error(Errc code, const std::string& message, int sys_errno = 0);
  Errc code() const noexcept { return code_; }
  // errno of the failing system call when there was one, else 0.
  int sys_errno() const noexcept { return errno_; }

 private:
  Errc code_;
  int errno_;
};

// ---------------------------------------------------------------- tensors

// Element types. The numeric values are part of the on-shm format.
enum class DType : std::uint16_t {
  kBool = 1, kU8 = 2, kI8 = 3, kI16 = 4, kI32 = 5, kI64 = 6,
  kU16 = 7, kU32 = 8, kU64 = 9,
  kF16 = 10, kBF16 = 11, kF32 = 12, kF64 = 13,
  kF8E4M3FN = 14, kF8E5M2 = 15, kF8E4M3FNUZ = 16, kF8E5M2FNUZ = 17,
  kC64 = 18, kC128 = 19, kF8E8M0FNU = 20,
  kRaw = 255,  // untyped bytes: shape must be {nbytes}
};

SHMCAST_API std::size_t dtype_size(DType) noexcept;          // 0 for unknown
SHMCAST_API std::string_view dtype_name(DType) noexcept;     // "bf16", "f32", ...
SHMCAST_API bool dtype_from_name(std::string_view name, DType* out) noexcept;

// The library's limits (region geometry and one sync).
namespace limits {
inline constexpr std::uint32_t kMaxConsumers = 64;
inline constexpr std::uint32_t kMaxSlots = 4096;
inline constexpr std::uint64_t kMaxSlotBytes = 64ull << 30;
inline constexpr std::uint64_t kMinManifestBytes = 4096;
inline constexpr std::uint64_t kMaxManifestBytes = 1ull << 30;
inline constexpr std::uint32_t kMaxTensors = 1u << 20;        // tensors in one sync
inline constexpr std::uint32_t kMaxRanks = 64;                // producer ranks of one region
// Delta syncs of an update sent as several syncs of different tensors
// (buckets; docs/protocol.md §12): a delta producer keeps a base for each of
// at most this many tensor sets (the least recently sent goes first: its
// next sync is full), and a consumer remembers as many reads (the oldest
// goes first: a delta on it is let go, and a full sync asked for).
inline constexpr std::uint32_t kMaxDeltaGroups = 1024;
inline constexpr std::uint64_t kMaxStreamBytes = 1ull << 46;  // 64 TiB: one sync's stream, and one tensor
// Alignments of the layout (docs/protocol.md): each tensor starts at a multiple
// of kTensorAlign bytes of its (sub-)stream; slot sizes, and the slot data area,
// are multiples of kDataAlign (create() rounds slot_bytes up to it).
inline constexpr std::uint64_t kTensorAlign = 256;
inline constexpr std::uint64_t kDataAlign = 2ull << 20;
}  // namespace limits

inline constexpr int kMaxDims = 8;
inline constexpr std::size_t kMaxNameBytes = 1024;

struct TensorSpec {
  std::string name;
  DType dtype = DType::kRaw;
  std::vector<std::int64_t> shape;  // the whole (logical) tensor's shape; empty = scalar
  // A shard (sharded producers): this rank holds the rows
  // [shard_start, shard_start + shard_length) along dimension shard_dim,
  // stored contiguously. shard_dim = -1: the whole tensor.
  int shard_dim = -1;
  std::int64_t shard_start = 0;
  std::int64_t shard_length = 0;
  SHMCAST_API std::uint64_t nbytes() const;        // dtype_size * prod(shape); throws on overflow
  SHMCAST_API std::uint64_t local_nbytes() const;  // bytes this rank holds: nbytes() of the shard
};

// Where one piece of a tensor sits: written by producer rank `rank` into its
// sub-stream at `stream_offset`; the whole tensor (dim -1) or the rows
// [start, start + length) along `dim`.
struct ShardInfo {
  std::uint32_t rank = 0;
  int dim = -1;
  std::int64_t start = 0;
  std::int64_t length = 0;
  std::uint64_t stream_offset = 0;
  std::uint64_t nbytes = 0;        // the piece's bytes (logical)
  // Delta syncs (ProducerOptions::delta): a piece sent as a delta blob of
  // `wire_bytes` bytes against the piece as version `base_version` held it;
  // base_version 0: its bytes, wire_bytes == nbytes.
  std::uint64_t wire_bytes = 0;
  std::uint64_t base_version = 0;
  bool operator==(const ShardInfo&) const = default;
};

// Part of a tensor a consumer reads: the rows [start, start + length) along
// `dim` (dim -1: the whole tensor). The destination is contiguous, with the
// shape of that slice.
struct TensorInfo;
struct Selection {
  int dim = -1;
  std::int64_t start = 0;
  std::int64_t length = 0;
  // Why this selection cannot be read from tensor `t`, or "" when it can: the
  // check read_into() makes before it reads.
  SHMCAST_API std::string problem(const TensorInfo& t) const;
  // Bytes of its destination (t.nbytes for dim -1); throws kInvalidArgument
  // (the problem()) when it does not fit `t`.
  SHMCAST_API std::uint64_t nbytes(const TensorInfo& t) const;
};

// What a consumer sees of one tensor of a sync.
struct TensorInfo {
  std::string name;
  DType dtype;
  std::vector<std::int64_t> shape;
  std::uint64_t nbytes;
  std::uint64_t stream_offset;   // where its first piece starts in its rank's sub-stream
  std::vector<ShardInfo> shards; // its pieces: one whole piece, or shards sorted by start
  bool operator==(const TensorInfo&) const = default;
};

struct SyncInfo {
  std::uint64_t version = 0;          // producer-assigned, strictly increasing
  std::uint64_t stream_bytes = 0;     // bytes including alignment padding (all ranks)
  std::uint64_t payload_bytes = 0;    // sum of tensor sizes
  std::uint64_t first_seq = 0;        // first chunk sequence number
  std::uint64_t chunks = 0;           // chunks (one per slot fill)
  std::uint32_t world_size = 1;       // producer ranks; rank r's chunk j is first_seq + j * R + r
  std::vector<std::uint64_t> rank_bytes;  // each rank's sub-stream length
  std::vector<TensorInfo> tensors;
  // Delta syncs: the version whose content the sync's delta pieces are
  // applied to (0: a full sync), and the bytes the pieces take in the
  // stream (blobs; payload_bytes stays the tensors' logical size).
  std::uint64_t base_version = 0;
  std::uint64_t wire_bytes = 0;
  bool delta() const noexcept { return base_version != 0; }
  // Index of a tensor by name, or -1.
  SHMCAST_API std::ptrdiff_t find(std::string_view name) const;
  bool operator==(const SyncInfo&) const = default;
};

// What the last sync moved (Producer::last_sync, Consumer::last_sync).
struct SyncReport {
  std::uint64_t version = 0;        // 0: none yet
  bool delta = false;               // sent as deltas ("delta") or whole ("full")
  std::uint64_t logical_bytes = 0;  // the tensors' bytes (a consumer: of its selections)
  std::uint64_t payload_bytes = 0;  // the bytes that crossed the region (a delta: blobs, whole pieces)
};

// A contiguous piece of one tensor inside a slot, valid only during visit().
// Where a sync's tensors sit in its byte stream, and which chunks it takes.
struct SyncLayout {
  std::uint64_t version = 0;        // 0 before the first begin_sync
  std::uint64_t first_seq = 0;      // first chunk sequence number
  std::uint64_t chunks = 0;         // of the whole sync (all ranks)
  std::uint64_t stream_bytes = 0;   // with alignment padding
  std::uint64_t payload_bytes = 0;  // sum of tensor sizes
  std::vector<std::uint64_t> offsets;  // stream offset of each tensor, manifest order
  // Sharded producers: this rank, the number of ranks, and chunks per rank;
  // stream_bytes, payload_bytes and offsets are then this rank's.
  std::uint32_t rank = 0, world_size = 1;
  std::uint64_t rank_chunks = 0;
};

// The layout a producer with slots of `slot_bytes` (rounded up to 2 MiB, as
// create() does) gives a sync of `tensors` (version and first_seq left 0).
// Throws kInvalidArgument for an invalid spec or slot size.
SHMCAST_API SyncLayout stream_layout(std::span<const TensorSpec> tensors, std::uint64_t slot_bytes);
// The manifest_bytes a one-producer region needs for a sync of `tensors`
// (before rounding up to 4 KiB).
SHMCAST_API std::uint64_t manifest_bytes_needed(std::span<const TensorSpec> tensors);
// The store_bytes a store region (RegionMode::kStore) needs to hold a sync of
// `tensors`: their stream with alignment padding.
SHMCAST_API std::uint64_t store_bytes_needed(std::span<const TensorSpec> tensors);

struct Piece {
  std::size_t tensor;          // index into SyncInfo::tensors
  std::uint64_t offset;        // byte offset of this piece within its shard (the tensor when whole)
  const std::byte* data;       // in the shared region
  std::uint64_t bytes;
  std::uint64_t tensor_bytes;  // size of the whole tensor
  bool chunk_end = false;      // last piece of its slot: the slot may be released after fn returns
  std::size_t shard = 0;       // index into TensorInfo::shards
  bool whole() const noexcept { return offset == 0 && bytes == tensor_bytes; }
};

// ---------------------------------------------------------------- regions

using Clock = std::chrono::steady_clock;
using Duration = std::chrono::nanoseconds;

// Region directory: $SHMCAST_DIR if set, else /dev/shm. A tmpfs volume that
// two containers share works the same as /dev/shm.
SHMCAST_API std::string region_dir();
// Path of the file that backs region `name`.
SHMCAST_API std::string region_path(std::string_view name);
// Validates a region name: 1..128 chars of [A-Za-z0-9._-], not starting with
// '.' or '-'. Returns an empty string when valid, else the reason.
SHMCAST_API std::string validate_name(std::string_view name);
// Removes the region's name. Attached processes keep their mapping.
// Returns false when there was nothing to remove.
SHMCAST_API bool unlink_region(std::string_view name);

enum class StallPolicy : std::uint8_t {
  kFail,   // a live consumer that stalls past consumer_timeout fails the sync
  kEvict,  // ... is evicted (it gets Errc::kEvicted); the producer carries on
};

// Whether to pin the region with cudaHostRegister (once, at create/open).
enum class Pin : std::uint8_t {
  kNo,
  kYes,   // fail with kCudaUnavailable when CUDA or a GPU is missing
  kAuto,  // pin when built with CUDA and a GPU is present
};

// Which copy engine a producer uses, fixed when it is created.
enum class CopyEngine : std::uint8_t {
  kAuto,  // CUDA when the library has it and a GPU is present, else host
  kHost,  // memcpy only: write_device() is refused; host writes use progressive fill
  kCuda,  // async copies on a library stream (kCudaUnavailable at create without a GPU);
          // host sources are copied with memcpy, then published in stream order
};

// What a region does with the syncs it carries.
enum class RegionMode : std::uint8_t {
  kRing,   // streams each sync through K slots to the consumers attached when it begins
  kStore,  // keeps the newest complete version for any consumer, at any time (late
           // joiners, restarts): see ProducerOptions::store_bytes
};

// Where a ring region's slots live, fixed when it is created.
enum class SlotMemory : std::uint8_t {
  kHost,    // the region file (pinned host memory): any process can map it, any engine copies
  kDevice,  // GPU memory on the producer's GPU (a CUDA VMM allocation), shared with the
            // consumers as a file descriptor over a Unix socket next to the region
            // (SCM_RIGHTS; no CUDA IPC handle, no pidfd_getfd). Copies are
            // device-to-device; the region file keeps the header, seats and manifest.
};

// ---------------------------------------------------------------- quantize-on-send

// What a producer makes of the tensors its quantize filter selects
// (ProducerOptions::quantize; docs/protocol.md §14). A selected 2-D float
// tensor W [M, N] named P (bf16, f16 or f32) goes out as float8_e4m3fn
// [M, N] under the same name, followed in the manifest by a new float32
// tensor P + quantize::kScaleSuffix of shape [ceil(M/128), ceil(N/128)]:
// the block-FP8 layout of DeepSeek-V3 and Qwen3-FP8 checkpoints, which vLLM
// and SGLang load as `fp8` with weight_block_size [128, 128].
enum class Quantize : std::uint8_t {
  kNone,
  // amax = max |x| of the 128 x 128 block in float32, at least 1e-4;
  // q = e4m3fn(x * (448 / amax)) (round to nearest even, torch's
  // conversion; 448 / amax in float32 as torch evaluates it, the
  // reciprocal times 448, docs/protocol.md §14); scale_inv = amax / 448.
  kFp8Block128,
  // The same with the scale amax / 448 rounded up to a power of two (UE8M0),
  // q = e4m3fn(x * (1 / scale)), scale_inv = scale (DeepSeek-V3.1; vLLM's
  // use_ue8m0).
  kFp8Block128Ue8m0,
};
namespace quantize {
inline constexpr std::int64_t kBlock = 128;                // block rows and columns
inline constexpr std::string_view kScaleSuffix = "_scale_inv";  // the scales' name: the tensor's name + this
}  // namespace quantize
// "none", "fp8-block128", "fp8-block128-ue8m0" (the Python option's values).
SHMCAST_API std::string_view quantize_name(Quantize) noexcept;
SHMCAST_API bool quantize_from_name(std::string_view name, Quantize* out) noexcept;
// Which tensors a quantizing producer converts when given no filter: what
// block-FP8 checkpoints quantize. A 2-D bf16, f16 or f32 tensor whose name
// ends in ".weight" (or is "weight"), both dims >= 128, and whose name has
// no component that names an embedding (contains "embed"), "lm_head", a
// norm (contains "norm") or a router ("mlp.gate": a component "gate" right
// after "mlp"). Biases and 1-D tensors are never selected. The shape is the
// whole tensor's (TensorSpec::shape), not a shard's.
SHMCAST_API bool default_quantize_filter(const TensorSpec& t);
// Chooses the tensors to quantize, by name, dtype and (whole) shape. A
// filter that selects a tensor that is not 2-D or not bf16/f16/f32 makes
// begin_sync() fail (kInvalidArgument) with nothing announced.
using QuantizeFilter = std::function<bool(const TensorSpec&)>;

struct ProducerOptions {
  RegionMode mode = RegionMode::kRing;
  // kStore: room for one version's stream (store_bytes_needed(tensors), at
  // most limits::kMaxSlotBytes), rounded up to 2 MiB.
  // The region holds two versions' room (2 x store_bytes, pinned): a sync is
  // written beside the version readers see and replaces it when complete.
  // A consumer reads the newest version whenever it comes, without the
  // producer; the producer does not overwrite a version a live consumer
  // still reads (it waits up to consumer_timeout, then applies
  // stall_policy: kEvict keeps the trainer going when a reader holds a
  // version too long, and is the Python default for store regions).
  // slot_bytes and slots are ignored; one producer rank.
  std::uint64_t store_bytes = 0;
  std::uint64_t slot_bytes = 256ull << 20;    // S, rounded up to 2 MiB
  std::uint32_t slots = 2;                    // K >= 2: double buffering
  std::uint32_t max_consumers = 8;            // N, 1..64, fixed at create
  // Room for one sync's manifest (and, sharded, each rank's list). The
  // default, the most a region takes, fits every sync of up to
  // limits::kMaxTensors tensors with names of up to ~880 bytes: the area is
  // reserved sparsely, so a small model uses (and allocates) only the
  // pages its manifest fills. A smaller value only caps the manifest.
  std::uint64_t manifest_bytes = limits::kMaxManifestBytes;
  bool group_access = false;     // create mode 0660 instead of 0600
  bool replace_stale = true;     // replace a same-named region whose producer is dead
  bool unlink_on_close = true;   // remove the name when the producer closes
  bool checksums = false;        // XXH3-64 per slot, verified by consumers
  StallPolicy stall_policy = StallPolicy::kFail;
  // How long a live consumer may hold back a slot or a manifest ack.
  Duration consumer_timeout = std::chrono::seconds(60);
  Pin pin = Pin::kAuto;
  CopyEngine engine = CopyEngine::kAuto;
  // Sharded producers: `world_size` processes (ranks) write one sync
  // together. Rank 0 creates the region (with the geometry above; slots >=
  // 2 * world_size) and assembles each sync's manifest; ranks 1.. attach to
  // it by name (their geometry options are ignored). Every rank calls
  // begin_sync() with the pieces it holds and writes them itself.
  std::uint32_t rank = 0;
  std::uint32_t world_size = 1;
  // How long a rank waits for the region (ranks 1..), for the other ranks to
  // begin a sync (rank 0, kTimeout naming the missing rank) or for rank 0 to
  // answer (ranks 1..).
  Duration rank_timeout = std::chrono::seconds(120);
  // Delta syncs (ring regions; sharded producers: every rank alike, each
  // keeping the base of its own pieces, and a sync is a delta only when it
  // is one on every rank, docs/protocol.md §12.1): the producer keeps a base, a
  // copy of the bytes it last sent (host memory, delta_base_bytes()), and
  // sends each tensor as the elements that changed since then (compared as
  // raw words: bit-exact for any dtype), docs/protocol.md §12. One rank
  // keeps a base per set of tensors (names, dtypes, shapes): an update sent
  // as several syncs (buckets) has each bucket's sync a delta against that
  // bucket's last one (kMaxDeltaGroups). A sync goes out full (a keyframe)
  // when there is no base for its tensors yet (a sharded rank: they are not
  // its last sync's), a consumer asked for one (it attached late,
  // skipped a version, was handed other destinations, or found a checksum
  // mismatch), the set's previous sync was aborted, every keyframe_every-th
  // sync of a set (0: never on a schedule), or when the deltas would take more than
  // delta_max_ratio of the full size (they would not pay: on an H200,
  // Qwen2.5-3B shapes, a delta sync stopped being faster than a full one
  // between 0.37 and 0.57 of the bytes, docs/benchmarks.md; decided from the
  // planned sizes, before anything is encoded, for tensors from GPUs).
  bool delta = false;
  std::uint32_t keyframe_every = 0;
  double delta_max_ratio = 0.4;
  // Device slots (SlotMemory::kDevice): the K slots of S bytes (2 x 256 MiB
  // by default: bounded, never the whole model) are allocated on GPU
  // `slot_device` (-1: the current device), the copy engine is CUDA, and
  // the consumers must see that GPU or reach it by peer access (else their
  // open() fails with kUnsupported). Ring regions of one rank, without
  // checksums or deltas (kInvalidArgument otherwise). Who may fetch the
  // memory is decided as for the region file: this uid, trusted uids, and
  // with group_access the region's group (checked with SO_PEERCRED).
  SlotMemory slot_memory = SlotMemory::kHost;
  int slot_device = -1;
  // Quantize-on-send (see Quantize): the tensors quantize_filter selects
  // (empty: default_quantize_filter) are converted to block FP8 while they
  // are copied into the slots, once per sync for every consumer; the
  // manifest carries the FP8 tensor and its scales (begin_sync() adds them;
  // write(i) takes tensor i of the caller's list and writes both), so
  // consumers need no option. last_sync().logical_bytes counts the caller's
  // tensors (e.g. bf16), payload_bytes what crossed the region. A tensor to
  // quantize is written whole (write_part() is refused for it): from host
  // memory, quantized by host code straight into host slots; from a GPU
  // (write_device(), the CUDA engine; not with delta), by kernels straight
  // into the slots as the engine copies (docs/protocol.md §14). A NaN or Inf
  // in it fails that write (kInvalidArgument naming the tensor; send(), and
  // prepare_device() before a sync of GPU tensors, find it before the sync
  // begins, so consumers keep the last version). Its source (pointer and
  // pitch) must be aligned to its elements (2 or 4 bytes), as a framework's
  // tensors are: another is refused with kInvalidArgument before it is read.
  // Not with fill_spans(), lend_chunk() or begin_forwarded().
  // Sharded producers: each rank quantizes its own rows, so a shard must
  // start and (unless it is the tensor's end) end on a multiple of 128 along
  // its dim: begin_sync() refuses one that does not, naming the tensor and
  // the boundary (docs/protocol.md §14).
  Quantize quantize = Quantize::kNone;
  QuantizeFilter quantize_filter{};
};

struct ConsumerOptions {
  // How long open() waits for the region to exist, be initialised and have a
  // live producer (for example while the trainer restarts).
  Duration open_timeout = std::chrono::seconds(30);
  // How long one wait for the next chunk may take, mid-sync, while the
  // producer is alive. While a slot fills progressively (host producers
  // without checksums), each wait is for more of its bytes: a producer that
  // keeps adding bytes does not time out.
  Duration chunk_timeout = std::chrono::seconds(60);
  Pin pin = Pin::kAuto;
  bool verify_checksums = true;  // slot checksums (when written), every delta piece applied (partial ones refused)
  // Whose regions to trust. A region owned by another uid, or writable by
  // others, is refused with kPermission: its owner could change the tensors
  // under you. By default only regions of this process's effective uid,
  // mode 0600, are opened.
  bool group_access = false;                // also accept 0660 regions of a group we are in
  std::vector<std::uint32_t> trusted_uids;  // also accept regions owned by these uids
  // Regions with device slots: the GPU (this process's ordinal) whose
  // streams copy out of them; -1: the current device. The slots are mapped
  // for it (and for the GPU that holds them). open() fails with
  // kUnsupported when this process cannot map them: the GPU is not visible
  // here, or not reachable by peer access, or there is no GPU at all.
  int device = -1;
};

// A tensor stored with a constant row pitch (e.g. a column slice of a matrix):
// `rows` rows of `row_bytes` bytes, row r starting at src + r * pitch_bytes.
struct Strided2D {
  std::uint64_t rows = 0;
  std::uint64_t row_bytes = 0;
  std::uint64_t pitch_bytes = 0;
};

// ---------------------------------------------------------------- producer

class SHMCAST_API Producer {
 public:
  // Creates region `name` (O_EXCL, mode 0600): header, seats, slots, manifest.
  // A sharded producer's rank r >= 1 attaches to the region rank 0 creates
  // instead (waiting up to rank_timeout for it).
  static Producer create(std::string_view name, const ProducerOptions& options = {});

  Producer(Producer&&) noexcept;
  Producer& operator=(Producer&&) noexcept;
  ~Producer();  // close()

  // Blocks until at least `n` live consumers are attached.
  void wait_for_consumers(std::uint32_t n, Duration timeout);
  std::uint32_t consumers() const;  // attached consumers whose process is alive

  // Starts a sync: packs `tensors` (in order) into the stream and publishes the
  // manifest. Consumers attached now take part; later ones start with the
  // next sync. Returns the sync's version: `version` when given (it must be
  // greater than last_version(); a relay publishes its upstream's), else
  // last_version() + 1.
  // Sharded producers: every rank calls it for every sync with the pieces it
  // holds (whole tensors or shards, full shapes in `shape`); rank 0 waits for
  // all ranks, checks that the pieces tile each tensor exactly, publishes one
  // manifest of whole tensors, and every rank returns the same version. Each
  // call is one round of the ranks, and the round's id is the sync's version:
  // `version` when given (every rank names each sync alike, e.g. the
  // training step, strictly increasing), else this rank's last round + 1. A
  // rank's list is only ever merged into the round it names: a rank that is
  // late, gave up, failed or skipped a round fails that round (kTimeout
  // naming the late rank, or the failing rank's error) on every rank, and
  // the next round starts clean. A rank that never calls begin_sync() for a
  // sync cannot be told from a late one unless the ranks name versions.
  std::uint64_t begin_sync(std::span<const TensorSpec> tensors, std::uint64_t version = 0);
  // Copies tensor `index` from host memory. Tensors are written in order.
  // A write that throws (a wrong index, a bad layout, a copy error, a
  // consumer that timed out) aborts the sync: consumers get kAborted with the
  // reason, and the next begin_sync() starts a fresh one.
  void write(std::size_t index, const void* src);
  void write_strided(std::size_t index, const void* src, const Strided2D& layout);
  // Copies bytes [offset, offset + bytes) of tensor `index` from host memory:
  // a tensor written in parts, in order and without gaps (offset = the bytes
  // of it written so far); it is complete with its last byte.
  void write_part(std::size_t index, std::uint64_t offset, const void* src, std::uint64_t bytes);
  // Copies tensor `index` from device memory with async D2H copies on a
  // stream the library owns, ordered after `cuda_stream` (a cudaStream_t, or
  // nullptr for the legacy default stream). Slots are published as their
  // copies complete. The source may be reused once end_sync() returns
  // (not before: a delta producer reads it again in end_sync(), where it
  // encodes the sync's GPU tensors).
  void write_device(std::size_t index, const void* src, void* cuda_stream);
  // Quantize-on-send with GPU sources, before begin_sync(): computes the
  // block scales of every tensor of `tensors` the filter selects from its
  // device memory (`srcs`, contiguous; nullptr: skip it) on `cuda_stream`,
  // waiting once for all of them, so that a NaN or Inf fails here
  // (kInvalidArgument naming the tensor) with nothing announced; the next
  // sync's write_device() of the same pointers takes them instead of
  // computing and waiting for its own. No-op without quantize. A sharded
  // rank whose prepare_device() throws still owes its round: skip_sync().
  void prepare_device(std::span<const TensorSpec> tensors, std::span<const void* const> srcs, void* cuda_stream);
  // The tensors that a sync of `tensors` announces in its manifest, in
  // order, as consumers see them in SyncInfo::tensors: `tensors` itself,
  // except that with quantize each tensor the filter selects becomes
  // float8_e4m3fn and is followed by its scales (Quantize). For a control
  // plane that announces a sync's names (a count, a digest) before sending
  // it. Throws kInvalidArgument where begin_sync() would refuse the
  // selection. Calls the filter once per tensor; changes nothing.
  // kUnsupported for a sharded producer (world_size > 1): a round's manifest
  // merges every rank's list, which one rank cannot know.
  std::vector<TensorSpec> manifest_specs(std::span<const TensorSpec> tensors) const;
  void write_device_strided(std::size_t index, const void* src, const Strided2D& layout,
                            void* cuda_stream);
  // Store regions: lends out the room of the sync in progress in the bank
  // being written, one span per tensor (its bytes, contiguous; empty for an
  // empty tensor), for the caller to fill itself (file reads straight into
  // the region, any order, any thread) instead of write(). Call it right
  // after begin_sync(); end_sync() then publishes what the spans hold, and
  // abort_sync() drops it. write() is refused for the rest of that sync.
  std::vector<std::span<std::byte>> fill_spans();
  // Ring regions, one rank: lends the slot of chunk c of the sync in
  // progress (stream bytes [c * slot_bytes(), +span size)) for the caller to
  // fill itself, from any thread, instead of write(): a relay receives the
  // network's bytes straight into it. Waits as write() does for the
  // consumers to release the slot (claiming every chunk before c too). At
  // most slots() chunks may be lent ahead of the first unpublished one.
  // Consumers see a chunk only once publish_chunks() passes it. write() is
  // refused for the rest of the sync; end_sync() publishes what is left.
  // Chunks skipped over (lent implicitly when a later one is) and chunks
  // never lent are published as the slot holds them: fill every chunk
  // that holds tensor bytes. Device slots (SlotMemory::kDevice): kUnsupported
  // (the span would be GPU memory, which host code cannot touch).
  std::span<std::byte> lend_chunk(std::uint64_t c);
  // Publishes every chunk below `end` not yet published, in order: their
  // bytes are final. Each must have been claimed (lent, or skipped over).
  void publish_chunks(std::uint64_t end);
  // Publishes the last slot and returns once every slot of the sync has been
  // filled (all D2H copies done). Consumers may still be reading. Sharded
  // producers: returns on every rank only once every rank's chunks are in
  // (the sync is complete for the consumers); else throws (kPeerDied, kTimeout
  // naming the rank, kAborted), on every rank.
  void end_sync();
  // Abandons the sync in progress; consumers get Errc::kAborted with `why`.
  void abort_sync(std::string_view why);

  // begin_sync + write each + end_sync, from host memory.
  std::uint64_t send(std::span<const TensorSpec> tensors, std::span<const void* const> srcs);
  // The same with the sync's version (begin_sync's `version`).
  std::uint64_t send(std::span<const TensorSpec> tensors, std::span<const void* const> srcs, std::uint64_t version);
  // Sharded producers: this rank cannot begin its next sync (its caller failed
  // before it could, e.g. preparing the tensors): takes the round anyway and
  // fails it on every rank with `why` (kAborted), so the ranks stay in step.
  // `version` as for begin_sync(). A producer of one rank: does nothing.
  void skip_sync(std::string_view why, std::uint64_t version = 0);
  // Sharded producers: the last round this rank took (begun, failed or
  // skipped; its id is that sync's version), 0 before the first.
  std::uint64_t last_round() const;

  // Blocks until every consumer of the last sync has released all its slots
  // (a store region returns at once: its readers never hold the producer up
  // between syncs).
  void wait_drained(Duration timeout);

  // Things the producer did on its own since the last call, such as
  // evicting a dead consumer's seat. One line each.
  std::vector<std::string> take_events();

  const std::string& name() const;
  const std::string& path() const;
  std::uint64_t region_bytes() const;
  std::uint64_t slot_bytes() const;
  std::uint32_t slots() const;
  std::uint64_t last_version() const;
  RegionMode mode() const;
  // The layout of the sync in progress, or of the last one begun (completed
  // or aborted): what consumers will see in SyncInfo.
  const SyncLayout& last_layout() const;
  bool pinned() const;
  CopyEngine engine() const;   // kHost or kCuda: the engine chosen at create
  SlotMemory slot_memory() const;
  // Device slots: the GPU that holds them (this process's ordinal) and the
  // bytes allocated there (slots x slot_bytes, rounded up to the GPU's
  // granularity); -1 and 0 for host slots.
  int slot_device() const;
  std::uint64_t slot_device_bytes() const;
  double pin_seconds() const;  // time spent in cudaHostRegister
  double create_seconds() const;  // time to create and fallocate the region
  // The last completed sync: full or delta, logical and payload bytes.
  SyncReport last_sync() const;
  // Bytes of the delta base (ProducerOptions::delta), 0 without deltas.
  std::uint64_t delta_base_bytes() const;

  // Relays (a delta region, ProducerOptions::delta): begins a sync that
  // passes on another delta region's sync as it is, under its version. With
  // base_version 0 a full sync (write the tensors' bytes); else a delta sync
  // against version base_version: tensor i's stream piece is a blob of
  // wire_bytes[i] bytes (is_delta[i]) or its own bytes (wire_bytes[i] ==
  // nbytes, a dtype sent whole), written with write_part() or lend_chunk()
  // as the upstream's stream holds them. No base is kept (nothing is
  // encoded or copied aside); a later begin_sync() is full. The blobs are
  // checked by the consumers that apply them (sizes here). kInvalidArgument
  // for sizes no blob of that tensor can have, or a base not below version.
  std::uint64_t begin_forwarded(std::span<const TensorSpec> tensors, std::uint64_t version,
                                std::uint64_t base_version, std::span<const std::uint64_t> wire_bytes,
                                std::span<const std::uint8_t> is_delta);
  // Delta regions: whether a live consumer asked for a full sync that the
  // last full sync does not answer (what makes a delta producer's next sync
  // full; a relay passes it upstream). `after`, when given, receives the
  // latest version after which such a consumer wants one (any full sync
  // of a later version answers every such request).
  bool full_sync_requested(std::uint64_t* after = nullptr) const;

  // Marks the region closed (consumers get Errc::kClosed after the last
  // sync), unpins, unmaps and, by default, unlinks the name.
  void close();

  struct Impl;

 private:
  explicit Producer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// ---------------------------------------------------------------- consumer

class SHMCAST_API Consumer {
 public:
  // Opens region `name`, claims a consumer seat and waits for nothing else.
  static Consumer open(std::string_view name, const ConsumerOptions& options = {});

  Consumer(Consumer&&) noexcept;
  Consumer& operator=(Consumer&&) noexcept;
  ~Consumer();  // close()

  // Waits for the next sync this consumer takes part in and copies its
  // manifest. The previous sync must have been read or skipped.
  // A store region: returns at once when it holds a version newer than
  // last_version() (the newest one; a consumer that just opened gets the
  // current weights), else waits for the producer to store one. The version
  // is held (the producer will not replace its bytes) until it has been read
  // or skipped. The SyncInfo (and every name, shape and shard list in it)
  // is valid until the next wait_sync() on this consumer, which reuses its
  // memory: copy what must outlive that.
  const SyncInfo& wait_sync(Duration timeout);

  // Reads the sync into caller memory: dsts[i] receives tensor i (nullptr
  // skips it). Releases each slot as soon as it and every slot of the sync
  // before it have been copied out (with several producer ranks, chunks are
  // read in the order they are ready, not in the ring's order).
  void read_into(std::span<void* const> dsts);
  // The same, reading only a part of some tensors: selections[i] (empty span:
  // whole tensors) picks rows along one dim; dsts[i] then holds that slice,
  // contiguous. Only the selected bytes are copied.
  void read_into(std::span<void* const> dsts, std::span<const Selection> selections);
  // Zero-copy: calls fn for every piece of every tensor, in stream order,
  // while its slot is held. A tensor no larger than a slot is one piece.
  // With several producer ranks, each rank's pieces come in its sub-stream's
  // order, and the ranks' chunks in the order they are ready.
  void visit(const std::function<void(const Piece&)>& fn);
  // Zero-copy, for a reader that hands slots to something asynchronous (a
  // relay's network sends): fn(c, data, bytes, release) gets chunk c of the
  // sync, stream bytes [c * slot_bytes(), + bytes), in order, and returns at
  // once; the slot stays held until release() is called (once, from any
  // thread). Several chunks may be held at once (at most the region's
  // slots). Returns when every chunk was released; kTimeout when one is not
  // within chunk_timeout. After it returns or throws, a late release() does
  // nothing and the bytes may be overwritten. One producer rank only.
  void visit_chunks(
      const std::function<void(std::uint64_t, const std::byte*, std::uint64_t, std::function<void()>)>& fn);
  // Releases the rest of the sync without reading it (store regions: lets
  // go of the version, and of views()).
  void skip();
  // Store regions, zero-copy: where each tensor of the version wait_sync()
  // returned lies in the region (nullptr for an empty one), contiguous. The
  // version stays held until skip(), the next wait_sync() or close(): the
  // producer does not overwrite it for up to its consumer_timeout; after
  // that a producer with StallPolicy::kEvict evicts this consumer and may
  // rewrite the bytes under the pointers (views_valid() turns false), one
  // with kFail fails its sync. Hold views briefly: load them, then skip().
  // The bytes are every reader's: this process maps them read-only (see
  // views_read_only()), so a write through a pointer (after a const_cast)
  // kills the process with SIGSEGV rather than change the kept version. To
  // change the tensors, copy them (read_into()).
  std::vector<const std::byte*> views();
  // True while the version views() points at is still held and unchanged.
  bool views_valid() const;
  // Store regions: true when this process maps the stored versions (the
  // banks) read-only, so that a write through views() faults. Always on the
  // host; with pinning (Pin::kYes, kAuto on a GPU machine) only where the
  // GPU driver registers read-only memory (CU_MEMHOSTREGISTER_READ_ONLY);
  // elsewhere the banks are pinned writable and this is false. False for a
  // ring region.
  bool views_read_only() const;

  // H2D (needs CUDA): dsts[i] is a device pointer for tensor i (nullptr
  // skips). Copies run on a library stream; `cuda_stream` is made to wait for
  // them, so work queued on it afterwards sees the data. Slots are released
  // as their copies complete.
  void read_into_device(std::span<void* const> dsts, void* cuda_stream);
  // With selections, as read_into: strided H2D copies straight out of the
  // region move only the selected bytes.
  void read_into_device(std::span<void* const> dsts, void* cuda_stream, std::span<const Selection> selections);
  // H2D into a device buffer the library owns on `device`; returns one device
  // pointer per tensor, valid until the next wait_sync() on this consumer.
  std::vector<void*> read_to_staging(int device, void* cuda_stream);

  const SyncInfo& sync() const;     // the current (or last) sync
  std::uint64_t last_version() const;
  RegionMode mode() const;           // of the region
  std::uint64_t slot_bytes() const;  // of the region: chunk c of a sync is stream bytes [c*S, (c+1)*S)
  // Of the region. Device slots: every read is a copy by the GPU (into
  // device or host destinations); visit() and visit_chunks(), which hand
  // slot bytes to host code, are kUnsupported.
  SlotMemory slot_memory() const;
  int seat() const;
  const std::string& name() const;
  bool pinned() const;
  double pin_seconds() const;
  double open_seconds() const;
  // The last sync read_into() or read_into_device() completed: full or
  // delta, logical and payload bytes.
  SyncReport last_sync() const;
  // Whether the region's producer sends delta syncs (ProducerOptions::delta).
  bool delta() const;
  // Relays: passes a delta region's syncs on as they are. From now on
  // wait_sync() returns delta syncs whatever their base (the caller checks
  // SyncInfo::base_version against what its own readers hold, and calls
  // request_full_sync() when they do not), and visit_chunks() hands out a
  // delta sync's stream: the blobs, as the manifest's pieces place them.
  void forward_syncs();
  // Delta regions: asks the producer for a full sync as its next one (for
  // destinations that were changed or replaced since the last read, e.g.
  // after weights were discarded or reloaded); forgets the destinations, so
  // no delta is applied to them meanwhile. Does nothing on other regions.
  void request_full_sync();
  // Delta regions: the memory [ptr, ptr + bytes) no longer holds what a
  // read left there (freed, reused or written): no delta is ever applied to
  // destinations in it on that read's base. A later delta for them raises
  // kNeedsFullSync (or wait_sync() lets it go), as for other destinations.
  // Asks for nothing. Does nothing on other regions.
  void forget_destinations(const void* ptr, std::uint64_t bytes);

  // Leaves the seat; the producer stops waiting for this consumer.
  void close();

  struct Impl;

 private:
  explicit Consumer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// ---------------------------------------------------------------- CUDA

// True when built with CUDA and at least one device is usable.
SHMCAST_API bool cuda_available() noexcept;
// Why not, in words, when cuda_available() is false.
SHMCAST_API std::string cuda_unavailable_reason();

}  // namespace shmcast
