"""Receiving syncs and loading them into a model: the code that every adapter
(vLLM worker extension and weight-transfer backend, ROLL tickets, verl
checkpoint engine, SGLang loader) shares.

* default_device(): where a worker's consumer receives (its CUDA device, else CPU).
* ConsumerCache: one Consumer per region, reopened when closed or when the
  region was recreated by a new producer (a restarted trainer).
* wait_for(): waits for a given sync version, skipping older syncs and
  reporting a newer one (this receiver missed a sync).
* load_whole(): receives a sync whole and hands it to model.load_weights(),
  which maps HF names onto the model's (fused, sharded) parameters: works for
  every model vLLM or SGLang can load, quantized ones included.
* DirectLoader: receives only this tensor-parallel rank's slice of each
  tensor straight into the parameters (shmcast.tp plans where), with no
  staging copy and no load_weights() call: for unquantized models in HF
  layout.

Delta syncs (Producer(delta=True)): load_whole() reads through the
consumer's own copy (Consumer.read keeps one on a delta region), so a loader
that transforms the weights (quantization on load) never sees a delta.
DirectLoader applies deltas to the parameters in place, and only while they
still hold what its last load left there (holds_last_load(): a sample of
their bits); weights discarded or rewritten since (vLLM's level-2 sleep, a
reload into the same memory) turn a delta sync into shmcast.NeedsFullSync,
after asking the producer for a full sync, instead of a wrong result. A TP
rank's slices hold only part of what a one-rank producer sends (whole
tensors), where a delta cannot be checked: with verify_checksums (the
default) DirectLoader asks for a full sync after each load, so its syncs
are full (a sharded producer's delta whose pieces it holds only in part is
refused by the consumer: NeedsFullSync, and the next sync is full).
"""
from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from typing import Dict, Iterable, Optional

import torch

from . import _shmcast as _C
from . import tp as _tp
from ._torch import Consumer

__all__ = ["default_device", "names_digest", "ConsumerCache", "wait_for", "load_whole", "DirectLoader", "Loaded",
           "region_token"]


def tp_rank_size():
    """This vLLM worker's tensor-parallel rank and size ((0, 1) outside vLLM
    or without a model-parallel group)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except (ImportError, AssertionError, AttributeError):  # no model-parallel group: a single worker
        return 0, 1


def default_device(device=None) -> torch.device:
    """`device` as a torch.device with an index; None: the current CUDA
    device when there is one, else the CPU."""
    if device is not None:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def names_digest(names: Iterable[str]) -> str:
    """blake2b-64 of the names in order: what a receiver checks a manifest against."""
    h = hashlib.blake2b(digest_size=8)
    for n in names:
        h.update(n.encode())
        h.update(b"\0")
    return h.hexdigest()


def region_token(region: str) -> str:
    """Identifies one incarnation of a region: a producer that recreates the
    name (a restarted trainer) makes a new file, so a new token. A consumer
    attached to the old file compares tokens to know it must reattach."""
    st = os.stat(_C.region_path(region))
    return f"{st.st_dev}:{st.st_ino}"


class ConsumerCache:
    """Consumers by region, for a process that receives from one or a few
    regions over its lifetime. get() reopens a consumer that was closed (an
    error path closes it to give its seat back) or whose region was
    recreated (token differs)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._consumers: Dict[str, Consumer] = {}
        self._tokens: Dict[str, Optional[str]] = {}

    def get(self, region: str, device=None, *, open_timeout: float = 60.0, mode: Optional[str] = None,
            token: Optional[str] = None) -> Consumer:
        """The open consumer of `region`, opening it (waiting up to
        open_timeout for the region) if needed on `device` (None: the cached
        consumer's, else default_device()) in `mode` (None: the cached one's,
        else 'copy'). A cached consumer on another device or in another mode
        is replaced, and so is one of another incarnation of the region
        (token: what region_token() gave on the producer's side)."""
        dev = None if device is None else default_device(device)
        with self._lock:
            c = self._consumers.get(region)
            if c is not None and (c.closed or (dev is not None and c.device != dev)
                                  or (mode is not None and c.mode != mode)
                                  or (token is not None and self._tokens.get(region) != token)):
                c.close()
                c = None
            if c is None:
                c = Consumer(region, device=dev or default_device(), open_timeout=open_timeout, mode=mode or "copy")
                self._consumers[region] = c
                self._tokens[region] = token
            return c

    def peek(self, region: str) -> Optional[Consumer]:
        with self._lock:
            c = self._consumers.get(region)
            return None if c is None or c.closed else c

    def drop(self, region: str) -> None:
        """Closes the consumer of `region` (its seat is freed at once, so a
        producer never waits for a receiver that failed)."""
        with self._lock:
            c = self._consumers.pop(region, None)
            self._tokens.pop(region, None)
        if c is not None:
            c.close()

    def close(self, region: Optional[str] = None) -> None:
        for name in [region] if region is not None else list(self._consumers):
            self.drop(name)

    def __contains__(self, region) -> bool:
        return self.peek(region) is not None


