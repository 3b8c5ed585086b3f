"""STAND-IN for MultiprocessingSerializer of roll/utils/cuda_ipc_utils.py
(alibaba/ROLL @ 8eb27cc2dc34c4d1310b169d9b86d339004d811a): torch's
ForkingPickler (CPU tensors as shared memory, CUDA tensors as CUDA IPC
handles); output_str gives base64. Not ROLL's code."""
import base64
import io
from multiprocessing.reduction import ForkingPickler

import torch.multiprocessing  # noqa: F401  (registers torch's tensor reducers with ForkingPickler)


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
