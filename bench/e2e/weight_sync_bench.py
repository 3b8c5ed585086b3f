#!/usr/bin/env python3
"""End-to-end weight-sync benchmark: shmcast against the paths RL frameworks use today.

One invocation moves a model's state dict (default: Qwen2.5-3B bf16, 434 tensors,
6.17 GB, random bits) from a trainer process to an inference process whose
parameters are preallocated, and measures:

  a         CPU staging as ROLL's ROLL_WEIGHT_SYNC_USE_CPU fallback does it: 1 GiB
            buckets, D2H to pageable memory, .numpy(), ForkingPickler into bytes,
            a Unix socket to the other process, unpickle, H2D, copy into params.
            One bucket in flight, as ROLL's ray.get(refs) before the next send.
  b-legacy  torch CUDA IPC of the same buckets (ForkingPickler of the CUDA
            tensor), trainer allocating with plain cudaMalloc segments;
  b-exp     the same with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
            (opening such a handle calls pidfd_getfd);
  c         shmcast through its Python API: Producer.send / Consumer.receive_into;
  d         single-process ceilings: pinned D2H, pinned H2D, both at once.

plus fan-out (one producer, consumers on two GPUs), a trainer-loop mode
(sync inside real AdamW training steps of a small transformer), and every
two-process path again under Docker's default seccomp profile through
shmcast-seccomp-run. Processes are started with subprocess (never fork after
CUDA init). Every sync carries fresh random bytes (the trainer re-randomises
its weights before each repetition, outside the timed region, and the receiver
poisons its parameters) and is checked bit-exact after its timer stopped, with
per-tensor checksums computed on the device on both sides; any mismatch makes
the bench exit 1. Every figure is the median of --reps-fast (paths b, c,
fan-out) or --reps (path a) timed syncs, with min and max; the shmcast rows
are compared against the copy ceilings measured again in the trainer process
right before them.

  python3 bench/e2e/weight_sync_bench.py --out OUT            # GPU, everything
  python3 bench/e2e/weight_sync_bench.py --device cpu --small # CPU smoke run
  python3 bench/e2e/weight_sync_bench.py --only c,a           # some paths only
  python3 bench/e2e/weight_sync_bench.py report OUT/results.json --md T.md --png C.png

Needs `import shmcast` (PYTHONPATH=<build>/python) for path c.
"""
from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import pickle
import platform
import shlex
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
GiB = 1 << 30
MiB = 1 << 20

ALL_SELECT = ("d", "a", "b-legacy", "b-exp", "c", "fanout", "loop", "seccomp")


# --------------------------------------------------------------------------- manifests

def qwen25_3b_manifest():
    """Qwen2.5-3B (tied embeddings): 434 bf16 tensors, 6,171,877,376 bytes."""
    from shmcast.manifests import qwen25_3b_shapes
    return [(n, s, "bf16") for n, s in qwen25_3b_shapes()]


def small_manifest():
    """Same structure, scaled down (4 layers, ~14 MB): for CPU smoke runs."""
    from shmcast.manifests import QWEN2_SMALL, qwen2_shapes
    return [(n, s, "bf16") for n, s in qwen2_shapes(**QWEN2_SMALL)]


def manifest_bytes(manifest):
    total = 0
    for _n, shape, dt in manifest:
        k = 1
        for d in shape:
            k *= d
        total += k * {"bf16": 2, "f16": 2, "f32": 4}[dt]
    return total


# --------------------------------------------------------------------------- framing

_HDR = struct.Struct("!BQ")  # kind (0 pickled control object, 1 raw bytes), length


class Chan:
    """Length-prefixed frames over a connected SOCK_STREAM Unix socket."""

    def __init__(self, sock):
        self.s = sock

    def send_obj(self, obj):
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self.s.sendall(_HDR.pack(0, len(data)) + data)

    def send_bytes(self, data):
        mv = memoryview(data).cast("B")
        self.s.sendall(_HDR.pack(1, mv.nbytes))
        self.s.sendall(mv)

    def _exact(self, n):
        buf = bytearray(n)
        mv = memoryview(buf)
        got = 0
        while got < n:
            r = self.s.recv_into(mv[got:], min(n - got, 1 << 24))
            if r == 0:
                raise ConnectionError("peer closed the connection")
            got += r
        return buf

    def recv(self, timeout=None):
        self.s.settimeout(timeout)
        try:
            kind, n = _HDR.unpack(bytes(self._exact(_HDR.size)))
            return kind, self._exact(n)
        finally:
            self.s.settimeout(None)

    def recv_obj(self, timeout=None):
        kind, payload = self.recv(timeout)
        if kind != 0:
            raise RuntimeError(f"protocol: expected a control frame, got {len(payload)} raw bytes")
        return pickle.loads(payload)


def describe(e: BaseException, limit=700) -> str:
    """One-line error text; keeps the line that names pidfd_getfd if any."""
    text = f"{type(e).__name__}: {e}"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    key = [ln for ln in lines if "pidfd" in ln or "Operation not permitted" in ln]
    first = lines[0] if lines else text
    out = first if not key or key[0] == first else f"{first} ... {key[0]}"
    return out[:limit]


def now():
    return time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the machine


# --------------------------------------------------------------------------- torch helpers (workers only)

def _torch():
    import torch
    return torch


_DT = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}
_W_CACHE = {}
_CHUNK = 1 << 24


def _weights(dev):
    """Random odd int64 weights, the same in every process (CPU generator, fixed
    seed), cached per device."""
    torch = _torch()
    w = _W_CACHE.get(dev)
    if w is None:
        g = torch.Generator()
        g.manual_seed(0x5EED)
        w = torch.randint(-(1 << 62), 1 << 62, (_CHUNK,), generator=g, dtype=torch.int64) * 2 + 1
        w = _W_CACHE[dev] = w.to(dev)
    return w


def checksums(tensors):
    """Per-tensor (sum, weighted sum) of the raw bits as int64 (wrapping
    arithmetic, so the result does not depend on reduction order). The weights
    are random odd 64-bit words (times 2k + 1 for the k-th 16 Mi-element chunk),
    so a change of any single word always changes the weighted sum, and any other
    change does so but with probability about 2^-64. Computed on the tensors'
    device; one host transfer for the whole list."""
    torch = _torch()
    out = []
    for t in tensors:
        v = t.detach().reshape(-1)
        nb = v.numel() * v.element_size()
        v = v.view(torch.int32) if nb % 4 == 0 else v.view(torch.int16) if nb % 2 == 0 else v.view(torch.uint8)
        dev = v.device
        w = _weights(dev)
        s1 = torch.zeros((), dtype=torch.int64, device=dev)
        s2 = torch.zeros((), dtype=torch.int64, device=dev)
        for k, off in enumerate(range(0, v.numel(), _CHUNK)):
            c = v[off:off + _CHUNK].to(torch.int64)
            s1 += c.sum()
            s2 += (c * w[: c.numel()]).sum() * (2 * k + 1)
        out.append(torch.stack([s1, s2]))
    if not out:
        return []
    return [tuple(r) for r in torch.stack(out).cpu().tolist()]


def make_buckets(named, bucket_bytes):
    """Greedy buckets of whole tensors up to bucket_bytes (a larger tensor goes alone)."""
    cur, size = [], 0
    for name, t in named:
        nb = t.numel() * t.element_size()
        if cur and size + nb > bucket_bytes:
            yield cur
            cur, size = [], 0
        cur.append((name, t))
        size += nb
    if cur:
        yield cur


def bucket_named_tensors(named):
    """ROLL's _bucket_named_tensors: flatten each tensor to int8 bytes, torch.cat."""
    torch = _torch()
    meta, flats, idx = [], [], 0
    for name, t in named:
        f = t.flatten().view(torch.int8)
        meta.append({"name": name, "shape": list(t.shape), "dtype": t.dtype, "start_idx": idx,
                     "end_idx": idx + f.numel(), "numel": f.numel()})
        flats.append(f)
        idx += f.numel()
    return torch.cat(flats, dim=0), meta


def unpack_bucket(bucket, meta, params):
    """ROLL's named_tensors_from_bucket + load_weights: copy into the preallocated params."""
    torch = _torch()
    for m in meta:
        p = params[m["name"]]
        p.view(-1).view(torch.int8).copy_(bucket[m["start_idx"]:m["end_idx"]])


