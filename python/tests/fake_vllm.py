"""STAND-IN FOR vLLM, FOR TESTS ONLY. This is not vLLM and shares no code with it.

vLLM cannot be installed here, so shmcast.vllm.ShmcastWorkerExtension is
tested against objects with the same shape as the parts it touches:

* FakeQwen2ForCausalLM: a torch nn.Module laid out like vLLM's Qwen2 model,
  with FUSED parameters (self_attn.qkv_proj = q|k|v stacked on dim 0,
  mlp.gate_up_proj = gate|up), whose load_weights(weights) takes HF-named
  (name, tensor) pairs and maps q_proj/k_proj/v_proj and gate_proj/up_proj
  onto shards of the fused parameters through per-parameter weight_loader
  callbacks with shard ids ('q', 'k', 'v' / 0, 1), as vLLM's models do
  (facts checked against public descriptions of vLLM's Qwen2
  stacked_params_mapping; nothing copied).
* FakeWorker: an object with .device and .model_runner.model, which is
  what vLLM's worker offers a `worker_extension_cls` mixin.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from shmcast.vllm import ShmcastWorkerExtension


class Cfg:
    vocab = 256
    hidden = 64
    heads = 4
    kv_heads = 2
    head_dim = 16
    inter = 96
    layers = 2
    dtype = torch.bfloat16


_device = "cpu"  # where _param() puts new parameters (FakeQwen2ForCausalLM(device) sets it)


def _param(*shape, dtype=Cfg.dtype) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=dtype, device=_device), requires_grad=False)


def _default_loader(param, w):
    if tuple(param.shape) != tuple(w.shape):
        raise ValueError(f"shape {tuple(w.shape)} does not fit parameter {tuple(param.shape)}")
    param.data.copy_(w)


def _qkv_loader(param, w, shard_id):
    c = Cfg
    q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
    off, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
    dst = param.data.narrow(0, off, size)
    if tuple(dst.shape) != tuple(w.shape):
        raise ValueError(f"qkv shard {shard_id}: {tuple(w.shape)} does not fit {tuple(dst.shape)}")
    dst.copy_(w)


def _gate_up_loader(param, w, shard_id):
    dst = param.data.narrow(0, shard_id * Cfg.inter, Cfg.inter)
    if tuple(dst.shape) != tuple(w.shape):
        raise ValueError(f"gate_up shard {shard_id}: {tuple(w.shape)} does not fit {tuple(dst.shape)}")
    dst.copy_(w)


class _Attn(nn.Module):
    def __init__(self):
        super().__init__()
        c = Cfg
        qkv = (c.heads + 2 * c.kv_heads) * c.head_dim
        self.qkv_proj = nn.Module()
        self.qkv_proj.weight = _param(qkv, c.hidden)
        self.qkv_proj.bias = _param(qkv)
        self.o_proj = nn.Module()
        self.o_proj.weight = _param(c.hidden, c.heads * c.head_dim)
        for p in (self.qkv_proj.weight, self.qkv_proj.bias):
            p.weight_loader = _qkv_loader


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        c = Cfg
        self.gate_up_proj = nn.Module()
        self.gate_up_proj.weight = _param(2 * c.inter, c.hidden)
        self.gate_up_proj.weight.weight_loader = _gate_up_loader
        self.down_proj = nn.Module()
        self.down_proj.weight = _param(c.hidden, c.inter)


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = _Attn()
        self.mlp = _Mlp()
        self.input_layernorm = nn.Module()
        self.input_layernorm.weight = _param(Cfg.hidden)
        self.post_attention_layernorm = nn.Module()
        self.post_attention_layernorm.weight = _param(Cfg.hidden)


class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = _param(Cfg.vocab, Cfg.hidden)
        self.layers = nn.ModuleList(_Layer() for _ in range(Cfg.layers))
        self.norm = nn.Module()
        self.norm.weight = _param(Cfg.hidden)


class FakeQwen2ForCausalLM(nn.Module):
    """STAND-IN for vLLM's Qwen2ForCausalLM (tied embeddings, fused qkv/gate_up)."""

    stacked_params_mapping = [
        # (fused parameter, HF shard name, shard id)
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]

    def __init__(self, device="cpu"):
        super().__init__()
        global _device
        _device = device
        try:
            self.model = _Inner()
        finally:
            _device = "cpu"
        self.loaded_calls = 0

    def load_weights(self, weights):
        """Takes an iterable of HF-named (name, tensor); returns the names of
        the parameters it loaded."""
        params = dict(self.named_parameters())
        loaded = set()
        self.loaded_calls += 1
        for name, w in weights:
            if "rotary_emb.inv_freq" in name or name == "lm_head.weight":  # tied / not a parameter
                continue
            for fused, shard, shard_id in self.stacked_params_mapping:
                if shard not in name:
                    continue
                target = name.replace(shard, fused)
                p = params[target]
                p.weight_loader(p, w, shard_id)
                loaded.add(target)
                break
            else:
                p = params[name]
                getattr(p, "weight_loader", _default_loader)(p, w)
                loaded.add(name)
        return loaded


