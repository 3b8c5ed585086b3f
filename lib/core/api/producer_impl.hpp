// api/ (layer 6), private to the producer: Producer::Impl, the state behind
// the public Producer, for its four modes: a ring region of one rank (the
// default), a store region (RegionMode::kStore, two banks), a sharded ring
// (world_size > 1, the ranks agree on each sync in rounds) and a sync whose
// chunks are lent to the caller (lend_chunk(), or fill_spans() for a store).
// Its methods run on the caller's thread, one call at a time (the bytes of
// lent spans and slots may be filled from any thread); the engine's
// completion threads only run the publish callbacks ChunkWriter hands them.
//
// Its methods live in one file per concern:
//   producer.cpp         the public Producer methods, thin: checks of open
//                        state, then a call into Impl; getters
//   producer_create.cpp  create (options checks, rank 0 creates, ranks 1..
//                        attach), taking over a stale region, close
//   producer_write.cpp   a sync of every mode: begin_sync's checks and the
//                        ring's begin, write() (the ring write path),
//                        end_sync, abort
//   producer_ranks.cpp   sharded producers: the rounds, rank 0's gather and
//                        merge, the other ranks' join, end_sync's waits
//   producer_store.cpp   store regions (begin, fill_spans) and lent chunks
//                        (lend_chunk, publish_chunks)
//   producer_delta.cpp   delta syncs (ProducerOptions::delta): the base,
//                        keyframes, staged encoding, full-sync requests
//   producer_quant.cpp   quantize-on-send (ProducerOptions::quantize): the
//                        FP8 tensors and their scales in the manifest, each
//                        write quantized into the slots
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "base/checks.hpp"
#include "base/layout.hpp"
#include "base/name_set.hpp"
#include "engine/cuda_vmm.hpp"
#include "engine/delta_cuda.hpp"
#include "engine/engine.hpp"
#include "engine/fp8_cuda.hpp"
#include "engine/quant.hpp"
#include "protocol/delta.hpp"
#include "protocol/fd_channel.hpp"
#include "protocol/ring.hpp"
#include "protocol/rounds.hpp"
#include "shmcast/shmcast.hpp"

namespace shmcast {

// Tensors whose elements are words of 1, 2, 4 or 8 bytes are sent as
// deltas; others (c128: 16-byte elements, whose slices a word map cannot
// address) as their bytes (producer_delta.cpp, producer_delta_ranks.cpp).
inline bool delta_encodes(DType dtype) { return detail::delta::elem_width(dtype) == dtype_size(dtype); }

namespace detail {
// Delta syncs: the same tensor set (names, dtypes, shapes, shards, in order).
bool same_tensor_set(const std::vector<TensorSpec>& a, const std::vector<TensorSpec>& b);
// The names of a tensor set, and whether another set has a tensor of one of
// them (the tensors were regrouped: the other set's state is stale).
class TensorNames {
 public:
  explicit TensorNames(const std::vector<TensorSpec>& set) {
    for (const TensorSpec& t : set) names_.insert(t.name);
  }
  bool shared_by(const std::vector<TensorSpec>& other) const {
    return std::any_of(other.begin(), other.end(), [&](const TensorSpec& t) { return names_.count(t.name) != 0; });
  }

 private:
  std::unordered_set<std::string_view> names_;  // views of the set's names: the set outlives this
};
}  // namespace detail

// Hidden: a member of the exported class Producer would be exported with it
// from a shared libshmcast (lib/shmcast.map), and Impl is no public API.
struct __attribute__((visibility("hidden"))) Producer::Impl {
  // ---- the region, every mode (set by create(), fixed until close)
  std::string name, path;
  ProducerOptions opts;
  detail::RegionView view;
  std::optional<detail::ProducerRing> ring;
  std::unique_ptr<detail::ProducerEngine> engine;
  detail::PinInfo pin;
  // What `pin` registers: the slot data, from data_offset to the end.
  void* pinned_base() const { return view.file().data() + view.geo().data_offset; }
  double create_s = 0;
  bool checksums = false;
  // Device slots (SlotMemory::kDevice): the slots' GPU memory, and the
  // server that hands it to consumers (stopped, then released, at close).
  detail::vmm::Mapping slot_mem;
  detail::FdServer slot_server;

