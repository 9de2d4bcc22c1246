"""Issue 22: a row needing a bad page id is inert everywhere, inert rows select nothing, one rule
per edge (NaN scores, geometry errors), and no launch grows with ``Kb`` past the visible groups.

Simulator shapes are tiny (one prefill launch costs seconds there); the ``gpu`` tests repeat the
inert-row and ``Kb`` cases at real shapes. Expected results come from the oracle on the *valid*
tables with the rows :func:`oracle.batch.bad_page_rows` names turned inert (position -1): the rule
the device guard applies.
"""
import numpy as np
import pytest
from numba import cuda

import numqsa
import oracle
from numqsa.kernels import guard as K
from numqsa.kernels import page4 as P
from numqsa.testing import (assert_matches_oracle, assert_selection_matches, groups_of_tokens, poison,
                            to_device)
from oracle.batch import bad_page_rows, row_states
from oracle.problems import make_problem

ARGS = ("qi", "index_cache", "index_block_table", "q", "k_cache", "v_cache", "block_table",
        "req_ids", "positions", "seq_lens")
SEL = ("qi", "index_cache", "index_block_table", "req_ids", "positions", "seq_lens")
KB = 8


def small(seed, shared=False):
    """Two requests; rows 0 and 1 of request 0 at positions 299 and 150 (page 16, separate index
    pages of 3 groups): KV column 15 and index column 20 are needed by row 0 only."""
    return make_problem([300, 40], positions=[299, 150, 39, 20], req_ids=[0, 0, 1, 1],
                        page_size=16, Hq=2, Hkv=1, D=32, Hi=2, Di=16, dtype=np.float16, seed=seed,
                        shared_index_table=shared)


def inert_positions(p, ibt, bt):
    """The oracle's positions for a batch run on bad tables ``ibt`` / ``bt`` (None: not checked)."""
    kw = {}
    if ibt is not None:
        kw.update(index_block_table=ibt, num_idx_pages=p["index_cache"].shape[0],
                  idx_page_rows=p["index_cache"].shape[1])
    if bt is not None:
        kw.update(block_table=bt, num_pages=p["k_cache"].shape[0], page_size=p["k_cache"].shape[1])
    bad = bad_page_rows(p["req_ids"], p["positions"], p["seq_lens"], 4, **kw)
    return np.where(bad, -1, p["positions"]).astype(np.int32), bad


def check_prefill(p, got, pos, kb=KB):
    """``got = (out, lse, tokens, counts)`` against the oracle on the valid tables at ``pos``."""
    out, lse, tokens, counts = got
    ref_s = oracle.index_scores(*[p[k] for k in SEL[:4]], pos, p["seq_lens"])
    tok, cnt = np.asarray(tokens), np.asarray(counts)
    groups = groups_of_tokens(tok, cnt, kb)
    assert_selection_matches(groups, tok, cnt, ref_s, p["req_ids"], pos, p["seq_lens"], Kb=kb)
    eo, el = oracle.sparse_attention(p["q"], p["k_cache"], p["v_cache"], p["block_table"], tok, cnt,
                                     p["req_ids"], p["seq_lens"])
    assert_matches_oracle(np.asarray(out), eo, dtype="float16", what="out")
    assert_matches_oracle(np.asarray(lse), el, dtype="float16", what="lse")


# -- the rule ---------------------------------------------------------------------------------
def test_bad_page_rows_by_definition():
    """Row i needs index columns 0..(nb-1)//R and KV columns 0..p//page_size; missing ones are bad."""
    req, pos, lens = np.array([0, 0, 1, 2, 0]), np.array([299, 150, 39, 5, -1]), np.array([300, 40, 8])
    bt = np.arange(3 * 19).reshape(3, 19)
    bt[0, 15] = 10**6
    bt[2, 0] = -3
    rows = bad_page_rows(req, pos, lens, 4, block_table=bt, num_pages=57, page_size=16)
    assert rows.tolist() == [True, False, False, True, False]
    it = np.zeros((3, 2), np.int64)                 # index: 2 columns of 3 groups = 6 groups only
    rows = bad_page_rows(req, pos, lens, 4, index_block_table=it, num_idx_pages=1, idx_page_rows=3)
    # nb: 75, 37, 10, 1, 0 -> columns 25, 13, 4, 1, 0 needed
    assert rows.tolist() == [True, True, True, False, False]


@pytest.mark.parametrize("kv", [False, True])
def test_guard_kernel_matches_the_rule(rng, kv):
    """The device guard on random tables with random bad entries (several requests per block,
    stale and inert rows, a table with fewer rows than requests) gives the rule's positions."""
    nreq, cols, rows = 6, 9, 70
    lens = rng.integers(0, cols * 16 + 1, nreq).astype(np.int32)
    req = rng.integers(-1, nreq + 1, rows).astype(np.int32)
    pos = rng.integers(-2, cols * 16 + 8, rows).astype(np.int32)
    it = rng.integers(0, 40, (nreq - 1, cols)).astype(np.int32)      # request 5 has no table row
    kt = rng.integers(0, 50, (nreq, cols - 2)).astype(np.int32)      # KV columns 7, 8 missing
    for t, n in ((it, 40), (kt, 50)):
        m = rng.random(t.shape) < 0.08
        t[m] = rng.choice([-3, n, 10**6], m.sum())
    kw = dict(index_block_table=it, num_idx_pages=40, idx_page_rows=4)
    if kv:
        kw.update(block_table=kt, num_pages=50, page_size=16)
    bad = bad_page_rows(req, pos, lens, 4, **kw)
    assert 0 < bad.sum() < (row_states(req, pos, lens, 4)[0]).sum()   # the case tests both sides
    out = poison(cuda.device_array(rows, np.int32))
    extra = dict(ktable=to_device(kt), n_kpages=50, page_size=16) if kv else {}
    K.launch_guard(to_device(req), to_device(pos), to_device(lens), to_device(it), 40, 4, out, 0,
                   r=4, **extra)
    np.testing.assert_array_equal(out.copy_to_host(), np.where(bad, -1, pos))


# -- points 1 and 2: every entry point -------------------------------------------------------
@pytest.mark.parametrize("table, value, validate, where", [
    ("index_block_table", 10**6, None, "device"),
    ("block_table", -3, False, "device"),
    ("block_table", 10**6, False, "host"),
])
def test_prefill_row_needing_bad_page_is_inert(seed, table, value, validate, where):
    """qsa_prefill: the row needing the bad page gives out 0, lse -inf, count 0, tokens -1; the
    others equal the oracle on the valid tables (the issue saw a finite output, or a count of 35)."""
    p = small(seed)
    col = 20 if table == "index_block_table" else 15
    bad_tab = p[table].copy()
    bad_tab[0, col] = value
    pos, bad = inert_positions(p, *((bad_tab, None) if table == "index_block_table"
                                    else (None, bad_tab)))
    assert bad.tolist() == [True, False, False, False]
    args = {k: p[k] for k in ARGS}
    args[table] = bad_tab
    if where == "device":
        args = {k: to_device(np.ascontiguousarray(v)) for k, v in args.items()}
    got = numqsa.qsa_prefill(*[args[k] for k in ARGS], Kb=KB, validate=validate)
    got = [x if isinstance(x, np.ndarray) else x.copy_to_host() for x in got]
    out, lse, tokens, counts = got
    assert counts[0] == 0 and (tokens[0] == -1).all()
    assert not out[0].any() and np.isneginf(lse[0]).all()
    check_prefill(p, got, pos)


def test_validate_true_refuses_bad_device_table(seed):
    p = small(seed)
    bt = p["block_table"].copy()
    bt[0, 15] = -3
    d = {k: to_device(np.ascontiguousarray(p[k])) for k in ARGS}
    d["block_table"] = to_device(bt)
    with pytest.raises(numqsa.QSAInputError, match=r"block_table\[0, 15\] = -3"):
        numqsa.qsa_prefill(*[d[k] for k in ARGS], Kb=KB, validate=True)


def test_select_run_select_and_run_inert(seed):
    """select (index table), and a wrapper planned on a shared device table with a bad id:
    run_select and run return count 0 and -1 tokens for the row that needs it."""
    p = small(seed, shared=True)
    bt = p["block_table"].copy()
    bt[0, 15] = 10**6                       # shared: index column 15 too (R = 4 groups a page)
    pos, bad = inert_positions(p, bt, bt)
    assert bad.tolist() == [True, False, False, False]
    d = {k: to_device(np.ascontiguousarray(p[k])) for k in ARGS}
    d["block_table"] = d["index_block_table"] = to_device(bt)
    tokens, counts, groups = (x.copy_to_host() for x in numqsa.select(*[d[k] for k in SEL], Kb=KB))
    assert counts[0] == 0 and (tokens[0] == -1).all() and (groups[0] == -1).all()
    ref_s = oracle.index_scores(*[p[k] for k in SEL[:4]], pos, p["seq_lens"])
    assert_selection_matches(groups, tokens, counts, ref_s, p["req_ids"], pos, p["seq_lens"], Kb=KB)
    w = numqsa.QSAPrefillWrapper(Hi=2, Di=16, Hq=2, Hkv=1, D=32, Kb=KB)
    w.plan(d["req_ids"], d["positions"], d["seq_lens"], d["block_table"], validate=False)
    t2, c2, g2 = (x.copy_to_host() for x in w.run_select(d["qi"], d["index_cache"]))
    np.testing.assert_array_equal(c2, counts)
    np.testing.assert_array_equal(g2, groups)
    got = [x.copy_to_host() for x in w.run(d["qi"], d["index_cache"], d["q"], d["k_cache"],
                                           d["v_cache"], return_selection=True)]
    assert got[3][0] == 0 and (got[2][0] == -1).all()
    np.testing.assert_array_equal(got[2], tokens)
    check_prefill(p, got, pos)


def test_index_scores_row_needing_bad_page_is_minus_inf(seed):
    """The stage function on a device table: the row is inert (all -inf), the others as the oracle."""
    p = small(seed)
    ibt = p["index_block_table"].copy()
    ibt[0, 20] = -3
    pos, bad = inert_positions(p, ibt, None)
    d = [to_device(np.ascontiguousarray(p[k])) for k in SEL]
    d[2] = to_device(ibt)
    out = poison(cuda.device_array((4, 75), np.float32))
    numqsa.index_scores(*d, out=out)
    got = out.copy_to_host()
    assert np.isneginf(got[0]).all()
    assert_matches_oracle(got, oracle.index_scores(*[p[k] for k in SEL[:4]], pos, p["seq_lens"]),
                          dtype="float16", what="scores")


# -- point 3: one rule per edge ---------------------------------------------------------------
@pytest.mark.parametrize("where", ["host", "device"])
def test_topk_nan_rule_host_and_device(rng, where):
    """NaN (either sign, any payload) ranks above +inf, NaNs tie by lowest id; the stage function
    on host or device scores equals the oracle bitwise (it refused host NaN before)."""
    rows, G = 3, 40
    s = rng.standard_normal((rows, G)).astype(np.float32)
    s[:, ::7] = 0.0
    bits = s.view(np.uint32)
    bits[0, [3, 30]] = 0x7FC00000                 # quiet NaN
    bits[0, 11] = 0xFFC00001                      # negative NaN with a payload
    s[0, 5] = np.inf
    s[1, [2, 9]] = np.nan
    s[1, 33] = -np.inf
    req, pos, lens = (np.zeros(rows, np.int32), np.array([159, 100, 30], np.int32),
                      np.array([160], np.int32))
    want = oracle.topk_groups(s, req, pos, lens, Kb=KB)
    assert {3, 11, 30, 5} <= set(want[0]) and {2, 9} <= set(want[1])
    arg = s if where == "host" else to_device(s)
    got = numqsa.topk_groups(arg, req, pos, lens, Kb=KB)
    np.testing.assert_array_equal(got if where == "host" else got.copy_to_host(), want)


@pytest.mark.parametrize("wrong, match", [
    ("D", r"k_cache has shape \(\d+, 16, 1, 32\) \(Hkv = 1, D = 32\); expected \[num_pages, "
          r"page_size, Hkv = 1, D = 16\]"),
    ("Hq", r"q has shape \(4, 2, 32\) \(Hq = 2\); expected \[rows = 4, Hq = 4, D = 32\]"),
    ("Di", r"index_cache has shape \(\d+, 3, 16\) \(Di = 16\); expected \[num_idx_pages, "
           r"idx_page_rows, Di = 8\]"),
    ("Hi", r"qi has shape \(4, 2, 16\) \(Hi = 2\); expected \[rows = 4, Hi = 1, Di = 16\]"),
])
def test_geometry_errors_name_the_array_first(seed, wrong, match):
    p = small(seed)
    geo = dict(Hi=2, Di=16, Hq=2, Hkv=1, D=32, Kb=KB)
    geo[wrong] = {"D": 16, "Hq": 4, "Di": 8, "Hi": 1}[wrong]
    w = numqsa.QSAPrefillWrapper(**geo)
    w.plan(p["req_ids"], p["positions"], p["seq_lens"], p["block_table"], p["index_block_table"])
    with pytest.raises(numqsa.QSAInputError, match=match):
        w.run(p["qi"], p["index_cache"], p["q"], p["k_cache"], p["v_cache"])


# -- point 4: nothing after the selection grows with Kb past the visible groups --------------
def test_plan_pages_bound():
    assert P.plan_pages(512, 512, 64, 4) == 512
    assert P.plan_pages(20000, 512, 64, 4) == 8192          # the table's capacity
    assert P.plan_pages(20000, 512, 64, 4, max_groups=75) == 75
    assert P.plan_pages(8, 1, 16, 4, max_groups=0) == 1


def test_rows_beyond_the_plan_width_go_generic(seed):
    """A plan narrower than a row's selection (a caller's wrong ``max_groups``) leaves the row to
    the generic kernel: the page-4 route's answer is still the oracle's, never a truncated row."""
    from numqsa.stages.attention import attention_launch
    p = small(seed)
    tokens, counts, _ = oracle.select(*[p[k] for k in SEL], Kb=KB)
    assert (counts[:3] > 2 * 4).all()
    out, lse = attention_launch(p["q"], p["k_cache"], p["v_cache"], p["block_table"], tokens, counts,
                                p["req_ids"], p["seq_lens"], route_name="page4", max_groups=2)
    eo, el = oracle.sparse_attention(p["q"], p["k_cache"], p["v_cache"], p["block_table"], tokens,
                                     counts, p["req_ids"], p["seq_lens"])
    assert_matches_oracle(out, eo, dtype="float16", what="out")
    assert_matches_oracle(lse, el, dtype="float16", what="lse")


