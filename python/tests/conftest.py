import itertools
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # roles, fake_vllm: importable here and in spawned children
# The framework stand-ins (vllm, verl, sglang, roll; standins/README.md) shadow
# any installed package of the same name, here and in spawned children (spawn
# passes sys.path on). SHMCAST_REAL_FRAMEWORKS=1 puts them last instead: an
# installed framework is used, the stand-ins only fill in for the absent ones
# (the GPU script sets it where a framework is installed).
STANDINS = os.path.join(os.path.dirname(__file__), "standins")
REAL_FRAMEWORKS = os.environ.get("SHMCAST_REAL_FRAMEWORKS", "") not in ("", "0")
if REAL_FRAMEWORKS:
    sys.path.append(STANDINS)
else:
    sys.path.insert(0, STANDINS)

import shmcast  # noqa: E402

_counter = itertools.count()


def framework_origin(name: str) -> str:
    """'stand-in', 'real' or 'absent': where `import name` comes from."""
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None:
        return "absent"
    where = spec.origin or (list(spec.submodule_search_locations or [""])[0])
    return "stand-in" if os.path.abspath(where).startswith(os.path.abspath(STANDINS) + os.sep) else "real"


def pytest_report_header(config):
    return "frameworks: " + ", ".join(f"{n}={framework_origin(n)}" for n in ("vllm", "verl", "sglang", "roll"))


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a GPU and a shmcast built with CUDA")
    config.addinivalue_line("markers", "deadline(seconds): the deadline fixture's limit for this test")


def cuda_ready() -> bool:
    try:
        import torch

        return torch.cuda.is_available() and shmcast.cuda_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if cuda_ready():
        return
    why = "no GPU" if not _torch_cuda() else "shmcast was built without CUDA: " + shmcast.cuda_unavailable_reason()
    skip = pytest.mark.skip(reason=why)
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def _torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_sessionfinish(session, exitstatus):
    # Under ctest, a run whose every test was skipped (the CUDA tier on a
    # machine without a GPU) exits 77 so ctest reports it as skipped.
    if os.environ.get("SHMCAST_PYTEST_SKIP_CODE") and exitstatus == 0:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            stats = reporter.stats
            ran = len(stats.get("passed", [])) + len(stats.get("failed", [])) + len(stats.get("error", []))
            if ran == 0 and stats.get("skipped"):
                session.exitstatus = int(os.environ["SHMCAST_PYTEST_SKIP_CODE"])


@pytest.fixture
def region():
    """A fresh region name; whatever is left of it is removed afterwards."""
    name = f"pytest-{os.getpid()}-{next(_counter)}"
    yield name
    try:
        shmcast.unlink_region(name)
    except shmcast.Error:
        pass


def mp_context(method=None):
    """The start method of the test processes: forkserver, whose server
    imports torch, shmcast and roles once, so that each process is a fork of
    it (a spawned process imports torch anew: about 1.5 s of CPU each, most of
    the python tier's time). A child holds the server's imported modules and
    nothing of the pytest process, and never a CUDA context (the server
    touches no GPU).
    SHMCAST_TEST_MP_START=spawn restores spawn."""
    method = method or os.environ.get("SHMCAST_TEST_MP_START", "forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["torch", "shmcast", "roles"])
    return ctx


class Procs:
    """Test processes (roles.run) and their result queues."""

    def __init__(self, method=None):
        self.ctx = mp_context(method)
        self.procs = []

    def start(self, role, inbox=None, **kwargs):
        import roles

        q = self.ctx.Queue()
        if inbox is None:
            p = self.ctx.Process(target=roles.run, args=(role, kwargs, q), daemon=True)
        else:
            p = self.ctx.Process(target=roles.run_with_inbox, args=(role, kwargs, q, inbox), daemon=True)
        p.start()
        self.procs.append(p)
        p.q = q
        return p

    def queue(self):
        return self.ctx.Queue()

    @staticmethod
    def get(p, timeout=120.0):
        try:
            msg = p.q.get(timeout=timeout)
        except queue_mod.Empty:
            raise AssertionError(f"no message from {p.name} within {timeout} s (exit code {p.exitcode})")
        if not msg.get("ok", True):
            raise AssertionError(f"{p.name} failed: {msg['error']}: {msg['message']}\n{msg['trace']}")
        return msg

    def ready(self, p, timeout=120.0):
        msg = self.get(p, timeout)
        assert msg.get("ready"), msg
        return msg

    def kill(self, p):
        """SIGKILL (a crash: no cleanup in the process) and reap."""
        p.kill()
        p.join(30)

    def cleanup(self):
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()


@pytest.fixture
def deadline(request):
    """Fails the test (TimeoutError in the test's own thread) after
    `@pytest.mark.deadline(seconds)` (default 240 s), so that a contract test
    that hangs does not hold the whole tier until ctest's timeout."""
    m = request.node.get_closest_marker("deadline")
    seconds = int(m.args[0]) if m else 240

    def expired(*_):
        raise TimeoutError(f"{request.node.name} ran past its {seconds} s deadline")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture
def procs(request):
    # CUDA tests keep spawn, the start method their GPU runs were checked
    # with: a fork of the server is fine for CUDA while the server never
    # initialised it, but that was not run on a GPU when forkserver came in.
    pr = Procs("spawn" if request.node.get_closest_marker("cuda") else None)
    yield pr
    pr.cleanup()
