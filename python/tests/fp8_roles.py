"""Quantize-on-send tests (test_fp8.py): the torch reference of the block-FP8
format and the consumer process.

per_block_cast_to_fp8 is DeepGEMM's formula (deepseek-ai/DeepGEMM,
deep_gemm/utils/math.py at 38939a4c494ce6e904b54da94a1183955a5e9497; the
non-UE8M0 multiplier in the 448.0 / amax form of issue 44, which vLLM's and
SGLang's test utilities use) written in torch ops, on CPU tensors. Where
this torch has float8_e4m3fn the conversion is torch's own; an older torch
(Debian's 1.13 here) gets a nearest-even search over the 127 finite values,
with c10's NaN code above 464.
"""
import math

import torch

from shmcast import _shmcast as _C

HAS_FP8 = isinstance(getattr(torch, "float8_e4m3fn", None), torch.dtype)
_VALUES = torch.tensor([(m / 512.0 if e == 0 else (1 + m / 8.0) * 2.0 ** (e - 7))
                        for e in range(16) for m in range(8)][:127], dtype=torch.float64)


def to_e4m3_codes(p: torch.Tensor) -> torch.Tensor:
    """float32 -> e4m3fn codes (uint8), as torch converts."""
    if HAS_FP8:
        return p.to(torch.float8_e4m3fn).view(torch.uint8)
    a = p.abs().double()
    hi = torch.bucketize(a, _VALUES).clamp(max=126)
    lo = (hi - 1).clamp(min=0)
    du, dd = _VALUES[hi] - a, a - _VALUES[lo]
    code = torch.where(du < dd, hi, torch.where(dd < du, lo, torch.where(hi % 2 == 0, hi, lo)))
    code = torch.where((a > 464) | torch.isnan(p), torch.full_like(code, 127), code)
    return (code | (torch.signbit(p).long() << 7)).to(torch.uint8)


def per_block_cast_to_fp8(x: torch.Tensor, ue8m0: bool):
    """(codes uint8 [m, n], scale_inv float32 [ceil(m/128), ceil(n/128)])."""
    m, n = x.shape
    xp = torch.zeros((math.ceil(m / 128) * 128, math.ceil(n / 128) * 128), dtype=x.dtype)
    xp[:m, :n] = x
    xv = xp.view(-1, 128, xp.size(1) // 128, 128)
    amax = xv.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    if ue8m0:
        sf = amax / 448.0
        bits = sf.view(torch.int32)
        exp = ((bits >> 23) & 0xFF) + (bits & 0x7FFFFF).bool().int()
        sf = (exp.clamp(1, 254) << 23).view(torch.float32)
        scaled = xv * (1.0 / sf)
    else:
        scaled = xv * (448.0 / amax)
        sf = amax / 448.0
    codes = to_e4m3_codes(scaled.float()).view(xp.shape)[:m, :n].contiguous()
    return codes, sf.view(xv.size(0), xv.size(2)).contiguous()


def model(seed: int):
    """A small model in bf16 (and one f32 weight): [(name, tensor)]."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape, dtype=torch.bfloat16, scale=0.02):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    big = w(1000, 1100)
    big[::97, ::89] *= 300  # blocks of very different maxima
    big[128:256, 0:128] = 0  # an all-zero block
    return [
        ("model.embed_tokens.weight", w(512, 128)),
        ("model.layers.0.input_layernorm.weight", w(1100)),
        ("model.layers.0.mlp.down_proj.weight", big),  # its FP8 bytes cross the 2 MiB slot
        ("model.layers.0.mlp.gate.weight", w(128, 1100)),
        ("model.layers.0.self_attn.o_proj.weight", w(300, 257, dtype=torch.float32)),
        ("model.layers.0.self_attn.o_proj.bias", w(300)),
        ("lm_head.weight", w(512, 128)),
    ]


def expected(named, ue8m0: bool, selected=None):
    """What the manifest carries for `named`: [(name, torch dtype name or 'f8e4m3fn', uint8 bytes)]."""
    out = []
    for name, t in named:
        pick = selected(name) if selected else _C.default_quantize_filter(name, tuple(t.shape), _dt(t))
        if not pick:
            out.append((name, _dt(t), t.contiguous().view(-1).view(torch.uint8)))
            continue
        q, s = per_block_cast_to_fp8(t, ue8m0)
        out.append((name, "f8e4m3fn", q.view(-1)))
        out.append((name + "_scale_inv", "f32", s.view(-1).view(torch.uint8)))
    return out


def _dt(t: torch.Tensor) -> str:
    return {torch.bfloat16: "bf16", torch.float32: "f32", torch.float16: "f16"}[t.dtype]


def read_raw(c, timeout=60.0):
    """One sync read with the low-level consumer into uint8 buffers: [(name, dtype name, bytes)]."""
    s = c.wait_sync(timeout)
    bufs = [torch.empty(t[3], dtype=torch.uint8) for t in s.tensors]
    c.read_into([b.data_ptr() for b in bufs])
    return [(t[0], t[1], b) for t, b in zip(s.tensors, bufs)]


def compare(got, want) -> list:
    problems = []
    if [(n, d) for n, d, _ in got] != [(n, d) for n, d, _ in want]:
        return [f"manifest {[(n, d) for n, d, _ in got]} != {[(n, d) for n, d, _ in want]}"]
    for (n, _, a), (_, _, b) in zip(got, want):
        if not torch.equal(a, b):
            problems.append(f"'{n}': {int((a != b).sum())} bytes differ")
    return problems


def role_consumer(q, region, seeds, ue8m0, timeout=60.0):
    """Reads one sync per seed (low-level consumer, raw bytes) and checks
    it; a sync the producer aborted (Aborted) is counted and let go."""
    import shmcast

    c = _C.Consumer(region, open_timeout=timeout, pin="no")
    q.put({"ready": True})
    problems, aborted = [], []
    for seed in seeds:
        while True:
            try:
                got = read_raw(c, timeout)
                break
            except shmcast.Aborted as e:
                aborted.append(str(e))
        problems += compare(got, expected(model(seed), ue8m0))
    c.close()
    return {"problems": problems, "aborted": aborted}
