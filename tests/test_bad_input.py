"""The README's table of input mistakes, one test per row (simulator): a clear QSAInputError before
any launch, or a documented result that the oracle agrees with."""
import numpy as np
import pytest
from numba import cuda

import numqsa
import oracle
from numqsa import launch as L
from oracle.problems import make_problem

QSAInputError = numqsa.QSAInputError
ARGS = ("qi", "index_cache", "index_block_table", "q", "k_cache", "v_cache", "block_table",
        "req_ids", "positions", "seq_lens")


@pytest.fixture
def prob(seed):
    return make_problem([300, 40], positions=[299, 150, 39], req_ids=[0, 0, 1], page_size=16, Hq=4,
                        Hkv=2, D=16, Hi=2, Di=16, dtype=np.float16, seed=seed)


@pytest.fixture
def launches(monkeypatch):
    """Kernel launches that really ran (recorded ones do not count)."""
    from numba.cuda.simulator.kernel import FakeCUDAKernel
    L._install_hook()
    ran = []
    hooked = FakeCUDAKernel.__call__

    def counting(self, *args):
        if L._recording() is None and not self._device:
            ran.append(self.fn.__name__)
        return hooked(self, *args)
    monkeypatch.setattr(FakeCUDAKernel, "__call__", counting)
    return ran


def prefill(p, **kw):
    over = {k: kw.pop(k) for k in list(kw) if k in ARGS}
    return numqsa.qsa_prefill(*[over.get(k, p[k]) for k in ARGS], **{"Kb": 8, **kw})


def refused(p, launches, match, **kw):
    with pytest.raises(QSAInputError, match=match):
        prefill(p, **kw)
    assert launches == [], f"launched {launches} before refusing"


# -- issue 12 point 2: int64 metadata beyond int32 --------------------------------------------
@pytest.mark.parametrize("name, row, value", [("positions", 0, 2**32 + 5), ("req_ids", 2, 2**32),
                                              ("positions", 1, -2**32 + 7)])
def test_int64_beyond_int32_refused(prob, launches, name, row, value):
    a = prob[name].astype(np.int64)
    a[row] = value
    refused(prob, launches, "outside int32", **{name: a})


def test_int64_beyond_int32_on_device_saturates(prob):
    """On the device there is no host read: saturation keeps the spec's meaning (inert row)."""
    req = prob["req_ids"].astype(np.int64)
    req[2] = 2**32                                  # out of range: inert (the oracle agrees)
    d = {k: cuda.to_device(np.ascontiguousarray(prob[k])) for k in ARGS}
    d["req_ids"] = cuda.to_device(req)
    out, lse, tokens, counts = [x.copy_to_host() for x in numqsa.qsa_prefill(*[d[k] for k in ARGS],
                                                                            Kb=8)]
    ref = oracle.qsa_prefill(*[prob[k] for k in ARGS[:7]], req, prob["positions"], prob["seq_lens"],
                             Kb=8)
    assert counts[2] == 0 and ref[3][2] == 0
    assert not out[2].any() and np.isneginf(lse[2]).all()


# -- point 4: every check before any launch ---------------------------------------------------
@pytest.mark.parametrize("case, match", [
    ("q rank", "q must have rank 3"),
    ("Hq % Hkv", "not a positive multiple"),
    ("block table page id", r"block_table\[0, 3\]"),
    ("out shape", r"out\[0\] \(out\) must be float16"),
])
def test_attention_side_checks_before_any_launch(prob, launches, case, match):
    kw = {}
    if case == "q rank":
        kw["q"] = prob["q"][:, 0]
    elif case == "Hq % Hkv":
        kw["q"] = prob["q"][:, :3]
    elif case == "block table page id":
        t = prob["block_table"].copy()
        t[0, 3] = 10_000
        kw["block_table"] = t
    else:
        kw["out"] = (np.zeros((3, 4, 15), np.float16), np.zeros((3, 4), np.float32))
    refused(prob, launches, match, **kw)


