"""Arrays and streams at the API boundary: NumPy in/out, zero-copy CUDA arrays, foreign streams.

NumPy inputs are copied to the device and results copied back; numba device arrays, PyTorch and CuPy
CUDA tensors (anything with ``__cuda_array_interface__``) and DLPack producers (read through
``cuda.core``'s ``StridedMemoryView``) are used in place, strides included. Results come back in the
caller's framework (:func:`array_kind`, :func:`new_array`): torch in, torch out; CuPy in, CuPy out;
NumPy in, NumPy out; numba (or DLPack) in, numba out.

bfloat16: NumPy arrays of ``ml_dtypes.bfloat16`` are copied in as they are (16-bit words); a torch
``bfloat16`` CUDA tensor, whose ``__cuda_array_interface__`` has no bfloat16 type (``<V2``), is
viewed without a copy as a numba device array of dtype ``ml_dtypes.bfloat16`` (:func:`as_numba`).
numba never types such an array: the kernel launchers pass its uint16 view
(:func:`numqsa.kernels.common.bits16`). Results in bfloat16 come back as ``ml_dtypes.bfloat16``
NumPy arrays, ``torch.bfloat16`` tensors, or numba arrays of dtype ``ml_dtypes.bfloat16``.
"""
import os

import numpy as np
from numba import cuda

from .jit import SIMULATOR
from .plan import PROFILES

__all__ = ["resolve_stream", "as_device", "to_device", "copy_to_device", "device_cc", "host_like", "empty", "is_host", "array_kind",
           "as_numba", "describe", "new_array", "current_stream_handle", "stream_handle",
           "host_int32", "is_bf16"]

INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1
_BUILDABLE = set()         # compute capabilities this install's toolchain was checked to build


def resolve_stream(stream=None):
    """A numba stream from ``None`` (default stream), a numba stream, a raw ``cudaStream_t`` handle,
    or a torch/CuPy stream object.

    Every launch path resolves a stream first: the first one also checks that this install's
    toolchain can build for the device (:func:`device_cc`), before any kernel compiles."""
    if not (SIMULATOR or _BUILDABLE):
        device_cc()
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


def is_bf16(a):
    """Whether ``a`` (any array) holds bfloat16 (ml_dtypes NumPy / numba arrays, torch tensors)."""
    dt = getattr(a, "dtype", None)
    return (getattr(dt, "name", None) or str(dt)).replace("torch.", "") == "bfloat16"


def is_host(x):
    return isinstance(x, np.ndarray)


_KINDS = {np.ndarray: "numpy"}


def array_kind(x, name="array"):
    """``"numpy"``, ``"torch"``, ``"cupy"``, ``"numba"`` or ``"cuda"`` (any other
    ``__cuda_array_interface__`` / DLPack producer), or a :class:`QSAInputError` that says why not."""
    t = type(x)
    kind = _KINDS.get(t)                 # the kind is the type's (torch: and the tensor's device)
    if kind is None:
        kind = _kind_of_type(x)
        if kind is not None:
            _KINDS[t] = kind
    if kind == "torch":
        if not x.is_cuda:
            from oracle.validate import QSAInputError
            raise QSAInputError(f"{name} is a CPU torch tensor: pass {name}.cuda() (used in place "
                                f"from then on) or {name}.numpy() (copied in and out)")
        return kind
    if kind is not None:
        return kind
    from oracle.validate import QSAInputError
    if isinstance(x, (list, tuple)):
        raise QSAInputError(f"{name} is a Python {type(x).__name__}; pass an array "
                            f"(np.asarray({name}, dtype=...) or a CUDA tensor)")
    raise QSAInputError(f"{name} is a {type(x).__name__}; expected a NumPy array or a CUDA array "
                        f"(torch, CuPy, numba, __cuda_array_interface__ or DLPack)")


