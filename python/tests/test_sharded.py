"""Sharded syncs from Python: R producer ranks (separate processes) send
shmcast.Shard pieces and whole tensors; consumers receive whole tensors,
TP slices (receive and receive_into) or a subset of names, bit-exact."""
import pytest
import torch

import shmcast


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ranks_send_one_sync_consumers_read_whole_sliced_and_named(region, procs, world):
    seed = 100 + world
    kinds = [("full", 0), ("slice", 0), ("into", 1), ("names", 0)]
    ranks = [procs.start("sharded_rank", region=region, rank=r, world=world, seed=seed, consumers=len(kinds))
             for r in range(world)]
    procs.ready(ranks[0])
    cons = [procs.start("sharded_consumer", region=region, seed=seed, kind=k, part=p) for k, p in kinds]
    for c in cons:
        procs.ready(c)
    for r in ranks[1:]:
        procs.ready(r)
    versions = [procs.get(r)["versions"] for r in ranks]
    assert versions == [[1, 2]] * world, versions
    for c, (kind, _) in zip(cons, kinds):
        assert procs.get(c)["problems"] == [], kind


def test_rank_that_never_sends_is_a_timeout_naming_it(region, procs):
    done = procs.queue()  # rank 1 stays attached, sending nothing, until rank 0 has failed
    late = procs.start("sharded_rank", inbox=done, region=region, rank=1, world=2, seed=0, skip_send=True,
                       timeout=60.0)
    try:
        with shmcast.Producer(region, rank=0, world_size=2, slot_bytes=2 << 20, slots=4, pin=False,
                              rank_timeout=1.0) as p:
            procs.ready(late)
            with pytest.raises(shmcast.Timeout, match="rank 1 is attached but did not begin"):
                p.send([("w", torch.zeros(4))])
    finally:
        done.put("done")
    assert procs.get(late)["versions"] == []


def test_shard_is_checked_and_needs_a_sharded_producer(region):
    with pytest.raises(ValueError, match="lie outside"):
        shmcast.Shard(torch.zeros(3, 4), (4, 4), 0, 2)
    with pytest.raises(ValueError, match="with dim 0 cut"):
        shmcast.Shard(torch.zeros(3, 5), (4, 4), 0, 0)
    with shmcast.Producer(region, slot_bytes=2 << 20, pin=False) as p:
        with pytest.raises(ValueError, match="one rank"):
            p.send([("w", shmcast.Shard(torch.zeros(2, 4), (4, 4), 0, 0))])


def test_bad_slices_are_a_mismatch_before_any_byte(region, procs):
    prod = procs.start("producer", region=region, seed=1, sets=("shapes",))
    procs.ready(prod)
    with shmcast.Consumer(region) as c:
        c.wait_sync(30.0)
        with pytest.raises(shmcast.Mismatch, match="do not fit"):
            c.read(slices={"shape.3d": (0, 3, 5)})
    procs.get(prod)


def _steps_with_a_failing_rank(region, procs, fault, named, scale=1):
    seed = 300
    # One consumer (every process costs a torch import): it checks every
    # version it gets against that version's step, every byte.
    ranks = [procs.start("sharded_steps", region=region, rank=r, world=2, seed=seed, fault=fault, named=named,
                         consumers=1) for r in range(2)]
    procs.ready(ranks[0])
    cons = [procs.start("sharded_checker", region=region, seed=seed, until=7 * scale, scale=scale)]
    for c in cons:
        procs.ready(c)
    procs.ready(ranks[1])
    results = [procs.get(r)["results"] for r in ranks]
    for c in cons:
        got = procs.get(c)
        assert got["problems"] == [], got["problems"]
        assert 2 * scale not in got["versions"], got["versions"]
        assert {scale * s for s in range(3, 8)} <= set(got["versions"]), got["versions"]  # the next five, every byte
    for r in range(2):
        for step in (1, 3, 4, 5, 6, 7):
            assert results[r][step] == ["ok", scale * step], (r, step, results[r][step])
    return results


def test_a_send_that_raises_before_shmcast_keeps_the_ranks_in_step(region, procs):
    """Rank 1's batch at step 2 holds a sparse tensor: its send() raises
    TypeError before shmcast begins the sync, and still takes (and fails) its
    round, so rank 0's sync 2 fails with rank 1's reason and no later version
    mixes two steps (rounds numbered, no version given)."""
    results = _steps_with_a_failing_rank(region, procs, "sparse", named=False)
    assert results[1][2][0] == "TypeError", results[1][2]
    assert results[0][2][0] == "Aborted", results[0][2]
    assert "rank 1 raised TypeError" in results[0][2][1], results[0][2]


def test_a_step_skipped_in_user_code_is_harmless_with_named_versions(region, procs):
    """Rank 1's own code raises (a bad shmcast.Shard(...)) at step 2, so it
    never calls send() for that step. With the step as each sync's version
    on every rank, rank 0's sync 2 is refused at once (InvalidArgument naming
    rank 1) and every later version is one step's, bit-exact."""
    results = _steps_with_a_failing_rank(region, procs, "shard", named=True)
    assert results[1][2][0] == "ValueError", results[1][2]
    assert results[0][2][0] == "InvalidArgument", results[0][2]
    assert "producer rank 1 is at sync round 3" in results[0][2][1], results[0][2]


def test_a_send_that_raises_keeps_its_named_round_when_the_version_is_a_numpy_int(region, procs):
    """Versions named with numpy integers, 10 apart: rank 1's send() at step
    2 raises TypeError (a sparse tensor) before shmcast begins the sync. It
    must take round 20, the version it was given (any __index__ integer),
    not the next number after its last round (11): rank 0's sync 20 then
    fails at once with rank 1's reason instead of waiting out rank_timeout
    and blaming rank 1 for not beginning it."""
    results = _steps_with_a_failing_rank(region, procs, "sparse", named="numpy_gaps", scale=10)
    assert results[1][2][0] == "TypeError", results[1][2]
    assert results[0][2][0] == "Aborted", results[0][2]
    assert "rank 1 raised TypeError" in results[0][2][1], results[0][2]
