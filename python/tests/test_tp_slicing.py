"""shmcast.tp: which slice of which HF tensor a tensor-parallel worker reads
and where it goes. Pure functions, checked two ways: against hand-computed
placements, and against the weight loaders of the vLLM stand-in (which shard
as vLLM's linear / vocab-parallel layers do) for TP = 1, 2, 4, with grouped
and replicated KV heads, padded vocabularies and tied embeddings."""
import pytest
import torch
from torch import nn

import fake_vllm
from shmcast import tp
from shmcast._load import DirectLoader
from vllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear
from vllm.model_executor.models.qwen2 import Qwen2Config, Qwen2ForCausalLM

CONFIGS = {
    "gqa": Qwen2Config(),  # 4 heads, 2 kv heads, vocab 250 (padded)
    "kv_replicated": Qwen2Config(num_attention_heads=8, num_key_value_heads=1, hidden_size=64, vocab_size=300),
    "tied": Qwen2Config(tie_word_embeddings=True, vocab_size=256),
    "small_vocab": Qwen2Config(vocab_size=100),  # TP=4: rank 2 and 3 hold padding only
}


def apply(model, pl: tp.Plan, hf: dict):
    """What a consumer does with a plan, done with torch on full tensors:
    narrow the HF tensor to its slice, copy it where the plan says, zero the
    padding."""
    params = dict(model.named_parameters())
    for name, p in pl.placements.items():
        data = params[p.param].data
        if p.zero is not None:
            data.narrow(*p.zero).zero_()
        if p.length == 0:
            continue
        src = hf[name]
        if p.slice is not None:
            src = src.narrow(*p.slice)
        dst = data if data.dim() == 0 else data.narrow(p.dim, p.offset, p.length)
        dst.copy_(src)


@pytest.mark.parametrize("cfg", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("size", [1, 2, 4])
def test_plan_matches_vllm_loaders(cfg, size):
    c = CONFIGS[cfg]
    hf = fake_vllm.hf_state_dict(3, c)
    hf_shapes = {n: tuple(t.shape) for n, t in hf}
    for rank in range(size):
        with fake_vllm.tp_rank(rank, size):
            model = Qwen2ForCausalLM(c)
        for p in model.parameters():
            p.data.view(torch.uint8).fill_(0x5A)
        pl = tp.plan_for_model(model, rank, size, hf_shapes)
        assert pl.complete, pl.why_incomplete()
        # the inverse: what the model expects is what a trainer sends
        assert tp.plan_for_model(model, rank, size).placements == pl.placements
        apply(model, pl, dict(hf))
        assert fake_vllm.check_loaded(model, hf, rank, size) == [], (cfg, rank, size)
        if size == 1:
            assert pl.slices() == {}  # TP = 1 reads every tensor whole: today's receive_into suffices


def test_plan_by_hand():
    L = tp.ParamLayout
    params = {
        "col.weight": L("col.weight", (4, 8), "column", 0),
        "row.weight": L("row.weight", (8, 3), "row", 1),
        "qkv.weight": L("qkv.weight", (4 + 2 + 2, 8), "qkv", 0, (4, 2, 2), replicas=2),
        "gate_up.weight": L("gate_up.weight", (6, 8), "merged", 0, (3, 3)),
        "emb.weight": L("emb.weight", (64, 8), "vocab", 0, vocab=100),
        "norm.weight": L("norm.weight", (8,), "replicated"),
    }
    hf = {
        "col.weight": (8, 8), "row.weight": (8, 6),
        "q.weight": (8, 8), "k.weight": (2, 8), "v.weight": (2, 8),
        "gate.weight": (6, 8), "up.weight": (6, 8),
        "emb.weight": (100, 8), "norm.weight": (8,),
        "rotary_emb.inv_freq": (4,), "lm_head.weight": (100, 8),
    }
    packed = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}
    P = tp.Placement
    r1 = tp.plan(hf, params, 1, 2, packed)
    assert r1.complete, r1.why_incomplete()
    assert r1.placements == {
        "col.weight": P("col.weight", "col.weight", 0, 0, 4, (0, 4, 4)),
        "row.weight": P("row.weight", "row.weight", 1, 0, 3, (1, 3, 3)),
        "q.weight": P("q.weight", "qkv.weight", 0, 0, 4, (0, 4, 4)),
        "k.weight": P("k.weight", "qkv.weight", 0, 4, 2, None),  # 2 ranks share the one kv head: whole
        "v.weight": P("v.weight", "qkv.weight", 0, 6, 2, None),
        "gate.weight": P("gate.weight", "gate_up.weight", 0, 0, 3, (0, 3, 3)),
        "up.weight": P("up.weight", "gate_up.weight", 0, 3, 3, (0, 3, 3)),
        "emb.weight": P("emb.weight", "emb.weight", 0, 0, 36, (0, 64, 36), (0, 36, 28)),  # 100 rows: 64 + 36
        "norm.weight": P("norm.weight", "norm.weight", 0, 0, 8),
    }
    assert sorted(r1.skipped) == ["lm_head.weight", "rotary_emb.inv_freq"]  # no lm_head parameter: tied
    r0 = tp.plan(hf, params, 0, 2, packed)
    assert r0.placements["emb.weight"] == P("emb.weight", "emb.weight", 0, 0, 64, (0, 0, 64))
    assert r0.slices()["row.weight"] == (1, 0, 3)
    # kv shards when there are enough kv heads: 4 kv rows, 2 per rank
    params["qkv.weight"] = L("qkv.weight", (4 + 2 + 2, 8), "qkv", 0, (4, 2, 2), replicas=1)
    hf.update({"k.weight": (4, 8), "v.weight": (4, 8)})
    assert tp.plan(hf, params, 1, 2, packed).placements["v.weight"] == P("v.weight", "qkv.weight", 0, 6, 2, (0, 2, 2))


