"""vLLM native weight transfer with the `shmcast` backend
(shmcast.vllm_transfer), against the vLLM stand-in (standins/vllm: base.py
and factory.py of vllm-project/vllm, the worker's weight-transfer methods,
the TP layers' weight loaders; see standins/README.md).

The contract tests run the real call sequence in real processes: worker
processes (stand-in vLLM Worker, backend found through the package's
vllm.general_plugins entry point) serving the dev weight-sync routes, a
trainer process building the engine with
WeightTransferTrainerFactory.trainer_init(ShmcastTrainerInitInfo(...), ...) and calling
send_weights() as an RL loop does; then sleep/wake, a worker restart, a
trainer restart (SIGKILL) and shutdown, with every parameter of every worker
checked bit for bit after each update.

TP = 2 with load='direct' reads each worker's slices with
Consumer.receive_into(..., slices=...), the API of shmcast's sharded syncs
(issue 13): until it is merged that test fails with a TypeError.
"""
import os

import pytest
import torch

import fake_vllm
import shmcast
from framework_roles import Deployment, RouteClient, RouteError, plugin_dir

pytestmark = pytest.mark.usefixtures("deadline")

CFG = dict(vocab_size=250, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
           num_hidden_layers=2)
# ~ 0.2 MB per model in bf16: three buckets of at most 80 KB each
BUCKET = 80_000


class Cluster(Deployment):
    """vLLM worker processes on fixed addresses plus one trainer process."""

    def __init__(self, procs, tmp_path, region, *, tp_size=1, workers=2, load="auto", bucket_bytes=BUCKET):
        super().__init__(procs, [str(tmp_path / f"w{i}.sock") for i in range(workers)])
        self.region, self.tp_size, self.load, self.bucket = region, tp_size, load, bucket_bytes
        self.plugin = plugin_dir(tmp_path)

    @property
    def workers(self):
        return self.servers

    def start_worker(self, i):
        p = self.procs.start("vllm_roles:server", address=self.addresses[i], rank=i, tp_size=self.tp_size, cfg=CFG,
                             plugin=self.plugin)
        assert self.procs.ready(p)["engine"] == "ShmcastWeightTransferEngine"
        self.servers[i] = p
        return p

    def start_trainer(self):
        super().start_trainer("vllm_roles:trainer", region=self.region, consumers=len(self.addresses), cfg=CFG,
                              bucket_bytes=self.bucket, load=self.load)

    def route(self, i, name, **body):
        return RouteClient(self.addresses[i]).call(name, body)

    def check(self, seed):
        return [self.route(i, "check", seed=seed) for i in range(len(self.addresses))]


ROUND = ["start_weight_update", "update_weights", "update_weights", "update_weights", "finish_weight_update"]


def assert_loaded(results, seed, load, updates, tp_size=1):
    for r in results:
        assert r["problems"] == [], (seed, r["problems"][:5])
        s = r["stats"]
        assert s["path"] == load and s["syncs"] == 3
        assert s["versions"] == sorted(s["versions"]) and len(set(s["versions"])) == 3
        if load == "loader":
            assert r["reload"] == ["initialize", "finalize"] * updates  # layerwise reload around every update
            assert s["bytes_read"] == s["bytes_total"]
        else:
            assert r["reload"] == []  # in place: no layerwise reload
            if tp_size == 1:
                assert s["bytes_read"] == s["bytes_total"]
            else:  # only this rank's slices (plus the replicated norms)
                assert s["bytes_read"] < s["bytes_total"] * 0.6


