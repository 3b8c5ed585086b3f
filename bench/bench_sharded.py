#!/usr/bin/env python3
"""Sharded syncs on a 2-GPU node, measured next to the node's limits in one run.

Topology: colocated (trainer rank g and inference worker g share GPU g).
Model: N bf16 matrices [8192, 8192] (96 = 12.9 GB); the trainer holds each
tensor sharded along dim 0 (FSDP2's Shard(0)); a TP=2 worker reads even
tensors split along dim 0 (column-parallel) and odd ones along dim 1
(row-parallel: 2D-strided copies out of the region).

Experiments, each REPS timed syncs after one warm-up, every timed sync with
fresh random bytes and every byte of it checked on the GPU afterwards:
  limits     pinned 2 GiB copies: D2H and H2D of each GPU alone, then all four
             copies (D2H + H2D on both GPUs) at once: the node's host traffic
  two_region today's best: one region per trainer rank, each holding whole
             tensors (rank r owns tensors r::2), each worker reads both
             regions in two threads (the whole model)
  tp         one sharded sync, 2 ranks -> 2 TP workers reading half each
  full       one sharded sync, 2 ranks -> 2 workers reading the whole model
  fsdp2      FSDP2 (fully_shard, NCCL) on 2 ranks: trainer-side send() of the
             DTensors (local shards, no gather) vs one producer on rank 0 that
             gathers with full_tensor(); a worker per GPU reads the whole model
             and checks it against the trainer's weights.
Sync time = last worker done - first trainer start (one clock, perf_counter).

  python3 bench/bench_sharded.py [--reps 10] [--tensors 96] [--only tp,full]
  python3 bench/bench_sharded.py --cpu --tensors 8 --dim 512 --reps 2   (smoke test, no GPU)
Prints one JSON object per experiment (and writes them to --out).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import traceback

import torch
import torch.multiprocessing as mp

import shmcast


def stats(xs):
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)}


def dev_of(args, g):
    return torch.device("cpu") if args.cpu else torch.device("cuda", g)


def gen(args, dev, seed, shape):
    """Deterministic random bf16 bits (the same on every process)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    return torch.randint(-32768, 32767, shape, generator=g, dtype=torch.int16, device=dev).view(torch.bfloat16)


def tp_slice(i, dim_size, part):
    """Even tensors: column-parallel (dim 0); odd: row-parallel (dim 1)."""
    half = dim_size // 2
    return (i % 2, part * half, half)


def barrier_time(bar):
    bar.wait()
    return time.perf_counter()


# ---------------------------------------------------------------- roles (one process each)


def role_limits(args, g, bar, q):
    dev = dev_of(args, g)
    torch.cuda.set_device(dev)
    n = 2 << 30
    host_a = torch.empty(n, dtype=torch.uint8).pin_memory()
    host_b = torch.empty(n, dtype=torch.uint8).pin_memory()
    d_a = torch.empty(n, dtype=torch.uint8, device=dev)
    d_b = torch.empty(n, dtype=torch.uint8, device=dev)
    s1, s2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    out = {}

    def timed(kind):
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        if kind in ("d2h", "both"):
            with torch.cuda.stream(s1):
                host_a.copy_(d_a, non_blocking=True)
        if kind in ("h2d", "both"):
            with torch.cuda.stream(s2):
                d_b.copy_(host_b, non_blocking=True)
        torch.cuda.synchronize(dev)
        return time.perf_counter() - t0

    for kind in ("d2h", "h2d"):
        xs = []
        for turn in (0, 1):  # each GPU alone; the other waits at the barrier
            for r in range(args.reps + 1):
                bar.wait()
                if g == turn:
                    x = n / timed(kind) / 1e9
                    if r > 0:
                        xs.append(x)
        out[f"{kind}_alone_gbps"] = stats(xs)
    xs = []
    for r in range(args.reps + 1):
        bar.wait()
        xs.append(n / timed("both") / 1e9)
    out["both_gbps_per_copy"] = stats(xs[1:])
    q.put({"gpu": g, **out})


def fill_shards(args, dev, rep, rank, R, tensors):
    """This rank's Shard(0) of every tensor for sync `rep` (fresh bytes)."""
    D = args.dim
    rows = D // R
    out = []
    for i in range(args.tensors):
        full = gen(args, dev, rep * 100003 + i, (D, D))
        local = tensors[i]
        local.copy_(full[rank * rows:(rank + 1) * rows])
        out.append((f"w{i}", shmcast.Shard(local, (D, D), 0, rank * rows)))
    return out


