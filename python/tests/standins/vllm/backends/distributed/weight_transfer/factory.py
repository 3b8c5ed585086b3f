"""STAND-IN for vllm/backends/distributed/weight_transfer/factory.py of
vllm-project/vllm @ 055e47c28003156421365af985d676fc921cb075 (checked
2026-12-06): two lazy registries. WeightTransferEngineFactory (worker side):
register_engine(name, module_path_or_cls, class_name=None),
create_engine(config, vllm_config, device, model) -> engine_cls(config,
vllm_config, device, model). WeightTransferTrainerFactory:
register_engine(...), trainer_init(init_info, *, client, source=None): no
config and no backend argument, the backend is init_info.backend (the
TrainerInitInfo ClassVar), and the engine is built with
engine_cls.trainer_init(init_info=init_info, client=client, source=source)
(all keywords). Registering a taken name is a ValueError; an unknown backend
is a ValueError listing the registered ones. The built-in names are
registered as in vLLM, pointing at modules the stand-in does not have (they
are only imported when used). Written for shmcast's tests; not vLLM's code."""
from __future__ import annotations

import importlib


class _Registry:
    _registry: dict = {}
    _what = "engine"

    @classmethod
    def register_engine(cls, name, module_path_or_cls, class_name=None) -> None:
        if name in cls._registry:
            raise ValueError(f"Weight transfer {cls._what} '{name}' is already registered.")
        if isinstance(module_path_or_cls, str):
            if class_name is None:
                raise ValueError("class_name is required when registering with module path")
            cls._registry[name] = lambda: getattr(importlib.import_module(module_path_or_cls), class_name)
        else:
            cls._registry[name] = lambda: module_path_or_cls

    @classmethod
    def _lookup(cls, backend):
        if backend not in cls._registry:
            raise ValueError(f"Invalid weight transfer backend: {backend}. "
                             f"Available {cls._what}s: {list(cls._registry)}")
        return cls._registry[backend]()


class WeightTransferEngineFactory(_Registry):
    _registry: dict = {}

    @classmethod
    def create_engine(cls, config, vllm_config, device, model):
        return cls._lookup(config.backend)(config, vllm_config, device, model)


class WeightTransferTrainerFactory(_Registry):
    _registry: dict = {}
    _what = "trainer engine"

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        return cls._lookup(init_info.backend).trainer_init(init_info=init_info, client=client, source=source)


_MOD = "vllm.backends.distributed.weight_transfer"
for _name, _cls in (("nccl", "NCCLWeightTransferEngine"), ("ipc", "IPCWeightTransferEngine"),
                    ("sparse_nccl", "SparseNCCLWeightTransferEngine"),
                    ("sharded_rdt", "ShardedRDTWeightTransferEngine")):
    WeightTransferEngineFactory.register_engine(_name, f"{_MOD}.{_name}_engine", _cls)
for _name, _mod, _cls in (("nccl", "nccl_engine", "NCCLTrainerWeightTransferEngine"),
                          ("ipc", "ipc_engine", "IPCTrainerWeightTransferEngine"),
                          ("sparse_nccl", "sparse_nccl_engine", "SparseNCCLTrainerWeightTransferEngine"),
                          ("sharded_rdt", "sharded_rdt_trainer", "ShardedRDTTrainerWeightTransferEngine")):
    WeightTransferTrainerFactory.register_engine(_name, f"{_MOD}.{_mod}", _cls)
