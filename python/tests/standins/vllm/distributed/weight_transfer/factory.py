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
    def trainer_init(cls, backend, config, init_info, *, client, source):
        return cls._lookup(backend).trainer_init(config=config, init_info=init_info, client=client, source=source)


for _name, _cls in (("nccl", "NCCLWeightTransferEngine"), ("ipc", "IPCWeightTransferEngine"),
                    ("sparse_nccl", "SparseNCCLWeightTransferEngine")):
    WeightTransferEngineFactory.register_engine(_name, f"vllm.distributed.weight_transfer.{_name}_engine", _cls)
