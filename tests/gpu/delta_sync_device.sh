#!/usr/bin/env bash
# Delta syncs on the lent GPU machine, in one call:
#   run: bash tests/gpu/delta_sync_device.sh      carry: [".deb"]
# Builds the CUDA tree, runs the delta sync tests (GPU and CPU) and the gpu
# tier, then the benchmarks: shmcast-delta-sync-bench (Qwen2.5-3B shapes,
# trainer and engine on one GPU: full vs delta syncs, the sweep, the
# ceilings) and shmcast-delta-bench --mode cuda (encode and apply alone).
# Logs and JSON go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/delta-sync.log") 2>&1
log() { echo "== $(date +%T) $*"; }
source scripts/device-env.sh >/dev/null
B=/tmp/shmcast-delta-sync
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
git log --oneline -1
log build
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
{ cmake -S . -B $B "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DSHMCAST_WITH_CUDA=ON -DCUDAToolkit_ROOT=/usr/local/cuda \
    -DSHMCAST_BUILD_PYTHON=OFF -DSHMCAST_BUILD_RELAY=OFF \
  && cmake --build $B -j"$(nproc)"; } >"$OUT/build.log" 2>&1 || { grep -E "error|Error" -A3 "$OUT/build.log" | head -40; exit 1; }
log "tests: delta syncs (GPU, CPU), the gpu tier"
timeout 300 $B/tests/gpu/test_delta_sync_gpu 2>&1 | tail -8
timeout 200 $B/tests/test_multiprocess --gtest_filter='DeltaSync.*' 2>&1 | tail -3
(cd $B && timeout 400 ctest -L gpu --output-on-failure --timeout 240 -j4) >"$OUT/ctest-gpu.log" 2>&1
grep -E "tests passed|tests failed|\*\*\*Failed|Not Run" "$OUT/ctest-gpu.log" | head -20
log "bench: shmcast-delta-sync-bench"
timeout 900 $B/bench/shmcast-delta-sync-bench --reps ${REPS:-10} --json "$OUT/delta_sync_bench.json"
echo "exit $?"
log "bench: shmcast-delta-bench --mode cuda (the codec alone)"
timeout 300 $B/bench/shmcast-delta-bench --mode cuda --mib 1024 --fractions 0.02 0.1 0.3 --reps 10 --json > "$OUT/delta_codec_bench.json"
echo "exit $?"; python3 -c "import json;d=json.load(open('$OUT/delta_codec_bench.json'));print(json.dumps(d)[:3000])"
log done
