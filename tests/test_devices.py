"""Several devices without a GPU: the simulator's fake device ids (``numqsa.device.on_device``; an
array made there carries its id) drive the same code as ``cuda.gpus[i]`` does on a GPU host.

A call runs on its arrays' device and leaves the caller's current device as it was; arrays of one
call on two devices are refused, naming both, before anything launches; prepared launches,
workspaces, constants and the functional calls' wrappers are kept per device. The same on real GPUs:
``tests/test_multi_gpu.py`` (``-m multi_gpu``, two GPUs)."""
import types

import numpy as np
import pytest

import numqsa
from numqsa import device as dev
from numqsa import launch
from numqsa.jit import SIMULATOR
from numqsa.testing import assert_prefill_matches_oracle, poison
from oracle.problems import make_problem

GEOM = dict(Hi=2, Di=32, Hq=4, Hkv=2, D=32)
META = ("req_ids", "positions", "seq_lens", "block_table", "index_block_table")
LAYER = ("qi", "index_cache", "q", "k_cache", "v_cache")
FULL = ("qi", "index_cache", "index_block_table", "q", "k_cache", "v_cache", "block_table",
        "req_ids", "positions", "seq_lens")

sim_only = pytest.mark.skipif(not SIMULATOR, reason="fake device ids exist in the simulator only")


def problem(seed):
    return make_problem([70, 41], positions=[69, 50, 40, -1, 3], req_ids=[0, 0, 1, 0, 5],
                        page_size=16, dtype=np.float16, seed=seed, **GEOM)


def on(device, p, names):
    """The arrays ``names`` of ``p``, copied to (simulated) device ``device``."""
    with dev.on_device(device):
        return {n: dev.to_device(np.ascontiguousarray(p[n])) for n in names}


def host(xs):
    return [x.copy_to_host() for x in xs]


@sim_only
def test_run_on_another_device_matches_and_restores(seed, api_attention, monkeypatch):
    p = problem(seed)
    monkeypatch.setattr(dev, "_CONSTANTS", {})
    seen = []
    replay = launch.Program.__call__

    def spy(self, *args, **kwargs):
        seen.append(dev.current_device())
        return replay(self, *args, **kwargs)
    monkeypatch.setattr(launch.Program, "__call__", spy)
    w0 = numqsa.QSAPrefillWrapper(Kb=5, **GEOM)
    w0.plan(*on(0, p, META).values())
    want = host(w0.run(*on(0, p, LAYER).values(), return_selection=True))
    w1 = numqsa.QSAPrefillWrapper(Kb=5, **GEOM)
    w1.plan(*on(1, p, META).values())
    got = w1.run(*on(1, p, LAYER).values(), return_selection=True)
    assert dev.current_device() == 0                       # the caller's device, as it was
    assert seen == [0, 1]                                  # each run launched on its arrays' device
    assert [dev.array_device(x, "numba") for x in got] == [1] * 4
    got = host(got)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)
    assert_prefill_matches_oracle(p, *got, Kb=5)
    # what the wrapper keeps is keyed by device: prepared launches, buffers, streams, constants
    assert {k[1] for k in w0._programs} == {0} and {k[1] for k in w1._programs} == {1}
    assert {k[0] for k in w1._ws._buffers} == {1}
    assert {k[0] for k in w1._streams} == {1}
    assert {k[0] for k in dev._CONSTANTS} == {0, 1}


