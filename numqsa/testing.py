"""The one comparator every test and benchmark uses, the selection comparator of spec §8, and
emulated narrow-accumulation variants of the kernels that the comparator must tell apart.

Tolerances are named by the precision of the arithmetic that produced a result, not by its inputs:
a float32 result (index scores, ``lse``, ``index_keys``' float32 keys, attention ``out`` of the FMA
route in float32) is checked at ``"float32"``; a result rounded to float16 or bfloat16 on its way
(stored outputs, the softmax probabilities before the tensor-core ``P @ V``) at that type's row.
"""
from dataclasses import dataclass

import numpy as np

import oracle
from oracle.batch import row_states
from oracle.selection import gather_index_keys

__all__ = ["Tolerance", "TOLERANCES", "UNIT_ROUNDOFF", "float32_sum_tolerance", "compare", "assert_matches_oracle",
           "assert_selection_matches", "assert_prefill_matches_oracle", "groups_of_tokens", "poison", "to_device", "INT_POISON",
           "sum_in", "index_scores_accumulating_in", "sparse_attention_accumulating_in",
           "matmul_accumulating_in"]

INT_POISON = -7777   # no valid output (ids, counts, -1 padding) takes this value

# Half an ulp of 1: the largest relative error of one rounding to nearest.
UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24}


@dataclass(frozen=True)
class Tolerance:
    """``rel_l2`` bounds the relative L2 error of the whole tensor; ``row_rel_l2`` that of every row
    (each vector along the last axis: one head of one query row, one row of scores, one row's
    ``lse`` over its heads), measured against the larger of the row's own norm and the tensor's RMS
    row norm, so that a row whose values are all near 0 is judged on the tensor's scale."""
    rel_l2: float
    row_rel_l2: float


def _tolerance(rel_l2):
    # A row of a few elements (D 8-32 in the simulator) spreads its rounding error wider than the
    # whole tensor: twice the tensor's bound per row.
    return Tolerance(rel_l2=rel_l2, row_rel_l2=2 * rel_l2)


TOLERANCES = {
    # spec §8: "float16 inputs with float32 accumulation land near relative L2 1e-3": two unit
    # roundoffs (the probabilities rounded before P @ V, the output rounded once).
    "float16": _tolerance(2 * UNIT_ROUNDOFF["float16"]),
    # bfloat16 keeps 8 mantissa bits: 8x float16's rounding error.
    "bfloat16": _tolerance(2 * UNIT_ROUNDOFF["bfloat16"]),
    # float32 arithmetic throughout: sums of <= ~10^4 terms grow the error to ~sqrt(n) unit
    # roundoffs (measured: index scores 2e-8 to 1.4e-7, lse <= 7e-8, float32 outputs of the FMA
    # route <= 3.3e-7); the same sums accumulated in float16 are off by 2e-4 to 4e-4.
    "float32": _tolerance(1e-5),
}


def float32_sum_tolerance(adds):
    """The tolerance of a float32 result built by ``adds`` chained accumulator updates whose
    rounding may be biased (tensor cores truncate their sums: up to one ulp, two unit roundoffs, per
    update): ``adds`` such updates, never below the ``"float32"`` row. A float16 accumulator's
    error is ``2^13`` times larger per update."""
    rel = max(TOLERANCES["float32"].rel_l2, 2 * adds * UNIT_ROUNDOFF["float32"])
    return _tolerance(rel)


def compare(actual, expected):
    """Max abs, relative L2 (whole tensor and worst row), cosine and finiteness of ``actual``
    against the float64 ``expected``.

    Non-finite entries of ``expected`` (``-inf`` scores, ``lse`` of empty rows, NaN where the float64
    math gives NaN) must be matched exactly, NaN by NaN, and are left out of the norms. A row is a
    vector along the last axis (a 1-D array: each element).
    """
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    if a.shape != e.shape:
        raise AssertionError(f"shape {a.shape} != expected {e.shape}")
    fin = np.isfinite(e)
    special_ok = bool(np.array_equal(a[~fin], e[~fin], equal_nan=True))
    finite = bool(np.isfinite(a[fin]).all())
    e0 = np.where(fin, e, 0.0)
    with np.errstate(invalid="ignore"):
        diff = np.where(fin, a - e0, 0.0)
    norm_e = float(np.linalg.norm(e0))
    norm_a = float(np.linalg.norm(np.where(fin, a, 0.0)))
    norm_d = float(np.linalg.norm(diff))
    rel = norm_d / norm_e if norm_e > 0 else norm_d
    cos = (float(np.sum(np.where(fin, a, 0.0) * e0)) / (norm_a * norm_e)
           if norm_a > 0 and norm_e > 0 else float(norm_a == norm_e))
    lead = e.shape[:-1] if e.ndim > 1 else e.shape
    rows = e0.reshape(int(np.prod(lead)), e.shape[-1] if e.ndim > 1 else 1)
    drows = diff.reshape(rows.shape)
    n_row = (fin.reshape(rows.shape)).sum(axis=1)
    n_all = max(int(fin.sum()), 1)
    row_ref = np.maximum(np.linalg.norm(rows, axis=1), norm_e * np.sqrt(n_row / n_all))
    row_err = np.linalg.norm(drows, axis=1)
    row_rel = np.where(row_ref > 0, row_err / np.where(row_ref > 0, row_ref, 1.0), row_err)
    worst = int(np.argmax(row_rel)) if row_rel.size else 0
    return dict(max_abs=float(np.abs(diff).max()) if diff.size else 0.0, rel_l2=rel,
                row_rel_l2=float(row_rel[worst]) if row_rel.size else 0.0,
                worst_row=tuple(int(i) for i in np.unravel_index(worst, lead)) if row_rel.size else (),
                cos=cos, finite=finite, special_ok=special_ok, n=int(a.size))


