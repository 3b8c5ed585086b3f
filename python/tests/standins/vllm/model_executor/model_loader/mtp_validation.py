"""STAND-IN for vllm/model_executor/model_loader/mtp_validation.py of
vllm-project/vllm @ 67837fe3f210997ba8f9d2ea4feb99bee6b302df (checked
2026-12-06): a context variable, on by default, that models' load_weights
read to decide whether to insist that a checkpoint holds every MTP
(multi-token prediction) layer; disable_mtp_completeness_check() turns it off
for the duration of one load. vLLM's nccl and ipc engines wrap their
model.load_weights() calls in it, because a weight update may carry only
some of the weights. Written for shmcast's tests; not vLLM's code."""
from contextlib import contextmanager
from contextvars import ContextVar

_enabled: ContextVar = ContextVar("mtp_completeness_check_enabled", default=True)


def is_mtp_completeness_check_enabled() -> bool:
    return _enabled.get()


@contextmanager
def disable_mtp_completeness_check():
    token = _enabled.set(False)
    try:
        yield
    finally:
        _enabled.reset(token)
