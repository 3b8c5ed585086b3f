#!/usr/bin/env bash
# One call on the 2-GPU machine (device kind nvidia-h200-x2): build the Python
# module with CUDA, run the 2-rank sharded-sync tests on the GPUs, then
# bench/bench_sharded.py (limits, two-region baseline, TP and full sharded
# syncs, FSDP2). Logs and JSON lines in $OUT.
#
#   run: bash bench/sharded_device.sh       carry: [".deb"]   kind: nvidia-h200-x2
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE_LOG=sharded_device.log
source bench/device-python.sh
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
