"""Quantize-on-send through the Python API (Producer(quantize=...), issue 44):
consumers, with no option, get the FP8 tensors and their scales bit for bit
as the torch reference (fp8_roles.per_block_cast_to_fp8: DeepGEMM's formula
in torch ops, CPU tensors) makes them; the filter's forms; NaN; a late
joiner."""
import pytest
import torch

import fp8_roles as fr
import roles
import shmcast

pytestmark = pytest.mark.usefixtures("deadline")

VARIANTS = [("fp8-block128", False), ("fp8-block128-ue8m0", True)]


@pytest.mark.parametrize("quantize,ue8m0", VARIANTS)
def test_consumer_process_gets_reference_bits(region, procs, quantize, ue8m0):
    with shmcast.Producer(region, slot_bytes=roles.SLOT, quantize=quantize) as prod:
        con = procs.start("fp8_roles:consumer", region=region, seeds=[1, 2], ue8m0=ue8m0)
        procs.ready(con)
        prod.wait_for_consumers(1, 60)
        for seed in (1, 2):
            named = fr.model(seed)
            prod.send(named)
            logical = sum(t.numel() * t.element_size() for _, t in named)
            wire = sum(b.numel() for _, _, b in fr.expected(named, ue8m0))
            assert prod.last_sync["logical_bytes"] == logical
            assert prod.last_sync["payload_bytes"] == wire
            assert wire < 0.6 * logical  # this model keeps embeddings, lm_head and the router in bf16
        res = procs.get(con)
    assert res["problems"] == [] and res["aborted"] == []


