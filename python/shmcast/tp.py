"""Tensor-parallel slicing: which part of which Hugging Face tensor a vLLM (or
SGLang) tensor-parallel worker needs, and where in which of its parameters
that part goes.

The trainer sends whole tensors in HF naming (or shards of them, which the
consumer sees as whole logical tensors). A TP worker holds, for each
parameter, one slice along the parameter's shard dimension. plan() computes,
as a pure function of names, shapes and the parallel layout, one Placement
per HF tensor:

    hf name -> (parameter, dim, offset, length)   where in the parameter
               (dim, start, length) or None        which slice of the HF tensor
               zero_rows                            padding rows the loader zeroes

so that a consumer can read only those bytes (Consumer.receive_into(...,
slices=...)) straight into the parameter's views, with no staging copy and no
model.load_weights() call. The layouts follow vLLM's parallel layers:

* replicated (norms, row-parallel biases, ReplicatedLinear): whole tensor.
* column-parallel (ColumnParallelLinear): dim 0 (the parameter's output_dim),
  rank r takes rows [r * n, (r + 1) * n) with n the parameter's rows.
* row-parallel (RowParallelLinear): dim 1 (input_dim), likewise by columns;
  its bias is replicated.
* fused q/k/v (QKVParallelLinear): q, k, v are three HF tensors stacked on
  dim 0 in the parameter: [q_r | k_r | v_r]. Query heads are split across
  ranks; key/value heads are split when there are at least tp of them, else
  replicated: rank r takes kv shard r // replicas.
* fused gate/up (MergedColumnParallelLinear): each HF part is split like a
  column-parallel weight and stacked on dim 0 in the parameter.
* vocab-parallel (VocabParallelEmbedding, ParallelLMHead): the vocabulary is
  padded (to a multiple of 64 in vLLM) and split evenly; rank r takes rows
  [r * n, min((r + 1) * n, vocab)) of the HF tensor, its remaining rows are
  padding that the loader fills with zeros (as vLLM's weight_loader does).

describe_model() reads these layouts off a live model by the layer classes'
names and attributes (vLLM and SGLang use the same names), so plan() itself
never imports vLLM. A model that uses anything else (quantized parameters,
renamed weights, pipeline stages) yields an incomplete plan; callers then fall
back to model.load_weights() with whole tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = ["ParamLayout", "Placement", "Plan", "plan", "expected_hf", "describe_model", "plan_for_model", "read_fraction",
           "DEFAULT_PACKED", "SKIP_SUFFIXES"]

# vLLM's stacked_params_mapping for Llama/Qwen2-style models, as
# packed_modules_mapping spells it: fused module -> HF modules in stacking order.
DEFAULT_PACKED: Dict[str, Tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}

# HF tensors vLLM's load_weights() skips: rotary caches are recomputed buffers.
SKIP_SUFFIXES: Tuple[str, ...] = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")

KINDS = ("replicated", "column", "row", "qkv", "merged", "vocab", "unknown")


@dataclass(frozen=True)
class ParamLayout:
    """What plan() needs to know about one parameter of a TP worker.

    shape: this rank's (local) shape. kind: one of KINDS. dim: the shard
    dimension (column/qkv/merged/vocab: the parameter's output_dim, 0 for
    vLLM's weights and biases; row: input_dim, 1). parts: for 'qkv' and
    'merged', this rank's rows of each HF part in stacking order (qkv: q, k, v).
    replicas: for 'qkv', how many ranks share one k/v shard
    (num_kv_head_replicas). vocab: for 'vocab', the unpadded vocabulary size."""

    name: str
    shape: Tuple[int, ...]
    kind: str = "replicated"
    dim: int = 0
    parts: Tuple[int, ...] = ()
    replicas: int = 1
    vocab: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind must be one of {KINDS}, not {self.kind!r}")


@dataclass(frozen=True)
class Placement:
    """Where one HF tensor goes on this rank.

    param, dim, offset, length: the destination is
    param.narrow(dim, offset, length) (offset 0, length = the parameter's size
    along dim for a non-fused parameter). slice: (dim, start, length) of the
    HF tensor to read, or None for the whole tensor. zero: (dim, start,
    length) of the parameter the loader fills with zeros (vocab padding), or
    None."""

    hf_name: str
    param: str
    dim: int
    offset: int
    length: int
    slice: Optional[Tuple[int, int, int]] = None
    zero: Optional[Tuple[int, int, int]] = None


@dataclass
class Plan:
    """plan()'s answer. placements: HF name -> Placement. skipped: HF names
    deliberately not loaded (rotary buffers; lm_head.weight when the model
    ties it to the embeddings). unmapped: HF names with no parameter (or a
    shape that does not fit): the plan cannot load them. uncovered: parameters
    no HF name reaches. complete: no unmapped names and no uncovered
    parameters."""

    placements: Dict[str, Placement] = field(default_factory=dict)
    skipped: List[str] = field(default_factory=list)
    unmapped: List[str] = field(default_factory=list)
    uncovered: List[str] = field(default_factory=list)
    problems: List[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not (self.unmapped or self.uncovered or self.problems)

    def slices(self) -> Dict[str, Tuple[int, int, int]]:
        """name -> (dim, start, length) for the HF tensors read in part (the
        `slices` argument of Consumer.receive_into); empty when every tensor
        is read whole (TP = 1)."""
        return {n: p.slice for n, p in self.placements.items() if p.slice is not None}

    def why_incomplete(self) -> str:
        out = []
        if self.problems:
            out.append("; ".join(self.problems[:3]))
        if self.unmapped:
            out.append(f"{len(self.unmapped)} tensor(s) without a parameter, e.g. '{self.unmapped[0]}'")
        if self.uncovered:
            out.append(f"{len(self.uncovered)} parameter(s) no tensor reaches, e.g. '{self.uncovered[0]}'")
        return "; ".join(out) or "complete"


def _split(name: str) -> Tuple[str, str]:
    """'a.b.q_proj.weight' -> ('a.b.q_proj', 'weight')."""
    mod, _, leaf = name.rpartition(".")
    return mod, leaf


def _fused_target(hf_name: str, packed: Mapping[str, Sequence[str]]) -> Optional[Tuple[str, int]]:
    """HF name of a part of a fused module -> (fused parameter name, part index)."""
    mod, leaf = _split(hf_name)
    prefix, _, last = mod.rpartition(".")
    for fused, parts in packed.items():
        if last in parts:
            target = f"{prefix}.{fused}.{leaf}" if prefix else f"{fused}.{leaf}"
            return target, list(parts).index(last)
    return None


def plan(
    hf: Mapping[str, Sequence[int]],
    params: Mapping[str, ParamLayout],
    tp_rank: int,
    tp_size: int,
    packed: Optional[Mapping[str, Sequence[str]]] = None,
) -> Plan:
    """The placements of the HF tensors `hf` (name -> full shape) on TP rank
    `tp_rank` of `tp_size`, for parameters `params` (name -> ParamLayout).
    Pure: no tensors, no vLLM. See the module doc for the layouts."""
    if not (0 <= tp_rank < tp_size):
        raise ValueError(f"tp_rank {tp_rank} is not in [0, {tp_size})")
    packed = DEFAULT_PACKED if packed is None else packed
    out = Plan()
    reached = set()
    for name, shape in hf.items():
        shape = tuple(int(s) for s in shape)
        if name.endswith(SKIP_SUFFIXES):
            out.skipped.append(name)
            continue
        p = params.get(name)
        part = None
        if p is None:
            fused = _fused_target(name, packed)
            if fused is not None and fused[0] in params:
                p, part = params[fused[0]], fused[1]
        if p is None:
            if name == "lm_head.weight" and "lm_head.weight" not in params:
                out.skipped.append(name)  # tied to the embeddings: vLLM skips it too
            else:
                out.unmapped.append(name)
            continue
        try:
            pl = _place(name, shape, p, part, tp_rank, tp_size)
        except ValueError as e:
            out.problems.append(str(e))
            out.unmapped.append(name)
            continue
        out.placements[name] = pl
        reached.add(p.name)
    out.uncovered = [n for n in params if n not in reached]
    return out


def expected_hf(
    params: Mapping[str, ParamLayout], tp_size: int, packed: Optional[Mapping[str, Sequence[str]]] = None
) -> Dict[str, Tuple[int, ...]]:
    """The inverse of plan(): the HF tensors (name -> full shape) that a
    trainer sends for these parameters. A fused parameter yields its parts
    (q_proj/k_proj/v_proj, gate_proj/up_proj, after `packed`). This lets a
    consumer build its destinations before it sees a sync's manifest."""
    packed = DEFAULT_PACKED if packed is None else packed
    out: Dict[str, Tuple[int, ...]] = {}
    for p in params.values():
        local = tuple(p.shape)
        if p.kind in ("replicated", "unknown"):
            out[p.name] = local  # unknown: plan() reports it
            continue
        d = p.dim

        def full(rows):
            s = list(local)
            s[d] = rows
            return tuple(s)

        if p.kind in ("column", "row"):
            out[p.name] = full(local[d] * tp_size)
        elif p.kind == "vocab":
            out[p.name] = full(p.vocab or local[d] * tp_size)
        else:
            mod, leaf = _split(p.name)
            prefix, _, fused = mod.rpartition(".")
            parts = packed.get(fused)
            if parts is None or len(parts) != len(p.parts):
                raise ValueError(f"parameter '{p.name}' is {p.kind} with {len(p.parts)} parts, but the packed "
                                 f"mapping gives {list(parts or ())} for '{fused}'")
            for i, (hf_mod, rows) in enumerate(zip(parts, p.parts)):
                shards = tp_size // max(1, int(p.replicas)) if (p.kind == "qkv" and i > 0) else tp_size
                name = f"{prefix}.{hf_mod}.{leaf}" if prefix else f"{hf_mod}.{leaf}"
                out[name] = full(rows * shards)
    return out


def _place(name, shape, p: ParamLayout, part, rank, tp) -> Placement:
    local = tuple(p.shape)
    if len(shape) != len(local):
        raise ValueError(f"'{name}' has {len(shape)} dimensions, parameter '{p.name}' {len(local)}")
    kind, d = p.kind, p.dim
    if kind == "unknown":
        raise ValueError(f"parameter '{p.name}' has a layout shmcast.tp does not know (a quantized, TP-disabled or "
                         "custom parallel layer)")
    if part is not None and kind not in ("qkv", "merged"):
        raise ValueError(f"'{name}' is part {part} of '{p.name}', which is not fused ({kind})")
    if kind in ("qkv", "merged") and part is None:
        raise ValueError(f"'{name}' names the fused parameter '{p.name}' itself: send its parts in HF naming")

    def others_equal():
        for i, (a, b) in enumerate(zip(shape, local)):
            if i != d and a != b:
                raise ValueError(f"'{name}' {list(shape)} does not fit parameter '{p.name}' {list(local)} "
                                 f"(dimension {i})")

    if kind == "replicated":
        if shape != local:
            raise ValueError(f"'{name}' {list(shape)} does not fit replicated parameter '{p.name}' {list(local)}")
        return Placement(name, p.name, 0, 0, local[0] if local else 1)
    others_equal()
    n = local[d]
    if kind in ("column", "row"):
        if shape[d] != n * tp:
            raise ValueError(f"'{name}': {shape[d]} along dimension {d} is not {tp} x {n} ({kind}-parallel "
                             f"'{p.name}')")
        return Placement(name, p.name, d, 0, n, (d, rank * n, n) if tp > 1 else None)
    if kind == "vocab":
        vocab = p.vocab or shape[d]
        if shape[d] != vocab:
            raise ValueError(f"'{name}': {shape[d]} rows, but the vocabulary of '{p.name}' is {vocab}")
        if n * tp < vocab:
            raise ValueError(f"'{name}': {tp} x {n} padded rows cannot hold a vocabulary of {vocab}")
        start = min(rank * n, vocab)  # a rank past the vocabulary holds padding only
        length = max(0, min(n, vocab - start))
        sl = None if (start == 0 and length == vocab) else (d, start, length)
        zero = (d, length, n - length) if length < n else None
        return Placement(name, p.name, d, 0, length, sl, zero)
    # fused: qkv or merged
    parts = tuple(p.parts)
    if part >= len(parts):
        raise ValueError(f"'{name}' is part {part} of '{p.name}', which has {len(parts)} parts")
    if sum(parts) != n:
        raise ValueError(f"parameter '{p.name}': parts {list(parts)} do not add up to {n}")
    rows = parts[part]
    offset = sum(parts[:part])
    if kind == "qkv" and part > 0:
        replicas = max(1, int(p.replicas))
        shard, shards = rank // replicas, tp // replicas
    else:
        shard, shards = rank, tp
    if shape[d] != rows * shards:
        raise ValueError(f"'{name}': {shape[d]} along dimension {d} is not {shards} x {rows} "
                         f"(part {part} of '{p.name}')")
    sl = None if shards == 1 else (d, shard * rows, rows)
    return Placement(name, p.name, d, offset, rows, sl)


# ------------------------------------------------------------ live models


# The layers whose sharding plan() understands, by exact class name (vLLM's
# model_executor/layers/linear.py and vocab_parallel_embedding.py; SGLang's
# ports use the same names). Another subclass of a parallel layer may lay its
# parameter out differently (interleaved heads, extra parts): 'unknown'.
_LAYERS = {
    "QKVParallelLinear": "qkv",
    "MergedColumnParallelLinear": "merged",
    "ColumnParallelLinear": "column",
    "RowParallelLinear": "row",
    "ReplicatedLinear": "replicated",
    "VocabParallelEmbedding": "vocab",
    "ParallelLMHead": "vocab",
}
_FAMILIES = ("LinearBase", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding")


def describe_model(model, tp_size: int = 1) -> Dict[str, ParamLayout]:
    """ParamLayouts of a vLLM (or SGLang) model's parameters, read off its
    modules: the layers of _LAYERS by exact class name and their attributes
    (num_heads, num_kv_heads, head_size, num_kv_head_replicas, output_sizes,
    org_vocab_size; the parameters' output_dim / input_dim), any other module's
    parameters replicated. Other subclasses of the parallel layers, layers
    with a quant_config, and layers that disabled TP are 'unknown': plan()
    reports them and callers fall back to model.load_weights()."""
    out: Dict[str, ParamLayout] = {}
    seen = set()
    for mod_name, mod in model.named_modules():
        for leaf, prm in mod.named_parameters(recurse=False):
            if id(prm) in seen:
                continue  # tied (lm_head = embed_tokens): named once, as named_parameters() does
            seen.add(id(prm))
            full = f"{mod_name}.{leaf}" if mod_name else leaf
            out[full] = _layout(full, leaf, tuple(prm.shape), prm, mod, tp_size)
    return out


def _layout(full, leaf, shape, prm, mod, tp) -> ParamLayout:
    cls = type(mod).__name__
    kind = _LAYERS.get(cls)
    if kind is None:
        bases = [c.__name__ for c in type(mod).__mro__]
        if any(b in _FAMILIES for b in bases):
            return ParamLayout(full, shape, "unknown")
        return ParamLayout(full, shape, "replicated")
    if getattr(mod, "quant_config", None) is not None or getattr(mod, "tp_size", tp) != tp:
        return ParamLayout(full, shape, "unknown")
    out_dim = getattr(prm, "output_dim", 0)
    in_dim = getattr(prm, "input_dim", 1)
    if kind == "qkv":
        q = mod.num_heads * mod.head_size
        kv = mod.num_kv_heads * mod.head_size
        v = mod.num_kv_heads * getattr(mod, "v_head_size", mod.head_size)
        return ParamLayout(full, shape, "qkv", out_dim, (q, kv, v), int(getattr(mod, "num_kv_head_replicas", 1)))
    if kind == "merged":
        return ParamLayout(full, shape, "merged", out_dim, tuple(int(s) // tp for s in mod.output_sizes))
    if kind == "vocab":
        return ParamLayout(full, shape, "vocab", out_dim, vocab=int(mod.org_vocab_size))
    if kind == "row":
        if leaf == "bias":  # added after the all-reduce: every rank holds all of it
            return ParamLayout(full, shape, "replicated")
        return ParamLayout(full, shape, "row", in_dim)
    if kind == "column":
        return ParamLayout(full, shape, "column", out_dim)
    return ParamLayout(full, shape, "replicated")


def packed_of(model) -> Dict[str, Tuple[str, ...]]:
    """The model's packed_modules_mapping (vLLM's class attribute: fused
    module -> HF modules in stacking order), else the Llama/Qwen2 default."""
    packed = getattr(type(model), "packed_modules_mapping", None) or DEFAULT_PACKED
    return {k: tuple(v) for k, v in packed.items()}


def plan_for_model(model, tp_rank: int, tp_size: int, hf: Optional[Mapping[str, Sequence[int]]] = None) -> Plan:
    """plan() for a live model: layouts from describe_model(), fused modules
    from packed_of(model); `hf` defaults to expected_hf() of those layouts
    (what a trainer in HF naming sends)."""
    packed = packed_of(model)
    layouts = describe_model(model, tp_size)
    if hf is None:
        hf = expected_hf(layouts, tp_size, packed)
    return plan(hf, layouts, tp_rank, tp_size, packed)


def read_fraction(pl: Plan, hf: Mapping[str, Sequence[int]], itemsize: Mapping[str, int]) -> Tuple[int, int]:
    """(bytes this rank reads, bytes of the whole sync) under plan `pl`."""
    total = got = 0
    for name, shape in hf.items():
        n = itemsize.get(name, 1)
        for s in shape:
            n *= int(s)
        total += n
        p = pl.placements.get(name)
        if p is None:
            continue
        if p.slice is None:
            got += n
        else:
            d, _, length = p.slice
            got += n // int(shape[d]) * length if int(shape[d]) else 0
    return got, total
