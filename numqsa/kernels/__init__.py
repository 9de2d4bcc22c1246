"""numba.cuda kernels, one pipeline stage per module.

Each module exposes ``make_<stage>_kernel(...)`` factories (cached per compile-time constants), a
``launch(...)`` used by :mod:`numqsa.api`, and ``RESOURCE_CASES`` for :mod:`numqsa.resources`.
"""
