#!/usr/bin/env bash
# The checkpoint publish bench (docs/benchmarks-log.md, "Checkpoint publish"):
# shmcast-publish of a safetensors checkpoint into a region, next to the
# references measured in the same run, every figure REPS (10) times,
# reported as min / median / max:
#
#   cold   shmcast-publish from a cold page cache  vs  fio sequential O_DIRECT read of the same files
#   warm   shmcast-publish from a warm page cache  vs  single-thread memcpy of the same bytes
#   store  the same two into a store region (--store: reads straight into its bank)
#   python safetensors.torch.load_file of the same files, cold and warm (when python3 has it)
#   variants  --io pread (what a container that denies io_uring gets), cold and warm, and
#             buffered io_uring reads copied inline (SHMCAST_URING_INLINE=1), warm
#   consumers (CONSUMERS="1 2 4"): publish to N host consumers, until every one has the bytes
#
# Two figures per publish: "first", a fresh shmcast-publish process per
# repetition (it creates the region, its staging windows and ring, and
# faults them in during the sync); and the steady state, REPS syncs of one
# process (--repeat; cold: --drop-cache before each), which is what a
# publisher that stays up pays per sync. The ratios use the steady state.
#
# The page cache is dropped before every cold repetition: `echo 3 >
# /proc/sys/vm/drop_caches` as root where it is writable, else
# posix_fadvise(DONTNEED) on the checkpoint's files (shmcast-publish-ref evict).
# Without fio, `dd iflag=direct bs=64M` is the cold reference (said so in the output).
#
#   BUILD=build-pub bash bench/publish_bench.sh                # after building the targets below
#   LAYERS=8 REPS=10 BUILD=build bash bench/publish_bench.sh   # a 1.86 GB checkpoint
#
# Needs: $BUILD/tools/shmcast-publish, $BUILD/bench/shmcast-publish-ref
# (cmake --build $BUILD --target shmcast-publish shmcast-publish-ref), python3
# (JSON and statistics), fio (Debian: fio) for the cold reference.
#
# Environment:
#   CKPT_DIR  where the synthetic checkpoint lives (default /var/tmp/shmcast-publish-bench);
#             kept between runs, remade when LAYERS or SHARDS change. CKPT=PATH uses an
#             existing checkpoint instead (file, directory or index)
#   LAYERS    Qwen2.5-3B layers of the synthetic checkpoint (36: 6,171,877,376 bytes; 8: 1.86 GB)
#   SHARDS    files it is split into (1)
#   REPS      repetitions of every figure (10)
#   STAGES    "env gen fio cold warm store memcpy python variants consumers" (all by default;
#             consumers runs only with CONSUMERS set)
#   CONSUMERS e.g. "1 2 4"
#   SLOT_MB, SLOTS, IO   region geometry and --io of shmcast-publish (256, 2, auto)
#   FIO       the fio command (default: fio in PATH)
#   PY        python3 with torch and safetensors for the python stage (default python3)
#   OUT       results directory (default $BUILD/publish-bench): bench.jsonl, summary.txt
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
PUBLISH=${PUBLISH:-$BUILD/tools/shmcast-publish}
REF=${REF:-$BUILD/bench/shmcast-publish-ref}
CKPT_DIR=${CKPT_DIR:-/var/tmp/shmcast-publish-bench}
LAYERS=${LAYERS:-36}
SHARDS=${SHARDS:-1}
REPS=${REPS:-10}
STAGES=${STAGES:-"env gen fio cold warm store memcpy python variants consumers"}
CONSUMERS=${CONSUMERS:-}
SLOT_MB=${SLOT_MB:-256}
SLOTS=${SLOTS:-2}
IO=${IO:-auto}
FIO=${FIO:-fio}
PY=${PY:-python3}
OUT=${OUT:-$BUILD/publish-bench}
mkdir -p "$OUT"
JSONL=$OUT/bench.jsonl
: >"$JSONL"
has() { [[ " $STAGES " == *" $1 "* ]]; }
log() { echo "== $(date +%T) $*"; }
REGION=pubbench-$$
trap 'rm -f "${SHMCAST_DIR:-/dev/shm}/shmcast.$REGION"' EXIT

for b in "$PUBLISH" "$REF"; do
  [ -x "$b" ] || { echo "publish_bench: $b is missing: cmake --build $BUILD --target shmcast-publish shmcast-publish-ref" >&2; exit 1; }
done
command -v python3 >/dev/null || { echo "publish_bench: python3 is needed for the statistics" >&2; exit 1; }

# ---------------------------------------------------------------- the checkpoint
if [ -n "${CKPT:-}" ]; then
  CKPT_PATH=$CKPT
