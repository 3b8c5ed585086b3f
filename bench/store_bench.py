"""Store-region bench (issue #14, docs/benchmarks-log.md "Store regions"), on one GPU.

A trainer process keeps a Qwen2.5-3B-shaped bf16 model (434 tensors,
6,171,877,376 bytes) on cuda:0 and stores it in a store region
(Producer(mode='store'), CUDA engine, pinned), with fresh random bytes for
every version (bench_python.Content: regenerated and checked on the GPU by
the readers, every byte). Stages, each REPS times (min / median / max):

  ceiling    pinned H2D of 512 MiB, measured in this run (the reference)
  late       a late joiner: a fresh process opens the region (pinning it)
             after the version is stored and receive_into()s its own GPU
             tensors: GB/s of the receive (open and pin reported apart)
  drill      restart drill: the trainer stores a new version every
             --interval s; a worker opens, receives the newest version,
             checks it, holds the next one as views and is SIGKILLed, and a
             new one starts; time from the end of open() to the newest
             version on its GPU, bit-exact; with pin=True and pin=False
  readers    N = 1, 2, 4 workers (one process each, all on cuda:0) load the
             stored version at once: time until all have it, against N
             processes doing safetensors.torch.load_file(device='cuda:0') of
             the same tensors from a file (warm page cache), in the same run

  python3 bench/store_bench.py --reps 10 --out store.jsonl
  python3 bench/store_bench.py --scale 0.05 --reps 3        # a small smoke run
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# bench_python (Content, measure_ceiling) lives in python/, next to the
# source package: appended, so that the built shmcast on PYTHONPATH wins.
sys.path.append(os.path.join(HERE, "..", "python"))


def _now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)  # one clock for every process


def _stat(xs, nd=3):
    return {"median": round(statistics.median(xs), nd), "min": round(min(xs), nd), "max": round(max(xs), nd),
            "n": len(xs)}


def _recv(conn, proc, timeout=300.0):
    """The next message from a child, or an error as soon as it died."""
    end = time.monotonic() + timeout
    while not conn.poll(1.0):
        if not proc.is_alive():
            raise RuntimeError(f"{proc.name} exited with {proc.exitcode} before answering")
        if time.monotonic() > end:
            raise TimeoutError(f"{proc.name} did not answer within {timeout} s")
    return conn.recv()


def _model(scale):
    from bench_python import qwen25_3b_manifest

    return qwen25_3b_manifest(scale)


def _sync(device):
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _setup(device):
    import torch

    if device.startswith("cuda"):
        torch.cuda.set_device(device)


def _alloc(manifest, device):
    import torch

    return {n: torch.empty(s, dtype=torch.bfloat16, device=device) for n, s in manifest}


# ---------------------------------------------------------------- processes


def trainer(conn, region, scale, seed, device):
    import torch

    import shmcast
    from bench_python import Content

    _setup(device)
    manifest = _model(scale)
    ts = _alloc(manifest, device)
    content = Content(seed, device)
    p = shmcast.Producer(region, mode="store", store_bytes=shmcast.store_bytes_for(ts), pin=device.startswith("cuda"),
                         max_consumers=16, consumer_timeout=60.0)
    conn.send({"ready": True, "payload": sum(t.numel() * 2 for t in ts.values()), "region_bytes": p.region_bytes,
               "pin_s": p.raw.pin_seconds, "engine": p.raw.engine})

    def store():
        v = p.last_version + 1
        for i, t in enumerate(ts.values()):
            content.fill(t, v, i)
        _sync(device)
        t0 = _now()
        got = p.send(ts)
        return got, t0, _now()

    while True:
        cmd = conn.recv()
        if cmd[0] == "store":
            v, t0, t1 = store()
            conn.send({"version": v, "send_s": t1 - t0, "done": t1})
        elif cmd[0] == "save":  # the safetensors reference file
            from safetensors.torch import save_file

            save_file({k: t.contiguous() for k, t in ts.items()}, cmd[1])
            os.sync()
            conn.send({"version": p.last_version})
        elif cmd[0] == "loop":  # store every `interval` s until told to stop
            interval, log = cmd[1], []
            while not conn.poll(max(0.0, interval - (log[-1][2] - log[-1][1] if log else 0))):
                log.append(store())
            conn.recv()
            conn.send({"log": log})
        elif cmd[0] == "exit":
            p.close()
            conn.send({"bye": True})
            return


def reader(conn, region, scale, seed, pin, hold_after, device):
    """Opens the region, receives the newest version into its own GPU
    tensors, checks every byte; hold_after: then holds the next version as
    views until killed."""
    import torch

    import shmcast
    from bench_python import Content

    _setup(device)
    manifest = _model(scale)
    dst = _alloc(manifest, device)
    content = Content(seed, device)
    _sync(device)
    t0 = _now()
    c = shmcast.Consumer(region, device=device, pin=pin, open_timeout=60.0)
    t1 = _now()
    v = c.receive_into(dst, timeout=60.0)
    _sync(device)
    t2 = _now()
    bad = sum(0 if content.equal(t, v, i) else 1 for i, t in enumerate(dst.values()))
    res = {"version": v, "open_s": t1 - t0, "pin_s": c.raw.pin_seconds, "receive_s": t2 - t1, "opened": t1,
           "received": t2, "bad_tensors": bad}
    if hold_after:
        conn.send(res)
        view = c.hold(timeout=60.0)  # the next version, held by a process about to be killed
        conn.send({"holding": view.version})
        time.sleep(3600)
    conn.send(res)
    c.close()


def loader(conn, region, scale, seed, path, device):
    """One of N readers kept alive across repetitions: on ("shmcast",) it
    receives the newest version into its GPU tensors, on ("safetensors",) it
    load_file()s the reference file onto the GPU; checks every byte."""
    import torch

    import shmcast
    from bench_python import Content

    _setup(device)
    manifest = _model(scale)
    dst = _alloc(manifest, device)
    content = Content(seed, device)
    c = shmcast.Consumer(region, device=device, pin=device.startswith("cuda"), open_timeout=60.0)
    conn.send({"ready": True, "open_s": c.raw.open_seconds, "pin_s": c.raw.pin_seconds})
    while True:
        cmd = conn.recv()
        if cmd[0] == "exit":
            c.close()
            return
        t0 = _now()
        if cmd[0] == "shmcast":
            v = c.receive_into(dst, timeout=60.0)
            got = dst
        else:
            from safetensors.torch import load_file

            got = load_file(path, device=device)
            v = cmd[1]
        _sync(device)
        t1 = _now()
        bad = sum(0 if content.equal(got[n], v, i) else 1 for i, (n, _) in enumerate(manifest))
        del got
        conn.send({"start": t0, "end": t1, "version": v, "bad_tensors": bad})


# ---------------------------------------------------------------- stages


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--interval", type=float, default=1.0, help="drill: seconds between stored versions")
    ap.add_argument("--readers", default="1,2,4")
    ap.add_argument("--stages", default="ceiling,late,drill,readers")
    ap.add_argument("--file", default="/var/tmp/shmcast-store-bench.safetensors")
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda:0", help="cpu: a smoke run of the bench's logic without a GPU")
    a = ap.parse_args(argv)
    stages = a.stages.split(",")
    import torch

    from bench_python import measure_ceiling

    ctx = mp.get_context("spawn")
    region = f"store-bench-{os.getpid()}"
    seed = 20261130
    out = open(a.out, "a") if a.out else None

    def emit(rec):
        rec = {"bench": "store", "scale": a.scale, **rec}
        print(json.dumps(rec), flush=True)
        if out:
            out.write(json.dumps(rec) + "\n")
            out.flush()

    tc, tp = ctx.Pipe()
    tr = ctx.Process(target=trainer, args=(tp, region, a.scale, seed, a.device), daemon=True)
    tr.start()
    info = _recv(tc, tr)
    payload = info["payload"]
    cuda = a.device.startswith("cuda")
    emit({"stage": "trainer", **info, "device": torch.cuda.get_device_name(a.device) if cuda else "cpu"})

    def store():
        tc.send(("store",))
        return _recv(tc, tr)

    if "ceiling" in stages:
        c = measure_ceiling(a.device, 512 << 20, a.reps)
        emit({"stage": "ceiling", **c})

    if "late" in stages:
        xs, opens, pins, sends, bad = [], [], [], [], 0
        for _ in range(a.reps):
            s = store()
            sends.append(payload / s["send_s"] / 1e9)
            rc, rp = ctx.Pipe()
            r = ctx.Process(target=reader, args=(rp, region, a.scale, seed, cuda, False, a.device), daemon=True)
            r.start()
            res = _recv(rc, r)
            r.join(60)
            assert res["version"] == s["version"], (res, s)
            bad += res["bad_tensors"]
            xs.append(payload / res["receive_s"] / 1e9)
            opens.append(res["open_s"])
            pins.append(res["pin_s"])
        emit({"stage": "late", "payload_bytes": payload, "receive_gbps": _stat(xs, 2), "open_s": _stat(opens),
              "pin_s": _stat(pins), "store_send_gbps": _stat(sends, 2), "bad_tensors": bad})

    if "drill" in stages:
        for pin in (True, False):
            tc.send(("loop", a.interval))
            time.sleep(2 * a.interval)
            after, opens, got, bad, holds = [], [], [], 0, 0
            for _ in range(a.reps):
                rc, rp = ctx.Pipe()
                r = ctx.Process(target=reader, args=(rp, region, a.scale, seed, pin and cuda, True, a.device), daemon=True)
                r.start()
                res = _recv(rc, r)
                bad += res["bad_tensors"]
                after.append(res["received"] - res["opened"])
                opens.append(res["open_s"])
                got.append((res["opened"], res["version"]))
                if rc.poll(3 * a.interval + 10):  # it holds the next version: kill it now
                    rc.recv()
                    holds += 1
                r.kill()
                r.join(30)
            tc.send(("stop",))
            log = _recv(tc, tr)["log"]
            # Newest: no version stored before the worker's open() returned is newer than the one it got.
            newest = 0
            for opened, v in got:
                before = [ver for ver, _t0, t1 in log if t1 <= opened]
                newest += 1 if not before or v >= max(before) else 0
            emit({"stage": "drill", "pin": pin, "interval_s": a.interval, "payload_bytes": payload,
                  "after_open_s": _stat(after), "open_s": _stat(opens), "newest": newest, "reps": a.reps,
                  "killed_while_holding": holds, "bad_tensors": bad, "versions_stored": len(log)})

    if "readers" in stages:
        store()  # the tensors hold a stored version's bytes, whatever ran before
        tc.send(("save", a.file))
        saved = _recv(tc, tr)["version"]  # the file holds the version stored last
        for n in [int(x) for x in a.readers.split(",")]:
            pipes, procs = [], []
            for _ in range(n):
                rc, rp = ctx.Pipe()
                pr = ctx.Process(target=loader, args=(rp, region, a.scale, seed, a.file, a.device), daemon=True)
                pr.start()
                pipes.append(rc)
                procs.append(pr)
            opens = [_recv(p, pr) for p, pr in zip(pipes, procs)]
            res = {"shmcast": [], "safetensors": []}
            bad = {"shmcast": 0, "safetensors": 0}
            for kind in ("safetensors", "shmcast"):
                for _ in range(a.reps):
                    if kind == "shmcast":
                        store()  # fresh bytes; the workers load the newest version
                    for p in pipes:
                        p.send((kind, saved))
                    rs = [_recv(p, pr) for p, pr in zip(pipes, procs)]
                    bad[kind] += sum(r["bad_tensors"] for r in rs)
                    res[kind].append(max(r["end"] for r in rs) - min(r["start"] for r in rs))
            for p in pipes:
                p.send(("exit",))
            for pr in procs:
                pr.join(60)
            emit({"stage": "readers", "n": n, "payload_bytes": payload, "shmcast_all_s": _stat(res["shmcast"]),
                  "safetensors_all_s": _stat(res["safetensors"]),
                  "open_s": _stat([o["open_s"] for o in opens]), "bad_tensors": bad,
                  "reference": "safetensors.torch.load_file(device='cuda:0') in each process, warm page cache"})
        os.unlink(a.file)

    tc.send(("exit",))
    _recv(tc, tr)
    tr.join(60)


if __name__ == "__main__":
    main()