def _kind_of_type(x):
    if isinstance(x, np.ndarray):
        return "numpy"
    mod = type(x).__module__.split(".")[0]
    if mod == "torch":
        return "torch"
    if mod == "cupy":
        return "cupy"
    if hasattr(x, "copy_to_host") and hasattr(x, "copy_to_device"):
        return "numba"
    if hasattr(x, "__cuda_array_interface__") or hasattr(x, "__dlpack__"):
        return "cuda"
    return None


def np_dtype(dtype):
    """``np.dtype(dtype)``, where ``"bfloat16"`` means ``ml_dtypes.bfloat16`` (imported on demand)."""
    if (isinstance(dtype, str) and dtype == "bfloat16") or str(dtype) == "torch.bfloat16":
        return _bf16()
    return np.dtype(dtype)


def _bf16():
    try:
        import ml_dtypes
    except ImportError:
        from oracle.validate import QSAInputError
        raise QSAInputError("bfloat16 arrays need the ml_dtypes package (pip install "
                            "'numqsa[bf16]' or pip install ml_dtypes)") from None
    return np.dtype(ml_dtypes.bfloat16)


def _torch_bf16_view(x):
    """A numba bfloat16 array over a torch bfloat16 CUDA tensor (no copy): its bits' interface
    (read through an int16 view of the same storage), retyped."""
    import torch
    bits = x.view(torch.int16)
    cai = dict(bits.__cuda_array_interface__)
    cai["typestr"] = "<u2"
    holder = _CAI.__new__(_CAI)
    holder.__cuda_array_interface__ = cai
    holder.owner = x
    return cuda.as_cuda_array(holder, sync=False).view(_bf16())


class _CAI:
    """A ``__cuda_array_interface__`` holder for a DLPack producer seen through StridedMemoryView."""

    def __init__(self, view, owner):
        itemsize = np.dtype(view.dtype).itemsize
        strides = None if view.strides is None else tuple(int(s) * itemsize for s in view.strides)
        self.__cuda_array_interface__ = {"data": (int(view.ptr), False), "shape": tuple(view.shape),
                                         "strides": strides, "typestr": np.dtype(view.dtype).str,
                                         "version": 3, "stream": None}
        self.owner = owner


def as_numba(x, name="array"):
    """A numba device array viewing ``x`` (no copy); NumPy arrays are refused here."""
    kind = array_kind(x, name)
    if kind == "numba":
        return x
    if kind == "numpy":
        raise TypeError("as_numba views device memory; copy NumPy arrays with as_device")
    if kind == "torch" and str(x.dtype) == "torch.bfloat16":
        return _torch_bf16_view(x)
    if not SIMULATOR and not hasattr(x, "__cuda_array_interface__") and hasattr(x, "__dlpack__"):
        from cuda.core.utils import StridedMemoryView
        x = _CAI(StridedMemoryView(x, stream_ptr=-1), x)
    # No synchronisation on the producer's stream: every launch goes on the caller's stream,
    # where the inputs must be ready (as for any stream-ordered op); a sync here would also
    # break CUDA-graph capture.
    return cuda.as_cuda_array(x, sync=False)


def to_device(a, stream=0):
    """``cuda.to_device`` that also takes ``ml_dtypes.bfloat16``: numba's host copies go through
    the buffer protocol, which NumPy refuses for that dtype, so its bits travel as uint16."""
    a = np.ascontiguousarray(a)
    if is_bf16(a):
        return cuda.to_device(a.view(np.uint16), stream=stream).view(a.dtype)
    return cuda.to_device(a, stream=stream)


def copy_to_device(buf, host, stream=0):
    """``buf.copy_to_device(host)``, bfloat16 included (as uint16 bits, see :func:`to_device`)."""
    if is_bf16(host):
        buf.view(np.uint16).copy_to_device(np.ascontiguousarray(host).view(np.uint16),
                                           stream=stream)
    else:
        buf.copy_to_device(host, stream=stream)


def as_device(x, stream, name="array"):
    """``(device_array, was_host)``: NumPy is copied (made contiguous first), CUDA arrays are viewed."""
    if isinstance(x, np.ndarray):
        return to_device(x, stream), True
    return as_numba(x, name), False


