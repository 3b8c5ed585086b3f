"""Store regions from Python (Producer(mode='store')): late joiners get the
newest version at once, StoreView zero-copy tensors and their lifetime,
a worker killed while holding a version does not stall the trainer, and a
restarted worker gets the newest version bit-exact."""
import time

import pytest
import torch

import shmcast
from roles import as_bytes, build, compare

SEED = 500


def store_producer(region, tensors, **kw):
    return shmcast.Producer(region, mode="store", store_bytes=shmcast.store_bytes_for(tensors), pin=False,
                            engine="host", **kw)


def test_store_needs_store_bytes_and_one_rank(region):
    with pytest.raises(ValueError, match="store_bytes"):
        shmcast.Producer(region, mode="store")
    with pytest.raises(shmcast.InvalidArgument, match="mode must be"):
        shmcast.Producer(region, mode="tape", store_bytes=1 << 20)
    with pytest.raises(shmcast.InvalidArgument, match="one producer rank"):
        shmcast.Producer(region, mode="store", store_bytes=1 << 20, world_size=2, pin=False)


def test_late_joiner_receives_the_newest_version_at_once(region):
    want = {v: build(SEED + v, ("dtypes", "shapes")) for v in (1, 2, 3)}
    with store_producer(region, want[1]) as p:
        assert p.region_mode == "store"
        for v in (1, 2):
            assert p.send(want[v]) == v
        with shmcast.Consumer(region, pin=False) as c:
            assert c.region_mode == "store"
            got = c.receive(timeout=0)  # stored already: no waiting
            assert c.last_version == 2
            assert compare(got, want[2]) == []
            with pytest.raises(shmcast.Timeout):
                c.receive(timeout=0.1)  # nothing newer
            assert p.send(want[3]) == 3
            dst = {n: torch.empty_like(t).contiguous() for n, t in want[3]}
            assert c.receive_into(dst, timeout=1.0) == 3
            assert compare(list(dst.items()), want[3]) == []


def test_store_view_is_zero_copy_and_held_until_released(region):
    want = build(SEED, ("dtypes", "shapes"))
    with store_producer(region, want, consumer_timeout=0.3, stall_policy="fail") as p:
        p.send(want)
        with shmcast.Consumer(region, pin=False) as c:
            with c.hold(timeout=0) as view:
                assert view.version == 1 and view.valid()
                assert compare(list(view), want) == []
                name, t = view.tensors[-1]
                before = as_bytes(t).clone()
                p.send(want)  # version 2: the other bank
                # version 3 needs version 1's bank: refused while we hold it
                with pytest.raises(shmcast.Timeout, match="consumer seat"):
                    p.send(build(SEED + 9, ("dtypes", "shapes")))
                assert view.valid() and torch.equal(as_bytes(view[name]), before)
            assert not view.valid()
            # released: the producer goes on; the consumer then gets the newest
            v = p.send(want)
            got = c.receive(timeout=1.0)
            assert c.last_version == v and compare(got, want) == []


def test_evicting_producer_invalidates_a_held_view(region):
    want = build(SEED, ("shapes",))
    with store_producer(region, want, consumer_timeout=0.3, stall_policy="evict") as p:
        p.send(want)
        c = shmcast.Consumer(region, pin=False)
        view = c.hold(timeout=0)
        p.send(want)
        p.send(want)  # waits 0.3 s, evicts the holder, rewrites its bank
        assert not view.valid()
        with pytest.raises(shmcast.Evicted):
            c.receive(timeout=1.0)
        c.close()


def test_next_receive_releases_the_view(region):
    want = build(SEED, ("shapes",))
    with store_producer(region, want) as p:
        p.send(want)
        with shmcast.Consumer(region, pin=False) as c:
            view = c.hold(timeout=0)
            p.send(want)
            c.receive(timeout=1.0)
            assert not view.valid()
            view.release()  # idempotent, and does not release what came after


def test_hold_on_a_ring_region_is_refused(region):
    with shmcast.Producer(region, slot_bytes=2 << 20, pin=False, engine="host") as p:
        with shmcast.Consumer(region, pin=False) as c:
            assert c.region_mode == "ring"
            p.send([("w", torch.arange(10))])
            with pytest.raises(shmcast.InvalidArgument, match="store region"):
                c.hold(timeout=5.0)
            # the refused hold let go of the sync: the next one arrives
            p.send([("w", torch.arange(10))])
            assert c.receive(timeout=5.0)[0][0] == "w"