@pytest.mark.skipif(not fr.HAS_FP8, reason="this torch has no float8_e4m3fn (torch >= 2.1 does)")
@pytest.mark.parametrize("quantize,ue8m0", VARIANTS)
def test_receive_yields_float8_tensors_and_scales(region, quantize, ue8m0):
    named = fr.model(3)
    with shmcast.Producer(region, slot_bytes=roles.SLOT, quantize=quantize) as prod, \
            shmcast.Consumer(region) as con:
        prod.send(named)
        got = dict(con.receive(timeout=30))
    for name, t in named:
        if not shmcast.default_quantize_filter(name, tuple(t.shape), fr._dt(t)):
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
            continue
        q, s = fr.per_block_cast_to_fp8(t, ue8m0)
        assert got[name].dtype == torch.float8_e4m3fn and got[name].shape == t.shape
        assert torch.equal(got[name].view(torch.uint8), q)
        scale = got[name + "_scale_inv"]
        assert scale.dtype == torch.float32 and tuple(scale.shape) == ((t.shape[0] + 127) // 128,
                                                                       (t.shape[1] + 127) // 128)
        assert torch.equal(scale, s)
    # What vLLM's load_weights of a block-FP8 model takes from a checkpoint.
    assert sorted(n for n in got if n.endswith("_scale_inv")) == [
        "model.layers.0.mlp.down_proj.weight_scale_inv", "model.layers.0.self_attn.o_proj.weight_scale_inv"]


def test_reference_matches_library_edge_cases():
    # The test's conversion against torch's documented edges (c10): ties to
    # even, the NaN code above 464, signs.
    x = torch.tensor([448.0, 464.0, 464.0001, 480.0, -1e30, float("inf"), float("nan"), 2.0 ** -10,
                      3 * 2.0 ** -10, -0.0, 1.0625, 1.1875])
    assert fr.to_e4m3_codes(x).tolist() == [0x7E, 0x7E, 0x7F, 0x7F, 0xFF, 0x7F, 0x7F, 0x00, 0x02, 0x80, 0x38, 0x3A]


def test_nan_fails_the_send_naming_the_tensor(region, procs):
    with shmcast.Producer(region, slot_bytes=roles.SLOT, quantize="fp8-block128") as prod:
        con = procs.start("fp8_roles:consumer", region=region, seeds=[1, 4], ue8m0=False)
        procs.ready(con)
        prod.wait_for_consumers(1, 60)
        prod.send(fr.model(1))
        bad = fr.model(2)
        bad[4][1][3, 5] = float("nan")
        with pytest.raises(shmcast.InvalidArgument, match=r"'model.layers.0.self_attn.o_proj.weight' holds NaN "
                                                          r"at \[3, 5\]"):
            prod.send(bad)
        prod.send(fr.model(4))
        res = procs.get(con)
    assert res["problems"] == []
    assert all("o_proj.weight' holds NaN" in a for a in res["aborted"])


def test_filter_forms(region):
    # A callable of (name, shape); a quantization_config; refusals.
    named = fr.model(5)
    only_big = {"model.layers.0.mlp.down_proj.weight"}
    cfg = {"quant_method": "fp8", "weight_block_size": [128, 128],
           "modules_to_not_convert": ["self_attn.o_proj"]}
    for filt in (lambda name, shape: name in only_big, cfg):
        with shmcast.Producer(region, slot_bytes=roles.SLOT, quantize="fp8-block128", quantize_filter=filt) as prod:
            con = shmcast._shmcast.Consumer(region, pin="no")
            prod.send(named)
            got = fr.read_raw(con, 30)
            con.close()
        assert fr.compare(got, fr.expected(named, False, selected=lambda n: n in only_big)) == []
    with shmcast.Producer(region, slot_bytes=roles.SLOT, quantize="fp8-block128",
                          quantize_filter=lambda name, shape: name.endswith("layernorm.weight")) as prod:
        with pytest.raises(shmcast.InvalidArgument, match=r"input_layernorm.weight.*only 2-D bf16, f16 or f32"):
            prod.send(named)
        assert prod.last_version == 0
    with pytest.raises(ValueError, match="weight_block_size"):
        shmcast.Producer(region, quantize="fp8-block128", quantize_filter={"weight_block_size": [1, 128]})
    with pytest.raises(ValueError, match="no weight_block_size"):  # per-tensor FP8: no block scales
        shmcast.Producer(region, quantize="fp8-block128", quantize_filter={"quant_method": "fp8"})
    # Modules match whole dot-separated parts: layer 1 is not layers 10-19.
    keep = shmcast._quant.filter_from_config({"weight_block_size": [128, 128],
                                              "modules_to_not_convert": ["model.layers.1", "o_proj"]})
    assert not keep("model.layers.1.mlp.up_proj.weight", (256, 256), "bf16")
    assert keep("model.layers.10.mlp.up_proj.weight", (256, 256), "bf16")
    assert not keep("model.layers.10.self_attn.o_proj.weight", (256, 256), "bf16")
    assert keep("model.layers.10.self_attn.xo_proj.weight", (256, 256), "bf16")
    with pytest.raises(shmcast.InvalidArgument, match="quantize must be"):
        shmcast.Producer(region, quantize="int4")


def test_sync_names_are_the_manifests(region):
    """Producer.sync_names(named), which the framework backends announce
    (a count and a digest) before they send, is the names of the manifest
    that send(named) writes: every filter form, no quantize, a mapping, and
    a refusal where send() refuses."""
    from shmcast._load import names_digest

    named = fr.model(6)
    for quantize, filt in ((None, None), ("fp8-block128", None), ("fp8-block128-ue8m0", None),
                           ("fp8-block128", lambda name, shape: shape[0] == 1000),
                           ("fp8-block128", {"weight_block_size": [128, 128], "ignored_layers": ["o_proj"]})):
        with shmcast.Producer(region, slot_bytes=roles.SLOT, quantize=quantize, quantize_filter=filt) as prod:
            con = shmcast._shmcast.Consumer(region, pin="no")
            want = prod.sync_names(named)
            assert prod.sync_names(dict(named)) == want
            assert prod.last_version == 0  # nothing sent
            prod.send(named)
            got = [n for n, _, _ in fr.read_raw(con, 30)]
            con.close()
        assert got == want, (quantize, filt)
        assert names_digest(got) == names_digest(want)
        assert len(want) == len(named) + (0 if quantize is None else 2 if filt is None else 1), (quantize, filt)
    with shmcast.Producer(region, slot_bytes=roles.SLOT, quantize="fp8-block128",
                          quantize_filter=lambda name, shape: len(shape) == 1) as prod:
        with pytest.raises(shmcast.InvalidArgument, match=r"input_layernorm.weight.*only 2-D bf16, f16 or f32"):
            prod.sync_names(named)
    # A sharded producer's manifest merges every rank's list: one rank cannot name it.
    with shmcast.Producer(region, slot_bytes=roles.SLOT, slots=4, rank=0, world_size=2, quantize="fp8-block128") as prod:
        with pytest.raises(shmcast.Unsupported, match="sharded producer"):
            prod.sync_names(named)


def test_default_filter_is_the_librarys():
    f = shmcast.default_quantize_filter
    assert f("model.layers.0.mlp.up_proj.weight", (11008, 2048), "bf16")
    assert not f("model.layers.0.mlp.gate.weight", (128, 2048), "bf16")
    assert not f("model.embed_tokens.weight", (151936, 2048), "bf16")
    assert not f("lm_head.weight", (151936, 2048), "bf16")
    assert not f("model.norm.weight", (2048,), "bf16")
    assert not f("model.layers.0.mlp.up_proj.weight", (11008, 2048), "i32")


def test_late_joiner_of_a_store_region(region, procs):
    named = fr.model(6)
    with shmcast.Producer(region, mode="store", store_bytes=shmcast.store_bytes_for(named),
                          quantize="fp8-block128-ue8m0") as prod:
        prod.send(named)
        con = procs.start("fp8_roles:consumer", region=region, seeds=[6], ue8m0=True)
        procs.ready(con)
        res = procs.get(con)
    assert res["problems"] == [] and res["aborted"] == []


@pytest.mark.cuda
@pytest.mark.parametrize("quantize,ue8m0", VARIANTS)
def test_cuda_tensors_are_quantized_on_the_gpu(region, quantize, ue8m0):
    # The library's kernels (engine 'cuda') give the torch reference's bits.
    named = fr.model(7)
    with shmcast.Producer(region, slot_bytes=roles.SLOT, quantize=quantize, engine="cuda") as prod:
        con = shmcast._shmcast.Consumer(region, pin="no")
        prod.send([(n, t.cuda()) for n, t in named])
        got = fr.read_raw(con, 60)
        con.close()
    assert fr.compare(got, fr.expected(named, ue8m0)) == []


@pytest.mark.cuda
def test_nan_in_a_cuda_tensor_fails_the_send_before_the_sync_begins(region, procs):
    # send() of CUDA tensors computes every scale on the GPU before the sync
    # begins (Producer.prepare_device): a NaN fails it with nothing announced,
    # so the consumer sees no aborted sync at all, only the good ones.
    with shmcast.Producer(region, slot_bytes=roles.SLOT, quantize="fp8-block128", engine="cuda") as prod:
        con = procs.start("fp8_roles:consumer", region=region, seeds=[1, 4], ue8m0=False)
        procs.ready(con)
        prod.wait_for_consumers(1, 60)
        prod.send([(n, t.cuda()) for n, t in fr.model(1)])
        bad = [(n, t.cuda()) for n, t in fr.model(2)]
        bad[4][1][3, 5] = float("nan")
        with pytest.raises(shmcast.InvalidArgument,
                           match=r"'model.layers.0.self_attn.o_proj.weight' holds NaN or Inf in the block at rows "
                                 r"\[0, .*nothing was sent"):
            prod.send(bad)
        assert prod.last_version == 1
        prod.send([(n, t.cuda()) for n, t in fr.model(4)])
        res = procs.get(con)
    assert res["problems"] == [] and res["aborted"] == []
