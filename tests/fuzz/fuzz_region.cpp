// libFuzzer target: a whole region whose shared bytes are hostile. A valid
// region is built and a consumer attaches; then the bytes a producer (or a
// misbehaving peer) writes are replaced by the input: lifecycle and sync
// record, publication counters, the consumer's own seat, the slot
// descriptors and the first bytes of the sparse manifest area (the rest a
// hole that reads as zeros; fuzz_support.hpp: RegionInput; its flags let
// the fuzzer keep some of them consistent, to reach the read paths). Then
// wait_sync(0) and read_into / visit run with every timeout 0.
//
// Contract: success or shmcast::Error, promptly; read_into never writes past
// the caller's buffers (ASan); visit pieces stay inside their tensors.
#include <xxhash.h>

#include <optional>
#include <vector>

#include "fuzz_support.hpp"
#include "protocol/ring.hpp"

using namespace fuzz;

namespace {

template <class T>
T load(const std::uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <class T>
void store(std::uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof v);
}

// Offsets inside RegionInput::header, which holds Header bytes [128, 384).
constexpr std::size_t H = 128;
constexpr std::size_t kInit = offsetof(d::Header, init_state) - H;
constexpr std::size_t kRec = offsetof(d::Header, sync) - H;
constexpr std::size_t kPublished = offsetof(d::Header, published_seq) - H;

std::vector<std::uint8_t> zeros(kRegionSlotBytes);

std::uint64_t zero_sum(std::uint64_t bytes) {
  if (bytes > kRegionSlotBytes) bytes = kRegionSlotBytes;
  return XXH3_64bits(zeros.data(), bytes);
}

// XXH3 of the first `used` bytes of the manifest area as a reader sees
// them: the `written` input bytes, then zeros (the hole; capped at the area).
std::uint64_t manifest_hash(const std::uint8_t* m, std::size_t written, std::uint64_t used) {
  if (used > kRegionManifestBytes) used = kRegionManifestBytes;
  static XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  const std::size_t head = used < written ? static_cast<std::size_t>(used) : written;
  XXH3_64bits_update(st, m, head);
  for (std::uint64_t left = used - head; left > 0;) {
    const std::size_t n = static_cast<std::size_t>(left < zeros.size() ? left : zeros.size());
    XXH3_64bits_update(st, zeros.data(), n);
    left -= n;
  }
  return XXH3_64bits_digest(st);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  init_env();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  RegionInput in{};
  if (size) std::memcpy(&in, data, size < sizeof in ? size : sizeof in);
  std::uint8_t manifest[kRegionManifestInput] = {};
  std::size_t written = 0;  // manifest bytes written; the rest of the area is a hole
  if (size > sizeof in) {
    written = size - sizeof in < sizeof manifest ? size - sizeof in : sizeof manifest;
    std::memcpy(manifest, data + sizeof in, written);
  }
  const d::Geometry g = region_geometry();
  RegionFile& f = RegionFile::get();
  f.reset(g.total_bytes);
  const d::HeaderFixed h = fixed_for(g, in.flags & kChecksumFeature);
  f.write(0, &h, sizeof h);
  const std::uint32_t ready = d::kInitReady;
  f.write(offsetof(d::Header, init_state), &ready, sizeof ready);
  f.hold_lock(!(in.flags & kProducerDead));

  std::optional<shmcast::Consumer> c;
  try {
    c.emplace(shmcast::Consumer::open(kName, no_wait()));
  } catch (const shmcast::Error& e) {
    outcome("open", e);
    return 0;
  }
  const std::uint32_t seat = static_cast<std::uint32_t>(c->seat());
  const std::uint64_t seat_at = g.seats_offset + std::uint64_t{seat} * d::kSeatBytes;

  // ---- the producer's bytes
  std::uint8_t* hdr = in.header;
  if (in.flags2 & kFix2Ready) store<std::uint32_t>(hdr + kInit, d::kInitReady);
  if (in.flags2 & kFix2EvenWord) store<std::uint32_t>(hdr + kRec, load<std::uint32_t>(hdr + kRec) & ~1u);
  const std::uint64_t version = load<std::uint64_t>(hdr + kRec + 8);
  const std::uint64_t first_seq = load<std::uint64_t>(hdr + kRec + 16);
  const std::uint64_t chunks = load<std::uint64_t>(hdr + kRec + 24);
  const std::uint64_t stream = load<std::uint64_t>(hdr + kRec + 32);
  const std::uint64_t used = load<std::uint64_t>(hdr + kRec + 40);
  if (in.flags & kFixHash) store<std::uint64_t>(hdr + kRec + 48, manifest_hash(manifest, written, used));
  if ((in.flags2 & kFix2Published) && chunks > 0) store<std::uint64_t>(hdr + kPublished, first_seq + chunks - 1);
  f.write(H, hdr, sizeof in.header);

  // ---- the consumer's seat (as a confused peer might rewrite it)
  std::uint8_t seat_bytes[192];
  std::memcpy(seat_bytes, in.seat, sizeof seat_bytes);
  std::uint64_t word = 0;
  if (::pread(f.fd, &word, sizeof word, static_cast<off_t>(seat_at)) != sizeof word) finding("pread seat");
  if (in.flags & kKeepSeatWord) store<std::uint64_t>(seat_bytes, word);
  if (in.flags & kFixEnroll) {
    store<std::uint64_t>(seat_bytes + offsetof(d::Seat, included_gen), load<std::uint64_t>(seat_bytes) >> 32);
    store<std::uint64_t>(seat_bytes + offsetof(d::Seat, first_seq), first_seq);
    store<std::uint64_t>(seat_bytes + offsetof(d::Seat, first_version), version);
  }
  f.write(seat_at, seat_bytes, sizeof seat_bytes);

  // ---- slot descriptors
  std::uint8_t slots[sizeof in.slots];
  std::memcpy(slots, in.slots, sizeof slots);
  if ((in.flags2 & kFix2Slots) && first_seq > 0) {
    for (std::uint64_t k = 0; k < chunks && k < kRegionSlots; ++k) {
      const std::uint64_t seq = first_seq + k;
      std::uint8_t* dsc = slots + ((seq - 1) % kRegionSlots) * d::kSlotDescBytes;
      store<std::uint64_t>(dsc + 0, seq);
      store<std::uint64_t>(dsc + 8, version);
      store<std::uint64_t>(dsc + 16, d::chunk_len(k, stream, kRegionSlotBytes));
    }
  }
  if (in.flags & kFixChecksums)
    for (std::uint32_t k = 0; k < kRegionSlots; ++k) {
      std::uint8_t* dsc = slots + k * d::kSlotDescBytes;
      store<std::uint64_t>(dsc + 24, zero_sum(load<std::uint64_t>(dsc + 16)));
    }
  f.write(g.slots_offset, slots, sizeof slots);
  f.write(g.manifest_offset, manifest, written);

  // ---- the consumer reads whatever that says
  try {
    const shmcast::SyncInfo& info = c->wait_sync(std::chrono::nanoseconds(0));
    if (in.flags & kFixPatch) f.write(192, in.patch, sizeof in.patch);
    if (!(in.flags & kUseVisit) && info.payload_bytes <= (8u << 20)) {
      std::vector<std::vector<std::uint8_t>> out;
      std::vector<void*> dst;
      for (const auto& t : info.tensors) out.emplace_back(t.nbytes);
      for (auto& o : out) dst.push_back(o.data());
      c->read_into(dst);
    } else {
      c->visit([&](const shmcast::Piece& p) {
        if (p.tensor >= info.tensors.size()) finding("piece names a tensor that does not exist");
        if (p.offset > p.tensor_bytes || p.bytes > p.tensor_bytes - p.offset) finding("piece runs past its tensor");
        if (p.bytes > kRegionSlotBytes) finding("piece larger than a slot");
        if (p.bytes) {
          volatile std::byte a = p.data[0];
          volatile std::byte b = p.data[p.bytes - 1];
          (void)a;
          (void)b;
        }
      });
    }
    outcome("read", "ok");
  } catch (const shmcast::Error& e) {
    outcome("sync", e);
  }
  try {
    c->wait_sync(std::chrono::nanoseconds(0));
  } catch (const shmcast::Error& e) {
    outcome("next", e);
  }
  c.reset();
  return 0;
}
