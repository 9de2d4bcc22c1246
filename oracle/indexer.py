"""Spec §3: compressed index keys and index queries (pool -> Gemma RMSNorm -> partial NeoX RoPE)."""
import numpy as np

from . import rounding as _chains
from . import validate as V
from .batch import row_states

__all__ = ["gnorm", "rope", "index_keys", "index_queries"]


def gnorm(x, w, eps=1e-6):
    """Gemma RMSNorm over the last axis: ``x / sqrt(mean(x^2) + eps) * (1 + w)``."""
    x = np.asarray(x, dtype=np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + np.asarray(w, np.float64))


def rope(x, pos, rot=64, theta=1e7):
    """NeoX rotation of the first ``rot`` dims (pairs ``(j, j + rot/2)``, angle ``pos * theta^(-2j/rot)``).

    ``pos`` broadcasts against ``x.shape[:-1]``; dims ``rot..`` pass through.
    """
    x = np.asarray(x, dtype=np.float64)
    half = rot // 2
    inv_freq = float(theta) ** (-2.0 * np.arange(half) / rot)
    ang = np.asarray(pos, dtype=np.float64)[..., None] * inv_freq
    c, s = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., :half], x[..., half:rot]
    out = x.copy()
    out[..., :half] = x1 * c - x2 * s
    out[..., half:rot] = x2 * c + x1 * s
    return out


def index_keys(k_raw, w_k, group_req_ids, group_ids, index_cache, index_block_table, *,
               eps=1e-6, rot=64, theta=1e7, emulate_dtype=None, rope_positions=None, rounding=None):
    """Compress complete groups of raw index keys and store them in the paged index cache.

    ``kc[g] = rope(gnorm(mean(k_raw[g]), w_k), pos = r * group_ids[g])``: pool, norm, then RoPE at the
    group's first token. ``emulate_dtype`` rounds the pooled mean to that dtype before the norm, as
    the serving engines' fp32-mean-then-store references do; ``rounding="hf-bf16"`` (or another
    chain of :mod:`oracle.rounding`) computes the keys through that engine's whole rounding chain
    instead (the float64 truth stays the default). The result is stored at
    ``index_cache[index_block_table[q, e // R], e % R]`` (``R = index_cache.shape[1]``), rounded once
    more to the cache's dtype; the float64 keys are returned.

    Shapes: ``k_raw [G, r, Di]``, ``w_k [Di]``, ``group_req_ids, group_ids [G]``.
    Cost: FLOP ~ G*Di*(r + 8) (pool, norm, rotate); bytes = G*r*Di (read) + G*Di (write) elements.
    """
    s = np.shape(k_raw)
    if len(s) != 3:
        raise V.QSAInputError(f"k_raw must have rank 3 [G, r, Di], got shape {s}")
    G, r, di = s
    if np.shape(w_k) != (di,):
        raise V.QSAInputError(f"w_k must have shape ({di},), got {np.shape(w_k)}")
    if rot % 2 or rot > di:
        raise V.QSAInputError(f"rot = {rot} must be even and <= Di = {di}")
    ic = V.check_index_cache(index_cache)
    if ic[2] != di:
        raise V.QSAInputError(f"index_cache Di = {ic[2]} differs from k_raw's Di = {di}")
    reqs = V.host_ints(group_req_ids)
    eids = V.host_ints(group_ids)
    if reqs.shape != (G,) or eids.shape != (G,):
        raise V.QSAInputError(f"group_req_ids {reqs.shape} and group_ids {eids.shape} must be ({G},)")
    tab = V.host_ints(index_block_table)
    if tab.ndim != 2:
        raise V.QSAInputError(f"index_block_table must have rank 2, got shape {tab.shape}")
    rows_per_page = ic[1]
    for g in range(G):
        q, e = int(reqs[g]), int(eids[g])
        if not 0 <= q < tab.shape[0] or e < 0:
            raise V.QSAInputError(f"group {g}: request {q} / group id {e} out of range")
        c = e // rows_per_page
        if c >= tab.shape[1] or not 0 <= tab[q, c] < ic[0]:
            page = tab[q, c] if c < tab.shape[1] else "missing"
            raise V.QSAInputError(f"index_block_table[{q}, {c}] = {page} is not a valid page id "
                                  f"(num_idx_pages = {ic[0]}) for request {q}, column {c} (group {e})")
    pos = r * eids if rope_positions is None else V.host_ints(rope_positions)
    if rounding is not None:
        if emulate_dtype is not None:
            raise V.QSAInputError("pass emulate_dtype or rounding, not both (a chain rounds the mean)")
        kc = _chains.index_keys(k_raw, w_k, pos, rounding=rounding, eps=eps, rot=rot, theta=theta)
    else:
        mean = np.asarray(k_raw, dtype=np.float64).mean(axis=1)
        if emulate_dtype is not None:
            mean = mean.astype(emulate_dtype).astype(np.float64)
        kc = rope(gnorm(mean, w_k, eps), pos, rot, theta)
    index_cache[tab[reqs, eids // rows_per_page], eids % rows_per_page] = kc
    return kc


def index_queries(q_raw, w_q, req_ids, positions, seq_lens, *, eps=1e-6, rot=64, theta=1e7,
                  rope_positions=None, rounding=None):
    """Index queries ``qi[i, h] = rope(gnorm(q_raw[i, h], w_q), pos = p_i)``; inert rows are 0.

    ``rounding`` (a chain of :mod:`oracle.rounding`, e.g. ``"hf-bf16"``) computes them through that
    engine's rounding chain instead of in float64.

    ``p_i`` is the clamped position (spec §1) unless ``rope_positions[i]`` overrides it.
    Shapes: ``q_raw [rows, Hi, Di]`` -> ``[rows, Hi, Di]`` float64.
    Cost: FLOP ~ rows*Hi*Di*8; bytes = 2*rows*Hi*Di elements.
    """
    rows, _ = V.check_batch(req_ids, positions, seq_lens)
    s = np.shape(q_raw)
    if len(s) != 3 or s[0] != rows:
        raise V.QSAInputError(f"q_raw must be [rows={rows}, Hi, Di], got shape {s}")
    if np.shape(w_q) != (s[2],):
        raise V.QSAInputError(f"w_q must have shape ({s[2]},), got {np.shape(w_q)}")
    live, _, p, _ = row_states(req_ids, positions, seq_lens, 1)
    pos = p if rope_positions is None else V.host_ints(rope_positions)
    if rounding is not None:
        qi = _chains.index_queries(q_raw, w_q, pos, rounding=rounding, eps=eps, rot=rot, theta=theta)
    else:
        qi = rope(gnorm(q_raw, w_q, eps), pos[:, None], rot, theta)
    qi[~live] = 0.0
    return qi