@pytest.mark.deadline(180)
def test_worker_killed_while_holding_then_restarted_gets_the_newest_version(region, procs, deadline):
    """The restart drill on CPU: a worker holding a version is SIGKILLed; the
    trainer keeps storing versions (the dead holder does not stall it); a
    restarted worker gets the newest version at once, bit-exact."""
    with store_producer(region, build(SEED, ("dtypes", "shapes")), consumer_timeout=60.0) as p:
        p.send(build(SEED + 1, ("dtypes", "shapes")))
        w = procs.start("store_reader", region=region, seed_of_version=SEED, hold=True)
        msg = procs.ready(w)
        assert msg["version"] == 1 and msg["problems"] == [], msg
        procs.kill(w)
        t0 = time.monotonic()
        for v in (2, 3, 4):  # 3 needs the dead worker's bank: a live holder would stall it 60 s
            p.send(build(SEED + v, ("dtypes", "shapes")))
        assert time.monotonic() - t0 < 30.0
        r = procs.start("store_reader", region=region, seed_of_version=SEED)
        res = procs.get(r)
        assert res["version"] == 4 and res["problems"] == [], res


def test_store_defaults_to_evicting_a_reader_that_overstays(region):
    want = build(SEED, ("shapes",))
    with store_producer(region, want, consumer_timeout=0.3) as p:  # no stall_policy given
        p.send(want)
        c = shmcast.Consumer(region, pin=False)
        view = c.hold(timeout=0)
        p.send(want)
        p.send(want)  # the trainer goes on: the holder is evicted after 0.3 s
        assert not view.valid()
        c.close()


def test_views_keep_the_region_mapped_and_a_dropped_view_lets_go(region):
    """Tensors of a StoreView keep their consumer (and its mapping) alive
    when the caller dropped everything else; once no tensor is left, the
    version is let go and the producer can replace it."""
    import gc

    want = build(SEED, ("dtypes", "shapes"))
    with store_producer(region, want, consumer_timeout=30.0, stall_policy="fail") as p:
        p.send(want)
        tensors = dict(shmcast.Consumer(region, pin=False).hold(timeout=0))  # consumer and view dropped
        gc.collect()
        assert compare(list(tensors.items()), want) == []  # still mapped, still held
        p.send(want)  # the other bank
        del tensors
        gc.collect()  # the view is collected and lets go of version 1
        t0 = time.monotonic()
        p.send(want)  # version 1's bank: would wait 30 s for a holder
        assert time.monotonic() - t0 < 10.0


def test_hold_that_cannot_build_its_view_lets_go(region, monkeypatch):
    want = build(SEED, ("shapes",))
    with store_producer(region, want, consumer_timeout=30.0, stall_policy="fail") as p:
        p.send(want)
        with shmcast.Consumer(region, pin=False) as c:
            import shmcast._store as T  # StoreView looks torch_dtype up there

            def boom(*a, **k):
                raise TypeError("no such dtype here")

            monkeypatch.setattr(T, "torch_dtype", boom)
            with pytest.raises(TypeError):
                c.hold(timeout=0)
            monkeypatch.undo()
            p.send(want)
            t0 = time.monotonic()
            p.send(want)  # version 1's bank: free, not held by the failed hold
            assert time.monotonic() - t0 < 10.0


def test_closing_a_consumer_whose_views_live_never_unmaps_under_them(region):
    """close() (here: the end of a `with` block) while StoreView tensors are
    alive lets go of the version at once but unmaps only when the last
    tensor is gone: the tensors are invalid, never a fault."""
    import gc

    want = build(SEED, ("shapes",))
    with store_producer(region, want, consumer_timeout=30.0, stall_policy="fail") as p:
        p.send(want)
        with shmcast.Consumer(region, pin=False) as c:
            view = c.hold(timeout=0)
        assert c.closed and not view.valid()
        with pytest.raises(shmcast.Closed):
            c.receive(timeout=0)
        _ = [float(t.float().sum()) for _, t in view]  # still mapped: no fault
        p.send(want)
        t0 = time.monotonic()
        p.send(want)  # version 1 was let go at close()
        assert time.monotonic() - t0 < 10.0
        assert p.consumers == 1  # the seat stays until the tensors are gone
        del view, _
        gc.collect()
        assert p.consumers == 0



