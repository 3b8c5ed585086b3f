#!/usr/bin/env bash
# Bounded libFuzzer run over every target in tests/fuzz (clang, ASan+UBSan).
#
# Builds the fuzz targets into build-fuzz (or $BUILD_DIR) with
# -DSHMCAST_FUZZ=ON, then runs each target for FUZZ_SECONDS / #targets
# seconds (FUZZ_JOBS of them at a time), seeded from tests/fuzz/corpus/<t> and tests/fuzz/regressions/<t>
# (a regression that crashes again fails the run at load). New corpus entries
# go to build-fuzz/corpus/<t>, never into the checked-in seeds. Any crash,
# sanitizer report, leak, timeout (> FUZZ_TIMEOUT s for one input) or OOM
# fails the script; the input is left in build-fuzz/artifacts/<t>/. To keep
# it as a regression test:
#   build-fuzz/tests/fuzz/fuzz_<t> -minimize_crash=1 -runs=10000 \
#       -exact_artifact_path=tests/fuzz/regressions/<t>/<name> <artifact>
# then fix the library; ctest fuzz.replay.<t> replays it in every build.
#
# Environment:
#   FUZZ_SECONDS   total fuzzing time in seconds, split across targets (60)
#   FUZZ_JOBS      targets fuzzed at once (the number of cores)
#   FUZZ_TARGETS   targets to run (header manifest region safetensors relay_wire delta)
#   FUZZ_TIMEOUT   per-input timeout in seconds (10)
#   BUILD_DIR      build directory (build-fuzz)
#   CC_FUZZ, CXX_FUZZ  compilers (clang, clang++; clang-14 on Debian 12)
#
# Output: one parseable line per target and one for the whole run:
#   FUZZ-SUMMARY target=region status=pass seconds=20 runs=81234 cov=1234 ft=4567 corpus=210 exec_per_s=4061 new_units=12 peak_rss_mb=120
#   FUZZ-SUMMARY total status=pass seconds=60 runs=... targets=3 failed=0
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/ccache-env
build=${BUILD_DIR:-build-fuzz}
total=${FUZZ_SECONDS:-60}
timeout_s=${FUZZ_TIMEOUT:-10}
read -r -a targets <<<"${FUZZ_TARGETS:-header manifest region safetensors relay_wire delta}"
cc=${CC_FUZZ:-clang}
cxx=${CXX_FUZZ:-clang++}

gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
[ -f "$build/CMakeCache.txt" ] && gen=()  # keep the generator it was made with
mkdir -p "$build"
t0=$(date +%s)
cmake -S . -B "$build" "${gen[@]}" -DCMAKE_C_COMPILER="$cc" -DCMAKE_CXX_COMPILER="$cxx" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSHMCAST_FUZZ=ON -DSHMCAST_WITH_CUDA=OFF -DSHMCAST_BUILD_PYTHON=OFF \
  -DSHMCAST_BUILD_TOOLS=OFF -DSHMCAST_BUILD_BENCH=OFF >"$build/configure.log" 2>&1 ||
  { cat "$build/configure.log"; exit 1; }
fuzzers=()
for t in "${targets[@]}"; do fuzzers+=("fuzz_$t"); done
cmake --build "$build" -j"$(nproc)" --target "${fuzzers[@]}"
echo "fuzz.sh: built in $(($(date +%s) - t0)) s"

per=$((total / ${#targets[@]}))
[ "$per" -ge 1 ] || per=1
# The harnesses' region files live here; removed whatever happens.
shm_base=$(mktemp -d "${TMPDIR_FUZZ:-/dev/shm}/shmcast-fuzz-run-XXXXXX" 2>/dev/null || mktemp -d)
trap 'rm -rf "$shm_base"' EXIT
export SHMCAST_FUZZ_BASE=$shm_base
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

# The targets run FUZZ_JOBS at a time (the cores: each libFuzzer process is
# one thread), each for its share of FUZZ_SECONDS: the same fuzzing in a
# FUZZ_JOBS-th of the wall time. Each one's exit status goes to a file.
jobs_max=${FUZZ_JOBS:-$(nproc)}
[ "$jobs_max" -ge 1 ] || jobs_max=1
run_one() {  # run_one TARGET: fuzzes it; its exit status into $build/fuzz-TARGET.rc
  local t=$1 work=$build/corpus/$1 art=$build/artifacts/$1 log=$build/fuzz-$1.log s rc
  mkdir -p "$work" "$art"
  local seeds=()
  for s in "tests/fuzz/corpus/$t" "tests/fuzz/regressions/$t"; do [ -d "$s" ] && seeds+=("$s"); done
  rc=0
  "$build/tests/fuzz/fuzz_$t" -max_total_time="$per" -timeout="$timeout_s" -rss_limit_mb=2048 -max_len=8192 \
    -print_final_stats=1 -artifact_prefix="$art/" "$work" "${seeds[@]}" >"$log" 2>&1 || rc=$?
  echo "$rc" >"$build/fuzz-$t.rc"
}
running=0
for t in "${targets[@]}"; do
  rm -f "$build/fuzz-$t.rc"
  if [ "$running" -ge "$jobs_max" ]; then
    wait -n || true
    running=$((running - 1))
  fi
  run_one "$t" &
  running=$((running + 1))
done
wait || true

failed=0 all_runs=0
for t in "${targets[@]}"; do
  art=$build/artifacts/$t
  log=$build/fuzz-$t.log
  rc=$(cat "$build/fuzz-$t.rc" 2>/dev/null || echo 99)
  done_line=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -1 || true)
  field() { sed -n "s/.*\b$1: \([0-9]*\).*/\1/p" <<<"$done_line"; }
  stat() { sed -n "s/^stat::$1:[[:space:]]*\([0-9]*\)/\1/p" "$log" | tail -1; }
  runs=$(stat number_of_executed_units)
  corpus=$(sed -n 's/.*corp: \([0-9]*\).*/\1/p' <<<"$done_line")
  status=pass
  if [ "$rc" -ne 0 ] || [ -z "$done_line" ]; then
    status=fail
    failed=$((failed + 1))
    echo "---- fuzz_$t failed (exit $rc); last lines of $log:"
    grep -m1 'INFO: Seed:' "$log" || true
    tail -40 "$log"
    ls -1 "$art" | sed 's/^/artifact: /'
    # Each input on one line, gzip + base64: a CI machine is gone after its
    # run, its log is all that is left. To replay it:
    #   echo '<gz_b64>' | base64 -d | gunzip > in; build/tests/fuzz/fuzz_<t>_replay in
    for a in "$art"/*; do
      [ -f "$a" ] && echo "FUZZ-ARTIFACT target=$t file=$(basename "$a") bytes=$(wc -c <"$a") gz_b64=$(gzip -9nc "$a" | base64 -w0)"
    done
  fi
  all_runs=$((all_runs + ${runs:-0}))
  echo "FUZZ-SUMMARY target=$t status=$status seconds=$per runs=${runs:-0} cov=$(field cov) ft=$(field ft)" \
       "corpus=${corpus:-0} exec_per_s=$(stat average_exec_per_sec) new_units=$(stat new_units_added)" \
       "peak_rss_mb=$(stat peak_rss_mb)"
done
status=pass
[ "$failed" -eq 0 ] || status=fail
echo "FUZZ-SUMMARY total status=$status seconds=$((per * ${#targets[@]})) runs=$all_runs targets=${#targets[@]} failed=$failed wall=$(($(date +%s) - t0))"
[ "$failed" -eq 0 ]
