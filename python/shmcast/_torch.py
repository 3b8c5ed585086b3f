"""The torch-native API: Producer.send(named_tensors) and Consumer.receive().

Tensors cross into C++ as raw pointers; no tensor data is pickled, copied
through Python, or touched by the GIL-holding thread. A whole sync is one
Python->C++ call in the common case (every tensor contiguous or a row-pitched
2-D view): the per-tensor Python work is reading dtype/shape/data_ptr.
"""
from __future__ import annotations

import ctypes
import errno
import inspect
import weakref
import math
import os
import threading
from collections.abc import Mapping
from typing import Optional, Union

import torch

from . import _shmcast as _C

__all__ = [
    "Producer",
    "Consumer",
    "Mismatch",
    "ReadOnly",
    "ReadOnlyTensor",
    "dtype_name",
    "torch_dtype",
    "supported_dtypes",
]

# ---------------------------------------------------------------- dtypes

# torch attribute name -> shmcast DType name (lib/src/common.cpp). Types this
# torch lacks (uint16/32/64 before 2.3, float8 before 2.1, ...) are skipped.
_DTYPE_PAIRS = (
    ("bool", "bool"),
    ("uint8", "u8"),
    ("int8", "i8"),
    ("int16", "i16"),
    ("int32", "i32"),
    ("int64", "i64"),
    ("uint16", "u16"),
    ("uint32", "u32"),
    ("uint64", "u64"),
    ("float16", "f16"),
    ("bfloat16", "bf16"),
    ("float32", "f32"),
    ("float64", "f64"),
    ("complex64", "c64"),
    ("complex128", "c128"),
    ("float8_e4m3fn", "f8e4m3fn"),
    ("float8_e5m2", "f8e5m2"),
    ("float8_e4m3fnuz", "f8e4m3fnuz"),
    ("float8_e5m2fnuz", "f8e5m2fnuz"),
    ("float8_e8m0fnu", "f8e8m0fnu"),
)
_TO_NAME: dict = {}
_FROM_NAME: dict = {}
for _attr, _name in _DTYPE_PAIRS:
    _dt = getattr(torch, _attr, None)
    if isinstance(_dt, torch.dtype):
        _TO_NAME[_dt] = _name
        _FROM_NAME[_name] = _dt
_FROM_NAME["raw"] = torch.uint8  # untyped bytes, shape (nbytes,)
del _attr, _name, _dt


def supported_dtypes() -> list:
    """The torch dtypes this process can send and receive."""
    return list(_TO_NAME)