def sync_device(dev):
    torch = _torch()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def cuda_check(dev):
    """Does CUDA work in this process (e.g. under a seccomp profile)?"""
    torch = _torch()
    info = {"torch": torch.__version__, "pid": os.getpid(),
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
    try:
        info["seccomp_mode"] = next((ln.split()[1] for ln in open("/proc/self/status") if ln.startswith("Seccomp:")),
                                    "?")
    except OSError:
        info["seccomp_mode"] = "?"
    if dev.type != "cuda":
        info["cuda"] = "not used (cpu)"
        return info
    try:
        a = torch.randn(512, 512, device=dev)
        ref = a.double().cpu() @ a.double().cpu()
        err = ((a @ a).double().cpu() - ref).abs().max().item() / ref.abs().max().item()
        ok = err < 1e-3
        info.update(cuda="ok" if ok else f"matmul relative error {err:.2e}", device_name=torch.cuda.get_device_name(dev),
                    device_count=torch.cuda.device_count(), cuda_version=torch.version.cuda)
    except Exception as e:  # noqa: BLE001
        info["cuda"] = "FAILED: " + describe(e)
    return info


def alloc_params(manifest, dev):
    torch = _torch()
    return {n: torch.empty(s, dtype=getattr(torch, _DT[dt]), device=dev) for n, s, dt in manifest}


def randomize(tensors, gen=None):
    torch = _torch()
    for t in tensors:
        t.view(-1).view(torch.int16).random_(-32768, 32767, generator=gen)


def poison(tensors):
    torch = _torch()
    for t in tensors:
        t.view(-1).view(torch.int16).fill_(-1)


# --------------------------------------------------------------------------- inference (peer) process

def peer_main(cfg):
    torch = _torch()
    import torch.multiprocessing  # noqa: F401  (registers torch's CUDA IPC reductions)
    from multiprocessing.reduction import ForkingPickler

    dev = torch.device(cfg["device"])
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = now() + 60
    while True:
        try:
            sock.connect(cfg["sock"])
            break
        except OSError:
            if now() > deadline:
                raise
            time.sleep(0.05)
    ch = Chan(sock)
    ch.send_obj({"hello": cfg["index"], "pid": os.getpid(), "device": str(dev)})
    params = {}
    cons = None
    shm = None
    # SHMCAST_BENCH_CORRUPT=i: flip a bit of the first parameter after this process's
    # round i (0-based), after its timer stopped: a self-test of the check (exit 1)
    corrupt = int(os.environ.get("SHMCAST_BENCH_CORRUPT", "-1") or -1)
    rounds = 0

    def recv_buckets(path):
        err, nb = None, 0
        while True:
            kind, payload = ch.recv()
            if kind == 0:
                if pickle.loads(payload).get("end"):
                    return err
                continue
            if err is not None:
                continue  # drain the round after a failure
            try:
                obj = ForkingPickler.loads(payload)  # path b: opens the CUDA IPC handle here
                del payload
                bucket = obj["bucket"]
                if path == "a":
                    bucket = torch.from_numpy(bucket).to(dev)  # H2D from pageable memory
                unpack_bucket(bucket, obj["tensors_meta"], params)
                if path == "b":
                    sync_device(dev)  # the bucket is the trainer's memory: done reading before the ack
                del obj, bucket
                ch.send_obj({"ack": nb})
            except Exception as e:  # noqa: BLE001
                err = describe(e)
                ch.send_obj({"error": err, "traceback": traceback.format_exc()[-2000:]})
            nb += 1

    while True:
        msg = ch.recv_obj()
        op = msg["op"]
        try:
            if op == "exit":
                ch.send_obj({"ok": True})
                break
            elif op == "check_cuda":
                ch.send_obj(cuda_check(dev))
            elif op == "alloc":
                params = {}
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                params = alloc_params(msg["manifest"], dev)
                ch.send_obj({"ok": True})
            elif op == "open_c":
                if shm is None:
                    import shmcast as shm  # noqa: F811
                t = now()
                cons = shm.Consumer(msg["region"], device=str(dev), open_timeout=60.0)
                ch.send_obj({"ok": True, "open_s": now() - t, "pinned": bool(getattr(cons, "pinned", False)),
                             "seat": getattr(cons, "seat", None)})
            elif op == "close_c":
                if cons is not None:
                    cons.close()
                cons = None
                ch.send_obj({"ok": True})
            elif op == "round":
                path = msg["path"]
                poison(params.values())
                sync_device(dev)
                ch.send_obj({"ready": True})
                err = None
                try:
                    if path in ("a", "b"):
                        err = recv_buckets(path)
                    elif path == "c":
                        cons.receive_into(params, timeout=msg.get("timeout", 60.0))
                    else:
                        raise ValueError(f"unknown path {path}")
                    sync_device(dev)
                except Exception as e:  # noqa: BLE001
                    err = describe(e)
                t_done = now()
                if rounds == corrupt and params:
                    b = next(iter(params.values())).view(-1).view(torch.uint8)
                    b[b.numel() // 3] ^= 1
                rounds += 1
                ch.send_obj({"done": t_done, "error": err})
                sums = None
                if err is None and msg.get("verify", True):
                    sums = checksums(list(params.values()))
                ch.send_obj({"sums": sums})
            else:
                raise ValueError(f"unknown op {op}")
        except Exception as e:  # noqa: BLE001
            ch.send_obj({"error": describe(e), "traceback": traceback.format_exc()[-2000:]})
    if cons is not None:
        cons.close()
    sock.close()


# --------------------------------------------------------------------------- trainer process

class Trainer:
    def __init__(self, cfg):
        torch = _torch()
        import torch.multiprocessing  # noqa: F401

        self.torch = torch
        self.cfg = cfg
        self.dev = torch.device(cfg["device"])
        if self.dev.type == "cuda":
            torch.cuda.set_device(self.dev)
        self.results = {"group": cfg["group"], "tasks": [], "peers": [], "trainer": {}}
        self.out = cfg["result_file"]
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(cfg["sock"])
        srv.listen(8)
        srv.settimeout(cfg.get("connect_timeout", 60))
        self.chans = [None] * cfg["npeers"]
        for _ in range(cfg["npeers"]):
            s, _addr = srv.accept()
            ch = Chan(s)
            hello = ch.recv_obj(timeout=30)
            self.chans[hello["hello"]] = ch
            self.results["peers"].append(hello)
        srv.close()
        self.shm = None
        self.region_n = 0

    # ---- helpers
    def save(self):
        tmp = self.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.results, f, indent=1, default=str)
        os.replace(tmp, self.out)

    def ask(self, idx, msg, timeout=None):
        self.chans[idx].send_obj(msg)
        rep = self.chans[idx].recv_obj(timeout=timeout)
        if isinstance(rep, dict) and "error" in rep and len(rep) <= 2:
            raise RuntimeError(f"peer {idx}: {rep['error']}")
        return rep

    def shmcast(self):
        if self.shm is None:
            import shmcast
            self.shm = shmcast
        return self.shm

    def new_region(self):
        self.region_n += 1
        return f"e2e-{os.getpid()}-{self.region_n}"

    # ---- one sync round, timed from the trainer's start to the last peer's done
    def round(self, path, named, peers, ref_sums, prod=None, bucket_bytes=GiB, verify=True):
        torch = self.torch
        for i in peers:
            self.chans[i].send_obj({"op": "round", "path": path[0], "verify": verify})
        for i in peers:
            rep = self.chans[i].recv_obj(timeout=120)
            if not rep.get("ready"):
                raise RuntimeError(f"peer {i} not ready: {rep}")
        sync_device(self.dev)
        t0 = now()
        terr = None
        try:
            if path[0] in ("a", "b"):
                terr = self.send_buckets(path[0], named, peers, bucket_bytes)
            else:
                prod.send(named)
        except Exception as e:  # noqa: BLE001  (send_buckets ends its rounds itself)
            terr = "trainer: " + describe(e)
        t_send = now() - t0
        dones = {}
        for i in peers:
            dones[i] = self.chans[i].recv_obj(timeout=300)
        sums = {}
        for i in peers:
            sums[i] = self.chans[i].recv_obj(timeout=300).get("sums")
        if ref_sums is None and verify:
            ref_sums = checksums([t for _n, t in named])
        errs = [terr] if terr else []
        errs += [f"peer {i}: {d['error']}" for i, d in dones.items() if d.get("error")]
        per_peer = {i: dones[i]["done"] - t0 for i in peers}
        exact = {i: (sums[i] == ref_sums) if (verify and sums[i] is not None) else None for i in peers}
        if path[0] == "b":
            torch.cuda.ipc_collect()
        return {"seconds": max(per_peer.values()), "per_peer": per_peer, "send_s": t_send,
                "bit_exact": exact, "errors": errs}

    def send_buckets(self, path, named, peers, bucket_bytes):
        """ROLL-style: serialize bucket k+1 while the peer loads bucket k; wait for
        k's ack before sending k+1 (ray.get(refs) before the next call)."""
        from multiprocessing.reduction import ForkingPickler
        torch = self.torch
        err, inflight = None, None

        def wait_acks():
            e = None
            for i in peers:
                rep = self.chans[i].recv_obj(timeout=300)
                if "error" in rep:
                    e = e or f"peer {i}: {rep['error']}"
            return e

        try:
            for group in make_buckets(named, bucket_bytes):
                flat, meta = bucket_named_tensors(group)
                if path == "a":
                    obj = {"bucket": flat.detach().to("cpu").contiguous().numpy(), "tensors_meta": meta}
                    flat = None
                else:
                    obj = {"bucket": flat, "tensors_meta": meta}
                buf = io.BytesIO()
                ForkingPickler(buf).dump(obj)  # MultiprocessingSerializer.serialize
                payload = buf.getvalue()
                del buf, obj
                if inflight is not None:
                    err = wait_acks()
                    inflight = None
                    if err:
                        break
                for i in peers:
                    self.chans[i].send_bytes(payload)
                inflight = flat if flat is not None else True
                del payload
            if inflight is not None and err is None:
                err = wait_acks()
        except Exception as e:  # noqa: BLE001
            err = "trainer: " + describe(e)
        inflight = None
        for i in peers:
            self.chans[i].send_obj({"end": True})
        if path == "b" and torch.cuda.is_available():
            torch.cuda.synchronize()
        return err

    # ---- tasks
    def weights(self, manifest):
        torch = self.torch
        w = getattr(self, "_w", None)
        if w is None or self._wm != manifest:
            self._w = None
            if self.dev.type == "cuda":
                torch.cuda.empty_cache()
            self._w = alloc_params(manifest, self.dev)
            self._wm = manifest
        return self._w

    def task_check(self, task):
        rec = {"kind": "check", "label": task.get("label"), "trainer": cuda_check(self.dev), "peers": {}}
        for i in range(len(self.chans)):
            rec["peers"][i] = self.ask(i, {"op": "check_cuda"}, timeout=120)
        return rec

    def open_consumers(self, prod, region, peers):
        info = {}
        for i in peers:
            info[i] = self.ask(i, {"op": "open_c", "region": region}, timeout=120)
        prod.wait_for_consumers(len(peers), timeout=60)
        return info

    def close_consumers(self, peers):
        for i in peers:
            self.ask(i, {"op": "close_c"}, timeout=60)

    def new_producer(self, slot_mb, slots, max_consumers=2):
        shm = self.shmcast()
        region = self.new_region()
        t = now()
        prod = shm.Producer(region, slot_bytes=slot_mb * MiB, slots=slots, max_consumers=max_consumers)
        return prod, region, now() - t

    def task_sync(self, task):
        torch = self.torch
        path = task["path"]
        manifest = self.cfg["manifest"]
        nbytes = manifest_bytes(manifest)
        rec = {"kind": "sync", "label": task["label"], "path": path, "bytes": nbytes, "tensors": len(manifest),
               "warmup": task["warmup"], "reps": task["reps"], "runs": [], "errors": []}
        named = list(self.weights(manifest).items())
        peers = list(range(len(self.chans)))
        for i in peers:
            self.ask(i, {"op": "alloc", "manifest": manifest}, timeout=300)
        prod = None
        try:
            if task.get("ceiling_reps") and self.dev.type == "cuda":
                # this configuration's ceiling, measured in this process right before it
                try:
                    rec["ceiling"] = copy_ceilings(self.dev, task["ceiling_mb"] * MiB, task["ceiling_reps"])
                except Exception as e:  # noqa: BLE001
                    rec["ceiling"] = {"errors": [describe(e)]}
            if path == "c":
                prod, region, create_s = self.new_producer(task["slot_mb"], task["slots"])
                rec.update(slot_mb=task["slot_mb"], slots=task["slots"], create_s=create_s,
                           producer_pinned=bool(getattr(prod, "pinned", False)),
                           pin_s=getattr(prod.raw, "pin_seconds", None) if hasattr(prod, "raw") else None)
                rec["consumers"] = self.open_consumers(prod, region, peers)
            gen = torch.Generator(device=self.dev)
            gen.manual_seed(1234)
            for rep in range(task["warmup"] + task["reps"]):
                randomize([t for _n, t in named], gen)
                sync_device(self.dev)
                ref = checksums([t for _n, t in named])
                r = self.round(path, named, peers, ref, prod=prod, bucket_bytes=task.get("bucket_bytes", GiB))
                r["warmup"] = rep < task["warmup"]
                rec["runs"].append(r)
                if r["errors"]:
                    rec["errors"] += r["errors"]
                    break  # a failing path fails the same way every time
            if prod is not None:
                ls = prod.last_layout
                rec["sent"] = {k: getattr(ls, k, None) for k in ("version", "chunks", "stream_bytes", "payload_bytes")}
                self.close_consumers(peers)
        except Exception as e:  # noqa: BLE001
            rec["errors"].append("trainer: " + describe(e))
            rec["traceback"] = traceback.format_exc()[-3000:]
        finally:
            if prod is not None:
                prod.close()
        summarize(rec)
        return rec

    def task_fanout(self, task):
        """Producer on the trainer's GPU; consumer 0 on cuda:0, consumer 1 on cuda:1.
        Phases: consumer 0 alone, consumer 1 alone, both. Then D2H bytes of one
        profiled sync with one and with two consumers (host copy made once?)."""
        torch = self.torch
        manifest = self.cfg["manifest"]
        nbytes = manifest_bytes(manifest)
        rec = {"kind": "fanout", "label": task["label"], "bytes": nbytes, "slot_mb": task["slot_mb"],
               "slots": task["slots"], "warmup": task["warmup"], "reps": task["reps"], "phases": {}, "errors": [],
               "peer_devices": {i: p["device"] for i, p in enumerate(self.results["peers"])}}
        named = list(self.weights(manifest).items())
        for i in range(len(self.chans)):
            self.ask(i, {"op": "alloc", "manifest": manifest}, timeout=300)
        prod = None
        try:
            prod, region, _ = self.new_producer(task["slot_mb"], task["slots"], max_consumers=2)
            gen = torch.Generator(device=self.dev)
            gen.manual_seed(99)
            opened = set()
            for phase, members in (("single0", [0]), ("single1", [1]), ("both", [0, 1])):
                for i in sorted(opened - set(members)):
                    self.close_consumers([i])
                    opened.discard(i)
                for i in members:
                    if i not in opened:
                        self.ask(i, {"op": "open_c", "region": region}, timeout=120)
                        opened.add(i)
                prod.wait_for_consumers(len(members), timeout=60)
                runs = []
                for rep in range(task["warmup"] + task["reps"]):
                    randomize([t for _n, t in named], gen)
                    sync_device(self.dev)
                    ref = checksums([t for _n, t in named])
                    r = self.round("c", named, members, ref, prod=prod)
                    r["warmup"] = rep < task["warmup"]
                    runs.append(r)
                    if r["errors"]:
                        rec["errors"] += r["errors"]
                        break
                ph = {"members": members, "runs": runs}
                good = [r for r in runs if not r["warmup"] and not r["errors"]]
                for i in members:
                    ts = [r["per_peer"][i] for r in good]
                    if ts:
                        med = statistics.median(ts)
                        ph[f"peer{i}_median_s"] = med
                        ph[f"peer{i}_min_s"], ph[f"peer{i}_max_s"] = min(ts), max(ts)
                        ph[f"peer{i}_gbps"] = nbytes / med / 1e9
                timed = [r for r in runs if not r["warmup"]]
                ph["verified"] = f"{sum(run_exact(r) for r in timed)}/{len(timed)}"
                ph["mismatch"] = any(run_mismatch(r) for r in runs)
                ph["bit_exact"] = bool(good) and all(run_exact(r) for r in good)
                if phase in ("single0", "both"):
                    ph["d2h"] = self.profiled_d2h(prod, named, members)
                ls = prod.last_layout
                ph["sent"] = {k: getattr(ls, k, None) for k in ("version", "chunks", "stream_bytes", "payload_bytes")}
                rec["phases"][phase] = ph
                self.save()
            self.close_consumers(sorted(opened))
        except Exception as e:  # noqa: BLE001
            rec["errors"].append("trainer: " + describe(e))
            rec["traceback"] = traceback.format_exc()[-3000:]
        finally:
            if prod is not None:
                prod.close()
        p = rec["phases"]
        for i in (0, 1):
            s, b = p.get(f"single{i}", {}).get(f"peer{i}_gbps"), p.get("both", {}).get(f"peer{i}_gbps")
            if s and b:
                rec[f"peer{i}_ratio"] = b / s
        return rec

    def profiled_d2h(self, prod, named, members):
        """Bytes copied device-to-host in this process during one sync, read from a
        torch.profiler (CUPTI) trace: equals the model's bytes when the host copy is
        made once, whatever the number of consumers."""
        torch = self.torch
        if self.dev.type != "cuda":
            return {"skipped": "cpu"}
        try:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                r = self.round("c", named, members, None, prod=prod)
                torch.cuda.synchronize()
            fd, path = tempfile.mkstemp(suffix=".json")
            os.close(fd)
            prof.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)
            os.unlink(path)
            d2h = h2d = n = 0
            for ev in trace.get("traceEvents", []):
                if ev.get("cat") != "gpu_memcpy":
                    continue
                b = (ev.get("args") or {}).get("bytes", 0) or 0
                nm = ev.get("name", "")
                if "DtoH" in nm:
                    d2h += b
                    n += 1
                elif "HtoD" in nm:
                    h2d += b
            return {"d2h_bytes": d2h, "d2h_copies": n, "h2d_bytes_this_process": h2d, "consumers": len(members),
                    "bit_exact": r["bit_exact"], "errors": r["errors"]}
        except Exception as e:  # noqa: BLE001
            return {"error": describe(e)}

    def task_loop(self, task):
        """Real training steps (AdamW) on a small transformer; after each step the
        weights (bf16 copies) go to the inference process by `path`."""
        torch = self.torch
        nn = torch.nn
        path = task["path"]
        small = self.cfg["small"]
        dev = self.dev
        if small or dev.type != "cuda":
            d, heads, ff, layers, vocab, batch, seq, micro = 64, 4, 256, 2, 512, 4, 32, 1
        else:
            d, heads, ff, layers, vocab, batch, seq, micro = 2048, 16, 8192, 6, 32000, 8, 1024, 4
        rec = {"kind": "loop", "label": task["label"], "path": path, "errors": [], "steps": [],
               "model": dict(d_model=d, heads=heads, ffn=ff, layers=layers, vocab=vocab, batch=batch, seq=seq,
                             micro_batches=micro, optimizer="AdamW", precision="bf16 autocast, fp32 master"
                             if dev.type == "cuda" else "fp32")}

        class LM(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(vocab, d)
                self.blocks = nn.ModuleList([
                    nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, activation="gelu", batch_first=True,
                                               norm_first=True) for _ in range(layers)])
                self.norm = nn.LayerNorm(d)
                self.head = nn.Linear(d, vocab, bias=False)

            def forward(self, x):
                h = self.embed(x)
                for b in self.blocks:
                    h = b(h)
                return self.head(self.norm(h))

        prod = None
        try:
            torch.manual_seed(0)
            self._w = None  # free the big state dict of the sync tasks
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            model = LM().to(dev)
            try:
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda")
            except (TypeError, RuntimeError):
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            manifest = [(n, tuple(p.shape), "bf16") for n, p in model.named_parameters()]
            rec["sync_bytes"] = manifest_bytes(manifest)
            rec["params"] = sum(p.numel() for p in model.parameters())
            peers = list(range(len(self.chans)))
            for i in peers:
                self.ask(i, {"op": "alloc", "manifest": manifest}, timeout=300)
            if path == "c":
                prod, region, _ = self.new_producer(task["slot_mb"], task["slots"])
                self.open_consumers(prod, region, peers)
            lossf = nn.CrossEntropyLoss()
            for step in range(task["warmup"] + task["steps"]):
                sync_device(dev)
                t0 = now()
                opt.zero_grad(set_to_none=True)
                for _ in range(micro):
                    x = torch.randint(0, vocab, (batch, seq), device=dev)
                    y = torch.randint(0, vocab, (batch, seq), device=dev)
                    if dev.type == "cuda":
                        with torch.autocast("cuda", dtype=torch.bfloat16):
                            logits = model(x)
                    else:
                        logits = model(x)
                    loss = lossf(logits.float().reshape(-1, vocab), y.reshape(-1)) / micro
                    loss.backward()
                opt.step()
                sync_device(dev)
                t_step = now() - t0
                # the sync, timed from here: bf16 copies of the weights, then the transfer
                t1 = now()
                named = [(n, p.detach().to(torch.bfloat16)) for n, p in model.named_parameters()]
                sync_device(dev)
                t_cast = now() - t1
                r = self.round(path, named, peers, None, prod=prod)
                # casts + the transfer (round's own timer: trainer start to the receiver's stream
                # synchronize), not the checksums that round computes after it
                t_sync = t_cast + r["seconds"]
                rec["steps"].append({"step_s": t_step, "sync_s": t_sync, "cast_s": t_cast,
                                     "loss": float(loss.item()) * micro, "bit_exact": run_exact(r),
                                     "mismatch": run_mismatch(r), "warmup": step < task["warmup"],
                                     "errors": r["errors"]})
                del named
                if r["errors"]:
                    rec["errors"] += r["errors"]
                    break
            if path == "c":
                self.close_consumers(peers)
        except Exception as e:  # noqa: BLE001
            rec["errors"].append("trainer: " + describe(e))
            rec["traceback"] = traceback.format_exc()[-3000:]
        finally:
            if prod is not None:
                prod.close()
        good = [s for s in rec["steps"] if not s["warmup"] and not s["errors"]]
        if good:
            st = statistics.median(s["step_s"] for s in good)
            sy = statistics.median(s["sync_s"] for s in good)
            rec.update(step_median_s=st, sync_median_s=sy, sync_share=sy / (st + sy),
                       sync_min_s=min(s["sync_s"] for s in good), sync_max_s=max(s["sync_s"] for s in good),
                       bit_exact=all(s["bit_exact"] for s in good), measured_steps=len(good),
                       sync_gbps=rec["sync_bytes"] / sy / 1e9)
        timed = [s for s in rec["steps"] if not s["warmup"]]
        rec["verified"] = f"{sum(s['bit_exact'] for s in timed)}/{len(timed)}"
        rec["mismatch"] = any(s.get("mismatch") for s in rec["steps"])
        return rec

    def run(self):
        self.results["trainer"] = {"pid": os.getpid(), "device": str(self.dev)}
        self.save()
        for task in self.cfg["tasks"]:
            t = now()
            try:
                rec = getattr(self, "task_" + task["kind"])(task)
            except Exception as e:  # noqa: BLE001
                rec = {"kind": task["kind"], "label": task.get("label"), "errors": ["trainer: " + describe(e)],
                       "traceback": traceback.format_exc()[-3000:]}
            rec["wall_s"] = now() - t
            self.results["tasks"].append(rec)
            self.save()
            if any("ConnectionError" in e or "BrokenPipe" in e for e in rec.get("errors", [])):
                break  # a peer is gone: the rest of the group cannot run
        for i, ch in enumerate(self.chans):
            try:
                self.ask(i, {"op": "exit"}, timeout=30)
            except Exception:  # noqa: BLE001
                pass
        self.save()


