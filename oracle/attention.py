"""Spec §6-§7: sparse GQA attention over the selection, and the page-4 virtual-page plan."""
import numpy as np

from . import rounding as _chains
from . import validate as V
from .batch import row_states

__all__ = ["sparse_attention", "page4_plan", "page4_attention", "attend"]


def attend(q_row, k_sel, v_sel, scale):
    """One row: ``q_row [Hq, D]``, ``k_sel, v_sel [n, Hkv, D]`` -> ``(out [Hq, D], lse [Hq])``.

    The definition, in IEEE float64 for each head: ``s_t = scale <q, K_t>``, ``m = max_t s_t`` (NaN if
    any ``s_t`` is), ``w_t = exp(s_t - m)``, ``out = sum_t w_t V_t / sum_t w_t``, ``lse = m + log sum_t w_t``,
    over the list of selected entries (a token listed twice is two entries). So:

    - a NaN score (NaN in ``q`` or in ``K`` at a selected token, ``inf * 0``, ``inf - inf``), a
      ``+inf`` score, or every score ``-inf`` make that head's ``out`` (all of it) and ``lse`` NaN;
    - a ``-inf`` score among finite ones is weight 0;
    - NaN or inf in ``V`` at a selected token reaches exactly the ``out`` elements of its column
      (``0 * inf`` is NaN: even a zero-weight entry poisons them); ``lse`` stays finite.
    Values outside the selection are never read. Kernels accumulate in float32: non-finite values
    that only a float32 overflow of finite inputs would create are outside this contract.
    """
    hq, d = q_row.shape
    hkv = k_sel.shape[1]
    if k_sel.shape[0] == 0:
        return np.zeros((hq, d)), np.full(hq, -np.inf)
    qh = q_row.reshape(hkv, hq // hkv, d)                   # query head h uses kv head h // (Hq/Hkv)
    logits = np.einsum("jgd,njd->jgn", qh, k_sel) * scale
    m = logits.max(axis=-1, keepdims=True)
    w = np.exp(logits - m)
    z = w.sum(axis=-1, keepdims=True)
    out = np.einsum("jgn,njd->jgd", w, v_sel) / z
    lse = (m + np.log(z))[..., 0]
    return out.reshape(hq, d), lse.reshape(hq)


def _check_attention(q, k_cache, v_cache, req_ids, r):
    rows = np.shape(req_ids)[0] if np.ndim(req_ids) == 1 else -1
    if rows < 0:
        raise V.QSAInputError(f"req_ids must have rank 1 [rows], got shape {np.shape(req_ids)}")
    num_pages, page_size, hkv, d = V.check_kv(k_cache, v_cache, r)
    hq = V.check_q(q, rows, hkv, d)
    return rows, num_pages, page_size, hq, d


def sparse_attention(q, k_cache, v_cache, block_table, tokens, counts, req_ids, seq_lens, *,
                     scale=None, r=4, rounding=None):
    """``out[i, h] = sum_{t in S_i} softmax_t(scale <q[i,h], K[t, h // (Hq/Hkv)]>) V[t, ...]`` and ``lse``.

    ``S_i = tokens[i, :counts[i]]`` (request-local token ids, any order), token ``t`` of request ``q``
    at ``K[block_table[q, t // page_size], t % page_size]``; K/V may have any strides and are never
    copied whole. Empty selections give ``out = 0``, ``lse = -inf``. ``scale`` defaults to 1/sqrt(D).
    Duplicates: ``S_i`` is a list, not a set -- a token listed ``k`` times is weighted ``k`` times,
    exactly as attention over a list holding ``k`` copies of its key and value (the kernels do the
    same; :func:`numqsa.select` never repeats a token, and the page-4 route hands repeats to the
    generic kernel). Non-finite values follow IEEE float64 (see :func:`attend`): NaN or inf in
    ``q[i, h]`` makes head ``h`` of row ``i`` NaN; NaN in ``K`` at a selected token makes the heads
    of its KV head NaN, inf there those whose score it makes NaN or ``+inf`` (a ``-inf`` score is
    weight 0, as in the math); NaN/inf in ``V`` there reaches the output column. Never a 0 / ``-inf``
    "empty row" result for a row that selected tokens.
    Shapes: ``q [rows, Hq, D]``, ``k_cache, v_cache [num_pages, page_size, Hkv, D]`` ->
    ``out [rows, Hq, D]``, ``lse [rows, Hq]`` float64.
    Cost: FLOP = 4*Hq*D*sum_i(counts_i); bytes >= 2*rows*Hq*D (q, out) + 2*Hkv*D*(unique tokens) elements.
    ``rounding`` (a chain of :mod:`oracle.rounding`, e.g. ``"hf-bf16"``) computes ``out`` through that
    engine's rounding chain (``lse`` stays the float64 one).
    """
    rows, num_pages, page_size, hq, d = _check_attention(q, k_cache, v_cache, req_ids, r)
    V.check_batch(req_ids, np.zeros(rows, np.int32), seq_lens)
    V.check_selection(tokens, counts, rows, r)
    V.check_tokens(tokens, counts, req_ids, seq_lens)
    tab = V.check_table(block_table, seq_lens, units_per_page=page_size, num_pages=num_pages)
    scale = 1.0 / np.sqrt(d) if scale is None else float(scale)
    live, req, _, _ = row_states(req_ids, np.zeros(rows), seq_lens, r)
    toks, cnt = V.host_ints(tokens), V.host_ints(counts)
    out = np.zeros((rows, hq, d))
    lse = np.full((rows, hq), -np.inf)
    for i in np.flatnonzero(live & (cnt > 0)):
        t = toks[i, :cnt[i]]
        pages, slots = tab[req[i], t // page_size], t % page_size
        k_sel = np.asarray(k_cache[pages, slots], dtype=np.float64)
        v_sel = np.asarray(v_cache[pages, slots], dtype=np.float64)
        out[i], lse[i] = attend(np.asarray(q[i], dtype=np.float64), k_sel, v_sel, scale)
        if rounding is not None:
            out[i] = _chains.attend(q[i], k_sel, v_sel, scale, rounding)
    return out, lse


def _plan_row(t, r, page_size, table_row, num_pages):
    """Virtual pages of one row, or None if the selection is not whole groups plus one tail run."""
    n = t.size
    tail = n % r
    starts = t[::r]
    if np.any(np.diff(t) <= 0) or np.any(starts % r):
        return None
    runs = np.arange(n) % r
    if np.any(t != np.repeat(starts, r)[:n] + runs):
        return None
    cols = starts // page_size
    if cols.max() >= table_row.size:
        return None
    pages = table_row[cols]
    if np.any((pages < 0) | (pages >= num_pages)):
        return None
    return np.stack([pages, starts % page_size], axis=1), tail


def page4_plan(tokens, counts, block_table, req_ids, seq_lens, *, page_size, num_pages, r=4):
    """Each selected group as a virtual page ``(physical page, first slot)`` of ``r`` tokens (spec §7).

    Pages follow logical token order (so relocation cannot change a reduction order), full groups
    first and the partial tail page (``1..r-1`` tokens) last. A row whose selection is not whole
    aligned groups plus one aligned tail run, or that needs an invalid page id, becomes inert.
    Shapes: ``tokens [rows, Kb*r + r - 1]`` -> ``pages int32 [rows, Kb + 1, 2]`` (``-1`` padded),
    ``num_vpages int32 [rows]``, ``tail_len int32 [rows]``.
    Cost: reads rows*(Kb*r + r - 1) ids and the table, writes rows*(Kb + 1)*2 ids.
    """
    r = V.check_r(r)
    rows, _ = V.check_batch(req_ids, np.zeros(np.shape(req_ids)[0], np.int32), seq_lens)
    kb = V.check_selection(tokens, counts, rows, r)
    V.check_page_size(page_size, r)
    live, req, _, _ = row_states(req_ids, np.zeros(rows), seq_lens, r)
    toks, cnt, lens = V.host_ints(tokens), V.host_ints(counts), V.host_ints(seq_lens)
    tab = V.host_ints(block_table)
    pages = np.full((rows, kb + 1, 2), -1, dtype=np.int32)
    num_vpages = np.zeros(rows, dtype=np.int32)
    tail_len = np.zeros(rows, dtype=np.int32)
    for i in np.flatnonzero(live & (cnt > 0) & (cnt <= toks.shape[1])):
        t = toks[i, :cnt[i]]
        if t.min() < 0 or t.max() >= lens[req[i]]:
            continue
        planned = _plan_row(t, r, page_size, tab[req[i]], num_pages)
        if planned is None:
            continue
        vp, tail = planned
        pages[i, :len(vp)] = vp
        num_vpages[i] = len(vp)
        tail_len[i] = tail
    return pages, num_vpages, tail_len


def page4_attention(q, k_cache, v_cache, pages, num_vpages, tail_len, req_ids, *, scale=None, r=4):
    """Attention over a page-4 plan: the same math as :func:`sparse_attention`, tokens read in place
    as ``K[page, slot .. slot + r - 1]`` (the last page holding ``tail_len`` tokens if nonzero)."""
    rows, num_pages, page_size, hq, d = _check_attention(q, k_cache, v_cache, req_ids, r)
    scale = 1.0 / np.sqrt(d) if scale is None else float(scale)
    pg, nv, tl = V.host_ints(pages), V.host_ints(num_vpages), V.host_ints(tail_len)
    out = np.zeros((rows, hq, d))
    lse = np.full((rows, hq), -np.inf)
    for i in np.flatnonzero(nv > 0):
        n = int(nv[i])
        lens = np.full(n, r)
        if tl[i]:
            lens[-1] = tl[i]
        pid = np.repeat(pg[i, :n, 0], lens)
        slot = np.repeat(pg[i, :n, 1], lens) + np.concatenate([np.arange(k) for k in lens])
        if pid.min() < 0 or pid.max() >= num_pages or slot.max() >= page_size:
            raise V.QSAInputError(f"row {i}: plan entries outside the cache")
        k_sel = np.asarray(k_cache[pid, slot], dtype=np.float64)
        v_sel = np.asarray(v_cache[pid, slot], dtype=np.float64)
        out[i], lse[i] = attend(np.asarray(q[i], dtype=np.float64), k_sel, v_sel, scale)
    return out, lse
