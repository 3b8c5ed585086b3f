"""STAND-IN: vllm/backends/distributed/weight_transfer/__init__.py re-exports."""
from .base import (  # noqa: F401
    ModuleSource,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferInitRequest,
    WeightTransferUpdateInfo,
    WeightTransferUpdateRequest,
)
from .factory import WeightTransferEngineFactory, WeightTransferTrainerFactory  # noqa: F401

__all__ = ["ModuleSource", "TrainerInitInfo", "TrainerWeightTransferEngine", "VLLMWeightSyncClient", "WeightSource",
           "WeightTransferEngine", "WeightTransferInitInfo", "WeightTransferInitRequest", "WeightTransferUpdateInfo",
           "WeightTransferUpdateRequest", "WeightTransferEngineFactory", "WeightTransferTrainerFactory"]
