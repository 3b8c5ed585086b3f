// The CUDA delta codec's kernel launches, in order, for each operation, and
// the errors its status bits stand for. Written once for delta_cuda.cpp
// (which launches through the driver) and for the test that runs the same
// kernels on the host (tests/unit/test_delta_kernels.cpp), so that test
// covers the grids, argument blocks and status handling too.
//
// A launcher L has
//   void launch(Kernel k, std::uint32_t w, unsigned grid, unsigned threads, const Args& args);
// (w: the element width of the kernels that have one, else 0).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "protocol/delta_format.hpp"

namespace shmcast::detail::delta {

enum class Kernel {
  kCount, kScan, kEncode, kValidate, kApply, kChecksum, kFinish, kReset,
  kBatchReset, kBatchValidate, kBatchApply, kBatchChecksum, kBatchFinish, kBatchCount, kBatchScan, kBatchEncode
};

inline constexpr std::uint64_t kMaxGrid = 32768;  // the kernels grid-stride beyond it

inline unsigned grid_for(std::uint64_t units) {
  return static_cast<unsigned>(units == 0 ? 1 : (units < kMaxGrid ? units : kMaxGrid));
}

// Clears the status words (before first use, and in finish after reading them).
template <class L>
void launch_reset(L& l, std::uint64_t scratch, bool all) {
  l.launch(Kernel::kReset, 0, 1, 1, ResetArgs{scratch, all ? 1u : 0u});
}

// Counts and checksum terms into the head's table, then offsets and header.
template <class L>
void launch_plan(L& l, std::uint64_t base, std::uint64_t next, std::uint32_t w, std::uint64_t n, std::uint64_t head) {
  const std::uint64_t blocks = block_count(n);
  if (blocks > 0)
    l.launch(Kernel::kCount, w, grid_for(blocks), kKernelThreads, CountArgs{base, next, head + kHeaderBytes, n, blocks});
  l.launch(Kernel::kScan, 0, 1, kScanThreads, ScanArgs{head, n, blocks, w});
}

template <class L>
void launch_encode(L& l, std::uint64_t base, std::uint64_t next, std::uint32_t w, std::uint64_t n, std::uint64_t head,
                   std::uint64_t out, std::uint64_t out_bytes, std::uint64_t scratch) {
  const std::uint64_t blocks = block_count(n);
  l.launch(Kernel::kEncode, w, grid_for(blocks), kKernelThreads,
           EncodeArgs{base, next, head, out, out_bytes, n, blocks, scratch});
}

// The content checksum of [data, data + bytes) into *out (a device u64,
// when out != 0) and/or compared with blob's header (when blob != 0).
template <class L>
void launch_checksum(L& l, std::uint64_t data, std::uint64_t bytes, std::uint64_t out, std::uint64_t blob,
                     std::uint64_t scratch, bool reset) {
  if (reset) launch_reset(l, scratch, false);
  l.launch(Kernel::kChecksum, 0, grid_for(bytes / 8 / (kKernelThreads * 8) + 1), kKernelThreads,
           ChecksumArgs{data, bytes, scratch});
  l.launch(Kernel::kFinish, 0, 1, 1, FinishArgs{scratch, bytes, out, blob});
}

// Validate, then apply (which writes nothing when validation found a
// fault), then with `verify` the result's checksum against the header's.
template <class L>
void launch_apply(L& l, std::uint64_t blob, std::uint64_t blob_bytes, std::uint32_t w, const SliceMap& m,
                  std::uint64_t dst, bool verify, std::uint64_t scratch) {
  const std::uint64_t blocks = block_count(m.n);
  launch_reset(l, scratch, false);
  l.launch(Kernel::kValidate, w, grid_for(blocks), kKernelThreads, ValidateArgs{blob, blob_bytes, m.n, blocks, scratch});
  l.launch(Kernel::kApply, w, grid_for(blocks), kKernelThreads, ApplyArgs{blob, m.n, blocks, dst, scratch, m});
  if (verify) launch_checksum(l, dst + m.dst0 * w, m.n * w, 0, blob, scratch, false);
}

// Numbers a batch's jobs (unit0, sum_unit0, sum_units; the rest filled by
// the caller) and returns the totals of apply units and checksum units.
inline void number_jobs(ApplyJob* jobs, std::uint64_t njobs, std::uint64_t* units, std::uint64_t* sum_units) {
  std::uint64_t u = 0, s = 0;
  for (std::uint64_t i = 0; i < njobs; ++i) {
    ApplyJob& j = jobs[i];
    j.unit0 = u;
    u += j.blocks > 0 ? j.blocks : 1;
    const std::uint64_t words = j.map.n * j.w / 8;
    j.sum_units = j.verify != 0 ? (words / kSumUnitWords + 1) : 0;
    j.sum_unit0 = s;
    s += j.sum_units;
  }
  *units = u;
  *sum_units = s;
}

// A batch of applies (jobs: device memory, numbered by number_jobs): every
// job's validation words cleared, all validated, then applied (a rejected
// job writes nothing), then the verified ones' results checked.
template <class L>
void launch_apply_batch(L& l, std::uint64_t jobs, std::uint64_t njobs, std::uint64_t units, std::uint64_t sum_units,
                        std::uint64_t status) {
  if (njobs == 0) return;
  const unsigned per_job = grid_for((njobs + kKernelThreads - 1) / kKernelThreads);
  l.launch(Kernel::kBatchReset, 0, per_job, kKernelThreads, BatchArgs{jobs, njobs, njobs, status});
  l.launch(Kernel::kBatchValidate, 0, grid_for(units), kKernelThreads, BatchArgs{jobs, njobs, units, status});
  l.launch(Kernel::kBatchApply, 0, grid_for(units), kKernelThreads, BatchArgs{jobs, njobs, units, status});
  if (sum_units == 0) return;
  l.launch(Kernel::kBatchChecksum, 0, grid_for(sum_units), kKernelThreads, BatchArgs{jobs, njobs, sum_units, status});
  l.launch(Kernel::kBatchFinish, 0, per_job, kKernelThreads, BatchArgs{jobs, njobs, njobs, status});
}

// Numbers a plan batch's jobs (unit0; the rest filled by the caller) and
// returns the total of count units (the jobs' delta blocks).
inline std::uint64_t number_plan_jobs(PlanJob* jobs, std::uint64_t njobs) {
  std::uint64_t u = 0;
  for (std::uint64_t i = 0; i < njobs; ++i) {
    jobs[i].unit0 = u;
    u += jobs[i].blocks;
  }
  return u;
}

// A batch of plans (jobs: device memory, numbered by number_plan_jobs):
// every job's counts, then every job's offsets and header.
template <class L>
void launch_plan_batch(L& l, std::uint64_t jobs, std::uint64_t njobs, std::uint64_t units) {
  if (njobs == 0) return;
  if (units > 0) l.launch(Kernel::kBatchCount, 0, grid_for(units), kKernelThreads, PlanBatchArgs{jobs, njobs, units});
  l.launch(Kernel::kBatchScan, 0, grid_for(njobs), kScanThreads, PlanBatchArgs{jobs, njobs, units});
}

// Numbers an encode batch's jobs (unit0; the rest filled by the caller)
// and returns the total of encode units (max(blocks, 1) each).
inline std::uint64_t number_encode_jobs(EncodeJob* jobs, std::uint64_t njobs) {
  std::uint64_t u = 0;
  for (std::uint64_t i = 0; i < njobs; ++i) {
    jobs[i].unit0 = u;
    u += jobs[i].blocks > 0 ? jobs[i].blocks : 1;
  }
  return u;
}

// Encodes jobs [first, last) of a numbered table (`table`: device memory,
// `host`: the same jobs on the host, for their units) in one launch.
template <class L>
void launch_encode_batch(L& l, std::uint64_t table, const EncodeJob* host, std::uint64_t first, std::uint64_t last,
                         std::uint64_t scratch) {
  if (first >= last) return;
  const EncodeJob& e = host[last - 1];
  const std::uint64_t u0 = host[first].unit0, u1 = e.unit0 + (e.blocks > 0 ? e.blocks : 1);
  l.launch(Kernel::kBatchEncode, 0, grid_for(u1 - u0), kKernelThreads,
           EncodeBatchArgs{table + first * sizeof(EncodeJob), last - first, u0, u1 - u0, scratch});
}

// The batch copy (shmcast_copy_pieces; device slots, Lane::flush_small):
// the bytes each CUDA block copies, for a batch of `total` bytes. `fixed`
// (SHMCAST_CUDA_PIECE_BYTES) when set; else a multiple of 4 KiB that gives
// about kCopyTargetBlocks blocks, from kCopyPieceMin to kCopyPieceMax
// (small blocks spread a small batch over the GPU; in a large one each
// block's fixed cost shows: on an H200, 2 x 1 GiB device slots of
// Qwen2.5-3B all through the kernel took 10.0 ms in 64 KiB blocks, 7.6 in
// 256 KiB, 7.7 in 1 MiB, docs/benchmarks-log.md).
inline constexpr std::uint64_t kCopyTargetBlocks = 2048;
inline std::uint64_t copy_block_bytes(std::uint64_t total, std::uint64_t fixed) {
  if (fixed != 0) return fixed;
  std::uint64_t b = (total / kCopyTargetBlocks + 4095) & ~std::uint64_t{4095};
  if (b < kCopyPieceMin) b = kCopyPieceMin;
  if (b > kCopyPieceMax) b = kCopyPieceMax;
  return b;
}

// Appends `in`'s pieces to `out` split into at most `block` bytes each (a
// multiple of 16, so that a 16-byte aligned piece's parts stay aligned);
// an empty piece is dropped.
inline void split_copy_pieces(std::span<const CopyPiece> in, std::uint64_t block, std::vector<CopyPiece>* out) {
  for (const CopyPiece& p : in)
    for (std::uint64_t at = 0; at < p.bytes; at += block)
      out->push_back(CopyPiece{p.src + at, p.dst + at, p.bytes - at < block ? p.bytes - at : block});
}

// Throws the error that accumulated status bits stand for (nothing for 0):
// kInvalidArgument for encode's, kCorrupt for a rejected blob or result.
// Defined in delta.cpp.
void throw_for_status(std::uint32_t status);

}  // namespace shmcast::detail::delta
