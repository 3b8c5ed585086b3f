"""verl checkpoint engine with the `shmcast` backend (shmcast.verl), against
the verl stand-in (standins/verl: CheckpointEngineRegistry, CheckpointEngine
and the CheckpointEngineManager's call order of verl-project/verl @ 1dda039b).

Trainer ranks and rollout checkpoint-engine workers are real processes that
build their engines as verl does (custom_backend_module imported, registry,
is_master on trainer rank 0, bucket_size, engine_kwargs); the stand-in
manager, given update_weights(global_steps=step), drives prepare /
build_topology / init_process_group / send_weights + receive_weights /
finalize per step. Each rollout worker's inference model is checked bit for
bit after every step, across a rollout-worker restart, a restart of every
trainer rank (SIGKILL) and shutdown. Colocated and disaggregated placement
differ only in devices: on a machine without GPUs both run on the CPU (the
GPU script runs them on GPUs)."""
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import shmcast
from framework_roles import RouteClient, stop_all

pytestmark = pytest.mark.usefixtures("deadline")

CFG = dict(vocab_size=250, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
           num_hidden_layers=2)
BUCKET = 80_000  # about 0.2 MB of bf16 per model: three buckets, plus the closing control sync


def devices(placement, n):
    """(trainer devices, rollout devices) for n ranks and n rollout workers."""
    g = torch.cuda.device_count() if torch.cuda.is_available() and shmcast.cuda_available() else 0
    if g == 0:
        return ["cpu"] * n, ["cpu"] * n
    trainer = [f"cuda:{i % g}" for i in range(n)]
    shift = 1 if placement == "disaggregated" and g > 1 else 0
    return trainer, [f"cuda:{(i + shift) % g}" for i in range(n)]


class WorkerGroup:
    """A RayWorkerGroup as the stand-in manager sees it: calls dispatched to
    every worker at once, futures back in worker order."""

    _pool = ThreadPoolExecutor(max_workers=16)

    def __init__(self, addresses):
        self.addresses = list(addresses)
        self.seed = None

    @property
    def world_size(self):
        return len(self.addresses)

    @classmethod
    def concat(cls, groups):
        return cls([a for g in groups for a in g.addresses])

    def _each(self, route, bodies):
        return [self._pool.submit(RouteClient(a, 120).call, route, b) for a, b in zip(self.addresses, bodies)]

    def execute_checkpoint_engine(self, method, **kwargs):
        bodies = [{"method": m, "kwargs": {k: v[i] for k, v in kwargs.items()}} for i, m in enumerate(method)]
        return self._each("execute_checkpoint_engine", bodies)

    def update_weights(self, global_steps=None):
        body = {"global_steps": global_steps}
        if self.seed is not None:
            body["seed"] = self.seed
        return self._each("update_weights", [body] * self.world_size)


class Replica:
    def __init__(self, group):
        self.workers, self.calls = group, []

    async def abort_all_requests(self):
        self.calls.append("abort_all_requests")

    async def resume_generation(self):
        self.calls.append("resume_generation")

    async def release_kv_cache(self):
        self.calls.append("release_kv_cache")

    async def resume_kv_cache(self):
        self.calls.append("resume_kv_cache")

    async def sleep(self):
        self.calls.append("sleep")


STEP = ["prepare", "init_process_group", "update_weights", "finalize"]


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_contract(procs, tmp_path, region, placement):
    # registered the current way: checkpoint_engine.custom_backend_module, which
    # the manager and every worker import before looking the backend up
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.workers.config import CheckpointEngineConfig

    n = 2
    tdev, rdev = devices(placement, n)
    kwargs = {"region": region, "slot_bytes": 2 << 20, "slots": 4, "timeout": 60.0}
    config = CheckpointEngineConfig(backend="shmcast", engine_kwargs={"shmcast": kwargs},
                                    custom_backend_module="shmcast.verl")
    common = dict(cfg=CFG, bucket_size=BUCKET, engine_kwargs=config.engine_kwargs["shmcast"],
                  custom_backend_module=config.custom_backend_module)
    t_addr = [str(tmp_path / f"t{i}.sock") for i in range(n)]
    r_addr = [str(tmp_path / f"r{i}.sock") for i in range(n)]
    trainers, rollouts = [None] * n, [None] * n

    def start_trainer(i):
        trainers[i] = procs.start("verl_roles:trainer_rank", address=t_addr[i], rank=i, device=tdev[i], **common)
        assert procs.ready(trainers[i])["engine"] == "ShmcastCheckpointEngine"

    def start_rollout(i):
        rollouts[i] = procs.start("verl_roles:rollout_worker", address=r_addr[i], device=rdev[i], **common)
        assert procs.ready(rollouts[i])["engine"] == "ShmcastCheckpointEngine"

    trainer = WorkerGroup(t_addr)
    replicas = [Replica(WorkerGroup([a])) for a in r_addr]  # two replicas of one worker each
    manager = CheckpointEngineManager(config, trainer, replicas)

    def step(seed):
        trainer.seed = seed
        manager.calls.clear()
        manager.update_weights(global_steps=seed)  # verl's trainer passes its step
        assert manager.calls == STEP
        for i, a in enumerate(r_addr):
            res = RouteClient(a).call("check", {"seed": seed})
            assert res["problems"] == [], (seed, i, res["problems"][:5])
            assert res["device"] == rdev[i]
        return res

    try:
        for i in range(n):
            start_trainer(i)
            start_rollout(i)
        for seed in (30, 31):
            step(seed)
        for r in replicas:  # the rollout keeps its weights: only its KV cache is released
            assert r.calls == ["abort_all_requests", "release_kv_cache", "resume_kv_cache", "resume_generation"] * 2

        # a rollout worker restarts: it attaches at the next step's init_process_group
        procs.kill(rollouts[1])
        start_rollout(1)
        step(32)
        # every trainer rank restarts: rank 0 recreates the region, the rollout workers reattach
        for i in range(n):
            procs.kill(trainers[i])
        for i in range(n):
            start_trainer(i)
        step(33)

        for a in t_addr + r_addr:
            RouteClient(a).call("shutdown")
        for p in trainers + rollouts:
            assert procs.get(p)["stopped"]
        assert not os.path.exists(shmcast.region_path(region))
    finally:
        stop_all(procs, None, None, trainers + rollouts, t_addr + r_addr)


