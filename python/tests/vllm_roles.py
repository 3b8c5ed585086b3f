"""Processes of the vLLM weight-transfer contract test (test_vllm_transfer.py):
a vLLM worker serving the dev weight-sync routes, and a trainer driving the
shmcast trainer engine through a FanOutClient. Everything vLLM here is the
stand-in (standins/vllm)."""
from __future__ import annotations

import os
import sys

import fake_vllm
from framework_roles import FanOutClient, inbox_loop, serve


def role_server(q, address, rank, tp_size, cfg, device="cpu", plugin=None, backend="shmcast"):
    """A vLLM worker (stand-in Worker, stand-in Qwen2 model) with
    weight_transfer_config=WeightTransferConfig(backend=backend); shmcast is
    found through its vllm.general_plugins entry point in `plugin`."""
    if plugin:
        sys.path.insert(0, plugin)
    from vllm.config import ParallelConfig, VllmConfig, WeightTransferConfig
    from vllm.model_executor.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
    from vllm.v1.worker.gpu_worker import Worker

    c = Qwen2Config(**cfg)
    vc = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=tp_size),
                    weight_transfer_config=WeightTransferConfig(backend=backend))
    w = Worker(vc, local_rank=rank, rank=rank, device=device, model_factory=lambda dev: Qwen2ForCausalLM(c, dev))
    w.load_model()
    model = w.model_runner.model
    for p in model.parameters():
        p.data.view(__import__("torch").uint8).fill_(0x33)  # not what any trainer sends

    def check(seed):
        problems = fake_vllm.check_loaded(model, fake_vllm.hf_state_dict(seed, c), rank % tp_size, tp_size)
        return {"problems": problems, "reload": list(model.__dict__.get("_standin_reload", [])),
                "stats": w.weight_transfer_engine.last_update_stats(), "pid": os.getpid()}

    def shutdown():
        w.shutdown()
        return "stop"

    routes = {
        "init_weight_transfer_engine": lambda init_info: w.init_weight_transfer_engine(init_info),
        "start_weight_update": w.start_weight_update,
        "update_weights": lambda update_info: w.update_weights(update_info),
        "finish_weight_update": w.finish_weight_update,
        "sleep": lambda level: w.sleep(level),
        "wake_up": lambda tags=None: w.wake_up(tags),
        "check": check,
        "shutdown": shutdown,
    }
    q.put({"ready": True, "engine": type(w.weight_transfer_engine).__name__})
    serve(address, routes)
    return {"stopped": True}


def role_trainer(q, commands, addresses, region, consumers, cfg, bucket_bytes=0, load="auto", slot_bytes=2 << 20,
                 timeout=60.0):
    """The trainer: WeightTransferTrainerFactory.trainer_init(ShmcastTrainerInitInfo(...), ...)
    on command 'init', send_weights() of hf_state_dict(seed) on 'send'."""
    import shmcast.vllm_plugin
    from shmcast.vllm_transfer import ShmcastTrainerInitInfo
    from vllm.distributed.weight_transfer import WeightSource, WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.base import ParamMeta
    from vllm.model_executor.models.qwen2 import Qwen2Config

    shmcast.vllm_plugin.register()  # what a trainer process does (it loads no vLLM plugins)
    c = Qwen2Config(**cfg)

    class Source(WeightSource):
        named: list = []

        def metadata(self):
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.named]

        def __iter__(self):
            return iter(list(self.named))

    src = Source()
    client = FanOutClient(addresses, timeout=timeout * 2)
    state = {}

    def init():
        state["engine"] = WeightTransferTrainerFactory.trainer_init(
            ShmcastTrainerInitInfo(rank=0, region=region, consumers=consumers, bucket_bytes=bucket_bytes,
                                   slot_bytes=slot_bytes, slots=4, load=load, timeout=timeout),
            client=client, source=src)
        return {"calls": list(client.calls), "engine": type(state["engine"]).__name__}

    def send(seed):
        src.named = fake_vllm.hf_state_dict(seed, c)
        client.calls.clear()
        state["engine"].send_weights()
        return {"calls": list(client.calls), "version": state["engine"].producer.last_version}

    def shutdown():
        state.pop("engine").shutdown()

    q.put({"ready": True})
    inbox_loop(q, commands, {"init": init, "send": send, "shutdown": shutdown}, timeout=timeout * 4)
    return {"exited": True}
