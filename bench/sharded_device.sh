#!/usr/bin/env bash
# One call on the 2-GPU machine (device kind nvidia-h200-x2): build the Python
# module with CUDA, run the 2-rank sharded-sync tests on the GPUs, then
# bench/bench_sharded.py (limits, two-region baseline, TP and full sharded
# syncs, FSDP2). Logs and JSON lines in $OUT.
#
#   run: bash bench/sharded_device.sh       carry: [".deb"]   kind: nvidia-h200-x2
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/sharded_device.log") 2>&1
T0=$(date +%s)
log() { echo "== $(date +%T) (+$(( $(date +%s) - T0 )) s) $*"; }
B=/tmp/shmcast-build
source scripts/device-env.sh >"$OUT/env.log" 2>&1
PY=$(command -v python3)
PB=$($PY -m pybind11 --cmakedir 2>/dev/null)
export PATH=/usr/local/cuda/bin:$PATH
{ nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv; nvidia-smi topo -m | head -4;
  lscpu | grep -E "Model name|^CPU\(s\)|NUMA node\(s\)"; $PY -c "import torch; print('torch', torch.__version__)"; } >>"$OUT/env.log" 2>&1
log build
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
{ cmake -S . -B $B "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DSHMCAST_WITH_CUDA=ON -DCUDAToolkit_ROOT=/usr/local/cuda \
    -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc -DSHMCAST_BUILD_PYTHON=ON -DPython3_EXECUTABLE="$PY" \
    ${PB:+-Dpybind11_DIR=$PB} -DSHMCAST_BUILD_TESTS=OFF -DSHMCAST_BUILD_TOOLS=OFF \
  && cmake --build $B -j"$(nproc)" --target _shmcast; } >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
export PYTHONPATH=$B/python${PYTHONPATH:+:$PYTHONPATH}
if [ "${TESTS:-1}" = 1 ]; then
  log "python sharded tests (CPU paths of the GPU build), and FSDP2 on the GPUs"
  [ "${SKIP_CPU:-0}" = 1 ] || timeout 300 $PY -m pytest -q -x -p no:cacheprovider python/tests/test_sharded.py 2>&1 | tail -5
  timeout 300 $PY -m pytest -q -ra -p no:cacheprovider -m cuda python/tests/test_cuda.py -k "fsdp2 or sharded" 2>&1 | tail -8
fi
rc=0
if [ "${BENCH:-1}" = 1 ]; then
  log bench
  timeout ${BENCH_TIMEOUT:-420} $PY bench/bench_sharded.py --reps ${REPS:-10} --out "$OUT/sharded.jsonl" ${BENCH_ARGS:-}
  rc=$?
fi
if [ -n "${VARIANT_ARGS:-}" ]; then
  log "variant: ${VARIANT_ENV:-} $VARIANT_ARGS"
  env ${VARIANT_ENV:-} timeout 300 $PY bench/bench_sharded.py --reps ${REPS:-10} --out "$OUT/sharded-variant.jsonl" $VARIANT_ARGS
fi
log "done rc=$rc"
