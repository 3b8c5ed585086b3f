"""STAND-IN for vllm/distributed/weight_transfer/factory.py of
vllm-project/vllm @ 047c993cc49c32e9b94f5bf826a9214e163eb982: two lazy
registries, WeightTransferEngineFactory (worker side: register_engine(name,
module_path_or_cls, class_name=None), create_engine(config, vllm_config,
device, model)) and WeightTransferTrainerFactory (register_engine,
trainer_init(backend, config, init_info, *, client, source)). Registering a
taken name is a ValueError; an unknown backend is a ValueError listing the
registered ones. The built-in names are registered as in vLLM, pointing at
modules the stand-in does not have (they are only imported when used).
Written for shmcast's tests; not vLLM's code."""
from __future__ import annotations

import importlib


def _loader(module_path_or_cls, class_name):
    if isinstance(module_path_or_cls, str):
        if class_name is None:
            raise ValueError("class_name is required when registering with module path")
        return lambda: getattr(importlib.import_module(module_path_or_cls), class_name)
    return lambda: module_path_or_cls


class WeightTransferEngineFactory:
    _registry: dict = {}

    @classmethod
    def register_engine(cls, name, module_path_or_cls, class_name=None) -> None:
        if name in cls._registry:
            raise ValueError(f"Weight transfer engine '{name}' is already registered.")
        cls._registry[name] = _loader(module_path_or_cls, class_name)

    @classmethod
    def create_engine(cls, config, vllm_config, device, model):
        if config.backend not in cls._registry:
            raise ValueError(f"Invalid weight transfer backend: {config.backend}. "
                             f"Available engines: {list(cls._registry)}")
        engine_cls = cls._registry[config.backend]()
        return engine_cls(config, vllm_config, device, model)


class WeightTransferTrainerFactory:
    _registry: dict = {}

    @classmethod
    def register_engine(cls, name, module_path_or_cls, class_name=None) -> None:
        if name in cls._registry:
            raise ValueError(f"Weight transfer trainer engine '{name}' is already registered.")
        cls._registry[name] = _loader(module_path_or_cls, class_name)

    @classmethod
    def trainer_init(cls, backend, config, init_info, *, client, source):
        if backend not in cls._registry:
            raise ValueError(f"Invalid weight transfer backend: {backend}. "
                             f"Available trainer engines: {list(cls._registry)}")
        engine_cls = cls._registry[backend]()
        return engine_cls.trainer_init(config=config, init_info=init_info, client=client, source=source)


for _name, _cls in (("nccl", "NCCLWeightTransferEngine"), ("ipc", "IPCWeightTransferEngine"),
                    ("sparse_nccl", "SparseNCCLWeightTransferEngine")):
    WeightTransferEngineFactory.register_engine(_name, f"vllm.distributed.weight_transfer.{_name}_engine", _cls)
