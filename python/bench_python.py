#!/usr/bin/env python3
"""Python-API benchmark of shmcast: the cost of the Python layer per sync of
the 434-tensor Qwen2.5-3B manifest, and the sync rate through the Python API.

    PYTHONPATH=build/python python3 python/bench_python.py                 # cuda if available, else cpu
    PYTHONPATH=build/python python3 python/bench_python.py --device cpu --scale 0.25
    PYTHONPATH=build/python python3 python/bench_python.py --device cuda --mode staging --json

Two processes (spawned): a producer holding the manifest's tensors on the
device and calling Producer.send(), and a consumer calling
Consumer.receive() on the same device (same GPU with --device cuda).

What is reported, each the median over --iters syncs after --warmup:
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

The manifest: embedding 151936 x 2048; 36 layers of q_proj 2048x2048 + bias,
k_proj / v_proj 256x2048 + bias, o_proj 2048x2048, gate_proj / up_proj
11008x2048, down_proj 2048x11008, two 2048 norms; final norm; bf16. --scale
shrinks the matrix dimensions (tensor count stays 434) for small machines.
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


def _now() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)  # one clock for both processes


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
    for i, (name, shape) in enumerate(qwen25_3b_manifest(args["scale"])):
        t = torch.full(shape, float(i % 200 + 1), dtype=torch.bfloat16, device=dev)
        tensors.append((name, t))
    payload = sum(t.numel() * t.element_size() for _, t in tensors)
    _sync(dev)
    prod = shmcast.Producer(args["region"], slot_bytes=args["slot_bytes"], slots=args["slots"], max_consumers=2)
    timed = _Timed(prod._c)
    prod._c = timed
    conn.send({"ready": True, "payload": payload, "region_bytes": prod.region_bytes, "pinned": prod.pinned,
               "slot_bytes": prod.slot_bytes})
    prod.wait_for_consumers(1, 120)
    rows = []
    while True:
        msg = conn.recv()
        if msg == "stop":
            break
        object.__setattr__(timed, "ns", 0)
        t0 = _now()
        prod.send(tensors)
        t1 = _now()
        rows.append({"start": t0, "send_ns": t1 - t0, "cxx_ns": timed.ns})
        conn.send(rows[-1])
    prod.wait_drained(60)
    prod.close()


def consumer_main(args, conn):
    import torch

    import shmcast

    dev = args["device"]
    cons = shmcast.Consumer(args["region"], device=dev, open_timeout=120, mode=args["mode"])
    timed = _Timed(cons._c)
    cons._c = timed
    conn.send({"ready": True, "pinned": cons.pinned})
    manifest = qwen25_3b_manifest(args["scale"])
    while True:
        msg = conn.recv()
        if msg == "stop":
            break
        object.__setattr__(timed, "ns", 0)
        t0 = _now()
        got = cons.receive(timeout=120)
        _sync(dev)
        t1 = _now()
        # cheap check: every tensor holds its index-derived constant, ends included
        ok = len(got) == 434 and [n for n, _ in got] == [n for n, _ in manifest]
        if msg == "check":
            for i, (_, t) in enumerate(got):
                flat = t.reshape(-1)
                want = float(i % 200 + 1)
                ok = ok and flat[0].item() == want and flat[-1].item() == want
        del got
        conn.send({"end": t1, "recv_ns": t1 - t0, "cxx_ns": timed.ns, "ok": ok})
    cons.close()


def run(args) -> dict:
    ctx = mp.get_context("spawn")
    pa, pb = ctx.Pipe()
    ca, cb = ctx.Pipe()
    p = ctx.Process(target=producer_main, args=(args, pb), daemon=True)
    c = ctx.Process(target=consumer_main, args=(args, cb), daemon=True)
    p.start()
    info = pa.recv()
    c.start()
    cinfo = ca.recv()
    rows = []
    for it in range(args["warmup"] + args["iters"]):
        ca.send("check" if it == args["warmup"] + args["iters"] - 1 else "go")
        time.sleep(0.05)  # the consumer is waiting in receive()
        pa.send("go")
        pr = pa.recv()
        cr = ca.recv()
        if it >= args["warmup"]:
            rows.append((pr, cr))
    pa.send("stop")
    ca.send("stop")
    p.join(60)
    c.join(60)
    payload = info["payload"]
    e2e = [cr["end"] - pr["start"] for pr, cr in rows]
    med = statistics.median

    def ms(xs):
        return round(med(xs) / 1e6, 3)

    return {
        "device": args["device"],
        "mode": args["mode"],
        "scale": args["scale"],
        "tensors": 434,
        "payload_bytes": payload,
        "slot_bytes": info["slot_bytes"],
        "slots": args["slots"],
        "pinned": [info["pinned"], cinfo["pinned"]],
        "iters": args["iters"],
        "sync_ms": ms(e2e),
        "sync_ms_min": round(min(e2e) / 1e6, 3),
        "gbps": round(payload / med(e2e), 3),  # bytes/ns = GB/s
        "send_ms": ms([pr["send_ns"] for pr, _ in rows]),
        "send_cxx_ms": ms([pr["cxx_ns"] for pr, _ in rows]),
        "send_python_overhead_ms": ms([pr["send_ns"] - pr["cxx_ns"] for pr, _ in rows]),
        "receive_ms": ms([cr["recv_ns"] for _, cr in rows]),
        "receive_cxx_ms": ms([cr["cxx_ns"] for _, cr in rows]),
        "receive_python_overhead_ms": ms([cr["recv_ns"] - cr["cxx_ns"] for _, cr in rows]),
        "bit_check": all(cr["ok"] for _, cr in rows),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    ap.add_argument("--mode", default="copy", choices=["copy", "staging"], help="Consumer receive mode")
    ap.add_argument("--scale", type=float, default=None,
                    help="matrix dimension scale (default 1.0 on cuda, 0.25 on cpu)")
    ap.add_argument("--slot-bytes", default="256M")
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
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
    args = dict(device=dev, mode=a.mode, scale=scale, slot_bytes=slot, slots=a.slots, iters=a.iters,
                warmup=a.warmup, region=f"bench-py-{os.getpid()}")
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
        print(f"shmcast Python bench: Qwen2.5-3B manifest x{scale} ({r['payload_bytes'] / 1e9:.3f} GB, 434 tensors), "
              f"{dev}, receive mode '{a.mode}', {a.slots} x {r['slot_bytes'] >> 20} MiB slots, "
              f"median of {a.iters} syncs (pinned: producer {r['pinned'][0]}, consumer {r['pinned'][1]})")
        print(f"  end to end            {r['sync_ms']:10.3f} ms  = {r['gbps']:.2f} GB/s")
        print(f"  send()                {r['send_ms']:10.3f} ms  (C++ {r['send_cxx_ms']:.3f} ms, "
              f"Python overhead {r['send_python_overhead_ms']:.3f} ms)")
        print(f"  receive()             {r['receive_ms']:10.3f} ms  (C++ {r['receive_cxx_ms']:.3f} ms, "
              f"Python overhead {r['receive_python_overhead_ms']:.3f} ms)")
        print(f"  values checked        {'yes' if r['bit_check'] else 'NO'}")
    return 0 if r["bit_check"] else 1


if __name__ == "__main__":
    sys.exit(main())
