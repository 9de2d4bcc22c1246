"""Sparse attention kernels (issue 4) against the float64 oracle, plus the invariances of spec §6.

Simulator tier: tiny shapes (D 32, a few rows) through both routes -- the generic FMA kernel and the
page-4 plan + grouped tensor-core kernel, the latter with both mma variants (``NUMQSA_ARCH=sm_70``
runs m8n8k4, ``sm_90`` m16n8k16) through the simulator stand-ins. GPU tier (``-m gpu``): the shipped
shape Hq 6 / Hkv 1 / D 256 with 2051 selected tokens at 4095, 4096 and 8192 rows.
Every comparison is against the oracle run on the kernel's own selection; outputs are NaN-poisoned.
"""
import numpy as np
import pytest
from numba import cuda

import numqsa
import oracle
from numqsa.jit import SIMULATOR
from numqsa.kernels import page4 as k_page4
from numqsa.testing import (INT_POISON, assert_matches_oracle, poison,
                            sparse_attention_accumulating_in)
from oracle.problems import make_problem

R = 4


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

def selection(rng, req_ids, positions, seq_lens, kb, mode="random", base_rows=None):
    """``(tokens, counts)`` from synthetic groups: each row takes ``min(kb, nb)`` visible groups.

    ``mode``: "random" (independent rows), "shared" (rows of a request take the same groups where
    visible), "overlap" (each row keeps ~80% of the previous row's groups).
    """
    live, _, _, nb = oracle.row_states(req_ids, positions, seq_lens, R)
    rows = len(req_ids)
    groups = np.full((rows, kb), -1, np.int32)
    prev = None
    for i in range(rows):
        if not live[i] or nb[i] == 0:
            prev = None
            continue
        n, k = int(nb[i]), min(kb, int(nb[i]))
        if mode == "shared" or (mode == "overlap" and prev is not None):
            keep = [] if prev is None else [g for g in prev if g < n]
            if mode == "overlap":
                keep = list(rng.choice(keep, size=min(len(keep), int(0.8 * k)), replace=False))
            rest = np.setdiff1d(np.arange(n), keep)
            extra = rng.choice(rest, size=max(0, k - len(keep)), replace=False) if k > len(keep) else []
            g = np.sort(np.r_[np.asarray(keep[:k], np.int64), np.asarray(extra, np.int64)])[:k]
        else:
            g = np.sort(rng.choice(n, size=k, replace=False))
        groups[i, :k] = g
        prev = list(g)
    tokens, counts = oracle.expand_tokens(groups, req_ids, positions, seq_lens, r=R)
    return tokens.astype(np.int32), counts.astype(np.int32)


def device_kv(k, v, layout):
    """Device views of host K/V made by ``oracle.problems.kv_views`` with the same strides (no copy)."""
    if layout == "contiguous":
        return cuda.to_device(k), cuda.to_device(v)
    if layout == "interleaved":
        kv = cuda.to_device(k.base)
        return kv[:, 0], kv[:, 1]
    dk, dv = cuda.to_device(np.ascontiguousarray(k.base)), cuda.to_device(np.ascontiguousarray(v.base))
    return _permuted(dk, (0, 2, 1, 3)), _permuted(dv, (0, 2, 1, 3))


def _permuted(d, axes):
    if SIMULATOR:
        return d.transpose(axes)
    from numba.cuda.cudadrv.devicearray import DeviceNDArray
    return DeviceNDArray(tuple(d.shape[a] for a in axes), tuple(d.strides[a] for a in axes), d.dtype,
                         gpu_data=d.gpu_data)


def run_attention(p, tokens, counts, route, out_dtype=None, layout=None, device=False):
    """The public function on host (or, with ``device``, strided device) arrays; NaN-poisoned outputs."""
    rows, hq, d = p["q"].shape
    od = np.dtype(out_dtype or p["q"].dtype)
    args = [p["q"], p["k_cache"], p["v_cache"], p["block_table"], tokens, counts, p["req_ids"],
            p["seq_lens"]]
    if device:
        k, v = device_kv(p["k_cache"], p["v_cache"], layout)
        args = [cuda.to_device(p["q"]), k, v] + [cuda.to_device(np.asarray(a)) for a in args[3:]]
        out = poison(cuda.device_array((rows, hq, d), od))
        lse = poison(cuda.device_array((rows, hq), np.float32))
    else:
        out = poison(np.empty((rows, hq, d), od))
        lse = poison(np.empty((rows, hq), np.float32))
    o, l = numqsa.sparse_attention(*args, out_dtype=out_dtype, route_name=route, out=(out, lse))
    if device:
        return o.copy_to_host(), l.copy_to_host()
    return o, l


