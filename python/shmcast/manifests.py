"""Reference state-dict shapes for benchmarks and tests.

`qwen2_shapes()` gives the (name, shape) list of a Qwen2-style decoder with
Hugging Face names; `QWEN25_3B` holds the Qwen2.5-3B sizes: 434 tensors,
6,171,877,376 bytes in bf16 (tied embeddings, so no lm_head).
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
