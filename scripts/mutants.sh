#!/usr/bin/env bash
# Mutation check: breaks the library on purpose, one way at a time, and
# reports which tests notice. Every mutant must be caught by at least one
# test; a mutant no test catches is a hole in the suite. Slow (a baseline and
# five rebuilds and test runs: about an hour on a 2-core machine), so it is
# not part of scripts/test or CI: run it by hand after changing the ring,
# the doorbell, liveness or the manifest checks, and update the table in
# docs/reliability.md.
#
#   scripts/mutants.sh                        all five mutants
#   MUTANTS="no_wake release_early" scripts/mutants.sh
#
# It never touches the checkout: the tracked and untracked-but-not-ignored
# files are copied to $MUTANT_DIR/src, built there (CUDA, Python, the bench
# and the relay off) in $MUTANT_DIR/build, and each mutant is applied to
# that copy, built incrementally, tested, and undone. A mutant is one exact
# text in one file and its replacement; the text must occur exactly once, or
# the script stops (exit 2) instead of testing unmutated code. The build must
# succeed and the mutated object must differ from the pristine one.
#
# The unmutated copy is built and tested first; a test that fails there is
# not credited with catching anything. A test failing under a mutant is run
# again, $MUTANT_RERUNS times (ctest --rerun-failed); only tests that fail
# every time are credited, so a flaky test does not catch a mutant by chance.
#
# Environment:
#   MUTANTS         which to run (default: all five, in the order below)
#   MUTANT_LABELS   ctest label regex (unit|multiprocess|fault|tool)
#   MUTANT_EXCLUDE  ctest -E regex of tests not to run (^install\.: they
#                   install and rebuild the whole library, and test packaging)
#   MUTANT_DIR      scratch directory (/tmp/shmcast-mutants-$USER)
#   MUTANT_JOBS     build jobs (1; at most 2 on a shared machine)
#   CTEST_JOBS      parallel ctest jobs (1)
#   MUTANT_RERUNS   reruns of the failed tests (2)
#   MUTANT_TIMEOUT  ctest --timeout for tests without their own (300)
#   MUTANT_TEST_TIMEOUT_CAP  upper bound on every GoogleTest test's timeout
#                   (SHMCAST_TEST_TIMEOUT_CAP; 90 s, 7x the slowest test's
#                   time: a mutant that makes tests hang costs 90 s a test)
# Output: a Markdown table (mutant, where, tests that caught it), and one line
# per mutant:
#   MUTANT-SUMMARY mutant=no_wake status=caught tests=3 where=lib/core/shm/doorbell.cpp:41 build_s=40 test_s=120
# Exit status: 0 when every mutant was caught, 1 when one survived, 2 when
# the script could not run (a pattern not found, a build failure).
set -euo pipefail
export LC_ALL=C  # sort and comm of test names agree

# ================================================================ the mutants
#
# Re-point a mutant here when the code it breaks moves: M_FILE, and M_OLD,
# the exact text (whitespace included) that must occur once in it.
# Pointed at the code with sharded syncs and store regions: the chunk writer
# and reader in lib/core/protocol/ring.cpp serve one-rank and sharded producers and
# store regions alike, and Consumer::wait_sync (lib/core/api/consumer.cpp) is the
# one place a consumer checks the manifest hash, ring or store
# (lib/core/probe/probe.cpp has its own, for the inspection tools, and is not
# mutated).

ALL_MUTANTS=(no_wake publish_early liveness_blind manifest_hash release_early)

define_mutant() {  # name: sets M_WHAT, M_FILE, M_OLD, M_NEW
  case $1 in
    no_wake)
      M_WHAT="the doorbell's ring() never calls FUTEX_WAKE (ring_keep_parity still does)"
      M_FILE=lib/core/shm/doorbell.cpp
      M_OLD=$(cat <<'EOF'
void ring(Bell& bell) noexcept {
  bell.word.fetch_add(1, std::memory_order_seq_cst);
  if (bell.waiters.load(std::memory_order_seq_cst) != 0) futex_wake(&bell.word, INT_MAX);
}
EOF
)
      M_NEW=$(cat <<'EOF'
void ring(Bell& bell) noexcept {
  bell.word.fetch_add(1, std::memory_order_seq_cst);
  (void)bell.waiters.load(std::memory_order_seq_cst);  // MUTANT no_wake: sleepers are never woken
}
EOF
)
      ;;
    publish_early)
      M_WHAT="a chunk is published when its slot is claimed (ChunkWriter::claim_chunk, for a one-rank producer and every sharded rank), before any of its bytes are written"
      M_FILE=lib/core/protocol/ring.cpp
      M_OLD=$(cat <<'EOF'
    ring_->acquire(seq);
    ring_->begin_fill(seq);
EOF
)
      M_NEW=$(cat <<'EOF'
    ring_->acquire(seq);
    ring_->begin_fill(seq);
    ring_->publish(seq, version_, chunk_len(acquired_, stream_, S_), 0);  // MUTANT publish_early
EOF
)
      ;;
    liveness_blind)
      M_WHAT="lock_held() says every lock byte is held: a dead producer or consumer is never detected"
      M_FILE=lib/core/shm/liveness.cpp
      M_OLD=$(cat <<'EOF'
  if (lock_op(fd, F_OFD_GETLK, F_RDLCK, byte, &fl) != 0) return Alive::kUnknown;
  return fl.l_type == F_UNLCK ? Alive::kNo : Alive::kYes;
EOF
)
      M_NEW=$(cat <<'EOF'
  if (lock_op(fd, F_OFD_GETLK, F_RDLCK, byte, &fl) != 0) return Alive::kUnknown;
  return Alive::kYes;  // MUTANT liveness_blind: every peer is alive
EOF
)
      ;;
    manifest_hash)
      M_WHAT="a consumer accepts a manifest whose bytes do not match the sync record's hash (Consumer::wait_sync)"
      M_FILE=lib/core/api/consumer.cpp
      M_OLD='    if (XXH3_64bits(bytes.data(), bytes.size()) != rec.manifest_hash) {'
      M_NEW='    if (false && XXH3_64bits(bytes.data(), bytes.size()) != rec.manifest_hash) {  // MUTANT manifest_hash'
      ;;
    release_early)
      M_WHAT="a consumer releases a slot when the reader (ChunkReader::next) hands out its last range, before copying it out"
      M_FILE=lib/core/protocol/ring.cpp
      M_OLD='  *out = Range{data + have, j * S_ + have, rank, bytes - have, true, seq, w.wait.slot};'
      M_NEW=$(cat <<'EOF'
  ring_->release(seq);  // MUTANT release_early: the producer may refill the slot while it is copied out
  *out = Range{data + have, j * S_ + have, rank, bytes - have, true, seq, w.wait.slot};
EOF
)
      ;;
    *) return 1 ;;
  esac
}

# ================================================================ the run

cd "$(dirname "$0")/.."
root=$PWD
work=${MUTANT_DIR:-/tmp/shmcast-mutants-${USER:-$(id -u)}}
labels=${MUTANT_LABELS:-unit|multiprocess|fault|tool}
exclude=${MUTANT_EXCLUDE:-^install\\.}
bjobs=${MUTANT_JOBS:-1}
cjobs=${CTEST_JOBS:-1}
reruns=${MUTANT_RERUNS:-2}
ctimeout=${MUTANT_TIMEOUT:-300}
tcap=${MUTANT_TEST_TIMEOUT_CAP:-90}
read -r -a which <<<"${MUTANTS:-${ALL_MUTANTS[*]}}"
src=$work/src
bld=$work/build
logs=$work/logs

for m in "${which[@]}"; do
  define_mutant "$m" || { echo "mutants.sh: unknown mutant '$m' (known: ${ALL_MUTANTS[*]})" >&2; exit 2; }
done

# Replaces the one occurrence of $2 in file $1 by $3; prints the line of
# the first line it changes. Fails (exit 2) unless $2 occurs exactly once.
apply_text() {
  python3 - "$1" "$2" "$3" <<'PY'
import sys
path, old, new = sys.argv[1:]
s = open(path).read()
n = s.count(old)
if n != 1:
    sys.stderr.write(f"mutants.sh: the text to mutate occurs {n} times in {path}, not once: re-point the mutant "
                     f"(top of scripts/mutants.sh)\n--- text:\n{old}\n")
    sys.exit(2)
at = s.index(old)
open(path, "w").write(s[:at] + new + s[at + len(old):])
same = 0
for a, b in zip(old.split("\n"), new.split("\n")):
    if a != b:
        break
    same += 1
print(s[:at].count("\n") + 1 + same)
PY
}

