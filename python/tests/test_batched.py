"""The batched paths of send() and receive_into(), and SyncInfo as the
binding makes it for every sync (issue 43 item 2). Batched paths: a
sync whose tensors are all plain contiguous CPU tensors is checked and
moved with a few passes over the whole list (shmcast._batch). Each test
checks that the batched path was taken where it should be (a spy on
_send_batched / _read_into_batched), that the bytes arrive bit-exact,
and that any tensor the batched path must not take (wrong dtype or shape, non-contiguous, conj/neg
bits, other devices, names that do not match) sends it to the per-tensor
path, which gives the same answer as before: the bytes, or Mismatch with
nothing written."""
import pytest
import torch

import shmcast
from shmcast import _consumer, _producer

SLOT = 1 << 20


def _spy(monkeypatch, cls, method):
    """Records whether cls.method (the batched path) took each sync: True,
    or False when it handed the sync to the per-tensor path."""
    seen = []
    real = getattr(cls, method)

    def spy(*args):
        r = real(*args)
        seen.append(r is not None)
        return r

    monkeypatch.setattr(cls, method, spy)
    return seen


PRODUCER = (_producer.Producer, "_send_batched")
CONSUMER = (_consumer.Consumer, "_read_into_batched")


def _tensors(seed, n=300):
    """n plain tensors of several dtypes and shapes (an empty one, a
    Parameter), with bytes that differ from tensor to tensor."""
    g = torch.Generator().manual_seed(seed)
    dts = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.float16, torch.bool, torch.complex64]
    out = {}
    for i in range(n):
        dt = dts[i % len(dts)]
        shape = [(3,), (2, 5), (4, 1, 3), (0, 7), ()][i % 5]
        raw = torch.randint(0, 256, (int(torch.Size(shape).numel()) * torch.empty((), dtype=dt).element_size(),),
                            dtype=torch.uint8, generator=g)
        t = raw.view(dt).reshape(shape) if raw.numel() else torch.empty(shape, dtype=dt)
        out[f"layer.{i}.w"] = torch.nn.Parameter(t, requires_grad=False) if i == 7 else t
    return out


def _bits(t):
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)


def _same(a, b):
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(_bits(a), _bits(b))


def _zeros_like(src):
    return {k: torch.zeros_like(v.detach()) for k, v in src.items()}


def test_batched_send_and_receive_into_are_bit_exact(region, monkeypatch):
    sent, got = _spy(monkeypatch, *PRODUCER), _spy(monkeypatch, *CONSUMER)
    with shmcast.Producer(region, slot_bytes=SLOT, slots=4) as prod, shmcast.Consumer(region) as cons:
        for seed, as_list in ((1, False), (2, True)):
            src = _tensors(seed)
            v = prod.send(list(src.items()) if as_list else src)
            dst = _zeros_like(src)
            assert cons.receive_into(dst, timeout=5) == v
            bad = [k for k in src if not _same(src[k], dst[k])]
            assert bad == []
            # receive() after the batched send: the same bytes again
            prod.send(src)
            assert all(_same(src[k], t) for k, t in cons.receive(timeout=5))
    assert sent == [True] * 4 and got == [True, True]


def test_batched_receive_into_strict_false_takes_a_superset(region, monkeypatch):
    got = _spy(monkeypatch, *CONSUMER)
    with shmcast.Producer(region, slot_bytes=SLOT, slots=4) as prod, shmcast.Consumer(region) as cons:
        src = _tensors(3, 40)
        prod.send(src)
        dst = _zeros_like(src)
        dst["extra"] = torch.full((2,), 5.0)
        cons.receive_into(dst, timeout=5, strict=False)
        assert all(_same(src[k], dst[k]) for k in src) and dst["extra"].tolist() == [5.0, 5.0]
    assert got == [True]


class _Sub(torch.Tensor):
    pass


# What the C++ check (shmcast._batch.plain_sources, the binding's
# tensors.cpp) must refuse, each in a list of plain CPU tensors: the
# per-tensor path then takes the sync (and words any error).
NOT_PLAIN = {
    "subclass": lambda: torch.zeros(3).as_subclass(_Sub),
    "sparse": lambda: torch.zeros(2, 5).to_sparse(),
    "non-contiguous": lambda: torch.zeros(6)[::2],
    "transposed": lambda: torch.zeros(2, 3).t(),
    "conj bit": lambda: torch.zeros(2, dtype=torch.complex64).conj(),
    "neg bit": lambda: torch._neg_view(torch.zeros(3)),
    "meta": lambda: torch.zeros(3, device="meta"),
    "quantized dtype": lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8),
    "not a tensor": lambda: [1.0, 2.0],
}


