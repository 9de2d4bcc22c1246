"""``python -m numqsa``: the main job — a default QSA prefill problem, run and checked against the oracle.

On a GPU: 8K context, 4096 query rows at the last positions, the Qwen3.8 per-rank geometry
(Hq 6 / Hkv 1 / D 256, Hi 4 / Di 128, Kb 512, r 4), float16, page size 64 in a random physical order,
index queries correlated along rows so that adjacent rows share most of their selection, as in real
prefill. Without a GPU the same pipeline runs a small problem in the numba CUDA simulator.
Prints the time per stage and the agreement with the float64 oracle on sampled rows; exits 1 on a
mismatch.
"""
import argparse
import os
import sys
import time


def _backend():
    """Re-run under the simulator when there is no GPU (numba reads the switch at import)."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return "simulator"
    from numba import cuda
    if cuda.is_available():
        return "gpu"
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    os.execv(sys.executable, [sys.executable, "-m", "numqsa", *sys.argv[1:]])


GPU_PROBLEM = dict(context=8192, rows=4096, Hq=6, Hkv=1, D=256, Hi=4, Di=128, Kb=512, page_size=64,
                   sample=48)
SIM_PROBLEM = dict(context=150, rows=6, Hq=2, Hkv=1, D=32, Hi=2, Di=32, Kb=8, page_size=16,
                   sample=6)


def correlated_queries(rng, rows, hi, di, rho=0.97):
    """Index queries of adjacent rows drift slowly (AR(1) along rows), as in a real prompt."""
    import numpy as np
    q = np.empty((rows, hi, di))
    q[0] = rng.standard_normal((hi, di))
    for i in range(1, rows):
        q[i] = rho * q[i - 1] + np.sqrt(1 - rho * rho) * rng.standard_normal((hi, di))
    return q


def overlap(tokens, counts):
    """Mean fraction of a row's selection also selected by the previous row."""
    import numpy as np
    fr = []
    for i in range(1, tokens.shape[0]):
        a, b = tokens[i, :counts[i]], tokens[i - 1, :counts[i - 1]]
        if a.size:
            fr.append(np.intersect1d(a, b).size / a.size)
    return float(np.mean(fr)) if fr else 0.0


def main(argv=None):
    ap = argparse.ArgumentParser(description="run and check the default QSA prefill problem")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rows", type=int, help="override the number of query rows")
    ap.add_argument("--context", type=int, help="override the context length")
    args = ap.parse_args(argv)
    backend = _backend()

    import numpy as np
    from numba import cuda

    import numqsa
    import oracle
    from numqsa.testing import assert_matches_oracle, assert_selection_matches
    from oracle.problems import make_problem

    cfg = dict(GPU_PROBLEM if backend == "gpu" else SIM_PROBLEM)
    cfg["rows"] = args.rows or cfg["rows"]
    cfg["context"] = args.context or cfg["context"]
    rng = np.random.default_rng(args.seed)
    p = make_problem([cfg["context"]], rows_per_req=[cfg["rows"]], page_size=cfg["page_size"],
                     Hq=cfg["Hq"], Hkv=cfg["Hkv"], D=cfg["D"], Hi=cfg["Hi"], Di=cfg["Di"],
                     dtype=np.float16, seed=args.seed)
    p["qi"] = correlated_queries(rng, cfg["rows"], cfg["Hi"], cfg["Di"]).astype(np.float16)
    print(f"numqsa main job on {backend}: {cfg['rows']} rows at the end of a {cfg['context']}-token "
          f"context, Hq {cfg['Hq']} / Hkv {cfg['Hkv']} / D {cfg['D']}, Hi {cfg['Hi']} / Di {cfg['Di']}, "
          f"Kb {cfg['Kb']}, page size {cfg['page_size']}, float16", flush=True)

    d = {k: cuda.to_device(np.ascontiguousarray(v)) for k, v in p.items()}
    batch = (d["req_ids"], d["positions"], d["seq_lens"])

    def run():
        tokens, counts, groups = numqsa.select(d["qi"], d["index_cache"], d["index_block_table"],
                                               *batch, Kb=cfg["Kb"])
        out, lse = numqsa.sparse_attention(d["q"], d["k_cache"], d["v_cache"], d["block_table"],
                                           tokens, counts, d["req_ids"], d["seq_lens"])
        return tokens, counts, groups, out, lse

    def timed(fn, reps):
        times = []
        for _ in range(reps):
            cuda.synchronize()
            t0 = time.perf_counter()
            res = fn()
            cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return res, float(np.median(times)) * 1e3

    gpu = backend == "gpu"
    reps = 5 if gpu else 1
    if gpu:
        run()  # compile outside the timings
    sel, t_sel = timed(lambda: numqsa.select(d["qi"], d["index_cache"], d["index_block_table"],
                                             *batch, Kb=cfg["Kb"]), reps)
    tokens, counts, groups = sel
    (out, lse), t_att = timed(lambda: numqsa.sparse_attention(
        d["q"], d["k_cache"], d["v_cache"], d["block_table"], tokens, counts, d["req_ids"],
        d["seq_lens"]), reps)
    t_all = timed(run, reps)[1] if gpu else t_sel + t_att   # the simulator is slow enough once

    tokens_h, counts_h, groups_h = (x.copy_to_host() for x in (tokens, counts, groups))
    out_h, lse_h = out.copy_to_host(), lse.copy_to_host()
    rows = np.sort(rng.choice(cfg["rows"], min(cfg["sample"], cfg["rows"]), replace=False))
    sub = (p["req_ids"][rows], p["positions"][rows], p["seq_lens"])
    s_ref = oracle.index_scores(p["qi"][rows], p["index_cache"], p["index_block_table"], *sub)
    ok = True
    try:
        assert_selection_matches(groups_h[rows], tokens_h[rows], counts_h[rows], s_ref, *sub,
                                 Kb=cfg["Kb"])
        sel_msg = "selection matches the oracle (spec §8)"
    except AssertionError as err:
        ok, sel_msg = False, f"SELECTION MISMATCH: {err}"
    ref_out, ref_lse = oracle.sparse_attention(p["q"][rows], p["k_cache"], p["v_cache"],
                                               p["block_table"], tokens_h[rows], counts_h[rows],
                                               p["req_ids"][rows], p["seq_lens"])
    try:
        st = assert_matches_oracle(out_h[rows], ref_out, dtype="float16", what="out")
        assert_matches_oracle(lse_h[rows], ref_lse, dtype="float32", what="lse")
        att_msg = (f"attention matches the oracle: rel L2 {st['rel_l2']:.2e}, cos {st['cos']:.7f}, "
                   f"max abs {st['max_abs']:.2e}, all finite")
    except AssertionError as err:
        ok, att_msg = False, f"ATTENTION MISMATCH: {err}"

    print(f"\n{'stage':28s} {'time':>10s}")
    print(f"{'select (scores+top-k+expand)':28s} {t_sel:8.3f} ms")
    print(f"{'sparse attention':28s} {t_att:8.3f} ms")
    print(f"{'prefill (both)':28s} {t_all:8.3f} ms")
    if not gpu:
        print("(simulator times measure Python threads, not a GPU)")
    print(f"\nadjacent-row selection overlap {overlap(tokens_h, counts_h):.1%}; "
          f"checked {rows.size} sampled rows:")
    print(" ", sel_msg)
    print(" ", att_msg)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
