#!/usr/bin/env python3
"""Delta syncs of a real training run: a transformers Qwen2 with Qwen2.5-0.5B
shapes (random init: no network), fp32 master weights trained with AdamW
(weight decay 0) on random tokens, cast to bf16 after every step and sent
with Producer(delta=True); an engine process on the same GPU receives them
into its own bf16 Qwen2 (receive_into its parameters) and computes logits
on a fixed batch. The trainer computes the same logits from its bf16 cast;
they must be bit-identical at every step (the run fails otherwise).

    python3 bench/delta_adamw.py --steps 50 --lr 1e-6 --json out.json

Reports per step the kind of sync, payload/logical bytes and the sync time
(trainer's send() to the engine's receive_into() done, CLOCK_MONOTONIC in
both processes), and, in the same run, the same weights sent as full syncs
(a region without deltas) for comparison. Needs CUDA, torch, transformers
and the shmcast module.
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


def qwen2_config(small: bool):
    from transformers import Qwen2Config
    if small:  # a few layers: for a quick check
        return Qwen2Config(vocab_size=32000, hidden_size=896, intermediate_size=4864, num_hidden_layers=2,
                           num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)
    # Qwen2.5-0.5B's shapes.
    return Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)


def make_model(cfg, dtype, device, seed=1234):
    from transformers import Qwen2ForCausalLM
    torch.manual_seed(seed)
    m = Qwen2ForCausalLM(cfg).to(device=device, dtype=dtype)
    m.eval()
    return m


def fixed_batch(cfg, device):
    g = torch.Generator(device="cpu").manual_seed(99)
    return torch.randint(0, cfg.vocab_size, (2, 64), generator=g).to(device)


@torch.no_grad()
def logits_of(model, batch):
    return model(input_ids=batch).logits.float().cpu()


def engine(args, region, full_region, q_in, q_out):
    torch.use_deterministic_algorithms(True)
    dev = torch.device("cuda:0")
    cfg = qwen2_config(args.small)
    model = make_model(cfg, torch.bfloat16, dev)
    params = dict(model.named_parameters())
    batch = fixed_batch(cfg, dev)
    c = shmcast.Consumer(region, dev)
    q_out.put("ready")
    results = []
    for step in range(args.steps + 1):
        v = c.receive_into(params, timeout=300)
        torch.cuda.synchronize(dev)
        t_done = time.monotonic()
        got = logits_of(model, batch)
        want = q_in.get()  # the trainer's logits for this step
        same = torch.equal(got, want)
        results.append({"version": v, "t_done": t_done, "logits_equal": bool(same),
                        "last_sync": dict(c.last_sync)})
        q_out.put(("step", step, bool(same)))
    c.close()
    # The same weights as full syncs, from a region without deltas.
    cf = shmcast.Consumer(full_region, dev)
    q_out.put("ready")
    full = []
    for _ in range(args.full_reps + 1):
        cf.receive_into(params, timeout=300)
        torch.cuda.synchronize(dev)
        full.append(time.monotonic())
        q_out.put("got")
    cf.close()
    q_out.put(("done", results, full))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--full-reps", type=int, default=10)
    ap.add_argument("--small", action="store_true", help="2 layers, 32k vocabulary (a quick check)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("delta_adamw: needs CUDA", file=sys.stderr)
        return 2
    torch.use_deterministic_algorithms(True)
    ctx = mp.get_context("spawn")
    region = f"delta-adamw-{os.getpid()}"
    full_region = region + "-full"
    q_to_engine, q_from_engine = ctx.Queue(), ctx.Queue()
    dev = torch.device("cuda:0")
    cfg = qwen2_config(args.small)
    master = make_model(cfg, torch.float32, dev)
    master.train()
    replica = make_model(cfg, torch.bfloat16, dev)  # the trainer's own bf16 model, for reference logits
    rparams = dict(replica.named_parameters())
    batch = fixed_batch(cfg, dev)
    opt = torch.optim.AdamW(master.parameters(), lr=args.lr, weight_decay=0.0)
    p = shmcast.Producer(region, delta=True)
    eng = ctx.Process(target=engine, args=(args, region, full_region, q_to_engine, q_from_engine))
    eng.start()
    assert q_from_engine.get(timeout=600) == "ready"
    p.wait_for_consumers(1, 120)
    g = torch.Generator(device="cpu").manual_seed(7)
    sends, failures = [], 0
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
        t0 = time.monotonic()
        v = p.send(bf16)
        t1 = time.monotonic()
        q_to_engine.put(logits_of(replica, batch))
        msg = q_from_engine.get(timeout=600)
        ok = msg[2]
        failures += 0 if ok else 1
        ls = dict(p.last_sync)
        sends.append({"step": step, "version": v, "t0": t0, "t1": t1, **ls})
        print(f"step {step:3d}: {ls['kind']:5s} payload/logical {ls['payload_bytes'] / ls['logical_bytes']:.4f} "
              f"logits {'equal' if ok else 'DIFFER'}", flush=True)
    base_bytes = p.delta_base_bytes
    p.close()
    # Full syncs of the same (last) weights, for comparison in this run.
    pf = shmcast.Producer(full_region)
    assert q_from_engine.get(timeout=600) == "ready"
    pf.wait_for_consumers(1, 120)
    full_t0 = []
    for _ in range(args.full_reps + 1):
        torch.cuda.synchronize(dev)
        full_t0.append(time.monotonic())
        pf.send(bf16)
        assert q_from_engine.get(timeout=600) == "got"
    msg = q_from_engine.get(timeout=600)
    eng.join(timeout=120)
    pf.close()
    _, results, full_done = msg
    delta_times = [r["t_done"] - s["t0"] for r, s in zip(results, sends) if s["kind"] == "delta"]
    ratios = [s["payload_bytes"] / s["logical_bytes"] for s in sends if s["kind"] == "delta"]
    full_times = [d - t for d, t in zip(full_done[1:], full_t0[1:])]

    def st(v):
        return {"n": len(v), "min": min(v), "median": statistics.median(v), "max": max(v)} if v else {"n": 0}

    summary = {
        "command": " ".join(sys.argv), "steps": args.steps, "lr": args.lr, "small": args.small,
        "logical_bytes": sends[-1]["logical_bytes"], "delta_base_bytes": base_bytes,
        "logits_equal_steps": sum(1 for r in results if r["logits_equal"]), "of": len(results),
        "delta_syncs": sum(1 for s in sends if s["kind"] == "delta"),
        "payload_ratio": st(ratios), "delta_sync_s": st(delta_times), "full_sync_s": st(full_times),
        "ratio_by_step": [round(s["payload_bytes"] / s["logical_bytes"], 5) for s in sends],
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "ratio_by_step"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if failures == 0 and summary["logits_equal_steps"] == summary["of"] else 1


if __name__ == "__main__":
    sys.exit(main())
