"""Spec §4-§5: index scores over the paged compressed-key cache, top-k groups, expansion to tokens."""
import numpy as np

from . import validate as V
from .batch import row_states

__all__ = ["gather_index_keys", "index_scores", "topk_groups", "expand_tokens", "select"]

_ROW_CHUNK = 256  # rows per score block: bounds the [rows, Hi, groups] float64 temporary


def gather_index_keys(index_cache, index_block_table, q, n):
    """Compressed keys ``0..n-1`` of request ``q`` as a float64 ``[n, Di]`` array."""
    e = np.arange(n)
    rows_per_page = index_cache.shape[1]
    pages = V.host_ints(index_block_table)[q, e // rows_per_page]
    return np.asarray(index_cache[pages, e % rows_per_page], dtype=np.float64)


def index_scores(qi, index_cache, index_block_table, req_ids, positions, seq_lens, *, r=4,
                 num_groups=None):
    """``score[i, e] = sum_h max(0, <qi[i, h], kc[e]>) / sqrt(Di)`` for ``e < nb_i``, else ``-inf``.

    Shapes: ``qi [rows, Hi, Di]`` -> ``[rows, num_groups]`` float64, ``num_groups`` defaulting to
    ``max(seq_lens) // r``. Inert rows are all ``-inf``.
    Non-finite inputs propagate as IEEE float64 arithmetic does: ``relu`` is ``np.maximum(x, 0)``,
    which keeps NaN, so a NaN in ``qi[i]`` or in key ``e`` makes ``score[i, e]`` NaN, and an inf
    gives ``+inf`` or NaN (``inf * 0``, ``inf - inf``) as the dot products do. Kernels follow it
    (float32 accumulation: an overflow of finite float32 inputs is outside the contract).
    Cost: FLOP = 2*Hi*Di*sum_i(nb_i); bytes >= rows*Hi*Di + (unique keys)*Di elements read and
    rows*num_groups*4 written (float32 scores in kernels).
    """
    r = V.check_r(r)
    rows, _ = V.check_batch(req_ids, positions, seq_lens)
    n_pages, rows_per_page, di = V.check_index_cache(index_cache)
    V.check_index_q(qi, rows, di)
    V.check_table(index_block_table, seq_lens, units_per_page=rows_per_page, num_pages=n_pages,
                  r=r, name="index_block_table")
    lens = V.host_ints(seq_lens)
    if num_groups is None:
        num_groups = int(lens.max()) // r if lens.size else 0
    live, req, _, nb = row_states(req_ids, positions, seq_lens, r)
    nb = np.minimum(nb, num_groups)
    qi = np.asarray(qi, dtype=np.float64)
    out = np.full((rows, num_groups), -np.inf)
    for q in np.unique(req[live]):
        idx = np.flatnonzero(req == q)
        n = int(nb[idx].max())
        if n == 0:
            continue
        keys = gather_index_keys(index_cache, index_block_table, q, n)
        for c in range(0, idx.size, _ROW_CHUNK):
            ids = idx[c:c + _ROW_CHUNK]
            dots = qi[ids] @ keys.T                        # [chunk, Hi, n]
            s = np.maximum(dots, 0.0).sum(axis=1) / np.sqrt(di)
            s[np.arange(n)[None, :] >= nb[ids][:, None]] = -np.inf
            out[ids, :n] = s
    return out


def _topk_row(s, kb):
    """Ascending ids of the ``kb`` best of ``s`` by (score desc, id asc); ``-0.0 == +0.0``;
    NaN above every number, NaNs equal."""
    if s.size <= kb:
        return np.arange(s.size)
    nan = np.isnan(s)
    if nan.any():
        order = np.lexsort((np.arange(s.size), -np.where(nan, 0.0, s), ~nan))
        return np.sort(order[:kb])
    kth = np.partition(s, s.size - kb)[s.size - kb]   # the kb-th largest value
    above = np.flatnonzero(s > kth)
    ties = np.flatnonzero(s == kth)[:kb - above.size]  # lowest ids win among equal scores
    return np.sort(np.concatenate([above, ties]))


def topk_groups(scores, req_ids, positions, seq_lens, *, Kb=512, r=4):
    """Row ``i`` selects ``min(Kb, nb_i)`` groups by (score desc, group id asc), returned ascending.

    The rule is applied to the given scores exactly, so the oracle run on a kernel's own float32
    scores is that kernel's exact expected output. Shapes: ``scores [rows, G]`` ->
    ``groups int32 [rows, Kb]``, ``-1`` padded.
    A NaN score (a NaN or inf in the index queries or cache, see :func:`index_scores`) ranks above
    every number and NaNs tie, so a row takes its NaN groups first, lowest ids first -- the order
    ``torch.topk`` gives the serving engines; ``+inf`` ranks next.
    Cost: reads rows*G scores, writes rows*Kb ids.
    """
    r = V.check_r(r)
    rows, _ = V.check_batch(req_ids, positions, seq_lens)
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 2 or s.shape[0] != rows:
        raise V.QSAInputError(f"scores must be [rows={rows}, groups], got shape {s.shape}")
    if Kb < 1:
        raise V.QSAInputError(f"Kb must be >= 1, got {Kb}")
    _, _, _, nb = row_states(req_ids, positions, seq_lens, r)
    if np.any(nb > s.shape[1]):
        raise V.QSAInputError(f"scores has {s.shape[1]} groups but a row sees {int(nb.max())}")
    groups = np.full((rows, Kb), -1, dtype=np.int32)
    for i in np.flatnonzero(nb):
        vis = s[i, :nb[i]]
        g = _topk_row(vis, Kb)
        groups[i, :g.size] = g
    return groups


def expand_tokens(groups, req_ids, positions, seq_lens, *, r=4):
    """Token ids of the selected groups, ascending, then the forced tail ``r*nb .. p``.

    Shapes: ``groups [rows, Kb]`` (ids ``< nb``, ``-1`` padded) -> ``tokens int32 [rows, Kb*r + r - 1]``
    (``-1`` padded) and ``counts int32 [rows]``. Inert rows: no tokens, count 0.
    A group id outside ``0 .. nb - 1`` (a future group: its tokens lie past the row's position) or a
    repeated id is refused here (``QSAInputError``), as the public API refuses host groups. The
    device kernel, which cannot refuse, never expands one: it reads a row's ids up to the first that
    is not a visible group strictly above its predecessor, so its output is this function's on the
    longest valid prefix (for ascending input: exactly the visible ids) -- never a token past ``p``.
    Cost: reads rows*Kb ids, writes rows*(Kb*r + r - 1) ids.
    """
    r = V.check_r(r)
    rows, _ = V.check_batch(req_ids, positions, seq_lens)
    g = V.host_ints(groups)
    if g.ndim != 2 or g.shape[0] != rows:
        raise V.QSAInputError(f"groups must be [rows={rows}, Kb], got shape {g.shape}")
    kb = g.shape[1]
    live, _, p, nb = row_states(req_ids, positions, seq_lens, r)
    tokens = np.full((rows, kb * r + r - 1), -1, dtype=np.int32)
    counts = np.zeros(rows, dtype=np.int32)
    lane = np.arange(r)
    for i in np.flatnonzero(live):
        gi = np.sort(g[i][g[i] >= 0])
        if gi.size and (gi[-1] >= nb[i] or np.any(np.diff(gi) == 0)):
            raise V.QSAInputError(f"groups row {i} has ids outside 0..{nb[i] - 1} or repeats")
        t = np.concatenate([(gi[:, None] * r + lane).ravel(), np.arange(r * nb[i], p[i] + 1)])
        tokens[i, :t.size] = t
        counts[i] = t.size
    return tokens, counts


def select(qi, index_cache, index_block_table, req_ids, positions, seq_lens, *, Kb=512, r=4):
    """Scores, top-k and expansion in one call: ``(tokens, counts, groups)``."""
    s = index_scores(qi, index_cache, index_block_table, req_ids, positions, seq_lens, r=r)
    groups = topk_groups(s, req_ids, positions, seq_lens, Kb=Kb, r=r)
    tokens, counts = expand_tokens(groups, req_ids, positions, seq_lens, r=r)
    return tokens, counts, groups
