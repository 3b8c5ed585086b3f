"""The dtype table: torch dtypes <-> shmcast dtype names.

The shmcast names and their element sizes are the library's (_C.dtypes,
shmcast::dtype_name / dtype_size); this module only pairs them with torch's
dtypes. tests (test_shared_rules.py) check that the two agree.
"""
from __future__ import annotations

import torch

from . import _shmcast as _C

# torch attribute name -> shmcast DType name (_C.dtypes: the library's table). Types this
# torch lacks (uint16/32/64 before 2.3, float8 before 2.1, ...) are skipped.
_DTYPE_PAIRS = (
    ("bool", "bool"),
    ("uint8", "u8"),
    ("int8", "i8"),
    ("int16", "i16"),
    ("int32", "i32"),
    ("int64", "i64"),
    ("uint16", "u16"),
    ("uint32", "u32"),
    ("uint64", "u64"),
    ("float16", "f16"),
    ("bfloat16", "bf16"),
    ("float32", "f32"),
    ("float64", "f64"),
    ("complex64", "c64"),
    ("complex128", "c128"),
    ("float8_e4m3fn", "f8e4m3fn"),
    ("float8_e5m2", "f8e5m2"),
    ("float8_e4m3fnuz", "f8e4m3fnuz"),
    ("float8_e5m2fnuz", "f8e5m2fnuz"),
    ("float8_e8m0fnu", "f8e8m0fnu"),
)
_TO_NAME: dict = {}
_FROM_NAME: dict = {}
for _attr, _name in _DTYPE_PAIRS:
    _dt = getattr(torch, _attr, None)
    if isinstance(_dt, torch.dtype):
        _TO_NAME[_dt] = _name
        _FROM_NAME[_name] = _dt
_FROM_NAME["raw"] = torch.uint8  # untyped bytes, shape (nbytes,)
del _attr, _name, _dt


def supported_dtypes() -> list:
    """The torch dtypes this process can send and receive."""
    return list(_TO_NAME)


def dtype_name(dtype: torch.dtype) -> str:
    """shmcast's name for a torch dtype ('bf16', 'f32', ...)."""
    try:
        return _TO_NAME[dtype]
    except KeyError:
        raise TypeError(f"shmcast cannot carry torch dtype {dtype}") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a shmcast dtype name."""
    try:
        return _FROM_NAME[name]
    except KeyError:
        raise TypeError(
            f"shmcast dtype '{name}' has no torch dtype in this process (torch {torch.__version__}); "
            "upgrade torch on the receiving side"
        ) from None


# Bytes per element of each dtype this process carries: the library's sizes.
_ELEM_SIZE = {dt: _C.dtypes[name] for dt, name in _TO_NAME.items()}