def test_topology_and_arguments():
    import verl  # noqa: F401
    from verl.checkpoint_engine import CheckpointEngineRegistry

    import shmcast.verl as sv

    assert CheckpointEngineRegistry.get("shmcast") is sv.ShmcastCheckpointEngine
    meta = [{"region": "r", "token": "t"}, None, None, None, None]
    tk, rk = sv.ShmcastCheckpointEngine.build_topology(2, 3, meta)
    assert tk == {"rank": [0, -1], "world_size": [4, 4], "master_metadata": [meta[0]] * 2}
    assert rk == {"rank": [1, 2, 3], "world_size": [4, 4, 4], "master_metadata": [meta[0]] * 3}
    e = CheckpointEngineRegistry.new("shmcast", bucket_size=1 << 20, rollout_dtype="float16")
    assert e.rollout_dtype == torch.float16 and e.prepare() is None  # not the master: no region
    with pytest.raises(ValueError, match="rollout_dtype"):
        CheckpointEngineRegistry.new("shmcast", bucket_size=1, rollout_dtype="float17")


def _pair(region):
    """A trainer rank 0 and one rollout worker in this process, set up as the
    manager does (prepare, build_topology, init_process_group)."""
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs("shmcast.verl")  # checkpoint_engine.custom_backend_module
    kw = dict(region=region, slot_bytes=1 << 20, slots=4, timeout=20.0, device="cpu", rollout_dtype=None)
    sender = CheckpointEngineRegistry.new("shmcast", bucket_size=1 << 16, is_master=True, **kw)
    receiver = CheckpointEngineRegistry.new("shmcast", bucket_size=1 << 16, **kw)
    meta = [sender.prepare(), receiver.prepare()]
    tk, rk = sender.build_topology(1, 1, meta)
    sender.init_process_group(**{k: v[0] for k, v in tk.items()})
    receiver.init_process_group(**{k: v[0] for k, v in rk.items()})
    return sender, receiver


def _update(sender, receiver, weights, send_steps, receive_steps):
    """send_weights and receive_weights concurrently, as verl runs them."""
    import asyncio

    got = []

    async def consume():
        async for name, t in receiver.receive_weights(global_steps=receive_steps):
            got.append((name, t.clone()))

    async def both():
        return await asyncio.gather(sender.send_weights(iter(weights), global_steps=send_steps), consume(),
                                    return_exceptions=True)

    return asyncio.run(asyncio.wait_for(both(), 60)), got


def test_global_steps_travel_with_the_update(region):
    """verl (PR #6507) passes global_steps to send_weights and
    receive_weights: it reaches the receiver, which refuses an update that
    was sent for another step."""
    sender, receiver = _pair(region)
    weights = [(f"w{i}", torch.full((4096,), float(i))) for i in range(6)]  # 96 KB: two buckets
    try:
        res, got = _update(sender, receiver, weights, 7, 7)
        assert res == [None, None]
        assert [n for n, _ in got] == [n for n, _ in weights]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, weights))
        assert receiver.last_receive["global_steps"] == 7 and receiver.last_receive["syncs"] == 3
        # an older verl passes no step: nothing to check, nothing carried
        res, got = _update(sender, receiver, weights, None, None)
        assert res == [None, None] and len(got) == len(weights)
        assert receiver.last_receive["global_steps"] is None
        # a receiver asked for step 9 refuses the update sent for step 8, and leaves (never blocks the trainer)
        res, got = _update(sender, receiver, weights, 8, 9)
        assert isinstance(res[1], shmcast.Corrupt) and "global step 8" in str(res[1]) and got == []
    finally:
        receiver.close()
        sender.close()