@sim_only
def test_mixed_devices_refused_before_any_launch(seed):
    p = problem(seed)
    a0, a1 = on(0, p, FULL), on(1, p, FULL)
    w = numqsa.QSAPrefillWrapper(Kb=5, **GEOM).plan(*[a0[n] for n in META])
    with dev.on_device(0):
        bufs = [dev.to_device(poison(np.empty((5, 4, 32), np.float16))),
                dev.to_device(poison(np.empty((5, 4), np.float32)))]
    layer = [a0[n] for n in LAYER]
    layer[LAYER.index("k_cache")] = a1["k_cache"]
    with pytest.raises(numqsa.QSAInputError, match=r"q is on cuda:0 and k_cache on cuda:1"):
        w.run(*layer, out=bufs)
    assert w.num_programs == 0
    assert all(np.isnan(b.copy_to_host()).all() for b in bufs)   # nothing ran
    with dev.on_device(1):
        out1 = dev.to_device(poison(np.empty((5, 4, 32), np.float16)))
    with pytest.raises(numqsa.QSAInputError,
                       match=r"q is on cuda:0 and out\[0\] \(out\) on cuda:1"):
        w.run(*[a0[n] for n in LAYER], out=(out1, bufs[1]))
    # the functional calls (their wrapper's plan checks the metadata, its run the layer's arrays)
    # and the single-stage functions check every array (and out=) before any launch
    args = [a0[n] for n in FULL]
    args[FULL.index("block_table")] = a1["block_table"]
    with pytest.raises(numqsa.QSAInputError, match=r"req_ids is on cuda:0 and block_table on cuda:1"):
        numqsa.qsa_prefill(*args, Kb=5)
    args = [a0[n] for n in FULL]
    args[FULL.index("v_cache")] = a1["v_cache"]
    with pytest.raises(numqsa.QSAInputError, match=r"q is on cuda:0 and v_cache on cuda:1"):
        numqsa.qsa_prefill(*args, Kb=5)
    with pytest.raises(numqsa.QSAInputError, match=r"qi is on cuda:0 and index_cache on cuda:1"):
        numqsa.index_scores(a0["qi"], a1["index_cache"], a0["index_block_table"],
                            a0["req_ids"], a0["positions"], a0["seq_lens"])
    with pytest.raises(numqsa.QSAInputError, match=r"groups is on cuda:1 and out\[0\] on cuda:0"):
        with dev.on_device(1):
            g = dev.to_device(np.full((5, 5), -1, np.int32))
        numqsa.expand_tokens(g, p["req_ids"], p["positions"], p["seq_lens"],
                             out=(a0["block_table"], None))
    assert dev.current_device() == 0


@sim_only
def test_plan_device_is_the_run_device(seed, api_attention):
    p = problem(seed)
    w = numqsa.QSAPrefillWrapper(Kb=5, **GEOM)
    with dev.on_device(1):
        w.plan(*[p[n] for n in META])              # NumPy metadata: copied to the current device
    assert w._device == 1 and dev.current_device() == 0
    with pytest.raises(numqsa.QSAInputError,
                       match=r"q is on cuda:0 but this plan's metadata .* is on cuda:1"):
        w.run(*on(0, p, LAYER).values())
    w.plan(*on(1, p, META).values())
    with pytest.raises(numqsa.QSAInputError, match=r"q is on cuda:0 but this plan's req_ids is on "
                                                   r"cuda:1: a wrapper runs on the device it was "
                                                   r"planned on"):
        w.run(*on(0, p, LAYER).values())
    # NumPy layers follow the plan: copied to its device, run there, copied back
    out = w.run(*[p[n] for n in LAYER], return_selection=True)
    assert all(isinstance(x, np.ndarray) for x in out)
    assert_prefill_matches_oracle(p, *out, Kb=5)
    assert {k[1] for k in w._programs} == {1} and {k[0] for k in w._ws._buffers} == {1}
    assert dev.current_device() == 0


@sim_only
def test_functional_calls_keep_wrappers_and_outputs_per_device(seed, api_attention):
    p = problem(seed)
    ws = numqsa.Workspace()
    got = {}
    for d in (0, 1):
        a = on(d, p, FULL)
        res = numqsa.qsa_prefill(*[a[n] for n in FULL], Kb=5, workspace=ws)
        assert [dev.array_device(x, "numba") for x in res] == [d] * 4
        got[d] = host(res)
        tokens, counts, _ = numqsa.select(*[a[n] for n in ("qi", "index_cache",
                                                               "index_block_table", "req_ids",
                                                               "positions", "seq_lens")], Kb=5)
        out, lse = numqsa.sparse_attention(a["q"], a["k_cache"], a["v_cache"], a["block_table"],
                                           tokens, counts, a["req_ids"], a["seq_lens"])
        assert {dev.array_device(x, "numba") for x in (tokens, counts, out, lse)} == {d}
    for a, b in zip(got[0], got[1]):
        np.testing.assert_array_equal(a, b)
    assert_prefill_matches_oracle(p, *got[1], Kb=5)
    assert sorted(k[2] for k in ws._wrappers) == [0, 1]       # (mode, geometry, device, ...)
    assert sorted(k[0] for k in ws._outs) == [0, 1]
    assert dev.current_device() == 0


@sim_only
def test_current_device_restored_on_errors_and_nesting(seed):
    p = problem(seed)
    a1 = on(1, p, FULL)
    w = numqsa.QSAPrefillWrapper(Kb=5, **GEOM).plan(*[a1[n] for n in META])
    wrong = dict(a1)
    with dev.on_device(1):
        wrong["q"] = dev.to_device(np.zeros((5, 8, 32), np.float16))        # Hq 8, not 4
    with pytest.raises(numqsa.QSAInputError, match="Hq = 8"):
        w.run(*[wrong[n] for n in LAYER])                  # refused inside the device-1 scope
    assert dev.current_device() == 0
    with dev.on_device(1):
        with dev.on_device(0):
            assert dev.current_device() == 0
            a0 = on(0, p, FULL)
            numqsa.index_scores(*[a0[n] for n in ("qi", "index_cache", "index_block_table",
                                                  "req_ids", "positions", "seq_lens")])
            assert dev.current_device() == 0
        assert dev.current_device() == 1
    assert dev.current_device() == 0


class _FakeTorch:
    """Enough of a CUDA torch tensor for the device checks (its module names torch)."""
    __module__ = "torch.fake"
    is_cuda = True
    shape = (3,)

    def __init__(self, device):
        self.device_index = device

    def get_device(self):
        return self.device_index


def test_same_device_names_both_arrays():
    assert dev.same_device([("a", np.zeros(3)), ("b", None), ("c", 4), ("d", "x")]) is None
    assert dev.same_device([("q", _FakeTorch(1)), ("k", np.zeros(2)), ("v", _FakeTorch(1))]) == 1
    with pytest.raises(numqsa.QSAInputError, match=r"q is on cuda:0 and v_cache on cuda:1: the "
                                                   r"arrays of one call must be on one device"):
        dev.same_device([("q", _FakeTorch(0)), ("k_cache", _FakeTorch(0)),
                         ("v_cache", _FakeTorch(1))])


def test_gpu_branches_with_a_fake_driver(monkeypatch):
    """The GPU code paths of ``current_device``, ``array_device`` and ``on_device`` against a fake
    driver: one ``cuCtxGetDevice`` per check, numba's ``cuda.gpus[i]`` only when the device differs,
    the device of a numba array or CUDA-array-interface producer read from its pointer, DLPack's
    device from ``__dlpack_device__``."""
    ok = object()
    state = {"current": 0, "calls": 0}
    owner = {0x1000: 0, 0x2000: 1}

    class Driver:
        CUpointer_attribute = types.SimpleNamespace(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL="ordinal")

        @staticmethod
        def cuCtxGetDevice():
            state["calls"] += 1
            return ok, state["current"]

        @staticmethod
        def cuPointerGetAttribute(attribute, ptr):
            assert attribute == "ordinal"
            return (ok, owner[ptr]) if ptr in owner else ("invalid", 0)

    gpus = {0: "gpus[0]", 1: "gpus[1]"}
    monkeypatch.setattr(dev, "SIMULATOR", False)
    monkeypatch.setattr(dev, "_driver", [Driver, ok])
    monkeypatch.setattr(dev, "cuda", types.SimpleNamespace(gpus=gpus))
    assert dev.on_device(0) is dev._SAME and state["calls"] == 1
    assert dev.on_device(None) is dev._SAME and state["calls"] == 1
    assert dev.on_device(1) == "gpus[1]"
    state["current"] = 1
    assert dev.on_device(1) is dev._SAME and dev.on_device(0) == "gpus[0]"

    class Numba:
        def __init__(self, ptr):
            self.device_ctypes_pointer = types.SimpleNamespace(value=ptr)

    class Interface:
        def __init__(self, ptr):
            self.__cuda_array_interface__ = {"data": (ptr, False)}

    class DLPack:
        def __dlpack_device__(self):
            return 2, 5

    assert dev.array_device(Numba(0x2000), "numba") == 1
    assert dev.array_device(Numba(0), "numba") is None              # an empty array
    assert dev.array_device(Interface(0x1000), "cuda") == 0
    assert dev.array_device(Interface(0x3000), "cuda") is None      # unknown to the driver
    assert dev.array_device(DLPack(), "cuda") == 5
    assert dev.array_device(_FakeTorch(3), "torch") == 3
    assert dev.array_device(np.zeros(2), "numpy") is None
