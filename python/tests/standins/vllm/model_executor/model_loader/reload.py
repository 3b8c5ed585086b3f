"""STAND-IN for vllm/model_executor/model_loader/reload (layerwise reload;
the package's __init__ re-exports layerwise.py: vllm-project/vllm @
01424e4b5c6768cacbb637fa08e7064a4301ec68, checked 2026-12-06). vLLM's nccl
and ipc engines call initialize_layerwise_reload(model) in
start_weight_update and finalize_layerwise_reload(model, model_config) in
finish_weight_update, so that weights in checkpoint format can be loaded
into a model whose layers transformed theirs after the first load
(quantization, repacking). Written for shmcast's tests; not vLLM's code.

What the stand-in does, in vLLM's order:
* record_metadata_for_reloading(model): the model loader calls it before the
  first process_weights_after_loading; it records each layer's parameters in
  checkpoint format (name, shape, dtype, weight_loader).
* initialize_layerwise_reload(model): a layer whose parameters still have
  their checkpoint layout is left alone (loads land in place: vLLM's
  "mapped" layers); any other layer keeps its current (kernel) tensors aside
  and gets fresh parameters in checkpoint format, with their recorded
  weight loaders. Without a record for such a layer it raises (vLLM: "Must be
  called after record_metadata_for_reloading").
* finalize_layerwise_reload(model, model_config): every restored layer runs
  layer.quant_method.process_weights_after_loading(layer) and the result is
  copied back into the kept kernel tensors, which become the layer's
  parameters again (their storage, hence CUDA-graph addresses, is kept).

Not modelled: processing a layer as soon as all its weights arrived (the
stand-in processes every layer at finalize), meta-device restoring,
attention layers, torchao. The calls are also logged in
model._standin_reload so the tests can check their order."""
from __future__ import annotations

from weakref import WeakKeyDictionary

import torch

_RECORD: "WeakKeyDictionary[torch.nn.Module, dict]" = WeakKeyDictionary()
_KERNEL: "WeakKeyDictionary[torch.nn.Module, dict]" = WeakKeyDictionary()


def _log(model) -> list:
    return model.__dict__.setdefault("_standin_reload", [])


def _params(layer) -> dict:
    return dict(layer.named_parameters(recurse=False))


def record_metadata_for_reloading(model) -> None:
    for layer in model.modules():
        _RECORD[layer] = {n: (tuple(p.shape), p.dtype, getattr(p, "weight_loader", None))
                          for n, p in _params(layer).items()}


def _same_layout(record: dict, params: dict) -> bool:
    return record.keys() == params.keys() and all(
        record[n][:2] == (tuple(p.shape), p.dtype) for n, p in params.items())


@torch.no_grad()
def initialize_layerwise_reload(model) -> None:
    log = _log(model)
    if log and log[-1] == "initialize":
        raise RuntimeError("initialize_layerwise_reload called twice without finalize")
    for layer in model.modules():
        params = _params(layer)
        rec = _RECORD.get(layer)
        if rec is None:
            if getattr(layer, "quant_method", None) is not None:
                raise RuntimeError("initialize_layerwise_reload: call record_metadata_for_reloading first")
            continue
        if _same_layout(rec, params):
            continue
        _KERNEL[layer] = params
        for n in params:
            delattr(layer, n)
        for n, (shape, dtype, loader) in rec.items():
            p = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=next(iter(params.values())).device),
                                   requires_grad=False)
            if loader is not None:
                p.weight_loader = loader
            layer.register_parameter(n, p)
    log.append("initialize")


@torch.no_grad()
def finalize_layerwise_reload(model, model_config) -> None:
    log = _log(model)
    if not log or log[-1] != "initialize":
        raise RuntimeError("finalize_layerwise_reload without initialize_layerwise_reload")
    for layer in model.modules():
        kernel = _KERNEL.pop(layer, None)
        if kernel is None:
            continue
        qm = getattr(layer, "quant_method", None)
        if qm is not None:
            qm.process_weights_after_loading(layer)
        for n, k in kernel.items():
            k.data.copy_(getattr(layer, n).data)
            delattr(layer, n)
            layer.register_parameter(n, k)
    log.append("finalize")
