"""STAND-IN: the shim vllm/distributed/weight_transfer/base.py (the old path
of vllm/backends/distributed/weight_transfer/base.py, re-exported)."""
from vllm.backends.distributed.weight_transfer.base import *  # noqa: F401,F403
from vllm.backends.distributed.weight_transfer.base import ParamMeta, materialize_full_tensor  # noqa: F401
