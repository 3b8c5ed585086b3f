"""STAND-IN: the few config fields the weight-transfer engines read
(vllm/config/vllm.py VllmConfig: parallel_config, model_config,
weight_transfer_config; ModelConfig.quantization)."""
from dataclasses import dataclass, field
from typing import Optional

from .parallel import ParallelConfig
from .weight_transfer import WeightTransferConfig


@dataclass
class ModelConfig:
    quantization: Optional[str] = None


@dataclass
class VllmConfig:
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    model_config: ModelConfig = field(default_factory=ModelConfig)
    weight_transfer_config: Optional[WeightTransferConfig] = None


__all__ = ["VllmConfig", "ModelConfig", "ParallelConfig", "WeightTransferConfig"]
