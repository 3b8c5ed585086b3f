#!/usr/bin/env python3
"""Relay throughput against ucx_perftest on the same transport, in the same run.

    python3 bench/relay_bench.py [--build build] [--bytes 512M] [--chunk 32M] [--reps 10]
                                 [--nodes 2,4] [--tls tcp] [--devices lo] [--json FILE]

Simulated nodes on one machine (one SHMCAST_DIR each), relays over UCX with
UCX_TLS/UCX_NET_DEVICES as given (default: TCP over loopback):

1. Ceiling: ``ucx_perftest -t tag_bw`` on the same transport, one fresh
   server/client pair per repetition, each moving --bytes: messages of one
   chunk with busy polling (perftest's default) and waiting for events
   (``-E sleep``, as the relay waits), and 1 MiB messages; the best median
   is the ceiling.
2. For each chain length N: a trainer (shmcast-relay-bench-peer produce) on
   node 0, shmcast-relay on every node (source on node 0), one worker
   (consume) on every other node. One warm-up sync, then --reps syncs of
   --bytes, each of fresh random bytes, each started only once every worker
   has checked every byte of the previous one. A node's time for a sync is
   from the trainer's begin_sync to its worker's read_into returning
   (CLOCK_MONOTONIC, one clock for all processes); its rate is bytes / time.
With --link RATE (root, iproute2): emulated links instead of loopback.
Every node gets a network namespace of its own with one veth to a bridge,
shaped with tbf to RATE in each direction: a node's NIC of RATE, full
duplex, behind a switch. The relays and ucx_perftest run inside the nodes'
namespaces over UCX's TCP on those veths; the trainer and the workers stay
where they are (they use no network). On one machine the loopback "link" is
the CPUs and memory every hop shares, so a longer chain slows every hop;
with links slower than that, the link is the bottleneck, as between real
nodes, and the chain's pipelining is measured against it.

3. Per-hop costs besides the network (memcpy into the region, XXH3 of a
   chunk), and memcpy on up to 8 threads at once (the machine's memory
   bandwidth for copies), from ``shmcast-relay-bench-peer costs``.

Prints min/median/max of every figure and the ratios the issue asks for:
2-node relay / perftest, and the last node of the N-node chain / 2-node.
Exit 1 when a worker saw a wrong byte or a step did not finish in time.

Delta syncs (issue #31's relay figure; instead of step 2):

    python3 bench/relay_bench.py --delta-change 0.02 [--manifest qwen2.5-3b] [--link 10Gbit] [--nodes 2] ...

For each chain length, two chains in the same run, each with its own
trainer: "full" (ProducerOptions::delta off) and "delta" (on). Both trainers
start from the same kind of seeded bytes and, before each sync (outside the
timer), change about F of their bf16 elements at seeded random positions
(XOR with a non-zero value), so both move the same logical bytes. A worker
on every node, node 0's too (it reads the trainer's region), reads each sync
into the same buffers (a delta applies in place) and compares every byte
with its own copy, which takes the same changes (relay_peer.cpp mutate()).
Two warm-up syncs (full: the first, and the one that answers the downstream
relay's full-sync request made when it connected before the first sync),
then --reps timed syncs. Per node: the rate in logical bytes/s (from the
trainer's begin_sync to the worker's read_into returning), the sync time,
each sync's kind; the trainer's payload/logical (Producer::last_sync), its
begin_sync -> last write() (a delta trainer's compare and encode on host
threads), -> end_sync, and the delta base's bytes; the ratio delta / full of
the last node's median rate; and the logical rate the link alone would carry
(ucx_perftest / payload per logical byte, computed). A timed sync of the
wrong kind is reported, not hidden.

    python3 bench/relay_bench.py --delta-change 0.02 --cuda ...   (a GPU, the CUDA build)

--cuda: as a real trainer and engine do it, both chains (full and delta) on
GPU 0: the trainer's tensors live in device memory and go out with
write_device() through the CUDA engine (a delta trainer compares and
encodes on the GPU in end_sync(), and only the blobs cross PCIe; its
"begin_sync -> last write" is then only the queueing of the copies), and
each worker reads with read_into_device() into device buffers (a delta is
applied by the library's kernels) and compares every word on the GPU with
its own device copy after its timer stopped. Content and changes come from
kernels (bench/cuda_kernels.cu: each element changes with probability F).
Without --delta-change (fresh bytes) it works the same way. A peer that
cannot run (no GPU, a build without CUDA) ends the run with its reason.

Isolation (instead of the above; TCP over loopback only):

    python3 bench/relay_bench.py --flood 1000 [--window 4] [--reps 10] ...
    python3 bench/relay_bench.py --slow [--window 4.3] [--reps 10] ...

A source relay and its downstream relays, syncs back to back (each started
once the measured worker checked every byte of the previous one), and the
measured downstream's rate in windows of --window seconds: payload bytes
its worker received whole / the window's time. --reps pairs of windows,
without the disturbance then with it, in the same run (interleaved, so that
what else runs on the machine weighs on both alike):
  --flood N: the keyed downstream's rate while relay_attacker (the attack
    tests' keyless peer, build/tests/relay) holds N UCX connections and N
    plain TCP connections open to the source relay's port, opening again
    every one the relay closes (at most 2 N at once, loopback only). Wanted:
    >= 0.5x the rate without it.
  --slow: the healthy downstream's rate, alone, then beside two more
    downstream relays of the same source: one stopped (SIGSTOP) for good,
    one stopped 4 s and resumed 0.3 s over and over. Wanted: >= 0.9x.
"""

