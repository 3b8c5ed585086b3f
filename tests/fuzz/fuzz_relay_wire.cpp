// libFuzzer target: the relay's control-message reader and decode_sync()
// (lib/relay/wire.cpp), what a downstream shmcast-relay makes of the bytes
// its upstream sends. Input: one selector byte, then the control message.
//   bit 0: the message ends in a MAC (as every message after the handshake
//          does; the reader must leave those bytes out of the body)
//   bit 1: for a type other than kSync, read the body as strings rather
//          than as 64-bit words
//
// Contract: the reader and decode_sync return or throw wire::ProtocolError,
// promptly, and allocate only what the message can hold. A plan that
// decode_sync accepts is consistent (checked field by field below: every
// tensor inside the stream at shmcast's packing, the chunks it sends and
// their fragments, each with a tag of its own that fits in 32 bits) and
// survives an encode/decode round trip.
#include <algorithm>
#include <span>
#include <vector>

#include "fuzz_support.hpp"
#include "wire.hpp"

using namespace fuzz;
namespace w = shmcast::relay::wire;

namespace {

void check_plan(const w::SyncPlan& p) {
  if (p.version == 0) finding("version 0 accepted");
  if (p.chunk_bytes == 0 || p.chunk_bytes % (2u << 20) || p.chunk_bytes > shmcast::limits::kMaxSlotBytes)
    finding("bad chunk size accepted");
  if (p.frag_bytes < w::kMinFragBytes || p.frag_bytes > w::kMaxFragBytes || (p.frag_bytes & (p.frag_bytes - 1)))
    finding("bad fragment size accepted");
  if (p.offsets.size() != p.specs.size() || p.nbytes.size() != p.specs.size()) finding("plan arrays disagree");
  std::uint64_t payload = 0;
  for (std::size_t i = 0; i < p.specs.size(); ++i) {
    if (p.specs[i].nbytes() != p.nbytes[i]) finding("tensor size disagrees with dtype x shape");
    if (p.nbytes[i] > p.stream_bytes || p.offsets[i] > p.stream_bytes - p.nbytes[i]) finding("tensor past the stream");
    payload += p.nbytes[i];
    if (p.nbytes[i] == 0) continue;
    // Every chunk holding a byte of this tensor is one the source sends.
    for (std::uint64_t c = p.offsets[i] / p.chunk_bytes; c <= (p.offsets[i] + p.nbytes[i] - 1) / p.chunk_bytes; ++c)
      if (!std::binary_search(p.data_chunks.begin(), p.data_chunks.end(), static_cast<std::uint32_t>(c)))
        finding("a chunk holding tensor bytes is not sent");
  }
  if (payload != p.payload_bytes) finding("payload disagrees with the tensors");
  // shmcast's packing of these tensors: chunk c upstream is chunk c here.
  try {
    const shmcast::SyncLayout l = shmcast::stream_layout(p.specs, p.chunk_bytes);
    if (l.offsets != p.offsets || l.stream_bytes != p.stream_bytes) finding("a layout other than shmcast's accepted");
  } catch (const shmcast::Error&) {
    finding("a manifest shmcast cannot pack accepted");
  }
  if (p.frag_base.size() != p.data_chunks.size() + 1 || p.frag_base[0] != 0) finding("fragment ordinals malformed");
  const std::uint64_t per = p.frags_per_chunk();
  for (std::size_t k = 0; k < p.data_chunks.size(); ++k) {
    const std::uint32_t c = p.data_chunks[k];
    if (k > 0 && c <= p.data_chunks[k - 1]) finding("sent chunks not strictly increasing");
    if (static_cast<std::uint64_t>(c) * p.chunk_bytes >= p.stream_bytes) finding("sent chunk past the stream");
    const std::uint32_t f = p.frags(c);
    if (f == 0 || f > per) finding("chunk with no fragment or too many");
    if (p.frag_base[k + 1] - p.frag_base[k] != f) finding("fragment ordinals disagree with the chunks");
    if ((static_cast<std::uint64_t>(c) + 1) * per > (1ull << 32)) finding("fragment tag does not fit in 32 bits");
    std::uint64_t len = 0;
    for (std::uint32_t j = 0; j < f; ++j) {
      const std::uint64_t fl = p.frag_len(c, j);
      if (fl == 0 || fl > p.frag_bytes) finding("fragment length out of range");
      len += fl;
    }
    if (len != p.chunk_len(c)) finding("fragments do not tile their chunk");
  }
}

bool same(const w::SyncPlan& a, const w::SyncPlan& b) {
  if (a.version != b.version || a.chunk_bytes != b.chunk_bytes || a.frag_bytes != b.frag_bytes ||
      a.stream_bytes != b.stream_bytes || a.payload_bytes != b.payload_bytes || a.offsets != b.offsets ||
      a.nbytes != b.nbytes || a.data_chunks != b.data_chunks || a.frag_base != b.frag_base ||
      a.specs.size() != b.specs.size())
    return false;
  for (std::size_t i = 0; i < a.specs.size(); ++i)
    if (a.specs[i].name != b.specs[i].name || a.specs[i].dtype != b.specs[i].dtype ||
        a.specs[i].shape != b.specs[i].shape)
      return false;
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const std::uint8_t sel = data[0];
  const std::span<const std::uint8_t> msg(data + 1, size - 1);
  try {
    w::Reader r(msg, sel & 1);
    if (r.type() != w::Type::kSync) {
      // The generic reads every other message is made of.
      while (!r.done()) {
        if (sel & 2) (void)r.str(shmcast::kMaxNameBytes);
        else (void)r.u64();
      }
      return 0;
    }
    const w::SyncPlan p = w::decode_sync(r);
    check_plan(p);
    w::Writer wr(w::Type::kSync);
    w::encode_sync(wr, p);
    w::Reader again(wr.buffer(), false);
    w::SyncPlan q;
    try {
      q = w::decode_sync(again);
    } catch (const w::ProtocolError&) {
      finding("an accepted plan, encoded again, is refused");
    }
    if (!same(p, q)) finding("an accepted plan does not survive an encode/decode round trip");
  } catch (const w::ProtocolError&) {
  }
  return 0;
}
