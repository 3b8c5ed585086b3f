"""STAND-IN: sglang.srt.distributed's tensor-parallel queries (parallel_state,
ported from vLLM; SGLang also patches vLLM's parallel state to its own,
monkey_patch_vllm_parallel_state). The stand-in shares the vLLM stand-in's
state, which the TP worker sets (_set_tp)."""
from vllm.distributed import _set_tp, get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

__all__ = ["_set_tp", "get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size"]
