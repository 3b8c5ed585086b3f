"""Processes of the SGLang contract test (test_sglang.py): SGLang TP ranks
(stand-in ModelRunner behind a scheduler-like route) and a trainer holding
the stand-in Engine and shmcast's ShmcastSGLangSender. The model on each
rank is the vLLM stand-in's Qwen2 (SGLang's layers are ports of vLLM's, with
the same names and sharding)."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import torch

import fake_vllm
from framework_roles import RouteClient, inbox_loop, serve

LOADER = "shmcast.sglang.load_weights"


def role_tp_rank(q, address, rank, tp_size, cfg, device="cpu", custom_weight_loader=(LOADER,)):
    from sglang.srt.distributed import _set_tp
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.utils import MultiprocessingSerializer
    from vllm.model_executor.models.qwen2 import Qwen2Config, Qwen2ForCausalLM

    import shmcast.sglang

    _set_tp(rank, tp_size)
    c = Qwen2Config(**cfg)
    model = Qwen2ForCausalLM(c, device)
    for p in model.parameters():
        p.data.view(torch.uint8).fill_(0x33)
    runner = ModelRunner(model, rank, device, custom_weight_loader=list(custom_weight_loader))
    flushes = [0]

    def update_weights_from_tensor(req):
        """The scheduler: this rank's payload, the ModelRunner, the cache flush."""
        named = MultiprocessingSerializer.deserialize(req["serialized_named_tensors"][rank])
        success, message = runner.update_weights_from_tensor(named, req["load_format"])
        if success and req["flush_cache"]:
            flushes[0] += 1
        return success, message

    def check(seed):
        return {"problems": fake_vllm.check_loaded(model, fake_vllm.hf_state_dict(seed, c), rank, tp_size),
                "stats": dict(shmcast.sglang.stats), "flushes": flushes[0], "pid": os.getpid()}

    q.put({"ready": True})
    serve(address, {"update_weights_from_tensor": update_weights_from_tensor, "check": check,
                    "shutdown": lambda: "stop"})
    return {"stopped": True}


def role_trainer(q, commands, addresses, region, consumers, cfg, bucket_bytes=0, load="loader", timeout=60.0):
    from sglang.srt.entrypoints.engine import Engine
    from vllm.model_executor.models.qwen2 import Qwen2Config

    from shmcast.sglang import ShmcastSGLangSender

    c = Qwen2Config(**cfg)
    pool = ThreadPoolExecutor(max_workers=len(addresses))
    calls = []

    def deliver(req):
        calls.append(req.load_format)
        body = {"req": asdict(req)}
        futures = [pool.submit(RouteClient(a, timeout * 2).call, "update_weights_from_tensor", body)
                   for a in addresses]
        return [tuple(f.result()) for f in futures]

    engine = Engine(tp_size=len(addresses), deliver=deliver)
    state = {}

    def init():
        state["sender"] = ShmcastSGLangSender(engine.update_weights_from_tensor, region, consumers,
                                              slot_bytes=2 << 20, slots=4, bucket_bytes=bucket_bytes, load=load,
                                              timeout=timeout)
        return {"calls": len(calls)}

    def send(seed):
        calls.clear()
        version = state["sender"].send(fake_vllm.hf_state_dict(seed, c))
        return {"calls": len(calls), "version": version}

    def close():
        state.pop("sender").close()

    def plain(load_format):
        """An update_weights_from_tensor call with ordinary tensors (SGLang's own path)."""
        return {"result": list(engine.update_weights_from_tensor(fake_vllm.hf_state_dict(1, c)[:1],
                                                                 load_format=load_format))}

    q.put({"ready": True})
    inbox_loop(q, commands, {"init": init, "send": send, "close": close, "plain": plain}, timeout=timeout * 4)
    return {"exited": True}
