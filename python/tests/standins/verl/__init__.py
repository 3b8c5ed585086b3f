"""STAND-IN FOR verl, FOR TESTS ONLY (see python/tests/standins/README.md).
Mirrors verl/__init__.py of verl-project/verl @
1dda039b9c6311889a9c9a26040677e1254814f9 in the one respect shmcast relies
on: importing `verl` imports the comma-separated modules of
$VERL_USE_EXTERNAL_MODULES (verl.utils.import_utils.import_external_libs),
the older way for a backend outside verl to register itself in every
process (the newer one is checkpoint_engine.custom_backend_module). The
"verl.plugins" entry points are not modelled. Not verl's code."""
import os

from verl.utils.import_utils import import_external_libs

__version__ = "0.0.0+shmcast-standin"

_modules = os.getenv("VERL_USE_EXTERNAL_MODULES", "")
if _modules:
    import_external_libs(_modules.split(","))
