"""SyncInfo as the binding makes it for every sync (issue 43 item 2):
its tuples are built with the C API, its pieces on first use."""
import torch

import shmcast

SLOT = 1 << 20


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
