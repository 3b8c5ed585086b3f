#!/usr/bin/env python3
"""ctest python.install_prefix: `cmake --install <build> --component python
--prefix P` writes under P only (not into the interpreter's site-packages),
and the package imports and runs from P/<rel> with the build tree out of the
way. Exits 77 (skipped) when SHMCAST_PYTHON_INSTALL_DIR is absolute.

    install_check.py --build BIN --work DIR --rel REL -- CHECK...

CHECK is the command that exercises the installed package
(tests/gpu/python_no_gpu.py); it gets --expect-prefix P/REL.
"""
import argparse
import os
import shutil
import subprocess
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--rel", required=True, help="SHMCAST_PYTHON_INSTALL_DIR")
    ap.add_argument("check", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    check_cmd = a.check[1:] if a.check[:1] == ["--"] else a.check
    if not a.rel or os.path.isabs(a.rel):
        print(f"SHMCAST_PYTHON_INSTALL_DIR is {a.rel!r}, not relative: --prefix does not apply; skipped")
        return 77
    shutil.rmtree(a.work, ignore_errors=True)
    prefix = os.path.join(a.work, "prefix")
    cmake = os.environ.get("CMAKE_COMMAND", "cmake")
    r = subprocess.run([cmake, "--install", a.build, "--component", "python", "--prefix", prefix],
                       capture_output=True, text=True)
    print(r.stdout + r.stderr)
    if r.returncode != 0:
        print("FAIL: cmake --install failed")
        return 1
    # Every "-- Installing:" / "-- Up-to-date:" line names a path under the prefix.
    outside = [l for l in r.stdout.splitlines()
               if l.startswith(("-- Installing:", "-- Up-to-date:")) and not l.split(":", 1)[1].strip().startswith(prefix + os.sep)]
    if outside:
        print("FAIL: installed outside the prefix:\n" + "\n".join(outside))
        return 1
    site = os.path.join(prefix, a.rel)
    pkg = os.path.join(site, "shmcast")
    have = sorted(os.listdir(pkg)) if os.path.isdir(pkg) else []
    print("installed:", pkg, have)
    for want in ("__init__.py", "_torch.py", "_version.py"):
        if want not in have:
            print(f"FAIL: {want} is not in {pkg}")
            return 1
    if not any(f.startswith("_shmcast") and f.endswith(".so") for f in have):
        print(f"FAIL: no _shmcast*.so in {pkg}")
        return 1
    env = dict(os.environ)
    env["PYTHONPATH"] = site  # the build tree is not on the path
    run_dir = os.path.join(a.work, "run")
    os.makedirs(run_dir, exist_ok=True)
    r = subprocess.run(check_cmd + ["--expect-prefix", site], cwd=run_dir, env=env)
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())
