"""``qsa_prefill`` end to end: against the oracle's pipeline, with a reusable workspace, with PyTorch
and CuPy arrays, and captured in a CUDA graph (the last three on a GPU)."""
import numpy as np
import pytest

import numqsa
from numqsa.testing import assert_prefill_matches_oracle, poison
from oracle.problems import make_problem

ARGS = ("qi", "index_cache", "index_block_table", "q", "k_cache", "v_cache", "block_table",
        "req_ids", "positions", "seq_lens")


def args(p):
    return [p[k] for k in ARGS]


def host(x):
    """NumPy copy of a NumPy, numba, torch or CuPy result."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "copy_to_host"):
        return x.copy_to_host()
    if hasattr(x, "get"):
        return x.get()
    return x.cpu().numpy()


@pytest.mark.parametrize("layout", ["contiguous", "interleaved"])
def test_prefill_numpy_matches_oracle(seed, layout, api_attention):
    p = make_problem([70, 41, 9], positions=[69, 68, 50, 40, 40, 2, -1, 3], req_ids=[0, 0, 0, 1, 1, 2, 0, 5],
                     page_size=16, Hq=4, Hkv=2, D=32, Hi=2, Di=32, dtype=np.float16, layout=layout,
                     seed=seed)
    bufs = (poison(np.empty((8, 4, 32), np.float16)), poison(np.empty((8, 4), np.float32)))
    result = numqsa.qsa_prefill(*args(p), Kb=6, out=bufs)
    assert all(isinstance(x, np.ndarray) for x in result) and result[0] is bufs[0]
    assert_prefill_matches_oracle(p, *result, Kb=6)
    out, lse = result[:2]
    assert not out[6:].any() and np.isneginf(lse[6:]).all()       # inert rows


def test_workspace_reuses_its_buffers(seed, monkeypatch, api_attention):
    from numba import cuda
    from numqsa import device as dev
    p = make_problem([90], rows_per_req=[5], page_size=16, Hq=2, Hkv=1, D=32, Hi=2, Di=32,
                     dtype=np.float16, seed=seed)
    d = [cuda.to_device(np.ascontiguousarray(a)) for a in args(p)]
    ws = numqsa.Workspace()
    first = [x.copy_to_host() for x in numqsa.qsa_prefill(*d, Kb=4, workspace=ws, num_groups=22)]
    allocated = []
    real_empty = dev.empty
    monkeypatch.setattr(dev, "empty", lambda *a, **k: allocated.append(a) or real_empty(*a, **k))
    second = [x.copy_to_host() for x in numqsa.qsa_prefill(*d, Kb=4, workspace=ws, num_groups=22)]
    assert allocated == [], f"a second call allocated {allocated}"
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    assert ws.nbytes > 0


# ------------------------------------------------------------------------------ GPU tier

def _gpu_problem(seed, rows=1024, context=8192):
    from numqsa.__main__ import correlated_queries
    p = make_problem([context], rows_per_req=[rows], page_size=64, dtype=np.float16, seed=seed)
    p["qi"] = correlated_queries(np.random.default_rng(seed), rows, 4, 128).astype(np.float16)
    return p


@pytest.mark.gpu
def test_gpu_prefill_matches_oracle(seed):
    from numba import cuda
    p = _gpu_problem(seed)
    d = [cuda.to_device(np.ascontiguousarray(a)) for a in args(p)]
    result = [x.copy_to_host() for x in numqsa.qsa_prefill(*d)]
    rows = np.sort(np.random.default_rng(seed).choice(1024, 64, replace=False))
    sub = {k: (v[rows] if k in ("qi", "q", "req_ids", "positions") else v) for k, v in p.items()}
    assert_prefill_matches_oracle(sub, *[x[rows] for x in result], Kb=512)


@pytest.mark.gpu
@pytest.mark.parametrize("peer", ["torch", "cupy"])
def test_gpu_foreign_arrays_bitwise(seed, peer):
    """PyTorch / CuPy arrays, used in place on their own stream, give the numba arrays' bits."""
    from numba import cuda
    lib = __import__("torch") if peer == "torch" else pytest.importorskip(peer)   # torch: required
    p = _gpu_problem(seed)
    want = [x.copy_to_host() for x in numqsa.qsa_prefill(*[cuda.to_device(np.ascontiguousarray(a))
                                                              for a in args(p)])]
    if peer == "torch":
        arrs = [lib.from_numpy(np.ascontiguousarray(a)).cuda() for a in args(p)]
        stream = lib.cuda.Stream()
    else:
        arrs = [lib.asarray(np.ascontiguousarray(a)) for a in args(p)]
        stream = lib.cuda.Stream(non_blocking=True)
    got = numqsa.qsa_prefill(*arrs, stream=stream)
    stream.synchronize()
    assert all(type(x) is type(arrs[0]) for x in got), "arrays come back as they came in"
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, host(b))