def test_plan_reports_what_it_cannot_place():
    L = tp.ParamLayout
    params = {"a.weight": L("a.weight", (4, 8), "column", 0), "b.weight": L("b.weight", (4,), "unknown"),
              "c.weight": L("c.weight", (4,), "replicated")}
    pl = tp.plan({"a.weight": (6, 8), "b.weight": (4,), "x.weight": (1,)}, params, 0, 2)
    assert not pl.complete
    assert set(pl.unmapped) == {"a.weight", "b.weight", "x.weight"}  # 6 rows are not 2 x 4; unknown layout; no param
    assert set(pl.uncovered) == {"a.weight", "b.weight", "c.weight"}
    assert "not 2 x 4" in pl.why_incomplete() or "not 2 x 4" in " ".join(pl.problems)
    with pytest.raises(ValueError):
        tp.plan({}, params, 2, 2)
    with pytest.raises(ValueError):
        L("z", (1,), "sideways")


def test_describe_model_is_conservative():
    class Interleaved(QKVParallelLinear):  # another layout under a known base: not guessed
        pass

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = Interleaved(16, 4, 4, 2, bias=False)
            self.col = ColumnParallelLinear(16, 8, bias=False)
            self.col_q = ColumnParallelLinear(16, 8, bias=False, quant_config=object())
            self.norm = nn.LayerNorm(16)

    lay = tp.describe_model(M(), 1)
    assert lay["qkv.weight"].kind == "unknown" and lay["col_q.weight"].kind == "unknown"
    assert lay["col.weight"].kind == "column" and lay["norm.weight"].kind == "replicated"
    assert not DirectLoader(M()).complete


def test_plain_torch_model_is_all_replicated():
    """A transformers-style model (nn.Linear / nn.Embedding): one worker
    reads every tensor whole into its parameter (the GPU logits test)."""
    m = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4))
    d = DirectLoader(m)
    assert d.complete and d.slices == {} and set(d.dsts) == {"0.weight", "1.weight", "1.bias"}


@pytest.mark.parametrize("size", [1, 2, 4])
def test_bytes_per_rank(size):
    c = Qwen2Config(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4,
                    vocab_size=1024)
    hf = {n: tuple(t.shape) for n, t in fake_vllm.hf_state_dict(0, c)}
    with fake_vllm.tp_rank(0, size):
        model = Qwen2ForCausalLM(c)
    got, total = tp.read_fraction(tp.plan_for_model(model, 0, size, hf), hf, {})
    replicated = sum(s[0] for n, s in hf.items() if "norm" in n)
    assert got - replicated == (total - replicated) // size


def test_direct_loader_notices_moved_parameters():
    m = nn.Linear(4, 4)
    d = DirectLoader(m)
    assert not d.stale()
    m.weight.data = torch.zeros(4, 4)  # a loader that re-creates storage
    assert d.stale()