def run_exact(r):
    return bool(r["bit_exact"]) and all(v is True for v in r["bit_exact"].values())


def run_mismatch(r):
    """A sync whose checksums were compared and differed (not a sync that failed)."""
    return any(v is False for v in r["bit_exact"].values())


def summarize(rec):
    good = [r for r in rec["runs"] if not r["warmup"] and not r["errors"]]
    rec["ok"] = bool(good) and not rec["errors"] and len(good) >= rec["reps"]
    if good:
        secs = [r["seconds"] for r in good]
        rec["seconds"] = secs
        rec["median_s"] = statistics.median(secs)
        rec["min_s"], rec["max_s"] = min(secs), max(secs)
        rec["gbps"] = rec["bytes"] / rec["median_s"] / 1e9
        rec["gbps_min"], rec["gbps_max"] = rec["bytes"] / rec["max_s"] / 1e9, rec["bytes"] / rec["min_s"] / 1e9
        cb = (rec.get("ceiling") or {}).get("both_gbps")
        if cb:
            rec["ratio"] = rec["gbps"] / cb
    timed = [r for r in rec["runs"] if not r["warmup"]]
    rec["verified"] = f"{sum(run_exact(r) for r in timed)}/{len(timed)}"
    rec["mismatch"] = any(run_mismatch(r) for r in rec["runs"])
    rec["bit_exact"] = bool(good) and all(run_exact(r) for r in rec["runs"] if not r["errors"])


