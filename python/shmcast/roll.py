"""ROLL-style adapters: keep an RPC framework's per-bucket control flow, move
the bytes through shmcast.

ROLL (roll/utils/send_recv_utils.py) serializes each bucket of
(name, tensor) pairs into a payload with `serialize_named_weights(named_weights,
infer_strategy) -> bytes`, ships it through Ray or gloo, and rebuilds the
tensors on the inference side. The drop-ins here have the same shapes, but
the payload is a ticket of a few hundred bytes (region, version, chunk
sequence range, tensor count and a digest of the names): the tensors go
through the shmcast region, and no tensor byte is pickled.

    # sending rank and every inference worker, once, at setup:
    shmcast.roll.create_region("roll-weights")      # sender (or let the first bucket create it)
    shmcast.roll.attach("roll-weights")             # each receiver, before the first bucket
    # trainer, per bucket (FSDP2 DTensors are gathered one tensor at a time):
    payload = shmcast.roll.serialize_named_weights(bucket, "vllm", region="roll-weights", consumers=n_workers)
    # ... the framework ships `payload` as before; each worker:
    named = shmcast.roll.named_tensors_from_ticket(payload)

Not a drop-in: ROLL's receivers unpack the payload as a pickled dict of
tensors and fail on a ticket, so both ends are patched. The receiving end is
one line, in ROLL's vLLM worker extension (roll/third_party/vllm/worker.py,
WorkerBase.update_parameter_in_bucket):

    def update_parameter_in_bucket(self, serialized_named_tensors, is_lora=False):
        return shmcast.roll.update_parameter_in_bucket(self, serialized_named_tensors, is_lora)

which receives this rank's bucket and loads it as ROLL does (and still
accepts ROLL's own payloads). The sending end: the model-update code
(roll/third_party/fsdp2/model_update.py, megatron/model_update.py) calls
shmcast.roll.serialize_named_weights instead of ROLL's. ROLL's SGLang path
(SGLang's update_weights_from_tensor with load_format='flattened_bucket')
is not covered: use shmcast.sglang there.

Checked against alibaba/ROLL @ 8eb27cc2dc34c4d1310b169d9b86d339004d811a
(2026-08-19; checked 2026-12-06): roll/utils/send_recv_utils.py
(serialize_named_weights(named_weights, infer_strategy),
named_tensors_from_bucket(bucket, tensors_meta)), roll/third_party/vllm/
worker.py (update_parameter_in_bucket(serialized_named_tensors,
is_lora=False): serialized_named_tensors[self.rank], load_weights or
tensor_lora_manager.add_weight).

A bucket must fit in the region (slots x slot_bytes): the sender writes the
whole bucket before the ticket exists, so nobody reads while it writes.
"""
from __future__ import annotations

import io
import os
import pickle
import threading
from dataclasses import dataclass
from typing import Optional, Union

import torch

from . import _shmcast as _C
from ._load import ConsumerCache, check_manifest, names_digest, wait_for
from ._torch import Consumer, Producer

__all__ = [
    "ShmcastTicket",
    "serialize_named_weights",
    "named_tensors_from_ticket",
    "attach",
    "create_region",
    "close",
    "default_region",
    "update_parameter_in_bucket",
]

_lock = threading.Lock()
_producers: dict = {}
_consumers = ConsumerCache()


def default_region() -> str:
    """$SHMCAST_ROLL_REGION, else 'roll-weights'."""
    return os.environ.get("SHMCAST_ROLL_REGION", "roll-weights")


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    if not v:
        return default
    try:
        return int(v)
    except ValueError:
        raise _C.InvalidArgument(f"${name} is {v!r}; it must be an int") from None


@dataclass(frozen=True)
class ShmcastTicket:
    """What travels through the RPC framework instead of the tensors."""

    region: str
    version: int         # the sync's version (strictly increasing per region)
    first_seq: int       # the sync's chunk sequence range [first_seq, first_seq + chunks)
    chunks: int
    count: int           # tensors in the bucket
    payload_bytes: int
    names_digest: str    # blake2b-64 of the names in order: the receiver checks the manifest against it
    infer_strategy: str


def create_region(region: Optional[str] = None, **producer_options) -> Producer:
    """Creates (or returns) the cached Producer of `region` on the sending
    rank, e.g. at setup so that receivers can attach() before the first
    bucket. producer_options: Producer keyword arguments (defaults from
    $SHMCAST_ROLL_SLOT_BYTES / _SLOTS / _MAX_CONSUMERS, else 256 MiB x 4
    slots, 8 consumers)."""
    return _producer(region or default_region(), producer_options)


def _producer(region: str, producer_options: dict) -> Producer:
    with _lock:
        p = _producers.get(region)
        if p is None or p.closed:
            opts = dict(
                slot_bytes=_env_int("SHMCAST_ROLL_SLOT_BYTES", 256 << 20),
                slots=_env_int("SHMCAST_ROLL_SLOTS", 4),
                max_consumers=_env_int("SHMCAST_ROLL_MAX_CONSUMERS", 8),
            )
            opts.update(producer_options)
            p = _producers[region] = Producer(region, **opts)
        return p


def serialize_named_weights(
    named_weights,
    infer_strategy: str,
    *,
    region: Optional[str] = None,
    consumers: Optional[int] = None,
    timeout: float = 60.0,
    sender: bool = True,
    **producer_options,
) -> Optional[bytes]:
    """Writes one bucket of (name, tensor) pairs into `region` (default
    default_region()) through a Producer cached per region, and returns a
    pickled ShmcastTicket (well under 1 KiB; no tensor bytes).

    consumers: wait until this many receivers are attached before the first
    bucket (default $SHMCAST_ROLL_CONSUMERS, else 0: send to whoever is
    attached). FSDP2 DTensor parameters (anything with full_tensor()) are
    all-gathered one tensor at a time while the bucket is written, so at most
    one gathered tensor (per staging budget) is alive. full_tensor() is a
    collective: ranks that do not send call this with sender=False, in the
    same order, to take part in the gathers; they get None back.
    producer_options: Producer keyword arguments for the first call on a
    region (slot_bytes, slots, max_consumers, ...; defaults from
    $SHMCAST_ROLL_SLOT_BYTES / _SLOTS / _MAX_CONSUMERS, else 256 MiB x 4, 8)."""
    named = list(named_weights)
    if not sender:
        for _, t in named:
            if type(t) is not torch.Tensor and hasattr(t, "full_tensor"):
                del _
                t.full_tensor()
        return None
    region = region or default_region()
    if consumers is None:
        consumers = _env_int("SHMCAST_ROLL_CONSUMERS", 0)
    consumers = _C.check_int(consumers, "consumers", 0, _C.limits["max_consumers"])
    prod = _producer(region, producer_options)
    # What the sync will carry (with quantize: float8 and the scales, about
    # half the bytes), laid out as send() will lay it out.
    wire = prod._manifest_specs(named, "a ROLL bucket")
    stream, _payload, _chunks, _ = _C.stream_layout(wire, prod.slot_bytes)
    capacity = prod.slot_bytes * prod.slots
    if stream > capacity:
        raise _C.InvalidArgument(
            f"a bucket of {stream} stream bytes does not fit in region '{region}' ({prod.slots} x {prod.slot_bytes} "
            "bytes): receivers read only after the ticket arrives, so a bucket must fit whole. Use smaller buckets or "
            "a larger region (slot_bytes/slots, or $SHMCAST_ROLL_SLOT_BYTES / $SHMCAST_ROLL_SLOTS)")
    if consumers > 0 and prod.consumers < consumers:
        prod.wait_for_consumers(consumers, timeout)
    names = [w[0] for w in wire]  # with quantize, each selected tensor's scales too
    version = prod.send(named)
    s = prod.last_layout
    ticket = ShmcastTicket(
        region=region,
        version=version,
        first_seq=s.first_seq,
        chunks=s.chunks,
        count=len(names),
        payload_bytes=s.payload_bytes,
        names_digest=names_digest(names),
        infer_strategy=str(infer_strategy),
    )
    return pickle.dumps(ticket, protocol=4)


class _TicketUnpickler(pickle.Unpickler):
    """Loads a ShmcastTicket and nothing else: an RPC payload is input."""

    def find_class(self, module, name):
        if module == __name__ and name == "ShmcastTicket":
            return ShmcastTicket
        raise pickle.UnpicklingError(f"a shmcast ticket may not contain {module}.{name}")


def load_ticket(ticket: Union[bytes, bytearray, memoryview, ShmcastTicket]) -> ShmcastTicket:
    if isinstance(ticket, ShmcastTicket):
        return ticket
    t = _TicketUnpickler(io.BytesIO(bytes(ticket))).load()
    if not isinstance(t, ShmcastTicket):
        raise _C.InvalidArgument("not a shmcast ticket")
    return t


