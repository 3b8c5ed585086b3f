#!/usr/bin/env bash
# The delta codec on the GPU machine, in one call: builds the library with
# CUDA and the delta kernels (nvcc to PTX), test_delta_gpu, test_unit and
# shmcast-delta-bench (no Python, no tools, no relay), then
#   1. ctest: DeltaGpu.* (tests/gpu/test_delta_gpu.cpp: the CUDA codec
#      against the host codec byte for byte: plan, encode, apply into slices,
#      checksum, > 32768 blocks, the default stream, misaligned pointers),
#      and the host Delta.* / DeltaKernels.* unit tests;
#   2. shmcast-delta-bench --mode both: host threads and CUDA kernels, 10 reps,
#      against memcpy / a device-to-device copy measured in the same run.
# Output in $OUT: delta_device.log (this), delta_build.log, delta_tests.log,
# delta_bench.json.
#
#   run: bash tests/gpu/delta_device.sh      carry: [".deb"]      kind: nvidia-h200
#
# Shares its build directory with tests/gpu/vmm_device.sh, so running both in
# one call builds the library once.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/delta_device.log") 2>&1
REPS=${REPS:-10}
MIB=${MIB:-1024}
B=${B:-/tmp/shmcast-vmm-build}
T0=$(date +%s)
log() { echo "== $(date +%T) (+$(( $(date +%s) - T0 )) s) $*"; }

source scripts/device-env.sh >/dev/null 2>&1
export PATH=/usr/local/cuda/bin:$PATH

log build
gen=(); command -v ninja >/dev/null && [ ! -f $B/CMakeCache.txt ] && gen=(-G Ninja)
{ cmake -S . -B $B "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DSHMCAST_WITH_CUDA=ON -DCUDAToolkit_ROOT=/usr/local/cuda \
    -DSHMCAST_DELTA_KERNELS=ON -DSHMCAST_BUILD_PYTHON=OFF -DSHMCAST_BUILD_TOOLS=OFF -DSHMCAST_BUILD_RELAY=OFF \
    -DSHMCAST_BUILD_TESTS=ON \
  && cmake --build $B -j"$(nproc)" --target test_delta_gpu test_unit shmcast-delta-bench; } >"$OUT/delta_build.log" 2>&1
rc=$?
grep -E "shmcast:" "$OUT/delta_build.log"; tail -2 "$OUT/delta_build.log"
if [ $rc -ne 0 ]; then grep -E "error|Error" -A3 "$OUT/delta_build.log" | head -60; echo "BUILD FAILED"; exit 1; fi

log tests
(cd $B && timeout 400 ctest -R '^(DeltaGpu|DeltaKernels|Delta)\.' --output-on-failure --timeout 300) >"$OUT/delta_tests.log" 2>&1
echo "tests rc=$?"
grep -E "tests passed|tests failed|Failed|Skipped|\*\*\*" "$OUT/delta_tests.log" | head -30

log bench
timeout 400 $B/bench/shmcast-delta-bench --mode both --mib "$MIB" --reps "$REPS" --json >"$OUT/delta_bench.json" 2>"$OUT/delta_bench.err"
echo "bench rc=$?"
tail -5 "$OUT/delta_bench.err"
timeout 200 $B/bench/shmcast-delta-bench --mode cuda --mib "$MIB" --reps "$REPS" 2>&1 | tail -30
log done
