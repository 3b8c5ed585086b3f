// api/ (layer 6): quantize-on-send (ProducerOptions::quantize,
// docs/protocol.md §14). begin_sync() turns each tensor the filter selects
// into its FP8 tensor and, right after it in the manifest, its scales
// (quant_specs); write(i) of such a tensor computes its block scales once,
// then quantizes it straight into the slot bytes chunk by chunk
// (write_tensor_in_sync with a quantizing Buffer), then writes the scales.
// A delta producer (and host tensors into device slots) quantizes the
// tensor into a host scratch buffer first: the codec compares the FP8 bytes
// with its base. GPU tensors: the kernels of engine/fp8_cuda.hpp quantize
// straight into the slots on the engine's streams (pinned host slots, device
// slots of the tensor's GPU), or else into one tensor's device staging room,
// which the engine copies into the slots chunk by chunk. The format itself
// is engine/quant.hpp's.
#include <cstdlib>
#include <exception>
#include <optional>
#include <string>
#include <string_view>

#include "api/producer_impl.hpp"
#include "engine/fp8_cuda.hpp"
#include "engine/quant.hpp"
#include "protocol/manifest.hpp"
#include "shmcast/shmcast.hpp"

namespace shmcast {

using namespace detail;

std::string_view quantize_name(Quantize q) noexcept {
  switch (q) {
    case Quantize::kNone: return "none";
    case Quantize::kFp8Block128: return "fp8-block128";
    case Quantize::kFp8Block128Ue8m0: return "fp8-block128-ue8m0";
  }
  return "";
}

bool quantize_from_name(std::string_view name, Quantize* out) noexcept {
  for (Quantize q : {Quantize::kNone, Quantize::kFp8Block128, Quantize::kFp8Block128Ue8m0})
    if (name == quantize_name(q)) {
      *out = q;
      return true;
    }
  return false;
}

bool default_quantize_filter(const TensorSpec& t) {
  if (t.shape.size() != 2 || t.shape[0] < quantize::kBlock || t.shape[1] < quantize::kBlock) return false;
  if (!quant::source_dtype(t.dtype)) return false;
  const std::string_view name = t.name;
  constexpr std::string_view kWeight = "weight";
  if (name != kWeight && !(name.size() > kWeight.size() && name.ends_with(".weight"))) return false;
  // The name's components: none may be an embedding, lm_head, a norm, or
  // the router ("gate" right after "mlp").
  std::string_view prev;
  std::size_t at = 0;
  while (at <= name.size()) {
    const std::size_t dot = name.find('.', at);
    const std::string_view part = name.substr(at, dot == std::string_view::npos ? std::string_view::npos : dot - at);
    if (part.find("embed") != std::string_view::npos || part == "lm_head" ||
        part.find("norm") != std::string_view::npos || (part == "gate" && prev == "mlp"))
      return false;
    prev = part;
    if (dot == std::string_view::npos) break;
    at = dot + 1;
  }
  return true;
}

namespace {

// SHMCAST_FP8_STAGED=1: GPU tensors take the staged path even where the
// kernel could write the slots (bench/ compares the two in one run).
bool fp8_staged() {
  static const bool on = [] {
    const char* v = std::getenv("SHMCAST_FP8_STAGED");
    return v != nullptr && v[0] == '1' && v[1] == 0;
  }();
  return on;
}

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// This rank's rows and columns of a selected (valid, 2-D) tensor.
void local_dims(const TensorSpec& t, std::int64_t* rows, std::int64_t* cols) {
  *rows = t.shape[0];
  *cols = t.shape[1];
  if (t.shard_dim == 0) *rows = t.shard_length;
  if (t.shard_dim == 1) *cols = t.shard_length;
}

// The matrix a write of tensor `t` from `src` (host memory; `l` its layout,
// rows 0: contiguous) reads.
quant::Matrix matrix_of(const TensorSpec& t, const void* src, const Strided2D& l) {
  quant::Matrix m;
  m.base = static_cast<const std::byte*>(src);
  m.dtype = t.dtype;
  local_dims(t, &m.rows, &m.cols);
  const std::uint64_t row_bytes = static_cast<std::uint64_t>(m.cols) * dtype_size(t.dtype);
  m.pitch = row_bytes;
  if (l.rows != 0) {
    if (l.rows != static_cast<std::uint64_t>(m.rows) || l.row_bytes != row_bytes || l.pitch_bytes < l.row_bytes)
      throw Error(Errc::kInvalidArgument, "strided layout of '" + t.name + "', which is quantized: it must have one "
                                          "row per tensor row (rows " + std::to_string(m.rows) + ", row_bytes " +
                                          std::to_string(row_bytes) + ", pitch_bytes >= row_bytes)");
    m.pitch = l.pitch_bytes;
  }
  if (m.rows > 0 && m.cols > 0 && src == nullptr)
    throw Error(Errc::kInvalidArgument, "null source for tensor '" + t.name + "'");
  // The quantizers read whole elements (the GPU kernel with aligned loads:
  // a misaligned one would fault the caller's CUDA context).
  const std::uint64_t es = dtype_size(t.dtype);
  if (m.rows > 0 && m.cols > 0 && (reinterpret_cast<std::uintptr_t>(src) % es != 0 || m.pitch % es != 0))
    throw Error(Errc::kInvalidArgument, "source of '" + t.name + "', which is quantized, is not aligned to its " +
                                            std::to_string(es) + "-byte elements (address " +
                                            std::to_string(reinterpret_cast<std::uintptr_t>(src) % es) +
                                            " past a multiple, pitch_bytes " + std::to_string(m.pitch) +
                                            "): pass an element-aligned source and pitch");
  return m;
}

void scales_of(const TensorSpec& t, const quant::Matrix& m, Quantize q, quant::Scales* out, bool before_sync) {
  const std::string bad = quant::block_scales(m, q, out);
  if (!bad.empty())
    throw Error(Errc::kInvalidArgument,
                "tensor '" + t.name + "' holds " + bad + ", which block FP8 cannot carry: " +
                    (before_sync ? "nothing was sent (consumers keep the last version)"
                                 : "the sync is aborted (consumers get kAborted; a store region keeps the last version)") +
                    "; find where the non-finite value comes from, or leave the tensor out of quantize_filter");
}

}  // namespace

namespace {

// The manifest's tensors for the caller's `tensors`: each selected one as
// its FP8 tensor, then its scales. Records, where asked, which tensors are
// selected and where each caller tensor sits in the manifest. Throws
// kInvalidArgument for a selection that cannot be quantized.
std::vector<TensorSpec> wire_specs(const ProducerOptions& opts, std::span<const TensorSpec> tensors,
                                   std::vector<std::size_t>* at, std::vector<std::uint8_t>* selected) {
  std::vector<TensorSpec> wire;
  wire.reserve(tensors.size());
  if (at != nullptr) at->clear();
  if (selected != nullptr) selected->clear();
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const TensorSpec& t = tensors[i];
    const bool pick = opts.quantize_filter ? opts.quantize_filter(t) : default_quantize_filter(t);
    if (at != nullptr) at->push_back(wire.size());
    if (selected != nullptr) selected->push_back(pick ? 1 : 0);
    if (!pick) {
      wire.push_back(t);
      continue;
    }
    const std::string who = "tensor " + std::to_string(i) + " ('" + t.name + "')";
    if (std::string why = validate_spec(t); !why.empty()) throw Error(Errc::kInvalidArgument, who + ": " + why);
    if (t.shape.size() != 2 || !quant::source_dtype(t.dtype))
      throw Error(Errc::kInvalidArgument,
                  "quantize_filter selected " + who + ", a " + std::string(dtype_name(t.dtype)) + " tensor of shape " +
                      shape_text(t.shape) +
                      ": only 2-D bf16, f16 or f32 tensors can be quantized to block FP8; leave it out of the filter");
    TensorSpec scales;
    scales.name = t.name + std::string(quantize::kScaleSuffix);
    scales.dtype = DType::kF32;
    scales.shape = {quant::blocks(t.shape[0]), quant::blocks(t.shape[1])};
    if (t.shard_dim != -1) {
      // A rank quantizes only its own rows: its shard must hold whole blocks
      // along the shard's dim (the last one may be the tensor's partial edge).
      const std::int64_t dim = t.shape[static_cast<std::size_t>(t.shard_dim)];
      const std::int64_t start = t.shard_start, end = t.shard_start + t.shard_length;
      const std::int64_t cut = start % quantize::kBlock != 0 ? start : (end % quantize::kBlock != 0 && end != dim ? end : -1);
      if (cut >= 0)
        throw Error(Errc::kInvalidArgument,
                    who + " is quantized in 128 x 128 blocks, but this rank's shard holds [" + std::to_string(start) +
                        ", " + std::to_string(end) + ") along dim " + std::to_string(t.shard_dim) +
                        ": the rank boundary at " + std::to_string(cut) + " falls inside the block [" +
                        std::to_string(cut / quantize::kBlock * quantize::kBlock) + ", " +
                        std::to_string(cut / quantize::kBlock * quantize::kBlock + quantize::kBlock) +
                        "), which two ranks would share; shard it on multiples of 128 along that dim, or leave it "
                        "out of quantize_filter");
      scales.shard_dim = t.shard_dim;
      scales.shard_start = start / quantize::kBlock;
      scales.shard_length = quant::blocks(end) - scales.shard_start;
    }
    TensorSpec fp8 = t;
    fp8.dtype = DType::kF8E4M3FN;
    wire.push_back(std::move(fp8));
    wire.push_back(std::move(scales));
  }
  return wire;
}

}  // namespace

