"""STAND-IN for vllm/v1/worker/gpu_worker.py (class Worker) of
vllm-project/vllm, the parts weight transfer touches, as stored in the
public index for the trainer-engine era (the same API as base.py @
02f250b03f38822ccdb63f27a3005d10ca81f385; the index gave no commit for this
file):

* __init__: weight_transfer_engine = None, _weight_update_active = False;
  the worker process loads vLLM's general plugins first (worker_base.py).
* load_model(): builds the model, then, when vllm_config.weight_transfer_config
  is set, WeightTransferEngineFactory.create_engine(config, vllm_config,
  self.device, model).
* init_weight_transfer_engine(init_info: dict): parse_init_info +
  init_transfer_engine. start_weight_update(): refuses a second active
  session, engine.start_weight_update(), marks it active.
  update_weights(update_info: dict): refuses without an active session;
  engine.update_weights(); an exception ends the session. finish_weight_update():
  refuses without a session, engine.finish_weight_update(), ends it.
  shutdown(): engine.shutdown().
* sleep(level) / wake_up(tags): level 1 offloads the weights and restores
  them on wake; level 2 discards them, so after wake_up they hold garbage
  (the stand-in writes 0xFF bytes) until the next weight update. (Real vLLM
  unmaps the memory; the stand-in keeps tensors so a test can see garbage.)

Left out: devices, model runner, KV cache, profiling, draft models.
Written for shmcast's tests; not vLLM's code."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from vllm.distributed import _set_tp
from vllm.distributed.weight_transfer import WeightTransferEngineFactory


class Worker:
    def __init__(self, vllm_config, local_rank: int = 0, rank: int = 0, distributed_init_method: str = "",
                 is_driver_worker: bool = False, device: str = "cpu", model_factory=None):
        from vllm.plugins import load_general_plugins

        load_general_plugins()
        self.vllm_config = vllm_config
        self.local_rank, self.rank = local_rank, rank
        self.weight_transfer_engine = None
        self._weight_update_active = False
        self._sleep_saved = None
        self._model_factory = model_factory
        self.device = torch.device(device)
        tp = vllm_config.parallel_config.tensor_parallel_size
        _set_tp(rank % tp, tp)

    def load_model(self) -> None:
        model = self._model_factory(self.device)
        self.model_runner = SimpleNamespace(model=model, get_model=lambda: model)
        if self.vllm_config.weight_transfer_config is not None:
            self.weight_transfer_engine = WeightTransferEngineFactory.create_engine(
                self.vllm_config.weight_transfer_config, self.vllm_config, self.device, self.model_runner.get_model())

    # ---- weight transfer
    def _check_weight_transfer_engine(self) -> None:
        if self.weight_transfer_engine is None:
            raise RuntimeError("Weight transfer not configured. "
                               "Please set weight_transfer_config to enable weight transfer.")

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._check_weight_transfer_engine()
        typed = self.weight_transfer_engine.parse_init_info(init_info)
        self.weight_transfer_engine.init_transfer_engine(typed)

    def start_weight_update(self) -> None:
        self._check_weight_transfer_engine()
        if self._weight_update_active:
            raise RuntimeError("start_weight_update called while a weight update is already active. "
                               "Call finish_weight_update first.")
        self.weight_transfer_engine.start_weight_update()
        self._weight_update_active = True

    def update_weights(self, update_info: dict) -> None:
        self._check_weight_transfer_engine()
        if not self._weight_update_active:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        try:
            self.weight_transfer_engine.update_weights(update_info)
        except BaseException:
            self._weight_update_active = False
            raise

    def finish_weight_update(self) -> None:
        self._check_weight_transfer_engine()
        if not self._weight_update_active:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update.")
        self.weight_transfer_engine.finish_weight_update()
        self._weight_update_active = False

    # ---- sleep mode
    def sleep(self, level: int = 1) -> None:
        params = [p.data for p in self.model_runner.model.parameters()]
        if level == 1:
            self._sleep_saved = [t.to("cpu", copy=True) for t in params]
        for t in params:
            t.view(torch.uint8).fill_(0xFF)

    def wake_up(self, tags=None) -> None:
        if self._sleep_saved is not None:
            for p, saved in zip(self.model_runner.model.parameters(), self._sleep_saved):
                p.data.copy_(saved)
            self._sleep_saved = None

    def shutdown(self) -> None:
        if self.weight_transfer_engine is not None:
            self.weight_transfer_engine.shutdown()
