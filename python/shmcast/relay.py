"""``python -m shmcast.relay REGION ...``: runs the ``shmcast-relay`` tool.

The relay (docs/relay.md) is a C++ program; this entry point finds it and
replaces the Python process with it, so arguments, signals and the exit code
are the tool's own. It looks, in order, at ``$SHMCAST_RELAY_BIN``, next to
the interpreter (where ``pip install`` puts the tool), in a build tree
(``<build>/tools``) and on ``PATH``.
"""

import os
import shutil
import sys
import sysconfig

__all__ = ["find_relay", "main"]


def find_relay():
    """Path of the shmcast-relay executable, or None."""
    env = os.environ.get("SHMCAST_RELAY_BIN")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    for cand in (
        os.path.join(sysconfig.get_path("scripts"), "shmcast-relay"),
        os.path.join(os.path.dirname(sys.executable), "shmcast-relay"),
        os.path.normpath(os.path.join(here, "..", "..", "tools", "shmcast-relay")),
    ):
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return shutil.which("shmcast-relay")


def main(argv=None):
    exe = find_relay()
    if exe is None:
        sys.stderr.write(
            "shmcast.relay: the shmcast-relay tool was not found (it is built when UCX and OpenSSL are "
            "present: apt install libucx-dev libssl-dev, then reinstall); or set SHMCAST_RELAY_BIN\n"
        )
        return 127
    args = sys.argv[1:] if argv is None else list(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(exe, [exe] + args)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
