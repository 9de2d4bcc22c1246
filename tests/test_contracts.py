"""The contracts of issue 12, points 3, 5 and 6: one rule the oracle and every kernel follow.

- Non-finite values propagate as the float64 math does (``oracle.attention.attend``,
  ``oracle.index_scores``): NaN where the math gives NaN, never a finite or "empty row" result.
- A NaN index score ranks above every number (NaNs tie: lowest group ids first), as ``torch.topk``.
- Caller-supplied groups outside a row's visible groups are refused on the host and never expanded
  on the device.
- A token listed twice in a selection is weighted twice, by the oracle and the kernels alike.

Each case compares kernel and oracle with :func:`numqsa.testing.assert_matches_oracle`, which
matches NaN by NaN; the oracle's value is also pinned where the contract names it.
"""
import numpy as np
import pytest
from numba import cuda

import numqsa
import oracle
from numqsa.stages import selection as sel
from numqsa.kernels import index_scores as k_scores
from numqsa.kernels import topk as k_topk
from numqsa.plan import arch_profile
from numqsa.testing import assert_matches_oracle, assert_selection_matches, groups_of_tokens, poison
from oracle.problems import make_problem
from test_attention_kernels import out_precision

R = 4


# ------------------------------------------------------------------------------------------------
# attention: non-finite q, K, V
# ------------------------------------------------------------------------------------------------

def _attention_problem(rng, hq=6, hkv=2, d=16, dtype=np.float32):
    """Two requests, four live rows of dense selections (every token 0..p), one inert row."""
    p = make_problem([23, 11], positions=[22, 13, 9, 10, 4], req_ids=[0, 0, 1, 1, 7], page_size=8,
                     Hq=hq, Hkv=hkv, D=d, Hi=1, Di=8, dtype=dtype, seed=int(rng.integers(1 << 31)))
    rows = p["req_ids"].size
    live, _, pos, _ = oracle.row_states(p["req_ids"], p["positions"], p["seq_lens"], R)
    tokens = np.full((rows, 6 * R + R - 1), -1, np.int32)
    counts = np.zeros(rows, np.int32)
    for i in np.flatnonzero(live):
        tokens[i, :pos[i] + 1] = np.arange(pos[i] + 1)
        counts[i] = pos[i] + 1
    return p, tokens, counts


