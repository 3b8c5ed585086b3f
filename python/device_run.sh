#!/usr/bin/env bash
# One call on the GPU machine (the `device` tool) for the Python package:
# build shmcast with CUDA plus the Python module for the machine's python3,
# run the Python CUDA tests (and the CPU tests that need a newer torch: float8,
# uint16..64), the example, then the Python bench next to the C++ bench in the
# same run. Logs and JSON go to $OUT.
#
#   run: bash python/device_run.sh              carry: [".deb"]
#
# Packages the machine lacks are unpacked from .deb/ (apt-get download here)
# into /tmp/pfx, never into /. STAGES (default "build test example bench")
# picks stages. The extra stage "frameworks" (not in the default) runs
# python/tests/gpu_vllm_contract.py (the vLLM weight-transfer backend with a
# real transformers model: bit-identical logits, colocated and, with two GPUs,
# disaggregated) and the framework contract tests with the GPUs present:
#   run: STAGES="build frameworks" bash python/device_run.sh   carry: [".deb"]
# The extra stage "real" lists which of vllm, sglang, verl, roll the machine's
# python3 has and, for those, runs python/tests/test_framework_api.py against
# the installed package (SHMCAST_REAL_FRAMEWORKS=1: conftest puts the stand-ins
# last, so an installed framework wins; pytest's header says which was used):
#   run: STAGES="build real" bash python/device_run.sh          carry: [".deb"]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
STAGES=${STAGES:-"build test bench example"}
B=${B:-/tmp/shmcast-pybuild}
PY=$(command -v python3)
log() { echo "== $(date +%T) $*"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }

{
  log machine
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  lscpu | grep -E "Model name|^CPU\(s\)" 2>&1
  free -g | head -2; uname -r; ulimit -l; df -h /dev/shm | tail -1
  "$PY" -c "import sys, torch; print(sys.version.split()[0], sys.executable, 'torch', torch.__version__, torch.version.cuda, torch.cuda.is_available())"
  "$PY" -m pybind11 --version 2>&1; "$PY" -m pytest --version 2>&1
  nvcc --version | tail -1; gcc --version | head -1; cmake --version | head -1
} >"$OUT/env.log" 2>&1

source scripts/device-env.sh >>"$OUT/env.log" 2>&1

if has build; then
  log build
  gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
  { cmake -S . -B $B "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DSHMCAST_WITH_CUDA=ON -DCUDAToolkit_ROOT=/usr/local/cuda \
      -DSHMCAST_BUILD_PYTHON=ON -DPython3_EXECUTABLE="$PY" -DSHMCAST_BUILD_TESTS=OFF -DSHMCAST_BUILD_TOOLS=OFF \
    && cmake --build $B -j16 --target _shmcast shmcast-bench; } >"$OUT/build.log" 2>&1
  rc=$?
  grep -E "shmcast:" "$OUT/build.log"; tail -2 "$OUT/build.log"
  if [ $rc -ne 0 ]; then grep -E "error|Error" -A3 "$OUT/build.log" | head -60; echo "BUILD FAILED"; exit 1; fi
fi
export PYTHONPATH=$B/python
export PYTHONUNBUFFERED=1

if has test; then
  log "pytest -m cuda"
  timeout 150 "$PY" -m pytest -q -ra -p no:cacheprovider -m cuda python/tests >"$OUT/tests.log" 2>&1
  echo "cuda tests rc=$?"; tail -15 "$OUT/tests.log"
fi

if has bench; then
  J="$OUT/bench.jsonl"
  : >"$J"
  log "bench: C++ shmcast-bench --mode cuda --reps 10"
  timeout 120 $B/bench/shmcast-bench --mode cuda --reps 10 --json >"$OUT/run.json" 2>>"$OUT/bench.err"
  echo "rc=$?"; python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); d["label"]="cxx"; print(json.dumps(d))' "$OUT/run.json" >>"$J"
  for mode in copy staging; do
    log "bench: python bench_python.py --device cuda --mode $mode --reps 10"
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 120 "$PY" python/bench_python.py --device cuda:0 \
      --mode $mode --reps 10 --json >"$OUT/run.json" 2>>"$OUT/bench.err"
    echo "rc=$?"; python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); d["label"]="python-"+sys.argv[2]; print(json.dumps(d))' "$OUT/run.json" "$mode" >>"$J"
  done
  rm -f "$OUT/run.json"
  python3 - "$J" <<'EOF' | tee "$OUT/summary.txt"