  // ---- the sync in progress, every mode
  bool in_sync = false;
  std::uint64_t version = 0;         // of the sync in progress or the last one
  std::uint64_t last_completed = 0;  // last sync that was not aborted
  std::uint64_t next_seq = 1;
  std::uint64_t first_seq = 0;    // of the sync in progress
  std::uint64_t rank_chunks = 0;  // chunks per rank of the sync in progress
  std::vector<TensorSpec> specs;
  detail::NameSet dup_names;  // begin_sync()'s duplicate-name check, its table kept
  std::vector<std::uint64_t> offsets;
  std::uint64_t stream_bytes = 0, payload_bytes = 0;  // this rank's
  std::uint64_t sync_payload = 0;  // the whole sync's (rank 0)
  std::size_t next_tensor = 0;
  std::uint64_t part_done = 0;
  detail::ChunkWriter writer;  // the sync's chunks
  SyncLayout layout;   // of the sync in progress or the last one begun
  std::int64_t sync_start_ns = 0;

  // ---- sharded producers (world > 1): rank 0 leads each round, the others join it
  std::uint32_t rank = 0, world = 1;
  std::uint64_t round = 0;   // the last round this rank took (its id is that sync's version)
  bool abandon_won = false;  // sharded: this rank decided the sync's fate (abandoned); abort() writes the reason
  std::uint64_t dropped = 0;  // ranks 1..: the round it dropped last, whose reason its list area may still hold
  bool leader() const { return rank == 0; }

  // ---- store regions
  detail::RecordSnapshot store_rec{};  // store regions: the record end_sync() announces
  bool lent = false;                   // store regions: fill_spans() lent the bank to the caller

  // ---- lent chunks (ring regions of one rank)
  bool lent_chunks = false;  // ring regions: lend_chunk() lent slots to the caller

