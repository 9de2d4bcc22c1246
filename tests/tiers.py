"""The two simulator tiers (issue 26): what ``pytest`` leaves to ``pytest -m slow``, and why no check
is lost.

``pytest`` runs the default tier: every kernel and route in the simulator against the oracle at the
smallest shapes that reach each code path, every public function, the bad-input table and the README
example. ``pytest -m slow`` runs the rest of the full tier (the sizes and parametrisations the
default tier repeats); ``.ci/run`` runs both. ``SLOW`` maps each test moved to the slow tier (its node
id under ``tests/``) to the default-tier tests that still reach its code path; ``conftest.py`` marks
them. Besides these, every API test that takes the ``api_attention`` fixture runs in the default tier
with attention on the generic kernel and, as ``[planned]``, in the slow tier on the planned route
(the grouped kernel keeps its own default-tier tests).
"""

_GEN = "test_attention_kernels.py::test_generic_layouts_and_page_sizes"
_P4 = "test_attention_kernels.py::test_page4_matches_oracle"
_GEO = "test_geometries.py::test_generic_attention_geometry"
_TOPK = "test_selection_kernels.py::test_topk_kernels"

SLOW = {
    # -- attention, generic FMA kernel -----------------------------------------------------------
    **{f"{_GEN}[{ps}-{lay}]": f"{_GEN}[64-interleaved], [784-head_major] and the contiguous "
       "page-16 caches of the other generic-route tests (each layout and each page size once)"
       for ps, lay in ((16, "interleaved"), (16, "head_major"), (64, "contiguous"),
                       (64, "head_major"), (784, "contiguous"), (784, "interleaved"))},
    "test_attention_kernels.py::test_generic_heads_dtypes[24-2]":
        "test_generic_heads_dtypes[12-1] (12 heads per KV head) and "
        "test_geometries.py::test_generic_attention_geometry[4-2-40-float32] (a second KV head)",
    "test_attention_kernels.py::test_prefill_chunks_bitwise[sm_70-generic]":
        "test_prefill_chunks_bitwise[sm_90-generic]: the same kernel",
    "test_attention_kernels.py::test_invariances[sm_70-generic]":
        "test_invariances[sm_90-generic] (slow): the same kernel in the simulator; in the default "
        "tier test_grouped.py::test_grouped_row_invariance",
    **{f"{_GEO}[{g}]": f"{_GEO}[6-1-256-float16], [12-1-256-bfloat16], [3-1-256-float32], "
       "[1-1-8-float16], [2-1-24-bfloat16], [4-2-40-float32]: both staged tiles (16 tokens at 6 heads "
       "per KV head, 8 at 12), each dtype's loads, one and two KV heads, odd head dims"
       for g in ("3-1-256-float16", "3-1-256-bfloat16", "6-1-256-bfloat16", "6-1-256-float32",
                 "12-1-256-float16", "12-1-256-float32", "24-2-256-float16", "24-2-256-float32",
                 "24-2-256-bfloat16", "1-1-8-bfloat16", "1-1-8-float32", "2-1-24-float16",
                 "2-1-24-float32", "4-2-40-float16", "4-2-40-bfloat16")},
    "test_geometries.py::test_generic_attention_page_sizes[784]":
        f"{_GEN}[784-head_major] (page size 784) and {_GEO}[12-1-256-bfloat16] (8-token tiles)",
    "test_bf16.py::test_generic_bf16[sm_70-None]": "test_generic_bf16[sm_90-None]: the same kernel",
    "test_bf16.py::test_generic_bf16[sm_70-float32]":
        "test_generic_bf16[sm_90-float32]: the same kernel",
    # -- attention, page-4 route (m8n8k4 page-4 kernel on sm_70, grouped kernel on sm_90) ---------
    **{f"test_grouped.py::test_grouped_direct_d_split[{c}]":
       "test_grouped_direct_d_split[6-64]: direct blocks on 1, 2 and 4 warps a head tile, against "
       "each other, union windows and the oracle (here: two head tiles; D 32, whose two k-steps "
       "allow no split past a parity)" for c in ("12-64", "3-32")},
    f"{_P4}[sm_70-random]":
        "test_page4_layouts_heads[sm_70-interleaved-64-12-1] and test_page4_long_context_sparse"
        "[sm_70] (the page-4 kernel on independent and overlapping selections)",
    f"{_P4}[sm_70-shared]": "test_page4_inert_stale_rows_and_bad_pages[sm_70] (shared groups)",
    f"{_P4}[sm_90-random]": "test_grouped.py::test_grouped_matches_oracle[pieces and solo rows-...]",
    f"{_P4}[sm_90-shared]": "test_grouped.py::test_grouped_matches_oracle[3 heads, shared-...]",
    f"{_P4}[sm_90-overlap]":
        "test_grouped.py::test_grouped_matches_oracle[two requests per window-...]",
    "test_attention_kernels.py::test_page4_layouts_heads[sm_70-head_major-784-24-2]":
        "test_page4_layouts_heads[sm_70-interleaved-64-12-1] (strided K/V on the page-4 kernel) and "
        f"{_GEN}[784-head_major]",
    "test_attention_kernels.py::test_page4_layouts_heads[sm_90-head_major-784-24-2]":
        "test_grouped.py::test_grouped_matches_oracle[24/2 heads, 784-token pages-...] and "
        f"{_GEN}[784-head_major]",
    "test_attention_kernels.py::test_page4_route_takes_any_selection[sm_70]":
        "test_page4_route_takes_any_selection[sm_90]: the route's split is the same on both",
    "test_attention_kernels.py::test_invariances[sm_90-generic]":
        "the generic kernel's correctness tests (a rerun, relocated pages and other rows change only "
        "the blocks' order) and test_grouped.py::test_grouped_row_invariance (the route users get)",
    "test_attention_kernels.py::test_page4_grouping_invariance[sm_70]":
        "test_page4_inert_stale_rows_and_bad_pages[sm_70], test_page4_layouts_heads[sm_70-...], "
        "test_page4_long_context_sparse[sm_70] (the page-4 kernel at its planned row grouping)",
    f"{_P4}[sm_70-overlap]":
        "test_page4_layouts_heads[sm_70-interleaved-64-12-1] (overlapping selections) and "
        "test_page4_inert_stale_rows_and_bad_pages[sm_70] (shared groups)",
    "test_attention_kernels.py::test_page4_layouts_heads[sm_90-interleaved-64-12-1]":
        "test_page4_layouts_heads[sm_70-interleaved-64-12-1] (interleaved K/V) and the grouped "
        "kernel's tests in test_grouped.py (12 heads per KV head: test_bf16.py::"
        "test_grouped_bf16_12_heads_d256)",
    "test_attention_kernels.py::test_page4_long_context_sparse[sm_90]":
        "test_grouped.py::test_grouped_matches_oracle[pieces and solo rows-...] (several pieces, "
        "solo rows) and test_page4_long_context_sparse[sm_70]",
    f"{_GEN}[16-contiguous]": f"{_GEN}[64-interleaved], [784-head_major] and every contiguous "
        "cache of the other generic-route tests",
    "test_grouped.py::test_grouped_matches_oracle[12 heads per KV head-seq_lens2-rows2-16-12-1-6-overlap]":
        "test_bf16.py::test_grouped_bf16_12_heads_d256 (12 heads per KV head in the grouped kernel)",
    "test_grouped.py::test_grouped_piece_boundaries":
        "test_grouped.py::test_grouped_matches_oracle[pieces and solo rows-...] (rows of 2-3 pieces "
        "and a remainder, merged) and test_grouped_row_invariance (a row alone and in its batch)",
    "test_attention_kernels.py::test_invariances[sm_70-page4]":
        "test_grouped.py::test_grouped_row_invariance (batch composition and relocation on the "
        "route sm_80+ users get) and the page-4 kernel's sm_70 tests (its correctness)",
    "test_attention_kernels.py::test_invariances[sm_90-page4]":
        "test_grouped.py::test_grouped_row_invariance (batch composition, rerun and relocation on "
        "the grouped kernel)",
    "test_attention_kernels.py::test_page4_grouping_invariance[sm_90]":
        "test_grouped.py::test_grouped_row_invariance (on sm_90 the route runs the grouped kernel)",
    "test_bf16.py::test_grouped_bf16[pieces and solo rows-seq_lens0-rows0-16-6-1-20-random]":
        "test_grouped_bf16_12_heads_d256 (bfloat16 through the grouped kernel) and "
        "test_grouped.py::test_grouped_matches_oracle[pieces and solo rows-...] (pieces, solo rows)",
    "test_bf16.py::test_qsa_prefill_bf16[sm_70]":
        "test_wrapper_bf16_device_arrays[generic] (the bfloat16 chain through the wrapper), "
        "test_sm70_bf16_takes_generic and test_index_scores_light_bf16[sm_70]",
    "test_bf16.py::test_grouped_bf16[two requests per window-seq_lens1-rows1-64-6-1-18-overlap]":
        "test_grouped_bf16_12_heads_d256 (bfloat16 in the grouped kernel) and the float16 case of "
        "test_grouped.py",
    "test_bf16.py::test_grouped_bf16[24/2 heads, 784-token pages-seq_lens2-rows2-784-24-2-4-overlap]":
        "test_grouped_bf16_12_heads_d256 and test_grouped.py::test_grouped_matches_oracle[24/2 "
        "heads, 784-token pages-...]",
    "test_bf16.py::test_qsa_prefill_bf16[sm_90]":
        "test_wrapper_bf16_device_arrays[generic] (the chain in bfloat16), "
        "test_grouped_bf16_12_heads_d256 (the grouped route)",
    "test_contracts.py::test_nonfinite_production_geometry[float32]":
        "test_nonfinite_production_geometry[float16] (D 256 tiles) and test_nonfinite_query (float32)",
    "test_contracts.py::test_nonfinite_page4_route[k]":
        "test_nonfinite_page4_route[q] (NaN scores on the page-4 route) and "
        "test_nonfinite_key_at_selected_token (inf in K)",
    "test_contracts.py::test_nonfinite_query[inf]": "test_nonfinite_query[nan], [-inf]",
    "test_contracts.py::test_nonfinite_value_at_selected_token[nan]":
        "test_nonfinite_value_at_selected_token[inf] (the same column propagation)",
    "test_contracts.py::test_compress_ratio_other_than_4[8]": "test_compress_ratio_other_than_4[2]",
    # -- selection -------------------------------------------------------------------------------
    "test_selection_kernels.py::test_index_keys[True-float16]": "test_index_keys[True-bfloat16]",
    "test_selection_kernels.py::test_index_keys[True-float32]": "test_index_keys[True-bfloat16]",
    "test_selection_kernels.py::test_index_queries[float32]":
        "test_index_queries[float16] and test_geometries.py::test_index_keys_and_queries_geometry",
    "test_selection_kernels.py::test_index_queries[bfloat16]":
        "test_index_queries[float16] and "
        "test_geometries.py::test_index_keys_and_queries_geometry[bfloat16]",
    "test_geometries.py::test_index_keys_and_queries_geometry[float16]":
        "test_index_keys_and_queries_geometry[bfloat16] and test_selection_kernels.py::test_index_keys",
    "test_geometries.py::test_index_keys_and_queries_geometry[float32]":
        "test_index_keys_and_queries_geometry[bfloat16] and test_selection_kernels.py::test_index_keys",
    **{f"test_selection_kernels.py::test_index_scores_tiled[{c}]":
       "test_index_scores_tiled[sm_90-2-True] and test_geometries.py::test_index_scores_tiled_geometry "
       "(keys-as-M, per-warp-M and m8n8k4 with stale, inert and padding rows)"
       for c in ("sm_90-4-False", "sm_70-4-False", "sm_90-8-False", "sm_70-2-False")},
    **{f"test_geometries.py::test_index_scores_tiled_geometry[4-128-{c}]":
       f"test_index_scores_tiled_geometry[2-32-{c}] and [4-128-sm_90-keysm-float16]"
       for c in ("sm_90-generic-float16", "sm_70-None-float16", "sm_90-keysm-bfloat16",
                 "sm_90-generic-bfloat16")},
    "test_selection_kernels.py::test_index_scores_direct[float16-strided]":
        "test_index_scores_direct[float16] and the element loads of "
        "test_index_scores_tiled[sm_90-2-True]",
    "test_selection_kernels.py::test_index_scores_direct[bfloat16]":
        "test_index_scores_direct[float16] and test_bf16.py::test_index_scores_tiled_bf16",
    "test_bf16.py::test_index_scores_tiled_bf16[8-False]":
        "test_geometries.py::test_index_scores_tiled_geometry[2-32-sm_90-generic-bfloat16] "
        "(per-warp-M bfloat16)",
    **{f"{_TOPK}[{route}-{kind}]":
       f"{_TOPK}[registers-wide], [bitmap-clustered], [radix-sparse], "
       "test_geometries.py::test_topk_boundaries (every route: Kb - 1, Kb, Kb + 1 visible groups, "
       "zero plateaus, -0.0 ties) and test_contracts.py::test_topk_nan_ranks_first"
       for route, kinds in (("registers", ("random", "clustered", "plateau", "sparse", "zeros",
                                           "signed_zero")),
                            ("bitmap", ("random", "plateau", "sparse", "zeros", "signed_zero",
                                        "wide")),
                            ("radix", ("random", "clustered", "plateau", "zeros", "signed_zero",
                                       "wide")))
       for kind in kinds},
    **{f"test_selection_kernels.py::test_topk_exact[{kind}]":
       "test_topk_exact[signed_zero] (the planned route) and the kernels' own cases"
       for kind in ("random", "zeros", "plateau", "wide")},
    "test_selection_kernels.py::test_select_dense_boundary[2052]":
        "test_select_dense_boundary[2050], [2051] (the last dense and the first sparse position)",
    "test_selection_kernels.py::test_select_vs_oracle[16-False]":
        "test_geometries.py::test_select_indexer_geometry[784-True] (the fused chain, odd rows, "
        "poisoned out=), test_select_dense_boundary and test_contracts.py::"
        "test_select_with_nonfinite_index_cache",
    "test_selection_kernels.py::test_select_vs_oracle[64-True]":
        "test_geometries.py::test_select_indexer_geometry[784-True]",
    "test_selection_kernels.py::test_select_vs_oracle[784-True]":
        "test_geometries.py::test_select_indexer_geometry[784-True]",
    "test_geometries.py::test_select_indexer_geometry[16-False]":
        "test_select_indexer_geometry[784-True] and test_contracts.py::test_select_with_nonfinite_"
        "index_cache (page 16, an index table of its own)",
    # -- API -------------------------------------------------------------------------------------
    "test_wrapper.py::test_prepared_launches_follow_new_arrays[interleaved]":
        "test_prepared_launches_follow_new_arrays[contiguous] (re-pointed launches) and the "
        "interleaved layouts of the kernel tests",
    "test_resources.py::test_resource_report":
        "none in the simulator: the offline compile of every kernel for sm_70 and sm_90 (about 80 s "
        "on two cores when not cached) runs in the slow tier, which .ci/run runs",
    "test_wrapper.py::test_run_writes_out_buffers[generic]":
        "test_run_matches_oracle_several_batches[generic] (poisoned out= buffers, all four) and "
        "test_bad_input.py::test_numpy_out_buffers_written[generic-False] (non-contiguous)",
    "test_wrapper.py::test_bfloat16_from_numpy[generic]":
        "test_bf16.py::test_wrapper_bf16_device_arrays[generic] and the bfloat16 kernel tests",
    "test_prefill.py::test_prefill_numpy_matches_oracle[generic-interleaved]":
        "test_prefill_numpy_matches_oracle[generic-contiguous] and the interleaved caches of the "
        "kernel tests",
    "test_bad_input.py::test_numpy_out_buffers_written[generic-True]":
        "test_numpy_out_buffers_written[generic-False] and test_wrapper.py::"
        "test_run_matches_oracle_several_batches[generic] (contiguous out= buffers)",
    "test_readme.py::test_readme_numpy_example":
        "test_readme_numpy_example_fresh_process_without_simulator_flag (the same block, as a user "
        "runs it)",
}
