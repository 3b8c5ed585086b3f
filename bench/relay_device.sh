#!/usr/bin/env bash
# The relay bench (bench/relay_bench.py) on the lent machine's CPUs: a core for
# every process of a 4-node chain, where the 2-core development machine has
# two for all of them. No GPU is used. The machine has no network: UCX,
# ucx_perftest and OpenSSL come from carried Debian packages (.deb/ucx,
# fetched beforehand with
#   mkdir -p .deb/ucx && cd .deb/ucx && apt-get download libucx-dev libucx0 \
#     ucx-utils libibverbs1 librdmacm1 libnuma1 libssl-dev libssl3
# ), unpacked into /tmp/pfx by scripts/device-env.sh and here, never into /.
#
#   run: bash bench/relay_device.sh        carry: [".deb"]        kind: nvidia-h200
#
# Results in $OUT: relay_device.log, env.log, build.log, relay*.json.
# Environment: REPS (10), BYTES (2G), CHUNK (32M), NODES (2,4), RUNS (the
# relay_bench runs: "default"; "nocsum": --no-checksums; "inline":
# --no-progress-threads; "direct": --direct-receive; "link:RATE": emulated
# links of RATE, e.g. link:10Gbit, see relay_bench.py --link; "none"),
# TESTS (1: the relay test tier first), TARGETS (what to build: all when empty),
# BUILD_DIR (/tmp/shmcast-relay-build), CMAKE_ARGS (more configure arguments).
#
# The delta stage (issue #31's relay figure): full syncs and delta syncs over
# the relay in one relay_bench run, 2 nodes on emulated 10 Gbit/s links, 2 %
# of the bf16 elements changed at random positions before each sync,
# Qwen2.5-3B shapes (6.17 GB), every sync checked byte for byte by a worker on
# each node; builds only the relay and the bench peer, no tests:
#
#   run: STAGE=delta bash bench/relay_device.sh   carry: [".deb"]   kind: nvidia-h200
#
# Results in $OUT: relay-delta-10Gbit.json (+ the logs). RUNS entries
# "delta:RATE" (relay_bench.py --link RATE --delta-change $DELTA_CHANGE) can
# be combined with the others; DELTA_CHANGE (0.02), DELTA_MANIFEST
# (qwen2.5-3b; empty: --bytes in --tensors equal tensors).
#
# The same on the GPU (as a real trainer and engine do it: relay_bench.py
# --cuda; the trainer's tensors in GPU memory sent with write_device, the
# delta encoded on the GPU, the workers' read_into_device into GPU buffers,
# checked on the GPU; full and delta chains alike), built with CUDA (nvcc
# from /usr/local/cuda) in its own BUILD_DIR (/tmp/shmcast-relay-cuda-build):
#
#   run: STAGE=delta CUDA=1 bash bench/relay_device.sh   carry: [".deb"]   kind: nvidia-h200
#
# Results in $OUT: relay-deltacuda-10Gbit.json. RUNS entries
# "deltacuda:RATE" are the delta runs with --cuda (CUDA=1 makes it the
# stage's default run; RUNS="delta:10Gbit deltacuda:10Gbit" gives both, in
# about twice the time); any deltacuda entry builds with CUDA.
# iproute2 (ip, tc) for link:RATE comes from .deb/net when the machine lacks it
#   (mkdir -p .deb/net && cd .deb/net && apt-get download iproute2 libbpf1 libelf1 \
#     libmnl0 libcap2 libxtables12 libbsd0 libmd0).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${STAGE:-}" = delta ]; then
  [ "${CUDA:-0}" = 1 ] && : "${RUNS:=deltacuda:10Gbit}"
  : "${TESTS:=0}" "${RUNS:=delta:10Gbit}" "${NODES:=2}" "${CHUNK:=8M}" "${BENCH_TIMEOUT:=420}"
  : "${TARGETS:=shmcast-relay shmcast-relay-bench-peer}" "${BENCH_ARGS:=--perftest 1M:sleep}"
fi
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/relay_device.log") 2>&1
T0=$(date +%s)
log() { echo "== $(date +%T) (+$(( $(date +%s) - T0 )) s) $*"; }
source scripts/device-env.sh >"$OUT/env.log" 2>&1
PFX=/tmp/pfx
for f in .deb/ucx/*.deb; do
  case $f in
    */libssl*) [ -f /usr/include/openssl/hmac.h ] && continue ;;
  esac
  dpkg -x "$f" $PFX && echo "unpacked $f" >>"$OUT/env.log"