def test_store_view_tensors_are_read_only_and_copies_are_not(region):
    """A StoreView's tensors are every reader's bytes: each in-place form
    raises shmcast.ReadOnly before a byte changes (views of them too), numpy()
    is a read-only array, and copies (clone(), to(), arithmetic) are plain
    tensors the reader may change. The pages are mapped read-only as well."""
    import numpy as np

    want = [("w", torch.arange(64, dtype=torch.float32).reshape(8, 8)), ("i", torch.arange(10)),
            ("e", torch.empty(0))]
    with store_producer(region, want) as p:
        p.send(want)
        with shmcast.Consumer(region, pin=False) as c:
            assert c.views_read_only
            with c.hold(timeout=0) as view:
                w, i, e = (t for _, t in view)
                assert all(isinstance(t, shmcast.ReadOnlyTensor) for t in (w, i, e))
                writes = [
                    lambda: w.mul_(-1000), lambda: w.add_(1), lambda: w.zero_(), lambda: w.copy_(torch.zeros(8, 8)),
                    lambda: w.__setitem__(0, 1.0), lambda: w.__iadd__(1), lambda: torch.add(w, 1, out=w),
                    lambda: w.data.fill_(3), lambda: w.detach().zero_(), lambda: w[2:4].neg_(),
                    lambda: w.view(-1).index_fill_(0, torch.tensor([1]), 9.0), lambda: torch.nn.init.zeros_(w),
                    lambda: torch.nn.functional.relu(w, inplace=True), lambda: torch._foreach_add_([w], 1),
                    lambda: i.clamp_(0, 1), lambda: e.zero_(),
                ]
                for write in writes:
                    with pytest.raises(shmcast.ReadOnly):
                        write()
                assert issubclass(shmcast.ReadOnly, (shmcast.Permission, PermissionError))
                for a in (w.numpy(), np.asarray(i)):
                    assert not a.flags.writeable
                    with pytest.raises(ValueError):
                        a[0] = 1
                assert compare(list(view), want) == []  # nothing changed
                assert isinstance(w.narrow(0, 0, 2), shmcast.ReadOnlyTensor)
                assert isinstance(w.t(), shmcast.ReadOnlyTensor) and isinstance(w[1], shmcast.ReadOnlyTensor)
                for copy in (w.clone(), w.to(torch.float64), w * 2, w + 0, torch.empty_like(w).copy_(w)):
                    assert type(copy) is torch.Tensor
                    copy.mul_(-1)  # the reader's own memory
                dst = torch.zeros(8, 8)
                dst.copy_(w)  # a view is a fine source
                assert torch.equal(dst, want[0][1])
                w.requires_grad_(False)  # metadata only: allowed
        with shmcast.Consumer(region, pin=False) as late:
            assert compare(late.receive(timeout=0), want) == []


@pytest.mark.cuda
def test_pinned_store_views_are_read_only_where_the_driver_can(region):
    """On a GPU: a pinned consumer's banks are registered read-only where the
    driver supports it (views_read_only; the fallback pins them writable);
    either way in-place ops on the view raise ReadOnly, and receive() to the
    GPU is bit-exact."""
    want = build(SEED, ("dtypes", "shapes"))
    with store_producer(region, want) as p:
        p.send(want)
        with shmcast.Consumer(region, pin=True, device="cuda:0") as c:
            assert c.pinned
            print("views_read_only:", c.views_read_only)
            with c.hold(timeout=0) as view:
                name, t = next((n, t) for n, t in view if t.numel() > 0)
                with pytest.raises(shmcast.ReadOnly):
                    t.mul_(-1000)
                assert compare(list(view), want) == []
        with shmcast.Consumer(region, pin=True, device="cuda:0") as late:
            got = late.receive(timeout=0)
            assert all(t.is_cuda for _, t in got)
            assert compare([(n, t.cpu()) for n, t in got], want) == []
