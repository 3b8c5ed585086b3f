"""Delta syncs through the Python API (Producer(delta=True), issue 31):
bit-exact over many versions in real processes, what last_sync reports,
keyframes, and the full sync a consumer gets when a delta cannot apply."""
import pytest
import torch

import delta_roles as dr
import roles
import shmcast

pytestmark = pytest.mark.usefixtures("deadline")

N_VERSIONS = 20


def test_delta_stream_bit_exact_in_consumer_processes(region, procs):
    # Three consumer processes: receive_into the same destinations (some of
    # them transposed views), receive() fresh tensors, receive() staging views.
    hows = ("into", "copy", "staging")
    cons = [procs.start("delta_roles:consumer", region=region, seed=31, n_versions=N_VERSIONS, how=h) for h in hows]
    sent = []
    # delta_max_ratio 0.6: at 30 % changed deltas take ~0.37-0.43 of the bytes
    # (docs/protocol.md §12), which the default (0.4) may send full.
    ratio = 0.6
    with shmcast.Producer(region, slot_bytes=roles.SLOT, slots=4, max_consumers=4, delta=True,
                          delta_max_ratio=ratio) as prod:
        for c in cons:
            assert procs.ready(c)["delta"] is True
        prod.wait_for_consumers(len(cons), 60)
        for named in dr.versions(31, N_VERSIONS):
            v = prod.send(named)
            sent.append(dict(prod.last_sync))
            assert sent[-1]["version"] == v
        assert prod.delta_base_bytes == dr.logical_bytes()
        results = {h: procs.get(c)["results"] for h, c in zip(hows, cons)}

    logical = dr.logical_bytes()
    assert [s["version"] for s in sent] == list(range(1, N_VERSIONS + 1))
    assert [s["kind"] for s in sent] == ["full"] + ["delta"] * (N_VERSIONS - 1)
    assert all(s["logical_bytes"] == logical for s in sent)
    assert sent[0]["payload_bytes"] == logical
    fr = dr.fractions(31, N_VERSIONS)
    for s, f in zip(sent[1:], fr):
        assert s["payload_bytes"] <= ratio * logical
        if f <= 0.02:  # docs/protocol.md §12: ~0.07 for 1-byte words at 2 %, less for wider ones
            assert s["payload_bytes"] < 0.15 * logical, (f, s)
    for how, res in results.items():
        assert [r["version"] for r in res] == list(range(1, N_VERSIONS + 1)), how
        for r, s in zip(res, sent):
            assert r["problems"] == [], (how, r["version"], r["problems"][:5])
            assert r["last_sync"] == s, (how, r["last_sync"], s)  # a consumer of whole tensors: the same numbers
            assert r["delta"] == (s["kind"] == "delta") and (r["base"] == r["version"] - 1 if r["delta"] else True)


def _send_and_receive_into(prod, cons, named, dst):
    v = prod.send(named)
    assert cons.receive_into(dst, timeout=10) == v
    assert dr.compare([(n, dst[n]) for n, _ in named], named) == []
    assert cons.last_sync == prod.last_sync
    return prod.last_sync["kind"]


def test_keyframe_every(region):
    with shmcast.Producer(region, slot_bytes=roles.SLOT, slots=8, delta=True, keyframe_every=3) as prod, \
            shmcast.Consumer(region) as cons:
        dst = dr.destinations(noncontig=False)
        kinds = [_send_and_receive_into(prod, cons, named, dst) for named in dr.versions(5, 8)]
    assert kinds == ["full", "delta", "delta", "full", "delta", "delta", "full", "delta"]


