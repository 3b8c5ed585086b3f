"""STAND-IN for CheckpointEngineConfig of verl/workers/config/rollout.py
(verl-project/verl @ 1dda039b9c6311889a9c9a26040677e1254814f9; the config
node actor_rollout_ref.rollout.checkpoint_engine): backend,
update_weights_bucket_megabytes, engine_kwargs (per backend),
custom_backend_module (imported on every worker process before the backend
is instantiated, so that an out-of-tree backend registers itself). The real
class is a BaseConfig dataclass. Not verl's code."""
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class CheckpointEngineConfig:
    backend: Optional[str] = "naive"
    update_weights_bucket_megabytes: int = 2048
    engine_kwargs: dict = field(default_factory=dict)
    custom_backend_module: Optional[str] = None
