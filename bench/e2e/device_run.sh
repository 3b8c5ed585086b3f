#!/usr/bin/env bash
# The end-to-end weight-sync bench on the GPU machine, in one call:
#   run: bash bench/e2e/device_run.sh        carry: [".deb"]    kind: nvidia-h200-x2 (fan-out needs 2 GPUs)
#
# 1. dependencies: scripts/device-env.sh unpacks what the machine lacks from
#    .deb/ into /tmp/pfx (it says which .debs to fetch beforehand, off the device);
# 2. build: the Python module with CUDA (shmcast._shmcast) and shmcast-seccomp-run,
#    Python and pybind11 from the machine's python3;
# 3. bench/e2e/weight_sync_bench.py, everything into $OUT (at most 8 files).
#
# E2E_BUDGET_S (default 230) bounds the bench; E2E_ARGS adds bench arguments.
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/device_run.log") 2>&1
log() { echo "== $(date +%T) $*"; }
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1} \
       NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
T0=$(date +%s)

# ---------------------------------------------------------------- 1. dependencies
log deps
source scripts/device-env.sh
PY=$(command -v python3)
PYINC=$($PY -c "import sysconfig; print(sysconfig.get_paths()['include'])")
PB=$($PY -m pybind11 --cmakedir 2>/dev/null)
echo "python3=$PY include=$PYINC Python.h=$([ -f "$PYINC/Python.h" ] && echo yes || echo MISSING) pybind11=$PB"
$PY -c "import torch, matplotlib; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), 'matplotlib', matplotlib.__version__)" 2>&1 | tail -1
nvidia-smi --query-gpu=index,name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader 2>&1
echo "kernel $(uname -r), $(nproc) cpus, /dev/shm $(df -h /dev/shm | tail -1 | awk '{print $4}') free, ulimit -l $(ulimit -l)"

# ---------------------------------------------------------------- 2. build
log build
B=/tmp/shmcast-e2e-build
build_runner() {  # shmcast-seccomp-run alone: two sources, libseccomp and nlohmann-json headers
  mkdir -p $B/tests/seccomp
  g++ -std=c++20 -O2 -Itests/seccomp tests/seccomp/seccomp_run.cpp tests/seccomp/seccomp_profile.cpp -lseccomp \
      -o $B/tests/seccomp/shmcast-seccomp-run >>/tmp/e2e-build.log 2>&1 || echo "seccomp runner: build failed"
}
if [ "${E2E_BUILD:-all}" = runner ]; then
  # paths (a) and (b) need no shmcast: E2E_BUILD=runner E2E_ARGS="--only a,seccomp --seccomp-only"
  : >/tmp/e2e-build.log
  build_runner
  rc=0
else
  gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
  cfg=(-S . -B $B "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DSHMCAST_WITH_CUDA=ON -DSHMCAST_BUILD_PYTHON=ON
       -DSHMCAST_BUILD_BENCH=OFF -DSHMCAST_BUILD_TOOLS=OFF -DCUDAToolkit_ROOT=/usr/local/cuda
       -DPython3_EXECUTABLE=$PY ${PB:+-Dpybind11_DIR=$PB})
  { cmake "${cfg[@]}" && cmake --build $B -j"$(nproc)" --target _shmcast shmcast-seccomp-run; } >/tmp/e2e-build.log 2>&1
  rc=$?
  if [ $rc -ne 0 ]; then
    echo "build with tests ON failed (rc=$rc); retrying with SHMCAST_BUILD_TESTS=OFF and the seccomp runner by hand"
    grep -E "error|Error" -A3 /tmp/e2e-build.log | head -30
    rm -rf $B
    { cmake "${cfg[@]}" -DSHMCAST_BUILD_TESTS=OFF && cmake --build $B -j"$(nproc)" --target _shmcast; } \
      >>/tmp/e2e-build.log 2>&1
    rc=$?
    build_runner
  fi
fi
cp /tmp/e2e-build.log "$OUT/build.log"
tail -2 /tmp/e2e-build.log
if [ $rc -ne 0 ]; then grep -E "error|Error" -A3 /tmp/e2e-build.log | head -40; echo "BUILD FAILED: path (c) will fail"; fi
export PYTHONPATH=$B/python${PYTHONPATH:+:$PYTHONPATH}
$PY -c "import shmcast; print('shmcast', shmcast.__version__, 'cuda_available', shmcast.cuda_available(), shmcast.cuda_unavailable_reason() or '')" 2>&1 | tail -2
echo "build took $(( $(date +%s) - T0 )) s"

# ---------------------------------------------------------------- 3. bench
log bench
GPUS=$($PY -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
MACHINE="$($PY -c "import torch; print(torch.cuda.get_device_name(0))" 2>/dev/null) x$GPUS"
PYTHONUNBUFFERED=1 $PY bench/e2e/weight_sync_bench.py --out "$OUT" --machine "$MACHINE" \
  --budget-s "${E2E_BUDGET_S:-230}" --seccomp-run $B/tests/seccomp/shmcast-seccomp-run ${E2E_ARGS:-}
echo "bench rc=$?"
ls -la "$OUT"
log "done in $(( $(date +%s) - T0 )) s"