def wait_for(cons: Consumer, version: Optional[int], timeout: Optional[float], *, what: str = ""):
    """Waits for the sync `version` (None: the next one) and returns its
    SyncInfo, leaving it to read. Older syncs are skipped; a newer one means
    this receiver missed `version` (skipped, shmcast.InvalidArgument)."""
    while True:
        try:
            info = cons.wait_sync(timeout)
        except _C.Timeout as e:
            want = "the next sync" if version is None else f"sync {version}"
            raise _C.Timeout(f"{want} of region '{cons.name}' did not arrive: {e}{what}") from None
        if version is None or info.version == version:
            return info
        cons.skip()
        if info.version > version:
            raise _C.InvalidArgument(f"region '{cons.name}' is at sync {info.version}, past the expected "
                                     f"{version}: this receiver missed a sync{what}")


def check_manifest(cons: Consumer, info, count: Optional[int], digest: Optional[str]) -> None:
    """Raises shmcast.Corrupt (and skips the sync) when the manifest's names
    are not the `count` names whose names_digest() is `digest`."""
    if count is None and digest is None:
        return
    names = [t[0] for t in info.tensors]
    if (count is not None and len(names) != count) or (digest is not None and names_digest(names) != digest):
        cons.skip()
        raise _C.Corrupt(f"sync {info.version} of region '{cons.name}' holds {len(names)} tensors whose names do not "
                         f"match the announced {count} (digest {digest})")


@dataclass
class Loaded:
    """What one received sync did: its version, the tensors in it, the bytes
    this receiver copied out of the region and the bytes of the whole sync."""

    version: int
    tensors: int
    bytes_read: int
    bytes_total: int
    mode: str


def load_whole(cons: Consumer, model, *, timeout: Optional[float], version: Optional[int] = None,
               count: Optional[int] = None, digest: Optional[str] = None, mode: Optional[str] = None) -> Loaded:
    """Receives a sync (wait_for(version)) whole and calls
    model.load_weights(weights) with its (name, tensor) pairs in HF naming.
    'staging' views are dropped before returning."""
    info = wait_for(cons, version, timeout)
    check_manifest(cons, info, count, digest)
    weights = cons.read(mode=mode)
    try:
        model.load_weights(weights)
    finally:
        del weights  # staging views must not outlive this call
    return Loaded(info.version, len(info.tensors), info.payload_bytes, info.payload_bytes, "loader")


def cached_direct_loader(cache: dict, key, model) -> "DirectLoader":
    """The DirectLoader of `model` for this worker's TP rank, from `cache`
    (built anew when missing or when the model's parameters moved)."""
    d = cache.get(key)
    if d is None or d.stale():
        rank, size = tp_rank_size()
        d = cache[key] = DirectLoader(model, rank, size)
    return d


class DirectLoader:
    """Receives syncs straight into a model's parameters, each TP rank
    reading only its slices (shmcast.tp.plan). Built once per model; usable
    when `complete` (every parameter reached, every layout understood);
    otherwise `why` says what is missing and callers use load_whole()."""

    def __init__(self, model, tp_rank: int = 0, tp_size: int = 1, params: Optional[dict] = None):
        self.tp_rank, self.tp_size = tp_rank, tp_size
        params = dict(model.named_parameters()) if params is None else params
        packed = _tp.packed_of(model)
        layouts = _tp.describe_model(model, tp_size)
        try:
            self.expected = _tp.expected_hf(layouts, tp_size, packed)
            self.plan = _tp.plan(self.expected, layouts, tp_rank, tp_size, packed)
        except ValueError as e:
            self.expected, self.plan = {}, _tp.Plan(problems=[str(e)])
        self.why = None if self.plan.complete else self.plan.why_incomplete()
        self.dsts: Dict[str, torch.Tensor] = {}
        self.zero = []
        self.skip = set(self.plan.skipped)
        for name, pl in self.plan.placements.items():
            data = params[pl.param].data
            if pl.zero is not None:
                d, start, length = pl.zero
                self.zero.append(data.narrow(d, start, length))
            if pl.length == 0:
                self.skip.add(name)  # a rank past the vocabulary: padding only
                continue
            if data.dim() == 0 or (pl.offset == 0 and pl.length == data.shape[pl.dim]):
                self.dsts[name] = data
            else:
                self.dsts[name] = data.narrow(pl.dim, pl.offset, pl.length)
        self.slices = {n: s for n, s in self.plan.slices().items() if n in self.dsts}
        self._watch = [(p, p.data.data_ptr()) for p in params.values()]
        self._sample = None  # holds_last_load(): the destinations' sampled bits after the last load

    _SAMPLES = 64  # elements sampled per destination

    def _sampled(self) -> torch.Tensor:
        """The raw bytes of up to _SAMPLES elements of every destination, at
        fixed positions spread over it (one buffer, on their device)."""
        parts = []
        for d in self.dsts.values():
            n = d.numel()
            if n == 0:
                continue
            k = min(n, self._SAMPLES)
            idx = torch.arange(k, device=d.device) * (n // k) + (n - 1 - (k - 1) * (n // k)) // 2
            parts.append(torch.take(d.detach(), idx).reshape(-1).view(torch.uint8))
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)

    def holds_last_load(self) -> Optional[bool]:
        """Whether the destinations still hold what the last load() left
        there, as far as a sample of their bits tells (None before the first
        load): False after weights were discarded or rewritten (vLLM's
        level-2 sleep, a reload), when a delta sync must not be applied."""
        if self._sample is None:
            return None
        return torch.equal(self._sampled(), self._sample)

    def stale(self) -> bool:
        """True when a parameter's storage moved since the plan's views were
        taken (a loader that re-created parameters): build a new DirectLoader."""
        return any(p.data.data_ptr() != ptr for p, ptr in self._watch)

    @property
    def complete(self) -> bool:
        return self.why is None

    def load(self, cons: Consumer, *, timeout: Optional[float], version: Optional[int] = None) -> Loaded:
        """Receives the next sync (or sync `version`, receiving past older
        ones) into the parameters. Tensors of the sync that no parameter
        takes are an error (raised after the read: they were not loaded)."""
        kw = {"slices": self.slices} if self.slices else {}
        while True:
            info = cons.wait_sync(timeout)
            if info.delta and self.holds_last_load() is False:
                # The parameters changed since the last load: the delta's base
                # is gone. visit() of a delta sync lets it go, asks the
                # producer for a full sync and raises NeedsFullSync.
                cons.raw.visit(lambda *_: None)
            v = cons.read_into(self.dsts, strict=False, **kw)
            if version is None or v >= version:
                break
        info = cons.sync_info
        for z in self.zero:
            z.zero_()  # vocab padding rows, as vLLM's weight_loader leaves them
        self._sample = self._sampled() if cons.delta else None
        if cons.delta and self.slices and info.world_size == 1 and getattr(cons, "verify_checksums", True):
            # One producer rank sends every tensor whole: a TP slice holds
            # part of it, where a delta cannot be checked (the consumer would
            # refuse it, NeedsFullSync). Ask for the next sync full instead
            # of losing it (verify_checksums=False takes deltas unchecked).
            cons.request_full_sync()
        if version is not None and v != version:
            raise _C.InvalidArgument(f"region '{cons.name}' is at sync {v}, past the expected {version}: this receiver "
                                     "missed a sync")
        unknown = [t[0] for t in info.tensors if t[0] not in self.dsts and t[0] not in self.skip
                   and not t[0].endswith(_tp.SKIP_SUFFIXES)]
        if unknown:
            raise _C.InvalidArgument(
                f"sync {v} of region '{cons.name}' has {len(unknown)} tensor(s) this model has no parameter for, e.g. "
                f"'{unknown[0]}': they were not loaded. Send HF names of this model, or load through "
                "model.load_weights() (load='loader')")
        got = 0
        for name, _dt, shape, nbytes, _off in info.tensors:
            sl = self.slices.get(name)
            if name not in self.dsts:
                continue
            got += nbytes if sl is None or not shape[sl[0]] else nbytes // shape[sl[0]] * sl[2]
        return Loaded(v, len(info.tensors), got, info.payload_bytes, "direct")
