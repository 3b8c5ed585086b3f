"""What the test processes run, plus the deterministic tensor sets both sides
rebuild from a seed (so results cross process boundaries as plain data, never
as tensors).

Children are forked from a forkserver that has imported torch, shmcast and
this module (conftest.mp_context(); CUDA tests use spawn) and call run(),
which puts a plain dict on the result queue.
"""
from __future__ import annotations

import importlib
import os
import time
import traceback

import torch

import shmcast

SLOT = 2 << 20  # small slots so modest tensors span several of them

# ---------------------------------------------------------------- tensor sets


def _rand(g: torch.Generator, dtype: torch.dtype, shape) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    if dtype == torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=g, dtype=torch.uint8).to(torch.bool)
    es = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * es,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(tuple(shape))


def dtype_set(g) -> list:
    return [(f"dtype.{shmcast.dtype_name(dt)}", _rand(g, dt, (7, 33))) for dt in shmcast.supported_dtypes()]


def shape_set(g) -> list:
    return [
        ("shape.scalar", _rand(g, torch.float32, ())),
        ("shape.scalar_bool", torch.tensor(True)),
        ("shape.zero_rows", _rand(g, torch.float16, (0, 3))),
        ("shape.zero_cols", _rand(g, torch.int32, (5, 0))),
        ("shape.one", _rand(g, torch.int64, (1,))),
        ("shape.3d", _rand(g, torch.bfloat16, (4, 5, 6))),
        ("shape.8d", _rand(g, torch.int8, (2, 1, 2, 1, 2, 1, 2, 3))),
        ("shape.multi_slot", _rand(g, torch.float32, (5 * SLOT // 4 + 17,))),  # ~5 slots, odd tail
        ("shape.exact_slot", _rand(g, torch.uint8, (SLOT,))),
        ("shape.after_big", _rand(g, torch.bfloat16, (3, 1000))),
    ]


def noncontig_set(g) -> list:
    """Non-contiguous views: the producer sends them as they are; the
    consumer expects their contiguous values."""
    m = _rand(g, torch.float32, (64, 96))
    big = _rand(g, torch.bfloat16, (1024, 1536))  # 3 MiB: a strided tensor across slots
    cube = _rand(g, torch.int16, (6, 7, 8))
    z = _rand(g, torch.float32, (16, 8)).to(torch.complex64) + 1j
    return [
        ("nc.transposed", m.t()),                       # general: staged copy
        ("nc.col_slice", m[:, 16:80]),                  # row-pitched (Strided2D)
        ("nc.row_step", m[::2]),                        # row-pitched, pitch = 2 rows
        ("nc.big_col_slice", big[:, 100:1300]),         # row-pitched, spans slots
        ("nc.permuted", cube.permute(2, 0, 1)),         # general
        ("nc.sliced_3d", cube[:, 1:6, :]),              # outer dims collapse: row-pitched
        ("nc.expanded", torch.arange(8, dtype=torch.float64).expand(5, 8)),  # stride 0: general
        ("nc.narrow_rows", m[:, :4]),                   # rows of 16 B: staged, not strided
        ("nc.conj", z.conj()),                          # conjugate bit: resolved
    ]


SETS = {"dtypes": dtype_set, "shapes": shape_set, "noncontig": noncontig_set}


def build(seed: int, sets=("dtypes", "shapes", "noncontig"), device: str = "cpu") -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in sets:
        out += SETS[s](g)
    if device != "cpu":
        out = [(n, _to_device_keep_layout(t, device)) for n, t in out]
    return out


def _to_device_keep_layout(t: torch.Tensor, device: str) -> torch.Tensor:
    """Moves `t` to `device`, keeping its strides (transposed, sliced,
    expanded...) so the device path sees non-contiguous tensors too."""
    if t.is_contiguous() or t.is_conj() or t.numel() == 0:
        return t.to(device)
    zero = [d for d, st in enumerate(t.stride()) if st == 0 and t.shape[d] > 1]
    if zero:  # broadcast dims: move the un-broadcast tensor, expand again
        small = t
        for d in zero:
            small = small.narrow(d, 0, 1)
        return _to_device_keep_layout(small, device).expand(t.shape)
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    buf = torch.zeros(t.storage_offset() + span, dtype=t.dtype, device=device)
    view = buf.as_strided(t.shape, t.stride(), t.storage_offset())
    view.copy_(t)
    return view


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu()
    if t.is_conj():
        t = t.resolve_conj()
    return t.contiguous().reshape(-1).view(torch.uint8)


def compare(got: list, want: list) -> list:
    """Bit-exact comparison of two [(name, tensor)] lists; returns problems."""
    problems = []
    if [n for n, _ in got] != [n for n, _ in want]:
        return [f"names differ: {[n for n, _ in got][:5]} vs {[n for n, _ in want][:5]}"]
    for (n, a), (_, b) in zip(got, want):
        if a.dtype != b.dtype:
            problems.append(f"{n}: dtype {a.dtype} != {b.dtype}")
        elif tuple(a.shape) != tuple(b.shape):
            problems.append(f"{n}: shape {tuple(a.shape)} != {tuple(b.shape)}")
        elif not torch.equal(as_bytes(a), as_bytes(b)):
            problems.append(f"{n}: bytes differ")
    return problems


# ---------------------------------------------------------------- roles


def run(role: str, kwargs: dict, q) -> None:
    """Entry point of a test process: runs role(**kwargs), puts its dict
    (or the error) on q."""
    try:
        env = kwargs.pop("env", None) or {}
        os.environ.update(env)
        if ":" in role:  # "module:name": role_name of another module (framework_roles, vllm_roles, ...)
            mod, _, role = role.partition(":")
            fn = getattr(importlib.import_module(mod), "role_" + role)
        else:
            fn = globals()["role_" + role]
        res = fn(q=q, **kwargs)
        q.put({"ok": True, **(res or {})})
    except BaseException as e:  # report everything, including shmcast errors by class name
        q.put({"ok": False, "error": type(e).__name__, "message": str(e), "trace": traceback.format_exc()})


def role_consumer(q, region, seed, sets, n_syncs=1, device="cpu", mode="copy", timeout=30.0, want_device=None):
    problems, versions, devices = [], [], set()
    with shmcast.Consumer(region, device=device, mode=mode, open_timeout=timeout) as c:
        q.put({"ready": True, "seat": c.seat})
        for k in range(n_syncs):
            got = c.receive(timeout=timeout)
            versions.append(c.last_version)
            devices |= {str(t.device) for _, t in got}
            problems += compare(got, build(seed + k, sets))
            del got
    return {"problems": problems, "versions": versions, "devices": sorted(devices)}


def destinations(seed, sets, device="cpu", noncontig_dst=False):
    """Preallocated destinations matching build(seed, sets), filled with junk;
    with noncontig_dst, 2-D ones are transposed views of a buffer."""
    out = {}
    for n, t in build(seed, sets):
        if noncontig_dst and t.dim() == 2 and t.shape[0] > 1 and t.shape[1] > 1:
            d = torch.empty(t.shape[1], t.shape[0], dtype=t.dtype, device=device).t()
        else:
            d = torch.empty(t.shape, dtype=t.dtype, device=device)
        if d.numel():
            as_junk = d.view(torch.uint8) if d.is_contiguous() and d.dim() > 0 and d.dtype != torch.bool else None
            if as_junk is not None:
                as_junk.fill_(0xA5)
        out[n] = d
    return out


def role_consumer_into(q, region, seed, sets, device="cpu", noncontig_dst=False, timeout=30.0):
    with shmcast.Consumer(region, device=device, open_timeout=timeout) as c:
        dst = destinations(seed, sets, device, noncontig_dst)
        q.put({"ready": True})
        version = c.receive_into(dst, timeout=timeout)
        problems = compare(list(dst.items()), build(seed, sets))
    return {"problems": problems, "version": version}


def role_producer(q, region, seed, sets, n_syncs=1, consumers=1, device="cpu", hold=0.0, timeout=30.0, **opts):
    versions = []
    with shmcast.Producer(region, slot_bytes=SLOT, max_consumers=4, **opts) as p:
        q.put({"ready": True, "path": p.path})
        p.wait_for_consumers(consumers, timeout)
        for k in range(n_syncs):
            versions.append(p.send(build(seed + k, sets, device)))
        if hold:
            time.sleep(hold)
        p.wait_drained(timeout)
    return {"versions": versions}


def role_producer_idle(q, region, seconds=60.0):
    """Creates the region and sleeps (to be killed: PeerDied)."""
    p = shmcast.Producer(region, slot_bytes=SLOT, max_consumers=2)
    q.put({"ready": True})
    time.sleep(seconds)
    p.close()


def role_vllm_worker(q, region, device="cpu", n_updates=1, timeout=30.0, seed=0, tp_rank=0, tp_size=1):
    """A stand-in vLLM worker (see fake_vllm.py) receiving weight updates,
    as TP rank tp_rank of tp_size."""
    import fake_vllm
    from vllm.distributed import _set_tp

    _set_tp(tp_rank, tp_size)  # this process is one TP worker
    worker = fake_vllm.FakeWorker(device=device)
    worker.init_shmcast(region, timeout)
    q.put({"ready": True})
    results = []
    for k in range(n_updates):
        version = worker.update_weights_from_shmcast(region, timeout=timeout)
        hf = fake_vllm.hf_state_dict(seed + k)
        results.append({"version": version, "stats": worker.shmcast_stats(),
                        "problems": fake_vllm.check_loaded(worker.model_runner.model, hf, tp_rank, tp_size)})
    worker.close_shmcast()
    return {"updates": results}


def role_roll_receiver(q, region, device="cpu", n_tickets=1, timeout=30.0, seeds=()):
    import shmcast.roll as roll

    roll.attach(region, device=device, timeout=timeout)
    q.put({"ready": True})
    problems = []
    for k in range(n_tickets):
        ticket = q_get(q, "ticket")
        named = roll.named_tensors_from_ticket(ticket, timeout=timeout)
        problems += compare(named, build(seeds[k], ("dtypes", "shapes")))
    roll.close(region)
    return {"problems": problems}


# Tickets reach the receiver through a second queue handed over in kwargs;
# q_get reads it (set by role_roll_receiver's caller).
_inbox = None


def q_get(_q, what):
    return _inbox.get(timeout=60)


def run_with_inbox(role: str, kwargs: dict, q, inbox) -> None:
    global _inbox
    _inbox = inbox
    run(role, kwargs, q)


# ---------------------------------------------------------------- sharded syncs


def sharded_model(seed: int) -> list:
    """(name, full tensor, how it is split): ('shard', dim) over the ranks
    (torch.chunk's split: uneven, empty pieces when ranks outnumber rows),
    ('own', rank) sent whole by one rank, ('shard_t', dim): a shard whose
    local tensor is a non-contiguous view."""
    g = torch.Generator().manual_seed(seed)
    return [
        ("embed", _rand(g, torch.bfloat16, (37, 24)), ("shard", 0)),
        ("o_proj", _rand(g, torch.float32, (16, 50)), ("shard", 1)),
        ("moe", _rand(g, torch.float16, (3, 10, 7)), ("shard", 1)),
        ("norm", _rand(g, torch.float32, (24,)), ("own", 0)),
        ("bias", _rand(g, torch.int32, (9,)), ("own", -1)),
        ("big", _rand(g, torch.float32, (700, 1024)), ("shard", 0)),  # several slots per rank
        ("tiny", _rand(g, torch.float32, (2, 3)), ("shard", 0)),
        ("wt", _rand(g, torch.float32, (40, 30)), ("shard_t", 1)),
    ]


def sharded_items(seed: int, rank: int, world: int, device: str = "cpu") -> list:
    out = []
    for name, t, (how, arg) in sharded_model(seed):
        t = t.to(device)
        if how == "own":
            if arg % world == rank:
                out.append((name, t.clone()))
            continue
        pieces = torch.chunk(torch.arange(t.shape[arg]), world)
        start = sum(len(p) for p in pieces[:rank]) if rank < len(pieces) else t.shape[arg]
        length = len(pieces[rank]) if rank < len(pieces) else 0
        local = t.narrow(arg, start, length).clone()
        if how == "shard_t":  # the same values, held transposed
            local = local.t().contiguous().t()
            assert not local.is_contiguous() or local.numel() <= 1 or 1 in local.shape
        out.append((name, shmcast.Shard(local, tuple(t.shape), arg, start)))
    return out


def tp_slice(t: torch.Tensor, how, part: int, parts: int = 2):
    """The slice a TP worker reads: along the other dim than the shards."""
    if t.dim() == 0:
        return None
    dim = 1 if (how[0] != "own" and how[1] == 0 and t.dim() > 1) else 0
    n = t.shape[dim]
    c = -(-n // parts)
    start = min(n, c * part)
    return (dim, start, min(n, start + c) - start)


def role_sharded_rank(q, region, rank, world, seed, n_syncs=2, consumers=0, timeout=30.0, skip_send=False,
                      device="cpu"):
    versions = []
    with shmcast.Producer(region, rank=rank, world_size=world, slot_bytes=SLOT, slots=2 * world, max_consumers=4,
                          pin=False, rank_timeout=timeout) as p:
        q.put({"ready": True})
        if rank == 0 and consumers:
            p.wait_for_consumers(consumers, timeout)
        if skip_send:
            # Attached, never sending, until the test says it is done (its
            # inbox), or for `timeout` without one.
            if _inbox is not None:
                _inbox.get(timeout=timeout)
            else:
                time.sleep(timeout)
            return {"versions": versions}
        for k in range(n_syncs):
            versions.append(p.send(sharded_items(seed + k, rank, world, device)))
        if rank == 0:
            p.wait_drained(timeout)
    return {"versions": versions}


def role_sharded_consumer(q, region, seed, kind, part=0, n_syncs=2, timeout=30.0, device="cpu"):
    problems = []
    devices = set()
    with shmcast.Consumer(region, device, open_timeout=timeout) as c:
        q.put({"ready": True})
        for k in range(n_syncs):
            model = sharded_model(seed + k)
            full = {n: t for n, t, _ in model}
            if kind == "full":
                got = c.receive(timeout=timeout)
                want = [(n, full[n]) for n, _ in got]
                if sorted(n for n, _ in got) != sorted(full):
                    problems.append(f"names {sorted(n for n, _ in got)}")
            elif kind == "names":
                pick = ["o_proj", "bias", "big"]
                got = c.receive(timeout=timeout, names=pick)
                want = [(n, full[n]) for n in pick]
                got = sorted(got, key=lambda x: pick.index(x[0]))
            else:
                sl = {n: tp_slice(t, how, part) for n, t, how in model if tp_slice(t, how, part) is not None}
                want = [(n, full[n].narrow(*sl[n]) if n in sl else full[n]) for n, _, _ in model]
                if kind == "slice":
                    got = dict(c.receive(timeout=timeout, slices=sl))
                    got = [(n, got[n]) for n, _ in want]
                else:  # into: preallocated destinations of the slices' shapes
                    dst = {n: torch.full_like(w.contiguous(), 7, device=device) for n, w in want}
                    c.receive_into(dst, timeout=timeout, slices=sl)
                    got = [(n, dst[n]) for n, _ in want]
            devices |= {str(t.device) for _, t in got}
            problems += compare(got, want)
    return {"problems": problems, "devices": sorted(devices)}


def role_sharded_steps(q, region, rank, world, seed, n_steps=7, fault=None, fault_rank=1, fault_step=2,
                       named=False, consumers=2, timeout=30.0):
    """A trainer rank that sends one sync per step (the step's tensors:
    sharded_model(seed + step)); at `fault_step` rank `fault_rank` fails:
    'sparse': its batch holds a sparse tensor, which Producer.send() refuses
    (TypeError) before shmcast begins the sync; 'shard': a shmcast.Shard(...)
    in its own code raises (ValueError) and it never calls send() for that
    step. The rank goes on with the next step either way. Returns, per step,
    ['ok', version] or [error class, message]."""
    results = {}
    with shmcast.Producer(region, rank=rank, world_size=world, slot_bytes=SLOT, slots=2 * world, max_consumers=4,
                          pin=False, rank_timeout=timeout) as p:
        q.put({"ready": True})
        if rank == 0 and consumers:
            p.wait_for_consumers(consumers, timeout)
        for step in range(1, n_steps + 1):
            try:
                items = sharded_items(seed + step, rank, world)
                if rank == fault_rank and step == fault_step:
                    if fault == "sparse":
                        items.append(("bad", torch.zeros(4, 4).to_sparse()))
                    elif fault == "shard":
                        items.append(("bad", shmcast.Shard(torch.zeros(3, 4), (4, 4), 0, 2)))  # raises ValueError
                if named == "numpy_gaps":  # numpy integers, 10 apart (versions with gaps)
                    import numpy as np
                    results[step] = ["ok", p.send(items, version=np.int64(10 * step))]
                else:
                    results[step] = ["ok", p.send(items, version=step) if named else p.send(items)]
            except Exception as e:  # the trainer logs it and goes on with the next step
                results[step] = [type(e).__name__, str(e)]
        if rank == 0:
            p.wait_drained(timeout)
    return {"results": results}


def role_sharded_checker(q, region, seed, until, timeout=30.0, scale=1):
    """Receives syncs until version `until`; checks every version it gets,
    every byte, against that step's tensors (a version mixing two steps
    fails); aborted syncs are skipped."""
    versions, problems = [], []
    with shmcast.Consumer(region, open_timeout=timeout) as c:
        q.put({"ready": True})
        while not versions or versions[-1] < until:
            try:
                got = c.receive(timeout=timeout)
            except shmcast.Aborted:
                continue
            except shmcast.Closed:
                break  # the trainer is done: report what arrived
            v = c.last_version
            versions.append(v)
            full = {n: t for n, t, _ in sharded_model(seed + v // scale)}
            if sorted(n for n, _ in got) != sorted(full):
                problems.append(f"version {v}: names {sorted(n for n, _ in got)}")
                continue
            problems += [f"version {v}: {p}" for p in compare(got, [(n, full[n]) for n, _ in got])]
    return {"versions": versions, "problems": problems}


# ---------------------------------------------------------------- FSDP2 (2 GPUs)


def fsdp_model(dev):
    """A small model with uneven FSDP2 shards (3 and 5 rows on 2 ranks), its
    weights set from a seed (the same on every process)."""
    torch.manual_seed(5)
    m = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.LayerNorm(96), torch.nn.Linear(96, 3),
                            torch.nn.Linear(3, 5)).to(dev)
    g = torch.Generator(device="cpu").manual_seed(11)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g).to(dev))
    return m


def role_fsdp_rank(q, region, rank, store, n_syncs=2, timeout=60.0):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        m = fsdp_model(dev)
        for layer in m:
            fully_shard(layer)
        fully_shard(m)
        kinds = sorted({type(p).__name__ for p in m.parameters()})
        with shmcast.Producer(region, rank=rank, world_size=2, slot_bytes=SLOT, slots=4, max_consumers=2,
                              rank_timeout=timeout) as p:
            q.put({"ready": True})
            if rank == 0:
                p.wait_for_consumers(2, timeout)
            versions = []
            for k in range(n_syncs):
                with torch.no_grad():
                    for prm in m.parameters():
                        prm.add_(1)  # a training step: DTensor in-place op, each rank changes its own shard
                versions.append(p.send(m.named_parameters()))
            if rank == 0:
                p.wait_drained(timeout)
        return {"versions": versions, "kinds": kinds}
    finally:
        dist.destroy_process_group()


def role_fsdp_consumer(q, region, gpu, n_syncs=2, timeout=60.0):
    dev = torch.device("cuda", gpu)
    want = dict(fsdp_model(dev).named_parameters())
    problems = []
    stepped = {n: p.detach().clone() for n, p in want.items()}
    with shmcast.Consumer(region, device=str(dev), open_timeout=timeout) as c:
        q.put({"ready": True})
        for k in range(n_syncs):
            for t in stepped.values():
                t.add_(1)  # the trainer's step, the same fp32 adds in the same order
            if gpu == 0:
                got = c.receive(timeout=timeout)
                exp = [(n, stepped[n]) for n, _ in got]
            else:  # a TP-style reader: half of each matrix along dim 1, vectors whole
                info = c.wait_sync(timeout)
                sl = {t[0]: (1, 0, t[2][1] // 2) for t in info.tensors if len(t[2]) == 2}
                got = c.read(slices=sl)
                exp = [(n, stepped[n].narrow(*sl[n]) if n in sl else stepped[n]) for n, _ in got]
            if len(got) != len(want):
                problems.append(f"{len(got)} tensors, expected {len(want)}")
            bad = compare(got, exp)
            if bad:  # say how they differ: from the initial weights, and from what was expected
                e = dict(exp)
                for n, t in got:
                    base = want[n].detach()
                    if n in e and not torch.equal(t, e[n]) and t.shape == e[n].shape:
                        base = base.narrow(*sl[n]) if gpu != 0 and n in sl else base
                        bad.append(f"{n} sync {k}: got - initial in [{float((t - base).min())}, "
                                   f"{float((t - base).max())}], got - expected max {float((t - e[n]).abs().max())}")
            problems += bad
    return {"problems": problems}


def role_store_reader(q, region, seed_of_version, hold=False, timeout=30.0):
    """A worker of a store region: opens it and takes the newest version at
    once, as its own tensors (receive), or with hold=True as zero-copy views
    that it keeps until it is killed (a crash while holding). Reports the
    version, how long it took and whether the bytes are what the producer
    stored for it (build(seed_of_version + version))."""
    with shmcast.Consumer(region, open_timeout=timeout) as c:
        t0 = time.monotonic()
        if hold:
            view = c.hold(timeout=timeout)
            got, v = list(view), view.version
        else:
            got = c.receive(timeout=timeout)
            v = c.last_version
        took = time.monotonic() - t0
        res = {"version": v, "problems": compare(got, build(seed_of_version + v, ("dtypes", "shapes"))),
               "seconds": took}
        if hold:
            q.put({"ready": True, **res})
            time.sleep(3600)
        return res


def many_tensors(count: int, version: int) -> dict:
    """`count` u8 tensors of 1..16 bytes named like an MoE checkpoint's
    experts, views of one buffer filled from (count, version)."""
    sizes = [1 + j % 16 for j in range(count)]
    g = torch.Generator().manual_seed(count * 1000 + version)
    flat = torch.randint(0, 256, (sum(sizes),), dtype=torch.uint8, generator=g)
    names = [f"model.layers.{j // 384}.mlp.experts.{j // 3 % 128}.w{j % 3}.weight" for j in range(count)]
    return dict(zip(names, torch.split(flat, sizes)))


def role_many_consumer(q, region, count, timeout=60.0):
    """Receives two syncs of many_tensors(count, v): the first with
    receive_into(), the second with receive(); checks every byte."""
    problems = []
    with shmcast.Consumer(region, pin=False, open_timeout=timeout) as c:
        q.put({"ready": True})
        want = many_tensors(count, 1)
        flat = torch.full((sum(t.numel() for t in want.values()),), 0xA5, dtype=torch.uint8)
        dst = dict(zip(want, torch.split(flat, [t.numel() for t in want.values()])))
        if c.receive_into(dst, timeout=timeout) != 1:
            problems.append("receive_into: not version 1")
        if not torch.equal(flat, torch.cat(list(want.values()))):
            problems.append("receive_into: bytes differ")
        got = c.receive(timeout=timeout)
        want = many_tensors(count, 2)
        names = [n for n, _ in got] if isinstance(got, list) else list(got)
        tensors = [t for _, t in got] if isinstance(got, list) else list(got.values())
        if names != list(want):
            problems.append("receive: names differ")
        elif not torch.equal(torch.cat(tensors), torch.cat(list(want.values()))):
            problems.append("receive: bytes differ")
    return {"problems": problems}
