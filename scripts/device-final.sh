#!/usr/bin/env bash
# Final check on the lent GPU machine (the `device` tool), in one call:
#   run: bash scripts/device-final.sh      carry: [".deb"]
# Builds everything with CUDA and the Python module, runs the GPU and Python
# tiers, the container script (tests/seccomp/gpu_ipc_vs_shmcast.py: CUDA IPC
# vs shmcast under Docker's default seccomp profile) and the default CUDA
# bench. Logs and JSON go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/final.log") 2>&1
log() { echo "== $(date +%T) $*"; }
source scripts/device-env.sh >/dev/null
PY=$(command -v python3)
PB=$($PY -m pybind11 --cmakedir 2>/dev/null)
B=/tmp/shmcast-final
nvidia-smi --query-gpu=index,name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader

log build
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
{ cmake -S . -B $B "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DSHMCAST_WITH_CUDA=ON -DCUDAToolkit_ROOT=/usr/local/cuda \
    -DSHMCAST_BUILD_PYTHON=ON -DPython3_EXECUTABLE="$PY" ${PB:+-Dpybind11_DIR=$PB} \
  && cmake --build $B -j"$(nproc)"; } >"$OUT/build.log" 2>&1 || { grep -E "error|Error" -A3 "$OUT/build.log" | head -40; exit 1; }

log "ctest gpu + python"
(cd $B && timeout 300 ctest -L "gpu|python" --output-on-failure --timeout 240) >"$OUT/ctest.log" 2>&1
echo "ctest rc=$?"; grep -E "tests passed|tests failed|\*\*\*Failed|Skipped" "$OUT/ctest.log" | head -20

log "container script: CUDA IPC vs shmcast under docker-default"
PYTHONPATH=$B/python timeout 240 $PY tests/seccomp/gpu_ipc_vs_shmcast.py --runner $B/tests/seccomp/shmcast-seccomp-run \
  --profile tests/seccomp/docker-default.json >"$OUT/gpu_container.log" 2>&1
echo "container script rc=$?"; tail -1 "$OUT/gpu_container.log"

log "bench (default: Qwen2.5-3B, 2 x 256 MiB)"
timeout 120 $B/bench/shmcast-bench --mode cuda --reps 10 --json >"$OUT/bench.json" 2>"$OUT/bench.err"
echo "bench rc=$?"; $PY -c "import json,sys; d=json.load(open('$OUT/bench.json')); print({k: d.get(k) for k in ('gbps','seconds','ratio','concurrent_gbps','bit_exact')})" 2>&1 | tail -1
log done
