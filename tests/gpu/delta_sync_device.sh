#!/usr/bin/env bash
# Delta syncs on the lent GPU machine, in one call:
#   run: bash tests/gpu/delta_sync_device.sh      carry: [".deb"]
# Builds the CUDA tree with the Python module, then runs, per STAGES
# (default "tests bench python adamw"):
#   tests   the delta sync tests (GPU; CPU: DeltaSync.*, ShardedDelta.*) and the gpu tier
#           (test_delta_gpu, test_delta_sync_gpu: strided Shard(1) pieces checked on the GPU)
#   bench   shmcast-delta-sync-bench (Qwen2.5-3B shapes, trainer and engine
#           on one GPU: full against delta syncs, the break-even sweep, the
#           ceilings) and shmcast-delta-bench --mode cuda (the codec alone)
#   python  the Python delta tests (python/tests/test_delta*.py), CUDA included
#   adamw   bench/delta_adamw.py: a transformers Qwen2 (0.5B shapes) trained
#           with AdamW at lr 1e-6 for 50 steps, synced as deltas, logits
#           compared at every step
# Logs and JSON go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
STAGES=${STAGES:-tests bench python adamw}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/delta-sync.log") 2>&1
log() { echo "== $(date +%T) $*"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }
source scripts/device-env.sh >/dev/null
PY=$(command -v python3)
PB=$($PY -m pybind11 --cmakedir 2>/dev/null)
B=/tmp/shmcast-delta-sync
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
log "build (stages: $STAGES)"
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
{ cmake -S . -B $B "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DSHMCAST_WITH_CUDA=ON -DCUDAToolkit_ROOT=/usr/local/cuda \
    -DSHMCAST_BUILD_PYTHON=ON -DPython3_EXECUTABLE="$PY" ${PB:+-Dpybind11_DIR=$PB} -DSHMCAST_BUILD_RELAY=OFF \
  && cmake --build $B -j"$(nproc)"; } >"$OUT/build.log" 2>&1 || { grep -E "error|Error" -A3 "$OUT/build.log" | head -40; exit 1; }
export PYTHONPATH=$B/python${PYTHONPATH:+:$PYTHONPATH}
if has tests; then
  log "tests: delta syncs (GPU, CPU), the gpu tier"
  timeout 300 $B/tests/gpu/test_delta_sync_gpu 2>&1 | tail -8
  timeout 400 $B/tests/test_multiprocess --gtest_filter='DeltaSync.*:ShardedDelta.*' 2>&1 | tail -3
  (cd $B && timeout 400 ctest -L gpu --output-on-failure --timeout 240 -j4) >"$OUT/ctest-gpu.log" 2>&1
  grep -E "tests passed|tests failed|\*\*\*Failed|Not Run" "$OUT/ctest-gpu.log" | head -20
fi
if has adamw; then
  log "bench/delta_adamw.py: Qwen2 0.5B shapes, AdamW lr 1e-6, 50 steps"
  timeout 500 $PY bench/delta_adamw.py --steps 50 --lr 1e-6 --json "$OUT/delta_adamw.json" 2>&1 | tail -40
  echo "exit ${PIPESTATUS[0]}"
fi
if has bench; then
  log "bench: shmcast-delta-sync-bench"
  timeout 900 $B/bench/shmcast-delta-sync-bench --reps ${REPS:-10} --json "$OUT/delta_sync_bench.json"
  echo "exit $?"
  log "bench: shmcast-delta-bench --mode cuda (the codec alone)"
  timeout 300 $B/bench/shmcast-delta-bench --mode cuda --mib 1024 --fractions 0.02 0.1 0.3 --reps 10 --json \
    > "$OUT/delta_codec_bench.json"
  echo "exit $?"
fi
if has python; then
  log "pytest: the delta tests"
  (cd $B/python && timeout 400 $PY -m pytest -q -ra -p no:cacheprovider "$OLDPWD"/python/tests/test_delta*.py \
     "$OLDPWD"/python/tests/test_vllm_transfer.py 2>&1 | tail -15)
fi
log done