@pytest.mark.parametrize("what", sorted(NOT_PLAIN))
def test_plain_sources_refuses_what_is_not_plain(what):
    from shmcast import _batch

    ts = [torch.arange(4.0), torch.ones(2, 3, dtype=torch.bfloat16), NOT_PLAIN[what](), torch.zeros(5)]
    names = [f"t{i}" for i in range(len(ts))]
    assert _batch.plain_sources(names, ts) is None
    del ts[2], names[2]
    plain = _batch.plain_sources(names, ts)
    assert plain is not None and plain.device == -1 and len(plain) == 3


def test_plain_sources_takes_plain_tensors_and_refuses_names_and_lists():
    from shmcast import _batch

    ts = [torch.zeros(3), torch.nn.Parameter(torch.ones(2, 2), requires_grad=True), torch.zeros(2).conj(),
          torch.zeros(0, 4, dtype=torch.int64), torch.tensor(True)]
    assert len(_batch.plain_sources([f"n{i}" for i in range(5)], ts)) == 5  # a real tensor's conj() has no bit
    assert _batch.plain_sources(["a", "b", 3, "d", "e"], ts) is None  # a name that is not a str
    assert _batch.plain_sources(["a", "b"], ts) is None  # lengths differ
    assert _batch.plain_sources([], []) is None


def test_batched_receive_into_takes_any_mapping(region, monkeypatch):
    import types

    got = _spy(monkeypatch, *CONSUMER)
    with shmcast.Producer(region, slot_bytes=SLOT, slots=4) as prod, shmcast.Consumer(region) as cons:
        src = _tensors(10, 30)
        prod.send(src)
        dst = _zeros_like(src)
        cons.receive_into(types.MappingProxyType(dst), timeout=5)
        assert all(_same(src[k], dst[k]) for k in src)
    assert got == [True]


def _swap(dst, name, new):
    dst = dict(dst)
    dst[name] = new
    return dst


# _tensors(): tensor i has dtype DTS[i % 7] and shape SHAPES[i % 5].
# Destinations the batched path must refuse (the per-tensor path then reads
# them, or raises Mismatch naming the problem): (change, expected words or
# None when the read succeeds).
REFUSED = [
    (lambda d: _swap(d, "layer.0.w", torch.zeros(3, dtype=torch.float64)), "dtype"),  # f32 (3,) there
    (lambda d: _swap(d, "layer.1.w", torch.zeros(5, 2, dtype=torch.bfloat16)), "shape"),  # (2, 5) there
    (lambda d: _swap(d, "layer.2.w", torch.zeros(4, 3, 1, dtype=torch.int64)), "shape"),  # same numel and ndim
    (lambda d: {k: v for k, v in d.items() if k != "layer.13.w"}, "no destination"),
    (lambda d: _swap(d, "zzz", torch.zeros(1)), "not in the sync"),
    (lambda d: _swap(d, "layer.3.w", torch.zeros(0, 7, dtype=torch.uint8, device="meta")), "CPU or CUDA"),
    (lambda d: _swap(d, "layer.5.w", torch.zeros(1, dtype=torch.bool).expand(3)), "share memory"),
    (lambda d: _swap(d, "layer.21.w", torch.zeros(2, 5).to_sparse()), "dense"),
    (lambda d: _swap(d, "layer.17.w", "not a tensor"), "expected a torch.Tensor"),
    # taken by the per-tensor path, read correctly:
    (lambda d: _swap(d, "layer.35.w", torch.zeros(6)[::2]), None),  # non-contiguous
    (lambda d: _swap(d, "layer.6.w", torch.zeros(2, 5, dtype=torch.complex64).conj()), None),  # conj bit, contiguous
    (lambda d: _swap(d, "layer.0.w", torch._neg_view(torch.zeros(3))), None),  # neg bit, contiguous
]


