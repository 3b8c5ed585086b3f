"""vLLM worker extension (against the labelled stand-in in fake_vllm.py) and
the ROLL-style ticket adapters."""
import pickle

import pytest
import torch

import fake_vllm
import roles
import shmcast
import shmcast.roll as roll


def test_vllm_extension_loads_fused_weights(region, procs):
    worker = procs.start("vllm_worker", region=region, n_updates=2, seed=40)
    with shmcast.Producer(region, slot_bytes=roles.SLOT, max_consumers=2) as prod:
        procs.ready(worker)
        prod.wait_for_consumers(1, 30)
        versions = [prod.send(fake_vllm.hf_state_dict(40 + k)) for k in range(2)]
        res = procs.get(worker)
    assert [u["version"] for u in res["updates"]] == versions
    assert all(u["problems"] == [] for u in res["updates"]), res


def test_vllm_extension_tp2_reads_only_its_part(region, procs):
    # Two TP workers of the stand-in model: each receives straight into its
    # parameters and reads about half of the sync (plus replicated tensors).
    workers = [procs.start("vllm_worker", region=region, n_updates=2, seed=60, tp_rank=r, tp_size=2) for r in range(2)]
    with shmcast.Producer(region, slot_bytes=roles.SLOT, max_consumers=2) as prod:
        for w in workers:
            procs.ready(w)
        prod.wait_for_consumers(2, 30)
        versions = [prod.send(fake_vllm.hf_state_dict(60 + k)) for k in range(2)]
        res = [procs.get(w) for w in workers]
    for r in res:
        assert [u["version"] for u in r["updates"]] == versions
        assert all(u["problems"] == [] for u in r["updates"]), r
        for u in r["updates"]:
            st = u["stats"]
            assert st["path"] == "direct", st
            assert st["bytes_read"] < 0.6 * st["payload_bytes"], st  # about half, not the whole model


def test_vllm_extension_in_process(region):
    # Same, in one process and in "copy" mode, and with a lazily opened consumer.
    worker = fake_vllm.FakeWorker("cpu")
    worker.shmcast_mode = "copy"
    worker.shmcast_load = "loader"  # whole tensors through the model's load_weights()
    with shmcast.Producer(region, slot_bytes=roles.SLOT, slots=8) as prod:
        worker.init_shmcast(region)
        hf = fake_vllm.hf_state_dict(1)
        v = prod.send(hf)
        assert worker.update_weights_from_shmcast(region, timeout=10) == v
        assert fake_vllm.check_loaded(worker.model_runner.model, hf) == []
        assert worker.model_runner.model.loaded_calls == 1
        worker.close_shmcast(region)
        assert prod.consumers == 0


def test_stand_in_model_rejects_bad_shapes():
    m = fake_vllm.FakeQwen2ForCausalLM()
    bad = [("model.layers.0.self_attn.k_proj.weight", torch.zeros(3, 3, dtype=torch.bfloat16))]
    with pytest.raises((ValueError, RuntimeError, AssertionError)):  # vLLM's loaders assert or fail in narrow()
        m.load_weights(bad)


def test_roll_ticket_roundtrip(region, procs):
    inbox = procs.queue()
    seeds = [70, 71, 72]
    recv = procs.start("roll_receiver", inbox=inbox, region=region, n_tickets=len(seeds), seeds=seeds)
    try:
        # The sender creates the region; the receiver's attach() waits for it,
        # and the first bucket waits for the receiver (consumers=1).
        roll.create_region(region, slot_bytes=roles.SLOT, slots=8)
        procs.ready(recv)
        for s in seeds:
            bucket = roles.build(s, ("dtypes", "shapes"))
            ticket = roll.serialize_named_weights(bucket, "vllm", region=region, consumers=1)
            assert isinstance(ticket, bytes) and len(ticket) < 1024
            # no tensor bytes in the payload: not even a 16-byte run of the largest tensor
            big = max(bucket, key=lambda nt: nt[1].numel() * nt[1].element_size())[1]
            raw = roles.as_bytes(big).numpy().tobytes()
            assert raw[4096:4112] not in ticket and raw[:16] not in ticket
            t = roll.load_ticket(ticket)
            assert t.region == region and t.count == len(bucket) and t.chunks >= 1
            inbox.put(ticket)
        res = procs.get(recv)
        assert res["problems"] == []
    finally:
        roll.close(region)


