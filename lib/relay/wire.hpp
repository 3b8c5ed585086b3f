// The relay's wire format (docs/relay.md, "Wire protocol"): control
// messages travel framed on each connection's own TCP socket (CtrlSocket),
// so each is bound to the connection it arrives on; chunk bytes are UCX
// tagged messages, received straight into their buffers.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shmcast/shmcast.hpp"

namespace shmcast::relay::wire {

// 3: control messages on the relay's own TCP connection; the chunk bytes on
// a UCX connection to a listener the upstream opens for that connection.
// 4: delta syncs (a sync message's base version and delta pieces) and the
// downstream's full-sync request (kWantFull).
// 5: one long-lived data listener per relay; each data connection proves
// the session key (auth::data_proof, a UCP stream message) before a chunk
// is sent on it.
inline constexpr std::uint32_t kProto = 5;
inline constexpr std::uint32_t kMagic = 0x594c5253;  // "SRLY"

// Chunk bytes are tagged messages (received straight into their buffers).
// A fragment's tag: bit 63 set | the connection's sync serial (31 bits) |
// the fragment tag (SyncPlan::frag_tag, 32 bits). Tags without bit 63 are
// never data: a relay drains them as junk.
inline constexpr std::uint64_t kDataBit = 1ull << 63;
inline constexpr std::uint64_t kFullMask = ~0ull;
inline constexpr std::uint32_t kSerialMask = 0x7fffffff;
inline constexpr std::uint64_t data_tag(std::uint32_t serial, std::uint32_t frag) {
  return kDataBit | (static_cast<std::uint64_t>(serial & kSerialMask) << 32) | frag;
}
// The serial of the n-th sync (n = 1, 2, ...) on a connection whose session
// gives `base` (auth::data_tag_base): both sides count the syncs of their
// connection, so consecutive syncs never share a tag, whatever their versions.
inline constexpr std::uint32_t data_serial(std::uint32_t base, std::uint64_t n) {
  return static_cast<std::uint32_t>((base + n) & kSerialMask);
}
// Limits on what a peer announces (docs/relay.md, "Limits").
// A handshake message (challenge, response, welcome, refused) is small.
inline constexpr std::uint64_t kHandshakeBytes = 4096;
// Largest control message a relay takes from its upstream: a sync message
// holds a manifest, which the node's region must store (its manifest area,
// ProducerOptions::manifest_bytes, at most limits::kMaxManifestBytes; the
// relay's encoding takes fewer bytes per tensor than the region's), plus
// its fixed fields and MAC.
inline constexpr std::uint64_t kControlSlack = 64ull << 10;
inline constexpr std::uint64_t kMaxControlBytes = limits::kMaxManifestBytes + kControlSlack;
std::uint64_t control_cap(std::uint64_t region_manifest_bytes);
// Largest chunk (the source's slot size) a relay accepts from its upstream.
inline constexpr std::uint64_t kMaxChunkBytes = 1ull << 30;
// What a node has room for: `buffers` receive buffers of one chunk (0 with
// direct receive), `region_slots` slots of one chunk in its region (0 when
// --slot-bytes fixes the region's slot size), against its memory and the
// size of the region directory's file system (0: unknown).
struct ChunkRoom {
  std::uint64_t buffers = 0, region_slots = 0, memory_bytes = 0, fs_bytes = 0;
};
// "" when chunks of `chunk_bytes` fit, else why not.
std::string chunk_problem(std::uint64_t chunk_bytes, const ChunkRoom& room);

enum class Type : std::uint16_t {
  kChallenge = 1,  // up -> down: proto, connection id (64 bits), server nonce, region
  kResponse,       // down -> up: client nonce, client proof, region
  kWelcome,        // up -> down: server proof, chunk size (0: not known yet), flags, data address (HOST:PORT)
  kRefused,        // up -> down: why (then the connection is closed); not authenticated
  kSync,           // up -> down: a sync begins: version, chunk size, stream, manifest
  kChunk,          // up -> down: chunk index, length, XXH3 (after its bytes were sent)
  kEnd,            // up -> down: the sync is complete
  kAbort,          // up -> down: the sync is abandoned after `sent` fragments; why
  kWantFull,       // down -> up: make the source producer's next sync full (after version, flags)
};
const char* type_name(Type t);

inline constexpr std::size_t kNonceBytes = 32;
inline constexpr std::size_t kMacBytes = 32;
using Nonce = std::array<std::uint8_t, kNonceBytes>;
using Mac = std::array<std::uint8_t, kMacBytes>;
inline constexpr std::uint32_t kFlagChecksums = 1;
// What a downstream sends first on its data connection (a UCP stream
// message): the connection id (64 bits, the challenge's) and
// auth::data_proof over it.
inline constexpr std::size_t kDataProofBytes = 8 + kMacBytes;

// Malformed input from a peer.
struct ProtocolError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class Writer {
 public:
  explicit Writer(Type t) {
    u32(kMagic);
    u16(static_cast<std::uint16_t>(t));
    u16(0);
    u64(0);  // sequence number, set_seq()
  }
  Writer& u8(std::uint8_t v) { return raw(&v, 1); }
  Writer& u16(std::uint16_t v) { return raw(&v, 2); }
  Writer& u32(std::uint32_t v) { return raw(&v, 4); }
  Writer& u64(std::uint64_t v) { return raw(&v, 8); }
  Writer& i64(std::int64_t v) { return raw(&v, 8); }
  Writer& str(std::string_view s) {
    u32(static_cast<std::uint32_t>(s.size()));
    return raw(s.data(), s.size());
  }
  template <std::size_t N>
  Writer& bytes(const std::array<std::uint8_t, N>& a) {
    return raw(a.data(), N);
  }
  Writer& raw(const void* p, std::size_t n) {
    const auto* b = static_cast<const std::uint8_t*>(p);
    buf_.insert(buf_.end(), b, b + n);
    return *this;
  }
  // Header sequence number (authenticated messages) and the finished bytes.
  void set_seq(std::uint64_t seq) { std::memcpy(buf_.data() + 8, &seq, 8); }
  std::vector<std::uint8_t>& buffer() { return buf_; }

 private:
  std::vector<std::uint8_t> buf_;
};

inline constexpr std::size_t kHeaderBytes = 16;

class Reader {
 public:
  // Checks the header; with `has_mac` the last kMacBytes are not body.
  Reader(std::span<const std::uint8_t> msg, bool has_mac);
  Type type() const { return type_; }
  std::uint64_t seq() const { return seq_; }
  std::uint8_t u8() { return get<std::uint8_t>(); }
  std::uint16_t u16() { return get<std::uint16_t>(); }
  std::uint32_t u32() { return get<std::uint32_t>(); }
  std::uint64_t u64() { return get<std::uint64_t>(); }
  std::int64_t i64() { return get<std::int64_t>(); }
  std::string str(std::size_t max = 1u << 20);
  template <std::size_t N>
  void bytes(std::array<std::uint8_t, N>* out) {
    need(N);
    std::memcpy(out->data(), p_ + at_, N);
    at_ += N;
  }
  bool done() const { return at_ == end_; }
  std::size_t left() const { return end_ - at_; }
  void expect_done() const {
    if (!done()) throw ProtocolError(std::string(type_name(type_)) + " message has trailing bytes");
  }

 private:
  template <class T>
  T get() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, p_ + at_, sizeof v);
    at_ += sizeof v;
    return v;
  }
  void need(std::size_t n) const {
    if (end_ - at_ < n) throw ProtocolError(std::string(type_name(type_)) + " message is truncated");
  }
  const std::uint8_t* p_;
  std::size_t at_ = kHeaderBytes, end_;
  Type type_{};
  std::uint64_t seq_ = 0;
};

// ---------------------------------------------------------------- sync plan

// Fragment sizes a source may choose: powers of two in this range (each
// divides every chunk size, a multiple of 2 MiB).
inline constexpr std::uint64_t kMinFragBytes = 64ull << 10;
inline constexpr std::uint64_t kMaxFragBytes = 2ull << 20;

// One sync as it travels: the manifest, and the source's chunking of its
// stream (chunk c is stream bytes [c*chunk_bytes, ...)). Each chunk travels
// as fragments of frag_bytes (the last one shorter), each a tagged message of
// its own, so that several are in flight on a link and a relay forwards a
// fragment as soon as it has it.
struct SyncPlan {
  std::uint64_t version = 0;
  std::uint64_t chunk_bytes = 0;
  std::uint64_t frag_bytes = 0;
  std::uint64_t stream_bytes = 0;
  std::uint64_t payload_bytes = 0;
  std::vector<TensorSpec> specs;
  std::vector<std::uint64_t> offsets;  // stream offset of each tensor
  std::vector<std::uint64_t> nbytes;  // each tensor's bytes in the stream (a delta piece: its blob's)
  // A delta sync (docs/protocol.md §12.1): the version its delta pieces
  // apply to (0: a full sync), and which tensors are delta pieces (the
  // others are their bytes). payload_bytes stays the tensors' logical size.
  std::uint64_t base_version = 0;
  std::vector<std::uint8_t> is_delta;
  bool delta() const { return base_version != 0; }
  // Chunks that hold at least one byte of a tensor, in order: the ones sent.
  std::vector<std::uint32_t> data_chunks;

  std::uint64_t chunk_len(std::uint32_t c) const {
    const std::uint64_t start = static_cast<std::uint64_t>(c) * chunk_bytes;
    return stream_bytes - start < chunk_bytes ? stream_bytes - start : chunk_bytes;
  }
  std::uint64_t frags_per_chunk() const { return chunk_bytes / frag_bytes; }
  std::uint32_t frags(std::uint32_t c) const {
    return static_cast<std::uint32_t>((chunk_len(c) + frag_bytes - 1) / frag_bytes);
  }
  std::uint64_t frag_len(std::uint32_t c, std::uint32_t j) const {
    const std::uint64_t at = static_cast<std::uint64_t>(j) * frag_bytes, len = chunk_len(c);
    return len - at < frag_bytes ? len - at : frag_bytes;
  }
  // The low 32 bits of fragment j of chunk c's tag (decode_sync checks that
  // every fragment of the sync has its own).
  std::uint32_t frag_tag(std::uint32_t c, std::uint32_t j) const {
    return static_cast<std::uint32_t>(static_cast<std::uint64_t>(c) * frags_per_chunk() + j);
  }
  // Fills data_chunks (and frag_base) from the offsets and sizes.
  void index_chunks();
  // frag_base[k]: fragments of data_chunks[0..k) (size data_chunks + 1): a
  // fragment's ordinal in the sync, the unit of an abort's `sent`.
  std::vector<std::uint64_t> frag_base;
  std::uint64_t total_frags() const { return frag_base.empty() ? 0 : frag_base.back(); }
};

// The plan for `specs` at shmcast's packing with these chunk and fragment
// sizes (what decode_sync accepts). Throws shmcast::Error for specs that
// shmcast cannot pack.
SyncPlan plan_for(const std::vector<TensorSpec>& specs, std::uint64_t version, std::uint64_t chunk_bytes,
                  std::uint64_t frag_bytes);

void encode_sync(Writer& w, const SyncPlan& p);
// Decodes and checks a kSync body: the layout must be the one shmcast
// packs for these tensors and this chunk size. Throws ProtocolError.
SyncPlan decode_sync(Reader& r);

}  // namespace shmcast::relay::wire