std::vector<TensorSpec> Producer::Impl::quant_specs(std::span<const TensorSpec> tensors) {
  return wire_specs(opts, tensors, &quant.at, &quant.selected);
}

std::vector<TensorSpec> Producer::manifest_specs(std::span<const TensorSpec> tensors) const {
  impl_->require_open();
  if (impl_->world > 1)
    throw Error(Errc::kUnsupported, "manifest_specs() of a sharded producer: a round's manifest merges every rank's "
                                    "list (rank 0 orders it), which one rank cannot know; announce the names from "
                                    "the unsharded model's list on a one-rank producer, or not at all");
  if (!impl_->quantizing()) return {tensors.begin(), tensors.end()};
  return wire_specs(impl_->opts, tensors, nullptr, nullptr);
}

// send()'s pass before its sync begins: the selected tensors' scales from
// their sources, so that a NaN or Inf fails the send before anything is
// announced. The writes of the sync that follows use them.
void Producer::Impl::prescale(std::span<const TensorSpec> tensors, std::span<const void* const> srcs) {
  quant.pre_pending = false;
  // Its own selection: the maps of a sync in progress (quant.at/selected)
  // stay that sync's (a send() during it is refused later, by begin_sync).
  std::vector<std::uint8_t> selected;
  (void)wire_specs(opts, tensors, nullptr, &selected);
  quant.pre.assign(tensors.size(), quant::Scales{});
  quant.pre_src.assign(tensors.size(), nullptr);
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (!selected[i] || srcs[i] == nullptr) continue;  // a null source: its write() refuses it
    const quant::Matrix m = matrix_of(tensors[i], srcs[i], Strided2D{});
    scales_of(tensors[i], m, opts.quantize, &quant.pre[i], true);
    quant.pre_src[i] = srcs[i];
  }
  quant.pre_pending = true;
}