def test_receive_into_other_tensors_needs_full_sync(region):
    with shmcast.Producer(region, slot_bytes=roles.SLOT, slots=8, delta=True) as prod, \
            shmcast.Consumer(region) as cons:
        vs = dr.versions(7, 6)
        a, b = dr.destinations(), dr.destinations()
        assert _send_and_receive_into(prod, cons, next(vs), a) == "full"
        assert _send_and_receive_into(prod, cons, next(vs), a) == "delta"
        # A delta for other destinations: refused before a byte is written,
        # and the producer is asked for a full sync.
        named = next(vs)
        prod.send(named)
        assert prod.last_sync["kind"] == "delta"
        before = {n: t.clone() for n, t in b.items()}
        with pytest.raises(shmcast.NeedsFullSync) as ei:
            cons.receive_into(b, timeout=10)
        assert isinstance(ei.value, shmcast.Error) and ei.value.code == "NeedsFullSync"
        assert all(torch.equal(dr.words(b[n]), dr.words(before[n])) for n in b)
        # The next sync is full, and b takes it exactly; then deltas again.
        assert _send_and_receive_into(prod, cons, next(vs), b) == "full"
        assert _send_and_receive_into(prod, cons, next(vs), b) == "delta"
        # Back to a: a full sync first again.
        named = next(vs)
        prod.send(named)
        with pytest.raises(shmcast.NeedsFullSync):
            cons.receive_into(a, timeout=10)


def test_receive_keeps_its_own_copy(region):
    with shmcast.Producer(region, slot_bytes=roles.SLOT, slots=8, delta=True) as prod, \
            shmcast.Consumer(region) as cons:
        assert cons.delta
        vs = list(dr.versions(9, 5))
        got = []
        for k in range(3):
            prod.send(vs[k])
            got.append(cons.receive(timeout=10))
            assert cons.last_sync["kind"] == ("full" if k == 0 else "delta")
            for j, g in enumerate(got):  # 'copy': every version received stays as it was
                assert dr.compare(g, vs[j]) == [], (k, j)
        # The tensors are the consumer's copies: writing into them changes
        # nothing the next delta applies to.
        for _n, t in got[-1]:
            dr.words(t).fill_(0)
        prod.send(vs[3])
        assert dr.compare(cons.receive(timeout=10, mode="staging"), vs[3]) == []
        assert cons.last_sync["kind"] == "delta"
        # Another set of tensors (names) than the last read: a delta cannot
        # apply to it; the next sync is full.
        prod.send(vs[4])
        with pytest.raises(shmcast.NeedsFullSync):
            cons.receive(timeout=10, names=["bf16.big"])
        prod.send(vs[4])
        got = cons.receive(timeout=10, names=["bf16.big"])
        assert cons.last_sync["kind"] == "full" and dr.compare(got, vs[4][:1]) == []


def test_late_consumer_gets_a_full_sync(region):
    with shmcast.Producer(region, slot_bytes=roles.SLOT, slots=8, delta=True) as prod:
        vs = dr.versions(13, 5)
        prod.send(next(vs))
        prod.send(next(vs))
        assert prod.last_sync["kind"] == "delta"
        with shmcast.Consumer(region) as cons:
            dst = dr.destinations()
            assert _send_and_receive_into(prod, cons, next(vs), dst) == "full"
            assert _send_and_receive_into(prod, cons, next(vs), dst) == "delta"


def test_visit_of_a_delta_sync_needs_full_sync(region):
    with shmcast.Producer(region, slot_bytes=roles.SLOT, slots=8, delta=True) as prod, \
            shmcast.Consumer(region) as cons:
        vs = dr.versions(17, 3)
        dst = dr.destinations()
        _send_and_receive_into(prod, cons, next(vs), dst)
        prod.send(next(vs))
        info = cons.wait_sync(10)
        assert info.delta and info.base_version == info.version - 1 and info.wire_bytes < info.payload_bytes
        with pytest.raises(shmcast.NeedsFullSync):
            cons.raw.visit(lambda *a: None)
        assert _send_and_receive_into(prod, cons, next(vs), dst) == "full"


def test_deltas_that_do_not_pay_go_full(region):
    with shmcast.Producer(region, slot_bytes=roles.SLOT, slots=8, delta=True) as prod, \
            shmcast.Consumer(region) as cons:
        g = torch.Generator().manual_seed(3)
        dst = dr.destinations()
        named = [(n, roles._rand(g, dt, shape)) for n, dt, shape in dr.SPECS]
        assert _send_and_receive_into(prod, cons, named, dst) == "full"
        named = [(n, t.clone()) for n, t in named]
        for _n, t in named:
            dr.words(t).bitwise_not_()  # every element changes
        assert _send_and_receive_into(prod, cons, named, dst) == "full"
        assert prod.last_sync["payload_bytes"] == prod.last_sync["logical_bytes"] == dr.logical_bytes()


