#!/usr/bin/env bash
# Store regions on the GPU machine (one call, kind nvidia-h200): build the
# Python module with CUDA, run the store tests (CPU paths of the GPU build,
# and the CUDA store test), then bench/store_bench.py (late joiner, restart
# drill, N readers vs safetensors load_file), REPS (10) each.
#
#   run: bash bench/store_device.sh        carry: [".deb"]        kind: nvidia-h200
#
# About 5-7 minutes. Results in $OUT: store_device.log, env.log, build.log,
# store.jsonl. Environment: REPS, STAGES (store_bench.py --stages), TESTS (1).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/store_device.log") 2>&1
T0=$(date +%s)
log() { echo "== $(date +%T) (+$(( $(date +%s) - T0 )) s) $*"; }
B=/tmp/shmcast-build
source scripts/device-env.sh >"$OUT/env.log" 2>&1
PY=$(command -v python3)
PB=$($PY -m pybind11 --cmakedir 2>/dev/null)
export PATH=/usr/local/cuda/bin:$PATH
{ nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv;
  lscpu | grep -E "Model name|^CPU\(s\)|NUMA node\(s\)"; free -g | head -2; df -h /dev/shm /var/tmp;
  $PY -c "import torch; print('torch', torch.__version__)"; } >>"$OUT/env.log" 2>&1
log build
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
{ cmake -S . -B $B "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DSHMCAST_WITH_CUDA=ON -DCUDAToolkit_ROOT=/usr/local/cuda \
    -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc -DSHMCAST_BUILD_PYTHON=ON -DPython3_EXECUTABLE="$PY" \
    ${PB:+-Dpybind11_DIR=$PB} -DSHMCAST_BUILD_TESTS=OFF -DSHMCAST_BUILD_TOOLS=OFF \
  && cmake --build $B -j"$(nproc)" --target _shmcast; } >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
export PYTHONPATH=$B/python${PYTHONPATH:+:$PYTHONPATH}
if [ "${TESTS:-1}" = 1 ]; then
  log "store tests: python/tests/test_store.py, and the CUDA store test"
  (cd $B/python && timeout 240 $PY -m pytest -q -x -p no:cacheprovider "$OLDPWD/python/tests/test_store.py" 2>&1 | tail -4)
  (cd $B/python && timeout 240 $PY -m pytest -q -ra -p no:cacheprovider -m cuda "$OLDPWD/python/tests/test_cuda.py" \
     -k "store or two_processes" 2>&1 | tail -6)
fi
log bench
timeout ${BENCH_TIMEOUT:-420} $PY bench/store_bench.py --reps ${REPS:-10} --out "$OUT/store.jsonl" \
  ${STAGES:+--stages $STAGES} ${BENCH_ARGS:-}
log "done rc=$?"