# ---- the scratch copy of the tree (refreshed every run) and its build.
mkdir -p "$src" "$bld" "$logs"
git ls-files -z -co --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$src"
pristine=$logs/pristine
rm -rf "$pristine"
mkdir -p "$pristine"
# A mutant is undone on any exit (copied back with a new mtime, so that
# make rebuilds it). The files the mutants touch are rebuilt for the
# baseline whatever an earlier, interrupted run left in the build.
restore() {
  local f
  for f in "$pristine"/*; do
    [ -e "$f" ] || continue
    cp "$f" "$src/$(basename "$f" | tr '%' '/')"
  done
}
trap restore EXIT
trap 'exit 130' INT TERM HUP
for m in "${ALL_MUTANTS[@]}"; do
  define_mutant "$m"
  touch "$src/$M_FILE"
done
if grep -rl "MUTANT " "$src/lib" >/dev/null 2>&1; then
  echo "mutants.sh: the checkout itself holds a MUTANT marker: $(grep -rl "MUTANT " "$src/lib" | head -3)" >&2
  exit 2
fi
gen=()
command -v ninja >/dev/null && [ ! -f "$bld/CMakeCache.txt" ] && gen=(-G Ninja)
cmake -S "$src" -B "$bld" "${gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSHMCAST_WITH_CUDA=OFF \
  -DSHMCAST_BUILD_PYTHON=OFF -DSHMCAST_BUILD_BENCH=OFF -DSHMCAST_BUILD_RELAY=OFF -DSHMCAST_TEST_TIMEOUT_CAP="$tcap" \
  -DSHMCAST_SHARED_SECCOMP_DIR="$root/../shared/seccomp" >"$logs/configure.log" 2>&1 ||
  { cat "$logs/configure.log"; exit 2; }

# Names of the failed tests in a ctest log (without gtest's "# GetParam() = ...").
failed_in() {
  [ -f "$1" ] || return 0
  sed -n '/The following tests FAILED:/,$ s/^[[:space:]]*[0-9]* - \(.*\) ([^()]*)$/\1/p' "$1" |
    sed 's/  # GetParam() = .*//' | sort -u
}

# ctest over the selected tests into log $1 (more ctest arguments after it).
# The same -L and -E every time: ctest numbers the tests after -E, and
# --rerun-failed finds the failed ones by those numbers. ctest runs in a
# process group of its own (job control), in this script's session: the
# fault tier SIGSTOPs its children, and a stopped process in an orphaned
# process group (this script's, when it runs detached) gets the whole group
# killed by SIGHUP; a group of its own also keeps a broken test's signals
# away from the script.
run_ctest() {
  local log=$1 pid
  shift
  set -m
  (cd "$bld" && exec ctest -L "$labels" -E "$exclude" -j"$cjobs" --timeout "$ctimeout" --output-on-failure "$@" \
    >"$log" 2>&1) &
  pid=$!
  set +m
  wait "$pid"
}

# A ctest run that ended without its summary (killed) cannot be judged:
# flagged in $logs/unfinished, which stops the script after that run.
finished() {
  grep -q "tests passed, [0-9]* tests failed out of" "$1" && return 0
  echo "mutants.sh: ctest ended without its summary ($1): cannot tell which tests failed" >&2
  touch "$logs/unfinished"
  return 1
}
judged() { [ ! -e "$logs/unfinished" ] || exit 2; }

# Runs the tests, then the failed ones again, $reruns times; prints the
# names of the tests that failed every time (by name, in every log).
failing_tests() {
  local tag=$1 i names
  rm -f "$logs/$tag".ctest.log "$logs/$tag".rerun*.log
  run_ctest "$logs/$tag.ctest.log" && return 0
  finished "$logs/$tag.ctest.log" || return 0
  names=$(failed_in "$logs/$tag.ctest.log")
  for ((i = 1; i <= reruns; i++)); do
    run_ctest "$logs/$tag.rerun$i.log" --rerun-failed && return 0
    finished "$logs/$tag.rerun$i.log" || return 0
    names=$(comm -12 <(echo "$names") <(failed_in "$logs/$tag.rerun$i.log"))
  done
  [ -z "$names" ] || echo "$names"
}

# The object file a source file of the library builds into.
object_of() {
  find "$bld/lib" -name "$(basename "$1").o" -path "*shmcast.dir*" | head -1
}

