// libFuzzer target: decode_manifest, the decoder of the manifest a consumer
// copies out of the region. Input: one byte choosing the slot size (bits
// 0-1) and whether the expected version/stream size are the manifest's own
// (bit 2 clear) or off by one; then the manifest bytes.
//
// Contract: a manifest the decoder accepts describes a consistent packing
// (checked below, field by field), its names take no more bytes than the
// manifest, and it survives an encode/decode round trip; decoded into the
// SyncInfo an earlier input left (with a kept name table, as the consumer
// decodes), every input gets the fresh decode's verdict and result.
#include <vector>

#include "fuzz_support.hpp"
#include "base/name_set.hpp"
#include "protocol/manifest.hpp"

using namespace fuzz;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const std::uint64_t slot = kManifestSlotSizes[data[0] & 3];
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data + 1), size - 1);
  std::uint64_t version = 1, stream = 0;
  if (bytes.size() >= sizeof(d::ManifestHeader)) {
    d::ManifestHeader mh;
    std::memcpy(&mh, bytes.data(), sizeof mh);
    version = mh.sync_version;
    stream = mh.stream_bytes;
  }
  if (data[0] & 4) {
    version += 1;
    stream ^= 256;
  }
  shmcast::SyncInfo info;
  const std::string why = d::decode_manifest(bytes, version, stream, slot, &info);
  // The consumer's way: into the SyncInfo (and with the name table) an
  // earlier input left behind. Same verdict; accepted, the same result.
  static shmcast::SyncInfo reused;
  static d::NameSet names;
  const std::string why_reused =
      d::decode_manifest(bytes, version, stream, slot, &reused, true, d::ManifestCheck::kFull, &names);
  if (why_reused != why) finding("a decode into a used SyncInfo gave another verdict");
  if (!why.empty()) return 0;
  if (!(reused == info)) finding("a decode into a used SyncInfo gave another result");

  // Accepted: every tensor is well-formed and the packing is consistent.
  if (info.version != version || info.stream_bytes != stream) finding("decoded sync fields disagree");
  std::uint64_t end_prev = 0, payload = 0, name_bytes = 0;
  std::vector<shmcast::TensorSpec> specs;
  std::vector<std::uint64_t> offsets;
  for (const shmcast::TensorInfo& t : info.tensors) {
    if (t.name.empty() || t.name.size() > shmcast::kMaxNameBytes) finding("bad name length accepted");
    // Names lie end to end: together no longer than the manifest.
    name_bytes += t.name.size();
    if (name_bytes > bytes.size()) finding("decoded names take more bytes than the manifest");
    if (t.shape.size() > static_cast<std::size_t>(shmcast::kMaxDims)) finding("too many dims accepted");
    std::uint64_t n = shmcast::dtype_size(t.dtype);
    if (n == 0) finding("unknown dtype accepted");
    for (std::int64_t dim : t.shape)
      if (dim < 0 || __builtin_mul_overflow(n, static_cast<std::uint64_t>(dim), &n)) finding("bad shape accepted");
    if (n != t.nbytes) finding("nbytes disagrees with dtype x shape");
    if (t.stream_offset % d::kTensorAlign) finding("misaligned tensor accepted");
    if (t.stream_offset < end_prev) finding("overlapping tensors accepted");
    if (t.nbytes > stream || t.stream_offset > stream - t.nbytes) finding("tensor past the stream accepted");
    if (t.nbytes > 0 && t.nbytes <= slot && t.stream_offset / slot != (t.stream_offset + t.nbytes - 1) / slot)
      finding("straddling tensor accepted");
    end_prev = t.stream_offset + t.nbytes;
    payload += t.nbytes;
    specs.push_back({t.name, t.dtype, t.shape});
    offsets.push_back(t.stream_offset);
  }
  if (payload != info.payload_bytes) finding("payload disagrees with the tensors");

  // Round trip: what the producer would encode for it decodes the same.
  const std::uint64_t need = d::manifest_size(specs);
  std::vector<std::byte> buf(need);
  if (d::encode_manifest(specs, offsets, version, stream, payload, buf.data(), need) != need)
    finding("re-encoding used another size");
  shmcast::SyncInfo again;
  if (!d::decode_manifest(buf, version, stream, slot, &again).empty()) finding("re-encoded manifest rejected");
  if (again.tensors.size() != info.tensors.size() || again.payload_bytes != info.payload_bytes)
    finding("round trip changed the sync");
  for (std::size_t i = 0; i < info.tensors.size(); ++i) {
    const auto &a = info.tensors[i], &b = again.tensors[i];
    if (a.name != b.name || a.dtype != b.dtype || a.shape != b.shape || a.nbytes != b.nbytes ||
        a.stream_offset != b.stream_offset)
      finding("round trip changed a tensor");
  }
  return 0;
}