import argparse
import datetime
import fcntl
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

KEY = "relay-bench-key-0123456789abcdef"


def size(s):
    m = re.fullmatch(r"(\d+)([KMG]?)", s)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {s!r}")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)]


def stats(xs):
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)}


def fmt(s):
    return f"{s['median']:.3f} GB/s (min {s['min']:.3f}, max {s['max']:.3f}, n={s['n']})"


def wait_for(pred, timeout, what):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.002)
    raise TimeoutError(f"timed out waiting for {what}")


def read_lines(path):
    try:
        with open(path) as f:
            return f.read().splitlines()
    except FileNotFoundError:
        return []


def status(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_cpu_s(pid):
    """User + system CPU seconds of a process (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def machine_busy():
    """(busy, total) jiffies of all CPUs, everyone's processes included."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)


class Links:
    """Emulated links (--link RATE): node i in network namespace NS-n<i>,
    address 10.77.0.<i+1>/24 on its eth0, a veth to bridge br0 in NS-sw;
    tbf at RATE on both ends of every veth (what node i sends, and what the
    bridge sends to node i). Needs root and iproute2 (ip, tc)."""

    NS = "shmcast-bench"

    def __init__(self, nodes, rate, mtu):
        self.nodes, self.rate, self.mtu = nodes, rate, mtu
        self.sw = f"{self.NS}-sw"
        self.up = False

    @staticmethod
    def cmd(*argv):
        argv = [str(a) for a in argv]
        r = subprocess.run(argv, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip()}")

    def ip(self, *argv):
        self.cmd("ip", *argv)

    def tc(self, *argv):
        self.cmd("tc", *argv)

    def ns(self, i):
        return f"{self.NS}-n{i}"

    def host(self, i):
        return f"10.77.0.{i + 1}"

    def prefix(self, i):
        return ["ip", "netns", "exec", self.ns(i)]

    def existing(self):
        r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
        return [l.split()[0] for l in r.stdout.splitlines() if l.startswith(self.NS + "-")]

    def delete_all(self):
        for ns in self.existing():
            # Whatever still runs in it first (a relay of a killed run).
            r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in r.stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns])

    def setup(self):
        # One emulated network per machine: a second run would delete this
        # one's namespaces. The lock goes with the process.
        self.lock = open(os.path.join(tempfile.gettempdir(), "shmcast-relay-bench-links.lock"), "w")
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise RuntimeError("another relay_bench.py --link run holds the emulated network on this machine")
        self.delete_all()  # left behind by a killed run
        self.up = True
        # Bucket: 2 ms at RATE, and never less than two 64 KiB GSO packets.
        burst = max(2 * 65536 + 2 * self.mtu, self.rate // 8 // 500)
        shape = ["root", "tbf", "rate", f"{self.rate}bit", "burst", str(burst), "latency", "20ms"]
        self.ip("netns", "add", self.sw)
        self.ip("-n", self.sw, "link", "set", "lo", "up")
        self.ip("-n", self.sw, "link", "add", "br0", "type", "bridge")
        self.ip("-n", self.sw, "link", "set", "br0", "up")
        for i in range(self.nodes):
            ns = self.ns(i)
            self.ip("netns", "add", ns)
            self.ip("-n", ns, "link", "set", "lo", "up")
            self.ip("-n", ns, "link", "add", "eth0", "mtu", self.mtu, "type", "veth", "peer", "name", f"p{i}",
                    "mtu", self.mtu, "netns", self.sw)
            self.ip("-n", ns, "addr", "add", f"{self.host(i)}/24", "dev", "eth0")
            self.ip("-n", ns, "link", "set", "eth0", "up")
            self.ip("-n", self.sw, "link", "set", f"p{i}", "master", "br0", "up")
            self.tc("-n", ns, "qdisc", "add", "dev", "eth0", *shape)
            self.tc("-n", self.sw, "qdisc", "add", "dev", f"p{i}", *shape)
        self.shape = " ".join(shape)

    def close(self):
        if self.up:
            self.delete_all()
            self.up = False


def rate_bits(s):
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMG]?)bit", s)
    if not m:
        raise argparse.ArgumentTypeError(f"bad rate {s!r} (e.g. 10Gbit)")
    return int(float(m.group(1)) * {"": 1, "K": 1e3, "M": 1e6, "G": 1e9}[m.group(2)])


