"""Every kernel at every head geometry a user runs (issue 12, point 1).

The production shapes are the per-rank slices of Qwen3.8-Flash-Next: Hq/Hkv 24/2 (tensor parallel 1),
12/1 (TP 2), 6/1 (TP 4), 3/1 (TP 8), all at D 256, and the indexer's Hi 4 / Di 128. Shared-memory
tiles change with the heads per KV head (the generic attention kernel stages 16 tokens up to 10
heads per KV head at D 256 and 8 beyond), so a geometry no test runs is a tile size no test runs.

Simulator tier: those geometries with few rows and short contexts (a tile or two of tokens), plus
small ones, float16 and float32, NaN-poisoned outputs, odd and boundary sizes (tails 0-3, page size
784, inert and stale rows). GPU tier (``-m gpu``): the same geometries on real sizes, the oracle on
sampled rows. Every comparison goes through :mod:`numqsa.testing`.
"""
import numpy as np
import pytest
from numba import cuda

import numqsa
import oracle
from numqsa import selection as sel
from numqsa.kernels import attention as k_attention
from numqsa.kernels import index_scores as k_scores
from numqsa.kernels import topk as k_topk
from numqsa.plan import arch_profile
from numqsa.testing import assert_matches_oracle, assert_selection_matches, poison
from oracle.problems import make_problem

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
    dv = [cuda.to_device(np.ascontiguousarray(p[k])) for k in ("q", "k_cache", "v_cache",
                                                                 "block_table")]
    out = poison(cuda.device_array((rows, hq, d), out_dtype))
    lse = poison(cuda.device_array((rows, hq), np.float32))
    k_attention.launch_attention(*dv, cuda.to_device(tokens), cuda.to_device(counts),
                                 cuda.to_device(p["req_ids"]), cuda.to_device(p["seq_lens"]),
                                 1.0 / np.sqrt(d), out, lse, arch_profile((9, 0)), 0)
    return out.copy_to_host(), lse.copy_to_host()


def _check_attention(p, tokens, counts, out, lse, dtype):
    eo, el = oracle.sparse_attention(p["q"], p["k_cache"], p["v_cache"], p["block_table"], tokens,
                                     counts, p["req_ids"], p["seq_lens"])
    assert_matches_oracle(out, eo, dtype=dtype, what="out")
    assert_matches_oracle(lse, el, dtype=dtype, what="lse")


# ------------------------------------------------------------------------------------------------
# generic attention
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("hq,hkv,d", GEOMETRIES)
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
    _check_attention(p, tokens, counts, out, lse, "float16")
