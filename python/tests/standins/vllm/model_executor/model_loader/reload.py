"""STAND-IN for vllm/model_executor/model_loader/reload (layerwise reload):
initialize_layerwise_reload(model) before checkpoint-format weights arrive,
finalize_layerwise_reload(model, model_config) after the last one; vLLM's
nccl and ipc engines call them from start/finish_weight_update. The real
functions rewrap weight loaders and re-run process_weights_after_loading per
layer; the stand-in only records the calls (model._standin_reload), so the
tests can check that the engine calls them in that order (and that the
in-place 'direct' path does not)."""


def initialize_layerwise_reload(model) -> None:
    log = model.__dict__.setdefault("_standin_reload", [])
    if log and log[-1] == "initialize":
        raise RuntimeError("initialize_layerwise_reload called twice without finalize")
    log.append("initialize")


def finalize_layerwise_reload(model, model_config) -> None:
    log = model.__dict__.setdefault("_standin_reload", [])
    if not log or log[-1] != "initialize":
        raise RuntimeError("finalize_layerwise_reload without initialize_layerwise_reload")
    log.append("finalize")
