"""Every kernel at every head geometry a user runs (issue 12, point 1).

The production shapes are the per-rank slices of Qwen3.8-Flash-Next: Hq/Hkv 24/2 (tensor parallel 1),
12/1 (TP 2), 6/1 (TP 4), 3/1 (TP 8), all at D 256, and the indexer's Hi 4 / Di 128. Shared-memory
tiles change with the heads per KV head (the generic attention kernel stages 16 tokens up to 10
heads per KV head at D 256 and 8 beyond), so a geometry no test runs is a tile size no test runs.

Simulator tier: those geometries with few rows and short contexts (a tile or two of tokens), plus
small ones, float16, bfloat16 and float32, NaN-poisoned outputs, odd and boundary sizes (tails 0-3, page size
784, inert and stale rows). GPU tier (``-m gpu``): the same geometries on real sizes, the oracle on
sampled rows. Every comparison goes through :mod:`numqsa.testing`.
"""
import numpy as np
import pytest
from numba import cuda

import numqsa
import oracle
from numqsa.stages import selection as sel
from numqsa.kernels import attention as k_attention
from numqsa.kernels import index_scores as k_scores
from numqsa.kernels import topk as k_topk
from numqsa.plan import arch_profile
from numqsa.testing import assert_matches_oracle, assert_selection_matches, poison, to_device
from oracle.problems import make_problem

try:
    import ml_dtypes
    DTYPES = [np.float16, np.dtype(ml_dtypes.bfloat16), np.float32]
except ImportError:
    DTYPES = [np.float16, np.float32]
FLOATS = [pytest.param(dt, id=np.dtype(dt).name) for dt in DTYPES]

R = 4
# (Hq, Hkv, D): the four production slices, then small shapes (one head; odd head dims).
PRODUCTION = [(3, 1, 256), (6, 1, 256), (12, 1, 256), (24, 2, 256)]
SMALL = [(1, 1, 8), (2, 1, 24), (4, 2, 40)]
GEOMETRIES = PRODUCTION + SMALL
# Attention routes the GPU tier runs at every geometry; a new route is covered by listing its name.
ATTENTION_ROUTES = ("generic", "page4")


def _odd_rows(seq_lens):
    """Rows over requests of ``seq_lens``: the last four positions of request 0 (every tail length
    0-3), the last of the others, a stale row, an inert row (bad request) and a padding row."""
    req = [0, 0, 0, 0] + list(range(1, len(seq_lens))) + [0, len(seq_lens) + 2, 0]
    pos = [seq_lens[0] - k for k in (1, 2, 3, 4)] + [n - 1 for n in seq_lens[1:]]
    pos += [seq_lens[0] + 9, 3, -1]
    return np.array(req, np.int32), np.array(pos, np.int32)


def _groups(rng, req_ids, positions, seq_lens, kb):
    """Random ``min(kb, nb)`` visible groups per row, ascending, -1 padded (as top-k writes them)."""
    live, _, _, nb = oracle.row_states(req_ids, positions, seq_lens, R)
    g = np.full((len(req_ids), kb), -1, np.int32)
    for i in np.flatnonzero(live):
        k = min(kb, int(nb[i]))
        g[i, :k] = np.sort(rng.choice(int(nb[i]), size=k, replace=False))
    return g


def _attention_case(rng, hq, hkv, d, dtype, page_size=16, seq_lens=(27, 10), kb=5):
    req, pos = _odd_rows(list(seq_lens))
    p = make_problem(list(seq_lens), positions=pos, req_ids=req, page_size=page_size, Hq=hq,
                     Hkv=hkv, D=d, Hi=1, Di=8, dtype=dtype, seed=int(rng.integers(1 << 31)))
    groups = _groups(rng, req, pos, p["seq_lens"], kb)
    tokens, counts = oracle.expand_tokens(groups, req, pos, p["seq_lens"], r=R)
    return p, tokens, counts


def _run_generic(p, tokens, counts, out_dtype):
    """The generic kernel alone, on device arrays, into NaN-poisoned outputs."""
    rows, hq, d = p["q"].shape
    dv = [to_device(np.ascontiguousarray(p[k])) for k in ("q", "k_cache", "v_cache",
                                                                 "block_table")]
    out = poison(cuda.device_array((rows, hq, d), out_dtype))
    lse = poison(cuda.device_array((rows, hq), np.float32))
    k_attention.launch_attention(*dv, to_device(tokens), to_device(counts),
                                 to_device(p["req_ids"]), to_device(p["seq_lens"]),
                                 1.0 / np.sqrt(d), out, lse, arch_profile((9, 0)), 0)
    return out.copy_to_host(), lse.copy_to_host()


