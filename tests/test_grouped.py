"""The grouped attention route (numqsa.kernels.grouped) against the float64 oracle, and its invariances.

Simulator tier: the sm_90 route (NUMQSA_ARCH=sm_90) with the simulator's small shapes (3 ring
stages of 4 pages, pieces of 8 pages in spans of 16, windows of 2 rows), so the ring, the fold of a
span's pieces, multi-span merges and solo rows are all exercised on tiny problems. GPU tier: the
shipped shape at every head geometry.
"""
import numpy as np
import pytest
from numba import cuda

import numqsa
import oracle
from numqsa.kernels import grouped
from test_attention_kernels import check, run_attention, selection, small_problem


@pytest.fixture(autouse=True)
def sm90(monkeypatch):
    monkeypatch.setenv("NUMQSA_ARCH", "sm_90")


def _calls(monkeypatch):
    seen = []
    orig = grouped.launch_grouped

    def spy(*a, **k):
        seen.append(1)
        return orig(*a, **k)
    monkeypatch.setattr(numqsa.stages.attention._grouped, "launch_grouped", spy)
    return seen


_GROUPED_CONFIG = grouped.grouped_config


def _launch_shape(monkeypatch, g, stages=None, producers=None, fused=None):
    """From here on the grouped route runs windows of ``g`` rows (one for a plan without tokens)
    and the given ring depth, copy warps and schedule; the rest as ``grouped_config`` chooses."""
    def cfg(d, hg, rows, kb1, hkv, profile, single=False):
        base = _GROUPED_CONFIG(d, hg, rows, kb1, hkv, profile, single)
        return grouped.GroupedConfig(d, hg, base.stages if stages is None else stages,
                                     base.stage_pages, 1 if single else g, base.plan_threads,
                                     piece=base.piece,
                                     producers=base.producers if producers is None else producers,
                                     fused=base.fused if fused is None else fused, span=base.span)
    monkeypatch.setattr(grouped, "grouped_config", cfg)


def _window_plans(monkeypatch):
    """The arguments of every window-plan kernel built from here on (a list that grows)."""
    plans = []
    make_plan = grouped.make_window_plan_kernel
    monkeypatch.setattr(grouped, "make_window_plan_kernel",
                        lambda *a: plans.append(a) or make_plan(*a))
    return plans


@pytest.mark.parametrize("name,seq_lens,rows,page_size,hq,hkv,kb,mode", [
    ("pieces and solo rows", [300], [5], 16, 6, 1, 20, "random"),
    ("two requests per window", [260, 150], [3, 2], 64, 6, 1, 18, "overlap"),
    ("12 heads per KV head", [90], [3], 16, 12, 1, 6, "overlap"),
    ("24/2 heads, 784-token pages", [45], [3], 784, 24, 2, 4, "overlap"),
    ("3 heads, shared", [61], [4], 16, 3, 1, 5, "shared"),
])
def test_grouped_matches_oracle(rng, monkeypatch, name, seq_lens, rows, page_size, hq, hkv, kb, mode):
    seen = _calls(monkeypatch)
    p = small_problem(rng, seq_lens, rows, page_size=page_size, Hq=hq, Hkv=hkv)
    tokens, counts = selection(rng, p["req_ids"], p["positions"], p["seq_lens"], kb=kb, mode=mode)
    out, lse = run_attention(p, tokens, counts, "page4")
    check(p, tokens, counts, out, lse)
    assert seen, "the grouped kernel did not run"


def test_grouped_inert_stale_rows(rng, monkeypatch):
    seen = _calls(monkeypatch)
    p = small_problem(rng, [37, 9], None, positions=[36, 50, 2, -3, 35, 8], req_ids=[0, 0, 3, 0, 0, 1],
                      Hq=3)
    tokens, counts = selection(rng, p["req_ids"], p["positions"], p["seq_lens"], kb=5, mode="shared")
    out, lse = run_attention(p, tokens, counts, "page4")
    check(p, tokens, counts, out, lse)
    assert seen


def test_grouped_piece_boundaries(rng, monkeypatch):
    """Rows around the piece size (8 pages in the simulator, ``grouped_config``): shorter than one
    piece, exactly one, one page past (the last piece takes the rest), one short of two, two, two
    and one, three, three and one; tails of 0 to 3 tokens; two requests. Every row against the
    oracle, and rows one page past a piece alone give the bits they give in the batch."""
    seen = _calls(monkeypatch)
    assert grouped.grouped_config(32, 6, 12, 26, 1, None).piece == 8
    p = small_problem(rng, [120, 40], None, positions=[27, 30, 31, 32, 57, 63, 64, 65, 95, 98, 35, 39],
                      req_ids=[0] * 10 + [1, 1])
    tokens, counts = selection(rng, p["req_ids"], p["positions"], p["seq_lens"], kb=30)
    _, nv, tl = oracle.page4_plan(tokens, counts, p["block_table"], p["req_ids"], p["seq_lens"],
                                  page_size=16, num_pages=p["k_cache"].shape[0])
    assert nv.tolist() == [7, 8, 8, 9, 15, 16, 17, 17, 24, 25, 9, 10]
    assert sorted(set(tl.tolist())) == [0, 1, 2, 3]
    out, lse = run_attention(p, tokens, counts, "page4")
    check(p, tokens, counts, out, lse)
    sub = [3, 9, 6]
    q = dict(p)
    q.update(q=p["q"][sub], req_ids=p["req_ids"][sub], positions=p["positions"][sub])
    o2, l2 = run_attention(q, tokens[sub], counts[sub], "page4")
    np.testing.assert_array_equal(o2, out[sub])
    np.testing.assert_array_equal(l2, lse[sub])
    assert len(seen) == 2, "the grouped kernel did not run"


def test_grouped_direct_windows(rng, monkeypatch):
    """One-row windows over the plan kernel's own plan run the direct kernel (no window plan: a
    block streams one piece of its row in order, the merge folds the pieces into spans). Rows
    shorter than a piece, one page past one, two pieces and one, three pieces (two folds of a span's
    state in the union kernel), tails of 0-3 tokens, inert and stale rows, two requests: against the
    oracle, and bitwise the same as two-row windows sharing a union."""
    p = small_problem(rng, [120, 40], None, positions=[31, 32, 65, 50, -3, 35, 39, 130, 98, 20],
                      req_ids=[0, 0, 0, 3, 0, 1, 1, 0, 0, 0])
    tokens, counts = selection(rng, p["req_ids"], p["positions"], p["seq_lens"], kb=26)
    plans = _window_plans(monkeypatch)
    results = []
    for g in (1, 2):
        _launch_shape(monkeypatch, g)
        results.append(run_attention(p, tokens, counts, "page4"))
        assert bool(plans) == (g == 2)
    check(p, tokens, counts, *results[0])
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])


def test_grouped_direct_windows_hand_made_rows(rng, monkeypatch):
    """One-row windows of several pieces beside rows the plan leaves out (ids in any order and
    unaligned, one group shifted off its alignment): those rows are the generic kernel's, on its
    graph branch, which the direct blocks and the merge leave alone; every row as the oracle."""
    p = small_problem(rng, [150, 90], [5, 2], page_size=16)
    tokens, counts = selection(rng, p["req_ids"], p["positions"], p["seq_lens"], kb=24,
                               mode="overlap")
    assert grouped.pieces_of(tokens.shape[1] // 4, 8) > 1          # pieces: the merge runs
    n = int(counts[1])
    tokens[1, :n] = rng.permutation(int(p["positions"][1]) + 1)[:n]
    assert counts[3] >= 8
    tokens[3, 4:8] = np.minimum(tokens[3, 4:8] + 1, p["positions"][3])
    # a row whose first piece is whole and whose second is not (its 10th page unaligned): the
    # direct blocks that plan their own pieces see it only in the second
    assert counts[4] >= 44
    tokens[4, 36:40] += 1
    _launch_shape(monkeypatch, 1)
    plans = _window_plans(monkeypatch)
    out, lse = run_attention(p, tokens, counts, "page4")
    assert not plans
    check(p, tokens, counts, out, lse)


def _direct_runs(rng, monkeypatch, key, values):
    """One-row windows of one problem (rows of several pieces, an inert and a stale row, two
    requests) with ``TUNING[key]`` set to each of ``values``: per value the result, the recorded
    launches and their kernels' names. Every result is the first's, bitwise, and the first is the
    oracle's."""
    from numqsa import launch
    p = small_problem(rng, [120, 40], None, positions=[32, 65, 50, -3, 39, 98],
                      req_ids=[0, 0, 3, 0, 1, 0])
    tokens, counts = selection(rng, p["req_ids"], p["positions"], p["seq_lens"], kb=26)
    _launch_shape(monkeypatch, 1)
    runs = []
    for v in values:
        monkeypatch.setitem(grouped.TUNING, key, v)
        result = run_attention(p, tokens, counts, "page4")
        with launch.recording() as records:
            run_attention(p, tokens, counts, "page4")
        names = [r.kernel.py_func.__name__ if hasattr(r.kernel, "py_func") else r.kernel.fn.__name__
                 for r in records]
        runs.append((result, records, names))
    check(p, tokens, counts, *runs[0][0])
    for (out, lse), _, _ in runs[1:]:
        np.testing.assert_array_equal(out, runs[0][0][0])
        np.testing.assert_array_equal(lse, runs[0][0][1])
    return runs


def test_grouped_direct_blocks_plan_their_pieces(rng, monkeypatch):
    """One-row windows plan their own pieces (``SELF_PLAN``): recorded, no page-4 plan runs, the
    merge and the generic kernel both wait for the direct kernel alone (the generic one for its
    verdicts); run, the bits are those of direct blocks over the plan's pages (``TUNING["self"] =
    0``: the plan, then the direct blocks, the generic kernel after the plan), against the
    oracle."""
    from numqsa import launch
    for own, (_, records, names) in zip((1, 0), _direct_runs(rng, monkeypatch, "self", (1, 0))):
        deps = launch.graph_dependencies(records)
        attn = [i for i, x in enumerate(names) if x.startswith("grouped_attn")]
        assert len(attn) == 1 and ("_self" in names[attn[0]]) == bool(own)
        assert ("plan" in names) != bool(own), names        # no page-4 plan before such blocks
        merge, = [i for i, x in enumerate(names) if x.startswith("grouped_merge")]
        generic, = [i for i, x in enumerate(names) if x not in ("plan", names[attn[0]], names[merge])]
        assert deps[merge] == attn
        # the generic kernel: after the plan, or after the blocks' verdicts (beside the merge)
        assert deps[generic] == (attn if own else [names.index("plan")])


def test_grouped_direct_programmatic_merge(rng, monkeypatch):
    """Direct blocks with their merge launched programmatically (``TUNING["pdl"]`` 1 and 2: the
    blocks trigger it early or after their stores): recorded, the merge and the generic kernel
    (which reads the self-planned blocks' verdicts) are the programmatic launches and their one
    dependency is the attention kernel (the graph edges from its programmatic port); run, the bits
    are those without (the ``griddepcontrol.wait`` and the blocks' trigger change no arithmetic)."""
    from numqsa import launch
    for pdl, (_, records, names) in zip((0, 1, 2), _direct_runs(rng, monkeypatch, "pdl", (0, 1, 2))):
        marked = [i for i, r in enumerate(records) if r.programmatic]
        if not pdl:
            assert not marked
            continue
        attn = [n for n in names if n.startswith("grouped_attn")]
        assert sorted(names[i].split("_")[0] for i in marked) == ["grouped", "sparse"], names
        assert any(names[i].startswith("grouped_merge") for i in marked), names
        for i in marked:
            assert [names[x] for x in launch.graph_dependencies(records)[i]] == attn


@pytest.mark.parametrize("d", [32, 64, 128, 256, 512])
def test_ring_swizzle(d):
    """The ring's layout (session 22): every 16-byte chunk of a stage's token rows has its own
    place in its row; the 8 rows an ``ldmatrix`` reads at one chunk (two pages' 4 rows, ring pages
    of opposite parity) meet 8 different bank groups; and ``at_step`` lands where ``ring_offset``
    puts chunk ``c + 2 j`` for every lane chunk ``c`` and step ``j`` the kernel forms: K's
    (``hik`` and, in a D split, the parity's ``2 pr``: steps ``ks`` or ``2 i``) and V's
    (``2 dh + hiv``, steps ``DS * mt``), from a 128-byte aligned ring base."""
    pitch = 4 * grouped.row_words(d)
    off = getattr(grouped.ring_offset, "py_func", grouped.ring_offset)
    step = getattr(grouped.at_step, "py_func", grouped.at_step)
    nch = d // 8
    place = {}
    for r in range(64):
        for c in range(nch):
            o = int(off(np.uint32(r), np.uint32(c), np.uint32(pitch)))
            assert o % 16 == 0 and r * pitch <= o < (r + 1) * pitch, (r, c, o)
            place[o] = (r, c)
    assert len(place) == 64 * nch
    for pa in range(8):
        for pb in range(pa + 1, 8, 2):          # opposite parities
            for c in range(nch):
                rows = [4 * pa + x for x in range(4)] + [4 * pb + x for x in range(4)]
                banks = {int(off(np.uint32(r), np.uint32(c), np.uint32(pitch))) // 16 % 8 for r in rows}
                assert len(banks) == 8, (pa, pb, c)
    base = 128 * 5
    lanes = [(c0, j) for c0 in (0, 1) for j in range(nch // 2)]               # K, one warp
    lanes += [(c0 + 2 * pr, 2 * i) for c0 in (0, 1) for pr in (0, 1) for i in range(nch // 4)]
    for ds in (1, 2, 4):                                                      # V's D parts
        lanes += [(2 * dh + hv, ds * mt) for dh in range(ds) for hv in (0, 1)
                  for mt in range(nch // (2 * ds))]
    for r in range(16):
        for c0, j in lanes:
            if c0 + 2 * j >= nch:
                continue
            a = np.uint32(base + int(off(np.uint32(r), np.uint32(c0), np.uint32(pitch))))
            want = base + int(off(np.uint32(r), np.uint32(c0 + 2 * j), np.uint32(pitch)))
            assert int(step(a, j)) == want, (r, c0, j)


@pytest.mark.parametrize("hq,d", [(6, 64), (12, 64), (3, 32)])
def test_grouped_direct_d_split(rng, monkeypatch, hq, d):
    """Direct blocks put a head tile on 1, 2 or 4 warps (``dsplit``): each warp a share of O's dims
    and of S^T's accumulation chains (a parity; a parity of one half), exchanged through shared
    memory every chunk. The bits are those of one warp and of two-row union windows; rows of one
    to three pieces, tails of 0-3 tokens, an inert row, two requests, against the oracle."""
    p = small_problem(rng, [120, 40], None, positions=[32, 65, 50, -3, 39, 98],
                      req_ids=[0, 0, 3, 0, 1, 0], Hq=hq, D=d)
    tokens, counts = selection(rng, p["req_ids"], p["positions"], p["seq_lens"], kb=26)
    results = []
    splits = (1, 2, 4) if d // 16 % 4 == 0 else (1, 2)
    for ds in splits:
        monkeypatch.setitem(grouped.TUNING, "ds", ds)
        _launch_shape(monkeypatch, 1)
        results.append(run_attention(p, tokens, counts, "page4"))
    monkeypatch.delitem(grouped.TUNING, "ds")
    _launch_shape(monkeypatch, 2)
    results.append(run_attention(p, tokens, counts, "page4"))
    check(p, tokens, counts, *results[0])
    for out, lse in results[1:]:
        np.testing.assert_array_equal(out, results[0][0])
        np.testing.assert_array_equal(lse, results[0][1])


def test_window_plan_marks_solo_rows_and_pieces(rng):
    """Random (low-overlap) selections spread chunks over more stages than the ring keeps: such rows
    are solo; rows of more than one piece are merged. The union holds each group once."""
    p = small_problem(rng, [300], [4], page_size=16)
    tokens, counts = selection(rng, p["req_ids"], p["positions"], p["seq_lens"], kb=20, mode="random")
    pages, nv, tl = oracle.page4_plan(tokens, counts, p["block_table"], p["req_ids"], p["seq_lens"],
                                      page_size=16, num_pages=p["k_cache"].shape[0])
    # the simulator's launch shape on every platform: small stages and pieces
    cfg = grouped.GroupedConfig(32, 6, stages=2, stage_pages=4, rows_per_window=2, plan_threads=32,
                                piece=8)
    g, pc = cfg.rows_per_window, cfg.span
    npieces = grouped.pieces_of(pages.shape[1], pc)
    nwin = -(-4 // g)
    first = np.arange(0, 4, g, dtype=np.int32)
    windows = np.stack([first, np.minimum(g, 4 - first)], 1).astype(np.int32)
    wunion = np.full((nwin, npieces, g * 2 * pc, 2), -1, np.int32)
    wmeta = np.zeros((nwin, npieces, 3), np.int32)
    ownu = np.full((4, pages.shape[1]), -1, np.int32)
    k = grouped.make_window_plan_kernel(cfg.plan_threads, pc, cfg.stage_pages, cfg.keep, g)
    d = [cuda.to_device(np.ascontiguousarray(a)) for a in (tokens, pages, nv.astype(np.int32),
                                                          tl.astype(np.int32), p["req_ids"], windows,
                                                          wunion, wmeta, ownu)]
    k[(nwin, npieces), cfg.plan_threads](d[0], np.int32(1), *d[1:6], np.int32(p["k_cache"].shape[0]),
                                         np.int32(16), *d[6:])
    wunion, wmeta, ownu = (x.copy_to_host() for x in d[6:])
    assert not np.any(wmeta[:, :, 2])                  # no malformed rows
    assert int(nv.max()) >= 2 * pc                     # merged pieces occur
    assert np.any(wmeta[:, :, 1] != 0)                 # solo rows occur
    for w in range(nwin):
        for piece in range(npieces):
            n = wmeta[w, piece, 0]
            keys = set()
            for i in range(windows[w, 0], windows[w, 0] + windows[w, 1]):
                npc = max(1, nv[i] // pc)
                if piece >= npc:
                    continue
                k0, k1 = piece * pc, (nv[i] if piece == npc - 1 else piece * pc + pc)
                u = ownu[i, k0:k1]
                assert np.all(np.diff(u) > 0) and u.max() < n
                np.testing.assert_array_equal(wunion[w, piece, u], pages[i, k0:k1])
                keys |= set((tokens[i, 4 * np.arange(k0, k1)] // 4).tolist())
            assert n == len(keys)


def test_grouped_row_invariance(rng):
    """A row's bits do not depend on the other rows of its window or batch, nor on where the
    allocator put the pages (spec §6: the last subset runs on relocated pages)."""
    from test_attention_kernels import relocate
    p = small_problem(rng, [200], [6], page_size=16)
    tokens, counts = selection(rng, p["req_ids"], p["positions"], p["seq_lens"], kb=12, mode="overlap")
    out, lse = run_attention(p, tokens, counts, "page4")
    check(p, tokens, counts, out, lse)
    for sub, moved in (([3], False), ([2, 3], False), ([5, 3, 0], True)):
        q = dict(relocate(p, rng) if moved else p)
        q.update(q=p["q"][sub], req_ids=p["req_ids"][sub], positions=p["positions"][sub])
        o2, l2 = run_attention(q, tokens[sub], counts[sub], "page4")
        np.testing.assert_array_equal(o2, out[sub])
        np.testing.assert_array_equal(l2, lse[sub])


def test_grouped_launch_shape_invariance(rng, monkeypatch):
    """The launch shape never changes a row's bits: ring depth (a chunk spread over every stage, or
    rows run solo), copy warps sharing a stage (1 or 2 producers), window size (1 or 2 rows) and the
    schedule of pieces (a block each and the merge kernel, or one block folding them all) only
    change where operands are loaded from, who waits on which mbarrier and who folds; one-row
    windows stream their own pages with no window plan (the direct kernel)."""
    p = small_problem(rng, [160], [3], page_size=16)
    tokens, counts = selection(rng, p["req_ids"], p["positions"], p["seq_lens"], kb=16, mode="random")
    plans = _window_plans(monkeypatch)
    results = []
    for stages, producers, g, fused in ((2, 2, 2, False), (3, 1, 1, True), (3, 2, 2, True)):
        _launch_shape(monkeypatch, g, stages, producers, fused)
        before = len(plans)
        results.append(run_attention(p, tokens, counts, "page4"))
        # one-row windows over the plan kernel's own plan run direct: no window plan
        assert (len(plans) == before) == (g == 1)
    check(p, tokens, counts, *results[0])
    for out, lse in results[1:]:
        np.testing.assert_array_equal(out, results[0][0])
        np.testing.assert_array_equal(lse, results[0][1])


def _bench_workload(rows, context, seed, hq=6, hkv=1):
    """bench_attention's workload (the bench's cases: rows at the end of the context, page 64 in
    random order, ~0.82 adjacent-row overlap) at ``hq`` / ``hkv`` heads."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    import bench_attention as BA
    BA.HQ, BA.HKV = hq, hkv
    try:
        return BA.make_workload(rows, context, seed=seed)
    finally:
        BA.HQ, BA.HKV = 6, 1


def _assert_rows_match_oracle(w, idx, out, lse=None):
    """Rows ``idx`` of ``out`` (and ``lse``) against the float64 oracle on ``w``'s inputs."""
    from numqsa.testing import assert_matches_oracle
    pr = w["problem"]
    eo, el = oracle.sparse_attention(pr["q"][idx], pr["k_cache"], pr["v_cache"], pr["block_table"],
                                     w["tokens"][idx], w["counts"][idx], pr["req_ids"][idx],
                                     pr["seq_lens"])
    assert_matches_oracle(out[idx], eo, dtype="float16", what="out")
    if lse is not None:
        assert_matches_oracle(lse[idx], el, dtype="float32", what="lse")


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv", [(3, 1), (6, 1), (12, 1), (24, 2)])
def test_gpu_grouped_geometries(hq, hkv, seed):
    w = _bench_workload(1024, 32768, seed, hq, hkv)
    out, lse = run_attention(w["problem"], w["tokens"], w["counts"], "page4")
    _assert_rows_match_oracle(w, np.r_[0, 1, 511, 1023], out, lse)


@pytest.mark.gpu
def test_gpu_grouped_fused_equals_split(seed, monkeypatch):
    """The fused schedule (one block folds a window's pieces) and the split one (a block per piece,
    then the merge kernel) give the same bits on the H200: both folds call the same ``_fold_*``
    functions, and this checks that the compiler kept one arithmetic for them."""
    w = _bench_workload(1024, 32768, seed)
    results = []
    for fused in (0, 1):
        monkeypatch.setitem(grouped.TUNING, "fu", fused)
        results.append(run_attention(w["problem"], w["tokens"], w["counts"], "page4"))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])
    _assert_rows_match_oracle(w, np.r_[0, 511, 1023], results[1][0])


def test_grouped_direct_blocks_write_every_slot(rng, monkeypatch):
    """Self-planned direct blocks write every slot of every row, blank past a row's pieces, in rows
    without pages and beside a rejected piece (``blank_piece``), so that their merge loads the
    page count and all slots in one round trip: partials poisoned with NaN between two runs are
    all overwritten, and the second run's bits are the first's."""
    from numqsa.stages.attention import attention_launch
    p = small_problem(rng, [120, 40], None, positions=[110, 65, 50, -3, 39, 98],
                      req_ids=[0, 0, 3, 0, 1, 0])
    tokens, counts = selection(rng, p["req_ids"], p["positions"], p["seq_lens"], kb=26)
    tokens[0, 5] += 1                        # a row the plan cannot express: a rejected piece
    _launch_shape(monkeypatch, 1)
    ws = numqsa.Workspace()
    args = [p["q"], p["k_cache"], p["v_cache"], p["block_table"], tokens, counts, p["req_ids"],
            p["seq_lens"]]
    first = attention_launch(*args, route_name="page4", workspace=ws, validate=False)
    parts = [ws._scratch.kept(f"grouped.part_{x}") for x in ("o", "ml")]
    assert all(b is not None for b in parts) and parts[0].shape[2] > 1, "no merge ran"
    for b in parts:
        b.copy_to_device(np.full(b.shape, np.nan, np.float32))
    second = attention_launch(*args, route_name="page4", workspace=ws, validate=False)
    for b in parts:
        assert not np.isnan(b.copy_to_host()).any()
    for a, b in zip(first, second):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    check(p, tokens, counts, *second)
