"""SGLang with shmcast (shmcast.sglang): a custom weight loader reached
through SGLang's own update_weights_from_tensor(named_tensors,
load_format="shmcast.sglang.load_weights"), against the SGLang stand-in
(standins/sglang: Engine.update_weights_from_tensor of sgl-project/sglang @
001067f, the TP worker's payload validation and loader dispatch, the
scheduler's weight-update sessions of PR #28001).

With sessions (the default here: the newest SGLang), every update the sender
makes (attach, each send with its flush, close's detach) runs inside one
begin_weight_update / end_weight_update session, which the scheduler
asserts; without them (sessions=False: the offline Engine @ 001067ff and the
scheduler before sessions) none is opened.

Real processes: SGLang TP ranks (a ModelRunner each, --custom-weight-loader
set) and a trainer holding the Engine and a ShmcastSGLangSender. Several
updates of three buckets each, a TP-rank restart, a trainer restart
(SIGKILL), close; every rank's parameters checked bit for bit. TP = 2 with
load='direct' needs Consumer.receive_into(slices=...) (issue 13): it fails
with a TypeError until that API is merged."""
import os

import pytest

import shmcast
from framework_roles import Deployment, RouteClient

pytestmark = pytest.mark.usefixtures("deadline")

CFG = dict(vocab_size=250, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
           num_hidden_layers=2)
BUCKET = 80_000


class Sgl(Deployment):
    """SGLang TP-rank processes on fixed addresses plus one trainer process."""

    def __init__(self, procs, tmp_path, region, tp, load, sessions=True):
        super().__init__(procs, [str(tmp_path / f"tp{i}.sock") for i in range(tp)])
        self.region, self.tp, self.load, self.sessions = region, tp, load, sessions

    @property
    def ranks(self):
        return self.servers

    def start_rank(self, i):
        self.servers[i] = self.procs.start("sglang_roles:tp_rank", address=self.addresses[i], rank=i,
                                           tp_size=self.tp, cfg=CFG, sessions=self.sessions)
        self.procs.ready(self.servers[i])

    def start_trainer(self):
        super().start_trainer("sglang_roles:trainer", region=self.region, consumers=self.tp, cfg=CFG,
                              bucket_bytes=BUCKET, load=self.load, sessions=self.sessions)

    def check(self, seed, path, flushes, sessions=None):
        for i, a in enumerate(self.addresses):
            r = RouteClient(a).call("check", {"seed": seed})
            assert r["problems"] == [], (seed, i, r["problems"][:5])
            assert r["stats"]["path"] == path and r["flushes"] == flushes
            if sessions is not None:
                assert_sessions(r, sessions, self.sessions)
            if path == "direct" and self.tp > 1:
                assert r["stats"]["bytes_read"] < 0.6 * r["stats"]["bytes_total"]


def assert_sessions(r, updates, sessions):
    """Each update of the sender ran inside its own session (or, without
    sessions, none was opened): `updates` lists the update_weights_from_tensor
    calls per session on this rank, e.g. [1, 4] for attach, then a send of
    three buckets and the flush."""
    if not sessions:
        assert r["session_log"] == [] and all(name == "update_weights_from_tensor" for name, _ in r["log"])
        return
    want = []
    for n in updates:
        want += [("begin_weight_update", False)] + [("update_weights_from_tensor", True)] * n
        want += [("end_weight_update", True)]
    assert r["log"] == want
    assert r["session_log"] == ["begin", "end"] * len(updates) and r["open"] is False


@pytest.mark.parametrize("tp,load,sessions", [(1, "direct", True), (2, "loader", True), (2, "direct", True),
                                              (1, "loader", False)],
                         ids=["tp1-direct", "tp2-loader", "tp2-direct", "tp1-loader-nosessions"])
