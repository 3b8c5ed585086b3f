"""STAND-IN for sglang.srt.entrypoints.engine.Engine.update_weights_from_tensor
of sgl-project/sglang @ 001067fffe33427bee0ed2f007fb7551a1d76b44:
update_weights_from_tensor(named_tensors, load_format=None, flush_cache=True)
serializes `named_tensors` once per TP rank with MultiprocessingSerializer
(_serialize_tensors_per_rank), sends one UpdateWeightsFromTensorReqInput
through the tokenizer manager to the schedulers, where each TP rank
deserializes its own payload and runs its ModelRunner's
update_weights_from_tensor; the result is (success, message), the cache is
flushed after a successful update when flush_cache is set.

The stand-in's "tokenizer manager" is a callable that delivers the request to
every TP rank (the test sends it to the rank processes over a socket) and
returns their (success, message) pairs. This Engine has no session calls:
the offline Engine @ 001067ff has no begin_weight_update.

SessionEngine (not an SGLang class name) is a session-era server's weight
API as a trainer reaches it through an engine client or the HTTP routes
/begin_weight_update (body {"selector": "all"}) and /end_weight_update:
begin_weight_update(selector="all") and end_weight_update(), each delivered
to every TP rank's scheduler, plus update_weights_from_tensor as above.
Not SGLang's code."""
from typing import Callable, List, Optional

from sglang.srt.managers.io_struct import (
    BeginWeightUpdateReqInput,
    EndWeightUpdateReqInput,
    UpdateWeightsFromTensorReqInput,
)
from sglang.srt.utils import MultiprocessingSerializer


class Engine:
    def __init__(self, tp_size: int, deliver: Callable[[UpdateWeightsFromTensorReqInput], List[tuple]]):
        self.tp_size = tp_size
        self._deliver = deliver

    def _serialize_tensors_per_rank(self, tensors, load_format: Optional[str]) -> list:
        return [MultiprocessingSerializer.serialize(tensors) for _ in range(self.tp_size)]

    def update_weights_from_tensor(self, named_tensors, load_format: Optional[str] = None, flush_cache: bool = True):
        obj = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=self._serialize_tensors_per_rank(named_tensors, load_format),
            load_format=load_format, flush_cache=flush_cache)
        results = self._deliver(obj)
        ok = all(r[0] for r in results)
        return ok, "Success" if ok else "; ".join(r[1] for r in results if not r[0])


class SessionEngine(Engine):
    def begin_weight_update(self, selector: str = "all"):
        return self._all(self._deliver(BeginWeightUpdateReqInput(selector=selector)))

    def end_weight_update(self):
        return self._all(self._deliver(EndWeightUpdateReqInput()))

    @staticmethod
    def _all(results):
        ok = all(r[0] for r in results)
        return {"success": ok, "message": "Success" if ok else "; ".join(r[1] for r in results if not r[0])}
