"""numqsa: QSA sparse attention (Qwen3.8-Flash-Next) as numba.cuda kernels.

Every public function mirrors the float64 oracle in :mod:`oracle` name for name and argument for
argument, adding ``out=``/``stream=`` where they apply. NumPy inputs give NumPy outputs; numba
device arrays and PyTorch/CuPy CUDA tensors are used in place. :class:`QSAPrefillWrapper` plans a
batch once and runs each layer with prepared launches; :func:`qsa_prefill`, :func:`select` and
:func:`sparse_attention` are thin layers over it. By default (``validate=None``) no call on device
arrays reads them back, so none waits for the GPU.

Layers, each importing only those below it (``tests/test_layers.py`` checks): :mod:`numqsa.api`
(the functional calls) -> :mod:`numqsa.wrapper` (plan once, run per layer) -> :mod:`numqsa.stages`
(each stage's launcher: checks, route, launches; the single-stage public functions are these) ->
:mod:`numqsa.kernels` (kernel factories and their launches) -> :mod:`numqsa.plan`,
:mod:`numqsa.device` (array interop), :mod:`numqsa.launch` (prepared launches), :mod:`numqsa.jit`,
:mod:`numqsa.toolchain`; :mod:`oracle` beside them.
"""
import ctypes as _ctypes
import os as _os
import sys as _sys


def _choose_backend():
    """No CUDA driver and no explicit choice: run in the numba CUDA simulator, saying so in one line.

    Must run before numba.cuda is first imported (numba reads ``NUMBA_ENABLE_CUDASIM`` then).
    ``NUMBA_ENABLE_CUDASIM=0`` asks for the GPU and never falls back.
    """
    if "NUMBA_ENABLE_CUDASIM" in _os.environ or "numba.cuda" in _sys.modules:
        return
    try:
        _ctypes.CDLL("libcuda.so.1")
        return
    except OSError:
        pass
    _os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    print("numqsa: no CUDA driver found, running in the numba CUDA simulator (slow; small problems "
          "only; set NUMBA_ENABLE_CUDASIM=0 to require a GPU)", file=_sys.stderr)


_choose_backend()

from oracle.validate import QSAInputError  # noqa: E402

from .api import qsa_prefill, select, sparse_attention  # noqa: E402
from .wrapper import QSAPrefillWrapper, Workspace  # noqa: E402
from .stages.attention import page4_attention, page4_plan  # noqa: E402
from .stages.metadata import rows_from_query_start_loc, tables_from_paged_indptr  # noqa: E402
from .stages.selection import (expand_tokens, index_keys, index_queries, index_scores,  # noqa: E402
                               topk_groups)

__version__ = "0.1.0"

__all__ = [
    "QSAInputError", "index_keys", "index_queries", "index_scores", "topk_groups",
    "expand_tokens", "select", "page4_plan", "sparse_attention", "page4_attention", "qsa_prefill",
    "Workspace", "QSAPrefillWrapper", "rows_from_query_start_loc", "tables_from_paged_indptr",
]
