"""STAND-IN: vllm/distributed/weight_transfer/__init__.py, kept by vLLM as a
shim over vllm.backends.distributed.weight_transfer (vllm-project/vllm @
a8f1d79812aa51e1036eba41286879eb09bd1635); here it re-exports the stand-in."""
from vllm.backends.distributed.weight_transfer import *  # noqa: F401,F403
from vllm.backends.distributed.weight_transfer import __all__  # noqa: F401
