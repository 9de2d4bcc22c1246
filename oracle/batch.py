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