def perftest(args, env, exe, msg, wait, outstanding=None, links=None):
    """One ucx_perftest tag_bw run per repetition; GB/s (10^9 bytes) each.
    wait: "poll" (busy, perftest's default) or "sleep" (waits for events,
    as the relay does). With links: server on node 0, client on node 1."""
    iters = max(4, args.bytes // msg)
    out = []
    srv_pre, cli_pre, host = ([], [], "127.0.0.1") if not links else (links.prefix(0), links.prefix(1), links.host(0))
    for _ in range(args.reps):
        for attempt in range(20):
            port = free_port()
            server = subprocess.Popen(srv_pre + [exe, "-p", str(port), "-E", wait], env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
            try:
                time.sleep(0.2 * (attempt + 1))  # the server's bootstrap socket (no handshake to wait on)
                r = subprocess.run(cli_pre + [exe, host, "-p", str(port), "-t", "tag_bw", "-s", str(msg),
                                    "-n", str(iters), "-w", "2", "-E", wait] +
                                   (["-O", str(outstanding)] if outstanding else []), env=env, capture_output=True,
                                   text=True,
                                   timeout=300)
            finally:
                try:
                    server.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    server.kill()
                    server.wait()
            m = re.search(r"^Final:\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)", r.stdout, re.M)
            if r.returncode == 0 and m:
                # ucx_perftest's MB/s are MiB/s; the overall bandwidth column.
                out.append(float(m.group(6)) * (1 << 20) / 1e9)
                break
        else:
            raise RuntimeError("ucx_perftest did not run: " + r.stdout[-2000:] + r.stderr[-2000:])
    return out


class Chain:
    """mode: None (fresh random bytes every sync), or with --delta-change
    "full" (the trainer's ProducerOptions::delta off) or "delta" (on); both
    change --delta-change of the elements before each sync, and then a worker
    on node 0 reads the trainer's region too."""

    def __init__(self, args, n, env, tools, links=None, mode=None):
        self.args, self.n, self.env, self.tools, self.links, self.mode = args, n, env, tools, links, mode
        self.root = tempfile.mkdtemp(prefix=f"shmcast-relay-bench-{n}{'-' + mode if mode else ''}-")
        self.procs = []
        self.by_tag = {}
        self.region = "relay-bench"

    def dir(self, i):
        return os.path.join(self.root, f"node{i}")

    def alive(self, *tags, unless=None):
        """Raises when a peer of these tags has exited (with its report's
        "error" line, or its log's tail): no waiting out a timeout for a
        process that is gone. unless: what it was waiting for, read again
        once the exit is seen (a worker exits after its last sync)."""
        for tag in tags:
            p = self.by_tag.get(tag)
            if p is not None and p.poll() is not None:
                if unless is not None and unless():
                    return False
                why = [l for l in read_lines(os.path.join(self.root, tag + ".txt")) if l.startswith("error ")]
                if not why:
                    why = read_lines(os.path.join(self.root, tag + ".log"))[-5:]
                raise RuntimeError(f"{tag} exited with status {p.returncode}: " + " | ".join(why))

    def host(self, i):
        return self.links.host(i) if self.links else "127.0.0.1"

    def start(self, tag, argv, node, net=False):
        """net: a relay, which runs in node's namespace under --link."""
        if net and self.links:
            argv = self.links.prefix(node) + argv
        env = dict(self.env, SHMCAST_DIR=self.dir(node), SHMCAST_RELAY_KEY=KEY)
        log = open(os.path.join(self.root, tag + ".log"), "w")
        p = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(p)
        self.by_tag[tag] = p
        return p

    def status(self, i):
        return status(os.path.join(self.dir(i), f"shmcast-relay.{self.region}.json"))

    def wait_status(self, i, pred, what):
        return wait_for(lambda: (lambda s: s if s and pred(s) else None)(self.status(i)), 120, f"node {i}: {what}")

    def run(self):
        a, n = self.args, self.n
        for i in range(n):
            os.makedirs(self.dir(i))
        peer, relay = self.tools["peer"], self.tools["relay"]
        # Warm-up: the first sync; with --delta-change the first two (a relay
        # that connects before the first sync asks for a full sync after
        # version 1, so the trainer's second sync is full too), in both modes.
        self.warmup = 2 if self.mode else 1
        syncs = a.reps + self.warmup
        timed = range(self.warmup + 1, syncs + 1)
        seed = int.from_bytes(os.urandom(7), "little")
        trainer = os.path.join(self.root, "trainer.txt")
        go = os.path.join(self.root, "go")
        content = []  # the peers' content arguments
        if self.mode:
            content = ["--change", repr(a.delta_change)]
        if a.cuda:
            content += ["--cuda", "1"]
        manifest = ["--manifest", a.manifest] if a.manifest else []
        self.start("trainer", [peer, "produce", self.region, "--bytes", str(a.bytes), "--tensors", str(a.tensors),
                               "--slot-bytes", str(a.chunk), "--syncs", str(syncs), "--go", go, "--seed", str(seed),
                               "--report", trainer] + manifest + content +
                   (["--delta", "1"] if self.mode == "delta" else []), 0)
        wait_for(lambda: self.alive("trainer") or "ready" in read_lines(trainer), 300, "the trainer")
        logical = [int(l.split()[1]) for l in read_lines(trainer) if l.startswith("logical ")]
        self.logical = logical[0] if logical else a.payload
        ports = [0] * n
        for i in range(n):
            argv = [relay, self.region] + self.args.relay_args
            if i > 0:
                argv += ["--from", f"{self.host(i - 1)}:{ports[i - 1]}"]
            if i + 1 < n:
                argv += ["--listen", f"{self.host(i)}:0"]
            self.start(f"relay{i}", argv, i, net=True)
            if i + 1 < n:
                s = self.wait_status(i, lambda s: s.get("listen"), "listening")
                ports[i] = int(s["listen"].rsplit(":", 1)[1])
            if i == 0:
                self.wait_status(0, lambda s: s["region_state"]["ready"], "attached to the region")
            else:
                self.wait_status(i, lambda s: s["upstream"]["state"] == "connected" and s["region_state"]["ready"],
                                 "connected")
        for i in range(n - 1):
            self.wait_status(i, lambda s: s["downstream_ready"] >= 1, "its downstream relay")
        reports = {}
        for i in range(0 if self.mode else 1, n):
            rep = os.path.join(self.root, f"worker{i}.txt")
            self.start(f"worker{i}", [peer, "consume", self.region, "--syncs", str(syncs), "--seed", str(seed),
                                      "--report", rep] + content, i)
            wait_for(lambda: self.alive(f"worker{i}") or "attached" in read_lines(rep), 120, f"worker {i}")
            reports[i] = rep
        cpu0 = sum(proc_cpu_s(p.pid) for p in self.procs)
        m0 = machine_busy()
        t0 = time.monotonic()
        for v in range(1, syncs + 1):
            open(f"{go}.{v}", "w").close()
            for wi, rep in reports.items():
                def done(rep=rep, v=v, tag=f"worker{wi}"):
                    lines = read_lines(rep)
                    if any(l.startswith(f"bad {v}") for l in lines):
                        raise RuntimeError(f"{rep}: sync {v} has wrong bytes")
                    if f"needsfull {v}" in lines:
                        raise RuntimeError(f"{rep}: sync {v} was a delta on a base the worker did not hold "
                                           "(kNeedsFullSync)")
                    if f"ok {v}" in lines:
                        return True
                    self.alive("trainer", tag, unless=lambda: f"ok {v}" in read_lines(rep))
                    return False
                wait_for(done, 600, f"sync {v} at {rep}")
        # Cores kept busy while the syncs ran: by this chain's processes, and
        # by everything on the machine (others' jobs included).
        wall = time.monotonic() - t0
        m1 = machine_busy()
        self.cores = {"chain": (sum(proc_cpu_s(p.pid) for p in self.procs) - cpu0) / wall,
                      "machine": (m1[0] - m0[0]) / max(1, m1[1] - m0[1]) * os.cpu_count()}
        tl = read_lines(trainer)
        begin = {int(l.split()[1]): int(l.split()[2]) for l in tl if l.startswith("begin ")}
        tend = {int(l.split()[1]): int(l.split()[2]) for l in tl if l.startswith("end ")}
        rates = {}
        self.detail = {}
        for i, rep in reports.items():
            lines = read_lines(rep)
            end = {int(l.split()[1]): int(l.split()[2]) for l in lines if l.startswith("end ")}
            rates[i] = [self.logical / ((end[v] - begin[v]) * 1e-9) / 1e9 for v in timed]
            if self.mode:
                kinds = {int(l.split()[1]): l.split()[2:] for l in lines if l.startswith("sync ")}
                self.detail[i] = {
                    "sync_s": [(end[v] - begin[v]) * 1e-9 for v in timed],
                    "kinds": [kinds[v][0] for v in timed],
                    # the trainer's end_sync returned -> this worker's
                    # read_into returned (the last chunks' way, the apply)
                    "after_end_sync_s": [(end[v] - tend[v]) * 1e-9 for v in timed],
                    "verified": sum(1 for l in lines if l.startswith("ok ")),
                }
        if self.mode:
            written = {int(l.split()[1]): int(l.split()[2]) for l in tl if l.startswith("written ")}
            kinds = {int(l.split()[1]): l.split()[2:] for l in tl if l.startswith("sync ")}
            self.detail["trainer"] = {
                # begin_sync to the last write() returned: a delta trainer's
                # compare-and-encode of every tensor (host threads); with
                # --cuda the queueing of the write_device() copies (the GPU
                # encodes in end_sync).
                "written_s": [(written[v] - begin[v]) * 1e-9 for v in timed],
                "end_sync_s": [(tend[v] - begin[v]) * 1e-9 for v in timed],
                "kinds": [kinds[v][0] for v in timed],
                "payload_bytes": [int(kinds[v][1]) for v in timed],
                "logical_bytes": [int(kinds[v][2]) for v in timed],
                "warmup_kinds": [kinds[v][0] for v in range(1, self.warmup + 1)],
            }
            base = [int(l.split()[1]) for l in tl if l.startswith("delta_base_bytes ")]
            if base:
                self.detail["trainer"]["delta_base_bytes"] = base[0]
        relays = [self.status(i) for i in range(n)]
        return rates, relays

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if not self.args.keep:
            shutil.rmtree(self.root, ignore_errors=True)


class Tree:
    """A source relay and K downstream relays of it (--flood, --slow): the
    trainer waits for go files; worker 1 is measured."""

    def __init__(self, args, env, tools, k):
        self.args, self.env, self.tools, self.k = args, env, tools, k
        self.root = tempfile.mkdtemp(prefix="shmcast-relay-bench-iso-")
        self.procs = []
        self.region = "relay-bench"
        self.next_sync = 1

    def dir(self, i):
        return os.path.join(self.root, f"node{i}")

    def start(self, tag, argv, node):
        env = dict(self.env, SHMCAST_DIR=self.dir(node), SHMCAST_RELAY_KEY=KEY)
        log = open(os.path.join(self.root, tag + ".log"), "w")
        p = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def status(self, i):
        return status(os.path.join(self.dir(i), f"shmcast-relay.{self.region}.json"))

    def wait_status(self, i, pred, what):
        return wait_for(lambda: (lambda s: s if s and pred(s) else None)(self.status(i)), 120, f"node {i}: {what}")

    def setup(self, extra_nodes_now=True):
        a = self.args
        for i in range(self.k + 1):
            os.makedirs(self.dir(i))
        self.seed = int.from_bytes(os.urandom(7), "little")
        self.trainer = os.path.join(self.root, "trainer.txt")
        self.go = os.path.join(self.root, "go")
        self.start("trainer", [self.tools["peer"], "produce", self.region, "--bytes", str(a.bytes), "--tensors",
                               str(a.tensors), "--slot-bytes", str(a.chunk), "--syncs", "1000000", "--go", self.go,
                               "--seed", str(self.seed), "--report", self.trainer], 0)
        wait_for(lambda: "ready" in read_lines(self.trainer), 120, "the trainer")
        self.start("relay0", [self.tools["relay"], self.region, "--listen", "127.0.0.1:0"] + a.relay_args, 0)
        s = self.wait_status(0, lambda s: s.get("listen") and s["region_state"]["ready"], "listening")
        self.port = int(s["listen"].rsplit(":", 1)[1])
        self.relays = {}
        self.add_downstream(1)
        self.report = os.path.join(self.root, "worker1.txt")
        self.start("worker1", [self.tools["peer"], "consume", self.region, "--syncs", "1000000", "--seed",
                               str(self.seed), "--report", self.report], 1)
        wait_for(lambda: "attached" in read_lines(self.report), 120, "worker 1")

    def add_downstream(self, i):
        self.relays[i] = self.start(f"relay{i}", [self.tools["relay"], self.region, "--from",
                                                  f"127.0.0.1:{self.port}"] + self.args.relay_args, i)
        self.wait_status(i, lambda s: s["upstream"]["state"] == "connected", "connected")
        n = len(self.relays)
        self.wait_status(0, lambda s: s["downstream_ready"] >= n, f"{n} downstream relays")

    def remove_downstream(self, i):
        p = self.relays.pop(i)
        os.kill(p.pid, signal.SIGCONT)
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
        n = len(self.relays)
        self.wait_status(0, lambda s: len(s["downstream"]) <= n, f"{n} downstream relays left")

    def window(self, seconds):
        """Syncs back to back for `seconds`; worker 1's payload bytes per second."""
        a = self.args
        t0 = time.monotonic()
        got = 0
        while time.monotonic() - t0 < seconds:
            v = self.next_sync
            self.next_sync += 1
            open(f"{self.go}.{v}", "w").close()

            def done(v=v):
                lines = read_lines(self.report)
                if any(l.startswith(f"bad {v}") for l in lines):
                    raise RuntimeError(f"sync {v} has wrong bytes at the measured worker")
                return f"ok {v}" in lines
            wait_for(done, 600, f"sync {v} at the measured worker")
            got += a.payload
        return got / (time.monotonic() - t0) / 1e9

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if not self.args.keep:
            shutil.rmtree(self.root, ignore_errors=True)


def run_isolation(args, tools):
    """--flood N / --slow: the measured downstream's rate without, then with,
    the disturbance, in one run."""
    env = dict(os.environ, UCX_TLS=args.tls, UCX_NET_DEVICES=args.devices, UCX_WARN_UNUSED_ENV_VARS="n")
    mode = "flood" if args.flood else "slow"
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "loadavg_before": os.getloadavg()},
        "mode": mode, "payload_bytes": args.payload, "chunk_bytes": args.chunk, "window_s": args.window,
        "reps": args.reps, "relay_args": args.relay_args,
    }
    tree = Tree(args, env, tools, 1 if args.flood else 3)
    base, hit = [], []
    try:
        tree.setup()
        tree.window(args.window / 2)  # warm-up
        if args.flood:
            attacker = os.path.join(args.build, "tests", "relay", "relay_attacker")
            n = min(args.flood, 1000)
            result["flood"] = {"connections": n, "raw": n, "reports": []}
        else:
            result["slow"] = {}
        for r in range(args.reps):
            base.append(tree.window(args.window))
            if args.flood:
                rep = os.path.join(tree.root, f"flood{r}.txt")
                flood = tree.start(f"flood{r}", [attacker, "flood", "--to", f"127.0.0.1:{tree.port}", "--conns",
                                                 str(n), "--raw", str(n), "--sustain", "1", "--seconds",
                                                 str(int(args.window + 120)), "--report", rep], 1)
                wait_for(lambda: any(l.startswith("raw ") for l in read_lines(rep)), 300, "the flood")
                c0 = (proc_cpu_s(flood.pid), proc_cpu_s(tree.procs[1].pid))  # the attacker, the source relay
                t0 = time.monotonic()
                hit.append(tree.window(args.window))
                dt = time.monotonic() - t0
                result["flood"].setdefault("attacker_cores", []).append((proc_cpu_s(flood.pid) - c0[0]) / dt)
                result["flood"].setdefault("source_relay_cores", []).append((proc_cpu_s(tree.procs[1].pid) - c0[1]) / dt)
                flood.send_signal(signal.SIGTERM)
                flood.wait(timeout=60)
                result["flood"]["reports"].append(read_lines(rep))
            else:
                tree.add_downstream(2)
                tree.add_downstream(3)
                stopped, trickle = tree.relays[2], tree.relays[3]
                os.kill(stopped.pid, signal.SIGSTOP)
                stop = {"on": True}

                def toggle():
                    while stop["on"]:
                        os.kill(trickle.pid, signal.SIGSTOP)
                        end = time.monotonic() + 4.0
                        while stop["on"] and time.monotonic() < end:
                            time.sleep(0.01)
                        os.kill(trickle.pid, signal.SIGCONT)
                        time.sleep(0.3)
                th = threading.Thread(target=toggle, daemon=True)
                th.start()
                try:
                    hit.append(tree.window(args.window))
                finally:
                    stop["on"] = False
                    th.join()
                tree.remove_downstream(3)
                tree.remove_downstream(2)
        if not args.flood:
            result["slow"]["dropped_for_lag"] = sum(1 for l in open(os.path.join(tree.root, "relay0.log"))
                                                    if "fell behind the other downstream" in l)
        result["source_status"] = tree.status(0)
    except Exception as e:  # noqa: BLE001 (report, keep the logs, fail)
        print(f"relay_bench: {mode}: {e} (logs in {tree.root})", file=sys.stderr)
        args.keep = True
        tree.close()
        return 1
    tree.close()
    result["without"] = {"gbs": stats(base), "all": base}
    result["with"] = {"gbs": stats(hit), "all": hit}
    result["ratio_median"] = stats(hit)["median"] / stats(base)["median"]
    result["ratio_mean"] = statistics.mean(hit) / statistics.mean(base)
    result["machine"]["loadavg_after"] = os.getloadavg()
    if args.flood:
        for k in ("attacker_cores", "source_relay_cores"):
            result["flood"][k + "_median"] = statistics.median(result["flood"][k])
        print(f"flood: cores busy during the flood windows (median): attacker "
              f"{result['flood']['attacker_cores_median']:.2f}, source relay {result['flood']['source_relay_cores_median']:.2f}")
    what = f"a flood of {args.flood} keyless connections" if args.flood else "a stopped and a 4 s/0.3 s downstream"
    print(f"{mode}: measured downstream without: {fmt(result['without']['gbs'])}")
    print(f"{mode}: measured downstream with {what}: {fmt(result['with']['gbs'])}")
    print(f"{mode}: with / without: {result['ratio_median']:.2f} (medians), {result['ratio_mean']:.2f} (means)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--bytes", type=size, default=size("512M"), help="payload of one sync")
    ap.add_argument("--chunk", type=size, default=size("32M"), help="slot size of the source region = chunk")
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--nodes", default="2,4")
    ap.add_argument("--perftest", default="chunk:poll,chunk:sleep,1M:sleep",
                    help="ucx_perftest runs, SIZE:WAIT[:OUTSTANDING] (SIZE: chunk or a size; WAIT: poll or sleep; "
                         "OUTSTANDING: perftest's -O, sends in flight); "
                         "the best median is the ceiling")
    ap.add_argument("--tls", default="tcp")
    ap.add_argument("--devices", default="lo")
    ap.add_argument("--link", type=rate_bits, help="emulated links of this rate (e.g. 10Gbit), a network namespace "
                    "per node (root, iproute2); the transport is then TCP over those links")
    ap.add_argument("--mtu", type=int, default=9000, help="MTU of the emulated links")
    ap.add_argument("--relay-arg", dest="relay_args", action="append", default=[],
                    help="extra argument for every relay (repeat), e.g. --relay-arg=--no-checksums")
    ap.add_argument("--flood", type=int, metavar="N",
                    help="instead of chains: a downstream's rate without and with a flood of N (at most 1000) "
                         "keyless connections, loopback only (needs build/tests/relay/relay_attacker)")
    ap.add_argument("--slow", action="store_true",
                    help="instead of chains: a downstream's rate alone and beside a stopped one and one stopped 4 s "
                         "/ resumed 0.3 s over and over")
    ap.add_argument("--window", type=float, default=4.3, help="--flood/--slow: seconds of syncs per repetition")
    ap.add_argument("--delta-change", type=float, metavar="F",
                    help="instead of fresh bytes: each sync changes F (e.g. 0.02) of the bf16 elements at random "
                         "positions; per chain length, a chain of full syncs and a chain of delta syncs "
                         "(ProducerOptions::delta), the last node's rate in logical bytes/s, a worker on every "
                         "node (node 0's too) checking every byte against its own changed copy")
    ap.add_argument("--manifest", help="the trainer's tensors: a named model's shapes (qwen2.5-3b: bf16, 6.17 GB) "
                    "instead of --tensors tensors of --bytes in all (ucx_perftest still moves --bytes)")
    ap.add_argument("--cuda", action="store_true",
                    help="the trainer's tensors in GPU memory, sent with write_device (CUDA engine: a delta is "
                         "encoded on the GPU), the workers read with read_into_device into GPU buffers and check "
                         "them on the GPU (needs a GPU and a build with CUDA and nvcc)")
    ap.add_argument("--json")
    ap.add_argument("--keep", action="store_true", help="keep the node directories and logs")
    args = ap.parse_args()
    if args.reps < 10:
        print("relay_bench: --reps below 10 is not a result (docs/benchmarks.md)", file=sys.stderr)
    each = args.bytes // args.tensors // 2 * 2
    args.payload = each * args.tensors
    tools = {"relay": os.path.join(args.build, "tools", "shmcast-relay"),
             "peer": os.path.join(args.build, "bench", "shmcast-relay-bench-peer")}
    for t in tools.values():
        if not os.access(t, os.X_OK):
            sys.exit(f"relay_bench: {t} is missing: build it (cmake --build {args.build} --target "
                     "shmcast-relay shmcast-relay-bench-peer)")
    if args.delta_change is not None and not 0 < args.delta_change <= 1:
        sys.exit("relay_bench: --delta-change F: 0 < F <= 1")
    if args.flood or args.slow:
        if args.cuda:
            sys.exit("relay_bench: --cuda is for the chains (fresh bytes or --delta-change), not --flood or --slow")
        if args.link or args.tls != "tcp" or args.devices != "lo":
            sys.exit("relay_bench: --flood and --slow run over TCP loopback only")
        if args.flood and not 0 < args.flood <= 1000:
            sys.exit("relay_bench: --flood N: 1..1000")
        if args.flood and not os.access(os.path.join(args.build, "tests", "relay", "relay_attacker"), os.X_OK):
            sys.exit(f"relay_bench: --flood needs {args.build}/tests/relay/relay_attacker "
                     f"(cmake --build {args.build} --target relay_attacker)")
        return run_isolation(args, tools)
    perf = shutil.which("ucx_perftest")
    if not perf:
        sys.exit("relay_bench: ucx_perftest is missing (apt install ucx-utils)")
    links = None
    if args.link:
        if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
            sys.exit("relay_bench: --link needs root and iproute2 (ip, tc)")
        if args.tls != "tcp":
            sys.exit("relay_bench: --link emulates network links: --tls must be tcp (shared memory would bypass them)")
        args.devices = "eth0"
        links = Links(max(int(x) for x in args.nodes.split(",")), args.link, args.mtu)
    # SIGTERM (timeout, a killed job) unwinds like Ctrl-C: the finally
    # clauses stop the relays and delete the namespaces.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        if links:
            links.setup()  # inside the try: a setup that fails halfway is undone too
        return run_bench(args, tools, perf, links)
    except RuntimeError as e:
        sys.exit(f"relay_bench: {e}")
    finally:
        if links:
            links.close()


