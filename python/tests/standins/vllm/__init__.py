"""STAND-IN FOR vLLM, FOR TESTS ONLY (see python/tests/standins/README.md).
Nothing here is vLLM's code; the modules re-create the signatures and call
order shmcast's backend relies on, each naming what it mirrors."""
__version__ = "0.0.0+shmcast-standin"
