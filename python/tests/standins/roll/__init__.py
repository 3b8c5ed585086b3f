"""STAND-IN FOR ROLL (alibaba/ROLL), FOR TESTS ONLY (see
python/tests/standins/README.md): the bucket payload's two ends as ROLL
ships them, re-created from its source; not ROLL's code."""
__version__ = "0.0.0+shmcast-standin"
