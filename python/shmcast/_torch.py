"""The torch-native API: Producer.send(named_tensors) and Consumer.receive().

Tensors cross into C++ as raw pointers; no tensor data is pickled, copied
through Python, or touched by the GIL-holding thread. A whole sync is one
Python->C++ call in the common case (every tensor contiguous or a row-pitched
2-D view): the per-tensor Python work is reading dtype/shape/data_ptr.

The code lives in one module per concern; this module re-exports every name
it held when it was one file, so `from shmcast._torch import ...` keeps
working:
  _dtypes    torch dtypes <-> the library's dtype table
  _memory    buffers, views, the alignments, checks on tensors' memory
  _producer  Producer, Shard
  _consumer  Consumer, Mismatch, the slice check
  _store     StoreView, ReadOnlyTensor, ReadOnly, store_bytes_for
"""
from __future__ import annotations

import torch  # noqa: F401

from . import _shmcast as _C  # noqa: F401
from ._consumer import Consumer, Mismatch, _check_slices  # noqa: F401
from ._dtypes import (  # noqa: F401
    _DTYPE_PAIRS,
    _ELEM_SIZE,
    _FROM_NAME,
    _TO_NAME,
    dtype_name,
    supported_dtypes,
    torch_dtype,
)
from ._memory import (  # noqa: F401
    _DATA_ALIGN,
    _MIN_ROW_BYTES,
    _STRIDE_CACHE,
    _TENSOR_ALIGN,
    _alloc,
    _Closing,
    _contiguous_strides,
    _copy_back,
    _CudaArray,
    _free_bytes,
    _overlaps,
    _parse_device,
    _round_up,
    _row_pitch,
    _TensorAt,
    _unwritable,
    _views,
)
from ._producer import Producer, Shard, _dtensor_piece, _local_shape  # noqa: F401
from ._store import (  # noqa: F401
    _DUNDER_INPLACE,
    _INPLACE_PARAM,
    _METADATA_INPLACE,
    _NO_TORCH_FUNCTION,
    ReadOnly,
    ReadOnlyTensor,
    StoreView,
    _read_only_in,
    _rewrap,
    _spans,
    _StoreLease,
    _writes_read_only,
    store_bytes_for,
)

__all__ = [
    "Producer",
    "Consumer",
    "Mismatch",
    "ReadOnly",
    "ReadOnlyTensor",
    "dtype_name",
    "torch_dtype",
    "supported_dtypes",
]
