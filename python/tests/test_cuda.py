"""CUDA tests: skipped without a GPU or without a CUDA build of shmcast.

Two processes on one GPU, bit-exact; the trainer runs with
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True as RL frameworks do.
"""
import threading

import pytest
import torch

import fake_vllm
import roles
import shmcast

pytestmark = pytest.mark.cuda

EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
SETS = ("dtypes", "shapes", "noncontig")


def test_two_processes_one_gpu_bit_exact(region, procs):
    n = 3
    prod = procs.start("producer", region=region, seed=100, sets=SETS, n_syncs=n, consumers=3, device="cuda:0",
                       env=EXPANDABLE)
    procs.ready(prod)
    c_copy = procs.start("consumer", region=region, seed=100, sets=SETS, n_syncs=n, device="cuda:0", mode="copy")
    c_stage = procs.start("consumer", region=region, seed=100, sets=SETS, n_syncs=n, device="cuda:0",
                          mode="staging")
    c_cpu = procs.start("consumer", region=region, seed=100, sets=SETS, n_syncs=n, device="cpu")
    for c in (c_copy, c_stage, c_cpu):
        procs.ready(c)
    results = [procs.get(c) for c in (c_copy, c_stage, c_cpu)]
    assert procs.get(prod)["versions"] == [1, 2, 3]
    for r in results:
        assert r["problems"] == [] and r["versions"] == [1, 2, 3]
    assert results[0]["devices"] == ["cuda:0"] and results[1]["devices"] == ["cuda:0"]
    assert results[2]["devices"] == ["cpu"]


def test_receive_into_cuda_params(region, procs):
    sets = ("dtypes", "shapes")
    prod = procs.start("producer", region=region, seed=7, sets=sets, consumers=2, device="cuda:0", env=EXPANDABLE)
    procs.ready(prod)
    a = procs.start("consumer_into", region=region, seed=7, sets=sets, device="cuda:0")
    b = procs.start("consumer_into", region=region, seed=7, sets=sets, device="cuda:0", noncontig_dst=True)
    for c in (a, b):
        procs.ready(c)
        assert procs.get(c)["problems"] == []
    procs.get(prod)


def test_vllm_stand_in_on_gpu(region, procs):
    worker = procs.start("vllm_worker", region=region, device="cuda:0", n_updates=2, seed=9)
    with shmcast.Producer(region, slot_bytes=roles.SLOT, max_consumers=2) as prod:
        procs.ready(worker)
        prod.wait_for_consumers(1, 60)
        versions = [prod.send([(n, t.cuda()) for n, t in fake_vllm.hf_state_dict(9 + k)]) for k in range(2)]
        res = procs.get(worker)
    assert [u["version"] for u in res["updates"]] == versions
    assert all(u["problems"] == [] for u in res["updates"])


def _pair(region, slots=32):
    prod = shmcast.Producer(region, slot_bytes=roles.SLOT, slots=slots)
    cons = shmcast.Consumer(region, device="cuda:0")
    return prod, cons


def test_stream_ordering_and_no_memory_held(region):
    prod, cons = _pair(region)
    try:
        n = 8 << 20
        x = torch.empty(n, dtype=torch.float32, device="cuda")
        torch.cuda.synchronize()
        x.fill_(3.0)  # queued on the current stream; send must order after it
        t = torch.empty(1024, 2048, dtype=torch.bfloat16, device="cuda").normal_()
        before = torch.cuda.memory_allocated()
        v = prod.send([("x", x), ("t_transposed", t.t()), ("t_cols", t[:, 100:700])])
        assert torch.cuda.memory_allocated() == before  # staging copies released
        x.fill_(-1.0)  # after send returns the source may change
        got = dict(cons.receive(timeout=30))
        assert cons.last_version == v
        assert torch.equal(got["x"], torch.full_like(x, 3.0))
        assert torch.equal(got["t_transposed"], t.t().contiguous())
        assert torch.equal(got["t_cols"], t[:, 100:700].contiguous())
        # ordering on the receive side: the current stream sees the data
        s = got["x"].sum().item()
        assert s == 3.0 * n
    finally:
        cons.close()
        prod.close()


def test_mixed_cpu_and_cuda_send(region):
    prod, cons = _pair(region)
    try:
        data = [("cpu_first", torch.arange(1000, dtype=torch.int64)),
                ("gpu", torch.randn(300, 300, device="cuda")),
                ("cpu_t", torch.randn(50, 70).t()),
                ("gpu_bf16", torch.randn(64, 64, device="cuda").to(torch.bfloat16))]
        for _ in range(2):
            prod.send(data)
            got = cons.receive(timeout=30, mode="copy")
            assert roles.compare(got, data) == []
    finally:
        cons.close()
        prod.close()


