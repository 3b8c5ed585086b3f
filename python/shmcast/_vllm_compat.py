"""vLLM helpers shared by shmcast.vllm_transfer and shmcast.vllm, found by
feature detection (no version checks):

* mtp_check_off(): vLLM's disable_mtp_completeness_check() (vllm/
  model_executor/model_loader/mtp_validation.py, vllm-project/vllm @
  67837fe3f210997ba8f9d2ea4feb99bee6b302df), inside which vLLM's nccl and
  ipc engines call model.load_weights(): an update may carry part of a
  model. A vLLM without it: a context that does nothing.
* initialize_reload / finalize_reload: vLLM's layerwise reload (vllm/
  model_executor/model_loader/reload, layerwise.py @
  01424e4b5c6768cacbb637fa08e7064a4301ec68), which lets load_weights() put
  checkpoint-format weights into layers that transformed theirs after the
  first load (process_weights_after_loading: quantization, repacking).
  With required=False a vLLM without it is reported (False) instead of
  raising, and the caller loads without it as that vLLM did.
"""
from __future__ import annotations

import contextlib


def mtp_check_off():
    try:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    except ImportError:
        return contextlib.nullcontext()
    return disable_mtp_completeness_check()


def _reload(required: bool):
    try:
        from vllm.model_executor.model_loader import reload
    except ImportError:
        if required:
            raise
        return None
    return reload


def initialize_reload(model, *, required: bool = False) -> bool:
    r = _reload(required)
    if r is None:
        return False
    r.initialize_layerwise_reload(model)
    return True


def finalize_reload(model, model_config, *, required: bool = False) -> bool:
    r = _reload(required)
    if r is None:
        return False
    r.finalize_layerwise_reload(model, model_config)
    return True
