// libFuzzer target: header validation and the consumer's open path.
//
// The input is the start of a region's header page. validate_header() runs
// on it directly; then the bytes become a region file in a private
// SHMCAST_DIR and Consumer::open() attaches to it (timeout 0), and, when it
// succeeds, wait_sync(0) and visit() run on whatever the header announces.
// Contract: success or shmcast::Error, never a crash, a hang or an access
// outside the file.
#include <optional>

#include "fuzz_support.hpp"

using namespace fuzz;

namespace {

void check_accepted(const d::HeaderFixed& h, std::uint64_t file_bytes) {
  d::Geometry g{};
  if (!d::compute_geometry(h.max_consumers, h.slot_count, h.slot_bytes, h.manifest_bytes, &g).empty())
    finding("validate_header accepted a geometry compute_geometry rejects");
  if (g.total_bytes != file_bytes || h.total_bytes != file_bytes) finding("accepted header disagrees with the file size");
  if (h.seats_offset != d::kHeaderBytes || h.slots_offset < h.seats_offset + std::uint64_t{h.max_consumers} * d::kSeatBytes ||
      h.manifest_offset < h.slots_offset + std::uint64_t{h.slot_count} * d::kSlotDescBytes ||
      h.data_offset < h.manifest_offset + h.manifest_bytes ||
      h.data_offset + std::uint64_t{h.slot_count} * h.slot_bytes != file_bytes)
    finding("accepted header has overlapping or out-of-file sections");
}

void touch(const shmcast::SyncInfo& info, const shmcast::Piece& p) {
  if (p.tensor >= info.tensors.size()) finding("piece names a tensor that does not exist");
  if (p.tensor_bytes != info.tensors[p.tensor].nbytes) finding("piece tensor size disagrees with the manifest");
  if (p.offset > p.tensor_bytes || p.bytes > p.tensor_bytes - p.offset) finding("piece runs past its tensor");
  if (p.bytes) {
    volatile std::byte a = p.data[0];
    volatile std::byte b = p.data[p.bytes - 1];
    (void)a;
    (void)b;
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  init_env();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::uint8_t page[d::kHeaderBytes] = {};
  const std::size_t n = size < sizeof page ? size : sizeof page;
  if (n) std::memcpy(page, data, n);
  d::HeaderFixed h;
  std::memcpy(&h, page, sizeof h);

  // 1. validate_header on its own, against a few file sizes.
  bool version_mismatch = false;
  for (std::uint64_t fsz : {h.total_bytes, static_cast<std::uint64_t>(size), h.total_bytes + 4096, h.total_bytes - 1}) {
    if (d::validate_header(h, fsz, &version_mismatch).empty()) {
      if (version_mismatch) finding("accepted a header and flagged a version mismatch");
      check_accepted(h, fsz);
    }
  }

  // 2. The consumer's open path on a file made of these bytes.
  const std::uint8_t steer = page[kHeaderSteer];
  std::uint64_t file_bytes = size;
  if (!(steer & 2) && h.total_bytes >= n && h.total_bytes <= kMaxSparseBytes) file_bytes = h.total_bytes;
  RegionFile& f = RegionFile::get();
  f.reset(file_bytes);
  f.write(0, page, n < file_bytes ? n : file_bytes);
  f.hold_lock(!(steer & 1));
  try {
    shmcast::Consumer c = shmcast::Consumer::open(kName, no_wait());
    try {
      const shmcast::SyncInfo& info = c.wait_sync(std::chrono::nanoseconds(0));
      c.visit([&](const shmcast::Piece& p) { touch(info, p); });
      outcome("visit", "ok");
    } catch (const shmcast::Error& e) {
      outcome("sync", e);
    }
  } catch (const shmcast::Error& e) {
    outcome("open", e);
  }
  return 0;
}