elif has gen || [ ! -f "$CKPT_DIR/.stamp" ]; then
  want="layers=$LAYERS shards=$SHARDS"
  if [ "$(cat "$CKPT_DIR/.stamp" 2>/dev/null)" != "$want" ]; then
    log "gen: $want into $CKPT_DIR"
    rm -rf "$CKPT_DIR"
    "$REF" gen "$CKPT_DIR" --layers "$LAYERS" --shards "$SHARDS" | tee -a "$JSONL" || exit 1
    echo "$want" >"$CKPT_DIR/.stamp"
  fi
  CKPT_PATH=$CKPT_DIR
else
  CKPT_PATH=$CKPT_DIR
fi
# The data files (what fio, dd, eviction and load_file read).
list_json=$("$PUBLISH" "$CKPT_PATH" --list --json) || { echo "$list_json"; exit 1; }
mapfile -t FILES < <(python3 -c 'import json,sys; d=json.load(sys.stdin); [print(f["path"]) for f in d["files"]]' <<<"$list_json")
BYTES=$(python3 -c 'import json,sys; print(json.load(sys.stdin)["payload_bytes"])' <<<"$list_json")
FILE_BYTES=$(python3 -c 'import json,sys; print(sum(f["file_bytes"] for f in json.load(sys.stdin)["files"]))' <<<"$list_json")
log "checkpoint $CKPT_PATH: ${#FILES[@]} file(s), $BYTES payload bytes"

drop_method=""
drop() {
  sync
  if [ -w /proc/sys/vm/drop_caches ] && echo 3 >/proc/sys/vm/drop_caches 2>/dev/null; then
    drop_method="echo 3 > /proc/sys/vm/drop_caches"
  else
    "$REF" evict "${FILES[@]}" >/dev/null
    drop_method="posix_fadvise(DONTNEED) of the checkpoint files"
  fi
}
warm() { cat "${FILES[@]}" >/dev/null; }
now() { date +%s.%N; }
rec() { echo "$1" >>"$JSONL"; }

# ---------------------------------------------------------------- env
if has env; then
  {
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "kernel: $(uname -r)"
    lscpu 2>/dev/null | grep -E "Model name|^CPU\(s\)" | sed 's/  */ /g'
    free -g | head -2
    echo "checkpoint file system:"; df -hT "${FILES[0]}" | tail -1
    src=$(df --output=source "${FILES[0]}" | tail -1)
    echo "device: $src"
    lsblk -d -o NAME,MODEL,ROTA,SIZE,TRAN 2>/dev/null | head -8
    [ -n "$src" ] && cat "/sys/block/$(basename "$(readlink -f "$src")" | sed 's/[0-9]*$//')/queue/scheduler" 2>/dev/null
    echo "region directory: $(df -hT "${SHMCAST_DIR:-/dev/shm}" | tail -1)"
    echo "fio: $($FIO --version 2>/dev/null || echo none)"
    echo "python: $($PY -c 'import sys; print(sys.version.split()[0])' 2>/dev/null) safetensors: $($PY -c 'import safetensors; print(safetensors.__version__)' 2>/dev/null || echo none)"
  } | tee "$OUT/env.txt"
fi

# ---------------------------------------------------------------- fio (cold reference)
if has fio; then
  if $FIO --version >/dev/null 2>&1; then
    fnames=$(IFS=:; echo "${FILES[*]}")
    for engine in io_uring libaio; do
      $FIO --name=probe --filename="${FILES[0]}" --rw=read --bs=1M --size=16M --ioengine=$engine --direct=1 \
        --readonly --output-format=json >/dev/null 2>&1 && break
    done
    log "fio: sequential O_DIRECT read, bs=1M iodepth=32 ioengine=$engine, $REPS reps"
    for r in $(seq "$REPS"); do
      drop
      j=$($FIO --name=seqread --filename="$fnames" --rw=read --bs=1M --iodepth=32 --ioengine=$engine --direct=1 \
            --readonly --output-format=json 2>/dev/null)
      python3 -c '
import json,sys
d=json.loads(sys.stdin.read()); r=d["jobs"][0]["read"]
print(json.dumps({"stage":"fio","rep":int(sys.argv[1]),"bytes":r["io_bytes"],"seconds":r["runtime"]/1000.0,"engine":sys.argv[2]}))' \
        "$r" "$engine" <<<"$j" >>"$JSONL" || echo "fio rep $r failed"
    done
  else
    log "fio: not found ($FIO); the cold reference is dd iflag=direct bs=64M"
    for r in $(seq "$REPS"); do
      drop
      t0=$(now)
      for f in "${FILES[@]}"; do dd if="$f" of=/dev/null bs=64M iflag=direct status=none || exit 1; done
      t1=$(now)
      rec "{\"stage\":\"dd\",\"rep\":$r,\"bytes\":$FILE_BYTES,\"seconds\":$(python3 -c "print($t1-$t0)")}"
    done
  fi
