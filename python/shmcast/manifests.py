"""Reference state-dict shapes for benchmarks and tests.

`qwen2_shapes()` gives the (name, shape) list of a Qwen2-style decoder with
Hugging Face names; `QWEN25_3B` holds the Qwen2.5-3B sizes: 434 tensors,
6,171,877,376 bytes in bf16 (tied embeddings, so no lm_head).
`qwen3_moe_shapes()` gives a Qwen3-MoE decoder's; `QWEN3_30B_A3B` holds
Qwen3-30B-A3B's sizes from its published config (48 layers, 128 experts of
768 x 2048): 18,867 tensors, 61,064,245,248 bytes in bf16, or 579 with
`dense` (each layer's experts stacked in three tensors of the same bytes).
These mirror bench/manifests.cpp (shmcast-bench --manifest qwen3-30b-a3b[:N]).
"""

QWEN25_3B = dict(hidden=2048, intermediate=11008, kv=256, layers=36, vocab=151936)
# The same structure at about 14 MB in bf16: for CPU smoke runs.
QWEN2_SMALL = dict(hidden=256, intermediate=704, kv=64, layers=4, vocab=8192)


def qwen2_shapes(hidden, intermediate, kv, layers, vocab):
    """[(name, shape)] of a Qwen2-style decoder, in state-dict order."""
    h, i, k = hidden, intermediate, kv
    out = [("model.embed_tokens.weight", (vocab, h))]
    for n in range(layers):
        p = f"model.layers.{n}."
        out += [
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.q_proj.bias", (h,)),
            (p + "self_attn.k_proj.weight", (k, h)),
            (p + "self_attn.k_proj.bias", (k,)),
            (p + "self_attn.v_proj.weight", (k, h)),
            (p + "self_attn.v_proj.bias", (k,)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    out.append(("model.norm.weight", (h,)))
    return out


def qwen25_3b_shapes(layers=None):
    """Qwen2.5-3B: 434 tensors (with 36 layers)."""
    cfg = dict(QWEN25_3B)
    if layers is not None:
        cfg["layers"] = layers
    return qwen2_shapes(**cfg)


QWEN3_30B_A3B = dict(hidden=2048, experts=128, moe_intermediate=768, heads=32, kv_heads=4, head_dim=128, layers=48,
                     vocab=151936)


def qwen3_moe_shapes(hidden, experts, moe_intermediate, heads, kv_heads, head_dim, layers, vocab, dense=False):
    """[(name, shape)] of a Qwen3-MoE decoder (untied lm_head), in state-dict
    order; `dense`: each layer's experts as three stacked tensors."""
    h, e, i = hidden, experts, moe_intermediate
    q, kv = heads * head_dim, kv_heads * head_dim
    out = [("model.embed_tokens.weight", (vocab, h))]
    for n in range(layers):
        p = f"model.layers.{n}."
        out += [
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "self_attn.q_norm.weight", (head_dim,)),
            (p + "self_attn.k_norm.weight", (head_dim,)),
            (p + "mlp.gate.weight", (e, h)),
        ]
        if dense:
            out += [
                (p + "mlp.experts.gate_proj.weight", (e * i, h)),
                (p + "mlp.experts.up_proj.weight", (e * i, h)),
                (p + "mlp.experts.down_proj.weight", (h, e * i)),
            ]
        else:
            for x in range(e):
                px = f"{p}mlp.experts.{x}."
                out += [(px + "gate_proj.weight", (i, h)), (px + "up_proj.weight", (i, h)),
                        (px + "down_proj.weight", (h, i))]
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    return out


def qwen3_30b_a3b_shapes(layers=None, dense=False):
    """Qwen3-30B-A3B, or its first `layers` layers."""
    cfg = dict(QWEN3_30B_A3B)
    if layers is not None:
        if not 1 <= layers <= QWEN3_30B_A3B["layers"]:
            raise ValueError(f"layers must be 1..{QWEN3_30B_A3B['layers']}, not {layers}")
        cfg["layers"] = layers
    return qwen3_moe_shapes(**cfg, dense=dense)


def by_name(name):
    """The shapes named as shmcast-bench --manifest names them: qwen2.5-3b,
    qwen3-30b-a3b[:layers], qwen3-30b-a3b-dense[:layers]."""
    base, sep, n = name.partition(":")
    if base in ("qwen3-30b-a3b", "qwen3-30b-a3b-dense"):
        if sep and not n.isdigit():
            raise ValueError(f"manifest {name!r}: the layer count after ':' must be 1..48")
        return qwen3_30b_a3b_shapes(int(n) if n else None, dense=base.endswith("-dense"))
    if name == "qwen2.5-3b":
        return qwen25_3b_shapes()
    raise ValueError(f"unknown manifest {name!r} (known: qwen2.5-3b, qwen3-30b-a3b[:layers], "
                     "qwen3-30b-a3b-dense[:layers])")
