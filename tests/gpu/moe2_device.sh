#!/usr/bin/env bash
# A MoE model against a dense one of the same bytes on the lent GPU machine,
# after the per-tensor costs of device slots and delta syncs were batched
# (issue 43 item 3), in one call under 7 minutes:
#
#   run: OUT=$OUT bash tests/gpu/moe2_device.sh      carry: [".deb"]      (one GPU; H100 or H200)
#
# Builds the CUDA tree (Release; the tests and benches named below), then, in
# this order (the figures first; the benches check every byte too):
#   slots   shmcast-device-slots-bench --phases host,device --manifests
#           qwen3-30b-a3b:L,qwen3-30b-a3b-dense:L, REPS timed syncs each
#           (default 10): host and device slots, MoE and dense in one run
#   delta   shmcast-delta-sync-bench --phases full,delta (DELTA_PHASES) --fraction 0.02 with
#           the same two manifests (host slots; 2 % of the elements changed
#           before each sync; full syncs of the same changes beside them)
#   sweep   the MoE device phase again with the batch kernel's block fixed
#           (SHMCAST_CUDA_PIECE_BYTES = each of PIECES; 65536 is the block
#           of every batch before the size was chosen per batch)
#   prof    where nsys is installed: the MoE delta phase (3 syncs) under
#           nsys, its kernel and driver-call summaries (top lines)
#   tests   the gpu tier tests the batching touches, one at a time:
#           DeltaGpu.* (the codec against the host's blobs: encode ranges),
#           DeltaSyncGpu.* (delta syncs between processes: the mirrored
#           stream), DeviceSlotsGpu.TwoConsumers* and .ManyExpert* (the batch
#           copy), ManyTensors.* (test_multiprocess) and GpuExpertParallel.*
#           (test_ep_gpu: two ranks on one GPU)
# L (LAYERS) is the number of Qwen3-30B-A3B's 48 layers taken: the delta
# stage holds four copies of the model on the GPU (trainer's tensors and
# delta base, engine's tensors and reference), so 8 layers (11.2 GB) on a
# card under 100 GiB (H100), 16 (21.9 GB) above (H200); printed first.
# Output in $OUT: moe2.log (this, with every bench table and the summary),
# tests.log, slots.json, delta.json (build.log only when the build failed).
# A failing stage does not stop the next; the last lines list each stage's
# exit status and the MoE/dense ratios.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-/tmp/out}
STAGES=${STAGES:-slots delta sweep prof tests}
PIECES=${PIECES:-65536 262144 1048576}
TESTS_RE=${TESTS_RE:-'^(DeltaGpu\.|DeltaSyncGpu\.|DeviceSlotsGpu\.(TwoConsumers|ManyExpert)|ManyTensors\.|GpuExpertParallel\.)'}
REPS=${REPS:-10}
DELTA_PHASES=${DELTA_PHASES:-full,delta}
# BUDGET (s, 0: none): the seconds the call has; the sweep and prof stages are
# skipped when too little is left, and the tests get what remains.
BUDGET=${BUDGET:-0}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/moe2.log") 2>&1
T0=$(date +%s)
log() { echo "== $(date +%T) (+$(( $(date +%s) - T0 )) s) $*"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }
left() { if [ "$BUDGET" -gt 0 ]; then echo $(( BUDGET - ($(date +%s) - T0) )); else echo 100000; fi; }
RESULTS=()
FAILED=0
result() { RESULTS+=("$1: rc=$2"); log "$1: rc=$2"; [ "$2" -eq 0 ] || FAILED=1; }
B=/tmp/shmcast-moe2
PY=$(command -v python3)

{
  nvidia-smi --query-gpu=index,name,uuid,memory.total,driver_version --format=csv 2>&1
  uname -r; nproc; free -g | head -2
} 2>&1
source scripts/device-env.sh >/tmp/moe2-env.log 2>&1
export PATH=/usr/local/cuda/bin:$PATH
GPU=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)
MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | tr -d ' ')
if [ -z "${LAYERS:-}" ]; then
  if [ "${MIB:-0}" -gt 102400 ]; then LAYERS=16; else LAYERS=8; fi
fi
CARD=H100
[[ "$GPU" == *H200* ]] && CARD=H200
MOE=qwen3-30b-a3b:$LAYERS
DENSE=qwen3-30b-a3b-dense:$LAYERS
echo "GPU: $GPU -> card $CARD; first $LAYERS of 48 layers ($MOE against $DENSE)"