def assert_matches_oracle(actual, expected, *, dtype, what="output"):
    """Assert ``actual`` matches the oracle within the tolerance of ``dtype`` (the precision of the
    arithmetic that produced it, or a :class:`Tolerance`) on the whole tensor and on every row;
    return the stats."""
    if isinstance(dtype, Tolerance):
        tol = dtype
    else:
        tol = TOLERANCES[np.dtype(dtype).name if not isinstance(dtype, str) else dtype]
    st = compare(actual, expected)
    msg = (f"{what}: rel_l2={st['rel_l2']:.3e} (tol {tol.rel_l2:.1e}), worst row {st['worst_row']} "
           f"rel_l2={st['row_rel_l2']:.3e} (tol {tol.row_rel_l2:.1e}), finite={st['finite']}, "
           f"inf/-inf/NaN pattern matches={st['special_ok']}")
    assert st["finite"] and st["special_ok"], msg
    assert st["rel_l2"] <= tol.rel_l2 and st["row_rel_l2"] <= tol.row_rel_l2, msg
    return st


def assert_selection_matches(groups, tokens, counts, oracle_scores, req_ids, positions, seq_lens,
                             *, Kb, r=4):
    """Spec §8: widths exact (``groups [rows, Kb]``, ``tokens [rows, Kb*r + r - 1]``), each row's
    group ids first and its ``-1`` padding after them; counts and tails exact; groups agree with the
    oracle's scores outside the ``eps = 1e-4 * max(1, |s_k|)`` band around the Kb-th best score;
    tokens are exactly the expansion of the kernel's own groups."""
    g = np.asarray(groups, dtype=np.int64)
    rows = len(req_ids)
    assert g.shape == (rows, Kb), f"groups shape {g.shape}, expected {(rows, Kb)}"
    assert np.shape(tokens) == (rows, Kb * r + r - 1), \
        f"tokens shape {np.shape(tokens)}, expected {(rows, Kb * r + r - 1)}"
    assert np.shape(counts) == (rows,), f"counts shape {np.shape(counts)}, expected {(rows,)}"
    assert np.all((g >= 0) | (g == -1)), "groups hold values that are neither ids nor -1 padding"
    live, _, _, nb = row_states(req_ids, positions, seq_lens, r)
    s = np.asarray(oracle_scores, dtype=np.float64)
    for i in range(rows):
        k = min(Kb, int(nb[i])) if live[i] else 0
        chosen = g[i, :k]
        assert np.all(chosen >= 0) and np.all(g[i, k:] == -1), \
            f"row {i}: expected {k} group ids then -1 padding, got {g[i].tolist()}"
        assert np.all(np.diff(chosen) > 0), f"row {i}: groups not strictly ascending"
        assert not k or chosen[-1] < nb[i], f"row {i}: group outside 0..{nb[i] - 1}"
        if nb[i] <= Kb or not live[i]:
            continue
        vis = s[i, :nb[i]]
        s_k = np.sort(vis)[::-1][Kb - 1]
        eps = 1e-4 * max(1.0, abs(s_k))
        mask = np.zeros(nb[i], bool)
        mask[chosen] = True
        missed = np.flatnonzero(~mask & (vis > s_k + eps))
        extra = np.flatnonzero(mask & (vis < s_k - eps))
        assert missed.size == 0, f"row {i}: groups {missed[:5]} score above the band but were not chosen"
        assert extra.size == 0, f"row {i}: groups {extra[:5]} score below the band but were chosen"
    want_tokens, want_counts = oracle.expand_tokens(g, req_ids, positions, seq_lens, r=r)
    np.testing.assert_array_equal(np.asarray(counts), want_counts, err_msg="counts")
    np.testing.assert_array_equal(np.asarray(tokens), want_tokens,
                                  err_msg="tokens are not the expansion of the kernel's groups")


def groups_of_tokens(tokens, counts, Kb, r=4):
    """``int64 [rows, Kb]``: the whole groups of an expansion read back from its tokens (each group's
    ``r`` tokens in order, the partial tail last), -1 padded -- a selection's groups when only its
    tokens were returned."""
    tokens, counts = np.asarray(tokens), np.asarray(counts)
    groups = np.full((tokens.shape[0], Kb), -1, np.int64)
    for i in range(tokens.shape[0]):
        g = tokens[i, :counts[i]][::r] // r
        g = g[r * np.arange(g.size) + r - 1 < counts[i]]
        groups[i, :g.size] = g
    return groups


