"""Store regions: StoreView (a held version as zero-copy, read-only CPU
tensors), ReadOnlyTensor and ReadOnly, and store_bytes_for().
"""
from __future__ import annotations

import ctypes
import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from . import _shmcast as _C
from ._dtypes import _TO_NAME, torch_dtype

if TYPE_CHECKING:
    from ._consumer import Consumer


class _StoreLease:
    """The hold a StoreView's tensors keep: every tensor's buffer references
    it (and it its consumer, so the region stays mapped); when the last
    tensor is gone it is collected and lets go of the version. It references
    neither the view nor the tensors, so no cycle through torch's storages
    (which the garbage collector cannot see) keeps it alive."""

    def __init__(self, consumer: "Consumer"):
        self.consumer = consumer
        self.released = False
        self.close_consumer = False  # the consumer was closed while tensors lived: close it at the end

    def release(self) -> None:
        consumer = self.consumer
        with consumer._lock:  # not between another thread's hold() and its lease
            if self.released:
                return
            self.released = True
            ref = consumer._view
            if ref is not None and ref() is self:
                consumer._view = None
                c = consumer._c
                if c is not None and not c.closed and consumer._owned():
                    consumer._skip_quietly(c)

    def __del__(self):
        try:
            self.release()
            if self.close_consumer:
                c = self.consumer._c
                if c is not None and not c.closed:
                    c.close()
        except Exception:
            pass


class ReadOnly(_C.Permission):
    """An in-place write to a tensor of a StoreView: its bytes are the
    version the store region keeps for every reader, so they are read-only.
    Copy what you want to change (`t.clone()`), or receive() the version
    (owned copies) instead of hold()ing it."""

    code = "Permission"


# In-place methods that change a tensor's metadata (shape, names, autograd
# flags), never its bytes: allowed on a ReadOnlyTensor.
_METADATA_INPLACE = frozenset({
    "requires_grad_", "detach_", "rename_", "t_", "transpose_", "swapaxes_", "swapdims_", "squeeze_", "unsqueeze_",
    "as_strided_",
})
_DUNDER_INPLACE = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__imatmul__", "__itruediv__", "__ifloordiv__", "__idiv__",
    "__imod__", "__ipow__", "__ilshift__", "__irshift__", "__iand__", "__ixor__", "__ior__",
})
_INPLACE_PARAM: dict = {}  # func -> its signature when it takes `inplace` (torch.nn.functional), else None

# The context that runs a torch function without calling __torch_function__
# again (torch >= 2.0 has the subclass-only one).
_NO_TORCH_FUNCTION = getattr(torch._C, "DisableTorchFunctionSubclass", None) or torch._C.DisableTorchFunction


def _read_only_in(x) -> bool:
    if isinstance(x, ReadOnlyTensor):
        return True
    if isinstance(x, (list, tuple)):
        return any(isinstance(y, ReadOnlyTensor) for y in x)
    return False


def _writes_read_only(func, args, kwargs) -> str:
    """The name of the write when `func(*args, **kwargs)` would write into a
    ReadOnlyTensor's bytes, else ''."""
    name = getattr(func, "__name__", "") or ""
    first = args[0] if args else None
    if name in _DUNDER_INPLACE or (name.endswith("_") and not name.endswith("__") and name not in _METADATA_INPLACE):
        if _read_only_in(first):
            return name
    out = kwargs.get("out")
    if out is not None and _read_only_in(out):
        return f"{name}(out=...)"
    if _read_only_in(first):
        sig = _INPLACE_PARAM.get(func, 0)
        if sig == 0:
            sig = None
            if getattr(func, "__module__", "") == "torch.nn.functional":
                try:
                    s = inspect.signature(func)
                    if "inplace" in s.parameters:
                        sig = s
                except (TypeError, ValueError):
                    pass
            _INPLACE_PARAM[func] = sig
        if sig is not None:
            try:
                if sig.bind(*args, **kwargs).arguments.get("inplace"):
                    return f"{name}(inplace=True)"
            except TypeError:
                pass
    return ""


def _spans(args, kwargs) -> list:
    found = []
    for x in list(args) + list(kwargs.values()):
        for y in (x if isinstance(x, (list, tuple)) else (x,)):
            span = getattr(y, "_shmcast_span", None) if isinstance(y, ReadOnlyTensor) else None
            if span is not None:
                found.append(span)
    return found


def _rewrap(ret, spans):
    """Tensors that view a read-only span stay read-only; every other result
    (a copy: clone(), to(), arithmetic) is a plain tensor."""
    if isinstance(ret, torch.Tensor):
        p = ret.data_ptr() if ret.device.type == "cpu" else 0
        span = next(((lo, hi) for lo, hi in spans if lo <= p < hi), None)
        if span is not None:
            if not isinstance(ret, ReadOnlyTensor):
                ret = ret.as_subclass(ReadOnlyTensor)
            ret._shmcast_span = span
            return ret
        if isinstance(ret, ReadOnlyTensor):
            return ret.as_subclass(torch.Tensor)
        return ret
    if isinstance(ret, (list, tuple)) and type(ret) in (list, tuple):
        return type(ret)(_rewrap(r, spans) for r in ret)
    return ret


