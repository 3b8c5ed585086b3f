"""STAND-IN for vllm/model_executor/models/qwen2.py (Qwen2ForCausalLM) of
vllm-project/vllm: the module tree and parameter names of vLLM's model
(embed_tokens, layers.N.self_attn.{qkv_proj,o_proj}, mlp.{gate_up_proj,
down_proj}, the two norms, model.norm, lm_head tied or not), built from the
parallel layers of the sibling stand-ins; packed_modules_mapping as a class
attribute; load_weights(weights) with the same mapping rules: an HF name
containing q_proj/k_proj/v_proj or gate_proj/up_proj goes to the fused
parameter's weight_loader with shard id 'q'/'k'/'v' or 0/1, rotary buffers
and a tied lm_head.weight are skipped, every other name goes to its
parameter's weight_loader (default: copy). No forward pass (the GPU test uses
a transformers model). Written for shmcast's tests; not vLLM's code."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding


@dataclass
class Qwen2Config:
    vocab_size: int = 250  # not a multiple of 64: exercises vocab padding
    hidden_size: int = 64
    intermediate_size: int = 96
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    num_hidden_layers: int = 2
    tie_word_embeddings: bool = False
    dtype: torch.dtype = torch.bfloat16

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def default_weight_loader(param, loaded_weight):
    assert param.size() == loaded_weight.size(), f"{tuple(loaded_weight.shape)} vs {tuple(param.shape)}"
    param.data.copy_(loaded_weight)


class RMSNorm(nn.Module):
    def __init__(self, hidden, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden, dtype=dtype), requires_grad=False)


class Qwen2Attention(nn.Module):
    def __init__(self, c: Qwen2Config):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads,
                                          bias=True, params_dtype=c.dtype)
        self.o_proj = RowParallelLinear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False,
                                        params_dtype=c.dtype)


class Qwen2MLP(nn.Module):
    def __init__(self, c: Qwen2Config):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(c.hidden_size, [c.intermediate_size] * 2, bias=False,
                                                       params_dtype=c.dtype)
        self.down_proj = RowParallelLinear(c.intermediate_size, c.hidden_size, bias=False, params_dtype=c.dtype)


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, c: Qwen2Config):
        super().__init__()
        self.self_attn = Qwen2Attention(c)
        self.mlp = Qwen2MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.dtype)


class Qwen2Model(nn.Module):
    def __init__(self, c: Qwen2Config):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, params_dtype=c.dtype)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.dtype)


class Qwen2ForCausalLM(nn.Module):
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self, config: Qwen2Config = None, device="cpu"):
        super().__init__()
        self.config = c = config or Qwen2Config()
        self.model = Qwen2Model(c)
        if c.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(c.vocab_size, c.hidden_size, params_dtype=c.dtype)
        self.to(device)
        self.loaded_calls = 0

    def load_weights(self, weights):
        stacked = [
            ("qkv_proj", "q_proj", "q"),
            ("qkv_proj", "k_proj", "k"),
            ("qkv_proj", "v_proj", "v"),
            ("gate_up_proj", "gate_proj", 0),
            ("gate_up_proj", "up_proj", 1),
        ]
        params = dict(self.named_parameters())
        loaded = set()
        self.loaded_calls += 1
        for name, w in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if self.config.tie_word_embeddings and "lm_head.weight" in name:
                continue
            for fused, shard, shard_id in stacked:
                if shard not in name:
                    continue
                name = name.replace(shard, fused)
                p = params[name]
                p.weight_loader(p, w, shard_id)
                break
            else:
                p = params[name]
                getattr(p, "weight_loader", default_weight_loader)(p, w)
            loaded.add(name)
        return loaded

