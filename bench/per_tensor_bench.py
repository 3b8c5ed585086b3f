"""What a tensor costs a Python sync (issue 43, Wanted 2): 100,000 tensors
of 4 KiB against the same bytes in 16, alternating in one run, CPU tensors
(--device cuda: tensors on cuda:0 on both sides, a CUDA engine), host slots. Producer: send(); consumer (another process): receive_into()
or receive(). Prints min/median/max per case and side and the per-tensor
cost, (median many - median dense) / (tensors - dense). Every byte is
checked after the timer stops. The consumer's timer starts before the
producer's send(), so its figure holds send()'s time too;
--consumer-after starts it once send() has returned (the sync must fit in
the slots): the consumer's own cost.

    PYTHONPATH=build/python python3 bench/per_tensor_bench.py [--tensors 100000] [--tensor-bytes 4096]
        [--dense 16] [--reps 10] [--receive into|new] [--consumer-after] [--device cpu|cuda] [--json]
"""
import argparse
import json
import multiprocessing as mp
import os
import statistics
import time

import torch

import shmcast


def views(flat, n):
    each = flat.numel() // n
    sizes = [each] * (n - 1) + [flat.numel() - each * (n - 1)]
    names = [f"model.layers.{i // 384}.mlp.experts.{i // 3 % 128}.w{i % 3}.weight" for i in range(n)]
    return dict(zip(names, torch.split(flat, sizes)))


def consumer(region, args, conn):
    nbytes = args.tensors * args.tensor_bytes
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=args.device)
    cases = [views(dst, args.dense), views(dst, args.tensors)]
    times, bad = [[], []], 0
    cuda = args.device != "cpu"
    with shmcast.Consumer(region, args.device, pin=False, open_timeout=60) as c:
        for k in range(2 * args.reps):
            which = k % 2
            dst.zero_()
            conn.send("ready")
            if args.consumer_after:
                assert conn.recv() == "sent"
            t0 = time.perf_counter()
            if args.receive == "into":
                c.receive_into(cases[which], timeout=120)
                got = dst
            else:
                got = c.receive(timeout=120)
                got = torch.cat([t for _, t in got] if isinstance(got, list) else list(got.values()))
            if cuda:
                torch.cuda.synchronize()  # the copies are ordered on the current stream
            times[which].append(time.perf_counter() - t0)
            want = conn.recv()
            bad += int(not torch.equal(got.cpu(), want))
            conn.send("done")
    conn.send((times, bad))


def stat(xs):
    return min(xs), statistics.median(xs), max(xs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=100000)
    ap.add_argument("--tensor-bytes", type=int, default=4096)
    ap.add_argument("--dense", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--receive", choices=["into", "new"], default="into")
    ap.add_argument("--consumer-after", action="store_true",
                    help="start the consumer's timer once send() returned (the sync must fit in the slots)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: the tensors on cuda:0 on both sides, the producer's CUDA engine")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    region = f"per-tensor-py-{os.getpid()}"
    nbytes = args.tensors * args.tensor_bytes
    if args.device == "cuda":
        args.device = "cuda:0"
    src = torch.zeros(nbytes, dtype=torch.uint8, device=args.device)
    cases = [views(src, args.dense), views(src, args.tensors)]
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    with shmcast.Producer(region, pin=False, engine="host" if args.device == "cpu" else "cuda") as p:
        proc = ctx.Process(target=consumer, args=(region, args, b), daemon=True)
        proc.start()
        p.wait_for_consumers(1, 60)
        times = [[], []]
        for k in range(2 * args.reps):
            which = k % 2
            src[::4096] = k % 251
            assert a.recv() == "ready"
            time.sleep(0.002)
            t0 = time.perf_counter()
            p.send(cases[which])
            times[which].append(time.perf_counter() - t0)
            if args.consumer_after:
                a.send("sent")
            a.send(src.cpu())
            assert a.recv() == "done"
        ctimes, bad = a.recv()
        proc.join(60)
    out = {"tensors": args.tensors, "tensor_bytes": args.tensor_bytes, "dense": args.dense, "reps": args.reps,
           "receive": args.receive, "consumer_after": args.consumer_after, "device": args.device,
           "batch_cuda": os.environ.get("SHMCAST_PY_BATCH_CUDA", ""), "bad_syncs": bad}
    for side, t in (("producer send()", times), (f"consumer receive{'_into' if args.receive == 'into' else ''}()", ctimes)):
        d, m = stat(t[0]), stat(t[1])
        per = (m[1] - d[1]) / (args.tensors - args.dense) * 1e6
        out[side] = {"dense_s": d, "many_s": m, "per_tensor_us": per}
        if not args.json:
            print(f"  {side:24} dense {d[0]:.4f} / {d[1]:.4f} / {d[2]:.4f}   many {m[0]:.4f} / {m[1]:.4f} / {m[2]:.4f}"
                  f"   per tensor {per:.3f} us")
    if args.json:
        print(json.dumps(out))
    elif bad:
        print(f"  {bad} syncs read WRONG bytes")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