def run_bench(args, tools, perf, links):
    env = dict(os.environ, UCX_TLS=args.tls, UCX_NET_DEVICES=args.devices, UCX_WARN_UNUSED_ENV_VARS="n")
    ucx_version = subprocess.run(["ucx_info", "-v"], capture_output=True, text=True).stdout.splitlines()[:1]
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
                    "kernel": platform.release(), "loadavg_before": os.getloadavg()},
        "ucx": ucx_version, "transport": {"UCX_TLS": args.tls, "UCX_NET_DEVICES": args.devices,
                                          "links": None if not links else {"rate_bit_s": args.link, "mtu": args.mtu,
                                                                            "tbf": links.shape}},
        "relay_args": args.relay_args, "cuda": args.cuda, "payload_bytes": args.payload, "chunk_bytes": args.chunk, "tensors": args.tensors, "reps": args.reps,
    }
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"^model name\s*:\s*(.*)$", f.read(), re.M)
            if m:
                result["machine"]["cpu"] = m.group(1)
    except OSError:
        pass

    threads = max(1, min(8, (os.cpu_count() or 2) // 2))
    costs = subprocess.run([tools["peer"], "costs", "--bytes", str(args.chunk), "--reps", "20", "--threads", str(threads)],
                           capture_output=True, text=True, check=True)
    result["hop_costs"] = json.loads(costs.stdout)
    print(f"per-chunk costs ({args.chunk >> 20} MiB): memcpy {result['hop_costs']['memcpy_gbs']['median']:.2f} GB/s, "
          f"XXH3 {result['hop_costs']['xxh3_gbs']['median']:.2f} GB/s")
    if "memcpy_all_threads_gbs" in result["hop_costs"]:
        print(f"memcpy on {threads} threads at once ({args.chunk >> 20} MiB each): "
              f"{result['hop_costs']['memcpy_all_threads_gbs']['median']:.2f} GB/s copied")

    result["perftest_runs"] = []
    for spec in args.perftest.split(","):
        sz, wait, *rest = spec.split(":")
        outstanding = int(rest[0]) if rest else None
        msg = args.chunk if sz == "chunk" else size(sz)
        pt = perftest(args, env, perf, msg, wait, outstanding, links)
        run = {"args": f"-t tag_bw -s {msg} -n {max(4, args.bytes // msg)} -w 2 -E {wait}" +
                       (f" -O {outstanding}" if outstanding else ""), "gbs": stats(pt), "all": pt}
        result["perftest_runs"].append(run)
        print(f"ucx_perftest {run['args']}: {fmt(run['gbs'])}")
    result["perftest"] = max(result["perftest_runs"], key=lambda r: r["gbs"]["median"])

    if args.delta_change is not None:
        return run_delta(args, tools, env, links, result)
    ok = True
    result["chains"] = {}
    for n in [int(x) for x in args.nodes.split(",")]:
        chain = Chain(args, n, env, tools, links)
        try:
            rates, relays = chain.run()
        except Exception as e:  # noqa: BLE001 (report, keep the logs, fail)
            print(f"relay_bench: {n} nodes: {e} (logs in {chain.root})", file=sys.stderr)
            args.keep = True
            ok = False
            continue
        finally:
            chain.close()  # also on Ctrl-C or SIGTERM: no relay outlives its chain (or its namespace)
        entry = {"nodes": {str(i): stats(r) for i, r in rates.items()}, "all": rates,
                 "cores_busy": chain.cores, "relay_status": relays}
        entry["last"] = entry["nodes"][str(n - 1)]
        result["chains"][str(n)] = entry
        for i in rates:
            print(f"{n} nodes, node {i}: {fmt(entry['nodes'][str(i)])}")
        print(f"{n} nodes: cores busy while syncing: {chain.cores['chain']:.2f} by the chain, "
              f"{chain.cores['machine']:.2f} on the machine (of {os.cpu_count()})")
    result["machine"]["loadavg_after"] = os.getloadavg()
    if "2" in result["chains"]:
        two = result["chains"]["2"]["last"]["median"]
        result["ratio_2node_vs_perftest"] = two / result["perftest"]["gbs"]["median"]
        print(f"2-node relay / ucx_perftest: {result['ratio_2node_vs_perftest']:.2f}")
        for n, e in result["chains"].items():
            if n != "2":
                r = e["last"]["median"] / two
                result[f"ratio_{n}node_last_vs_2node"] = r
                print(f"{n}-node chain, last node / 2-node: {r:.2f}")
    for n, e in result["chains"].items():
        if n != "2":
            # Within one chain: the last node against the first. Forwarding
            # whole syncs (store and forward) would give 1 / (N - 1).
            r = e["last"]["median"] / e["nodes"]["1"]["median"]
            result[f"ratio_{n}node_last_vs_first"] = r
            print(f"{n}-node chain, last node / first downstream node: {r:.2f} (store-and-forward: {1 / (int(n) - 1):.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if ok else 1


def run_delta(args, tools, env, links, result):
    """--delta-change F: for each chain length, a chain whose trainer sends
    full syncs (delta off) and one whose trainer sends delta syncs, both
    changing F of the bf16 elements before each sync; the figure is the last
    node's rate in logical bytes per second, delta against full."""
    ok = True
    result["delta_change"] = args.delta_change
    result["manifest"] = args.manifest
    result["delta"] = {}
    result["perftest_bytes"] = args.bytes
    if args.manifest:
        result["tensors"] = None  # the manifest's; payload_bytes: the chains' logical bytes, below
    ceiling = result["perftest"]["gbs"]["median"]
    for n in [int(x) for x in args.nodes.split(",")]:
        entry = {}
        for mode in ("full", "delta"):
            chain = Chain(args, n, env, tools, links, mode)
            try:
                rates, relays = chain.run()
            except Exception as e:  # noqa: BLE001 (report, keep the logs, fail)
                print(f"relay_bench: {n} nodes, {mode} syncs: {e} (logs in {chain.root})", file=sys.stderr)
                args.keep = True
                ok = False
                continue
            finally:
                chain.close()
            tr = chain.detail["trainer"]
            result["payload_bytes"] = chain.logical
            e = {"logical_bytes": chain.logical,
                 "nodes": {str(i): stats(r) for i, r in rates.items()}, "all": rates,
                 "sync_s": {str(i): stats(chain.detail[i]["sync_s"]) for i in rates},
                 "after_end_sync_s": {str(i): stats(chain.detail[i]["after_end_sync_s"]) for i in rates},
                 "kinds": {str(i): chain.detail[i]["kinds"] for i in rates},
                 "verified": {str(i): chain.detail[i]["verified"] for i in rates},
                 "trainer": tr,
                 "trainer_written_s": stats(tr["written_s"]), "trainer_end_sync_s": stats(tr["end_sync_s"]),
                 "payload_over_logical": stats([p / l for p, l in zip(tr["payload_bytes"], tr["logical_bytes"])]),
                 "cores_busy": chain.cores, "relay_status": relays}
            e["last"] = e["nodes"][str(n - 1)]
            e["last_vs_perftest"] = e["last"]["median"] / ceiling
            # What the link alone would allow: logical bytes at the ceiling's
            # rate for the payload (computed, no encode or apply).
            e["link_bound_logical_gbs"] = ceiling / e["payload_over_logical"]["median"]
            entry[mode] = e
            want = "delta" if mode == "delta" else "full"
            other = sum(1 for k in tr["kinds"] if k != want)
            for i in rates:
                print(f"{n} nodes, {mode} syncs, node {i}: {fmt(e['nodes'][str(i)])} logical; sync "
                      f"{e['sync_s'][str(i)]['median']:.3f} s ({e['sync_s'][str(i)]['min']:.3f}-"
                      f"{e['sync_s'][str(i)]['max']:.3f}); verified {e['verified'][str(i)]}/{args.reps + chain.warmup}")
            print(f"{n} nodes, {mode} syncs: payload/logical {e['payload_over_logical']['median']:.4f}; trainer "
                  f"begin_sync -> last write {e['trainer_written_s']['median']:.3f} s, -> end_sync "
                  f"{e['trainer_end_sync_s']['median']:.3f} s, -> node {n - 1}'s read_into "
                  f"{e['trainer_end_sync_s']['median'] + e['after_end_sync_s'][str(n - 1)]['median']:.3f} s "
                  f"(medians); last node / ucx_perftest "
                  f"{e['last_vs_perftest']:.2f}; cores busy {chain.cores['chain']:.2f} by the chain"
                  + (f"; {other} of {len(tr['kinds'])} timed syncs were not {want}" if other else ""))
            if mode == "delta":
                print(f"{n} nodes, delta syncs: the link alone would carry {e['link_bound_logical_gbs']:.2f} GB/s "
                      "logical (ucx_perftest / payload per logical byte, computed)")
            if "delta_base_bytes" in tr:
                print(f"{n} nodes, delta syncs: the trainer's base {tr['delta_base_bytes'] / 1e9:.3f} GB")
        if "full" in entry and "delta" in entry:
            r = entry["delta"]["last"]["median"] / entry["full"]["last"]["median"]
            entry["ratio_delta_vs_full"] = r
            print(f"{n} nodes: delta / full, last node's logical rate (medians): {r:.2f} (issue #31: >= 8 on 2 nodes "
                  f"at 10 Gbit/s, 2 % changed)")
        result["delta"][str(n)] = entry
    result["machine"]["loadavg_after"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
