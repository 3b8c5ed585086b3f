"""The benches' MoE manifests (shmcast.manifests, mirroring bench/manifests.cpp):
Qwen3-30B-A3B's published sizes, its first N layers, and the dense twin of the
same bytes that the MoE figures are compared against."""
import math

import pytest

from shmcast import manifests as M


def _bytes(shapes):
    return sum(2 * math.prod(s) for _, s in shapes)  # bf16


def test_qwen3_30b_a3b_has_the_published_sizes():
    moe, dense = M.qwen3_30b_a3b_shapes(), M.qwen3_30b_a3b_shapes(dense=True)
    assert len(moe) == 18867 and len(dense) == 579  # the figures bench/manifests.cpp states
    assert _bytes(moe) == _bytes(dense) == 61_064_245_248
    assert sum(1 for _, s in moe if s in ((768, 2048), (2048, 768))) == 48 * 128 * 3
    assert len({n for n, _ in moe}) == len(moe)


@pytest.mark.parametrize("layers", [1, 8, 48])
def test_first_layers_and_the_dense_twin_hold_the_same_bytes(layers):
    moe, dense = M.by_name(f"qwen3-30b-a3b:{layers}"), M.by_name(f"qwen3-30b-a3b-dense:{layers}")
    assert len(moe) == 3 + layers * (9 + 3 * 128) and len(dense) == 3 + layers * 12
    assert _bytes(moe) == _bytes(dense)
    per_layer = _bytes(M.by_name("qwen3-30b-a3b:2")) - _bytes(M.by_name("qwen3-30b-a3b:1"))
    assert _bytes(moe) == _bytes(M.by_name("qwen3-30b-a3b:1")) + (layers - 1) * per_layer


@pytest.mark.parametrize("name", ["qwen3-30b-a3b:0", "qwen3-30b-a3b:49", "qwen3-30b-a3b:x", "qwen3-30b-a3b:",
                                  "qwen3-30b", "qwen2.5-3b:4"])
def test_bad_names_are_refused(name):
    with pytest.raises(ValueError):
        M.by_name(name)
