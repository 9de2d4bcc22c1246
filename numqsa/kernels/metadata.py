"""Batch metadata from what serving engines hand over, built on the device (no host reads).

- :func:`make_rows_kernel`: ``query_start_loc`` / ``cu_seqlens_q`` (flash-attn, vLLM) plus
  ``seq_lens`` -> per-row ``req_ids`` and ``positions``. Request ``q``'s query rows are
  ``qsl[q] .. qsl[q+1]-1``, the last ``qsl[q+1]-qsl[q]`` tokens of its ``seq_lens[q]``; rows at or
  beyond ``qsl[num_reqs]`` (padding) get ``req = -1, position = -1`` (inert).
- :func:`make_paged_kernel`: FlashInfer's ``kv_indptr / kv_indices / kv_last_page_len`` ->
  ``block_table [num_reqs, cols]`` (-1 past a request's pages) and ``seq_lens``.

Both run on every architecture, one kernel per hand-over format; no route to choose.
"""
import functools

from numba import cuda, int32

from ..jit import jit

__all__ = ["launch_rows", "launch_paged", "THREADS"]

THREADS = 128


@functools.lru_cache(maxsize=None)
def make_rows_kernel():
    """One thread per row; the row's request by binary search over ``qsl`` (``num_reqs + 1``)."""

    def kernel(qsl, seq_lens, req_ids, positions):
        i = cuda.grid(1)
        if i >= req_ids.shape[0]:
            return
        n = qsl.shape[0] - 1
        row = int32(i)
        req = int32(-1)
        pos = int32(-1)
        if n > 0 and row >= int32(qsl[0]) and row < int32(qsl[n]):
            lo = int32(0)
            hi = int32(n)          # invariant: qsl[lo] <= row < qsl[hi]
            while hi - lo > int32(1):
                mid = (lo + hi) // int32(2)
                if int32(qsl[mid]) <= row:
                    lo = mid
                else:
                    hi = mid
            start = int32(qsl[lo])
            length = int32(qsl[lo + 1]) - start
            req = lo
            pos = int32(seq_lens[lo]) - length + (row - start)
        req_ids[i] = req
        positions[i] = pos

    kernel.__name__ = "rows_from_query_start_loc"
    return jit(kernel)


@functools.lru_cache(maxsize=None)
def make_paged_kernel():
    """Grid ``(num_reqs, ceil(cols / THREADS))``; thread ``c`` writes column ``c`` of its request."""

    def kernel(indptr, indices, last_page_len, page_size, block_table, seq_lens):
        q = cuda.blockIdx.x
        c = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
        first = int32(indptr[q])
        npages = int32(indptr[q + 1]) - first
        if c < block_table.shape[1]:
            pg = int32(-1)
            if int32(c) < npages:
                pg = int32(indices[first + int32(c)])
            block_table[q, c] = pg
        if c == 0:
            n = int32(0)
            if npages > int32(0):
                n = (npages - int32(1)) * page_size + int32(last_page_len[q])
            seq_lens[q] = n

    kernel.__name__ = "tables_from_paged_indptr"
    return jit(kernel)


def launch_rows(qsl, seq_lens, req_ids, positions, stream):
    from ..launch import launch
    rows = req_ids.shape[0]
    if rows:
        launch(make_rows_kernel(), -(-rows // THREADS), THREADS, stream,
               (qsl, seq_lens, req_ids, positions))
    return req_ids, positions


def launch_paged(indptr, indices, last_page_len, page_size, block_table, seq_lens, stream):
    import numpy as np

    from ..launch import launch
    nreq, cols = block_table.shape
    if nreq:
        launch(make_paged_kernel(), (nreq, max(1, -(-cols // THREADS))), THREADS, stream,
               (indptr, indices, last_page_len, np.int32(page_size), block_table, seq_lens))
    return block_table, seq_lens
