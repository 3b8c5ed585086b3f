// engine/ (layer 5): copy engines. The ring decides where bytes go; an engine moves
// them. The host engine uses memcpy. The CUDA engine (cuda_engine.cpp, built
// with SHMCAST_WITH_CUDA) issues async D2H / H2D copies on a stream the
// library owns and runs the publish / release step when they complete.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "shmcast/shmcast.hpp"

namespace shmcast::detail {

namespace quant {
struct Matrix;
struct Scales;
}  // namespace quant

// Where a tensor's bytes come from (producer) or go to (consumer).
// Bytes made on the GPU instead of copied (quantize-on-send from GPU
// memory, api/producer_quant.cpp): launch() enqueues, on `stream`, the work
// that writes bytes [first, first + n) of the tensor to `dst`, device
// memory (a device slot, or a staging piece the engine then copies into a
// host slot). The engine calls it in place of a copy, on its own streams.
class DeviceFill {
 public:
  virtual ~DeviceFill() = default;
  virtual void launch(std::byte* dst, std::uint64_t first, std::uint64_t n, void* stream) const = 0;
};

struct Buffer {
  void* ptr = nullptr;
  bool device = false;
  Strided2D layout{};  // rows == 0: contiguous
  // Quantize-on-send (engine/quant.hpp): the bytes to write are the e4m3fn
  // codes of this host matrix's elements, one byte each, with these scales
  // (the producer writes them with quant::quantize_elems, not copy()).
  const quant::Matrix* qm = nullptr;
  const quant::Scales* qs = nullptr;
  // Not null: the engine has `fill` make the bytes (device == true, ptr the
  // source, for the ordering after the caller's stream).
  const DeviceFill* fill = nullptr;
};

// Copies bytes [offset, offset + n) of a tensor laid out as `layout` at
// `base` into the contiguous `dst` (host memory, row by row when strided).
void gather_host(std::byte* dst, const std::byte* base, const Strided2D& layout, std::uint64_t offset,
                 std::uint64_t n);
// The reverse: contiguous `src` into bytes [offset, offset + n) of a tensor
// laid out as `layout` at `base`.
void scatter_host(std::byte* base, const Strided2D& layout, std::uint64_t offset, const std::byte* src,
                  std::uint64_t n);

class ProducerEngine {
 public:
  virtual ~ProducerEngine() = default;
  // Orders the copies that follow after the work queued so far on the
  // caller's stream (CUDA); no-op on the host.
  virtual void begin(void* caller_stream) { (void)caller_stream; }
  // Copies bytes [offset, offset + n) of `src` into slot memory at `dst`
  // (or, src.fill set, has it make them there).
  virtual void copy(std::byte* dst, const Buffer& src, std::uint64_t offset, std::uint64_t n) = 0;
  // Whether copy() can take a Buffer with `fill` after the last begin():
  // a CUDA engine whose streams run on the caller's GPU, into slots that GPU
  // can address (device slots, or host slots that are pinned: `pinned`).
  virtual bool can_fill(bool pinned) const {
    (void)pinned;
    return false;
  }
  // All copies into a chunk are issued: run `publish` once they complete.
  virtual void chunk_done(std::function<void()> publish) = 0;
  // Blocks until every chunk_done callback has run. Rethrows a copy error.
  virtual void drain() {}
  virtual bool is_cuda() const { return false; }
};

class ConsumerEngine {
 public:
  virtual ~ConsumerEngine() = default;
  virtual void begin(void* caller_stream) { (void)caller_stream; }
  // Copies n bytes from slot memory `src` to `dst` + offset (device or host).
  virtual void copy(const Buffer& dst, std::uint64_t offset, const std::byte* src, std::uint64_t n) = 0;
  // Copies `rows` rows of `width` bytes: row i from src + i * src_pitch to
  // dst + offset + i * dst_pitch (a contiguous destination, or one whose
  // Strided2D layout the engine follows byte by byte).
  virtual void copy2d(const Buffer& dst, std::uint64_t offset, std::uint64_t dst_pitch, const std::byte* src,
                      std::uint64_t src_pitch, std::uint64_t width, std::uint64_t rows) {
    for (std::uint64_t i = 0; i < rows; ++i) copy(dst, offset + i * dst_pitch, src + i * src_pitch, width);
  }
  // All copies out of a chunk are issued: run `release` once they complete.
  virtual void chunk_done(std::function<void()> release) = 0;
  // Makes `caller_stream` wait for the copies issued since begin().
  virtual void end(void* caller_stream) { (void)caller_stream; }
  virtual void drain() {}
  // A device buffer of at least `bytes` on `device`, owned by the engine.
  virtual std::byte* staging(int device, std::uint64_t bytes) {
    (void)device;
    (void)bytes;
    throw Error(Errc::kCudaUnavailable, "staging buffers need the CUDA engine");
  }
  virtual bool is_cuda() const { return false; }
};

std::unique_ptr<ProducerEngine> make_host_producer_engine();
std::unique_ptr<ConsumerEngine> make_host_consumer_engine();
// Throw Errc::kCudaUnavailable when built without CUDA or with no device.
// `device_slots`: the slot pointers the engine is handed are device memory
// (SlotMemory::kDevice): copies are D2D, or H2D / D2H for host tensors.
// Either engine starts on `device` (-1: the current device); a producer's
// with device slots on the slots' GPU.
std::unique_ptr<ProducerEngine> make_cuda_producer_engine(bool device_slots = false, int device = -1);
std::unique_ptr<ConsumerEngine> make_cuda_consumer_engine(bool device_slots = false, int device = -1);

// Page-locks [base, base + bytes) with cudaHostRegister, in calls of at most
// 64 GiB. Returns false (with `why`) when CUDA or a GPU is missing, or when
// registration failed; never leaves a sticky CUDA error behind.
// [read_only_from, bytes), which the caller has mapped read-only (a
// consumer's store banks), is registered with CU_MEMHOSTREGISTER_READ_ONLY
// where the device supports it (read_only true). Where it does not, that
// range is mapped read-write again and pinned as the rest (read_only
// false); when pinning fails it is left read-only.
struct PinInfo {
  bool pinned = false;
  double seconds = 0;
  std::string why;
  bool read_only = false;  // the read-only range stays read-only (and pinned so)
};
PinInfo cuda_pin(void* base, std::uint64_t bytes, std::uint64_t read_only_from = ~0ull);
// Unregisters what cuda_pin registered at `base` (bytes: unused, kept for symmetry).
void cuda_unpin(void* base, std::uint64_t bytes);
bool cuda_present(std::string* why);

}  // namespace shmcast::detail
