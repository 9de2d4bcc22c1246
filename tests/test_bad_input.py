"""The table of input mistakes (docs/usage.md, "Data model"), one test per row (simulator): a clear
QSAInputError before any launch, or a documented result that the oracle agrees with."""
import numpy as np
import pytest
from numba import cuda

import numqsa
import oracle
from numqsa import launch as L
from numqsa.testing import assert_matches_oracle, poison
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


def test_int64_beyond_int32_on_device_saturates(prob, api_attention):
    """On the device there is no host read: saturation keeps the spec's meaning -- req_ids 2^32 and
    positions -2^32 + 7 are inert rows, positions 2^32 + 5 a stale row (clamped), as the oracle
    says of the int64 values themselves."""
    req, pos = prob["req_ids"].astype(np.int64), prob["positions"].astype(np.int64)
    req[2] = 2**32
    pos[0], pos[1] = 2**32 + 5, -2**32 + 7
    d = {k: cuda.to_device(np.ascontiguousarray(prob[k])) for k in ARGS}
    d["req_ids"], d["positions"] = cuda.to_device(req), cuda.to_device(pos)
    bufs = (poison(cuda.device_array((3, 4, 16), np.float16)),
            poison(cuda.device_array((3, 4), np.float32)))
    out, lse, tokens, counts = [x.copy_to_host() for x in numqsa.qsa_prefill(
        *[d[k] for k in ARGS], Kb=8, out=bufs)]
    ref = oracle.qsa_prefill(*[prob[k] for k in ARGS[:7]], req, pos, prob["seq_lens"], Kb=8)
    np.testing.assert_array_equal(counts, ref[3])
    assert counts[1] == 0 and counts[2] == 0 and counts[0] > 0
    ref_out, ref_lse = oracle.sparse_attention(prob["q"], prob["k_cache"], prob["v_cache"],
                                               prob["block_table"], tokens, counts, req,
                                               prob["seq_lens"])
    assert_matches_oracle(out, ref_out, dtype="float16", what="out")
    assert_matches_oracle(lse, ref_lse, dtype="float32", what="lse")


def test_int64_device_metadata_of_the_wrapper_saturates(prob):
    """The wrapper's plan converts device int64 metadata on the device too (no read back)."""
    req, pos = prob["req_ids"].astype(np.int64), prob["positions"].astype(np.int64)
    pos[0], req[2] = 2**31, -2**31 - 1                  # stale (clamped); inert
    meta = [cuda.to_device(np.ascontiguousarray(a)) for a in
            (req, pos, prob["seq_lens"], prob["block_table"], prob["index_block_table"])]
    w = numqsa.QSAPrefillWrapper(Hi=2, Di=16, Hq=4, Hkv=2, D=16, Kb=8).plan(*meta)
    tokens, counts, _ = w.run_select(cuda.to_device(prob["qi"]), cuda.to_device(prob["index_cache"]))
    ref = oracle.select(prob["qi"], prob["index_cache"], prob["index_block_table"], req, pos,
                        prob["seq_lens"], Kb=8)
    np.testing.assert_array_equal(counts.copy_to_host(), ref[1])
    assert ref[1][2] == 0 and ref[1][0] > 0


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
def test_numpy_out_buffers_written(prob, contiguous, api_attention):
    """NaN-poisoned buffers, every element written: the result in them matches the oracle."""
    if contiguous:
        out, lse = np.full((3, 4, 16), np.nan, np.float16), np.full((3, 4), np.nan, np.float32)
    else:
        out = np.full((3, 8, 16), np.nan, np.float16)[:, ::2]
        lse = np.full((3, 4, 2), np.nan, np.float32)[:, :, 0]
    got = prefill(prob, out=(out, lse))
    assert got[0] is out and got[1] is lse
    ref_out, ref_lse = oracle.sparse_attention(prob["q"], prob["k_cache"], prob["v_cache"],
                                               prob["block_table"], got[2], got[3],
                                               prob["req_ids"], prob["seq_lens"])
    assert_matches_oracle(out, ref_out, dtype="float16", what="out")
    assert_matches_oracle(lse, ref_lse, dtype="float32", what="lse")


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


@pytest.mark.parametrize("page_size, match", [(0, "page_size = 0 is out of range"),
                                               (-4, "page_size = -4 is out of range"),
                                               (16.0, r"page_size must be an integer, got 16.0"),
                                               (18, "page_size 18 is not a multiple of r = 4")])
def test_page4_plan_page_size(prob, launches, page_size, match):
    """``page4_plan``'s page size, an argument of its own: a positive multiple of ``r`` (0 and
    negative multiples of 4 passed the modulo check before session 23), in numqsa and the oracle."""
    tokens, counts = oracle.select(prob["qi"], prob["index_cache"], prob["index_block_table"],
                                   prob["req_ids"], prob["positions"], prob["seq_lens"], Kb=8)[:2]
    args = (tokens, counts, prob["block_table"], prob["req_ids"], prob["seq_lens"])
    for api in (numqsa, oracle):
        with pytest.raises(QSAInputError, match=match):
            api.page4_plan(*args, page_size=page_size, num_pages=prob["k_cache"].shape[0])
    assert launches == [], f"launched {launches} before refusing"


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


# -- issue 26 point 7: the rest of docs/usage.md's table --------------------------------------------
@pytest.mark.parametrize("name, dtype", [("q", np.float64), ("k_cache", np.int8), ("qi", np.float64),
                                         ("index_cache", np.int8)])
def test_data_dtype_refused(prob, launches, name, dtype):
    kw = {name: prob[name].astype(dtype)}
    if name == "k_cache":
        kw["v_cache"] = prob["v_cache"].astype(dtype)
    refused(prob, launches, rf"{name} has dtype {np.dtype(dtype).name}; the kernels take float16, "
            rf"bfloat16, float32", **kw)


@pytest.mark.parametrize("name, match", [
    ("k_cache", r"k_cache must have rank 4 \[num_pages, page_size, Hkv, D\], got shape \(16, 2, 16\)"),
    ("qi", r"qi must have rank 3 \[rows, Hi, Di\], got shape \(2, 16\)"),
    ("index_cache", r"index_cache must have rank 3 \[num_idx_pages, idx_page_rows, Di\]"),
    ("block_table", r"block_table must have rank 2 \[num_reqs, cols\], got shape \(19,\)"),
    ("index_block_table", r"index_block_table must have rank 2 \[num_reqs, cols\], got shape \(1, 2, 19\)"),
])
def test_wrong_rank_refused(prob, launches, name, match):
    bad = prob[name][None] if name == "index_block_table" else prob[name][0]
    kw = {name: bad}
    if name == "k_cache":
        kw["v_cache"] = prob["v_cache"][0]
    refused(prob, launches, match, **kw)


class _CPUTensor:
    """What numqsa sees of a CPU torch tensor (when torch is not installed): a torch type whose
    ``is_cuda`` is False."""
    is_cuda = False

    def __init__(self, a):
        self.shape, self.dtype = a.shape, a.dtype


_CPUTensor.__module__ = "torch"


def test_cpu_torch_tensor_refused(prob, launches):
    try:
        import torch
        q = torch.from_numpy(prob["q"])
    except ImportError:
        q = _CPUTensor(prob["q"])
    refused(prob, launches, r"q is a CPU torch tensor: pass q.cuda\(\) .* or q.numpy\(\)", q=q)


@pytest.mark.parametrize("kw, match", [
    (dict(Kb=2**20 + 1), r"Kb = 1048577 is out of range: it must be in 1..1048576"),
    (dict(Kb=2**20, r=3), "page_size 16 is not a multiple of r = 3"),       # Kb at its bound passes
    (dict(r=1024), "page_size 16 is not a multiple of r = 1024"),           # r at its bound passes
    (dict(r=1025), r"r = 1025 is out of range: it must be in 1..1024"),
])
def test_kb_and_r_bounds(prob, launches, kw, match):
    refused(prob, launches, match, **kw)


@pytest.mark.parametrize("which, match", [(0, r"out\[0\] \(out\) must be float16 \(3, 4, 16\), got float32"),
                                          (1, r"out\[1\] \(lse\) must be float32 \(3, 4\), got float16")])
def test_out_of_the_wrong_dtype(prob, launches, which, match):
    out = [np.zeros((3, 4, 16), np.float16), np.zeros((3, 4), np.float32)]
    out[which] = out[which].astype(np.float32 if which == 0 else np.float16)
    refused(prob, launches, match, out=tuple(out))
