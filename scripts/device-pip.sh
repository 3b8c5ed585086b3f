#!/usr/bin/env bash
# The pip package and the CUDA engine (driver API) on the lent GPU machine (the
# `device` tool), in one call of about 7 minutes (every stage has a timeout;
# the whole stays under 9):
#
#   run: bash scripts/device-pip.sh                  carry: [".deb"]
#
# (.deb holds the Debian packages the machine lacks; scripts/device-env.sh
# says which and unpacks them into /tmp/pfx, never into /.)
#
#  env     GPU, driver, python3, torch, pip, scikit-build-core, pybind11, cmake, nvcc
#  build   the tree (the CUDA engine through the driver API, dlopen libcuda.so.1):
#          library, shmcast-bench, GPU tests
#  pip     (in the background while ctest runs) python3 -m venv --system-site-packages
#          /tmp/venv, then /tmp/venv/bin/python -m pip install --no-build-isolation --no-index .
#  ctest   ctest -L gpu
#  bench   shmcast-bench --mode cuda, Qwen2.5-3B manifest, 2 x 256 MiB slots, twice,
#          --iters 6 each: 12 timed syncs (nothing else runs meanwhile)
#  pytest  from /tmp, out of the source tree: python/tests -m cuda against the installed
#          package, tests/gpu/python_no_gpu.py against it (driver library missing),
#          shmcast-inspect from the venv, the installed module's NEEDED entries
#
# Each stage's exit status is logged ("== stage NAME: rc=N") and a failing stage does not
# stop the next. $OUT gets (8 files at most come back): device-pip.log (everything, with
# set -x), summary.txt (also printed last), bench.jsonl, build.log, pip.log, ctest.log,
# pytest.log.
set -uo pipefail
cd "$(dirname "$0")/.."
SRC=$(pwd)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/device-pip.log") 2>&1
T0=$(date +%s)
log() { echo "== $(date +%T) (+$(( $(date +%s) - T0 ))s) $*"; }
STAGES=()
stage() {  # name, command...: runs it, logs and records its exit status, never fails
  local name=$1 t=$(date +%s) rc
  shift
  log "stage $name"
  "$@"
  rc=$?
  STAGES+=("$name: rc=$rc ($(( $(date +%s) - t )) s)")
  log "stage $name: rc=$rc"
  return 0
}
set -x

PY=$(command -v python3)
VER=$(sed -n 's/^project(shmcast VERSION \([0-9.]*\).*/\1/p' CMakeLists.txt)
DRV=/tmp/shmcast-driver
VENV=/tmp/venv
VPY=$VENV/bin/python
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

env_stage() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv
  uname -r; nproc; free -g | head -2; ulimit -l; df -h /dev/shm | tail -1
  "$PY" -c "import sys, torch; print(sys.version.split()[0], sys.executable, sys.prefix, sys.base_prefix); print('torch', torch.__version__, torch.version.cuda, torch.cuda.is_available())"
  "$PY" -m pip --version
  "$PY" -m pip show scikit-build-core pybind11 pytest 2>/dev/null | grep -E "^(Name|Version|Location)"
  cmake --version | head -1; ninja --version; nvcc --version | tail -2; gcc --version | head -1
  ls -l /usr/local/cuda/include/cuda.h
  ldconfig -p | grep -E "libcuda\.so|libcudart" | head -5
  git -C "$SRC" log --oneline -1 2>/dev/null || true
}
stage env env_stage
source scripts/device-env.sh
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)

build_stage() {  # the library, shmcast-bench and the GPU tests
  local targets=(shmcast-bench test_gpu test_gpu_absent test_cuda_driver)
  { timeout 300 cmake -S "$SRC" -B $DRV "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DSHMCAST_WITH_CUDA=ON \
      -DCUDAToolkit_ROOT=/usr/local/cuda -DSHMCAST_BUILD_PYTHON=OFF \
      -DSHMCAST_BUILD_TOOLS=OFF -DSHMCAST_BUILD_BENCH=ON -DSHMCAST_BUILD_TESTS=ON &&
      timeout 300 cmake --build $DRV -j8 --target "${targets[@]}"; } >"$OUT/build.log" 2>&1
  local r=$?
  echo "build rc=$r"
  grep -E "shmcast:" "$OUT/build.log"
  [ $r -eq 0 ] || grep -E "error|Error" -A3 "$OUT/build.log" | head -30
  echo "$DRV/lib/libshmcast.a undefined cu*/cuda* symbols:"; nm -u $DRV/lib/libshmcast.a 2>/dev/null | grep -E " (cu|cuda)[A-Z]" | sort -u | head -5
  [ $r -eq 0 ]
}
stage build build_stage