def attach(region: Optional[str] = None, device=None, timeout: float = 60.0) -> Consumer:
    """Opens (or returns the cached) Consumer of `region` on `device`
    (default: the current CUDA device, else CPU). Call it on every receiver
    before the sender writes its first bucket: only consumers attached when a
    sync begins take part in it."""
    return _consumers.get(region or default_region(), device, open_timeout=timeout)


def named_tensors_from_ticket(ticket, *, device=None, timeout: float = 60.0, mode: str = "copy") -> list:
    """Receives the bucket a ticket names and returns [(name, tensor), ...]
    on `device` (see attach()). mode='copy' (default): the tensors own their
    memory; 'staging': zero-copy views valid until the next receive on this
    region. Syncs older than the ticket are skipped; a newer one means this
    receiver missed the ticket's bucket (shmcast.InvalidArgument)."""
    t = load_ticket(ticket)
    cons = attach(t.region, device, timeout)
    info = wait_for(cons, t.version, timeout,
                    what=" (was this receiver attached with shmcast.roll.attach before the sender wrote the bucket? "
                         "tickets must be consumed in order)")
    check_manifest(cons, info, t.count, t.names_digest)
    if info.first_seq != t.first_seq or info.chunks != t.chunks:
        cons.skip()
        raise _C.Corrupt(f"sync {info.version} of region '{t.region}' does not match its ticket "
                         f"(chunks {info.first_seq}+{info.chunks}; ticket: chunks {t.first_seq}+{t.chunks})")
    # The manifest is read: receive the data with the consumer's machinery.
    return cons.read(mode=mode)


def close(region: Optional[str] = None) -> None:
    """Closes the cached producers/consumers of `region` (or of all regions)."""
    with _lock:
        for name in [region] if region is not None else list(_producers):
            obj = _producers.pop(name, None)
            if obj is not None:
                obj.close()
    _consumers.close(region)


def _ticket_or_none(payload) -> Optional[ShmcastTicket]:
    if isinstance(payload, ShmcastTicket):
        return payload
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        return None
    try:
        return load_ticket(payload)
    except (pickle.UnpicklingError, _C.InvalidArgument, EOFError, ValueError):
        return None


def update_parameter_in_bucket(worker, serialized_named_tensors, is_lora: bool = False, *, timeout: float = 60.0):
    """ROLL's vLLM worker's update_parameter_in_bucket, receiving through
    shmcast: the worker's one-line patch calls this (module doc). Takes this
    rank's payload (serialized_named_tensors[worker.rank]); a shmcast ticket
    is received on the worker's device (worker.device, else the current CUDA
    device) and handed, like ROLL's own path, to worker.load_weights(list of
    (name, tensor)) or, with is_lora, to worker.tensor_lora_manager.add_weight.
    Any other payload goes through ROLL's own code (roll.utils), unchanged."""
    payload = serialized_named_tensors[getattr(worker, "rank", 0)]
    ticket = _ticket_or_none(payload)
    if ticket is None:
        return _roll_own(worker, payload, is_lora)
    named = named_tensors_from_ticket(ticket, device=getattr(worker, "device", None), timeout=timeout)
    if is_lora:
        for name, weight in named:
            worker.tensor_lora_manager.add_weight(name, weight)
        return None
    worker.load_weights(named)
    return None


def _roll_own(worker, payload, is_lora):
    """ROLL's receive path for its own payloads (a pickled dict of a bucket
    tensor and its metadata)."""
    try:
        from roll.utils.cuda_ipc_utils import MultiprocessingSerializer
        from roll.utils.send_recv_utils import monkey_patch_torch_reductions, named_tensors_from_bucket
    except ImportError:
        raise _C.InvalidArgument("shmcast.roll.update_parameter_in_bucket: the payload is not a shmcast ticket "
                                 "(shmcast.roll.serialize_named_weights) and ROLL is not importable to read it") \
            from None
    monkey_patch_torch_reductions()
    named = named_tensors_from_bucket(**MultiprocessingSerializer.deserialize(payload))
    if is_lora:
        for name, weight in named:
            worker.tensor_lora_manager.add_weight(name, weight)
        return None
    worker.load_weights([(n, w) for n, w in named])
    return None
