"""STAND-IN for verl/checkpoint_engine/base.py of verl-project/verl (formerly
volcengine/verl) @ 1dda039b9c6311889a9c9a26040677e1254814f9 (2026-08-22;
checked 2026-12-06). Written for shmcast's tests, not copied. Mirrors:

* CheckpointEngineRegistry: register(backend) class decorator, get(backend)
  and new(backend, *args, **kwargs) (unknown backend: ValueError listing the
  registered ones).
* CheckpointEngine: abstract prepare(), classmethod build_topology(
  actor_wg_world_size, rollout_world_size, metadata) -> (trainer_kwargs,
  rollout_kwargs) of per-worker lists, init_process_group(**kwargs),
  finalize(), async send_weights(weights, global_steps=None), async
  receive_weights(global_steps=None) (verl PR #6507); class variable
  wire_format = "named_tensors"; CheckpointEngineWithCache adds async
  get_weights(); the "naive" ColocatedCheckpointEngine(bucket_size,
  is_master=False).
* How engines are built: CheckpointEngineWorker.__init__ (rollout side) and
  verl/workers/engine_workers.py (trainer side) first call
  import_external_libs(checkpoint_engine.custom_backend_module or None)
  (verl/utils/import_utils.py), then new(backend, bucket_size=...,
  **engine_kwargs) (trainer ranks add is_master=(rank == 0)); bucket_size =
  update_weights_bucket_megabytes << 20; engine_kwargs =
  checkpoint_engine.engine_kwargs.get(backend, {}). The trainer rank's
  update_weights(global_steps) calls send_weights(per_tensor_param,
  global_steps=global_steps); CheckpointEngineWorker.update_weights(
  global_steps) calls receive_weights(global_steps=global_steps) and hands
  the result to the server adapter.
* CheckpointEngineManager(config, actor_wg, replicas): __init__ imports
  config.custom_backend_module, then looks the backend up.
  update_weights(global_steps=None): naive: the trainer's update_weights()
  only; otherwise abort_all_requests on every replica, a worker group of
  every replica's workers, release_kv_cache on every replica (weights stay),
  build_process_group (prepare on every trainer and rollout worker, trainer
  metadata first; build_topology; init_process_group with each worker's
  kwargs), then trainer.update_weights(global_steps=) and
  rollout.update_weights(global_steps=) concurrently, finalize on every
  worker, resume_kv_cache, resume_generation. sleep_replicas() /
  wake_up_replicas() are separate calls of the trainer loop.

Left out: Ray, delta engines, metrics. A "worker group" here is any object
whose execute_checkpoint_engine(method=[...], **kwargs lists) and
update_weights(global_steps=...) return lists of futures
(concurrent.futures) in worker order, as a RayWorkerGroup's DP_COMPUTE /
ONE_TO_ALL dispatch returns ObjectRefs; `get` plays ray.get.
"""
from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import Any, Optional, TypedDict

import torch

from verl.utils.import_utils import import_external_libs


class TensorMeta(TypedDict):
    name: str
    shape: torch.Size
    dtype: torch.dtype
    offset: int


class CheckpointEngineRegistry:
    _registry: dict = {}

    def register(backend: str):  # called on the class, as verl does: @CheckpointEngineRegistry.register("x")
        def wrapper(cls):
            CheckpointEngineRegistry._registry[backend] = cls
            return cls

        return wrapper

    @classmethod
    def get(cls, backend: str):
        if backend not in cls._registry:
            raise ValueError(f"Checkpoint engine {backend} not registered, registered backends: "
                             f"{sorted(cls._registry)}")
        return cls._registry[backend]

    @classmethod
    def new(cls, backend: str, *args, **kwargs):
        if backend not in cls._registry:
            raise ValueError(f"Checkpoint engine {backend} not registered, registered backends: "
                             f"{sorted(cls._registry)}")
        return cls._registry[backend](*args, **kwargs)


class CheckpointEngine(ABC):
    wire_format = "named_tensors"

    @abstractmethod
    def prepare(self) -> dict:
        raise NotImplementedError

    @classmethod
    @abstractmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list):
        raise NotImplementedError

    @abstractmethod
    def init_process_group(self, **kwargs):
        raise NotImplementedError

    @abstractmethod
    def finalize(self):
        raise NotImplementedError

    @abstractmethod
    async def send_weights(self, weights, global_steps: Optional[int] = None):
        raise NotImplementedError

    @abstractmethod
    async def receive_weights(self, global_steps: Optional[int] = None):
        raise NotImplementedError