def test_roll_ticket_is_small_plain_data():
    t = roll.ShmcastTicket(region="r", version=3, first_seq=10, chunks=2, count=434, payload_bytes=6 << 30,
                           names_digest="00" * 8, infer_strategy="vllm")
    b = pickle.dumps(t, protocol=4)
    assert len(b) < 1024 and roll.load_ticket(b) == t
    # the loader refuses anything but a ticket
    with pytest.raises(pickle.UnpicklingError):
        roll.load_ticket(pickle.dumps({"x": torch.zeros(2)}))


def test_roll_in_process_with_fake_dtensors(region):
    """FAKE DTensor objects (distributed init is not available in CI): each
    exposes full_tensor(); the adapter gathers them while writing the bucket."""

    class FakeDTensor:
        placements = ("Shard(0)",)

        def __init__(self, full):
            self._full, self.shape, self.dtype, self.calls = full, full.shape, full.dtype, 0

        def full_tensor(self):
            self.calls += 1
            return self._full.clone()

    try:
        full = [(f"layer.{i}.w", torch.randn(32, 16, dtype=torch.bfloat16)) for i in range(4)]
        fakes = [(n, FakeDTensor(t)) for n, t in full]
        # a bucket sent before any receiver attached reaches nobody (and blocks nobody)
        roll.serialize_named_weights(fakes[:1], "vllm", region=region, slot_bytes=roles.SLOT, slots=8)
        roll.attach(region, device="cpu", timeout=5)
        ticket = roll.serialize_named_weights(fakes, "vllm", region=region)
        got = roll.named_tensors_from_ticket(ticket, timeout=5)
        assert roles.compare(got, full) == []
        assert [f.calls for _, f in fakes] == [2, 1, 1, 1]
        # a non-sending rank only takes part in the gathers
        assert roll.serialize_named_weights(fakes, "vllm", region=region, sender=False) is None
        assert [f.calls for _, f in fakes] == [3, 2, 2, 2]
        # a bucket larger than the region is refused before anything is written
        huge = [("huge", torch.zeros(9 * roles.SLOT, dtype=torch.uint8))]
        with pytest.raises(shmcast.InvalidArgument, match="does not fit"):
            roll.serialize_named_weights(huge, "vllm", region=region)
        # a ticket whose sync was overtaken (the receiver consumed a later one) is detected
        import threading

        t1 = roll.serialize_named_weights(full[:1], "vllm", region=region)
        box = {}
        th = threading.Thread(target=lambda: box.setdefault("t2", roll.serialize_named_weights(
            full[:2], "vllm", region=region)))
        th.start()  # blocks until this receiver has read t1's manifest
        assert roles.compare(roll.named_tensors_from_ticket(t1, timeout=5), full[:1]) == []
        th.join(10)
        assert roles.compare(roll.named_tensors_from_ticket(box["t2"], timeout=5), full[:2]) == []
        with pytest.raises(shmcast.Timeout):  # t1's sync is gone: nothing newer comes either
            roll.named_tensors_from_ticket(t1, timeout=0.5)
        t3 = roll.serialize_named_weights(full[:3], "vllm", region=region)
        with pytest.raises(shmcast.InvalidArgument, match="missed"):
            roll.named_tensors_from_ticket(box["t2"], timeout=5)  # the region moved on to t3
        del t3
    finally:
        roll.close(region)


def test_roll_ticket_names_what_a_quantizing_producer_sends(region):
    """A region created with quantize= carries each selected weight's
    scales too: the ticket's count and names digest are the manifest's
    (named_tensors_from_ticket refuses a sync that does not hold them)."""
    import fp8_roles as fr

    try:
        roll.create_region(region, slot_bytes=roles.SLOT, slots=8, quantize="fp8-block128")
        con = shmcast._shmcast.Consumer(region, pin="no")
        named = fr.model(9)
        t = roll.load_ticket(roll.serialize_named_weights(named, "vllm", region=region, consumers=1))
        names = [n for n, _, _ in fr.read_raw(con, 30)]
        con.close()
        assert (t.count, t.names_digest) == (len(names), shmcast._load.names_digest(names))
        assert len(names) == len(named) + 2  # two weights' scales
    finally:
        roll.close(region)


