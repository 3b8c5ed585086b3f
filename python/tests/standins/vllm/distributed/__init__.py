"""STAND-IN: vllm.distributed's tensor-parallel queries (parallel_state).
The stand-in worker sets the rank and size it runs as (_set_tp); real vLLM
derives them from its model-parallel process groups."""
_tp = {"rank": 0, "size": 1}


def _set_tp(rank: int, size: int) -> None:
    _tp.update(rank=rank, size=size)


def get_tensor_model_parallel_rank() -> int:
    return _tp["rank"]


def get_tensor_model_parallel_world_size() -> int:
    return _tp["size"]


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator
