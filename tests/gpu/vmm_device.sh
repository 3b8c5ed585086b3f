#!/usr/bin/env bash
# Device slots' lower pieces on the GPU machine, in one call: builds the
# library with CUDA, the VMM tests and shmcast-vmm-probe (no Python, no
# tools, no relay), then
#   1. ctest: Vmm.* (tests/gpu/test_vmm.cpp: two processes share a VMM slot
#      over the fd channel, D2D both ways bit-exact; memory back once the
#      last importer unmapped; 100 cycles leave cuMemGetInfo unchanged;
#      a consumer on GPU 1 when there is one), VmmFake.* (the same wrapper
#      against the emulation), and the fd channel's seccomp test;
#   2. shmcast-vmm-probe, 1 GiB and 4 GiB, REPS (10) copies each, plain and
#      under Docker's default seccomp profile (shmcast-seccomp-run);
#   3. with 2 GPUs: the probe with the consumer on GPU 1.
# Output in $OUT: vmm_device.log (this), env.log, build.log, tests.log,
# probe.jsonl (one JSON object per probe run).
#
#   run: bash tests/gpu/vmm_device.sh      carry: [".deb"]      kind: nvidia-h200 (or nvidia-h200-x2)
#
# Estimated 4-6 minutes (the build 2-3).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/vmm_device.log") 2>&1
REPS=${REPS:-10}
B=/tmp/shmcast-vmm-build
T0=$(date +%s)
log() { echo "== $(date +%T) (+$(( $(date +%s) - T0 )) s) $*"; }

{
  nvidia-smi --query-gpu=index,name,uuid,memory.total,driver_version --format=csv 2>&1
  nvidia-smi topo -m 2>&1 | head -6
  uname -r; nproc; df -h /dev/shm | tail -1
} >"$OUT/env.log" 2>&1
source scripts/device-env.sh >>"$OUT/env.log" 2>&1
export PATH=/usr/local/cuda/bin:$PATH

log build
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
{ cmake -S . -B $B "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DSHMCAST_WITH_CUDA=ON -DCUDAToolkit_ROOT=/usr/local/cuda \
    -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc -DSHMCAST_BUILD_PYTHON=OFF -DSHMCAST_BUILD_TOOLS=OFF \
    -DSHMCAST_BUILD_RELAY=OFF -DSHMCAST_BUILD_TESTS=ON \
  && cmake --build $B -j"$(nproc)" --target test_vmm test_vmm_fake test_fd_channel_seccomp shmcast-vmm-probe \
       shmcast-seccomp-run; } >"$OUT/build.log" 2>&1
rc=$?
grep -E "shmcast:" "$OUT/build.log"; tail -2 "$OUT/build.log"
if [ $rc -ne 0 ]; then grep -E "error|Error" -A3 "$OUT/build.log" | head -60; echo "BUILD FAILED"; exit 1; fi

log tests
(cd $B && timeout 420 ctest -R '^(Vmm|VmmFake)\.|FdChannelUnderProfile' --output-on-failure --timeout 300) \
  >"$OUT/tests.log" 2>&1
echo "tests rc=$?"
grep -E "tests passed|tests failed|Failed|Skipped|\*\*\*|free GPU memory|free:" "$OUT/tests.log" | head -30

log probe
J="$OUT/probe.jsonl"
: >"$J"
P=$B/bench/shmcast-vmm-probe
SEC=$B/tests/seccomp/shmcast-seccomp-run
probe() {  # label, args...
  local label=$1; shift
  log "probe $label: $*"
  timeout 300 "$@" >"/tmp/probe-$label.txt" 2>"/tmp/probe-$label.err"
  local prc=$?
  cat "/tmp/probe-$label.txt"; tail -3 "/tmp/probe-$label.err"
  echo "   rc=$prc"
  python3 -c 'import json,sys; d=json.loads(open(sys.argv[1]).read().strip().splitlines()[-1]); d["label"]=sys.argv[2]; print(json.dumps(d))' \
    "/tmp/probe-$label.txt" "$label" >>"$J" 2>/dev/null || echo "{\"label\": \"$label\", \"rc\": $prc}" >>"$J"
}
probe 1g "$P" --bytes 1G --reps "$REPS" --json
probe 1g-docker "$SEC" --profile tests/seccomp/docker-default.json -- "$P" --bytes 1G --reps "$REPS" --json
probe 4g-docker "$SEC" --profile tests/seccomp/docker-default.json -- "$P" --bytes 4G --reps "$REPS" --json
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  probe 1g-peer-docker "$SEC" --profile tests/seccomp/docker-default.json -- "$P" --bytes 1G --reps "$REPS" \
    --owner 0 --consumer 1 --json
else
  echo "one GPU: no peer probe (kind nvidia-h200-x2 gives two)"
fi
log done
