"""What each framework calls on shmcast's backends, checked against the
framework's own classes: every method signature (parameter names, kinds,
defaults), keyword-only argument, class variable and lifecycle step.

The frameworks come from python/tests/standins (conftest.py puts them first
on sys.path) unless SHMCAST_REAL_FRAMEWORKS names them (comma-separated:
vllm, sglang, verl, roll): then conftest leaves the installed package in
front, and these tests check shmcast against the real one (the GPU machine's
script does that when a framework is installed). `framework_origin` says
which was used."""
import dataclasses
import inspect
import typing

import pytest
import torch

import shmcast
from conftest import framework_origin


def params(fn):
    """(name, kind, default) of every parameter but self/cls."""
    sig = inspect.signature(fn)
    return [(p.name, p.kind, p.default) for p in sig.parameters.values() if p.name not in ("self", "cls")]


def same_call(impl, spec):
    """impl accepts exactly what a caller of spec may pass: same names, same
    kinds (positional / keyword-only), same defaults."""
    assert params(impl) == params(spec), f"{impl.__qualname__}{inspect.signature(impl)} vs " \
                                         f"{spec.__qualname__}{inspect.signature(spec)}"


KW = inspect.Parameter.KEYWORD_ONLY
POS = inspect.Parameter.POSITIONAL_OR_KEYWORD
NO = inspect.Parameter.empty


# ------------------------------------------------------------------ vLLM


def _vllm():
    wt = pytest.importorskip("vllm.distributed.weight_transfer")
    try:
        from vllm.backends.distributed.weight_transfer import base, factory
    except ImportError:  # an older vLLM: the old path is the module itself
        from vllm.distributed.weight_transfer import base, factory
    return wt, base, factory


def test_vllm_trainer_api():
    """vllm-project/vllm @ a8f1d798 (base.py) / 055e47c2 (factory.py): the
    trainer init info carries `backend` as a ClassVar, the trainer engine has
    one type parameter and no config, the factory dispatches on
    init_info.backend."""
    _, base, factory = _vllm()
    import shmcast.vllm_plugin
    from shmcast.vllm_transfer import ShmcastTrainerInitInfo, ShmcastTrainerWeightTransferEngine

    # the framework's side, as the stand-in mirrors it
    assert "backend" in typing.get_type_hints(base.TrainerInitInfo, include_extras=True)
    assert typing.get_origin(typing.get_type_hints(base.TrainerInitInfo)["backend"]) is typing.ClassVar
    assert len(base.TrainerWeightTransferEngine.__parameters__) == 1
    assert params(base.TrainerWeightTransferEngine.__init__) == [("client", KW, NO), ("source", KW, None),
                                                                 ("is_sender", KW, True)]
    assert params(base.TrainerWeightTransferEngine.trainer_init) == [("init_info", POS, NO), ("client", KW, NO),
                                                                     ("source", KW, None)]
    assert params(factory.WeightTransferTrainerFactory.trainer_init) == [("init_info", POS, NO),
                                                                         ("client", KW, NO), ("source", KW, None)]

    # shmcast's side
    assert ShmcastTrainerInitInfo.backend == shmcast.vllm_plugin.BACKEND == "shmcast"
    hints = typing.get_type_hints(ShmcastTrainerInitInfo)
    assert typing.get_origin(hints["backend"]) is typing.ClassVar
    fields = {f.name: f for f in dataclasses.fields(ShmcastTrainerInitInfo)}
    assert "backend" not in fields and fields["rank"].kw_only
    info = ShmcastTrainerInitInfo(rank=1, region="r")
    assert not info.is_sender and info.backend == "shmcast"
    with pytest.raises(TypeError):
        ShmcastTrainerInitInfo(region="r")  # rank is required (keyword-only)
    assert issubclass(ShmcastTrainerWeightTransferEngine, base.TrainerWeightTransferEngine)
    (generic,) = ShmcastTrainerWeightTransferEngine.__orig_bases__
    assert typing.get_args(generic) == (ShmcastTrainerInitInfo,)
    same_call(ShmcastTrainerWeightTransferEngine.__init__, base.TrainerWeightTransferEngine.__init__)
    same_call(ShmcastTrainerWeightTransferEngine.trainer_init, base.TrainerWeightTransferEngine.trainer_init)
    assert ShmcastTrainerWeightTransferEngine.init_info_cls is ShmcastTrainerInitInfo
    assert not inspect.isabstract(ShmcastTrainerWeightTransferEngine)