# -- point 7: NumPy out= buffers are written --------------------------------------------------
@pytest.mark.parametrize("contiguous", [True, False])
def test_numpy_out_buffers_written(prob, contiguous):
    want = prefill(prob)
    if contiguous:
        out, lse = np.full((3, 4, 16), np.nan, np.float16), np.full((3, 4), np.nan, np.float32)
    else:
        out = np.full((3, 8, 16), np.nan, np.float16)[:, ::2]
        lse = np.full((3, 4, 2), np.nan, np.float32)[:, :, 0]
    got = prefill(prob, out=(out, lse))
    assert got[0] is out and got[1] is lse
    np.testing.assert_array_equal(out, want[0])
    np.testing.assert_array_equal(lse, want[1])


# -- point 8: num_groups below the longest request --------------------------------------------
def test_num_groups_too_small(prob, launches):
    refused(prob, launches, "num_groups = 5 is below the longest request's 75 groups", num_groups=5)
    with pytest.raises(QSAInputError, match="num_groups = 5 is below"):
        numqsa.select(prob["qi"], prob["index_cache"], prob["index_block_table"], prob["req_ids"],
                      prob["positions"], prob["seq_lens"], Kb=8, num_groups=5)


# -- point 9: arguments that used to fail deep inside ------------------------------------------
@pytest.mark.parametrize("kw, match", [
    (dict(Kb=8.0), r"Kb must be an integer, got 8.0 \(float\) \(use 8\)"),
    (dict(Kb=2**31 - 1), "Kb = 2147483647 is out of range"),
    (dict(Kb=2**40), "Kb = 1099511627776 is out of range"),
    (dict(Kb=0), "Kb = 0 is out of range"),
    (dict(r=0), "r = 0 is out of range"),
    (dict(r=3), "page_size 16 is not a multiple of r = 3"),
])
def test_kb_and_r(prob, launches, kw, match):
    refused(prob, launches, match, **kw)


def test_python_lists(prob, launches):
    refused(prob, launches, "q is a Python list", q=prob["q"].tolist())
    refused(prob, launches, "req_ids is a Python list", req_ids=[0, 0, 1])
    with pytest.raises(QSAInputError, match="w_q is a Python list"):
        numqsa.index_queries(prob["qi"], [0.0] * 16, prob["req_ids"], prob["positions"],
                             prob["seq_lens"], rot=8)


# -- issue 10 point 8: messages that name the real mistake ------------------------------------
def test_head_major_cache_without_transpose(prob, launches):
    k = np.ascontiguousarray(prob["k_cache"].transpose(0, 2, 1, 3))
    v = np.ascontiguousarray(prob["v_cache"].transpose(0, 2, 1, 3))
    refused(prob, launches, r"looks head-major.*transpose\(1, 2\)", k_cache=k, v_cache=v)


@pytest.mark.parametrize("od, match", [("float64", "out_dtype float64 is not supported"),
                                       ("int8", "out_dtype int8 is not supported"),
                                       ("bogus", "out_dtype 'bogus' is not a dtype")])
def test_out_dtype(prob, launches, od, match):
    refused(prob, launches, match, out_dtype=od)


def test_cuda_void16_refused(prob, launches):
    """bfloat16 seen through a bare __cuda_array_interface__ is ``<V2`` (void16): refused, naming
    what to pass instead (CUDA bfloat16 itself runs: tests/test_bf16.py)."""
    d = {k: cuda.to_device(np.ascontiguousarray(prob[k])) for k in ARGS}
    d["q"] = cuda.to_device(prob["q"].view(np.uint16).view("V2"))
    with pytest.raises(QSAInputError, match="q has dtype void16.*torch tensor itself"):
        numqsa.qsa_prefill(*[d[k] for k in ARGS], Kb=8)
    assert launches == []
