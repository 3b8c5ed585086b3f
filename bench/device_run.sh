#!/usr/bin/env bash
# One call on the GPU machine (the `device` tool): build with CUDA, run the GPU
# and multi-process tests, then the benchmarks; logs and JSON go to $OUT.
#
#   run: bash bench/device_run.sh            carry: [".deb"]
#
# Packages the machine lacks are unpacked from .deb/ (apt-get download here)
# into /tmp/pfx, never into /. STAGES (default "env build test bench") picks
# stages; BENCH_SET picks bench runs (default "all").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
STAGES=${STAGES:-"env build test bench"}
BENCH_SET=${BENCH_SET:-"default sweep2 sweep3 sweep4 staging inline"}
GPU_TESTS_ONLY=${GPU_TESTS_ONLY:-0}
B=/tmp/shmcast-build
BENCH=$B/bench/shmcast-bench
log() { echo "== $(date +%T) $*"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }

# ---------------------------------------------------------------- machine and deps
{
  log machine
  nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current,clocks.sm,clocks.mem --format=csv 2>&1
  nvidia-smi topo -m 2>&1 | head -5
  lscpu | grep -E "Model name|^CPU\(s\)|Thread|Socket|NUMA node\(s\)|MHz" 2>&1
  free -g | head -2; uname -r; nproc; ulimit -l; df -h /dev/shm | tail -1
  nvcc --version | tail -1; gcc --version | head -1; cmake --version | head -1
  ls -d /usr/include/xxhash.h /usr/include/CLI /usr/include/nlohmann /usr/include/boost/interprocess /usr/include/gtest 2>&1
  ls /usr/lib/x86_64-linux-gnu/libgtest* /usr/lib/x86_64-linux-gnu/cmake 2>&1 | head -20
} >"$OUT/env.log" 2>&1

source scripts/device-env.sh >>"$OUT/env.log" 2>&1
ls $PFX/usr/include 2>/dev/null | tr '\n' ' ' >>"$OUT/env.log"