@pytest.mark.gpu
@pytest.mark.device_alone
def test_gpu_workspace_allocates_nothing(seed, monkeypatch):
    from numba import cuda
    from numba.cuda.cudadrv import driver
    p = _gpu_problem(seed)
    d = [cuda.to_device(np.ascontiguousarray(a)) for a in args(p)]
    ws = numqsa.Workspace()
    numqsa.qsa_prefill(*d, workspace=ws, num_groups=2048, validate=False)
    cuda.synchronize()
    calls = []
    real = driver.Context.memalloc
    monkeypatch.setattr(driver.Context, "memalloc", lambda self, n: calls.append(n) or real(self, n))
    ctx = cuda.current_context()
    with cuda.defer_cleanup():
        free_before = ctx.get_memory_info().free
        numqsa.qsa_prefill(*d, workspace=ws, num_groups=2048, validate=False)
        cuda.synchronize()
        free_after = ctx.get_memory_info().free
    assert calls == [], f"device allocations in a second call: {calls}"
    assert free_after == free_before, f"free device memory moved by {free_before - free_after} B"


@pytest.mark.gpu
def test_gpu_graph_replay_bitwise(seed):
    """Captured once with torch.cuda.graph, replayed on new inputs: the eager result's bits."""
    import torch
    p = _gpu_problem(seed)
    t = [torch.from_numpy(np.ascontiguousarray(a)).cuda() for a in args(p)]
    ws = numqsa.Workspace()
    s = torch.cuda.Stream()
    kw = dict(workspace=ws, num_groups=2048, validate=False, stream=s)
    with torch.cuda.stream(s):
        numqsa.qsa_prefill(*t, **kw)                      # compile and allocate outside the capture
    s.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        captured = numqsa.qsa_prefill(*t, **kw)
    q2 = _gpu_problem(seed + 1)
    for name in ("qi", "q"):                               # new inputs, same buffers
        t[ARGS.index(name)].copy_(torch.from_numpy(q2[name]))
    g.replay()
    torch.cuda.synchronize()
    replayed = [host(x) for x in captured]
    eager = numqsa.qsa_prefill(*t, **{**kw, "workspace": numqsa.Workspace()})
    s.synchronize()               # the results are s's: read them only once s has finished
    eager = [host(x) for x in eager]
    for a, b in zip(eager, replayed):
        np.testing.assert_array_equal(a, b)


def test_stream_arguments():
    """``stream=`` takes None, a numba stream, a raw handle, or torch/CuPy-style stream objects."""
    from numba import cuda
    from numqsa.device import resolve_stream

    class TorchLike:
        cuda_stream = 0

    class CupyLike:
        ptr = 0

    s = cuda.stream()
    assert resolve_stream(s) is s
    for arg in (None, 0, TorchLike(), CupyLike()):
        assert hasattr(resolve_stream(arg), "synchronize")
