"""The whole QSA prefill in one call: selection, then sparse attention, on the caller's stream.

Repeated calls at fixed shapes allocate nothing when given a :class:`Workspace` (and, for the outputs,
``out=`` buffers or the workspace's own). That is also what CUDA-graph capture needs; see
:func:`qsa_prefill`'s docstring for the recipe.
"""
import numpy as np

from oracle import validate as V

from . import device as dev
from .attention import sparse_attention
from .selection import select, select_chunk_rows

__all__ = ["qsa_prefill", "Workspace"]


class Workspace:
    """Device buffers reused across :func:`qsa_prefill` calls.

    A buffer is allocated the first time a call needs it and reused while later calls need the same
    shape and dtype, so a second call of the same shapes allocates no device memory.
    """

    def __init__(self):
        self._buffers = {}

    def buffer(self, name, shape, dtype, stream):
        shape, dtype = tuple(int(s) for s in shape), np.dtype(dtype)
        buf = self._buffers.get(name)
        if buf is None or tuple(buf.shape) != shape or np.dtype(buf.dtype) != dtype:
            buf = dev.empty(shape, dtype, stream)
            self._buffers[name] = buf
        return buf

    @property
    def nbytes(self):
        return sum(b.size * np.dtype(b.dtype).itemsize for b in self._buffers.values())


def qsa_prefill(qi, index_cache, index_block_table, q, k_cache, v_cache, block_table, req_ids,
                positions, seq_lens, *, Kb=512, r=4, scale=None, out_dtype=None, out=None,
                workspace=None, num_groups=None, validate=True, stream=None):
    """``(out, lse, tokens, counts)``: each row attends to its top-``Kb`` groups plus its tail.

    Mirrors :func:`oracle.qsa_prefill`. ``qi [rows, Hi, Di]`` are finished index queries (after norm
    and RoPE) and the index cache holds finished compressed keys; ``q [rows, Hq, D]`` and the paged
    ``k_cache``/``v_cache`` as in :func:`numqsa.sparse_attention`. The selection stays on the device.

    Arrays: NumPy inputs give NumPy outputs (copied in and out). numba device arrays and PyTorch or
    CuPy CUDA tensors are used in place (no copies; any strides for the caches) and the results are
    numba device arrays (``torch.as_tensor(x, device="cuda")`` wraps one without a copy), or the
    caller's own ``out=(out, lse)`` buffers. ``stream`` takes a numba stream, a raw ``cudaStream_t``
    or a torch/CuPy stream; every launch goes on it.

    Repeated calls: pass ``workspace=Workspace()`` (scores, selection and output buffers are kept in
    it) and ``num_groups`` (the score width ``max(seq_lens) // r``, else read from ``seq_lens`` with a
    device-to-host copy); with ``validate=False`` the host-side checks of page tables are skipped too.
    Then a call allocates no device memory and never synchronises, so it can be captured in a CUDA
    graph: run it once eagerly (compiles the kernels), then capture the same call on a side stream,
    e.g. with ``torch.cuda.graph(g, stream=s)`` and ``stream=s``, and ``g.replay()`` after writing new
    inputs into the same buffers. Padding rows of a fixed-size batch are made inert (``req_ids = -1``).
    """
    stream = dev.resolve_stream(stream)
    was_host = dev.is_host(q)
    arrays = [qi, index_cache, index_block_table, q, k_cache, v_cache, block_table, req_ids,
              positions, seq_lens]
    (qi, index_cache, index_block_table, q, k_cache, v_cache, block_table, req_ids, positions,
     seq_lens) = [dev.as_device(a, stream)[0] for a in arrays]
    rows = int(q.shape[0])
    if num_groups is None:
        lens = V.host_ints(seq_lens)
        num_groups = int(lens.max()) // r if lens.size else 0
    sel_out, scores = None, None
    if workspace is not None:
        width = Kb * r + r - 1
        sel_out = (workspace.buffer("tokens", (rows, width), np.int32, stream),
                   workspace.buffer("counts", (rows,), np.int32, stream),
                   workspace.buffer("groups", (rows, Kb), np.int32, stream))
        chunk = select_chunk_rows(rows, num_groups)
        scores = workspace.buffer("scores", (max(1, chunk * max(num_groups, 1)),), np.float32, stream)
        if out is None:
            od = np.dtype(out_dtype or dev.float_dtype(q, "q"))
            out = (workspace.buffer("out", tuple(q.shape), od, stream),
                   workspace.buffer("lse", (rows, q.shape[1]), np.float32, stream))
    tokens, counts, _ = select(qi, index_cache, index_block_table, req_ids, positions, seq_lens,
                               Kb=Kb, r=r, out=sel_out, workspace=scores, num_groups=num_groups,
                               validate=validate, stream=stream)
    o, lse = sparse_attention(q, k_cache, v_cache, block_table, tokens, counts, req_ids, seq_lens,
                              scale=scale, r=r, out_dtype=out_dtype, out=out, workspace=workspace,
                              validate=validate, stream=stream)
    return tuple(dev.host_like(x, was_host, stream) for x in (o, lse, tokens, counts))
