"""Trainer-side helpers the framework backends share: cutting a stream of
(name, tensor) pairs into buckets, one sync each."""
from __future__ import annotations

from typing import Iterable, Iterator, List, Optional, Tuple

import torch

__all__ = ["buckets", "nbytes"]


def nbytes(t) -> int:
    """Bytes of a tensor (or of a DTensor's full tensor: shape and dtype are global)."""
    n = 1
    for s in t.shape:
        n *= int(s)
    return n * torch.empty((), dtype=t.dtype).element_size()


def buckets(named: Iterable[Tuple[str, torch.Tensor]], bucket_bytes: int = 0,
            dtype: Optional[torch.dtype] = None) -> Iterator[List[Tuple[str, torch.Tensor]]]:
    """Groups `named` into lists of at most `bucket_bytes` (0: everything in
    one bucket; a tensor larger than the limit is a bucket of its own). Each
    bucket is one sync: the trainer holds at most one bucket of materialized
    (e.g. all-gathered) tensors at a time. dtype: cast floating-point
    tensors to it first (verl sends the rollout's dtype, e.g. bfloat16)."""
    out: List[Tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        if dtype is not None and t.dtype != dtype and t.is_floating_point():
            t = t.to(dtype)
        n = nbytes(t)
        if out and bucket_bytes and size + n > bucket_bytes:
            yield out
            out, size = [], 0
        out.append((name, t))
        size += n
    if out:
        yield out