@pytest.mark.parametrize("load", ["direct", "loader"])
def test_contract_two_workers(procs, tmp_path, region, load):
    c = Cluster(procs, tmp_path, region, load=load)
    try:
        for i in range(2):
            c.start_worker(i)
        c.start_trainer()
        assert c.cmd("init")["calls"] == ["init_weight_transfer_engine"]
        updates = 0
        for seed in (10, 11):  # several updates, each of three buckets (three syncs)
            assert c.cmd("send", seed=seed)["calls"] == ROUND
            updates += 1
            assert_loaded(c.check(seed), seed, load, updates)

        # sleep level 1 keeps the weights; level 2 discards them until the trainer's next sync
        for i in range(2):
            c.route(i, "sleep", level=1)
            c.route(i, "wake_up")
        assert_loaded(c.check(11), 11, load, updates)
        for i in range(2):
            c.route(i, "sleep", level=2)
            c.route(i, "wake_up", tags=["weights"])
        assert all(r["problems"] for r in c.check(11))  # garbage after a level-2 sleep
        assert c.cmd("send", seed=12)["calls"] == ROUND
        updates += 1
        assert_loaded(c.check(12), 12, load, updates)

        # a worker restart: the new process (a fresh engine) is attached by the next round
        old_pid = c.check(12)[1]["pid"]
        procs.kill(c.workers[1])
        c.start_worker(1)
        assert c.cmd("send", seed=13)["calls"] == ["init_weight_transfer_engine"] + ROUND
        updates += 1
        res = c.check(13)
        assert res[1]["pid"] != old_pid
        assert_loaded(res[:1], 13, load, updates)
        assert_loaded(res[1:], 13, load, 1)

        # a trainer restart (SIGKILL): the new trainer recreates the region, the workers reattach
        procs.kill(c.trainer)
        c.start_trainer()
        assert c.cmd("init")["calls"] == ["init_weight_transfer_engine"]
        assert c.cmd("send", seed=14)["calls"] == ROUND
        updates += 1
        res = c.check(14)
        assert_loaded(res[:1], 14, load, updates)
        assert_loaded(res[1:], 14, load, 2)

        # shutdown: the trainer removes the region, the workers leave
        c.cmd("shutdown")
        assert not os.path.exists(shmcast.region_path(region))
        c.commands.put(("exit", {}))
        assert procs.get(c.trainer)["exited"]
        for i in range(2):
            c.route(i, "shutdown")
            assert procs.get(c.workers[i])["stopped"]
    finally:
        c.stop()


@pytest.mark.parametrize("load", ["loader", "direct"])
def test_contract_tensor_parallel_2(procs, tmp_path, region, load):
    """Two TP ranks of one model. 'loader' sends whole tensors to both ranks
    (vLLM's loaders narrow them). 'direct' reads each rank's slices only:
    NEEDS Consumer.receive_into(slices=...) from shmcast's sharded syncs."""
    c = Cluster(procs, tmp_path, region, tp_size=2, load=load)
    try:
        for i in range(2):
            c.start_worker(i)
        c.start_trainer()
        c.cmd("init")
        for n, seed in enumerate((20, 21), 1):
            assert c.cmd("send", seed=seed)["calls"] == ROUND
            assert_loaded(c.check(seed), seed, load, n, tp_size=2)
    finally:
        c.stop()


# ------------------------------------------------------------- in one process


def _engine(region, model=None, quantization=None):
    import shmcast.vllm_plugin
    from vllm.config import ModelConfig, VllmConfig, WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    shmcast.vllm_plugin.register()
    shmcast.vllm_plugin.register()  # idempotent
    vc = VllmConfig(model_config=ModelConfig(quantization=quantization),
                    weight_transfer_config=WeightTransferConfig(backend="shmcast"))
    model = model or fake_vllm.FakeQwen2ForCausalLM()
    return WeightTransferEngineFactory.create_engine(vc.weight_transfer_config, vc, torch.device("cpu"), model)


def test_engine_checks_and_gives_its_seat_back(region):
    from shmcast.vllm_transfer import ShmcastWeightTransferEngine

    eng = _engine(region)
    assert isinstance(eng, ShmcastWeightTransferEngine)
    with pytest.raises(ValueError, match="Invalid init_info"):
        eng.parse_init_info({"regoin": region})
    with pytest.raises(ValueError, match="load must be"):
        eng.parse_init_info({"region": region, "load": "sideways"})
    with pytest.raises(ValueError, match="Invalid update_info"):
        eng.parse_update_info({"version": 1})
    with pytest.raises(NotImplementedError, match="trainer engine"):
        ShmcastWeightTransferEngine.trainer_send_weights(iter(()), {})
    hf = fake_vllm.hf_state_dict(5)
    with shmcast.Producer(region, slot_bytes=2 << 20, slots=4) as prod:
        eng.init_transfer_engine(eng.parse_init_info({"region": region, "timeout": 10.0}))
        assert prod.consumers == 1
        eng.start_weight_update()
        # an announcement that does not match the sync: refused, and the seat is given back at once
        bad = {"version": prod.last_version + 1, "count": len(hf) - 1, "names_digest": "0" * 16}
        import threading

        t = threading.Thread(target=prod.send, args=(hf,))
        t.start()
        with pytest.raises((shmcast.Corrupt, ValueError)):
            eng.update_weights(bad)
        t.join(30)
        assert prod.consumers == 0
        # the next start reattaches; a good round loads
        eng.start_weight_update()
        assert prod.consumers == 1
        from shmcast._load import names_digest

        good = {"version": prod.last_version + 1, "count": len(hf), "names_digest": names_digest(n for n, _ in hf)}
        t = threading.Thread(target=prod.send, args=(hf,))
        t.start()
        eng.update_weights(good)
        t.join(30)
        eng.finish_weight_update()
        assert fake_vllm.check_loaded(eng.model, hf) == []
        assert eng.last_update_stats()["path"] == "direct"
        eng.shutdown()
        assert prod.consumers == 0


