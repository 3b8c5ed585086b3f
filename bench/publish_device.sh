#!/usr/bin/env bash
# The checkpoint publish bench on the GPU machine (one call, kind
# nvidia-h200; the GPU itself is not used): build shmcast-publish, the bench
# helper and the fileio tests (Release, no CUDA), run bench/publish_bench.sh
# on a 6,171,877,376-byte Qwen2.5-3B-shaped bf16 checkpoint (434 tensors, one
# file) made on the local disk: cold publish vs fio O_DIRECT, warm publish vs
# single-thread memcpy, safetensors.torch.load_file cold and warm, --io pread
# and inline/async io_uring variants, 1/2/4 host consumers, every figure REPS
# (10) times; then `ctest -L fileio` and the PublishSeccomp tests on that
# machine's disk and kernel.
#
#   run: bash bench/publish_device.sh        carry: [".deb"]        kind: nvidia-h200
#
# Not yet run there; estimated 6-8 minutes (build 1-2, checkpoint 0.5-1,
# bench 4-5). Results in $OUT: publish_device.log (this output), env.txt,
# summary.txt (the table), bench.jsonl (every repetition), tests.log.
#
# Packages the machine lacks are unpacked from .deb/ into /tmp/pfx (see
# scripts/device-env.sh: xxhash, CLI11, nlohmann-json, boost, gtest,
# liburing, ...). fio: the machine's own if it has one, else Debian 12's fio
# and the libraries it loads, unpacked into /tmp/pfx-fio and used by fio
# alone (LD_LIBRARY_PATH for that command only). Fetch them here with
#   mkdir -p .deb/fio && cd .deb/fio && apt-get download fio $(
#     for l in $(ldd /usr/bin/fio | awk '/=> \//{print $3}'); do
#       dpkg -S "$l" 2>/dev/null || dpkg -S "$(readlink -f "$l")" 2>/dev/null || dpkg -S "/usr$l"; done |
#     cut -d: -f1 | sort -u | grep -vx -e libc6 -e libgcc-s1 -e libstdc++6 -e zlib1g)
# (about 38 MB; apt-get install fio first so that ldd can see its libraries).
# Without fio the cold reference is `dd iflag=direct bs=64M`, and the
# summary says so.
#
# Environment: STAGES (default "env build bench test": the numbers first), BENCH_STAGES (the
# STAGES of bench/publish_bench.sh, default all), REPS (10), LAYERS
# (36), CONSUMERS ("1 2 4"), CKPT_DIR (default /var/tmp/shmcast-publish-bench:
# a disk, never /dev/shm), plus those of bench/publish_bench.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/publish_device.log") 2>&1
STAGES=${STAGES:-"env build bench test"}
B=${B:-/tmp/shmcast-publish-build}
T0=$(date +%s)
log() { echo "== $(date +%T) (+$(($(date +%s) - T0)) s) $*"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }

if has env; then
  log machine
  { lscpu | grep -E "Model name|^CPU\(s\)"; free -g | head -2; uname -r; df -hT / /var/tmp /tmp /dev/shm;
    lsblk -d -o NAME,MODEL,ROTA,SIZE,TRAN 2>/dev/null; ulimit -l; cat /sys/kernel/mm/transparent_hugepage/enabled;
    cmake --version | head -1; gcc --version | head -1; } 2>&1 | tee "$OUT/machine.txt"
fi
source scripts/device-env.sh >>"$OUT/machine.txt" 2>&1

# fio: the machine's, else the carried Debian one.
if [ -z "${FIO:-}" ]; then
  if command -v fio >/dev/null; then
    FIO=fio
  elif ls .deb/fio/fio_*.deb >/dev/null 2>&1; then
    for f in .deb/fio/*.deb; do dpkg -x "$f" /tmp/pfx-fio; done
    L=/tmp/pfx-fio/usr/lib/x86_64-linux-gnu:/tmp/pfx-fio/lib/x86_64-linux-gnu:/tmp/pfx-fio/usr/lib/x86_64-linux-gnu/ceph
    FIO="env LD_LIBRARY_PATH=$L /tmp/pfx-fio/usr/bin/fio"
  else
    FIO=fio
  fi
fi
if $FIO --version >/dev/null 2>&1; then log "fio: $($FIO --version)"; else log "fio: not usable here ($FIO): dd is the cold reference"; fi
export FIO

if has build; then
  log build
  gen=()
  command -v ninja >/dev/null && gen=(-G Ninja)
  targets=(shmcast-publish shmcast-publish-ref)
  has test && targets+=(test_fileio test_publish shmcast-inspect fuzz_safetensors_replay test_publish_seccomp)
  { cmake -S . -B "$B" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DSHMCAST_WITH_CUDA=OFF -DSHMCAST_BUILD_PYTHON=OFF \
      -DSHMCAST_BUILD_TESTS=ON && cmake --build "$B" -j"$(nproc)" --target "${targets[@]}"; } >"$OUT/build.log" 2>&1
  rc=$?
  grep -E "shmcast:" "$OUT/build.log"
  if [ $rc -ne 0 ]; then grep -E "error|Error" -A3 "$OUT/build.log" | head -40; echo "BUILD FAILED"; exit 1; fi
fi

if has bench; then
  log "bench/publish_bench.sh"
  STAGES=${BENCH_STAGES:-"env gen fio cold warm store memcpy python variants consumers"} \
  BUILD=$B OUT=$OUT REPS=${REPS:-10} LAYERS=${LAYERS:-36} CONSUMERS=${CONSUMERS:-"1 2 4"} \
    CKPT_DIR=${CKPT_DIR:-/var/tmp/shmcast-publish-bench} bash bench/publish_bench.sh
  rc=$?
  [ $rc -eq 0 ] || echo "publish_bench.sh exited $rc"
  rm -rf "${CKPT_DIR:-/var/tmp/shmcast-publish-bench}"  # 6 GB of the machine's 64 GiB disk
fi
if has test; then
  log "ctest -L fileio and PublishSeccomp (on this machine's disk: SHMCAST_TEST_TMPDIR=${SHMCAST_TEST_TMPDIR:-/var/tmp})"
  (cd "$B" && SHMCAST_TEST_TMPDIR=${SHMCAST_TEST_TMPDIR:-/var/tmp} ctest -L fileio -j4 --timeout 300 --output-on-failure &&
     ctest -R '^PublishSeccomp' --timeout 300 --output-on-failure) >"$OUT/tests.log" 2>&1
  grep -E "tests passed|tests failed" "$OUT/tests.log"
  grep -E "Skipped|SKIPPED|\*\*\*Failed" "$OUT/tests.log" | head
fi
log done
