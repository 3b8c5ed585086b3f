// The delta module's batched kernels, included at the end of delta.cu (one
// module, one PTX; split from it by role, to keep each file short): the
// engine's batch of device-to-device copies, and the batched apply, plan
// and encode (a launch for many tensors instead of one or more each). They
// use delta.cu's per-unit code.

// A batch of device-to-device copies (device slots: the engine gathers a
// chunk's pieces, split into at most kCopyPieceMax bytes each, into one
// launch instead of one cudaMemcpy each, whose fixed cost dominates small
// copies). One block per piece (grid-stride over them); 16-byte words, four
// in flight per thread, when everything is 16-byte aligned.
extern "C" __global__ void __launch_bounds__(256) shmcast_copy_pieces(CopyPiecesArgs a) {
  const CopyPiece* ps = reinterpret_cast<const CopyPiece*>(a.pieces);
  for (ull i = blockIdx.x; i < a.n; i += gridDim.x) {
    const CopyPiece p = ps[i];
    if (((p.src | p.dst | p.bytes) & 15) == 0) {
      const uint4* s = reinterpret_cast<const uint4*>(p.src);
      uint4* d = reinterpret_cast<uint4*>(p.dst);
      const ull words = p.bytes / 16, step = blockDim.x;
      ull k = threadIdx.x;
      for (; k + 3 * step < words; k += 4 * step) {
        const uint4 v0 = s[k], v1 = s[k + step], v2 = s[k + 2 * step], v3 = s[k + 3 * step];
        d[k] = v0;
        d[k + step] = v1;
        d[k + 2 * step] = v2;
        d[k + 3 * step] = v3;
      }
      for (; k < words; k += step) d[k] = s[k];
    } else {
      const unsigned char* s = reinterpret_cast<const unsigned char*>(p.src);
      unsigned char* d = reinterpret_cast<unsigned char*>(p.dst);
      for (ull k = threadIdx.x; k < p.bytes; k += blockDim.x) d[k] = s[k];
    }
  }
}

// ---------------------------------------------------------------- batched apply
//
// The apply of many pieces (ApplyJob, delta_format.hpp) in five launches:
// the same per-unit code as the single kernels, each CUDA block finding
// its job by a binary search over the jobs' first units.

extern "C" __global__ void __launch_bounds__(kThreads) shmcast_batch_reset(BatchArgs a) {
  const ApplyJob* jobs = reinterpret_cast<const ApplyJob*>(a.jobs);
  const ull stride = static_cast<ull>(gridDim.x) * blockDim.x;
  for (ull i = static_cast<ull>(blockIdx.x) * blockDim.x + threadIdx.x; i < a.njobs; i += stride) {
    Scratch* op = scratch_of(jobs[i].scratch);
    op->status = 0;
    op->op_err = 0;
    op->op_sum = 0;
    op->sum = 0;
  }
}

extern "C" __global__ void __launch_bounds__(kThreads) shmcast_batch_validate(BatchArgs a) {
  for (ull u = blockIdx.x; u < a.units; u += gridDim.x) {
    const ApplyJob* j = job_at(a, u, false);
    const ValidateArgs v{j->blob, j->blob_bytes, j->n, j->blocks, j->scratch};
    Scratch* op = scratch_of(j->scratch);
    const ull b = u - j->unit0;
    switch (j->w) {
      case 1: validate_unit<1>(v, b, op); break;
      case 2: validate_unit<2>(v, b, op); break;
      case 4: validate_unit<4>(v, b, op); break;
      default: validate_unit<8>(v, b, op); break;
    }
  }
}

extern "C" __global__ void __launch_bounds__(kThreads) shmcast_batch_apply(BatchArgs a) {
  Scratch* st = scratch_of(a.status);
  for (ull u = blockIdx.x; u < a.units; u += gridDim.x) {
    const ApplyJob* j = job_at(a, u, false);
    const ApplyArgs p{j->blob, j->n, j->blocks, j->dst, j->scratch, j->map};
    Scratch* op = scratch_of(j->scratch);
    const ull b = u - j->unit0;
    switch (j->w) {
      case 1: apply_unit<1>(p, b, op, st); break;
      case 2: apply_unit<2>(p, b, op, st); break;
      case 4: apply_unit<4>(p, b, op, st); break;
      default: apply_unit<8>(p, b, op, st); break;
    }
  }
}

// Checksum unit k of a job: words [k * kSumUnitWords, +kSumUnitWords) of
// its piece's content, and the tail in unit 0: where the piece lands in one
// run, that run's bytes (dst + dst0 elements, n elements); else (strided:
// sharded along a dim >= 1, read whole) read back through its map.
extern "C" __global__ void __launch_bounds__(kThreads) shmcast_batch_checksum(BatchArgs a) {
  __shared__ ull sh[kWarps];
  for (ull u = blockIdx.x; u < a.units; u += gridDim.x) {
    const ApplyJob* j = job_at(a, u, true);
    const ull data = j->dst + j->map.dst0 * j->w, bytes = j->map.n * j->w;
    const unsigned char* p = reinterpret_cast<const unsigned char*>(data);
    const unsigned char* dst = reinterpret_cast<const unsigned char*>(j->dst);
    const bool run = map_contiguous(j->map);
    const ull words = bytes / 8, k = u - j->sum_unit0;
    const bool aligned = (data & 7) == 0;
    const ull w0 = k * kSumUnitWords, w1 = words < w0 + kSumUnitWords ? words : w0 + kSumUnitWords;
    ull s = 0;
    for (ull i = w0 + threadIdx.x; i < w1; i += kThreads) {
      const ull x = !run ? mapped_word(j->map, dst, j->w, i, 8)
                         : aligned ? reinterpret_cast<const ull*>(p)[i] : load_partial(p + 8 * i, 8);
      s += checksum_term(i, x);
    }
    const unsigned tail = static_cast<unsigned>(bytes % 8);
    if (k == 0 && tail != 0 && threadIdx.x == 0)
      s += checksum_term(words, run ? load_partial(p + 8 * words, tail) : mapped_word(j->map, dst, j->w, words, tail));
    s = block_sum(s, sh);
    if (threadIdx.x == 0 && s != 0) atomicAdd(reinterpret_cast<ull*>(&scratch_of(j->scratch)->sum), s);
  }
}