  // ---- delta syncs (ProducerOptions::delta; producer_delta.cpp)
  struct DeltaState {
    // One tensor's base: on the host, or (a tensor written from a GPU,
    // contiguous, at the last full sync) on its device.
    struct Base {
      std::unique_ptr<std::byte[]> host;
      void* dev = nullptr;  // the codec's allocation
      std::uint64_t bytes = 0;
    };
    // A staged tensor from a GPU: encoded by end_sync() (sources stay valid until it returns).
    struct Pending {
      const void* src = nullptr;
      void* stream = nullptr;
      std::uint64_t head_at = 0, out_at = 0, blob = 0;
    };
    std::vector<TensorSpec> specs;  // the tensors the base holds
    std::vector<Base> base;
    std::uint64_t base_bytes = 0;
    std::unique_ptr<detail::delta::CudaCodec> codec;  // device bases (made on first use)
    std::vector<Pending> pending;                     // per tensor; src null: not from a GPU
    std::byte* heads = nullptr;                       // plan_pending(): the planned heads (device)
    std::byte* out = nullptr;                         // the blobs' device buffer (blobs_at(), mirror_blobs())
    std::uint64_t out_bytes = 0;                      // plan_pending(): the blobs' room, packed (out_at)
    void* mirror_stream = nullptr;                    // mirror_blobs(): the stream every GPU tensor came on
    std::vector<bool> raw_from_base;                  // per tensor: sent as its bytes from its device base
    bool force_full = false;                          // a base changed outside the codec this sync
    int codec_ok = -1;                                // codec_usable(): -1 not asked yet
    bool valid = false;              // the base holds version base_version, as the consumers got it
    std::uint64_t base_version = 0;
    std::uint64_t last_full = 0;     // version of the last full sync (0: none)
    std::uint64_t deltas_since_full = 0;
    // Other tensor sets' bases (an update sent as several syncs of different
    // tensors, buckets; one rank only): parked while other tensors are sent,
    // taken back when the same tensors come again (switch_group()). Least
    // recently sent first; with the current set at most kMaxDeltaGroups.
    struct Group {
      std::vector<TensorSpec> specs;
      std::vector<Base> base;
      std::uint64_t base_bytes = 0;
      bool valid = false;
      std::uint64_t base_version = 0, last_full = 0, deltas_since_full = 0;
    };
    std::vector<Group> parked;
    std::uint64_t parked_bytes = 0;
    // the sync in progress
    bool staged = false;             // encoding into blobs; announced by end_sync()
    bool full = false;               // a keyframe (or a staged sync that fell back)
    std::uint64_t want = 0;          // begin_sync's version (staged)
    std::vector<std::vector<std::byte>> blobs;
    std::vector<std::byte> scratch;  // a tensor gathered from parts, strides or the device
    std::uint64_t wire = 0, logical = 0;
    // Sharded (world > 1): what this rank listed for the round, and the
    // round's kind as rank 0 agreed it (every rank's sync of a round is
    // full, or every one a delta against the same base).
    enum class Posted { kFull, kDelta, kNeutral };  // kNeutral: no piece a delta can carry (the same either way)
    Posted posted = Posted::kFull;
    bool round_full = true;
  } delta;
  // A delta sync's stream: each tensor's blob size (write_tensor_in_sync
  // writes that many bytes); empty: the tensors' own sizes.
  std::vector<std::uint64_t> wire_sizes;
  SyncReport report;  // the last completed sync
  // Quantize-on-send (ProducerOptions::quantize; producer_quant.cpp): the
  // sync's manifest (specs) holds, for each tensor the filter selects, its
  // FP8 tensor and right after it its scales; the caller writes its own list.
  struct QuantState {
    std::vector<TensorSpec> wire;          // the specs begin_sync() packs
    std::vector<std::size_t> at;           // per caller tensor: its index in the manifest
    std::vector<std::uint8_t> selected;    // per caller tensor: quantized
    std::vector<TensorSpec> user;          // the caller's tensors of the sync in progress
    std::uint64_t logical = 0;             // their bytes (this rank's)
    // send()'s pass before the sync begins: each selected tensor's scales
    // from its source (a NaN or Inf fails the send with nothing announced).
    std::vector<detail::quant::Scales> pre;
    std::vector<const void*> pre_src;
    bool pre_pending = false, use_pre = false;
    detail::quant::Scales cur;
    // prepare_device()'s scales of GPU sources, for the next sync only.
    detail::quant::DeviceScales dpre;
    std::vector<detail::quant::Matrix> dpre_m;  // what each was computed from (base null: none)
    bool dpre_pending = false, use_dpre = false;
    std::vector<std::byte> scratch;        // delta producers, device slots: one tensor's FP8 bytes
    std::unique_ptr<detail::quant::CudaQuantizer> gpu;  // GPU tensors (made on first use)
  } quant;
  // Forwarded syncs (begin_forwarded, a relay's delta region; producer_forward.cpp)
  struct Forward {
    bool requested = false;  // begin_forwarded() is calling begin_sync()
    bool active = false;     // the sync in progress is forwarded
    std::uint64_t base = 0;  // its base version (0: full)
    std::vector<std::uint64_t> wire;
    std::vector<std::uint8_t> is_delta;
    // Per tensor set forwarded (buckets), the version of its last full
    // sync: a seat's request is answered once every set had one after it
    // (delta.last_full is the oldest). Sets sharing a tensor with a newer
    // one are dropped (regrouped); at most kMaxDeltaGroups, least recent first.
    struct SetFull {
      std::vector<TensorSpec> specs;
      std::uint64_t last_full = 0, used = 0;
    };
    std::vector<SetFull> sets;
    std::uint64_t tick = 0;
  } fwd;

  ~Impl() { close_quietly(); }

  void require_open() const {
    if (view.file().inherited()) detail::throw_inherited("Producer", view.file());
    if (!view.mapped()) throw Error(Errc::kClosed, "this producer is closed");
  }

  // ---- producer_create.cpp: closing
  void leave_rank() noexcept;
  void close_quietly() noexcept;

  // ---- producer_write.cpp: a sync of every mode, the ring's write path
  std::uint64_t begin_sync(std::span<const TensorSpec> tensors, std::uint64_t want);
  // `pieces`: a delta sync's (one rank's blobs); empty: the specs' own.
  std::uint64_t begin_ring(std::uint64_t want, std::span<const detail::ManifestPiece> pieces = {});
  void complete_below(std::uint64_t pos);
  static constexpr std::uint64_t kWhole = ~0ull;  // write_tensor's len: the whole tensor
  void write_tensor(std::size_t index, const detail::Buffer& src, void* stream, std::uint64_t from = 0,
                    std::uint64_t len = kWhole);
  void write_tensor_in_sync(std::size_t index, const detail::Buffer& src, void* stream, std::uint64_t from,
                            std::uint64_t len);
  void end_sync();
  void set_error_text(Errc code, const std::string& text);
  void abort(std::string_view why, Errc code = Errc::kAborted);

