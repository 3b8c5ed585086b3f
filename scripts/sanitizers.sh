#!/usr/bin/env bash
# Builds shmcast twice, each in its own build directory, and runs the tests
# each sanitizer can check:
#   build-asan  -DSHMCAST_SANITIZE=address,undefined  (ASan + UBSan + LSan):
#               every test (ctest -LE 'gpu|python'), but the install tests
#   build-tsan  -DSHMCAST_SANITIZE=thread             (TSan): the tests
#               whose threads share memory inside one process (below)
# both with -DSHMCAST_WITH_CUDA=OFF -DSHMCAST_BUILD_PYTHON=OFF
# -DSHMCAST_BUILD_BENCH=OFF, at -O1 -g1 (line tables: the reports name
# files and lines; -O2 -g took twice the compile time for the same reports).
#
# Excluded ctest labels: gpu and python. The gpu tier needs a GPU and the
# CUDA engine, which these builds leave out (a sanitized CUDA runtime is not
# supported either); the python tier needs the extension module, which is
# not built here: a sanitized module would have to be run by an interpreter
# with the sanitizer runtime LD_PRELOADed, which is a different test.
# Also excluded, by name: the two install tests. install.find_package
# builds an outside project against the installed static library with plain
# flags, which cannot link a sanitized libshmcast.a (undefined
# __asan_*/__tsan_* symbols); install.shared_exports_public_api_only builds
# the library again, unsanitized (Release, a tree of its own), exactly as
# the plain build's run of it does. Both check packaging, not behaviour,
# and run in the plain build.
#
# TSan and shared memory: TSan sees one process. Peers in other processes
# (most multi-process tests) are invisible to it; it checks what happens
# inside each process. So the TSan build runs the tests where threads of one
# process share the library's state (SAN_TSAN_LABELS):
#   unit     in-process producer, consumer, doorbell, ring and fd-channel
#            tests, several with threads;
#   threads  tests/fault/test_threads.cpp: the producer and three consumers
#            as threads over one region (with checksums, and without:
#            progressive fill); and the multiprocess and tool tests that
#            run two threads of one process over the library (the
#            multiprocess ones in test_multiprocess_threads, a binary of
#            their own; the tool ones by shmcast_label_tests in
#            tests/tool/CMakeLists.txt);
#   relay    shmcast-relay is one process of several threads (network,
#            UCX's async thread, the status writer), in every relay test.
# and builds only what those need (SAN_TSAN_TARGETS). The multiprocess,
# fault (but threads), attack, seccomp, tool and fileio tiers run their
# peers as processes of one thread each (but those labelled threads): they run under ASan here, twice
# in the plain build (tiers, under load), and under TSan only with
# SANITIZERS_FULL=1 (docs/reliability.md, "CI time", says why). The CUDA
# engine, and so its completion thread, is not built here and not checked.
# Suppressions, if any, live in tests/fault/tsan.supp, each with its reason.
#
# Environment:
#   SANITIZERS      which builds to run (asan tsan)
#   SANITIZERS_FULL 1: the TSan build builds and runs every test, as ASan's
#   SAN_TSAN_LABELS ctest label regex of the TSan run (^(unit|threads|relay)$)
#   SAN_FAULT_TRIALS_PERCENT  share of each fault matrix's random trials
#                   (50; SHMCAST_FAULT_TRIALS_PERCENT): each trial is the
#                   same fault at new random points, the tiers stage runs
#                   them all, and a memory error on a fault's path shows in
#                   half of them as in all
#   CTEST_JOBS      parallel ctest jobs (2)
#   SAN_CTEST_ARGS  extra ctest arguments (e.g. -L fault)
# Output: one line per build, e.g.
#   SANITIZER-SUMMARY build=asan status=pass configure_build_s=95 test_s=140 tests=160 failed=0
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
read -r -a which <<<"${SANITIZERS:-asan tsan}"
jobs=${CTEST_JOBS:-2}
read -r -a extra <<<"${SAN_CTEST_ARGS:-}"

export SHMCAST_FAULT_TRIALS_PERCENT=${SAN_FAULT_TRIALS_PERCENT:-50}
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0:strict_string_checks=1:detect_stack_use_after_return=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1:suppressions=$root/tests/fault/tsan.supp}

. scripts/ccache-env
# -O1 -g1 for both trees (see the header); NDEBUG as in the plain build.
flags=(-DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG")
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
  cmake -S . -B "$dir" "${g[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo "${flags[@]}" -DSHMCAST_SANITIZE="$san" \
    -DSHMCAST_WITH_CUDA=OFF -DSHMCAST_BUILD_PYTHON=OFF -DSHMCAST_BUILD_BENCH=OFF >"$dir/configure.log" 2>&1 ||
    { cat "$dir/configure.log"; exit 1; }
  select=(-LE 'gpu|python')
  targets=()
  if [ "$name" = tsan ] && [ "${SANITIZERS_FULL:-0}" != 1 ]; then
    select=(-L "${SAN_TSAN_LABELS:-^(unit|threads|relay)\$}")
    read -r -a targets <<<"${SAN_TSAN_TARGETS:-test_unit test_probe test_fault_threads test_multiprocess_threads test_tool}"
    # The relay's tests (every test_* of tests/relay, and the relay status
    # attack), when the relay is built (UCX and OpenSSL found).
    if [ -z "${SAN_TSAN_TARGETS:-}" ]; then
      for d in "$dir"/tests/relay/CMakeFiles/test_*.dir "$dir"/tests/attack/CMakeFiles/test_attack_relay_status.dir; do
        [ -d "$d" ] && targets+=("$(basename "$d" .dir)")
      done
    fi
    targets=(--target "${targets[@]}")
  fi
  cmake --build "$dir" -j"$(nproc)" "${targets[@]}"
  t1=$(date +%s)
  # Older TSan runtimes cannot map their shadow under a high-entropy ASLR
  # ("unexpected memory mapping"): run that build with ASLR off for its tests.
  run=()
  if [ "$name" = tsan ] && command -v setarch >/dev/null && setarch "$(uname -m)" -R true 2>/dev/null; then
    run=(setarch "$(uname -m)" -R)
  fi
  set +e
  (cd "$dir" && "${run[@]}" ctest "${select[@]}" -E '^install\.' -j"$jobs" --output-on-failure --timeout 600 \
    "${extra[@]}") | tee "$dir/ctest.log"
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