def test_receive_into_mixed_devices_and_staging_lifetime(region):
    prod, cons = _pair(region)
    try:
        data = [("a", torch.randn(128, 64, device="cuda")), ("b", torch.randint(0, 9, (77,), device="cuda"))]
        prod.send(data)
        dst = {"a": torch.empty(128, 64, device="cuda"), "b": torch.empty(77, dtype=torch.int64)}  # b on CPU
        cons.receive_into(dst, timeout=30)
        assert torch.equal(dst["a"], data[0][1]) and torch.equal(dst["b"], data[1][1].cpu())
        # staging views: valid until the next receive
        prod.send(data)
        got = cons.receive(timeout=30, mode="staging")
        assert roles.compare(got, data) == []
        copies = [(n, t.clone()) for n, t in got]
        del got
        prod.send([(n, t + 1) for n, t in data])
        got2 = cons.receive(timeout=30, mode="staging")
        assert roles.compare(got2, [(n, t + 1) for n, t in data]) == []
        assert roles.compare(copies, data) == []
    finally:
        cons.close()
        prod.close()


def test_roll_on_gpu_with_fake_dtensor(region):
    """FAKE DTensor (no process group): full_tensor() returns a CUDA tensor."""
    import shmcast.roll as roll

    class FakeDTensor:
        placements = ("Shard(0)",)

        def __init__(self, full):
            self._full, self.shape, self.dtype = full, full.shape, full.dtype

        def full_tensor(self):
            return self._full.clone()

    full = [(f"w{i}", torch.randn(256, 128, device="cuda").to(torch.bfloat16)) for i in range(6)]
    try:
        roll.create_region(region, slot_bytes=roles.SLOT, slots=8)
        roll.attach(region, device="cuda:0", timeout=5)
        before = torch.cuda.memory_allocated()
        ticket = roll.serialize_named_weights([(n, FakeDTensor(t)) for n, t in full], "vllm", region=region)
        assert torch.cuda.memory_allocated() == before
        assert len(ticket) < 1024
        got = roll.named_tensors_from_ticket(ticket, timeout=10)
        assert roles.compare(got, full) == []
        assert all(t.is_cuda for _, t in got)
    finally:
        roll.close(region)


def test_threads_receive_while_send(region):
    # A sync larger than the region: producer and consumer must overlap.
    prod = shmcast.Producer(region, slot_bytes=roles.SLOT, slots=2)
    cons = shmcast.Consumer(region, device="cuda:0")
    try:
        data = [(f"w{i}", torch.randn(1 << 20, device="cuda")) for i in range(8)]  # 32 MiB
        box = {}
        th = threading.Thread(target=lambda: box.setdefault("got", cons.receive(timeout=60)))
        th.start()
        prod.send(data)
        th.join(60)
        assert roles.compare(box["got"], data) == []
    finally:
        cons.close()
        prod.close()


def test_cuda_consumer_refuses_what_it_cannot_hold_or_write(region):
    """On the GPU too: a manifest announcing 64 TiB is RegionFull before
    any allocation (copy mode: checked against the device's free memory);
    receive_into refuses an expanded CUDA destination before writing the
    others, and writes a non-contiguous CUDA parameter that requires grad;
    a device index beyond the machine's is InvalidArgument."""
    import regions

    with pytest.raises(shmcast.InvalidArgument, match="device"):
        shmcast.Consumer(region, device=f"cuda:{torch.cuda.device_count()}", open_timeout=0)
    with shmcast.Producer(region, slot_bytes=roles.SLOT, slots=4) as prod, \
            shmcast.Consumer(region, device="cuda:0") as cons:
        prod.send([("x", torch.arange(4.0))])
        with regions.edit_sync(prod.path) as m:
            m.set_tensor(0, nbytes=1 << 46, shape=(1 << 44,))
            m.stream_bytes(1 << 46)
            m.payload_bytes(1 << 46)
        with pytest.raises(shmcast.RegionFull, match="cuda:0"):
            cons.receive(timeout=5, mode="copy")
        data = [("a", torch.arange(6.0).reshape(2, 3)), ("b", torch.arange(4.0))]
        a = torch.zeros(2, 3, device="cuda:0")
        prod.send(data)
        with pytest.raises(shmcast.Mismatch, match="share memory"):
            cons.receive_into({"a": a, "b": torch.zeros(1, device="cuda:0").expand(4)}, timeout=5)
        assert torch.count_nonzero(a).item() == 0
        w = torch.nn.Parameter(torch.zeros(3, 2, device="cuda:0").t())
        prod.send(data)
        cons.receive_into({"a": w, "b": torch.zeros(4, device="cuda:0")}, timeout=5)
        torch.cuda.synchronize()
        assert torch.equal(w.detach().cpu(), data[0][1]) and w.is_leaf and w.requires_grad


