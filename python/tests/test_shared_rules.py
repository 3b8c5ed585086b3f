"""The rules Python shares with the library come from the library (_C), and
give the answers they gave when Python kept its own copies: the alignments,
the dtype table, and the check of a read's slices (issue 29)."""
import math
from types import SimpleNamespace

import pytest
import torch

import shmcast
from shmcast import _shmcast as _C
from shmcast import _torch as T


def test_alignments_are_the_librarys():
    assert T._TENSOR_ALIGN == _C.tensor_align == 256
    assert T._DATA_ALIGN == _C.data_align == 2 << 20
    assert shmcast.max_delta_groups == _C.max_delta_groups == 1024  # limits::kMaxDeltaGroups
    # ... and the ones the library lays a sync out with: each tensor starts at
    # a multiple of tensor_align, slots are rounded up to data_align.
    specs = [("a", "u8", (1,)), ("b", "u8", (3,)), ("c", "f32", (5,))]
    stream_bytes, _payload, _chunks, offsets = _C.stream_layout(specs, 1)
    assert offsets == [0, _C.tensor_align, 2 * _C.tensor_align]
    assert stream_bytes == 2 * _C.tensor_align + 20
    _s, _p, chunks, _o = _C.stream_layout([("big", "u8", (_C.data_align + 1,))], 1)
    assert chunks == 2  # a slot of 1 byte holds data_align bytes


def test_dtype_table_is_the_librarys():
    assert list(_C.dtypes) == _C.dtype_names()
    for name, size in _C.dtypes.items():
        assert _C.dtype_size(name) == size
    # Every dtype the library knows has its torch pair here (raw: untyped bytes).
    assert {n for _attr, n in T._DTYPE_PAIRS} | {"raw"} == set(_C.dtypes)
    assert T.torch_dtype("raw") is torch.uint8
    assert T.supported_dtypes(), "torch has none of the library's dtypes?"
    for dt in T.supported_dtypes():
        name = T.dtype_name(dt)
        assert T.torch_dtype(name) is dt
        assert T._ELEM_SIZE[dt] == _C.dtypes[name] == torch.empty((), dtype=dt).element_size(), dt


def _old_check_slices(info, slices):
    """_check_slices as Python wrote it before it asked the library (1e07059)."""
    out = {}
    if not slices:
        return out
    shapes = {t[0]: t[2] for t in info.tensors}
    for name, sel in slices.items():
        shape = shapes.get(name)
        if shape is None:
            continue
        try:
            dim, start, length = (int(x) for x in sel)
        except (TypeError, ValueError):
            raise shmcast.Mismatch(f"slice of '{name}': expected (dim, start, length), got {sel!r}") from None
        if dim < 0:
            dim += len(shape)
        if not (0 <= dim < len(shape)) or start < 0 or length < 0 or start + length > shape[dim]:
            raise shmcast.Mismatch(f"slice of '{name}': rows [{start}, +{length}) along dim {dim} do not fit its "
                                   f"shape {list(shape)}")
        out[name] = (dim, start, length)
    return out


def _tensor(name, dt, shape):
    return (name, dt, shape, _C.dtypes[dt] * math.prod(shape), 0)


TENSORS = [_tensor("m", "f32", (4, 6)), _tensor("v", "bf16", (8,)), _tensor("s", "i64", ()),
           _tensor("e", "f16", (0, 3)), _tensor("z", "u8", (3, 0, 2))]
SELECTIONS = [
    # fit
    (0, 0, 4), (0, 1, 2), (1, 5, 1), (1, 6, 0), (0, 4, 0), (-1, 2, 3), (-2, 0, 4), (1, 0, 0), (2, 0, 2),
    (0.0, 1, 2.9), ("0", "1", "2"), [0, 0, 1],
    # out of range: past the end, negative, a dim the tensor lacks
    (0, 3, 2), (0, 5, 0), (1, 0, 7), (1, 7, 0), (0, 6, 1), (0, -1, 1), (0, 1, -1), (2, 0, 1), (-3, 0, 1), (9, 0, 1),
    (-9, 0, 1), (0, 2 ** 70, 1), (0, 0, 2 ** 70), (0, 2 ** 62, 2 ** 62), (2 ** 40, 0, 1), (-2 ** 40, 0, 1),
    # not a (dim, start, length)
    (0, 1), (0, 1, 2, 3), "abc", None, 3, (0, "x", 1), (0, None, 1),
]


def _outcome(fn, info, slices):
    try:
        return ("ok", fn(info, slices))
    except Exception as e:  # noqa: BLE001  (the comparison is the test)
        return (type(e), str(e))


@pytest.mark.parametrize("sel", SELECTIONS, ids=repr)
def test_slice_check_answers_as_before(sel):
    info = SimpleNamespace(tensors=TENSORS)
    for t in TENSORS:
        slices = {t[0]: sel, "absent": (0, 0, 1)}
        new, old = _outcome(T._check_slices, info, slices), _outcome(_old_check_slices, info, slices)
        assert new == old, (t, sel)
        if new[0] != "ok":
            assert new[0] is shmcast.Mismatch
            continue
        # The destination's bytes: the library's count, as Python counted them.
        dim, start, length = new[1][t[0]]
        assert _C.selection_problem(t, (dim, start, length)) == ""
        shape = t[2][:dim] + (length,) + t[2][dim + 1:]
        assert _C.selection_bytes(t, (dim, start, length)) == _C.dtypes[t[1]] * math.prod(shape)


def test_selection_check_is_the_librarys():
    m = _tensor("m", "f32", (4, 6))
    assert _C.selection_problem(m, None) == "" and _C.selection_bytes(m, None) == 96
    assert "outside dim 0 of size 4" in _C.selection_problem(m, (0, 3, 2))
    assert "not a dimension" in _C.selection_problem(m, (2, 0, 1))
    assert _C.selection_bytes(m, (1, 2, 3)) == 4 * 4 * 3
    with pytest.raises(shmcast.InvalidArgument, match="outside dim 1"):
        _C.selection_bytes(m, (1, 5, 2))
    with pytest.raises(shmcast.InvalidArgument, match="selection dim"):  # the binding's range, as read_into's
        _C.selection_problem(m, (-1, 0, 1))
