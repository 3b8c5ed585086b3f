#!/usr/bin/env bash
# Builds the whole project twice, each in its own build directory, and runs
# the whole ctest suite in each:
#   build-asan  -DSHMCAST_SANITIZE=address,undefined  (ASan + UBSan + LSan)
#   build-tsan  -DSHMCAST_SANITIZE=thread             (TSan)
# both with -DSHMCAST_WITH_CUDA=OFF -DSHMCAST_BUILD_PYTHON=OFF.
#
# Excluded ctest labels: gpu and python. The gpu tier needs a GPU and the
# CUDA engine, which these builds leave out (a sanitized CUDA runtime is not
# supported either); the python tier needs the extension module, which is
# not built here: a sanitized module would have to be run by an interpreter
# with the sanitizer runtime LD_PRELOADed, which is a different test.
# Also excluded, by name: install.find_package. It builds an outside project
# against the installed static library with plain flags, which cannot link
# a sanitized libshmcast.a (undefined __asan_*/__tsan_* symbols); it checks
# packaging, not behaviour, and runs in the plain build.
# Everything else runs: unit, multiprocess, fault (the fault matrix and the
# fuzz corpus replays), seccomp, tool.
#
# TSan and shared memory: TSan sees one process. Peers in other processes
# (most multi-process tests) are invisible to it; it checks what happens
# inside each process: the library's own state, and the in-process
# producer/consumer threads of tests/fault/test_threads.cpp (with checksums,
# and without: progressive fill). The CUDA engine, and so its callback
# thread, is not built here and not checked. Suppressions, if any, live in
# tests/fault/tsan.supp, each with its reason.
#
# Environment:
#   SANITIZERS     which builds to run (asan tsan)
#   CTEST_JOBS     parallel ctest jobs (2)
#   SAN_CTEST_ARGS extra ctest arguments (e.g. -L fault)
# Output: one line per build, e.g.
#   SANITIZER-SUMMARY build=asan status=pass configure_build_s=95 test_s=140 tests=160 failed=0
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
read -r -a which <<<"${SANITIZERS:-asan tsan}"
jobs=${CTEST_JOBS:-2}
read -r -a extra <<<"${SAN_CTEST_ARGS:-}"

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0:strict_string_checks=1:detect_stack_use_after_return=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1:suppressions=$root/tests/fault/tsan.supp}

gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
summaries=()
failed_builds=0
for name in "${which[@]}"; do
  case $name in
    asan) san=address,undefined ;;
    tsan) san=thread ;;
    *) echo "sanitizers.sh: unknown build '$name'"; exit 2 ;;
  esac
  dir=build-$name
  g=("${gen[@]}")
  [ -f "$dir/CMakeCache.txt" ] && g=()
  mkdir -p "$dir"
  t0=$(date +%s)
  cmake -S . -B "$dir" "${g[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSHMCAST_SANITIZE="$san" \
    -DSHMCAST_WITH_CUDA=OFF -DSHMCAST_BUILD_PYTHON=OFF >"$dir/configure.log" 2>&1 ||
    { cat "$dir/configure.log"; exit 1; }
  cmake --build "$dir" -j"$(nproc)"
  t1=$(date +%s)
  # Older TSan runtimes cannot map their shadow under a high-entropy ASLR
  # ("unexpected memory mapping"): run that build with ASLR off for its tests.
  run=()
  if [ "$name" = tsan ] && command -v setarch >/dev/null && setarch "$(uname -m)" -R true 2>/dev/null; then
    run=(setarch "$(uname -m)" -R)
  fi
  set +e
  (cd "$dir" && "${run[@]}" ctest -LE 'gpu|python' -E '^install\.find_package$' -j"$jobs" --output-on-failure --timeout 600 "${extra[@]}") \
    | tee "$dir/ctest.log"
  rc=${PIPESTATUS[0]}
  set -e
  t2=$(date +%s)
  tests=$(sed -n 's/.*tests passed, \([0-9]*\) tests failed out of \([0-9]*\).*/\2/p' "$dir/ctest.log" | tail -1)
  failed=$(sed -n 's/.*tests passed, \([0-9]*\) tests failed out of.*/\1/p' "$dir/ctest.log" | tail -1)
  status=pass
  if [ "$rc" -ne 0 ]; then status=fail; failed_builds=$((failed_builds + 1)); fi
  summaries+=("SANITIZER-SUMMARY build=$name status=$status configure_build_s=$((t1 - t0)) test_s=$((t2 - t1)) tests=${tests:-0} failed=${failed:-?}")
done
printf '%s\n' "${summaries[@]}"
[ "$failed_builds" -eq 0 ]
