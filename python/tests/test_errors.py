"""shmcast::Error codes -> Python exception classes, across real processes."""
import math
import os
import signal
import time

import pytest
import torch

import regions
import roles
import shmcast
import shmcast.roll as roll


def test_class_hierarchy():
    names = ["InvalidArgument", "BadName", "Exists", "NotFound", "RegionFull", "Permission", "Corrupt",
             "VersionMismatch", "Timeout", "PeerDied", "Closed", "NoSeat", "Evicted", "Aborted", "Checksum",
             "CudaError", "CudaUnavailable", "SystemFailure", "Unsupported"]
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
    assert shmcast.Unsupported.code == "Unsupported"


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


def test_trust_options(region):
    # A group_access region (0660) is refused unless the consumer asks for
    # group access; then it is read like any other. A 0666 region never is.
    with shmcast.Producer(region, slot_bytes=roles.SLOT, group_access=True) as prod:
        with pytest.raises(shmcast.Permission) as ei:
            shmcast.Consumer(region, open_timeout=1.0)
        assert "group_access" in str(ei.value)
        with shmcast.Consumer(region, group_access=True, trusted_uids=[os.geteuid()]) as cons:
            t = torch.arange(1000, dtype=torch.int32)
            prod.send({"t": t})
            got = dict(cons.receive(timeout=10.0))
            assert torch.equal(got["t"], t)
        os.chmod(shmcast.region_path(region), 0o666)
        with pytest.raises(shmcast.Permission) as ei:
            shmcast.Consumer(region, open_timeout=1.0, group_access=True)
        assert "0666" in str(ei.value)
    with pytest.raises(shmcast.InvalidArgument):
        shmcast.Consumer(region, open_timeout=0.1, trusted_uids=[-1])


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


# ---------------------------------------------------------------- hostile or odd input: always a shmcast.Error


def test_manifest_sizes_never_reach_torch_allocator_unchecked(region):
    """A manifest no shmcast producer would write claims a 64 TiB tensor:
    receive() refuses to allocate it (RegionFull, errno ENOMEM, saying what
    to do) in both modes instead of raising torch's allocation error, and
    the consumer goes on with the next sync."""
    with shmcast.Producer(region, slot_bytes=roles.SLOT, slots=4) as prod, shmcast.Consumer(region) as cons:
        for mode in ("copy", "staging"):
            prod.send([("x", torch.arange(4.0))])
            with regions.edit_sync(prod.path) as m:
                m.set_tensor(0, nbytes=1 << 46, shape=(1 << 44,))
                m.stream_bytes(1 << 46)
                m.payload_bytes(1 << 46)
            with pytest.raises(shmcast.RegionFull) as ei:
                cons.receive(timeout=5, mode=mode)
            e = ei.value
            assert e.code == "RegionFull" and e.sys_errno == 12  # ENOMEM
            assert str(1 << 46) in str(e) and "receive_into" in str(e)
        data = [("y", torch.arange(6, dtype=torch.int32))]
        prod.send(data)
        assert roles.compare(cons.receive(timeout=5), data) == []


def test_name_that_is_not_utf8_is_corrupt(region):
    """A manifest whose tensor name is not UTF-8 (a producer refuses such
    names; the region can still hold any bytes): shmcast.Corrupt, never a
    UnicodeDecodeError."""
    with shmcast.Producer(region, slot_bytes=roles.SLOT, slots=4) as prod, shmcast.Consumer(region) as cons:
        prod.send([("ab", torch.zeros(2))])
        with regions.edit_sync(prod.path) as m:
            m.set_name(0, b"a\xff")
        with pytest.raises(shmcast.Corrupt) as ei:
            cons.receive(timeout=5)
        assert ei.value.code == "Corrupt"


def test_names_without_utf8_form_are_refused(region):
    """A str with a lone surrogate (what os.fsdecode makes of non-UTF-8
    bytes) has no UTF-8 form: InvalidArgument for a tensor name (the sync
    is not begun: the producer goes on), BadName for a region name."""
    with shmcast.Producer(region, slot_bytes=roles.SLOT, slots=4) as prod, shmcast.Consumer(region) as cons:
        with pytest.raises(shmcast.InvalidArgument, match="UTF-8") as ei:
            prod.send([("ok", torch.zeros(1)), ("bad\udcff", torch.zeros(1))])
        assert ei.value.code == "InvalidArgument"
        with pytest.raises(shmcast.InvalidArgument, match="UTF-8"):
            prod.raw.begin_sync([("\udcff", "f32", (1,))])
        with pytest.raises(shmcast.InvalidArgument, match="UTF-8"):
            shmcast._shmcast.stream_layout([("\udcff", "f32", (1,))], prod.slot_bytes)
        data = [("fine", torch.ones(3))]
        prod.send(data)
        assert roles.compare(cons.receive(timeout=5), data) == []
    with pytest.raises(shmcast.BadName):
        shmcast.Producer("bad\udcff")
    with pytest.raises(shmcast.BadName):
        shmcast.Consumer("bad\udcff", open_timeout=0)
    with pytest.raises(shmcast.BadName):
        shmcast.unlink_region("bad\udcff")
    assert "UTF-8" in shmcast.validate_name("bad\udcff")