echo "mutants.sh: baseline (unmutated) build and tests in $work"
t0=$(date +%s)
cmake --build "$bld" -j"$bjobs" >"$logs/baseline.build.log" 2>&1 || { tail -50 "$logs/baseline.build.log"; exit 2; }
t1=$(date +%s)
ntests=$(cd "$bld" && ctest -N -L "$labels" -E "$exclude" | sed -n 's/^Total Tests: //p')
if [ "${ntests:-0}" -eq 0 ]; then
  echo "mutants.sh: no tests match -L '$labels' -E '$exclude'" >&2
  exit 2
fi
rm -f "$logs/unfinished"
mapfile -t baseline_fail < <(failing_tests baseline)
judged
t2=$(date +%s)
echo "MUTANT-SUMMARY mutant=baseline status=$([ ${#baseline_fail[@]} -eq 0 ] && echo pass || echo fail) tests=$ntests failed=${#baseline_fail[@]} build_s=$((t1 - t0)) test_s=$((t2 - t1))"
if [ ${#baseline_fail[@]} -gt 0 ]; then
  echo "mutants.sh: these tests fail without any mutant and are not counted as catching one:"
  printf '  %s\n' "${baseline_fail[@]}"
fi

join() { local IFS=,; echo "$*" | sed 's/,/, /g'; }
rows=()
summaries=()
missed=0
for m in "${which[@]}"; do
  define_mutant "$m"
  f=$M_FILE
  saved=$pristine/$(echo "$f" | tr '/' '%')
  cp -p "$src/$f" "$saved"
  obj=$(object_of "$f")
  [ -n "$obj" ] && cp "$obj" "$logs/pristine.o"
  line=$(apply_text "$src/$f" "$M_OLD" "$M_NEW") || exit 2
  echo "mutants.sh: mutant $m: $M_WHAT ($f:$line)"
  diff -u "$saved" "$src/$f" | sed -n '/^[-+][^-+]/p' | sed 's/^/    /' || true
  t0=$(date +%s)
  if ! cmake --build "$bld" -j"$bjobs" >"$logs/$m.build.log" 2>&1; then
    echo "mutants.sh: mutant $m does not build:" >&2
    tail -20 "$logs/$m.build.log" >&2
    exit 2
  fi
  if [ -n "$obj" ] && cmp -s "$obj" "$logs/pristine.o"; then
    echo "mutants.sh: mutant $m built into the same object as the pristine $f: it changes nothing" >&2
    exit 2
  fi
  t1=$(date +%s)
  mapfile -t fails < <(failing_tests "$m")
  judged
  t2=$(date +%s)
  cp "$saved" "$src/$f"  # a new mtime: rebuilt from the pristine text before the next mutant
  rm -f "$saved"
  catchers=()
  for t in "${fails[@]}"; do
    known=0
    for b in "${baseline_fail[@]}"; do [ "$t" = "$b" ] && known=1; done
    [ "$known" -eq 1 ] || catchers+=("$t")
  done
  # Failed, but not every time: noted, not credited.
  once=()
  while IFS= read -r t; do
    [ -n "$t" ] || continue
    every=0
    for c in "${fails[@]}"; do [ "$t" = "$c" ] && every=1; done
    [ "$every" -eq 1 ] || once+=("$t")
  done < <(failed_in "$logs/$m.ctest.log")
  if [ ${#catchers[@]} -gt 0 ]; then
    status=caught
  else
    status=SURVIVED
    missed=$((missed + 1))
  fi
  rows+=("| $m | \`$f:$line\` | $status | $(join "${catchers[@]}") | $(join "${once[@]}") |")
  summaries+=("MUTANT-SUMMARY mutant=$m status=$status tests=${#catchers[@]} where=$f:$line build_s=$((t1 - t0)) test_s=$((t2 - t1))")
  echo "    caught by (${#catchers[@]}): $(join "${catchers[@]}")"
  echo "${summaries[-1]}"
done
# Leave the scratch build matching the pristine sources.
cmake --build "$bld" -j"$bjobs" >"$logs/restore.build.log" 2>&1 || true

echo
echo "| mutant | mutated | result | tests that caught it (failed 1 + $reruns reruns) | failed, but not every time (not credited) |"
echo "| --- | --- | --- | --- | --- |"
printf '%s\n' "${rows[@]}"
echo
printf '%s\n' "${summaries[@]}"
echo "mutants.sh: logs in $logs"
[ "$missed" -eq 0 ] || exit 1
