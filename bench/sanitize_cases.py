"""One small case per kernel and route, for ``compute-sanitizer --tool memcheck`` on a GPU.

Each public function runs once on the sm_90 profile and once under ``NUMQSA_ARCH=sm_70`` (the m8n8k4
kernels), with routes forced, odd sizes, inert and stale rows, and a page size that is not a power of
two. Results are compared to the oracle so a silent wrong answer fails here too.
"""
import os
import sys

import numpy as np
from numba import cuda

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import numqsa  # noqa: E402
import oracle  # noqa: E402
from numqsa.testing import assert_matches_oracle, assert_selection_matches  # noqa: E402
from oracle.problems import make_problem  # noqa: E402


def run(arch):
    os.environ["NUMQSA_ARCH"] = arch
    ctx, rows = 8195, 515     # tiled scores admitted: 515 rows x 2048 groups >= 2^20
    positions = np.arange(ctx - rows, ctx, dtype=np.int32)
    positions[:3] = [-1, ctx + 40, 2]             # inert, stale, short
    p = make_problem([ctx], positions=positions, req_ids=np.zeros(rows, np.int32), page_size=48,
                     layout="interleaved", seed=7)
    batch = (p["req_ids"], p["positions"], p["seq_lens"])
    d = {k: cuda.to_device(np.ascontiguousarray(v)) for k, v in p.items()}
    dbatch = (d["req_ids"], d["positions"], d["seq_lens"])
    # pre-indexer
    g = 40
    k_raw = np.random.default_rng(1).standard_normal((g, 4, 128)).astype(np.float16)
    w = np.zeros(128, np.float16)
    cache = p["index_cache"].copy()
    numqsa.index_keys(k_raw, w, np.zeros(g, np.int32), np.arange(g, dtype=np.int32), cache,
                      p["index_block_table"])
    numqsa.index_queries(p["qi"], w, *batch)
    # scores on both routes, then the fused selection
    for tiled in ("1", "0"):
        os.environ["NUMQSA_INDEXER_TILED"] = tiled
        s = numqsa.index_scores(d["qi"], d["index_cache"], d["index_block_table"], *dbatch)
    ref_s = oracle.index_scores(p["qi"], p["index_cache"], p["index_block_table"], *batch)
    assert_matches_oracle(s.copy_to_host(), ref_s, dtype="float16", what=f"{arch} scores")
    tokens, counts, groups = numqsa.select(d["qi"], d["index_cache"], d["index_block_table"], *dbatch,
                                           Kb=512)
    assert_selection_matches(groups.copy_to_host(), tokens.copy_to_host(), counts.copy_to_host(),
                             ref_s, *batch, Kb=512)
    # attention: page-4 plan, both routes
    num_pages, ps = p["k_cache"].shape[:2]
    numqsa.page4_plan(tokens, counts, d["block_table"], d["req_ids"], d["seq_lens"], page_size=ps,
                      num_pages=num_pages)
    kv = cuda.to_device(np.stack([p["k_cache"], p["v_cache"]], axis=1))
    ref = oracle.sparse_attention(p["q"], p["k_cache"], p["v_cache"], p["block_table"],
                                  tokens.copy_to_host(), counts.copy_to_host(), *batch[::2])
    for route in ("generic", "page4"):
        out, lse = numqsa.sparse_attention(d["q"], kv[:, 0], kv[:, 1], d["block_table"], tokens,
                                           counts, d["req_ids"], d["seq_lens"], route_name=route)
        assert_matches_oracle(out.copy_to_host(), ref[0], dtype="float16", what=f"{arch} {route}")
    cuda.synchronize()
    print(f"{arch}: all kernels ran")


if __name__ == "__main__":
    for arch in ("sm_90", "sm_70"):
        run(arch)
