"""The whole QSA prefill in one call: selection (§4-§5) then sparse attention (§6)."""
from .attention import sparse_attention
from .selection import select

__all__ = ["qsa_prefill"]


def qsa_prefill(qi, index_cache, index_block_table, q, k_cache, v_cache, block_table, req_ids,
                positions, seq_lens, *, Kb=512, r=4, scale=None):
    """``(out, lse, tokens, counts)``: each row attends to its top-``Kb`` groups plus its tail.

    ``qi [rows, Hi, Di]`` are finished index queries (after norm and RoPE); the index cache holds
    finished compressed keys. Cost: the sum of :func:`oracle.index_scores`, top-k, expansion and
    :func:`oracle.sparse_attention`.
    """
    tokens, counts, _ = select(qi, index_cache, index_block_table, req_ids, positions, seq_lens,
                               Kb=Kb, r=r)
    out, lse = sparse_attention(q, k_cache, v_cache, block_table, tokens, counts, req_ids,
                                seq_lens, scale=scale, r=r)
    return out, lse, tokens, counts
