"""numqsa: QSA sparse attention (Qwen3.8-Flash-Next) as numba.cuda kernels.

Every public function mirrors the float64 oracle in :mod:`oracle` name for name and argument for
argument, adding ``out=``/``stream=`` where they apply. NumPy inputs give NumPy outputs; numba
device arrays and PyTorch/CuPy CUDA tensors are used in place. :class:`QSAPrefillWrapper` plans a
batch once and runs each layer with prepared launches; :func:`qsa_prefill` is a thin layer over it.
"""
from oracle.validate import QSAInputError

from .attention import page4_attention, page4_plan, sparse_attention
from .prefill import Workspace, qsa_prefill
from .wrapper import QSAPrefillWrapper
from .selection import expand_tokens, index_keys, index_queries, index_scores, select, topk_groups

__version__ = "0.1.0"

__all__ = [
    "QSAInputError", "index_keys", "index_queries", "index_scores", "topk_groups",
    "expand_tokens", "select", "page4_plan", "sparse_attention", "page4_attention", "qsa_prefill",
    "Workspace", "QSAPrefillWrapper",
]
