"""What every stage launcher shares: value-check policy, kernel dtypes, index arrays, buffers.

The stage layer (:mod:`numqsa.stages`) sits between :class:`numqsa.QSAPrefillWrapper` and the
kernels: it checks a stage's arguments, picks its route (:mod:`numqsa.plan`) and launches.
"""
import numpy as np

from oracle import validate as V

from .. import device as dev
from ..kernels.convert import launch_saturate_int32
from ..kernels.guard import launch_guard

__all__ = ["values_checked", "kernel_dtype", "ints", "guard_positions", "fill_out", "Buffers"]


def values_checked(validate, *arrays):
    """Whether value checks run: ``validate=True`` always (device arrays are read back), None when
    every array they read is on the host (no call on device arrays waits), False never."""
    if validate is None:
        return all(isinstance(a, np.ndarray) for a in arrays)
    return bool(validate)


def kernel_dtype(x, name, kind):
    """The kernel dtype of a float input: float16, bfloat16 (ml_dtypes NumPy arrays, torch
    bfloat16 tensors, numba arrays of dtype ml_dtypes.bfloat16) or float32."""
    dt = V.dtype_name(x)
    if dt == "void16":
        raise V.QSAInputError(
            f"{name} has dtype void16 (a 16-bit type the CUDA array interface cannot name, e.g. "
            f"bfloat16 seen through __cuda_array_interface__); pass the torch tensor itself, or a "
            f"numba array viewed as ml_dtypes.bfloat16")
    if dt not in dev.KERNEL_FLOATS:
        raise V.QSAInputError(f"{name} has dtype {dt}; the kernels take "
                              f"{', '.join(dev.KERNEL_FLOATS)}")
    return dt


def ints(x, stream, name="index array", out=None):
    """Device int32 array of a small integer array.

    Host arrays are range-checked (:func:`numqsa.device.host_int32`) and copied; device int32 arrays
    are used in place; device int64 arrays are converted on the device with saturation (no host
    read), which keeps their meaning under spec §1: an id beyond int32 stays out of range (inert row, invalid page), a
    position beyond it stays past the end (clamped), a negative one stays negative (inert).
    ``out`` (optional, int32 of the same shape) receives a conversion instead of a new buffer.
    """
    if isinstance(x, np.ndarray) or isinstance(x, (list, tuple)):
        return dev.as_device(dev.host_int32(x, name), stream)[0]
    d = dev.as_device(x, stream)[0]
    if V.dtype_name(d) == "int32":
        return d
    out = dev.empty(d.shape, np.int32, stream) if out is None else out
    return launch_saturate_int32(d, out, stream)


def guard_positions(req_ids, positions, seq_lens, index_block_table, index_cache, out, stream, r,
                    block_table=None, k_cache=None):
    """``out``: ``positions``, or ``-1`` for the rows that need a bad page id of the index table or,
    when given, of the block table (:mod:`numqsa.kernels.guard`), so that every later stage sees
    them inert. Device int32 arrays; nothing is read back."""
    kv = {} if block_table is None else dict(ktable=block_table, n_kpages=int(k_cache.shape[0]),
                                             page_size=int(k_cache.shape[1]))
    return launch_guard(req_ids, positions, seq_lens, index_block_table, int(index_cache.shape[0]),
                        int(index_cache.shape[1]), out, stream, r=r, **kv)


def fill_out(out, names, fresh):
    """``out`` as a full tuple of ``len(names)`` buffers, ``None`` entries replaced by ``fresh(i)``."""
    if not isinstance(out, (tuple, list)) or len(out) != len(names):
        raise V.QSAInputError(f"out must be a tuple ({', '.join(names)}), got "
                              f"{type(out).__name__}" + (f" of {len(out)}" if isinstance(
                                  out, (tuple, list)) else ""))
    if all(b is not None for b in out):
        return tuple(out)
    return tuple(fresh(i) if b is None else b for i, b in enumerate(out))


class Buffers:
    """Device buffers kept by device and name, reallocated only when the shape or dtype changes."""

    def __init__(self):
        self._buffers = {}

    def buffer(self, name, shape, dtype, stream):
        """The buffer ``name`` on the current device."""
        shape, dtype = tuple(int(s) for s in shape), dev.np_dtype(dtype)
        key = (dev.current_device(), name)
        buf = self._buffers.get(key)
        if buf is None or tuple(buf.shape) != shape or np.dtype(buf.dtype) != dtype:
            buf = dev.empty(shape, dtype, stream or 0)
            self._buffers[key] = buf
        return buf

    def kept(self, name):
        """The buffer ``name`` of the current device (None if there is none)."""
        return self._buffers.get((dev.current_device(), name))

    def put(self, name, host, stream):
        """A kept device buffer holding a copy of ``host`` (ordered on ``stream``)."""
        buf = self.buffer(name, host.shape, host.dtype, stream)
        if host.size:               # (the simulator refuses empty copies of unequal strides)
            dev.copy_to_device(buf, host, stream or 0)
        return buf

    @property
    def nbytes(self):
        return sum(b.size * np.dtype(b.dtype).itemsize for b in self._buffers.values())