def role_trainer(args, rank, mode, bar, q):
    dev = dev_of(args, rank)
    if not args.cpu:
        torch.cuda.set_device(dev)
    D, R = args.dim, 2
    try:
        if mode == "two_region":
            mine = [i for i in range(args.tensors) if i % 2 == rank]
            bufs = {i: torch.empty((D, D), dtype=torch.bfloat16, device=dev) for i in mine}
            p = shmcast.Producer(f"{args.name}-base{rank}", slot_bytes=args.slot_mb << 20, slots=args.slots // 2,
                                 max_consumers=2,
                                 pin=not args.cpu, engine="host" if args.cpu else "cuda")
        else:
            bufs = [torch.empty((D // R, D), dtype=torch.bfloat16, device=dev) for _ in range(args.tensors)]
            p = shmcast.Producer(f"{args.name}-{mode}", rank=rank, world_size=R, slot_bytes=args.slot_mb << 20,
                                 slots=args.slots, max_consumers=2, pin=not args.cpu, engine="host" if args.cpu else "cuda")
        q.put({"ready": True})
        if rank == 0 or mode == "two_region":
            p.wait_for_consumers(2, 120.0)
        starts, sends = [], []
        for rep in range(args.reps + 1):
            if mode == "two_region":
                named = []
                for i in mine:
                    bufs[i].copy_(gen(args, dev, rep * 100003 + i, (D, D)))
                    named.append((f"w{i}", bufs[i]))
            else:
                named = fill_shards(args, dev, rep, rank, R, bufs)
            if not args.cpu:
                torch.cuda.synchronize(dev)
            t0 = barrier_time(bar)
            p.send(named)
            sends.append(time.perf_counter() - t0)
            starts.append(t0)
            bar.wait()  # every worker checked this sync
        p.wait_drained(120.0)
        p.close()
        q.put({"role": "trainer", "rank": rank, "starts": starts, "sends": sends})
    except BaseException as e:
        q.put({"error": f"trainer {rank}: {type(e).__name__}: {e}", "trace": traceback.format_exc()})
        bar.abort()


def role_worker(args, g, mode, bar, q):
    dev = dev_of(args, g)
    if not args.cpu:
        torch.cuda.set_device(dev)
    D = args.dim
    try:
        if mode == "two_region":
            cons = [shmcast.Consumer(f"{args.name}-base{r}", device=str(dev), open_timeout=120.0) for r in range(2)]
        else:
            cons = [shmcast.Consumer(f"{args.name}-{mode}", device=str(dev), open_timeout=120.0)]
        slices = {f"w{i}": tp_slice(i, D, g) for i in range(args.tensors)} if mode == "tp" else None
        if mode == "tp":
            dst = {f"w{i}": torch.empty((D // 2, D) if i % 2 == 0 else (D, D // 2), dtype=torch.bfloat16, device=dev)
                   for i in range(args.tensors)}
        else:
            dst = {f"w{i}": torch.empty((D, D), dtype=torch.bfloat16, device=dev) for i in range(args.tensors)}
        q.put({"ready": True})
        ends, bad, moved = [], 0, 0
        for rep in range(args.reps + 1):
            for t in dst.values():
                t.fill_(0)
            bar.wait()  # the trainers start now
            if mode == "two_region":
                errs = []

                def read(k):
                    try:
                        mine = {n: t for n, t in dst.items() if int(n[1:]) % 2 == k}
                        cons[k].receive_into(mine, timeout=120.0)
                    except BaseException as e:  # noqa: BLE001
                        errs.append(e)
                th = [threading.Thread(target=read, args=(k,)) for k in range(2)]
                for t in th:
                    t.start()
                for t in th:
                    t.join()
                if errs:
                    raise errs[0]
            else:
                cons[0].receive_into(dst, timeout=120.0, slices=slices)
            if not args.cpu:
                torch.cuda.synchronize(dev)
            ends.append(time.perf_counter())
            # Check every byte of this sync.
            for i in range(args.tensors):
                want = gen(args, dev, rep * 100003 + i, (D, D))
                if slices:
                    want = want.narrow(*slices[f"w{i}"])
                if not torch.equal(dst[f"w{i}"].view(torch.int16), want.view(torch.int16)):
                    bad += 1
            moved = sum(t.numel() * 2 for t in dst.values())
            bar.wait()
        for c in cons:
            c.close()
        q.put({"role": "worker", "gpu": g, "ends": ends, "bad": bad, "bytes": moved})
    except BaseException as e:
        q.put({"error": f"worker {g}: {type(e).__name__}: {e}", "trace": traceback.format_exc()})
        bar.abort()


# ---------------------------------------------------------------- FSDP2


def fsdp_weight(dev, i, D):
    g = torch.Generator(device=dev).manual_seed(7000 + i)
    return torch.randint(-32768, 32767, (D, D), generator=g, dtype=torch.int16, device=dev).view(torch.bfloat16)


def role_fsdp_trainer(args, rank, bar, q):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    try:
        dist.init_process_group("nccl", init_method=f"file://{args.store}", rank=rank, world_size=2)
        D, L = args.dim, args.fsdp_layers
        model = torch.nn.Sequential(*[torch.nn.Linear(D, D, bias=False) for _ in range(L)]).to(dev, torch.bfloat16)
        with torch.no_grad():
            for i, lin in enumerate(model):
                lin.weight.copy_(fsdp_weight(dev, i, D))
        for lin in model:
            fully_shard(lin)
        fully_shard(model)
        assert all(type(p).__name__ == "DTensor" for p in model.parameters())
        # Room for the whole sync: the trainer's send() returns once its bytes
        # are in the region, while the workers still read.
        big = dict(slot_bytes=512 << 20, slots=args.fsdp_slots, max_consumers=2)
        sharded = shmcast.Producer(f"{args.name}-fsdp", rank=rank, world_size=2, **big)
        single = shmcast.Producer(f"{args.name}-fsdp1", **big) if rank == 0 else None
        q.put({"ready": True})
        if rank == 0:
            sharded.wait_for_consumers(2, 120.0)
            single.wait_for_consumers(2, 120.0)
        out = {"sharded": [], "gather": []}
        for rep in range(args.reps + 1):
            for kind in ("sharded", "gather"):
                torch.cuda.synchronize(dev)
                dist.barrier()
                t0 = barrier_time(bar)
                if kind == "sharded":
                    sharded.send(model.named_parameters())
                elif rank == 0:
                    single.send(model.named_parameters())  # full_tensor() per parameter: an all-gather each
                else:
                    for _, p in model.named_parameters():
                        p.full_tensor()  # rank 1's half of each gather
                torch.cuda.synchronize(dev)
                out[kind].append(time.perf_counter() - t0)
                bar.wait()  # the workers checked it
        sharded.wait_drained(120.0)
        sharded.close()
        if single is not None:
            single.wait_drained(120.0)
            single.close()
        dist.destroy_process_group()
        q.put({"role": "fsdp_trainer", "rank": rank, **out})
    except BaseException as e:
        q.put({"error": f"fsdp trainer {rank}: {type(e).__name__}: {e}", "trace": traceback.format_exc()})
        bar.abort()


def role_fsdp_worker(args, g, bar, q):
    dev = torch.device("cuda", g)
    torch.cuda.set_device(dev)
    try:
        D, L = args.dim, args.fsdp_layers
        cs = {k: shmcast.Consumer(f"{args.name}-{k}", device=str(dev), open_timeout=120.0) for k in ("fsdp", "fsdp1")}
        want = [fsdp_weight(dev, i, D) for i in range(L)]
        q.put({"ready": True})
        bad = 0
        for rep in range(args.reps + 1):
            for kind in ("fsdp", "fsdp1"):
                bar.wait()
                got = dict(cs[kind].receive(timeout=120.0))
                for i in range(L):
                    if not torch.equal(got[f"{i}.weight"].view(torch.int16), want[i].view(torch.int16)):
                        bad += 1
                del got
                bar.wait()
        for c in cs.values():
            c.close()
        q.put({"role": "fsdp_worker", "gpu": g, "bad": bad})
    except BaseException as e:
        q.put({"error": f"fsdp worker {g}: {type(e).__name__}: {e}", "trace": traceback.format_exc()})
        bar.abort()


# ---------------------------------------------------------------- driver


def run_procs(ctx, targets, n_bar, timeout=600.0):
    bar = ctx.Barrier(n_bar)
    q = ctx.Queue()
    ps = [ctx.Process(target=t, args=(*a, bar, q), daemon=True) for t, a in targets]
    for p in ps:
        p.start()
    msgs, ready = [], 0
    deadline = time.time() + timeout
    while len(msgs) < len(ps):
        m = q.get(timeout=max(1.0, deadline - time.time()))
        if "error" in m:
            for p in ps:
                p.kill()
            raise RuntimeError(m["error"] + "\n" + m.get("trace", ""))
        if m.get("ready"):
            ready += 1
            continue
        msgs.append(m)
    for p in ps:
        p.join(30)
    return msgs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--tensors", type=int, default=96)
    ap.add_argument("--dim", type=int, default=8192)
    ap.add_argument("--fsdp-layers", type=int, default=48)
    ap.add_argument("--slot-mb", type=int, default=256, help="slot size of the sharded region (and the baseline's)")
    ap.add_argument("--slots", type=int, default=8, help="slots of the sharded region; each baseline region gets half")
    ap.add_argument("--fsdp-slots", type=int, default=16, help="512 MiB slots of the FSDP2 regions")
    ap.add_argument("--only", default="limits,two_region,tp,full,fsdp2")
    ap.add_argument("--cpu", action="store_true", help="smoke test without a GPU (host engine)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default=f"bsh{os.getpid()}")
    args = ap.parse_args()
    args.store = f"/tmp/{args.name}.store"
    ctx = mp.get_context("spawn")
    only = args.only.split(",")
    results = []
    model_bytes = args.tensors * args.dim * args.dim * 2

    def emit(obj):
        obj.update({"date": time.strftime("%Y-%m-%d %H:%M:%S"), "reps": args.reps})
        print(json.dumps(obj), flush=True)
        results.append(obj)

    if "limits" in only and not args.cpu:
        msgs = run_procs(ctx, [(role_limits, (args, g)) for g in range(2)], 2)
        emit({"experiment": "limits", "per_gpu": sorted(msgs, key=lambda m: m["gpu"]),
              "node_host_traffic_gbps_median": sum(m["both_gbps_per_copy"]["median"] * 2 for m in msgs)})
    for mode in ("two_region", "tp", "full"):
        if mode not in only:
            continue
        targets = [(role_trainer, (args, r, mode)) for r in range(2)] + [(role_worker, (args, g, mode)) for g in range(2)]
        msgs = run_procs(ctx, targets, 4)
        tr = [m for m in msgs if m["role"] == "trainer"]
        wk = [m for m in msgs if m["role"] == "worker"]
        times = [max(w["ends"][k] for w in wk) - min(t["starts"][k] for t in tr) for k in range(1, args.reps + 1)]
        emit({"experiment": mode, "model_bytes": model_bytes, "slot_mb": args.slot_mb, "slots": args.slots, "sync_s": stats(times),
              "trainer_send_s": stats([max(t["sends"][k] for t in tr) for k in range(1, args.reps + 1)]),
              "bytes_per_worker": [w["bytes"] for w in wk], "bad_tensors": sum(w["bad"] for w in wk),
              "worker_gbps_median": max(w["bytes"] for w in wk) / statistics.median(times) / 1e9})
    if "fsdp2" in only and not args.cpu:
        targets = [(role_fsdp_trainer, (args, r)) for r in range(2)] + [(role_fsdp_worker, (args, g)) for g in range(2)]
        msgs = run_procs(ctx, targets, 4)
        tr = [m for m in msgs if m["role"] == "fsdp_trainer"]
        wk = [m for m in msgs if m["role"] == "fsdp_worker"]
        sh = [max(t["sharded"][k] for t in tr) for k in range(1, args.reps + 1)]
        ga = [max(t["gather"][k] for t in tr) for k in range(1, args.reps + 1)]
        emit({"experiment": "fsdp2", "model_bytes": args.fsdp_layers * args.dim * args.dim * 2,
              "sharded_send_s": stats(sh), "gather_send_s": stats(ga),
              "ratio_median": statistics.median(sh) / statistics.median(ga),
              "bad_tensors": sum(w["bad"] for w in wk)})
    if args.out:
        with open(args.out, "w") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    bad = sum(r.get("bad_tensors", 0) for r in results)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
