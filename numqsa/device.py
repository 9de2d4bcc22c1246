"""Arrays and streams at the API boundary: NumPy in/out, zero-copy CUDA arrays, foreign streams.

NumPy inputs are copied to the device and results copied back; numba device arrays, PyTorch and CuPy
CUDA tensors (anything with ``__cuda_array_interface__``; numba-cuda 0.30 has no DLPack import) are
used in place, strides included.
"""
import os

import numpy as np
from numba import cuda

from .jit import SIMULATOR
from .plan import PROFILES

__all__ = ["resolve_stream", "as_device", "device_cc", "host_like", "empty", "is_host"]


def resolve_stream(stream=None):
    """A numba stream from ``None`` (default stream), a numba stream, a raw ``cudaStream_t`` handle,
    or a torch/CuPy stream object."""
    if stream is None or stream == 0:
        return cuda.default_stream()
    if hasattr(stream, "synchronize") and hasattr(stream, "handle"):   # numba Stream
        return stream
    handle = getattr(stream, "cuda_stream", None) or getattr(stream, "ptr", None) or stream
    if SIMULATOR:   # the simulator has no foreign streams; its launches are synchronous anyway
        return cuda.default_stream()
    return cuda.external_stream(int(handle))


def is_host(x):
    return isinstance(x, np.ndarray)


def as_device(x, stream):
    """``(device_array, was_host)``: NumPy is copied (made contiguous first), CUDA arrays are viewed."""
    if isinstance(x, np.ndarray):
        return cuda.to_device(np.ascontiguousarray(x), stream=stream), True
    if hasattr(x, "copy_to_host") and hasattr(x, "copy_to_device"):   # numba (or simulator) array
        return x, False
    if hasattr(x, "__cuda_array_interface__"):                          # PyTorch, CuPy, ...
        return cuda.as_cuda_array(x), False
    raise TypeError(f"expected a NumPy array or a CUDA array, got {type(x).__name__}")


def host_like(result, was_host, stream):
    """Copy a device result back when the caller passed NumPy."""
    if not was_host:
        return result
    out = result.copy_to_host(stream=stream)
    stream.synchronize()
    return out


def empty(shape, dtype, stream):
    return cuda.device_array(shape, dtype=np.dtype(dtype), stream=stream)


def device_cc():
    """Compute capability of the current device; in the simulator, that of ``NUMQSA_ARCH`` (default sm_90)."""
    if SIMULATOR:
        return PROFILES[os.environ.get("NUMQSA_ARCH", "sm_90")].cc
    return tuple(cuda.get_current_device().compute_capability)
