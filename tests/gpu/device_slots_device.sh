#!/usr/bin/env bash
# Device slots (ProducerOptions::slot_memory = SlotMemory::kDevice) on the
# lent GPU machine, in one call:
#
#   run: bash tests/gpu/device_slots_device.sh      carry: [".deb"]      kind: nvidia-h200
#
# Builds the CUDA tree (Release; tests on, tools and relay off, the Python
# module only for the python stage), then runs, per STAGES (default
# "tests bench python model"):
#   tests   ctest -R "$TESTS_RE" (default '^(DeviceSlotsGpu|Vmm|VmmFake)\.|FdChannel'):
#           test_device_slots_gpu (when tests/gpu/CMakeLists.txt has it),
#           test_vmm, test_vmm_fake, and the fd channel's tests (unit,
#           processes, hostile peers, under Docker's seccomp profile)
#   bench   shmcast-device-slots-bench (Qwen2.5-3B shapes; phases host, device,
#           fanout, fanout-host; REPS timed syncs each, default 10; the D2D and
#           host-path ceilings), plain, then again under Docker's default
#           seccomp profile (shmcast-seccomp-run --profile
#           tests/seccomp/docker-default.json); BENCH_ARGS are added to
#           both (e.g. "--slot-mib 1024")
#   sweep   shmcast-device-slots-bench --phases device --reps REPS once per
#           line of SWEEP, each "label; VAR=value ...; bench args" (the
#           variables set for that run only, e.g. "poll-1024;
#           SHMCAST_CUDA_COMPLETION=poll; --slot-mib 1024 --slots 2"): a
#           summary in sweep.txt, the JSONs in sweep.tgz
#   python  python/tests/test_device_slots.py (skipped when absent), with the
#           module of this build tree (PYTHONPATH, as delta_sync_device.sh);
#           PIP=1: pip install the package into a venv instead, as
#           scripts/device-pip.sh does, and test that (adds 1-2 minutes)
#   model   bench/device_slots_model.py under Docker's default seccomp profile:
#           a transformers Qwen2 (0.5B shapes) trained with AdamW, synced
#           through device slots then host slots, logits compared every step
#           (STEPS, default 10)
# Output in $OUT: device_slots.log (this), env.log, build.log, tests.log,
# bench.json, bench-docker.json, bench.txt, bench-docker.txt, pytest.log
# (pip.log with PIP=1). A failing stage does not stop the next; the last
# lines list each stage's exit status, and the script exits 1 when any
# failed.
#
# Estimated 5-7 minutes on an H200 (the build 1.5-2, the bench about 1 per
# run); every stage has a timeout, the whole stays under 9.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
SRC=$(pwd)
OUT=${OUT:-/tmp/out}
STAGES=${STAGES:-tests bench python model}
REPS=${REPS:-10}
PIP=${PIP:-0}
TESTS_RE=${TESTS_RE:-'^(DeviceSlotsGpu|DeviceSlots|Vmm|VmmFake)\.|FdChannel'}
PROFILE=${PROFILE:-tests/seccomp/docker-default.json}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/device_slots.log") 2>&1
T0=$(date +%s)
log() { echo "== $(date +%T) (+$(( $(date +%s) - T0 )) s) $*"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }
RESULTS=()
FAILED=0
result() { RESULTS+=("$1: rc=$2"); log "$1: rc=$2"; [ "$2" -eq 0 ] || FAILED=1; }
B=/tmp/shmcast-device-slots
PY=$(command -v python3)

{
  nvidia-smi --query-gpu=index,name,uuid,memory.total,driver_version --format=csv 2>&1
  nvidia-smi topo -m 2>&1 | head -6
  uname -r; nproc; free -g | head -2; df -h /dev/shm | tail -1
  git -C "$SRC" log --oneline -1 2>/dev/null || true
} >"$OUT/env.log" 2>&1
source scripts/device-env.sh >>"$OUT/env.log" 2>&1
export PATH=/usr/local/cuda/bin:$PATH
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader

# ---- build: only what the stages need
targets=()
if has tests; then
  targets+=(test_vmm test_vmm_fake test_fd_channel_seccomp test_unit test_multiprocess test_fd_channel_attack)
  if grep -q "test_device_slots_gpu" tests/gpu/CMakeLists.txt; then
    targets+=(test_device_slots_gpu)
  else
    echo "tests/gpu/CMakeLists.txt has no test_device_slots_gpu: not built (DeviceSlotsGpu.* will match nothing)"
  fi
fi
has bench && targets+=(shmcast-device-slots-bench shmcast-seccomp-run)
has sweep && targets+=(shmcast-device-slots-bench)
has model && targets+=(shmcast-seccomp-run)
pyopts=(-DSHMCAST_BUILD_PYTHON=OFF)
if { has python && [ "$PIP" != 1 ] && [ -f python/tests/test_device_slots.py ]; } || has model; then
  PB=$($PY -m pybind11 --cmakedir 2>/dev/null)
  pyopts=(-DSHMCAST_BUILD_PYTHON=ON -DPython3_EXECUTABLE="$PY" ${PB:+-Dpybind11_DIR=$PB})
  targets+=(_shmcast)
fi
log "build (stages: $STAGES; targets: ${targets[*]})"
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
{ timeout 300 cmake -S . -B $B "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DSHMCAST_WITH_CUDA=ON \
    -DCUDAToolkit_ROOT=/usr/local/cuda -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc "${pyopts[@]}" \
    -DSHMCAST_BUILD_TOOLS=OFF -DSHMCAST_BUILD_RELAY=OFF -DSHMCAST_BUILD_TESTS=ON -DSHMCAST_BUILD_BENCH=ON \
  && timeout 400 cmake --build $B -j"$(nproc)" --target "${targets[@]}"; } >"$OUT/build.log" 2>&1
rc=$?
grep -E "shmcast:" "$OUT/build.log"; tail -2 "$OUT/build.log"
if [ $rc -ne 0 ]; then grep -E "error|Error" -A3 "$OUT/build.log" | head -60; echo "BUILD FAILED"; exit 1; fi
result build 0

# ---- tests
if has tests; then
  log "tests: ctest -R '$TESTS_RE'"
  # One at a time: the VMM tests compare cuMemGetInfo before and after.
  (cd $B && timeout 300 ctest -R "$TESTS_RE" --output-on-failure --timeout 240) >"$OUT/tests.log" 2>&1
  rc=$?
  grep -E "tests passed|tests failed|\*\*\*Failed|\*\*\*Skipped|Not Run|Timeout|No tests were found" "$OUT/tests.log" |
    head -30
  grep -E "^ *[0-9]+/[0-9]+ Test +#[0-9]+: DeviceSlotsGpu" "$OUT/tests.log" | head -20
  result tests $rc
fi

# ---- bench, plain and under Docker's default seccomp profile
if has bench; then
  BIN=$B/bench/shmcast-device-slots-bench
  SEC=$B/tests/seccomp/shmcast-seccomp-run
  log "bench: shmcast-device-slots-bench --reps $REPS ${BENCH_ARGS:-}"
  # shellcheck disable=SC2086  # BENCH_ARGS is a word list
  timeout 200 "$BIN" --reps "$REPS" ${BENCH_ARGS:-} --json "$OUT/bench.json" >"$OUT/bench.txt" 2>&1
  rc=$?
  cat "$OUT/bench.txt"
  result bench $rc
  log "bench under $PROFILE (shmcast-seccomp-run)"
  # shellcheck disable=SC2086
  timeout 200 "$SEC" --profile "$PROFILE" -- "$BIN" --reps "$REPS" ${BENCH_ARGS:-} --json "$OUT/bench-docker.json" \
    >"$OUT/bench-docker.txt" 2>&1
  rc=$?
  cat "$OUT/bench-docker.txt"
  result bench-docker $rc
fi

# ---- sweep: one device phase per SWEEP line
if has sweep; then
  BIN=$B/bench/shmcast-device-slots-bench
  SW=/tmp/sweep
  rm -rf $SW && mkdir -p $SW
  src=0
  while IFS= read -r line; do
    [ -z "${line// /}" ] && continue
    IFS=';' read -r label vars args <<<"$line"
    label=$(echo $label)
    log "sweep $label: env $vars $BIN --phases device --reps $REPS $args"
    # shellcheck disable=SC2086  # vars and args are word lists
    env $vars timeout 150 "$BIN" --phases device --reps "$REPS" $args --json "$SW/$label.json" \
      >"$SW/$label.txt" 2>&1
    rc=$?
    { echo "== $label: env $vars --phases device --reps $REPS $args (rc=$rc)"; cat "$SW/$label.txt"; } \
      >>"$OUT/sweep.txt"
    grep -iE "ceiling|^ *device|ratio|median" "$SW/$label.txt" | head -8
    [ $rc -eq 0 ] || src=$rc
  done <<<"${SWEEP:-}"
  tar -C $SW -czf "$OUT/sweep.tgz" . 2>/dev/null
  result sweep $src
fi

# ---- python
if has python; then
  T=python/tests/test_device_slots.py
  if [ ! -f "$T" ]; then
    echo "$T is absent: python stage skipped"
    result python-skipped 0
  elif [ "$PIP" = 1 ]; then
    # As scripts/device-pip.sh: a venv over the machine's python3 (itself a
    # venv with torch, pip, scikit-build-core, pybind11), installed offline.
    VENV=/tmp/venv-device-slots
    VPY=$VENV/bin/python
    log "pip install into $VENV (log: pip.log)"
    {
      rm -rf $VENV
      "$PY" -m venv --system-site-packages $VENV || "$PY" -m venv --without-pip --system-site-packages $VENV
      if ! $VPY -c "import torch, scikit_build_core, pip" 2>/dev/null; then
        vsite=$($VPY -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
        "$PY" -c "import sysconfig; p = sysconfig.get_paths(); print(p['purelib']); print(p['platlib'])" |
          sort -u >"$vsite/_outer_site.pth"
      fi
      CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) timeout 330 $VPY -m pip install -v --no-build-isolation --no-index .
    } >"$OUT/pip.log" 2>&1
    rc=$?
    grep -E "Successfully|error|Error" "$OUT/pip.log" | grep -v "^ *-- Installing" | head -10
    result pip $rc
    if [ $rc -eq 0 ]; then
      log "pytest $T (the installed package)"
      mkdir -p /tmp/pytest-device-slots
      (cd /tmp/pytest-device-slots && env -u PYTHONPATH timeout 240 $VPY -m pytest -v -ra -p no:cacheprovider \
         "$SRC/$T") >"$OUT/pytest.log" 2>&1
      rc=$?
      tail -25 "$OUT/pytest.log"
      result python $rc
    fi
  else
    log "pytest $T (the module of $B)"
    (cd $B/python && PYTHONPATH=$B/python${PYTHONPATH:+:$PYTHONPATH} PYTHONDONTWRITEBYTECODE=1 timeout 240 \
       "$PY" -m pytest -v -ra -p no:cacheprovider "$SRC/$T") >"$OUT/pytest.log" 2>&1
    rc=$?
    tail -25 "$OUT/pytest.log"
    result python $rc
  fi
fi

# ---- a real model under Docker's profile
if has model; then
  SEC=$B/tests/seccomp/shmcast-seccomp-run
  log "model: bench/device_slots_model.py --steps ${STEPS:-10} under $PROFILE"
  (PYTHONPATH=$B/python${PYTHONPATH:+:$PYTHONPATH} timeout 300 "$SEC" --profile "$PROFILE" -- \
     "$PY" bench/device_slots_model.py --steps "${STEPS:-10}" --json "$OUT/model.json") >"$OUT/model.txt" 2>&1
  rc=$?
  grep -E "DIFFER|logits_equal|\"of\"|median|Error|error" "$OUT/model.txt" | head -20
  result model $rc
fi

log "done"
printf '   %s\n' "${RESULTS[@]}"
exit $FAILED