# ---- build: only what the stages need
targets=()
{ has slots || has sweep; } && targets+=(shmcast-device-slots-bench)
has delta && targets+=(shmcast-delta-sync-bench)
has tests && targets+=(test_delta_gpu test_delta_sync_gpu test_device_slots_gpu test_ep_gpu test_multiprocess)
log "build (stages: $STAGES; targets: ${targets[*]})"
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
{ timeout 300 cmake -S . -B $B "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DSHMCAST_WITH_CUDA=ON \
    -DCUDAToolkit_ROOT=/usr/local/cuda -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc -DSHMCAST_BUILD_PYTHON=OFF \
    -DSHMCAST_BUILD_TOOLS=OFF -DSHMCAST_BUILD_RELAY=OFF -DSHMCAST_BUILD_TESTS=ON -DSHMCAST_BUILD_BENCH=ON \
  && timeout 300 cmake --build $B -j"$(nproc)" --target "${targets[@]}"; } >/tmp/moe2-build.log 2>&1
rc=$?
tail -2 /tmp/moe2-build.log
if [ $rc -ne 0 ]; then
  cp /tmp/moe2-build.log "$OUT/build.log"
  grep -E "error|Error" -A3 /tmp/moe2-build.log | head -60; echo "BUILD FAILED"; exit 1
fi
result build 0
SLOTS=$B/bench/shmcast-device-slots-bench
DELTA=$B/bench/shmcast-delta-sync-bench

# ---- host and device slots
if has slots; then
  log "slots: $SLOTS --phases host,device --manifests $MOE,$DENSE --reps $REPS"
  timeout 150 "$SLOTS" --phases host,device --manifests "$MOE,$DENSE" --reps "$REPS" --timeout 120 \
    --json "$OUT/slots.json" >/tmp/moe2-slots.txt 2>&1
  rc=$?
  cat /tmp/moe2-slots.txt
  result slots $rc
fi

# ---- delta syncs at 2 %
if has delta; then
  log "delta: $DELTA --phases $DELTA_PHASES --fraction 0.02 --manifests $MOE,$DENSE --reps $REPS"
  timeout 150 "$DELTA" --phases "$DELTA_PHASES" --fraction 0.02 --manifests "$MOE,$DENSE" --reps "$REPS" \
    --json "$OUT/delta.json" >/tmp/moe2-delta.txt 2>&1
  rc=$?
  cat /tmp/moe2-delta.txt
  result delta $rc
fi

# ---- device slots with the batch kernel's block fixed
if has sweep && [ "$(left)" -lt 200 ]; then log "sweep: skipped ($(left) s left)"; fi
if has sweep && [ "$(left)" -ge 200 ]; then
  for pb in $PIECES; do
    log "sweep: SHMCAST_CUDA_PIECE_BYTES=$pb $SLOTS --phases device --manifests $MOE --reps $REPS"
    SHMCAST_CUDA_PIECE_BYTES=$pb timeout 60 "$SLOTS" --phases device --manifests "$MOE" --reps "$REPS" \
      --timeout 50 >/tmp/moe2-sweep.txt 2>&1
    rc=$?
    grep -E "device|GB/s|error" /tmp/moe2-sweep.txt | head -12
    result "sweep-$pb" $rc
  done
fi

# ---- where a MoE delta sync's GPU time goes (only where nsys is installed)
NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
if has prof && [ -n "$NSYS" ] && [ "$(left)" -ge 170 ]; then
  log "prof: $NSYS profile $DELTA --phases delta --manifests $MOE --reps 3"
  timeout 90 "$NSYS" profile -o /tmp/moe2-prof --force-overwrite true --trace cuda --sample none --cpuctxsw none \
    "$DELTA" --phases delta --fraction 0.02 --manifests "$MOE" --reps 3 >/tmp/moe2-prof.txt 2>&1
  rc=$?
  tail -3 /tmp/moe2-prof.txt
  for r in cuda_gpu_kern_sum cuda_api_sum; do
    timeout 60 "$NSYS" stats --report $r --format table /tmp/moe2-prof.nsys-rep 2>/dev/null | head -24
  done
  result prof $rc
fi

# ---- tests, one at a time
if has tests; then
  tt=$(( $(left) - 15 )); [ $tt -gt 200 ] && tt=200; [ $tt -lt 30 ] && tt=30
  log "tests: ctest -R '$TESTS_RE' (timeout $tt s)"
  (cd $B && timeout $tt ctest -R "$TESTS_RE" --output-on-failure --timeout 150 -j1) >"$OUT/tests.log" 2>&1
  rc=$?
  grep -E "tests passed|tests failed|\*\*\*Failed|\*\*\*Skipped|Not Run|Timeout|No tests were found" "$OUT/tests.log" |
    head -30
  result tests $rc
fi

# ---- summary: MoE over dense, per case (medians of this run)
log "summary ($CARD, first $LAYERS layers)"
"$PY" - "$OUT" <<'EOF' || true
import json, os, sys
out = sys.argv[1]
def load(n):
    try:
        return json.load(open(os.path.join(out, n)))
    except Exception:
        return None
def row(case, moe, dense, unit="GB/s"):
    if moe and dense:
        print(f"  {case:<28} MoE {moe:9.2f}  dense {dense:9.2f} {unit}   MoE/dense {moe / dense:.3f}")
s = load("slots.json")
if s and "phases" in s:
    ms = [m for m in s["manifests"]]
    for ph in ("host", "device"):
        g = {r["manifest"]: r for r in s["phases"] if r["label"] == ph and "gbps" in r}
        if len(g) == 2:
            row(ph + " slots", g[ms[0]]["gbps"]["median"], g[ms[1]]["gbps"]["median"])
d = load("delta.json")
if d and "phases" in d:
    for ph in ("full", "delta"):
        g = {r["manifest"]: r for r in d["phases"] if r["label"] == ph and "sync_s" in r}
        if len(g) == 2:
            a, b = [g[m["name"]] for m in d["manifests"]]
            row(f"{ph} sync at 2 % (ms)", a["sync_s"]["median"] * 1e3, b["sync_s"]["median"] * 1e3, "ms")
            print(f"  {'':<28} -> MoE/dense GB/s {b['sync_s']['median'] / a['sync_s']['median']:.3f}")
EOF
log "done"
printf '   %s\n' "${RESULTS[@]}"
exit $FAILED
