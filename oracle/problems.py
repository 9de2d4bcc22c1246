"""Random QSA problems (NumPy only) for tests, benchmarks and the main job.

A problem is a dict of arrays in the spec's layouts: paged K/V and index caches with a random
physical page order, page tables, and a batch of query rows. Values are drawn in the storage dtype.
"""
import numpy as np

__all__ = ["make_problem", "kv_views"]


def kv_views(kv_shape, dtype, layout, rng):
    """Random ``(k_cache, v_cache)`` ``[num_pages, page_size, Hkv, D]`` views in one of the spec's layouts.

    ``contiguous``: two arrays; ``interleaved``: ``kv[:, 0]``, ``kv[:, 1]`` of one
    ``[num_pages, 2, page_size, Hkv, D]`` array; ``head_major``: ``[num_pages, Hkv, page_size, D]``
    arrays seen through a transpose. No layout copies on the way.
    """
    n, ps, hkv, d = kv_shape
    if layout == "contiguous":
        return (rng.standard_normal(kv_shape).astype(dtype),
                rng.standard_normal(kv_shape).astype(dtype))
    if layout == "interleaved":
        kv = rng.standard_normal((n, 2, ps, hkv, d)).astype(dtype)
        return kv[:, 0], kv[:, 1]
    if layout == "head_major":
        k = rng.standard_normal((n, hkv, ps, d)).astype(dtype)
        v = rng.standard_normal((n, hkv, ps, d)).astype(dtype)
        return k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    raise ValueError(f"unknown layout {layout!r}")


def _page_table(rng, lens, units_per_page, spare):
    """A table with pages shuffled over a pool ``spare`` times larger than needed."""
    need = [-(-int(n) // units_per_page) for n in lens]
    cols = max(need + [1])
    pool = rng.permutation(max(1, int(sum(need) * spare) + 1))
    table = np.full((len(lens), cols), -1, dtype=np.int32)
    at = 0
    for q, k in enumerate(need):
        table[q, :k] = pool[at:at + k]
        at += k
    return table, int(pool.size)


def make_problem(seq_lens, rows_per_req=None, *, positions=None, req_ids=None, page_size=64,
                 Hq=6, Hkv=1, D=256, Hi=4, Di=128, r=4, dtype=np.float16, layout="contiguous",
                 shared_index_table=True, seed=0, spare_pages=1.25):
    """A batch over requests of the given lengths.

    Rows default to the last ``rows_per_req`` positions of each request (prefill of the chunk
    ending at ``seq_len``); pass ``positions``/``req_ids`` to choose them (inert and stale rows too).
    With ``shared_index_table`` the index cache shares the main page table
    (``idx_page_rows = page_size // r``); otherwise it gets its own pages and table.
    """
    rng = np.random.default_rng(seed)
    lens = np.asarray(seq_lens, dtype=np.int32)
    if positions is None:
        rows_per_req = rows_per_req or [int(n) for n in lens]
        req_ids = np.concatenate([np.full(k, q, np.int32) for q, k in enumerate(rows_per_req)])
        positions = np.concatenate([np.arange(lens[q] - k, lens[q], dtype=np.int32)
                                    for q, k in enumerate(rows_per_req)])
    req_ids = np.asarray(req_ids, dtype=np.int32)
    positions = np.asarray(positions, dtype=np.int32)
    block_table, num_pages = _page_table(rng, lens, page_size, spare_pages)
    k_cache, v_cache = kv_views((num_pages, page_size, Hkv, D), dtype, layout, rng)
    if shared_index_table:
        index_block_table, idx_pages, idx_rows = block_table, num_pages, page_size // r
    else:
        idx_rows = max(1, page_size // r // 2 + 1)
        index_block_table, idx_pages = _page_table(rng, lens // r, idx_rows, spare_pages)
    index_cache = rng.standard_normal((idx_pages, idx_rows, Di)).astype(dtype)
    rows = req_ids.shape[0]
    return dict(
        qi=rng.standard_normal((rows, Hi, Di)).astype(dtype),
        index_cache=index_cache, index_block_table=index_block_table,
        q=rng.standard_normal((rows, Hq, D)).astype(dtype),
        k_cache=k_cache, v_cache=v_cache, block_table=block_table,
        req_ids=req_ids, positions=positions, seq_lens=lens,
    )
