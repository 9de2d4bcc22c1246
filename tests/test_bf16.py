"""bfloat16 through every kernel (issues 8.1, 9.4, 10.3, 12.4) against the float64 oracle.

bfloat16 arrays are ``ml_dtypes.bfloat16`` on the host and in numba device arrays, ``torch.bfloat16``
on the GPU tier; the kernels see their uint16 bits. Simulator tier: tiny shapes through the
pre-indexer, index scores (light, keys-as-M, per-warp-M tensor cores), the generic attention kernel,
the grouped tensor-core route (sm_90) and the whole prefill / wrapper; on ``NUMQSA_ARCH=sm_70`` (no
bfloat16 tensor cores) bfloat16 takes the FMA routes. Outputs are NaN-poisoned. The oracle runs in
float64 on the same bfloat16 inputs; tolerances are the comparator's "bfloat16" row where a result
is rounded to bfloat16 (P before P @ V, stored outputs), tighter where the inputs are exact.
"""
import numpy as np
import pytest
from numba import cuda

import numqsa
import oracle
from numqsa.stages import selection as sel
from numqsa.testing import (assert_matches_oracle, assert_selection_matches, groups_of_tokens, poison,
                            to_device)
from oracle.problems import make_problem
from test_attention_kernels import selection, small_problem

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(params=["sm_90", "sm_70"])
def arch(request, monkeypatch):
    monkeypatch.setenv("NUMQSA_ARCH", request.param)
    return request.param


def _spy(monkeypatch, module, name):
    seen = []
    orig = getattr(module, name)

    def spy(*a, **k):
        seen.append(1)
        return orig(*a, **k)
    monkeypatch.setattr(module, name, spy)
    return seen


# ------------------------------------------------------------------------------------------------
# Element conversions
# ------------------------------------------------------------------------------------------------

