#!/usr/bin/env bash
# One call on the one-GPU machine (the `device` tool, kind nvidia-h200): build
# with CUDA and the Python module, then every bench that sends fresh random
# bytes and checks every byte of every timed sync, each figure over REPS (10)
# repetitions with its ceiling measured again for each configuration. In $OUT
# (at most 8 files come back): device_run.log (this output), env.log,
# build.log, [tests.log,] bench.jsonl (one JSON object per run), summary.txt,
# e2e_results.json, logs.tar.gz (each run's JSON and stderr, the e2e tables).
# Estimated 5-6 minutes on an H200 (build 1-2), not yet timed there.
#
#   run: bash bench/device_run.sh            carry: [".deb"]   kind: nvidia-h200
#
# Packages the machine lacks are unpacked from .deb/ (apt-get download here,
# see scripts/device-env.sh; the GPU machine has no xxhash headers) into
# /tmp/pfx, never into /. The device tool sends the checkout its session was
# started in: .deb/ and this script's version must be there.
#   STAGES     default "env build bench"; add "test" for ctest -L gpu and the
#              multi-process tier (builds the tests too: minutes more; best in
#              its own call, STAGES="env build test")
#   BENCH_SET  default "default sweep2 sweep3 sweep4 staging inline host python e2e";
#              also h2d2 h2d2d2h2 h2d2k4 h2d2sweep (the copy-stream experiments)
#   REPS       timed syncs per configuration, and copies per ceiling (default 10)
#   BUDGET_S   bench runs that would start after this many seconds are skipped
#              (default 470), so that the call ends inside the device's 10 minutes
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/device_run.log") 2>&1
STAGES=${STAGES:-"env build bench"}
BENCH_SET=${BENCH_SET:-"default sweep2 sweep3 sweep4 staging inline host python e2e"}
REPS=${REPS:-10}
BUDGET_S=${BUDGET_S:-470}
GPU_TESTS_ONLY=${GPU_TESTS_ONLY:-0}
B=/tmp/shmcast-build
BENCH=$B/bench/shmcast-bench
T0=$(date +%s)
log() { echo "== $(date +%T) (+$(( $(date +%s) - T0 )) s) $*"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }
sel() { [ "$BENCH_SET" = all ] || [[ " $BENCH_SET " == *" $1 "* ]]; }
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }

# ---------------------------------------------------------------- machine and deps
{
  log machine
  nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current,clocks.sm,clocks.mem --format=csv 2>&1
  nvidia-smi topo -m 2>&1 | head -5
  lscpu | grep -E "Model name|^CPU\(s\)|Thread|Socket|NUMA node\(s\)|MHz" 2>&1
  free -g | head -2; uname -r; nproc; ulimit -l; df -h /dev/shm | tail -1; uptime
  nvcc --version | tail -1; gcc --version | head -1; cmake --version | head -1
  ls -d /usr/include/xxhash.h /usr/include/CLI /usr/include/nlohmann /usr/include/boost/interprocess /usr/include/gtest 2>&1
} >"$OUT/env.log" 2>&1

source scripts/device-env.sh >>"$OUT/env.log" 2>&1
PY=$(command -v python3)
PB=$($PY -m pybind11 --cmakedir 2>/dev/null)
$PY -c "import sys, torch; print('python', sys.version.split()[0], sys.executable, 'torch', torch.__version__, torch.version.cuda, torch.cuda.is_available())" >>"$OUT/env.log" 2>&1
echo "pybind11 cmake dir: ${PB:-none}" >>"$OUT/env.log"
export PATH=/usr/local/cuda/bin:$PATH