// One thread per job: a verified job's result against its blob's header
// (only when its validation found nothing).
extern "C" __global__ void __launch_bounds__(kThreads) shmcast_batch_finish(BatchArgs a) {
  const ApplyJob* jobs = reinterpret_cast<const ApplyJob*>(a.jobs);
  Scratch* st = scratch_of(a.status);
  const ull stride = static_cast<ull>(gridDim.x) * blockDim.x;
  for (ull i = static_cast<ull>(blockIdx.x) * blockDim.x + threadIdx.x; i < a.njobs; i += stride) {
    const ApplyJob& j = jobs[i];
    if (j.verify == 0) continue;
    const Scratch* op = scratch_of(j.scratch);
    const ull c = checksum_final(op->sum, j.map.n * j.w);
    if (op->op_err == 0 && reinterpret_cast<const Header*>(j.blob)->checksum != c) atomicOr(&st->status, kStBadChecksum);
  }
}

// ---------------------------------------------------------------- batched plan
//
// The plan of many tensors (PlanJob, delta_format.hpp) in two launches
// instead of two per tensor: the count over every job's delta blocks (a
// CUDA block finds its job by a binary search over the jobs' first units),
// then one scan per job, the jobs' scans side by side.

namespace {

__device__ const PlanJob* plan_job_at(const PlanBatchArgs& a, ull u) {
  const PlanJob* jobs = reinterpret_cast<const PlanJob*>(a.jobs);
  ull lo = 0, hi = a.njobs;
  while (hi - lo > 1) {
    const ull mid = lo + (hi - lo) / 2;
    if (jobs[mid].unit0 <= u)
      lo = mid;
    else
      hi = mid;
  }
  return jobs + lo;
}

}  // namespace

extern "C" __global__ void __launch_bounds__(kThreads) shmcast_batch_count(PlanBatchArgs a) {
  __shared__ ull sh[2 * kWarps];
  for (ull u = blockIdx.x; u < a.units; u += gridDim.x) {
    const PlanJob* j = plan_job_at(a, u);
    const CountArgs c{j->base, j->next, j->head + kHeaderBytes, j->n, j->blocks};
    const ull b = u - j->unit0;
    switch (j->w) {
      case 1: count_unit<1>(c, b, sh); break;
      case 2: count_unit<2>(c, b, sh); break;
      case 4: count_unit<4>(c, b, sh); break;
      default: count_unit<8>(c, b, sh); break;
    }
  }
}

extern "C" __global__ void __launch_bounds__(kScanThreads) shmcast_batch_scan(PlanBatchArgs a) {
  const PlanJob* jobs = reinterpret_cast<const PlanJob*>(a.jobs);
  for (ull j = blockIdx.x; j < a.njobs; j += gridDim.x)
    scan_job(ScanArgs{jobs[j].head, jobs[j].n, jobs[j].blocks, jobs[j].w});
}

// ---------------------------------------------------------------- batched encode
//
// The encode of many tensors (EncodeJob, delta_format.hpp) in one launch
// instead of one each: the same per-unit code as the single kernels, each
// CUDA block finding its job by a binary search over the jobs' first units.
// A launch covers jobs [jobs, jobs + njobs) of a table numbered from its
// start: units [unit0, unit0 + units).
extern "C" __global__ void __launch_bounds__(kThreads) shmcast_batch_encode(EncodeBatchArgs a) {
  const EncodeJob* jobs = reinterpret_cast<const EncodeJob*>(a.jobs);
  for (ull u = a.unit0 + blockIdx.x; u < a.unit0 + a.units; u += gridDim.x) {
    ull lo = 0, hi = a.njobs;
    while (hi - lo > 1) {
      const ull mid = lo + (hi - lo) / 2;
      if (jobs[mid].unit0 <= u)
        lo = mid;
      else
        hi = mid;
    }
    const EncodeJob* j = jobs + lo;
    const EncodeArgs e{j->base, j->next, j->head, j->out, j->out_bytes, j->n, j->blocks, a.scratch};
    const ull b = u - j->unit0;
    if (b == 0)
      for (ull p = threadIdx.x; p < j->pad; p += kThreads) reinterpret_cast<unsigned char*>(j->out + j->out_bytes)[p] = 0;
    switch (j->w) {
      case 1: encode_unit<1>(e, b); break;
      case 2: encode_unit<2>(e, b); break;
      case 4: encode_unit<4>(e, b); break;
      default: encode_unit<8>(e, b); break;
    }
  }
}
