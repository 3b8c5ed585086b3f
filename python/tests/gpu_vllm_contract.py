"""GPU check of the vLLM weight-transfer backend with a real `transformers`
model: weights received through shmcast.vllm_transfer give bit-identical
logits to the trainer's model.

    PYTHONPATH=<build>/python python3 python/tests/gpu_vllm_contract.py [--out result.json]
    (python/device_run.sh runs it: STAGES="build frameworks" bash python/device_run.sh)

Processes: one trainer (a transformers Qwen2ForCausalLM from a tiny config
built here, no download, on cuda:0, driving ShmcastTrainerWeightTransferEngine
through the dev-route client) and one vLLM worker (the vLLM stand-in's Worker
with weight_transfer_config=WeightTransferConfig(backend="shmcast"), whose
model is the same transformers class built with another seed). Per update
the trainer changes every weight (a seeded step), sends, and both sides
compute logits on the same token ids; the worker's must equal the trainer's
bit for bit (torch.equal on bf16; deterministic algorithms on both sides).
The loss of weights at a level-2 sleep and their return with the next sync
are checked on the logits too.

Placements: 'colocated' (worker on cuda:0, the trainer's GPU) and, with two
GPUs, 'disaggregated' (worker on cuda:1). Load paths: 'direct' (receive_into
straight into the parameters) and 'loader' (model.load_weights). Each
combination runs in fresh processes; the script exits 1 on any mismatch and
77 when there is no usable GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "standins"))

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def tiny_config(tied: bool):
    import torch
    import transformers

    return transformers.Qwen2Config(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                    tie_word_embeddings=tied, torch_dtype=torch.bfloat16)


def build(tied: bool, seed: int, device: str):
    """The transformers model (deterministic in `seed`), with the
    load_weights(weights) a vLLM model offers (here: copy by HF name)."""
    import torch
    import transformers

    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(tiny_config(tied)).to(device=device, dtype=torch.bfloat16).eval()

    def load_weights(weights):
        params = dict(model.named_parameters())
        for name, w in weights:
            params[name].data.copy_(w)
        return set(params)

    model.load_weights = load_weights
    return model


def logits(model, device):
    import torch

    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, 1000, (2, 24), generator=g).to(device)
    with torch.no_grad():
        return model(input_ids=ids).logits.float().cpu()


def role_worker(q, address, device, tied, plugin):
    sys.path.insert(0, plugin)
    from framework_roles import serve
    from vllm.config import VllmConfig, WeightTransferConfig
    from vllm.v1.worker.gpu_worker import Worker

    import torch

    if device != "cpu":
        torch.cuda.set_device(torch.device(device))
    vc = VllmConfig(weight_transfer_config=WeightTransferConfig(backend="shmcast"))
    w = Worker(vc, device=device, model_factory=lambda dev: build(tied, seed=999, device=dev))
    w.load_model()

    def run_logits():
        return {"logits": logits(w.model_runner.model, device), "stats": w.weight_transfer_engine.last_update_stats()}

    def shutdown():
        w.shutdown()
        return "stop"

    routes = {
        "init_weight_transfer_engine": lambda init_info: w.init_weight_transfer_engine(init_info),
        "start_weight_update": w.start_weight_update,
        "update_weights": lambda update_info: w.update_weights(update_info),
        "finish_weight_update": w.finish_weight_update,
        "sleep": lambda level: w.sleep(level),
        "wake_up": lambda tags=None: w.wake_up(tags),
        "logits": run_logits,
        "shutdown": shutdown,
    }
    q.put({"ready": True})
    serve(address, routes)
    return {"stopped": True}


def role_trainer(q, commands, addresses, region, tied, load, bucket_bytes):
    import torch

    import shmcast.vllm_plugin
    from framework_roles import FanOutClient, inbox_loop
    from shmcast.vllm_transfer import ShmcastTrainerInitInfo
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    shmcast.vllm_plugin.register()
    device = os.environ.get("SHMCAST_GPU_CONTRACT_DEVICE", "cuda:0")
    if device != "cpu":
        torch.cuda.set_device(0)
    model = build(tied, seed=1, device=device)
    client = FanOutClient(addresses, timeout=240)
    engine = WeightTransferTrainerFactory.trainer_init(
        ShmcastTrainerInitInfo(rank=0, region=region, consumers=len(addresses), bucket_bytes=bucket_bytes,
                               slot_bytes=8 << 20, slots=4, load=load, timeout=120),
        client=client, source=ModuleSource(model))

    def step(seed):
        g = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g, device=device, dtype=torch.float32).to(p.dtype) * 0.01)
        t0 = time.perf_counter()
        client.calls.clear()
        engine.send_weights()
        return {"send_s": time.perf_counter() - t0, "calls": list(client.calls), "logits": logits(model, device)}

    def shutdown():
        engine.shutdown()

    q.put({"ready": True})
    inbox_loop(q, commands, {"step": step, "shutdown": shutdown}, timeout=600)
    return {"exited": True}


def run_case(procs, tmp, placement, load, tied, worker_device):
    import torch

    from framework_roles import RouteClient, plugin_dir, stop_all

    region = f"gpu-frameworks-{os.getpid()}-{placement}-{load}-{int(tied)}"
    address = os.path.join(tmp, f"{region}.sock")
    out = {"placement": placement, "load": load, "tied": tied, "worker_device": worker_device, "steps": []}
    worker = procs.start("gpu_vllm_contract:worker", address=address, device=worker_device, tied=tied,
                         plugin=plugin_dir(tmp))
    procs.ready(worker, 300)
    commands = procs.queue()
    trainer = procs.start("gpu_vllm_contract:trainer", commands=commands, addresses=[address], region=region,
                          tied=tied, load=load, bucket_bytes=1 << 20,
                          env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})  # as RL trainers run
    try:
        procs.ready(trainer, 300)
        w = RouteClient(address, 240)
        for k, seed in enumerate((11, 12, 13)):
            if k == 2:  # level-2 sleep: the weights are gone until the next sync
                w.call("sleep", {"level": 2})
                w.call("wake_up", {"tags": ["weights"]})
                lost = not torch.equal(w.call("logits")["logits"], out["steps"][-1]["want"])
                out["level2_sleep_lost_weights"] = lost
            commands.put(("step", {"seed": seed}))
            t = procs.get(trainer, 300)
            got = w.call("logits")
            same = torch.equal(got["logits"], t["logits"])
            out["steps"].append({"seed": seed, "bit_identical": same, "send_s": round(t["send_s"], 4),
                                 "calls": t["calls"], "stats": got["stats"], "want": t["logits"],
                                 "max_abs_diff": float((got["logits"] - t["logits"]).abs().max())})
        commands.put(("shutdown", {}))
        procs.get(trainer, 120)
    finally:
        stop_all(procs, trainer, commands, [worker], [address])
    for s in out["steps"]:
        s.pop("want")
    out["ok"] = all(s["bit_identical"] and s["stats"]["path"] == load for s in out["steps"]) and out.get(
        "level2_sleep_lost_weights", False)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the results here as JSON")
    ap.add_argument("--cpu", action="store_true", help="a dry run of the plumbing on the CPU (no GPU claim)")
    args = ap.parse_args()
    import torch

    import shmcast
    from conftest import Procs

    if not args.cpu and not (torch.cuda.is_available() and shmcast.cuda_available()):
        print("no usable GPU (torch or shmcast): skipped")
        return 77
    try:
        import transformers
    except ImportError:
        print("transformers is not installed: skipped")
        return 77
    gpus = 0 if args.cpu else torch.cuda.device_count()
    if args.cpu:
        os.environ["SHMCAST_GPU_CONTRACT_DEVICE"] = "cpu"
        cases = [("cpu-dry-run", "cpu")]
    else:
        cases = [("colocated", "cuda:0")] + ([("disaggregated", "cuda:1")] if gpus > 1 else [])
    results = {"torch": torch.__version__, "transformers": transformers.__version__, "gpus": gpus,
               "device": torch.cuda.get_device_name(0) if gpus else "cpu", "cases": []}
    procs = Procs("spawn")  # a GPU script: the start method its GPU runs were checked with
    with tempfile.TemporaryDirectory() as tmp:
        for placement, dev in cases:
            for load in ("direct", "loader"):
                for tied in (False, True):
                    t0 = time.perf_counter()
                    r = run_case(procs, tmp, placement, load, tied, dev)
                    r["seconds"] = round(time.perf_counter() - t0, 1)
                    results["cases"].append(r)
                    print(f"{placement:13s} {load:6s} tied={tied!s:5s}: ok={r['ok']} "
                          f"steps={[s['bit_identical'] for s in r['steps']]} "
                          f"level2_lost={r.get('level2_sleep_lost_weights')} "
                          f"send_s={[s['send_s'] for s in r['steps']]} ({r['seconds']} s)", flush=True)
    procs.cleanup()
    results["ok"] = all(c["ok"] for c in results["cases"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, default=str)
    print("ALL OK" if results["ok"] else "MISMATCH")
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
