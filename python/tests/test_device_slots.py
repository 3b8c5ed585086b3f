"""Device slots through the Python API (Producer(slot_memory="device")): the
option's checks (any machine), and on a GPU bit-exact syncs into consumer
processes, CUDA and CPU destinations, what the properties report, and the
consumer that cannot map the slots."""
import os

import pytest
import torch

import roles
import shmcast
import slot_roles as sr
from conftest import cuda_ready

pytestmark = pytest.mark.usefixtures("deadline")

N_VERSIONS = 5


def _gone(region) -> bool:
    return not os.path.exists(shmcast.region_path(region))


# ---------------------------------------------------------------- any machine


@pytest.mark.parametrize("bad", ["Device", "gpu", "", "vram"])
def test_unknown_slot_memory_is_a_value_error(region, bad):
    with pytest.raises(ValueError, match="slot_memory must be 'host' or 'device'") as ei:
        shmcast.Producer(region, slot_bytes=roles.SLOT, slot_memory=bad)
    assert isinstance(ei.value, shmcast.InvalidArgument)
    assert _gone(region)


def test_slot_memory_and_slot_device_types(region):
    with pytest.raises(TypeError, match="slot_memory"):
        shmcast.Producer(region, slot_bytes=roles.SLOT, slot_memory=1)
    with pytest.raises(shmcast.InvalidArgument, match="slot_device"):
        shmcast.Producer(region, slot_bytes=roles.SLOT, slot_memory="device", slot_device=-2)
    with pytest.raises(TypeError, match="slot_device"):
        shmcast.Producer(region, slot_bytes=roles.SLOT, slot_memory="device", slot_device="0")
    with pytest.raises(shmcast.InvalidArgument, match="device"):
        shmcast._shmcast.Consumer(region, open_timeout=0, device=-5)
    assert _gone(region)


@pytest.mark.parametrize("what, opts, words", [
    ("delta", {"delta": True}, "delta syncs"),
    ("store", {"mode": "store", "store_bytes": 4 << 20}, "ring region"),
    ("checksums", {"checksums": True}, "checksums"),
    ("host engine", {"engine": "host"}, "engine"),
])
def test_device_slots_refuse_what_they_cannot_carry(region, what, opts, words):
    # Checked before any GPU is touched: the same on every machine.
    with pytest.raises(shmcast.InvalidArgument, match=words) as ei:
        shmcast.Producer(region, slot_bytes=roles.SLOT, slot_memory="device", **opts)
    assert "device slots" in str(ei.value) or "host slots" in str(ei.value), (what, str(ei.value))
    assert _gone(region)


def test_without_a_gpu_device_slots_are_cuda_unavailable(region):
    if cuda_ready():
        pytest.skip("this machine has a GPU (and a CUDA build): the cuda tests cover create")
    with pytest.raises(shmcast.CudaUnavailable) as ei:
        shmcast.Producer(region, slot_bytes=roles.SLOT, slot_memory="device")
    assert "CUDA" in str(ei.value), str(ei.value)
    assert ei.value.code == "CudaUnavailable"
    assert _gone(region)  # refused before the region was made


def test_host_slots_report_host(region):
    with shmcast.Producer(region, slot_bytes=roles.SLOT, engine="host") as prod:
        assert prod.slot_memory == "host" and prod.raw.slot_memory == "host"
        assert prod.slot_device == -1
        assert prod.slot_device_bytes == 0
        # Host slots live in the region file.
        assert prod.region_bytes >= prod.slots * prod.slot_bytes
        with shmcast.Consumer(region, open_timeout=5) as cons:
            assert cons.slot_memory == "host" and cons.raw.slot_memory == "host"
            x = torch.arange(1000, dtype=torch.float32)
            prod.send([("x", x)])
            (name, got), = cons.receive(timeout=10)
            assert name == "x" and torch.equal(got, x)


# ---------------------------------------------------------------- on a GPU


def _device_producer(region, **kw):
    kw.setdefault("slots", 4)
    kw.setdefault("max_consumers", 8)
    return shmcast.Producer(region, slot_bytes=roles.SLOT, slot_memory="device", **kw)


@pytest.mark.cuda
def test_device_slot_properties(region):
    torch.cuda.set_device(0)
    with _device_producer(region) as prod:
        assert prod.slot_memory == "device"
        assert prod.slot_device == torch.cuda.current_device() == 0
        assert prod.slot_device_bytes >= prod.slots * prod.slot_bytes
        assert prod.raw.engine == "cuda"
        device_region = prod.region_bytes
    # The slots are GPU memory, not bytes of the region file: the file is
    # smaller by all of them than a host-slot region's of the same options
    # (both also hold the sparse manifest reserve, docs/protocol.md §2.1).
    with shmcast.Producer(region, slot_bytes=roles.SLOT, slots=4, max_consumers=8) as host:
        assert device_region + host.slots * host.slot_bytes <= host.region_bytes
    with _device_producer(region, slot_device=0) as prod:
        assert prod.slot_device == 0


