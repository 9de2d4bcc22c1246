"""Engine metadata adapters (simulator): cu_seqlens / FlashInfer paged indptr -> numqsa's batch,
checked element by element and through the oracle (same answer as the original metadata)."""
import numpy as np

import oracle
from numqsa.stages.metadata import rows_from_query_start_loc, tables_from_paged_indptr
from oracle.problems import make_problem


def test_rows_from_query_start_loc():
    seq_lens = np.array([10, 3, 7], np.int32)
    qsl = np.array([0, 4, 5, 8], np.int32)        # 4, 1 and 3 query rows: each request's last tokens
    req, pos = rows_from_query_start_loc(qsl, seq_lens, rows=10)
    np.testing.assert_array_equal(req, [0, 0, 0, 0, 1, 2, 2, 2, -1, -1])
    np.testing.assert_array_equal(pos, [6, 7, 8, 9, 2, 4, 5, 6, -1, -1])
    r2, p2 = rows_from_query_start_loc(qsl.astype(np.int64), seq_lens)
    np.testing.assert_array_equal(r2, req[:8])
    np.testing.assert_array_equal(p2, pos[:8])


def test_paged_indptr_through_the_oracle(seed):
    p = make_problem([70, 41, 9], rows_per_req=[3, 2, 1], page_size=16, Hq=2, Hkv=1, D=16, Hi=2,
                     Di=16, dtype=np.float16, seed=seed)
    bt, lens, ps = p["block_table"], p["seq_lens"], 16
    npages = -(-lens // ps)
    indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
    indices = np.concatenate([bt[q, :npages[q]] for q in range(len(lens))]).astype(np.int32)
    last = (lens - (npages - 1) * ps).astype(np.int32)
    table, seq_lens = tables_from_paged_indptr(indptr, indices, last, page_size=ps, cols=bt.shape[1] + 1)
    np.testing.assert_array_equal(seq_lens, lens)
    for q in range(len(lens)):
        np.testing.assert_array_equal(table[q, :npages[q]], bt[q, :npages[q]])
        assert (table[q, npages[q]:] == -1).all()
    want = oracle.qsa_prefill(p["qi"], p["index_cache"], p["index_block_table"], p["q"], p["k_cache"],
                              p["v_cache"], bt, p["req_ids"], p["positions"], lens, Kb=3)
    got = oracle.qsa_prefill(p["qi"], p["index_cache"], p["index_block_table"], p["q"], p["k_cache"],
                             p["v_cache"], table, p["req_ids"], p["positions"], seq_lens, Kb=3)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)