def out_precision(q_dtype, out_dtype, route):
    """The narrowest type on ``out``'s path: its own dtype, and on the tensor-core routes the
    probabilities P, rounded to the query dtype before ``P @ V``; the FMA route computes in float32."""
    od = np.dtype(out_dtype or q_dtype).name
    if od != "float32":
        return od
    return "float32" if route == "generic" else np.dtype(q_dtype).name


def check(p, tokens, counts, out, lse, out_dtype=None, route="page4"):
    eo, el = oracle.sparse_attention(p["q"], p["k_cache"], p["v_cache"], p["block_table"], tokens,
                                     counts, p["req_ids"], p["seq_lens"])
    assert_matches_oracle(out, eo, dtype=out_precision(p["q"].dtype, out_dtype, route), what="out")
    assert_matches_oracle(lse, el, dtype="float32", what="lse")
    inert = counts == 0
    assert np.all(out[inert] == 0) and np.all(lse[inert] == -np.inf)


@pytest.fixture(params=["sm_70", "sm_90"])
def arch(request, monkeypatch):
    monkeypatch.setenv("NUMQSA_ARCH", request.param)
    return request.param


def small_problem(rng, seq_lens, rows_per_req, page_size=16, Hq=6, Hkv=1, D=32, layout="contiguous",
                  dtype=np.float16, **kw):
    return make_problem(seq_lens, rows_per_req, page_size=page_size, Hq=Hq, Hkv=Hkv, D=D, Di=8,
                        dtype=dtype, layout=layout, seed=int(rng.integers(1 << 31)), **kw)


# ---------------------------------------------------------------------------------------------
# generic route
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["contiguous", "interleaved", "head_major"])
@pytest.mark.parametrize("page_size", [16, 64, 784])
def test_generic_layouts_and_page_sizes(rng, layout, page_size):
    p = small_problem(rng, [53, 30], [3, 2], page_size=page_size, D=16, layout=layout)
    tokens, counts = selection(rng, p["req_ids"], p["positions"], p["seq_lens"], kb=5)
    out, lse = run_attention(p, tokens, counts, "generic", layout=layout, device=True)
    check(p, tokens, counts, out, lse)


@pytest.mark.parametrize("hq,hkv", [(6, 1), (12, 1), (24, 2)])
def test_generic_heads_dtypes(rng, hq, hkv):
    dtype = np.float32 if hq == 12 else np.float16
    p = small_problem(rng, [41], [3], Hq=hq, Hkv=hkv, D=16, dtype=dtype)
    tokens, counts = selection(rng, p["req_ids"], p["positions"], p["seq_lens"], kb=4)
    out, lse = run_attention(p, tokens, counts, "generic", out_dtype=np.float32)
    assert out.dtype == np.float32
    check(p, tokens, counts, out, lse, out_dtype=np.float32, route="generic")


def test_generic_inert_stale_and_bad_ids(rng):
    # rows: live, stale (position past seq_len), inert (bad request), inert (negative position),
    # and a live row handed an out-of-range token id, which the kernel must turn inert.
    p = small_problem(rng, [29, 13], None, positions=[28, 40, 3, -1, 12], req_ids=[0, 1, 5, 0, 1])
    tokens, counts = selection(rng, p["req_ids"], p["positions"], p["seq_lens"], kb=3)
    assert counts[2] == 0 and counts[3] == 0 and counts[1] == 13
    bad = tokens.copy()
    bad[4, 0] = 13                       # == seq_len of request 1
    # device inputs: the API validates host selections' values, the kernel guards device ones
    out, lse = run_attention(p, bad, counts, "generic", layout="contiguous", device=True)
    assert np.all(out[4] == 0) and np.all(lse[4] == -np.inf)
    good = counts.copy()
    good[4] = 0
    check(p, tokens, good, out, lse)