def test_direct_refuses_what_it_cannot_place(region):
    eng = _engine(region, quantization="fp8")
    with shmcast.Producer(region, slot_bytes=2 << 20, slots=4):
        eng.init_transfer_engine(eng.parse_init_info({"region": region, "load": "direct"}))
        with pytest.raises(ValueError, match="quantization 'fp8'"):
            eng.start_weight_update()
        eng.init_transfer_engine(eng.parse_init_info({"region": region}))  # auto: falls back to the loader
        eng.start_weight_update()
        assert eng._path == "loader" and eng.model._standin_reload == ["initialize"]
        eng.finish_weight_update()
        eng.shutdown()


def test_unknown_backend_is_refused():
    from vllm.config import VllmConfig, WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    with pytest.raises(ValueError, match="Invalid weight transfer backend"):
        WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="shmcsat"), VllmConfig(), "cpu", None)


def test_route_errors_keep_their_type(tmp_path):
    with pytest.raises(TimeoutError):
        RouteClient(str(tmp_path / "nobody.sock"), timeout=0.3).call("check")
    assert issubclass(RouteError, RuntimeError)


def test_trainer_closes_a_failed_round(region):
    """A worker that fails an update leaves the round (vLLM's worker resets
    its session); the trainer closes the round on the others and raises."""
    import shmcast.vllm_plugin
    from shmcast.vllm_transfer import ShmcastTrainerInitInfo
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    class Client:
        calls = []

        def init_weight_transfer_engine(self, init_info):
            self.calls.append("init")

        def start_weight_update(self):
            self.calls.append("start")

        def update_weights(self, update_info):
            self.calls.append("update")
            raise RuntimeError("worker 1: receive failed")

        def finish_weight_update(self):
            self.calls.append("finish")

    shmcast.vllm_plugin.register()
    eng = WeightTransferTrainerFactory.trainer_init(
        ShmcastTrainerInitInfo(rank=0, region=region, consumers=0, slot_bytes=2 << 20),
        client=Client(), source=ModuleSource(torch.nn.Linear(4, 4)))
    with pytest.raises(RuntimeError, match="receive failed"):
        eng.send_weights()
    assert Client.calls == ["init", "start", "update", "finish"]
    eng.shutdown()
    assert not os.path.exists(shmcast.region_path(region))


def test_trainer_announces_the_names_it_sends_when_quantizing(region):
    """With producer_options={"quantize": ...} each sync carries every
    selected weight's scales too: the update_info's count and names digest
    are the manifest's (the worker refuses a sync that does not hold the
    announced tensors), for every bucket."""
    import fp8_roles as fr
    import shmcast.vllm_plugin
    from shmcast._load import names_digest
    from shmcast.vllm_transfer import ShmcastTrainerInitInfo
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    model = torch.nn.Module()  # fr.model's tensors under their own (dotted) names
    for n, t in fr.model(7):
        *path, leaf = n.split(".")
        m = model
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))

    class Client:  # a worker that reads each sync raw and checks what was announced against its manifest
        seen = []

        def init_weight_transfer_engine(self, init_info):
            self.con = shmcast._shmcast.Consumer(init_info["region"], pin="no")

        def start_weight_update(self):
            pass

        def update_weights(self, info):
            names = [n for n, _, _ in fr.read_raw(self.con, 30)]
            self.seen.append((info["count"], info["names_digest"], len(names), names_digest(names)))

        def finish_weight_update(self):
            pass

    shmcast.vllm_plugin.register()
    client = Client()
    eng = WeightTransferTrainerFactory.trainer_init(
        ShmcastTrainerInitInfo(rank=0, region=region, consumers=1, slot_bytes=2 << 20, bucket_bytes=1 << 20,
                               producer_options={"quantize": "fp8-block128"}),
        client=client, source=ModuleSource(model))
    eng.send_weights()
    client.con.close()
    eng.shutdown()
    assert len(Client.seen) >= 2  # buckets
    assert all(a == b for a, _, b, _ in Client.seen) and all(a == b for _, a, _, b in Client.seen), Client.seen
    assert sum(n for _, _, n, _ in Client.seen) == len(list(model.parameters())) + 2  # two weights' scales


