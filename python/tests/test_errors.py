"""shmcast::Error codes -> Python exception classes, across real processes."""
import os
import signal
import time

import pytest
import torch

import roles
import shmcast


def test_class_hierarchy():
    names = ["InvalidArgument", "BadName", "Exists", "NotFound", "RegionFull", "Permission", "Corrupt",
             "VersionMismatch", "Timeout", "PeerDied", "Closed", "NoSeat", "Evicted", "Aborted", "Checksum",
             "CudaError", "CudaUnavailable", "SystemFailure"]
    for n in names:
        cls = getattr(shmcast, n)
        assert issubclass(cls, shmcast.Error) and cls.__module__ == "shmcast"
    assert issubclass(shmcast.Error, RuntimeError)
    assert issubclass(shmcast.Timeout, TimeoutError)
    assert issubclass(shmcast.NotFound, FileNotFoundError)
    assert issubclass(shmcast.Exists, FileExistsError)
    assert issubclass(shmcast.Permission, PermissionError)
    assert issubclass(shmcast.InvalidArgument, ValueError) and issubclass(shmcast.BadName, ValueError)
    assert shmcast.Timeout.code == "Timeout" and shmcast.CudaError.code == "Cuda"


def test_bad_name():
    with pytest.raises(shmcast.BadName) as ei:
        shmcast.Producer("no spaces allowed")
    assert ei.value.code == "BadName" and "letters, digits" in str(ei.value)
    with pytest.raises(shmcast.BadName):
        shmcast.Consumer("-leading-dash", open_timeout=0.1)
    assert shmcast.validate_name("ok-name_1.2") == ""


def test_not_found(region):
    t0 = time.monotonic()
    with pytest.raises(shmcast.NotFound) as ei:
        shmcast.Consumer(region, open_timeout=0.3)
    assert time.monotonic() - t0 < 5
    assert region in str(ei.value) and ei.value.code == "NotFound"


def test_exists_and_no_seat(region):
    with shmcast.Producer(region, slot_bytes=roles.SLOT, max_consumers=1):
        with pytest.raises(shmcast.Exists):
            shmcast.Producer(region)
        with shmcast.Consumer(region):
            with pytest.raises(shmcast.NoSeat):
                shmcast.Consumer(region)


def test_timeout(region):
    with shmcast.Producer(region, slot_bytes=roles.SLOT), shmcast.Consumer(region) as cons:
        t0 = time.monotonic()
        with pytest.raises(shmcast.Timeout) as ei:
            cons.receive(timeout=0.4)
        dt = time.monotonic() - t0
        assert 0.35 < dt < 5
        assert isinstance(ei.value, TimeoutError) and ei.value.code == "Timeout"
    with shmcast.Producer(region, slot_bytes=roles.SLOT) as prod:
        with pytest.raises(shmcast.Timeout):
            prod.wait_for_consumers(1, 0.3)


def test_invalid_arguments(region):
    with pytest.raises(shmcast.InvalidArgument):
        shmcast.Producer(region, slots=1)
    with pytest.raises(shmcast.InvalidArgument):
        shmcast.Producer(region, stall_policy="sometimes")
    with shmcast.Producer(region, slot_bytes=roles.SLOT) as prod:
        with pytest.raises(shmcast.InvalidArgument, match="twice"):
            prod.send([("a", torch.zeros(1)), ("a", torch.zeros(1))])
        with pytest.raises(TypeError):
            prod.send([("a", "not a tensor")])
        raw = prod.raw
        with pytest.raises(shmcast.InvalidArgument):
            raw.end_sync()
        raw.begin_sync([("x", "f32", (4,))])
        with pytest.raises(shmcast.InvalidArgument, match="bytes"):
            raw.write(0, torch.zeros(4).data_ptr(), nbytes=8)
        raw.abort_sync("test")
        # the producer is still usable after the failures
        assert prod.send([("a", torch.zeros(1))]) >= 1


def test_peer_died_when_producer_killed(region, procs):
    p = procs.start("producer_idle", region=region, seconds=120)
    procs.ready(p)
    with shmcast.Consumer(region, open_timeout=30) as cons:
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        t0 = time.monotonic()
        with pytest.raises(shmcast.PeerDied) as ei:
            cons.receive(timeout=20)
        assert time.monotonic() - t0 < 10
        assert "died" in str(ei.value) and ei.value.code == "PeerDied"


def test_peer_died_mid_sync(region, procs):
    """The producer is killed while the consumer is in the middle of a sync
    (the sync spans more chunks than the 2 slots hold, so the producer is
    blocked on this consumer when it dies)."""
    p = procs.start("producer", region=region, seed=0, sets=("shapes",), n_syncs=1, consumers=1, hold=60)
    procs.ready(p)
    with shmcast.Consumer(region, open_timeout=30) as cons:
        info = cons.wait_sync(30)
        assert info.version == 1 and info.chunks > 2
        seen = []

        def on_piece(i, off, ptr, n, total):
            if not seen:
                os.kill(p.pid, signal.SIGKILL)
                p.join(30)
            seen.append(i)

        with pytest.raises(shmcast.PeerDied):
            cons.raw.visit(on_piece)
        assert seen


def test_closed_after_close(region):
    cons_holder = []
    with shmcast.Producer(region, slot_bytes=roles.SLOT):
        cons_holder.append(shmcast.Consumer(region))
    with pytest.raises(shmcast.Closed):
        cons_holder[0].receive(timeout=5)
    cons_holder[0].close()


def test_cuda_unavailable_on_cpu_build_or_machine(region):
    if torch.cuda.is_available() and shmcast.cuda_available():
        pytest.skip("CUDA is available here")
    assert shmcast.cuda_unavailable_reason()
    if torch.cuda.is_available():
        with shmcast.Producer(region, slot_bytes=roles.SLOT) as prod:
            with pytest.raises(shmcast.CudaUnavailable):
                prod.send([("x", torch.zeros(4, device="cuda"))])
    else:
        with pytest.raises(shmcast.CudaUnavailable):
            shmcast.Consumer(region, device="cuda:0", open_timeout=0.1)
