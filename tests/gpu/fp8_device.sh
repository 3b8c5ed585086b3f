#!/usr/bin/env bash
# Quantize-on-send (issue 44) on the lent GPU machine, one GPU, in one call:
#   run: bash tests/gpu/fp8_device.sh      carry: [".deb"]      (about 5-8 minutes)
# Builds the CUDA tree (the library with its FP8 kernels, the tests, the
# Python module), then, per STAGES (default "tests python bench"):
#   tests   test_fp8_gpu (the kernels against the host path, bit for bit;
#           CUDA tensors through host and device slots into a consumer
#           process), test_quant and test_quant_sync (the host path)
#   python  python/tests/test_fp8.py (with a torch that has float8_e4m3fn:
#           receive() yields float8 tensors equal to torch's own conversion),
#           test_fp8_engines.py (block-FP8 engine stand-ins fed through the
#           vLLM and SGLang backends) and the backends' quantize tests
#   bench   Fp8Gpu.Bench: Qwen2.5-3B shapes, BF16 against FP8 syncs through
#           host and device slots (bytes, sync time min/median/max over REPS,
#           default 10; FP8 with the kernel writing the slots and, as
#           before it did, through a staging room), and the quantize
#           kernels' rate against a D2D copy
#   seccomp tests/seccomp/fp8_adamw_seccomp.py: a transformers Qwen2 trained
#           with AdamW, its weights sent quantized, a worker and a late
#           joiner under Docker's profile, SHA-256 against the torch
#           reference at every step, for both variants
# Logs under $OUT (at most 6 files): fp8-device.log (everything, with the
# FP8BENCH lines), build.log, fp8_bench.jsonl.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
STAGES=${STAGES:-tests python bench}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/fp8-device.log") 2>&1
log() { echo "== $(date +%T) $*"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }
source scripts/device-env.sh >/dev/null
PY=$(command -v python3)
PB=$($PY -m pybind11 --cmakedir 2>/dev/null)
B=/tmp/shmcast-fp8
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
$PY -c "import torch; print('torch', torch.__version__, 'float8_e4m3fn', hasattr(torch, 'float8_e4m3fn'))" 2>&1
log "build (stages: $STAGES)"
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
{ timeout 400 cmake -S . -B $B "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DSHMCAST_WITH_CUDA=ON \
    -DCUDAToolkit_ROOT=/usr/local/cuda -DSHMCAST_BUILD_PYTHON=ON -DPython3_EXECUTABLE="$PY" \
    ${PB:+-Dpybind11_DIR=$PB} -DSHMCAST_BUILD_RELAY=OFF \
  && timeout 400 cmake --build $B -j"$(nproc)" --target test_fp8_gpu test_quant test_quant_sync _shmcast \
       $(has seccomp && echo shmcast-seccomp-run); } \
  >"$OUT/build.log" 2>&1 || { grep -E "error|Error" -A3 "$OUT/build.log" | head -40; exit 1; }
grep -E "FP8 quantize CUDA kernels" "$OUT/build.log"
export PYTHONPATH=$B/python${PYTHONPATH:+:$PYTHONPATH}
if has tests; then
  log "tests: test_fp8_gpu (GPU), test_quant, test_quant_sync (host path)"
  timeout 300 $B/tests/gpu/test_fp8_gpu --gtest_filter='-Fp8Gpu.Bench' 2>&1 | tail -12
  timeout 60 $B/tests/test_quant 2>&1 | tail -3
  timeout 200 $B/tests/test_quant_sync 2>&1 | tail -3
fi
if has python; then
  log "pytest: test_fp8.py, test_fp8_engines.py, the backends' quantize announcements"
  (cd $B/python && timeout 240 $PY -m pytest -q -ra -p no:cacheprovider "$OLDPWD"/python/tests/test_fp8.py \
     "$OLDPWD"/python/tests/test_fp8_engines.py "$OLDPWD"/python/tests/test_vllm_transfer.py \
     "$OLDPWD"/python/tests/test_sglang.py "$OLDPWD"/python/tests/test_adapters.py \
     -k 'fp8 or Fp8 or quantiz or engine_serving or stand_in_refuses or sync_names' 2>&1 | tail -25)
fi
if has bench; then
  log "bench: Fp8Gpu.Bench (Qwen2.5-3B shapes, REPS=${REPS:-10})"
  SHMCAST_FP8_BENCH=1 SHMCAST_FP8_BENCH_REPS=${REPS:-10} timeout 420 $B/tests/gpu/test_fp8_gpu \
    --gtest_filter=Fp8Gpu.Bench 2>&1 | tee "$OUT/bench.raw" | grep -E "FP8BENCH|OK|FAILED|Failure|child" | head -20
  grep -h '^FP8BENCH ' "$OUT/bench.raw" | sed 's/^FP8BENCH //' > "$OUT/fp8_bench.jsonl"
  rm -f "$OUT/bench.raw"
fi
if has seccomp; then
  for v in fp8-block128 fp8-block128-ue8m0; do
    log "seccomp: fp8_adamw_seccomp.py --quantize $v"
    timeout 300 $PY tests/seccomp/fp8_adamw_seccomp.py --runner $B/tests/seccomp/shmcast-seccomp-run \
      --quantize $v --layers ${LAYERS:-2} --steps ${STEPS:-4} --late-at 2 2>&1 | tail -${TAIL:-6}
    echo "exit ${PIPESTATUS[0]}"
  done
fi
log done
