"""STAND-IN for verl/checkpoint_engine/base.py of volcengine/verl @
b178a3cd56f58b2d502255daba591e92833930a7 (2026-01-29). Written for
shmcast's tests, not copied. Mirrors:

* CheckpointEngineRegistry: register(backend) class decorator, get(backend),
  new(backend, *args, **kwargs) (unknown backend: ValueError).
* CheckpointEngine: abstract prepare(), classmethod build_topology(
  trainer_world_size, rollout_world_size, metadata) -> (trainer_kwargs,
  rollout_kwargs) of per-worker lists, init_process_group(**kwargs),
  finalize(), async send_weights(weights), async receive_weights();
  CheckpointEngineWithCache adds async get_weights(); the "naive"
  ColocatedCheckpointEngine(bucket_size, is_master=False).
* How engines are built (verl/workers/engine_workers.py and
  CheckpointEngineWorker in this file): trainer ranks call
  new(backend, is_master=(rank == 0), bucket_size=..., **engine_kwargs),
  rollout workers new(backend, bucket_size=..., **engine_kwargs);
  bucket_size = update_weights_bucket_megabytes << 20; engine_kwargs =
  checkpoint_engine.engine_kwargs.get(backend, {}).
* CheckpointEngineManager.update_weights / sleep_replicas call order:
  naive: trainer.update_weights() only; otherwise abort_all_requests on every
  replica, build_process_group (prepare on every trainer and rollout worker,
  trainer metadata first; build_topology; init_process_group with each
  worker's kwargs), then trainer.update_weights() and rollout.update_weights()
  concurrently, then finalize on every worker, then resume_all_requests.
  sleep_replicas does nothing unless the backend is naive.

Left out: Ray. A "worker group" here is any object whose
execute_checkpoint_engine(method=[...], **kwargs lists) and update_weights()
return lists of futures (concurrent.futures) in worker order, as a
RayWorkerGroup's DP_COMPUTE / ONE_TO_ALL dispatch returns ObjectRefs; `get`
plays ray.get.
"""
from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import Any, TypedDict

import torch


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
        return cls._registry[backend]

    @classmethod
    def new(cls, backend: str, *args, **kwargs):
        if backend not in cls._registry:
            raise ValueError(f"Checkpoint engine {backend} not registered")
        return cls._registry[backend](*args, **kwargs)


class CheckpointEngine(ABC):
    @abstractmethod
    def prepare(self) -> dict:
        raise NotImplementedError

    @classmethod
    @abstractmethod
    def build_topology(cls, trainer_world_size: int, rollout_world_size: int, metadata: list):
        raise NotImplementedError

    @abstractmethod
    def init_process_group(self, **kwargs):
        raise NotImplementedError

    @abstractmethod
    def finalize(self):
        raise NotImplementedError

    @abstractmethod
    async def send_weights(self, weights):
        raise NotImplementedError

    @abstractmethod
    async def receive_weights(self):
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

    def send_weights(self, weights):
        self.weights = weights

    def receive_weights(self):
        yield from self.weights
        self.weights = None


def get(futures: list) -> list:
    """ray.get over a list of futures."""
    return [f.result() for f in futures]


class CheckpointEngineManager:
    """trainer: a worker group of the trainer ranks; replicas: objects with
    .workers (a worker group of their checkpoint-engine workers) and async
    abort_all_requests() / resume_all_requests() / sleep()."""

    def __init__(self, backend: str, trainer, replicas: list) -> None:
        self.backend = backend
        self.backend_cls = CheckpointEngineRegistry.get(backend)
        self.trainer = trainer
        self.replicas = replicas
        self.calls: list = []  # what the contract test checks

    def build_process_group(self, rollout) -> None:
        trainer = self.trainer
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
        if self.backend != "naive":
            return
        asyncio.run(_gather(*[r.sleep() for r in self.replicas]))

    def update_weights(self) -> None:
        if self.backend == "naive":
            get(self.trainer.update_weights())
            return
        asyncio.run(_gather(*[r.abort_all_requests() for r in self.replicas]))
        rollout = self.rollout_group()
        self.build_process_group(rollout)
        get(self.trainer.update_weights() + rollout.update_weights())
        self.calls.append("update_weights")
        get(self.trainer.execute_checkpoint_engine(method=["finalize"] * self.trainer.world_size)
            + rollout.execute_checkpoint_engine(method=["finalize"] * rollout.world_size))
        self.calls.append("finalize")
        asyncio.run(_gather(*[r.resume_all_requests() for r in self.replicas]))

    def rollout_group(self):
        """verl builds a temporary RayWorkerGroup of every replica's workers."""
        groups = [r.workers for r in self.replicas]
        return type(groups[0]).concat(groups) if len(groups) > 1 else groups[0] if groups else None


async def _gather(*aws: Any):
    return await asyncio.gather(*aws)
