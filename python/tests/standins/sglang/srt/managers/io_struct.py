"""STAND-IN: the request types of sglang.srt.managers.io_struct that the
weight-update path uses (sgl-project/sglang; UpdateWeightsFromTensorReqInput
as of python/sglang/srt/entrypoints/engine.py @
001067fffe33427bee0ed2f007fb7551a1d76b44, the session requests as stored in
the public index for the weight-update sessions of PR #28001):
one serialized payload per TP rank, the load format, whether to flush the
cache afterwards, and the runner selector ('all', 'target', 'draft');
BeginWeightUpdateReqInput(selector='all'), EndWeightUpdateReqInput().
Not SGLang's code."""
from dataclasses import dataclass
from typing import List, Optional, Union


@dataclass
class UpdateWeightsFromTensorReqInput:
    serialized_named_tensors: List[Union[str, bytes]]
    load_format: Optional[str] = None
    flush_cache: bool = True
    selector: str = "all"


@dataclass
class BeginWeightUpdateReqInput:
    selector: str = "all"


@dataclass
class EndWeightUpdateReqInput:
    pass
