"""numqsa on two GPUs of one host (``pytest -m multi_gpu``; skipped with fewer than two GPUs).

In one process: arrays on ``cuda:1`` while the caller's current device is 0 run on ``cuda:1`` (its
context, its current stream), bitwise equal to ``cuda:0``, and leave the current device at 0;
wrappers of the two devices alternate layer by layer as under HF's ``device_map``; arrays of one
call on two devices are refused before any launch; CUDA graphs capture and replay on ``cuda:1``;
torch, CuPy, numba and DLPack arrays alike. One process per GPU: ``tests/multi_gpu_torchrun.py`` under ``torchrun --nproc_per_node 2``, each
rank's output bitwise equal to the one-GPU result of its batch. The HF model split by
``device_map`` and under ``tp_plan="auto"``: ``tests/test_hf_transformers.py``'s ``multi_gpu``
tests. The same bookkeeping without GPUs (fake device ids): ``tests/test_devices.py``.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import numqsa
from test_wrapper_gpu import LAYER, META, gpu_problem, wrapper

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu]
SCRIPT = Path(__file__).with_name("multi_gpu_torchrun.py")
FULL = ("qi", "index_cache", "index_block_table", "q", "k_cache", "v_cache", "block_table",
        "req_ids", "positions", "seq_lens")


def on(torch, p, names, device):
    return [torch.from_numpy(np.ascontiguousarray(p[k])).to(device) for k in names]


def host(xs):
    return [x.cpu().numpy() for x in xs]


def current_devices(torch):
    """The caller's current device as torch and as numba see it."""
    from numba import cuda
    return torch.cuda.current_device(), cuda.get_current_device().id


def test_multi_gpu_wrapper_on_second_device_bitwise(seed):
    import torch
    torch.cuda.set_device(0)
    p = gpu_problem(seed)
    want = host(wrapper().plan(*on(torch, p, META, "cuda:0")).run(*on(torch, p, LAYER, "cuda:0"),
                                                                 return_selection=True))
    w = wrapper().plan(*on(torch, p, META, "cuda:1"))
    for stream in (None, torch.cuda.Stream(device=1)):   # device 1's current stream, a given one
        got = w.run(*on(torch, p, LAYER, "cuda:1"), return_selection=True, stream=stream)
        torch.cuda.synchronize(1)
        assert current_devices(torch) == (0, 0)
        assert all(x.device == torch.device("cuda:1") for x in got)
        for a, b in zip(want, host(got)):
            np.testing.assert_array_equal(a, b)
    assert {key[1] for key in w._programs} == {1}
    assert all(prog.fast for prog in w._programs.values())


def test_multi_gpu_device_map_pattern_alternates_devices(seed):
    """One wrapper per device, the layers alternating between them (HF ``device_map``): each layer's
    output is its one-GPU output; a wrapper planned on cuda:0 refuses cuda:1's layer."""
    import torch
    torch.cuda.set_device(0)
    ps = [gpu_problem(seed + k, rows=256) for k in range(4)]
    meta = {d: on(torch, ps[0], META, f"cuda:{d}") for d in (0, 1)}
    for k in range(1, 4):
        for n in META:
            ps[k][n] = ps[0][n]
    want = [host(wrapper().plan(*meta[0]).run(*on(torch, p, LAYER, "cuda:0"))) for p in ps]
    ws = {d: wrapper().plan(*meta[d]) for d in (0, 1)}
    for k, p in enumerate(ps):
        d = k % 2
        got = host(ws[d].run(*on(torch, p, LAYER, f"cuda:{d}")))
        for a, b in zip(want[k], got):
            np.testing.assert_array_equal(a, b)
    assert current_devices(torch) == (0, 0)
    with pytest.raises(numqsa.QSAInputError, match=r"q is on cuda:1 but this plan's req_ids is on "
                                                   r"cuda:0"):
        ws[0].run(*on(torch, ps[0], LAYER, "cuda:1"))


