"""STAND-IN for vllm/distributed/weight_transfer/base.py of vllm-project/vllm
@ 02f250b03f38822ccdb63f27a3005d10ca81f385 (the trainer-engine API: WeightSource,
TrainerInitInfo(rank=...), TrainerWeightTransferEngine.trainer_init/send_weights;
documented for vLLM v0.29 on docs.vllm.ai). Written for shmcast's tests, not
copied: same class names, generic parameters, constructor and method
signatures, dataclass fields and the same control flow in the concrete
methods (parse_*_info wrap TypeError into ValueError; update_weights parses,
calls receive_weights, then synchronizes the accelerator).

Left out: typing-only imports; `torch.accelerator` (torch >= 2.6) falls back
to torch.cuda here, because CI runs torch 1.13."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import torch

from vllm.config.weight_transfer import WeightTransferConfig

TInitInfo = TypeVar("TInitInfo", bound="WeightTransferInitInfo")
TUpdateInfo = TypeVar("TUpdateInfo", bound="WeightTransferUpdateInfo")
TConfig = TypeVar("TConfig", bound="WeightTransferConfig")


def _accelerator_synchronize() -> None:
    acc = getattr(torch, "accelerator", None)
    if acc is not None:
        acc.synchronize()
    elif torch.cuda.is_available():
        torch.cuda.synchronize()


def materialize_full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full_tensor() (a collective), any other tensor as it is."""
    full = getattr(tensor, "full_tensor", None)
    return full() if callable(full) else tensor


@dataclass(frozen=True)
class ParamMeta:
    name: str
    dtype: torch.dtype
    shape: tuple


class WeightSource(ABC):
    """Re-iterable (name, tensor) stream plus metadata(); every trainer rank
    iterates it in the same order (materializing is a collective)."""

    @abstractmethod
    def metadata(self) -> list:
        raise NotImplementedError

    @abstractmethod
    def __iter__(self) -> Iterator:
        raise NotImplementedError


class ModuleSource(WeightSource):
    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module

    def metadata(self) -> list:
        return [ParamMeta(n, p.dtype, tuple(p.shape)) for n, p in self._module.named_parameters()]

    def __iter__(self):
        for n, p in self._module.named_parameters():
            yield n, materialize_full_tensor(p)


@dataclass
class WeightTransferInitInfo(ABC):  # noqa: B024
    pass


@dataclass
class TrainerInitInfo(WeightTransferInitInfo):
    rank: int = field(kw_only=True)

    @property
    def is_sender(self) -> bool:
        return self.rank == 0


@dataclass
class WeightTransferUpdateInfo(ABC):  # noqa: B024
    pass


@dataclass
class WeightTransferInitRequest:
    init_info: dict = field(default_factory=dict)


@dataclass
class WeightTransferUpdateRequest:
    update_info: dict = field(default_factory=dict)


class WeightTransferEngine(ABC, Generic[TInitInfo, TUpdateInfo]):
    init_info_cls: type
    update_info_cls: type

    supports_draft_weight_update: bool = True

    def __init__(self, config: WeightTransferConfig, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        self.config = config
        self.vllm_config = vllm_config
        self.parallel_config = vllm_config.parallel_config
        self.model_config = vllm_config.model_config
        self.device = device
        self.model = model
        self._default_model_config = self.model_config
        self._default_model = model

    def set_weight_update_target(self, model: torch.nn.Module, model_config: Any) -> None:
        self.model = model
        self.model_config = model_config

    def reset_weight_update_target(self) -> None:
        self.model = self._default_model
        self.model_config = self._default_model_config

    def _parse(self, cls, d: dict, what: str):
        try:
            return cls(**d)
        except TypeError as e:
            raise ValueError(f"Invalid {what} for {type(self).__name__}: {e}") from e

    def parse_init_info(self, init_dict: dict) -> TInitInfo:
        return self._parse(self.init_info_cls, init_dict, "init_info")

    def parse_update_info(self, update_dict: dict) -> TUpdateInfo:
        return self._parse(self.update_info_cls, update_dict, "update_info")

    @abstractmethod
    def init_transfer_engine(self, init_info: TInitInfo) -> None:
        raise NotImplementedError

    @abstractmethod
    def start_weight_update(self) -> None:
        raise NotImplementedError

    @abstractmethod
    def finish_weight_update(self) -> None:
        raise NotImplementedError

    def update_weights(self, update_info: dict) -> None:
        typed = self.parse_update_info(update_info)
        self.receive_weights(typed)
        _accelerator_synchronize()

    @abstractmethod
    def receive_weights(self, update_info: TUpdateInfo) -> None:
        raise NotImplementedError

    @abstractmethod
    def shutdown(self) -> None:
        raise NotImplementedError

    @staticmethod
    @abstractmethod
    def trainer_send_weights(iterator: Iterator, trainer_args: Any) -> None:
        raise NotImplementedError


@runtime_checkable
class VLLMWeightSyncClient(Protocol):
    """The trainer's handle on the inference side's four weight-sync calls."""

    def init_weight_transfer_engine(self, init_info: dict) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict) -> None: ...

    def finish_weight_update(self) -> None: ...


class TrainerWeightTransferEngine(ABC, Generic[TConfig, TInitInfo]):
    init_info_cls: type
    config_cls: type

    def __init__(self, config: TConfig, *, client: VLLMWeightSyncClient, source: WeightSource,
                 is_sender: bool = True) -> None:
        self.config = config
        self.is_sender = is_sender
        self.client = client
        self.source = source

    @classmethod
    @abstractmethod
    def trainer_init(cls, config: TConfig, init_info: TInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource):
        raise NotImplementedError

    @abstractmethod
    def send_weights(self) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass
