"""A `shmcast` backend for vLLM's native weight transfer
(vllm/backends/distributed/weight_transfer, formerly vllm/distributed/
weight_transfer: WeightTransferEngineFactory, WeightTransferTrainerFactory,
WeightTransferConfig(backend=...), TrainerWeightTransferEngine).

Checked against vllm-project/vllm (2026-12-06):
  base.py    @ a8f1d79812aa51e1036eba41286879eb09bd1635 (vllm/backends/distributed/weight_transfer)
  factory.py @ 055e47c28003156421365af985d676fc921cb075 (same directory)
  ipc_engine.py @ 055e47c28003156421365af985d676fc921cb075 (the engines' load order)
  model_loader/mtp_validation.py @ 67837fe3f210997ba8f9d2ea4feb99bee6b302df
  model_loader/reload/layerwise.py @ 01424e4b5c6768cacbb637fa08e7064a4301ec68
and, by feature detection, the previous trainer API (base.py @
02f250b03f38822ccdb63f27a3005d10ca81f385: TrainerWeightTransferEngine[config,
init info], __init__(config, *, ...), trainer_init(config, init_info, *, ...),
factory trainer_init(backend, config, init_info, *, ...)).

    # inference side: nothing but the backend name (the package's
    # vllm.general_plugins entry point registers it in every vLLM process)
    llm = LLM(model=..., weight_transfer_config=WeightTransferConfig(backend="shmcast"))
    # or: vllm serve ... --weight-transfer-config '{"backend": "shmcast"}'

    # trainer side (rank 0 sends; every rank calls both, like vLLM's nccl/ipc engines)
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
    from shmcast.vllm_transfer import ShmcastTrainerInitInfo   # backend = "shmcast" (a ClassVar)
    engine = WeightTransferTrainerFactory.trainer_init(
        ShmcastTrainerInitInfo(rank=rank, region="actor-0", consumers=tp * dp),
        client=client, source=ModuleSource(model))     # client: vLLM's Ray/HTTP weight-sync client
    engine.send_weights()                                # every step

How a round goes (the order of vLLM's engines): trainer_init creates the
region (pinned POSIX shared memory) and calls the workers'
init_weight_transfer_engine, which attach a consumer each; send_weights calls
start_weight_update, then per bucket runs the workers' update_weights (each
waits for one sync) concurrently with Producer.send, then
finish_weight_update. The update_info of a bucket announces the sync's
version, tensor count and a digest of its names; no tensor bytes and no CUDA
IPC handle cross the control plane.

Loading (init_info `load`):
* 'direct': each TP worker reads only its slice of every tensor straight
  into its parameters (shmcast.tp plans which rows/columns; q/k/v and
  gate/up land in their fused parameters; vocab padding is zeroed): bytes
  read per worker ~ model / TP + replicated tensors, no staging, no
  load_weights(). Needs an unquantized model in HF layout; with TP > 1 it
  needs Consumer.receive_into(..., slices=...) (shmcast's sharded syncs).
  Like vLLM's in-place engines, start/finish_weight_update do nothing.
* 'loader': the whole sync is received and handed to model.load_weights()
  inside vLLM's layerwise reload (start/finish_weight_update call
  initialize/finalize_layerwise_reload, as the nccl and ipc engines do;
  load_weights() runs inside disable_mtp_completeness_check(), as theirs
  does): any model vLLM can load, quantized ones included.
* 'auto' (default): 'direct' when the plan covers the model and vLLM has no
  quantization configured, else 'loader'.

Sleep and wake: sleep(level=1) keeps the weights (offloaded), nothing to do.
sleep(level=2) discards them; after wake_up the weights are garbage until the
trainer's next send_weights() (RL frameworks sync right after waking the
weights).

Delta syncs (producer_options={"delta": True}; with bucket_bytes > 0 each
bucket's sync is a delta against that bucket's last one): 'direct' applies each delta to
the parameters in place; start_weight_update() checks that they still hold
what the last update left there (a sample of their bits,
DirectLoader.holds_last_load) and, after a level-2 sleep, takes a new seat,
which makes the round's sync full. 'loader' reads through the consumer's own
copy of the weights (one more copy of the model on the worker's device) and
hands load_weights() whole tensors, so loads that transform the weights
(quantization) are fine. This backend streams through a ring region; a store region
(shmcast.Producer(mode='store'), docs/python.md) keeps the newest version,
so a worker could reload it after sleep(level=2) or a restart without the
trainer (Consumer.receive_into), but this backend does not do that itself.
The consumer (a pinned host mapping, no GPU memory) stays attached across
sleep; 'direct' holds no GPU staging memory at all, 'loader' holds one
bucket's receive buffer during an update only.

Restarts: a worker whose receive failed gives its seat back at once (the
trainer never waits for it) and reattaches at the next start_weight_update;
a restarted worker is reattached by the trainer's next send_weights (it
repeats init_weight_transfer_engine when fewer consumers are attached than
expected). A restarted trainer recreates the region (its producer is gone);
its trainer_init announces the new region's token and the workers reattach.
"""
from __future__ import annotations

import inspect
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Iterator, Optional

import torch

from ._load import ConsumerCache, DirectLoader, cached_direct_loader, load_whole, names_digest, region_token
from ._send import buckets
from ._torch import Producer
from ._vllm_compat import finalize_reload, initialize_reload, mtp_check_off
from .vllm_plugin import BACKEND, register  # noqa: F401  (register: the plugin entry point)

try:  # vLLM since the vllm/backends move (the old path is a shim there)
    from vllm.backends.distributed.weight_transfer.base import (  # noqa: E402
        TrainerInitInfo,
        TrainerWeightTransferEngine,
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
except ImportError:  # older vLLM (this module needs vLLM)
    from vllm.distributed.weight_transfer.base import (  # noqa: E402
        TrainerInitInfo,
        TrainerWeightTransferEngine,
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )

try:
    from vllm.foundation.config.weight_transfer import WeightTransferConfig  # noqa: E402
except ImportError:
    from vllm.config.weight_transfer import WeightTransferConfig  # noqa: E402

# The previous trainer API generation took a WeightTransferConfig: its
# TrainerWeightTransferEngine.__init__ has a `config` parameter (and two type
# parameters); the current one does not.
TRAINER_TAKES_CONFIG = "config" in inspect.signature(TrainerWeightTransferEngine.__init__).parameters

logger = logging.getLogger(__name__)

__all__ = [
    "BACKEND",
    "register",
    "ShmcastWeightTransferInitInfo",
    "ShmcastWeightTransferUpdateInfo",
    "ShmcastTrainerInitInfo",
    "ShmcastWeightTransferEngine",
    "ShmcastTrainerWeightTransferEngine",
]

LOADS = ("auto", "direct", "loader")


@dataclass
class ShmcastWeightTransferInitInfo(WeightTransferInitInfo):
    """Worker-side init info (built by the trainer engine; plain values, so
    it crosses Ray and the HTTP route as JSON)."""

    region: str
    token: Optional[str] = None
    """The region's incarnation (shmcast._load.region_token): a worker attached
    to an older region of the same name (a trainer restarted) reattaches."""
    open_timeout: float = 60.0
    """Seconds to wait for the region to exist."""
    timeout: float = 300.0
    """Seconds an update_weights call waits for its sync."""
    load: str = "auto"
    """'auto' | 'direct' | 'loader' (module doc)."""
    mode: str = "copy"
    """Receive mode of the 'loader' path ('copy': a buffer per bucket, freed
    after loading; 'staging': one reused buffer kept by the consumer)."""

    def __post_init__(self):
        if self.load not in LOADS:
            raise ValueError(f"load must be one of {LOADS}, not {self.load!r}")


@dataclass
class ShmcastWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """One bucket = one sync: what the worker checks the sync's manifest against."""

    version: int
    count: int
    names_digest: str


@dataclass
class ShmcastTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info. `rank` (keyword-only, from TrainerInitInfo):
    rank 0 creates the region and sends; other ranks only iterate the source
    (FSDP gathers are collectives). `backend` (a ClassVar, not a field) is
    the WeightTransferTrainerFactory key vLLM dispatches on."""

    backend: ClassVar[str] = BACKEND
    region: str = "vllm-weights"
    consumers: int = 1
    """Inference workers that receive (TP x PP x DP): every send waits for them."""
    slot_bytes: int = 256 << 20
    slots: int = 4
    bucket_bytes: int = 0
    """Bytes per sync; 0: the whole model in one sync. The trainer holds at
    most one bucket of materialized tensors."""
    timeout: float = 300.0
    load: str = "auto"
    mode: str = "copy"
    producer_options: dict = field(default_factory=dict)
    """More shmcast.Producer keyword arguments (max_consumers, checksums, ...)."""


class ShmcastWeightTransferEngine(WeightTransferEngine[ShmcastWeightTransferInitInfo, ShmcastWeightTransferUpdateInfo]):
    """Worker side: created by WeightTransferEngineFactory.create_engine
    (config, vllm_config, device, model) once the model is loaded."""

    init_info_cls = ShmcastWeightTransferInitInfo
    update_info_cls = ShmcastWeightTransferUpdateInfo

    def __init__(self, config: WeightTransferConfig, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self._consumers = ConsumerCache()
        self._init: Optional[ShmcastWeightTransferInitInfo] = None
        self._direct: dict = {}  # id(model) -> DirectLoader (the draft model has its own)
        self._path: Optional[str] = None
        self.updates: list = []  # shmcast._load.Loaded of the current / last update

    # ---- lifecycle
    def init_transfer_engine(self, init_info: ShmcastWeightTransferInitInfo) -> None:
        """Attaches this worker to the region (idempotent: an attached worker
        keeps its consumer unless the region was recreated)."""
        self._init = init_info
        self._attach()

    def _attach(self):
        i = self._init
        if i is None:
            raise RuntimeError("shmcast weight transfer not initialized: call init_weight_transfer_engine first")
        return self._consumers.get(i.region, self.device, open_timeout=i.open_timeout, mode=i.mode, token=i.token)

    def _loader(self) -> Optional[DirectLoader]:
        """The DirectLoader of the current target model, or None for the
        'loader' path."""
        load = self._init.load
        if load == "loader":
            return None
        d = cached_direct_loader(self._direct, id(self.model), self.model)
        quant = getattr(self.model_config, "quantization", None)
        if d.complete and quant is None:
            return d
        why = d.why or f"quantization '{quant}' is configured"
        if load == "direct":
            raise ValueError(f"shmcast load='direct' cannot load this model: {why}")
        logger.info("shmcast: loading through model.load_weights(): %s", why)
        return None

    def start_weight_update(self) -> None:
        cons = self._attach()  # reattach after a failed update (its seat was given back)
        self.updates = []
        d = self._loader()
        self._path = "direct" if d is not None else "loader"
        if d is not None and cons.delta and d.holds_last_load() is False:
            # Delta syncs: the parameters no longer hold what the last update
            # left there (a level-2 sleep discarded them). A new seat asks the
            # producer for a full sync, and the trainer sends this round's
            # sync only after this call.
            self._consumers.drop(self._init.region)
            self._attach()
        if self._path == "loader":
            initialize_reload(self.model, required=True)

    def receive_weights(self, update_info: ShmcastWeightTransferUpdateInfo) -> None:
        i = self._init
        cons = self._attach()
        try:
            d = self._loader() if self._path == "direct" else None
            if d is not None:
                res = d.load(cons, timeout=i.timeout, version=update_info.version)
                names = [t[0] for t in cons.sync_info.tensors]
                if len(names) != update_info.count or names_digest(names) != update_info.names_digest:
                    raise ValueError(f"sync {res.version} does not hold the {update_info.count} announced tensors")
            else:
                with mtp_check_off():  # a round may carry part of the model, as vLLM's engines assume
                    res = load_whole(cons, self.model, timeout=i.timeout, version=update_info.version,
                                     count=update_info.count, digest=update_info.names_digest)
        except BaseException:
            self._consumers.drop(i.region)  # never keep the trainer waiting for this worker
            raise
        self.updates.append(res)

    def finish_weight_update(self) -> None:
        if self._path == "loader":
            finalize_reload(self.model, self.model_config, required=True)
        self._path = None

    def shutdown(self) -> None:
        self._consumers.close()

    @staticmethod
    def trainer_send_weights(iterator: Iterator[Any], trainer_args: Any) -> None:
        raise NotImplementedError(
            "the shmcast backend sends through its trainer engine: "
            "WeightTransferTrainerFactory.trainer_init(ShmcastTrainerInitInfo(...), client=..., "
            "source=...).send_weights()")

    # ---- reporting
    def last_update_stats(self) -> dict:
        """Bytes this worker copied out of the region in the last update and
        the bytes of the syncs (a TP worker in 'direct' reads ~ 1/TP)."""
        return {
            "path": self.updates[0].mode if self.updates else None,
            "syncs": len(self.updates),
            "versions": [u.version for u in self.updates],
            "bytes_read": sum(u.bytes_read for u in self.updates),
            "bytes_total": sum(u.bytes_total for u in self.updates),
        }


_TrainerBase = (TrainerWeightTransferEngine[WeightTransferConfig, ShmcastTrainerInitInfo] if TRAINER_TAKES_CONFIG
                else TrainerWeightTransferEngine[ShmcastTrainerInitInfo])


class ShmcastTrainerWeightTransferEngine(_TrainerBase):
    """Trainer side, built on every trainer rank with trainer_init();
    send_weights() once per sync round. Signatures follow the installed
    vLLM's TrainerWeightTransferEngine (TRAINER_TAKES_CONFIG)."""

    init_info_cls = ShmcastTrainerInitInfo

    if TRAINER_TAKES_CONFIG:  # the previous generation: a config first
        config_cls = WeightTransferConfig

        def __init__(self, config, *, client, source, is_sender: bool = True) -> None:
            super().__init__(config, client=client, source=source, is_sender=is_sender)
            self.init_info: Optional[ShmcastTrainerInitInfo] = None
            self.producer: Optional[Producer] = None

        @classmethod
        def trainer_init(cls, config, init_info: ShmcastTrainerInitInfo, *, client, source):
            return cls(config, client=client, source=source, is_sender=init_info.is_sender)._rendezvous(init_info)
    else:
        def __init__(self, *, client, source=None, is_sender: bool = True) -> None:
            super().__init__(client=client, source=source, is_sender=is_sender)
            self.init_info: Optional[ShmcastTrainerInitInfo] = None
            self.producer: Optional[Producer] = None

        @classmethod
        def trainer_init(cls, init_info: ShmcastTrainerInitInfo, *, client, source=None):
            if source is None:
                raise ValueError("the shmcast trainer engine sends a full model every round: it needs a WeightSource")
            return cls(client=client, source=source, is_sender=init_info.is_sender)._rendezvous(init_info)

    def _rendezvous(self, init_info: ShmcastTrainerInitInfo):
        """The sender creates the region and attaches the workers; other ranks
        only keep the init info."""
        self.init_info = init_info
        if not self.is_sender:
            return self
        i = init_info
        opts = dict(slot_bytes=i.slot_bytes, slots=i.slots, max_consumers=max(8, i.consumers),
                    consumer_timeout=i.timeout)
        opts.update(i.producer_options)
        self.producer = Producer(i.region, **opts)
        self._attach_workers()
        return self

    def worker_init_info(self) -> dict:
        i = self.init_info
        return asdict(ShmcastWeightTransferInitInfo(region=i.region, token=region_token(i.region),
                                                    timeout=i.timeout, load=i.load, mode=i.mode))

    def _attach_workers(self) -> None:
        # Workers open their consumers inside this call (the region exists).
        self.client.init_weight_transfer_engine(self.worker_init_info())
        self.producer.wait_for_consumers(self.init_info.consumers, self.init_info.timeout)

    def send_weights(self) -> None:
        if not self.is_sender:
            for _ in self.source:  # take part in the gathers, send nothing
                pass
            return
        if self.producer.consumers < self.init_info.consumers:
            self._attach_workers()  # a restarted worker: attach it before the round
        self.client.start_weight_update()
        try:
            for bucket in buckets(iter(self.source), self.init_info.bucket_bytes):
                self._send_bucket(bucket)
        except BaseException:
            # Close the round on the workers that are still in it, so that the
            # next start_weight_update is accepted; the failed ones already left it.
            try:
                self.client.finish_weight_update()
            except BaseException as e:  # noqa: BLE001  (the first error is the one to raise)
                logger.warning("shmcast: closing the failed round: %s", e)
            raise
        self.client.finish_weight_update()

    def _send_bucket(self, bucket) -> int:
        names = self.producer.sync_names(bucket)  # with quantize, each selected tensor's scales too
        info = ShmcastWeightTransferUpdateInfo(version=self.producer.last_version + 1, count=len(names),
                                               names_digest=names_digest(names))
        # The workers' update_weights waits for this sync while we write it
        # (a sync may be larger than the region: they read as it fills).
        with ThreadPoolExecutor(max_workers=1) as exe:
            future = exe.submit(self.client.update_weights, asdict(info))
            try:
                version = self.producer.send(bucket)
            except BaseException:
                try:
                    future.result(timeout=self.init_info.timeout)
                except BaseException as worker_error:  # noqa: BLE001  (the send error is the one to raise)
                    logger.warning("shmcast: workers failed too: %s", worker_error)
                raise
            future.result()
        return version

    def shutdown(self) -> None:
        if self.producer is not None:
            self.producer.close()
            self.producer = None
