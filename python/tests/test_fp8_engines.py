"""A BF16 trainer and a block-FP8 engine through the framework backends
(issue 44): the trainer side names quantize= in its producer options, the
engine side names nothing, and the engine's FP8 layers end up holding the
reference quantization (fp8_roles.per_block_cast_to_fp8) of the trainer's
BF16 weights, bit for bit, update after update.

The engine model is a stand-in of a block-FP8 linear layer as vLLM's
Fp8LinearMethod builds it with weight_block_size [128, 128]
(vllm/model_executor/layers/quantization/fp8.py @ 1436674b, read
2026-12-07): create_weights registers `weight` (float8_e4m3fn [out, in]) and
`weight_scale_inv` (float32 [ceil(out/128), ceil(in/128)]), both with the
layer's weight loader. Its process_weights_after_loading does what vLLM
0.11-0.13 did on Hopper without DeepGEMM: the weight stays, the scale is
deleted and registered again as a plain Parameter named `weight_scale` (no
loader), so a plain load_weights() of a checkpoint's `weight_scale_inv`
finds no parameter and only vLLM's layerwise reload (which the shmcast
backend's 'loader' path brackets every update with) restores it. SGLang on
Hopper keeps the checkpoint's parameters and loaders
(python/sglang/srt/layers/quantization/fp8.py: `layer.weight_scale_inv.data
= ...`): the same model with rename=False. Written for shmcast's tests; not
the frameworks' code. Needs a torch with float8_e4m3fn (the GPU machine's;
Debian's 1.13 has none)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fp8_roles as fr

pytestmark = [pytest.mark.usefixtures("deadline"),
              pytest.mark.skipif(not fr.HAS_FP8, reason="this torch has no float8_e4m3fn (torch >= 2.1 does)")]

VARIANTS = [("fp8-block128", False), ("fp8-block128-ue8m0", True)]
# name: (out, in); every one has a partial edge block
LINEAR = {"model.layers.0.self_attn.o_proj": (200, 256), "model.layers.0.mlp.down_proj": (256, 330)}
PLAIN = {"model.embed_tokens.weight": (300, 256), "model.norm.weight": (256,)}


def loader(param, loaded):
    """A loader that takes only what a block-FP8 checkpoint holds: the same
    shape and the same dtype (a bf16 tensor into a float8 parameter would
    otherwise be converted silently)."""
    if param.shape != loaded.shape or param.dtype != loaded.dtype:
        raise ValueError(f"{loaded.dtype} {tuple(loaded.shape)} into a parameter of {param.dtype} {tuple(param.shape)}")
    param.data.copy_(loaded)


class BlockFp8Method:
    def __init__(self, rename: bool):
        self.rename = rename

    def create_weights(self, layer, out_features, in_features):
        w = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn), requires_grad=False)
        s = nn.Parameter(torch.empty(-(-out_features // 128), -(-in_features // 128), dtype=torch.float32),
                         requires_grad=False)
        w.weight_loader = s.weight_loader = loader
        layer.register_parameter("weight", w)
        layer.register_parameter("weight_scale_inv", s)

    def process_weights_after_loading(self, layer):
        if not self.rename:
            return
        s = layer.weight_scale_inv.data
        del layer.weight_scale_inv
        layer.register_parameter("weight_scale", nn.Parameter(s, requires_grad=False))


class Fp8Linear(nn.Module):
    def __init__(self, out_features, in_features, rename):
        super().__init__()
        self.quant_method = BlockFp8Method(rename)
        self.quant_method.create_weights(self, out_features, in_features)


class Fp8Engine(nn.Module):
    """The engine's model: FP8 linears, a bf16 embedding and norm."""

    def __init__(self, rename: bool):
        super().__init__()
        for name, (o, i) in LINEAR.items():
            self._put(name, Fp8Linear(o, i, rename))
        for name, shape in PLAIN.items():
            mod_name, leaf = name.rsplit(".", 1)
            self._put(mod_name, nn.Module())
            p = nn.Parameter(torch.empty(*shape, dtype=torch.bfloat16), requires_grad=False)
            self.get_submodule(mod_name).register_parameter(leaf, p)

    def _put(self, dotted, mod):
        *path, leaf = dotted.split(".")
        m = self
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, nn.Module())
            m = getattr(m, part)
        if not hasattr(m, leaf):
            m.add_module(leaf, mod)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, w in weights:
            if name not in params:
                raise KeyError(f"no parameter '{name}' to load into")
            p = params[name]
            getattr(p, "weight_loader", loader)(p, w)


def trainer_weights(seed: int) -> list:
    """The trainer's bf16 model (HF names)."""
    g = torch.Generator().manual_seed(seed)
    out = [(f"{n}.weight", (torch.randn(o, i, generator=g) * 0.02).to(torch.bfloat16)) for n, (o, i) in LINEAR.items()]
    out[0][1][::37, ::41] *= 500  # blocks of very different maxima
    out += [(n, torch.randn(*s, generator=g).to(torch.bfloat16)) for n, s in PLAIN.items()]
    return out


def build(rename: bool, ue8m0: bool) -> Fp8Engine:
    """vLLM's order: create, load the FP8 checkpoint, record, process."""
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    m = Fp8Engine(rename)
    m.load_weights(checkpoint(trainer_weights(0), ue8m0))
    record_metadata_for_reloading(m)
    for layer in m.modules():
        if isinstance(layer, Fp8Linear):
            layer.quant_method.process_weights_after_loading(layer)
    return m


def checkpoint(named, ue8m0: bool) -> list:
    """The block-FP8 checkpoint of `named` (the torch reference)."""
    out = []
    for name, t in named:
        if name.removesuffix(".weight") not in LINEAR:
            out.append((name, t))
            continue
        q, s = fr.per_block_cast_to_fp8(t, ue8m0)
        out += [(name, q.view(torch.float8_e4m3fn)), (name + "_scale_inv", s)]
    return out


def problems(model: Fp8Engine, named, ue8m0: bool, rename: bool) -> list:
    """What the engine holds that differs from the reference of `named`."""
    params = dict(model.named_parameters())
    out = []
    for name, want in checkpoint(named, ue8m0):
        if rename and name.endswith("_scale_inv"):
            name = name.removesuffix("_scale_inv").removesuffix("weight") + "weight_scale"
        got = params.get(name)
        if got is None or got.dtype != want.dtype or not torch.equal(got.data.view(torch.uint8),
                                                                     want.view(torch.uint8)):
            out.append(name)
    return out


@pytest.mark.parametrize("quantize,ue8m0", VARIANTS)
def test_vllm_engine_serving_block_fp8_takes_the_bf16_trainers_updates(region, quantize, ue8m0):
    """vLLM's weight-transfer backend, both sides in this process: the
    trainer engine with producer_options={"quantize": ...}, the worker engine
    of a model with quantization 'fp8' ('auto' loads it through
    load_weights() inside the layerwise reload), two updates in buckets."""
    import shmcast.vllm_plugin
    from vllm.config import ModelConfig, VllmConfig, WeightTransferConfig
    from vllm.distributed.weight_transfer import (ModuleSource, WeightTransferEngineFactory,
                                                  WeightTransferTrainerFactory)

    from shmcast.vllm_transfer import ShmcastTrainerInitInfo

    shmcast.vllm_plugin.register()
    model = build(rename=True, ue8m0=ue8m0)
    kernel = {n: p.data_ptr() for n, p in model.named_parameters()}
    vc = VllmConfig(model_config=ModelConfig(quantization="fp8"),
                    weight_transfer_config=WeightTransferConfig(backend="shmcast"))
    worker = WeightTransferEngineFactory.create_engine(vc.weight_transfer_config, vc, torch.device("cpu"), model)

    class Client:  # vLLM's weight-sync client, calling the one worker directly
        def init_weight_transfer_engine(self, init_info):
            worker.init_transfer_engine(worker.parse_init_info(init_info))

        def start_weight_update(self):
            worker.start_weight_update()

        def update_weights(self, update_info):
            worker.update_weights(update_info)

        def finish_weight_update(self):
            worker.finish_weight_update()

    trainer = nn.Module()
    for name, t in trainer_weights(1):
        Fp8Engine._put(trainer, name.rsplit(".", 1)[0], nn.Module())
        trainer.get_submodule(name.rsplit(".", 1)[0]).register_parameter(name.rsplit(".", 1)[1],
                                                                          nn.Parameter(t, requires_grad=False))
    eng = WeightTransferTrainerFactory.trainer_init(
        ShmcastTrainerInitInfo(rank=0, region=region, consumers=1, slot_bytes=1 << 20, bucket_bytes=200_000,
                               timeout=30.0, producer_options={"quantize": quantize}),
        client=Client(), source=ModuleSource(trainer))
    try:
        for seed in (1, 2):
            params = dict(trainer.named_parameters())
            with torch.no_grad():
                for n, t in trainer_weights(seed):
                    params[n].copy_(t)
            eng.send_weights()
            named = list(trainer.named_parameters())
            assert problems(model, named, ue8m0, rename=True) == [], seed
            assert worker.last_update_stats()["path"] == "loader"
            assert worker.last_update_stats()["syncs"] >= 2  # buckets
        assert {n: p.data_ptr() for n, p in model.named_parameters()} == kernel  # the kernel tensors kept
    finally:
        eng.shutdown()
        worker.shutdown()


@pytest.mark.parametrize("quantize,ue8m0", VARIANTS)
def test_sglang_engine_serving_block_fp8_takes_the_bf16_trainers_updates(region, quantize, ue8m0):
    """SGLang's update_weights_from_tensor with shmcast's custom loader, the
    sender given quantize=: the engine (parameters and loaders kept after
    processing, as SGLang's block-FP8 layers do on Hopper) loads FP8 weights
    and scales by their checkpoint names."""
    from shmcast import sglang

    model = build(rename=False, ue8m0=ue8m0)

    def update(named_tensors, load_format=None, flush_cache=False):  # the engine's TP rank, in this process
        assert load_format == sglang.LOAD_FORMAT
        sglang.load_weights(model, named_tensors)
        return True, "ok"

    sender = sglang.ShmcastSGLangSender(update, region, 1, slot_bytes=1 << 20, bucket_bytes=200_000, timeout=30,
                                        sessions=False, quantize=quantize)
    try:
        for seed in (3, 4):
            named = trainer_weights(seed)
            sender.send(named)
            assert problems(model, named, ue8m0, rename=False) == [], seed
            assert sglang.stats["path"] == "loader"
    finally:
        sender.close()


def test_engine_stand_in_refuses_what_a_block_fp8_checkpoint_does_not_hold():
    """The stand-in is strict where a real engine is: bf16 bytes into its
    FP8 weight, and a plain load of the scales after processing (vLLM
    renamed them), are refused."""
    model = build(rename=True, ue8m0=False)
    named = trainer_weights(5)
    with pytest.raises(ValueError, match="into a parameter of torch.float8_e4m3fn"):
        model.load_weights(named[:1])
    with pytest.raises(KeyError, match="weight_scale_inv"):
        model.load_weights(checkpoint(named, False)[:2])