def test_vllm_worker_api():
    """The worker-side engine: what vLLM's Worker and factory call."""
    _, base, factory = _vllm()
    from shmcast.vllm_transfer import (
        ShmcastWeightTransferEngine,
        ShmcastWeightTransferInitInfo,
        ShmcastWeightTransferUpdateInfo,
    )

    E, B = ShmcastWeightTransferEngine, base.WeightTransferEngine
    assert issubclass(E, B) and not inspect.isabstract(E)
    assert typing.get_args(E.__orig_bases__[0]) == (ShmcastWeightTransferInitInfo, ShmcastWeightTransferUpdateInfo)
    for name in ("__init__", "init_transfer_engine", "start_weight_update", "finish_weight_update",
                 "receive_weights", "shutdown"):
        same_call(getattr(E, name), getattr(B, name))
    assert E.update_weights is B.update_weights and E.parse_update_info is B.parse_update_info
    assert E.init_info_cls is ShmcastWeightTransferInitInfo and E.update_info_cls is ShmcastWeightTransferUpdateInfo
    assert issubclass(ShmcastWeightTransferInitInfo, base.WeightTransferInitInfo)
    assert issubclass(ShmcastWeightTransferUpdateInfo, base.WeightTransferUpdateInfo)
    assert E.defers_processing is False  # update_weights returns with the weights loaded
    assert params(factory.WeightTransferEngineFactory.create_engine) == [
        ("config", POS, NO), ("vllm_config", POS, NO), ("device", POS, NO), ("model", POS, NO)]


def test_vllm_registration_and_lifecycle(region):
    """The plugin registers both sides; WeightTransferTrainerFactory.trainer_init
    (init_info, *, client, source) builds shmcast's trainer engine, which
    drives init, then start, update(s), finish on the inference side."""
    import shmcast.vllm_plugin
    from shmcast.vllm_transfer import ShmcastTrainerInitInfo, ShmcastTrainerWeightTransferEngine

    wt, _, factory = _vllm()
    shmcast.vllm_plugin.register()
    assert factory.WeightTransferTrainerFactory._registry["shmcast"]() is ShmcastTrainerWeightTransferEngine
    assert factory.WeightTransferEngineFactory._registry["shmcast"]().__name__ == "ShmcastWeightTransferEngine"

    calls = []

    class Client:  # vLLM's VLLMWeightSyncClient protocol
        def init_weight_transfer_engine(self, init_info):
            calls.append(("init", sorted(init_info)))

        def start_weight_update(self):
            calls.append("start")

        def update_weights(self, update_info):
            calls.append(("update", sorted(update_info)))
            cons.receive(10)

        def finish_weight_update(self, weight_version=None):
            calls.append("finish")

    assert isinstance(Client(), wt.VLLMWeightSyncClient)
    src = wt.ModuleSource(torch.nn.Linear(4, 4))
    cons = None
    with pytest.raises(ValueError, match="WeightSource"):
        factory.WeightTransferTrainerFactory.trainer_init(ShmcastTrainerInitInfo(rank=0, region=region),
                                                          client=Client())
    import threading

    def attach():  # a worker attaching once the region exists
        nonlocal cons
        cons = shmcast.Consumer(region, open_timeout=10)

    t = threading.Thread(target=attach)
    t.start()
    eng = factory.WeightTransferTrainerFactory.trainer_init(
        ShmcastTrainerInitInfo(rank=0, region=region, consumers=1, slot_bytes=1 << 20, timeout=10.0),
        client=Client(), source=src)
    t.join(10)
    try:
        assert isinstance(eng, ShmcastTrainerWeightTransferEngine) and eng.is_sender and eng.source is src
        eng.send_weights()
        fields = sorted(f.name for f in dataclasses.fields(shmcast.vllm_transfer.ShmcastWeightTransferInitInfo))
        assert calls == [("init", fields), "start", ("update", ["count", "names_digest", "version"]), "finish"]
        # a non-sender rank: no region, no client call, the source iterated (FSDP gathers are collectives)
        other = factory.WeightTransferTrainerFactory.trainer_init(
            ShmcastTrainerInitInfo(rank=1, region=region), client=Client(), source=src)
        calls.clear()
        other.send_weights()
        assert calls == [] and other.producer is None
    finally:
        eng.shutdown()
        cons.close()


