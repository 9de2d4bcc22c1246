"""One kernel source for the GPU and the numba CUDA simulator.

The simulator (``NUMBA_ENABLE_CUDASIM=1``) rejects some ``cuda.jit`` keyword arguments and has no
warp intrinsics or inline PTX; kernels call :func:`jit` instead of ``cuda.jit`` and branch on the
compile-time constant :data:`SIMULATOR` where the two must differ.
"""
from numba import cuda
from numba.cuda.core import config

SIMULATOR = bool(config.ENABLE_CUDASIM)

_SIM_REJECTS = ("launch_bounds", "max_registers", "lineinfo", "lto", "forceinline",
                "shared_memory_carveout")


def jit(*args, **kwargs):
    """``cuda.jit`` that drops the options the simulator raises on."""
    if SIMULATOR:
        for key in _SIM_REJECTS:
            kwargs.pop(key, None)
    return cuda.jit(*args, **kwargs)


def device_jit(fn=None, **kwargs):
    """``cuda.jit(device=True)`` with the same filtering."""
    if fn is None:
        return lambda f: jit(device=True, **kwargs)(f)
    return jit(device=True, **kwargs)(fn)