class FakeWorker(ShmcastWorkerExtension):
    """STAND-IN for a vLLM GPU worker: .device and .model_runner.model."""

    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        self.model_runner = SimpleNamespace(model=FakeQwen2ForCausalLM(self.device))


def hf_state_dict(seed: int) -> list:
    """HF-named weights of the stand-in model (what a trainer holds)."""
    c = Cfg
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(c.dtype)

    out = [("model.embed_tokens.weight", r(c.vocab, c.hidden))]
    for i in range(c.layers):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", r(c.heads * c.head_dim, c.hidden)),
            (p + "self_attn.q_proj.bias", r(c.heads * c.head_dim)),
            (p + "self_attn.k_proj.weight", r(c.kv_heads * c.head_dim, c.hidden)),
            (p + "self_attn.k_proj.bias", r(c.kv_heads * c.head_dim)),
            (p + "self_attn.v_proj.weight", r(c.kv_heads * c.head_dim, c.hidden)),
            (p + "self_attn.v_proj.bias", r(c.kv_heads * c.head_dim)),
            (p + "self_attn.o_proj.weight", r(c.hidden, c.heads * c.head_dim)),
            (p + "mlp.gate_proj.weight", r(c.inter, c.hidden)),
            (p + "mlp.up_proj.weight", r(c.inter, c.hidden)),
            (p + "mlp.down_proj.weight", r(c.hidden, c.inter)),
            (p + "input_layernorm.weight", r(c.hidden)),
            (p + "post_attention_layernorm.weight", r(c.hidden)),
        ]
    out.append(("model.norm.weight", r(c.hidden)))
    return out


def check_loaded(model: FakeQwen2ForCausalLM, hf: list) -> list:
    """Problems (empty when every HF tensor landed bit-exactly in its place)."""
    c = Cfg
    hf = dict(hf)
    problems = []

    def same(name, got, want):
        if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape) or not torch.equal(got.cpu(), want):
            problems.append(name)

    params = dict(model.named_parameters())
    q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
    for i in range(c.layers):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            fused = params[p + f"self_attn.qkv_proj.{kind}"].data
            same(p + f"q_proj.{kind}", fused[:q], hf[p + f"self_attn.q_proj.{kind}"])
            same(p + f"k_proj.{kind}", fused[q:q + kv], hf[p + f"self_attn.k_proj.{kind}"])
            same(p + f"v_proj.{kind}", fused[q + kv:], hf[p + f"self_attn.v_proj.{kind}"])
        gu = params[p + "mlp.gate_up_proj.weight"].data
        same(p + "gate_proj", gu[:c.inter], hf[p + "mlp.gate_proj.weight"])
        same(p + "up_proj", gu[c.inter:], hf[p + "mlp.up_proj.weight"])
        for n in ("self_attn.o_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
                  "post_attention_layernorm.weight"):
            same(p + n, params[p + n].data, hf[p + n])
    for n in ("model.embed_tokens.weight", "model.norm.weight"):
        same(n, params[n].data, hf[n])
    return problems
