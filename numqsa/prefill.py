"""The whole QSA prefill in one call: selection, then sparse attention, on the caller's stream."""
from . import device as dev
from .attention import sparse_attention
from .selection import select

__all__ = ["qsa_prefill"]


def qsa_prefill(qi, index_cache, index_block_table, q, k_cache, v_cache, block_table, req_ids,
                positions, seq_lens, *, Kb=512, r=4, scale=None, out_dtype=None, stream=None):
    """``(out, lse, tokens, counts)`` — each row attends to its top-``Kb`` groups plus its tail.

    Mirrors :func:`oracle.qsa_prefill`. ``qi [rows, Hi, Di]`` are finished index queries; the index
    cache holds finished compressed keys. The selection stays on the device between the stages.
    NumPy inputs give NumPy outputs; device inputs stay on the device (no copies).
    """
    stream = dev.resolve_stream(stream)
    was_host = dev.is_host(q)
    arrays = [qi, index_cache, index_block_table, q, k_cache, v_cache, block_table, req_ids,
              positions, seq_lens]
    (qi, index_cache, index_block_table, q, k_cache, v_cache, block_table, req_ids, positions,
     seq_lens) = [dev.as_device(a, stream)[0] for a in arrays]
    tokens, counts, _ = select(qi, index_cache, index_block_table, req_ids, positions, seq_lens,
                               Kb=Kb, r=r, stream=stream)
    out, lse = sparse_attention(q, k_cache, v_cache, block_table, tokens, counts, req_ids, seq_lens,
                                scale=scale, r=r, out_dtype=out_dtype, stream=stream)
    return tuple(dev.host_like(x, was_host, stream) for x in (out, lse, tokens, counts))
