"""Batched checks of a whole sync's tensors (issue 43 item 2): the common
case, where every tensor is a plain dense contiguous tensor on the CPU or on
one GPU, is told apart with a few C-level passes (map over the tensors)
instead of a Python loop that asks each tensor a dozen questions. Anything
else returns None, and the caller takes its per-tensor path, which checks
each tensor and words the errors; so these functions only ever accept what
that path accepts."""
from __future__ import annotations

import contextlib
import gc
import operator
import os
import threading
from typing import Optional

import torch

_PLAIN = frozenset((torch.Tensor, torch.nn.Parameter))
_STRIDED = frozenset((torch.strided,))
_Tensor = torch.Tensor
dtype_of = operator.attrgetter("dtype")
shape_of = operator.attrgetter("shape")
_layout_of = operator.attrgetter("layout")
_is_cpu = operator.attrgetter("is_cpu")
_is_cuda = operator.attrgetter("is_cuda")


# CUDA tensors of one GPU could take the batched paths too (send through the
# CUDA engine, receive_into through read_into_device), but that has not run
# on a GPU yet: until it has, they keep the per-tensor path, as before the
# batched paths came in. SHMCAST_PY_BATCH_CUDA=1 turns it on (the GPU test
# test_batched.py::test_batched_paths_on_one_gpu runs both ways).
BATCH_CUDA = os.environ.get("SHMCAST_PY_BATCH_CUDA", "") not in ("", "0")


def plain_device(ts: list) -> Optional[int]:
    """-1 when every tensor of `ts` (a non-empty list) is a torch.Tensor or
    nn.Parameter (no subclass, no DTensor), strided, contiguous, without a
    conj or neg bit, on the CPU; the index of the GPU when all that holds
    with every one on that one CUDA device; None otherwise (or when `ts` is
    empty)."""
    if not ts or not _PLAIN.issuperset(map(type, ts)) or not _STRIDED.issuperset(map(_layout_of, ts)):
        return None
    devs = set(map(_Tensor.get_device, ts))
    if len(devs) != 1:
        return None
    dev = devs.pop()
    if dev >= 0 and not BATCH_CUDA:
        return None  # CUDA tensors take the per-tensor path (BATCH_CUDA)
    if not all(map(_is_cpu if dev < 0 else _is_cuda, ts)):
        return None  # another kind of device (meta, ...)
    if not all(map(_Tensor.is_contiguous, ts)) or any(map(_Tensor.is_conj, ts)) or any(map(_Tensor.is_neg, ts)):
        return None
    return dev


def data_ptrs(ts: list) -> list:
    """Each tensor's data_ptr()."""
    return list(map(_Tensor.data_ptr, ts))


_gc_lock = threading.Lock()
_gc_pauses = 0  # gc_paused() blocks running now, in any thread
_gc_was_enabled = False


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic GC paused for the block: a pass over a sync's tensors
    makes an object per tensor (a torch.Size, a tensor view), and each 700
    new objects would start a collection that walks every tracked object of
    the process (a model's tensors): most of the cost of a sync of 100,000
    tensors. Nested and concurrent blocks share one pause; the GC is
    enabled again after the last one only when it was enabled before the
    first. Around Python work only, never around a wait or a copy."""
    global _gc_pauses, _gc_was_enabled
    with _gc_lock:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_enabled:
                gc.enable()
