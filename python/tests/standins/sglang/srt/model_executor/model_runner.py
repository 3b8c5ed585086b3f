"""STAND-IN for the TP worker's end of SGLang's update_weights_from_tensor
(ModelRunner.update_weights_from_tensor / the WeightUpdater that later took
it over, sgl-project/sglang as stored in the public index, the version that
validates the payload; the index gave no commit). Same order and rules:

1. the payload must be a list of (non-empty str name, Tensor or
   LocalSerializedTensor) pairs, and a load_format other than None, 'direct'
   and 'flattened_bucket' must be listed in server_args.custom_weight_loader
   ("Invalid update_weights_from_tensor payload: ..." -> (False, message));
2. every tensor is unwrapped to the current device
   (_unwrap_tensor(tensor, tp_rank, device) = tensor.to(device));
3. 'direct': default_weight_loader per parameter; a custom loader:
   dynamic_import(load_format)(model, named_tensors); None:
   model.load_weights(named_tensors); then (True, "Success").

Sessions (PR #28001): begin_weight_update() and end_weight_update(
run_post_load) bracket a session's loads (restore packed weights, then
quantization post-processing); the stand-in logs them in session_log.

Left out: flattened buckets, LocalSerializedTensor's CUDA IPC, the weight
cache checks, what begin/end do to quantized layers. Not SGLang's code."""
from dataclasses import dataclass
from typing import List, Optional

import torch

from sglang.srt.utils import MultiprocessingSerializer, dynamic_import


@dataclass
class LocalSerializedTensor:
    values: List[bytes]

    def get(self, rank: int):
        return MultiprocessingSerializer.deserialize(self.values[rank])


def _unwrap_tensor(tensor, tp_rank, device):
    if isinstance(tensor, LocalSerializedTensor):
        tensor = tensor.get(tp_rank)
    return tensor.to(device)


def _validate(named_tensors, load_format, custom_weight_loaders):
    prefix = "Invalid update_weights_from_tensor payload"
    if load_format not in (None, "direct", "flattened_bucket"):
        if not isinstance(load_format, str):
            return f"{prefix}: load_format must be a string or null"
        if load_format not in custom_weight_loaders:
            return f"{prefix}: unknown load_format={load_format}"
    if not isinstance(named_tensors, (list, tuple)):
        return f"{prefix}: named_tensors must be a list or tuple"
    for i, item in enumerate(named_tensors):
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            return f"{prefix}: entry {i} must be a (name, tensor) pair"
        name, tensor = item
        if not isinstance(name, str) or not name:
            return f"{prefix}: entry {i} has an invalid tensor name"
        if not isinstance(tensor, (torch.Tensor, LocalSerializedTensor)):
            return f"{prefix}: entry {i} has an invalid tensor value"
    return None


class ModelRunner:
    def __init__(self, model, tp_rank: int, device, custom_weight_loader: Optional[List[str]] = None):
        self.model, self.tp_rank, self.device = model, tp_rank, torch.device(device)
        self.custom_weight_loaders = list(custom_weight_loader or [])
        self.session_log: list = []

    def begin_weight_update(self) -> None:
        self.session_log.append("begin")

    def end_weight_update(self, run_post_load: bool = False) -> None:
        self.session_log.append("end")

    def update_weights_from_tensor(self, named_tensors, load_format: Optional[str] = None):
        error = _validate(named_tensors, load_format, self.custom_weight_loaders)
        if error is not None:
            return False, error
        named_tensors = [(n, _unwrap_tensor(t, tp_rank=self.tp_rank, device=self.device)) for n, t in named_tensors]
        if load_format == "direct":
            params = dict(self.model.named_parameters())
            for name, tensor in named_tensors:
                params[name].data.copy_(tensor)
        elif load_format in self.custom_weight_loaders:
            dynamic_import(load_format)(self.model, named_tensors)
        elif load_format is None:
            self.model.load_weights(named_tensors)
        else:
            raise NotImplementedError(f"Unknown load_format={load_format}")
        return True, "Success"