def test_contract(procs, tmp_path, region, tp, load, sessions):
    s = Sgl(procs, tmp_path, region, tp, load, sessions)
    path = load
    try:
        for i in range(tp):
            s.start_rank(i)
        s.start_trainer()
        assert s.cmd("init")["calls"] == 1  # the attach ticket
        flushes = 0
        for seed in (40, 41):
            assert s.cmd("send", seed=seed)["calls"] == 3 + 1  # three buckets, then the cache flush
            flushes += 1
            s.check(seed, path, flushes, sessions=[1] + [4] * flushes)

        # a TP rank restarts (a new engine process): the next send reattaches every rank
        procs.kill(s.ranks[tp - 1])
        s.start_rank(tp - 1)
        assert s.cmd("send", seed=42)["calls"] == 1 + 3 + 1
        for i, a in enumerate(s.addresses):
            assert RouteClient(a).call("check", {"seed": 42})["problems"] == []

        # the trainer restarts (SIGKILL): a new sender recreates the region, the ranks reattach
        procs.kill(s.trainer)
        s.start_trainer()
        s.cmd("init")
        assert s.cmd("send", seed=43)["calls"] == 3 + 1
        for a in s.addresses:
            assert RouteClient(a).call("check", {"seed": 43})["problems"] == []

        s.cmd("close")  # the detach ticket, in its own session
        for i, a in enumerate(s.addresses):
            # sessions per rank: a restarted rank saw the last round's attach onwards
            first = [1, 4, 4] if i < tp - 1 else []
            assert_sessions(RouteClient(a).call("check", {"seed": 43}), first + [1, 4, 1, 4, 1], sessions)
        assert not os.path.exists(shmcast.region_path(region))
    finally:
        s.stop()


def test_sglang_checks_apply(procs, tmp_path, region):
    """SGLang's own rules hold for the hook: a load format that is not in
    --custom-weight-loader is refused by SGLang, and shmcast's loader refuses
    a payload that is not its ticket."""
    s = Sgl(procs, tmp_path, region, 1, "loader")
    try:
        s.start_rank(0)
        s.start_trainer()
        res = s.cmd("plain", load_format="my.other.loader")["result"]
        assert res[0] is False and "unknown load_format" in res[1]
        s.commands.put(("plain", {"load_format": "shmcast.sglang.load_weights"}))
        out = s.trainer.q.get(timeout=120)
        assert out["ok"] is False and "one shmcast ticket" in out["message"]
    finally:
        s.stop()


def test_ticket_roundtrip():
    from shmcast import sglang

    named = sglang.ticket("load", "r", version=3, count=2, digest="ab")
    t = sglang.parse_ticket(named)
    assert t == {"op": "load", "region": "r", "version": 3, "count": 2, "digest": "ab"}
    assert len(named[0][0]) < 200 and named[0][1].numel() == 1
    with pytest.raises(ValueError):
        sglang.ticket("reload", "r")
    with pytest.raises(ValueError, match="one shmcast ticket"):
        sglang.parse_ticket([("model.norm.weight", named[0][1])])


def test_sender_announces_the_names_it_sends_when_quantizing(region):
    """ShmcastSGLangSender(..., quantize=...): every sync carries each
    selected weight's scales too; the ticket's count and names digest are
    the manifest's (the ranks refuse a sync that does not hold the announced
    tensors). The engine here is a callable that reads each sync raw."""
    import fp8_roles as fr
    from shmcast import sglang
    from shmcast._load import names_digest

    seen, state = [], {}

    def update(named_tensors, load_format=None, flush_cache=False):
        assert load_format == sglang.LOAD_FORMAT
        t = sglang.parse_ticket(named_tensors)
        if t["op"] == "attach":
            state["con"] = shmcast._shmcast.Consumer(t["region"], pin="no")
        elif t["op"] == "load":
            names = [n for n, _, _ in fr.read_raw(state["con"], 30)]
            seen.append((t["count"], t["digest"], len(names), names_digest(names)))
        return True, "ok"

    named = fr.model(8)
    sender = sglang.ShmcastSGLangSender(update, region, 1, slot_bytes=2 << 20, bucket_bytes=1 << 20, timeout=30,
                                        sessions=False, quantize="fp8-block128")
    sender.send(named)
    state["con"].close()
    sender.close()
    assert len(seen) >= 2  # buckets
    assert all(a == b for a, _, b, _ in seen) and all(a == b for _, a, _, b in seen), seen
    assert sum(n for _, _, n, _ in seen) == len(named) + 2  # two weights' scales
