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
DEVICE_LOG=store_device.log
source bench/device-python.sh
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
