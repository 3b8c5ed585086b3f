#!/usr/bin/env python3
"""A real model through device slots: a transformers Qwen2 with
Qwen2.5-0.5B shapes (random init: no network), fp32 master weights trained
with AdamW on random tokens, cast to bf16 after every step and sent with
Producer(slot_memory="device"); an engine process on the same GPU receives
them into its own bf16 Qwen2 (receive_into its parameters) and computes
logits on a fixed batch. The trainer computes the same logits from its bf16
cast; they must be bit-identical at every step (the run fails otherwise).
In the same run the same weights go through a region of host slots, for
the sync time next to it.

    python3 bench/device_slots_model.py --steps 10 --json out.json

Run it under Docker's default seccomp profile with
    shmcast-seccomp-run --profile docker-default.json -- python3 bench/device_slots_model.py
Reports per step the sync time (trainer's send() to the engine's
receive_into() done, CLOCK_MONOTONIC in both processes). Needs CUDA, torch,
transformers and the shmcast module.
"""
import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import shmcast  # noqa: E402


# The model, its batch and its logits: the same as the delta run's (same folder).
from delta_adamw import fixed_batch, logits_of, make_model, qwen2_config  # noqa: E402


def engine(args, regions, q_in, q_out):
    torch.use_deterministic_algorithms(True)
    dev = torch.device("cuda:0")
    cfg = qwen2_config(args.small)
    model = make_model(cfg, torch.bfloat16, dev, seed=4321)  # other weights than the trainer's
    params = dict(model.named_parameters())
    batch = fixed_batch(cfg, dev)
    out = {}
    for kind, region in regions:
        c = shmcast.Consumer(region, dev)
        q_out.put(("ready", c.slot_memory))
        done = []
        for step in range(args.steps + 1):
            c.receive_into(params, timeout=300)
            torch.cuda.synchronize(dev)
            done.append(time.monotonic())
            want = q_in.get()
            q_out.put(("step", step, bool(torch.equal(logits_of(model, batch), want))))
        c.close()
        out[kind] = done
    q_out.put(("done", out))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--small", action="store_true", help="2 layers, 32k vocabulary (a quick check)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("device_slots_model: needs CUDA", file=sys.stderr)
        return 2
    torch.use_deterministic_algorithms(True)
    ctx = mp.get_context("spawn")
    base = f"devslots-model-{os.getpid()}"
    regions = [("device", base + "-dev"), ("host", base + "-host")]
    q_to, q_from = ctx.Queue(), ctx.Queue()
    dev = torch.device("cuda:0")
    cfg = qwen2_config(args.small)
    master = make_model(cfg, torch.float32, dev, seed=1234)
    master.train()
    replica = make_model(cfg, torch.bfloat16, dev, seed=1234)
    rparams = dict(replica.named_parameters())
    batch = fixed_batch(cfg, dev)
    opt = torch.optim.AdamW(master.parameters(), lr=args.lr, weight_decay=0.0)
    eng = ctx.Process(target=engine, args=(args, regions, q_to, q_from))
    eng.start()
    g = torch.Generator(device="cpu").manual_seed(7)
    summary = {"command": " ".join(sys.argv), "steps": args.steps, "lr": args.lr, "small": args.small}
    failures = 0
    t0s = {}
    for kind, region in regions:
        p = shmcast.Producer(region, slot_memory=kind)
        msg = q_from.get(timeout=600)
        assert msg[0] == "ready" and msg[1] == kind, msg
        p.wait_for_consumers(1, 120)
        summary[kind] = {"slot_memory": p.slot_memory, "slot_device_bytes": p.slot_device_bytes,
                         "region_bytes": p.region_bytes}
        t0s[kind] = []
        for step in range(args.steps + 1):
            if step > 0:
                tokens = torch.randint(0, cfg.vocab_size, (4, 128), generator=g).to(dev)
                out = master(input_ids=tokens, labels=tokens)
                out.loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                bf16 = {n: t.detach().to(torch.bfloat16) for n, t in master.named_parameters()}
                for n, t in bf16.items():
                    rparams[n].copy_(t)
            torch.cuda.synchronize(dev)
            t0s[kind].append(time.monotonic())
            p.send(bf16)
            q_to.put(logits_of(replica, batch))
            _, s, ok = q_from.get(timeout=600)
            failures += 0 if ok else 1
            print(f"{kind} slots, step {s:3d}: logits {'equal' if ok else 'DIFFER'}", flush=True)
        p.close()
    _, done = q_from.get(timeout=600)
    eng.join(timeout=120)

    def st(v):
        return {"n": len(v), "min": min(v), "median": statistics.median(v), "max": max(v)} if v else {"n": 0}

    logical = sum(t.numel() * 2 for t in bf16.values())
    summary["logical_bytes"] = logical
    summary["logits_equal_steps"] = 2 * (args.steps + 1) - failures
    summary["of"] = 2 * (args.steps + 1)
    for kind, _ in regions:
        times = [d - t for d, t in zip(done[kind][1:], t0s[kind][1:])]  # step 0 is a warm-up
        summary[kind]["sync_s"] = st(times)
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