@pytest.mark.cuda
@pytest.mark.parametrize("src", ["cuda", "cpu"])
def test_device_slots_bit_exact_in_consumer_processes(region, procs, src):
    # CUDA consumers: receive_into (transposed destinations among them),
    # receive() fresh tensors, staging views, CUDA and CPU destinations
    # together; CPU consumers: receive_into CPU tensors, receive() onto CPU.
    kinds = [("cuda:0", "into"), ("cuda:0", "copy"), ("cuda:0", "staging"), ("cuda:0", "mixed"),
             ("cpu", "into"), ("cpu", "copy")]
    cons = [procs.start("slot_roles:consumer", region=region, seed=41, n_versions=N_VERSIONS, device=d, how=h)
            for d, h in kinds]
    sent = []
    with _device_producer(region) as prod:
        assert prod.slot_memory == "device"
        for c in cons:
            assert procs.ready(c)["slot_memory"] == "device"
        prod.wait_for_consumers(len(cons), 60)
        for k in range(N_VERSIONS):
            v = prod.send(sr.version(41, k, "cuda:0" if src == "cuda" else "cpu"))
            sent.append(dict(prod.last_sync))
            assert sent[-1]["version"] == v
        results = {kd: procs.get(c)["results"] for kd, c in zip(kinds, cons)}
    assert [s["version"] for s in sent] == list(range(1, N_VERSIONS + 1))
    assert all(s["kind"] == "full" and s["logical_bytes"] == sr.logical_bytes() for s in sent)
    want_devices = {("cuda:0", "into"): ["cuda:0"], ("cuda:0", "copy"): ["cuda:0"],
                    ("cuda:0", "staging"): ["cuda:0"], ("cuda:0", "mixed"): ["cpu", "cuda:0"],
                    ("cpu", "into"): ["cpu"], ("cpu", "copy"): ["cpu"]}
    for kd, res in results.items():
        assert [r["version"] for r in res] == list(range(1, N_VERSIONS + 1)), kd
        for r, s in zip(res, sent):
            assert r["problems"] == [], (kd, r["version"], r["problems"][:5])
            assert r["devices"] == want_devices[kd], (kd, r["devices"])
            if kd[1] != "staging":  # read_to_staging() does not report a last_sync
                assert r["last_sync"] == s, (kd, r["last_sync"], s)


@pytest.mark.cuda
def test_device_slots_in_one_process(region):
    # Producer and consumer in one process; visit() hands slot bytes to host
    # code and is refused on device slots; read_into_device still works after.
    with _device_producer(region, slots=8) as prod, shmcast.Consumer(region, device="cuda:0", open_timeout=10) as cons:
        assert cons.slot_memory == "device"
        named = sr.version(5, 0, "cuda:0")
        prod.send(named)
        cons.wait_sync(10)
        with pytest.raises(shmcast.Unsupported, match="read_into"):
            cons.raw.visit(lambda *_: None)
        cons.skip()
        named = sr.version(5, 1, "cuda:0")
        prod.send(named)
        got = cons.receive(timeout=10)
        assert roles.compare(got, named) == []
        dst = sr.destinations("cuda:0")
        named = sr.version(5, 2, "cuda:0")
        prod.send(named)
        assert cons.receive_into(dst, timeout=10) == prod.last_version
        assert roles.compare([(n, dst[n]) for n, _ in named], named) == []


@pytest.mark.cuda
def test_consumer_that_cannot_map_the_slots_is_unsupported(region, procs):
    with _device_producer(region) as prod:
        blind = procs.start("slot_roles:open", region=region, env={"CUDA_VISIBLE_DEVICES": ""})
        res = procs.get(blind)
        assert res["error"] == "Unsupported", res
        assert "slot_memory=\"host\"" in res["message"], res["message"]
        # The producer is unharmed: a consumer that sees the GPU still reads.
        ok = procs.start("slot_roles:consumer", region=region, seed=3, n_versions=1, device="cpu", how="into")
        assert procs.ready(ok)["slot_memory"] == "device"
        prod.wait_for_consumers(1, 60)
        prod.send(sr.version(3, 0, "cuda:0"))
        (r,) = procs.get(ok)["results"]
        assert r["problems"] == []


@pytest.mark.cuda
def test_trainer_killed_mid_sync_is_an_error_for_the_consumer(region, procs):
    # The trainer announces a sync, writes part of it and is SIGKILLed: the
    # engine's receive raises PeerDied (no hang, no partial weights handed out).
    trainer = procs.start("slot_roles:die_mid_sync", region=region)
    procs.ready(trainer)
    with shmcast.Consumer(region, device="cuda:0", open_timeout=60) as cons:
        assert cons.slot_memory == "device"
        with pytest.raises(shmcast.PeerDied):
            cons.receive(timeout=60)
    trainer.join(30)
    assert trainer.exitcode == -9, trainer.exitcode
