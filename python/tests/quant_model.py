"""A model whose layers transform their weights after loading, as vLLM's
quantized layers do (layer.quant_method.process_weights_after_loading(layer)
turns the checkpoint-format parameters into the kernel's), for the
layerwise-reload tests. Built like vLLM's model loader builds one:
parameters in checkpoint format with a weight_loader, the initial load,
record_metadata_for_reloading(model) (stand-in: standins/vllm/
model_executor/model_loader/reload.py), then process_weights_after_loading.

The toy "quantization": the checkpoint's weight [out, in] (float32) becomes
an int8 tensor [in, out] (transposed: a kernel layout) plus a float32 scale
per output row. Loading a checkpoint-format tensor into the processed
parameter fails (the shape differs) or, for a square layer, would store
unscaled values in an int8 tensor: only a reload that restores the
checkpoint format and processes again gives the right kernel weights."""
from __future__ import annotations

import torch
from torch import nn


def default_weight_loader(param, loaded_weight):
    if param.size() != loaded_weight.size():
        raise ValueError(f"weight of shape {tuple(loaded_weight.shape)} into a parameter of {tuple(param.shape)}")
    param.data.copy_(loaded_weight)


def quantize(w: torch.Tensor):
    """What process_weights_after_loading makes of a checkpoint weight."""
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.t().contiguous(), scale.to(torch.float32)


class ToyInt8Method:
    """The quant_method of a layer (vLLM: a QuantizeMethodBase)."""

    def create_weights(self, layer, out_features, in_features):
        w = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        w.weight_loader = default_weight_loader
        layer.register_parameter("weight", w)

    def process_weights_after_loading(self, layer):
        q, scale = quantize(layer.weight.data)
        del layer.weight
        layer.register_parameter("weight", nn.Parameter(q, requires_grad=False))
        layer.register_parameter("weight_scale", nn.Parameter(scale, requires_grad=False))


class ToyQuantLinear(nn.Module):
    def __init__(self, out_features, in_features):
        super().__init__()
        self.quant_method = ToyInt8Method()
        self.quant_method.create_weights(self, out_features, in_features)


class ToyQuantModel(nn.Module):
    """Two quantized layers (6 -> 4 -> 6) and a plain norm."""

    def __init__(self):
        super().__init__()
        self.up = ToyQuantLinear(4, 6)
        self.down = ToyQuantLinear(6, 4)
        self.norm = nn.Parameter(torch.ones(4), requires_grad=False)

    def load_weights(self, weights):
        # what a model with MTP layers reads to decide whether to insist on them
        from vllm.model_executor.model_loader.mtp_validation import is_mtp_completeness_check_enabled

        self.__dict__.setdefault("mtp_checks", []).append(is_mtp_completeness_check_enabled())
        params = dict(self.named_parameters())
        for name, w in weights:
            p = params[name]
            getattr(p, "weight_loader", default_weight_loader)(p, w)


def checkpoint(seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [("up.weight", torch.randn(4, 6, generator=g)), ("down.weight", torch.randn(6, 4, generator=g)),
            ("norm", torch.randn(4, generator=g))]


def build(seed: int = 0) -> ToyQuantModel:
    """vLLM's order: create, load the checkpoint, record, process."""
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    m = ToyQuantModel()
    m.load_weights(checkpoint(seed))
    record_metadata_for_reloading(m)
    for layer in m.modules():
        qm = getattr(layer, "quant_method", None)
        if qm is not None:
            qm.process_weights_after_loading(layer)
    return m


def problems(model: ToyQuantModel, ckpt: list) -> list:
    """What differs from the kernel weights `ckpt` should have produced."""
    out = []
    sd = dict(ckpt)
    for layer in ("up", "down"):
        q, scale = quantize(sd[f"{layer}.weight"])
        mod = getattr(model, layer)
        if not torch.equal(mod.weight.data, q):
            out.append(f"{layer}.weight")
        if not torch.equal(mod.weight_scale.data, scale):
            out.append(f"{layer}.weight_scale")
    if not torch.equal(model.norm.data, sd["norm"]):
        out.append("norm")
    return out