def assert_prefill_matches_oracle(p, out, lse, tokens, counts, Kb):
    """A prefill's results on problem ``p`` (a :func:`oracle.problems.make_problem` dict, host
    arrays): the selection by spec §8 (its groups read back from its tokens), then the attention
    over that selection."""
    batch = (p["req_ids"], p["positions"], p["seq_lens"])
    scores = oracle.index_scores(p["qi"], p["index_cache"], p["index_block_table"], *batch)
    assert_selection_matches(groups_of_tokens(tokens, counts, Kb), tokens, counts, scores, *batch,
                             Kb=Kb)
    ref, ref_lse = oracle.sparse_attention(p["q"], p["k_cache"], p["v_cache"], p["block_table"],
                                           tokens, counts, p["req_ids"], p["seq_lens"])
    assert_matches_oracle(out, ref, dtype=p["q"].dtype, what="out")
    assert_matches_oracle(lse, ref_lse, dtype="float32", what="lse")


def poison(x):
    """Fill an output buffer (NumPy or numba device array) with NaN, or INT_POISON for integers."""
    dt = np.dtype(x.dtype)
    value = np.nan if dt.kind == "f" or dt.name == "bfloat16" else INT_POISON
    if isinstance(x, np.ndarray):
        x[...] = value
    else:
        from .device import copy_to_device
        copy_to_device(x, np.full(x.shape, value, dtype=dt))
    return x


def to_device(a, stream=0):
    """A device copy of a host array, ``ml_dtypes.bfloat16`` included (:func:`numqsa.device.to_device`)."""
    from .device import to_device as _to_device
    return _to_device(a, stream)


# ------------------------------------------------------------------------------------------------
# Emulated kernels that accumulate in a narrower type: the comparator must reject them
# ------------------------------------------------------------------------------------------------

def sum_in(x, dtype, axis=-1):
    """``x`` summed along ``axis`` in order, every partial sum rounded to ``dtype`` (float64 out)."""
    x = np.moveaxis(np.asarray(x, np.float64), axis, -1)
    if x.shape[-1] == 0:
        return np.zeros(x.shape[:-1])
    return np.cumsum(x.astype(dtype), axis=-1, dtype=dtype)[..., -1].astype(np.float64)


def index_scores_accumulating_in(dtype, qi, index_cache, index_block_table, req_ids, positions,
                                 seq_lens, *, r=4):
    """:func:`oracle.index_scores` with its dot products and head sums accumulated in ``dtype``."""
    live, req, _, nb = row_states(req_ids, positions, seq_lens, r)
    di = index_cache.shape[-1]
    num_groups = int(np.max(seq_lens)) // r if len(seq_lens) else 0
    out = np.full((len(req_ids), num_groups), -np.inf)
    for i in np.flatnonzero(live & (nb > 0)):
        keys = gather_index_keys(index_cache, index_block_table, int(req[i]), int(nb[i]))
        prod = np.asarray(qi[i], np.float64)[:, None, :] * keys[None]          # [Hi, nb, Di]
        dots = np.maximum(sum_in(prod, dtype), 0.0)                             # [Hi, nb]
        out[i, :nb[i]] = sum_in(dots, dtype, axis=0) / np.sqrt(di)
    return out


def sparse_attention_accumulating_in(dtype, q, k_cache, v_cache, block_table, tokens, counts,
                                     req_ids, seq_lens, *, scale=None):
    """:func:`oracle.sparse_attention` (finite inputs) with ``q.K``, the softmax sum and ``P @ V``
    accumulated in ``dtype``: ``(out, lse)``."""
    rows, hq, d = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    scale = 1.0 / np.sqrt(d) if scale is None else float(scale)
    live, req, _, _ = row_states(req_ids, np.zeros(rows), seq_lens, 4)
    out, lse = np.zeros((rows, hq, d)), np.full((rows, hq), -np.inf)
    for i in np.flatnonzero(live & (np.asarray(counts) > 0)):
        t = np.asarray(tokens[i, :counts[i]])
        pages, slots = np.asarray(block_table)[req[i], t // page_size], t % page_size
        k = np.asarray(k_cache[pages, slots], np.float64)                       # [n, Hkv, D]
        v = np.asarray(v_cache[pages, slots], np.float64)
        kv = np.arange(hq) // (hq // hkv)
        qh = np.asarray(q[i], np.float64)
        s = sum_in(qh[:, None, :] * k[:, kv].transpose(1, 0, 2), dtype) * scale  # [Hq, n]
        m = s.max(axis=1, keepdims=True)
        w = np.exp(s - m)
        z = sum_in(w, dtype)
        out[i] = sum_in(w[:, :, None] * v[:, kv].transpose(1, 0, 2), dtype, axis=1) / z[:, None]
        lse[i] = m[:, 0] + np.log(z)
    return out, lse


def matmul_accumulating_in(a, b, dtype):
    """``a @ b`` with every dot product accumulated in ``dtype`` (float64 out)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return sum_in(a[:, :, None] * b[None, :, :], dtype, axis=1)
