"""Selection kernels (index keys/queries, index scores on both routes, top-k, expansion, select)
against the float64 oracle.

Simulator cases are tiny (Hi 2, Di 16-32, a few rows); ``@pytest.mark.gpu`` cases run the real shapes
on a GPU (the lead runs them on an H200, also with ``NUMQSA_ARCH=sm_70`` for the m8n8k4 path).
"""

import ml_dtypes
import numpy as np
import pytest

import oracle
from oracle.problems import make_problem
import numqsa
from numqsa.stages import selection as sel
from numqsa.testing import (assert_matches_oracle, assert_selection_matches,
                            index_scores_accumulating_in, poison)

BF16 = np.dtype(ml_dtypes.bfloat16)


SMALL = dict(Hi=2, Di=16, D=8)
ROT = 8


def _batch(P):
    return [P[k] for k in ("qi", "index_cache", "index_block_table", "req_ids", "positions",
                           "seq_lens")]


def _scores_expect(P, G=None):
    return oracle.index_scores(*_batch(P), num_groups=G)


def _with_odd_rows(P, rng):
    """Append a stale row (position past seq_len), an inert row (bad request) and a padding row."""
    nreq = P["seq_lens"].shape[0]
    P["req_ids"] = np.concatenate([P["req_ids"], np.array([0, nreq + 3, 0], np.int32)])
    P["positions"] = np.concatenate([P["positions"],
                                     np.array([P["seq_lens"][0] + 5, 2, -1], np.int32)])
    extra = rng.standard_normal((3,) + P["qi"].shape[1:]).astype(P["qi"].dtype)
    P["qi"] = np.concatenate([P["qi"], extra])
    return P


