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
    if isinstance(stream, type(cuda.default_stream())):               # a numba stream
        return stream
    for attr in ("cuda_stream", "ptr"):              # torch.cuda.Stream, cupy.cuda.Stream
        if hasattr(stream, attr):
            stream = getattr(stream, attr)
            break
    if SIMULATOR or int(stream) == 0:   # the simulator's launches are synchronous anyway
        return cuda.default_stream()
    return cuda.external_stream(int(stream))


def is_host(x):
    return isinstance(x, np.ndarray)


def as_device(x, stream):
    """``(device_array, was_host)``: NumPy is copied (made contiguous first), CUDA arrays are viewed."""
    if isinstance(x, np.ndarray):
        return cuda.to_device(np.ascontiguousarray(x), stream=stream), True
    if hasattr(x, "copy_to_host") and hasattr(x, "copy_to_device"):   # numba (or simulator) array
        return x, False
    if hasattr(x, "__cuda_array_interface__"):                          # PyTorch, CuPy, ...
        # No synchronisation on the producer's stream: every launch goes on the caller's stream,
        # where the inputs must be ready (as for any stream-ordered op); a sync here would also
        # break CUDA-graph capture.
        return cuda.as_cuda_array(x, sync=False), False
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


KERNEL_FLOATS = ("float16", "float32")


def float_dtype(x, name):
    """The dtype name of a floating input the kernels take, or a clear error."""
    from oracle.validate import QSAInputError, dtype_name
    dt = dtype_name(x)
    if dt not in KERNEL_FLOATS:
        raise QSAInputError(f"{name} has dtype {dt}; the kernels take {', '.join(KERNEL_FLOATS)}")
    return dt


def ints(x, stream):
    """Device int32 array of a small integer array (int64 inputs are converted on the host)."""
    from oracle.validate import dtype_name, host_ints
    if dtype_name(x) != "int32":
        x = host_ints(x).astype(np.int32)
    return as_device(x, stream)[0]


def out_buffer(out, shape, dtype, stream, name):
    """A caller's output buffer after a shape/dtype check, or a fresh device array."""
    from oracle.validate import QSAInputError, dtype_name
    if out is None:
        return empty(shape, dtype, stream)
    want = np.dtype(dtype).name
    if tuple(out.shape) != tuple(shape) or dtype_name(out) != want:
        raise QSAInputError(f"out for {name} must be {want} {tuple(shape)}, got "
                            f"{dtype_name(out)} {tuple(out.shape)}")
    return as_device(out, stream)[0]


def finish(result, was_host, out, stream):
    """NumPy back for NumPy callers (into ``out`` if that was a NumPy array), else the device array."""
    if not was_host:
        return result
    host = host_like(result, True, stream)
    if isinstance(out, np.ndarray):
        out[...] = host
        return out
    return host


_CONSTANTS = {}


def constant(values, stream):
    """A small read-only device copy of ``values``, made once per device and content, then reused.

    Launch metadata that depends only on shapes and strides (row windows, stride tables) goes
    through here, so repeated calls neither allocate nor copy, as CUDA-graph capture requires.
    """
    a = np.ascontiguousarray(values)
    try:
        device_id = cuda.get_current_device().id
    except Exception:          # the simulator's device object differs; one device there
        device_id = 0
    key = (device_id, a.dtype.str, a.shape, a.tobytes())
    buf = _CONSTANTS.get(key)
    if buf is None:
        buf = _CONSTANTS[key] = cuda.to_device(a, stream=stream)
    return buf
