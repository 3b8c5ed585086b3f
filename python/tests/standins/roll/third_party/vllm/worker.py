"""STAND-IN for WorkerBase of roll/third_party/vllm/worker.py (alibaba/ROLL @
8eb27cc2dc34c4d1310b169d9b86d339004d811a, checked 2026-12-06), the receiving
end of a bucket: ROLL mixes it into vLLM's worker (worker_extension_cls), so
`self` has .rank, .device and .model_runner.model.
custom_init_worker() makes the TensorLoraManager;
update_parameter_in_bucket(serialized_named_tensors, is_lora=False) takes
serialized_named_tensors[self.rank], deserializes it and rebuilds the
tensors with named_tensors_from_bucket, then either adds each to the LoRA
manager (is_lora) or calls self.load_weights(list of pairs);
load_weights(weights) hands them to self.model_runner.model.load_weights.

Left out: reload_model / wake-up, broadcast_parameter (NCCL), the draft
model, LoRA requests, vLLM version branches. Not ROLL's code."""
from collections import OrderedDict

from roll.utils.cuda_ipc_utils import MultiprocessingSerializer
from roll.utils.send_recv_utils import monkey_patch_torch_reductions, named_tensors_from_bucket


class TensorLoraManager:
    def __init__(self):
        self.lora_params = OrderedDict()

    def add_weight(self, name, weight):
        self.lora_params[name] = weight


class WorkerBase:
    def custom_init_worker(self, *args, **kwargs):
        self.weight_loaded = True
        self.tensor_lora_manager = TensorLoraManager()

    def load_weights(self, weights):
        self.model_runner.model.load_weights(weights=list(weights))

    def update_parameter_in_bucket(self, serialized_named_tensors, is_lora=False):
        monkey_patch_torch_reductions()
        bucket_with_meta = MultiprocessingSerializer.deserialize(serialized_named_tensors[self.rank])
        named_params = named_tensors_from_bucket(**bucket_with_meta)
        if is_lora:
            for name, weight in named_params:
                self.tensor_lora_manager.add_weight(name, weight)
            return
        self.load_weights([(name, weight) for name, weight in named_params])
