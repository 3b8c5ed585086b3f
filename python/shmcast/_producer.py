"""The producer: Producer.send(named_tensors), and the sharded trainer's
pieces (Shard, DTensor shards).

Tensors cross into C++ as raw pointers; a whole sync is one Python->C++ call
in the common case (every tensor contiguous or a row-pitched 2-D view).
"""
from __future__ import annotations

import operator
import os
from collections.abc import Mapping
from typing import Optional, Union

import torch

from . import _quant
from . import _shmcast as _C
from ._batch import gc_paused, plain_sources
from ._dtypes import _TO_NAME
from ._memory import _Closing, _row_pitch


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
    2 MiB), slots (>= 2), max_consumers, manifest_bytes (None: room for
    the largest sync, reserved sparsely at no cost), group_access,
    replace_stale, unlink_on_close, checksums, stall_policy ('fail' |
    'evict'), consumer_timeout (seconds), pin ('auto' | True | False).

    staging_budget: bytes of temporary GPU copies (non-contiguous CUDA tensors
    that are not row-pitched, DTensor gathers) that may be alive at once
    during a send before the producer waits for their D2H copies. A delta
    producer (delta=True) encodes GPU tensors at the end of a send, so its
    temporary copies all live until then, whatever the budget.

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

    delta=True (ring regions; sharded producers: on every rank): each
    send() after the first carries only the elements whose raw bits changed
    since the previous send of the same tensors (bit-exact for every dtype;
    an update sent as buckets: since that bucket's previous send); the
    producer keeps a copy of the last sent tensors for that
    (delta_base_bytes; a sharded rank: of its own shards, one set of
    tensors at a time). A sharded send is a delta only when it is
    one on every rank: any rank's reason to go full makes it full for all. A send goes out full
    when there is no base for its tensors (names, dtypes, shapes) yet,
    a consumer asked for one (it attached late, skipped a version, or was
    handed other destinations), every keyframe_every-th send (0: never on a
    schedule), or when the deltas would take more than delta_max_ratio of
    the full size (None: the library's default, ProducerOptions). last_sync
    says what the last send was.

    slot_memory='device' (ring regions, every rank alike, without checksums or
    delta; engine 'auto' or 'cuda'): the K slots of slot_bytes are GPU
    memory on slot_device (None: torch's current device), shared with the
    consumers as a file descriptor, and every copy is made by the GPU
    (device-to-device from CUDA tensors, host-to-device from CPU ones).
    Consumers must see that GPU or reach it by peer access; others get
    shmcast.Unsupported when they open the region. No GPU: CudaUnavailable.
    slot_device_bytes says what the slots take on the GPU.

    quantize='fp8-block128' or 'fp8-block128-ue8m0' (a BF16 trainer, an
    FP8 engine; docs/protocol.md §14): the tensors quantize_filter selects
    are sent as torch.float8_e4m3fn plus a float32 '<name>_scale_inv' of
    shape [ceil(M/128), ceil(N/128)] right after each, the layout of a
    block-FP8 checkpoint (weight_block_size [128, 128]); consumers need no
    option. quantize_filter: None (shmcast.default_quantize_filter: 2-D
    '*.weight' with both dims >= 128, not embeddings, lm_head, norms or
    routers), a callable f(name, shape) -> bool, or a model's
    quantization_config (weight_block_size, modules_to_not_convert). CUDA
    tensors are quantized on their GPU by the library's kernels (engine
    'cuda'; with delta=True send them from CPU memory). A NaN or Inf in
    one fails the send (InvalidArgument naming
    the tensor; the consumers' read of that sync gets Aborted). last_sync's
    logical_bytes counts the tensors given, payload_bytes what crossed.
    """

    def __init__(
        self,
        name: str,
        *,
        slot_bytes: int = 256 << 20,
        slots: int = 2,
        max_consumers: int = 8,
        manifest_bytes: Optional[int] = None,
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
        delta: bool = False,
        keyframe_every: int = 0,
        delta_max_ratio: Optional[float] = None,
        slot_memory: str = "host",
        slot_device: Optional[int] = None,
        quantize: Optional[str] = None,
        quantize_filter=None,
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
        if slot_device is None and slot_memory == "device" and torch.cuda.is_available():
            # torch's current device (the library's "current" is the driver
            # context's, which torch.cuda.set_device alone may not have made).
            slot_device = torch.cuda.current_device()
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
            delta=bool(delta),
            keyframe_every=keyframe_every,
            delta_max_ratio=delta_max_ratio,
            slot_memory=slot_memory,
            slot_device=slot_device,
            quantize=None if quantize in (None, "none") else quantize,
            quantize_filter=_quant.filter_arg(quantize_filter),
        )
        self.rank, self.world_size = int(rank), int(world_size)
        self._staging_budget = budget
        # Fixed at create: 'cuda' copies device tensors with async D2H (and
        # host ones with memcpy); 'host' stages CUDA tensors to CPU first.
        self._engine_cuda = self._c.engine == "cuda"
        self._delta = bool(delta)
        self._quantizing = quantize not in (None, "none")
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
                    # The round this send() was for: the version it was given
                    # (any integer type, as _send takes it), else the next.
                    try:
                        named = 0 if version is None or isinstance(version, bool) else operator.index(version)
                    except TypeError:
                        named = 0
                    c.skip_sync(f"send() on rank {self.rank} raised {type(e).__name__} before its sync began: {e}",
                                named if 0 < named < (1 << 63) else 0)
                except _C.Error:
                    pass
            raise

    def sync_names(self, named_tensors) -> list:
        """The names, in order, that send(named_tensors) announces in its
        manifest (what consumers find in sync_info's tensors): the names
        given, and with quantize each selected tensor's scales,
        f"{name}_scale_inv", right after it. For control planes that
        announce a sync's names (a count, a digest) before sending it, as
        the framework backends do. Takes what send() takes (a list or a
        mapping: a generator would be used up); reads names, dtypes and
        (whole) shapes only, sends nothing; raises InvalidArgument where
        send() would refuse the filter's choice. One-rank producers only
        (Unsupported for a sharded one: its manifest merges every rank's list)."""
        return [s[0] for s in self._manifest_specs(named_tensors, "sync_names()")]

    def _manifest_specs(self, named_tensors, what: str) -> list:
        """(name, dtype name, shape) of each tensor of the manifest that
        send(named_tensors) announces (sync_names; roll's bucket check lays
        them out): with quantize, the selected ones in float8 and their
        scales. One-rank producers only."""
        c = self._live()
        if self.world_size > 1:
            raise _C.Unsupported(f"{what} of a sharded producer: a round's manifest merges every rank's list "
                                 "(rank 0 orders it), which one rank cannot know")
        items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
        specs = []
        for name, t in items:
            if type(t) is Shard:
                shape, dt = t.global_shape, t.local.dtype
            else:  # a tensor, or a DTensor (its global shape)
                shape, dt = tuple(t.shape), t.dtype
            d = _TO_NAME.get(dt)
            if d is None:
                raise TypeError(f"'{name}': shmcast cannot carry torch dtype {dt}")
            specs.append((name, d, tuple(int(x) for x in shape)))
        if not self._quantizing:
            return specs
        return list(c.manifest_specs(specs))

    def _send_batched(self, c, names: list, ts: list, want: int) -> Optional[int]:
        """_send() for the common case, checked by one C++ loop over the
        tensors (_batch.plain_sources): every one a plain contiguous tensor
        of a dtype shmcast carries, all on the CPU, or all on one GPU with a
        CUDA engine. Returns the version, or None before anything is sent
        when the case is another (_send() then takes each tensor in turn).
        A GPU batch is sent as _send() sends ready CUDA tensors: in the
        device's context, on its current stream."""
        with gc_paused():
            plain = plain_sources(names, ts)
        if plain is None:
            return None
        if plain.device < 0:
            return c.send_plain(plain, None, want)
        if not self._engine_cuda:
            return None  # a host engine stages CUDA tensors one at a time (_send)
        cuda_dev = torch.device("cuda", plain.device)
        with torch.cuda.device(cuda_dev):
            return c.send_plain(plain, self._stream_of(cuda_dev), want)

    def _send(self, c, named_tensors, version) -> int:
        want = 0 if version is None else _C.check_int(version, "version", 1, (1 << 63) - 1)
        if isinstance(named_tensors, Mapping):
            names, ts = list(named_tensors.keys()), list(named_tensors.values())
            items = zip(names, ts)
        else:
            items = list(named_tensors)
            names, ts = [n for n, _ in items], [t for _, t in items]
        sent = self._send_batched(c, names, ts, want)
        if sent is not None:
            return sent
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
                    # A delta producer reads GPU sources again at end_sync()
                    # (it encodes them there): its staging copies live until
                    # then, whatever the budget.
                    if held_bytes > self._staging_budget and not self._delta:
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
                         doc="The last completed send: {'version', 'kind' ('full' | 'delta'; None before the first), "
                             "'logical_bytes' (the tensors' bytes), 'payload_bytes' (the bytes that went through the "
                             "region: the deltas' for a delta sync)}")
    last_layout = property(lambda self: self._c.last_layout,
                           doc="SentSync of the last send begun: version, first_seq, chunks, stream_bytes, "
                               "payload_bytes (its stream's layout)")
    delta_base_bytes = property(lambda self: self._c.delta_base_bytes,
                                doc="Host memory the delta base takes (one copy of the last sent tensors; 0 without "
                                    "delta=True)")
    pinned = property(lambda self: self._c.pinned)
    slot_memory = property(lambda self: self._c.slot_memory,
                           doc="'host' (slots in the region file) or 'device' (slots on a GPU: slot_memory='device')")
    slot_device = property(lambda self: self._c.slot_device,
                           doc="Device slots: the GPU that holds them (this process's ordinal); -1 for host slots")
    slot_device_bytes = property(lambda self: self._c.slot_device_bytes,
                                 doc="Device slots: GPU bytes they take (slots x slot_bytes, rounded up to the GPU's "
                                     "granularity); 0 for host slots")

    def __repr__(self):
        if self._c is None:
            return "<shmcast.Producer (not created)>"
        state = "closed" if self._c.closed else f"{self._c.slots} x {self._c.slot_bytes} B slots"
        return f"<shmcast.Producer '{self._c.name}' {state}>"
