"""Batched checks of a whole sync's tensors (issue 43 item 2): the common
case, where every tensor is a plain dense contiguous tensor on the CPU or on
one GPU, is told apart by one C++ loop over the tensors (the binding's
plain_sources / plain_destinations, python/src/binding/tensors.cpp), which
reads each tensor's attributes through the descriptors handed to it here,
instead of a Python loop that asks each tensor a dozen questions. Anything
else gives None, and the caller takes its per-tensor path, which checks
each tensor and words the errors; so these functions only ever accept what
that path accepts."""
from __future__ import annotations

import contextlib
import gc
import inspect
import os
import threading
from typing import Optional

import torch

from . import _shmcast as _C
from ._dtypes import _FROM_NAME, _TO_NAME

_ATTRS = ("layout", "get_device", "is_cpu", "is_cuda", "is_contiguous", "is_conj", "is_neg", "dtype", "shape",
          "data_ptr")


def _use_torch() -> bool:
    """Hands the binding what its batched checks read: the descriptors of
    torch.Tensor's attributes (found as `t.name` finds them), the dtype
    tables and the complex dtypes (the only ones a conj bit is set on).
    nn.Parameter is batched only where it reads the same descriptors.
    False when this torch's attributes are not what the binding can call
    (every sync then takes the per-tensor paths)."""
    try:
        attrs = {n: inspect.getattr_static(torch.Tensor, n) for n in _ATTRS}
        param = torch.nn.Parameter
        if any(inspect.getattr_static(param, n) is not attrs[n] for n in _ATTRS):
            param = None
        complex_ = [dt for dt in _TO_NAME if dt.is_complex]
        _C.use_torch(torch.Tensor, param, torch.strided, attrs, dict(_TO_NAME), dict(_FROM_NAME), complex_)
    except (AttributeError, _C.Error):
        return False
    return True


_BATCHED = _use_torch()


# CUDA tensors of one GPU could take the batched paths too (send through the
# CUDA engine, receive_into through read_into_device), but that has not run
# on a GPU yet: until it has, they keep the per-tensor path, as before the
# batched paths came in. SHMCAST_PY_BATCH_CUDA=1 turns it on (the GPU test
# test_batched.py::test_batched_paths_on_one_gpu runs both ways).
BATCH_CUDA = os.environ.get("SHMCAST_PY_BATCH_CUDA", "") not in ("", "0")


def plain_sources(names: list, ts: list):
    """send(): shmcast._shmcast.PlainTensors when every tensor of `ts` (a
    non-empty list, names the list of their names) is a torch.Tensor or
    nn.Parameter (no subclass, no DTensor), strided, contiguous, without a
    conj or neg bit, of a dtype shmcast carries, all on the CPU (device
    -1) or all on one GPU (its index; only with BATCH_CUDA); None
    otherwise. Its specs and pointers go to Producer.send_plain."""
    return _C.plain_sources(names, ts, BATCH_CUDA) if _BATCHED else None


def plain_destinations(info, dsts: dict, strict: bool):
    """receive_into(): PlainTensors when every tensor of the sync `info`
    has a destination in `dsts` (strict: and no other name is there) that
    is plain as plain_sources() says and has the tensor's dtype and shape;
    None otherwise. Its pointers (None for an empty tensor) go to
    Consumer.read_plain."""
    return _C.plain_destinations(info, dsts, strict, BATCH_CUDA) if _BATCHED else None


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
