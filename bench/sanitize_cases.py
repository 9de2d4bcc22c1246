"""Tiny cases for every kernel and route, for compute-sanitizer (memcheck, racecheck, synccheck, initcheck).

Two cases per kernel: ``small`` (one request of 70 tokens, 3 rows, page size 16) and ``boundary``
(page size 784, two requests, rows with every tail length 0-3, a stale row, inert rows, a separate
index table with non-monotonic pages), the attention routes at every production head geometry
(Hq/Hkv 3/1, 6/1, 12/1, 24/2 at D 256), and the bfloat16 variants (pre-indexer, scores, attention:
tensor cores on sm_90, the FMA routes on sm_70). Every result is compared with the oracle, so a silent wrong
answer fails here too. Outputs are NaN-poisoned device buffers (initcheck then sees every read of
them as initialised: a kernel reading an output it did not write would still fail the comparison).

    python bench/sanitize_cases.py [--arch sm_90|sm_70|both] [--routes generic,page4,...] [--quick]

``--routes`` (or ``NUMQSA_SANITIZE_ROUTES``) lists the ``route_name`` values of
``numqsa.sparse_attention`` to cover: a new attention kernel is covered by adding its name.
``--quick`` keeps the 6/1 and 12/1 geometries for racecheck's slow runs: 12/1's tile shrinks, and
the direct blocks split a head tile over four warps at 6/1 and over two at 12/1 (their S^T exchange).
Prints one line per case and ``cases: N ok``; exits 1 on the first mismatch.
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from numba import cuda  # noqa: E402

import numqsa  # noqa: E402
import oracle  # noqa: E402
from numqsa.stages import selection as sel  # noqa: E402
from numqsa.kernels import index_scores as k_scores  # noqa: E402
from numqsa.kernels import grouped  # noqa: E402
from numqsa.kernels import topk as k_topk  # noqa: E402
from numqsa.plan import arch_profile  # noqa: E402
from numqsa.testing import (assert_matches_oracle, assert_selection_matches, groups_of_tokens,  # noqa: E402
                            poison, to_device)
from oracle.problems import make_problem  # noqa: E402

try:
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:                  # no bfloat16 cases without ml_dtypes
    BF16 = None

R = 4
GEOMETRIES = [(3, 1), (6, 1), (12, 1), (24, 2)]
QUICK = [(6, 1), (12, 1)]           # --quick (bench/sanitize.py names both lists again, as text)
DEFAULT_ROUTES = "generic,page4"


def problems(seed):
    """``{"small": ..., "boundary": ...}`` at Hi 4 / Di 128, attention heads filled in per geometry."""
    small = dict(seq_lens=[70], rows_per_req=[3], page_size=16, shared_index_table=True)
    req = np.array([0, 0, 0, 0, 1, 1, 0, 5, 0], np.int32)
    pos = np.array([842, 841, 840, 839, 30, 2, 900, 3, -1], np.int32)   # tails 3..0, stale, inert
    boundary = dict(seq_lens=[843, 31], positions=pos, req_ids=req, page_size=784,
                    shared_index_table=False)
    return {"small": (small, seed), "boundary": (boundary, seed + 1)}


def make(spec, seed, hq=6, hkv=1, dtype=np.float16):
    p = make_problem(**spec, Hq=hq, Hkv=hkv, D=256, Hi=4, Di=128, dtype=dtype, seed=seed)
    if not spec["shared_index_table"]:      # a non-monotonic index table: reverse each row's pages
        t = p["index_block_table"]
        for q in range(t.shape[0]):
            n = int((t[q] >= 0).sum())
            t[q, :n] = t[q, :n][::-1]
    return p


def dev(p, *keys):
    return [to_device(np.ascontiguousarray(p[k])) for k in keys]


BATCH = ("qi", "index_cache", "index_block_table", "req_ids", "positions", "seq_lens")


def run(arch, routes, quick, seed=7):
    os.environ["NUMQSA_ARCH"] = arch
    prof = arch_profile((9, 0))            # the forced architecture's profile
    n = 0

    def ok(what):
        nonlocal n
        n += 1
        print(f"{arch} {what}: ok", flush=True)

    for name, (spec, s) in problems(seed).items():
        p = make(spec, s)
        batch = [p[k] for k in BATCH[3:]]
        d = dev(p, *BATCH)
        # pre-indexer: keys into a copy of the index cache, queries
        rng = np.random.default_rng(s)
        g = 5
        k_raw = rng.standard_normal((g, R, 128)).astype(np.float16)
        w = (0.1 * rng.standard_normal(128)).astype(np.float16)
        reqs = np.zeros(g, np.int32)
        eids = np.array([0, 1, 7, 3, 12], np.int32)
        ic_k, ic_o = p["index_cache"].copy(), p["index_cache"].copy()
        d_ic = to_device(ic_k)
        kc = sel.index_keys(to_device(k_raw), to_device(w), to_device(reqs),
                            to_device(eids), d_ic, to_device(p["index_block_table"]),
                            out=poison(cuda.device_array((g, 128), np.float32)))
        want = oracle.index_keys(k_raw, w, reqs, eids, ic_o, p["index_block_table"])
        assert_matches_oracle(kc.copy_to_host(), want, dtype="float32", what="index_keys")
        assert_matches_oracle(d_ic.copy_to_host(), ic_o, dtype="float16", what="index cache")
        ok(f"{name} index_keys")
        q_raw = rng.standard_normal(p["qi"].shape).astype(np.float16)
        qi = sel.index_queries(to_device(q_raw), to_device(w), *d[3:],
                               out=poison(cuda.device_array(q_raw.shape, np.float16)))
        assert_matches_oracle(qi.copy_to_host(), oracle.index_queries(q_raw, w, *batch),
                              dtype="float16", what="index_queries")
        ok(f"{name} index_queries")
        # index scores: light and the tensor-core variants of this architecture
        ref_s = oracle.index_scores(*[p[k] for k in BATCH])
        sc = scores_variants(arch, prof, d, ref_s, ok, name, "", sm70_tiled=True)
        # top-k, both kernels, on the kernel's own scores (exact)
        own = sc.copy_to_host()
        kb = 8
        fits = {"registers": k_topk.register_groups(), "bitmap": k_topk.bitmap_shape()[1]}
        for route in k_topk.ROUTES:
            if own.shape[1] > fits.get(route, own.shape[1]):
                continue                     # the simulator's small kernels take short rows only
            gr = poison(cuda.device_array((own.shape[0], kb), np.int32))
            k_topk.launch_topk(to_device(own.view(np.uint32)), *d[3:], gr, prof, 0, route=route)
            np.testing.assert_array_equal(gr.copy_to_host(),
                                          oracle.topk_groups(own.astype(np.float64), *batch, Kb=kb))
            ok(f"{name} topk {route}")
        # expansion and the fused selection
        out = tuple(poison(cuda.device_array(sh, np.int32))
                    for sh in ((own.shape[0], kb * R + R - 1), (own.shape[0],), (own.shape[0], kb)))
        tokens, counts, groups = numqsa.select(*d, Kb=kb, out=out)
        assert_selection_matches(groups.copy_to_host(), tokens.copy_to_host(),
                                 counts.copy_to_host(), ref_s, *batch, Kb=kb)
        ok(f"{name} select (scores, top-k, expand)")
        tok_h, cnt_h = tokens.copy_to_host(), counts.copy_to_host()
        # attention: every route at every geometry, float16; float32 on the generic route
        for hq, hkv in (QUICK if quick else GEOMETRIES):
            pa = make(spec, s + hq, hq=hq, hkv=hkv)
            num_pages, ps = pa["k_cache"].shape[:2]
            numqsa.page4_plan(tokens, counts, to_device(pa["block_table"]), d[3], d[5],
                              page_size=ps, num_pages=num_pages)
            eo, el = oracle.sparse_attention(pa["q"], pa["k_cache"], pa["v_cache"], pa["block_table"],
                                             tok_h, cnt_h, pa["req_ids"], pa["seq_lens"])
            kv = to_device(np.stack([pa["k_cache"], pa["v_cache"]], axis=1))   # interleaved
            da = dev(pa, "q", "block_table", "req_ids", "seq_lens")
            # these few rows take one-row windows (the grouped route's direct kernel); the page-4
            # route once more with windows of two rows: the window plan and the union kernel
            for route, windows in [(r, None) for r in routes] + [("page4", 2)] * ("page4" in routes):
                grouped.TUNING.pop("g", None)
                if windows:
                    grouped.TUNING["g"] = windows
                o = poison(cuda.device_array(pa["q"].shape, np.float16))
                lse = poison(cuda.device_array(pa["q"].shape[:2], np.float32))
                numqsa.sparse_attention(da[0], kv[:, 0], kv[:, 1], da[1], tokens, counts, da[2],
                                        da[3], route_name=route, out=(o, lse))
                assert_matches_oracle(o.copy_to_host(), eo, dtype="float16", what=f"{route} out")
                assert_matches_oracle(lse.copy_to_host(), el, dtype="float16", what=f"{route} lse")
                ok(f"{name} attention {route}{' windows of 2' if windows else ''} {hq}/{hkv}")
            grouped.TUNING.pop("g", None)
            q32 = to_device(pa["q"].astype(np.float32))
            k32, v32 = (to_device(pa[k].astype(np.float32)) for k in ("k_cache", "v_cache"))
            o = poison(cuda.device_array(pa["q"].shape, np.float32))
            lse = poison(cuda.device_array(pa["q"].shape[:2], np.float32))
            numqsa.sparse_attention(q32, k32, v32, da[1], tokens, counts, da[2], da[3],
                                    route_name="generic", out=(o, lse))
            eo32, _ = oracle.sparse_attention(pa["q"].astype(np.float32), pa["k_cache"].astype(np.float32),
                                              pa["v_cache"].astype(np.float32), pa["block_table"],
                                              tok_h, cnt_h, pa["req_ids"], pa["seq_lens"])
            assert_matches_oracle(o.copy_to_host(), eo32, dtype="float32", what="generic float32")
            ok(f"{name} attention generic float32 {hq}/{hkv}")
            if BF16 is not None:
                bf_attention(arch, pa, tokens, counts, tok_h, cnt_h, da, routes, ok,
                             f"{name} attention bf16 {hq}/{hkv}")
        if BF16 is not None:
            bf_selection(arch, prof, p, s, ok, name)
    inert_cases(ok, seed)
    cuda.synchronize()
    return n


PREFILL = ("qi", "index_cache", "index_block_table", "q", "k_cache", "v_cache", "block_table",
           "req_ids", "positions", "seq_lens")


def inert_cases(ok, seed):
    """Issue 22: device tables with a bad page id a row needs (not read back: the guard makes that
    row inert), and a ``Kb`` far past the visible groups (the page-4 plan sized by what rows see).
    Rows 0 / 1 of request 0 sit at 299 / 150; index column 20 and KV column 15 are row 0's only."""
    from oracle.batch import bad_page_rows
    p = make_problem([300, 40], positions=[299, 150, 39, 20], req_ids=[0, 0, 1, 1], page_size=16,
                     Hq=6, Hkv=1, D=256, Hi=4, Di=128, dtype=np.float16, seed=seed + 5,
                     shared_index_table=False)
    ic, kc = p["index_cache"].shape, p["k_cache"].shape
    for table, col, value, validate, kb in (("index_block_table", 20, 10**6, None, 8),
                                            ("block_table", 15, -3, False, 8),
                                            (None, 0, 0, None, 20000)):
        d = {k: to_device(np.ascontiguousarray(p[k])) for k in PREFILL}
        pos = p["positions"]
        if table is not None:
            bad_tab = p[table].copy()
            bad_tab[0, col] = value
            d[table] = to_device(bad_tab)
            kw = (dict(index_block_table=bad_tab, num_idx_pages=ic[0], idx_page_rows=ic[1])
                  if table == "index_block_table" else
                  dict(block_table=bad_tab, num_pages=kc[0], page_size=kc[1]))
            bad = bad_page_rows(p["req_ids"], pos, p["seq_lens"], R, **kw)
            assert bad.tolist() == [True, False, False, False]
            pos = np.where(bad, -1, pos).astype(np.int32)
        rows, w = pos.size, kb * R + R - 1
        out = (poison(cuda.device_array(p["q"].shape, np.float16)),
               poison(cuda.device_array(p["q"].shape[:2], np.float32)),
               poison(cuda.device_array((rows, w), np.int32)),
               poison(cuda.device_array(rows, np.int32)))
        numqsa.qsa_prefill(*[d[k] for k in PREFILL], Kb=kb, validate=validate, out=out)
        o, lse, tok, cnt = (x.copy_to_host() for x in out)
        ref = oracle.qsa_prefill(*[p[k] for k in PREFILL[:8]], pos, p["seq_lens"], Kb=kb)
        ref_s = oracle.index_scores(*[p[k] for k in PREFILL[:3]], p["req_ids"], pos, p["seq_lens"])
        assert_selection_matches(groups_of_tokens(tok, cnt, kb), tok, cnt, ref_s, p["req_ids"], pos,
                                 p["seq_lens"], Kb=kb)
        eo, el = oracle.sparse_attention(p["q"], p["k_cache"], p["v_cache"], p["block_table"], tok,
                                         cnt, p["req_ids"], p["seq_lens"])
        assert_matches_oracle(o, eo, dtype="float16", what="inert out")
        assert_matches_oracle(lse, el, dtype="float16", what="inert lse")
        np.testing.assert_array_equal(cnt, ref[3])
        ok(f"issue 22 prefill {table or 'Kb 20000'} {value if table else ''}".rstrip())


def scores_variants(arch, prof, d, ref_s, ok, name, label, sm70_tiled):
    """Index scores by the light kernel and this architecture's tensor-core variants (sm_70's
    m8n8k4 one only when ``sm70_tiled``: it takes float16), each against the oracle; returns the
    last variant's scores (device)."""
    variants = [("light", None)] + ([("tiled", "keysm"), ("tiled", "keysm.shared"),
                                     ("tiled", "generic")] if arch == "sm_90"
                                    else [("tiled", None)] if sm70_tiled else [])
    for route, variant in variants:
        sc = poison(cuda.device_array(ref_s.shape, np.float32))
        if route == "light":
            k_scores.launch_light(*d, sc, prof, 0)
        elif variant == "keysm.shared":      # the block's few rows take the direct kernel otherwise
            k_scores.launch_tiled(*d, sc, prof, 0, variant="keysm", direct=False)
        else:
            k_scores.launch_tiled(*d, sc, prof, 0, variant=variant)
        assert_matches_oracle(sc.copy_to_host(), ref_s, dtype="float16",
                              what=f"{label}{route} {variant} scores")
        ok(f"{name} index_scores {label}{route}{'/' + variant if variant else ''}")
    return sc


def bf_selection(arch, prof, p, s, ok, name):
    """bfloat16 pre-indexer (mean rounded to bfloat16, stored in a bfloat16 cache) and scores."""
    pb = {k: (v.astype(BF16) if v.dtype == np.float16 else v) for k, v in p.items()}
    batch = [pb[k] for k in BATCH[3:]]
    d = dev(pb, *BATCH)
    rng = np.random.default_rng(s + 99)
    k_raw = rng.standard_normal((5, R, 128)).astype(BF16)
    w = (0.1 * rng.standard_normal(128)).astype(BF16)
    reqs, eids = np.zeros(5, np.int32), np.array([0, 1, 7, 3, 12], np.int32)
    ic_o = pb["index_cache"].copy()
    d_ic = to_device(pb["index_cache"])
    kc = sel.index_keys(to_device(k_raw), to_device(w), to_device(reqs),
                        to_device(eids), d_ic, to_device(pb["index_block_table"]),
                        emulate_dtype=BF16, out=poison(cuda.device_array((5, 128), np.float32)))
    want = oracle.index_keys(k_raw, w, reqs, eids, ic_o, pb["index_block_table"], emulate_dtype=BF16)
    assert_matches_oracle(kc.copy_to_host(), want, dtype="bfloat16", what="bf16 index_keys")
    assert_matches_oracle(d_ic.copy_to_host(), ic_o, dtype="bfloat16", what="bf16 index cache")
    ok(f"{name} index_keys bf16")
    q_raw = rng.standard_normal(pb["qi"].shape).astype(BF16)
    qi = sel.index_queries(to_device(q_raw), to_device(w), *d[3:],
                           out=poison(cuda.device_array(q_raw.shape, BF16)))
    assert_matches_oracle(qi.copy_to_host(), oracle.index_queries(q_raw, w, *batch),
                          dtype="bfloat16", what="bf16 index_queries")
    ok(f"{name} index_queries bf16")
    ref_s = oracle.index_scores(*[pb[k] for k in BATCH])
    scores_variants(arch, prof, d, ref_s, ok, name, "bf16 ", sm70_tiled=False)


def bf_attention(arch, pa, tokens, counts, tok_h, cnt_h, da, routes, ok, what):
    """bfloat16 q/K/V (interleaved cache), bfloat16 out, on every route that takes it here."""
    q, k, v = (pa[x].astype(BF16) for x in ("q", "k_cache", "v_cache"))
    eo, el = oracle.sparse_attention(q, k, v, pa["block_table"], tok_h, cnt_h, pa["req_ids"],
                                     pa["seq_lens"])
    kv = to_device(np.stack([k, v], axis=1))
    dq = to_device(q)
    for route in routes:
        if route != "generic" and arch == "sm_70":
            continue                  # no bfloat16 tensor cores: bfloat16 is generic there
        o = poison(cuda.device_array(q.shape, BF16))
        lse = poison(cuda.device_array(q.shape[:2], np.float32))
        numqsa.sparse_attention(dq, kv[:, 0], kv[:, 1], da[1], tokens, counts, da[2], da[3],
                                route_name=route, out=(o, lse))
        assert_matches_oracle(o.copy_to_host(), eo, dtype="bfloat16", what=f"{what} {route} out")
        assert_matches_oracle(lse.copy_to_host(), el, dtype="bfloat16", what=f"{what} {route} lse")
        ok(f"{what} {route}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="both", choices=["sm_90", "sm_70", "both"])
    ap.add_argument("--routes", default=os.environ.get("NUMQSA_SANITIZE_ROUTES", DEFAULT_ROUTES))
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    routes = [r for r in a.routes.split(",") if r]
    t0 = time.time()
    n = 0
    for arch in (("sm_90", "sm_70") if a.arch == "both" else (a.arch,)):
        n += run(arch, routes, a.quick)
    print(f"cases: {n} ok ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