def test_abort_reason_cut_inside_a_character(region):
    """The region keeps 255 bytes of an abort reason, so a long non-ASCII
    one is cut inside a character: the consumer's Aborted error still
    arrives (the cut byte escaped), not a UnicodeDecodeError."""
    with shmcast.Producer(region, slot_bytes=roles.SLOT, slots=2) as prod, shmcast.Consumer(region) as cons:
        raw = prod.raw
        raw.begin_sync([("big", "u8", (3 * roles.SLOT,))])
        cons.wait_sync(5)
        raw.abort_sync("\u00e9" * 300)  # 600 UTF-8 bytes
        with pytest.raises(shmcast.Aborted) as ei:
            cons.read()
        assert "\u00e9" * 100 in str(ei.value)


def _bad_numbers(region, prod, cons):
    """(call, argument name) pairs: each call passes one number out of range."""
    nan, raw = math.nan, prod.raw
    ptr = torch.zeros(4).data_ptr()
    return [
        (lambda: shmcast.Producer(region, slot_bytes=2**64), "slot_bytes"),
        (lambda: shmcast.Producer(region, slot_bytes=0), "slot_bytes"),
        (lambda: shmcast.Producer(region, slot_bytes=(64 << 30) + 1), "slot_bytes"),
        (lambda: shmcast.Producer(region, slots=2**32), "slots"),
        (lambda: shmcast.Producer(region, slots=-1), "slots"),
        (lambda: shmcast.Producer(region, max_consumers=2**32), "max_consumers"),
        (lambda: shmcast.Producer(region, max_consumers=0), "max_consumers"),
        (lambda: shmcast.Producer(region, manifest_bytes=2**64), "manifest_bytes"),
        (lambda: shmcast.Producer(region, consumer_timeout=nan), "consumer_timeout"),
        (lambda: shmcast.Producer(region, consumer_timeout=-1.0), "consumer_timeout"),
        (lambda: shmcast.Producer(region, staging_budget=-1), "staging_budget"),
        (lambda: shmcast.Producer(region, staging_budget=2**64), "staging_budget"),
        (lambda: shmcast.Consumer(region, open_timeout=nan), "open_timeout"),
        (lambda: shmcast.Consumer(region, chunk_timeout=-5), "chunk_timeout"),
        (lambda: shmcast.Consumer(region, device="cuda:99") if torch.cuda.is_available()
         else shmcast.Consumer(region, open_timeout=-1), "device" if torch.cuda.is_available() else "open_timeout"),
        (lambda: prod.wait_for_consumers(-1, 1), "n"),
        (lambda: prod.wait_for_consumers(2**32, 1), "n"),
        (lambda: prod.wait_for_consumers(1, nan), "timeout"),
        (lambda: prod.wait_drained(-1), "timeout"),
        (lambda: cons.receive(timeout=-1), "timeout"),
        (lambda: cons.wait_sync(nan), "timeout"),
        (lambda: cons.receive_into({}, timeout=-0.5), "timeout"),
        (lambda: raw.write(-1, ptr), "index"),
        (lambda: raw.write(2**64, ptr), "index"),
        (lambda: raw.write(0, ptr, nbytes=-1), "nbytes"),
        (lambda: raw.write(0, -1), "pointer"),
        (lambda: raw.write_strided(0, ptr, -1, 4, 4), "rows"),
        (lambda: raw.write_batch(-1, [ptr]), "first"),
        (lambda: raw.begin_sync([("x", "f32", (-1,))]), "shape dimension"),
        (lambda: raw.begin_sync([("x", "f32", (2**63,))]), "shape dimension"),
        (lambda: cons.raw.read_to_staging(-1), "device"),
        (lambda: shmcast._shmcast.stream_layout([("x", "f32", (4,))], 0), "slot_bytes"),
        (lambda: roll.serialize_named_weights([("x", torch.zeros(1))], "vllm", region=region, consumers=-1),
         "consumers"),
    ]


def test_numbers_out_of_range_are_invalid_argument(region):
    """Every numeric argument out of range (beyond its C++ type, negative,
    NaN, outside the library's limits) is shmcast.InvalidArgument naming the
    argument and its range, not pybind11's "incompatible arguments"
    TypeError, an OverflowError or a torch error."""
    with shmcast.Producer(region, slot_bytes=roles.SLOT) as prod, shmcast.Consumer(region) as cons:
        calls = _bad_numbers(region, prod, cons)
        for call, arg in calls:
            with pytest.raises(shmcast.InvalidArgument) as ei:
                call()
            msg = str(ei.value)
            assert ei.value.code == "InvalidArgument" and msg.startswith(arg), (arg, msg)
            assert "must be" in msg, (arg, msg)
        # inf (and None where it is allowed) means no limit
        prod.wait_for_consumers(1, math.inf)
        prod.wait_for_consumers(1, None)
        with shmcast.Consumer(region, open_timeout=math.inf, chunk_timeout=math.inf):
            pass
        # still usable after all that
        data = [("z", torch.arange(5))]
        prod.send(data)
        assert roles.compare(cons.receive(timeout=5), data) == []


def test_non_numbers_are_type_errors_naming_the_argument(region):
    with pytest.raises(TypeError, match="slot_bytes"):
        shmcast.Producer(region, slot_bytes=1.5e9)
    with pytest.raises(TypeError, match="open_timeout"):
        shmcast.Consumer(region, open_timeout="soon")
    with pytest.raises(TypeError, match="staging_budget"):
        shmcast.Producer(region, staging_budget="lots")
