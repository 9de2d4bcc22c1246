"""int64 -> int32 with saturation, on the device (batch metadata handed over as int64 tensors).

Saturating keeps each value's meaning under spec §1 where wrapping would not: a request id or page id
beyond int32 stays out of range (inert row / invalid page), a position beyond it stays past the end
(clamped to the last token), a negative one stays negative (inert).

Every architecture; launched by ``QSAPrefillWrapper.plan`` for int64 metadata; no route to choose.
"""
import functools

from numba import cuda, int32, int64

from ..jit import jit

__all__ = ["launch_saturate_int32"]

THREADS = 256


@functools.lru_cache(maxsize=None)
def make_saturate_kernel(ndim):
    """One thread per element over a 1-D grid; 2-D arrays walk (row, col) from the flat index."""
    LO, HI = int64(-(1 << 31)), int64((1 << 31) - 1)

    if ndim == 1:
        def kernel(src, dst):
            i = cuda.grid(1)
            if i < src.shape[0]:
                dst[i] = int32(min(max(int64(src[i]), LO), HI))
    else:
        def kernel(src, dst):
            i = cuda.grid(1)
            cols = src.shape[1]
            if cols > 0 and i < src.shape[0] * cols:
                r = i // cols
                c = i - r * cols
                dst[r, c] = int32(min(max(int64(src[r, c]), LO), HI))
    kernel.__name__ = f"saturate_int32_{ndim}d"
    return jit(kernel)


def launch_saturate_int32(src, dst, stream):
    """Write ``dst`` (int32, ``src``'s shape) from integer ``src`` (1-D or 2-D device arrays)."""
    from ..launch import launch
    n = 1
    for s in src.shape:
        n *= int(s)
    if n == 0:
        return dst
    k = make_saturate_kernel(len(src.shape))
    launch(k, -(-n // THREADS), THREADS, stream, (src, dst))
    return dst
