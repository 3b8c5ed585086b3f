"""STAND-IN for vllm/backends/distributed/weight_transfer/base.py of
vllm-project/vllm @ a8f1d79812aa51e1036eba41286879eb09bd1635 (checked
2026-12-06; the trainer-side API after PRs #48981 and #50902). The old path
vllm/distributed/weight_transfer/base.py is kept by vLLM as a re-exporting
shim, and so it is here. Written for shmcast's tests, not copied: same class
names, generic parameters, constructor and method signatures, dataclass
fields, class variables and the same control flow in the concrete methods:

* TrainerInitInfo: a dataclass with `backend: ClassVar[str]` (the
  WeightTransferTrainerFactory key) checked in __init_subclass__ (a subclass
  without a non-empty `backend` is a TypeError at class creation), `rank`
  keyword-only, `is_sender` = rank == 0.
* TrainerWeightTransferEngine: ONE type parameter (the trainer init info);
  __init__(*, client, source=None, is_sender=True), no config; abstract
  classmethod trainer_init(init_info, *, client, source=None) and
  send_weights(); shutdown() does nothing by default.
* WeightTransferEngine (worker side): __init__(config, vllm_config, device,
  model), parse_*_info wrap TypeError into ValueError, update_weights parses,
  calls receive_weights, then synchronizes the accelerator; abstract
  init_transfer_engine, start_weight_update, finish_weight_update,
  receive_weights, shutdown; class variables supports_draft_weight_update
  and defers_processing; drain_pending() does nothing.
* VLLMWeightSyncClient: the four-method protocol; finish_weight_update takes
  an optional weight_version.

Left out: layerwise_groups / WeightSource.groups / iter_groups / held_names
(sharded engines only), typing-only imports; `torch.accelerator` (torch >=
2.6) falls back to torch.cuda here, because CI runs torch 1.13."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Optional, Protocol, TypeVar, runtime_checkable

import torch

from vllm.foundation.config.weight_transfer import WeightTransferConfig

TInitInfo = TypeVar("TInitInfo", bound="WeightTransferInitInfo")
TUpdateInfo = TypeVar("TUpdateInfo", bound="WeightTransferUpdateInfo")
TTrainerInitInfo = TypeVar("TTrainerInitInfo", bound="TrainerInitInfo")


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
class TrainerInitInfo:
    backend: ClassVar[str]
    rank: int = field(kw_only=True)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not getattr(cls, "backend", None):
            raise TypeError(f"{cls.__name__} must set a class-level `backend` string "
                            "(the WeightTransferTrainerFactory registry key).")

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
    update_info: Any = field(default_factory=dict)


class WeightTransferEngine(ABC, Generic[TInitInfo, TUpdateInfo]):
    init_info_cls: type
    update_info_cls: type

    supports_draft_weight_update: bool = True
    defers_processing: bool = False

    def drain_pending(self) -> None:
        pass

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


@runtime_checkable
class VLLMWeightSyncClient(Protocol):
    """The trainer's handle on the inference side's four weight-sync calls."""

    def init_weight_transfer_engine(self, init_info: dict) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: Any) -> None: ...

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None: ...


class TrainerWeightTransferEngine(ABC, Generic[TTrainerInitInfo]):
    init_info_cls: type

    def __init__(self, *, client: VLLMWeightSyncClient, source: Optional[WeightSource] = None,
                 is_sender: bool = True) -> None:
        self.is_sender = is_sender
        self.client = client
        self.source = source

    @classmethod
    @abstractmethod
    def trainer_init(cls, init_info: TTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: Optional[WeightSource] = None):
        raise NotImplementedError

    @abstractmethod
    def send_weights(self) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass
