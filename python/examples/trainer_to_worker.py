#!/usr/bin/env python3
"""A trainer process feeding a vLLM-style inference worker through shmcast.

    cmake -S . -B build && cmake --build build -j        # builds shmcast._shmcast
    PYTHONPATH=build/python python3 python/examples/trainer_to_worker.py

Runs on one GPU (trainer and worker both on cuda:0) or, without one, on the
CPU. The trainer runs with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,
as RL frameworks do (CUDA IPC of such memory needs pidfd_getfd; shmcast does
not).

The worker is a STAND-IN for a vLLM worker (vLLM is not installed here): the
model is the Qwen2 of python/tests/standins/vllm (see fake_vllm.py), whose
load_weights() maps HF names onto fused qkv_proj / gate_up_proj parameters
like vLLM's Qwen2. With real vLLM the worker side is:

    llm = LLM(model=..., worker_extension_cls="shmcast.vllm.ShmcastWorkerExtension")
    llm.collective_rpc("init_shmcast", args=("actor-0",))
    ...
    llm.collective_rpc("update_weights_from_shmcast", args=("actor-0",))   # while the trainer sends

Here a multiprocessing Pipe plays collective_rpc.
"""
import os

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import hashlib  # noqa: E402
import multiprocessing as mp  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
sys.path.insert(0, _TESTS)  # fake_vllm
sys.path.insert(0, os.path.join(_TESTS, "standins"))  # the vLLM stand-in it builds on

import shmcast  # noqa: E402

STEPS = 3


def config():
    """The stand-in model's size: a vocabulary without padding, tied embeddings."""
    import fake_vllm

    return fake_vllm.Cfg(vocab_size=256, tie_word_embeddings=True)


def fused_digest(named) -> str:
    """Digest of a model's weights in vLLM's fused layout (q|k|v, gate|up)."""
    d = dict(named)
    h = hashlib.sha256()
    for name in sorted(d):
        h.update(name.encode())
        h.update(d[name].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def hf_to_fused(hf):
    """What the worker's parameters must look like after load_weights(hf)."""
    d = dict(hf)
    out = {}
    for name, t in d.items():
        if ".q_proj." in name:
            k, v = name.replace("q_proj", "k_proj"), name.replace("q_proj", "v_proj")
            out[name.replace("q_proj", "qkv_proj")] = torch.cat([t, d[k], d[v]])
        elif ".gate_proj." in name:
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat([t, d[name.replace("gate_proj", "up_proj")]])
        elif not any(s in name for s in (".k_proj.", ".v_proj.", ".up_proj.")):
            out[name] = t
    return out


def worker_main(conn, region, device):
    """The inference worker: a vLLM-style worker with the shmcast extension."""
    import fake_vllm  # STAND-IN for vLLM (see its docstring)

    worker = fake_vllm.FakeWorker(device=device, cfg=config())
    worker.init_shmcast(region, timeout=60)  # attach before the first sync
    conn.send("attached")
    while True:
        msg = conn.recv()  # plays collective_rpc
        if msg == "stop":
            break
        version = worker.update_weights_from_shmcast(region, timeout=60)
        conn.send((version, fused_digest(worker.model_runner.model.named_parameters())))
    worker.close_shmcast()


def main():
    import fake_vllm

    region = f"example-actor-{os.getpid()}"
    device = "cuda:0" if torch.cuda.is_available() and shmcast.cuda_available() else "cpu"
    print(f"trainer: weights on {device}; region '{region}' in {shmcast.region_dir()}")
    # The trainer's model, in HF naming (a real trainer: model.named_parameters()).
    weights = [(n, t.to(device)) for n, t in fake_vllm.hf_state_dict(seed=0, cfg=config())]

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    with shmcast.Producer(region, slot_bytes=64 << 20, slots=2, max_consumers=1) as prod:
        worker = ctx.Process(target=worker_main, args=(there, region, device))
        worker.start()
        assert here.recv() == "attached"
        prod.wait_for_consumers(1, timeout=60)
        for step in range(STEPS):
            with torch.no_grad():  # "training": change every weight
                for _, t in weights:
                    t.add_(torch.randn(t.shape, device=device).to(t.dtype) * 0.01)
            here.send("update")  # the worker starts receiving (collective_rpc is async here)
            t0 = time.perf_counter()
            version = prod.send(weights)  # returns once the bytes are in the region
            got_version, digest = here.recv()
            dt = time.perf_counter() - t0
            want = fused_digest(hf_to_fused(weights).items())
            ok = got_version == version and digest == want
            print(f"step {step}: sync {version} -> worker loaded version {got_version} in {dt * 1e3:.1f} ms, "
                  f"weights {'match' if ok else 'DIFFER'}")
            if not ok:
                raise SystemExit(1)
        here.send("stop")
        worker.join(60)
    print("done: region removed" if not os.path.exists(shmcast.region_path(region)) else "region still there?")


if __name__ == "__main__":
    main()
