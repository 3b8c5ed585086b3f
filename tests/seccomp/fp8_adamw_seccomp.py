#!/usr/bin/env python3
"""GPU container test of quantize-on-send (issue 44): a real transformers
Qwen2 trained with AdamW, its BF16 weights sent with
Producer(quantize=...), received as block FP8 by workers, all under a
Docker-format seccomp profile (Docker's default unless --profile says
otherwise) through shmcast-seccomp-run.

  trainer   Qwen2ForCausalLM (Qwen2.5-0.5B widths, --layers layers, random
            init: no network) with fp32 master weights on the GPU, AdamW
            (--lr, weight decay 0) on random tokens; after every step the
            weights cast to bf16 go out with send() (CUDA tensors: the
            library's kernels quantize them). For each step it writes the
            reference: every tensor of the manifest as the torch reference
            (DeepGEMM's per_block_cast_to_fp8 in torch ops on the CPU,
            python/tests/fp8_roles.py) makes it from the same bf16 weights,
            as SHA-256 digests of its bytes.
  worker    opens before the first step; receive() of every step onto the
            GPU; each tensor's bytes (FP8 codes, float32 scales, the bf16
            tensors the filter keeps) must equal the reference of the
            step its version names, and it must see every step.
  late      opens after step --late-at, then does what the worker does
            until the last step.

Usage (on a GPU machine, from the repo root, after building _shmcast and
shmcast-seccomp-run):
  PYTHONPATH=build/python python3 tests/seccomp/fp8_adamw_seccomp.py \
      --runner build/tests/seccomp/shmcast-seccomp-run --quantize fp8-block128

Prints one JSON object last; exit 0 only when every step of both workers
matched the reference bit for bit, with the filter's scales present.
"""
import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python", "tests"))  # fp8_roles: the torch reference


def wait_for(path, timeout):
    end = time.time() + timeout
    while not os.path.exists(path):
        if time.time() > end:
            raise TimeoutError(f"gave up waiting for {path}")
        time.sleep(0.01)


