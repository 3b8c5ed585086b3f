"""Quantize-on-send's Python side: the filter argument of Producer.

The rules (which tensors, the FP8 format, the scales' name) are the
library's (shmcast::Quantize, default_quantize_filter; docs/protocol.md
§14): this module only turns what a Python caller gives into the callable
the library calls, f(name, shape, dtype name) -> bool.
"""
from __future__ import annotations

from collections.abc import Mapping

from . import _shmcast as _C

BLOCK = _C.quantize_block
SCALE_SUFFIX = _C.quantize_scale_suffix
NAMES = _C.quantize_names


def _config_dict(config) -> dict:
    if isinstance(config, Mapping):
        return dict(config)
    to_dict = getattr(config, "to_dict", None)  # transformers' QuantizationConfig
    if callable(to_dict):
        return dict(to_dict())
    return dict(vars(config))


def filter_from_config(config):
    """The filter of a model's quantization_config (a dict, or an object
    with those attributes): the library's default rule, less the modules
    named in modules_to_not_convert (or ignored_layers), each matched as
    whole dot-separated parts of the tensor's name ("model.layers.1" skips
    layer 1, not layers 10-19; "self_attn.o_proj" every layer's o_proj).
    weight_block_size must be [128, 128]; a config without it (per-tensor
    FP8, whose engine takes no block scales) is refused."""
    cfg = _config_dict(config)
    method = cfg.get("quant_method")
    if method not in (None, "fp8"):
        raise ValueError(f"quantization_config has quant_method {method!r}: shmcast quantizes to block 'fp8' only")
    block = cfg.get("weight_block_size")
    if block is None:
        raise ValueError("quantization_config has no weight_block_size: a per-tensor FP8 engine takes no block "
                         f"scales; shmcast sends [{BLOCK}, {BLOCK}] blocks (weight_block_size [{BLOCK}, {BLOCK}])")
    if [int(b) for b in block] != [BLOCK, BLOCK]:
        raise ValueError(f"quantization_config has weight_block_size {list(block)}: shmcast quantizes in "
                         f"[{BLOCK}, {BLOCK}] blocks only")
    skip = [f".{str(m).strip('.')}." for m in (cfg.get("modules_to_not_convert") or cfg.get("ignored_layers") or [])
            if str(m).strip(".")]

    def keep(name: str, shape: tuple, dtype: str) -> bool:
        if not _C.default_quantize_filter(name, shape, dtype):
            return False
        dotted = f".{name}."
        return not any(m in dotted for m in skip)

    return keep


def filter_arg(quantize_filter):
    """Producer's quantize_filter as the library's callable: None (the
    default rule), a callable f(name, shape) -> bool, or a model's
    quantization_config."""
    if quantize_filter is None:
        return None
    if callable(quantize_filter) and not isinstance(quantize_filter, Mapping):
        user = quantize_filter
        return lambda name, shape, dtype: bool(user(name, tuple(shape)))
    return filter_from_config(quantize_filter)
