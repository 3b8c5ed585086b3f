// engine/ (layer 5): the delta codec on CUDA devices; the same blobs as the host codec
// (delta.hpp), made and taken by kernels (kernels/delta.cu) that the library
// carries as PTX and loads with cuModuleLoadDataEx through the driver API it
// dlopens (cuda_driver.hpp): libshmcast links no CUDA library.
//
// Every call enqueues work on the caller's stream (a cudaStream_t, i.e. a
// CUstream of the device's primary context; nullptr: the legacy default
// stream of the current context) and returns without waiting. Errors the
// device finds (a rejected blob, a checksum mismatch, inputs that changed
// between plan and encode) accumulate in the codec and are thrown by the
// next finish(), which waits for the stream. Argument errors throw at once.
//
// Pointers are device memory of the stream's device. base, next, head, out
// and blob must be 8-byte aligned (any cudaMalloc'd tensor is; kInvalidArgument
// otherwise); dst must be aligned to its element width; checksum data may
// have any alignment.
//
// A codec is bound to the context of the first stream it is used with, owns
// 32 bytes of device memory there, and is not thread-safe: use one per
// thread, and one stream at a time (its status words are shared by the
// calls it enqueues).
//
// The first call in a process JIT-compiles the kernels for the device
// (ptxas takes about 3 s for them on the 2-core development VM); the driver
// caches the result (~/.nv/ComputeCache, CUDA_CACHE_PATH), so later
// processes load it at once unless that cache is off or not kept.
//
// Costs: plan = one read of base and next (the count kernel) plus a scan of
// the block table in one CUDA block (for a 6 GB bf16 model's largest tensor,
// 76 K entries); encode reads the blocks that changed; apply reads the blob
// and writes the selected changed elements. No host round trip inside any of
// them; the caller reads the planned size with read_header() (one 64-byte
// D2H and a stream sync), which it needs anyway to size the blob.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <vector>

#include "protocol/delta_format.hpp"

namespace shmcast::detail::delta {

// Whether the CUDA delta codec can run here: built with its kernels, a
// driver and a device present. `why` says why not.
bool cuda_codec_available(std::string* why);

// The same module's batched copy (CopyPiece, delta_format.hpp), for the
// CUDA engine. copy_pieces_ready: the kernels load in the current context
// (loads them once; false with `why` otherwise: a build without nvcc).
// launch_copy_pieces: copies the n pieces described at `pieces` (device
// memory, CopyPiece[n]) in one launch on `stream`, in the current context.
bool copy_pieces_ready(std::string* why);
void launch_copy_pieces(const void* pieces, std::uint64_t n, void* stream);

class CudaCodec {
 public:
  CudaCodec();   // loads nothing; the first call loads the driver and the kernels
  ~CudaCodec();  // frees its device memory (after the work it enqueued, which the caller must have waited for)
  CudaCodec(const CudaCodec&) = delete;
  CudaCodec& operator=(const CudaCodec&) = delete;

  // Compares next with base (n elements of w bytes) and writes the blob's
  // header and table into `head` (head_bytes(n) bytes; it may be the start
  // of the output buffer). The blob's size is head_bytes(n) +
  // header.payload_bytes (read_header()).
  void plan(const void* base, const void* next, std::uint32_t w, std::uint64_t n, void* head, void* stream);
  // plan() of many tensors in two launches (not two each, whose fixed cost
  // dominates small tensors): the same checks, before anything is queued,
  // the same headers and tables.
  struct PlanItem {
    const void* base;
    const void* next;
    std::uint32_t w;
    std::uint64_t n;
    void* head;
  };
  void plan_batch(const std::vector<PlanItem>& items, void* stream);
  // Writes the blob planned in `head` into out[0, out_bytes) (copying the
  // header and table unless out == head) and makes base equal to next.
  // base and next must hold what plan saw; if they changed, finish() throws
  // kInvalidArgument (base partly updated, out not a blob). An out_bytes
  // smaller than the blob: finish() throws kInvalidArgument, nothing written.
  void encode(void* base, const void* next, std::uint32_t w, std::uint64_t n, const void* head, void* out,
              std::uint64_t out_bytes, void* stream);
  // encode() of many tensors, a launch per range of them (not one each,
  // whose fixed cost dominates small tensors): encode_table() makes every
  // check encode() makes, before anything is queued, and uploads the
  // table of all the items in one copy on `stream`; encode_range(first,
  // last) then encodes items [first, last) of it in one launch on the same
  // stream (a range per chunk lets the copies of the first blobs overlap
  // the encoding of the later ones). The same blobs, base updates and
  // errors at finish(). The table serves until the next encode_table().
  struct EncodeItem {
    void* base;
    const void* next;
    std::uint32_t w;
    std::uint64_t n;
    const void* head;
    void* out;
    std::uint64_t out_bytes;
    std::uint64_t pad = 0;  // bytes after out + out_bytes to zero (the gap to the next blob)
  };
  void encode_table(const std::vector<EncodeItem>& items, void* stream);
  void encode_range(std::size_t first, std::size_t last, void* stream);
  // Applies `blob` (blob_bytes, in device memory) to `dst` as
  // delta::apply does on the host (the same map, the same checks). A blob
  // that fails validation writes nothing, and finish() throws kCorrupt (one
  // too short for its header and table: apply throws it at once); with
  // `verify` (holds_piece(map) only), so does a result whose checksum is
  // not the blob's.
  void apply(const void* blob, std::uint64_t blob_bytes, std::uint32_t w, const SliceMap& map, void* dst,
             std::uint64_t dst_bytes, bool verify, void* stream);
  // apply() of many pieces in one go (five launches in all, not five
  // each): the same checks, before anything is queued; the same errors at
  // finish() (a rejected piece writes nothing; the others are applied).
  struct ApplyItem {
    const void* blob;
    std::uint64_t blob_bytes;
    std::uint32_t w;
    SliceMap map;
    void* dst;
    std::uint64_t dst_bytes;
    bool verify;
  };
  void apply_batch(const std::vector<ApplyItem>& items, void* stream);
  // The content checksum of [data, data + bytes) into *out (a device u64).
  void checksum(const void* data, std::uint64_t bytes, void* out, void* stream);
  // Waits for `stream`, then throws what the device found since the last
  // finish() (kCorrupt, kInvalidArgument) and clears it.
  void finish(void* stream);
  // Waits for `stream` and returns the header at `head` (device memory).
  Header read_header(const void* head, void* stream);

  // Device memory for the codec's callers, in its context (bound by
  // `stream`), 256-byte aligned: buffer(i, bytes) is the codec's buffer i
  // (0..3) of at least `bytes`, kept and reused (grown after waiting for
  // `stream`); freed with the codec.
  void* buffer(int i, std::uint64_t bytes, void* stream);
  // Device memory of `bytes` in the codec's context, owned by the codec
  // until release(p) or its destruction (kCuda when the device is full).
  void* alloc(std::uint64_t bytes, void* stream);
  void release(void* p) noexcept;
  // Copies on `stream`: host memory may be pageable (then the call returns
  // once the bytes are taken); device to device.
  void upload(void* dev, const void* host, std::uint64_t bytes, void* stream);
  void download(void* host, const void* dev, std::uint64_t bytes, void* stream);
  void copy(void* dev_dst, const void* dev_src, std::uint64_t bytes, void* stream);
  // Waits for `stream`.
  void wait(void* stream);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shmcast::detail::delta
