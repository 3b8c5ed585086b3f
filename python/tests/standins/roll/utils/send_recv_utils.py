"""STAND-IN for roll/utils/send_recv_utils.py of alibaba/ROLL @
8eb27cc2dc34c4d1310b169d9b86d339004d811a (checked 2026-12-06), the
non-SGLang path: serialize_named_weights(named_weights, infer_strategy)
flattens the bucket into one int8 tensor with per-tensor metadata (name,
shape, dtype, start_idx, end_idx, numel) and returns
MultiprocessingSerializer.serialize({"bucket": ..., "tensors_meta": ...});
named_tensors_from_bucket(bucket, tensors_meta) rebuilds the (name, tensor)
views. monkey_patch_torch_reductions() does nothing here (ROLL patches
torch's CUDA reductions for device-index remapping).

Left out: the SGLang path (FlattenedTensorBucket, load_format
'flattened_bucket'), moving CPU buckets to the device, the CUDA-side
bucketing. Not ROLL's code."""
import torch

from roll.utils.cuda_ipc_utils import MultiprocessingSerializer


def monkey_patch_torch_reductions() -> None:
    pass


def _bucket_named_tensors(named_tensors):
    if not named_tensors:
        raise ValueError("Cannot create empty tensor bucket")
    meta, flat, idx = [], [], 0
    for name, tensor in named_tensors:
        f = tensor.contiguous().flatten().view(torch.int8)
        meta.append({"name": name, "shape": list(tensor.shape), "dtype": tensor.dtype, "start_idx": idx,
                     "end_idx": idx + f.numel(), "numel": f.numel()})
        flat.append(f)
        idx += f.numel()
    return torch.cat(flat, dim=0), meta


def named_tensors_from_bucket(bucket, tensors_meta):
    return [(m["name"], bucket[m["start_idx"]:m["end_idx"]].view(m["dtype"]).reshape(torch.Size(m["shape"])))
            for m in tensors_meta]


def serialize_named_weights(named_weights, infer_strategy: str):
    if infer_strategy == "sglang":
        raise NotImplementedError("the stand-in has no SGLang path (FlattenedTensorBucket)")
    bucket, meta = _bucket_named_tensors(named_weights)
    monkey_patch_torch_reductions()
    return MultiprocessingSerializer.serialize({"bucket": bucket, "tensors_meta": meta})
