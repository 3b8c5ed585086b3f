"""A plain os.fork() child and the parent's Producer / Consumer objects.

The child inherits them (mapping, descriptors, seat), but they are the
parent's: whatever the child does with them, and however it exits, the
parent's region keeps its name, its consumer keeps its seat and the next
sync arrives bit-exact. Using them in the child raises InvalidArgument.
"""
import gc
import os
import subprocess
import sys
import textwrap
import traceback

import pytest
import torch

import roles
import shmcast


def _fork(child) -> int:
    """Runs child() in a forked child that leaves with os._exit (0: child()
    returned, 1: it raised; the traceback goes to stderr). Returns the exit
    code."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            child()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _parent_still_works(prod, cons):
    assert os.path.exists(prod.path), "the child removed the parent's region"
    assert prod.consumers == 1, "the child freed the parent's consumer seat"
    data = roles.build(4, ("shapes",))
    v = prod.send(data)
    assert roles.compare(cons.receive(timeout=10), data) == []
    assert cons.last_version == v


def _drop(objs):
    objs.clear()  # the last references: __del__, then the binding's destructor
    gc.collect()


def _close(objs):
    for o in objs:
        o.close()
    with objs[0], objs[1]:  # __exit__ closes again
        pass


@pytest.mark.parametrize("how", [_drop, _close], ids=["del+gc", "close"])
def test_child_dropping_or_closing_inherited_objects_leaves_parent_alone(region, how):
    objs = [shmcast.Producer(region, slot_bytes=roles.SLOT, slots=16), None]
    objs[1] = shmcast.Consumer(region)
    assert _fork(lambda: how(objs)) == 0
    prod, cons = objs
    try:
        _parent_still_works(prod, cons)
    finally:
        cons.close()
        prod.close()


def test_child_exiting_normally_leaves_parent_alone(region):
    """The child returns from the script: the interpreter's own shutdown
    finalizes the inherited objects (module globals)."""
    script = textwrap.dedent(f"""
        import os, sys, torch, shmcast
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import roles
        prod = shmcast.Producer({region!r}, slot_bytes=roles.SLOT, slots=16)
        cons = shmcast.Consumer({region!r})
        pid = os.fork()
        if pid:
            os.waitpid(pid, 0)
            assert os.path.exists(prod.path), "the child removed the parent's region"
            assert prod.consumers == 1, "the child freed the parent's consumer seat"
            data = roles.build(4, ("shapes",))
            prod.send(data)
            assert roles.compare(cons.receive(timeout=10), data) == []
            print("parent ok")
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "parent ok" in r.stdout, r.stdout + r.stderr


def test_child_cannot_use_inherited_objects(region):
    prod = shmcast.Producer(region, slot_bytes=roles.SLOT, slots=16)
    cons = shmcast.Consumer(region)

    def child():
        calls = [
            lambda: prod.send([("x", torch.zeros(1))]),
            lambda: prod.wait_for_consumers(1, 0),
            lambda: prod.consumers,
            lambda: prod.raw.end_sync(),
            lambda: cons.receive(timeout=0),
            lambda: cons.skip(),
            lambda: cons.raw.wait_sync(0),
        ]
        for k, call in enumerate(calls):
            try:
                call()
            except shmcast.InvalidArgument as e:
                assert "forked child" in str(e), (k, str(e))
            else:
                raise AssertionError(f"call {k} worked in a forked child")

    try:
        assert _fork(child) == 0
        _parent_still_works(prod, cons)
    finally:
        cons.close()
        prod.close()
