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

Devices: a call runs on the device of its CUDA arrays (:func:`array_device`), inside
:func:`on_device`, which makes that device's primary context current through numba's own
``cuda.gpus[i]`` (and leaves the caller's current context as it was afterwards) only when it is not
already current. Arrays of one call on two devices are refused (:func:`same_device`). What numqsa
keeps between calls (prepared launches, workspaces, constants, the functional calls' wrappers) is
kept per device. The simulator has one device; there :func:`on_device` switches a simulated device
id and the arrays made by :func:`empty` / :func:`to_device` carry the id they were made on, so the
tests can check the bookkeeping with fake device ids.
"""
import contextlib
import functools
import os
import threading

import numpy as np
from numba import cuda

from .jit import SIMULATOR
from .plan import PROFILES

__all__ = ["resolve_stream", "as_device", "to_device", "copy_to_device", "device_cc", "host_like", "empty", "is_host", "array_kind",
           "as_numba", "describe", "new_array", "current_stream_handle", "stream_handle",
           "host_int32", "is_bf16", "array_device", "current_device", "on_device",
           "same_device", "device_error", "on_arrays_device", "device_name"]

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
        return _made(cuda.to_device(a.view(np.uint16), stream=stream).view(a.dtype))
    return _made(cuda.to_device(a, stream=stream))


def _made(a):
    """A fresh device array; in the simulator it carries the simulated device it was made on."""
    if SIMULATOR:
        a._numqsa_device = current_device()
    return a


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
        with like.device:               # CuPy allocates on its current device
            return cupy.empty(tuple(shape), dtype=dtype)
    if kind == "numpy":
        return np.empty(tuple(shape), dtype)
    return _made(cuda.device_array(tuple(shape), dtype=dtype, stream=stream))


def current_stream_handle(kind, like=None):
    """The caller's framework's current stream as a raw handle (0: the legacy default stream)."""
    if kind == "torch":
        import torch
        return int(torch.cuda.current_stream(like.device).cuda_stream)
    if kind == "cupy":
        import cupy
        if like is None:
            return int(cupy.cuda.get_current_stream().ptr)
        try:
            return int(cupy.cuda.get_current_stream(like.device.id).ptr)
        except TypeError:       # an older CuPy: the current device's stream only
            with like.device:
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
    return _made(cuda.device_array(shape, dtype=np_dtype(dtype), stream=stream))


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
    key = (current_device(), a.dtype.str, a.shape, a.tobytes())
    buf = _CONSTANTS.get(key)
    if buf is None:
        buf = _CONSTANTS[key] = cuda.to_device(a, stream=stream)
    return buf


# ------------------------------------------------------------------------------------------------
# Devices: which one holds an array, which one is current, running a call on an array's device
# ------------------------------------------------------------------------------------------------

_SAME = contextlib.nullcontext()    # on_device's answer when nothing needs to switch (reusable)
_sim = threading.local()            # the simulator's current device id
_DLPACK_CUDA = (2, 3, 13)           # DLPack device types kDLCUDA, kDLCUDAHost, kDLCUDAManaged
_driver = []                        # cuda.bindings.driver and its success code (on first use)


def _cu():
    if not _driver:
        from cuda.bindings import driver
        _driver.extend((driver, driver.CUresult.CUDA_SUCCESS))
    return _driver


def device_name(device):
    """``"cuda:1"`` (torch's spelling, which CuPy and numba users read as well)."""
    return "the host" if device is None else f"cuda:{device}"


def current_device():
    """The ordinal of the device whose context is current on this thread.

    0 when no context is current: numba then makes device 0's primary context current at its first
    use, as it always did. One driver call (``cuCtxGetDevice``), every call of a run: numba's
    ``cuda.get_current_device()`` takes a lock, asks the driver twice and would make device 0's
    context current itself when none is. The simulator's id otherwise.
    """
    if SIMULATOR:
        return getattr(_sim, "device", 0)
    cu, ok = _cu()
    err, d = cu.cuCtxGetDevice()
    return int(d) if err == ok else 0


def _pointer_device(ptr):
    """The ordinal of the device holding device pointer ``ptr`` (None for 0 or a pointer the driver
    does not know)."""
    if not ptr:
        return None
    cu, ok = _cu()
    err, ordinal = cu.cuPointerGetAttribute(
        cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, int(ptr))
    return int(ordinal) if err == ok else None


def array_device(x, kind):
    """The ordinal of the CUDA device holding ``x`` (``kind`` of :func:`array_kind`), or None: NumPy
    arrays (copied to the call's device) and empty arrays the driver knows no device of.

    torch ``get_device()``, CuPy ``device.id``, DLPack ``__dlpack_device__``; numba arrays and other
    ``__cuda_array_interface__`` producers by their data pointer (one driver call), since a numba
    view made while another device was current names that device's context, not the memory's.
    In the simulator: the id the array was made on (:func:`on_device`, :func:`empty`), else 0.
    """
    if kind == "torch":
        return x.get_device()
    if kind == "numpy":
        return None
    if SIMULATOR:
        return getattr(x, "_numqsa_device", 0)
    if kind == "cupy":
        return x.device.id
    if kind == "numba":
        return _pointer_device(x.device_ctypes_pointer.value)
    dl = getattr(x, "__dlpack_device__", None)
    if dl is not None:
        kind_id, ordinal = dl()
        if int(kind_id) in _DLPACK_CUDA:
            return int(ordinal)
    cai = getattr(x, "__cuda_array_interface__", None)
    return None if cai is None else _pointer_device(cai["data"][0])


class _SimulatedDevice:
    """The simulator's ``cuda.gpus[i]``: sets the simulated current device id, then restores it."""

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        self.prev = getattr(_sim, "device", 0)
        _sim.device = self.device

    def __exit__(self, *exc):
        _sim.device = self.prev


def on_device(device):
    """A context manager running its block on ``device``: numba's ``cuda.gpus[device]``, which
    pushes that device's primary context and pops it on exit (the caller's current device is left
    as it was, on errors too); a shared null context when ``device`` is None or already current
    (the one-GPU case: one driver call, nothing pushed)."""
    if device is None or device == current_device():
        return _SAME
    if SIMULATOR:
        return _SimulatedDevice(device)
    return cuda.gpus[device]


def device_error(first, other):
    """The refusal of two arrays of one call on two devices (``(name, device)`` pairs)."""
    from oracle.validate import QSAInputError
    (n1, d1), (n2, d2) = first, other
    return QSAInputError(f"{n1} is on {device_name(d1)} and {n2} on {device_name(d2)}: the arrays "
                         f"of one call must be on one device (numqsa runs a call on its arrays' "
                         f"device); move {n2} to {device_name(d1)} or {n1} to {device_name(d2)}")


def same_device(named):
    """The device of the CUDA arrays among ``named`` (``(name, array)`` pairs; NumPy arrays, None
    and anything that is not a CUDA array are skipped), or None if there are none. Arrays on two
    devices raise :class:`QSAInputError` naming both."""
    first = None
    for name, x in named:
        kind = _cuda_kind(x)
        if kind is None:
            continue
        d = array_device(x, kind)
        if d is None:
            continue
        if first is None:
            first = (name, d)
        elif d != first[1]:
            raise device_error(first, (name, d))
    return None if first is None else first[1]


def _cuda_kind(x):
    """:func:`array_kind` of a CUDA array, None for anything else (never raises: a function's own
    checks give the reasons)."""
    if x is None or isinstance(x, (np.ndarray, int, float, str, bool)) or not hasattr(x, "shape"):
        return None
    kind = _KINDS.get(type(x)) or _kind_of_type(x)
    if kind in (None, "numpy") or (kind == "torch" and not x.is_cuda):
        return None
    return kind


def on_arrays_device(fn):
    """Decorator for the public single-stage functions: run ``fn`` on the device of its CUDA array
    arguments (``out=`` buffers included), refusing arrays on two devices before anything runs."""
    code = fn.__code__
    names = code.co_varnames[:code.co_argcount]

    @functools.wraps(fn)
    def on_their_device(*args, **kwargs):
        named = list(zip(names, args)) + list(kwargs.items())
        flat = []
        for name, a in named:
            if name == "out" and isinstance(a, (tuple, list)):
                flat.extend((f"{name}[{i}]", x) for i, x in enumerate(a))
            else:
                flat.append((name, a))
        with on_device(same_device(flat)):
            return fn(*args, **kwargs)
    return on_their_device
