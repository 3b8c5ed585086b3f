"""Producer -> consumer between two real processes, CPU tensors, bit-exact."""
import os

import pytest
import torch

import roles
import shmcast


def test_every_dtype_shape_and_layout_bit_exact(region, procs):
    sets = ("dtypes", "shapes", "noncontig")
    cons = procs.start("consumer", region=region, seed=11, sets=sets, n_syncs=3)
    with shmcast.Producer(region, slot_bytes=roles.SLOT, slots=2, max_consumers=2) as prod:
        procs.ready(cons)
        prod.wait_for_consumers(1, 30)
        versions = [prod.send(roles.build(11 + k, sets)) for k in range(3)]
        res = procs.get(cons)
    assert res["problems"] == []
    assert versions == [1, 2, 3] and res["versions"] == versions
    assert res["devices"] == ["cpu"]


def test_all_available_dtypes_are_carried():
    names = {shmcast.dtype_name(dt) for dt in shmcast.supported_dtypes()}
    assert {"bool", "u8", "i8", "i16", "i32", "i64", "f16", "bf16", "f32", "f64", "c64", "c128"} <= names
    for attr, name in [("uint16", "u16"), ("uint32", "u32"), ("uint64", "u64"), ("float8_e4m3fn", "f8e4m3fn"),
                       ("float8_e5m2", "f8e5m2"), ("float8_e4m3fnuz", "f8e4m3fnuz"),
                       ("float8_e5m2fnuz", "f8e5m2fnuz"), ("float8_e8m0fnu", "f8e8m0fnu")]:
        if isinstance(getattr(torch, attr, None), torch.dtype):
            assert name in names
            assert shmcast.torch_dtype(name) is getattr(torch, attr)
    with pytest.raises(TypeError):
        shmcast.dtype_name(torch.quint8)


def test_staging_mode_and_dict_input(region, procs):
    sets = ("shapes",)
    cons = procs.start("consumer", region=region, seed=5, sets=sets, n_syncs=2, mode="staging")
    with shmcast.Producer(region, slot_bytes=roles.SLOT) as prod:
        procs.ready(cons)
        prod.wait_for_consumers(1, 30)
        for k in range(2):
            prod.send(dict(roles.build(5 + k, sets)))  # a mapping works too
        assert procs.get(cons)["problems"] == []


def test_receive_into_preallocated(region, procs):
    sets = ("dtypes", "shapes")
    cons = procs.start("consumer_into", region=region, seed=3, sets=sets)
    cons2 = procs.start("consumer_into", region=region, seed=3, sets=sets, noncontig_dst=True)
    with shmcast.Producer(region, slot_bytes=roles.SLOT, max_consumers=2) as prod:
        procs.ready(cons)
        procs.ready(cons2)
        prod.wait_for_consumers(2, 30)
        v = prod.send(roles.build(3, sets))
        for c in (cons, cons2):
            res = procs.get(c)
            assert res["problems"] == [] and res["version"] == v


def test_single_process_roundtrip_and_last_sync(region):
    # A producer and a consumer may live in one process (no threads needed
    # while the region's slots hold the whole sync).
    with shmcast.Producer(region, slot_bytes=roles.SLOT, slots=16) as prod, \
            shmcast.Consumer(region) as cons:
        data = roles.build(1, ("shapes",))
        v = prod.send(data)
        info = cons.wait_sync(5)
        assert info.version == v and len(info) == len(data)
        s = prod.last_layout
        assert (s.version, s.first_seq, s.chunks, s.stream_bytes, s.payload_bytes) == \
               (info.version, info.first_seq, info.chunks, info.stream_bytes, info.payload_bytes)
        assert [t[0] for t in info.tensors] == [n for n, _ in data]
        assert not info.delta and info.base_version == 0 and info.wire_bytes == info.payload_bytes
        assert not cons.delta and prod.delta_base_bytes == 0
        got = cons.read()
        assert roles.compare(got, data) == []
        # what the last sync moved: every byte, whole (no deltas in this region)
        logical = sum(t.numel() * t.element_size() for _, t in data)
        assert prod.last_sync == {"version": v, "kind": "full", "logical_bytes": logical, "payload_bytes": logical}
        assert cons.last_sync == prod.last_sync
        # stream_layout predicts the same layout
        specs = [(n, shmcast.dtype_name(t.dtype), tuple(t.shape)) for n, t in data]
        stream, payload, chunks, offsets = shmcast._shmcast.stream_layout(specs, prod.slot_bytes)
        assert (stream, payload, chunks) == (info.stream_bytes, info.payload_bytes, info.chunks)
        assert offsets == [t[4] for t in info.tensors]
        # the next sync continues the chunk sequence
        v2 = prod.send(data[:2])
        info2 = cons.wait_sync(5)
        assert info2.version == v2 == v + 1 and info2.first_seq == info.first_seq + info.chunks
        assert prod.last_layout.first_seq == info2.first_seq
        cons.skip()


