"""STAND-IN: the shim vllm/distributed/weight_transfer/factory.py (the old
path of vllm/backends/distributed/weight_transfer/factory.py, re-exported)."""
from vllm.backends.distributed.weight_transfer.factory import *  # noqa: F401,F403