# ------------------------------------------------------------------------------------------------
# Pre-indexer
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float16, np.float32, BF16], ids=["float16", "float32", "bfloat16"])
@pytest.mark.parametrize("emulate", [False, True])
def test_index_keys(rng, dtype, emulate):
    G, r, di = 5, 4, 32
    lens = np.array([64, 41], np.int32)
    P = make_problem(lens, [1, 1], page_size=16, Di=di, Hi=2, D=8, dtype=dtype,
                     shared_index_table=False, seed=int(rng.integers(1 << 31)))
    k_raw = rng.standard_normal((G, r, di)).astype(dtype)
    w = (0.1 * rng.standard_normal(di)).astype(dtype)
    reqs = np.array([0, 0, 1, 0, 1], np.int32)
    eids = np.array([0, 15, 9, 7, 1], np.int32)
    ic_kernel, ic_oracle = P["index_cache"].copy(), P["index_cache"].copy()
    half = BF16 if dtype == BF16 else np.float16          # the reference's rounding of the mean
    em = half if emulate else None
    kc = sel.index_keys(k_raw, w, reqs, eids, ic_kernel, P["index_block_table"], rot=16,
                        emulate_dtype=em)
    want = oracle.index_keys(k_raw, w, reqs, eids, ic_oracle, P["index_block_table"], rot=16,
                             emulate_dtype=em)
    assert ic_kernel.dtype == dtype
    # Emulated rounding puts the pooled mean on the 16-bit grid: a float32 and a float64 mean on
    # either side of a rounding boundary then differ by one ulp of it, so that type's tolerance.
    assert_matches_oracle(kc, want, dtype="float32" if not emulate else np.dtype(half).name,
                          what="kc")
    # the cache holds kc in the cache's dtype: with emulated rounding, kc's 16-bit grid (a float32
    # cache would otherwise be held to float32's tolerance across that one-ulp boundary)
    assert_matches_oracle(ic_kernel, ic_oracle, dtype=np.dtype(half if emulate else dtype).name,
                          what="index_cache")
    bits = f"u{np.dtype(dtype).itemsize}"
    slots = (P["index_block_table"][reqs, eids // ic_kernel.shape[1]], eids % ic_kernel.shape[1])
    if dtype == BF16:       # the kernel's own float32 key, rounded once on storage
        np.testing.assert_array_equal(ic_kernel[slots].view(bits), kc.astype(dtype).view(bits))
    untouched = np.ones(ic_kernel.shape[:2], bool)
    untouched[slots] = False
    np.testing.assert_array_equal(ic_kernel[untouched].view(bits),
                                  P["index_cache"][untouched].view(bits))


def test_index_keys_rope_positions_and_strided_cache(rng):
    """The TensorRT-LLM layout: one cache row per token, the key at the group's last slot."""
    G, r, di, ps = 3, 4, 16, 16
    token_cache = rng.standard_normal((4, ps, di)).astype(np.float16)
    view_k, view_o = token_cache.copy()[:, r - 1::r], token_cache.copy()[:, r - 1::r]
    table = np.array([[2, 0, 3]], np.int32)
    k_raw = rng.standard_normal((G, r, di)).astype(np.float16)
    w = np.zeros(di, np.float16)
    reqs, eids = np.zeros(G, np.int32), np.array([0, 5, 9], np.int32)
    rp = np.array([1000003, 7, 123456], np.int32)
    kc = sel.index_keys(k_raw, w, reqs, eids, view_k, table, rot=ROT, rope_positions=rp)
    want = oracle.index_keys(k_raw, w, reqs, eids, view_o, table, rot=ROT, rope_positions=rp)
    assert_matches_oracle(kc, want, dtype="float32", what="kc")
    # the float32 tolerance tells a float16 step on the way (the pooled mean in float16) apart
    halfway = oracle.index_keys(k_raw, w, reqs, eids, view_o.copy(), table, rot=ROT,
                                rope_positions=rp, emulate_dtype=np.float16)
    with pytest.raises(AssertionError):
        assert_matches_oracle(halfway, want, dtype="float32", what="kc with a float16 mean")
    # The kernel stores its own float32 keys rounded once to float16; the oracle's float64 keys can
    # round to the neighbouring float16 where the two sit on either side of a rounding boundary.
    slots = (table[0, eids // view_k.shape[1]], eids % view_k.shape[1])
    np.testing.assert_array_equal(view_k[slots], kc.astype(np.float16))
    assert_matches_oracle(view_k, view_o, dtype="float16", what="stored keys")
    others = np.ones(view_k.shape[:2], bool)
    others[slots] = False
    np.testing.assert_array_equal(view_k[others], view_o[others])   # nothing else written


@pytest.mark.parametrize("dtype", [np.float16, np.float32, BF16], ids=["float16", "float32", "bfloat16"])
def test_index_queries(rng, dtype):
    lens = np.array([9, 0, 30], np.int32)
    req = np.array([0, 0, 2, 1, 5, 2, 0], np.int32)
    pos = np.array([8, 20, 29, 0, 1, -2, 0], np.int32)     # stale, inert x3
    q_raw = rng.standard_normal((7, 2, 32)).astype(dtype)
    w = (0.1 * rng.standard_normal(32)).astype(dtype)
    out = poison(np.empty((7, 2, 32), dtype))
    got = sel.index_queries(q_raw, w, req, pos, lens, rot=16, out=out)
    assert got is out and got.dtype == dtype
    want = oracle.index_queries(q_raw, w, req, pos, lens, rot=16)
    assert_matches_oracle(got, want, dtype=np.dtype(dtype).name, what="qi")
    assert not got[[3, 4, 5]].astype(np.float32).any(), "inert rows must be exactly 0"
    rp = np.array([5, 1 << 20, 3, 0, 0, 0, 9], np.int32)
    got = sel.index_queries(q_raw, w, req, pos, lens, rot=16, rope_positions=rp)
    want = oracle.index_queries(q_raw, w, req, pos, lens, rot=16, rope_positions=rp)
    assert_matches_oracle(got, want, dtype=np.dtype(dtype).name, what="qi (rope_positions)")


# ------------------------------------------------------------------------------------------------
# Index scores
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("page_size,shared", [(16, True), (64, False), (784, True)])
def test_index_scores_light(rng, dtype, page_size, shared):
    lens = np.array([57, 9, 0, 22], np.int32)
    P = make_problem(lens, [4, 2, 1, 1], page_size=page_size, dtype=dtype, shared_index_table=shared,
                     seed=int(rng.integers(1 << 31)), **SMALL)
    P = _with_odd_rows(P, rng)
    G = 57 // 4
    out = poison(np.empty((P["qi"].shape[0], G), np.float32))
    got = sel.index_scores(*_batch(P), out=out)
    assert_matches_oracle(got, _scores_expect(P), dtype="float32", what="scores")


def test_index_scores_tell_float16_accumulation(rng):
    """Scores are float32 sums of exact inputs, checked at float32: the same dot products and head
    sums accumulated in float16 fail that tolerance."""
    P = make_problem([57, 22], [3, 2], page_size=16, dtype=np.float16, Hi=2, Di=32, D=8,
                     seed=int(rng.integers(1 << 31)))
    want = _scores_expect(P)
    assert_matches_oracle(sel.index_scores(*_batch(P)), want, dtype="float32", what="scores")
    with pytest.raises(AssertionError):
        assert_matches_oracle(index_scores_accumulating_in(np.float16, *_batch(P)), want,
                              dtype="float32", what="scores accumulated in float16")


@pytest.mark.parametrize("num_groups", [0, 3])
def test_index_scores_num_groups(rng, num_groups):
    P = make_problem([30], [3], page_size=16, dtype=np.float32, seed=int(rng.integers(1 << 31)),
                     **SMALL)
    got = sel.index_scores(*_batch(P), num_groups=num_groups)
    assert got.shape == (3, num_groups)
    assert_matches_oracle(got, _scores_expect(P, num_groups), dtype="float32", what="scores")


@pytest.mark.parametrize("rows", [0, 1, 3, 5])
def test_index_scores_rows(rng, rows):
    P = make_problem([41], [max(rows, 1)], page_size=16, dtype=np.float16,
                     seed=int(rng.integers(1 << 31)), **SMALL)
    if rows == 0:
        for k in ("req_ids", "positions"):
            P[k] = P[k][:0]
        P["qi"] = P["qi"][:0]
    got = sel.index_scores(*_batch(P))
    assert got.shape == (rows, 10)
    assert_matches_oracle(got, _scores_expect(P), dtype="float32", what="scores")


@pytest.mark.parametrize("arch,hi,strided", [("sm_90", 4, False), ("sm_70", 4, False),
                                             ("sm_90", 8, False), ("sm_70", 2, False),
                                             ("sm_90", 2, True)])
def test_index_scores_tiled(rng, monkeypatch, arch, hi, strided):
    """The tensor-core route through the mma stand-in: keys-as-M m16n8k16 for sm_90 with Hi <= 4
    (uint32 word loads; float16 loads for a strided cache in the simulator), per-warp-M m16n8k16
    for Hi 8, m8n8k4 for sm_70."""
    from numba import cuda
    from numqsa.kernels import index_scores as K
    from numqsa.plan import arch_profile
    monkeypatch.setenv("NUMQSA_ARCH", arch)
    lens = np.array([75, 13, 40], np.int32)
    P = make_problem(lens, [5, 2, 1], page_size=64, Hi=hi, Di=32, D=8, dtype=np.float16,
                     shared_index_table=False, seed=int(rng.integers(1 << 31)))
    P = _with_odd_rows(P, rng)
    G = 75 // 4
    d = [cuda.to_device(np.ascontiguousarray(a)) for a in _batch(P)]
    if strided:     # the cache as a view into a wider buffer: last axis contiguous, rows strided
        ic = P["index_cache"]
        wide = np.zeros(ic.shape[:2] + (2 * ic.shape[2],), ic.dtype)
        wide[:, :, :ic.shape[2]] = ic
        d[1] = cuda.to_device(wide)[:, :, :ic.shape[2]]
    sc = poison(cuda.device_array((P["qi"].shape[0], G), np.float32))
    prof = arch_profile((9, 0))
    K.launch_tiled(*d, sc, prof, 0)
    assert_matches_oracle(sc.copy_to_host(), _scores_expect(P), dtype="float32",
                          what=f"tiled {prof.scores.mma} scores")


@pytest.mark.parametrize("dtype,strided", [(np.float16, False), (np.float16, True), (BF16, False)],
                         ids=["float16", "float16-strided", "bfloat16"])
def test_index_scores_direct(rng, monkeypatch, dtype, strided):
    """The few-row keys-as-M kernel (registers straight from global memory, no block barrier)
    against the oracle, forced onto 12 rows of three requests (two 8-row tiles: one with three
    passes, inert, stale and padding rows, a row whose warp has no visible key) and bitwise equal
    to the shared-memory keys-as-M kernel on the same rows: a row's scores do not depend on which
    kernel its batch's size picks."""
    from numba import cuda
    from numqsa.kernels import index_scores as K
    from numqsa.testing import to_device
    from numqsa.plan import arch_profile
    monkeypatch.setenv("NUMQSA_ARCH", "sm_90")
    lens = np.array([290, 13, 40], np.int32)
    P = make_problem(lens, [5, 2, 1], page_size=64, Hi=4, Di=32, D=8, dtype=dtype,
                     shared_index_table=False, seed=int(rng.integers(1 << 31)))
    P = _with_odd_rows(P, rng)
    P["req_ids"] = np.append(P["req_ids"], np.int32(0))     # a row that sees 2 groups only
    P["positions"] = np.append(P["positions"], np.int32(9))
    P["qi"] = np.concatenate([P["qi"], P["qi"][:1]])
    G = 290 // 4
    d = [to_device(np.ascontiguousarray(a)) for a in _batch(P)]
    if strided:     # float16 element loads instead of uint32 words
        ic = P["index_cache"]
        wide = np.zeros(ic.shape[:2] + (2 * ic.shape[2],), ic.dtype)
        wide[:, :, :ic.shape[2]] = ic
        d[1] = to_device(wide)[:, :, :ic.shape[2]]
    prof = arch_profile((9, 0))
    got = {}
    for direct in (True, False):
        sc = poison(cuda.device_array((P["qi"].shape[0], G), np.float32))
        K.launch_keysm(*d, sc, prof, 0, direct=direct)
        got[direct] = sc.copy_to_host()
    assert_matches_oracle(got[True], _scores_expect(P), dtype="float32", what="direct scores")
    np.testing.assert_array_equal(got[True].view(np.uint32), got[False].view(np.uint32))


# ------------------------------------------------------------------------------------------------
# Top-k and expansion
# ------------------------------------------------------------------------------------------------

def _topk_case(rng, kind, rows=6, G=70):
    lens = np.array([4 * G + 2, 37], np.int32)
    req = np.array([0, 0, 0, 1, 0, 0, 7, 0][:rows + 2], np.int32)[:rows]
    pos = np.array([4 * G + 1, 4 * G - 3, 120, 36, 9, -1][:rows], np.int32)
    if kind == "random":
        s = rng.standard_normal((rows, G)).astype(np.float32)
    elif kind == "zeros":
        s = np.zeros((rows, G), np.float32)
    elif kind == "plateau":      # ReLU output: many exact zeros, a few positive values, some ties
        s = np.maximum(rng.standard_normal((rows, G)), 0).astype(np.float32)
        s[:, ::9] = 0.5
    elif kind == "signed_zero":
        s = np.where(rng.random((rows, G)) < 0.5, np.float32(-0.0), np.float32(0.0))
        s[:, 3::11] = np.float32(2.0)
    elif kind == "sparse":       # fewer positives than some Kb: the threshold is the zero plateau
        s = np.zeros((rows, G), np.float32)
        s[:, ::13] = 0.5 + rng.random((rows, len(range(0, G, 13))))
    elif kind == "clustered":    # one top-12-bit bin: the bitmap kernel resolves lower digits
        s = (1.0 + 1e-3 * rng.random((rows, G))).astype(np.float32)
        s[:, ::7] = 1.0
    else:                        # large magnitudes of both signs, -inf past nb
        s = (rng.standard_normal((rows, G)) * 1e30).astype(np.float32)
        s[:, G // 2:] = -np.inf
    return s, req, pos, lens


@pytest.mark.parametrize("kind", ["random", "clustered", "plateau", "sparse", "zeros", "signed_zero",
                                  "wide"])
@pytest.mark.parametrize("route", ["registers", "bitmap", "radix"])
def test_topk_kernels(rng, kind, route):
    """Every top-k kernel on device arrays (bitmap: candidate path and global fallback; registers:
    thresholds near the row's best and 16 octaves or more below it; -0.0 ties +0.0)."""
    from numba import cuda
    from numqsa.kernels import topk as KT
    from numqsa.plan import arch_profile
    # the simulator's register kernel takes rows of up to 64 groups, its bitmap kernel 128
    G = {"registers": 61, "bitmap": 120, "radix": 70}[route]
    s, req, pos, lens = _topk_case(rng, kind, G=G)
    for kb in (5, 17):
        out = poison(cuda.device_array((s.shape[0], kb), np.int32))
        d = [cuda.to_device(x) for x in (s.view(np.uint32), req, pos, lens)]
        KT.launch_topk(*d, out, arch_profile((9, 0)), 0, route=route)
        want = oracle.topk_groups(s.astype(np.float64), req, pos, lens, Kb=kb)
        np.testing.assert_array_equal(out.copy_to_host(), want, err_msg=f"Kb={kb}")


@pytest.mark.parametrize("kind", ["random", "zeros", "plateau", "signed_zero", "wide"])
def test_topk_exact(rng, kind):
    s, req, pos, lens = _topk_case(rng, kind)
    kb = 9
    out = poison(np.empty((s.shape[0], kb), np.int32))
    got = sel.topk_groups(s, req, pos, lens, Kb=kb, out=out)
    want = oracle.topk_groups(s.astype(np.float64), req, pos, lens, Kb=kb)
    np.testing.assert_array_equal(got, want)


def test_topk_kb_edges(rng):
    s, req, pos, lens = _topk_case(rng, "plateau", rows=4, G=40)
    for kb in (1, 39, 40, 41, 64):
        got = sel.topk_groups(s, req, pos, lens, Kb=kb)
        want = oracle.topk_groups(s.astype(np.float64), req, pos, lens, Kb=kb)
        np.testing.assert_array_equal(got, want, err_msg=f"Kb={kb}")


def test_expand_worked_example():
    """Spec §9."""
    groups = np.array([[1, 0], [0, -1]], np.int32)
    groups[0] = np.sort(groups[0])
    tokens, counts = sel.expand_tokens(groups, np.array([0, 1], np.int32),
                                       np.array([9, 5], np.int32), np.array([10, 6], np.int32))
    np.testing.assert_array_equal(tokens, [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, -1],
                                           [0, 1, 2, 3, 4, 5, -1, -1, -1, -1, -1]])
    np.testing.assert_array_equal(counts, [10, 6])


def test_expand_matches_oracle(rng):
    s, req, pos, lens = _topk_case(rng, "random")
    groups = oracle.topk_groups(s.astype(np.float64), req, pos, lens, Kb=7)
    out = (poison(np.empty((6, 31), np.int32)), poison(np.empty(6, np.int32)))
    tokens, counts = sel.expand_tokens(groups, req, pos, lens, out=out)
    want_t, want_c = oracle.expand_tokens(groups, req, pos, lens)
    np.testing.assert_array_equal(tokens, want_t)
    np.testing.assert_array_equal(counts, want_c)


def test_expand_rejects_unsorted_groups():
    with pytest.raises(oracle.QSAInputError):
        sel.expand_tokens(np.array([[3, 1]], np.int32), np.array([0], np.int32),
                          np.array([40], np.int32), np.array([41], np.int32))


# ------------------------------------------------------------------------------------------------
# Fused select
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ctx", [2050, 2051, 2052])
def test_select_dense_boundary(rng, ctx):
    """At p <= Kb*r + r - 2 = 2050 the selection is every token 0..p (Kb 512, r 4)."""
    P = make_problem([ctx], [2], page_size=64, dtype=np.float16, seed=int(rng.integers(1 << 31)),
                     **SMALL)
    tokens, counts, groups = numqsa.select(*_batch(P), Kb=512)
    assert_selection_matches(groups, tokens, counts, _scores_expect(P), P["req_ids"],
                             P["positions"], P["seq_lens"], Kb=512)
    for i, p in enumerate(P["positions"]):
        if p <= 2050:
            np.testing.assert_array_equal(tokens[i, :p + 1], np.arange(p + 1))


@pytest.mark.parametrize("page_size,shared", [(16, False), (64, True), (784, True)])
def test_select_vs_oracle(rng, page_size, shared):
    lens = np.array([203, 0, 46, 130], np.int32)
    P = make_problem(lens, [3, 1, 2, 2], page_size=page_size, dtype=np.float16,
                     shared_index_table=shared, seed=int(rng.integers(1 << 31)), **SMALL)
    P = _with_odd_rows(P, rng)
    kb = 6
    rows = P["qi"].shape[0]
    out = (poison(np.empty((rows, kb * 4 + 3), np.int32)), poison(np.empty(rows, np.int32)),
           poison(np.empty((rows, kb), np.int32)))
    tokens, counts, groups = numqsa.select(*_batch(P), Kb=kb, out=out)
    assert_selection_matches(groups, tokens, counts, _scores_expect(P), P["req_ids"],
                             P["positions"], P["seq_lens"], Kb=kb)
    # the kernel's own scores through the oracle's top-k give exactly the kernel's groups
    own = sel.index_scores(*_batch(P))
    np.testing.assert_array_equal(groups, oracle.topk_groups(own.astype(np.float64), P["req_ids"],
                                                             P["positions"], P["seq_lens"], Kb=kb))


def test_select_chunked_equals_whole(rng):
    P = make_problem([150, 77], [3, 2], page_size=16, dtype=np.float16,
                     seed=int(rng.integers(1 << 31)), **SMALL)
    whole = numqsa.select(*_batch(P), Kb=5)
    G = 150 // 4
    chunked = numqsa.select(*_batch(P), Kb=5, score_bytes=2 * 4 * G)    # two rows per chunk
    for a, b in zip(whole, chunked):
        np.testing.assert_array_equal(a, b)


def test_select_ties_zero_scores(rng):
    """All keys zero: every score is exactly 0 and the lowest group ids must win."""
    P = make_problem([120], [2], page_size=16, dtype=np.float16, seed=int(rng.integers(1 << 31)),
                     **SMALL)
    P["index_cache"][...] = 0
    tokens, counts, groups = numqsa.select(*_batch(P), Kb=4)
    nb = (P["positions"] + 1) // 4
    for i in range(2):
        np.testing.assert_array_equal(groups[i], np.arange(4))
        tail = np.arange(4 * nb[i], P["positions"][i] + 1)
        np.testing.assert_array_equal(tokens[i, :counts[i]],
                                      np.concatenate([np.arange(16), tail]))


def test_select_rejects_bad_page():
    P = make_problem([40], [1], page_size=16, dtype=np.float16, seed=1, **SMALL)
    P["index_block_table"] = P["index_block_table"].copy()
    P["index_block_table"][0, 0] = P["index_cache"].shape[0]
    with pytest.raises(oracle.QSAInputError, match=r"index_block_table\[0, 0\]"):
        numqsa.select(*_batch(P), Kb=4)


def test_select_chunk_rows():
    assert sel.select_chunk_rows(16384, 262144) == 1024
    assert sel.select_chunk_rows(8192, 32768) == 8192
    assert sel.select_chunk_rows(3, 0) == 3


# ------------------------------------------------------------------------------------------------
# GPU tier: real shapes (skipped in the simulator)
# ------------------------------------------------------------------------------------------------

GPU_CASES = [(1024, 32768), (8192, 32768), (1024, 131072), (8192, 131072)]


@pytest.mark.gpu
@pytest.mark.parametrize("rows,ctx", GPU_CASES)
def test_gpu_select_real_shapes(rows, ctx, seed):
    from numba import cuda
    P = make_problem([ctx], [rows], page_size=64, dtype=np.float16, seed=seed)
    d = [cuda.to_device(np.ascontiguousarray(a)) for a in _batch(P)]
    tokens, counts, groups = numqsa.select(*d, Kb=512)
    ref = _scores_expect(P)
    assert_selection_matches(groups.copy_to_host(), tokens.copy_to_host(), counts.copy_to_host(),
                             ref, P["req_ids"], P["positions"], P["seq_lens"], Kb=512)
    scores = sel.index_scores(*d)             # device seq_lens: the table's capacity wide
    assert_matches_oracle(scores.copy_to_host()[:, :ref.shape[1]], ref, dtype="float32",
                          what="scores")
    first = [x.copy_to_host() for x in (tokens, counts, groups)]
    for _ in range(20):
        again = [x.copy_to_host() for x in numqsa.select(*d, Kb=512)]
        for a, b in zip(first, again):
            assert np.array_equal(a, b), "select is not bitwise deterministic"


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["tiled", "light"])
def test_gpu_scores_routes_agree(route, seed, monkeypatch):
    """Both score routes against the oracle at 2048 rows x 32K (the tiled route is admitted)."""
    from numba import cuda
    if route == "light":
        monkeypatch.setenv("NUMQSA_INDEXER_TILED", "0")
    P = make_problem([32768], [2048], page_size=64, dtype=np.float16, seed=seed)
    d = [cuda.to_device(np.ascontiguousarray(a)) for a in _batch(P)]
    want = _scores_expect(P)
    got = sel.index_scores(*d).copy_to_host()[:, :want.shape[1]]   # capacity wide (device seq_lens)
    assert_matches_oracle(got, want, dtype="float32", what=f"{route} scores")


@pytest.mark.gpu
def test_gpu_scores_batch_invariance(seed):
    """A row's scores are bitwise the same in batches of 1 to 2,048 rows (the direct and the
    shared-memory keys-as-M kernels, one and several row tiles), at 32K and 131K tokens."""
    from numba import cuda
    from numqsa.kernels import index_scores as K
    for ctx in (32768, 131072):
        P = make_problem([ctx], [2048], page_size=64, dtype=np.float16, seed=seed)
        d = [cuda.to_device(np.ascontiguousarray(a)) for a in _batch(P)]
        G = ctx // 4
        full = sel.index_scores(*d, num_groups=G).copy_to_host()
        assert not K.direct_route(2048, G)
        for a, n in ((2047, 1), (0, 5), (1000, 8), (7, 9), (1900, 33), (64, 64), (5, 700)):
            qi, req, pos = (x[a:a + n] for x in (d[0], d[3], d[4]))
            got = sel.index_scores(qi, d[1], d[2], req, pos, d[5], num_groups=G).copy_to_host()
            np.testing.assert_array_equal(got.view(np.uint32), full[a:a + n].view(np.uint32),
                                          err_msg=f"rows {a}..{a + n - 1} at {ctx}")


@pytest.mark.gpu
def test_gpu_topk_one_million_tokens(seed):
    """262,144 groups per row, zero plateaus included; exact against the oracle on the same scores."""
    from numba import cuda
    rng = np.random.default_rng(seed)
    rows, G = 16, 262144
    s = np.maximum(rng.standard_normal((rows, G)), 0).astype(np.float32)
    s[::2, : G // 2] = 0
    lens = np.array([4 * G], np.int32)
    req = np.zeros(rows, np.int32)
    pos = np.full(rows, 4 * G - 1, np.int32)
    got = sel.topk_groups(cuda.to_device(s), cuda.to_device(req), cuda.to_device(pos),
                          cuda.to_device(lens), Kb=512).copy_to_host()
    np.testing.assert_array_equal(got, oracle.topk_groups(s.astype(np.float64), req, pos, lens))


def _real_scores(rng, dist, rows, G):
    """The bench's score distributions at a real row length (``bench/workloads.py``)."""
    if dist == "relu":
        return (np.maximum(rng.standard_normal((4, rows, G)), 0).sum(0) / np.sqrt(128)).astype(
            np.float32)
    if dist == "concentrated":
        s = 1e-3 * rng.random((rows, G))
        return (s + (rng.random((rows, G)) < 32 / G) * (1 + rng.random((rows, G)))).astype(np.float32)
    if dist == "plateau":
        return np.maximum(rng.standard_normal((rows, G)) - 2.5, 0).astype(np.float32)
    if dist == "fewvalues":
        return (np.floor(rng.random((rows, G)) * 8) / 8).astype(np.float32)
    return (rng.standard_normal((rows, G)) * 1e30).astype(np.float32)     # both signs, wide


@pytest.mark.gpu
@pytest.mark.parametrize("dist", ["relu", "concentrated", "plateau", "fewvalues", "wide"])
@pytest.mark.parametrize("route", ["registers", "bitmap", "radix"])
def test_gpu_topk_routes_exact(dist, route, seed):
    """Every top-k kernel exact against the oracle on 8,192-group rows (32K tokens) of each score
    distribution of the bench, rows seeing 513 .. 8,192 groups, on three reruns."""
    from numba import cuda
    from numqsa.kernels import topk as KT
    from numqsa.plan import arch_profile
    rng = np.random.default_rng(seed)
    rows, G = 96, 8192
    s = _real_scores(rng, dist, rows, G)
    lens = np.array([4 * G], np.int32)
    req = np.zeros(rows, np.int32)
    pos = np.linspace(4 * 513, 4 * G - 1, rows).astype(np.int32)
    d = [cuda.to_device(x) for x in (s.view(np.uint32), req, pos, lens)]
    want = oracle.topk_groups(s.astype(np.float64), req, pos, lens, Kb=512)
    for rerun in range(3):
        out = poison(cuda.device_array((rows, 512), np.int32))
        KT.launch_topk(*d, out, arch_profile((9, 0)), 0, route=route)
        np.testing.assert_array_equal(out.copy_to_host(), want, err_msg=f"{route} {dist} #{rerun}")