@pytest.mark.parametrize("case", range(len(REFUSED)))
def test_batched_receive_into_refuses_what_it_must_not_take(region, monkeypatch, case):
    change, words = REFUSED[case]
    got = _spy(monkeypatch, *CONSUMER)
    with shmcast.Producer(region, slot_bytes=SLOT, slots=4) as prod, shmcast.Consumer(region) as cons:
        src = _tensors(4, 40)
        # the names the cases change hold what the cases say
        for name, dt, shape in (("layer.0.w", torch.float32, (3,)), ("layer.1.w", torch.bfloat16, (2, 5)),
                                ("layer.2.w", torch.int64, (4, 1, 3)), ("layer.3.w", torch.uint8, (0, 7)),
                                ("layer.5.w", torch.bool, (3,)), ("layer.21.w", torch.float32, (2, 5)),
                                ("layer.35.w", torch.float32, (3,)), ("layer.6.w", torch.complex64, (2, 5))):
            assert src[name].dtype == dt and tuple(src[name].shape) == shape, name
        prod.send(src)
        dst = change(_zeros_like(src))
        before = {k: v.clone() for k, v in dst.items()
                  if isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.layout is torch.strided}
        if words is None:
            cons.receive_into(dst, timeout=5)
            bad = [k for k in src if not _same(src[k], dst[k])]
            assert bad == []
        else:
            with pytest.raises(shmcast.Mismatch, match=words):
                cons.receive_into(dst, timeout=5)
            for k, v in before.items():  # nothing written
                assert torch.equal(_bits(dst[k]), _bits(v)), k
        # the consumer goes on: the next sync takes the batched path again
        prod.send(src)
        dst = _zeros_like(src)
        cons.receive_into(dst, timeout=5)
        assert all(_same(src[k], dst[k]) for k in src)
    assert got == [False, True]


# Sources the batched send must refuse: the per-tensor path sends them (the
# bytes arrive as the tensor's values) or raises.
def _src_case(name):
    src = _tensors(5, 40)
    if name == "noncontig":
        src["layer.1.w"] = torch.arange(10, dtype=torch.bfloat16).reshape(5, 2).t()
    elif name == "conj":
        src["layer.6.w"] = torch.complex(torch.arange(10.0), torch.ones(10)).reshape(2, 5).conj()
    elif name == "neg":
        src["layer.0.w"] = torch._neg_view(torch.arange(3.0))
    elif name == "strided":  # a column slice: sent as rows with a pitch
        src["layer.21.w"] = torch.arange(16.0).reshape(2, 8)[:, 1:6]
    return src


@pytest.mark.parametrize("name", ["noncontig", "conj", "neg", "strided"])
def test_batched_send_refuses_what_it_must_not_take(region, monkeypatch, name):
    sent = _spy(monkeypatch, *PRODUCER)
    with shmcast.Producer(region, slot_bytes=SLOT, slots=4) as prod, shmcast.Consumer(region) as cons:
        src = _src_case(name)
        prod.send(src)
        got = dict(cons.receive(timeout=5))
        bad = [k for k in src if not _same(src[k], got[k])]
        assert bad == []
    assert sent == [False]


def test_batched_send_refuses_dtypes_and_devices(region):
    with shmcast.Producer(region, slot_bytes=SLOT, slots=4) as prod:
        src = _tensors(6, 20)
        src["q"] = torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8)
        with pytest.raises(TypeError, match="'q'"):
            prod.send(src)
        src = _tensors(6, 20)
        src["m"] = torch.zeros(2, device="meta")
        with pytest.raises(TypeError, match="'m'.*CPU or CUDA"):
            prod.send(src)


def test_sync_info_pieces_made_on_first_use(region):
    with shmcast.Producer(region, slot_bytes=SLOT, slots=4) as prod, shmcast.Consumer(region) as cons:
        src = _tensors(7, 30)
        prod.send(src)
        info = cons.wait_sync(5)
        assert [t[:4] for t in info.tensors] == [
            (n, shmcast.dtype_name(v.dtype), tuple(v.shape), v.numel() * v.element_size()) for n, v in src.items()]
        want = [[(0, -1, 0, 0, t[3])] for t in info.tensors]
        assert info.pieces == want
        assert info.pieces is info.pieces  # made once
        assert cons.sync_info.pieces == want  # a copy of the SyncInfo shares them
        cons.skip()