def describe(x, kind):
    """``(data pointer, layout key)`` of a device array, cheaply (the plan/run hot path).

    The key holds dtype, shape, strides and the pointer's alignment: whatever a launcher may route on.
    """
    if kind == "torch":
        p = x.data_ptr()
        return p, (x.dtype, x.shape, x.stride(), p & 15)
    if kind == "numba":
        if SIMULATOR:
            p = int(x._ary.__array_interface__["data"][0])
            return p, (x.dtype, x.shape, x._ary.strides, p & 15)
        p = x.device_ctypes_pointer.value or 0
        return p, (x.dtype, x.shape, x.strides, p & 15)
    if kind == "cupy":
        p = x.data.ptr
        return p, (x.dtype, x.shape, x.strides, p & 15)
    cai = as_numba(x).__cuda_array_interface__
    p = int(cai["data"][0])
    return p, (cai["typestr"], tuple(cai["shape"]), cai.get("strides"), p & 15)


_TORCH_DTYPES = {}


def new_array(kind, shape, dtype, like, stream):
    """A fresh uninitialised array in the caller's framework (``kind`` of :func:`array_kind`)."""
    dtype = np_dtype(dtype)
    if kind == "torch":
        import torch
        td = _TORCH_DTYPES.get(dtype)
        if td is None:
            td = _TORCH_DTYPES[dtype] = getattr(torch, dtype.name)
        return torch.empty(tuple(shape), dtype=td, device=like.device)
    if kind == "cupy":
        import cupy
        return cupy.empty(tuple(shape), dtype=dtype)
    if kind == "numpy":
        return np.empty(tuple(shape), dtype)
    return cuda.device_array(tuple(shape), dtype=dtype, stream=stream)


def current_stream_handle(kind, like=None):
    """The caller's framework's current stream as a raw handle (0: the legacy default stream)."""
    if kind == "torch":
        import torch
        return int(torch.cuda.current_stream(like.device).cuda_stream)
    if kind == "cupy":
        import cupy
        return int(cupy.cuda.get_current_stream().ptr)
    return 0


def stream_handle(stream):
    """A raw ``cudaStream_t`` from None/0, a numba stream, a raw handle or a torch/CuPy stream."""
    if stream is None:
        return 0
    for attr in ("cuda_stream", "ptr"):              # torch.cuda.Stream, cupy.cuda.Stream
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    if SIMULATOR:
        return 0
    if hasattr(stream, "handle"):                    # numba stream
        h = stream.handle
        return int(h.value or 0) if hasattr(h, "value") else int(h)
    return int(stream)


def host_like(result, was_host, stream):
    """Copy a device result back when the caller passed NumPy."""
    if not was_host:
        return result
    out = result.copy_to_host(stream=stream)
    stream.synchronize()
    return out


def empty(shape, dtype, stream):
    return cuda.device_array(shape, dtype=np_dtype(dtype), stream=stream)


def device_cc():
    """Compute capability of the current device; in the simulator, that of ``NUMQSA_ARCH`` (default sm_90).

    Kernels are compiled for the device's own cc (``NUMQSA_ARCH`` picks the launch profile only, so
    the sm_70 kernels still build on an sm_75+ device with CUDA 13); a device this install's
    toolchain cannot build for (a V100 under CUDA 13) raises :class:`numqsa.toolchain.ToolchainError`.
    """
    if SIMULATOR:
        return PROFILES[os.environ.get("NUMQSA_ARCH", "sm_90")].cc
    cc = tuple(cuda.get_current_device().compute_capability)
    if cc not in _BUILDABLE:
        from .toolchain import check_target   # imported here: `python -m numqsa.toolchain` runs it
        check_target(cc)
        _BUILDABLE.add(cc)
    return cc


