"""shmcast: move tensors (model weights) from a trainer process to inference
workers on one machine through a named POSIX shared-memory region, pinned
with cudaHostRegister. No CUDA IPC, no pidfd_getfd, no pickled tensor data.

    import shmcast
    prod = shmcast.Producer("actor-0", slot_bytes=512 << 20, slots=2, max_consumers=2)
    version = prod.send(named_tensors)          # iterable of (name, tensor), CPU or CUDA
    cons = shmcast.Consumer("actor-0", device="cuda:0")   # or device="cpu"
    for name, tensor in cons.receive(timeout=30.0): ...
    cons.receive_into({"name": existing_tensor, ...})

Adapters: shmcast.vllm (ShmcastWorkerExtension), shmcast.roll
(serialize_named_weights / named_tensors_from_ticket). docs/python.md has
the whole story.
"""
# torch first. The module reaches CUDA through the driver (libcuda.so.1,
# loaded on first use) and shares the device's primary context with torch's
# runtime.
import torch as _torch  # noqa: F401

try:
    from . import _shmcast
except ImportError as _e:  # pragma: no cover
    raise ImportError(
        f"shmcast: the compiled extension shmcast._shmcast is missing next to {__file__} ({_e}). Build it "
        "(`pip install .`, or cmake --build <build> and put <build>/python on PYTHONPATH); see docs/python.md"
    ) from None
from ._shmcast import (  # noqa: F401  (exceptions: shmcast.Error and one subclass per code)
    Aborted,
    BadName,
    Checksum,
    Closed,
    Corrupt,
    CudaError,
    CudaUnavailable,
    Error,
    Evicted,
    Exists,
    InvalidArgument,
    NoSeat,
    NotFound,
    PeerDied,
    Permission,
    RegionFull,
    SyncInfo,
    SystemFailure,
    Timeout,
    Unsupported,
    NeedsFullSync,
    VersionMismatch,
    cuda_available,
    cuda_unavailable_reason,
    max_delta_groups,
    region_dir,
    region_path,
    unlink_region,
    validate_name,
)
from ._torch import (  # noqa: F401
    Consumer,
    Mismatch,
    Producer,
    ReadOnly,
    ReadOnlyTensor,
    Shard,
    StoreView,
    dtype_name,
    store_bytes_for,
    supported_dtypes,
    torch_dtype,
)
from ._shmcast import default_quantize_filter  # noqa: F401,E402  (quantize-on-send's default rule)
from ._quant import filter_from_config as quantize_filter_from_config  # noqa: F401,E402

try:
    from ._version import __version__  # written by the build: project(VERSION) of CMakeLists.txt
except ImportError:  # pragma: no cover  (a package assembled without the build's _version.py)
    __version__ = f"{_shmcast.version_major}.{_shmcast.version_minor}.0"

__all__ = [
    "Producer", "Consumer", "Shard", "Mismatch", "SyncInfo", "StoreView", "ReadOnlyTensor", "ReadOnly",
    "store_bytes_for",
    "Error", "InvalidArgument", "BadName", "Exists", "NotFound", "RegionFull", "Permission", "Corrupt",
    "VersionMismatch", "Timeout", "PeerDied", "Closed", "NoSeat", "Evicted", "Aborted", "Checksum", "CudaError",
    "CudaUnavailable", "SystemFailure", "Unsupported", "NeedsFullSync",
    "cuda_available", "cuda_unavailable_reason", "region_dir", "region_path", "unlink_region", "validate_name",
    "dtype_name", "torch_dtype", "supported_dtypes", "max_delta_groups",
    "default_quantize_filter", "quantize_filter_from_config",
]
