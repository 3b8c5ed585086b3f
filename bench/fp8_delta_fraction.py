#!/usr/bin/env python3
"""How much of a quantize-on-send sync changes per training step (issue 44
item 4), on CPU: a stack of Qwen2-style blocks with Qwen2.5-0.5B widths
(hidden 896, intermediate 4864, 2 KV heads of 64; random init, no network),
fp32 master weights trained with AdamW (weight decay 0) on a fixed random
regression task, cast to bf16 after every step and sent three ways through
store regions of the library itself: bf16 (quantize off), fp8-block128 and
fp8-block128-ue8m0. A consumer reads each version's bytes; per step the
script reports the changed fraction of the weights' bytes (bf16 elements,
or FP8 codes) and of the scales, and the payload of the same step sent as a
delta sync (Producer(delta=True)) against the logical bf16 bytes.

    python3 bench/fp8_delta_fraction.py --steps 20 --lr 1e-6 1e-5 --json out.json

Needs torch and the shmcast module (PYTHONPATH=build/python). Indicative:
a small model on synthetic data, not a language model's run (that one is
bench/delta_adamw.py's, on the GPU machine).
"""
import argparse
import json
import os
import statistics

import torch

import shmcast
from shmcast import _shmcast as _C

VARIANTS = ("none", "fp8-block128", "fp8-block128-ue8m0")


class Block(torch.nn.Module):
    def __init__(self, h=896, kv=128, inter=4864):
        super().__init__()
        self.q_proj = torch.nn.Linear(h, h, bias=True)
        self.k_proj = torch.nn.Linear(h, kv, bias=True)
        self.v_proj = torch.nn.Linear(h, kv, bias=True)
        self.o_proj = torch.nn.Linear(h, h, bias=False)
        self.gate_proj = torch.nn.Linear(h, inter, bias=False)
        self.up_proj = torch.nn.Linear(h, inter, bias=False)
        self.down_proj = torch.nn.Linear(inter, h, bias=False)
        self.norm = torch.nn.LayerNorm(h)

    def forward(self, x):
        y = self.norm(x)
        a = self.o_proj(self.q_proj(y) * torch.sigmoid(self.k_proj(y).repeat(1, 7) + self.v_proj(y).repeat(1, 7)))
        x = x + a
        return x + self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def named_bf16(model):
    out = []
    for i, blk in enumerate(model):
        for n, p in blk.named_parameters():
            name = f"model.layers.{i}.{'self_attn.' if n.split('.')[0] in ('q_proj', 'k_proj', 'v_proj', 'o_proj') else 'mlp.' if n.split('.')[0].endswith('proj') else ''}{n}"
            out.append((name, p.detach().to(torch.bfloat16).contiguous()))
    return out


def read_raw(c):
    s = c.wait_sync(60)
    bufs = [torch.empty(t[3], dtype=torch.uint8) for t in s.tensors]
    c.read_into([b.data_ptr() for b in bufs])
    return {t[0]: b for t, b in zip(s.tensors, bufs)}


def run(lr, steps, layers, tag):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block() for _ in range(layers)])
    teacher = torch.nn.Sequential(*[Block() for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    x = torch.randn(32, 896)
    with torch.no_grad():
        target = teacher(x)
    named = named_bf16(model)
    logical = sum(t.numel() * 2 for _, t in named)
    room = shmcast.store_bytes_for(named)
    store, cons, delta, dcons = {}, {}, {}, {}
    for v in VARIANTS:
        q = None if v == "none" else v
        store[v] = shmcast.Producer(f"{tag}-s-{v}", mode="store", store_bytes=room, pin="no", quantize=q)
        cons[v] = _C.Consumer(f"{tag}-s-{v}", pin="no")
        delta[v] = shmcast.Producer(f"{tag}-d-{v}", slot_bytes=room, slots=2, pin="no", quantize=q, delta=True,
                                    delta_max_ratio=1.0)
        dcons[v] = _C.Consumer(f"{tag}-d-{v}", pin="no")
    prev, dbufs = {}, {}
    rows = []
    try:
        for step in range(steps + 1):
            if step > 0:
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), target)
                loss.backward()
                opt.step()
            named = named_bf16(model)
            row = {"step": step}
            for v in VARIANTS:
                store[v].send(named)
                got = read_raw(cons[v])
                delta[v].send(named)
                s = dcons[v].wait_sync(60)
                if v not in dbufs:  # a delta applies to the destinations the last read filled
                    dbufs[v] = [torch.empty(t[3], dtype=torch.uint8) for t in s.tensors]
                dcons[v].read_into([b.data_ptr() for b in dbufs[v]])
                if any(not torch.equal(a, got[t[0]]) for a, t in zip(dbufs[v], s.tensors)):
                    raise AssertionError(f"step {step} {v}: the delta sync's bytes differ from the full one's")
                if step > 0:
                    w_changed = w_total = s_changed = s_total = 0
                    for name, b in got.items():
                        if not name.endswith(".weight") and not name.endswith("_scale_inv"):
                            continue
                        if name.endswith("_scale_inv"):
                            a, o = b.view(torch.int32), prev[v][name].view(torch.int32)
                            s_changed += int((a != o).sum())
                            s_total += a.numel()
                        else:
                            w = 2 if v == "none" else 1
                            a = b.view(torch.int16) if w == 2 else b
                            o = prev[v][name].view(torch.int16) if w == 2 else prev[v][name]
                            w_changed += int((a != o).sum()) * w
                            w_total += a.numel() * w
                    ls = delta[v].last_sync
                    row[v] = {"weights_changed": w_changed / w_total,
                              "scales_changed": (s_changed / s_total) if s_total else None,
                              "delta_kind": ls["kind"], "delta_payload_over_bf16": ls["payload_bytes"] / logical}
                prev[v] = got
            if step > 0:
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for d in (cons, dcons):
            for c in d.values():
                c.close()
        for d in (store, delta):
            for p in d.values():
                p.close()
    summary = {}
    for v in VARIANTS:
        wc = [r[v]["weights_changed"] for r in rows]
        pl = [r[v]["delta_payload_over_bf16"] for r in rows]
        sc = [r[v]["scales_changed"] for r in rows if r[v]["scales_changed"] is not None]
        summary[v] = {"weights_changed_median": statistics.median(wc), "weights_changed_min": min(wc),
                      "weights_changed_max": max(wc), "delta_payload_over_bf16_median": statistics.median(pl),
                      "scales_changed_median": statistics.median(sc) if sc else None}
    return {"lr": lr, "steps": steps, "layers": layers, "logical_bytes": logical, "summary": summary, "rows": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    out = [run(lr, a.steps, a.layers, f"fp8frac-{os.getpid()}-{i}") for i, lr in enumerate(a.lr)]
    for r in out:
        print(json.dumps({"lr": r["lr"], "summary": r["summary"]}))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