def write_atomic(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.rename(tmp, path)


def digest(t):
    """SHA-256 of a tensor's bytes (any dtype, any device)."""
    import torch
    b = t.detach().contiguous().cpu().view(torch.uint8).reshape(-1)
    return hashlib.sha256(b.numpy().tobytes()).hexdigest()


def reference(named, ue8m0):
    """{name: digest} of what the manifest must carry for bf16 `named`."""
    import torch
    import fp8_roles as fr
    import shmcast
    out = {}
    for name, t in named:
        c = t.detach().cpu()
        if shmcast.default_quantize_filter(name, tuple(c.shape), fr._dt(c)):
            q, s = fr.per_block_cast_to_fp8(c, ue8m0)
            out[name] = digest(q)
            out[name + "_scale_inv"] = digest(s)
        else:
            out[name] = digest(c)
    return out


# --------------------------------------------------------------- roles
def role_trainer(a):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    import shmcast
    torch.manual_seed(1234)
    cfg = Qwen2Config(vocab_size=32000, hidden_size=896, intermediate_size=4864, num_hidden_layers=a.layers,
                      num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg).to(device="cuda", dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    g = torch.Generator(device="cpu").manual_seed(7)
    ue8m0 = a.quantize.endswith("ue8m0")
    stats = []
    with shmcast.Producer(a.region, slot_bytes=a.slot_bytes, slots=2, max_consumers=2, quantize=a.quantize) as prod:
        open(f"{a.work}/ready", "w").close()
        prod.wait_for_consumers(1, timeout=120.0)
        for step in range(1, a.steps + 1):
            if step == a.late_at + 1:
                open(f"{a.work}/late.go", "w").close()
                prod.wait_for_consumers(2, timeout=120.0)
            batch = torch.randint(0, cfg.vocab_size, (2, 64), generator=g).cuda()
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                named = [(n, p.detach().to(torch.bfloat16)) for n, p in model.state_dict().items()]
            torch.cuda.synchronize()
            write_atomic(f"{a.work}/ref.{step}.json", reference(named, ue8m0))
            t0 = time.perf_counter()
            prod.send(named)
            sync = dict(prod.last_sync)
            stats.append({"step": step, "send_s": time.perf_counter() - t0, "loss": float(loss),
                          "logical_bytes": sync.get("logical_bytes"), "payload_bytes": sync.get("payload_bytes")})
        prod.wait_drained(timeout=120.0)
    print(json.dumps({"role": "trainer", "steps": stats}))


def role_worker(a, late=False):
    import torch
    import shmcast
    wait_for(f"{a.work}/late.go" if late else f"{a.work}/ready", 600)
    checked, problems, scales, seen = 0, [], 0, []
    with shmcast.Consumer(a.region, device="cuda:0") as con:
        while not seen or seen[-1] < a.steps:
            got = con.receive(timeout=120.0)
            torch.cuda.synchronize()
            step = con.last_version  # one sync per step, versions from 1
            seen.append(step)
            wait_for(f"{a.work}/ref.{step}.json", 120)
            with open(f"{a.work}/ref.{step}.json") as f:
                want = json.load(f)
            names = [n for n, _ in got]
            if sorted(names) != sorted(want):
                problems.append({"step": step, "names": sorted(set(names) ^ set(want))[:8]})
                continue
            for n, t in got:
                if digest(t) != want[n]:
                    problems.append({"step": step, "tensor": n, "dtype": str(t.dtype)})
                checked += 1
                scales += n.endswith("_scale_inv")
                if n.endswith("_scale_inv") and t.dtype != torch.float32:
                    problems.append({"step": step, "tensor": n, "scale dtype": str(t.dtype)})
            fp8 = [n for n, t in got if t.dtype == getattr(torch, "float8_e4m3fn", None)]
            if len(fp8) != sum(n.endswith("_scale_inv") for n in names):
                problems.append({"step": step, "fp8 tensors": len(fp8)})
    print(json.dumps({"role": "late" if late else "worker", "steps_seen": seen, "tensors_checked": checked,
                      "scales_checked": scales, "problems": problems[:20], "n_problems": len(problems)}))


# --------------------------------------------------------------- driver
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role")
    ap.add_argument("--work")
    ap.add_argument("--runner", default="build/tests/seccomp/shmcast-seccomp-run")
    ap.add_argument("--profile", default=os.path.join(HERE, "docker-default.json"))
    ap.add_argument("--region", default=f"fp8-ct-{os.getpid()}")
    ap.add_argument("--quantize", default="fp8-block128", choices=["fp8-block128", "fp8-block128-ue8m0"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--late-at", type=int, default=3, help="the late worker opens after this step")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--slot-bytes", type=int, default=64 << 20)
    a = ap.parse_args()
    if a.role:
        {"trainer": role_trainer, "worker": role_worker, "late": lambda x: role_worker(x, late=True)}[a.role](a)
        return 0

    a.work = tempfile.mkdtemp(prefix="shmcast-fp8-")
    procs = {}
    for role in ("worker", "trainer", "late"):
        cmd = [sys.executable, os.path.abspath(__file__), "--role", role, "--work", a.work, "--region", a.region,
               "--quantize", a.quantize, "--layers", str(a.layers), "--steps", str(a.steps),
               "--late-at", str(a.late_at), "--lr", str(a.lr), "--slot-bytes", str(a.slot_bytes)]
        procs[role] = subprocess.Popen([a.runner, "--profile", a.profile, "--"] + cmd, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
    report = {"profile": a.profile, "quantize": a.quantize, "lr": a.lr, "steps": a.steps}
    for role, p in procs.items():
        try:
            so, se = p.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            p.kill()
            so, se = p.communicate()
        last = [l for l in so.splitlines() if l.startswith("{")]
        report[role] = {"rc": p.returncode, "result": json.loads(last[-1]) if last else None,
                        "stderr": se[-2000:] if p.returncode else ""}
    ok = all(report[r]["rc"] == 0 and report[r]["result"] for r in procs)
    for r, want in (("worker", list(range(1, a.steps + 1))), ("late", None)):
        res = report[r]["result"] or {}
        seen = res.get("steps_seen") or []
        ok = ok and res.get("n_problems") == 0 and res.get("scales_checked", 0) > 0 and bool(seen)
        ok = ok and (seen == want if want else seen[-1] == a.steps and seen[0] > a.late_at - 1)
    report["ok"] = bool(ok)
    print(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