class ReadOnlyTensor(torch.Tensor):
    """A CPU tensor of a StoreView: its bytes are a version a store region
    keeps for every reader. Reading works as for any tensor (it is one);
    an in-place write raises ReadOnly before any byte changes: methods
    ending in `_` (mul_, copy_, zero_, ...), `t[i] = x`, `t += x`, `out=t`,
    `inplace=True`, and numpy() gives a read-only array. Views of it
    (narrow, view, reshape, t[...], .data, detach()) are ReadOnlyTensors
    too; results with memory of their own (clone(), to(), arithmetic) are
    plain tensors. Writes that bypass torch's operators (a storage, a C
    extension, data_ptr()) reach memory mapped read-only: the process gets
    SIGSEGV (docs/python.md)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        write = _writes_read_only(func, args, kwargs)
        if write:
            raise ReadOnly(
                f"{write} would write into a StoreView tensor, whose bytes are the version the store region keeps "
                "for every reader: copy it first (t.clone()), or receive() the version instead of hold()ing it")
        with _NO_TORCH_FUNCTION():
            ret = func(*args, **kwargs)
            if getattr(func, "__name__", "") in ("numpy", "__array__") and hasattr(ret, "setflags"):
                ret.setflags(write=False)
                return ret
            return _rewrap(ret, _spans(args, kwargs))


class StoreView:
    """A version held in a store region, as CPU tensors that are views into
    the pinned region (no copy): hand them to a loader (vLLM's
    load_weights() copies from pinned memory at full speed).

    LIFETIME: the tensors are valid until release() (or the end of a `with`
    block, or the consumer's next receive()/wait_sync()/hold()/close()), and
    while any of them is alive the consumer stays open and the region mapped.
    Once every tensor is gone the version is let go on its own. While held,
    the producer does not overwrite the version: a send that needs its room
    waits up to the producer's consumer_timeout, then fails (stall_policy
    'fail') or evicts this consumer and REWRITES THE BYTES UNDER THE TENSORS
    (stall_policy 'evict', the default for store regions; valid() turns
    False). After release() the tensors still point into the region but may
    change at any time: never use them then. They are read-only
    (ReadOnlyTensor): every reader shares the bytes, so an in-place write
    raises ReadOnly, and the pages are mapped read-only (a write that
    bypasses torch faults; Consumer.views_read_only). Clone a tensor you
    need to change. A forked child cannot use them (the region is not mapped
    in children). Hold briefly: load, then release.
    """

    def __init__(self, lease: _StoreLease, info, ptrs):
        self._lease = lease
        self.version = info.version
        tensors = []
        for (name, dt, shape, nbytes, _off), ptr in zip(info.tensors, ptrs):
            dtype = torch_dtype(dt)
            if nbytes == 0:
                t, span = torch.empty(shape, dtype=dtype), (0, 0)
            else:
                raw = (ctypes.c_uint8 * nbytes).from_address(ptr)
                raw._lease = lease  # the tensor keeps the hold and the mapping
                t, span = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape), (ptr, ptr + nbytes)
            # Every reader's bytes: in-place writes raise ReadOnly (and the
            # pages are mapped read-only below that, where the library can).
            t = t.as_subclass(ReadOnlyTensor)
            t._shmcast_span = span
            tensors.append((name, t))
        self.tensors = tensors

    def valid(self) -> bool:
        """True while the version is held and unchanged."""
        if self._lease.released:
            return False
        c = self._lease.consumer._c
        return c is not None and not c.closed and c.views_valid()

    def release(self) -> None:
        """Lets the producer replace the version; the tensors become invalid."""
        self._lease.release()

    def __getitem__(self, name: str) -> torch.Tensor:
        for n, t in self.tensors:
            if n == name:
                return t
        raise KeyError(name)

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self):
        return len(self.tensors)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

    def __repr__(self):
        state = "released" if self._lease.released else "held"
        return f"<shmcast.StoreView version {self.version}, {len(self.tensors)} tensors, {state}>"


def store_bytes_for(named_tensors) -> int:
    """store_bytes a store region (Producer(mode='store')) needs to hold a
    send() of `named_tensors` ((name, tensor) pairs or a mapping)."""
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    specs = []
    for name, t in items:
        dt = _TO_NAME.get(t.dtype)
        if dt is None:
            raise TypeError(f"'{name}': shmcast cannot carry torch dtype {t.dtype}")
        specs.append((name, dt, tuple(t.shape)))
    return _C.store_bytes_needed(specs)