# ---------------------------------------------------------------- build
if has build; then
  log build
  gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
  { cmake -S . -B $B "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DSHMCAST_WITH_CUDA=ON -DSHMCAST_BUILD_PYTHON=OFF \
      -DSHMCAST_BUILD_TOOLS=OFF -DCUDAToolkit_ROOT=/usr/local/cuda \
    && cmake --build $B -j16; } >"$OUT/build.log" 2>&1
  rc=$?
  tail -3 "$OUT/build.log"
  if [ $rc -ne 0 ]; then grep -E "error|Error" -A3 "$OUT/build.log" | head -60; echo "BUILD FAILED"; exit 1; fi
fi

# ---------------------------------------------------------------- tests
if has test; then
  log tests
  (cd $B && timeout 300 ctest -L gpu --output-on-failure --timeout 240) >"$OUT/tests.log" 2>&1
  echo "gpu tests rc=$?"; grep -E "tests passed|tests failed|Failed|\*\*\*" "$OUT/tests.log" | head -20
  [ "$GPU_TESTS_ONLY" = 1 ] || (cd $B && timeout 240 ctest -L multiprocess -j8 --output-on-failure --timeout 200) >>"$OUT/tests.log" 2>&1
  echo "multiprocess tests rc=$?"; grep -E "tests passed|tests failed" "$OUT/tests.log" | tail -1
fi

# ---------------------------------------------------------------- benchmarks
if has bench; then
  J="$OUT/bench.jsonl"
  : >"$J"
  runb() {  # label, timeout, args...
    local label=$1 to=$2; shift 2
    log "bench $label: ${RUN_ENV:-} shmcast-bench $*"
    local t0=$(date +%s.%N)
    env ${RUN_ENV:-} timeout "$to" "$BENCH" "$@" --json >"$OUT/run.json" 2>"$OUT/run.err"
    local rc=$?
    echo "   rc=$rc $(python3 -c "print(round($(date +%s.%N)-$t0,1))") s"
    [ -s "$OUT/run.err" ] && tail -3 "$OUT/run.err"
    python3 -c '
import json, sys
label, rc, args, path = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
txt = open(path).read().strip()
try:
    d = json.loads(txt)
except Exception:
    d = {"raw": txt[-2000:]}
d["label"], d["rc"], d["args"] = label, rc, args
d["env"] = sys.argv[5]
print(json.dumps(d))' "$label" "$rc" "$*" "$OUT/run.json" "${RUN_ENV:-}" >>"$J"
    rm -f "$OUT/run.json" "$OUT/run.err"
  }
  sel() { [ "$BENCH_SET" = all ] || [[ " $BENCH_SET " == *" $1 "* ]]; }
  sel default && runb default 120 --mode cuda --iters 7 --checksums
  sel sweep2 && runb sweep-k2 300 --mode cuda --iters 7 --sweep-slots 64M,128M,256M,512M,1G
  sel sweep3 && runb sweep-k3 200 --mode cuda --iters 7 --slots 3 --sweep-slots 64M,128M,256M
  sel sweep4 && runb sweep-k4 150 --mode cuda --iters 7 --slots 4 --sweep-slots 64M,128M
  sel staging && runb staging 120 --mode cuda --iters 7 --staging
  sel inline && RUN_ENV=SHMCAST_CUDA_CALLBACKS=inline runb inline-callbacks 120 --mode cuda --iters 7
  sel h2d2 && RUN_ENV=SHMCAST_CUDA_H2D_STREAMS=2 runb h2d-2streams 120 --mode cuda --iters 7
  sel h2d2d2h2 && RUN_ENV="SHMCAST_CUDA_H2D_STREAMS=2 SHMCAST_CUDA_D2H_STREAMS=2" runb both-2streams 120 --mode cuda --iters 7
  sel h2d2k4 && RUN_ENV=SHMCAST_CUDA_H2D_STREAMS=2 runb h2d-2streams-k4 120 --mode cuda --iters 7 --slots 4 --slot-bytes 128M
  sel h2d2sweep && RUN_ENV=SHMCAST_CUDA_H2D_STREAMS=2 runb h2d-2streams-sweep-k2 300 --mode cuda --iters 7 --sweep-slots 64M,128M,256M,512M,1G
  sel host && runb host 200 --mode host --checksums
  python3 - "$J" <<'EOF' | tee "$OUT/summary.txt"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
for d in rows:
    if "raw" in d:
        print(f"{d['label']}: rc={d['rc']} output: {d['raw'][-300:]}"); continue
    if d.get("mode") == "host":
        print(f"{d['label']}: {d['gbps']:.2f} GB/s vs memcpy {d['memcpy_gbps']:.2f} (ratio {d['ratio']:.2f}); "
              f"rt median {d['roundtrip_us_median']:.1f} us p99 {d['roundtrip_us_p99']:.1f}; "
              f"checksums {d.get('checksums_gbps', 0):.2f} GB/s; bit_exact {d.get('bit_exact')}")
        continue
    c = d["ceilings"]
    print(f"{d['label']} {d.get('env','')} ceilings: D2H {c['d2h_gbps']:.2f} H2D {c['h2d_gbps']:.2f} "
          f"both {c['concurrent_gbps']:.2f} (D2H {c['concurrent_d2h_gbps']:.2f}, H2D {c['concurrent_h2d_gbps']:.2f}); "
          f"H2D/2 {c.get('h2d_2streams_gbps',0):.2f} both/2 {c.get('concurrent_h2d_2streams_gbps',0):.2f} "
          f"(D2H {c.get('concurrent_h2d_2streams_d2h_gbps',0):.2f}, H2D {c.get('concurrent_h2d_2streams_h2d_gbps',0):.2f}) GB/s; "
          f"pin {c['pin_s_per_gib']:.3f} s/GiB")
    runs = d.get("sweep") or [d]
    for r in runs:
        if not r.get("ok", True):
            print(f"   slot {r['slot_bytes']>>20}M: FAILED {r.get('error')}"); continue
        s = r["setup"]
        print(f"   slot {r['slot_bytes']>>20:5d}M x{r['slots']}: {r['seconds']*1e3:7.1f} ms  {r['gbps']:6.2f} GB/s  "
              f"x{r['gbps']/c['concurrent_gbps']:.3f}  prod {r['producer_gbps']:.2f} GB/s  "
              f"min {r['seconds_min']*1e3:.1f} max {r['seconds_max']*1e3:.1f} ms  bit_exact {r.get('bit_exact')}  "
              f"create+pin {s['producer_create_pin_s_per_gib']:.3f} s/GiB  open+pin {s.get('consumer_open_pin_s_per_gib',0):.3f} s/GiB")
    if "checksums_gbps" in d:
        print(f"   with checksums: {d['checksums_gbps']:.2f} GB/s")
EOF
fi
log done