def test_roll_bucket_check_lays_out_what_a_quantizing_producer_sends(region):
    """The bucket-fits check lays out the sync that goes out: with quantize,
    float8 weights and their scales, about half the bf16 bytes. A bucket
    whose bf16 bytes overflow the region but whose FP8 sync fits is sent
    (it was refused when the check laid out the bf16 tensors); the same
    bucket to a region that does not quantize is refused."""
    import fp8_roles as fr

    named = fr.model(9) + [("model.layers.0.mlp.up_proj.weight", torch.randn(1024, 1024).to(torch.bfloat16))]
    C = shmcast._shmcast
    bf16 = C.stream_layout([(n, fr._dt(t), tuple(t.shape)) for n, t in named], roles.SLOT)[0]
    assert bf16 > 2 * roles.SLOT  # does not fit in the two slots below
    other = region + "p"
    try:
        prod = roll.create_region(region, slot_bytes=roles.SLOT, slots=2, quantize="fp8-block128")
        con = C.Consumer(region, pin="no")
        t = roll.load_ticket(roll.serialize_named_weights(named, "vllm", region=region, consumers=1))
        got = fr.read_raw(con, 30)
        con.close()
        assert fr.compare(got, fr.expected(named, False)) == []
        names = [n for n, _, _ in got]
        assert (t.count, t.names_digest) == (len(names), shmcast._load.names_digest(names))
        stream, payload, chunks, _ = C.stream_layout(prod._manifest_specs(named, "test"), roles.SLOT)
        assert stream <= 2 * roles.SLOT and (t.chunks, t.payload_bytes) == (chunks, payload)
        roll.create_region(other, slot_bytes=roles.SLOT, slots=2)
        with pytest.raises(shmcast.InvalidArgument, match="does not fit"):
            roll.serialize_named_weights(named, "vllm", region=other)
    finally:
        roll.close(region)
        roll.close(other)


def test_roll_worker_receives_with_a_one_line_patch(region):
    """ROLL's vLLM worker (stand-in of roll/third_party/vllm/worker.py @
    8eb27cc2) with its update_parameter_in_bucket replaced by one line that
    calls shmcast.roll.update_parameter_in_bucket: a ticket is received and
    loaded as ROLL loads a bucket (weights and LoRA), ROLL's own payloads
    still load, and the unpatched worker cannot read a ticket."""
    from types import SimpleNamespace

    from roll.third_party.vllm.worker import WorkerBase
    from roll.utils.send_recv_utils import serialize_named_weights as roll_serialize

    loaded = []

    class Model:
        def load_weights(self, weights):
            loaded.append([(n, t.clone()) for n, t in weights])

    class Patched(WorkerBase):
        def update_parameter_in_bucket(self, serialized_named_tensors, is_lora=False):
            return roll.update_parameter_in_bucket(self, serialized_named_tensors, is_lora)

    def worker(cls):
        w = cls()
        w.rank, w.device, w.model_runner = 0, torch.device("cpu"), SimpleNamespace(model=Model())
        w.custom_init_worker()
        return w

    g = torch.Generator().manual_seed(3)
    bucket = [("a.weight", torch.randn(3, 4, generator=g)), ("b.bias", torch.arange(5, dtype=torch.int32))]
    w = worker(Patched)
    try:
        roll.create_region(region, slot_bytes=1 << 20, slots=4)
        roll.attach(region, device="cpu", timeout=5)
        ticket = roll.serialize_named_weights(bucket, "vllm", region=region, consumers=1)
        assert w.update_parameter_in_bucket([ticket]) is None
        assert [n for n, _ in loaded[-1]] == ["a.weight", "b.bias"]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(loaded[-1], bucket))
        # is_lora: into the LoRA manager, not load_weights
        ticket = roll.serialize_named_weights(bucket, "vllm", region=region, consumers=1)
        w.update_parameter_in_bucket([ticket], is_lora=True)
        assert list(w.tensor_lora_manager.lora_params) == ["a.weight", "b.bias"] and len(loaded) == 1
        # ROLL's own payload through the patched worker: ROLL's path
        w.update_parameter_in_bucket([roll_serialize(bucket, "vllm")])
        assert len(loaded) == 2 and all(torch.equal(a, b) for (_, a), (_, b) in zip(loaded[-1], bucket))
        # why the receiving end is patched: ROLL's own code cannot read a ticket
        with pytest.raises(TypeError):
            worker(WorkerBase).update_parameter_in_bucket([ticket])
    finally:
        roll.close(region)
