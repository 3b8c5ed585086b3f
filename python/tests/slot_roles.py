"""Device slots (Producer(slot_memory="device")): a model whose versions both
sides rebuild from a seed, and the consumer processes of
test_device_slots.py.

The model is bf16 and fp32 tensors: one spans two 2 MiB slots with an odd
tail, two are 2-D (received into transposed destinations by the 'into'
consumers), one is a scalar.
"""
from __future__ import annotations

import torch

import roles
import shmcast

SPECS = [
    ("bf16.big", torch.bfloat16, (1024, 1100)),  # 2.2 MB: across two 2 MiB slots
    ("bf16.2d", torch.bfloat16, (96, 257)),
    ("fp32.2d", torch.float32, (128, 130)),
    ("fp32.vec", torch.float32, (3 * roles.SLOT // 16 + 17,)),
    ("fp32.scalar", torch.float32, ()),
]


def logical_bytes() -> int:
    return sum(torch.empty((), dtype=dt).element_size() * torch.Size(shape).numel() for _n, dt, shape in SPECS)


def version(seed: int, k: int, device: str = "cpu") -> list:
    """Version k of the model: [(name, tensor)], every element new random
    bits (NaNs and infinities included: compared as raw bytes)."""
    g = torch.Generator().manual_seed(seed * 1000 + k)
    out = [(name, roles._rand(g, dt, shape)) for name, dt, shape in SPECS]
    if device != "cpu":
        out = [(n, t.to(device)) for n, t in out]
    return out


def destinations(device: str, transposed: bool = True) -> dict:
    """receive_into destinations on `device`, filled with junk; with
    `transposed` the 2-D ones are transposed views (non-contiguous)."""
    out = {}
    for name, dt, shape in SPECS:
        if transposed and name.endswith(".2d"):
            d = torch.empty(shape[::-1], dtype=dt, device=device).t()
        else:
            d = torch.empty(shape, dtype=dt, device=device)
        if d.dim() and d.is_contiguous():
            d.view(torch.uint8).fill_(0xA5)
        else:
            d.fill_(-7)
        out[name] = d
    return out


def role_consumer(q, region, seed, n_versions, device="cuda:0", how="into", timeout=60.0):
    """Receives n_versions syncs and checks each bit for bit against
    version(seed, k). how:
      'into'    receive_into the same destinations on `device` every time
                (the 2-D ones transposed views)
      'mixed'   receive_into CUDA destinations and CPU ones together
      'copy'    receive() fresh tensors (earlier versions' must not change)
      'staging' receive() staging views
    """
    mode = "staging" if how == "staging" else "copy"
    results = []
    with shmcast.Consumer(region, device=device, mode=mode, open_timeout=timeout) as c:
        if how == "into":
            dst = destinations(device)
        elif how == "mixed":
            dst = destinations("cuda:0")
            for name in ("bf16.2d", "fp32.scalar"):
                dst[name] = dst[name].cpu()
        else:
            dst = None
        q.put({"ready": True, "slot_memory": c.slot_memory})
        kept = []
        for k in range(n_versions):
            want = version(seed, k)
            if dst is not None:
                v = c.receive_into(dst, timeout=timeout)
                got = [(n, dst[n]) for n, _ in want]
                devices = sorted({str(t.device) for t in dst.values()})
            else:
                got = c.receive(timeout=timeout)
                v = c.last_version
                devices = sorted({str(t.device) for _, t in got})
            res = {"version": v, "devices": devices, "last_sync": c.last_sync, "problems": roles.compare(got, want)}
            if how == "copy":
                kept.append((got, want))
                if len(kept) > 2:
                    kept.pop(0)
                old, old_want = kept[0]
                res["problems"] += [f"an earlier version's tensors changed: {p}" for p in roles.compare(old, old_want)]
            results.append(res)
            del got
    return {"results": results}


def role_open(q, region, device="cpu", timeout=60.0):
    """Opens the region (env may hide the GPU) and reports what happened:
    {'error': class name or None, 'message'}."""
    try:
        c = shmcast.Consumer(region, device=device, open_timeout=timeout)
    except shmcast.Error as e:
        return {"error": type(e).__name__, "message": str(e)}
    with c:
        return {"error": None, "message": "", "slot_memory": c.slot_memory}


def role_die_mid_sync(q, region):
    """A trainer with device slots (2 x 2 MiB) that announces a sync of
    three slot-sized fp32 tensors, writes the first from the GPU and is
    SIGKILLed before the others: the consumer must get an error
    (PeerDied), never a hang or a partial model."""
    import os
    import signal
    n = roles.SLOT // 4
    with shmcast.Producer(region, slot_bytes=roles.SLOT, slots=2, slot_memory="device") as prod:
        q.put({"ready": True})
        prod.wait_for_consumers(1, 60)
        srcs = [torch.full((n,), float(i + 1), device="cuda:0") for i in range(3)]
        torch.cuda.synchronize()
        raw = prod.raw
        raw.begin_sync([(f"t{i}", "f32", (n,)) for i in range(3)])
        raw.write_device(0, srcs[0].data_ptr(), torch.cuda.current_stream().cuda_stream)
        os.kill(os.getpid(), signal.SIGKILL)
