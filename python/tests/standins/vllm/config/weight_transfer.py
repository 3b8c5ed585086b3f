"""STAND-IN: the shim vllm/config/weight_transfer.py (re-exports
vllm.foundation.config.weight_transfer)."""
from vllm.foundation.config.weight_transfer import WeightTransferConfig  # noqa: F401