# --------------------------------------------------------------------------- ceilings process (d)

def copy_ceilings(dev, n, reps):
    """Pinned D2H alone, H2D alone and both at once on two streams (bytes each way
    / time until both finish), n bytes per copy, `reps` copies after 1 warm-up,
    CUDA events. GB/s: median under each name, with _min, _max and _all."""
    torch = _torch()
    out = {}
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    src.random_(0, 256)
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    t = now()
    ha = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    hb = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    out["pin_alloc_s_per_gib"] = (now() - t) / (2 * n / GiB)
    ha.fill_(1)
    hb.fill_(0x33)
    torch.cuda.synchronize()  # src's random fill ran on the default stream
    s1, s2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    gb = lambda ms: n / (ms * 1e-3) / 1e9  # noqa: E731
    d2h, h2d, both, bd, bh = [], [], [], [], []
    for i in range(reps + 1):
        with torch.cuda.stream(s1):
            ev[0].record(s1)
            ha.copy_(src, non_blocking=True)
            ev[1].record(s1)
        ev[1].synchronize()
        if i:
            d2h.append(gb(ev[0].elapsed_time(ev[1])))
    for i in range(reps + 1):
        with torch.cuda.stream(s2):
            ev[0].record(s2)
            dst.copy_(hb, non_blocking=True)
            ev[1].record(s2)
        ev[1].synchronize()
        if i:
            h2d.append(gb(ev[0].elapsed_time(ev[1])))
    for i in range(reps + 1):
        ev[0].record(s1)
        s2.wait_event(ev[0])
        with torch.cuda.stream(s1):
            ha.copy_(src, non_blocking=True)
        with torch.cuda.stream(s2):
            dst.copy_(hb, non_blocking=True)
        ev[1].record(s1)
        ev[2].record(s2)
        ev[1].synchronize()
        ev[2].synchronize()
        m1, m2 = ev[0].elapsed_time(ev[1]), ev[0].elapsed_time(ev[2])
        if i:
            bd.append(gb(m1))
            bh.append(gb(m2))
            both.append(gb(max(m1, m2)))
    out.update(bytes=n, reps=reps)
    for k, xs in (("d2h", d2h), ("h2d", h2d), ("both", both), ("both_d2h", bd), ("both_h2d", bh)):
        out[f"{k}_gbps"] = statistics.median(xs)
        out[f"{k}_gbps_min"] = min(xs)
        out[f"{k}_gbps_max"] = max(xs)
        out[f"{k}_all"] = xs
    del src, dst, ha, hb
    torch.cuda.empty_cache()
    return out


