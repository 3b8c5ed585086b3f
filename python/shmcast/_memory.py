"""Memory: host and device buffers for received syncs, views into them, and
the checks on tensors a sync is read from or into (row pitches, overlap,
writability); the lifetime mixin of the objects that map a region.
"""
from __future__ import annotations

import errno
import math
import os
from typing import NamedTuple, Optional

import torch

from . import _shmcast as _C
from ._batch import gc_paused
from ._dtypes import _ELEM_SIZE, _FROM_NAME, torch_dtype

# The library's alignments (shmcast::limits, docs/protocol.md): each tensor
# of a sync starts at a multiple of _TENSOR_ALIGN bytes of its stream; a
# reused host staging buffer grows in steps of _DATA_ALIGN (2 MiB).
_TENSOR_ALIGN = _C.tensor_align
_DATA_ALIGN = _C.data_align


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class _TensorAt(NamedTuple):
    """A tensor of a sync and where it sits in a buffer: a SyncInfo.tensors
    entry (name, dtype, shape, nbytes, stream_offset) has the same fields."""

    name: str
    dtype: str
    shape: tuple
    nbytes: int
    offset: int


_MIN_ROW_BYTES = 64  # narrower rows: one contiguous staging copy is faster


def _row_pitch(t: torch.Tensor):
    """(rows, row_bytes, pitch_bytes) when `t` is rows of contiguous bytes at a
    constant pitch (a column slice of a matrix, a slice of a fused
    parameter...), else None."""
    dims = [(s, st) for s, st in zip(t.shape, t.stride()) if s != 1]
    if len(dims) < 2:
        return None
    inner, k = 1, len(dims)
    while k > 0 and dims[k - 1][1] == inner:
        inner *= dims[k - 1][0]
        k -= 1
    if k == 0:
        return None  # contiguous after all
    for j in range(k - 1):  # the outer dims must collapse into one
        if dims[j][1] != dims[j + 1][1] * dims[j + 1][0]:
            return None
    pitch = dims[k - 1][1]
    if pitch < inner:
        return None  # overlapping or broadcast rows
    es = t.element_size()
    if inner * es < _MIN_ROW_BYTES:
        return None
    rows = math.prod(s for s, _ in dims[:k])
    return (rows, inner * es, pitch * es)


def _parse_device(device) -> torch.device:
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise _C.InvalidArgument(f"device {device!r}: {e}; shmcast receives on 'cpu' or 'cuda[:N]'") from None
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise _C.CudaUnavailable(f"device {device!r}: torch sees no CUDA device")
        if d.index is None:
            d = torch.device("cuda", torch.cuda.current_device())
        n = torch.cuda.device_count()
        if d.index >= n:
            raise _C.InvalidArgument(f"device {device!r}: the CUDA device index must be 0..{n - 1} on this machine")
    elif d.type != "cpu":
        raise _C.InvalidArgument(f"shmcast receives on 'cpu' or 'cuda[:N]', not {device!r}")
    return d


