"""Syncs of many tensors (mixture-of-experts checkpoints) with the default
manifest_bytes (issue 43): 20,000 and 100,000 tensors between two processes,
receive_into() and receive(), every byte checked. The tensors are tiny and
the slots small: the count is what is tested."""
import pytest

import roles
import shmcast


@pytest.mark.parametrize("count", [20000, 100000])
def test_many_tensors_with_default_manifest_bytes(region, procs, count):
    cons = procs.start("many_consumer", region=region, count=count)
    with shmcast.Producer(region, slot_bytes=4 << 20, pin=False, engine="host") as prod:
        procs.ready(cons)
        prod.wait_for_consumers(1, 60)
        assert prod.send(roles.many_tensors(count, 1)) == 1
        assert prod.send(roles.many_tensors(count, 2)) == 2
        res = procs.get(cons, timeout=300)
    assert res["problems"] == []


def test_default_manifest_bytes_is_the_library_default(region):
    # None (the default) takes the C++ default: room for the largest manifest.
    with shmcast.Producer(region, slot_bytes=2 << 20, pin=False, engine="host") as prod:
        assert prod.send({"x": roles.many_tensors(1, 1)["model.layers.0.mlp.experts.0.w0.weight"]}) == 1
    with pytest.raises(shmcast.InvalidArgument, match="room for"):
        with shmcast.Producer(region, slot_bytes=2 << 20, pin=False, engine="host", manifest_bytes=1 << 20) as prod:
            prod.send(roles.many_tensors(20000, 1))
