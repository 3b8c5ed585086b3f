"""STAND-IN for vllm/model_executor/layers/vocab_parallel_embedding.py of
vllm-project/vllm (the unquantized path, no LoRA-added vocabulary): the
vocabulary is padded to a multiple of padding_size (64) and split evenly
across TP ranks; rank r holds rows [r * n, (r + 1) * n) of the padded
vocabulary, and its weight_loader copies rows [org_vocab_start_index,
org_vocab_end_index) of the checkpoint tensor to the top of the parameter and
fills the rest (padding) with zeros. ParallelLMHead is a subclass. Attributes
as vLLM's: org_vocab_size, num_embeddings_padded,
num_embeddings_per_partition, shard_indices; the weight has output_dim 0 and
input_dim 1. Written for shmcast's tests; not vLLM's code."""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import Parameter

from vllm.distributed import divide, get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

DEFAULT_VOCAB_PADDING_SIZE = 64


def pad_vocab_size(vocab_size: int, pad_to: int = DEFAULT_VOCAB_PADDING_SIZE) -> int:
    return (vocab_size + pad_to - 1) // pad_to * pad_to


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings, embedding_dim, params_dtype=None, org_num_embeddings=None,
                 padding_size=DEFAULT_VOCAB_PADDING_SIZE, quant_config=None, prefix=""):
        super().__init__()
        self.tp_rank, self.tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        self.num_embeddings = num_embeddings
        self.org_vocab_size = org_num_embeddings or num_embeddings
        self.padding_size = padding_size
        self.num_embeddings_padded = pad_vocab_size(self.org_vocab_size, padding_size)
        self.num_embeddings_per_partition = divide(self.num_embeddings_padded, self.tp_size)
        start = self.tp_rank * self.num_embeddings_per_partition
        self.shard_indices = SimpleNamespace(
            org_vocab_start_index=min(start, self.org_vocab_size),
            org_vocab_end_index=min(start + self.num_embeddings_per_partition, self.org_vocab_size))
        self.embedding_dim = embedding_dim
        self.weight = Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim,
                                            dtype=params_dtype or torch.get_default_dtype()), requires_grad=False)
        self.weight.output_dim, self.weight.input_dim = 0, 1
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded_weight):
        output_dim = getattr(param, "output_dim", None)
        if output_dim is None:
            assert param.data.shape == loaded_weight.shape
            param.data.copy_(loaded_weight)
            return
        start = self.shard_indices.org_vocab_start_index
        size = self.shard_indices.org_vocab_end_index - start
        assert loaded_weight.shape[output_dim] == self.org_vocab_size
        loaded_weight = loaded_weight.narrow(output_dim, start, size)
        param[: loaded_weight.shape[0]].data.copy_(loaded_weight)
        param[loaded_weight.shape[0]:].data.fill_(0)

    def forward(self, ids):  # single-rank only (no masking / all-reduce in the stand-in)
        return F.embedding(ids, self.weight)


class ParallelLMHead(VocabParallelEmbedding):
    def __init__(self, num_embeddings, embedding_dim, bias=False, params_dtype=None, org_num_embeddings=None,
                 padding_size=DEFAULT_VOCAB_PADDING_SIZE, quant_config=None, prefix=""):
        super().__init__(num_embeddings, embedding_dim, params_dtype, org_num_embeddings, padding_size,
                         quant_config, prefix)
        self.register_parameter("bias", None)

    def tie_weights(self, embed_tokens):
        self.weight = embed_tokens.weight
        return self
