"""A `shmcast` checkpoint engine for verl (verl/checkpoint_engine: the
CheckpointEngineRegistry backends naive, nccl, nixl, hccl, ...): the trainer
writes the weights into a pinned POSIX shared-memory region, the rollout
side's checkpoint-engine workers read them, on one node, with no NCCL group,
no CUDA IPC handle and no pickled tensor.

    # the trainer config: verl imports checkpoint_engine.custom_backend_module
    # (CheckpointEngineManager and every CheckpointEngineWorker /
    # engine worker, before they look the backend up), which registers it
    actor_rollout_ref.rollout.checkpoint_engine.backend=shmcast
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=shmcast.verl
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.shmcast.region=verl-actor
    # (older verl without custom_backend_module: VERL_USE_EXTERNAL_MODULES=shmcast.verl
    # in every process, which `import verl` imports)

Checked against verl-project/verl (formerly volcengine/verl) @
1dda039b9c6311889a9c9a26040677e1254814f9 (2026-08-22; checked 2026-12-06):
verl/checkpoint_engine/base.py (CheckpointEngine, CheckpointEngineRegistry,
CheckpointEngineWorker, CheckpointEngineManager), verl/workers/engine_workers.py
(send_weights(..., global_steps=...)), verl/workers/config/rollout.py
(custom_backend_module). Still works with the older API of
b178a3cd56f58b2d502255daba591e92833930a7 (no global_steps: it defaults to None).

global_steps (verl PR #6507: the manager passes the trainer step to
send_weights and receive_weights): it is not the syncs' version (an update
is several syncs, and a region's versions only grow, across trainer
restarts too); send_weights writes it into every bucket's control tensor and
receive_weights(global_steps=g) refuses an update that was sent for another
step (shmcast.Corrupt), so a rollout worker never loads a stale or foreign
update under the step it was asked for. None on either side checks nothing.
last_receive["global_steps"] is the step the last update carried.

How verl drives it (CheckpointEngineManager.update_weights, per step):
prepare() on every trainer and rollout worker (trainer rank 0 creates the
region the first time and returns its name and incarnation token);
build_topology(trainer_world_size, rollout_world_size, metadata) gives trainer
rank 0 rank 0, the other trainer ranks -1 and the rollout workers 1..n;
init_process_group(rank, world_size, master_metadata) attaches every rollout
worker (reattaching when the trainer recreated the region); then the
trainer's send_weights(per_tensor_param) and the rollout workers'
receive_weights() run concurrently; finalize() ends the step.

send_weights writes one sync per bucket (update_weights_bucket_megabytes,
the tensors cast to rollout_dtype, as the nccl engine does) plus a final
control-only sync; each sync carries a small control tensor
(bucket index, is_last, global_steps or -1). Trainer ranks other than 0 only iterate the
generator (the FSDP gathers are collectives). receive_weights yields each
bucket's (name, tensor) pairs on the worker's device ('copy' mode: a buffer
per bucket, freed once the server adapter has copied it out).

Placement on one node: colocated (trainer rank g and rollout worker g on GPU
g) and disaggregated (other GPUs) use the same code; the consumer reads into
its own device. verl's manager runs every backend except 'naive' as
disaggregated: it does not put the rollout to sleep around the update, so
in colocated placement both sides stay resident (verl 1dda039b releases the
rollout's KV cache before and restores it after the update, keeping its
weights, release_kv_cache_replicas / resume_kv_cache_replicas; the weights
are overwritten in place). The last hop, from the
checkpoint-engine worker into the inference server, is verl's ServerAdapter
(CUDA IPC into vLLM/SGLang), unchanged.

get_weights() (CheckpointEngineWithCache: rollouts reloading from a local
cache on their own) is not offered: this backend's ring region does not keep
a sync once every consumer has read it. A store region
(shmcast.Producer(mode='store')) does keep the newest version; wiring it in
as get_weights() is not done.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, AsyncGenerator, Generator, Optional, Union

import torch

from . import _shmcast as _C
from ._load import ConsumerCache, region_token
from ._send import buckets
from ._torch import Producer

from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry  # noqa: E402  (needs verl)

logger = logging.getLogger(__name__)

__all__ = ["ShmcastCheckpointEngine", "CONTROL"]

# The last tensor of every sync: int64 [bucket index, is_last, global_steps
# (-1: none)], named
# CONTROL + ".<bucket index>" (each bucket its own tensors, so that a delta
# producer keeps each bucket's base apart and sends it as a delta).
CONTROL = "__shmcast__.verl.bucket"


def _control(index: int) -> str:
    return f"{CONTROL}.{index}"


def _dtype(d: Union[str, torch.dtype, None]) -> Optional[torch.dtype]:
    if d is None or isinstance(d, torch.dtype):
        return d
    t = getattr(torch, str(d).replace("torch.", ""), None)
    if not isinstance(t, torch.dtype):
        raise ValueError(f"rollout_dtype {d!r} is not a torch dtype")
    return t


def _step(global_steps) -> int:
    if global_steps is None:
        return -1
    step = int(global_steps)
    if step < 0:
        raise ValueError(f"global_steps must be >= 0 or None, not {global_steps!r}")
    return step


@CheckpointEngineRegistry.register("shmcast")
class ShmcastCheckpointEngine(CheckpointEngine):
    """verl checkpoint engine over a shmcast region.

    Args (engine_kwargs.shmcast in verl's config, plus what verl passes):
        bucket_size: bytes per sync (verl: update_weights_bucket_megabytes << 20).
        is_master: trainer rank 0 (verl passes it on the trainer side only).
        region: the region's name (one per trainer / rollout pairing).
        rollout_dtype: floating-point tensors are sent in this dtype (default
            bfloat16, like the nccl engine; None keeps them as they are).
        slot_bytes, slots: the region's geometry (slots x slot_bytes of
            pinned host memory; a bucket may be larger: it streams).
        timeout: seconds to wait for consumers, a bucket or the region.
        device: where rollout workers receive (default: the current CUDA
            device, else the CPU).
        mode: 'copy' (a buffer per bucket) or 'staging' (one reused buffer;
            only when the consumer of the yielded tensors copies them out
            before asking for the next one).
        producer_options: more shmcast.Producer keyword arguments.
    """

    def __init__(self, bucket_size: int, is_master: bool = False, region: str = "verl-weights",
                 rollout_dtype: Union[str, torch.dtype, None] = torch.bfloat16, slot_bytes: int = 256 << 20,
                 slots: int = 4, timeout: float = 300.0, device=None, mode: str = "copy",
                 **producer_options: Any) -> None:
        self.bucket_size = int(bucket_size)
        self.is_master = is_master
        self.region = region
        self.rollout_dtype = _dtype(rollout_dtype)
        self.slot_bytes, self.slots, self.timeout = slot_bytes, slots, timeout
        self.device, self.mode = device, mode
        self.producer_options = producer_options
        self.producer: Optional[Producer] = None
        self._consumers = ConsumerCache()
        self.rank: Optional[int] = None
        self.world_size: Optional[int] = None
        self.last_receive: dict = {}

    # ---- topology (called by CheckpointEngineManager through execute_checkpoint_engine)
    def prepare(self) -> Optional[dict]:
        if not self.is_master:
            return None
        if self.producer is None or self.producer.closed:
            opts = dict(slot_bytes=self.slot_bytes, slots=self.slots, max_consumers=64, consumer_timeout=self.timeout)
            opts.update(self.producer_options)
            self.producer = Producer(self.region, **opts)
        return {"region": self.region, "token": region_token(self.region)}

    @classmethod
    def build_topology(cls, trainer_world_size: int, rollout_world_size: int, metadata: list):
        master = metadata[0]  # the manager lists the trainer's metadata first; rank 0's is the master's
        world = rollout_world_size + 1
        trainer_kwargs = {
            "rank": [0] + [-1] * (trainer_world_size - 1),
            "world_size": [world] * trainer_world_size,
            "master_metadata": [master] * trainer_world_size,
        }
        rollout_kwargs = {
            "rank": list(range(1, rollout_world_size + 1)),
            "world_size": [world] * rollout_world_size,
            "master_metadata": [master] * rollout_world_size,
        }
        return trainer_kwargs, rollout_kwargs

    def init_process_group(self, rank: int, world_size: int, master_metadata: dict):
        self.rank, self.world_size = rank, world_size
        if rank > 0:  # a rollout worker: attach now, before the trainer's first bucket
            self._consumers.get(master_metadata["region"], self.device, open_timeout=self.timeout, mode=self.mode,
                                token=master_metadata["token"])
            self._region = master_metadata["region"]

    def finalize(self):
        """Nothing to free per step: the region and the consumers' seats stay
        for the next one (close() releases them)."""

    def close(self) -> None:
        self._consumers.close()
        if self.producer is not None:
            self.producer.close()
            self.producer = None

    # ---- data
    async def send_weights(self, weights: Generator[tuple, None, None], global_steps: Optional[int] = None):
        """Sends one update (every rank iterates `weights`; rank 0 writes).
        global_steps: the trainer step, carried to the receivers (module doc)."""
        assert self.rank is not None and self.rank <= 0, "rollout workers do not send"
        if self.rank < 0:  # other trainer ranks: take part in the gathers only
            for _ in weights:
                pass
            return
        loop = asyncio.get_running_loop()
        prod = self.producer
        await loop.run_in_executor(None, prod.wait_for_consumers, self.world_size - 1, self.timeout)
        step = _step(global_steps)
        index = 0
        for bucket in buckets(weights, self.bucket_size, self.rollout_dtype):
            bucket.append((_control(index), torch.tensor([index, 0, step], dtype=torch.int64)))
            await loop.run_in_executor(None, prod.send, bucket)
            index += 1
        await loop.run_in_executor(None, prod.send,
                                   [(_control(index), torch.tensor([index, 1, step], dtype=torch.int64))])

    async def receive_weights(self, global_steps: Optional[int] = None) -> AsyncGenerator[tuple, None]:
        """Yields the update's (name, tensor) pairs bucket by bucket.
        global_steps: the step verl asks for; an update sent for another
        step raises shmcast.Corrupt (module doc)."""
        assert self.rank is not None and self.rank > 0, "only rollout workers receive"
        cons = self._consumers.peek(self._region)
        if cons is None:
            raise _C.Closed(f"not attached to region '{self._region}': init_process_group first")
        loop = asyncio.get_running_loop()
        receive = functools.partial(cons.receive, self.timeout)
        stats = self.last_receive = {"syncs": 0, "tensors": 0, "bytes": 0, "global_steps": None}
        want = None if global_steps is None else _step(global_steps)
        expect = 0
        while True:
            try:
                named = await loop.run_in_executor(None, receive)
                name, ctl = named.pop()
                if name != _control(expect) or ctl.numel() != 3 or int(ctl[0]) != expect:
                    raise _C.Corrupt(f"region '{cons.name}': expected bucket {expect} of this update, got {name} "
                                     f"{ctl.tolist() if name == _control(expect) else ''}")
                sent = int(ctl[2])
                if want is not None and sent >= 0 and sent != want:
                    raise _C.Corrupt(f"region '{cons.name}': the update was sent for global step {sent}, "
                                     f"not for step {want} that verl asked for: the trainer and this rollout "
                                     "worker are out of step")
            except BaseException:
                self._consumers.drop(self._region)  # never keep the trainer waiting for this worker
                raise
            stats["syncs"] += 1
            stats["global_steps"] = None if sent < 0 else sent
            stats["tensors"] += len(named)
            stats["bytes"] += cons.sync_info.payload_bytes
            for item in named:
                yield item
            del named
            if int(ctl[1]):
                return
            expect += 1