def test_kb_beyond_visible_groups(seed):
    """Kb = 20000 with 75 visible groups: the page plan holds 75 + 1 pages (not 20001), rows take
    every visible group, and the result is the oracle's (dense: the selection is 0..p)."""
    p = small(seed)
    p = {**p, "req_ids": p["req_ids"][:2], "positions": p["positions"][:2],
         "qi": p["qi"][:2], "q": p["q"][:2]}
    w = numqsa.QSAPrefillWrapper(Hi=2, Di=16, Hq=2, Hkv=1, D=32, Kb=20000)
    w.plan(p["req_ids"], p["positions"], p["seq_lens"], p["block_table"], p["index_block_table"])
    out, lse, tokens, counts = w.run(p["qi"], p["index_cache"], p["q"], p["k_cache"], p["v_cache"],
                                     return_selection=True)
    assert w._ws.kept("page4.pages").shape == (2, 76, 2)
    np.testing.assert_array_equal(counts, p["positions"] + 1)
    eo, el = oracle.qsa_prefill(*[p[k] for k in ARGS], Kb=20000)[:2]
    assert_matches_oracle(out, eo, dtype="float16", what="out")
    assert_matches_oracle(lse, el, dtype="float16", what="lse")


# -- the same at real shapes on the GPU (with compute-sanitizer: bench/sanitize_cases.py) ---------
def real(seed, rows=256, ctx=32768):
    return make_problem([ctx, 5000], positions=np.r_[np.arange(ctx - rows + 2, ctx), [4999, 3000]],
                        req_ids=np.r_[np.zeros(rows - 2), [1, 1]].astype(np.int32), page_size=64,
                        dtype=np.float16, seed=seed, shared_index_table=False)


@pytest.mark.gpu
@pytest.mark.parametrize("table, value, validate", [("index_block_table", 10**6, None),
                                                    ("block_table", -3, False),
                                                    ("block_table", 10**6, None)])
def test_gpu_prefill_bad_page_inert(seed, table, value, validate):
    """Real geometry (Hi 4 / Di 128, Hq 6 / D 256, Kb 512, page 64): the bad column holds token
    ``ctx - 128``, so the later half of request 0's rows is inert and the rest is checked."""
    p = real(seed)
    bad_tab = p[table].copy()
    t = 32768 - 128
    col = t // 64 if table == "block_table" else (t // 4) // p["index_cache"].shape[1]
    bad_tab[0, col] = value
    pos, bad = inert_positions(p, *((bad_tab, None) if table == "index_block_table"
                                    else (None, bad_tab)))
    assert 0 < bad.sum() < bad.size - 2
    d = {k: to_device(np.ascontiguousarray(p[k])) for k in ARGS}
    d[table] = to_device(bad_tab)
    got = [x.copy_to_host() for x in numqsa.qsa_prefill(*[d[k] for k in ARGS], Kb=512,
                                                        validate=validate)]
    assert (got[3][bad] == 0).all() and (got[2][bad] == -1).all()
    assert not got[0][bad].any() and np.isneginf(got[1][bad]).all()
    check_prefill(p, got, pos, kb=512)


@pytest.mark.gpu
def test_gpu_kb_beyond_visible_groups(seed):
    p = real(seed, rows=64, ctx=8192)
    d = {k: to_device(np.ascontiguousarray(p[k])) for k in ARGS}
    w = numqsa.QSAPrefillWrapper(Kb=20000)
    w.plan(p["req_ids"], p["positions"], p["seq_lens"], p["block_table"], p["index_block_table"])
    out, lse, tokens, counts = (x.copy_to_host() for x in w.run(
        d["qi"], d["index_cache"], d["q"], d["k_cache"], d["v_cache"], return_selection=True))
    if numqsa.stages.attention.route(64, 64).route == "page4":   # sm_70 takes the generic kernel here
        assert w._ws.kept("page4.pages").shape[1] == 8192 // 4 + 1
    np.testing.assert_array_equal(counts, np.minimum(p["positions"], 8191) + 1)
    eo, el = oracle.sparse_attention(p["q"], p["k_cache"], p["v_cache"], p["block_table"], tokens,
                                     counts, p["req_ids"], p["seq_lens"])
    assert_matches_oracle(out, eo, dtype="float16", what="out")
    assert_matches_oracle(lse, el, dtype="float16", what="lse")