def dtype_name(dtype: torch.dtype) -> str:
    """shmcast's name for a torch dtype ('bf16', 'f32', ...)."""
    try:
        return _TO_NAME[dtype]
    except KeyError:
        raise TypeError(f"shmcast cannot carry torch dtype {dtype}") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a shmcast dtype name."""
    try:
        return _FROM_NAME[name]
    except KeyError:
        raise TypeError(
            f"shmcast dtype '{name}' has no torch dtype in this process (torch {torch.__version__}); "
            "upgrade torch on the receiving side"
        ) from None


class Mismatch(_C.InvalidArgument):
    """receive_into(): the sync does not match the destination tensors (names,
    dtypes or shapes), or a destination cannot take its bytes (overlapping
    memory, not a dense CPU/CUDA tensor). The sync was skipped; the
    destinations are untouched."""

    code = "InvalidArgument"


# ---------------------------------------------------------------- helpers

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


_ELEM_SIZE = {dt: torch.empty((), dtype=dt).element_size() for dt in _TO_NAME}
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


# ---------------------------------------------------------------- producer


class Shard:
    """A contiguous shard of a larger (logical) tensor, sent by one rank of a
    sharded Producer: `local` holds the rows [offset, offset +
    local.shape[dim]) along `dim` of a tensor of shape `global_shape`.
    Consumers see the whole tensor (or the slice they ask for)."""

    __slots__ = ("local", "global_shape", "dim", "offset")

    def __init__(self, local: torch.Tensor, global_shape, dim: int, offset: int):
        if not isinstance(local, torch.Tensor):
            raise TypeError(f"Shard: local must be a torch.Tensor, got {type(local).__name__}")
        shape = tuple(int(x) for x in global_shape)
        if not (isinstance(dim, int) and 0 <= dim < len(shape)):
            raise ValueError(f"Shard: dim {dim} is not a dimension of {list(shape)}")
        want = shape[:dim] + (int(local.shape[dim]) if local.dim() == len(shape) else -1,) + shape[dim + 1:]
        if local.dim() != len(shape) or tuple(local.shape) != want:
            raise ValueError(f"Shard: local shape {list(local.shape)} is not {list(shape)} with dim {dim} cut")
        if not (isinstance(offset, int) and 0 <= offset and offset + int(local.shape[dim]) <= shape[dim]):
            raise ValueError(f"Shard: rows [{offset}, +{local.shape[dim]}) lie outside dim {dim} of {list(shape)}")
        self.local, self.global_shape, self.dim, self.offset = local, shape, dim, offset

    def __repr__(self):
        return (f"shmcast.Shard({list(self.local.shape)} of {list(self.global_shape)}, dim={self.dim}, "
                f"offset={self.offset})")


def _dtensor_piece(name, t):
    """This rank's piece of DTensor `t`, without any gather: None when another
    rank sends it (a replicated tensor is sent by mesh coordinate 0), a plain
    tensor when this rank sends it whole, or a Shard."""
    mesh, placements = t.device_mesh, t.placements
    coord = mesh.get_coordinate()
    if coord is None:
        return None  # this rank is not in the tensor's mesh
    shard = None
    for md, pl in enumerate(placements):
        if pl.is_shard():
            if shard is not None:
                raise NotImplementedError(
                    f"'{name}' is sharded over several mesh dims {placements}: send shmcast.Shard pieces "
                    "or full_tensor() it")
            shard = (md, pl.dim)
        elif pl.is_replicate():
            if coord[md] != 0:
                return None  # a replica another rank sends
        else:
            raise NotImplementedError(f"'{name}' has placement {pl}: only Shard and Replicate are sent as they are")
    local = t.to_local()
    if shard is None:
        return local
    dim = shard[1]
    if dim < 0:
        dim += len(t.shape)
    try:  # what DTensor itself computes (uneven shards included)
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        _, goff = compute_local_shape_and_global_offset(t.shape, mesh, placements)
        offset = int(goff[dim])
    except ImportError:  # torch.chunk's split, as Shard places it
        n, k = int(t.shape[dim]), mesh.size(shard[0])
        offset = min(n, -(-n // k) * coord[shard[0]])
    return Shard(local, tuple(t.shape), dim, offset)


def _local_shape(spec):
    if len(spec) == 3:
        return spec[2]
    shape = list(spec[2])
    shape[spec[3]] = spec[5]
    return tuple(shape)


class Producer(_Closing):
    """Creates region `name` and sends syncs of named tensors into it.

    Options are ProducerOptions (shmcast.hpp): slot_bytes (rounded up to
    2 MiB), slots (>= 2), max_consumers, manifest_bytes, group_access,
    replace_stale, unlink_on_close, checksums, stall_policy ('fail' |
    'evict'), consumer_timeout (seconds), pin ('auto' | True | False).

    staging_budget: bytes of temporary GPU copies (non-contiguous CUDA tensors
    that are not row-pitched, DTensor gathers) that may be alive at once
    during a send before the producer waits for their D2H copies.

    stall_policy: 'fail' (default for ring regions) or 'evict' (default for
    store regions).

    mode='store' (with store_bytes, see store_bytes_for()): the region keeps
    the newest complete version for consumers that come at any time (a
    restarted or added worker gets the current weights at once, without a
    new send). It holds two versions' room (2 x store_bytes, pinned): each
    send() is written beside the version readers see and replaces it when
    complete; one rank only.

    Sharded trainers: every rank creates Producer(name, rank=r,
    world_size=R, ...) (rank 0 creates the region, slots >= 2 * R; the
    others attach to it) and calls send() for every sync with what it
    holds: DTensors (its local shard, no gather; a replicated one is sent by
    mesh coordinate 0), shmcast.Shard pieces, or plain tensors it owns
    whole. Every rank's send() returns the same version; consumers see one
    sync of whole tensors. rank_timeout: how long rank 0 waits for the
    others (and they for it) before Timeout naming the missing rank.
    """

    def __init__(
        self,
        name: str,
        *,
        slot_bytes: int = 256 << 20,
        slots: int = 2,
        max_consumers: int = 8,
        manifest_bytes: int = 1 << 20,
        group_access: bool = False,
        replace_stale: bool = True,
        unlink_on_close: bool = True,
        checksums: bool = False,
        stall_policy: Optional[str] = None,
        consumer_timeout: float = 60.0,
        pin: Union[str, bool] = "auto",
        staging_budget: int = 256 << 20,
        engine: str = "auto",
        rank: int = 0,
        world_size: int = 1,
        rank_timeout: float = 120.0,
        mode: str = "ring",
        store_bytes: Optional[int] = None,
    ):
        self._pid = os.getpid()
        self._c = None
        budget = _C.check_int(staging_budget, "staging_budget", 0, (1 << 63) - 1)
        if stall_policy is None:
            # A store region's readers hold versions (views) for as long as
            # they like: one that overstays is evicted, never the trainer stalled.
            stall_policy = "evict" if mode == "store" else "fail"
        if mode == "store" and store_bytes is None:
            raise ValueError("a store region (mode='store') needs store_bytes: the room for one version, "
                             "shmcast.store_bytes_for(named_tensors)")
        self._c = _C.Producer(
            name,
            slot_bytes=slot_bytes,
            slots=slots,
            max_consumers=max_consumers,
            manifest_bytes=manifest_bytes,
            group_access=group_access,
            replace_stale=replace_stale,
            unlink_on_close=unlink_on_close,
            checksums=checksums,
            stall_policy=stall_policy,
            consumer_timeout=consumer_timeout,
            pin=pin,
            engine=engine,
            rank=rank,
            world_size=world_size,
            rank_timeout=rank_timeout,
            mode=mode,
            store_bytes=0 if store_bytes is None else store_bytes,
        )
        self.rank, self.world_size = int(rank), int(world_size)
        self._staging_budget = budget
        # Fixed at create: 'cuda' copies device tensors with async D2H (and
        # host ones with memcpy); 'host' stages CUDA tensors to CPU first.
        self._engine_cuda = self._c.engine == "cuda"
        self._streams: dict = {}

    # -------------------------------------------------------- sending

    def send(self, named_tensors, *, version: Optional[int] = None) -> int:
        """Sends one sync: `named_tensors` is an iterable of (name, tensor)
        pairs or a mapping name -> tensor; tensors on CPU or CUDA, any shape,
        any layout (FSDP2 DTensors are gathered with full_tensor(), one at a
        time). Returns the sync's version once every byte is in the region:
        the tensors may be modified or freed afterwards (consumers may still
        be reading the region).

        version: the sync's version (default: the last one + 1; a given one
        must be greater than the last).

        Sharded producers: returns on every rank only once the sync is
        complete (every rank's bytes are in), else raises on every rank.
        Whatever raises in send() on a rank, before or after shmcast began
        the sync, takes that rank's round and fails it on every rank, so the
        ranks stay in step. A step whose send() a rank never calls (its own
        code raised first) cannot be told apart from a late call: name every
        sync's version on every rank alike (version=step) and such a step is
        refused on every rank instead of shifting later syncs.

        CUDA copies are ordered after the work queued so far on the tensors'
        device's torch.cuda.current_stream()."""
        c = self._live()
        if self.world_size <= 1:
            return self._send(c, named_tensors, version)
        taken = c.last_round
        try:
            return self._send(c, named_tensors, version)
        except BaseException as e:
            if c.last_round == taken:
                # Raised before shmcast took this rank's round (a tensor it
                # cannot send, a failing gather, an interrupt): take the round
                # anyway and fail it on every rank.
                try:
                    c.skip_sync(f"send() on rank {self.rank} raised {type(e).__name__} before its sync began: {e}",
                                version if isinstance(version, int) and version > 0 else 0)
                except _C.Error:
                    pass
            raise

    def _send(self, c, named_tensors, version) -> int:
        want = 0 if version is None else _C.check_int(version, "version", 1, (1 << 63) - 1)
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        specs, srcs, devs, lays, keep = [], [], [], [], []
        slow = []  # indices that need a per-tensor step (staging copy, gather)
        cuda_dev = None
        any_cpu = False
        to_name = _TO_NAME
        row_pitch = _row_pitch
        Tensor, Parameter, strided = torch.Tensor, torch.nn.Parameter, torch.strided
        sharded = self.world_size > 1
        for name, t in items:
            i = len(specs)
            tt = type(t)
            shard = None
            if tt is not Tensor and tt is not Parameter and sharded:
                if hasattr(t, "placements") and hasattr(t, "to_local"):  # DTensor: this rank's piece, no gather
                    t = _dtensor_piece(name, t)
                    if t is None:
                        continue
                    tt = type(t)
                if tt is Shard:
                    shard, t = t, t.local
                    tt = type(t)
            elif tt is Shard:
                raise ValueError(f"'{name}' is a shmcast.Shard but this producer has one rank: create every "
                                 "rank's Producer with rank= and world_size=")
            keep.append(t)
            if tt is not Tensor and tt is not Parameter:
                if hasattr(t, "full_tensor"):  # FSDP2 DTensor (or alike): gathered when its turn comes
                    dt = to_name.get(t.dtype)
                    if dt is None:
                        raise TypeError(f"'{name}': shmcast cannot carry torch dtype {t.dtype}")
                    specs.append((name, dt, tuple(t.shape)))
                    srcs.append(None)
                    devs.append(False)
                    lays.append(None)
                    slow.append(i)
                    continue
                if not isinstance(t, Tensor):
                    raise TypeError(f"'{name}': expected a torch.Tensor, got {tt.__name__}")
            dt = to_name.get(t.dtype)
            if dt is None:
                raise TypeError(f"'{name}': shmcast cannot carry torch dtype {t.dtype}")
            if t.layout is not strided:
                raise TypeError(f"'{name}': shmcast sends dense tensors, not {t.layout}")
            if shard is not None:
                specs.append((name, dt, shard.global_shape, shard.dim, shard.offset, int(t.shape[shard.dim])))
            else:
                specs.append((name, dt, tuple(t.shape)))
            if t.is_cuda:
                if cuda_dev is None:
                    cuda_dev = t.device
                elif t.device != cuda_dev:
                    raise ValueError(
                        f"'{name}' is on {t.device} but earlier tensors are on {cuda_dev}: "
                        "one send takes the tensors of one GPU (send per device, or move them)")
                devs.append(True)
            else:
                if t.device.type != "cpu":
                    raise TypeError(f"'{name}': shmcast sends CPU or CUDA tensors, not {t.device}")
                any_cpu = True
                devs.append(False)
            if t.is_conj() or t.is_neg():
                srcs.append(None)
                lays.append(None)
                slow.append(i)
            elif t.is_contiguous():
                srcs.append(t.data_ptr())
                lays.append(None)
            else:
                lay = row_pitch(t)
                srcs.append(t.data_ptr() if lay is not None else None)
                lays.append(lay)
                if lay is None:
                    slow.append(i)
        # Where sources go. A CUDA engine copies device tensors with async
        # D2H and host tensors with memcpy; a host engine takes host memory
        # only, so its CUDA tensors are staged to CPU one at a time.
        if cuda_dev is not None and not self._engine_cuda:
            slow = sorted(set(slow) | {i for i in range(len(devs)) if devs[i]})
            devs = [False] * len(devs)
            cuda_dev = None
            target = "host"
        elif cuda_dev is not None:
            target = "device"
        elif any_cpu:
            target = "host"
        else:
            target = None  # only gathers: the first gathered tensor decides
        streams = self._stream_of(cuda_dev) if cuda_dev is not None else None
        if not slow:
            if cuda_dev is None:
                return c.send_batch(specs, srcs, devs, lays, None, want)
            with torch.cuda.device(cuda_dev):
                return c.send_batch(specs, srcs, devs, lays, streams, want)
        return self._send_slow(c, specs, srcs, devs, lays, streams, slow, keep, target, cuda_dev, want)

    @staticmethod
    def _stream_of(dev: torch.device) -> int:
        return torch.cuda.current_stream(dev).cuda_stream

    def _send_slow(self, c, specs, srcs, devs, lays, streams, slow, keep, target, cuda_dev, want=0) -> int:
        # Runs of ready tensors go in one write_batch call each; every slow
        # tensor gets its own staging step, so at most staging_budget bytes
        # of temporary copies are alive at once.
        v = c.begin_sync(specs, want)
        held, held_bytes = [], 0
        try:
            start = 0
            for i in slow + [len(specs)]:
                if i > start:
                    if cuda_dev is not None:
                        with torch.cuda.device(cuda_dev):
                            c.write_batch(start, srcs[start:i], devs[start:i], lays[start:i], streams)
                    else:
                        c.write_batch(start, srcs[start:i], devs[start:i], lays[start:i], None)
                if i == len(specs):
                    break
                staged = self._stage(keep[i])
                if tuple(staged.shape) != _local_shape(specs[i]) or _TO_NAME.get(staged.dtype) != specs[i][1]:
                    raise ValueError(f"'{specs[i][0]}': full_tensor() gave {staged.dtype} {list(staged.shape)}, "
                                     f"expected {specs[i][1]} {list(specs[i][2])}")
                if target is None:
                    target = "device" if staged.is_cuda else "host"
                if staged.is_cuda and target == "host":
                    staged = staged.cpu()  # a GPU gather in a host sync
                if staged.is_cuda and not self._engine_cuda:
                    staged = staged.cpu()  # a host engine takes host memory only
                if not staged.is_cuda:
                    c.write(i, staged.data_ptr())  # host memory: memcpy (through either engine)
                else:
                    dev = staged.device
                    with torch.cuda.device(dev):
                        c.write_device(i, staged.data_ptr(), self._stream_of(dev))
                    # The copy runs on the library's stream: keep the staging
                    # copy alive until the device has done it.
                    held.append(staged)
                    held_bytes += staged.numel() * staged.element_size()
                    if held_bytes > self._staging_budget:
                        torch.cuda.synchronize(dev)  # every stream of the device, the library's too
                        held, held_bytes = [], 0
                del staged
                start = i + 1
            c.end_sync()  # returns once every copy has run: held copies may go
        except BaseException as e:
            try:
                c.abort_sync(f"the Python producer failed: {type(e).__name__}: {e}")
            except _C.Error:
                pass
            raise
        finally:
            held.clear()
        return v

    @staticmethod
    def _stage(t) -> torch.Tensor:
        tt = type(t)
        if tt is not torch.Tensor and tt is not torch.nn.Parameter and hasattr(t, "full_tensor"):
            t = t.full_tensor()  # FSDP2 DTensor: all-gathers this one tensor
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        return t.contiguous()

    # -------------------------------------------------------- the rest

    @property
    def region_mode(self) -> str:
        """'ring' or 'store'."""
        return self._live().mode

    def wait_for_consumers(self, n: int = 1, timeout: Optional[float] = 30.0) -> None:
        """Blocks until at least n live consumers are attached. Only consumers
        attached when a send begins take part in that sync."""
        self._live().wait_for_consumers(n, timeout)

    @property
    def consumers(self) -> int:
        """Attached consumers whose process is alive."""
        return self._live().consumers

    def wait_drained(self, timeout: Optional[float] = 60.0) -> None:
        """Blocks until every consumer of the last sync released all its slots."""
        self._live().wait_drained(timeout)

    def take_events(self) -> list:
        """Things the producer did on its own (e.g. evicted a dead consumer)."""
        return self._live().take_events()

    def close(self) -> None:
        """Marks the region closed (consumers get shmcast.Closed after the last
        sync), unpins, unmaps and by default removes the name. Idempotent."""
        c = getattr(self, "_c", None)
        if c is not None and not c.closed and self._owned():
            c.close()

    @property
    def closed(self) -> bool:
        return self._c is None or self._c.closed

    @property
    def raw(self) -> "_C.Producer":
        """The low-level binding (pointers as ints)."""
        return self._live()

    def _live(self):
        c = self._c
        if c is None:
            raise _C.Closed("this producer is closed")
        c.check()  # closed: Closed; in a forked child: InvalidArgument
        return c

    name = property(lambda self: self._c.name)
    path = property(lambda self: self._c.path)
    region_bytes = property(lambda self: self._c.region_bytes)
    slot_bytes = property(lambda self: self._c.slot_bytes)
    slots = property(lambda self: self._c.slots)
    last_version = property(lambda self: self._c.last_version)
    last_sync = property(lambda self: self._c.last_sync,
                         doc="SentSync of the last send: version, first_seq, chunks, stream_bytes, payload_bytes")
    pinned = property(lambda self: self._c.pinned)

    def __repr__(self):
        if self._c is None:
            return "<shmcast.Producer (not created)>"
        state = "closed" if self._c.closed else f"{self._c.slots} x {self._c.slot_bytes} B slots"
        return f"<shmcast.Producer '{self._c.name}' {state}>"


# ---------------------------------------------------------------- consumer


class Consumer(_Closing):
    """Attaches to region `name` (waiting up to open_timeout seconds for it to
    appear) and receives syncs onto `device` ('cpu', 'cuda', 'cuda:N').

    mode (per Consumer, or per receive() call):
      'copy' (default): each receive() allocates ONE torch buffer on `device`
          (the caching allocator reuses it once you drop the last tensor) and
          returns views into it. The tensors own their memory: keep them as
          long as you like (all of a sync's tensors share that one buffer, so
          holding any of them holds the whole sync's memory).
      'staging': zero-copy views of a buffer the consumer reuses (CUDA: the
          library's staging buffer, filled with one H2D copy per slot; CPU: a
          cached host buffer). The tensors are valid only until the next
          receive()/receive_into()/close() on this consumer: copy out what
          you keep (load_weights() does).
    """

    def __init__(
        self,
        name: str,
        device: Union[str, torch.device] = "cpu",
        *,
        open_timeout: float = 30.0,
        chunk_timeout: float = 60.0,
        pin: Union[str, bool] = "auto",
        verify_checksums: bool = True,
        mode: str = "copy",
        group_access: bool = False,
        trusted_uids=None,
    ):
        self._pid = os.getpid()
        self._c = None
        self.device = _parse_device(device)
        if mode not in ("copy", "staging"):
            raise ValueError("mode must be 'copy' or 'staging'")
        self.mode = mode
        self._lock = threading.RLock()
        self._pending = None  # SyncInfo from wait_sync() not yet read
        self._view = None  # the StoreView hold() handed out, while held
        self._host_buf: Optional[torch.Tensor] = None
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                self._c = _C.Consumer(name, open_timeout=open_timeout, chunk_timeout=chunk_timeout, pin=pin,
                                      verify_checksums=verify_checksums, group_access=group_access,
                                      trusted_uids=trusted_uids)
        else:
            self._c = _C.Consumer(name, open_timeout=open_timeout, chunk_timeout=chunk_timeout, pin=pin,
                                  verify_checksums=verify_checksums, group_access=group_access,
                                  trusted_uids=trusted_uids)

    # -------------------------------------------------------- receiving

    def receive(self, timeout: Optional[float] = 30.0, *, mode: Optional[str] = None, names=None,
                slices: Optional[Mapping] = None) -> list:
        """Waits for the next sync (timeout in seconds; None waits forever) and
        returns its tensors as a list of (name, tensor) on this consumer's
        device, in the producer's order: what model.load_weights() takes.

        names: only these tensors (an iterable of names; absent ones are
        skipped). slices: name -> (dim, start, length): that tensor arrives
        as the slice [start, start + length) along dim (a tensor-parallel
        worker's part); only the selected bytes are copied.

        CUDA: the copies are ordered before later work on
        torch.cuda.current_stream(device). See the class doc for `mode`."""
        with self._lock:
            self.wait_sync(timeout)
            return self.read(mode=mode, names=names, slices=slices)

    def wait_sync(self, timeout: Optional[float] = 30.0):
        """Step 1 of receive(): waits for the next sync and returns its
        SyncInfo (version, tensors = [(name, dtype, shape, nbytes,
        stream_offset)], ...). Follow with read(), read_into() or skip(); a
        sync left unread is skipped by the next wait_sync()."""
        c = self._live()
        with self._lock:
            self._drop_view()  # the library lets go of a held version at wait_sync()
            info = c.wait_sync(timeout)
            self._pending = info
            return info

    def _drop_view(self):
        ref, self._view = self._view, None
        lease = ref() if ref is not None else None
        if lease is not None:
            lease.released = True

    def read(self, *, mode: Optional[str] = None, names=None, slices: Optional[Mapping] = None) -> list:
        """Step 2 of receive(): reads the sync wait_sync() returned into
        tensors on this consumer's device; returns [(name, tensor), ...]."""
        c = self._live()
        with self._lock:
            info = self._take_pending()
            try:
                if names is not None or slices or info.world_size > 1:
                    return self._read_selected(c, info, mode or self.mode, names, slices)
                return self._read(c, info, mode or self.mode)
            except BaseException:
                self._skip_quietly(c)
                raise

    def _take_pending(self):
        info = self._pending
        if info is None:
            raise _C.InvalidArgument("no sync to read: call wait_sync() first")
        self._pending = None
        return info

    def _read(self, c, info, mode) -> list:
        tensors = info.tensors
        for t in tensors:  # fail before reading when a dtype cannot be represented
            if t[1] not in _FROM_NAME:
                torch_dtype(t[1])
        nbytes = info.stream_bytes
        dev = self.device
        what = f"sync {info.version} of '{c.name}'"
        if dev.type == "cpu":
            if mode == "staging":
                buf = self._host_buf
                if buf is None or buf.numel() < nbytes:
                    self._host_buf = buf = None  # the old one goes first
                    buf = self._host_buf = _alloc(_round_up(max(nbytes, 1), 1 << 21), torch.uint8, dev, what)
            else:
                buf = _alloc(_round_up(max(nbytes, 1), 256), torch.uint8, dev, what)
            base = buf.data_ptr()
            c.read_into([base + t[4] if t[3] else None for t in tensors])
            return _views(buf, tensors)
        with torch.cuda.device(dev):
            stream = torch.cuda.current_stream(dev).cuda_stream
            if mode == "staging":
                ptrs = c.read_to_staging(dev.index, stream)
                if nbytes == 0 or not ptrs:
                    return _views(torch.empty(256, dtype=torch.uint8, device=dev), tensors)
                base = ptrs[0] - tensors[0][4]
                buf = torch.as_tensor(_CudaArray(base, nbytes, self), device=dev)
                return _views(buf, tensors)
            buf = _alloc(_round_up(max(nbytes, 1), 256), torch.uint8, dev, what)
            base = buf.data_ptr()
            c.read_into_device([base + t[4] if t[3] else None for t in tensors], stream)
            return _views(buf, tensors)

    def _read_selected(self, c, info, mode, names, slices) -> list:
        """The general read: some tensors (names), some of them sliced, from
        one or several producer ranks. One buffer, each tensor (or slice)
        packed at a 256-byte boundary."""
        want = None if names is None else set(names)
        slices = _check_slices(info, slices or {})
        picked, ptrs, sels, total = [], [None] * len(info.tensors), [None] * len(info.tensors), 0
        for j, (name, dt, shape, nbytes, _off) in enumerate(info.tensors):
            if want is not None and name not in want:
                continue
            if dt not in _FROM_NAME:
                torch_dtype(dt)  # raises the explanatory TypeError
            sel = slices.get(name)
            if sel is not None:
                shape = shape[:sel[0]] + (sel[2],) + shape[sel[0] + 1:]
                nbytes = _ELEM_SIZE[_FROM_NAME[dt]] * math.prod(shape)
                sels[j] = sel
            total = _round_up(total, 256)
            picked.append((j, (name, dt, shape, nbytes, total)))
            total += nbytes
        dev = self.device
        what = f"sync {info.version} of '{c.name}'"
        if dev.type == "cpu" and mode == "staging":
            buf = self._host_buf
            if buf is None or buf.numel() < total:
                self._host_buf = buf = None
                buf = self._host_buf = _alloc(_round_up(max(total, 1), 1 << 21), torch.uint8, dev, what)
        else:
            buf = _alloc(_round_up(max(total, 1), 256), torch.uint8, dev, what)
        base = buf.data_ptr()
        for j, t in picked:
            ptrs[j] = base + t[4] if t[3] else None
        selections = sels if slices else None
        if dev.type == "cpu":
            c.read_into(ptrs, selections)
        else:
            with torch.cuda.device(dev):
                c.read_into_device(ptrs, torch.cuda.current_stream(dev).cuda_stream, selections)
        return _views(buf, [t for _, t in picked])

    def receive_into(self, tensors: Mapping, timeout: Optional[float] = 30.0, *, strict: bool = True,
                     slices: Optional[Mapping] = None) -> int:
        """Waits for the next sync and copies it straight into the given
        tensors (a mapping name -> preallocated tensor, CPU or CUDA, e.g. a
        model's parameters). Returns the sync's version.

        Every destination must match its tensor's dtype and shape exactly
        and be a dense CPU or CUDA tensor whose elements each have their own
        memory (not an expand()ed view); it may be non-contiguous, and may
        require grad (written as load_state_dict writes: under no_grad).
        strict=True: the sync's names and the mapping's names must be the
        same set; strict=False: tensors of the sync without a destination
        are skipped and destinations absent from the sync are left alone.
        All of this is checked before the first byte is read: on any
        mismatch the sync is skipped, nothing is written, and
        shmcast.Mismatch is raised. (A read that fails later, e.g. the
        producer died, may leave destinations partly written.)"""
        with self._lock:
            self.wait_sync(timeout)
            return self.read_into(tensors, strict=strict, slices=slices)

    def read_into(self, tensors: Mapping, *, strict: bool = True, slices: Optional[Mapping] = None) -> int:
        """Step 2 of receive_into(): copies the sync wait_sync() returned into
        `tensors`. slices: name -> (dim, start, length); that destination
        then has the shape of the slice [start, start + length) along dim of
        the sync's tensor, and only those bytes are copied."""
        c = self._live()
        with self._lock:
            info = self._take_pending()
            try:
                return self._read_into(c, info, tensors, strict, slices or {})
            except BaseException:
                self._skip_quietly(c)
                raise

    def _read_into(self, c, info, dsts: Mapping, strict: bool, slices: Mapping) -> int:
        # Every destination is checked before the first byte is read: on any
        # problem the sync is skipped and no destination is touched.
        slices = _check_slices(info, slices)
        sels = [None] * len(info.tensors)
        problems = []
        plan = []  # (sync index, destination, nbytes)
        cuda_dev = None
        seen = 0
        for j, (name, dt, shape, nbytes, _off) in enumerate(info.tensors):
            d = dsts.get(name)
            if d is None:
                if strict:
                    problems.append(f"'{name}' is in the sync but has no destination")
                continue
            seen += 1
            why = _unwritable(d)
            if why is not None:
                problems.append(f"'{name}': {why}")
                continue
            want = _FROM_NAME.get(dt)
            if d.dtype != want:
                problems.append(f"'{name}': the sync has dtype {want or dt}, the destination {d.dtype}")
            sel = slices.get(name)
            if sel is not None:
                sels[j] = sel
                shape = shape[:sel[0]] + (sel[2],) + shape[sel[0] + 1:]
                nbytes = (_ELEM_SIZE[want] * math.prod(shape)) if want is not None else 0
            if tuple(d.shape) != shape:
                what = "slice" if sel is not None else "shape"
                problems.append(f"'{name}': the sync's {what} is {list(shape)}, the destination {list(d.shape)}")
            if d.is_cuda:
                if cuda_dev is None:
                    cuda_dev = d.device
                elif d.device != cuda_dev:
                    problems.append(f"'{name}' is on {d.device} but others are on {cuda_dev}: one GPU per receive_into")
            plan.append((j, d, nbytes))
        if strict and seen < len(dsts):
            names = {t[0] for t in info.tensors}
            missing = [n for n in dsts if n not in names]
            if missing:
                problems.append(f"{len(missing)} destination(s) not in the sync, e.g. '{missing[0]}'")
        if problems:
            shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            raise Mismatch(f"sync {info.version} does not match the destinations: {shown}")
        ptrs = [None] * len(info.tensors)
        after = []  # (destination, temporary): copied once the read is done
        for j, d, nbytes in plan:
            if not nbytes:
                continue
            # read_into_device takes device pointers only: in a CUDA receive,
            # CPU destinations (like non-contiguous ones) land in temporaries.
            if d.is_contiguous() and not (d.is_conj() or d.is_neg()) and (cuda_dev is None or d.is_cuda):
                ptrs[j] = d.data_ptr()
            else:
                tmp = _alloc(tuple(d.shape), d.dtype, cuda_dev if cuda_dev is not None else d.device,
                             f"sync {info.version}: the temporary for '{info.tensors[j][0]}'")
                after.append((d, tmp))
                ptrs[j] = tmp.data_ptr()
        selections = sels if slices else None
        if cuda_dev is None:
            c.read_into(ptrs, selections)
            _copy_back(after)
        else:
            with torch.cuda.device(cuda_dev):
                c.read_into_device(ptrs, torch.cuda.current_stream(cuda_dev).cuda_stream, selections)
                _copy_back(after)  # on the current stream, after the read
        return info.version

    def _skip_quietly(self, c):
        try:
            c.skip()
        except _C.Error:
            pass

    def hold(self, timeout: Optional[float] = 30.0) -> "StoreView":
        """Store regions: the newest version this consumer has not read
        (waiting up to `timeout` for one), as zero-copy CPU tensors that are
        views into the pinned region. See StoreView for their lifetime."""
        c = self._live()
        with self._lock:
            self.wait_sync(timeout)
            info = self._take_pending()
            try:
                lease = _StoreLease(self)
                view = StoreView(lease, info, c.views())
            except BaseException:  # views() refused, or a tensor torch cannot make: let go of the version
                self._skip_quietly(c)
                raise
            # Weak: once no tensor of the view is left, its lease is
            # collected and lets go of the version (_StoreLease.__del__).
            self._view = weakref.ref(lease)
            return view

    # -------------------------------------------------------- the rest

    def skip(self) -> None:
        """Releases the rest of the current sync without reading it (and a
        held store version: StoreView.release())."""
        c = self._live()
        with self._lock:
            self._pending = None
            self._drop_view()
            c.skip()

    def close(self) -> None:
        """Leaves the seat (the producer stops waiting for this consumer),
        unpins and unmaps. Staging views from receive() become invalid.
        A StoreView's tensors still alive: the version is let go now (the
        tensors are invalid), and the region is unmapped only once the last
        of them is gone, so touching them never faults."""
        if not self._owned() or getattr(self, "_deferred_close", False):
            return
        c = getattr(self, "_c", None)
        lock = getattr(self, "_lock", None)
        if lock is not None:
            with lock:
                ref = getattr(self, "_view", None)
                lease = ref() if ref is not None else None
                if ref is not None:
                    self._drop_view()
                if lease is not None and c is not None and not c.closed:
                    self._skip_quietly(c)
                    lease.close_consumer = True  # the lease closes c when the last tensor goes
                    self._deferred_close = True
                    self._host_buf = None
                    return
        if c is not None and not c.closed:
            c.close()
        self._host_buf = None

    @property
    def closed(self) -> bool:
        return self._c is None or self._c.closed or getattr(self, "_deferred_close", False)

    @property
    def raw(self) -> "_C.Consumer":
        """The low-level binding (pointers as ints)."""
        return self._live()

    def _live(self):
        c = self._c
        if c is None or getattr(self, "_deferred_close", False):
            raise _C.Closed("this consumer is closed")
        c.check()  # closed: Closed; in a forked child: InvalidArgument
        return c

    name = property(lambda self: self._c.name)
    seat = property(lambda self: self._c.seat)
    region_mode = property(lambda self: self._c.mode, doc="'ring' or 'store': what the region does")
    last_version = property(lambda self: self._c.last_version)
    last_sync = property(lambda self: self._c.sync, doc="SyncInfo of the last sync received")
    pinned = property(lambda self: self._c.pinned)
    views_read_only = property(
        lambda self: self._c.views_read_only,
        doc="Store regions: True when this process maps the stored versions read-only, so that a write that "
            "bypasses ReadOnlyTensor's checks faults; False where a GPU driver needed them pinned writable.")

    def __repr__(self):
        if self._c is None:
            return "<shmcast.Consumer (not open)>"
        state = "closed" if self._c.closed else f"seat {self._c.seat}"
        return f"<shmcast.Consumer '{self._c.name}' on {self.device} {state}>"


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


def _check_slices(info, slices: Mapping) -> dict:
    """name -> (dim, start, length), checked against the sync (Mismatch)."""
    out = {}
    if not slices:
        return out
    shapes = {t[0]: t[2] for t in info.tensors}
    for name, sel in slices.items():
        shape = shapes.get(name)
        if shape is None:
            continue  # not in this sync: nothing to slice
        try:
            dim, start, length = (int(x) for x in sel)
        except (TypeError, ValueError):
            raise Mismatch(f"slice of '{name}': expected (dim, start, length), got {sel!r}") from None
        if dim < 0:
            dim += len(shape)
        if not (0 <= dim < len(shape)) or start < 0 or length < 0 or start + length > shape[dim]:
            raise Mismatch(f"slice of '{name}': rows [{start}, +{length}) along dim {dim} do not fit its shape "
                           f"{list(shape)}")
        out[name] = (dim, start, length)
    return out


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a
