#!/usr/bin/env python3
"""Python-API benchmark of shmcast: the cost of the Python layer per sync of
the 434-tensor Qwen2.5-3B manifest, and the sync rate through the Python API.

    PYTHONPATH=build/python python3 python/bench_python.py                 # cuda if available, else cpu
    PYTHONPATH=build/python python3 python/bench_python.py --device cpu --scale 0.25
    PYTHONPATH=build/python python3 python/bench_python.py --device cuda --mode staging --json
    PYTHONPATH=build/python python3 python/bench_python.py --manifest qwen3-30b-a3b:8     # then -dense:8

Two processes (spawned): a producer holding the manifest's tensors on the
device and calling Producer.send(), and a consumer calling
Consumer.receive() on the same device (same GPU with --device cuda).

Every sync carries fresh random bytes: before each repetition, outside the
timed region, the producer overwrites its tensors with new content (a random
pool, rotated and XORed with a fresh 64-bit key per 8 MiB block, keys drawn
from the run's seed, the repetition and the tensor), and after the timer
stopped the consumer recomputes that content on its device and compares
every byte (torch.equal). Two repetitions differ everywhere, so a stale slot
or a chunk of an earlier sync is caught. `verified: N/N` counts the timed
syncs that matched; any mismatch exits 1.

What is reported, as median (min, max) over --iters syncs after --warmup:
* sync time and GB/s end to end: from the producer entering send() to the
  consumer's receive() returning with the data usable (CUDA: after
  synchronizing its stream); payload bytes / time.
* Python overhead per sync: wall time of send() (receive()) minus the time
  spent inside the shmcast C++ calls it made (send_batch; wait_sync +
  read_into / read_into_device / read_to_staging), measured by timing each
  call into the binding. This is everything the Python layer adds beyond
  the C++ API path: building the spec/pointer lists, stream lookups, torch
  buffer allocation and the per-tensor views.
* the C++ time itself (what a C++ program making the same batched calls
  would spend).
* the ceiling, measured in the same run just before the syncs (--ceiling-reps
  copies): with CUDA, one process copying between the device and pinned host
  memory (D2H alone, H2D alone, and both at once on two streams: bytes each
  way / time until both finish; the ratio is taken to that concurrent
  figure); on the CPU, a single-thread memcpy of the payload.

The manifest: embedding 151936 x 2048; 36 layers of q_proj 2048x2048 + bias,
k_proj / v_proj 256x2048 + bias, o_proj 2048x2048, gate_proj / up_proj
11008x2048, down_proj 2048x11008, two 2048 norms; final norm; bf16. --scale
shrinks the matrix dimensions (tensor count stays 434) for small machines.
--manifest qwen3-30b-a3b[:N] takes Qwen3-30B-A3B's shapes instead (the first
N of its 48 layers: 128 experts of 768 x 2048 per layer, 3 matrices each),
and qwen3-30b-a3b-dense[:N] the same bytes with each layer's experts in
three tensors, to compare a MoE model against a dense one of its size.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

# Run from the source tree, this file's folder holds the *source* package
# python/shmcast (without the compiled extension): import the built one
# from PYTHONPATH instead.
_here = os.path.dirname(os.path.abspath(__file__))
if os.path.isdir(os.path.join(_here, "shmcast")):
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]


def qwen25_3b_manifest(scale: float = 1.0):
    def s(n):
        return max(8, int(round(n * scale / 8)) * 8)

    from shmcast.manifests import QWEN25_3B, qwen2_shapes

    cfg = {k: (v if k == "layers" else s(v)) for k, v in QWEN25_3B.items()}
    out = qwen2_shapes(**cfg)
    assert len(out) == 434
    return out


def bench_manifest(name: str = "qwen2.5-3b", scale: float = 1.0):
    """[(name, shape)] of --manifest: qwen2.5-3b, or qwen3-30b-a3b[:layers] /
    qwen3-30b-a3b-dense[:layers] (shmcast.manifests.by_name, the shapes of
    shmcast-bench --manifest). --scale shrinks the matrix dimensions (hidden,
    expert and head sizes, vocabulary; the tensor count stays)."""
    if name == "qwen2.5-3b":
        return qwen25_3b_manifest(scale)
    from shmcast.manifests import QWEN3_30B_A3B, by_name, qwen3_moe_shapes

    out = by_name(name)  # checks the name and the layer count
    if scale == 1.0:
        return out
    base, _, n = name.partition(":")

    def s(v):
        return max(8, int(round(v * scale / 8)) * 8)

    cfg = dict(QWEN3_30B_A3B)
    for k in ("hidden", "moe_intermediate", "head_dim", "vocab"):
        cfg[k] = s(cfg[k])
    if n:
        cfg["layers"] = int(n)
    scaled = qwen3_moe_shapes(**cfg, dense=base.endswith("-dense"))
    assert len(scaled) == len(out)
    return scaled


def _now() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)  # one clock for both processes


_MASK = (1 << 64) - 1
_POOL_WORDS = 1 << 20  # 8 MiB of int64


def _mix(x: int) -> int:
    """splitmix64's finaliser (a bijection of 64-bit words)."""
    x &= _MASK
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