def _check_attention(p, tokens, counts, out, lse, dtype):
    eo, el = oracle.sparse_attention(p["q"], p["k_cache"], p["v_cache"], p["block_table"], tokens,
                                     counts, p["req_ids"], p["seq_lens"])
    assert_matches_oracle(out, eo, dtype=dtype, what="out")
    assert_matches_oracle(lse, el, dtype="float32", what="lse")


# ------------------------------------------------------------------------------------------------
# generic attention
# ------------------------------------------------------------------------------------------------

def _generic_cases():
    """Every geometry x dtype; bfloat16 at 24/2 (the simulator's slowest case, > 30 s: its
    bfloat16 loads are those of 12/1, its second KV head that of float16 at 24/2) marked slow."""
    for hq, hkv, d in GEOMETRIES:
        for dt in DTYPES:
            name = np.dtype(dt).name
            marks = (pytest.mark.slow,) if name == "bfloat16" and hkv == 2 and d == 256 else ()
            yield pytest.param(hq, hkv, d, dt, marks=marks, id=f"{hq}-{hkv}-{d}-{name}")


@pytest.mark.parametrize("hq,hkv,d,dtype", list(_generic_cases()))
def test_generic_attention_geometry(rng, hq, hkv, d, dtype):
    """Both staged-tile sizes (16 and 8 tokens at D 256) over selections of 1..15 tokens (every
    tail length), inert and stale rows; output in the query dtype."""
    p, tokens, counts = _attention_case(rng, hq, hkv, d, dtype)
    assert {int(c) % R for c in counts[counts > 0]} == {0, 1, 2, 3}
    tile = k_attention.attention_tile(d, hq // hkv)
    assert int(counts.max()) > tile, "the case must span more than one staged tile"
    out, lse = _run_generic(p, tokens, counts, dtype)
    _check_attention(p, tokens, counts, out, lse, np.dtype(dtype).name)


def test_attention_tile_shrinks_where_expected():
    """The tile sizes the geometry test covers: 16 tokens up to 10 heads per KV head at D 256."""
    assert [k_attention.attention_tile(256, g) for g in (3, 6, 10, 11, 12)] == [16, 16, 16, 8, 8]


@pytest.mark.parametrize("page_size", [784])
def test_generic_attention_page_sizes(rng, page_size):
    """A page size that is not a power of two (the hybrid models' 784)."""
    p, tokens, counts = _attention_case(rng, 12, 1, 256, np.float16, page_size=page_size,
                                        seq_lens=(31, 6))
    out, lse = _run_generic(p, tokens, counts, np.float32)
    _check_attention(p, tokens, counts, out, lse, "float32")     # the FMA route, float32 out


# ------------------------------------------------------------------------------------------------
# selection kernels at the indexer's geometry (Hi 4 / Di 128) and small ones
# ------------------------------------------------------------------------------------------------

INDEXER = [(4, 128), (1, 16), (2, 32)]


def _index_case(rng, hi, di, dtype=np.float16, page_size=16, seq_lens=(75, 13), shared=False):
    req, pos = _odd_rows(list(seq_lens))
    return make_problem(list(seq_lens), positions=pos, req_ids=req, page_size=page_size, Hq=1,
                        Hkv=1, D=8, Hi=hi, Di=di, dtype=dtype, shared_index_table=shared,
                        seed=int(rng.integers(1 << 31)))


def _batch(p):
    return [p[k] for k in ("qi", "index_cache", "index_block_table", "req_ids", "positions",
                           "seq_lens")]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("hi,di", INDEXER)
def test_index_scores_light_geometry(rng, hi, di, dtype):
    p = _index_case(rng, hi, di, dtype, page_size=784 if hi == 4 else 16, shared=hi != 4)
    want = oracle.index_scores(*_batch(p))
    out = poison(cuda.device_array(want.shape, np.float32))
    k_scores.launch_light(*[to_device(np.ascontiguousarray(a)) for a in _batch(p)], out,
                          arch_profile((9, 0)), 0)
    # the inputs are exact: the scores carry float32 accumulation only
    assert_matches_oracle(out.copy_to_host(), want, dtype="float32", what="light scores")


@pytest.mark.parametrize("arch,variant,dtype", [("sm_90", "keysm", "float16"),
                                                ("sm_90", "generic", "float16"),
                                                ("sm_70", None, "float16"),
                                                ("sm_90", "keysm", "bfloat16"),
                                                ("sm_90", "generic", "bfloat16")])
@pytest.mark.parametrize("hi,di", [(4, 128), (2, 32)])
def test_index_scores_tiled_geometry(rng, monkeypatch, arch, variant, dtype, hi, di):
    """The tensor-core kernels through the mma stand-ins: keys-as-M and per-warp-M m16n8k16
    (sm_90, float16 and bfloat16), m8n8k4 (sm_70, float16)."""
    monkeypatch.setenv("NUMQSA_ARCH", arch)
    if dtype == "bfloat16":
        dtype = np.dtype(pytest.importorskip("ml_dtypes").bfloat16)
    p = _index_case(rng, hi, di, dtype)
    want = oracle.index_scores(*_batch(p))
    out = poison(cuda.device_array(want.shape, np.float32))
    d = [to_device(np.ascontiguousarray(a)) for a in _batch(p)]
    prof = arch_profile((9, 0))
    k_scores.launch_tiled(*d, out, prof, 0, variant=variant)
    assert_matches_oracle(out.copy_to_host(), want, dtype="float32",
                          what=f"tiled {prof.scores.mma} {variant} scores")


@pytest.mark.parametrize("route", k_topk.ROUTES)
def test_topk_boundaries(rng, route):
    """Rows seeing Kb - 1, Kb and Kb + 1 groups, a one-group row, inert and stale rows, and two
    full rows of signed zeros (-0.0 ties +0.0: lowest ids first) with a few positive scores; exact."""
    kb, G = 8, 40
    lens = np.array([4 * G + 3, 4 * (kb + 1), 4 * kb + 1, 4 * kb - 2, 5], np.int32)
    req = np.array([0, 0, 1, 2, 3, 4, 9, 0, 1, 0, 0], np.int32)
    pos = np.array([4 * G + 2, 4 * G - 1, 4 * (kb + 1) - 1, 4 * kb, 4 * kb - 3, 4, 0, -1, 1000,
                    4 * G + 2, 4 * G - 5], np.int32)
    s = np.maximum(rng.standard_normal((req.size, G)), 0).astype(np.float32)
    s[-2:] = np.where(rng.random((2, G)) < 0.5, np.float32(-0.0), np.float32(0.0))
    s[-2:, 3::11] = np.float32(2.0)
    out = poison(cuda.device_array((req.size, kb), np.int32))
    k_topk.launch_topk(*[to_device(x) for x in (s.view(np.uint32), req, pos, lens)], out,
                       arch_profile((9, 0)), 0, route=route)
    want = oracle.topk_groups(s.astype(np.float64), req, pos, lens, Kb=kb)
    np.testing.assert_array_equal(out.copy_to_host(), want)


@pytest.mark.parametrize("kb", [1, 5])
def test_expand_boundaries(rng, kb):
    """Every tail length, rows with fewer visible groups than Kb, inert and stale rows."""
    lens = np.array([31, 6, 3], np.int32)
    req, pos = _odd_rows(list(lens))
    groups = _groups(rng, req, pos, lens, kb)
    out = (poison(np.empty((req.size, kb * R + R - 1), np.int32)), poison(np.empty(req.size, np.int32)))
    tokens, counts = sel.expand_tokens(groups, req, pos, lens, out=out)
    want_t, want_c = oracle.expand_tokens(groups, req, pos, lens, r=R)
    np.testing.assert_array_equal(tokens, want_t)
    np.testing.assert_array_equal(counts, want_c)
    assert {int(c) % R for c in counts[counts > 0]} == {0, 1, 2, 3}


@pytest.mark.parametrize("page_size,shared", [(16, False), (784, True)])
def test_select_indexer_geometry(rng, page_size, shared):
    """The fused chain at Hi 4 / Di 128, NaN-poisoned outputs, against spec §8."""
    p = _index_case(rng, 4, 128, np.float16, page_size=page_size, seq_lens=(75, 13, 40),
                    shared=shared)
    rows, kb = p["req_ids"].size, 6
    out = tuple(poison(np.empty(s, np.int32)) for s in ((rows, kb * R + R - 1), (rows,), (rows, kb)))
    tokens, counts, groups = numqsa.select(*_batch(p), Kb=kb, out=out)
    assert_selection_matches(groups, tokens, counts, oracle.index_scores(*_batch(p)),
                             p["req_ids"], p["positions"], p["seq_lens"], Kb=kb)


@pytest.mark.parametrize("dtype", FLOATS)
def test_index_keys_and_queries_geometry(rng, dtype):
    """Di 128 with the production rotary width 64, Hi 4 queries, a paged cache of 784-token pages."""
    di, G = 128, 5
    lens = np.array([64, 41], np.int32)
    req, pos = _odd_rows(list(lens))
    p = make_problem(lens, positions=pos, req_ids=req, page_size=784, Hq=1, Hkv=1, D=8, Hi=4,
                     Di=di, dtype=dtype, shared_index_table=False, seed=int(rng.integers(1 << 31)))
    k_raw = rng.standard_normal((G, R, di)).astype(dtype)
    w = (0.1 * rng.standard_normal(di)).astype(dtype)
    reqs, eids = np.array([0, 0, 1, 0, 1], np.int32), np.array([0, 15, 9, 7, 1], np.int32)
    ic_k, ic_o = p["index_cache"].copy(), p["index_cache"].copy()
    kc = sel.index_keys(k_raw, w, reqs, eids, ic_k, p["index_block_table"])
    want = oracle.index_keys(k_raw, w, reqs, eids, ic_o, p["index_block_table"])
    assert_matches_oracle(kc, want, dtype="float32", what="kc")
    assert_matches_oracle(ic_k, ic_o, dtype=np.dtype(dtype).name, what="index_cache")
    q_raw = rng.standard_normal((req.size, 4, di)).astype(dtype)
    out = poison(np.empty(q_raw.shape, dtype))
    got = sel.index_queries(q_raw, w, req, pos, lens, out=out)
    assert_matches_oracle(got, oracle.index_queries(q_raw, w, req, pos, lens),
                          dtype=np.dtype(dtype).name, what="qi")


# ------------------------------------------------------------------------------------------------
# GPU tier: the production geometries on real sizes
# ------------------------------------------------------------------------------------------------

def gpu_attention_case(hq, hkv, dtype, rows, ctx, seed, page_size=64, kb=512):
    """One request of ``ctx`` tokens, its last ``rows`` positions, ``kb`` random groups per row."""
    rng = np.random.default_rng(seed)
    p = make_problem([ctx], [rows], page_size=page_size, Hq=hq, Hkv=hkv, D=256, Hi=1, Di=8,
                     dtype=dtype, seed=seed)
    groups = _groups(rng, p["req_ids"], p["positions"], p["seq_lens"], kb)
    tokens, counts = oracle.expand_tokens(groups, p["req_ids"], p["positions"], p["seq_lens"], r=R)
    return p, tokens, counts


@pytest.mark.gpu
@pytest.mark.parametrize("route", ATTENTION_ROUTES)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("hq,hkv,d", PRODUCTION)
def test_gpu_attention_geometry(hq, hkv, d, dtype, route, seed):
    """1024 rows x 2051 tokens of a 32K context at every production geometry, on each route
    (float32 runs the generic route only, bfloat16 too on sm_70), against the oracle on 32
    sampled rows."""
    name = np.dtype(dtype).name
    if route != "generic" and name == "float32":
        pytest.skip("float32 has the generic route only")
    if route != "generic" and name == "bfloat16" and arch_profile((9, 0)).attention.mma != "m16n8k16":
        pytest.skip("no bfloat16 tensor cores on sm_70: bfloat16 has the generic route only")
    rows = 1024
    p, tokens, counts = gpu_attention_case(hq, hkv, dtype, rows, 32768, seed)
    d_ = {k: to_device(np.ascontiguousarray(p[k])) for k in ("q", "k_cache", "v_cache",
                                                                   "block_table", "req_ids",
                                                                   "seq_lens")}
    out = poison(cuda.device_array((rows, hq, d), dtype))
    lse = poison(cuda.device_array((rows, hq), np.float32))
    numqsa.sparse_attention(d_["q"], d_["k_cache"], d_["v_cache"], d_["block_table"],
                            to_device(tokens), to_device(counts), d_["req_ids"],
                            d_["seq_lens"], route_name=route, out=(out, lse))
    o, l = out.copy_to_host(), lse.copy_to_host()
    assert np.isfinite(o.astype(np.float32)).all() and np.isfinite(l).all(), \
        f"seed {seed}: unwritten or non-finite"
    sample = np.random.default_rng(seed).choice(rows, size=32, replace=False)
    eo, el = oracle.sparse_attention(p["q"][sample], p["k_cache"], p["v_cache"], p["block_table"],
                                     tokens[sample], counts[sample], p["req_ids"][sample],
                                     p["seq_lens"])
    assert_matches_oracle(o[sample], eo, dtype=name, what=f"seed {seed} {route} out")
    assert_matches_oracle(l[sample], el, dtype="float32", what=f"seed {seed} {route} lse")
