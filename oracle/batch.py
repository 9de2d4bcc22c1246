"""The batch description of spec §1, evaluated per row in NumPy."""
import numpy as np


def row_states(req_ids, positions, seq_lens, r):
    """Per row: ``(live, req, p, nb)``.

    ``live`` is False for inert rows (request id outside ``[0, num_reqs)``, negative position, or an
    empty request); for those ``req = p = -1`` and ``nb = 0``. ``p`` is the position clamped to
    ``seq_len - 1`` (stale rows) and ``nb = min((p + 1) // r, seq_len // r)`` the visible groups.
    """
    req = np.asarray(req_ids, dtype=np.int64)
    pos = np.asarray(positions, dtype=np.int64)
    lens = np.asarray(seq_lens, dtype=np.int64)
    live = (req >= 0) & (req < lens.shape[0]) & (pos >= 0)
    slen = np.where(live, lens[np.where(live, req, 0)] if lens.size else 0, 0)
    live &= slen > 0
    p = np.where(live, np.minimum(pos, slen - 1), -1)
    nb = np.where(live, np.minimum((p + 1) // r, slen // r), 0)
    return live, np.where(live, req, -1), p, nb


def _needs_bad(table, req, need, num_pages):
    """Per row: whether one of the first ``need[i]`` columns of ``table[req[i]]`` is not a page id in
    ``[0, num_pages)`` (a column past the table's width or a request past its rows counts as bad)."""
    tab = np.asarray(table, dtype=np.int64)
    bad = np.zeros(req.shape[0], dtype=bool)
    for i in np.flatnonzero(need > 0):
        q, n = int(req[i]), int(need[i])
        ids = tab[q, :n] if q < tab.shape[0] else np.empty(0, np.int64)
        bad[i] = ids.size < n or bool(np.any((ids < 0) | (ids >= num_pages)))
    return bad


def bad_page_rows(req_ids, positions, seq_lens, r, *, index_block_table=None, num_idx_pages=0,
                  idx_page_rows=1, block_table=None, num_pages=0, page_size=1):
    """Rows that need a bad page id (spec §2): the rule the kernels apply to tables they were not
    allowed to read back, making those rows inert (empty selection, ``out = 0``, ``lse = -inf``).

    A live row (request ``q``, clamped position ``p``, ``nb`` visible groups) needs the index
    table's columns ``0 .. (nb - 1) // idx_page_rows`` (its visible groups) and the block table's
    columns ``0 .. p // page_size`` (its tokens ``0 .. p``); a needed entry outside
    ``[0, num_pages)``, or missing, is bad. Either table may be left out (not checked). The host
    API refuses such tables instead (:func:`oracle.validate.check_table`, per request).
    Returns a bool ``[rows]`` array.
    """
    live, req, p, nb = row_states(req_ids, positions, seq_lens, r)
    bad = np.zeros(live.shape[0], dtype=bool)
    if index_block_table is not None:
        bad |= _needs_bad(index_block_table, req, -(-nb // int(idx_page_rows)), num_idx_pages)
    if block_table is not None:
        bad |= _needs_bad(block_table, req, np.where(live, p // int(page_size) + 1, 0), num_pages)
    return bad
