// shmcast/safetensors.hpp: load safetensors checkpoints from disk and publish
// them as one sync of a region.
//
//   auto ckpt = shmcast::safetensors::open_checkpoint("/models/qwen");  // a file, a directory
//                                                                        // or its index.json
//   auto prod = shmcast::Producer::create("actor-0", {.slot_bytes = 256 << 20});
//   shmcast::safetensors::PublishStats s = shmcast::safetensors::publish(prod, ckpt);
//
// Library: shmcast::fileio (CMake target shmcast_fileio), which links
// liburing; users of the transfer alone link shmcast::shmcast and never
// liburing. Everything here throws shmcast::Error:
//   kCorrupt          the checkpoint fails validation (the header is untrusted
//                     input: lengths, JSON, dtypes, shapes, offsets, overlaps,
//                     names, shard names are all checked before a byte of
//                     tensor data is read)
//   kNotFound         a file or shard is missing
//   kPermission       the OS refused (file mode; a symlinked shard without
//                     allow_symlinks; io_uring forced but denied)
//   kInvalidArgument  bad options, or a tensor shmcast cannot carry
//   kSystem           an unexpected I/O error (errno attached)
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shmcast/shmcast.hpp"

namespace shmcast::safetensors {

// The header length is at most this (the reference implementation's limit).
inline constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;
// model.safetensors.index.json is at most this.
inline constexpr std::uint64_t kMaxIndexBytes = 64ull << 20;
// Shards one index may name.
inline constexpr std::size_t kMaxShards = 65536;

// ---------------------------------------------------------------- dtypes

// Bits per element of a safetensors dtype ("BF16" -> 16, "F4" -> 4); 0 when
// the name is not a safetensors dtype.
SHMCAST_API unsigned dtype_bits(std::string_view safetensors_dtype) noexcept;
// The shmcast dtype of a safetensors dtype: BOOL U8 I8 I16 I32 I64 U16 U32
// U64 F16 BF16 F32 F64 F8_E4M3 (kF8E4M3FN) F8_E5M2 F8_E8M0 (kF8E8M0FNU) C64.
// False for the sub-byte types (F4, F6_E2M3, F6_E3M2) and unknown names.
SHMCAST_API bool to_shmcast(std::string_view safetensors_dtype, DType* out) noexcept;
// The safetensors name of a shmcast dtype (what shmcast-inspect dump
// writes); empty when safetensors has none (f8e4m3fnuz, f8e5m2fnuz, c128, raw).
SHMCAST_API std::string_view from_shmcast(DType dtype) noexcept;

// ---------------------------------------------------------------- parsing

struct TensorEntry {
  std::string name;
  std::string dtype;                // as written in the file: "BF16"
  std::vector<std::int64_t> shape;  // empty: a scalar
  std::uint64_t nbytes = 0;
  std::uint32_t file = 0;           // index into Checkpoint::files (0 for parse_header)
  std::uint64_t offset = 0;         // absolute byte offset of the data in that file
};

// One validated file header. Tensors are in data order (by offset).
struct FileHeader {
  std::uint64_t header_bytes = 0;  // the JSON's length N
  std::uint64_t data_start = 0;    // 8 + N
  std::uint64_t file_bytes = 0;    // data_start + the data section
  std::map<std::string, std::string> metadata;  // __metadata__
  std::vector<TensorEntry> tensors;
};

// Validates the header length of a file of `file_bytes` bytes whose first 8
// bytes are `first8`; returns N.
SHMCAST_API std::uint64_t header_length(std::span<const std::byte> first8, std::uint64_t file_bytes,
                                        std::string_view what = "file");
// Parses and validates a whole header: `bytes` holds the file's first
// 8 + N bytes (or more), `file_bytes` is the file's size. Checks: N within
// the file and kMaxHeaderBytes; the JSON starts with '{', is well-formed
// UTF-8 JSON, nesting at most 3 deep, with no key twice in any object;
// `__metadata__` is an object of strings; every other key is a tensor whose
// value is exactly {dtype, shape, data_offsets}; dtype is known; shape holds
// integers >= 0; elements * bits is a whole number of bytes and equals
// end - begin (no overflow); begin <= end; sorted by offset, the tensors
// cover the data section exactly (no gap, no overlap) and it ends at the end
// of the file. `what` names the file in messages.
SHMCAST_API FileHeader parse_header(std::span<const std::byte> bytes, std::uint64_t file_bytes,
                                    std::string_view what = "file");

// Parses model.safetensors.index.json: {"metadata": {...}, "weight_map":
// {tensor: shard file name}}. Shard names must be plain file names (no '/',
// not '.' or '..', no NUL, at most 255 bytes). Returns the weight map.
SHMCAST_API std::map<std::string, std::string> parse_index(std::string_view json_text,
                                                           std::string_view what = "index");

// ---------------------------------------------------------------- checkpoints

struct OpenOptions {
  // Shards are opened relative to the checkpoint directory with O_NOFOLLOW,
  // so a shard that is a symbolic link is refused (kPermission). A Hugging
  // Face cache snapshot links every file into ../../blobs: set this to
  // follow links you trust.
  bool allow_symlinks = false;
};

struct CheckpointFile {
  std::string path;  // for messages: directory + shard name, or the file
  FileHeader header;
};

class SHMCAST_API Checkpoint {
 public:
  Checkpoint();
  Checkpoint(Checkpoint&&) noexcept;
  Checkpoint& operator=(Checkpoint&&) noexcept;
  ~Checkpoint();