# Name bytes of 4 that a region may hold: SyncInfo takes exactly what
# Python's strict UTF-8 decoder takes (the binding checks them without
# making the strs), and calls the rest Corrupt.
NAME_BYTES = [b"\xc3\xa9ab", b"\xf0\x9f\x98\x80", b"\xed\x9f\xbfa", b"\xee\x80\x80a", b"\xf4\x8f\xbf\xbf",
              b"a\xffbc", b"\xed\xa0\x80a", b"\xc0\xafab", b"\xe0\x80\xafa", b"\xf4\x90\x80\x80",
              b"\xf5\x80\x80\x80", b"abc\xc3", b"ab\xe2\x82", b"\xc3abc", b"\x80abc", b"a\xe2\x28\xa1"]


@pytest.mark.parametrize("raw", NAME_BYTES, ids=lambda b: b.hex())
def test_sync_info_names_are_checked_as_python_decodes(region, raw):
    from regions import edit_sync

    try:
        want = raw.decode("utf-8")
    except UnicodeDecodeError:
        want = None
    with shmcast.Producer(region, slot_bytes=SLOT, slots=4) as prod, shmcast.Consumer(region) as cons:
        prod.send([("zero", torch.zeros(2)), ("abcd", torch.arange(3.0))])
        with edit_sync(prod.path) as m:
            m.set_name(1, raw)
        if want is None:
            with pytest.raises(shmcast.Corrupt, match="not valid UTF-8"):
                cons.wait_sync(5)
        else:
            info = cons.wait_sync(5)
            assert [t[0] for t in info.tensors] == ["zero", want]
            dst = {"zero": torch.ones(2), want: torch.zeros(3)}
            assert cons.read_into(dst) == info.version
            assert dst[want].tolist() == [0.0, 1.0, 2.0] and dst["zero"].tolist() == [0.0, 0.0]


def test_sync_info_tensors_made_on_first_use(region):
    """wait_sync() keeps a sync's tensors as C++ arrays: receive_into() of
    plain destinations reads them there, and SyncInfo.tensors makes its
    Python objects (five per tensor) only when asked, once."""
    import sys

    n = 20000
    with shmcast.Producer(region, slot_bytes=SLOT, slots=4) as prod, shmcast.Consumer(region) as cons:
        src = {f"w.{i}": torch.full((2,), float(i)) for i in range(n)}
        for _ in range(2):
            prod.send(src)
            before = sys.getallocatedblocks()
            info = cons.wait_sync(5)
            made = sys.getallocatedblocks() - before
            assert made < n // 10, made  # not one object per tensor
            dst = _zeros_like(src)
            assert cons.read_into(dst) == info.version
            assert all(torch.equal(src[k], dst[k]) for k in src)
        tensors = info.tensors
        assert len(tensors) == len(info) == n and tensors is info.tensors
        assert tensors[7] == ("w.7", "f32", (2,), 8, tensors[7][4])


def test_sync_info_tensors_cannot_be_reordered_or_shortened(region):
    """SyncInfo.tensors is one object shared by every copy of the SyncInfo,
    and the batched read looks the names up in it: it is a tuple, so no
    caller can reorder it (pairing destinations with other tensors' bytes)
    or shorten it (a read past its end). Then read_into() still pairs
    every destination with its own tensor's bytes."""
    with shmcast.Producer(region, slot_bytes=SLOT) as prod, shmcast.Consumer(region) as cons:
        src = {"a": torch.full((4,), 1.0), "b": torch.full((4,), 2.0)}
        prod.send(src)
        info = cons.wait_sync(5)
        assert isinstance(info.tensors, tuple)
        with pytest.raises(AttributeError):
            info.tensors.reverse()
        with pytest.raises(AttributeError):
            info.tensors.pop()
        dst = _zeros_like(src)
        assert cons.read_into(dst, strict=False) == info.version
        assert torch.equal(dst["a"], src["a"]) and torch.equal(dst["b"], src["b"])