import json, sys
rows = {}
for l in open(sys.argv[1]):
    if l.strip():
        d = json.loads(l); rows[d["label"]] = d
c = rows.get("cxx", {})
cx = c.get("gbps")
if cx:
    ce = c["ceilings"]
    print(f"C++ shmcast-bench: {cx:.2f} GB/s ({c.get('seconds', 0)*1e3:.1f} ms per sync), concurrent ceiling "
          f"{ce['concurrent_gbps']:.2f} GB/s, verified {c.get('verified')}")
for m in ("copy", "staging"):
    p = rows.get("python-" + m)
    if not p:
        continue
    ratio = f" = {p['gbps'] / cx:.3f} x C++" if cx else ""
    print(f"Python ({m}): {p['gbps']:.2f} GB/s ({p['sync_ms']:.1f} ms per sync){ratio}; "
          f"send {p['send_ms']:.1f} ms (C++ {p['send_cxx_ms']:.1f}, Python overhead {p['send_python_overhead_ms']:.3f} ms); "
          f"receive {p['receive_ms']:.1f} ms (C++ {p['receive_cxx_ms']:.1f}, Python overhead "
          f"{p['receive_python_overhead_ms']:.3f} ms); verified {p.get('verified')}")
EOF
fi
if has example; then
  log example
  timeout 60 "$PY" python/examples/trainer_to_worker.py >"$OUT/example.log" 2>&1
  echo "example rc=$?"; cat "$OUT/example.log" | tail -6
fi

if has test; then
  log "pytest (CPU) dtypes and receive_into with this torch (float8, uint16..64)"
  timeout 90 "$PY" -m pytest -q -ra -p no:cacheprovider -m "not cuda" -k "dtype or receive_into_preallocated" \
    python/tests >>"$OUT/tests.log" 2>&1
  echo "cpu tests rc=$?"; tail -3 "$OUT/tests.log"
fi

if has frameworks; then
  log "frameworks: gpu_vllm_contract.py (transformers model, bit-identical logits)"
  timeout 300 "$PY" python/tests/gpu_vllm_contract.py --out "$OUT/frameworks.json" >"$OUT/frameworks.log" 2>&1
  echo "gpu_vllm_contract rc=$?"; tail -12 "$OUT/frameworks.log"
  log "frameworks: contract tests (verl places its processes on the GPUs)"
  timeout 240 "$PY" -m pytest -q -ra -p no:cacheprovider -m "not cuda" \
    python/tests/test_vllm_transfer.py python/tests/test_verl.py python/tests/test_sglang.py \
    python/tests/test_tp_slicing.py >>"$OUT/frameworks.log" 2>&1
  echo "framework contract tests rc=$? (TP=2 'direct' cases need Consumer.receive_into(slices=...))"
  tail -6 "$OUT/frameworks.log"
fi

if has real; then
  log "real frameworks: which are installed"
  "$PY" -m pip list 2>/dev/null | grep -iE '^(vllm|sglang|verl|roll) ' | tee "$OUT/real.log"
  if [ -s "$OUT/real.log" ]; then
    SHMCAST_REAL_FRAMEWORKS=1 timeout 300 "$PY" -m pytest -v -ra -p no:cacheprovider \
      python/tests/test_framework_api.py >>"$OUT/real.log" 2>&1
    echo "test_framework_api against the installed frameworks rc=$?"
    grep -E "^frameworks:|PASSED|FAILED|SKIPPED|ERROR" "$OUT/real.log" | head -40
  else
    echo "none of vllm, sglang, verl, roll is installed in $PY"
  fi
fi

log done