# ---------------------------------------------------------------------------------------------
# page-4 plan
# ---------------------------------------------------------------------------------------------

def test_plan_matches_oracle_and_rejects_malformed_rows(rng):
    p = small_problem(rng, [61, 22], [6, 4], page_size=16)
    tokens, counts = selection(rng, p["req_ids"], p["positions"], p["seq_lens"], kb=4)
    tails = {int(c) % 4 for c in counts}
    tok = tokens.copy()
    cnt = counts.copy()
    tok[1, 0] += 1                           # not aligned to a group start
    tok[2, [4, 5, 6, 7]] = tok[2, [0, 1, 2, 3]]   # not increasing
    cnt[3] = tok.shape[1] + 1                # count beyond the width
    table = p["block_table"].copy()
    table[1, 0] = 10 ** 6                    # page id out of range for request 1's first page
    n_pages = p["k_cache"].shape[0]
    outs = tuple(poison(np.empty(s, np.int32)) for s in ((len(cnt), tok.shape[1] // 4 + 1, 2),
                                                         (len(cnt),), (len(cnt),)))
    got = numqsa.page4_plan(tok, cnt, table, p["req_ids"], p["seq_lens"], page_size=16,
                            num_pages=n_pages, out=outs)
    want = oracle.page4_plan(tok, cnt, table, p["req_ids"], p["seq_lens"], page_size=16,
                             num_pages=n_pages)
    for g, w, name in zip(got, want, ("pages", "num_vpages", "tail_len")):
        assert not np.any(g == INT_POISON), name
        np.testing.assert_array_equal(g, w, err_msg=name)
    assert np.all(got[1][1:4] == 0) and np.all(got[1][6:] == 0)   # request 1 rows need page 0
    assert len(tails) >= 2


def test_plan_ids_near_the_int32_limit():
    """The plan's checks run in 32-bit arithmetic (session 23): ids at the top of the int32 range,
    negative ids, and a row whose ids would wrap past 2**31 - 1 get the oracle's verdicts, with
    well-formed rows beside them."""
    big = 2 ** 31 - 1
    page_size, cols = 16, 8
    seq_lens = np.array([100, big], np.int32)
    table = np.arange(2 * cols, dtype=np.int32).reshape(2, cols)
    good = np.arange(8, 16, dtype=np.int32)                   # two whole pages of request 0
    rows = [
        (good, 0),
        (np.array([big - 3, big - 2, big - 1, big], np.int32), 1),      # past the request's end
        (np.array([big - 7, big - 6, big - 5, big - 4], np.int32), 1),  # a column past the table
        (np.array([-4, -3, -2, -1], np.int32), 1),                       # negative
        (np.array([big - 1, big, -big - 1, -big], np.int32), 1),         # not aligned, wrapping
        (np.array([4, 5, 6, 7, big - 3, big - 2, big - 1, big], np.int32), 1),  # a good page first
        (good, 1),
    ]
    width = 2 * 4 + 3                                          # Kb 2
    tok = np.full((len(rows), width), -1, np.int32)
    cnt = np.zeros(len(rows), np.int32)
    req = np.zeros(len(rows), np.int32)
    for i, (ids, r) in enumerate(rows):
        tok[i, :ids.size] = ids
        cnt[i] = ids.size
        req[i] = r
    outs = tuple(poison(np.empty(s, np.int32)) for s in ((len(rows), width // 4 + 1, 2),
                                                         (len(rows),), (len(rows),)))
    got = numqsa.page4_plan(tok, cnt, table, req, seq_lens, page_size=page_size, num_pages=2 * cols,
                            out=outs)
    want = oracle.page4_plan(tok, cnt, table, req, seq_lens, page_size=page_size,
                             num_pages=2 * cols)
    for g, w, name in zip(got, want, ("pages", "num_vpages", "tail_len")):
        np.testing.assert_array_equal(g, w, err_msg=name)
    assert list(got[1]) == [2, 0, 0, 0, 0, 0, 2]


# ---------------------------------------------------------------------------------------------
# page-4 grouped route (both mma variants through the simulator stand-ins)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["random", "shared", "overlap"])
def test_page4_matches_oracle(rng, arch, mode):
    # 7 rows of one request (positions 57..63: tails 2,3,0,1,2,3,0) + 3 of another (Kb 6 of <=5
    # visible groups: every group, then dense), page size 16, shuffled physical pages.
    p = small_problem(rng, [64, 19], [7, 3], page_size=16)
    tokens, counts = selection(rng, p["req_ids"], p["positions"], p["seq_lens"], kb=6, mode=mode)
    out, lse = run_attention(p, tokens, counts, "page4")
    check(p, tokens, counts, out, lse)


def test_page4_long_context_sparse(rng, arch):
    """Keys beyond one 256-group window and stages cut by capacity: a 1203-token context."""
    p = small_problem(rng, [1203], [3], page_size=64)
    tokens, counts = selection(rng, p["req_ids"], p["positions"], p["seq_lens"], kb=9, mode="overlap")
    out, lse = run_attention(p, tokens, counts, "page4")
    check(p, tokens, counts, out, lse)


@pytest.mark.parametrize("layout,page_size,hq,hkv", [("interleaved", 64, 12, 1),
                                                      ("head_major", 784, 24, 2)])
def test_page4_layouts_heads(rng, arch, layout, page_size, hq, hkv):
    p = small_problem(rng, [45], [5], page_size=page_size, Hq=hq, Hkv=hkv, layout=layout)
    tokens, counts = selection(rng, p["req_ids"], p["positions"], p["seq_lens"], kb=4,
                               mode="overlap")
    out, lse = run_attention(p, tokens, counts, "page4", layout=layout, device=True)
    check(p, tokens, counts, out, lse)


def test_page4_unaligned_cache(rng, monkeypatch):
    """A cache whose rows are not 16-byte aligned cannot be copied with cp.async: on sm_90 the page-4
    route then runs the element-load grouped kernel, with the same result."""
    monkeypatch.setenv("NUMQSA_ARCH", "sm_90")
    p = small_problem(rng, [45], [4], page_size=16)
    tokens, counts = selection(rng, p["req_ids"], p["positions"], p["seq_lens"], kb=5, mode="overlap")
    pad = [np.concatenate([np.zeros(x.shape[:-1] + (1,), x.dtype), x], -1)
           for x in (p["k_cache"], p["v_cache"])]
    k, v = (cuda.to_device(x)[..., 1:] for x in pad)
    assert numqsa.kernels.grouped.words_view(k) is None
    rows, hq, d = p["q"].shape
    out = poison(cuda.device_array((rows, hq, d), np.float16))
    lse = poison(cuda.device_array((rows, hq), np.float32))
    numqsa.sparse_attention(cuda.to_device(p["q"]), k, v, *[cuda.to_device(np.asarray(p[n])) for n in
                            ("block_table",)], cuda.to_device(tokens), cuda.to_device(counts),
                            cuda.to_device(p["req_ids"]), cuda.to_device(p["seq_lens"]),
                            route_name="page4", out=(out, lse))
    check(p, tokens, counts, out.copy_to_host(), lse.copy_to_host())


def test_page4_inert_stale_rows_and_bad_pages(rng, arch):
    p = small_problem(rng, [37, 9], None, positions=[36, 50, 2, -3, 35, 8],
                      req_ids=[0, 0, 3, 0, 0, 1])
    tokens, counts = selection(rng, p["req_ids"], p["positions"], p["seq_lens"], kb=5, mode="shared")
    out, lse = run_attention(p, tokens, counts, "page4")
    check(p, tokens, counts, out, lse)
    # A plan entry outside the cache (handed to page4_attention directly) makes only its row inert.
    pages, nv, tl = oracle.page4_plan(tokens, counts, p["block_table"], p["req_ids"], p["seq_lens"],
                                      page_size=16, num_pages=p["k_cache"].shape[0])
    pages = pages.copy()
    pages[0, 1, 0] = p["k_cache"].shape[0]
    o2, l2 = numqsa.page4_attention(p["q"], p["k_cache"], p["v_cache"], pages, nv, tl, p["req_ids"])
    assert np.all(o2[0] == 0) and np.all(l2[0] == -np.inf)
    np.testing.assert_array_equal(o2[1:], out[1:])


def test_page4_route_takes_any_selection(rng, arch):
    """Rows whose selection is not whole aligned groups (hand-made) still get exactly their tokens:
    the plan leaves them out and the generic kernel computes them within the page-4 route."""
    p = small_problem(rng, [70], [5], page_size=16)
    tokens, counts = selection(rng, p["req_ids"], p["positions"], p["seq_lens"], kb=6, mode="overlap")
    for i in (1, 3):
        n = int(counts[i])
        tokens[i, :n] = rng.permutation(int(p["positions"][i]) + 1)[:n]      # any order, unaligned
    out, lse = run_attention(p, tokens, counts, "page4")
    check(p, tokens, counts, out, lse)


def test_routes_agree(rng):
    """The two routes agree; both routes' lse meet the float32 tolerance, which the same sums
    accumulated in float16 fail."""
    p = small_problem(rng, [70], [6], page_size=16)
    tokens, counts = selection(rng, p["req_ids"], p["positions"], p["seq_lens"], kb=8, mode="overlap")
    g, gl = run_attention(p, tokens, counts, "generic")
    q4, ql = run_attention(p, tokens, counts, "page4")
    assert_matches_oracle(q4, g.astype(np.float64), dtype="float16", what="page4 vs generic")
    assert_matches_oracle(ql, gl.astype(np.float64), dtype="float32", what="lse page4 vs generic")
    check(p, tokens, counts, q4, ql)
    _, el = oracle.sparse_attention(p["q"], p["k_cache"], p["v_cache"], p["block_table"], tokens,
                                    counts, p["req_ids"], p["seq_lens"])
    _, fl = sparse_attention_accumulating_in(np.float16, p["q"], p["k_cache"], p["v_cache"],
                                             p["block_table"], tokens, counts, p["req_ids"],
                                             p["seq_lens"])
    with pytest.raises(AssertionError):
        assert_matches_oracle(fl, el, dtype="float32", what="lse accumulated in float16")


def test_generic_float32_output_tells_float16_accumulation(rng):
    """float16 inputs, float32 output on the FMA route: checked at float32, where the same
    attention accumulated in float16 (q.K, softmax sum, P @ V) fails out and lse."""
    p = small_problem(rng, [53, 30], [3, 2], D=16)
    tokens, counts = selection(rng, p["req_ids"], p["positions"], p["seq_lens"], kb=5)
    out, lse = run_attention(p, tokens, counts, "generic", out_dtype=np.float32)
    check(p, tokens, counts, out, lse, out_dtype=np.float32, route="generic")
    eo, el = oracle.sparse_attention(p["q"], p["k_cache"], p["v_cache"], p["block_table"], tokens,
                                     counts, p["req_ids"], p["seq_lens"])
    fo, fl = sparse_attention_accumulating_in(np.float16, p["q"], p["k_cache"], p["v_cache"],
                                              p["block_table"], tokens, counts, p["req_ids"],
                                              p["seq_lens"])
    for got, want, what in ((fo, eo, "out"), (fl, el, "lse")):
        with pytest.raises(AssertionError):
            assert_matches_oracle(got, want, dtype="float32", what=f"{what} accumulated in float16")


# ---------------------------------------------------------------------------------------------
# invariances (spec §6): reruns, relocation, batch composition / grouping
# ---------------------------------------------------------------------------------------------

def relocate(p, rng):
    """The same logical content on other physical pages (a fresh permutation of the page pool)."""
    n = p["k_cache"].shape[0]
    perm = rng.permutation(n)                  # page x moves to perm[x]
    q = dict(p)
    k = np.empty_like(p["k_cache"])
    v = np.empty_like(p["v_cache"])
    k[perm] = p["k_cache"]
    v[perm] = p["v_cache"]
    q["k_cache"], q["v_cache"] = k, v
    tab = p["block_table"].copy()
    tab[tab >= 0] = perm[tab[tab >= 0]]
    q["block_table"] = tab
    return q


@pytest.mark.parametrize("route", ["generic", "page4"])
def test_invariances(rng, arch, route):
    p = small_problem(rng, [66, 30], [6, 2], page_size=16)
    tokens, counts = selection(rng, p["req_ids"], p["positions"], p["seq_lens"], kb=6, mode="overlap")
    base = run_attention(p, tokens, counts, route)
    again = run_attention(p, tokens, counts, route)
    moved = run_attention(relocate(p, rng), tokens, counts, route)
    for a, b in zip(base, again):
        np.testing.assert_array_equal(a, b, err_msg="rerun")
    for a, b in zip(base, moved):
        np.testing.assert_array_equal(a, b, err_msg="relocation")
    # Other rows join: one row of request 0 in front shifts every group boundary, two rows of
    # request 1 in the middle, and an inert padding row at the end.
    order = np.r_[[0], np.arange(6), [6, 7, 6], np.arange(6, 8), [0]]
    joined = dict(p)
    joined["q"] = p["q"][order]
    joined["req_ids"] = p["req_ids"][order].copy()
    joined["positions"] = p["positions"][order].copy()
    joined["positions"][0] = p["positions"][0] - 3
    joined["req_ids"][-1] = -1
    tj, cj = tokens[order].copy(), counts[order].copy()
    t0, c0 = selection(rng, joined["req_ids"][:1], joined["positions"][:1], p["seq_lens"], kb=6)
    tj[0], cj[0] = t0[0], c0[0]
    tj[-1], cj[-1] = -1, 0
    jo, jl = run_attention(joined, tj, cj, route)
    pick = np.r_[np.arange(1, 7), [10, 11]]
    np.testing.assert_array_equal(jo[pick], base[0], err_msg="batch composition")
    np.testing.assert_array_equal(jl[pick], base[1], err_msg="batch composition (lse)")
    check(joined, tj, cj, jo, jl)


def chunk_of(p, tokens, counts, rows):
    """Rows ``rows`` of one request as a prefill chunk runs them: the request's length ends at
    the chunk's last row (its cache holds nothing past it yet); the rows' selections unchanged."""
    c = dict(p)
    c["q"] = p["q"][rows]
    c["req_ids"] = p["req_ids"][rows]
    c["positions"] = p["positions"][rows]
    c["seq_lens"] = p["seq_lens"].copy()
    req = int(c["req_ids"][-1])
    c["seq_lens"][req] = int(c["positions"].max()) + 1
    return c, tokens[rows], counts[rows]


@pytest.mark.parametrize("route", ["generic", "page4"])
def test_prefill_chunks_bitwise(rng, arch, route):
    """A request's rows split into two prefill chunks, at two different boundaries: every row has
    the bits it has when the rows run in one call (the first chunk sees a shorter request)."""
    p = small_problem(rng, [120, 40], [9, 3], page_size=16)
    tokens, counts = selection(rng, p["req_ids"], p["positions"], p["seq_lens"], kb=8, mode="overlap")
    whole = run_attention(p, tokens, counts, route)
    check(p, tokens, counts, *whole)
    first = np.flatnonzero(p["req_ids"] == 0)
    for b in (1, 5):
        for rows in (first[:b], first[b:]):
            c, t, n = chunk_of(p, tokens, counts, rows)
            o, l = run_attention(c, t, n, route)
            np.testing.assert_array_equal(o, whole[0][rows], err_msg=f"chunk at {b}")
            np.testing.assert_array_equal(l, whole[1][rows], err_msg=f"chunk at {b} (lse)")


def test_page4_grouping_invariance(rng, arch):
    """Same rows, different group sizes: bitwise identical per row (the kernel-level claim).

    Two requests of equal length with the same page-table layout make windows that mix rows of
    both: equal logical keys there must not share staged pages."""
    p = small_problem(rng, [80, 80], [3, 4], page_size=16)
    tokens, counts = selection(rng, p["req_ids"], p["positions"], p["seq_lens"], kb=7, mode="overlap")
    from numqsa.plan import arch_profile
    prof = arch_profile((9, 0))
    res = []
    for gr in (1, 2, 4):
        pages, nv, tl = oracle.page4_plan(tokens, counts, p["block_table"], p["req_ids"],
                                          p["seq_lens"], page_size=16, num_pages=p["k_cache"].shape[0])
        args = [cuda.to_device(np.ascontiguousarray(x)) for x in
                (p["q"], p["k_cache"], p["v_cache"], pages.astype(np.int32), nv.astype(np.int32),
                 tl.astype(np.int32), p["req_ids"])]
        out = poison(cuda.device_array(p["q"].shape, np.float16))
        lse = poison(cuda.device_array(p["q"].shape[:2], np.float32))
        k_page4.launch_page4(*args, 1 / np.sqrt(32), out, lse, prof, cuda.default_stream(),
                             tokens=cuda.to_device(tokens), group_rows=gr)
        res.append((out.copy_to_host(), lse.copy_to_host()))
    for o, l in res[1:]:
        np.testing.assert_array_equal(o, res[0][0])
        np.testing.assert_array_equal(l, res[0][1])
    check(p, tokens, counts, *res[-1])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_small_rows(dtype, seed):
    """The small-row checks (issue 20) at the bench's shape: the last 1, 4, 16, 64 and 256 rows of a
    32K context (2051 selected tokens, page 64 in random order), planned route, against the float64
    oracle; every row bitwise the same as in the 4096-row batch, in a second call (the cached
    wrapper replays its prepared launches), on relocated pages, and in a prefill split into two chunks at two
    boundaries (the first chunk sees its request end at its last row)."""
    import ml_dtypes
    dt = np.dtype(np.float16) if dtype == "float16" else np.dtype(ml_dtypes.bfloat16)
    rows = 4096
    w = gpu_problem(rows, 32768, seed, dtype=dt)
    p, tokens, counts = w["problem"], w["tokens"], w["counts"]
    rng = np.random.default_rng(seed)
    whole = run_attention(p, tokens, counts, None)

    def same(got, sub, what):
        np.testing.assert_array_equal(got[0].view(np.uint16), whole[0][sub].view(np.uint16),
                                      err_msg=f"{dtype}: {what}")
        np.testing.assert_array_equal(got[1], whole[1][sub], err_msg=f"{dtype}: {what} (lse)")

    for n in (1, 4, 16, 64, 256):
        sub = np.arange(rows - n, rows)
        c, t, k = chunk_of(p, tokens, counts, sub)      # (the last rows: the request's length)
        first = run_attention(c, t, k, None)
        same(first, sub, f"{n} rows")
        same(run_attention(c, t, k, None), sub, f"{n} rows, again")
        if n == 4:
            same(run_attention(relocate(c, rng), t, k, None), sub, f"{n} rows, relocated")
        pick = np.unique(np.r_[0, n - 1, rng.integers(0, n, 6)])
        eo, el = oracle.sparse_attention(c["q"][pick], p["k_cache"], p["v_cache"], p["block_table"],
                                         t[pick], k[pick], c["req_ids"][pick], p["seq_lens"])
        assert_matches_oracle(first[0][pick], eo, dtype=dtype, what=f"{n} rows out")
        assert_matches_oracle(first[1][pick], el, dtype="float32", what=f"{n} rows lse")
    for b in (rows - 4, rows - 256):
        for sub in (np.arange(b), np.arange(b, rows)):
            same(run_attention(*chunk_of(p, tokens, counts, sub), None), sub, f"chunk at {b}")


# ---------------------------------------------------------------------------------------------
# routing
# ---------------------------------------------------------------------------------------------

def test_routing(monkeypatch):
    from numqsa.stages.attention import route
    from numqsa.plan import PROFILES
    for name, prof in PROFILES.items():       # one route at every batch size
        assert {route(n, 64, cc=prof.cc).route for n in (1, 4095, 4096, 10 ** 6)} == {"page4"}
    monkeypatch.setenv("NUMQSA_PAGE4", "0")
    assert route(10 ** 6, 64, cc=(9, 0)).route == "generic"


def test_page4_refuses_float32(rng):
    p = small_problem(rng, [20], [2], dtype=np.float32)
    tokens, counts = selection(rng, p["req_ids"], p["positions"], p["seq_lens"], kb=2)
    with pytest.raises(numqsa.QSAInputError):
        run_attention(p, tokens, counts, "page4")


# ---------------------------------------------------------------------------------------------
# GPU tier: the shipped shape
# ---------------------------------------------------------------------------------------------

def gpu_problem(rows, context, seed, page_size=64, kb=512, overlap=0.82, dtype=np.float16):
    """One request, rows at the last positions of a ``context``-token context, Hq6/Hkv1/D256."""
    import sys, os
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    from bench_attention import make_workload
    return make_workload(rows, context, page_size=page_size, kb=kb, overlap=overlap, seed=seed,
                         dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [4095, 4096, 8192])
def test_gpu_real_shapes(rows, seed):
    """The tier's architecture (the sm_70 kernels in the tier run under NUMQSA_ARCH=sm_70)."""
    w = gpu_problem(rows, 32768, seed)
    p, tokens, counts = w["problem"], w["tokens"], w["counts"]
    assert int(counts.max()) == 2051
    dev = {k: cuda.to_device(np.ascontiguousarray(v)) for k, v in p.items() if k != "meta"}
    dt, dc = cuda.to_device(tokens), cuda.to_device(counts)
    results = {}
    for route in ("generic", "page4"):
        outs = []
        for _ in range(20 if route == "page4" else 3):
            out = poison(cuda.device_array((rows, 6, 256), np.float16))
            lse = poison(cuda.device_array((rows, 6), np.float32))
            numqsa.sparse_attention(dev["q"], dev["k_cache"], dev["v_cache"], dev["block_table"], dt,
                                    dc, dev["req_ids"], dev["seq_lens"], route_name=route,
                                    out=(out, lse))
            outs.append((out.copy_to_host(), lse.copy_to_host()))
        for o, l in outs[1:]:
            np.testing.assert_array_equal(o, outs[0][0], err_msg=f"{route}: rerun")
            np.testing.assert_array_equal(l, outs[0][1], err_msg=f"{route}: rerun")
        results[route] = outs[0]
    sample = np.random.default_rng(seed).choice(rows, size=48, replace=False)
    eo, el = oracle.sparse_attention(p["q"][sample], p["k_cache"], p["v_cache"], p["block_table"],
                                     tokens[sample], counts[sample], p["req_ids"][sample],
                                     p["seq_lens"])
    for route, (o, l) in results.items():
        assert np.isfinite(o).all() and np.isfinite(l).all()
        assert_matches_oracle(o[sample], eo, dtype="float16", what=f"{route} out")
        assert_matches_oracle(l[sample], el, dtype="float32", what=f"{route} lse")
    assert_matches_oracle(results["page4"][0], results["generic"][0].astype(np.float64),
                          dtype="float16", what="page4 vs generic")
    # relocation and batch composition, grouped route: shift rows by one (other groups) and move pages
    perm = np.random.default_rng(seed + 1).permutation(p["k_cache"].shape[0])
    k = np.empty_like(p["k_cache"])
    v = np.empty_like(p["v_cache"])
    k[perm], v[perm] = p["k_cache"], p["v_cache"]
    bt = p["block_table"]
    tab = np.where(bt >= 0, perm[np.maximum(bt, 0)], -1).astype(np.int32)
    sub = slice(1, rows)
    out = poison(cuda.device_array((rows - 1, 6, 256), np.float16))
    lse = poison(cuda.device_array((rows - 1, 6), np.float32))
    numqsa.sparse_attention(dev["q"][sub], cuda.to_device(k), cuda.to_device(v), cuda.to_device(tab),
                            cuda.to_device(tokens[sub]), cuda.to_device(counts[sub]),
                            cuda.to_device(p["req_ids"][sub]), dev["seq_lens"], route_name="page4",
                            out=(out, lse))
    np.testing.assert_array_equal(out.copy_to_host(), results["page4"][0][sub])
    np.testing.assert_array_equal(lse.copy_to_host(), results["page4"][1][sub])
    # a row alone, 16 and 64 rows (one-row windows: the direct kernel with O's dims over two warps;
    # two-row windows) give the bits they give in the batch's six-row windows
    for sub in ([rows - 1], list(range(rows - 16, rows)), list(range(64))):
        n = len(sub)
        out = poison(cuda.device_array((n, 6, 256), np.float16))
        lse = poison(cuda.device_array((n, 6), np.float32))
        numqsa.sparse_attention(cuda.to_device(p["q"][sub]), dev["k_cache"], dev["v_cache"],
                                dev["block_table"], cuda.to_device(tokens[sub]),
                                cuda.to_device(counts[sub]), cuda.to_device(p["req_ids"][sub]),
                                dev["seq_lens"], route_name="page4", out=(out, lse))
        np.testing.assert_array_equal(out.copy_to_host(), results["page4"][0][sub], err_msg=f"{n} rows")
        np.testing.assert_array_equal(lse.copy_to_host(), results["page4"][1][sub], err_msg=f"{n} rows")
