"""Helpers around the vLLM STAND-IN (python/tests/standins/vllm; see its
README): not vLLM, and no code of vLLM's.

* FakeQwen2ForCausalLM / Cfg: the stand-in of vLLM's Qwen2ForCausalLM (fused
  qkv_proj / gate_up_proj, vocab-parallel embeddings with padding, TP layers
  whose weight loaders shard as vLLM's do).
* FakeWorker: an object with .device and .model_runner.model, which is what
  vLLM's worker offers a `worker_extension_cls` mixin.
* hf_state_dict(seed): what a trainer holding the Hugging Face model sends.
* expected_params / check_loaded: the oracle. A fresh stand-in model of the
  same TP rank loaded through its own load_weights() (vLLM's loading rules),
  compared byte for byte; at TP = 1 also every fused part against the HF
  tensor directly.
"""
from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import torch

from shmcast.vllm import ShmcastWorkerExtension
from vllm.distributed import _set_tp, get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.models.qwen2 import Qwen2Config, Qwen2ForCausalLM

Cfg = Qwen2Config
FakeQwen2ForCausalLM = Qwen2ForCausalLM


@contextmanager
def tp_rank(rank: int, size: int):
    """Builds stand-in layers as TP rank `rank` of `size` (the stand-in's
    process-wide parallel state), restoring the previous one."""
    before = (get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size())
    _set_tp(rank, size)
    try:
        yield
    finally:
        _set_tp(*before)


class FakeWorker(ShmcastWorkerExtension):
    """STAND-IN for a vLLM GPU worker: .device and .model_runner.model."""

    def __init__(self, device="cpu", cfg: Qwen2Config = None):
        self.device = torch.device(device)
        self.model_runner = SimpleNamespace(model=Qwen2ForCausalLM(cfg or Qwen2Config(), self.device))


def hf_state_dict(seed: int, cfg: Qwen2Config = None) -> list:
    """HF-named weights of the stand-in model (what a trainer holds),
    deterministic in `seed`."""
    c = cfg or Qwen2Config()
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(c.dtype)

    h, i, hd = c.hidden_size, c.intermediate_size, c.head_dim
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    out = [("model.embed_tokens.weight", r(c.vocab_size, h))]
    for n in range(c.num_hidden_layers):
        p = f"model.layers.{n}."
        out += [
            (p + "self_attn.q_proj.weight", r(q, h)),
            (p + "self_attn.q_proj.bias", r(q)),
            (p + "self_attn.k_proj.weight", r(kv, h)),
            (p + "self_attn.k_proj.bias", r(kv)),
            (p + "self_attn.v_proj.weight", r(kv, h)),
            (p + "self_attn.v_proj.bias", r(kv)),
            (p + "self_attn.o_proj.weight", r(h, q)),
            (p + "mlp.gate_proj.weight", r(i, h)),
            (p + "mlp.up_proj.weight", r(i, h)),
            (p + "mlp.down_proj.weight", r(h, i)),
            (p + "input_layernorm.weight", r(h)),
            (p + "post_attention_layernorm.weight", r(h)),
        ]
    out.append(("model.norm.weight", r(h)))
    if not c.tie_word_embeddings:
        out.append(("lm_head.weight", r(c.vocab_size, h)))
    return out


def expected_params(hf: list, cfg: Qwen2Config = None, rank: int = 0, size: int = 1) -> dict:
    """name -> tensor of a fresh stand-in model of TP rank `rank` / `size`
    after load_weights(hf)."""
    with tp_rank(rank, size):
        m = Qwen2ForCausalLM(cfg or Qwen2Config())
    for p in m.parameters():
        p.data.view(torch.uint8).fill_(0x5A)  # so a part load_weights() misses shows
    m.load_weights(hf)
    return {n: p.data for n, p in m.named_parameters()}


def check_loaded(model, hf: list, rank: int = 0, size: int = 1) -> list:
    """Problems (empty when `model` holds exactly what vLLM's loading rules
    put on TP rank `rank` of `size` for the HF weights `hf`)."""
    cfg = model.config
    problems = []
    want = expected_params(hf, cfg, rank, size)
    for n, p in model.named_parameters():
        got = p.data.detach().cpu()
        w = want[n]
        if got.dtype != w.dtype or got.shape != w.shape or not torch.equal(got.view(torch.uint8), w.view(torch.uint8)):
            problems.append(n)
    if size == 1:  # independently of the stand-in's loaders: every HF tensor where vLLM keeps it
        hf = dict(hf)
        params = dict(model.named_parameters())
        hd = cfg.head_dim
        q, kv, inter = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.intermediate_size
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            for kind in ("weight", "bias"):
                fused = params[p + f"self_attn.qkv_proj.{kind}"].data.cpu()
                for part, rows in (("q", fused[:q]), ("k", fused[q:q + kv]), ("v", fused[q + kv:])):
                    if not torch.equal(rows, hf[p + f"self_attn.{part}_proj.{kind}"]):
                        problems.append(p + f"{part}_proj.{kind} (direct)")
            gu = params[p + "mlp.gate_up_proj.weight"].data.cpu()
            if not (torch.equal(gu[:inter], hf[p + "mlp.gate_proj.weight"])
                    and torch.equal(gu[inter:], hf[p + "mlp.up_proj.weight"])):
                problems.append(p + "gate_up_proj (direct)")
        emb = params["model.embed_tokens.weight"].data.cpu()
        if not (torch.equal(emb[:cfg.vocab_size], hf["model.embed_tokens.weight"])
                and not emb[cfg.vocab_size:].any()):
            problems.append("model.embed_tokens.weight (direct)")
    return problems
