#!/usr/bin/env bash
# Runs the multiprocess, fault, relay and attack tiers once more while the machine is busy:
# stress-ng keeps more CPU hogs running than there are cores, and the tests
# run at a lower priority than the hogs (nice), so peers are preempted at
# arbitrary points, start late and wake late. A test that takes "some time
# has passed" for "the other process is ready" fails here; one that
# synchronises by a handshake does not.
#
# How hard: on the 2-core development machine the old "file exists, then
# 50 ms" liveness test passed 20/20 runs beside 8 hogs at equal priority,
# failed 13/20 beside 4 hogs at nice 10 (the default here) and 20/20 at
# nice 19. Much harder than the default starves live peers past the fault
# tier's deliberate short deadlines (a 500 ms consumer_timeout in the stall
# matrix): at nice 19 those tests report stalls that are the scheduler's.
#
# Uses the plain build in $BUILD_DIR (build/), which scripts/test has built.
#
# Beside other work (LOAD_AFTER_LOCK): scripts/test runs this stage while
# the sanitizer, fuzz and AArch64 stages build and test at nice 0 beside it,
# holding an flock on the file LOAD_AFTER_LOCK names: that work is the load
# (compilers, ASan and TSan test processes, libFuzzer, qemu), and stress-ng
# starts only once the lock is released, for the tests still running. Two
# CPU-bound lanes on 2 cores: the tests here get what the nice-0 work leaves,
# as they get what stress-ng's hogs leave, and the machine does the other
# stages' work meanwhile instead of stress-ng's.
#
# Environment:
#   BUILD_DIR        build directory (build)
#   LOAD_CPU         stress-ng CPU workers (2 x cores, at least 4)
#   LOAD_NICE        niceness of the tests (10)
#   LOAD_LABELS      ctest label regex (multiprocess|fault|relay|attack)
#   LOAD_EXCLUDE     ctest label regex left out (bulk: CPU volume, not
#                    timing, such as the 1M-tensor sync; the tiers run it)
#   LOAD_CTEST_JOBS  parallel ctest jobs (2)
#   LOAD_FAULT_TRIALS_PERCENT  share of each fault matrix's trials (25; the
#                    tiers stage runs them all): SHMCAST_FAULT_TRIALS_PERCENT
#   LOAD_TIMEOUT_S   per-test ctest timeout (600)
#   LOAD_AFTER_LOCK  a file whose flock other work holds: stress-ng waits
#                    for it (above); unset: stress-ng from the start
# Output: one line, e.g.
#   LOAD-SUMMARY status=pass cpu_workers=4 nice=10 labels=multiprocess|fault test_s=95 tests=49 failed=0
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build}
labels=${LOAD_LABELS:-multiprocess|fault|relay|attack}
jobs=${LOAD_CTEST_JOBS:-2}
export SHMCAST_FAULT_TRIALS_PERCENT=${LOAD_FAULT_TRIALS_PERCENT:-25}
cores=$(nproc)
cpu=${LOAD_CPU:-$((2 * cores < 4 ? 4 : 2 * cores))}
nice_n=${LOAD_NICE:-10}

command -v stress-ng >/dev/null || { echo "under-load.sh: stress-ng is missing (scripts/setup-deps installs it)"; exit 2; }
[ -f "$build/CTestTestfile.cmake" ] || { echo "under-load.sh: no build in $build (run scripts/build first)"; exit 2; }

# stress-ng stays in this session: with autogroup scheduling
# (/proc/sys/kernel/sched_autogroup_enabled) niceness only counts within a
# session, and a setsid'd load would get a fair half of the CPU whatever the
# tests' nice. On SIGTERM its parent process ends its workers; --timeout
# bounds it should this script be killed outright.
hogs=(stress-ng --cpu "$cpu" --cpu-method matrixprod --timeout 1800s --quiet)
if [ -n "${LOAD_AFTER_LOCK:-}" ]; then
  command -v flock >/dev/null || { echo "under-load.sh: flock is missing (util-linux)"; exit 2; }
  # The shell takes the lock, then becomes stress-ng (same pid): before
  # that, SIGTERM ends the waiting shell; after, stress-ng and its workers.
  bash -c 'flock 8 && echo "under-load.sh: the other stages are done at $(date +%T): stress-ng from here" &&
    exec "$@"' hogs "${hogs[@]}" 8>>"$LOAD_AFTER_LOCK" &
else
  "${hogs[@]}" &
fi
load_pid=$!
stop_load() {
  kill -TERM "$load_pid" 2>/dev/null || true
  wait "$load_pid" 2>/dev/null || true
}
trap stop_load EXIT
sleep 1  # let the hogs start before the first test
kill -0 "$load_pid" 2>/dev/null || { echo "under-load.sh: stress-ng did not start"; exit 2; }

t0=$(date +%s)
set +e
(cd "$build" && nice -n "$nice_n" ctest -L "$labels" -LE "${LOAD_EXCLUDE:-bulk}" -j"$jobs" --output-on-failure --timeout "${LOAD_TIMEOUT_S:-600}") | tee "$build/ctest-under-load.log"
rc=${PIPESTATUS[0]}
set -e
t1=$(date +%s)
stop_load
trap - EXIT

tests=$(sed -n 's/.*tests passed, \([0-9]*\) tests failed out of \([0-9]*\).*/\2/p' "$build/ctest-under-load.log" | tail -1)
failed=$(sed -n 's/.*tests passed, \([0-9]*\) tests failed out of.*/\1/p' "$build/ctest-under-load.log" | tail -1)
status=pass
[ "$rc" -eq 0 ] || status=fail
echo "LOAD-SUMMARY status=$status cpu_workers=$cpu nice=$nice_n labels=$labels beside=${LOAD_AFTER_LOCK:+other-stages} test_s=$((t1 - t0)) tests=${tests:-0} failed=${failed:-?}"
[ "$rc" -eq 0 ]