# ---------------------------------------------------------------- build
if has build; then
  log build
  gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
  tests=OFF; has test && tests=ON
  targets=(--target shmcast-bench _shmcast); [ $tests = ON ] && targets=()
  { cmake -S . -B $B "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DSHMCAST_WITH_CUDA=ON -DCUDAToolkit_ROOT=/usr/local/cuda \
      -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc -DSHMCAST_BUILD_PYTHON=ON -DPython3_EXECUTABLE="$PY" \
      ${PB:+-Dpybind11_DIR=$PB} -DSHMCAST_BUILD_TESTS=$tests -DSHMCAST_BUILD_TOOLS=OFF \
    && cmake --build $B -j"$(nproc)" "${targets[@]}"; } >"$OUT/build.log" 2>&1
  rc=$?
  grep -E "shmcast:" "$OUT/build.log"; tail -2 "$OUT/build.log"
  if [ $rc -ne 0 ]; then grep -E "error|Error" -A3 "$OUT/build.log" | head -60; echo "BUILD FAILED"; exit 1; fi
fi
export PYTHONPATH=$B/python${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1

# ---------------------------------------------------------------- tests
if has test; then
  log tests
  (cd $B && timeout 300 ctest -L gpu --output-on-failure --timeout 240) >"$OUT/tests.log" 2>&1
  echo "gpu tests rc=$?"; grep -E "tests passed|tests failed|Failed|\*\*\*|Skipped" "$OUT/tests.log" | head -20
  [ "$GPU_TESTS_ONLY" = 1 ] || (cd $B && timeout 240 ctest -L multiprocess -j8 --output-on-failure --timeout 200) >>"$OUT/tests.log" 2>&1
  echo "multiprocess tests rc=$?"; grep -E "tests passed|tests failed" "$OUT/tests.log" | tail -1
fi

# ---------------------------------------------------------------- benchmarks
if has bench; then
  J="$OUT/bench.jsonl"
  : >"$J"
  L=/tmp/shmcast-bench-logs
  rm -rf $L
  mkdir -p $L
  record() {  # label, rc, args, json file, env
    python3 -c '
import json, sys
label, rc, args, path, env = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
txt = open(path).read().strip() if path else ""
try:
    d = json.loads(txt.splitlines()[-1])
except Exception:
    d = {"raw": txt[-2000:]}
d["label"], d["rc"], d["args"], d["env"] = label, rc, args, env
print(json.dumps(d))' "$@" >>"$J"
  }
  skip() { echo "   SKIPPED $1: $(left) s of the budget left, needs about $2 s"; record "$1" 125 "skipped: budget" "" ""; }
  runb() {  # label, est. seconds, timeout, shmcast-bench args...
    local label=$1 est=$2 to=$3; shift 3
    [ "$(left)" -lt "$est" ] && { skip "$label" "$est"; return; }
    log "bench $label: ${RUN_ENV:-} shmcast-bench $* --json"
    local t0=$(date +%s)
    env ${RUN_ENV:-} timeout "$to" "$BENCH" "$@" --json >"$L/$label.json" 2>"$L/$label.err"
    local rc=$?
    echo "   rc=$rc $(( $(date +%s) - t0 )) s"
    [ -s "$L/$label.err" ] && tail -3 "$L/$label.err"
    record "$label" $rc "$*" "$L/$label.json" "${RUN_ENV:-}"
  }
  R=(--reps "$REPS" --ceiling-reps "$REPS")
  sel default && runb default 30 120 --mode cuda "${R[@]}" --checksums
  sel sweep2 && runb sweep-k2 45 240 --mode cuda "${R[@]}" --sweep-slots 64M,128M,256M,512M,1G
  sel sweep3 && runb sweep-k3 30 180 --mode cuda "${R[@]}" --slots 3 --sweep-slots 64M,128M,256M
  sel sweep4 && runb sweep-k4 20 150 --mode cuda "${R[@]}" --slots 4 --sweep-slots 64M,128M
  sel staging && runb staging 15 120 --mode cuda "${R[@]}" --staging
  sel inline && RUN_ENV=SHMCAST_CUDA_CALLBACKS=inline runb inline-callbacks 15 120 --mode cuda "${R[@]}"
  sel h2d2 && RUN_ENV=SHMCAST_CUDA_H2D_STREAMS=2 runb h2d-2streams 15 120 --mode cuda "${R[@]}"
  sel h2d2d2h2 && RUN_ENV="SHMCAST_CUDA_H2D_STREAMS=2 SHMCAST_CUDA_D2H_STREAMS=2" runb both-2streams 15 120 --mode cuda "${R[@]}"
  sel h2d2k4 && RUN_ENV=SHMCAST_CUDA_H2D_STREAMS=2 runb h2d-2streams-k4 15 120 --mode cuda "${R[@]}" --slots 4 --slot-bytes 128M
  sel h2d2sweep && RUN_ENV=SHMCAST_CUDA_H2D_STREAMS=2 runb h2d-2streams-sweep-k2 45 240 --mode cuda "${R[@]}" --sweep-slots 64M,128M,256M,512M,1G
  sel host && runb host 40 200 --mode host "${R[@]}" --checksums

  # Python API (python/bench_python.py), same GPU, both receive modes.
  if sel python; then
    for mode in copy staging; do
      label=python-$mode
      if [ "$(left)" -lt 30 ]; then skip $label 30; continue; fi
      log "bench $label: bench_python.py --device cuda:0 --mode $mode --reps $REPS --json"
      t0=$(date +%s)
      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 120 "$PY" python/bench_python.py --device cuda:0 \
        --mode $mode --reps "$REPS" --ceiling-reps "$REPS" --json >"$L/$label.json" 2>"$L/$label.err"
      rc=$?
      echo "   rc=$rc $(( $(date +%s) - t0 )) s"; [ -s "$L/$label.err" ] && tail -3 "$L/$label.err"
      record $label $rc "--mode $mode --reps $REPS" "$L/$label.json" "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    done
  fi

  # End to end (bench/e2e): shmcast through the Python API into preallocated
  # parameters, default allocator and expandable segments, plus the ceilings (d).
  if sel e2e; then
    if [ "$(left)" -lt 60 ]; then skip e2e 60; else
      log "bench e2e: weight_sync_bench.py --only d,c --reps-fast $REPS --ceiling-reps $REPS"
      t0=$(date +%s)
      MACHINE="$($PY -c "import torch; print(torch.cuda.get_device_name(0))" 2>/dev/null) x1"
      timeout $(( $(left) + 60 )) "$PY" bench/e2e/weight_sync_bench.py --out "$L/e2e" --machine "$MACHINE" \
        --only d,c --reps-fast "$REPS" --ceiling-reps "$REPS" --budget-s "$(( $(left) + 30 ))" >"$L/e2e.log" 2>&1
      rc=$?
      echo "   rc=$rc $(( $(date +%s) - t0 )) s"; grep -E "^\[|MISMATCH|Error" "$L/e2e.log" | tail -12
      record e2e $rc "--only d,c --reps-fast $REPS" "" ""
    fi
  fi

  [ -f $L/e2e/results.json ] && cp $L/e2e/results.json "$OUT/e2e_results.json"
  tar -czf "$OUT/logs.tar.gz" -C $L . 2>/dev/null
  python3 - "$J" "$L/e2e/results.json" <<'EOF' | tee "$OUT/summary.txt"
import json, os, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
def st(d, k, f="{:.2f}"):
    if d.get(k) is None:
        return "-"
    return (f + " (" + f + "-" + f + ")").format(d[k], d.get(k + "_min", d[k]), d.get(k + "_max", d[k]))
bad = 0
for d in rows:
    lab = d["label"]
    if d["rc"] == 125:
        print(f"{lab}: skipped (time budget)"); continue
    if d["rc"] != 0:
        bad += 1
    if "raw" in d:
        print(f"{lab}: rc={d['rc']}" + (f" output: {d['raw'][-300:]}" if d["raw"] else "")); continue
    if lab.startswith("python-"):
        print(f"{lab}: {st(d, 'gbps')} GB/s, {st(d, 'sync_ms', '{:.1f}')} ms; ceiling {st(d, 'ceiling_gbps')} "
              f"(ratio {d.get('ratio')}); Python overhead send {st(d, 'send_python_overhead_ms', '{:.2f}')} ms, "
              f"receive {st(d, 'receive_python_overhead_ms', '{:.2f}')} ms; verified {d.get('verified')} rc={d['rc']}")
        continue
    if d.get("mode") == "host":
        print(f"{lab}: {st(d, 'gbps')} GB/s vs memcpy {st(d, 'memcpy_gbps')} (ratio {d['ratio']:.2f}); "
              f"round trip b2b {d['roundtrip_us_median']:.1f} us ({d['roundtrip_us_min']:.1f}-{d['roundtrip_us_max']:.1f}), "
              f"idle {d['roundtrip_idle_us_median']:.1f} us ({d['roundtrip_idle_us_min']:.1f}-{d['roundtrip_idle_us_max']:.1f}); "
              f"verified {d.get('verified')}, round trips {d.get('roundtrip_verified')}; "
              f"checksums {d.get('checksums_gbps', 0):.2f} GB/s rc={d['rc']}")
        continue
    print(f"{lab} {d.get('env', '')} rc={d['rc']}")
    runs = d.get("sweep") or [d]
    if "checksums" in d:
        runs = runs + [dict(d["checksums"], label="with checksums")]
    for r in runs:
        if not r.get("ok", True):
            print(f"   slot {r['slot_bytes'] >> 20}M: FAILED {r.get('error')}"); continue
        c = r["ceilings"]
        s = r["setup"]
        print(f"   {r.get('label', '')}slot {r['slot_bytes'] >> 20:5d}M x{r['slots']}: {st(r, 'gbps')} GB/s "
              f"({r['seconds'] * 1e3:.1f} ms)  x{r['ratio']:.3f} of concurrent {st(c, 'concurrent_gbps')} "
              f"[D2H {c['d2h_gbps']:.2f}, H2D {c['h2d_gbps']:.2f}, at once D2H {c['concurrent_d2h_gbps']:.2f} "
              f"H2D {c['concurrent_h2d_gbps']:.2f}]  verified {r.get('verified')}  "
              f"create+pin {s['producer_create_pin_s_per_gib']:.3f} s/GiB")
e2e = sys.argv[2]
if os.path.exists(e2e):
    res = json.load(open(e2e))
    c = res.get("ceilings") or {}
    if c.get("both_gbps"):
        print(f"e2e (d): D2H {c['d2h_gbps']:.2f} H2D {c['h2d_gbps']:.2f} at once {c['both_gbps']:.2f} GB/s "
              f"({c['both_gbps_min']:.2f}-{c['both_gbps_max']:.2f})")
    for g in res.get("groups", []):
        for t in g.get("tasks", []):
            if t.get("kind") == "sync":
                cb = (t.get("ceiling") or {}).get("both_gbps")
                print(f"e2e {g['name']}/{t['label']}: " + (f"{t['median_s']:.4f} s ({t['min_s']:.4f}-{t['max_s']:.4f}) "
                      f"{t['gbps']:.2f} GB/s" if t.get("median_s") else "no result")
                      + (f", x{t['gbps'] / cb:.3f} of {cb:.2f} GB/s measured just before" if cb and t.get("gbps") else "")
                      + f"; verified {t.get('verified')}" + (f"; errors {t['errors'][:1]}" if t.get("errors") else ""))
print(f"runs with a non-zero exit: {bad}")
EOF
fi
log done