fi

publish_once() {  # stage rep [extra args]: one process; with --repeat N, N records (rep, rep+1, ...)
  local stage=$1 rep=$2
  shift 2
  local j
  j=$("$PUBLISH" "$CKPT_PATH" --region "$REGION" --slot-mb "$SLOT_MB" --slots "$SLOTS" --io "$IO" --json "$@") ||
    { echo "publish failed: $j" >&2; return 1; }
  python3 -c '
import json,sys
for i, l in enumerate(x for x in sys.stdin.read().splitlines() if x.startswith("{")):
    d = json.loads(l)
    print(json.dumps({"stage":sys.argv[1],"rep":int(sys.argv[2])+i,"bytes":d["payload_bytes"],"seconds":d["publish_s"],
      "drain_s":d["drain_s"],"io_path":d["io"]["path"],"registered":d["io"]["registered_buffers"],
      "fallback":d["io"]["fallback_reason"],"staging":d["io"]["staging_bytes"]}))' "$stage" "$rep" <<<"$j" >>"$JSONL"
}

# ---------------------------------------------------------------- publish, cold and warm
if has cold; then
  log "publish, cold page cache, a fresh process per sync: $REPS reps"
  for r in $(seq "$REPS"); do
    drop
    publish_once cold_first "$r" || exit 1
  done
  log "publish, cold page cache, $REPS syncs of one process (--drop-cache before each)"
  drop
  publish_once cold 1 --repeat "$REPS" --drop-cache || exit 1
fi
if has warm; then
  warm
  log "publish, warm page cache, a fresh process per sync: $REPS reps"
  for r in $(seq "$REPS"); do publish_once warm_first "$r" || exit 1; done
  log "publish, warm page cache, $REPS syncs of one process"
  publish_once warm 1 --repeat "$REPS" || exit 1
fi

# ---------------------------------------------------------------- publish --store
# A store region: the reads land straight in the bank (Producer::fill_spans,
# Reader::read_tensors), no staging window and no second copy.
if has store; then
  log "publish --store, cold page cache, $REPS syncs of one process (--drop-cache before each)"
  drop
  publish_once store_cold 1 --repeat "$REPS" --drop-cache --store || exit 1
  warm
  log "publish --store, warm page cache, $REPS syncs of one process"
  publish_once store_warm 1 --repeat "$REPS" --store || exit 1
fi

# ---------------------------------------------------------------- memcpy (warm reference)
if has memcpy; then
  log "memcpy: single thread, $BYTES bytes, $REPS reps"
  "$REF" memcpy "$BYTES" --reps "$REPS" | python3 -c '
import json,sys
d=json.loads(sys.stdin.read())
for i,s in enumerate(d["all_s"]): print(json.dumps({"stage":"memcpy","rep":i+1,"bytes":d["bytes"],"seconds":s}))' >>"$JSONL"
fi

# ---------------------------------------------------------------- safetensors.torch.load_file
if has python; then
  if $PY -c "import torch, safetensors.torch" 2>/dev/null; then
    log "python: safetensors.torch.load_file, cold and warm, $REPS reps each"
    for mode in cold warm; do
      [ $mode = warm ] && warm
      for r in $(seq "$REPS"); do
        [ $mode = cold ] && drop
        $PY - "$mode" "$r" "${FILES[@]}" >>"$JSONL" <<'PYEOF' || exit 1
import json, sys, time
from safetensors.torch import load_file
mode, rep, files = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
t0 = time.perf_counter()
n = 0
for f in files:
    d = load_file(f)
    # load_file may hand back tensors backed by a lazy mapping of the file:
    # copy each into memory of its own (what a worker's load does), so that
    # every byte is read inside the timed region.
    d = {k: t.clone() for k, t in d.items()}
    n += sum(t.numel() * t.element_size() for t in d.values())
dt = time.perf_counter() - t0
print(json.dumps({"stage": "load_file_" + mode, "rep": rep, "bytes": n, "seconds": dt}))
PYEOF
      done
    done
  else
    log "python: $PY has no torch + safetensors: skipped"
  fi
fi