@pytest.mark.cuda
@pytest.mark.parametrize("batch_cuda", [False, True])
def test_batched_paths_on_one_gpu(region, monkeypatch, batch_cuda):
    """CUDA tensors of one GPU take the per-tensor paths by default
    (shmcast._batch.BATCH_CUDA) and, with it on, the batched paths (send
    through the CUDA engine, receive_into through read_into_device), where
    one CPU destination among them sends the read to the per-tensor path (a
    temporary). Bit-exact both ways."""
    from shmcast import _batch

    monkeypatch.setattr(_batch, "BATCH_CUDA", batch_cuda)
    sent, got = _spy(monkeypatch, *PRODUCER), _spy(monkeypatch, *CONSUMER)
    with shmcast.Producer(region, slot_bytes=SLOT, slots=4, engine="cuda") as prod, \
            shmcast.Consumer(region, "cuda:0") as cons:
        src = {k: v.detach().to("cuda:0") for k, v in _tensors(8, 60).items()}
        for mixed in (False, True):
            prod.send(src)
            dst = _zeros_like(src)
            if mixed:
                dst["layer.0.w"] = dst["layer.0.w"].cpu()
            cons.receive_into(dst, timeout=10)
            torch.cuda.synchronize()
            bad = [k for k in src if not _same(src[k].cpu(), dst[k].cpu())]
            assert bad == []
    if batch_cuda:
        assert sent == [True, True] and got == [True, False]
    else:
        assert sent == [False, False] and got == [False, False]


def test_gc_is_paused_for_the_passes_and_left_as_it_was(region, monkeypatch):
    """The passes over a sync's tensors run with Python's cyclic GC paused
    (shmcast._batch.gc_paused); afterwards it is enabled or disabled as the
    caller had it, also after a refusal or an error."""
    import gc
    from shmcast import _batch

    during = []

    def spying(real):
        def spy(*args):
            during.append(gc.isenabled())
            return real(*args)
        return spy

    monkeypatch.setattr(_consumer, "plain_destinations", spying(_batch.plain_destinations))
    monkeypatch.setattr(_producer, "plain_sources", spying(_batch.plain_sources))
    was = gc.isenabled()
    try:
        with shmcast.Producer(region, slot_bytes=SLOT, slots=4) as prod, shmcast.Consumer(region) as cons:
            src = _tensors(9, 40)
            for enabled in (True, False):
                gc.enable() if enabled else gc.disable()
                prod.send(src)
                cons.receive_into(_zeros_like(src), timeout=5)
                assert gc.isenabled() == enabled
                prod.send(src)
                assert len(cons.receive(timeout=5)) == len(src)
                assert gc.isenabled() == enabled
                prod.send(src)
                with pytest.raises(shmcast.Mismatch):
                    cons.receive_into(_swap(_zeros_like(src), "layer.0.w", torch.zeros(4)), timeout=5)
                assert gc.isenabled() == enabled
                with _batch.gc_paused():  # nested in a caller's pause
                    prod.send(src)
                    cons.receive_into(_zeros_like(src), timeout=5)
                    assert not gc.isenabled()
                assert gc.isenabled() == enabled
    finally:
        gc.enable() if was else gc.disable()
    assert during and not any(during)


_OVERRIDDEN = r'''
import sys, torch
calls = []
base = torch.Tensor.is_contiguous
def is_contiguous(self, *a, **k):
    calls.append(1)
    return base(self, *a, **k)
torch.Tensor.is_contiguous = is_contiguous  # as a torch that defines it in Python would
if sys.argv[1] == "property":
    torch.Tensor.dtype = property(lambda self: 5)  # read as t.dtype reads it: not a dtype shmcast carries
elif sys.argv[1] == "value":
    torch.Tensor.dtype = 5  # not a descriptor: the binding cannot read it, no batched paths
import shmcast
from shmcast import _batch
ts = [torch.arange(3.0), torch.ones(2, 2)]
plain = _batch.plain_sources(["a", "b"], ts)
print(_batch._BATCHED, plain is not None and len(plain), len(calls))
'''


@pytest.mark.parametrize("how", ["function", "property", "value"])
def test_batched_checks_read_attributes_as_python_finds_them(how):
    """The binding calls torch.Tensor's attributes as `t.name` finds them (a
    Python override included); where one is not what it can call, the
    batched paths are off and every sync takes the per-tensor paths."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _OVERRIDDEN, how], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    want = {"function": ["True", "2", "2"], "property": ["True", "False", "1"], "value": ["False", "False", "0"]}
    assert out.stdout.split() == want[how]
