"""STAND-IN: sglang.srt.distributed's tensor-parallel queries (parallel_state,
ported from vLLM). The stand-in TP worker sets its rank (_set_tp)."""
_tp = {"rank": 0, "size": 1}


def _set_tp(rank: int, size: int) -> None:
    _tp.update(rank=rank, size=size)


def get_tensor_model_parallel_rank() -> int:
    return _tp["rank"]


def get_tensor_model_parallel_world_size() -> int:
    return _tp["size"]
