"""GPU fuzz against the oracle (issue 12, points 4 and 6 of Deliver). GPU tier only (``-m gpu``).

Each seed draws a geometry: 1-8 requests of mixed lengths up to 131,072 tokens (total capped so the
host can fill the caches), page size 16 / 64 / 784, the index cache on its own table or the main
one, random physical page order (non-monotonic tables), rows at random positions plus stale and
inert rows, ``Kb`` above and below the rows' visible groups, a production head geometry, float16,
bfloat16 (``ml_dtypes``) or float32. Every stage is compared with the oracle on sampled rows: index scores on the planned
route and on the forced other route, the fused selection (spec §8), and attention on the kernel's
own selection on every route that takes the dtype.

The fixed seeds run in the GPU tier; a longer run by hand:
``NUMQSA_FUZZ_SEEDS=200 NUMQSA_FUZZ_BASE=1000 pytest -m gpu tests/test_fuzz.py``. A failure
names its seed; ``NUMQSA_FUZZ_BASE=<seed> NUMQSA_FUZZ_SEEDS=1`` replays it.

Concurrency: two streams running different problems give the bits each gives alone; a batch of 64
mixed-length requests matches the oracle.
"""
import contextlib
import os

import numpy as np
import pytest
from numba import cuda

import numqsa
import oracle
from numqsa.stages import selection as sel
from numqsa.kernels import index_scores as k_scores
from numqsa.plan import arch_profile
from numqsa.testing import assert_matches_oracle, assert_selection_matches, poison, to_device
from oracle.problems import make_problem

try:
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:          # bfloat16 draws fall back to float16
    BF16 = np.dtype(np.float16)

R = 4
N_SEEDS = int(os.environ.get("NUMQSA_FUZZ_SEEDS", "6"))
BASE = int(os.environ.get("NUMQSA_FUZZ_BASE", "20261201"))
GEOMETRIES = [(3, 1), (6, 1), (12, 1), (24, 2)]
ATTENTION_ROUTES = ("generic", "page4")     # add a route name here to fuzz it
TOTAL_TOKENS = 1 << 18                      # host-side cap on the summed context of one draw
SAMPLE_ROWS = 24

pytestmark = pytest.mark.gpu


def draw(seed, dtype=None):
    """A random problem: ``(problem dict, Kb, description)``; ``dtype`` overrides the drawn one."""
    rng = np.random.default_rng(seed)
    nreq = int(rng.integers(1, 9))
    lens = np.exp(rng.uniform(0, np.log(131072), nreq)).astype(np.int64) + 1
    lens = np.minimum(lens, 131072)
    if rng.random() < 0.35:
        lens[0] = 131072                                   # the longest context the tier covers
    rest = TOTAL_TOKENS - int(lens[0])
    if lens[1:].sum() > rest:
        lens[1:] = np.maximum(1, lens[1:] * rest // lens[1:].sum())
    req, pos = [], []
    for q, n in enumerate(lens):
        k = int(rng.integers(1, 33))
        p = rng.integers(0, n, size=k)
        p[: min(k, 4)] = np.maximum(0, n - 1 - np.arange(min(k, 4)))        # every tail length
        req += [q] * k
        pos += list(np.sort(p))
    req += [0, -1, nreq + 1, int(rng.integers(nreq))]                      # stale and inert rows
    pos += [int(lens[0]) + 17, 5, 0, -3]
    page_size = int(rng.choice([16, 64, 784]))
    hq, hkv = GEOMETRIES[int(rng.integers(len(GEOMETRIES)))]
    u = rng.random()
    if dtype is None:
        dtype = np.float16 if u < 0.5 else (BF16 if u < 0.75 else np.float32)
    shared = bool(rng.random() < 0.5)
    # rows sit at random positions, so their visible groups fall on both sides of any of these
    kb = int(rng.choice([8, 61, 512]))
    p = make_problem(lens.astype(np.int32), positions=np.array(pos, np.int32),
                     req_ids=np.array(req, np.int32), page_size=page_size, Hq=hq, Hkv=hkv, D=256,
                     Hi=4, Di=128, dtype=dtype, shared_index_table=shared, seed=seed)
    desc = (f"seed {seed}: {nreq} requests {lens.tolist()}, {len(req)} rows, page {page_size}, "
            f"{'shared' if shared else 'own'} index table, Hq/Hkv {hq}/{hkv}, "
            f"{np.dtype(dtype).name}, Kb {kb}")
    return p, kb, desc


@contextlib.contextmanager
def replay_hint(desc):
    try:
        yield
    except AssertionError as e:
        raise AssertionError(f"{desc} (replay: NUMQSA_FUZZ_BASE={desc.split()[1][:-1]} "
                             f"NUMQSA_FUZZ_SEEDS=1)\n{e}") from e


BATCH = ("qi", "index_cache", "index_block_table", "req_ids", "positions", "seq_lens")


def _sub(p, idx):
    """The sampled rows as a batch of their own (requests, caches and tables unchanged)."""
    s = dict(p)
    for k in ("qi", "q", "req_ids", "positions"):
        s[k] = p[k][idx]
    return s


def check_problem(p, kb, desc, seed):
    rows = p["req_ids"].size
    idx = np.sort(np.random.default_rng(seed).choice(rows, size=min(rows, SAMPLE_ROWS),
                                                     replace=False))
    sp = _sub(p, idx)
    d = [to_device(np.ascontiguousarray(p[k])) for k in BATCH]
    ref_s = oracle.index_scores(*[sp[k] for k in BATCH], num_groups=int(p["seq_lens"].max()) // R)
    name = np.dtype(p["qi"].dtype).name
    with replay_hint(desc):
        # scores: planned route and the tensor-core route forced (float16; bfloat16 on sm_80+)
        # device seq_lens are not read back: the width is the index table's capacity, -inf past G
        sc = sel.index_scores(*d).copy_to_host()
        G = ref_s.shape[1]
        assert np.isneginf(sc[:, G:]).all()
        assert_matches_oracle(sc[idx, :G], ref_s, dtype="float32",
                              what="index scores (planned route)")
        prof = arch_profile((9, 0))
        if k_scores.tiled_supported(d[0], d[1], prof):
            t = poison(cuda.device_array(sc.shape, np.float32))
            k_scores.launch_tiled(*d, t, prof, 0)
            assert_matches_oracle(t.copy_to_host()[idx, :G], ref_s, dtype="float32",
                                  what="tiled scores")
        # fused selection
        tokens, counts, groups = numqsa.select(*d, Kb=kb)
        tok, cnt, grp = tokens.copy_to_host(), counts.copy_to_host(), groups.copy_to_host()
        assert_selection_matches(grp[idx], tok[idx], cnt[idx], ref_s, sp["req_ids"],
                                 sp["positions"], p["seq_lens"], Kb=kb)
        # attention on the kernel's own selection
        eo, el = oracle.sparse_attention(sp["q"], p["k_cache"], p["v_cache"], p["block_table"],
                                         tok[idx], cnt[idx], sp["req_ids"], p["seq_lens"])
        dq, dk, dv, dt, dr, dl = (to_device(np.ascontiguousarray(p[k])) for k in
                                  ("q", "k_cache", "v_cache", "block_table", "req_ids", "seq_lens"))
        tensor_cores = ("float16", "bfloat16") if prof.attention.mma == "m16n8k16" else ("float16",)
        for route in ATTENTION_ROUTES:
            if route != "generic" and name not in tensor_cores:
                continue
            o = poison(cuda.device_array(p["q"].shape, p["q"].dtype))
            lse = poison(cuda.device_array(p["q"].shape[:2], np.float32))
            numqsa.sparse_attention(dq, dk, dv, dt, tokens, counts, dr, dl, route_name=route,
                                    out=(o, lse))
            oh, lh = o.copy_to_host(), lse.copy_to_host()
            assert np.isfinite(oh.astype(np.float32)).all(), \
                f"{route}: an output element is unwritten or non-finite"
            assert_matches_oracle(oh[idx], eo, dtype=name, what=f"{route} out")
            assert_matches_oracle(lh[idx], el, dtype="float32", what=f"{route} lse")


@pytest.mark.parametrize("k", range(N_SEEDS))
def test_fuzz(k):
    seed = BASE + k
    p, kb, desc = draw(seed)
    print(desc)
    check_problem(p, kb, desc, seed)


@pytest.mark.parametrize("k", range(4))
def test_fuzz_bf16(k):
    """Draws forced to bfloat16 (the fixed seed set draws it only on a small problem): Kb 8, 8,
    61 and 512 over contexts up to 131K, page sizes 16 and 64, Hq/Hkv 6/1 and 3/1."""
    seed = BASE + 2000 + k
    p, kb, desc = draw(seed, dtype=BF16)
    print(desc)
    check_problem(p, kb, desc, seed)


@pytest.mark.parametrize("arch", ["sm_70"])
def test_fuzz_sm70(arch, monkeypatch):
    """One draw on the emulated m8n8k4 kernels (slow on an H200: one seed)."""
    monkeypatch.setenv("NUMQSA_ARCH", arch)
    seed = BASE + 1000
    p, kb, desc = draw(seed)
    check_problem(p, kb, desc, seed)


# ------------------------------------------------------------------------------------------------
# concurrency
# ------------------------------------------------------------------------------------------------

def _prefill(p, kb, stream):
    d = [to_device(np.ascontiguousarray(p[k]), stream=stream) for k in
         ("qi", "index_cache", "index_block_table", "q", "k_cache", "v_cache", "block_table",
          "req_ids", "positions", "seq_lens")]
    return numqsa.qsa_prefill(*d, Kb=kb, num_groups=int(p["seq_lens"].max()) // R,
                              validate=False, stream=stream)


def test_two_streams_same_bits_as_alone(seed):
    """Two different problems on two streams at once give the bits each gives alone."""
    pa = make_problem([32768, 5000], [600, 40], page_size=64, Hq=6, Hkv=1, seed=seed)
    pb = make_problem([9000], [700], page_size=784, Hq=24, Hkv=2, shared_index_table=False,
                      seed=seed + 1)
    s1, s2 = cuda.stream(), cuda.stream()
    alone = []
    for p, s in ((pa, s1), (pb, s2)):
        r = _prefill(p, 512, s)
        s.synchronize()
        alone.append([x.copy_to_host() for x in r])
    for _ in range(3):
        ra, rb = _prefill(pa, 512, s1), _prefill(pb, 512, s2)      # in flight together
        s1.synchronize()
        s2.synchronize()
        for got, want in ((ra, alone[0]), (rb, alone[1])):
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g.copy_to_host(), w, err_msg=f"seed {seed}")


def test_64_mixed_length_requests(seed):
    """64 requests of 1..20,000 tokens, 1-4 rows each plus inert padding rows, against the oracle."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 20000, size=64).astype(np.int32)
    lens[:3] = [1, 4, 2052]
    req = np.concatenate([np.repeat(np.arange(64), rng.integers(1, 5, size=64)), [-1] * 8])
    pos = np.array([int(rng.integers(0, lens[q])) if q >= 0 else 0 for q in req], np.int32)
    p = make_problem(lens, positions=pos, req_ids=req.astype(np.int32), page_size=64, Hq=12,
                     Hkv=1, seed=seed)
    out, lse, tokens, counts = _prefill(p, 512, 0)
    tok, cnt = tokens.copy_to_host(), counts.copy_to_host()
    idx = np.sort(rng.choice(req.size, size=32, replace=False))
    sp = _sub(p, idx)
    ref_s = oracle.index_scores(*[sp[k] for k in BATCH], num_groups=int(lens.max()) // R)
    assert_selection_matches(_groups_of(tok[idx], cnt[idx], sp), tok[idx], cnt[idx], ref_s,
                             sp["req_ids"], sp["positions"], p["seq_lens"], Kb=512)
    eo, el = oracle.sparse_attention(sp["q"], p["k_cache"], p["v_cache"], p["block_table"],
                                     tok[idx], cnt[idx], sp["req_ids"], p["seq_lens"])
    assert_matches_oracle(out.copy_to_host()[idx], eo, dtype="float16", what=f"seed {seed} out")
    assert_matches_oracle(lse.copy_to_host()[idx], el, dtype="float32", what=f"seed {seed} lse")


def _groups_of(tok, cnt, sp):
    """The groups a selection expands (its full groups, ascending), as ``[rows, 512]`` ids."""
    live, _, pos, nb = oracle.row_states(sp["req_ids"], sp["positions"], sp["seq_lens"], R)
    g = np.full((tok.shape[0], 512), -1, np.int32)
    for i in range(tok.shape[0]):
        full = tok[i, :cnt[i]]
        full = full[full < R * nb[i]]
        ids = full[::R] // R
        g[i, :ids.size] = ids
    return g