# ------------------------------------------------------------- delta syncs


def _changed(hf, seed, fraction=0.02):
    """hf with `fraction` of each tensor's elements given new random values
    (finite: the oracle compares the fused parts by value)."""
    import delta_roles

    g = torch.Generator().manual_seed(seed)
    out = []
    for n, t in hf:
        t = t.clone()
        w = delta_roles.words(t).reshape(-1)
        m = max(1, int(fraction * w.numel()))
        w[torch.randperm(w.numel(), generator=g)[:m]] = delta_roles.words(torch.randn(m, generator=g).to(t.dtype))
        out.append((n, t))
    return out


@pytest.mark.parametrize("load", ["direct", "loader"])
def test_delta_rounds_and_a_level2_sleep(region, load):
    """One sync per update from a delta producer: 'direct' applies the deltas
    to the parameters; after a level-2 sleep (garbage in the same memory)
    start_weight_update() takes a new seat, so that round's sync is full.
    'loader' applies them to the consumer's own copy: the sleep changes
    nothing there."""
    from shmcast._load import names_digest

    eng = _engine(region)
    kinds = []
    with shmcast.Producer(region, slot_bytes=2 << 20, slots=8, delta=True) as prod:
        eng.init_transfer_engine(eng.parse_init_info({"region": region, "timeout": 10.0, "load": load}))

        def one_round(hf):
            eng.start_weight_update()
            assert prod.consumers == 1
            prod.send(hf)  # one process: the sync fits in the region, the worker reads it afterwards
            eng.update_weights({"version": prod.last_version, "count": len(hf),
                                "names_digest": names_digest(n for n, _ in hf)})
            eng.finish_weight_update()
            assert fake_vllm.check_loaded(eng.model, hf) == []
            kinds.append(prod.last_sync["kind"])

        hf = fake_vllm.hf_state_dict(40)
        for k in range(3):
            one_round(hf)
            hf = _changed(hf, k)
        for p in eng.model.parameters():  # what the stand-in worker's sleep(level=2) leaves
            p.data.view(torch.uint8).fill_(0xFF)
        one_round(hf)
        one_round(_changed(hf, 9))
        assert eng.last_update_stats()["path"] == load
        eng.shutdown()
    if load == "direct":
        assert kinds == ["full", "delta", "delta", "full", "delta"]
    else:
        assert kinds == ["full", "delta", "delta", "delta", "delta"]


@pytest.mark.parametrize("tp", [1, 2])
def test_direct_loader_refuses_a_delta_onto_changed_parameters(region, tp):
    """Without a start hook (the worker extension, SGLang): a delta sync for
    parameters that changed since the last load raises NeedsFullSync, and
    the next sync is full. TP = 2: the rank's slices hold part of each
    tensor the producer sends whole, where a delta cannot be checked (the
    consumer would refuse it): the loader asks for a full sync after each
    load, so every sync is full and loads, changed parameters too."""
    from shmcast._load import DirectLoader

    with fake_vllm.tp_rank(0, tp):
        model = fake_vllm.FakeQwen2ForCausalLM()
    d = DirectLoader(model, 0, tp)
    assert d.complete and d.holds_last_load() is None
    with shmcast.Producer(region, slot_bytes=2 << 20, slots=8, delta=True) as prod, shmcast.Consumer(region) as cons:
        hf = fake_vllm.hf_state_dict(50)
        for k in range(2):
            prod.send(hf)
            d.load(cons, timeout=10)
            assert fake_vllm.check_loaded(model, hf, 0, tp) == []
            assert cons.last_sync["kind"] == ("full" if k == 0 or tp > 1 else "delta") and d.holds_last_load()
            hf = _changed(hf, k)
        for p in model.parameters():
            p.data.view(torch.uint8).fill_(0xFF)
        assert d.holds_last_load() is False
        prod.send(hf)
        if tp == 1:
            assert prod.last_sync["kind"] == "delta"
            with pytest.raises(shmcast.NeedsFullSync):
                d.load(cons, timeout=10)
        else:
            assert prod.last_sync["kind"] == "full"
            d.load(cons, timeout=10)
            assert fake_vllm.check_loaded(model, hf, 0, tp) == [] and d.holds_last_load()
        hf = _changed(hf, 7)
        prod.send(hf)
        assert prod.last_sync["kind"] == "full"
        d.load(cons, timeout=10)
        assert fake_vllm.check_loaded(model, hf, 0, tp) == [] and d.holds_last_load()