def test_delta_arguments(region):
    for bad in (0, 0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(shmcast.InvalidArgument, match="delta_max_ratio"):
            shmcast.Producer(region, slot_bytes=roles.SLOT, delta=True, delta_max_ratio=bad)
    with pytest.raises(TypeError, match="delta_max_ratio"):
        shmcast.Producer(region, slot_bytes=roles.SLOT, delta=True, delta_max_ratio="0.5")
    with pytest.raises(shmcast.InvalidArgument, match="keyframe_every"):
        shmcast.Producer(region, slot_bytes=roles.SLOT, delta=True, keyframe_every=-1)
    with pytest.raises(shmcast.InvalidArgument, match="ring region"):
        shmcast.Producer(region, slot_bytes=roles.SLOT, delta=True, mode="store", store_bytes=1 << 20)
    with shmcast.Producer(region, slot_bytes=roles.SLOT) as prod, shmcast.Consumer(region) as cons:
        assert prod.delta_base_bytes == 0 and not cons.delta
        assert prod.last_sync == {"version": 0, "kind": None, "logical_bytes": 0, "payload_bytes": 0}
        assert cons.last_sync["kind"] is None


@pytest.mark.cuda
@pytest.mark.parametrize("src", ["cpu", "cuda"])
def test_delta_on_cuda(region, src):
    """CUDA consumers (one process): receive_into CUDA destinations (some
    transposed, one on the CPU: both through kept device temporaries),
    receive() in 'copy' and 'staging' mode (the consumer's own copy on the
    GPU); the producer sends CPU or CUDA tensors."""
    dev = "cuda:0"
    with shmcast.Producer(region, slot_bytes=roles.SLOT, slots=16, max_consumers=3, delta=True) as prod, \
            shmcast.Consumer(region, device=dev) as into, \
            shmcast.Consumer(region, device=dev, mode="copy") as copy, \
            shmcast.Consumer(region, device=dev, mode="staging") as staging:
        dst = {}
        for name, dt, shape in dr.SPECS:
            if name.endswith(".2d"):
                dst[name] = torch.empty(shape[::-1], dtype=dt, device=dev).t()
            elif name == "u8.vec":
                dst[name] = torch.empty(shape, dtype=dt)  # a CPU destination in a CUDA receive
            else:
                dst[name] = torch.empty(shape, dtype=dt, device=dev)
        kinds = []
        for named in dr.versions(23, 8):
            prod.send([(n, t.to(src)) for n, t in named])
            kinds.append(prod.last_sync["kind"])
            assert into.receive_into(dst, timeout=10) == prod.last_version
            got_copy = copy.receive(timeout=10)
            got_staging = staging.receive(timeout=10)
            torch.cuda.synchronize()
            assert dr.compare([(n, dst[n].cpu()) for n, _ in named], named) == []
            assert dr.compare([(n, t.cpu()) for n, t in got_copy], named) == []
            assert dr.compare([(n, t.cpu()) for n, t in got_staging], named) == []
            assert all(t.device == torch.device(dev) for _n, t in got_copy + got_staging)
            for c in (into, copy, staging):
                assert c.last_sync == prod.last_sync
            del got_copy, got_staging
    assert kinds == ["full"] + ["delta"] * 7


@pytest.mark.cuda
def test_buckets_are_deltas_on_cuda(region):
    """test_buckets_are_deltas with CUDA tensors on both sides: the producer
    parks each bucket's base on the GPU and takes it back; receive_into
    CUDA destinations (transposed ones through kept device temporaries),
    receive() 'copy' and 'staging' keep a device copy per bucket."""
    dev = "cuda:0"
    groups = [[["bf16.big"], ["bf16.2d", "fp32.2d"], ["fp16.vec", "u8.vec"]]] * 4 + \
             [[["bf16.big", "bf16.2d"], ["fp32.2d", "fp16.vec", "u8.vec"]]] * 3
    with shmcast.Producer(region, slot_bytes=roles.SLOT, slots=8, max_consumers=4, delta=True,
                          delta_max_ratio=0.6) as prod, \
            shmcast.Consumer(region, device=dev) as into, \
            shmcast.Consumer(region, device=dev, mode="copy") as copy, \
            shmcast.Consumer(region, device=dev, mode="staging") as staging:
        dst = {}
        for name, dt, shape in dr.SPECS:
            dst[name] = (torch.empty(shape[::-1], dtype=dt, device=dev).t() if name.endswith(".2d")
                         else torch.empty(shape, dtype=dt, device=dev))
        kinds = []
        for named, buckets in zip(dr.versions(43, len(groups)), groups):
            by_name = dict(named)
            for names in buckets:
                bucket = [(n, by_name[n]) for n in names]
                v = prod.send([(n, t.to(dev)) for n, t in bucket])
                kinds.append(prod.last_sync["kind"])
                assert into.receive_into({n: dst[n] for n in names}, timeout=10) == v
                got_copy = copy.receive(timeout=10)
                got_staging = staging.receive(timeout=10)
                torch.cuda.synchronize()
                assert dr.compare([(n, dst[n].cpu()) for n in names], bucket) == [], v
                assert dr.compare([(n, t.cpu()) for n, t in got_copy], bucket) == [], v
                assert dr.compare([(n, t.cpu()) for n, t in got_staging], bucket) == [], v
                for c in (into, copy, staging):
                    assert c.last_sync == prod.last_sync
                del got_copy, got_staging
        assert prod.delta_base_bytes == dr.logical_bytes()
    assert kinds == ["full"] * 3 + ["delta"] * 9 + ["full"] * 2 + ["delta"] * 4, kinds


def test_request_full_sync(region):
    with shmcast.Producer(region, slot_bytes=roles.SLOT, slots=8, delta=True) as prod, \
            shmcast.Consumer(region) as cons:
        assert cons.delta
        vs = dr.versions(17, 4)
        dst = dr.destinations()
        assert _send_and_receive_into(prod, cons, next(vs), dst) == "full"
        assert _send_and_receive_into(prod, cons, next(vs), dst) == "delta"
        cons.request_full_sync()  # say the weights were reloaded
        assert _send_and_receive_into(prod, cons, next(vs), dst) == "full"
        assert _send_and_receive_into(prod, cons, next(vs), dst) == "delta"


@pytest.mark.cuda
@pytest.mark.parametrize("budget", [0, 256 << 20])
def test_delta_staged_cuda_copies_freed_before_end_sync(region, budget):
    """Red team: CUDA tensors that go through the producer's staging copies
    (transposed views: not row-pitched) with a staging budget they exceed.
    _send_slow frees each staging copy after torch.cuda.synchronize(), before
    end_sync(); a delta producer whose base is on the GPU encodes such a
    tensor from its source at end_sync() (Pending), so it reads memory the
    caching allocator has handed to the next staging copy. Every delta
    version must still arrive bit-exact (budget 256 MiB: the copies are held
    to end_sync, the control)."""
    dev = "cuda:0"
    g = torch.Generator().manual_seed(77)
    shape = (256, 384)  # every tensor the same size: the allocator reuses the freed block
    n = 6
    model = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(n)]
    with shmcast.Producer(region, slot_bytes=roles.SLOT, slots=16, delta=True, staging_budget=budget) as prod, \
            shmcast.Consumer(region) as cons:
        dst = {f"w{i}": torch.empty(shape[::-1], dtype=torch.bfloat16) for i in range(n)}
        kinds, bad = [], []
        for v in range(4):
            if v > 0:
                for i, t in enumerate(model):  # ~2 % of the elements change
                    w = t.view(torch.int16).reshape(-1)
                    pos = torch.randperm(w.numel(), generator=g)[: w.numel() // 50]
                    w[pos] ^= 0x0101
            src = [(f"w{i}", t.to(dev).t()) for i, t in enumerate(model)]  # transposed CUDA views
            prod.send(src)
            kinds.append(prod.last_sync["kind"])
            assert cons.receive_into(dst, timeout=10) == prod.last_version
            for i, t in enumerate(model):
                if not torch.equal(dst[f"w{i}"].view(torch.int16), t.t().view(torch.int16)):
                    bad.append((v, prod.last_sync["kind"], f"w{i}"))
            del src
    assert (bad, kinds) == ([], ["full", "delta", "delta", "delta"])


def test_buckets_are_deltas(region):
    # An update sent as buckets (one sync each, as bucket_bytes > 0 and
    # verl's checkpoint engine do): each bucket's sync is a delta against
    # that bucket's last one, applied by receive_into (transposed
    # destinations: kept temporaries), receive() 'copy' and 'staging' (a
    # kept copy per bucket). Regrouped tensors go full once, then as deltas.
    groups = [[["bf16.big"], ["bf16.2d", "fp32.2d"], ["fp16.vec", "u8.vec"]]] * 4 + \
             [[["bf16.big", "bf16.2d"], ["fp32.2d", "fp16.vec", "u8.vec"]]] * 3
    with shmcast.Producer(region, slot_bytes=roles.SLOT, slots=8, max_consumers=4, delta=True,
                          delta_max_ratio=0.6) as prod, \
            shmcast.Consumer(region) as into, shmcast.Consumer(region) as copy, \
            shmcast.Consumer(region) as staging:
        dst = dr.destinations()
        kinds = []
        for named, buckets in zip(dr.versions(41, len(groups)), groups):
            by_name = dict(named)
            for names in buckets:
                bucket = [(n, by_name[n]) for n in names]
                v = prod.send(bucket)
                kinds.append(prod.last_sync["kind"])
                assert into.receive_into({n: dst[n] for n in names}, timeout=10) == v
                assert dr.compare([(n, dst[n]) for n in names], bucket) == [], v
                assert into.last_sync == prod.last_sync
                got = copy.receive(timeout=10)
                assert dr.compare(got, bucket) == [] and copy.last_sync == prod.last_sync, v
                got = staging.receive(timeout=10, mode="staging")
                assert dr.compare(got, bucket) == [] and staging.last_sync == prod.last_sync, v
        # One base: a copy of the tensors, whatever the grouping.
        assert prod.delta_base_bytes == dr.logical_bytes()
    assert kinds == ["full"] * 3 + ["delta"] * 9 + ["full"] * 2 + ["delta"] * 4, kinds


def test_receive_into_failure_forgets_dropped_temporaries(region, monkeypatch):
    # An error inside receive_into()'s loop (a temporary that cannot be
    # allocated: OOM) must not drop the temporaries of the other buckets
    # without forget_destinations() (it did: the dict was emptied before
    # the loop and set back after it). The library still holds a
    # record for each (its version, these pointers); when the allocator
    # hands the same memory back for the next temporary (the CUDA caching
    # allocator does, for the same size), the next delta of that bucket is
    # applied to memory that does not hold its base. With a TP-style slice
    # (part of a piece) no blob checksum can catch it: wrong weights,
    # reported as a good delta. (With checks on such a delta is refused
    # anyway: this consumer takes them unchecked, verify_checksums=False.)
    # The reuse is simulated here by handing back the dropped temporary
    # itself, filled with other bytes.
    from shmcast import _consumer as consumer_mod
    torch.manual_seed(7)
    a1 = torch.randn(64, 64)
    a2 = a1.clone()
    a2[3, 5] += 1.0  # a small change: a delta
    b = torch.randn(32, 32)
    sl = {"a": (1, 0, 32)}  # a column slice, as a TP rank reads
    with shmcast.Producer(region, slot_bytes=roles.SLOT, slots=8, max_consumers=4, delta=True) as prod, \
            shmcast.Consumer(region, verify_checksums=False) as cons:
        dst_a = torch.zeros(32, 64).t()  # (64, 32), non-contiguous: a kept temporary
        dst_b = torch.zeros(32, 32).t()
        assert prod.send([("a", a1)]) == 1
        assert cons.receive_into({"a": dst_a}, timeout=10, slices=sl) == 1
        assert torch.equal(dst_a, a1[:, :32])
        tmp_a = cons._tmps["a"]
        real_alloc = consumer_mod._alloc

        def oom(*args, **kw):
            raise MemoryError("simulated out of memory for b's temporary")

        monkeypatch.setattr(consumer_mod, "_alloc", oom)
        assert prod.send([("b", b)]) == 2
        with pytest.raises(MemoryError):
            cons.receive_into({"b": dst_b}, timeout=10)
        dropped = "a" not in cons._tmps  # a's temporary was let go ...

        def reuse(shape, dtype, dev, what):  # ... and its memory comes back for the next one
            if tuple(shape) == tuple(tmp_a.shape) and dtype == tmp_a.dtype:
                tmp_a.fill_(0.0)
                return tmp_a
            return real_alloc(shape, dtype, dev, what)

        monkeypatch.setattr(consumer_mod, "_alloc", reuse)
        assert prod.send([("a", a2)]) == 3
        assert prod.last_sync["kind"] == "delta"
        try:
            v = cons.receive_into({"a": dst_a}, timeout=10, slices=sl)
        except shmcast.NeedsFullSync:
            v = None  # the right outcome: that memory no longer holds version 1
        wrong = v == 3 and not torch.equal(dst_a, a2[:, :32])
        assert not wrong, f"a delta was applied to memory that does not hold its base (dropped: {dropped})"


def test_a_tp_slice_refuses_an_unverifiable_delta_and_reads_the_full_sync(region):
    """A TP-style slice of a tensor the producer sends whole holds part of
    its piece, and the blob's checksum covers the whole piece: with checks on
    (the default) the delta is refused (NeedsFullSync naming the tensor and
    verify_checksums) before anything of the sync is written (it was applied
    unchecked), and the full sync the refusal asked for comes next,
    bit-exact. verify_checksums=False applies it unchecked, bit-exact here."""
    torch.manual_seed(11)
    a1, b1 = torch.randn(64, 64), torch.randn(16)
    a2, b2 = a1.clone(), b1.clone()
    a2[3, 5] += 1.0
    b2[0] += 1.0  # read whole: its piece is held, and written first if anything were
    sl = {"a": (1, 0, 32)}
    with shmcast.Producer(region, slot_bytes=roles.SLOT, slots=8, max_consumers=4, delta=True) as prod, \
            shmcast.Consumer(region) as cons, shmcast.Consumer(region, verify_checksums=False) as loose:
        dst = {"b": torch.zeros(16), "a": torch.zeros(64, 32)}
        ldst = {"b": torch.zeros(16), "a": torch.zeros(64, 32)}
        assert prod.send([("b", b1), ("a", a1)]) == 1
        assert cons.receive_into(dst, timeout=10, slices=sl) == 1
        assert loose.receive_into(ldst, timeout=10, slices=sl) == 1
        assert prod.send([("b", b2), ("a", a2)]) == 2
        assert prod.last_sync["kind"] == "delta"
        with pytest.raises(shmcast.NeedsFullSync, match=r"'a'.*holds only part.*verify_checksums"):
            cons.receive_into(dst, timeout=10, slices=sl)
        assert torch.equal(dst["a"], a1[:, :32]) and torch.equal(dst["b"], b1), "the refused delta wrote"
        assert loose.receive_into(ldst, timeout=10, slices=sl) == 2 and loose.last_sync["kind"] == "delta"
        assert torch.equal(ldst["a"], a2[:, :32]) and torch.equal(ldst["b"], b2)
        a3 = a2.clone()
        a3[7, 40] -= 1.0
        assert prod.send([("b", b2), ("a", a3)]) == 3
        assert prod.last_sync["kind"] == "full"  # the refusal asked for it
        assert cons.receive_into(dst, timeout=10, slices=sl) == 3 and cons.last_sync["kind"] == "full"
        assert torch.equal(dst["a"], a3[:, :32]) and torch.equal(dst["b"], b2)
        assert loose.receive_into(ldst, timeout=10, slices=sl) == 3
        assert torch.equal(ldst["a"], a3[:, :32]) and torch.equal(ldst["b"], b2)
