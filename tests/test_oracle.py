"""The oracle is the truth, so it is checked on its own: brute force on tiny cases, the spec's worked
example, and identities (dense equality up to 2050 tokens, permutation and layout invariance)."""
import math
import sys
import subprocess

import numpy as np
import pytest

import oracle
from oracle import attention as oracle_attention
from oracle.problems import kv_views, make_problem

R = 4


def batch(p):
    return p["req_ids"], p["positions"], p["seq_lens"]


# ---------------------------------------------------------------- brute force, stage by stage

def brute_gnorm_rope(x, w, pos, rot=64, theta=1e7, eps=1e-6):
    d = len(x)
    ms = sum(float(v) ** 2 for v in x) / d
    y = [float(x[j]) / math.sqrt(ms + eps) * (1 + float(w[j])) for j in range(d)]
    out = list(y)
    for j in range(rot // 2):
        ang = pos * theta ** (-2 * j / rot)
        a, b = y[j], y[j + rot // 2]
        out[j] = a * math.cos(ang) - b * math.sin(ang)
        out[j + rot // 2] = b * math.cos(ang) + a * math.sin(ang)
    return np.array(out)


def test_index_keys_brute_force(rng):
    G, Di, rows_per_page = 5, 96, 3
    k_raw = rng.standard_normal((G, R, Di)).astype(np.float32)
    w_k = rng.standard_normal(Di).astype(np.float32) * 0.1
    reqs = np.array([0, 0, 1, 1, 0], np.int32)
    eids = np.array([0, 4, 2, 0, 1], np.int32)
    table = np.array([[3, 0, 5], [1, 4, -1]], np.int32)
    cache = np.full((6, rows_per_page, Di), np.nan, np.float32)
    kc = oracle.index_keys(k_raw, w_k, reqs, eids, cache, table, rot=32)
    for g in range(G):
        mean = [sum(float(k_raw[g, t, j]) for t in range(R)) / R for j in range(Di)]
        want = brute_gnorm_rope(mean, w_k, R * eids[g], rot=32)
        np.testing.assert_allclose(kc[g], want, rtol=1e-12, atol=1e-12)
        page, row = table[reqs[g], eids[g] // rows_per_page], eids[g] % rows_per_page
        np.testing.assert_array_equal(cache[page, row], want.astype(np.float32))
    assert np.isnan(cache[0, 0]).all(), "a slot no group maps to was written"


def test_index_keys_emulated_rounding_and_rope_override(rng):
    Di = 64
    k_raw = rng.standard_normal((2, R, Di)).astype(np.float16)
    w = np.zeros(Di)
    cache = np.zeros((1, 4, Di), np.float64)
    kc = oracle.index_keys(k_raw, w, [0, 0], [0, 1], cache, np.array([[0]]),
                           emulate_dtype=np.float16, rope_positions=[7, 11])
    mean16 = k_raw.astype(np.float64).mean(axis=1).astype(np.float16).astype(np.float64)
    for g, pos in enumerate([7, 11]):
        np.testing.assert_allclose(kc[g], brute_gnorm_rope(mean16[g], w, pos), rtol=1e-12, atol=1e-12)


def test_index_queries_brute_force(rng):
    Hi, Di = 3, 64
    req = np.array([0, 1, 0, 5, 0], np.int32)
    pos = np.array([3, 40, -1, 2, 9], np.int32)       # row 1 stale (seq_len 17), 2 and 3 inert
    lens = np.array([12, 17], np.int32)
    q_raw = rng.standard_normal((5, Hi, Di))
    w = rng.standard_normal(Di) * 0.1
    qi = oracle.index_queries(q_raw, w, req, pos, lens)
    for i, p in [(0, 3), (1, 16), (4, 9)]:
        for h in range(Hi):
            np.testing.assert_allclose(qi[i, h], brute_gnorm_rope(q_raw[i, h], w, p), atol=1e-12)
    assert not qi[2].any() and not qi[3].any()


def brute_scores(p, r=R):
    qi, cache, tab = p["qi"].astype(np.float64), p["index_cache"], p["index_block_table"]
    rows, hi, di = qi.shape
    G = int(p["seq_lens"].max()) // r
    out = np.full((rows, G), -np.inf)
    for i in range(rows):
        q, pos = int(p["req_ids"][i]), int(p["positions"][i])
        if not (0 <= q < len(p["seq_lens"])) or pos < 0 or p["seq_lens"][q] <= 0:
            continue
        n = int(p["seq_lens"][q])
        pc = min(pos, n - 1)
        nb = min((pc + 1) // r, n // r)
        for e in range(nb):
            key = cache[tab[q, e // cache.shape[1]], e % cache.shape[1]].astype(np.float64)
            out[i, e] = sum(max(0.0, float(qi[i, h] @ key)) for h in range(hi)) / math.sqrt(di)
    return out


def brute_topk(scores, nb, kb):
    order = sorted(range(nb), key=lambda e: (-scores[e], e))
    return sorted(order[:kb])


@pytest.mark.parametrize("shared_table", [True, False])
def test_scores_topk_expand_brute_force(seed, shared_table):
    p = make_problem([37, 23, 0], positions=[36, 3, 100, 22, 0, 5, 10],
                     req_ids=[0, 0, 1, 1, 2, 7, 1], page_size=8, Hi=3, Di=16, Hq=2, Hkv=1, D=8,
                     dtype=np.float32, shared_index_table=shared_table, seed=seed)
    s = oracle.index_scores(p["qi"], p["index_cache"], p["index_block_table"], *batch(p))
    np.testing.assert_allclose(s, brute_scores(p), rtol=1e-12, atol=1e-12)
    kb = 3
    groups = oracle.topk_groups(s, *batch(p), Kb=kb)
    tokens, counts = oracle.expand_tokens(groups, *batch(p))
    _, _, pc, nb = oracle.row_states(*batch(p), R)
    for i in range(len(p["req_ids"])):
        want = brute_topk(s[i], int(nb[i]), kb)
        assert list(groups[i][groups[i] >= 0]) == want
        want_tokens = [g * R + j for g in want for j in range(R)] + list(range(R * nb[i], pc[i] + 1))
        if pc[i] < 0:
            want_tokens = []
        assert list(tokens[i, :counts[i]]) == want_tokens and counts[i] == len(want_tokens)
        assert (tokens[i, counts[i]:] == -1).all()


def brute_attention(q, k_sel, v_sel, scale):
    hq, d = q.shape
    hkv = k_sel.shape[1]
    out, lse = np.zeros((hq, d)), np.full(hq, -np.inf)
    for h in range(hq):
        j = h // (hq // hkv)
        logits = [scale * float(q[h] @ k_sel[t, j]) for t in range(len(k_sel))]
        if not logits:
            continue
        m = max(logits)
        w = [math.exp(x - m) for x in logits]
        z = sum(w)
        out[h] = sum(w[t] * v_sel[t, j] for t in range(len(w))) / z
        lse[h] = m + math.log(z)
    return out, lse


@pytest.mark.parametrize("hq,hkv", [(6, 1), (4, 2), (3, 3)])
def test_sparse_attention_brute_force(rng, seed, hq, hkv):
    p = make_problem([41, 9], positions=[40, 30, 8, 2, 3], req_ids=[0, 0, 1, 1, -1], page_size=8,
                     Hq=hq, Hkv=hkv, D=16, Di=16, Hi=2, dtype=np.float32, seed=seed)
    rows, W = 5, 2 * R + R - 1
    tokens = np.full((rows, W), -1, np.int32)
    counts = np.array([W, 5, 9, 0, 0], np.int32)
    tokens[0] = rng.choice(41, W, replace=False)
    tokens[1, :5] = [40, 0, 7, 8, 31]
    tokens[2, :9] = rng.permutation(9)
    out, lse = oracle.sparse_attention(p["q"], p["k_cache"], p["v_cache"], p["block_table"], tokens,
                                       counts, p["req_ids"], p["seq_lens"])
    for i in range(rows):
        q = int(p["req_ids"][i])
        t = tokens[i, :counts[i]]
        pages = p["block_table"][q, t // 8] if q >= 0 else []
        k_sel = p["k_cache"][pages, t % 8].astype(np.float64) if len(t) else np.zeros((0, hkv, 16))
        v_sel = p["v_cache"][pages, t % 8].astype(np.float64) if len(t) else np.zeros((0, hkv, 16))
        want_out, want_lse = brute_attention(p["q"][i].astype(np.float64), k_sel, v_sel, 0.25)
        np.testing.assert_allclose(out[i], want_out, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(lse[i], want_lse, rtol=1e-12)
    assert not out[3:].any() and np.isneginf(lse[3:]).all()


# ---------------------------------------------------------------- the spec's worked example (§9)

def test_worked_example():
    groups = np.array([[1, 0], [0, -1]], np.int32)
    args = (np.array([0, 1], np.int32), np.array([9, 5], np.int32), np.array([10, 6], np.int32))
    tokens, counts = oracle.expand_tokens(groups, *args, r=4)
    assert tokens.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, -1], [0, 1, 2, 3, 4, 5, -1, -1, -1, -1, -1]]
    assert counts.tolist() == [10, 6]
    trt_order = np.array([4, 5, 6, 7, 0, 1, 2, 3, 8, 9, -1])
    assert sorted(trt_order[:10].tolist()) == tokens[0, :10].tolist()


# ---------------------------------------------------------------- identities

def dense_causal(p, i):
    q = int(p["req_ids"][i])
    pos = min(int(p["positions"][i]), int(p["seq_lens"][q]) - 1)
    t = np.arange(pos + 1)
    ps = p["k_cache"].shape[1]
    pages = p["block_table"][q, t // ps]
    k = p["k_cache"][pages, t % ps].astype(np.float64)
    v = p["v_cache"][pages, t % ps].astype(np.float64)
    return oracle.attention.attend(p["q"][i].astype(np.float64), k, v, 1 / math.sqrt(k.shape[-1]))


@pytest.mark.parametrize("context", [2050, 2051, 2052])
def test_dense_equality_up_to_2050(seed, context):
    """Up to position 2050 the selection is 0..p: QSA is dense causal attention; beyond, it is not."""
    positions = [0, 1, 3, 4, 5, 2047, 2048, 2049, context - 1]
    p = make_problem([context], positions=positions, req_ids=[0] * len(positions), page_size=64,
                     Hq=2, Hkv=1, D=16, Hi=2, Di=16, dtype=np.float32, seed=seed)
    out, lse, tokens, counts = oracle.qsa_prefill(**p, Kb=512)
    for i, pos in enumerate(positions):
        if pos <= 512 * R + R - 2:
            assert counts[i] == pos + 1 and (tokens[i, :pos + 1] == np.arange(pos + 1)).all()
            want_out, want_lse = dense_causal(p, i)
            np.testing.assert_allclose(out[i], want_out, rtol=1e-12, atol=1e-14)
            np.testing.assert_allclose(lse[i], want_lse, rtol=1e-13)
        else:   # 2051 tokens visible, 2051 - 3 in groups: one group must lose
            nb = (pos + 1) // R
            assert counts[i] == 512 * R + (pos + 1 - R * nb) < pos + 1


def test_permutation_invariance(rng, seed):
    p = make_problem([300], positions=[299, 150], req_ids=[0, 0], page_size=16, Hq=6, Hkv=1,
                     D=32, Hi=2, Di=16, dtype=np.float16, seed=seed)
    _, _, tokens, counts = oracle.qsa_prefill(**p, Kb=8)
    shuffled = tokens.copy()
    for i in range(2):
        shuffled[i, :counts[i]] = rng.permutation(tokens[i, :counts[i]])
    args = (p["q"], p["k_cache"], p["v_cache"], p["block_table"])
    a = oracle.sparse_attention(*args, tokens, counts, p["req_ids"], p["seq_lens"])
    b = oracle.sparse_attention(*args, shuffled, counts, p["req_ids"], p["seq_lens"])
    np.testing.assert_allclose(a[0], b[0], rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(a[1], b[1], rtol=1e-14)


def test_layout_views_identical_without_copies(rng, seed):
    shape = (7, 16, 2, 8)
    logical = ("contiguous", "interleaved", "head_major")
    k0, v0 = kv_views(shape, np.float32, "contiguous", rng)
    p = make_problem([100], positions=[99, 50, 7], req_ids=[0, 0, 0], page_size=16, Hq=4, Hkv=2,
                     D=8, Hi=2, Di=16, dtype=np.float32, seed=seed)
    p["block_table"] = np.array([[3, 0, 6, 1, 5, 2, 4]], np.int32)
    results = []
    for name in logical:
        k2, v2 = kv_views(shape, np.float32, name, rng)   # same layout, our logical content copied in
        k2[...] = k0
        v2[...] = v0
        assert name == "contiguous" or not k2.flags.c_contiguous
        if name == "interleaved":
            assert np.shares_memory(k2, v2.base) and k2.base is v2.base
        p.update(k_cache=k2, v_cache=v2)
        results.append(oracle.qsa_prefill(**p, Kb=4))
    for other in results[1:]:
        for x, y in zip(results[0], other):
            np.testing.assert_array_equal(x, y)


def test_relocation_page_784_non_monotonic(seed):
    """Same logical content on other physical pages (and another page size) gives the same bits."""
    n = 3000
    a = make_problem([n], positions=[n - 1, 2100, 5], req_ids=[0, 0, 0], page_size=784, Hq=6,
                     Hkv=1, D=16, Hi=2, Di=16, dtype=np.float16, seed=seed)
    a["block_table"][0, :4] = np.sort(a["block_table"][0, :4])[::-1]   # strictly non-monotonic
    b = dict(a)
    ps_b = 16
    pages_b = -(-n // ps_b)
    perm = np.random.default_rng(seed + 1).permutation(pages_b)
    b["block_table"] = perm[None, :].astype(np.int32)
    t = np.arange(n)
    for name in ("k_cache", "v_cache"):
        src = a[name][a["block_table"][0, t // 784], t % 784]
        dst = np.zeros((pages_b, ps_b) + src.shape[1:], src.dtype)
        dst[perm[t // ps_b], t % ps_b] = src
        b[name] = dst
    b["index_block_table"] = a["index_block_table"]   # index cache unchanged: same selection
    ra = oracle.qsa_prefill(**a, Kb=64)
    rb = oracle.qsa_prefill(**b, Kb=64)
    for x, y in zip(ra, rb):
        np.testing.assert_array_equal(x, y)


def test_stale_and_inert_rows(seed):
    p = make_problem([50, 0], positions=[49, 80, -3, 10, 10], req_ids=[0, 0, 0, 1, 2], page_size=16,
                     Hq=2, Hkv=1, D=8, Hi=2, Di=16, dtype=np.float32, seed=seed)
    p["qi"][1] = p["qi"][0]
    p["q"][1] = p["q"][0]
    out, lse, tokens, counts = oracle.qsa_prefill(**p, Kb=4)
    np.testing.assert_array_equal(tokens[1], tokens[0])      # stale row == row at clamped position
    np.testing.assert_array_equal(out[1], out[0])
    for i in (2, 3, 4):                                       # negative position, empty request, bad id
        assert counts[i] == 0 and (tokens[i] == -1).all()
        assert not out[i].any() and np.isneginf(lse[i]).all()


def test_exact_ties_follow_the_rule(seed):
    """All-zero scores (ReLU plateau, with -0.0 and +0.0 mixed): the lowest group ids win."""
    kb, nb = 5, 40
    lens = np.array([nb * R], np.int32)
    args = (np.zeros(3, np.int32), np.array([nb * R - 1] * 3, np.int32), lens)
    zeros = np.zeros((3, nb))
    zeros[1, ::2] = -0.0
    zeros[2, :] = 1.0
    zeros[2, [3, 17, 30]] = 2.0          # three clear winners, then a plateau of ties at 1.0
    groups = oracle.topk_groups(zeros, *args, Kb=kb)
    assert groups[0].tolist() == [0, 1, 2, 3, 4]
    assert groups[1].tolist() == [0, 1, 2, 3, 4]
    assert groups[2].tolist() == [0, 1, 3, 17, 30]
    # Through the whole pipeline: zero index queries make every score exactly 0.
    p = make_problem([nb * R], positions=[nb * R - 1], req_ids=[0], page_size=16, Hi=2, Di=16,
                     Hq=2, Hkv=1, D=8, dtype=np.float32, seed=seed)
    p["qi"][:] = 0
    tokens, counts, g = oracle.select(p["qi"], p["index_cache"], p["index_block_table"], *batch(p), Kb=kb)
    assert g[0].tolist() == list(range(kb)) and counts[0] == kb * R


@pytest.mark.parametrize("rows", [0, 1, 3, 4, 5])
def test_row_counts(seed, rows):
    p = make_problem([2052], rows_per_req=[rows], page_size=64, Hq=2, Hkv=1, D=8, Hi=2, Di=16,
                     dtype=np.float16, seed=seed)
    out, lse, tokens, counts = oracle.qsa_prefill(**p, Kb=512)
    assert out.shape == (rows, 2, 8) and lse.shape == (rows, 2) and tokens.shape == (rows, 2051)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    assert (counts == np.minimum(p["positions"] + 1, 2048 + (p["positions"] + 1) % 4)).all()


def test_page4_plan_round_trip(rng, seed):
    p = make_problem([90, 45], positions=[89, 44, 42, 20], req_ids=[0, 1, 1, 0], page_size=12,
                     Hq=2, Hkv=1, D=8, Hi=2, Di=16, dtype=np.float32, seed=seed)
    tokens, counts, _ = oracle.select(p["qi"], p["index_cache"], p["index_block_table"], *batch(p), Kb=6)
    num_pages, ps = p["k_cache"].shape[:2]
    plan = oracle.page4_plan(tokens, counts, p["block_table"], p["req_ids"], p["seq_lens"],
                             page_size=ps, num_pages=num_pages)
    pages, nv, tail = plan
    for i in range(4):
        t = tokens[i, :counts[i]]
        q = p["req_ids"][i]
        assert nv[i] == -(-counts[i] // R) and tail[i] == counts[i] % R
        assert (pages[i, nv[i]:] == -1).all()
        for k in range(nv[i]):
            first = t[k * R]
            assert pages[i, k].tolist() == [p["block_table"][q, first // ps], first % ps]
    a = oracle.sparse_attention(p["q"], p["k_cache"], p["v_cache"], p["block_table"], tokens, counts,
                                p["req_ids"], p["seq_lens"])
    b = oracle.page4_attention(p["q"], p["k_cache"], p["v_cache"], *plan, p["req_ids"])
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    # Malformed selections make the row inert instead of reading anything.
    bad = tokens.copy()
    bad[0, 1] = bad[0, 0]              # not ascending
    bad[1, 0] = 1                      # group not aligned
    broken_table = p["block_table"].copy()
    broken_table[0, 0] = num_pages     # row 3 (request 0, token 0 selected) hits a bad page id
    _, nv2, _ = oracle.page4_plan(bad, counts, broken_table, p["req_ids"], p["seq_lens"],
                                  page_size=ps, num_pages=num_pages)
    assert nv2[0] == 0 and nv2[1] == 0 and nv2[3] == 0 and nv2[2] == nv[2]


def test_production_shape_32k(seed):
    """64 rows at a 32K context with production geometry (the GPU tests' oracle workload)."""
    p = make_problem([32768], rows_per_req=[64], page_size=64, dtype=np.float16, seed=seed)
    out, lse, tokens, counts = oracle.qsa_prefill(**p, Kb=512)
    assert (counts == 2048 + (p["positions"] + 1) % 4).all() and np.isfinite(out).all()
    assert (np.diff(tokens[:, :2048], axis=1) > 0).all()


def test_oracle_never_imports_numba():
    code = "import sys, oracle, oracle.problems; assert 'numba' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_nan_scores_rank_first_brute_force(rng):
    """The NaN rule against brute force: sort by (NaN first, score desc, id asc), take Kb."""
    kb, nb = 7, 30
    lens = np.array([nb * R], np.int32)
    args = (np.zeros(4, np.int32), np.array([nb * R - 1] * 4, np.int32), lens)
    s = rng.standard_normal((4, nb))
    s[0, rng.choice(nb, 3, replace=False)] = np.nan          # fewer NaNs than Kb
    s[1, rng.choice(nb, 10, replace=False)] = np.nan         # more NaNs than Kb
    s[2, [4, 9]] = [np.inf, np.nan]
    s[3, :] = np.nan
    groups = oracle.topk_groups(s, *args, Kb=kb)
    for i in range(4):
        key = sorted(range(nb), key=lambda e: (not np.isnan(s[i, e]),
                                               0.0 if np.isnan(s[i, e]) else -s[i, e], e))
        assert groups[i].tolist() == sorted(key[:kb]), f"row {i}"


def test_attention_nonfinite_follows_ieee():
    """``attend`` is the IEEE float64 evaluation of max-subtracted softmax: spot values."""
    q = np.ones((2, 1))                                        # Hq 2 sharing one KV head, D 1
    k = np.array([[[1.0]], [[2.0]]])
    v = np.array([[[3.0]], [[5.0]]])
    out, lse = oracle_attention.attend(q, k, v, 1.0)
    w = np.exp([1.0, 2.0]) / np.exp([1.0, 2.0]).sum()
    np.testing.assert_allclose(out[:, 0], w @ [3.0, 5.0])
    np.testing.assert_allclose(lse, np.log(np.exp([1.0, 2.0]).sum()))
    for bad_k, nan_out in (([[[np.inf]], [[2.0]]], True), ([[[-np.inf]], [[2.0]]], False),
                           ([[[-np.inf]], [[-np.inf]]], True), ([[[np.nan]], [[2.0]]], True)):
        with np.errstate(invalid="ignore"):
            o, l = oracle_attention.attend(q, np.array(bad_k), v, 1.0)
        assert np.isnan(o).all() == nan_out and np.isnan(l).all() == nan_out, bad_k
        if not nan_out:
            np.testing.assert_allclose(o, 5.0)