# ---------------------------------------------------------------- variants
if has variants; then
  log "variants: --io pread cold and warm, inline buffered io_uring warm; $REPS syncs of one process each"
  drop
  IO=pread publish_once pread_cold 1 --repeat "$REPS" --drop-cache || exit 1
  warm
  IO=pread publish_once pread_warm 1 --repeat "$REPS" || exit 1
  SHMCAST_URING_INLINE=1 IO=buffered publish_once uring_inline_warm 1 --repeat "$REPS" || exit 1
  IO=buffered publish_once uring_async_warm 1 --repeat "$REPS" || exit 1
fi

# ---------------------------------------------------------------- N host consumers
# N consumer processes attach, then one shmcast-publish process publishes
# REPS syncs (--repeat), each once all N are attached and until all N have
# read it (publish_s + drain_s is the time until the last consumer has every
# byte in its own memory). Destinations are faulted in beforehand.
if has consumers && [ -n "$CONSUMERS" ]; then
  warm
  for n in $CONSUMERS; do
    log "publish to $n host consumer(s), warm cache: $REPS syncs of one process"
    pids=()
    for c in $(seq "$n"); do
      "$REF" consume "$REGION" --timeout 120 --prefault "$BYTES" --syncs "$REPS" >"$OUT/consumer-$n-$c.jsonl" 2>/dev/null &
      pids+=($!)
    done
    publish_once "consumers_$n" 1 --repeat "$REPS" --wait-consumers "$n" --wait-timeout 60 --max-consumers "$n" || exit 1
    for p in "${pids[@]}"; do wait "$p" || echo "a consumer failed" >&2; done
  done
fi

# ---------------------------------------------------------------- summary
python3 - "$JSONL" "$OUT/summary.txt" "$drop_method" "$CKPT_PATH" "$REPS" <<'PYEOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
by = {}
for r in rows:
    if "stage" in r:
        by.setdefault(r["stage"], []).append(r)
def st(stage):
    v = by.get(stage)
    if not v: return None
    s = sorted(x["seconds"] + (x.get("drain_s", 0) if stage.startswith("consumers_") else 0) for x in v)
    b = v[0]["bytes"]
    return {"n": len(s), "min": s[0], "med": statistics.median(s), "max": s[-1], "bytes": b,
            "gbps": b / statistics.median(s) / 1e9}
out = []
out.append(f"checkpoint: {sys.argv[4]}; cache drop: {sys.argv[3] or 'n/a'}; reps: {sys.argv[5]}")
out.append(f"{'figure':<28} {'n':>3} {'min s':>8} {'median s':>9} {'max s':>8} {'GB/s (median)':>14}  notes")
notes = {}
for k, v in by.items():
    if v and "io_path" in v[0]:
        notes[k] = "io " + ",".join(sorted({x["io_path"] for x in v})) + \
                   ("; registered buffers" if all(x["registered"] for x in v) else "") + \
                   f"; staging {v[0]['staging'] >> 20} MiB"
for k in ["fio", "dd", "cold", "cold_first", "warm", "warm_first", "memcpy", "load_file_cold", "load_file_warm",
          "pread_cold", "pread_warm", "uring_async_warm", "uring_inline_warm", "store_cold", "store_warm"] + \
         sorted(x for x in by if x.startswith("consumers_")):
    s = st(k)
    if s:
        out.append(f"{k:<28} {s['n']:>3} {s['min']:>8.3f} {s['med']:>9.3f} {s['max']:>8.3f} {s['gbps']:>14.2f}  {notes.get(k, '')}")
ref = st("fio") or st("dd")
def ratio(a, b, label):
    if a and b: out.append(f"{label}: {a['gbps'] / b['gbps']:.2f}x (medians)")
refname = "fio O_DIRECT" if st("fio") else "dd iflag=direct"
ratio(st("cold"), ref, "publish cold (steady) / " + refname)
ratio(st("cold_first"), ref, "publish cold (first sync of a process) / " + refname)
ratio(st("warm"), st("memcpy"), "publish warm (steady) / single-thread memcpy")
ratio(st("warm_first"), st("memcpy"), "publish warm (first sync of a process) / single-thread memcpy")
ratio(st("pread_cold"), ref, "publish cold with --io pread (steady) / " + refname)
ratio(st("store_cold"), ref, "publish --store cold (steady) / " + refname)
ratio(st("store_warm"), st("memcpy"), "publish --store warm (steady) / single-thread memcpy")
ratio(st("cold"), st("load_file_cold"), "publish cold / load_file cold")
ratio(st("warm"), st("load_file_warm"), "publish warm / load_file warm")
text = "\n".join(out)
print(text)
open(sys.argv[2], "w").write(text + "\n")
PYEOF
