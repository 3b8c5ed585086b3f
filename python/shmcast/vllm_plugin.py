"""vLLM plugin entry point (`vllm.general_plugins` = shmcast.vllm_plugin:register,
declared in pyproject.toml): vLLM calls register() in every process it starts
(API server, engine core, workers) when shmcast is installed, so that
WeightTransferConfig(backend="shmcast") resolves everywhere. Cheap and
harmless: it imports nothing of shmcast's backend (the factories import
shmcast.vllm_transfer lazily, when the backend is used) and does nothing on a
vLLM without the weight-transfer registry. Set VLLM_PLUGINS to a list without
"shmcast" to keep it from running."""
from __future__ import annotations

BACKEND = "shmcast"
_MODULE = "shmcast.vllm_transfer"


def register() -> None:
    """Registers the `shmcast` weight-transfer backend with vLLM's factories
    (worker side and, where vLLM has one, trainer side). Idempotent."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # a vLLM without native weight transfer: nothing to register
        return
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, _MODULE, "ShmcastWeightTransferEngine")
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    except ImportError:  # trainer-side engines came later
        return
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, _MODULE, "ShmcastTrainerWeightTransferEngine")
