"""The plan/run object on a GPU: torch/CuPy round trips on the caller's stream, prepared launches
bitwise equal to the dispatcher's, CUDA-graph capture and replay bitwise equal to eager."""
import numpy as np
import pytest

import numqsa
from oracle.problems import make_problem

pytestmark = pytest.mark.gpu
META = ("req_ids", "positions", "seq_lens", "block_table", "index_block_table")
LAYER = ("qi", "index_cache", "q", "k_cache", "v_cache")


def gpu_problem(seed, rows=1024, context=8192):
    from numqsa.__main__ import correlated_queries
    p = make_problem([context], rows_per_req=[rows], page_size=64, dtype=np.float16, seed=seed)
    p["qi"] = correlated_queries(np.random.default_rng(seed), rows, 4, 128).astype(np.float16)
    return p


def wrapper():
    return numqsa.QSAPrefillWrapper(Hi=4, Di=128, Hq=6, Hkv=1, D=256, r=4, Kb=512)


def to_torch(torch, p, names):
    return [torch.from_numpy(np.ascontiguousarray(p[k])).cuda() for k in names]


def test_gpu_torch_in_torch_out_on_current_stream(seed):
    import torch
    from numba import cuda
    p = gpu_problem(seed)
    w = wrapper().plan(*[cuda.to_device(np.ascontiguousarray(p[k])) for k in META])
    want = [x.copy_to_host() for x in w.run(*[cuda.to_device(np.ascontiguousarray(p[k]))
                                              for k in LAYER], return_selection=True)]
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        w2 = wrapper().plan(*to_torch(torch, p, META))
        got = w2.run(*to_torch(torch, p, LAYER), return_selection=True)
    s.synchronize()
    assert all(isinstance(x, torch.Tensor) and x.is_cuda for x in got)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b.cpu().numpy())


def test_gpu_cupy_in_cupy_out(seed):
    cupy = pytest.importorskip("cupy")
    p = gpu_problem(seed, rows=256)
    w = wrapper().plan(*[cupy.asarray(np.ascontiguousarray(p[k])) for k in META])
    got = w.run(*[cupy.asarray(np.ascontiguousarray(p[k])) for k in LAYER])
    assert all(isinstance(x, cupy.ndarray) for x in got)
    want = wrapper().plan(*[p[k] for k in META]).run(*[p[k] for k in LAYER])
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, cupy.asnumpy(b))


def test_gpu_prepared_launches_equal_dispatcher(seed, monkeypatch):
    import torch
    p = gpu_problem(seed)
    w = wrapper().plan(*to_torch(torch, p, META))
    fast = [x.cpu().numpy() for x in w.run(*to_torch(torch, p, LAYER), return_selection=True)]
    prog = next(iter(w._programs.values()))
    assert prog.fast, prog.fallback_reason
    monkeypatch.setenv("NUMQSA_PREPARED_LAUNCH", "0")
    w2 = wrapper().plan(*to_torch(torch, p, META))
    slow = [x.cpu().numpy() for x in w2.run(*to_torch(torch, p, LAYER), return_selection=True)]
    assert not next(iter(w2._programs.values())).fast
    for a, b in zip(fast, slow):
        np.testing.assert_array_equal(a, b)


def test_gpu_graph_replay_bitwise(seed):
    import torch
    p, p2 = gpu_problem(seed), gpu_problem(seed + 1)
    meta, layer = to_torch(torch, p, META), to_torch(torch, p, LAYER)
    s = torch.cuda.Stream()
    w = wrapper()
    o = torch.empty(1024, 6, 256, dtype=torch.float16, device="cuda")
    lse = torch.empty(1024, 6, dtype=torch.float32, device="cuda")
    with torch.cuda.stream(s):
        w.plan(*meta, stream=s)
        w.run(*layer, out=(o, lse), stream=s)          # compile and prepare outside the capture
    s.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        w.run(*layer, out=(o, lse), stream=s)
    for name in ("qi", "q"):                            # new inputs, same tensors
        layer[LAYER.index(name)].copy_(torch.from_numpy(p2[name]))
    g.replay()
    torch.cuda.synchronize()
    replayed = [o.cpu().numpy(), lse.cpu().numpy()]
    eager = wrapper().plan(*meta).run(*layer)
    torch.cuda.synchronize()
    for a, b in zip(eager, replayed):
        np.testing.assert_array_equal(a.cpu().numpy(), b)