def _slot(p, req, t):
    """(page, slot) of token ``t`` of request ``req``."""
    ps = p["k_cache"].shape[1]
    return p["block_table"][req, t // ps], t % ps


def _attend_both(p, tokens, counts, route="generic"):
    rows, hq, d = p["q"].shape
    out = poison(np.empty((rows, hq, d), np.float32))
    lse = poison(np.empty((rows, hq), np.float32))
    numqsa.sparse_attention(p["q"], p["k_cache"], p["v_cache"], p["block_table"], tokens, counts,
                            p["req_ids"], p["seq_lens"], out_dtype=np.float32, out=(out, lse),
                            route_name=route)
    eo, el = oracle.sparse_attention(p["q"], p["k_cache"], p["v_cache"], p["block_table"], tokens,
                                     counts, p["req_ids"], p["seq_lens"])
    assert_matches_oracle(out, eo, dtype=out_precision(p["q"].dtype, np.float32, route), what="out")
    assert_matches_oracle(lse, el, dtype="float32", what="lse")
    return eo, el


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_nonfinite_query(rng, value):
    """NaN/inf in one element of q[0, 1]: head 1 of row 0 is NaN (out and lse), nothing else."""
    p, tokens, counts = _attention_problem(rng)
    p["q"][0, 1, 3] = value
    eo, el = _attend_both(p, tokens, counts)
    assert np.isnan(eo[0, 1]).all() and np.isnan(el[0, 1])
    assert np.isfinite(np.delete(eo[0], 1, axis=0)).all() and np.isfinite(eo[1:4]).all()


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_nonfinite_key_at_selected_token(rng, value):
    """NaN/inf in K at a token rows 0 and 1 select; row 2 (another request) is untouched.

    With +inf the heads whose query element is positive score +inf and are NaN; the others score
    -inf there, a weight of 0 (the issue's "finite where the math gives NaN" was the first kind)."""
    p, tokens, counts = _attention_problem(rng)
    pg, sl = _slot(p, 0, 5)
    p["k_cache"][pg, sl, 0, 2] = value
    p["q"][:, :, 2] = np.where(np.arange(6) % 2, 1.0, -1.0)[None, :]   # heads 0-2 read KV head 0
    eo, el = _attend_both(p, tokens, counts)
    nan_heads = [0, 1, 2] if np.isnan(value) else [1]
    for i in (0, 1):
        assert np.isnan(el[i, nan_heads]).all() and np.isnan(eo[i, nan_heads]).all()
        assert np.isfinite(np.delete(el[i], nan_heads)).all()
    assert np.isfinite(eo[2:4]).all()


def test_every_score_minus_inf_is_nan(rng):
    """-inf at every selected token (softmax of all -inf: 0/0) is NaN, not the empty-row 0/-inf."""
    p, tokens, counts = _attention_problem(rng, hkv=1)
    p["q"][:, :, 0] = 1.0
    p["k_cache"][:, :, :, 0] = -np.inf
    eo, el = _attend_both(p, tokens, counts)
    assert np.isnan(eo[:4]).all() and np.isnan(el[:4]).all()
    assert not eo[4].any() and np.all(el[4] == -np.inf), "the inert row stays 0 / -inf"


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_nonfinite_value_at_selected_token(rng, value):
    """NaN/inf in V[t, 0, 4]: column 4 of the heads of KV head 0 of the rows selecting t."""
    p, tokens, counts = _attention_problem(rng)
    pg, sl = _slot(p, 0, 7)
    p["v_cache"][pg, sl, 0, 4] = value
    eo, el = _attend_both(p, tokens, counts)
    bad = ~np.isfinite(eo)
    assert bad[:2, :3, 4].all() and bad.sum() == 6 and np.isfinite(el[:4]).all()


def test_nonfinite_outside_selection_is_not_read(rng):
    """NaN in K/V at tokens no row selects (past a row's position; another request's pages)."""
    p, tokens, counts = _attention_problem(rng)
    counts[0] = 12                       # row 0 now selects tokens 0..11, row 1 0..13
    for q, t in ((0, 14), (0, 20), (0, 22), (1, 12)):    # request 1 holds 11 tokens: 12 is stale
        pg, sl = _slot(p, q, t)
        p["k_cache"][pg, sl] = np.nan
        p["v_cache"][pg, sl] = np.nan
    eo, el = _attend_both(p, tokens, counts)
    assert np.isfinite(eo).all() and np.isfinite(el[:4]).all()


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_nonfinite_production_geometry(rng, dtype):
    """The same rule at Hq 12 / Hkv 1 / D 256 (8-token tiles), float16 and float32."""
    p, tokens, counts = _attention_problem(rng, hq=12, hkv=1, d=256, dtype=dtype)
    p["q"][0, 5, 100] = np.nan
    pg, sl = _slot(p, 1, 3)
    p["v_cache"][pg, sl, 0, 17] = np.inf
    eo, _ = _attend_both(p, tokens, counts)
    assert np.isnan(eo[0, 5]).all() and np.isinf(eo[2:4, :, 17]).all()


# ------------------------------------------------------------------------------------------------
# attention: a token listed twice
# ------------------------------------------------------------------------------------------------

def test_duplicate_token_weighted_per_occurrence(rng):
    """A selection ``[a, b, a]`` is attention over the list, ``a`` weighted twice: the oracle equals
    attention over ``[a, b]`` with ``a``'s logit raised by log 2, and the kernel equals the oracle."""
    p, tokens, counts = _attention_problem(rng, hkv=1)
    tokens[0, :3], counts[0] = [5, 9, 5], 3
    tokens[1, :4], counts[1] = [1, 1, 1, 2], 4
    eo, el = _attend_both(p, tokens, counts)
    q = p["q"][0].astype(np.float64)
    pa, sa = _slot(p, 0, 5)
    pb, sb = _slot(p, 0, 9)
    k = np.stack([p["k_cache"][pa, sa, 0], p["k_cache"][pb, sb, 0]]).astype(np.float64)
    v = np.stack([p["v_cache"][pa, sa, 0], p["v_cache"][pb, sb, 0]]).astype(np.float64)
    logits = q @ k.T / np.sqrt(q.shape[1]) + np.log([2.0, 1.0])
    w = np.exp(logits - logits.max(axis=1, keepdims=True))
    np.testing.assert_allclose(eo[0], (w / w.sum(axis=1, keepdims=True)) @ v, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(el[0], np.log(np.exp(logits).sum(axis=1)), rtol=1e-12)


def test_duplicate_token_page4_route(rng):
    """The page-4 route gives a repeated selection to the generic kernel: the same rule."""
    p, tokens, counts = _attention_problem(rng, hkv=1, d=32, dtype=np.float16)
    tokens[0, :8], counts[0] = [0, 1, 2, 3, 0, 1, 2, 3], 8
    _attend_both(p, tokens, counts, route="page4")


# ------------------------------------------------------------------------------------------------
# selection: non-finite index queries and cache, NaN ranking, out-of-range groups
# ------------------------------------------------------------------------------------------------

def _index_problem(rng):
    p = make_problem([75, 13], positions=[74, 60, 12, 5], req_ids=[0, 0, 1, 1], page_size=16,
                     Hq=1, Hkv=1, D=8, Hi=2, Di=16, dtype=np.float16, shared_index_table=False,
                     seed=int(rng.integers(1 << 31)))
    return p


def _batch(p):
    return [p[k] for k in ("qi", "index_cache", "index_block_table", "req_ids", "positions",
                           "seq_lens")]


def _poison_index(p):
    """NaN in qi[1, 0]; +inf and -inf in keys 3 and 7 of request 0; NaN in key 2 of request 1.
    Row 0's queries are positive in that element: its score of key 3 is +inf, of key 7 finite."""
    p["qi"][1, 0, 5] = np.nan
    p["qi"][0, :, 1] = 1.0
    ic, tab, rows = p["index_cache"], p["index_block_table"], p["index_cache"].shape[1]
    for q, e, v in ((0, 3, np.inf), (0, 7, -np.inf), (1, 2, np.nan)):
        ic[tab[q, e // rows], e % rows, 1] = v
    return p


@pytest.mark.parametrize("route", ["light", "tiled_sm_90", "tiled_sm_70"])
def test_nonfinite_index_scores(rng, monkeypatch, route):
    p = _poison_index(_index_problem(rng))
    want = oracle.index_scores(*_batch(p))
    assert np.isnan(want[1, :15]).all() and np.isnan(want[2, 2]) and np.isposinf(want[0, 3])
    assert np.isfinite(want[0, 7])
    out = poison(cuda.device_array(want.shape, np.float32))
    d = [cuda.to_device(np.ascontiguousarray(a)) for a in _batch(p)]
    if route == "light":
        k_scores.launch_light(*d, out, arch_profile((9, 0)), 0)
    else:
        monkeypatch.setenv("NUMQSA_ARCH", route[-5:])
        k_scores.launch_tiled(*d, out, arch_profile((9, 0)), 0)
    assert_matches_oracle(out.copy_to_host(), want, dtype="float32", what=f"{route} scores")


def test_relu_keeps_nan():
    """The kernels' ReLU is NumPy's maximum(x, 0), not fmaxf (which drops NaN on a GPU)."""
    x = cuda.to_device(np.array([np.nan, -np.inf, -1.5, -0.0, 0.0, 2.5, np.inf], np.float32))
    y = cuda.device_array(7, np.float32)

    @cuda.jit
    def kernel(x, y):
        i = cuda.grid(1)
        if i < x.size:
            y[i] = k_scores.relu(x[i])

    kernel[1, 32](x, y)
    np.testing.assert_array_equal(y.copy_to_host(), np.maximum(x.copy_to_host(), np.float32(0)))


@pytest.mark.parametrize("route", k_topk.ROUTES)
def test_topk_nan_ranks_first(rng, route):
    """NaN of any sign and payload ranks above +inf; NaNs tie (lowest ids); oracle and kernels."""
    G, kb = 40, 6
    lens = np.array([4 * G], np.int32)
    req, pos = np.zeros(3, np.int32), np.array([4 * G - 1, 4 * G - 1, 30], np.int32)
    s = rng.standard_normal((3, G)).astype(np.float32)
    bits = s.view(np.uint32)
    bits[0, [31, 4, 17]] = [0x7FC00000, 0xFFC00001, 0x7FFFFFFF]      # three NaNs
    s[0, 9] = np.inf
    s[1, :] = np.nan
    bits[2, [1, 5]] = [0xFF800001, 0x7F800001]                        # NaN in a short row
    want = oracle.topk_groups(s.astype(np.float64), req, pos, lens, Kb=kb)
    assert {4, 9, 17, 31} <= set(want[0]) and {1, 5} <= set(want[2])
    np.testing.assert_array_equal(want[1], np.arange(kb))
    out = poison(cuda.device_array((3, kb), np.int32))
    k_topk.launch_topk(*[cuda.to_device(x) for x in (bits, req, pos, lens)], out,
                       arch_profile((9, 0)), 0, route=route)
    np.testing.assert_array_equal(out.copy_to_host(), want)


def test_select_with_nonfinite_index_cache(rng):
    """The fused chain ranks NaN-scored groups first, as the oracle's select."""
    p = _poison_index(_index_problem(rng))
    d = [cuda.to_device(np.ascontiguousarray(a)) for a in _batch(p)]
    tokens, counts, groups = (x.copy_to_host() for x in numqsa.select(*d, Kb=4))
    scores = oracle.index_scores(*_batch(p))
    assert_selection_matches(groups, tokens, counts, scores, p["req_ids"], p["positions"],
                             p["seq_lens"], Kb=4)
    np.testing.assert_array_equal(groups[1], [0, 1, 2, 3])       # every score NaN: lowest ids
    assert 3 in groups[0] and 2 in groups[2]                    # +inf / NaN keys are chosen


def test_oracle_refuses_out_of_range_groups():
    with pytest.raises(oracle.QSAInputError):
        oracle.expand_tokens(np.array([[3, 50, -1]], np.int32), np.array([0], np.int32),
                             np.array([150], np.int32), np.array([151], np.int32))


def test_expand_never_expands_future_groups():
    """The issue's case on device arrays: group 50 for a row at position 150 (37 visible groups)
    was expanded to tokens 200..203. Ids are read up to the first that is not a visible group
    strictly above its predecessor; the row keeps its valid prefix and its tail."""
    lens = np.array([400], np.int32)
    req, pos = np.zeros(5, np.int32), np.array([150, 150, 150, 150, 150], np.int32)
    groups = np.array([[3, 50, -1, -1],        # future group: dropped
                       [3, 36, 37, 2],         # 37 is not visible (nb = 37): 3, 36 kept
                       [5, 5, 6, -1],          # repeat: 5 kept
                       [9, 4, 6, -1],          # descent: 9 kept
                       [-1, 7, 8, -1]], np.int32)   # nothing before the first -1
    kept = [[3], [3, 36], [5], [9], []]
    d = [cuda.to_device(x) for x in (groups, req, pos, lens)]
    tokens = poison(cuda.device_array((5, 4 * R + R - 1), np.int32))
    counts = poison(cuda.device_array(5, np.int32))
    sel.expand_tokens(*d, out=(tokens, counts))
    tokens, counts = tokens.copy_to_host(), counts.copy_to_host()
    assert tokens.max() <= 150, "a token past the row's position was emitted"
    want_g = np.full((5, 4), -1, np.int32)
    for i, k in enumerate(kept):
        want_g[i, :len(k)] = k
    wt, wc = oracle.expand_tokens(want_g, req, pos, lens)
    np.testing.assert_array_equal(tokens, wt)
    np.testing.assert_array_equal(counts, wc)


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_nonfinite_index_keys_and_queries(rng, value):
    """NaN/inf in a raw key or query: the pre-indexer's outputs are NaN exactly where the oracle's."""
    di, G = 32, 3
    lens = np.array([40], np.int32)
    p = make_problem(lens, [3], page_size=16, Hq=1, Hkv=1, D=8, Hi=2, Di=di, dtype=np.float32,
                     shared_index_table=False, seed=int(rng.integers(1 << 31)))
    k_raw = rng.standard_normal((G, R, di)).astype(np.float32)
    k_raw[1, 2, 7] = value
    w = (0.1 * rng.standard_normal(di)).astype(np.float32)
    reqs, eids = np.zeros(G, np.int32), np.array([0, 4, 9], np.int32)
    ic_k, ic_o = p["index_cache"].copy(), p["index_cache"].copy()
    kc = sel.index_keys(k_raw, w, reqs, eids, ic_k, p["index_block_table"], rot=16)
    want = oracle.index_keys(k_raw, w, reqs, eids, ic_o, p["index_block_table"], rot=16)
    assert not np.isfinite(want[1]).all() and np.isfinite(want[[0, 2]]).all()
    assert_matches_oracle(kc, want, dtype="float32", what="kc")
    q_raw = rng.standard_normal((3, 2, di)).astype(np.float32)
    q_raw[2, 1, 40 % di] = value
    got = sel.index_queries(q_raw, w, p["req_ids"], p["positions"], p["seq_lens"], rot=16)
    want = oracle.index_queries(q_raw, w, p["req_ids"], p["positions"], p["seq_lens"], rot=16)
    assert_matches_oracle(got, want, dtype="float32", what="qi")


@pytest.mark.parametrize("what", ["q", "k", "v"])
def test_nonfinite_page4_route(rng, what):
    """The rule on the page-4 route (float16, whole-group selections)."""
    p, tokens, counts = _attention_problem(rng, hkv=1, d=32, dtype=np.float16)
    if what == "q":
        p["q"][0, 1, 3] = np.nan
    else:
        pg, sl = _slot(p, 0, 5)
        p["k_cache" if what == "k" else "v_cache"][pg, sl, 0, 2] = np.inf
        p["q"][:, :, 2] = 1.0
    _attend_both(p, tokens, counts, route="page4")


# ------------------------------------------------------------------------------------------------
# contract statements (issue 26 point 7): scale, r, page size 1024, mixed dtypes, out_dtype,
# negative seq_lens -- each against the oracle, outputs NaN-poisoned
# ------------------------------------------------------------------------------------------------

PREFILL = ("qi", "index_cache", "index_block_table", "q", "k_cache", "v_cache", "block_table",
           "req_ids", "positions", "seq_lens")


def _prefill_vs_oracle(p, Kb, r=4, **kw):
    """qsa_prefill into NaN-poisoned buffers; selection (spec §8) and attention on the kernel's
    own selection against the oracle."""
    rows, hq, d = p["q"].shape
    od = np.dtype(kw.get("out_dtype") or p["q"].dtype)
    bufs = (poison(np.empty((rows, hq, d), od)), poison(np.empty((rows, hq), np.float32)))
    out, lse, tokens, counts = numqsa.qsa_prefill(*[p[k] for k in PREFILL], Kb=Kb, r=r, out=bufs,
                                                  **kw)
    batch = (p["req_ids"], p["positions"], p["seq_lens"])
    scores = oracle.index_scores(p["qi"], p["index_cache"], p["index_block_table"], *batch, r=r)
    assert_selection_matches(groups_of_tokens(tokens, counts, Kb, r=r), tokens, counts, scores,
                             *batch, Kb=Kb, r=r)
    eo, el = oracle.sparse_attention(p["q"], p["k_cache"], p["v_cache"], p["block_table"], tokens,
                                     counts, p["req_ids"], p["seq_lens"], scale=kw.get("scale"),
                                     r=r)
    return out, lse, eo, el, counts


@pytest.mark.parametrize("route", ["generic", "page4"])
def test_non_default_scale(rng, route):
    p, tokens, counts = _attention_problem(rng, hkv=1, d=32, dtype=np.float16)
    out = poison(np.empty(p["q"].shape, np.float16))
    lse = poison(np.empty(p["q"].shape[:2], np.float32))
    numqsa.sparse_attention(p["q"], p["k_cache"], p["v_cache"], p["block_table"], tokens, counts,
                            p["req_ids"], p["seq_lens"], scale=0.37, out=(out, lse),
                            route_name=route)
    eo, el = oracle.sparse_attention(p["q"], p["k_cache"], p["v_cache"], p["block_table"], tokens,
                                     counts, p["req_ids"], p["seq_lens"], scale=0.37)
    assert_matches_oracle(out, eo, dtype="float16", what="out")
    assert_matches_oracle(lse, el, dtype="float32", what="lse")
    default, _ = oracle.sparse_attention(p["q"], p["k_cache"], p["v_cache"], p["block_table"],
                                         tokens, counts, p["req_ids"], p["seq_lens"])
    with pytest.raises(AssertionError):              # the scale is honoured, not 1/sqrt(D)
        assert_matches_oracle(out, default, dtype="float16")


@pytest.mark.parametrize("r", [2, 8])
def test_compress_ratio_other_than_4(rng, r):
    """Groups of 2 and 8 tokens through the whole prefill: scores, top-k, expansion (tails of up
    to r - 1 tokens) and attention, which takes the generic route (the page-4 plan is for r = 4)."""
    p = make_problem([77, 30], positions=[76, 61, 29, 5], req_ids=[0, 0, 1, 1], page_size=16, Hq=4,
                     Hkv=2, D=16, Hi=2, Di=16, r=r, dtype=np.float16,
                     seed=int(rng.integers(1 << 31)))
    out, lse, eo, el, counts = _prefill_vs_oracle(p, Kb=3, r=r)
    assert {int(c) % r for c in counts} != {0}, "some row must have a partial tail"
    assert_matches_oracle(out, eo, dtype="float16", what="out")
    assert_matches_oracle(lse, el, dtype="float32", what="lse")


def test_page_size_1024(rng, api_attention):
    """A 1024-token page (one request spans two) through the whole prefill."""
    p = make_problem([1203, 70], positions=[1202, 1100, 69], req_ids=[0, 0, 1], page_size=1024,
                     Hq=2, Hkv=1, D=16, Hi=2, Di=16, dtype=np.float16,
                     seed=int(rng.integers(1 << 31)))
    out, lse, eo, el, _ = _prefill_vs_oracle(p, Kb=6)
    assert_matches_oracle(out, eo, dtype="float16", what="out")
    assert_matches_oracle(lse, el, dtype="float32", what="lse")


def test_mixed_dtypes(rng):
    """bfloat16 queries on a float16 cache (the FMA route): out in the query's dtype."""
    bf16 = np.dtype(pytest.importorskip("ml_dtypes").bfloat16)
    p, tokens, counts = _attention_problem(rng, hkv=1, d=32, dtype=np.float16)
    p["q"] = p["q"].astype(bf16)
    out = poison(np.empty(p["q"].shape, bf16))
    lse = poison(np.empty(p["q"].shape[:2], np.float32))
    numqsa.sparse_attention(p["q"], p["k_cache"], p["v_cache"], p["block_table"], tokens, counts,
                            p["req_ids"], p["seq_lens"], out=(out, lse))
    eo, el = oracle.sparse_attention(p["q"], p["k_cache"], p["v_cache"], p["block_table"], tokens,
                                     counts, p["req_ids"], p["seq_lens"])
    assert_matches_oracle(out, eo, dtype="bfloat16", what="out")
    assert_matches_oracle(lse, el, dtype="float32", what="lse")


@pytest.mark.parametrize("q_dtype, out_dtype, route", [("float16", "bfloat16", "generic"),
                                                       ("bfloat16", "float16", "generic"),
                                                       ("float16", "float32", "page4")])
def test_out_dtype_conversions(rng, q_dtype, out_dtype, route):
    """out_dtype other than the query's: rounded once to it (or kept in float32)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    as_dt = lambda n: np.dtype(ml_dtypes.bfloat16) if n == "bfloat16" else np.dtype(n)
    p, tokens, counts = _attention_problem(rng, hkv=1, d=32, dtype=np.float16)
    for k in ("q", "k_cache", "v_cache"):
        p[k] = p[k].astype(as_dt(q_dtype))
    out = poison(np.empty(p["q"].shape, as_dt(out_dtype)))
    lse = poison(np.empty(p["q"].shape[:2], np.float32))
    got, _ = numqsa.sparse_attention(p["q"], p["k_cache"], p["v_cache"], p["block_table"], tokens,
                                     counts, p["req_ids"], p["seq_lens"], out_dtype=out_dtype,
                                     out=(out, lse), route_name=route)
    assert got is out and out.dtype == as_dt(out_dtype)
    eo, el = oracle.sparse_attention(p["q"], p["k_cache"], p["v_cache"], p["block_table"], tokens,
                                     counts, p["req_ids"], p["seq_lens"])
    assert_matches_oracle(out, eo, dtype=out_precision(q_dtype, out_dtype, route), what="out")
    assert_matches_oracle(lse, el, dtype="float32", what="lse")


def test_negative_seq_lens_are_inert(rng, api_attention):
    """A request with seq_lens < 0 is empty: its rows select nothing, out = 0, lse = -inf."""
    p = make_problem([61, 20], positions=[60, 33, 10, 3], req_ids=[0, 0, 1, 1], page_size=16, Hq=2,
                     Hkv=1, D=16, Hi=2, Di=16, dtype=np.float16, seed=int(rng.integers(1 << 31)))
    p["seq_lens"] = np.array([61, -5], np.int32)
    out, lse, eo, el, counts = _prefill_vs_oracle(p, Kb=4)
    assert counts[0] > 0 and counts[1] > 0 and not counts[2:].any()
    assert not out[2:].astype(np.float32).any() and np.isneginf(lse[2:]).all()
    assert_matches_oracle(out, eo, dtype="float16", what="out")
    assert_matches_oracle(lse, el, dtype="float32", what="lse")