class Content:
    """Fresh random bytes per (seed, rep, tensor), regenerated on either side.

    A random pool of 8 MiB (the same in every process: random.Random(seed)),
    held twice in a row on the device; block b of a tensor (8 MiB) is the
    pool from a random offset, XORed with a random 64-bit word, both drawn
    from (seed, rep, tensor, b). Filling and checking are one elementwise pass
    at memory speed, on the tensor's device."""

    def __init__(self, seed: int, device):
        import random

        import torch

        self.seed = seed
        raw = bytearray(random.Random(seed).randbytes(_POOL_WORDS * 8))
        pool = torch.frombuffer(raw, dtype=torch.int64).to(device)
        self.pool2 = torch.cat([pool, pool])

    def _blocks(self, flat, rep: int, i: int):
        """(slice of flat, pool slice, key) for every block of the int64 view."""
        n = flat.numel()
        base = _mix(self.seed * 0x9E3779B97F4A7C15 + (rep << 20) + i)
        for b, at in enumerate(range(0, n, _POOL_WORDS)):
            k = _mix(base + (b + 1) * 0x9E3779B97F4A7C15)
            off = _mix(k ^ 0x0FF5E7) % _POOL_WORDS
            m = min(_POOL_WORDS, n - at)
            yield flat[at:at + m], self.pool2[off:off + m], _signed(k)

    @staticmethod
    def _words(t):
        import torch

        flat = t.reshape(-1)
        if flat.data_ptr() != t.data_ptr():
            raise ValueError("content: tensor is not contiguous")
        nb = flat.numel() * flat.element_size()
        if nb % 8:
            raise ValueError(f"content: {nb} bytes is not a multiple of 8")
        return flat.view(torch.uint8).view(torch.int64)

    def fill(self, t, rep: int, i: int):
        import torch

        for dst, src, k in self._blocks(self._words(t), rep, i):
            torch.bitwise_xor(src, k, out=dst)

    def equal(self, t, rep: int, i: int) -> bool:
        import torch

        return all(torch.equal(dst, torch.bitwise_xor(src, k)) for dst, src, k in self._blocks(self._words(t), rep, i))


def _stat(xs, scale=1.0, nd=3):
    return {"median": round(statistics.median(xs) * scale, nd), "min": round(min(xs) * scale, nd),
            "max": round(max(xs) * scale, nd)}


def measure_ceiling(device: str, nbytes: int, reps: int) -> dict:
    """The copy ceiling on this machine, measured now (GB/s over `reps` copies
    after one untimed): CUDA, pinned D2H / H2D alone and both at once on two
    streams (bytes each way / time until both finish); CPU, a single-thread
    memcpy of nbytes."""
    import torch

    gbs = lambda s: nbytes / s / 1e9  # noqa: E731
    if not device.startswith("cuda"):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            a = torch.empty(nbytes, dtype=torch.uint8)
            a.fill_(7)
            b = torch.empty_like(a)
            b.fill_(1)
            xs = []
            for i in range(reps + 1):
                t0 = time.perf_counter()
                b.copy_(a)
                if i:
                    xs.append(gbs(time.perf_counter() - t0))
        finally:
            torch.set_num_threads(threads)
        return {"kind": "single-thread memcpy", "bytes": nbytes, "reps": reps, "gbps": _stat(xs, nd=2)}
    dev = torch.device(device)
    n = min(nbytes, 512 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    src.fill_(3)
    dst = torch.empty_like(src)
    ha = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    hb = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    hb.fill_(5)
    torch.cuda.synchronize(dev)
    s1, s2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    gb = lambda ms: n / (ms * 1e-3) / 1e9  # noqa: E731
    d2h, h2d, both = [], [], []
    for i in range(reps + 1):
        with torch.cuda.stream(s1):
            ev[0].record(s1)
            ha.copy_(src, non_blocking=True)
            ev[1].record(s1)
        ev[1].synchronize()
        if i:
            d2h.append(gb(ev[0].elapsed_time(ev[1])))
    for i in range(reps + 1):
        with torch.cuda.stream(s2):
            ev[0].record(s2)
            dst.copy_(hb, non_blocking=True)
            ev[1].record(s2)
        ev[1].synchronize()
        if i:
            h2d.append(gb(ev[0].elapsed_time(ev[1])))
    for i in range(reps + 1):
        ev[0].record(s1)
        s2.wait_event(ev[0])
        with torch.cuda.stream(s1):
            ha.copy_(src, non_blocking=True)
        with torch.cuda.stream(s2):
            dst.copy_(hb, non_blocking=True)
        ev[1].record(s1)
        ev[2].record(s2)
        ev[1].synchronize()
        ev[2].synchronize()
        if i:
            both.append(gb(max(ev[0].elapsed_time(ev[1]), ev[0].elapsed_time(ev[2]))))
    del src, dst, ha, hb
    torch.cuda.empty_cache()
    return {"kind": "pinned D2H + H2D at once, one process", "bytes": n, "reps": reps, "gbps": _stat(both, nd=2),
            "d2h_gbps": _stat(d2h, nd=2), "h2d_gbps": _stat(h2d, nd=2)}


class _Timed:
    """Wraps a binding object: forwards everything, sums the time spent in
    its method calls (the C++ side) into .ns."""

    def __init__(self, inner):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "ns", 0)

    def __getattr__(self, name):
        v = getattr(self._inner, name)
        if not callable(v):
            return v

        def call(*a, **k):
            t0 = time.perf_counter_ns()
            try:
                return v(*a, **k)
            finally:
                object.__setattr__(self, "ns", self.ns + time.perf_counter_ns() - t0)

        return call


def _sync(device):
    import torch

    if device.startswith("cuda"):
        torch.cuda.current_stream().synchronize()


def producer_main(args, conn):
    import torch

    import shmcast

    dev = args["device"]
    tensors = []
    for name, shape in bench_manifest(args["manifest"], args["scale"]):
        tensors.append((name, torch.empty(shape, dtype=torch.bfloat16, device=dev)))
    payload = sum(t.numel() * t.element_size() for _, t in tensors)
    content = Content(args["seed"], dev)
    _sync(dev)
    prod = shmcast.Producer(args["region"], slot_bytes=args["slot_bytes"], slots=args["slots"], max_consumers=2)
    timed = _Timed(prod._c)
    prod._c = timed
    conn.send({"ready": True, "payload": payload, "region_bytes": prod.region_bytes, "pinned": prod.pinned,
               "slot_bytes": prod.slot_bytes})
    prod.wait_for_consumers(1, 120)
    while True:
        msg = conn.recv()
        if msg == "stop":
            break
        if msg["op"] == "ceiling":
            conn.send(measure_ceiling(dev, payload, args["ceiling_reps"]))
        elif msg["op"] == "prep":  # fresh bytes for this repetition, untimed
            for i, (_n, t) in enumerate(tensors):
                content.fill(t, msg["rep"], i)
            _sync(dev)
            conn.send({"prepared": msg["rep"]})
        elif msg["op"] == "go":
            object.__setattr__(timed, "ns", 0)
            t0 = _now()
            prod.send(tensors)
            t1 = _now()
            conn.send({"start": t0, "send_ns": t1 - t0, "cxx_ns": timed.ns})
    prod.wait_drained(60)
    prod.close()


