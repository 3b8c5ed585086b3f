"""Processes and plumbing for the framework contract tests
(test_vllm_transfer.py, test_verl.py, test_sglang.py).

* Routes / RouteClient: a control plane between real processes, shaped like
  vLLM's dev-mode HTTP routes (vllm/entrypoints/serve/dev/rlhf/api_router.py:
  POST /init_weight_transfer_engine {"init_info"}, /start_weight_update,
  /update_weights {"update_info"}, /finish_weight_update), over a Unix
  socket (multiprocessing.connection) instead of HTTP. A restarted process
  listens on the same address.
* FanOutClient: vLLM's VLLMWeightSyncClient protocol over several workers,
  each call sent to all of them at once and waited for (as
  RayVLLMWeightSyncClient does with ray.get over its handles): a worker's
  update_weights waits for a sync that every worker must read, so the calls
  must run concurrently.
* plugin_dir(): a directory holding a distribution whose only content is the
  `vllm.general_plugins` entry point of pyproject.toml, so that a worker
  process finds shmcast's plugin the way vLLM does (importlib.metadata).

Roles run in spawned processes through roles.run (roles.py).
"""
from __future__ import annotations

import os
import queue as queue_mod
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Client, Listener

AUTHKEY = b"shmcast-tests"


def plugin_dir(root) -> str:
    """A sys.path entry with the entry point shmcast declares for vLLM."""
    d = os.path.join(str(root), "plugin")
    info = os.path.join(d, "shmcast_standin_plugin-0.0.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: shmcast-standin-plugin\nVersion: 0.0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[vllm.general_plugins]\nshmcast = shmcast.vllm_plugin:register\n")
    return d


class RouteError(RuntimeError):
    """An error raised by the remote side of a route (type and message kept)."""

    def __init__(self, kind, message, trace=""):
        super().__init__(f"{kind}: {message}")
        self.kind, self.message, self.trace = kind, message, trace


class RouteClient:
    def __init__(self, address: str, timeout: float = 120.0):
        self.address, self.timeout = address, timeout

    def call(self, route: str, body=None):
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                conn = Client(self.address, family="AF_UNIX", authkey=AUTHKEY)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nothing listens on {self.address}") from None
                time.sleep(0.05)
        with conn:
            conn.send((route, body or {}))
            if not conn.poll(self.timeout):
                raise TimeoutError(f"{route} on {self.address}: no answer within {self.timeout} s")
            status, *rest = conn.recv()
        if status == "ok":
            return rest[0]
        raise RouteError(*rest)


def serve(address: str, routes: dict) -> None:
    """Answers requests on `address` until a route returns the string 'stop'."""
    if os.path.exists(address):
        os.unlink(address)  # a restarted process takes over its predecessor's address
    with Listener(address, family="AF_UNIX", authkey=AUTHKEY) as lst:
        while True:
            with lst.accept() as conn:
                route, body = conn.recv()
                try:
                    out = routes[route](**body)
                    conn.send(("ok", out))
                except BaseException as e:  # the caller re-raises it
                    conn.send(("err", type(e).__name__, str(e), traceback.format_exc()))
                    continue
            if out == "stop":
                return


class FanOutClient:
    """VLLMWeightSyncClient over several worker addresses (dev-route bodies)."""

    def __init__(self, addresses, timeout: float = 120.0):
        self.clients = [RouteClient(a, timeout) for a in addresses]
        self.calls = []  # (method) in order: the contract test checks the sequence

    def _all(self, route, body=None):
        self.calls.append(route)
        with ThreadPoolExecutor(max_workers=len(self.clients)) as exe:
            futures = [exe.submit(c.call, route, body) for c in self.clients]
            return [f.result() for f in futures]

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._all("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._all("start_weight_update")

    def update_weights(self, update_info: dict) -> None:
        self._all("update_weights", {"update_info": update_info})

    def finish_weight_update(self) -> None:
        self._all("finish_weight_update")


def inbox_loop(q, inbox, handlers: dict, timeout: float = 120.0) -> None:
    """Runs commands (name, kwargs) from `inbox` until 'exit'; each result
    (or error) goes to q as a dict."""
    while True:
        try:
            name, kwargs = inbox.get(timeout=timeout)
        except queue_mod.Empty:
            raise TimeoutError(f"no command within {timeout} s") from None
        if name == "exit":
            return
        try:
            q.put({"ok": True, "cmd": name, **(handlers[name](**kwargs) or {})})
        except BaseException as e:
            q.put({"ok": False, "cmd": name, "error": type(e).__name__, "message": str(e),
                   "trace": traceback.format_exc()})


class Deployment:
    """A test's processes: servers on fixed addresses (self.servers) and one
    trainer process driven by commands (start_trainer, cmd)."""

    def __init__(self, procs, addresses):
        self.procs, self.addresses = procs, list(addresses)
        self.servers = [None] * len(self.addresses)
        self.trainer, self.commands = None, None

    def start_trainer(self, role, **kwargs):
        self.commands = self.procs.queue()
        self.trainer = self.procs.start(role, commands=self.commands, addresses=self.addresses, **kwargs)
        self.procs.ready(self.trainer)

    def cmd(self, name, **kw):
        self.commands.put((name, kw))
        msg = self.procs.get(self.trainer, timeout=180)
        assert msg["cmd"] == name, msg
        return msg

    def stop(self):
        stop_all(self.procs, self.trainer, self.commands, self.servers, self.addresses)


def stop_all(procs, trainer, commands, servers, addresses) -> None:
    """Ends whatever still runs after a test (after a failure, say): the
    trainer by its 'exit' command, each server by its shutdown route, then
    SIGKILL for anything left."""
    if trainer is not None and trainer.is_alive():
        commands.put(("exit", {}))
        trainer.join(10)
    for p, a in zip(servers, addresses):
        if p is not None and p.is_alive():
            try:
                RouteClient(a, timeout=5).call("shutdown")
            except Exception:  # noqa: BLE001  (it is going to be killed)
                pass
            p.join(10)
    for p in [trainer, *servers]:
        if p is not None and p.is_alive():
            procs.kill(p)
