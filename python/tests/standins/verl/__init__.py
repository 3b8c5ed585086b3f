"""STAND-IN FOR verl, FOR TESTS ONLY (see python/tests/standins/README.md).
Mirrors verl/__init__.py of volcengine/verl @
b178a3cd56f58b2d502255daba591e92833930a7 in the one respect shmcast relies
on: importing `verl` imports the comma-separated modules of
$VERL_USE_EXTERNAL_MODULES (verl.utils.import_utils.import_external_libs),
which is how a backend outside verl registers itself in every process.
Not verl's code."""
import importlib
import os

__version__ = "0.0.0+shmcast-standin"

for _m in [m for m in os.getenv("VERL_USE_EXTERNAL_MODULES", "").split(",") if m]:
    importlib.import_module(_m)