def test_conversions_match_ml_dtypes():
    """float32 -> bfloat16 rounds to nearest even (ties, overflow to inf, NaN kept), and the bits
    read back exactly: the same as ml_dtypes on every value, special ones included."""
    from numqsa.kernels.common import bf16_to_f32, f32_to_bf16

    @cuda.jit
    def k(x, bits, back):
        i = cuda.grid(1)
        if i < x.shape[0]:
            b = f32_to_bf16(x[i])
            bits[i] = b
            back[i] = bf16_to_f32(b)

    rng = np.random.default_rng(0)
    x = np.concatenate([
        np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 3.4e38, -3.4e38, 1e-40, -1e-40,
                  1.00390625, 1.01171875, 1.0078125, 65504.0], np.float32),
        np.array([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x00008000], np.uint32).view(np.float32),
        (rng.standard_normal(40) * 10.0 ** rng.integers(-30, 30, 40)).astype(np.float32)])
    bits = to_device(np.zeros(x.size, np.uint16))
    back = to_device(np.full(x.size, np.nan, np.float32))
    k[1, 64](to_device(x), bits, back)
    want = x.astype(BF16)
    got = bits.copy_to_host().view(BF16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(got[~nan].view(np.uint16), want[~nan].view(np.uint16))
    assert np.isnan(got[nan].astype(np.float32)).all()
    np.testing.assert_array_equal(back.copy_to_host()[~nan], want[~nan].astype(np.float32))


# ------------------------------------------------------------------------------------------------
# Index scores (the pre-indexer's bfloat16 cases are in test_selection_kernels.py)
# ------------------------------------------------------------------------------------------------

def _batch(P):
    return [P[k] for k in ("qi", "index_cache", "index_block_table", "req_ids", "positions",
                           "seq_lens")]


def test_index_scores_light_bf16(rng, arch):
    lens = np.array([57, 9, 0, 22], np.int32)
    P = make_problem(lens, [4, 2, 1, 1], page_size=16, dtype=BF16, shared_index_table=False,
                     seed=int(rng.integers(1 << 31)), Hi=2, Di=16, D=8)
    G = 57 // 4
    out = poison(np.empty((P["qi"].shape[0], G), np.float32))
    got = sel.index_scores(*_batch(P), out=out)
    # exact bfloat16 inputs, float32 accumulation
    assert_matches_oracle(got, oracle.index_scores(*_batch(P)), dtype="float32", what="scores")


@pytest.mark.parametrize("hi,strided", [(4, False), (8, False), (2, True)])
def test_index_scores_tiled_bf16(rng, monkeypatch, hi, strided):
    """m16n8k16 .bf16 through the stand-in: keys-as-M (uint32 words; uint16 bit loads for a strided
    cache in the simulator) for Hi <= 4, per-warp-M for Hi 8."""
    from numqsa.kernels import index_scores as K
    from numqsa.plan import arch_profile
    monkeypatch.setenv("NUMQSA_ARCH", "sm_90")
    lens = np.array([75, 13, 40], np.int32)
    P = make_problem(lens, [5, 2, 1], page_size=64, Hi=hi, Di=32, D=8, dtype=BF16,
                     shared_index_table=False, seed=int(rng.integers(1 << 31)))
    G = 75 // 4
    d = [to_device(np.ascontiguousarray(a)) for a in _batch(P)]
    if strided:
        ic = P["index_cache"]
        wide = np.zeros(ic.shape[:2] + (2 * ic.shape[2],), BF16)
        wide[:, :, :ic.shape[2]] = ic
        d[1] = to_device(wide)[:, :, :ic.shape[2]]
    prof = arch_profile((9, 0))
    assert K.tiled_supported(d[0], d[1], prof)
    sc = poison(cuda.device_array((P["qi"].shape[0], G), np.float32))
    K.launch_tiled(*d, sc, prof, 0)
    assert_matches_oracle(sc.copy_to_host(), oracle.index_scores(*_batch(P)), dtype="float32",
                          what="tiled bf16 scores")


def test_index_scores_sm70_bf16_is_light(monkeypatch):
    from numqsa.kernels import index_scores as K
    from numqsa.plan import arch_profile
    qi = np.zeros((2, 4, 32), BF16)
    assert not K.tiled_supported(qi, qi, arch_profile((7, 0)))
    assert K.tiled_supported(qi, qi, arch_profile((9, 0)))


# ------------------------------------------------------------------------------------------------
# Attention
# ------------------------------------------------------------------------------------------------

def _attend(p, tokens, counts, route, out_dtype=None, device=False):
    rows, hq, d = p["q"].shape
    od = np.dtype(out_dtype or p["q"].dtype)
    args = [p["q"], p["k_cache"], p["v_cache"], p["block_table"], tokens, counts, p["req_ids"],
            p["seq_lens"]]
    if device:
        args = [to_device(np.ascontiguousarray(a)) for a in args]
        out, lse = (poison(cuda.device_array((rows, hq, d), od)),
                    poison(cuda.device_array((rows, hq), np.float32)))
    else:
        out, lse = poison(np.empty((rows, hq, d), od)), poison(np.empty((rows, hq), np.float32))
    o, l = numqsa.sparse_attention(*args, out_dtype=out_dtype, route_name=route, out=(out, lse))
    if device:
        o, l = o.copy_to_host(), l.copy_to_host()
    assert o.dtype == od
    return o, l


def _check(p, tokens, counts, out, lse):
    eo, el = oracle.sparse_attention(p["q"], p["k_cache"], p["v_cache"], p["block_table"], tokens,
                                     counts, p["req_ids"], p["seq_lens"])
    assert_matches_oracle(out, eo, dtype="bfloat16", what="out")
    assert_matches_oracle(lse, el, dtype="float32", what="lse")
    inert = counts == 0
    assert np.all(out[inert].astype(np.float32) == 0) and np.all(lse[inert] == -np.inf)


@pytest.mark.parametrize("out_dtype", [None, "float32"])
def test_generic_bf16(rng, arch, out_dtype):
    p = small_problem(rng, [37, 9], None, positions=[36, 20, 8, -3, 35], req_ids=[0, 0, 1, 0, 0],
                      Hq=4, Hkv=2, dtype=BF16)
    tokens, counts = selection(rng, p["req_ids"], p["positions"], p["seq_lens"], kb=5)
    out, lse = _attend(p, tokens, counts, "generic", out_dtype)
    _check(p, tokens, counts, out, lse)


@pytest.mark.parametrize("name,seq_lens,rows,page_size,hq,hkv,kb,mode", [
    ("pieces and solo rows", [300], [5], 16, 6, 1, 20, "random"),
    ("two requests per window", [260, 150], [3, 2], 64, 6, 1, 18, "overlap"),
    ("24/2 heads, 784-token pages", [45], [3], 784, 24, 2, 4, "overlap"),
])
def test_grouped_bf16(rng, monkeypatch, name, seq_lens, rows, page_size, hq, hkv, kb, mode):
    monkeypatch.setenv("NUMQSA_ARCH", "sm_90")
    seen = _spy(monkeypatch, numqsa.stages.attention._grouped, "launch_grouped")
    p = small_problem(rng, seq_lens, rows, page_size=page_size, Hq=hq, Hkv=hkv, dtype=BF16)
    tokens, counts = selection(rng, p["req_ids"], p["positions"], p["seq_lens"], kb=kb, mode=mode)
    out, lse = _attend(p, tokens, counts, "page4")
    _check(p, tokens, counts, out, lse)
    assert seen, "the grouped kernel did not run"


def test_grouped_bf16_12_heads_d256(rng, monkeypatch):
    """Qwen3.8-Flash-Next at TP2 (Hq 12 / Hkv 1, D 256): grouped route with float32 output and
    the generic kernel at the same geometry, device arrays."""
    monkeypatch.setenv("NUMQSA_ARCH", "sm_90")
    seen = _spy(monkeypatch, numqsa.stages.attention._grouped, "launch_grouped")
    p = small_problem(rng, [41], [2], page_size=16, Hq=12, Hkv=1, D=256, dtype=BF16)
    tokens, counts = selection(rng, p["req_ids"], p["positions"], p["seq_lens"], kb=4,
                               mode="overlap")
    out, lse = _attend(p, tokens, counts, "page4", "float32", device=True)
    _check(p, tokens, counts, out, lse)
    assert seen
    out, lse = _attend(p, tokens, counts, "generic", device=True)
    _check(p, tokens, counts, out, lse)


def test_sm70_bf16_takes_generic(rng, monkeypatch):
    """No bfloat16 tensor cores on sm_70: the planned page-4 route hands bfloat16 to the generic
    FMA kernel (and refuses it when forced)."""
    monkeypatch.setenv("NUMQSA_ARCH", "sm_70")
    seen = _spy(monkeypatch, numqsa.stages.attention._page4, "launch_page4")
    p = small_problem(rng, [30], [2], Hq=2, Hkv=1, dtype=BF16)
    tokens, counts = selection(rng, p["req_ids"], p["positions"], p["seq_lens"], kb=3)
    out, lse = _attend(p, tokens, counts, None)
    _check(p, tokens, counts, out, lse)
    assert not seen
    with pytest.raises(numqsa.QSAInputError, match="sm_80"):
        _attend(p, tokens, counts, "page4")


# ------------------------------------------------------------------------------------------------
# Whole prefill and the wrapper
# ------------------------------------------------------------------------------------------------

GEOM = dict(Hi=2, Di=32, Hq=4, Hkv=2, D=32)


def _problem(seed):
    """Rows past Kb groups (selection decides), a stale and an inert row, two requests."""
    return make_problem([50, 29], positions=[49, 60, 28, -1], req_ids=[0, 0, 1, 5],
                        page_size=16, dtype=BF16, seed=seed, **GEOM)


def _check_prefill(p, out, lse, tokens, counts, Kb):
    batch = (p["req_ids"], p["positions"], p["seq_lens"])
    scores = oracle.index_scores(p["qi"], p["index_cache"], p["index_block_table"], *batch)
    assert_selection_matches(groups_of_tokens(tokens, counts, Kb), tokens, counts, scores, *batch,
                             Kb=Kb)
    _check(p, tokens, counts, out, lse)


def test_qsa_prefill_bf16(seed, arch):
    p = _problem(seed)
    out, lse, tokens, counts = numqsa.qsa_prefill(
        p["qi"], p["index_cache"], p["index_block_table"], p["q"], p["k_cache"], p["v_cache"],
        p["block_table"], p["req_ids"], p["positions"], p["seq_lens"], Kb=5)
    assert out.dtype == BF16 and lse.dtype == np.float32
    _check_prefill(p, out, lse, tokens, counts, 5)


def test_wrapper_bf16_device_arrays(seed, monkeypatch, api_attention):
    """numba device arrays of dtype ml_dtypes.bfloat16 in, the same out; NaN-poisoned out= buffers;
    run_select (on new arrays) / run_attention agree with run bit for bit."""
    monkeypatch.setenv("NUMQSA_ARCH", "sm_90")
    p = _problem(seed)
    w = numqsa.QSAPrefillWrapper(Kb=5, dtype="bfloat16", **GEOM)
    w.plan(p["req_ids"], p["positions"], p["seq_lens"], p["block_table"], p["index_block_table"])
    lay = [to_device(p[k]) for k in ("qi", "index_cache", "q", "k_cache", "v_cache")]
    rows = p["q"].shape[0]
    bufs = (poison(cuda.device_array((rows, 4, 32), BF16)),
            poison(cuda.device_array((rows, 4), np.float32)),
            poison(cuda.device_array((rows, w.width), np.int32)),
            poison(cuda.device_array((rows,), np.int32)))
    res = w.run(*lay, out=bufs, return_selection=True)
    out, lse, tokens, counts = (b.copy_to_host() for b in res)
    assert out.dtype == BF16
    _check_prefill(p, out, lse, tokens, counts, 5)
    t, c, _ = w.run_select(*[to_device(x.copy_to_host()) for x in lay[:2]])
    np.testing.assert_array_equal(t.copy_to_host(), tokens)
    o2, l2 = w.run_attention(lay[2], lay[3], lay[4], t, c)
    np.testing.assert_array_equal(o2.copy_to_host().view(np.uint16), out.view(np.uint16))
    np.testing.assert_array_equal(l2.copy_to_host(), lse)


def test_void16_refused():
    """A 16-bit void array (bfloat16 seen through a bare __cuda_array_interface__) cannot be told
    apart from other 16-bit data: refused, naming the fix."""
    p = _problem(1)
    q = to_device(p["q"].view(np.uint16).view("V2"))
    with pytest.raises(numqsa.QSAInputError, match="void16"):
        numqsa.qsa_prefill(p["qi"], p["index_cache"], p["index_block_table"], q, p["k_cache"],
                           p["v_cache"], p["block_table"], p["req_ids"], p["positions"],
                           p["seq_lens"], Kb=5)


# ------------------------------------------------------------------------------------------------
# GPU tier (real shapes, torch bfloat16 tensors)
# ------------------------------------------------------------------------------------------------

GPU_GEOMS = [(6, 1), (24, 2)]


def _torch():
    import torch            # the GPU tier requires torch (conftest): never a silent skip
    return torch


def _gpu_problem(rows, ctx, hq, hkv, seed):
    return make_problem([ctx], [rows], page_size=64, Hq=hq, Hkv=hkv, D=256, Hi=4, Di=128,
                        dtype=BF16, seed=seed)


def _to_torch(torch, a):
    a = np.ascontiguousarray(a)
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16)).cuda().view(torch.bfloat16)
    return torch.from_numpy(a).cuda()