def test_multi_gpu_functional_and_stage_calls_bitwise(seed):
    import torch
    torch.cuda.set_device(0)
    p = gpu_problem(seed, rows=256)
    sel = ("qi", "index_cache", "index_block_table", "req_ids", "positions", "seq_lens")
    batch = ("req_ids", "positions", "seq_lens")

    def calls(a):
        tokens, counts, groups = numqsa.select(*[a[k] for k in sel])
        out, lse = numqsa.sparse_attention(a["q"], a["k_cache"], a["v_cache"], a["block_table"],
                                           tokens, counts, a["req_ids"], a["seq_lens"])
        scores = numqsa.index_scores(*[a[k] for k in sel])
        g = numqsa.topk_groups(scores, *[a[k] for k in batch])
        t2, c2 = numqsa.expand_tokens(g, *[a[k] for k in batch])
        pre = numqsa.qsa_prefill(*[a[k] for k in FULL])
        return [tokens, counts, groups, out, lse, g, t2, c2, *pre]

    names = [k for k, v in p.items() if isinstance(v, np.ndarray)]
    res = {d: calls(dict(zip(names, on(torch, p, names, f"cuda:{d}")))) for d in (0, 1)}
    assert current_devices(torch) == (0, 0)
    assert all(x.device == torch.device("cuda:1") for x in res[1])
    for a, b in zip(host(res[0]), host(res[1])):
        np.testing.assert_array_equal(a, b)


def test_multi_gpu_numba_arrays_on_second_device(seed):
    import torch
    from numba import cuda
    torch.cuda.set_device(0)
    p = gpu_problem(seed, rows=256)
    want = host(wrapper().plan(*on(torch, p, META, "cuda:0")).run(*on(torch, p, LAYER, "cuda:0")))
    with cuda.gpus[1]:
        meta, layer = ([cuda.to_device(np.ascontiguousarray(p[k])) for k in names]
                       for names in (META, LAYER))
    got = wrapper().plan(*meta).run(*layer)
    assert current_devices(torch) == (0, 0)
    with cuda.gpus[1]:
        got = [x.copy_to_host() for x in got]
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)


class _DLPackOnly:
    """A DLPack producer and nothing else (numqsa reads it through ``StridedMemoryView``)."""

    def __init__(self, t):
        self.t, self.shape, self.dtype = t, tuple(t.shape), np.dtype(str(t.dtype)[6:])

    def __dlpack__(self, *args, **kwargs):
        return self.t.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


def test_multi_gpu_cupy_and_dlpack_on_second_device(seed):
    """CuPy arrays made on device 1 come back as CuPy arrays of device 1; DLPack producers of
    device 1 as numba arrays there; both bitwise equal to cuda:0, the current device left at 0."""
    import torch
    from numba import cuda
    torch.cuda.set_device(0)
    p = gpu_problem(seed, rows=256)
    want = host(wrapper().plan(*on(torch, p, META, "cuda:0")).run(*on(torch, p, LAYER, "cuda:0")))
    cupy = pytest.importorskip("cupy")
    with cupy.cuda.Device(1):
        meta, layer = ([cupy.asarray(np.ascontiguousarray(p[k])) for k in names]
                       for names in (META, LAYER))
    got = wrapper().plan(*meta).run(*layer)
    assert current_devices(torch) == (0, 0) and cupy.cuda.Device().id == 0
    assert all(isinstance(x, cupy.ndarray) and x.device.id == 1 for x in got)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, cupy.asnumpy(b))
    layer = [_DLPackOnly(t) for t in on(torch, p, LAYER, "cuda:1")]
    got = wrapper().plan(*on(torch, p, META, "cuda:1")).run(*layer)
    torch.cuda.synchronize(1)
    assert current_devices(torch) == (0, 0)
    with cuda.gpus[1]:
        got = [x.copy_to_host() for x in got]
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)