def ceilings_main(cfg):
    torch = _torch()
    out = {"kind": "ceilings", "errors": []}
    try:
        dev = torch.device(cfg["device"])
        torch.cuda.set_device(dev)
        out["check"] = cuda_check(dev)
        out["device_count"] = torch.cuda.device_count()
        out["device_names"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        n = cfg["ceiling_bytes"]
        out.update(copy_ceilings(dev, n, cfg["ceiling_reps"]))
        # pageable, for context: what path (a) copies through
        med = statistics.median
        src = torch.empty(n, dtype=torch.uint8, device=dev)
        src.fill_(3)
        dst = torch.empty_like(src)
        pg = torch.empty(n, dtype=torch.uint8)
        pg.fill_(7)
        pd, ph = [], []
        for i in range(3):
            torch.cuda.synchronize()
            t = now()
            pg.copy_(src)
            torch.cuda.synchronize()
            if i:
                pd.append(n / (now() - t) / 1e9)
            t = now()
            dst.copy_(pg)
            torch.cuda.synchronize()
            if i:
                ph.append(n / (now() - t) / 1e9)
        out.update(pageable_d2h_gbps=med(pd), pageable_h2d_gbps=med(ph))
    except Exception as e:  # noqa: BLE001
        out["errors"].append(describe(e))
        out["traceback"] = traceback.format_exc()[-3000:]
    with open(cfg["result_file"], "w") as f:
        json.dump(out, f, indent=1)


# --------------------------------------------------------------------------- orchestrator

def cleanup_regions():
    """Removes region files this bench's killed processes may leave (names e2e-<pid>-<n>)."""
    d = os.environ.get("SHMCAST_DIR") or "/dev/shm"
    try:
        names = os.listdir(d)
    except OSError:
        return
    for n in names:
        if n.startswith("shmcast.e2e-"):
            try:
                pid = int(n.split("-")[1])
                os.kill(pid, 0)  # its producer is alive: leave it
            except ProcessLookupError:
                try:
                    os.unlink(os.path.join(d, n))
                except OSError:
                    pass
            except (ValueError, IndexError, PermissionError):
                pass


def find_seccomp_runner(explicit):
    cands = [explicit, os.environ.get("SHMCAST_SECCOMP_RUN")]
    for b in ("build-e2e", "build", "build-cuda", "build-py"):
        cands.append(os.path.join(REPO, b, "tests", "seccomp", "shmcast-seccomp-run"))
    cands.append(shutil.which("shmcast-seccomp-run"))
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


class Orchestrator:
    def __init__(self, args):
        self.a = args
        self.t_start = now()
        self.out = os.path.abspath(args.out)
        os.makedirs(os.path.join(self.out, "logs"), exist_ok=True)
        self.tmp = tempfile.mkdtemp(prefix="e2e-")
        self.cpu = args.device == "cpu"
        self.small = args.small
        self.manifest = small_manifest() if self.small else qwen25_3b_manifest()
        self.sel = set(ALL_SELECT if args.only in (None, "all") else args.only.split(","))
        bad = self.sel - set(ALL_SELECT)
        if bad:
            raise SystemExit(f"--only: unknown {sorted(bad)}; choose from {','.join(ALL_SELECT)}")
        self.seccomp_run = find_seccomp_runner(args.seccomp_run)
        self.profile = os.path.abspath(args.seccomp_profile)
        self.res = {
            "meta": {
                "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "machine": args.machine or platform.node(),
                "command": "python3 bench/e2e/weight_sync_bench.py " + " ".join(shlex.quote(x) for x in sys.argv[1:]),
                "command_base": "python3 bench/e2e/weight_sync_bench.py" + "".join(
                    " " + shlex.quote(x) for x in strip_args(sys.argv[1:])),
                "device": args.device, "small": self.small, "python": sys.version.split()[0],
                "kernel": platform.release(), "cpus": os.cpu_count(),
                "manifest": {"tensors": len(self.manifest), "bytes": manifest_bytes(self.manifest),
                             "name": "small (4-layer Qwen2.5-like)" if self.small else "Qwen2.5-3B bf16"},
                "seccomp_runner": self.seccomp_run, "seccomp_profile": self.profile,
                "budget_s": args.budget_s, "slot_mb": args.slot_mb, "slots": args.slots,
            },
            "groups": [], "not_run": [],
        }
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,pci.bus_id", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20)
            self.res["meta"]["nvidia_smi"] = q.stdout.strip().splitlines()
        except Exception:  # noqa: BLE001
            pass

    def left(self):
        return self.a.budget_s - (now() - self.t_start)

    def save(self):
        with open(os.path.join(self.out, "results.json"), "w") as f:
            json.dump(self.res, f, indent=1, default=str)

    def log(self, *x):
        print(f"[{now() - self.t_start:7.1f}s]", *x, flush=True)

    def spawn(self, name, role, cfg, env_over, seccomp):
        cfg_path = os.path.join(self.tmp, f"{name}.{role}.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", role, "--cfg", cfg_path]
        if seccomp:
            cmd = [self.seccomp_run, "--profile", self.profile, "--"] + cmd
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        for k, v in env_over.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        logp = os.path.join(self.out, "logs", f"{name}.{role}.log")
        lf = open(logp, "w")
        lf.write("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n" + "".join(
            f"  {k}={env_over[k]}\n" for k in env_over) + "\n")
        lf.flush()
        p = subprocess.Popen(cmd, env=env, stdout=lf, stderr=subprocess.STDOUT, cwd=REPO)
        return p, logp, lf, cmd

    def run_group(self, name, tasks, peer_devices, env_over, seccomp, est_s, trainer_device=None):
        if seccomp and not self.seccomp_run:
            self.res["not_run"].append({"group": name, "why": "shmcast-seccomp-run not found (build target "
                                                              "shmcast-seccomp-run, or pass --seccomp-run)"})
            return None
        if self.left() < est_s:
            self.res["not_run"].append({"group": name, "why": f"time budget: {self.left():.0f}s left, "
                                                              f"needs about {est_s:.0f}s",
                                        "tasks": [t.get("label") for t in tasks]})
            self.log(f"skip {name}: budget")
            return None
        self.log(f"group {name}: {[t.get('label') for t in tasks]} seccomp={seccomp} env={env_over}")
        sock = os.path.join(self.tmp, f"{name}.sock")
        result_file = os.path.join(self.tmp, f"{name}.result.json")
        base = {"sock": sock, "small": self.small, "manifest": self.manifest, "group": name}
        tdev = trainer_device or ("cpu" if self.cpu else "cuda:0")
        procs = [self.spawn(name, "trainer", dict(base, device=tdev, npeers=len(peer_devices), tasks=tasks,
                                                   result_file=result_file), env_over, seccomp)]
        for i, d in enumerate(peer_devices):
            procs.append(self.spawn(name, f"peer{i}", dict(base, device=d, index=i), env_over, seccomp))
        t0 = now()
        limit = max(30.0, min(self.a.group_timeout, self.left() - 5))
        rcs = {}
        timed_out = False
        for p, logp, lf, _cmd in procs:
            try:
                rcs[logp] = p.wait(timeout=max(1.0, limit - (now() - t0)))
            except subprocess.TimeoutExpired:
                timed_out = True
                for q, _l, _f, _c in procs:
                    if q.poll() is None:
                        q.kill()  # our own child, by its Popen handle
                rcs[logp] = p.wait()
        for _p, _l, lf, _c in procs:
            lf.close()
        grp = {"name": name, "seccomp": seccomp, "env": env_over, "peer_devices": peer_devices,
               "trainer_device": tdev, "wall_s": now() - t0, "timed_out": timed_out,
               "commands": [" ".join(shlex.quote(c) for c in cmd) for _p, _l, _f, cmd in procs], "processes": []}
        for p, logp, _lf, _c in procs:
            rc = rcs.get(logp)
            tail = ""
            try:
                with open(logp, errors="replace") as f:
                    tail = f.read()[-1500:]
            except OSError:
                pass
            grp["processes"].append({"log": os.path.basename(logp), "rc": rc, "tail": tail if rc else ""})
        try:
            with open(result_file) as f:
                grp.update(json.load(f))
        except (OSError, ValueError) as e:
            grp["errors"] = [f"no result from the trainer: {describe(e)}"]
        done = {t.get("label") for t in grp.get("tasks", [])}
        missing = [t.get("label") for t in tasks if t.get("label") not in done]
        if missing:
            why = (f"group killed at its time limit ({limit:.0f}s)" if timed_out
                   else "the group ended early (see its processes' rc and log tails)")
            self.res["not_run"].append({"group": name, "why": why, "tasks": missing})
        cleanup_regions()
        self.res["groups"].append(grp)
        self.save()
        for t in grp.get("tasks", []):
            self.log("   ", one_line(t))
        return grp

    def run_ceilings(self):
        result_file = os.path.join(self.tmp, "ceilings.result.json")
        cfg = {"device": "cuda:0", "ceiling_bytes": self.a.ceiling_mb * MiB, "ceiling_reps": self.a.ceiling_reps,
               "result_file": result_file}
        p, logp, lf, cmd = self.spawn("ceilings", "ceilings", cfg, {}, False)
        try:
            p.wait(timeout=min(180, max(30, self.left())))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        lf.close()
        try:
            with open(result_file) as f:
                c = json.load(f)
        except (OSError, ValueError) as e:
            c = {"kind": "ceilings", "errors": [f"no result: {describe(e)}"]}
        c["command"] = " ".join(shlex.quote(x) for x in cmd)
        self.res["ceilings"] = c
        self.save()
        self.log("ceilings:", {k: round(v, 2) for k, v in c.items() if k.endswith("gbps")}, c.get("errors"))
        return c

    def main(self):
        a, sel = self.a, self.sel
        W, R, RF = a.warmup, a.reps, a.reps_fast
        slot, slots = a.slot_mb, a.slots
        ngpu = 0
        plain = not a.seccomp_only
        if not self.cpu and plain:
            if "d" in sel or "fanout" in sel:
                c = self.run_ceilings()
                ngpu = c.get("device_count", 0)
            else:
                ngpu = 1
        pdev = "cpu" if self.cpu else "cuda:0"

        def t_sync(path, label, reps, **kw):
            t = dict(kind="sync", path=path, label=label, warmup=W, reps=reps, slot_mb=slot, slots=slots,
                     bucket_bytes=a.bucket_mb * MiB, **kw)
            if path == "c" and not self.cpu and a.ceiling_reps:
                t.update(ceiling_mb=a.ceiling_mb, ceiling_reps=a.ceiling_reps)
            return t

        big = not self.small
        est_a = (40 if big else 5) * (W + R) / 4
        # 1. default allocator, no seccomp
        tasks = [dict(kind="check", label="cuda-check")]
        if "c" in sel:
            tasks.append(t_sync("c", "c", RF))
        if "b-legacy" in sel and not self.cpu:
            tasks.append(t_sync("b", "b-legacy", RF))
        if "a" in sel:
            tasks.append(t_sync("a", "a", R))
        if "c" in sel and a.slot_sweep:
            for s in [int(x) for x in a.slot_sweep.split(",") if x and int(x) != slot]:
                tasks.append(dict(t_sync("c", f"c-slot{s}", RF), slot_mb=s))
        legacy = {"PYTORCH_CUDA_ALLOC_CONF": None}
        exp = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
        if len(tasks) > 1 and plain:
            self.run_group("main", tasks, [pdev], legacy, False, est_s=20 + (est_a if "a" in sel else 0))
        # 2. expandable segments, no seccomp
        tasks = [dict(kind="check", label="cuda-check")]
        if "b-exp" in sel and not self.cpu:
            tasks.append(t_sync("b", "b-exp", RF))
        if "c" in sel and not self.cpu:
            tasks.append(t_sync("c", "c-exp", RF))
        if len(tasks) > 1 and plain:
            self.run_group("expandable", tasks, [pdev], exp, False, est_s=20)
        # 3. fan-out
        if "fanout" in sel and plain:
            devs = ["cpu", "cpu"] if self.cpu else ["cuda:0", "cuda:1"]
            if not self.cpu and ngpu < 2:
                self.res["not_run"].append({"group": "fanout", "why": f"needs 2 GPUs, this machine has {ngpu}"})
            else:
                self.run_group("fanout", [dict(kind="fanout", label="fanout", warmup=W, reps=RF, slot_mb=slot,
                                               slots=slots)], devs, legacy, False, est_s=30)
        # 4. trainer loop: sync inside real training steps
        if "loop" in sel and plain:
            tasks = []
            if "c" in sel or "a" not in sel:
                tasks.append(dict(kind="loop", path="c", label="loop-c", warmup=2, steps=a.loop_steps,
                                  slot_mb=slot, slots=slots))
            if "a" in sel or "c" not in sel:
                tasks.append(dict(kind="loop", path="a", label="loop-a", warmup=1, steps=max(3, a.loop_steps - 2),
                                  slot_mb=slot, slots=slots))
            self.run_group("loop", tasks, [pdev], legacy, False, est_s=30)
        # 5. the same paths under Docker's default seccomp profile (trainer and inference both)
        if "seccomp" in sel:
            tasks = [dict(kind="check", label="cuda-check")]
            if "b-exp" in sel and not self.cpu:
                tasks.append(t_sync("b", "b-exp", RF))
            if "c" in sel and not self.cpu:
                tasks.append(t_sync("c", "c-exp", RF))
            if len(tasks) > 1:
                self.run_group("seccomp-expandable", tasks, [pdev], exp, True, est_s=20)
            tasks = [dict(kind="check", label="cuda-check")]
            if "c" in sel:
                tasks.append(t_sync("c", "c", RF))
            if "b-legacy" in sel and not self.cpu:
                tasks.append(t_sync("b", "b-legacy", RF))
            if "a" in sel:
                tasks.append(t_sync("a", "a", R))
            self.run_group("seccomp", tasks, [pdev], legacy, True, est_s=20 + (est_a / 2 if "a" in sel else 0))
        self.res["meta"]["wall_s"] = now() - self.t_start
        self.save()
        md = render_markdown(self.res)
        with open(os.path.join(self.out, "results.md"), "w") as f:
            f.write(md)
        print(md)
        try:
            draw_chart(self.res, os.path.join(self.out, "weight_sync_e2e.png"))
            self.log("chart: weight_sync_e2e.png")
        except Exception as e:  # noqa: BLE001
            self.log("no chart here:", describe(e))
        with tarfile.open(os.path.join(self.out, "logs.tar.gz"), "w:gz") as tf:
            tf.add(os.path.join(self.out, "logs"), arcname="logs")
        if not a.keep_logs_dir:
            shutil.rmtree(os.path.join(self.out, "logs"), ignore_errors=True)
        shutil.rmtree(self.tmp, ignore_errors=True)
        bad = mismatches(self.res)
        if bad:
            print("weight_sync_bench: MISMATCH: a receiver got bytes that were not sent: " + ", ".join(bad),
                  file=sys.stderr)
            return 1
        failed = shmcast_failures(self.res)
        if failed:
            print("weight_sync_bench: shmcast runs failed: " + "; ".join(failed), file=sys.stderr)
            return 2
        return 0


def _is_shmcast(label):
    lab = str(label)
    return lab == "c" or lab.startswith("c-") or lab in ("fanout", "loop-c")


def shmcast_failures(res):
    """The shmcast tasks (path c, fan-out, loop-c) that ended with an error."""
    out = []
    for g in res.get("groups", []):
        for t in g.get("tasks", []):
            lab = str(t.get("label"))
            if _is_shmcast(lab) and t.get("errors"):
                out.append(f"{g['name']}/{lab}: {t['errors'][0]}")
    for nr in res.get("not_run", []):  # a group that died (not one skipped for the time budget)
        labs = [str(x) for x in (nr.get("tasks") or []) if _is_shmcast(x)]
        if labs and "budget" not in nr.get("why", ""):
            out.append(f"{nr['group']}/{','.join(labs)}: {nr['why']}")
    return out


def mismatches(res):
    """Labels of the tasks (or fan-out phases) with a sync whose checksums differed."""
    out = []
    for g in res.get("groups", []):
        for t in g.get("tasks", []):
            if t.get("mismatch"):
                out.append(f"{g['name']}/{t.get('label')}")
            for name, ph in (t.get("phases") or {}).items():
                if ph.get("mismatch"):
                    out.append(f"{g['name']}/{t.get('label')}/{name}")
    return out


def command_base(meta):
    """The bench command of a run without its selection/output arguments (rows append --only ...)."""
    argv = shlex.split(meta["command"])
    if len(argv) >= 2 and argv[1].endswith("weight_sync_bench.py"):
        return " ".join(argv[:2] + [shlex.quote(x) for x in strip_args(argv[2:])])
    return meta.get("command_base") or meta["command"]


def strip_args(argv):
    """The arguments that change what is measured (not --only, --out, labels, budgets)."""
    drop_val = {"--only", "--out", "--machine", "--budget-s", "--group-timeout", "--seccomp-run"}
    drop = {"--keep-logs-dir", "--seccomp-only"}
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
            continue
        k = x.split("=", 1)[0]
        if k in drop_val:
            skip = "=" not in x
            continue
        if k in drop:
            continue
        out.append(x)
    return out


def one_line(t):
    k = t.get("kind")
    if k == "sync":
        s = f"{t['label']:<10} "
        if t.get("median_s") is not None:
            s += (f"{t['median_s']:.4f} s (min {t['min_s']:.4f}, max {t['max_s']:.4f})  {t['gbps']:.2f} GB/s  "
                  f"verified {t.get('verified')}")
            if t.get("ratio"):
                s += f"  x ceiling {t['ratio']:.3f} (ceiling {t['ceiling']['both_gbps']:.2f} GB/s just before)"
        if t.get("errors"):
            s += f"  ERROR {t['errors'][0]}"
        return s
    if k == "loop":
        if t.get("sync_share") is not None:
            return (f"{t['label']:<10} step {t['step_median_s']:.3f} s, sync {t['sync_median_s']:.3f} s, "
                    f"share {100 * t['sync_share']:.1f}%  bit-exact={t['bit_exact']}")
        return f"{t['label']:<10} ERROR {t.get('errors')}"
    if k == "fanout":
        return f"fanout ratios {t.get('peer0_ratio')}, {t.get('peer1_ratio')} errors={t.get('errors')}"
    if k == "check":
        return f"check trainer={t['trainer'].get('cuda')} seccomp={t['trainer'].get('seccomp_mode')} " \
               f"peers={[p.get('cuda') for p in t.get('peers', {}).values()]}"
    return json.dumps(t)[:200]


# --------------------------------------------------------------------------- report

PATH_NAMES = {
    "a": "(a) CPU staging (ROLL fallback: pageable D2H, pickle, socket, H2D)",
    "b-legacy": "(b) torch CUDA IPC, cudaMalloc buckets",
    "b-exp": "(b) torch CUDA IPC, expandable segments",
    "c": "(c) shmcast (Python API)",
    "c-exp": "(c) shmcast, trainer on expandable segments",
}


SHORT = {"a": "(a) CPU staging", "b-legacy": "(b) CUDA IPC, cudaMalloc", "b-exp": "(b) CUDA IPC, expandable",
         "c": "(c) shmcast", "c-exp": "(c) shmcast, expandable trainer"}


def _sync_tasks(res):
    for g in res.get("groups", []):
        for t in g.get("tasks", []):
            yield g, t


_ORDER = {"a": 0, "b-legacy": 1, "b-exp": 2, "c": 3, "c-exp": 4}


def sync_rows(res):
    """Sync results in table order (plain runs, then seccomp; a, b-legacy, b-exp, c, c-exp, slot variants),
    with the tasks that did not run as rows with t=None."""
    rows = []
    for g, t in _sync_tasks(res):
        if t.get("kind") == "sync":
            rows.append({"label": t["label"], "seccomp": bool(g["seccomp"]), "t": t, "g": g})
    checked = {g["name"] for g in res.get("groups", []) for t in g.get("tasks", []) if t.get("kind") == "check"}
    for nr in res.get("not_run", []):
        for lab in nr.get("tasks") or []:
            if lab == "cuda-check" and nr["group"] in checked:
                continue  # an early version did not label its check task
            if lab and not lab.startswith("loop") and lab != "cuda-check":
                rows.append({"label": lab, "seccomp": nr["group"].startswith("seccomp"), "t": None,
                             "why": nr["why"], "g": {}})
    rows.sort(key=lambda r: (r["seccomp"], _ORDER.get(r["label"], 9), r["label"]))
    return rows


def render_markdown(res, cmd_prefix=None):
    m = res["meta"]
    date = date0 = m["date"].split()[0]
    mach = mach0 = m["machine"]
    base = base0 = cmd_prefix or command_base(m)
    cuda = m.get("device") != "cpu"
    where = "one GPU" if cuda else "the CPU (--device cpu: no GPU copies; a smoke run)"
    gbytes = m["manifest"]["bytes"] / 1e9
    L = []
    L.append(f"Model: {m['manifest']['name']}, {m['manifest']['tensors']} tensors, {gbytes:.2f} GB, random bits; "
             f"consumer parameters preallocated; trainer and inference processes on {where}. "
             f"Median of the timed syncs after the warm-up; bit-exact = per-tensor checksums of every timed sync "
             f"equal on both sides. Run: {m['date']}, {mach}"
             + (f" ({'; '.join(m.get('nvidia_smi') or [])})" if m.get("nvidia_smi") else "") + "."
             + "".join(f" Rows from a second run: {x['date']}, {x['machine']}, `{x['command']}`." for x in
                       m.get("merged", [])))
    L.append("")
    c = res.get("ceilings") or {}
    ceil = c.get("both_gbps")
    rows = sync_rows(res)
    a_med = next((r["t"]["median_s"] for r in rows if r["label"] == "a" and not r["seccomp"] and r["t"]), None)
    c_med = next((r["t"]["median_s"] for r in rows if r["label"] == "c" and not r["seccomp"] and r["t"]), None)
    L.append("| date | machine | command | path | seccomp | median s | GB/s | x (a) | x ceiling | bit-exact | notes |")
    L.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    if c and not c.get("errors"):
        for key, lab in (("d2h_gbps", "(d) pinned D2H, one process"), ("h2d_gbps", "(d) pinned H2D, one process"),
                         ("both_gbps", "(d) D2H + H2D at once, two streams (each way)")):
            sec = gbytes / c[key]
            L.append(f"| {date} | {mach} | `{base} --only d` | {lab} | no | {sec:.4f} | {c[key]:.2f} | | "
                     f"{c[key] / ceil:.2f} | n/a | {c['bytes'] >> 20} MiB copies, median of {c['reps']} after 1 "
                     f"warm-up; seconds = {gbytes:.2f} GB at this rate |")
        L.append(f"| {date} | {mach} | `{base} --only d` | pageable D2H / H2D (what (a) copies through) | no | | "
                 f"{c['pageable_d2h_gbps']:.2f} / {c['pageable_h2d_gbps']:.2f} | | | n/a | median of 2 |")
    elif c:
        L.append(f"| {date} | {mach} | `{base} --only d` | (d) ceilings | no | | | | | | FAILED: {c['errors'][0]} |")
    for r in rows:
        t, lab, sec = r["t"], r["label"], r["seccomp"]
        gm = r["g"].get("_meta") or {}  # a row merged from another run (report A.json B.json)
        date, mach, base = gm.get("date", date0), gm.get("machine", mach0), gm.get("command_base", base0)
        name = PATH_NAMES.get(lab, f"(c) shmcast, {lab[6:]} MiB slots" if lab.startswith("c-slot") else lab)
        if t and lab.startswith("c") and t.get("slot_mb"):
            name += f" [{t['slots']} x {t['slot_mb']} MiB slots]"
        only = "c" if lab.startswith("c") else lab
        cmd = f"{base} --only {only}" + (",seccomp --seccomp-only" if sec else "")
        yes = "yes" if sec else "no"
        if t is None:
            L.append(f"| {date} | {mach} | `{cmd}` | {name} | {yes} | - | - | | | - | not run: {r['why']} |")
            continue
        notes = []
        if t.get("errors"):
            notes.append("FAILED: " + t["errors"][0].replace("|", "/"))
        if cuda and lab.startswith("c") and t.get("producer_pinned") is False:
            notes.append("region NOT pinned")
        med = t.get("median_s")
        if med:
            mm = f"; min {t['min_s']:.4f}, max {t['max_s']:.4f} s" if t.get("min_s") else ""
            notes.insert(0, f"median of {len(t['seconds'])} after {t['warmup']} warm-up{mm}"
                            + (f"; verified {t['verified']}" if t.get("verified") else ""))
            tc = (t.get("ceiling") or {}).get("both_gbps")
            if tc:
                notes.append(f"ceiling measured just before: {tc:.2f} GB/s (min {t['ceiling']['both_gbps_min']:.2f}, "
                             f"max {t['ceiling']['both_gbps_max']:.2f})")
            xa = f"{a_med / med:.0f}x" if (a_med and lab != "a") else ""
            xc = f"{t['gbps'] / (tc or ceil):.2f}" if (tc or ceil) and lab != "a" else ""
            L.append(f"| {date} | {mach} | `{cmd}` | {name} | {yes} | {med:.4f} | {t['gbps']:.2f} | {xa} | {xc} | "
                     f"{'yes' if t['bit_exact'] else 'NO'} | {'; '.join(notes)} |")
        else:
            L.append(f"| {date} | {mach} | `{cmd}` | {name} | {yes} | - | - | | | - | {'; '.join(notes) or 'no result'} |")
    L.append("")
    # fan-out
    for g, t in _sync_tasks(res):
        if t.get("kind") != "fanout":
            continue
        p = t.get("phases", {})
        L.append(f"Fan-out (`{base} --only fanout`): one producer on {g['trainer_device']}, consumers on "
                 f"{', '.join(g['peer_devices'])}; {t['slots']} x {t['slot_mb']} MiB slots.")
        L.append("")
        L.append("| consumer | alone: median s | alone: GB/s | with the other: median s | with the other: GB/s | ratio |"
                 " bit-exact |")
        L.append("| --- | --- | --- | --- | --- | --- | --- |")
        for i in (0, 1):
            s, b = p.get(f"single{i}", {}), p.get("both", {})
            if s.get(f"peer{i}_median_s") and b.get(f"peer{i}_median_s"):
                L.append(f"| {i} ({g['peer_devices'][i]}) | {s[f'peer{i}_median_s']:.4f} | {s[f'peer{i}_gbps']:.2f} | "
                         f"{b[f'peer{i}_median_s']:.4f} | {b[f'peer{i}_gbps']:.2f} | {t.get(f'peer{i}_ratio', 0):.2f} |"
                         f" {'yes' if s.get('bit_exact') and b.get('bit_exact') else 'NO'}"
                         + (f" ({s['verified']} alone, {b['verified']} together)" if s.get("verified") else "") + " |")
        d1, d2 = p.get("single0", {}).get("d2h", {}), p.get("both", {}).get("d2h", {})
        if d1.get("d2h_bytes") is not None and d2.get("d2h_bytes") is not None:
            L.append("")
            L.append(f"Host copy made once: the producer process copied {d1['d2h_bytes'] / 1e9:.3f} GB device-to-host "
                     f"for one sync with 1 consumer and {d2['d2h_bytes'] / 1e9:.3f} GB with 2 consumers "
                     f"(model: {gbytes:.3f} GB; read from a torch.profiler/CUPTI trace of one extra sync each).")
        elif d1 or d2:
            L.append("")
            L.append(f"D2H byte count: {d1.get('error') or d1.get('skipped')} / {d2.get('error') or d2.get('skipped')}")
        if t.get("errors"):
            L.append("")
            L.append(f"Fan-out errors: {t['errors']}")
        L.append("")
    # trainer loop
    loops = [(g, t) for g, t in _sync_tasks(res) if t.get("kind") == "loop"]
    if loops:
        mdl = loops[0][1].get("model", {})
        L.append(f"Trainer loop (`{base} --only loop,a,c`): {mdl.get('layers')}-layer transformer, d_model "
                 f"{mdl.get('d_model')}, FFN {mdl.get('ffn')}, vocab {mdl.get('vocab')}, "
                 f"{mdl.get('micro_batches')} x {mdl.get('batch')} x {mdl.get('seq')} tokens per step, "
                 f"{mdl.get('optimizer')}, {mdl.get('precision')}; after every step the weights go to the inference "
                 f"process as bf16 ({(loops[0][1].get('sync_bytes') or 0) / 1e9:.2f} GB, "
                 f"{(loops[0][1].get('params') or 0) / 1e6:.0f}M parameters).")
        L.append("")
        L.append("| sync path | step s (median) | sync s (median) | sync share of step+sync | bit-exact | notes |")
        L.append("| --- | --- | --- | --- | --- | --- |")
        for g, t in loops:
            if t.get("sync_share") is not None:
                L.append(f"| {PATH_NAMES.get(t['path'], t['path'])} | {t['step_median_s']:.3f} | "
                         f"{t['sync_median_s']:.3f} | {100 * t['sync_share']:.1f}% | "
                         f"{'yes' if t['bit_exact'] else 'NO'} | {t['measured_steps']} steps after warm-up"
                         + (f"; sync min {t['sync_min_s']:.3f}, max {t['sync_max_s']:.3f} s; verified {t['verified']}"
                            if t.get("sync_min_s") is not None else "") + " |")
            else:
                L.append(f"| {t['path']} | - | - | - | - | FAILED: {(t.get('errors') or ['?'])[0]} |")
        L.append("")
    # seccomp: CUDA works?
    for g in res.get("groups", []):
        if not g.get("tasks"):
            L.append(f"Group `{g['name']}` produced no result: {g.get('errors')}; "
                     f"{[(p['log'], p['rc'], p['tail'][-300:]) for p in g['processes'] if p['rc']]}")
        if not g.get("seccomp"):
            continue
        for t in g.get("tasks", []):
            if t.get("kind") == "check":
                tr = t["trainer"]
                on = f" on {g['_meta']['machine']}" if g.get("_meta") else ""
                L.append(f"Under `{g['name']}`{on} (Docker default profile via shmcast-seccomp-run): /proc Seccomp mode "
                         f"{tr.get('seccomp_mode')}, CUDA in the trainer: {tr.get('cuda')}; in the inference "
                         f"process: {', '.join(str(p.get('cuda')) for p in t.get('peers', {}).values())}.")
    checked = {g["name"] for g in res.get("groups", []) for t in g.get("tasks", []) if t.get("kind") == "check"}
    for nr in res.get("not_run", []):
        tasks = [x for x in (nr.get("tasks") or []) if not (x == "cuda-check" and nr["group"] in checked)]
        if nr.get("tasks") and not tasks:
            continue
        L.append(f"Not run: {nr['group']}" + (f" ({', '.join(map(str, tasks))})" if tasks else "")
                 + f": {nr['why']}.")
    # targets
    L.append("")
    L.append("Targets:")
    if a_med and c_med:
        sp = a_med / c_med
        L.append(f"- shmcast >= 100x path (a): {sp:.0f}x -> {'met' if sp >= 100 else 'NOT met'}")
    if c_med and ceil:
        r = gbytes / c_med / ceil
        L.append(f"- shmcast >= 0.9x concurrent ceiling: {r:.2f} -> {'met' if r >= 0.9 else 'NOT met'}")
    for g, t in _sync_tasks(res):
        if t.get("kind") == "fanout":
            rs = [t.get("peer0_ratio"), t.get("peer1_ratio")]
            if all(rs):
                L.append(f"- fan-out each consumer >= 0.9x its single-consumer rate: {rs[0]:.2f}, {rs[1]:.2f} -> "
                         f"{'met' if min(rs) >= 0.9 else 'NOT met'}")
    return "\n".join(L) + "\n"


def draw_chart(res, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    c = res.get("ceilings") or {}
    for key, lab in (("d2h_gbps", "(d) pinned D2H"), ("h2d_gbps", "(d) pinned H2D"),
                     ("both_gbps", "(d) D2H+H2D at once")):
        if c.get(key):
            rows.append((lab, c[key], None))
    for r in sync_rows(res):
        if r["label"].startswith("c-slot"):
            continue
        lab = SHORT.get(r["label"], r["label"]) + (" [Docker seccomp]" if r["seccomp"] else "")
        t = r["t"]
        if t is None:
            rows.append((lab, None, "not run: " + r["why"]))
        else:
            rows.append((lab, t.get("gbps"), "FAILED: " + t["errors"][0] if t.get("errors") else None))
    loops = [t for _g, t in _sync_tasks(res) if t.get("kind") == "loop" and t.get("sync_share") is not None]
    fan = [t for _g, t in _sync_tasks(res) if t.get("kind") == "fanout"]
    ncols = 1 + bool(loops) + bool(fan)
    fig, axes = plt.subplots(1, ncols, figsize=(7 + 4.5 * (ncols - 1), 0.42 * len(rows) + 2.2), squeeze=False)
    ax = axes[0][0]
    ys = list(range(len(rows)))[::-1]
    for y, (lab, gbps, err) in zip(ys, rows):
        if gbps:
            col = "#2a9d8f" if lab.startswith("(c)") else "#888888" if lab.startswith("(d)") else "#e76f51"
            ax.barh(y, gbps, color=col)
            ax.text(gbps * 1.08, y, f"{gbps:.2f} GB/s", va="center", fontsize=8)
        else:
            ax.text(0.012, y, (err or "no result")[:75], va="center", fontsize=7,
                    color="#b00020" if (err or "").startswith("FAILED") else "#555555",
                    transform=ax.get_yaxis_transform())
    ax.set_yticks(ys)
    ax.set_yticklabels([r[0] for r in rows], fontsize=8)
    ax.set_xscale("log")
    vals = [r[1] for r in rows if r[1]]
    if vals:
        ax.set_xlim(min(vals) / 2, max(vals) * 6)
    m = res["meta"]
    ax.set_xlabel(f"GB/s, log scale ({m['manifest']['name']}, {m['manifest']['bytes'] / 1e9:.2f} GB, "
                  f"trainer -> inference process)", fontsize=8)
    ax.set_title(f"Weight sync, {m['machine']}, {m['date'].split()[0]}", fontsize=9)
    k = 1
    if loops:
        ax2 = axes[0][k]
        k += 1
        labs = [SHORT.get(t["path"], t["path"]).replace(" ", "\n", 1) for t in loops]
        st = [t["step_median_s"] for t in loops]
        sy = [t["sync_median_s"] for t in loops]
        ax2.bar(labs, st, color="#8ab17d", label="training step")
        ax2.bar(labs, sy, bottom=st, color="#e9c46a", label="weight sync")
        for i, t in enumerate(loops):
            ax2.text(i, st[i] + sy[i], f"sync {100 * t['sync_share']:.0f}%", ha="center", va="bottom", fontsize=8)
        ax2.set_ylabel("seconds per step (median)", fontsize=8)
        ax2.set_title("Trainer loop: sync share of step", fontsize=9)
        ax2.legend(fontsize=7)
    if fan:
        ax3 = axes[0][k]
        p = fan[0].get("phases", {})
        labs, al, wi = [], [], []
        for i in (0, 1):
            a1 = p.get(f"single{i}", {}).get(f"peer{i}_gbps")
            b1 = p.get("both", {}).get(f"peer{i}_gbps")
            if a1 and b1:
                labs.append(f"consumer {i}")
                al.append(a1)
                wi.append(b1)
        xs = list(range(len(labs)))
        ax3.bar([x - 0.2 for x in xs], al, width=0.4, label="alone", color="#264653")
        ax3.bar([x + 0.2 for x in xs], wi, width=0.4, label="both at once", color="#2a9d8f")
        ax3.set_xticks(xs)
        ax3.set_xticklabels(labs, fontsize=8)
        ax3.set_ylabel("GB/s", fontsize=8)
        ax3.set_title("Fan-out: 1 producer -> 2 GPUs", fontsize=9)
        ax3.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=130)
    plt.close(fig)


# --------------------------------------------------------------------------- entry

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        role, cfg_path = argv[1], argv[3]
        with open(cfg_path) as f:
            cfg = json.load(f)
        if role == "trainer":
            Trainer(cfg).run()
        elif role == "ceilings":
            ceilings_main(cfg)
        else:
            peer_main(cfg)
        return 0
    if argv and argv[0] == "report":
        ap = argparse.ArgumentParser(prog="weight_sync_bench.py report")
        ap.add_argument("json", nargs="+", help="results.json; later files add their groups (own date, machine)")
        ap.add_argument("--md")
        ap.add_argument("--png")
        ap.add_argument("--cmd-prefix", help="command shown in the table's rows")
        r = ap.parse_args(argv[1:])
        with open(r.json[0]) as f:
            res = json.load(f)
        for extra in r.json[1:]:
            with open(extra) as f:
                other = json.load(f)
            om = other["meta"]
            gm = {"date": om["date"].split()[0], "machine": om["machine"], "command_base": command_base(om)}
            res["meta"].setdefault("merged", []).append({"date": om["date"], "machine": om["machine"],
                                                          "command": om["command"]})
            for g in other.get("groups", []):
                g["_meta"] = gm
                res["groups"].append(g)
                done = {t.get("label") for t in g.get("tasks", [])}
                for nr in res.get("not_run", []):
                    if nr["group"] == g["name"] and nr.get("tasks"):
                        nr["tasks"] = [x for x in nr["tasks"] if x not in done]
            res["not_run"] = [nr for nr in res.get("not_run", []) if nr.get("tasks") or "tasks" not in nr]
            res["not_run"] += other.get("not_run", [])
        md = render_markdown(res, r.cmd_prefix)
        if r.md:
            with open(r.md, "w") as f:
                f.write(md)
        else:
            print(md)
        if r.png:
            draw_chart(res, r.png)
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="e2e-out", help="results.json, results.md, weight_sync_e2e.png, logs.tar.gz")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--small", action="store_true", help="a 4-layer, ~14 MB manifest instead of Qwen2.5-3B")
    ap.add_argument("--only", help=f"comma list of {','.join(ALL_SELECT)} (default all)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=10, help="timed syncs of path (a) (about 19 s each on an H200)")
    ap.add_argument("--reps-fast", type=int, default=10, help="timed syncs of paths (b), (c) and fan-out")
    ap.add_argument("--slot-mb", type=int, default=512)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--slot-sweep", default="", help="extra (c) runs at these slot sizes in MiB, e.g. 256,1024")
    ap.add_argument("--bucket-mb", type=int, default=1024, help="bucket size of paths (a) and (b)")
    ap.add_argument("--loop-steps", type=int, default=5)
    ap.add_argument("--ceiling-mb", type=int, default=1024)
    ap.add_argument("--ceiling-reps", type=int, default=10,
                    help="copies per ceiling; measured for (d) and again before every shmcast configuration")
    ap.add_argument("--seccomp-run", help="shmcast-seccomp-run (default: found in build*/tests/seccomp)")
    ap.add_argument("--seccomp-profile", default=os.path.join(REPO, "tests", "seccomp", "docker-default.json"))
    ap.add_argument("--machine", help="machine label for the table")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip groups that would not finish in this time")
    ap.add_argument("--group-timeout", type=float, default=300)
    ap.add_argument("--keep-logs-dir", action="store_true", help="keep OUT/logs/ beside logs.tar.gz")
    ap.add_argument("--seccomp-only", action="store_true",
                    help="run only the groups under the seccomp profile (no ceilings, no plain runs)")
    ap.add_argument("--full", action="store_true", help="with --device cpu: the full Qwen2.5-3B manifest anyway")
    args = ap.parse_args(argv)
    if args.device == "cpu" and not args.full:
        args.small = True
    return Orchestrator(args).main()


if __name__ == "__main__":
    sys.exit(main())