class CheckpointEngineWithCache(CheckpointEngine):
    @abstractmethod
    async def get_weights(self):
        raise NotImplementedError


@CheckpointEngineRegistry.register("naive")
class ColocatedCheckpointEngine(CheckpointEngine):
    def __init__(self, bucket_size: int, is_master: bool = False) -> None:
        self.bucket_size, self.is_master = bucket_size, is_master

    def prepare(self):
        raise NotImplementedError

    def init_process_group(self, **kwargs):
        raise NotImplementedError

    def finalize(self):
        raise NotImplementedError

    @classmethod
    def build_topology(cls, *args, **kwargs):
        raise NotImplementedError

    def send_weights(self, weights, global_steps: Optional[int] = None):
        self.weights = weights

    def receive_weights(self, global_steps: Optional[int] = None):
        yield from self.weights
        self.weights = None


def get(futures: list) -> list:
    """ray.get over a list of futures."""
    return [f.result() for f in futures]


class CheckpointEngineManager:
    """config: a CheckpointEngineConfig; actor_wg: a worker group of the
    trainer ranks; replicas: objects with .workers (a worker group of their
    checkpoint-engine workers) and async abort_all_requests(),
    resume_generation(), release_kv_cache(), resume_kv_cache(), sleep(),
    wake_up()."""

    def __init__(self, config, actor_wg, replicas: list) -> None:
        self.config = config
        self.backend = config.backend
        import_external_libs(config.custom_backend_module or None)
        self.backend_cls = CheckpointEngineRegistry.get(config.backend)
        self.actor_wg = actor_wg
        self.replicas = replicas
        self.calls: list = []  # what the contract test checks

    def build_process_group(self, rollout) -> None:
        trainer = self.actor_wg
        metadata = get(trainer.execute_checkpoint_engine(method=["prepare"] * trainer.world_size)
                       + rollout.execute_checkpoint_engine(method=["prepare"] * rollout.world_size))
        self.calls.append("prepare")
        trainer_kwargs, rollout_kwargs = self.backend_cls.build_topology(trainer.world_size, rollout.world_size,
                                                                         metadata)
        for k, v in trainer_kwargs.items():
            assert len(v) == trainer.world_size, k
        for k, v in rollout_kwargs.items():
            assert len(v) == rollout.world_size, k
        trainer_kwargs["method"] = ["init_process_group"] * trainer.world_size
        rollout_kwargs["method"] = ["init_process_group"] * rollout.world_size
        get(trainer.execute_checkpoint_engine(**trainer_kwargs) + rollout.execute_checkpoint_engine(**rollout_kwargs))
        self.calls.append("init_process_group")

    def sleep_replicas(self) -> None:
        asyncio.run(_gather(*[r.sleep() for r in self.replicas]))

    def wake_up_replicas(self) -> None:
        asyncio.run(_gather(*[r.wake_up() for r in self.replicas]))

    def update_weights(self, global_steps: Optional[int] = None) -> dict:
        if self.backend == "naive":
            get(self.actor_wg.update_weights(global_steps=global_steps))
            return {}
        asyncio.run(_gather(*[r.abort_all_requests() for r in self.replicas]))
        rollout = self.rollout_group()
        asyncio.run(_gather(*[r.release_kv_cache() for r in self.replicas]))
        self.build_process_group(rollout)
        get(self.actor_wg.update_weights(global_steps=global_steps) + rollout.update_weights(global_steps=global_steps))
        self.calls.append("update_weights")
        get(self.actor_wg.execute_checkpoint_engine(method=["finalize"] * self.actor_wg.world_size)
            + rollout.execute_checkpoint_engine(method=["finalize"] * rollout.world_size))
        self.calls.append("finalize")
        asyncio.run(_gather(*[r.resume_kv_cache() for r in self.replicas]))
        asyncio.run(_gather(*[r.resume_generation() for r in self.replicas]))
        return {}

    def rollout_group(self):
        """verl builds a temporary RayWorkerGroup of every replica's workers."""
        groups = [r.workers for r in self.replicas]
        return type(groups[0]).concat(groups) if len(groups) > 1 else groups[0] if groups else None


async def _gather(*aws: Any):
    return await asyncio.gather(*aws)
