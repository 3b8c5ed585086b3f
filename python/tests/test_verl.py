"""verl checkpoint engine with the `shmcast` backend (shmcast.verl), against
the verl stand-in (standins/verl: CheckpointEngineRegistry, CheckpointEngine
and the CheckpointEngineManager's call order of volcengine/verl @ b178a3cd).

Trainer ranks and rollout checkpoint-engine workers are real processes that
build their engines as verl does (registry, is_master on trainer rank 0,
bucket_size, engine_kwargs) after `import verl` loaded shmcast.verl through
$VERL_USE_EXTERNAL_MODULES; the stand-in manager drives prepare /
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

    def update_weights(self):
        body = {} if self.seed is None else {"seed": self.seed}
        return self._each("update_weights", [body] * self.world_size)


class Replica:
    def __init__(self, group):
        self.workers, self.calls = group, []

    async def abort_all_requests(self):
        self.calls.append("abort_all_requests")

    async def resume_all_requests(self):
        self.calls.append("resume_all_requests")

    async def sleep(self):
        self.calls.append("sleep")


STEP = ["prepare", "init_process_group", "update_weights", "finalize"]


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_contract(procs, tmp_path, region, placement, monkeypatch):
    # the driver too imports verl with $VERL_USE_EXTERNAL_MODULES set (the manager looks the backend up)
    monkeypatch.setenv("VERL_USE_EXTERNAL_MODULES", "shmcast.verl")
    import shmcast.verl  # noqa: F401  (what `import verl` does with that variable, in an already-imported verl)
    from verl.checkpoint_engine import CheckpointEngineManager

    n = 2
    tdev, rdev = devices(placement, n)
    env = {"VERL_USE_EXTERNAL_MODULES": "shmcast.verl"}
    kwargs = {"region": region, "slot_bytes": 2 << 20, "slots": 4, "timeout": 60.0}
    t_addr = [str(tmp_path / f"t{i}.sock") for i in range(n)]
    r_addr = [str(tmp_path / f"r{i}.sock") for i in range(n)]
    trainers, rollouts = [None] * n, [None] * n

    def start_trainer(i):
        trainers[i] = procs.start("verl_roles:trainer_rank", address=t_addr[i], rank=i, cfg=CFG, bucket_size=BUCKET,
                                  engine_kwargs=kwargs, device=tdev[i], env=env)
        assert procs.ready(trainers[i])["engine"] == "ShmcastCheckpointEngine"

    def start_rollout(i):
        rollouts[i] = procs.start("verl_roles:rollout_worker", address=r_addr[i], cfg=CFG, bucket_size=BUCKET,
                                  engine_kwargs=kwargs, device=rdev[i], env=env)
        assert procs.ready(rollouts[i])["engine"] == "ShmcastCheckpointEngine"

    trainer = WorkerGroup(t_addr)
    replicas = [Replica(WorkerGroup([a])) for a in r_addr]  # two replicas of one worker each
    manager = CheckpointEngineManager("shmcast", trainer, replicas)

    def step(seed):
        trainer.seed = seed
        manager.calls.clear()
        manager.update_weights()
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
        for r in replicas:
            assert r.calls == ["abort_all_requests", "resume_all_requests"] * 2
        manager.sleep_replicas()  # verl sleeps replicas around updates only for 'naive'
        assert all("sleep" not in r.calls for r in replicas)

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
