"""STAND-IN for vllm/model_executor/layers/linear.py of vllm-project/vllm
@ 0036d38de46c5d48fdedeb658dedc0fc0f95677d, unquantized and legacy
(`weight_loader`, not `weight_loader_v2`) paths only. Same class names,
layer attributes (tp_rank, tp_size, output_sizes, output_size_per_partition,
input_size_per_partition; QKV: num_heads, num_kv_heads, head_size,
v_head_size, num_kv_head_replicas), parameter attributes (output_dim,
input_dim, weight_loader) and the same sharding arithmetic in the weight
loaders: column-parallel narrows the checkpoint tensor along output_dim at
tp_rank * shard; merged/qkv narrow the parameter at the part's offset and the
checkpoint tensor at (tp_rank, or tp_rank // num_kv_head_replicas for k/v)
* shard; row-parallel narrows along input_dim. shmcast.tp.plan() is checked
against these loaders. Written for shmcast's tests; not vLLM's code (no
quantization, packing, Marlin, block scales, DCP groups, custom ops)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import Parameter

from vllm.distributed import divide, get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size


def _narrow_copy(param, loaded_weight, dim, rank):
    """Copies rank `rank`'s shard of `loaded_weight` along `dim` (None: all of it) into `param`."""
    data = param.data
    if dim is not None:
        shard = data.shape[dim]
        loaded_weight = loaded_weight.narrow(dim, rank * shard, shard)
    assert data.shape == loaded_weight.shape
    data.copy_(loaded_weight)


def _param(*shape, dtype, **attrs) -> Parameter:
    p = Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


class LinearBase(nn.Module):
    def __init__(self, input_size, output_size, bias=False, params_dtype=None, quant_config=None, prefix="", *,
                 disable_tp=False):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.quant_config = quant_config
        self.prefix = prefix
        self.disable_tp = disable_tp
        if disable_tp:
            self.tp_rank, self.tp_size = 0, 1
        else:
            self.tp_rank, self.tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()

    def forward(self, x):
        return F.linear(x, self.weight, getattr(self, "bias", None))


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size, output_size, bias=True, params_dtype=None, quant_config=None, prefix="", **kw):
        super().__init__(input_size, output_size, bias, params_dtype, quant_config, prefix, **kw)
        self.weight = _param(output_size, input_size, dtype=self.params_dtype, input_dim=1, output_dim=0,
                             weight_loader=self.weight_loader)
        if bias:
            self.bias = _param(output_size, dtype=self.params_dtype, output_dim=0, weight_loader=self.weight_loader)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param, loaded_weight):
        assert param.size() == loaded_weight.size()
        param.data.copy_(loaded_weight)


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size, output_size, bias=True, gather_output=False, params_dtype=None,
                 quant_config=None, prefix="", *, disable_tp=False):
        super().__init__(input_size, output_size, bias, params_dtype, quant_config, prefix, disable_tp=disable_tp)
        self.input_size_per_partition = input_size
        self.output_size_per_partition = divide(output_size, self.tp_size)
        self.weight = _param(self.output_size_per_partition, input_size, dtype=self.params_dtype, input_dim=1,
                             output_dim=0, weight_loader=self.weight_loader)
        if bias:
            self.bias = _param(self.output_size_per_partition, dtype=self.params_dtype, output_dim=0,
                               weight_loader=self.weight_loader)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param, loaded_weight):
        _narrow_copy(param, loaded_weight, getattr(param, "output_dim", None), self.tp_rank)


class MergedColumnParallelLinear(ColumnParallelLinear):
    def __init__(self, input_size, output_sizes, bias=True, gather_output=False, params_dtype=None,
                 quant_config=None, prefix="", *, disable_tp=False):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, gather_output, params_dtype, quant_config, prefix,
                         disable_tp=disable_tp)
        assert all(s % self.tp_size == 0 for s in self.output_sizes)

    def weight_loader(self, param, loaded_weight, loaded_shard_id=None):
        if loaded_shard_id is None:
            raise NotImplementedError("stand-in: checkpoints with the parts already fused")
        output_dim = getattr(param, "output_dim", None)
        data = param.data
        offset = sum(self.output_sizes[:loaded_shard_id]) // self.tp_size
        shard = self.output_sizes[loaded_shard_id] // self.tp_size
        data = data.narrow(output_dim, offset, shard)
        loaded_weight = loaded_weight.narrow(output_dim, self.tp_rank * shard, shard)
        assert data.shape == loaded_weight.shape
        data.copy_(loaded_weight)


class QKVParallelLinear(ColumnParallelLinear):
    def __init__(self, hidden_size, head_size, total_num_heads, total_num_kv_heads=None, bias=True,
                 params_dtype=None, quant_config=None, prefix="", *, disable_tp=False, v_head_size=None):
        self.hidden_size, self.head_size = hidden_size, head_size
        self.v_head_size = v_head_size if v_head_size is not None else head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads or total_num_heads
        tp = 1 if disable_tp else get_tensor_model_parallel_world_size()
        self.num_heads = divide(self.total_num_heads, tp)
        if tp >= self.total_num_kv_heads:
            self.num_kv_heads, self.num_kv_head_replicas = 1, divide(tp, self.total_num_kv_heads)
        else:
            self.num_kv_heads, self.num_kv_head_replicas = divide(self.total_num_kv_heads, tp), 1
        self.output_sizes = [self.num_heads * head_size * tp, self.num_kv_heads * head_size * tp,
                             self.num_kv_heads * self.v_head_size * tp]
        super().__init__(hidden_size, sum(self.output_sizes), bias, False, params_dtype, quant_config, prefix,
                         disable_tp=disable_tp)

    def weight_loader(self, param, loaded_weight, loaded_shard_id=None):
        if loaded_shard_id not in ("q", "k", "v"):
            raise ValueError(f"Shard id for QKVParallelLinear should be 'q', 'k', or 'v', got {loaded_shard_id}")
        output_dim = getattr(param, "output_dim", None)
        h, kvh = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        offset, shard = {"q": (0, h), "k": (h, kvh), "v": (h + kvh, self.num_kv_heads * self.v_head_size)}[
            loaded_shard_id]
        data = param.data.narrow(output_dim, offset, shard)
        rank = self.tp_rank if loaded_shard_id == "q" else self.tp_rank // self.num_kv_head_replicas
        loaded_weight = loaded_weight.narrow(output_dim, rank * shard, shard)
        assert data.shape == loaded_weight.shape
        data.copy_(loaded_weight)


class RowParallelLinear(LinearBase):
    def __init__(self, input_size, output_size, bias=True, input_is_parallel=True, params_dtype=None,
                 reduce_results=True, quant_config=None, prefix="", *, disable_tp=False):
        super().__init__(input_size, output_size, bias, params_dtype, quant_config, prefix, disable_tp=disable_tp)
        self.input_is_parallel = input_is_parallel
        self.input_size_per_partition = divide(input_size, self.tp_size)
        self.output_size_per_partition = output_size
        self.weight = _param(output_size, self.input_size_per_partition, dtype=self.params_dtype, input_dim=1,
                             output_dim=0, weight_loader=self.weight_loader)
        if bias:
            self.bias = _param(output_size, dtype=self.params_dtype, output_dim=0, weight_loader=self.weight_loader)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param, loaded_weight):
        _narrow_copy(param, loaded_weight, getattr(param, "input_dim", None), self.tp_rank)
