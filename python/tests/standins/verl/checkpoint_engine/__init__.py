"""STAND-IN: verl/checkpoint_engine/__init__.py re-exports (no nccl / hccl /
nixl backends: their libraries are absent, and verl imports them inside
try/except ImportError too)."""
from .base import (  # noqa: F401
    CheckpointEngine,
    CheckpointEngineManager,
    CheckpointEngineRegistry,
    CheckpointEngineWithCache,
    ColocatedCheckpointEngine,
    TensorMeta,
)

__all__ = ["CheckpointEngine", "CheckpointEngineRegistry", "TensorMeta", "ColocatedCheckpointEngine",
           "CheckpointEngineManager", "CheckpointEngineWithCache"]
