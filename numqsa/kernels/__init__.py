"""numba.cuda kernels, one pipeline stage per module (index scores: a package, one module per
kernel family, :mod:`numqsa.kernels.index_scores`).

Each module exposes ``make_<stage>_kernel(...)`` factories (cached per compile-time constants), a
``launch(...)`` used by :mod:`numqsa.api`, and ``RESOURCE_CASES`` for :mod:`numqsa.resources`.
"""