done
if ! command -v tc >/dev/null || ! command -v ip >/dev/null; then
  mkdir -p $PFX/net
  for f in .deb/net/*.deb; do dpkg -x "$f" $PFX/net && echo "unpacked $f" >>"$OUT/env.log"; done
  # Wrappers: ip and tc with the carried libraries, through the dynamic
  # loader's --library-path, so that what ip netns exec runs (the relays,
  # ucx_perftest) does not inherit them.
  mkdir -p $PFX/netbin
  for t in ip tc; do
    printf '#!/bin/sh\nexec /lib64/ld-linux-x86-64.so.2 --library-path %s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} %s "$@"\n' \
      "$PFX/net/lib/x86_64-linux-gnu:$PFX/net/usr/lib/x86_64-linux-gnu" "$(ls $PFX/net/{usr/,}{s,}bin/$t 2>/dev/null | head -1)" \
      >$PFX/netbin/$t
    chmod +x $PFX/netbin/$t
  done
  export PATH=$PATH:$PFX/netbin
fi
# UCX's CMake package names its prefix outright: point it at /tmp/pfx.
for f in $PFX/usr/lib/x86_64-linux-gnu/cmake/ucx/ucx-targets.cmake; do
  [ -f "$f" ] && sed -i "s#^set(prefix \"/usr\")#set(prefix \"$PFX/usr\")#" "$f"
done
export PATH=$PFX/usr/bin:$PATH
export CPATH=$PFX/usr/include${CPATH:+:$CPATH}
export LIBRARY_PATH=$PFX/usr/lib/x86_64-linux-gnu${LIBRARY_PATH:+:$LIBRARY_PATH}
export LD_LIBRARY_PATH=$PFX/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export UCX_MODULE_DIR=$PFX/usr/lib/x86_64-linux-gnu/ucx
export CMAKE_PREFIX_PATH=$PFX/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}
{ uname -a; lscpu | grep -E "Model name|^CPU\(s\)|NUMA node\(s\)|Hypervisor"; free -g | head -2; df -h /dev/shm;
  ucx_info -v | head -2; ucx_info -d 2>/dev/null | grep -E "Transport|Device" | head -20; } >>"$OUT/env.log" 2>&1
# CUDA (relay_bench.py --cuda): the peer's kernels need nvcc.
cuda=(-DSHMCAST_WITH_CUDA=OFF)
B=${BUILD_DIR:-/tmp/shmcast-relay-build}
if [ "${CUDA:-0}" = 1 ] || [[ " ${RUNS:-} " == *" deltacuda:"* ]]; then
  export PATH=/usr/local/cuda/bin:$PATH
  cuda=(-DSHMCAST_WITH_CUDA=ON -DCUDAToolkit_ROOT=/usr/local/cuda -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc)
  B=${BUILD_DIR:-/tmp/shmcast-relay-cuda-build}
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvcc --version | tail -1; } >>"$OUT/env.log" 2>&1
fi
log "build (${cuda[*]})"
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
{ cmake -S . -B $B "${gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo "${cuda[@]}" -DSHMCAST_BUILD_RELAY=ON \
    -DSHMCAST_BUILD_PYTHON=OFF ${CMAKE_ARGS:-} \
  && cmake --build $B -j"$(nproc)" ${TARGETS:+--target $TARGETS}; } >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
grep -E "^-- shmcast:" "$OUT/build.log"
if [ "${TESTS:-1}" = 1 ]; then
  log "relay tests"
  (cd $B && timeout 300 ctest -L relay --output-on-failure -j4 2>&1 | tail -15)
fi
for run in ${RUNS:-default nocsum}; do
  [ "$run" = none ] && continue
  extra=()
  [ "$run" = nocsum ] && extra=(--relay-arg=--no-checksums --perftest 1M:sleep)
  [ "$run" = inline ] && extra=(--relay-arg=--no-progress-threads --perftest 1M:sleep)
  [ "$run" = direct ] && extra=(--relay-arg=--direct-receive --perftest 1M:sleep)
  case $run in
    link:*) extra=(--link "${run#link:}") ;;
    delta:*|deltacuda:*) extra=(--link "${run#*:}" --delta-change "${DELTA_CHANGE:-0.02}")
      [ -n "${DELTA_MANIFEST-qwen2.5-3b}" ] && extra+=(--manifest "${DELTA_MANIFEST-qwen2.5-3b}")
      [ "${run%%:*}" = deltacuda ] && extra+=(--cuda) ;;
  esac
  log "relay_bench ($run)"
  timeout ${BENCH_TIMEOUT:-400} python3 bench/relay_bench.py --build $B --bytes ${BYTES:-2G} --chunk ${CHUNK:-32M} \
    --reps ${REPS:-10} --nodes ${NODES:-2,4} --json "$OUT/relay-${run/:/-}.json" "${extra[@]}" ${BENCH_ARGS:-}
  log "relay_bench ($run) rc=$?"
done
log done