def test_multi_gpu_mixed_devices_refused_before_any_launch(seed):
    import torch
    p = gpu_problem(seed, rows=256)
    w = wrapper().plan(*on(torch, p, META, "cuda:0"))
    layer = on(torch, p, LAYER, "cuda:0")
    layer[LAYER.index("v_cache")] = layer[LAYER.index("v_cache")].to("cuda:1")
    o = torch.full((256, 6, 256), float("nan"), dtype=torch.float16, device="cuda:0")
    lse = torch.full((256, 6), float("nan"), dtype=torch.float32, device="cuda:0")
    with pytest.raises(numqsa.QSAInputError, match=r"q is on cuda:0 and v_cache on cuda:1"):
        w.run(*layer, out=(o, lse))
    torch.cuda.synchronize(0)
    assert torch.isnan(o).all() and torch.isnan(lse).all() and w.num_programs == 0
    a = dict(zip(FULL, on(torch, p, FULL, "cuda:0")))
    a["block_table"] = a["block_table"].to("cuda:1")
    # the functional call runs on qi's device; its wrapper's plan checks the metadata
    with pytest.raises(numqsa.QSAInputError, match=r"req_ids is on cuda:0 and block_table on cuda:1"):
        numqsa.qsa_prefill(*[a[k] for k in FULL])


def test_multi_gpu_graph_capture_and_replay_on_second_device(seed):
    """test_wrapper_gpu.py::test_gpu_graph_replay_bitwise, on cuda:1: capture on a cuda:1 stream,
    new inputs written into the same tensors, replay; bitwise equal to eager on cuda:0."""
    import torch
    torch.cuda.set_device(0)
    p, p2 = gpu_problem(seed), gpu_problem(seed + 1)
    with torch.cuda.device(1):
        meta, layer = on(torch, p, META, "cuda:1"), on(torch, p, LAYER, "cuda:1")
        s = torch.cuda.Stream()
        w = wrapper()
        o = torch.empty(1024, 6, 256, dtype=torch.float16, device="cuda:1")
        lse = torch.empty(1024, 6, dtype=torch.float32, device="cuda:1")
        with torch.cuda.stream(s):
            w.plan(*meta, stream=s)
            w.run(*layer, out=(o, lse), stream=s)      # compile and prepare outside the capture
        s.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            w.run(*layer, out=(o, lse), stream=s)
        for name in ("qi", "q"):
            layer[LAYER.index(name)].copy_(torch.from_numpy(p2[name]))
        g.replay()
        torch.cuda.synchronize(1)
    assert current_devices(torch) == (0, 0)
    replayed = host([o, lse])
    p2m = dict(p2, **{k: p[k] for k in META + ("index_cache", "k_cache", "v_cache")})
    eager = host(wrapper().plan(*on(torch, p2m, META, "cuda:0")).run(*on(torch, p2m, LAYER,
                                                                           "cuda:0")))
    for a, b in zip(eager, replayed):
        np.testing.assert_array_equal(a, b)


def test_multi_gpu_torchrun_one_process_per_gpu(seed, tmp_path):
    """``torchrun --nproc_per_node 2 tests/multi_gpu_torchrun.py``: each rank sets its device and
    runs the wrapper on its own batch (seed + rank); each rank's output is bitwise the one-GPU
    output of that batch, computed here on cuda:0."""
    import torch
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(SCRIPT), "--out", str(tmp_path), "--seed", str(seed), "--parts", "wrapper"]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    for rank in (0, 1):
        info = json.loads((tmp_path / f"wrapper-rank{rank}.json").read_text())
        assert info["device"] == rank and info["current_device"] == rank, info
        got = np.load(tmp_path / f"wrapper-rank{rank}.npz")
        p = gpu_problem(seed + rank)
        want = host(wrapper().plan(*on(torch, p, META, "cuda:0")).run(
            *on(torch, p, LAYER, "cuda:0"), return_selection=True))
        for name, a in zip(("out", "lse", "tokens", "counts"), want):
            np.testing.assert_array_equal(a, got[name], err_msg=f"rank {rank}: {name}")
