#!/usr/bin/env python3
"""GPU container test: where CUDA IPC fails, shmcast works.

A trainer process and an inference process share one GPU. Both run under a
Docker-format seccomp profile through shmcast-seccomp-run (Docker's default
profile unless --profile says otherwise).

  1. The trainer allocates with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
     and shares a CUDA tensor the way RL frameworks do (torch's reduce_tensor:
     a CUDA IPC handle). Opening it in the worker needs pidfd_getfd; the test
     ASSERTS that this fails with "Operation not permitted" under the profile
     (and, as a control, that it works with no filter).
  2. shmcast moves the same kind of weights (by default the Qwen2.5-3B bf16
     state dict, 434 tensors, 6.17 GB) through a region, bit-exact, and reports
     the rate.

Usage (on a GPU machine, from the repo root, after building):
  PYTHONPATH=build/python python3 tests/seccomp/gpu_ipc_vs_shmcast.py \
      --runner build/tests/seccomp/shmcast-seccomp-run --profile tests/seccomp/docker-default.json

Prints one JSON object last; exit 0 only when both parts behave as claimed.
"""
import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def qwen25_3b_specs(layers=36):
    """(name, shape) of the Qwen2.5-3B state dict: 434 tensors, 6.17 GB in bf16."""
    from shmcast.manifests import qwen25_3b_shapes
    return qwen25_3b_shapes(layers)


def make_weights(torch, specs, seed, device):
    """Deterministic random bf16 weights: both processes can regenerate them."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    out = []
    for name, shape in specs:
        bits = torch.randint(-32768, 32767, shape, dtype=torch.int16, device=device, generator=g)
        out.append((name, bits.view(torch.bfloat16)))
    return out


def wait_for(path, timeout):
    end = time.time() + timeout
    while not os.path.exists(path):
        if time.time() > end:
            raise TimeoutError(f"gave up waiting for {path}")
        time.sleep(0.01)


# --------------------------------------------------------------- roles

def role_ipc_trainer(a):
    import torch
    t = torch.arange(1 << 20, dtype=torch.float32, device="cuda") * 3
    from torch.multiprocessing.reductions import reduce_tensor
    rebuild, args = reduce_tensor(t)
    with open(a.work + "/handle.tmp", "wb") as f:
        pickle.dump((rebuild, args), f)
    os.rename(a.work + "/handle.tmp", a.work + "/handle.pkl")
    wait_for(a.work + "/ipc.done", 120)
    print(json.dumps({"role": "ipc-trainer", "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}))


def role_ipc_worker(a):
    import torch
    torch.cuda.init()
    wait_for(a.work + "/handle.pkl", 120)
    result = {"role": "ipc-worker"}
    try:
        with open(a.work + "/handle.pkl", "rb") as f:
            rebuild, args = pickle.load(f)
        t = rebuild(*args)
        ok = bool(torch.equal(t, torch.arange(1 << 20, dtype=torch.float32, device="cuda") * 3))
        result.update(opened=True, bit_exact=ok)
    except Exception as e:  # the failure users report
        result.update(opened=False, error=f"{type(e).__name__}: {e}")
    finally:
        open(a.work + "/ipc.done", "w").close()
    print(json.dumps(result))


def role_shm_trainer(a):
    import torch
    import shmcast
    specs = qwen25_3b_specs(a.layers)
    weights = make_weights(torch, specs, a.seed, "cuda")
    torch.cuda.synchronize()
    with shmcast.Producer(a.region, slot_bytes=a.slot_bytes, slots=a.slots, max_consumers=1) as prod:
        prod.wait_for_consumers(1, timeout=120.0)
        times = []
        for rep in range(a.reps + 1):
            open(f"{a.work}/go.{rep}", "w").close()
            t0 = time.perf_counter()
            prod.send(weights)
            times.append(time.perf_counter() - t0)
        prod.wait_drained(timeout=120.0)
    print(json.dumps({"role": "shm-trainer", "send_s": times}))


def role_shm_worker(a):
    import torch
    import shmcast
    specs = qwen25_3b_specs(a.layers)
    params = {name: torch.empty(shape, dtype=torch.bfloat16, device="cuda") for name, shape in specs}
    nbytes = sum(p.numel() * p.element_size() for p in params.values())
    torch.cuda.synchronize()
    times, exact = [], None
    with shmcast.Consumer(a.region, device="cuda:0") as cons:
        for rep in range(a.reps + 1):
            for p in params.values():
                p.fill_(0)  # poison: every byte must be written again
            torch.cuda.synchronize()
            wait_for(f"{a.work}/go.{rep}", 120)
            t0 = time.perf_counter()
            cons.receive_into(params, timeout=120.0)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        want = make_weights(torch, specs, a.seed, "cuda")
        exact = all(torch.equal(params[n].view(torch.int16), w.view(torch.int16)) for n, w in want)
    steady = sorted(times[1:]) if len(times) > 1 else times
    med = steady[len(steady) // 2]
    print(json.dumps({"role": "shm-worker", "bytes": nbytes, "tensors": len(specs), "receive_s": times,
                      "median_s": med, "gbps": nbytes / med / 1e9, "bit_exact": bool(exact)}))


# --------------------------------------------------------------- driver

def run_pair(a, profile, first, second, env_first=None, timeout=600):
    """Starts two roles under `profile`; returns their last JSON lines."""
    def cmd(role):
        c = [sys.executable, os.path.abspath(__file__), "--role", role, "--work", a.work, "--region", a.region,
             "--layers", str(a.layers), "--reps", str(a.reps), "--slot-bytes", str(a.slot_bytes),
             "--slots", str(a.slots), "--seed", str(a.seed)]
        return [a.runner, "--profile", profile, "--"] + c if profile else c
    env1 = dict(os.environ, **(env_first or {}))
    p1 = subprocess.Popen(cmd(first), env=env1, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p2 = subprocess.Popen(cmd(second), env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = []
    for p in (p1, p2):
        try:
            so, se = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            so, se = p.communicate()
        last = [l for l in so.splitlines() if l.startswith("{")]
        out.append({"rc": p.returncode, "result": json.loads(last[-1]) if last else None, "stderr": se[-2000:]})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role")
    ap.add_argument("--work")
    ap.add_argument("--runner", default="build/tests/seccomp/shmcast-seccomp-run")
    ap.add_argument("--profile", default=os.path.join(HERE, "docker-default.json"))
    ap.add_argument("--region", default=f"gpu-ct-{os.getpid()}")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--slot-bytes", type=int, default=256 << 20)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()
    roles = {"ipc-trainer": role_ipc_trainer, "ipc-worker": role_ipc_worker,
             "shm-trainer": role_shm_trainer, "shm-worker": role_shm_worker}
    if a.role:
        roles[a.role](a)
        return 0

    report = {"profile": a.profile, "runner": a.runner}
    expandable = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for label, profile in (("ipc_no_filter", None), ("ipc_under_profile", a.profile)):
        a.work = tempfile.mkdtemp(prefix="shmcast-ipc-")
        trainer, worker = run_pair(a, profile, "ipc-trainer", "ipc-worker", env_first=expandable, timeout=180)
        report[label] = {"trainer_rc": trainer["rc"], "worker": worker["result"], "worker_rc": worker["rc"],
                         "stderr": (worker["stderr"] if worker["rc"] else "")}
    a.work = tempfile.mkdtemp(prefix="shmcast-shm-")
    trainer, worker = run_pair(a, a.profile, "shm-trainer", "shm-worker", env_first=expandable)
    report["shmcast_under_profile"] = {"trainer_rc": trainer["rc"], "trainer": trainer["result"],
                                       "worker_rc": worker["rc"], "worker": worker["result"],
                                       "stderr": (trainer["stderr"] + worker["stderr"])[-3000:]
                                       if trainer["rc"] or worker["rc"] else ""}

    ipc = report["ipc_under_profile"]["worker"] or {}
    ctl = report["ipc_no_filter"]["worker"] or {}
    shm = report["shmcast_under_profile"]["worker"] or {}
    checks = {
        "ipc_works_without_filter": bool(ctl.get("opened") and ctl.get("bit_exact")),
        "ipc_fails_with_pidfd_getfd_eperm": (not ipc.get("opened", True)) and "pidfd_getfd" in ipc.get("error", "")
        and "Operation not permitted" in ipc.get("error", ""),
        "shmcast_bit_exact_under_profile": bool(shm.get("bit_exact")) and report["shmcast_under_profile"]["trainer_rc"] == 0,
    }
    report["checks"] = checks
    print(json.dumps(report, indent=1))
    print(json.dumps({"summary": checks, "shmcast_gbps": shm.get("gbps"), "shmcast_median_s": shm.get("median_s"),
                      "ipc_error": ipc.get("error")}))
    # The control may legitimately fail on hosts where even unfiltered
    # pidfd_getfd is refused; the two claims of the test are the other two.
    return 0 if checks["ipc_fails_with_pidfd_getfd_eperm"] and checks["shmcast_bit_exact_under_profile"] else 1


if __name__ == "__main__":
    sys.exit(main())
