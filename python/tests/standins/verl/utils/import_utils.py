"""STAND-IN for import_external_libs of verl/utils/import_utils.py
(verl-project/verl @ 1dda039b9c6311889a9c9a26040677e1254814f9): None does
nothing; a module name or a list of them is imported. verl calls it with
$VERL_USE_EXTERNAL_MODULES (verl/__init__.py) and with
checkpoint_engine.custom_backend_module (the checkpoint-engine manager and
workers). Not verl's code."""
import importlib


def import_external_libs(external_libs=None) -> None:
    if external_libs is None:
        return
    if not isinstance(external_libs, list):
        external_libs = [external_libs]
    for lib in external_libs:
        importlib.import_module(lib)
