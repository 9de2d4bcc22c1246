"""The one comparator every test and benchmark uses, and the selection comparator of spec §8."""
from dataclasses import dataclass

import numpy as np

import oracle
from oracle.batch import row_states

__all__ = ["Tolerance", "TOLERANCES", "compare", "assert_matches_oracle", "assert_selection_matches",
           "groups_of_tokens",
           "poison", "to_device", "INT_POISON"]

INT_POISON = -7777   # no valid output (ids, counts, -1 padding) takes this value


@dataclass(frozen=True)
class Tolerance:
    rel_l2: float
    min_cos: float


# Keyed by the lowest precision on the kernel's path (its inputs or output), accumulation being fp32.
TOLERANCES = {
    # spec §8 / issue 4: "float16 inputs with float32 accumulation land near relative L2 1e-3";
    # rounding a float16 output alone costs ~3e-4 (half an ulp of 2^-10, uniform).
    "float16": Tolerance(rel_l2=1e-3, min_cos=0.99999),
    # bfloat16 keeps 8 mantissa bits: 8x float16's rounding error.
    "bfloat16": Tolerance(rel_l2=8e-3, min_cos=0.9999),
    # float32 accumulation over <= ~10^4 terms of O(1) values.
    "float32": Tolerance(rel_l2=1e-5, min_cos=1 - 1e-9),
}


def compare(actual, expected):
    """Max abs, relative L2, cosine and finiteness of ``actual`` against the float64 ``expected``.

    Non-finite entries of ``expected`` (``-inf`` scores, ``lse`` of empty rows, NaN where the float64
    math gives NaN) must be matched exactly, NaN by NaN, and are left out of the norms.
    """
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    if a.shape != e.shape:
        raise AssertionError(f"shape {a.shape} != expected {e.shape}")
    fin = np.isfinite(e)
    special_ok = bool(np.array_equal(a[~fin], e[~fin], equal_nan=True))
    a_f, e_f = a[fin], e[fin]
    diff = a_f - e_f
    norm_e = float(np.linalg.norm(e_f))
    norm_a = float(np.linalg.norm(a_f))
    rel = float(np.linalg.norm(diff)) / norm_e if norm_e > 0 else float(np.linalg.norm(diff))
    cos = float(a_f @ e_f) / (norm_a * norm_e) if norm_a > 0 and norm_e > 0 else float(norm_a == norm_e)
    return dict(max_abs=float(np.abs(diff).max()) if diff.size else 0.0, rel_l2=rel, cos=cos,
                finite=bool(np.isfinite(a_f).all()), special_ok=special_ok, n=int(a.size))


def assert_matches_oracle(actual, expected, *, dtype, what="output"):
    """Assert ``actual`` matches the oracle within the tolerance of ``dtype``; return the stats."""
    tol = TOLERANCES[np.dtype(dtype).name if not isinstance(dtype, str) else dtype]
    st = compare(actual, expected)
    msg = (f"{what}: max_abs={st['max_abs']:.3e} rel_l2={st['rel_l2']:.3e} (tol {tol.rel_l2:.0e}) "
           f"cos={st['cos']:.8f} (min {tol.min_cos}) finite={st['finite']} "
           f"inf/-inf/NaN pattern matches={st['special_ok']}")
    assert st["finite"] and st["special_ok"], msg
    assert st["rel_l2"] <= tol.rel_l2 and st["cos"] >= tol.min_cos, msg
    return st


def assert_selection_matches(groups, tokens, counts, oracle_scores, req_ids, positions, seq_lens,
                             *, Kb, r=4):
    """Spec §8: counts and tails exact; groups agree with the oracle's scores outside the
    ``eps = 1e-4 * max(1, |s_k|)`` band around the Kb-th best score; tokens are exactly the
    expansion of the kernel's own groups."""
    g = np.asarray(groups, dtype=np.int64)
    assert np.all((g >= 0) | (g == -1)), "groups hold values that are neither ids nor -1 padding"
    live, _, _, nb = row_states(req_ids, positions, seq_lens, r)
    want_tokens, want_counts = oracle.expand_tokens(g, req_ids, positions,
                                                    seq_lens, r=r)
    np.testing.assert_array_equal(np.asarray(counts), want_counts, err_msg="counts")
    np.testing.assert_array_equal(np.asarray(tokens), want_tokens,
                                  err_msg="tokens are not the expansion of the kernel's groups")
    s = np.asarray(oracle_scores, dtype=np.float64)
    for i in range(g.shape[0]):
        chosen = g[i][g[i] >= 0]
        k = min(Kb, int(nb[i]))
        assert chosen.size == k, f"row {i}: {chosen.size} groups, expected {k}"
        assert np.all(np.diff(chosen) > 0), f"row {i}: groups not strictly ascending"
        if k and (chosen[0] < 0 or chosen[-1] >= nb[i]):
            raise AssertionError(f"row {i}: group outside 0..{nb[i] - 1}")
        if nb[i] <= Kb:
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
    assert not np.any(g[~live] >= 0), "inert rows selected groups"


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
