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


def role_tp_rank(q, address, rank, tp_size, cfg, device="cpu", custom_weight_loader=(LOADER,), sessions=True):
    """A TP rank: the stand-in ModelRunner behind the stand-in scheduler's
    weight updater (sessions=True: the session-era scheduler that asserts an
    open begin_weight_update session; False: the one before)."""
    from sglang.srt.distributed import _set_tp
    from sglang.srt.managers.io_struct import (
        BeginWeightUpdateReqInput,
        EndWeightUpdateReqInput,
        UpdateWeightsFromTensorReqInput,
    )
    from sglang.srt.managers.scheduler_weight_updater import SchedulerWeightUpdaterManager
    from sglang.srt.model_executor.model_runner import ModelRunner
    from vllm.model_executor.models.qwen2 import Qwen2Config, Qwen2ForCausalLM

    import shmcast.sglang

    _set_tp(rank, tp_size)
    c = Qwen2Config(**cfg)
    model = Qwen2ForCausalLM(c, device)
    for p in model.parameters():
        p.data.view(torch.uint8).fill_(0x33)
    runner = ModelRunner(model, rank, device, custom_weight_loader=list(custom_weight_loader))
    sched = SchedulerWeightUpdaterManager(runner, rank, sessions=sessions)
    log = []  # the scheduler calls in order, and whether a session was open at each

    def call(name, cls):
        def route(req):
            log.append((name, sched._weight_update_in_progress))
            return getattr(sched, name)(cls(**req))
        return route

    def check(seed):
        return {"problems": fake_vllm.check_loaded(model, fake_vllm.hf_state_dict(seed, c), rank, tp_size),
                "stats": dict(shmcast.sglang.stats), "flushes": sched.flushes, "pid": os.getpid(),
                "log": list(log), "session_log": list(runner.session_log),
                "open": sched._weight_update_in_progress}

    q.put({"ready": True})
    serve(address, {"update_weights_from_tensor": call("update_weights_from_tensor", UpdateWeightsFromTensorReqInput),
                    "begin_weight_update": call("begin_weight_update", BeginWeightUpdateReqInput),
                    "end_weight_update": call("end_weight_update", EndWeightUpdateReqInput),
                    "check": check, "shutdown": lambda: "stop"})
    return {"stopped": True}


def role_trainer(q, commands, addresses, region, consumers, cfg, bucket_bytes=0, load="loader", timeout=60.0,
                 sessions=True):
    """The trainer: the stand-in Engine (sessions=False: the offline Engine @
    001067ff, no begin_weight_update) or SessionEngine, and a
    ShmcastSGLangSender given only engine.update_weights_from_tensor."""
    from sglang.srt.entrypoints.engine import Engine, SessionEngine
    from vllm.model_executor.models.qwen2 import Qwen2Config

    from shmcast.sglang import ShmcastSGLangSender

    c = Qwen2Config(**cfg)
    pool = ThreadPoolExecutor(max_workers=len(addresses))
    calls = []

    routes = {"UpdateWeightsFromTensorReqInput": "update_weights_from_tensor",
              "BeginWeightUpdateReqInput": "begin_weight_update", "EndWeightUpdateReqInput": "end_weight_update"}

    def deliver(req):
        route = routes[type(req).__name__]
        if route == "update_weights_from_tensor":
            calls.append(req.load_format)
        body = {"req": asdict(req)}
        futures = [pool.submit(RouteClient(a, timeout * 2).call, route, body) for a in addresses]
        return [tuple(f.result()) for f in futures]

    engine = (SessionEngine if sessions else Engine)(tp_size=len(addresses), deliver=deliver)
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
        """An update_weights_from_tensor call with ordinary tensors (SGLang's own path, in a session)."""
        if sessions:
            engine.begin_weight_update()
        try:
            return {"result": list(engine.update_weights_from_tensor(fake_vllm.hf_state_dict(1, c)[:1],
                                                                     load_format=load_format))}
        finally:
            if sessions:
                engine.end_weight_update()

    q.put({"ready": True})
    inbox_loop(q, commands, {"init": init, "send": send, "close": close, "plain": plain}, timeout=timeout * 4)
    return {"exited": True}
