"""STAND-IN: vllm/config/weight_transfer.py as of vllm-project/vllm base.py
@ 02f250b03f38822ccdb63f27a3005d10ca81f385's era: a config whose `backend`
names an engine of WeightTransferEngineFactory (validated when the engine is
created, so a registered out-of-tree name such as "shmcast" is accepted).
The real class is a pydantic @config dataclass with backend subclasses
(IPC/NCCL carry their packed-buffer parameters); a custom backend gets the
base class, which is what the stand-in models."""
from dataclasses import dataclass


@dataclass
class WeightTransferConfig:
    backend: str = "nccl"