def _host(x):
    """NumPy copy of a torch tensor or numba device array (bfloat16 kept as ml_dtypes.bfloat16)."""
    if hasattr(x, "copy_to_host"):
        return x.copy_to_host()
    if str(x.dtype) == "torch.bfloat16":
        import torch
        return x.view(torch.int16).cpu().numpy().view(BF16)
    return x.cpu().numpy()


SAMPLE = 96     # rows compared with the oracle (spread over the batch, ends included)


def _sample_rows(rows):
    return np.unique(np.r_[np.linspace(0, rows - 1, SAMPLE).astype(int), rows - 1])


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv", GPU_GEOMS)
def test_gpu_prefill_bf16_real_shape(hq, hkv, seed):
    """4096 rows x 32K context, D 256, torch bfloat16 in place (zero copy), bfloat16 out."""
    torch = _torch()
    p = _gpu_problem(4096, 32768, hq, hkv, seed)
    t = {k: _to_torch(torch, v) for k, v in p.items()}
    out, lse, tokens, counts = numqsa.qsa_prefill(
        t["qi"], t["index_cache"], t["index_block_table"], t["q"], t["k_cache"], t["v_cache"],
        t["block_table"], t["req_ids"], t["positions"], t["seq_lens"], Kb=512)
    assert out.dtype == torch.bfloat16 and out.is_cuda
    torch.cuda.synchronize()
    out, lse, tokens, counts = (_host(x) for x in (out, lse, tokens, counts))
    rs = _sample_rows(4096)
    batch = (p["req_ids"][rs], p["positions"][rs], p["seq_lens"])
    sub = dict(p, qi=p["qi"][rs], q=p["q"][rs], req_ids=batch[0], positions=batch[1])
    scores = oracle.index_scores(sub["qi"], p["index_cache"], p["index_block_table"], *batch)
    assert_selection_matches(groups_of_tokens(tokens[rs], counts[rs], 512), tokens[rs], counts[rs],
                             scores, *batch, Kb=512)
    eo, el = oracle.sparse_attention(sub["q"], p["k_cache"], p["v_cache"], p["block_table"],
                                     tokens[rs], counts[rs], batch[0], p["seq_lens"])
    assert_matches_oracle(out[rs], eo, dtype="bfloat16", what="out")
    assert_matches_oracle(lse[rs], el, dtype="float32", what="lse")


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv", [(6, 1), (12, 1), (24, 2)])
def test_gpu_attention_bf16_routes(hq, hkv, seed):
    """Both attention routes on a 32K context with 2051 selected tokens per row: the planned one
    (grouped on sm_90, generic FMA in the tier run under NUMQSA_ARCH=sm_70) and the generic one;
    out= torch bfloat16 buffers poisoned with NaN; the two routes' bits repeat across reruns."""
    torch = _torch()
    rows = 256
    p = _gpu_problem(rows, 32768, hq, hkv, seed)
    rng = np.random.default_rng(seed)
    tokens, counts = selection(rng, p["req_ids"], p["positions"], p["seq_lens"], kb=512,
                               mode="overlap")
    t = {k: _to_torch(torch, v) for k, v in p.items()}
    tt, tc = _to_torch(torch, tokens), _to_torch(torch, counts)
    eo, el = oracle.sparse_attention(p["q"], p["k_cache"], p["v_cache"], p["block_table"], tokens,
                                     counts, p["req_ids"], p["seq_lens"])
    for route in (None, "generic"):
        outs = []
        for _ in range(2):
            o = torch.full((rows, hq, 256), float("nan"), dtype=torch.bfloat16, device="cuda")
            l = torch.full((rows, hq), float("nan"), dtype=torch.float32, device="cuda")
            numqsa.sparse_attention(t["q"], t["k_cache"], t["v_cache"], t["block_table"], tt, tc,
                                    t["req_ids"], t["seq_lens"], out=(o, l), route_name=route)
            torch.cuda.synchronize()
            outs.append((_host(o), _host(l)))
        assert_matches_oracle(outs[0][0], eo, dtype="bfloat16", what=f"out {route}")
        assert_matches_oracle(outs[0][1], el, dtype="float32", what=f"lse {route}")
        np.testing.assert_array_equal(outs[0][0].view(np.uint16), outs[1][0].view(np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,ctx", [(1024, 32768), (4096, 131072)])
def test_gpu_select_bf16(rows, ctx, seed):
    """The selection chain on bfloat16 index queries and cache (tiled m16n8k16 .bf16 scores)."""
    torch = _torch()
    p = _gpu_problem(rows, ctx, 6, 1, seed)
    t = {k: _to_torch(torch, v) for k, v in p.items()}
    tokens, counts, groups = numqsa.select(t["qi"], t["index_cache"], t["index_block_table"],
                                           t["req_ids"], t["positions"], t["seq_lens"], Kb=512)
    torch.cuda.synchronize()
    tokens, counts, groups = (_host(x) for x in (tokens, counts, groups))
    rs = _sample_rows(rows)
    batch = (p["req_ids"][rs], p["positions"][rs], p["seq_lens"])
    scores = oracle.index_scores(p["qi"][rs], p["index_cache"], p["index_block_table"], *batch)
    assert_selection_matches(groups[rs], tokens[rs], counts[rs], scores, *batch, Kb=512)


@pytest.mark.gpu
def test_gpu_pre_indexer_bf16(seed):
    """Index keys (mean rounded to bfloat16, stored in a bfloat16 cache) and index queries at
    Hi 4 / Di 128 on torch bfloat16 tensors."""
    torch = _torch()
    rng = np.random.default_rng(seed)
    G, r, di, rows = 8192, 4, 128, 4096
    k_raw = rng.standard_normal((G, r, di)).astype(BF16)
    w = (0.1 * rng.standard_normal(di)).astype(BF16)
    table = np.arange(G // 16, dtype=np.int32)[None, :]
    reqs, eids = np.zeros(G, np.int32), np.arange(G, dtype=np.int32)
    cache = np.zeros((G // 16, 16, di), BF16)
    want = oracle.index_keys(k_raw, w, reqs, eids, cache.copy(), table, emulate_dtype=BF16)
    tc = _to_torch(torch, cache)
    kc = sel.index_keys(_to_torch(torch, k_raw), _to_torch(torch, w), reqs, eids, tc, table,
                        emulate_dtype=BF16)
    torch.cuda.synchronize()
    assert_matches_oracle(_host(kc), want, dtype="bfloat16", what="kc")
    assert_matches_oracle(_host(tc).reshape(G, di), want, dtype="bfloat16", what="stored keys")
    q_raw = rng.standard_normal((rows, 4, di)).astype(BF16)
    lens = np.array([rows], np.int32)
    req, pos = np.zeros(rows, np.int32), np.arange(rows, dtype=np.int32)
    got = sel.index_queries(_to_torch(torch, q_raw), _to_torch(torch, w), req, pos, lens)
    torch.cuda.synchronize()
    got = _host(got)
    assert_matches_oracle(got, oracle.index_queries(q_raw, w, req, pos, lens), dtype="bfloat16",
                          what="qi")


@pytest.mark.gpu
def test_gpu_wrapper_bf16_torch_zero_copy_prepared_graph(seed, monkeypatch):
    """torch bfloat16 in, torch bfloat16 out, bitwise equal to numba bfloat16 device arrays in;
    the prepared cuLaunchKernel path is taken and equals the dispatcher's; a CUDA-graph replay
    with new inputs equals an eager run."""
    torch = _torch()
    rows = 1024
    p = make_problem([8192], [rows], page_size=64, dtype=BF16, seed=seed)
    p2 = make_problem([8192], [rows], page_size=64, dtype=BF16, seed=seed + 1)
    meta = ("req_ids", "positions", "seq_lens", "block_table", "index_block_table")
    layer = ("qi", "index_cache", "q", "k_cache", "v_cache")

    def wrapper():
        return numqsa.QSAPrefillWrapper(Hi=4, Di=128, Hq=6, Hkv=1, D=256, r=4, Kb=512,
                                        dtype="bfloat16")
    want = [_host(x) for x in wrapper().plan(*[to_device(p[k]) for k in meta]).run(
        *[to_device(p[k]) for k in layer], return_selection=True)]
    tm, tl = [_to_torch(torch, p[k]) for k in meta], [_to_torch(torch, p[k]) for k in layer]
    w = wrapper().plan(*tm)
    got = w.run(*tl, return_selection=True)
    assert got[0].dtype == torch.bfloat16 and all(x.is_cuda for x in got)
    assert next(iter(w._programs.values())).fast
    for a, b in zip(want, got):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), _host(b).view(np.uint8))
    monkeypatch.setenv("NUMQSA_PREPARED_LAUNCH", "0")
    slow = wrapper().plan(*tm).run(*tl, return_selection=True)
    for a, b in zip(want, slow):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), _host(b).view(np.uint8))
    monkeypatch.delenv("NUMQSA_PREPARED_LAUNCH")
    s = torch.cuda.Stream()
    o = torch.empty(rows, 6, 256, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(rows, 6, dtype=torch.float32, device="cuda")
    wg = wrapper()
    with torch.cuda.stream(s):
        wg.plan(*tm, stream=s)
        wg.run(*tl, out=(o, lse), stream=s)
    s.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        wg.run(*tl, out=(o, lse), stream=s)
    for name in ("qi", "q"):
        tl[layer.index(name)].copy_(_to_torch(torch, p2[name]))
    g.replay()
    torch.cuda.synchronize()
    eager = wrapper().plan(*tm).run(*tl)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(_host(o).view(np.uint16), _host(eager[0]).view(np.uint16))
    np.testing.assert_array_equal(_host(lse), _host(eager[1]))