def test_direct_loader_tp_slices_take_deltas_unchecked_only_when_asked(region):
    """verify_checksums=False: a TP = 2 rank's slices take the deltas of a
    one-rank producer unchecked (the loader asks for no full sync), and the
    weights are right while the parameters hold the last load."""
    from shmcast._load import DirectLoader

    tp = 2
    with fake_vllm.tp_rank(0, tp):
        model = fake_vllm.FakeQwen2ForCausalLM()
    d = DirectLoader(model, 0, tp)
    with shmcast.Producer(region, slot_bytes=2 << 20, slots=8, delta=True) as prod, \
            shmcast.Consumer(region, verify_checksums=False) as cons:
        hf = fake_vllm.hf_state_dict(50)
        for k in range(3):
            prod.send(hf)
            d.load(cons, timeout=10)
            assert fake_vllm.check_loaded(model, hf, 0, tp) == []
            assert cons.last_sync["kind"] == ("full" if k == 0 else "delta")
            hf = _changed(hf, k)


# ------------------------------------------------------------- layerwise reload


def test_the_toy_quantized_model_needs_the_reload():
    """The stand-in model transforms its weights after loading: a plain
    load_weights() of checkpoint tensors cannot go into it."""
    import quant_model

    m = quant_model.build(0)
    assert quant_model.problems(m, quant_model.checkpoint(0)) == []
    with pytest.raises(ValueError, match="into a parameter"):
        m.load_weights(quant_model.checkpoint(1))


def test_loader_path_reloads_a_model_that_processes_its_weights(region):
    """'loader' as vLLM's nccl/ipc engines load: start_weight_update
    initializes the layerwise reload (checkpoint-format parameters), the
    update's load_weights() runs with the MTP completeness check off,
    finish_weight_update processes the layers again, into the same storage."""
    import quant_model
    from shmcast._load import names_digest

    model = quant_model.build(0)
    kernel = {n: p.data_ptr() for n, p in model.named_parameters()}
    eng = _engine(region, model=model, quantization="toy-int8")
    with shmcast.Producer(region, slot_bytes=1 << 20, slots=4) as prod:
        eng.init_transfer_engine(eng.parse_init_info({"region": region, "timeout": 10.0}))  # auto: 'loader'
        for seed in (1, 2):
            ckpt = quant_model.checkpoint(seed)
            eng.start_weight_update()
            prod.send(ckpt)
            eng.update_weights({"version": prod.last_version, "count": len(ckpt),
                                "names_digest": names_digest(n for n, _ in ckpt)})
            eng.finish_weight_update()
            assert quant_model.problems(model, ckpt) == [], seed
        assert eng.last_update_stats()["path"] == "loader"
        assert model.mtp_checks == [True, False, False]  # the first load (build) checked, the updates did not
        assert model._standin_reload == ["initialize", "finalize"] * 2
        assert {n: p.data_ptr() for n, p in model.named_parameters()} == kernel
        eng.shutdown()


def test_worker_extension_loader_reloads(region):
    """shmcast.vllm.ShmcastWorkerExtension's 'loader' path brackets
    load_weights() with the layerwise reload too."""
    from types import SimpleNamespace

    import quant_model
    from shmcast.vllm import ShmcastWorkerExtension

    class Worker(ShmcastWorkerExtension):  # vLLM's worker with the mixin
        shmcast_load = "loader"
        shmcast_mode = "copy"

        def __init__(self, model):
            self.device = torch.device("cpu")
            self.model_runner = SimpleNamespace(model=model, model_config=SimpleNamespace(quantization="toy-int8"))

    w = Worker(quant_model.build(0))
    with shmcast.Producer(region, slot_bytes=1 << 20, slots=4) as prod:
        w.init_shmcast(region, timeout=10)
        for seed in (3, 4):
            ckpt = quant_model.checkpoint(seed)
            prod.send(ckpt)
            assert w.update_weights_from_shmcast(region, timeout=10) == prod.last_version
            assert quant_model.problems(w.model_runner.model, ckpt) == [], seed
        assert w.shmcast_stats()["path"] == "loader"
        assert w.model_runner.model.mtp_checks == [True, False, False]
        assert w.model_runner.model._standin_reload == ["initialize", "finalize"] * 2
        w.close_shmcast()