// prepare_device(): the selected GPU tensors' scales before the sync begins,
// in one pass with one wait (a NaN or Inf fails it with nothing announced);
// their multipliers stay on the device for the sync's writes.
void Producer::Impl::prescale_device(std::span<const TensorSpec> tensors, std::span<const void* const> srcs,
                                     void* stream) {
  quant.dpre_pending = false;
  if (!engine->is_cuda())
    throw Error(Errc::kInvalidArgument, "prepare_device() on a producer with the host copy engine: create it with "
                                        "engine = CopyEngine::kCuda (or kAuto on a machine with a GPU)");
  std::vector<std::uint8_t> selected;
  (void)wire_specs(opts, tensors, nullptr, &selected);
  std::vector<quant::Matrix>& ms = quant.dpre_m;
  ms.assign(tensors.size(), quant::Matrix{});
  std::vector<const quant::Matrix*> pick(tensors.size(), nullptr);
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (!selected[i] || srcs[i] == nullptr) continue;
    ms[i] = matrix_of(tensors[i], srcs[i], Strided2D{});
    pick[i] = &ms[i];
  }
  if (!quant.gpu) quant.gpu = std::make_unique<quant::CudaQuantizer>();
  try {
    engine->drain();  // the last sync's kernels read the multipliers' rooms until they have run
  } catch (const Error&) {  // that sync reported its copy error already
  }
  quant.gpu->reset();
  std::size_t bad = 0;
  const std::string why = quant.gpu->scales_batch(pick, opts.quantize, stream, &quant.dpre, &bad);
  if (!why.empty())
    throw Error(Errc::kInvalidArgument,
                "tensor '" + tensors[bad].name + "' holds " + why +
                    ", which block FP8 cannot carry: nothing was sent (consumers keep the last version); find where the "
                    "non-finite value comes from, or leave the tensor out of quantize_filter");
  quant.dpre_pending = true;
}