  const std::string& path() const;
  bool sharded() const;  // opened through an index
  const std::vector<CheckpointFile>& files() const;
  // Every tensor, by file (shard name order), then by offset.
  const std::vector<TensorEntry>& tensors() const;
  std::uint64_t payload_bytes() const;  // sum of the tensors' sizes
  std::ptrdiff_t find(std::string_view name) const;  // index or -1
  // The tensors as shmcast specs (throws kInvalidArgument, naming the tensor,
  // for one shmcast cannot carry: a sub-byte dtype, more than kMaxDims
  // dimensions, a name that is empty or longer than kMaxNameBytes).
  std::vector<TensorSpec> specs() const;

  struct Impl;
  explicit Checkpoint(std::unique_ptr<Impl> impl);
  const Impl& impl() const { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

// Opens a checkpoint: a .safetensors file; a directory holding
// model.safetensors.index.json (and its shards) or model.safetensors; or the
// path of an index file. Every header is validated, and for an index every
// name it maps must be in its shard and every tensor of a shard in the index
// (no name twice). The files stay open (the data is later read from the very
// files validated here).
SHMCAST_API Checkpoint open_checkpoint(const std::string& path, const OpenOptions& options = {});

// ---------------------------------------------------------------- reading

enum class IoPath : std::uint8_t {
  kAuto,      // io_uring: O_DIRECT for files not in the page cache, buffered for
              // cached ones; pread when io_uring is denied (Docker: EPERM,
              // Podman: ENOSYS) or SHMCAST_NO_URING=1
  kDirect,    // io_uring + O_DIRECT (kPermission when io_uring is unavailable,
              // kInvalidArgument when the file system refuses O_DIRECT)
  kBuffered,  // io_uring through the page cache
  kPread,     // pread(2) from a few threads, through the page cache
};
SHMCAST_API std::string_view io_path_name(IoPath) noexcept;  // "auto", "direct", ...

struct ReadOptions {
  IoPath path = IoPath::kAuto;
  std::uint32_t queue_depth = 32;           // io_uring requests in flight, 1..4096
  std::uint64_t request_bytes = 1ull << 20; // one read, a power of two, 4 KiB..64 MiB
  std::uint64_t window_bytes = 64ull << 20; // one staging window (stream_tensors), >= request_bytes
  std::uint32_t windows = 3;                // staging windows read ahead, 2..64
  std::uint32_t pread_threads = 4;          // kPread, 1..64
  bool register_buffers = true;             // io_uring fixed buffers for the windows (O_DIRECT)
};

struct ReadStats {
  std::string path;             // what was used: "direct", "buffered", "direct+buffered", "pread"
  std::string fallback_reason;  // why not io_uring / not O_DIRECT, when it was asked for or automatic
  std::uint64_t bytes = 0;          // bytes read from the files (with alignment overhead)
  std::uint64_t direct_bytes = 0;   // of those, through O_DIRECT
  std::uint64_t requests = 0;
  std::uint64_t staging_bytes = 0;  // stream_tensors' windows
  bool registered_buffers = false;
  std::uint32_t queue_depth = 0;
  double seconds = 0;
};

// Reads checkpoints with one io_uring ring (or pread threads), one set of
// staging windows and one registration of them, kept from call to call: the
// first call pays for setting them up (and for faulting in the staging
// memory), later ones do not. The I/O path is chosen at the first call and
// kept; O_DIRECT or buffered is chosen per file at every call. Not
// thread-safe: one call at a time.
class SHMCAST_API Reader {
 public:
  explicit Reader(const ReadOptions& options = {});  // throws kInvalidArgument for bad options
  Reader(Reader&&) noexcept;
  Reader& operator=(Reader&&) noexcept;
  ~Reader();

  // Reads tensor i into dsts[i] (host memory the caller owns, nbytes long;
  // nullptr skips it), straight into that memory: buffered and pread reads
  // land there directly; O_DIRECT reads land there for the block-aligned part
  // of a tensor whose destination is aligned like its file offset (modulo
  // 4 KiB); the rest goes through the page cache, also straight into dsts.
  ReadStats read_tensors(const Checkpoint& ckpt, std::span<void* const> dsts);

  // Reads the tensors, in file order, through aligned staging windows
  // (O_DIRECT reads land in them directly) and calls fn(i, bytes) for each
  // tensor once its bytes are in memory; `bytes` is valid during the call.
  // A window holds a run of tensors of one file spanning at most
  // window_bytes; reads run ahead of fn by up to `windows` windows. A tensor
  // larger than window_bytes is read into one buffer of its own size (one
  // such in flight), so the staging memory is about windows * window_bytes +
  // the largest tensor. An exception from fn stops the reads and propagates.
  ReadStats stream_tensors(const Checkpoint& ckpt, const std::function<void(std::size_t, const std::byte*)>& fn);

  const ReadOptions& options() const;
  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// One-shot forms: a Reader for one call.
SHMCAST_API ReadStats read_tensors(const Checkpoint& ckpt, std::span<void* const> dsts,
                                   const ReadOptions& options = {});
SHMCAST_API ReadStats stream_tensors(const Checkpoint& ckpt,
                                     const std::function<void(std::size_t, const std::byte*)>& fn,
                                     const ReadOptions& options = {});

// Asks the kernel to drop the checkpoint's files from the page cache
// (posix_fadvise DONTNEED; clean pages only): the next read comes from the
// disk. For benchmarks.
SHMCAST_API void drop_page_cache(const Checkpoint& ckpt) noexcept;

// ---------------------------------------------------------------- publishing

struct PublishOptions {
  ReadOptions read;  // unless publish() is given a Reader
  std::uint32_t wait_consumers = 0;  // wait for this many consumers before begin_sync
  Duration wait_timeout = std::chrono::seconds(60);
  // After end_sync, wait until every consumer of the sync has read it
  // (Producer::wait_drained); 0 does not wait.
  Duration drain_timeout = std::chrono::seconds(60);
  // Set (from a signal handler, another thread) to stop: the sync in
  // progress is aborted and publish() throws kAborted.
  const std::atomic<bool>* stop = nullptr;
};

struct PublishStats {
  std::uint64_t version = 0;
  std::size_t tensors = 0;
  std::uint64_t payload_bytes = 0;
  std::uint32_t consumers = 0;  // attached at begin_sync
  double wait_s = 0;     // waiting for consumers
  double publish_s = 0;  // begin_sync .. end_sync: reading and writing every byte
  double drain_s = 0;    // end_sync .. every consumer done
  ReadStats read;
};

// The manifest room a producer needs for this checkpoint (the format of
// docs/protocol.md section 6, rounded up to 4 KiB, at least 1 MiB).
SHMCAST_API std::uint64_t manifest_bytes_for(const Checkpoint& ckpt);

// Publishes the checkpoint as one sync through `producer`: a ring region:
// begin_sync, then write() of each tensor from the staging windows that
// Reader::stream_tensors fills, then end_sync; a store region: begin_sync,
// Reader::read_tensors straight into the spans Producer::fill_spans lends
// out (no staging, one copy), then end_sync. A failure aborts the sync.
// With `reader`, its options and its kept staging and ring are used (pass
// the same one to publish again without setting them up again); else a
// Reader of options.read for this call.
SHMCAST_API PublishStats publish(Producer& producer, const Checkpoint& ckpt, const PublishOptions& options = {},
                                 Reader* reader = nullptr);

}  // namespace shmcast::safetensors
