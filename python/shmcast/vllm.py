"""vLLM worker extension: weight updates through a shmcast region.

    # inference side
    llm = vllm.LLM(model=..., worker_extension_cls="shmcast.vllm.ShmcastWorkerExtension")
    llm.collective_rpc("init_shmcast", args=("actor-0",))          # attach every worker first
    # trainer side (another process), after the workers attached:
    prod = shmcast.Producer("actor-0", max_consumers=tp_size)
    prod.wait_for_consumers(tp_size)
    ... start llm.collective_rpc("update_weights_from_shmcast", args=("actor-0",)) (it blocks until the
    ... sync arrives), then: version = prod.send(model.named_parameters())

vLLM mixes this class into its worker class, so `self` is the worker:
`self.model_runner.model` is the model and `self.device` its device. The
adapter stays thin: it receives the sync and hands the (name, tensor) pairs
in HF naming to the model's own load_weights(), which maps q/k/v and
gate/up onto vLLM's fused parameters exactly as when loading a checkpoint.

The 'loader' path does what vLLM's own nccl and ipc weight-transfer engines
do around load_weights(): initialize_layerwise_reload(model) before,
finalize_layerwise_reload(model, model_config) after (so layers whose
process_weights_after_loading transformed their weights, quantized ones
first of all, get checkpoint-format parameters to load into and are
processed again), and the load itself inside disable_mtp_completeness_check().
A vLLM without layerwise reload (older than the module) loads as it did.

Checked against vllm-project/vllm (2026-12-06): the worker_extension_cls
mixin and collective_rpc (unchanged), model_loader/reload/layerwise.py @
01424e4b5c6768cacbb637fa08e7064a4301ec68, model_loader/mtp_validation.py @
67837fe3f210997ba8f9d2ea4feb99bee6b302df, and the order of
vllm/backends/distributed/weight_transfer/ipc_engine.py @
055e47c28003156421365af985d676fc921cb075.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._load import ConsumerCache, cached_direct_loader, default_device, load_whole
from ._vllm_compat import finalize_reload, initialize_reload, mtp_check_off

__all__ = ["ShmcastWorkerExtension"]


class ShmcastWorkerExtension:
    """Mixin for vLLM's `worker_extension_cls`. No __init__: vLLM builds the
    worker; the consumers are created on first use and cached per region."""

    # Receive mode for the cached consumers: 'staging' hands load_weights()
    # zero-copy views of one reused buffer (one H2D copy per slot), which is
    # safe because load_weights() copies every tensor into the model before
    # the next update. Set 'copy' to get tensors that own their memory.
    shmcast_mode = "staging"
    # 'auto': TP slices straight into the parameters when every layout is
    # understood (else load_weights()); 'direct' insists; 'loader' always
    # goes through load_weights() with whole tensors.
    shmcast_load = "auto"

    def _shmcast_device(self) -> torch.device:
        return default_device(getattr(self, "device", None))

    def _shmcast_consumers(self) -> ConsumerCache:
        d = self.__dict__.get("_shmcast_consumers_")
        if d is None:
            d = self.__dict__["_shmcast_consumers_"] = ConsumerCache()
        return d

    def init_shmcast(self, region: str, timeout: float = 60.0, mode: Optional[str] = None) -> int:
        """Attaches this worker to `region` (waiting up to `timeout` s for the
        producer to create it) and returns its consumer seat. Only consumers
        attached when a sync begins take part in it: call this on every
        worker (collective_rpc) before the trainer's first send."""
        cons = self._shmcast_consumers().get(region, self._shmcast_device(), open_timeout=timeout,
                                             mode=mode or self.shmcast_mode)
        return cons.seat

    def update_weights_from_shmcast(self, region: str, timeout: float = 60.0) -> int:
        """Receives the next sync of `region` (opening a consumer on this
        worker's device if init_shmcast() was not called) and loads it with
        self.model_runner.model.load_weights(weights). Returns the sync's
        version."""
        cons = self._shmcast_consumers().peek(region)
        if cons is None:
            self.init_shmcast(region, timeout)
            cons = self._shmcast_consumers().peek(region)
        model = self.model_runner.model
        direct = self._shmcast_direct(model)
        if direct is not None:
            loaded = direct.load(cons, timeout=timeout)
        else:
            loaded = self._shmcast_load_whole(cons, model, timeout)
        self.__dict__["_shmcast_last_"] = loaded
        return loaded.version

    def _shmcast_model_config(self):
        for owner in (self, getattr(self, "model_runner", None), getattr(self, "vllm_config", None)):
            mc = getattr(owner, "model_config", None)
            if mc is not None:
                return mc
        return None

    def _shmcast_load_whole(self, cons, model, timeout):
        """load_weights() bracketed by vLLM's layerwise reload, as vLLM's
        checkpoint-format engines load an update."""
        reloading = initialize_reload(model)
        try:
            with mtp_check_off():
                loaded = load_whole(cons, model, timeout=timeout)
        except BaseException:
            if reloading:  # leave the model loadable: finalize with what arrived, then raise
                try:
                    finalize_reload(model, self._shmcast_model_config())
                except BaseException:  # noqa: BLE001  (the load error is the one to raise)
                    pass
            raise
        if reloading:
            finalize_reload(model, self._shmcast_model_config())
        return loaded

    def _shmcast_direct(self, model):
        if self.shmcast_load == "loader":
            return None
        d = cached_direct_loader(self.__dict__.setdefault("_shmcast_direct_", {}), id(model), model)
        if d.complete:
            return d
        if self.shmcast_load == "direct":
            raise ValueError(f"shmcast_load='direct' cannot load this model: {d.why}")
        return None

    def shmcast_stats(self) -> dict:
        """What the last update moved: version, bytes this worker read
        (its TP slices), the sync's payload, and the path ('direct' or
        'loader')."""
        last = self.__dict__.get("_shmcast_last_")
        if last is None:
            return {}
        return {"version": last.version, "tensors": last.tensors, "bytes_read": last.bytes_read,
                "payload_bytes": last.bytes_total, "path": last.mode}

    def close_shmcast(self, region: Optional[str] = None) -> None:
        """Leaves `region` (or every region) and frees the staging buffers."""
        self._shmcast_consumers().close(region)
