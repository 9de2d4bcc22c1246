"""The float64 NumPy oracle of QSA: what every numqsa kernel is checked against.

It mirrors ``numqsa``'s public API name for name; it never imports numba. Each function's docstring
gives the definition (``docs/contract.md``) and the minimal FLOP and byte counts used by ``bench/``.
Decisions where the spec is silent are written in the docstrings.
"""
from .attention import page4_attention, page4_plan, sparse_attention
from .batch import row_states
from .indexer import gnorm, index_keys, index_queries, rope
from .prefill import qsa_prefill
from .selection import expand_tokens, index_scores, select, topk_groups
from .validate import QSAInputError

__all__ = [
    "QSAInputError", "row_states", "gnorm", "rope", "index_keys", "index_queries",
    "index_scores", "topk_groups", "expand_tokens", "select", "page4_plan", "sparse_attention",
    "page4_attention", "qsa_prefill",
]
