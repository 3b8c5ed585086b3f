"""Processes of the verl checkpoint-engine contract test (test_verl.py): trainer
ranks and rollout checkpoint-engine workers as verl builds them, each serving
execute_checkpoint_engine / update_weights over framework_roles' routes.
Everything verl here is the stand-in (standins/verl); the inference server
behind a rollout worker is the vLLM stand-in's Qwen2 model."""
from __future__ import annotations

import asyncio
import os

import torch

import fake_vllm
from framework_roles import serve


def _new_engine(backend, bucket_size, engine_kwargs, custom_backend_module=None, **extra):
    """What CheckpointEngineWorker.__init__ and the trainer's engine worker do
    (verl @ 1dda039b): import checkpoint_engine.custom_backend_module, then
    CheckpointEngineRegistry.new(backend, bucket_size=..., **engine_kwargs)."""
    import verl  # noqa: F401  (also imports $VERL_USE_EXTERNAL_MODULES, the older way)
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs(custom_backend_module or None)
    return CheckpointEngineRegistry.new(backend, bucket_size=bucket_size, **extra, **engine_kwargs)


def _execute(engine, method, kwargs=None):
    """ActorRolloutRefWorker / CheckpointEngineWorker.execute_checkpoint_engine."""
    return getattr(engine, method)(**(kwargs or {}))


def role_trainer_rank(q, address, rank, cfg, bucket_size, engine_kwargs, backend="shmcast", device="cpu",
                      custom_backend_module=None):
    """A trainer rank: engine = new(backend, is_master=(rank == 0), ...);
    update_weights() sends get_per_tensor_param() (fp32, as FSDP holds
    them; every rank iterates it, as FSDP's full_tensor() gathers require)."""
    from vllm.model_executor.models.qwen2 import Qwen2Config

    engine = _new_engine(backend, bucket_size, engine_kwargs, custom_backend_module, is_master=(rank == 0))
    c = Qwen2Config(**cfg)
    gathered = [0]

    def per_tensor_param(seed):
        for n, t in fake_vllm.hf_state_dict(seed, c):
            gathered[0] += 1
            yield n, t.float().to(device)

    def update_weights(seed, global_steps=None):
        # verl/workers/engine_workers.py: send_weights(per_tensor_param, global_steps=global_steps)
        asyncio.run(engine.send_weights(per_tensor_param(seed), global_steps=global_steps))
        return {"gathered": gathered[0], "pid": os.getpid()}

    def shutdown():
        engine.close()
        return "stop"

    q.put({"ready": True, "engine": type(engine).__name__})
    serve(address, {"execute_checkpoint_engine": lambda method, kwargs=None: _execute(engine, method, kwargs),
                    "update_weights": update_weights, "shutdown": shutdown})
    return {"stopped": True}


def role_rollout_worker(q, address, cfg, bucket_size, engine_kwargs, backend="shmcast", device="cpu",
                        custom_backend_module=None):
    """A rollout checkpoint-engine worker (CheckpointEngineWorker: engine =
    new(backend, bucket_size=..., **engine_kwargs)); update_weights() hands
    receive_weights() to a server adapter that consumes it as verl's vLLM
    ServerAdapter does (async for over ensure_async_iterator, each tensor
    copied out before the next is asked for; verl/workers/rollout/
    vllm_rollout/vllm_rollout.py @ b178a3cd) and loads it into the
    inference model (vLLM's load_weights, here the stand-in's)."""
    from vllm.model_executor.models.qwen2 import Qwen2Config, Qwen2ForCausalLM

    engine = _new_engine(backend, bucket_size, engine_kwargs, custom_backend_module)
    c = Qwen2Config(**cfg)
    model = Qwen2ForCausalLM(c, device)
    for p in model.parameters():
        p.data.view(torch.uint8).fill_(0x33)

    async def ensure_async_iterator(iterable):
        if hasattr(iterable, "__aiter__"):
            async for item in iterable:
                yield item
        else:
            for item in iterable:
                yield item

    async def server_adapter_update_weights(weights):
        async for name, weight in ensure_async_iterator(weights):
            model.load_weights([(name, weight.to(c.dtype))])

    async def update(global_steps):
        # CheckpointEngineWorker.update_weights(global_steps)
        weights = engine.receive_weights(global_steps=global_steps)
        await server_adapter_update_weights(weights)

    def update_weights(global_steps=None):
        asyncio.run(update(global_steps))
        return {"stats": dict(engine.last_receive)}

    def check(seed):
        return {"problems": fake_vllm.check_loaded(model, fake_vllm.hf_state_dict(seed, c)), "pid": os.getpid(),
                "device": str(next(model.parameters()).device)}

    def shutdown():
        engine.close()
        return "stop"

    q.put({"ready": True, "engine": type(engine).__name__})
    serve(address, {"execute_checkpoint_engine": lambda method, kwargs=None: _execute(engine, method, kwargs),
                    "update_weights": update_weights, "check": check, "shutdown": shutdown})
    return {"stopped": True}
