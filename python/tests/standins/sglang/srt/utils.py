"""STAND-IN: sglang.srt.utils MultiprocessingSerializer (torch's
ForkingPickler, so CPU tensors travel as shared memory and CUDA tensors as
CUDA IPC handles; output_str gives base64 for HTTP) and dynamic_import
("package.module.attr" -> attr). Not SGLang's code."""
import base64
import importlib
import io

from multiprocessing.reduction import ForkingPickler

import torch.multiprocessing  # noqa: F401  (registers torch's tensor reducers with ForkingPickler; newer torch
# no longer re-exports ForkingPickler from torch.multiprocessing.reductions)


class MultiprocessingSerializer:
    @staticmethod
    def serialize(obj, output_str: bool = False):
        buf = io.BytesIO()
        ForkingPickler(buf).dump(obj)
        out = buf.getvalue()
        return base64.b64encode(out).decode("utf-8") if output_str else out

    @staticmethod
    def deserialize(data):
        if isinstance(data, str):
            data = base64.b64decode(data)
        return ForkingPickler.loads(data)


def dynamic_import(func_path: str):
    module_path, _, name = func_path.rpartition(".")
    return getattr(importlib.import_module(module_path), name)
