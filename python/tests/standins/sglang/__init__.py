"""STAND-IN FOR SGLang, FOR TESTS ONLY (see python/tests/standins/README.md):
the path a custom weight loader takes through sgl-project/sglang, re-created
from its source; not SGLang's code."""
__version__ = "0.0.0+shmcast-standin"