  // ---- producer_delta.cpp: delta syncs
  bool seat_wants_full(std::uint64_t* after = nullptr) const;
  std::uint64_t begin_delta(std::uint64_t want);
  const std::byte* delta_source(const detail::Buffer& src, std::uint64_t from, std::uint64_t len,
                                std::byte* into);
  void write_keyframe(std::size_t index, const detail::Buffer& src, void* stream, std::uint64_t from,
                      std::uint64_t len);
  void write_staged(std::size_t index, const detail::Buffer& src, void* stream, std::uint64_t from,
                    std::uint64_t len);
  void end_staged();
  void stage(std::uint64_t want);
  std::uint64_t pack_blobs();
  bool plan_pending();
  bool encode_pending(std::vector<detail::Buffer>* sources);
  detail::Buffer encode_one(std::size_t i);
  bool mirror_blobs();
  void write_mirrored();
  void write_stream_range(const std::byte* dev, std::uint64_t from, std::uint64_t to, void* stream);
  void check_encodes();
  void delta_done();
  std::string keyframe_reason();
  void switch_group();
  std::uint64_t begin_delta_sharded(std::uint64_t n, std::uint64_t used);
  void end_staged_sharded();
  std::string adopt_round_kind(std::uint64_t base);
  std::uint64_t round_kind(std::vector<SyncInfo>* posts);
  detail::delta::CudaCodec& codec();
  bool codec_usable(void* stream);
  void base_on_host(std::size_t i);
  void base_on_device(std::size_t i, void* stream);

  // ---- producer_quant.cpp: quantize-on-send
  bool quantizing() const { return opts.quantize != Quantize::kNone; }
  std::vector<TensorSpec> quant_specs(std::span<const TensorSpec> tensors);
  void prescale(std::span<const TensorSpec> tensors, std::span<const void* const> srcs);
  void prescale_device(std::span<const TensorSpec> tensors, std::span<const void* const> srcs, void* stream);
  void write_user(std::size_t index, const detail::Buffer& src, void* stream, std::uint64_t from = 0,
                  std::uint64_t len = kWhole);
  // write_user's quantizing part (its caller aborts the sync on any exception).
  void write_quantized(std::size_t index, const detail::Buffer& src, void* stream, std::uint64_t from,
                       std::uint64_t len);

  // ---- producer_forward.cpp: forwarded syncs (a relay's delta region)
  std::uint64_t begin_forward(std::uint64_t want);
  void forward_done();

  // ---- producer_ranks.cpp: sharded producers, rounds (rounds.hpp, docs/protocol.md §9)
  detail::rounds::Words words() const;
  // Tests: a pause point (rounds.hpp, TestPoint); nothing in a real process.
  void hit(detail::TestPoint at, std::uint64_t n, void* answer = nullptr);
  std::string abandon_reason(std::uint64_t n);
  void fail_round(std::uint64_t n, Errc code, const std::string& why);
  void drop_round(std::uint64_t n, Errc code, const std::string& what) noexcept;
  void settle_dropped() noexcept;
  std::vector<SyncInfo> gather(std::uint64_t n, std::uint64_t used0);
  detail::rounds::Answer join_round(std::uint64_t n, std::uint64_t used);
  std::uint64_t lead_round(std::uint64_t n, std::uint64_t used);
  std::uint64_t begin_sharded(std::uint64_t n, std::uint64_t used);
  void end_sharded();
  void await_ranks();
  void await_done();
  void skip_sync(std::string_view why, std::uint64_t want);

  // ---- producer_store.cpp: store regions and lent chunks
  std::uint64_t begin_store(std::uint64_t want);
  std::vector<std::span<std::byte>> fill_spans();
  std::span<std::byte> lend_chunk(std::uint64_t c);
  void publish_chunks(std::uint64_t end);
};

}  // namespace shmcast
