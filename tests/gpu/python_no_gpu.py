#!/usr/bin/env python3
"""A shmcast Python module built with CUDA imports and runs its host path where
CUDA is missing (ctest python.no_gpu, python.no_driver, python.install_prefix;
scripts/device-pip.sh runs it against the pip-installed package).

  --natural   the machine as it is: exits 77 (skipped) where a GPU is usable.
              CI (CUDA toolkit, no GPU, no libcuda.so.1) runs it for real.
  (default)   SHMCAST_LIBCUDA names a file that does not exist, so a
              driver-API build finds no driver even on a GPU machine.

Checks: the version and the build's CUDA engine are the expected ones; the
module links no CUDA library (driver-API builds); cuda_available() is False
with a reason that names the cause; Pin=yes and device writes and reads raise
CudaUnavailable with that reason; a sync of CPU tensors between two threads
(region pinned with pin="auto": quietly unpinned) is bit-exact.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import threading

SKIP = 77


def fail(msg: str) -> None:
    print("FAIL:", msg, flush=True)
    sys.exit(1)


def check(cond: bool, msg: str) -> None:
    if not cond:
        fail(msg)
    print("ok:", msg, flush=True)


def needed_libraries(path: str) -> list:
    """DT_NEEDED entries of an ELF file (readelf), or None without readelf."""
    readelf = shutil.which("readelf")
    if readelf is None:
        return None
    out = subprocess.run([readelf, "-d", path], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", required=True, help="expected shmcast.__version__ (project(VERSION))")
    ap.add_argument("--cuda-engine", required=True, choices=["driver", "runtime", "none"])
    ap.add_argument("--natural", action="store_true", help="do not expect SHMCAST_LIBCUDA; skip where a GPU works")
    ap.add_argument("--expect-prefix", help="shmcast must be imported from under this directory")
    args = ap.parse_args()

    import shmcast
    from shmcast import _shmcast, _version

    print(f"shmcast {shmcast.__version__} from {shmcast.__file__}; cuda_engine={_version.cuda_engine}; "
          f"python {sys.version.split()[0]} at {sys.executable}; SHMCAST_LIBCUDA={os.environ.get('SHMCAST_LIBCUDA')}",
          flush=True)
    if args.expect_prefix:
        check(os.path.realpath(shmcast.__file__).startswith(os.path.realpath(args.expect_prefix) + os.sep),
              f"shmcast is imported from under {args.expect_prefix}")
    check(shmcast.__version__ == args.version, f"shmcast.__version__ == {args.version!r} (project version)")
    check(shmcast.__version__.split(".")[:2] == [str(_shmcast.version_major), str(_shmcast.version_minor)],
          "shmcast.__version__ agrees with the C++ kVersionMajor/kVersionMinor")
    engine = None if args.cuda_engine == "none" else args.cuda_engine
    check(_version.cuda_engine == engine, f"the module's CUDA engine is {engine!r}")

    needed = needed_libraries(_shmcast.__file__)
    if needed is None:
        print("readelf not found: the NEEDED check is skipped", flush=True)
    else:
        print("NEEDED:", " ".join(needed), flush=True)
        cuda_libs = [n for n in needed if re.match(r"lib(cuda|cudart|nvidia|nvrtc|cublas)", n)]
        if engine == "runtime":
            check(any(n.startswith("libcudart") for n in needed), "a runtime-API build links libcudart")
        else:
            check(not cuda_libs, f"the module links no CUDA library ({cuda_libs or 'none'})")

    available = shmcast.cuda_available()
    why = shmcast.cuda_unavailable_reason()
    print(f"cuda_available() = {available}; reason: {why!r}", flush=True)
    if available:
        if args.natural:
            print("a GPU is usable here: skipped (the CUDA tests cover this machine)", flush=True)
            return SKIP
        if engine == "driver":
            fail(f"SHMCAST_LIBCUDA={os.environ.get('SHMCAST_LIBCUDA')} but CUDA is available")
        print("a runtime-API build ignores SHMCAST_LIBCUDA and a GPU is usable: skipped", flush=True)
        return SKIP
    check(bool(why) and "CUDA" in why, "the reason is given and names CUDA")
    if engine == "none":
        check("without CUDA" in why, "a build without CUDA says so")
    elif engine == "driver":
        lib = os.environ.get("SHMCAST_LIBCUDA") or "libcuda.so.1"
        if args.natural:
            check(lib in why or "device" in why, "the reason names libcuda.so.1 or the missing device")
        else:
            check(lib in why and "could not be loaded" in why, f"the reason names {lib} and says it did not load")

    name = f"pynogpu-{os.getpid()}"
    shmcast.unlink_region(name)
    # Pin=yes needs CUDA: CudaUnavailable with the reason.
    try:
        _shmcast.Producer(name, slot_bytes=1 << 20, pin=True)
        fail("Producer(pin=True) worked without CUDA")
    except shmcast.CudaUnavailable as e:
        check(why in str(e) or engine == "runtime", f"Producer(pin=True) raises CudaUnavailable: {e}")
    check(not os.path.exists(shmcast.region_path(name)), "the refused producer left no region behind")

    import torch

    n = 3 << 18  # 3 MiB of float32 over 1 MiB slots: several chunks
    src = {"a": torch.arange(n, dtype=torch.float32), "b": torch.arange(1000, dtype=torch.int64) * 7,
           "c": torch.tensor(2.5, dtype=torch.float64)}
    got = {}
    errors = []

    with shmcast.Producer(name, slot_bytes=1 << 20, slots=2, max_consumers=1, pin="auto") as prod:
        check(not prod.pinned, "pin='auto' leaves the region unpinned without CUDA")
        # Device writes need CUDA: CudaUnavailable, and the producer goes on
        # (no consumer is attached yet, so none sees the aborted sync).
        raw = prod.raw
        raw.begin_sync([("x", "u8", [16])])
        try:
            raw.write_device(0, 0x1000, 0)
            fail("write_device worked without CUDA")
        except shmcast.CudaUnavailable as e:
            check("CUDA" in str(e), f"write_device raises CudaUnavailable: {e}")
        raw.abort_sync("no CUDA here")

        def consumer():
            try:
                with shmcast.Consumer(name, "cpu", pin="auto") as cons:
                    if cons.pinned:
                        errors.append("consumer pinned without CUDA")
                    got.update(dict(cons.receive(timeout=60.0)))
            except BaseException as e:  # noqa: BLE001
                errors.append(repr(e))

        t = threading.Thread(target=consumer)
        t.start()
        prod.wait_for_consumers(1, 30.0)
        version = prod.send(src.items())
        t.join(90.0)
        check(not t.is_alive(), "the consumer thread finished")
    check(not errors, f"the consumer saw no error ({errors})")
    check(version >= 1 and set(got) == set(src), f"sync {version} received every tensor")
    for k, v in src.items():
        check(torch.equal(got[k], v), f"tensor {k} is bit-exact")

    # Reading onto a device needs CUDA too.
    with shmcast.Producer(name, slot_bytes=1 << 20, slots=2, max_consumers=1, pin="auto") as prod:
        cons = _shmcast.Consumer(name, pin="auto")
        prod.wait_for_consumers(1, 30.0)
        prod.send([("y", torch.ones(4))])
        cons.wait_sync(30.0)
        try:
            cons.read_to_staging(0, 0)
            fail("read_to_staging worked without CUDA")
        except shmcast.CudaUnavailable as e:
            check("CUDA" in str(e), f"read_to_staging raises CudaUnavailable: {e}")
        cons.skip()
        cons.close()
    print("python_no_gpu: all checks passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