def consumer_main(args, conn):
    import torch

    import shmcast

    # SHMCAST_BENCH_CORRUPT=i: flip a bit of the first tensor of repetition i after
    # the timer stopped (a self-test of the check; the run must then exit 1)
    corrupt = int(os.environ.get("SHMCAST_BENCH_CORRUPT", "-1") or -1)
    dev = args["device"]
    cons = shmcast.Consumer(args["region"], device=dev, open_timeout=120, mode=args["mode"])
    timed = _Timed(cons._c)
    cons._c = timed
    content = Content(args["seed"], dev)
    conn.send({"ready": True, "pinned": cons.pinned})
    manifest = bench_manifest(args["manifest"], args["scale"])
    names = [n for n, _ in manifest]
    while True:
        msg = conn.recv()
        if msg == "stop":
            break
        object.__setattr__(timed, "ns", 0)
        t0 = _now()
        got = cons.receive(timeout=120)
        _sync(dev)
        t1 = _now()
        cxx = timed.ns
        if msg["rep"] == corrupt and got:  # self-test of the checker: flip one bit
            b = got[0][1].reshape(-1).view(torch.uint8)
            b[b.numel() // 3] ^= 1
        # every byte of every tensor, on the device, after the timer stopped
        bad = []
        if [n for n, _ in got] != names:
            bad.append("tensor names or count differ from the manifest")
        else:
            for i, (n, t) in enumerate(got):
                if not content.equal(t, msg["rep"], i):
                    bad.append(n)
        del got
        conn.send({"end": t1, "recv_ns": t1 - t0, "cxx_ns": cxx, "bad": len(bad), "first_bad": bad[0] if bad else None})
    cons.close()


def run(args) -> dict:
    ctx = mp.get_context("spawn")
    pa, pb = ctx.Pipe()
    ca, cb = ctx.Pipe()
    p = ctx.Process(target=producer_main, args=(args, pb), daemon=True)
    c = ctx.Process(target=consumer_main, args=(args, cb), daemon=True)
    p.start()
    pb.close()  # our copy of the child's end: without it a dead child reads as EOF, not a hang
    info = pa.recv()
    c.start()
    cb.close()
    cinfo = ca.recv()
    # The ceiling of this configuration, measured now, while the consumer waits.
    pa.send({"op": "ceiling"})
    ceiling = pa.recv()
    rows, warm_bad, first_bad = [], 0, None
    for it in range(args["warmup"] + args["iters"]):
        pa.send({"op": "prep", "rep": it})
        pa.recv()
        ca.send({"op": "go", "rep": it})
        time.sleep(0.05)  # the consumer is waiting in receive()
        pa.send({"op": "go"})
        pr = pa.recv()
        cr = ca.recv()
        if cr["bad"] and first_bad is None:
            first_bad = f"rep {it}: {cr['first_bad']}"
        if it >= args["warmup"]:
            rows.append((pr, cr))
        elif cr["bad"]:
            warm_bad += 1
    pa.send("stop")
    ca.send("stop")
    p.join(60)
    c.join(60)
    payload = info["payload"]
    e2e = [(cr["end"] - pr["start"]) / 1e6 for pr, cr in rows]  # ms
    good = sum(1 for _pr, cr in rows if cr["bad"] == 0)
    r = {
        "device": args["device"],
        "mode": args["mode"],
        "scale": args["scale"],
        "manifest": args["manifest"],
        "tensors": len(bench_manifest(args["manifest"], args["scale"])),
        "payload_bytes": payload,
        "slot_bytes": info["slot_bytes"],
        "slots": args["slots"],
        "pinned": [info["pinned"], cinfo["pinned"]],
        "iters": args["iters"],
        "warmup": args["warmup"],
        "seed": args["seed"],
        "ceiling": ceiling,
        "ceiling_gbps": ceiling["gbps"]["median"],
        "ceiling_gbps_min": ceiling["gbps"]["min"],
        "ceiling_gbps_max": ceiling["gbps"]["max"],
        "verified": f"{good}/{len(rows)}",
        "warmup_verified": f"{args['warmup'] - warm_bad}/{args['warmup']}",
        "first_mismatch": first_bad,
        "bit_check": good == len(rows) and warm_bad == 0,
    }
    # each figure: median under its name, min and max beside it
    figures = {
        "sync_ms": e2e,
        "gbps": [payload / x * 1e-6 for x in e2e],  # e2e in ms here: bytes/ms * 1e-6 = GB/s
        "send_ms": [pr["send_ns"] for pr, _ in rows],
        "send_cxx_ms": [pr["cxx_ns"] for pr, _ in rows],
        "send_python_overhead_ms": [pr["send_ns"] - pr["cxx_ns"] for pr, _ in rows],
        "receive_ms": [cr["recv_ns"] for _, cr in rows],
        "receive_cxx_ms": [cr["cxx_ns"] for _, cr in rows],
        "receive_python_overhead_ms": [cr["recv_ns"] - cr["cxx_ns"] for _, cr in rows],
    }
    for k, xs in figures.items():
        if k.endswith("_ms") and k != "sync_ms":
            xs = [x / 1e6 for x in xs]
        st = _stat(xs)
        r[k], r[k + "_min"], r[k + "_max"] = st["median"], st["min"], st["max"]
    r["ratio"] = round(r["gbps"] / r["ceiling_gbps"], 3) if r["ceiling_gbps"] else None
    return r


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    ap.add_argument("--mode", default="copy", choices=["copy", "staging"], help="Consumer receive mode")
    ap.add_argument("--manifest", default="qwen2.5-3b",
                    help="tensor set: qwen2.5-3b (default), qwen3-30b-a3b[:layers] or qwen3-30b-a3b-dense[:layers] "
                         "(the first N of 48 layers; -dense: the same bytes, each layer's experts in 3 tensors)")
    ap.add_argument("--scale", type=float, default=None,
                    help="matrix dimension scale (default 1.0 on cuda, 0.25 on cpu)")
    ap.add_argument("--slot-bytes", default="256M")
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--iters", "--reps", type=int, default=10, help="timed syncs (default 10)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--ceiling-reps", type=int, default=10, help="copies of the ceiling measurement (default 10)")
    ap.add_argument("--seed", type=int, default=None, help="seed of the random bytes (default: a fresh one)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args(argv)
    import torch

    dev = a.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    if dev == "cuda":
        dev = "cuda:0"
    scale = a.scale if a.scale is not None else (1.0 if dev.startswith("cuda") else 0.25)
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sb = a.slot_bytes.upper().rstrip("B").rstrip("I")
    slot = int(float(sb[:-1]) * units[sb[-1]]) if sb[-1] in units else int(sb)
    seed = a.seed if a.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    bench_manifest(a.manifest, scale)  # a bad name or layer count fails here, before any process starts
    args = dict(device=dev, manifest=a.manifest, mode=a.mode, scale=scale, slot_bytes=slot, slots=a.slots, iters=a.iters,
                warmup=a.warmup, ceiling_reps=a.ceiling_reps, seed=seed, region=f"bench-py-{os.getpid()}")
    try:
        r = run(args)
    finally:
        try:
            import shmcast

            shmcast.unlink_region(args["region"])
        except Exception:
            pass
    if a.json:
        print(json.dumps(r))
    else:
        c = r["ceiling"]

        def mm(k):
            return f"{r[k]:9.3f} ms (min {r[k + '_min']:.3f}, max {r[k + '_max']:.3f})"

        print(f"shmcast Python bench: {a.manifest} manifest x{scale} ({r['payload_bytes'] / 1e9:.3f} GB, "
              f"{r['tensors']} tensors), "
              f"{dev}, receive mode '{a.mode}', {a.slots} x {r['slot_bytes'] >> 20} MiB slots, "
              f"{a.iters} timed syncs after {a.warmup} warm-up, fresh random bytes each "
              f"(pinned: producer {r['pinned'][0]}, consumer {r['pinned'][1]})")
        print(f"  end to end            {mm('sync_ms')} = {r['gbps']:.2f} GB/s (min {r['gbps_min']:.2f}, "
              f"max {r['gbps_max']:.2f})")
        print(f"  ceiling               {r['ceiling_gbps']:.2f} GB/s (min {r['ceiling_gbps_min']:.2f}, max "
              f"{r['ceiling_gbps_max']:.2f}): {c['kind']}, {c['reps']} copies just before; ratio {r['ratio']}")
        print(f"  send()                {mm('send_ms')}")
        print(f"    C++                 {mm('send_cxx_ms')}")
        print(f"    Python overhead     {mm('send_python_overhead_ms')}")
        print(f"  receive()             {mm('receive_ms')}")
        print(f"    C++                 {mm('receive_cxx_ms')}")
        print(f"    Python overhead     {mm('receive_python_overhead_ms')}")
        print(f"  verified              {r['verified']} timed syncs (+ {r['warmup_verified']} warm-up), every byte"
              + (f"; FIRST MISMATCH: {r['first_mismatch']}" if r["first_mismatch"] else ""))
    if not r["bit_check"]:
        print(f"bench_python: MISMATCH: {r['first_mismatch']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
