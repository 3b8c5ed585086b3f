// api/ (layer 6): forwarded syncs of a delta producer (begin_forwarded):
// a relay's node region passes on the syncs of its upstream's delta
// region as they are. A full sync is written as any other; a delta sync's
// pieces are the upstream's blobs, announced with the upstream's base
// version and sizes before a byte is written (unlike the producer's own
// delta syncs, which are encoded first, producer_delta.cpp). No base is
// kept: nothing is encoded here, so nothing needs one. The consumers that
// apply the blobs validate them (docs/protocol.md §12); here only their
// sizes are checked, as the manifest's decoder will check them.
#include <algorithm>
#include <cstring>
#include <string>

#include "api/producer_impl.hpp"
#include "protocol/delta.hpp"
#include "protocol/manifest.hpp"
#include "protocol/ring.hpp"
#include "shmcast/shmcast.hpp"

namespace shmcast {

using namespace detail;

std::uint64_t Producer::begin_forwarded(std::span<const TensorSpec> tensors, std::uint64_t version,
                                        std::uint64_t base_version, std::span<const std::uint64_t> wire_bytes,
                                        std::span<const std::uint8_t> is_delta) {
  Impl& m = *impl_;
  m.require_open();
  if (m.quantizing())
    throw Error(Errc::kInvalidArgument, "begin_forwarded() on a quantizing producer: a relay passes its upstream's "
                                        "bytes on as they are; create it without quantize");
  if (!m.opts.delta)
    throw Error(Errc::kInvalidArgument, "begin_forwarded() passes on delta syncs: create the producer with delta");
  if (base_version != 0) {
    if (version == 0 || base_version >= version)
      throw Error(Errc::kInvalidArgument, "a forwarded delta sync's base version " + std::to_string(base_version) +
                                              " is not below its version " + std::to_string(version));
    if (wire_bytes.size() != tensors.size() || is_delta.size() != tensors.size())
      throw Error(Errc::kInvalidArgument, "a forwarded delta sync needs one wire size and one delta flag per tensor");
  }
  m.fwd.base = base_version;
  m.fwd.wire.assign(wire_bytes.begin(), wire_bytes.end());
  m.fwd.is_delta.assign(is_delta.begin(), is_delta.end());
  m.fwd.requested = true;
  struct Reset {
    Impl& m;
    ~Reset() { m.fwd.requested = false; }
  } reset{m};
  return m.begin_sync(tensors, version);
}

bool Producer::full_sync_requested(std::uint64_t* after) const {
  impl_->require_open();
  if (after != nullptr) *after = 0;
  return impl_->opts.delta && impl_->seat_wants_full(after);
}

// begin_sync() of a forwarded sync (specs, offsets and payload_bytes are
// the tensors' own, packed by begin_sync).
std::uint64_t Producer::Impl::begin_forward(std::uint64_t want) {
  DeltaState& d = delta;
  d.valid = false;  // no base: a later begin_sync() is full
  d.staged = false;
  d.full = fwd.base == 0;
  d.logical = payload_bytes;
  d.wire = payload_bytes;
  if (fwd.base == 0) {
    wire_sizes.clear();
    return begin_ring(want);
  }
  const std::uint64_t v = want != 0 ? want : version + 1;
  if (fwd.base >= v)
    throw Error(Errc::kInvalidArgument, "a forwarded delta sync's base version is not below its version");
  // The blobs as the stream's pieces, packed as raw tensors of their sizes
  // (as the upstream's producer packed them: end_staged()).
  std::vector<TensorSpec> packed(specs.size());
  std::vector<std::uint64_t> sizes(specs.size());
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const TensorSpec& t = specs[i];
    const std::uint64_t n = t.local_nbytes(), w = fwd.wire[i];
    if (fwd.is_delta[i] != 0) {
      if (delta::elem_width(t.dtype) != dtype_size(t.dtype) || !delta::piece_fits(t.dtype, n, w))
        throw Error(Errc::kInvalidArgument, "forwarded delta piece of '" + t.name + "' (" + std::to_string(w) +
                                                " bytes) cannot be a blob of its " + std::to_string(n) + " bytes");
    } else if (w != n) {
      throw Error(Errc::kInvalidArgument, "forwarded piece of '" + t.name + "' is " + std::to_string(w) +
                                              " bytes, not its size " + std::to_string(n));
    }
    sizes[i] = w;
    packed[i].dtype = DType::kRaw;
    packed[i].shape = {static_cast<std::int64_t>(w)};
  }
  std::uint64_t wire = 0;
  std::vector<std::uint64_t> offs;
  const std::uint64_t stream = pack(packed, view.geo().slot_bytes, &offs, &wire);
  if (stream > limits::kMaxStreamBytes)
    throw Error(Errc::kInvalidArgument, "the forwarded sync's stream exceeds 64 TiB");
  std::vector<ManifestPiece> pieces(specs.size());
  for (std::size_t i = 0; i < specs.size(); ++i) {
    ManifestPiece& p = pieces[i];
    std::memset(&p, 0, sizeof p);
    p.tensor = static_cast<std::uint32_t>(i);
    p.dim = kWholePiece;
    p.offset = offs[i];
    p.nbytes = sizes[i];
    p.base_version = fwd.is_delta[i] != 0 ? fwd.base : 0;
  }
  wire_sizes = std::move(sizes);
  offsets = std::move(offs);
  stream_bytes = stream;
  d.wire = wire;
  const std::uint64_t logical = payload_bytes;
  payload_bytes = wire;
  const std::uint64_t got = begin_ring(want, pieces);
  layout.payload_bytes = logical;
  return got;
}

// end_sync() of a forwarded sync.
void Producer::Impl::forward_done() {
  DeltaState& d = delta;
  report = SyncReport{version, fwd.base != 0, d.logical, d.wire};
  // This set's last full sync; other sets sharing a tensor with it go.
  const TensorNames names(specs);
  auto& sets = fwd.sets;
  sets.erase(std::remove_if(sets.begin(), sets.end(),
                            [&](const Forward::SetFull& s) {
                              return !same_tensor_set(s.specs, specs) && names.shared_by(s.specs);
                            }),
             sets.end());
  auto found = std::find_if(sets.begin(), sets.end(), [&](const auto& s) { return same_tensor_set(s.specs, specs); });
  Forward::SetFull* mine = found == sets.end() ? nullptr : &*found;
  if (mine == nullptr) {
    if (sets.size() >= limits::kMaxDeltaGroups)
      sets.erase(std::min_element(sets.begin(), sets.end(), [](const auto& a, const auto& b) { return a.used < b.used; }));
    sets.push_back(Forward::SetFull{specs, 0, 0});
    mine = &sets.back();
  }
  mine->used = ++fwd.tick;
  if (fwd.base == 0) mine->last_full = version;
  d.last_full = mine->last_full;
  for (const auto& s : sets) d.last_full = std::min(d.last_full, s.last_full);
  d.valid = false;
  wire_sizes.clear();
  fwd.active = false;
}

}  // namespace shmcast