@pytest.mark.parametrize("rows", [16, 1024])     # direct blocks and the merge; union windows
def test_gpu_graph_branch_bitwise(seed, rows, monkeypatch):
    """The replay graph runs the generic kernel (the plan's inert and empty rows) on a branch
    beside the grouped kernels; replay after replay it gives the bits of the kernels launched one
    by one in stream order (a row written by both branches would show as a difference in some
    replay). Every 7th row is inert (request -1): out 0, lse -inf. The branch is the grouped
    route's (sm_80+): under the sm_70 profile the page-4 kernel runs with no branch to test."""
    from numqsa.device import device_cc
    from numqsa.plan import arch_profile
    if arch_profile(device_cc()).attention.mma != "m16n8k16":     # (NUMQSA_ARCH's, if set)
        pytest.skip("the generic kernel's graph branch belongs to the grouped route (sm_80+)")
    import torch
    p = gpu_problem(seed, rows=rows)
    p["req_ids"] = p["req_ids"].copy()
    p["req_ids"][3::7] = -1
    meta, layer = to_torch(torch, p, META), to_torch(torch, p, LAYER)

    def runs(n):
        w = wrapper().plan(*meta)
        got = [[x.cpu().numpy() for x in w.run(*layer)] for _ in range(n)]
        return got, next(iter(w._programs.values()))
    monkeypatch.setenv("NUMQSA_PREPARED_LAUNCH", "0")
    (one_by_one,), prog = runs(1)
    assert not prog.fast
    monkeypatch.setenv("NUMQSA_PREPARED_LAUNCH", "1")
    graph, prog = runs(5)
    assert prog.fast and prog.graph, prog.fallback_reason
    assert any(r.after is not None for r in prog.records)
    out, lse = one_by_one
    inert = p["req_ids"] < 0
    if inert.any():
        assert np.all(out[inert] == 0) and np.all(np.isneginf(lse[inert]))
    assert np.all(np.isfinite(lse[~inert]))
    for got in graph:
        for a, b in zip(one_by_one, got):
            np.testing.assert_array_equal(a, b)


def test_gpu_functional_calls_do_not_wait_and_stay_native(seed):
    """Default arguments, torch in: select, sparse_attention, qsa_prefill and the stage functions
    return torch tensors, leave a busy GPU busy (no read-back, no synchronising free), and give
    NumPy's results bitwise."""
    import torch
    p = gpu_problem(seed, rows=256)
    t = {k: torch.from_numpy(np.ascontiguousarray(v)).cuda() for k, v in p.items()
         if isinstance(v, np.ndarray)}
    sel = ("qi", "index_cache", "index_block_table", "req_ids", "positions", "seq_lens")
    batch = ("req_ids", "positions", "seq_lens")
    full = ("qi", "index_cache", "index_block_table", "q", "k_cache", "v_cache", "block_table",
            "req_ids", "positions", "seq_lens")

    def calls(a):
        tokens, counts, groups = numqsa.select(*[a[k] for k in sel])
        out, lse = numqsa.sparse_attention(a["q"], a["k_cache"], a["v_cache"], a["block_table"],
                                           tokens, counts, a["req_ids"], a["seq_lens"])
        scores = numqsa.index_scores(*[a[k] for k in sel])
        g = numqsa.topk_groups(scores, *[a[k] for k in batch])
        t2, c2 = numqsa.expand_tokens(g, *[a[k] for k in batch])
        pre = numqsa.qsa_prefill(*[a[k] for k in full])
        return [tokens, counts, groups, out, lse, g, t2, c2, *pre]

    want = calls(p)
    calls(t)                                     # compile and prepare
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))                  # ~1 s of GPU work ahead of the calls
    for _ in range(20):                          # enough fresh outputs to flush deferred frees
        got = calls(t)
    assert torch.cuda.current_stream().query() is False, "a call waited for the GPU"
    torch.cuda.synchronize()
    assert all(isinstance(x, torch.Tensor) for x in got), [type(x).__name__ for x in got]
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b.cpu().numpy())
