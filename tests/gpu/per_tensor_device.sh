#!/usr/bin/env bash
# Per-tensor cost (issue 43 item 2) on the lent GPU machine, in one call:
#   run: bash tests/gpu/per_tensor_device.sh      carry: [".deb"]
# Builds the CUDA tree with the Python module (the same build directory as
# tests/gpu/delta_sync_device.sh), then
#   1. pytest python/tests/test_batched.py (the batched send() / receive_into()
#      paths, the CUDA case both ways) and test_cuda.py, test_many_tensors.py,
#      test_transfer.py (CPU and CUDA), then their CUDA cases again with
#      SHMCAST_PY_BATCH_CUDA=1 (every CUDA send() / receive_into() of plain
#      tensors through the batched paths);
#   2. the per-tensor benches on the machine's CPUs, twice each: as issue 43
#      measures them (the consumer's figure holds the producer's time) and
#      with --consumer-after (each side alone); REPS syncs of each case;
#   3. the Python bench with CUDA tensors (--device cuda --consumer-after),
#      without and with SHMCAST_PY_BATCH_CUDA=1.
# A step is left out (and says so) once 420 s have gone, so that the call
# stays under 8 minutes. Logs and JSON go to $OUT: per_tensor.log (this),
# build.log, pytest.log, pytest_batch_cuda.log, per_tensor_*.json, py_*.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
REPS=${REPS:-10}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/per_tensor.log") 2>&1
log() { echo "== $(date +%T) (${SECONDS}s) $*"; }
# time_left STEP: false (and says so) once 420 s of the call have gone.
time_left() { [ "$SECONDS" -lt 420 ] || { log "left out (time): $*"; return 1; }; }
source scripts/device-env.sh >/dev/null
PY=$(command -v python3)
PB=$($PY -m pybind11 --cmakedir 2>/dev/null)
B=/tmp/shmcast-delta-sync
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
$PY -c "import torch; print('torch', torch.__version__)"
log build
gen=(); command -v ninja >/dev/null && [ ! -f $B/CMakeCache.txt ] && gen=(-G Ninja)
{ cmake -S . -B $B "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DSHMCAST_WITH_CUDA=ON -DCUDAToolkit_ROOT=/usr/local/cuda \
    -DSHMCAST_BUILD_PYTHON=ON -DPython3_EXECUTABLE="$PY" ${PB:+-Dpybind11_DIR=$PB} -DSHMCAST_BUILD_RELAY=OFF \
  && cmake --build $B -j"$(nproc)" --target _shmcast shmcast-per-tensor-bench; } >"$OUT/build.log" 2>&1 \
  || { grep -E "error|Error" -A3 "$OUT/build.log" | head -40; exit 1; }
export PYTHONPATH=$B/python${PYTHONPATH:+:$PYTHONPATH}
log "pytest: test_batched, test_cuda, test_many_tensors, test_transfer"
(cd $B/python && timeout 300 $PY -m pytest -q -ra -p no:cacheprovider "$OLDPWD"/python/tests/test_batched.py \
   "$OLDPWD"/python/tests/test_cuda.py "$OLDPWD"/python/tests/test_many_tensors.py \
   "$OLDPWD"/python/tests/test_transfer.py) >"$OUT/pytest.log" 2>&1
echo "pytest rc=$?"; tail -15 "$OUT/pytest.log"
log "pytest, CUDA cases with SHMCAST_PY_BATCH_CUDA=1"
(cd $B/python && SHMCAST_PY_BATCH_CUDA=1 timeout 120 $PY -m pytest -q -ra -p no:cacheprovider -m cuda \
   "$OLDPWD"/python/tests/test_batched.py "$OLDPWD"/python/tests/test_cuda.py \
   "$OLDPWD"/python/tests/test_many_tensors.py "$OLDPWD"/python/tests/test_transfer.py) \
  >"$OUT/pytest_batch_cuda.log" 2>&1
echo "pytest (SHMCAST_PY_BATCH_CUDA=1) rc=$?"; tail -8 "$OUT/pytest_batch_cuda.log"
for mode in overlap after; do
  extra=(); [ $mode = after ] && extra=(--consumer-after)
  time_left "C++ per-tensor bench ($mode)" && {
    log "C++ per-tensor bench ($mode)"
    timeout 150 $B/bench/shmcast-per-tensor-bench --reps "$REPS" "${extra[@]}" --json "$OUT/per_tensor_cpp_$mode.json" 2>&1 | tail -3; }
  time_left "Python per-tensor bench, receive_into ($mode)" && {
    log "Python per-tensor bench, receive_into ($mode)"
    timeout 150 $PY bench/per_tensor_bench.py --reps "$REPS" "${extra[@]}" 2>&1 | tee "$OUT/py_into_$mode.txt" | tail -3; }
done
time_left "Python per-tensor bench, receive()" && {
  log "Python per-tensor bench, receive() (--consumer-after)"
  timeout 150 $PY bench/per_tensor_bench.py --reps "$REPS" --receive new --consumer-after 2>&1 | tee "$OUT/py_new_after.txt" | tail -3; }
for batch in 0 1; do
  time_left "Python per-tensor bench, CUDA tensors, SHMCAST_PY_BATCH_CUDA=$batch" && {
    log "Python per-tensor bench, CUDA tensors (--device cuda --consumer-after), SHMCAST_PY_BATCH_CUDA=$batch"
    SHMCAST_PY_BATCH_CUDA=$batch timeout 150 $PY bench/per_tensor_bench.py --reps "$REPS" --device cuda --consumer-after \
      2>&1 | tee "$OUT/py_cuda_batch$batch.txt" | tail -3; }
done
log done