def test_receive_into_mismatch_errors_then_recovers(region):
    with shmcast.Producer(region, slot_bytes=roles.SLOT, slots=4) as prod, \
            shmcast.Consumer(region) as cons:
        data = [("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)), ("b", torch.ones(4, dtype=torch.int64))]

        def dst(**over):
            d = {"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.int64)}
            d.update(over)
            return {k: v for k, v in d.items() if v is not None}

        cases = [
            (dict(a=torch.zeros(2, 3, dtype=torch.float64)), "dtype"),
            (dict(a=torch.zeros(3, 2)), "shape"),
            (dict(b=None), "no destination"),
            (dict(c=torch.zeros(1)), "not in the sync"),
            # destinations that cannot take the bytes: refused before "a" (first) is written
            (dict(b=torch.zeros(1, dtype=torch.int64).expand(4)), "share memory"),          # stride 0
            (dict(b=torch.zeros(3, dtype=torch.int64).as_strided((4,), (0,))), "share memory"),
            (dict(a=torch.zeros(2, 6).as_strided((2, 3), (1, 1))), "share memory"),  # internal overlap
            (dict(b="not a tensor"), "expected a torch.Tensor"),
            (dict(b=torch.zeros(4, dtype=torch.int64, device="meta")), "CPU or CUDA"),
            (dict(b=torch.zeros(4, dtype=torch.int64).to_sparse()), "dense"),
        ]
        for over, words in cases:
            prod.send(data)
            d = dst(**over)
            before = {k: v.clone() for k, v in d.items()
                      if isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.layout is torch.strided}
            with pytest.raises(shmcast.Mismatch, match=words) as ei:
                cons.receive_into(d, timeout=5)
            assert isinstance(ei.value, shmcast.InvalidArgument) and isinstance(ei.value, ValueError)
            for k, v in before.items():  # nothing written
                assert torch.equal(d[k], v), (words, k)
        # strict=False: extra destinations are left alone, missing ones skipped
        prod.send(data)
        d = {"a": torch.zeros(2, 3), "zzz": torch.full((1,), 7.0)}
        v = cons.receive_into(d, timeout=5, strict=False)
        assert v == prod.last_version
        assert torch.equal(d["a"], data[0][1]) and d["zzz"].item() == 7.0
        # the consumer still works normally afterwards
        prod.send(data)
        assert roles.compare(cons.receive(timeout=5), data) == []


def test_receive_into_tensors_autograd_or_inference_would_refuse(region):
    """receive_into() writes like load_state_dict (under no_grad): leaf
    parameters that require grad, non-contiguous ones (their bytes go
    through a temporary and copy_()), views of such parameters, and views of
    inference tensors all take the sync; none stops it half-written."""
    with shmcast.Producer(region, slot_bytes=roles.SLOT, slots=4) as prod, shmcast.Consumer(region) as cons:
        data = [(n, torch.arange(k, k + 6, dtype=torch.float32).reshape(2, 3)) for k, n in enumerate("pqvi")]
        p = torch.nn.Parameter(torch.zeros(2, 3))                # contiguous leaf
        q = torch.nn.Parameter(torch.zeros(3, 2).t())            # non-contiguous leaf
        big = torch.nn.Parameter(torch.zeros(2, 5))
        v = big[:, 1:4]                                          # a view of a leaf that requires grad
        with torch.inference_mode():
            inf = torch.zeros(3, 2)
        i = inf.t()                                              # a view of an inference tensor
        prod.send(data)
        assert cons.receive_into({"p": p, "q": q, "v": v, "i": i}, timeout=5) == prod.last_version
        assert roles.compare([("p", p), ("q", q), ("v", v), ("i", i)], data) == []
        assert p.is_leaf and q.is_leaf and q.requires_grad and q.grad_fn is None
        assert torch.equal(big[:, 0], torch.zeros(2)) and torch.equal(big[:, 4], torch.zeros(2))


def test_large_sync_many_slots(region, procs):
    # 48 MiB through 2 x 2 MiB slots: the producer waits on the consumer.
    sets = ("shapes",)
    cons = procs.start("consumer", region=region, seed=2, sets=sets, n_syncs=1)
    big = [(f"big.{i}", torch.randint(0, 1 << 30, (3 << 20,), dtype=torch.int32)) for i in range(4)]
    with shmcast.Producer(region, slot_bytes=roles.SLOT) as prod, shmcast.Consumer(region) as me:
        procs.ready(cons)
        prod.wait_for_consumers(2, 30)
        import threading

        got = {}
        t = threading.Thread(target=lambda: got.setdefault("x", me.receive(timeout=30)))
        t.start()
        prod.send(roles.build(2, sets))  # the spawned consumer's sync (this thread's consumer reads it too)
        t.join()
        assert roles.compare(got["x"], roles.build(2, sets)) == []
        assert procs.get(cons)["problems"] == []
        t = threading.Thread(target=lambda: got.setdefault("y", me.receive(timeout=30)))
        t.start()
        prod.send(big)
        t.join()
        assert roles.compare(got["y"], big) == []
        assert prod.last_layout.chunks >= 24


def test_gil_released_during_wait(region):
    import threading
    import time

    with shmcast.Producer(region, slot_bytes=roles.SLOT) as prod, shmcast.Consumer(region) as cons:
        ticks = []
        stop = threading.Event()

        def spin():
            while not stop.is_set():
                ticks.append(1)
                time.sleep(0.001)

        t = threading.Thread(target=spin)
        t.start()
        with pytest.raises(shmcast.Timeout):
            cons.receive(timeout=0.5)
        stop.set()
        t.join()
        assert len(ticks) > 20  # the other thread ran while receive() waited
        del prod


def test_dtensor_like_gathered_one_at_a_time(region):
    """FAKE DTensor (no torch.distributed here): an object with full_tensor(),
    shape, dtype and placements, like FSDP2's DTensor."""
    alive = []

    class FakeDTensor:
        placements = ("Shard(0)",)

        def __init__(self, full):
            self._full = full
            self.shape = full.shape
            self.dtype = full.dtype
            self.calls = 0

        def full_tensor(self):
            self.calls += 1
            import weakref

            out = self._full.clone()
            alive[:] = [r for r in alive if r() is not None]
            assert not alive, "a previous gather is still alive: gathers must be one at a time"
            alive.append(weakref.ref(out))
            return out

    full = [(f"w{i}", torch.randn(64, 32)) for i in range(5)]
    fakes = [(n, FakeDTensor(t)) for n, t in full]
    mixed = fakes[:2] + [("plain", torch.arange(10))] + fakes[2:]
    with shmcast.Producer(region, slot_bytes=roles.SLOT, slots=4) as prod, shmcast.Consumer(region) as cons:
        prod.send(mixed)
        got = cons.receive(timeout=5)
    want = full[:2] + [("plain", torch.arange(10))] + full[2:]
    assert roles.compare(got, want) == []
    assert all(f.calls == 1 for _, f in fakes)


def test_context_managers_clean_up(region):
    with shmcast.Producer(region, slot_bytes=roles.SLOT) as prod:
        path = prod.path
        assert os.path.exists(path) and path == shmcast.region_path(region)
        with shmcast.Consumer(region) as cons:
            assert cons.seat == 0 and prod.consumers == 1
        assert cons.closed and prod.consumers == 0
        with pytest.raises(shmcast.Closed):
            cons.receive(timeout=0.1)
    assert prod.closed and not os.path.exists(path)
    with pytest.raises(shmcast.Closed):
        prod.send([("x", torch.zeros(1))])
    prod.close()  # idempotent


def test_producer_close_is_seen_by_consumer(region):
    prod = shmcast.Producer(region, slot_bytes=roles.SLOT)
    cons = shmcast.Consumer(region)
    prod.send([("x", torch.ones(3))])
    assert torch.equal(cons.receive(timeout=5)[0][1], torch.ones(3))
    prod.close()
    with pytest.raises(shmcast.Closed):
        cons.receive(timeout=5)
    cons.close()


def test_last_sync_before_close_is_readable(region):
    prod = shmcast.Producer(region, slot_bytes=roles.SLOT)
    cons = shmcast.Consumer(region)
    try:
        prod.send([("x", torch.ones(3))])
        prod.close()
        assert torch.equal(cons.receive(timeout=5)[0][1], torch.ones(3))
        with pytest.raises(shmcast.Closed):
            cons.receive(timeout=5)
    finally:
        cons.close()
        prod.close()


def test_gc_closes_producer(region):
    prod = shmcast.Producer(region, slot_bytes=roles.SLOT)
    path = prod.path
    del prod
    import gc

    gc.collect()
    assert not os.path.exists(path)