#: Floating dtypes the kernels take. bfloat16: tensor-core routes on sm_80+; on sm_70 (no bfloat16
#: tensor cores) the FMA routes (generic attention, light scores) compute it, slower but exact.
KERNEL_FLOATS = ("float16", "bfloat16", "float32")


def float_dtype(x, name):
    """The dtype name of a floating input the kernels take, or a clear error."""
    from oracle.validate import QSAInputError, dtype_name
    dt = dtype_name(x)
    if dt not in KERNEL_FLOATS:
        raise QSAInputError(f"{name} has dtype {dt}; the kernels take {', '.join(KERNEL_FLOATS)}")
    return dt


def host_int32(x, name):
    """A host int32 copy of a host integer array; values outside int32 are refused, never wrapped."""
    from oracle.validate import QSAInputError
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise QSAInputError(f"{name} has dtype {a.dtype}; expected int32 or int64")
    if a.dtype != np.int32 and a.size:
        lo, hi = int(a.min()), int(a.max())
        if lo < INT32_MIN or hi > INT32_MAX:
            bad = lo if lo < INT32_MIN else hi
            at = np.unravel_index(int(np.argmax(a == bad)), a.shape)
            at = at[0] if len(at) == 1 else tuple(int(i) for i in at)
            raise QSAInputError(f"{name}[{at}] = {bad} is outside int32 (numqsa indexes with int32, "
                                f"|value| < 2^31); int64 values that large would be wrapped, so they "
                                f"are refused")
    return np.ascontiguousarray(a, dtype=np.int32)


def out_buffer(out, shape, dtype, stream, name):
    """A caller's output buffer after a shape/dtype check, or a fresh device array.

    A NumPy ``out`` gets a device stand-in (contiguous); :func:`finish` copies the result into the
    caller's array, whatever its strides.
    """
    from oracle.validate import QSAInputError, dtype_name
    if out is None:
        return empty(shape, dtype, stream)
    want = np_dtype(dtype).name
    if not hasattr(out, "shape") or not hasattr(out, "dtype"):
        raise QSAInputError(f"out for {name} must be an array ({want} {tuple(shape)}), got "
                            f"{type(out).__name__}")
    if tuple(out.shape) != tuple(shape) or dtype_name(out) != want:
        raise QSAInputError(f"out for {name} must be {want} {tuple(shape)}, got "
                            f"{dtype_name(out)} {tuple(out.shape)}")
    if isinstance(out, np.ndarray):
        return empty(shape, dtype, stream)
    return as_device(out, stream)[0]


def caller_stream(stream, like):
    """A numba stream: ``stream`` if given, else the current stream of ``like``'s framework
    (torch/CuPy), else the default stream."""
    if stream is None and not isinstance(like, np.ndarray):
        kind = array_kind(like)
        if kind in ("torch", "cupy"):
            stream = current_stream_handle(kind, like)
    return resolve_stream(stream)


def output(out, shape, dtype, stream, name, like):
    """``(device array to launch into, array to return or None)``: the caller's ``out`` (checked,
    see :func:`out_buffer`), else for torch/CuPy ``like`` a fresh array of that framework (torch
    in, torch out; its caching allocator frees without a device synchronisation), else a fresh
    numba array."""
    if out is None and not isinstance(like, np.ndarray):
        kind = array_kind(like)
        if kind in ("torch", "cupy"):
            arr = new_array(kind, shape, dtype, like, stream)
            return as_numba(arr), arr
    return out_buffer(out, shape, dtype, stream, name), None


def finish(result, was_host, out, stream, native=None):
    """As :func:`finish_one`, or ``native`` (the framework array :func:`output` made) if any."""
    if native is not None:
        return native
    return finish_one(result, was_host, out, stream)


def finish_one(result, was_host, out, stream):
    """The caller's ``out`` if one was given (a NumPy ``out`` is written, any strides), NumPy back
    for NumPy callers, else the device array."""
    if isinstance(out, np.ndarray):
        out[...] = host_like(result, True, stream)
        return out
    if not was_host:
        return result
    return host_like(result, True, stream)


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