# The venv's system site-packages are its base interpreter's. The GPU machine's python3 is
# itself a virtual environment (torch, pip, scikit-build-core, pybind11 live in it), so the
# new venv also gets a .pth naming that environment's site-packages when it lacks them.
pip_stage() {
  rm -rf $VENV
  "$PY" -m venv --system-site-packages $VENV || "$PY" -m venv --without-pip --system-site-packages $VENV || return 1
  if ! $VPY -c "import torch, scikit_build_core, pip" 2>/dev/null; then
    local vsite
    vsite=$($VPY -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    "$PY" -c "import sysconfig; p = sysconfig.get_paths(); print(p['purelib']); print(p['platlib'])" | sort -u >"$vsite/_outer_site.pth"
    echo "added $vsite/_outer_site.pth:"; cat "$vsite/_outer_site.pth"
  fi
  $VPY -c "import sys, torch, scikit_build_core, pip; print(sys.prefix, 'torch', torch.__version__, 'scikit-build-core', scikit_build_core.__version__, 'pip', pip.__version__)" || return 1
  $VPY -m pybind11 --version || echo "no pybind11 Python package: CMake looks for pybind11's CMake package instead"
  # --no-index: nothing can be fetched here; torch must be found installed (the dependency).
  (cd "$SRC" && CMAKE_BUILD_PARALLEL_LEVEL=8 timeout 330 $VPY -m pip install -v --no-build-isolation --no-index .)
  local rc=$?
  if [ $rc -ne 0 ]; then
    echo "pip install --no-index failed (rc=$rc); again with --no-deps, to tell a dependency problem from a build one"
    (cd "$SRC" && CMAKE_BUILD_PARALLEL_LEVEL=8 timeout 200 $VPY -m pip install -v --no-build-isolation --no-index --no-deps .)
    echo "pip install --no-deps rc=$?"
  fi
  return $rc
}
log "pip install in the background (log: pip.log)"
( stage_t=$(date +%s); pip_stage; rc=$?; echo "pip stage rc=$rc ($(( $(date +%s) - stage_t )) s)"; exit $rc ) >"$OUT/pip.log" 2>&1 &
PIP_PID=$!

ctest_stage() {  # dir, label
  echo "######## ctest -L gpu: $2 ($1)" >>"$OUT/ctest.log"
  (cd "$1" && timeout 200 ctest -L gpu --output-on-failure --timeout 150) >>"$OUT/ctest.log" 2>&1
  local rc=$?
  (cd "$1" && ctest -L gpu -N | tail -1)
  sed -n "/######## ctest -L gpu: $2/,\$p" "$OUT/ctest.log" | grep -E "tests passed|tests failed|\*\*\*Failed|\*\*\*Skipped|Not Run|Timeout" | head -20
  return $rc
}
stage ctest ctest_stage $DRV driver

log "waiting for pip"
wait $PIP_PID
PIP_RC=$?
STAGES+=("pip install: rc=$PIP_RC")
log "stage pip: rc=$PIP_RC"
grep -E "scikit-build-core|Successfully|shmcast:|error|Error|pip stage rc" "$OUT/pip.log" | grep -v "^ *-- Installing" | head -30

J="$OUT/bench.jsonl"
: >"$J"
runb() {  # label, build dir
  local label=$1 B=$2
  timeout 150 "$B/bench/shmcast-bench" --mode cuda --manifest qwen2.5-3b --slot-bytes 256M --slots 2 --iters 6 \
    --json >/tmp/run.json 2>/tmp/run.err
  local rc=$?
  [ -s /tmp/run.err ] && tail -3 /tmp/run.err
  "$PY" - "$label" "$rc" /tmp/run.json >>"$J" <<'EOF'
import json, sys
label, rc, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
try:
    d = json.load(open(path))
except Exception as e:
    d = {"raw": open(path).read()[-2000:], "parse_error": str(e)}
d["label"], d["rc"] = label, rc
print(json.dumps(d))
EOF
  return $rc
}
bench_stage() {
  local rc=0
  runb driver $DRV || rc=1
  runb driver $DRV || rc=1
  return $rc
}
stage bench bench_stage

pytest_stage() {
  [ -x $VPY ] || return 1
  mkdir -p /tmp/pytest-run && cd /tmp/pytest-run || return 1
  local rc=0
  env -u PYTHONPATH $VPY -c "
import importlib.metadata as md, shmcast, shmcast._shmcast as m, shmcast._version as v
print('shmcast', shmcast.__version__, 'dist', md.version('shmcast'), 'engine', v.cuda_engine)
print(shmcast.__file__); print(m.__file__)
print('cuda_available', shmcast.cuda_available(), repr(shmcast.cuda_unavailable_reason()))
assert shmcast.__file__.startswith('$VENV/'), 'not the installed package'
assert shmcast.__version__ == md.version('shmcast') == '$VER', 'versions differ'
assert v.cuda_engine == 'driver', 'the pip build has no driver-API CUDA engine'
assert shmcast.cuda_available(), 'CUDA is not available to the installed package'
" || rc=1
  local so
  so=$(env -u PYTHONPATH $VPY -c "import shmcast._shmcast as m; print(m.__file__)")
  echo "NEEDED of $so:"; readelf -d "$so" | grep NEEDED
  readelf -d "$so" | grep -E "NEEDED.*lib(cuda|cudart)" && { echo "the installed module links a CUDA library"; rc=1; }
  ls -l $VENV/bin/shmcast-inspect && $VENV/bin/shmcast-inspect --help | head -3 && $VENV/bin/shmcast-inspect list || rc=1
  env -u PYTHONPATH timeout 240 $VPY -m pytest -q -ra -p no:cacheprovider -m cuda "$SRC/python/tests" >"$OUT/pytest.log" 2>&1
  local prc=$?
  echo "pytest -m cuda (installed package) rc=$prc"; tail -15 "$OUT/pytest.log"
  [ $prc -eq 0 ] || rc=1
  env -u PYTHONPATH SHMCAST_LIBCUDA=/nonexistent/libcuda.so.1 timeout 120 $VPY "$SRC/tests/gpu/python_no_gpu.py" \
    --version "$VER" --cuda-engine driver --expect-prefix $VENV >>"$OUT/pytest.log" 2>&1
  local nrc=$?
  echo "python_no_gpu.py, driver library missing, installed package: rc=$nrc"; grep -E "FAIL|all checks passed" "$OUT/pytest.log" | tail -3
  [ $nrc -eq 0 ] || rc=1
  return $rc
}
stage pytest pytest_stage
cd "$SRC"

set +x
"$PY" - "$J" "$OUT/ctest.log" <<'EOF' | tee "$OUT/summary.txt"
import json, re, statistics, sys
rows = []
for l in open(sys.argv[1]):
    if l.strip():
        rows.append(json.loads(l))
payload = None
per = {"driver": []}
for d in rows:
    if "raw" in d or d.get("rc") or not d.get("ok", False):
        print(f"bench {d['label']}: rc={d.get('rc')} ok={d.get('ok')} {d.get('error', '')} {d.get('parse_error', '')} "
              f"{d.get('raw', '')[-300:]}")
        continue
    payload = d.get("bytes")
    c, s = d["ceilings"], d.get("setup", {})
    print(f"bench {d['label']:8s}: median {d['gbps']:.2f} GB/s ({d['seconds'] * 1e3:.1f} ms), min {d['seconds_min'] * 1e3:.1f} "
          f"max {d['seconds_max'] * 1e3:.1f} ms, x ceiling {d.get('ratio', 0):.3f} (concurrent {c['concurrent_gbps']:.2f}, "
          f"D2H {c['d2h_gbps']:.2f}, H2D {c['h2d_gbps']:.2f} GB/s), create+pin {s.get('producer_create_pin_s_per_gib', 0):.3f} "
          f"s/GiB, library pin {s.get('pin_s_per_gib', 0):.3f} s/GiB (bench's own cudaHostRegister {c.get('pin_s_per_gib', 0):.3f}), "
          f"open+pin {s.get('consumer_open_pin_s_per_gib', 0):.3f} s/GiB, bit_exact {d.get('bit_exact')}")
    per[d["label"]] += list(d.get("seconds_all") or [])
for k, v in per.items():
    if v and payload:
        med = statistics.median(v)
        q = statistics.quantiles(v, n=4) if len(v) >= 4 else [min(v), med, max(v)]
        print(f"{k:8s}: {len(v)} timed syncs, median {med * 1e3:.1f} ms = {payload / med / 1e9:.2f} GB/s, "
              f"IQR {q[0] * 1e3:.1f}-{q[2] * 1e3:.1f} ms, range {min(v) * 1e3:.1f}-{max(v) * 1e3:.1f} ms")
text = open(sys.argv[2]).read() if sys.argv[2] else ""
for part in text.split("######## ")[1:]:
    head = part.splitlines()[0]
    m = re.search(r"\d+% tests passed, \d+ tests failed out of \d+", part)
    print(f"ctest {head}: {m.group(0) if m else 'no summary'}")
EOF
{
  echo "pytest -m cuda, installed package: $(grep -E "(passed|failed|skipped|error).* in [0-9.]+s" "$OUT/pytest.log" 2>/dev/null | head -1)"
  echo "python_no_gpu.py, installed package, no driver: $(grep -E "all checks passed|^FAIL" "$OUT/pytest.log" 2>/dev/null | tail -1)"
  echo "pip: $(grep -E "scikit-build-core [0-9.]+ using CMake|Successfully installed" "$OUT/pip.log" 2>/dev/null | sort -u | tr -s ' ' | tr '\n' ';')"
  echo "stages:"
  for s in "${STAGES[@]}"; do echo "  $s"; done
} | tee -a "$OUT/summary.txt"
log "done"
