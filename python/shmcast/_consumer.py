"""The consumer: Consumer.receive() / receive_into() / hold(), and the
checks on what a read asks for (slices, destinations: Mismatch).
"""
from __future__ import annotations

import collections
import os
import threading
import weakref
from collections.abc import Mapping
from typing import Optional, Union

import torch

from . import _shmcast as _C
from ._batch import gc_paused, plain_destinations
from ._dtypes import _FROM_NAME, torch_dtype
from ._memory import (_DATA_ALIGN, _TENSOR_ALIGN, _alloc, _Closing, _copy_back, _CudaArray, _parse_device,
                      _round_up, _TensorAt, _unwritable, _views)
from ._store import StoreView, _StoreLease


class Mismatch(_C.InvalidArgument):
    """receive_into(): the sync does not match the destination tensors (names,
    dtypes or shapes), or a destination cannot take its bytes (overlapping
    memory, not a dense CPU/CUDA tensor). The sync was skipped; the
    destinations are untouched."""

    code = "InvalidArgument"


def _check_slices(info, slices: Mapping) -> dict:
    """name -> (dim, start, length), checked against the sync (Mismatch)."""
    out = {}
    if not slices:
        return out
    tensors = {t.name: t for t in map(_TensorAt._make, info.tensors)}
    for name, sel in slices.items():
        t = tensors.get(name)
        if t is None:
            continue  # not in this sync: nothing to slice
        try:
            dim, start, length = (int(x) for x in sel)
        except (TypeError, ValueError):
            raise Mismatch(f"slice of '{name}': expected (dim, start, length), got {sel!r}") from None
        shape = t.shape
        if dim < 0:
            dim += len(shape)  # Python's convention: from the end
        # The library's check (shmcast::Selection::problem); what the binding
        # cannot take (a dim still negative, a negative or huge start or
        # length) is InvalidArgument there, out of range here too.
        try:
            why = _C.selection_problem(t, (dim, start, length))
        except _C.InvalidArgument as e:
            why = str(e)
        if why:
            raise Mismatch(f"slice of '{name}': rows [{start}, +{length}) along dim {dim} do not fit its shape "
                           f"{list(shape)}")
        out[name] = (dim, start, length)
    return out


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

    Delta regions (Producer(delta=True); `delta` is True): receive() and
    read() keep the consumer's own copy of the tensors it reads, a buffer
    on `device` per set of tensors read (one per bucket when an update
    comes as buckets) that stays in place while the same tensors (names,
    slices) are asked for, and each delta sync is applied to it; 'copy'
    returns a copy of it (so twice the sync's memory), 'staging' views of
    it (do not write into them: they are what the next delta applies to).
    receive_into() keeps the temporaries of its non-contiguous destinations
    the same way. A delta sync that cannot apply (other destinations, names
    or slices than the read of its base) raises shmcast.NeedsFullSync after
    asking the producer for a full sync: call again for it. With
    verify_checksums=True (the default) every piece a delta is applied to is
    checked (shmcast.Corrupt when the result is not what the producer
    sent); a `slices` entry that holds only part of a producer rank's piece
    (a TP slice of a tensor the producer sends whole) cannot be checked, so
    such a delta is refused the same way (NeedsFullSync, nothing written, a
    full sync requested). verify_checksums=False applies it unchecked, at
    your own risk.

    Device slots (Producer(slot_memory='device'); `slot_memory` is
    'device'): the slots are GPU memory of the producer's GPU, mapped here
    at open; every read is a copy by the GPU, into `device` (a CUDA
    consumer's) or into host memory (a CPU consumer's, through the current
    CUDA device). A process that cannot map them (no GPU, the GPU not
    visible here nor reachable by peer access) gets shmcast.Unsupported
    from the constructor.
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
        self.verify_checksums = bool(verify_checksums)
        self._lock = threading.RLock()
        self._pending = None  # SyncInfo from wait_sync() not yet read
        self._view = None  # the StoreView hold() handed out, while held
        self._host_buf: Optional[torch.Tensor] = None
        self._delta = False  # the region sends delta syncs (set below, or by the first delta sync)
        # Delta regions: receive()'s own copies that deltas apply to, by the
        # tensors and slices read (one per bucket), least recently read first.
        self._kept: "collections.OrderedDict" = collections.OrderedDict()
        self._tmps: dict = {}  # delta regions: receive_into()'s temporaries by name (kept in place)
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                self._c = _C.Consumer(name, open_timeout=open_timeout, chunk_timeout=chunk_timeout, pin=pin,
                                      verify_checksums=verify_checksums, group_access=group_access,
                                      trusted_uids=trusted_uids, device=self.device.index)
        else:
            self._c = _C.Consumer(name, open_timeout=open_timeout, chunk_timeout=chunk_timeout, pin=pin,
                                  verify_checksums=verify_checksums, group_access=group_access,
                                  trusted_uids=trusted_uids)
        self._delta = bool(self._c.delta)

    # -------------------------------------------------------- receiving

    def receive(self, timeout: Optional[float] = 30.0, *, mode: Optional[str] = None, names=None,
                slices: Optional[Mapping] = None) -> list:
        """Waits for the next sync (timeout in seconds; None waits forever) and
        returns its tensors as a list of (name, tensor) on this consumer's
        device, in the producer's order: what model.load_weights() takes.

        names: only these tensors (an iterable of names; absent ones are
        skipped). slices: name -> (dim, start, length): that tensor arrives
        as the slice [start, start + length) along dim (a tensor-parallel
        worker's part); only the selected bytes are copied. On a delta
        region, a slice that holds only part of a producer rank's piece
        takes deltas only with verify_checksums=False (see the class doc).

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
                if self._delta or info.delta:
                    self._delta = True
                    return self._read_kept(c, info, mode or self.mode, names, slices)
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
        for _name, dt, _shape, _n, _off in tensors:  # fail before reading when a dtype cannot be represented
            if dt not in _FROM_NAME:
                torch_dtype(dt)
        nbytes = info.stream_bytes
        dev = self.device
        what = f"sync {info.version} of '{c.name}'"
        if dev.type == "cpu":
            if mode == "staging":
                buf = self._host_buf
                if buf is None or buf.numel() < nbytes:
                    self._host_buf = buf = None  # the old one goes first
                    buf = self._host_buf = _alloc(_round_up(max(nbytes, 1), _DATA_ALIGN), torch.uint8, dev, what)
            else:
                buf = _alloc(_round_up(max(nbytes, 1), _TENSOR_ALIGN), torch.uint8, dev, what)
            base = buf.data_ptr()
            c.read_into([base + off if n else None for _name, _dt, _shape, n, off in tensors])
            return _views(buf, tensors)
        with torch.cuda.device(dev):
            stream = torch.cuda.current_stream(dev).cuda_stream
            if mode == "staging":
                ptrs = c.read_to_staging(dev.index, stream)
                if nbytes == 0 or not ptrs:
                    return _views(torch.empty(_TENSOR_ALIGN, dtype=torch.uint8, device=dev), tensors)
                base = ptrs[0] - _TensorAt._make(tensors[0]).offset
                buf = torch.as_tensor(_CudaArray(base, nbytes, self), device=dev)
                return _views(buf, tensors)
            buf = _alloc(_round_up(max(nbytes, 1), _TENSOR_ALIGN), torch.uint8, dev, what)
            base = buf.data_ptr()
            c.read_into_device([base + off if n else None for _name, _dt, _shape, n, off in tensors], stream)
            return _views(buf, tensors)

    @staticmethod
    def _pack(info, names, slices):
        """The tensors `names` (None: all) of the sync, some sliced, packed
        in one buffer at _TENSOR_ALIGN (256) byte boundaries: [(sync index,
        _TensorAt)], the selections (None when nothing is sliced) and the
        buffer's bytes."""
        want = None if names is None else set(names)
        slices = _check_slices(info, slices or {})
        picked, sels, total = [], [None] * len(info.tensors), 0
        for j, t in enumerate(info.tensors):
            name, dt, shape, nbytes, _off = t
            if want is not None and name not in want:
                continue
            if dt not in _FROM_NAME:
                torch_dtype(dt)  # raises the explanatory TypeError
            sel = slices.get(name)
            if sel is not None:
                shape = shape[:sel[0]] + (sel[2],) + shape[sel[0] + 1:]
                nbytes = _C.selection_bytes(t, sel)
                sels[j] = sel
            total = _round_up(total, _TENSOR_ALIGN)
            picked.append((j, _TensorAt(name, dt, shape, nbytes, total)))
            total += nbytes
        return picked, (sels if slices else None), total

    def _read_selected(self, c, info, mode, names, slices) -> list:
        """The general read: some tensors (names), some of them sliced, from
        one or several producer ranks. One buffer, each tensor (or slice)
        packed at a _TENSOR_ALIGN (256) byte boundary."""
        picked, selections, total = self._pack(info, names, slices)
        dev = self.device
        what = f"sync {info.version} of '{c.name}'"
        if dev.type == "cpu" and mode == "staging":
            buf = self._host_buf
            if buf is None or buf.numel() < total:
                self._host_buf = buf = None
                buf = self._host_buf = _alloc(_round_up(max(total, 1), _DATA_ALIGN), torch.uint8, dev, what)
        else:
            buf = _alloc(_round_up(max(total, 1), _TENSOR_ALIGN), torch.uint8, dev, what)
        self._fill(c, buf, info, picked, selections)
        return _views(buf, [t for _, t in picked])

    def _fill(self, c, buf, info, picked, selections) -> None:
        """Reads the sync into `buf` as _pack() laid it out."""
        dev = self.device
        base = buf.data_ptr()
        ptrs = [None] * len(info.tensors)
        for j, t in picked:
            ptrs[j] = base + t.offset if t.nbytes else None
        if dev.type == "cpu":
            c.read_into(ptrs, selections)
        else:
            with torch.cuda.device(dev):
                c.read_into_device(ptrs, torch.cuda.current_stream(dev).cuda_stream, selections)

    def _read_kept(self, c, info, mode, names, slices) -> list:
        """Delta regions: the sync is read into the consumer's own copy, a
        buffer per set of tensors and slices read (an update sent as buckets
        has one per bucket) that stays where it is while the same tensors
        and slices are read (the library applies a delta sync only to the
        destinations that hold its base). 'staging' returns views of that
        buffer, 'copy' a copy of it."""
        picked, selections, total = self._pack(info, names, slices)
        dev = self.device
        what = f"sync {info.version} of '{c.name}'"
        key = (tuple(picked), None if selections is None else tuple(selections))
        kept = self._kept
        buf = kept.get(key)
        if buf is not None:
            kept.move_to_end(key)
        else:
            # Copies of the same tensors under another key (regrouped, or
            # other slices) go first, and the oldest beyond the library's
            # max_delta_groups; the library forgets what they held (their
            # memory may come back as another buffer).
            read = {t.name for _, t in picked}
            stale = [kept.pop(k) for k in [k for k in kept if any(t.name in read for _, t in k[0])]]
            while len(kept) >= _C.max_delta_groups:
                stale.append(kept.popitem(last=False)[1])
            for old in stale:
                c.forget_destinations(old.data_ptr(), old.numel())
            del stale
            buf = _alloc(_round_up(max(total, 1), _TENSOR_ALIGN), torch.uint8, dev, what)
            kept[key] = buf
        self._fill(c, buf, info, picked, selections)
        if mode != "staging":
            out = _alloc(buf.numel(), torch.uint8, dev, what)
            out.copy_(buf)  # CUDA: on the current stream, after the read
            buf = out
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
        the sync's tensor, and only those bytes are copied. A delta sync
        whose pieces a slice holds only in part raises NeedsFullSync before
        anything is written, unless verify_checksums=False (class doc)."""
        c = self._live()
        with self._lock:
            info = self._take_pending()
            try:
                return self._read_into(c, info, tensors, strict, slices or {})
            except BaseException:
                self._skip_quietly(c)
                raise

    def _read_into_batched(self, c, info, dsts: Mapping, strict: bool) -> Optional[int]:
        """_read_into() for the common case, checked by one C++ loop over the
        sync's tensors (_batch.plain_destinations): every tensor of the sync
        has a destination (and, when strict, nothing else does) that is a
        plain contiguous tensor of its dtype and shape, all on the CPU or all
        on one GPU. Returns the version once read, or None before anything
        is read when the case is another (_read_into() then checks each
        destination and says what is wrong). A GPU batch is read as
        _read_into() reads CUDA destinations: in the device's context, on
        its current stream."""
        if type(dsts) is not dict:
            dsts = dict(dsts.items())  # the names and tensors _read_into would look up
        with gc_paused():
            plain = plain_destinations(info, dsts, strict)
        if plain is None:
            return None
        # As _read_into leaves them: no temporary is needed, and a delta
        # region's kept temporaries stay as they are.
        keep = self._delta or info.delta
        self._delta = keep
        if not keep:
            self._tmps = {}
        if plain.device < 0:
            c.read_plain(plain, None)
        else:
            cuda_dev = torch.device("cuda", plain.device)
            with torch.cuda.device(cuda_dev):
                c.read_plain(plain, torch.cuda.current_stream(cuda_dev).cuda_stream)
        return info.version

    def _read_into(self, c, info, dsts: Mapping, strict: bool, slices: Mapping) -> int:
        # Every destination is checked before the first byte is read: on any
        # problem the sync is skipped and no destination is touched.
        if not slices:
            version = self._read_into_batched(c, info, dsts, strict)
            if version is not None:
                return version
        slices = _check_slices(info, slices)
        sels = [None] * len(info.tensors)
        problems = []
        plan = []  # (sync index, destination, nbytes)
        cuda_dev = None
        seen = 0
        for j, t in enumerate(info.tensors):
            name, dt, shape, nbytes, _off = t
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
                nbytes = _C.selection_bytes(t, sel)
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
            names = {t.name for t in map(_TensorAt._make, info.tensors)}
            missing = [n for n in dsts if n not in names]
            if missing:
                problems.append(f"{len(missing)} destination(s) not in the sync, e.g. '{missing[0]}'")
        if problems:
            shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            raise Mismatch(f"sync {info.version} does not match the destinations: {shown}")
        ptrs = [None] * len(info.tensors)
        after = []  # (destination, temporary): copied once the read is done
        # Delta regions: a delta applies only to the destinations that hold
        # its base, so temporaries are kept by name (same pointers next time;
        # they hold the base, whatever happened to the destination), those of
        # other tensors too (buckets: each sync has other tensors).
        keep = self._delta or info.delta
        self._delta = keep
        # Kept in place as the loop goes: an error in it (a temporary that
        # cannot be allocated) must not drop the temporaries of the other
        # tensors, which the library still holds as the base of their syncs.
        old_tmps = self._tmps
        tmps = self._tmps = old_tmps if keep else {}
        for j, d, nbytes in plan:
            if not nbytes:
                continue
            # read_into_device takes device pointers only: in a CUDA receive,
            # CPU destinations (like non-contiguous ones) land in temporaries.
            if d.is_contiguous() and not (d.is_conj() or d.is_neg()) and (cuda_dev is None or d.is_cuda):
                ptrs[j] = d.data_ptr()
            else:
                name = _TensorAt._make(info.tensors[j]).name
                tdev = cuda_dev if cuda_dev is not None else d.device
                tmp = tmps.pop(name, None) if keep else None
                if tmp is None or tmp.shape != d.shape or tmp.dtype != d.dtype or tmp.device != tdev:
                    if tmp is not None:  # its memory may come back as another buffer
                        c.forget_destinations(tmp.data_ptr(), tmp.numel() * tmp.element_size())
                    tmp = None
                    tmp = _alloc(tuple(d.shape), d.dtype, tdev, f"sync {info.version}: the temporary for '{name}'")
                if keep:
                    tmps[name] = tmp
                after.append((d, tmp))
                ptrs[j] = tmp.data_ptr()
        del old_tmps
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

    def request_full_sync(self) -> None:
        """Delta regions: asks the producer for a full sync as its next one,
        for destinations that changed since the last receive (weights
        discarded or reloaded); no delta is applied to them meanwhile. Does
        nothing on other regions."""
        c = self._live()
        with self._lock:
            c.request_full_sync()

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
                    self._kept = collections.OrderedDict()
                    self._tmps = {}
                    return
        if c is not None and not c.closed:
            c.close()
        self._host_buf = None
        self._kept = collections.OrderedDict()
        self._tmps = {}

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
    sync_info = property(lambda self: self._c.sync, doc="SyncInfo of the last sync wait_sync() (or a receive) took")
    last_sync = property(lambda self: self._c.last_sync,
                         doc="The last sync read into tensors (receive(), receive_into(), read()): {'version', 'kind' "
                             "('full' | 'delta'; None before the first), 'logical_bytes' (the bytes of what was read: "
                             "tensors, slices), 'payload_bytes' (the bytes that came through the region: the deltas' "
                             "and any tensor sent whole, for a delta sync)}")
    delta = property(lambda self: self._delta,
                     doc="True when the region sends delta syncs (Producer(delta=True)): receive() keeps its own copy")
    pinned = property(lambda self: self._c.pinned)
    slot_memory = property(lambda self: self._c.slot_memory,
                           doc="'host' or 'device': where the region's slots live (Producer(slot_memory=...))")
    views_read_only = property(
        lambda self: self._c.views_read_only,
        doc="Store regions: True when this process maps the stored versions read-only, so that a write that "
            "bypasses ReadOnlyTensor's checks faults; False where a GPU driver needed them pinned writable.")

    def __repr__(self):
        if self._c is None:
            return "<shmcast.Consumer (not open)>"
        state = "closed" if self._c.closed else f"seat {self._c.seat}"
        return f"<shmcast.Consumer '{self._c.name}' on {self.device} {state}>"
