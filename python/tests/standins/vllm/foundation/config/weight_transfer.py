"""STAND-IN for vllm/foundation/config/weight_transfer.py of vllm-project/vllm
@ aedcda890b813c2a68618ce6b7547d2e5881dbde (checked 2026-12-06; the old path
vllm/config/weight_transfer.py is a shim): a config whose `backend` names an
engine of WeightTransferEngineFactory, validated only when the engine is
created, so a registered out-of-tree name such as "shmcast" is accepted.
The real class is a pydantic @config dataclass; the worker side is the only
one that takes it (the trainer side lost its config argument)."""
from dataclasses import dataclass


@dataclass
class WeightTransferConfig:
    backend: str = "nccl"
