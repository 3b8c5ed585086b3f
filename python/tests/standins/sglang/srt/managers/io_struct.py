"""STAND-IN: sglang.srt.managers.io_struct.UpdateWeightsFromTensorReqInput:
one serialized payload per TP rank, the load format, whether to flush the
cache afterwards."""
from dataclasses import dataclass
from typing import List, Optional, Union


@dataclass
class UpdateWeightsFromTensorReqInput:
    serialized_named_tensors: List[Union[str, bytes]]
    load_format: Optional[str] = None
    flush_cache: bool = True