LEGACY = r"""
import sys, torch, shmcast
import shmcast.vllm_plugin, shmcast.vllm_transfer as vt
from vllm.config import WeightTransferConfig
from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
assert vllm_origin() and vt.TRAINER_TAKES_CONFIG
shmcast.vllm_plugin.register()
calls = []
class Client:
    def init_weight_transfer_engine(self, init_info): calls.append("init")
    def start_weight_update(self): calls.append("start")
    def update_weights(self, update_info): calls.append("update")
    def finish_weight_update(self): calls.append("finish")
eng = WeightTransferTrainerFactory.trainer_init("shmcast", WeightTransferConfig(backend="shmcast"),
    vt.ShmcastTrainerInitInfo(rank=0, region=sys.argv[1], consumers=0, slot_bytes=1 << 20),
    client=Client(), source=ModuleSource(torch.nn.Linear(4, 4)))
eng.send_weights()
eng.shutdown()
assert isinstance(eng, vt.ShmcastTrainerWeightTransferEngine) and eng.config.backend == "shmcast"
assert calls == ["init", "start", "update", "finish"], calls
print("legacy ok")
"""


def test_vllm_previous_trainer_api_by_feature_detection(region):
    """On the previous trainer API (vllm base.py @ 02f250b0: config argument,
    two type parameters, factory trainer_init(backend, config, init_info,
    ...); standins/legacy) the same module adapts itself and runs a round."""
    import os
    import subprocess
    import sys

    from conftest import STANDINS

    legacy = os.path.join(STANDINS, "legacy", "vllm-02f250b0")
    path = [legacy] + [p for p in sys.path if p and os.path.abspath(p) != os.path.abspath(STANDINS)]
    code = LEGACY.replace("vllm_origin()", repr(legacy) + " in __import__('vllm').__file__")
    res = subprocess.run([sys.executable, "-c", code, region], env={**os.environ, "PYTHONPATH": os.pathsep.join(path)},
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "legacy ok" in res.stdout, res.stdout + res.stderr


# ------------------------------------------------------------------ verl


def test_verl_checkpoint_engine_api():
    """verl-project/verl @ 1dda039b: send_weights(weights, global_steps=None)
    and receive_weights(global_steps=None) (both async), prepare,
    build_topology (classmethod, three positional), init_process_group(**kw),
    finalize; registered by importing checkpoint_engine.custom_backend_module."""
    base = pytest.importorskip("verl.checkpoint_engine.base")
    from verl.utils.import_utils import import_external_libs

    import_external_libs("shmcast.verl")  # what verl does with custom_backend_module=shmcast.verl
    E = base.CheckpointEngineRegistry.get("shmcast")
    B = base.CheckpointEngine
    import shmcast.verl as sv

    assert E is sv.ShmcastCheckpointEngine and issubclass(E, B) and not inspect.isabstract(E)
    for name in ("send_weights", "receive_weights", "prepare", "finalize"):
        same_call(getattr(E, name), getattr(B, name))
    assert params(B.send_weights)[1] == ("global_steps", POS, None)
    assert params(B.receive_weights) == [("global_steps", POS, None)]
    assert inspect.iscoroutinefunction(E.send_weights)
    assert inspect.isasyncgenfunction(E.receive_weights) or inspect.iscoroutinefunction(E.receive_weights)
    assert isinstance(inspect.getattr_static(E, "build_topology"), classmethod)
    assert len(params(E.build_topology)) == len(params(B.build_topology)) == 3
    assert [k for _, k, _ in params(B.init_process_group)] == [inspect.Parameter.VAR_KEYWORD]
    assert getattr(E, "wire_format", "named_tensors") == "named_tensors"
    # what verl passes when it builds one (bucket_size, is_master on the trainer, engine_kwargs)
    e = base.CheckpointEngineRegistry.new("shmcast", bucket_size=1 << 20, is_master=False, region="r")
    assert e.bucket_size == 1 << 20 and e.is_master is False


def test_verl_config_names_the_module():
    pytest.importorskip("verl")
    try:
        from verl.workers.config import CheckpointEngineConfig
    except ImportError:
        pytest.skip("this verl has no CheckpointEngineConfig")
    c = CheckpointEngineConfig(backend="shmcast", custom_backend_module="shmcast.verl")
    assert c.custom_backend_module == "shmcast.verl"


# ------------------------------------------------------------------ SGLang


def test_sglang_api():
    """The calls shmcast makes into SGLang and the hook SGLang calls back:
    update_weights_from_tensor(named_tensors, load_format=None,
    flush_cache=True), the session pair begin_weight_update(selector='all')
    / end_weight_update(), the custom loader (model, named_tensors)."""
    engine = pytest.importorskip("sglang.srt.entrypoints.engine")
    import shmcast.sglang as ss

    p = params(engine.Engine.update_weights_from_tensor)
    assert p[:3] == [("named_tensors", POS, NO), ("load_format", POS, None), ("flush_cache", POS, True)]
    assert params(ss.load_weights) == [("model", POS, NO), ("named_tensors", POS, NO)]
    session = getattr(engine, "SessionEngine", None)  # the stand-in's session-era server
    if session is not None:
        assert params(session.begin_weight_update) == [("selector", POS, "all")]
        assert params(session.end_weight_update) == []

    calls = []

    class WithSessions:
        def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
            calls.append("update")
            return True, "Success"

        def begin_weight_update(self, selector="all"):
            calls.append("begin")
            return {"success": True}

        def end_weight_update(self):
            calls.append("end")
            return {"success": True}

    class Without:
        def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
            return True, "Success"

    assert ss._session_calls(WithSessions().update_weights_from_tensor, None, None, True)[0] is not None
    assert ss._session_calls(Without().update_weights_from_tensor, None, None, True) == (None, None)
    assert ss._session_calls(WithSessions().update_weights_from_tensor, None, None, False) == (None, None)
    with pytest.raises(ValueError, match="together"):
        ss._session_calls(Without().update_weights_from_tensor, lambda: None, None, True)


# ------------------------------------------------------------------ ROLL


def test_roll_api():
    """alibaba/ROLL @ 8eb27cc2: the worker's update_parameter_in_bucket(
    serialized_named_tensors, is_lora=False) is what shmcast's receiver
    replaces in one line; serialize_named_weights(named_weights,
    infer_strategy) is what its sender replaces."""
    worker = pytest.importorskip("roll.third_party.vllm.worker")
    sru = pytest.importorskip("roll.utils.send_recv_utils")
    import shmcast.roll as sr

    assert params(sr.update_parameter_in_bucket)[1:3] == params(worker.WorkerBase.update_parameter_in_bucket)
    assert params(sr.update_parameter_in_bucket)[0] == ("worker", POS, NO)
    assert params(sr.serialize_named_weights)[:2] == params(sru.serialize_named_weights)


def test_origin_is_reported():
    for name in ("vllm", "verl", "sglang", "roll"):
        assert framework_origin(name) in ("stand-in", "real", "absent")