// write(i) and its kin, of the caller's tensor i.
void Producer::Impl::write_user(std::size_t index, const Buffer& src, void* stream, std::uint64_t from,
                                std::uint64_t len) {
  if (quantizing() && in_sync && index >= quant.at.size()) {
    // Not a manifest index either (the manifest holds the scales too).
    const std::string why = "tensor index " + std::to_string(index) + " is out of range: this sync has " +
                            std::to_string(quant.at.size()) + " tensors";
    abort(why, Errc::kInvalidArgument);
    throw Error(Errc::kInvalidArgument, why);
  }
  if (!quantizing() || !in_sync || !quant.selected[index]) {
    write_tensor(quantizing() && in_sync ? quant.at[index] : index, src, stream, from, len);
    return;
  }
  try {
    write_quantized(index, src, stream, from, len);
  } catch (const Error&) {
    throw;  // aborted where it was thrown
  } catch (const std::exception& e) {
    abort(e.what());  // an allocation that failed, say: the sync never stays open (a no-op if it was aborted)
    throw;
  }
}

void Producer::Impl::write_quantized(std::size_t index, const Buffer& src, void* stream, std::uint64_t from,
                                     std::uint64_t len) {
  const TensorSpec& t = quant.user[index];
  quant::Matrix m;
  const quant::Scales* scales = &quant.cur;
  std::uint64_t pre_mult = 0;  // prepare_device()'s multipliers of this tensor (device), if any
  try {
    require_open();
    if (quant.at[index] != next_tensor)
      throw Error(Errc::kInvalidArgument, "tensors must be written in order: '" + t.name + "' (index " +
                                              std::to_string(index) + ") is not the next one");
    if (from != 0 || len != kWhole)
      throw Error(Errc::kInvalidArgument, "write_part() of '" + t.name + "', which is quantized: its block scales "
                                          "need every element, so write() it whole");
    if (src.device && !engine->is_cuda())
      throw Error(Errc::kInvalidArgument, "write_device() on a producer with the host copy engine: create it with "
                                          "engine = CopyEngine::kCuda (or kAuto on a machine with a GPU), or copy "
                                          "the tensor to host memory and write() it");
    if (src.device && opts.delta)
      throw Error(Errc::kUnsupported, "write_device() of '" + t.name + "', which is quantized, on a delta producer: "
                                      "quantized GPU tensors are not diffed on the GPU yet; write() it from host "
                                      "memory, or turn delta off");
    m = matrix_of(t, src.ptr, src.layout);
    // prepare_device()'s scales, where they are of this source and shape
    // (a sync of other tensors than those prepared computes its own).
    if (src.device && quant.use_dpre && index < quant.dpre_m.size() && src.ptr != nullptr &&
        quant.dpre_m[index].base == m.base && quant.dpre_m[index].dtype == m.dtype &&
        quant.dpre_m[index].rows == m.rows && quant.dpre_m[index].cols == m.cols &&
        quant.dpre_m[index].pitch == m.pitch) {
      scales = &quant.dpre.host[index];  // prepare_device()'s: the multipliers are on the device
      pre_mult = quant.dpre.mult[index];
    } else if (src.device) {
      if (!quant.gpu) quant.gpu = std::make_unique<quant::CudaQuantizer>();
      const std::string bad = quant.gpu->scales(m, opts.quantize, stream, &quant.cur);
      if (!bad.empty())
        throw Error(Errc::kInvalidArgument,
                    "tensor '" + t.name + "' holds " + bad +
                        ", which block FP8 cannot carry: the sync is aborted (consumers get kAborted; a store region "
                        "keeps the last version); find where the non-finite value comes from, or leave the tensor "
                        "out of quantize_filter");
    } else if (quant.use_pre && index < quant.pre_src.size() && quant.pre_src[index] == src.ptr && src.layout.rows == 0 &&
        src.ptr != nullptr)
      scales = &quant.pre[index];
    else
      scales_of(t, m, opts.quantize, &quant.cur, false);
  } catch (const Error& e) {
    abort(e.what(), e.code());
    throw;
  }
  const std::uint64_t elems = static_cast<std::uint64_t>(m.rows) * static_cast<std::uint64_t>(m.cols);
  bool direct = false;
  if (src.device) {
    try {
      engine->begin(stream);  // can_fill() answers for the caller's GPU
      direct = engine->can_fill(pin.pinned) && !fp8_staged();
    } catch (const Error& e) {
      abort(e.what(), e.code());
      throw;
    }
  }
  if (direct) {
    // The kernel quantizes the tensor chunk by chunk as the engine would
    // copy it, on the engine's streams after the caller's stream's work:
    // into device slots, or into staging pieces the engine copies into the
    // pinned host slots (cuda_fill.hpp). No FP8 copy of the whole tensor
    // exists; the next tensor's scales are made while these kernels run
    // (their multipliers stay on the device until the next sync,
    // CudaQuantizer::reset()).
    std::optional<quant::CudaQuantizer::Fill> fill;
    try {
      if (pre_mult != 0)
        fill.emplace(*quant.gpu, m, pre_mult, scales->bcols);
      else
        fill.emplace(*quant.gpu, m);
    } catch (const Error& e) {
      abort(e.what(), e.code());
      throw;
    }
    Buffer b{const_cast<std::byte*>(m.base), true, {}};
    b.fill = &*fill;
    write_tensor(quant.at[index], b, stream);
  } else if (src.device) {
    // Slots the GPU cannot write (host slots not pinned; device slots of
    // another GPU than the tensor's): the kernel quantizes the tensor into
    // one tensor's device staging room, ordered on the caller's stream;
    // the engine copies it into the slots chunk by chunk after that work
    // (write_device's path), and is drained before the next tensor reuses
    // the room.
    std::byte* staged = nullptr;
    try {
      staged = quant.gpu->staging(elems);
      if (pre_mult != 0)
        quant::CudaQuantizer::Fill(*quant.gpu, m, pre_mult, scales->bcols).launch(staged, 0, elems, stream);
      else
        quant.gpu->quantize(m, staged, 0, elems, stream);
    } catch (const Error& e) {
      abort(e.what(), e.code());
      throw;
    }
    write_tensor(quant.at[index], Buffer{staged, true, {}}, stream);
    try {
      engine->drain();
    } catch (const Error& e) {
      abort(e.what(), e.code());
      throw;
    }
  } else if (opts.delta || view.geo().device_slots) {
    // The codec diffs bytes against its base (device slots: the engine
    // copies host bytes H2D): give it the FP8 bytes of this tensor.
    quant.scratch.resize(elems);
    quant::quantize_elems(quant.scratch.data(), m, *scales, 0, elems);
    write_tensor(quant.at[index], Buffer{quant.scratch.data(), false, {}}, nullptr);
  } else {
    Buffer q{const_cast<std::byte*>(m.base), false, {}};
    q.qm = &m;
    q.qs = scales;
    write_tensor(quant.at[index], q, nullptr);
  }
  write_tensor(quant.at[index] + 1, Buffer{const_cast<float*>(scales->scale_inv.data()), false, {}}, nullptr);
}

}  // namespace shmcast