@pytest.mark.cuda
def test_fsdp2_two_ranks_send_local_shards_bit_exact(region, procs, tmp_path):
    # Real FSDP2 (fully_shard, NCCL) on 2 GPUs: each rank sends its DTensors'
    # local shards (uneven ones too), no all-gather; a consumer per GPU reads
    # the whole model or half-column slices, bit-exact.
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        pytest.skip("this torch has no FSDP2 (fully_shard)")
    store = str(tmp_path / "store")
    ranks = [procs.start("fsdp_rank", region=region, rank=r, store=store) for r in range(2)]
    procs.ready(ranks[0], timeout=180)
    cons = [procs.start("fsdp_consumer", region=region, gpu=g) for g in range(2)]
    for c in cons:
        procs.ready(c, timeout=180)
    procs.ready(ranks[1], timeout=180)
    res = [procs.get(r, timeout=180) for r in ranks]
    assert [r["versions"] for r in res] == [[1, 2], [1, 2]]
    assert res[0]["kinds"] == ["DTensor"], res[0]
    for c in cons:
        problems = procs.get(c, timeout=180)["problems"]
        assert not problems, "\n".join(problems)


def test_store_from_gpu_to_late_joiners_on_gpu_and_views(region, procs):
    """A store region filled from GPU tensors (CUDA engine, async D2H): a late
    joiner in another process receives the newest version onto its GPU; one
    in this process takes it as zero-copy views and copies them to the GPU
    with .to() (what a framework's loader does), bit-exact."""
    want = {v: roles.build(700 + v, ("dtypes", "shapes"), device="cuda:0") for v in (1, 2)}
    with shmcast.Producer(region, mode="store", store_bytes=shmcast.store_bytes_for(want[1]), pin=True,
                          consumer_timeout=30.0) as p:
        assert p.raw.engine == "cuda" and p.region_mode == "store"
        p.send(want[1])
        p.send(want[2])
        late = procs.start("store_reader", region=region, seed_of_version=700)  # receive() onto the CPU
        res = procs.get(late)
        assert res["version"] == 2 and res["problems"] == [], res
        with shmcast.Consumer(region, device="cuda:0") as c:
            got = c.receive(timeout=0)
            assert c.last_version == 2 and roles.compare(got, want[2]) == []
            assert all(t.device.type == "cuda" for _, t in got)
            p.send(want[1])  # version 3: the bytes of set 1
            with c.hold(timeout=5.0) as view:
                assert view.version == 3
                on_gpu = [(n, t.to("cuda:0")) for n, t in view]
                assert view.valid()
            assert roles.compare(on_gpu, want[1]) == []


def test_sharded_ranks_on_one_gpu_to_cuda_consumers_whole_sliced_and_into(region, procs):
    # Two producer ranks write CUDA shards (D2H on the CUDA engine); consumers
    # on the same GPU read the whole model, TP slices and receive_into CUDA
    # tensors (H2D completions that may finish out of order: the consumer
    # reads whichever rank's chunk is ready first and releases only the
    # copied prefix), and one CPU consumer a subset of names. Bit-exact.
    seed, world = 300, 2
    kinds = [("full", 0, "cuda:0"), ("slice", 1, "cuda:0"), ("into", 0, "cuda:0"), ("names", 0, "cpu")]
    ranks = [procs.start("sharded_rank", region=region, rank=r, world=world, seed=seed, consumers=len(kinds),
                         device="cuda:0", env=EXPANDABLE) for r in range(world)]
    procs.ready(ranks[0])
    cons = [procs.start("sharded_consumer", region=region, seed=seed, kind=k, part=p, device=d) for k, p, d in kinds]
    for c in cons:
        procs.ready(c)
    procs.ready(ranks[1])
    assert [procs.get(r)["versions"] for r in ranks] == [[1, 2]] * world
    for c, (kind, _, dev) in zip(cons, kinds):
        res = procs.get(c)
        assert res["problems"] == [], kind
        assert res["devices"] == [dev], (kind, res["devices"])
