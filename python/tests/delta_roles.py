"""Delta syncs (Producer(delta=True)): a model whose versions both sides
rebuild from a seed, and the consumer processes of test_delta.py.

Version k+1 of the model is version k with a fraction of each tensor's
elements given new random bits (0.5 % to 30 %, a fraction per version),
so consecutive versions differ the way RL steps do (sparse, spread out), and
a consumer checks every version bit for bit against its own rebuild.
"""
from __future__ import annotations

import torch

import roles
import shmcast

# dtype, shape: bf16, fp32, fp16 and uint8 (element words of 2, 4, 2 and 1
# bytes); "bf16.big" spans two 2 MiB slots; "*.2d" tensors are received into
# transposed (non-contiguous) destinations by the receive_into consumer.
SPECS = [
    ("bf16.big", torch.bfloat16, (1024, 1100)),
    ("bf16.2d", torch.bfloat16, (96, 257)),
    ("fp32.2d", torch.float32, (128, 130)),
    ("fp16.vec", torch.float16, (3 * 4096 + 17,)),
    ("u8.vec", torch.uint8, (50_000,)),
]

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of their width (raw bits)."""
    return t.view(_INT[t.element_size()])


def fractions(seed: int, n: int) -> list:
    """The fraction of elements changed in version k + 1 (k < n - 1): 0.5 %
    to 30 %, the first ones small (where deltas pay most)."""
    g = torch.Generator().manual_seed(seed * 7919 + 1)
    out = [0.005, 0.02]
    while len(out) < n - 1:
        out.append(0.005 + float(torch.rand((), generator=g)) * 0.295)
    return out[: max(0, n - 1)]


def versions(seed: int, n: int):
    """Yields the model's versions 0..n-1: [(name, tensor)], each a fresh
    copy (a version may be kept while the next is built)."""
    g = torch.Generator().manual_seed(seed)
    model = [(name, roles._rand(g, dt, shape)) for name, dt, shape in SPECS]
    fr = fractions(seed, n)
    for k in range(n):
        if k > 0:
            for _name, t in model:
                w = words(t).reshape(-1)
                m = max(1, int(fr[k - 1] * w.numel()))
                pos = torch.randperm(w.numel(), generator=g)[:m]
                new = roles._rand(g, t.dtype, (m,))
                w[pos] = words(new)
        yield [(name, t.clone()) for name, t in model]


def logical_bytes() -> int:
    return sum(torch.empty((), dtype=dt).element_size() * torch.Size(shape).numel() for _n, dt, shape in SPECS)


def destinations(noncontig: bool = True) -> dict:
    """receive_into destinations, filled with junk; with noncontig the 2-D
    ones are transposed views (they go through kept temporaries)."""
    out = {}
    for name, dt, shape in SPECS:
        if noncontig and name.endswith(".2d"):
            d = torch.empty(shape[::-1], dtype=dt).t()
        else:
            d = torch.empty(shape, dtype=dt)
        words(d).fill_(0x5A)
        out[name] = d
    return out


def compare(got: list, want: list) -> list:
    """Bit-exact, by raw words; a problem names the tensor and how many
    elements differ."""
    problems = roles.compare(got, want)
    if problems:
        for (n, a), (_, b) in zip(got, want):
            if a.dtype == b.dtype and a.shape == b.shape:
                bad = int((words(a.contiguous()) != words(b)).sum())
                if bad:
                    problems.append(f"{n}: {bad} of {b.numel()} elements differ")
    return problems


def role_consumer(q, region, seed, n_versions, how="into", timeout=60.0):
    """Receives n_versions syncs and checks each against versions(seed):
    how = 'into' (receive_into the same destinations every time, some of them
    non-contiguous), 'copy' or 'staging' (receive())."""
    mode = "staging" if how == "staging" else "copy"
    results = []
    with shmcast.Consumer(region, mode=mode, open_timeout=timeout) as c:
        dst = destinations() if how == "into" else None
        q.put({"ready": True, "delta": c.delta})
        kept = []  # 'copy': earlier versions' tensors must stay as they were
        for want in versions(seed, n_versions):
            if how == "into":
                v = c.receive_into(dst, timeout=timeout)
                got = [(n, dst[n]) for n, _ in want]
            else:
                got = c.receive(timeout=timeout)
                v = c.last_version
            info = c.sync_info
            res = {"version": v, "last_sync": c.last_sync, "delta": info.delta, "base": info.base_version,
                   "problems": compare(got, want)}
            if how == "copy":
                kept.append((got, want))
                if len(kept) > 2:
                    kept.pop(0)
                old, old_want = kept[0]
                res["problems"] += [f"an earlier version's tensors changed: {p}" for p in compare(old, old_want)]
            results.append(res)
            del got
    return {"results": results}