def _free_bytes(device: torch.device) -> Optional[int]:
    """Bytes an allocation on `device` can get now (None: unknown). CPU:
    MemAvailable + SwapFree (/proc/meminfo); CUDA: the device's free memory
    plus what torch's caching allocator holds unused."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        with open("/proc/meminfo", "rb") as f:
            info = dict(line.split(b":", 1) for line in f if b":" in line)
        return sum(int(info[k].split()[0]) * 1024 for k in (b"MemAvailable", b"SwapFree"))
    except (OSError, KeyError, ValueError):
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            return None


def _alloc(shape, dtype: torch.dtype, device: torch.device, what: str) -> torch.Tensor:
    """torch.empty(shape) once `device` has room for it. Sizes come from a
    sync's manifest (another process wrote it): too large, or a failed
    allocation, is shmcast.RegionFull (errno ENOMEM), never a torch error."""
    n = (math.prod(shape) if isinstance(shape, tuple) else shape) * _ELEM_SIZE[dtype]
    free = _free_bytes(device)
    why = None
    if free is not None and n > free:
        why = f"only {free} bytes are free there"
    else:
        try:
            return torch.empty(shape, dtype=dtype, device=device)
        except RuntimeError as e:  # torch.cuda.OutOfMemoryError is one
            why = f"the allocation failed ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    err = _C.RegionFull(
        f"{what} needs {n} bytes on {device}, but {why}. Free memory, send smaller syncs, or receive_into() "
        f"preallocated tensors (if the producer did not send {n} bytes, its region is corrupt)")
    err.sys_errno = errno.ENOMEM
    raise err


def _views(buf: torch.Tensor, tensors) -> list:
    """(name, tensor) views into `buf` (uint8, the sync's stream layout)."""
    with gc_paused():  # a tensor object per tensor of the sync
        return _make_views(buf, tensors)


def _make_views(buf: torch.Tensor, tensors) -> list:
    out = []
    typed: dict = {}
    for name, dt, shape, nbytes, off in tensors:
        tdt = _FROM_NAME.get(dt)
        if tdt is None:
            torch_dtype(dt)  # raises the explanatory TypeError
        base = typed.get(tdt)
        es = _ELEM_SIZE[tdt]
        if base is None:
            base = buf[: (buf.numel() // es) * es].view(tdt)
            typed[tdt] = base
        if nbytes == 0:
            out.append((name, torch.empty(shape, dtype=tdt, device=buf.device)))
            continue
        strides = _contiguous_strides(shape)
        out.append((name, base.as_strided(shape, strides, off // es)))
    return out


_STRIDE_CACHE: dict = {}


def _contiguous_strides(shape):
    s = _STRIDE_CACHE.get(shape)
    if s is None:
        acc, out = 1, []
        for d in reversed(shape):
            out.append(acc)
            acc *= max(d, 1)
        s = tuple(reversed(out))
        if len(_STRIDE_CACHE) < 4096:
            _STRIDE_CACHE[shape] = s
    return s


def _overlaps(t: torch.Tensor) -> bool:
    """True unless every element of `t` has its own memory: a stride-0
    (expand()ed, broadcast) dimension, or strides that interleave. Checked
    on non-contiguous tensors only (contiguous ones never overlap)."""
    extent = 0  # elements spanned by the inner dimensions, minus one
    for st, s in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s > 1):
        if st <= extent:
            return True
        extent += (s - 1) * st
    return False


def _unwritable(d) -> Optional[str]:
    """Why receive_into() cannot write destination `d` (None: it can).
    Runs for every destination of every receive_into(): cheap checks first."""
    tt = type(d)
    if tt is not torch.Tensor and tt is not torch.nn.Parameter:
        if not isinstance(d, torch.Tensor):
            return f"expected a torch.Tensor, got {tt.__name__}"
        if hasattr(d, "full_tensor"):
            return "a DTensor: receive into plain tensors and distribute them"
    if d.layout is not torch.strided:
        return f"a {d.layout} tensor: destinations must be dense"
    if not (d.is_cuda or d.is_cpu):
        return f"on {d.device}: destinations must be CPU or CUDA tensors"
    if not d.is_contiguous() and _overlaps(d):
        return (f"its elements share memory (strides {list(d.stride())}, e.g. an expand()ed view): "
                "pass a tensor whose every element has its own memory (e.g. .clone())")
    return None


def _copy_back(pairs) -> None:
    """dst.copy_(tmp) for receive_into's temporaries, as load_state_dict
    writes parameters: under no_grad (a parameter that requires grad takes
    the bytes), inference tensors under inference_mode."""
    with torch.no_grad():
        for d, tmp in pairs:
            if d.is_inference() and not torch.is_inference_mode_enabled():
                with torch.inference_mode():
                    d.copy_(tmp)
            else:
                d.copy_(tmp)


class _CudaArray:
    """Exposes a raw device pointer through __cuda_array_interface__ (v2) so
    torch.as_tensor wraps it without a copy; `owner` keeps the memory's owner
    reachable from the tensor."""

    __slots__ = ("__cuda_array_interface__", "owner")

    def __init__(self, ptr: int, nbytes: int, owner):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 2,
        }
        self.owner = owner


class _Closing:
    """Context-manager mixin: `with X(...) as x:` closes x on exit.

    An object belongs to the process that made it. In a forked child,
    close() (and so __exit__ and __del__) does nothing: the child's exit
    must neither remove the parent's region nor free its seat. Every other
    call raises shmcast.InvalidArgument there (the binding checks)."""

    _pid = None  # the creator's pid, set first thing in __init__

    def _owned(self) -> bool:
        return self._pid == os.getpid()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
