"""Adapters from serving engines' batch metadata to numqsa's (spec §1-§2), on the device.

No host reads (no synchronisation): sizes that a host read would give (the number of rows, the
table width) are arguments. Results are int32 arrays of the input's framework (NumPy in: NumPy out).
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from oracle import validate as V

from .. import device as dev
from ..kernels import metadata as _k
from .common import ints

__all__ = ["rows_from_query_start_loc", "tables_from_paged_indptr"]


def _finish(x, kind, like, stream):
    if kind == "numpy":
        return x.copy_to_host(stream=stream)
    if kind in ("torch", "cupy"):
        out = dev.new_array(kind, x.shape, "int32", like, stream)
        dev.as_numba(out).copy_to_device(x, stream=stream)
        return out
    return x


@dev.on_arrays_device
def rows_from_query_start_loc(query_start_loc: Any, seq_lens: Any, *, rows: Optional[int] = None,
                              stream: Any = None) -> tuple:
    """``(req_ids, positions)`` int32 ``[rows]`` from ``query_start_loc`` (a.k.a. ``cu_seqlens_q``).

    ``query_start_loc [num_reqs + 1]`` (ascending, first 0) gives request ``q`` the query rows
    ``qsl[q] .. qsl[q+1]-1``; they are the *last* tokens of its ``seq_lens[q]`` (the chunk being
    prefilled), so ``positions = seq_lens[q] - n_q + j``. ``rows`` (default ``qsl[-1]``, read on the
    host only when ``qsl`` is a NumPy array) may exceed the batch's rows: extra rows are inert
    padding (``req_ids = positions = -1``), as a fixed-size CUDA-graph batch needs.
    """
    kind = dev.array_kind(query_start_loc, "query_start_loc")
    (n1,) = V._rank(query_start_loc, "query_start_loc", 1, "[num_reqs + 1]")
    (nreq,) = V._rank(seq_lens, "seq_lens", 1, "[num_reqs]")
    if n1 != nreq + 1:
        raise V.QSAInputError(f"query_start_loc has {n1} entries; expected num_reqs + 1 = {nreq + 1}")
    if rows is None:
        if kind != "numpy":
            raise V.QSAInputError("rows is needed when query_start_loc is on the device "
                                  "(reading query_start_loc[-1] back would synchronise)")
        rows = int(np.asarray(query_start_loc)[-1]) if n1 else 0
    rows = V.check_int(rows, "rows", 0)
    s = dev.resolve_stream(stream)
    qsl, lens = ints(query_start_loc, s, "query_start_loc"), ints(seq_lens, s, "seq_lens")
    req, pos = dev.empty((rows,), np.int32, s), dev.empty((rows,), np.int32, s)
    _k.launch_rows(qsl, lens, req, pos, s)
    return _finish(req, kind, query_start_loc, s), _finish(pos, kind, query_start_loc, s)


@dev.on_arrays_device
def tables_from_paged_indptr(kv_indptr: Any, kv_indices: Any, kv_last_page_len: Any, *,
                             page_size: int, cols: int, stream: Any = None) -> tuple:
    """``(block_table int32 [num_reqs, cols], seq_lens int32 [num_reqs])`` from FlashInfer's paged
    layout: request ``q`` owns pages ``kv_indices[kv_indptr[q] : kv_indptr[q+1]]``, the last one
    filled to ``kv_last_page_len[q]`` tokens. Columns past a request's pages are -1; ``cols`` (the
    table width, at least the longest request's page count) is given so that nothing is read back.
    """
    kind = dev.array_kind(kv_indptr, "kv_indptr")
    (n1,) = V._rank(kv_indptr, "kv_indptr", 1, "[num_reqs + 1]")
    V._rank(kv_indices, "kv_indices", 1, "[total_pages]")
    (nreq,) = V._rank(kv_last_page_len, "kv_last_page_len", 1, "[num_reqs]")
    if n1 != nreq + 1:
        raise V.QSAInputError(f"kv_indptr has {n1} entries; expected num_reqs + 1 = {nreq + 1}")
    page_size = V.check_int(page_size, "page_size")
    cols = V.check_int(cols, "cols", 0)
    if kind == "numpy" and nreq:
        longest = int(np.diff(np.asarray(kv_indptr)).max())
        if longest > cols:
            raise V.QSAInputError(f"cols = {cols} is below the longest request's {longest} pages")
    s = dev.resolve_stream(stream)
    ip, ix, lp = (ints(x, s, n) for x, n in ((kv_indptr, "kv_indptr"), (kv_indices, "kv_indices"),
                                                   (kv_last_page_len, "kv_last_page_len")))
    bt, lens = dev.empty((nreq, cols), np.int32, s), dev.empty((nreq,), np.int32, s)
    _k.launch_paged(ip, ix, lp, page_size, bt, lens, s)
    return _finish(bt, kind, kv_indptr, s), _finish(lens, kind, kv_indptr, s)
