"""vLLM plugin entry point (`vllm.general_plugins` = shmcast.vllm_plugin:register,
declared in pyproject.toml): vLLM calls register() in every process it starts
(API server, engine core, workers) when shmcast is installed, so that
WeightTransferConfig(backend="shmcast") resolves everywhere. Cheap and
harmless: it imports nothing of shmcast's backend (the factories import
shmcast.vllm_transfer lazily, when the backend is used) and does nothing on a
vLLM without the weight-transfer registry. Set VLLM_PLUGINS to a list without
"shmcast" to keep it from running.

Checked against vllm-project/vllm factory.py @
055e47c28003156421365af985d676fc921cb075 (vllm/backends/distributed/
weight_transfer/factory.py; the old vllm/distributed/weight_transfer path is
a shim there and is the only one in older vLLMs: both are tried)."""
from __future__ import annotations

BACKEND = "shmcast"
_MODULE = "shmcast.vllm_transfer"


def register() -> None:
    """Registers the `shmcast` weight-transfer backend with vLLM's factories
    (worker side and, where vLLM has one, trainer side). Idempotent."""
    factory = _factory_module()
    if factory is None:  # a vLLM without native weight transfer: nothing to register
        return
    engines = factory.WeightTransferEngineFactory
    if BACKEND not in engines._registry:
        engines.register_engine(BACKEND, _MODULE, "ShmcastWeightTransferEngine")
    WeightTransferTrainerFactory = getattr(factory, "WeightTransferTrainerFactory", None)
    if WeightTransferTrainerFactory is None:  # trainer-side engines came later
        return
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, _MODULE, "ShmcastTrainerWeightTransferEngine")


def _factory_module():
    import importlib

    for name in ("vllm.backends.distributed.weight_transfer.factory", "vllm.distributed.weight_transfer.factory"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None
