"""The whole QSA prefill in one call: a thin layer over :class:`numqsa.QSAPrefillWrapper`.

Each call plans the batch and runs one layer on a wrapper kept per geometry, stream and thread (or in
the caller's :class:`Workspace`), so repeated calls of one layout reuse the prepared launches
(:func:`numqsa.select` and :func:`numqsa.sparse_attention` do the same with ``run_select`` and
``run_attention``).
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from oracle import validate as V

from . import device as dev
from .wrapper import _Buffers, cached_wrapper, check_geometry_int

__all__ = ["qsa_prefill", "Workspace"]


class Workspace:
    """Keeps wrappers (their buffers and prepared launches) and outputs across functional calls.

    With a workspace, :func:`qsa_prefill` writes its results into buffers kept here (reused while
    the shapes stay the same: a second call of the same shapes allocates no device memory); the
    arrays a call returns are therefore overwritten by the next call. :func:`numqsa.select` and
    :func:`numqsa.sparse_attention` keep their wrapper here too (their results stay fresh arrays
    unless ``out=`` is given).
    """

    def __init__(self):
        self._wrappers = {}
        self._outs = {}
        self._scratch = _Buffers()

    def buffer(self, name, shape, dtype, stream):
        """A scratch device buffer kept by name (``select``/``sparse_attention``'s ``workspace=``)."""
        return self._scratch.buffer(name, shape, dtype, stream)

    def outputs(self, key, specs, like_kind, like, stream):
        bufs = self._outs.get(key)
        if bufs is None or [tuple(b.shape) for b in bufs] != [tuple(s) for _, s, _ in specs]:
            kind = "numba" if like_kind == "numpy" else like_kind
            bufs = self._outs[key] = tuple(dev.new_array(kind, s, dt, like, stream)
                                           for _, s, dt in specs)
        return bufs

    @property
    def nbytes(self):
        total = sum(w._ws.nbytes for w in self._wrappers.values()) + self._scratch.nbytes
        return total + sum(int(np.prod(b.shape)) * dev.np_dtype(str(b.dtype).replace("torch.", "")).itemsize
                           for bufs in self._outs.values() for b in bufs)


def qsa_prefill(qi: Any, index_cache: Any, index_block_table: Any, q: Any, k_cache: Any,
                v_cache: Any, block_table: Any, req_ids: Any, positions: Any, seq_lens: Any, *,
                Kb: int = 512, r: int = 4, scale: Optional[float] = None, out_dtype: Any = None,
                out: Optional[tuple] = None, workspace: Optional["Workspace"] = None,
                num_groups: Optional[int] = None, validate: Optional[bool] = None,
                stream: Any = None) -> tuple:
    """``(out, lse, tokens, counts)``: each row attends to its top-``Kb`` groups plus its tail.

    Mirrors :func:`oracle.qsa_prefill`. ``qi [rows, Hi, Di]`` are finished index queries (after norm
    and RoPE) and the index cache ``[idx_pages, R, Di]`` holds finished compressed keys;
    ``q [rows, Hq, D]``; ``k_cache``/``v_cache [num_pages, page_size, Hkv, D]`` (any strides).

    Arrays come back as they came in (``q``'s framework): NumPy in, NumPy out (copied in and out);
    torch/CuPy/numba CUDA arrays are used in place and fresh arrays of the same framework are
    returned, or the caller's ``out=(out, lse)`` / ``(out, lse, tokens, counts)`` buffers are
    written (NumPy buffers too, any strides). ``stream`` (numba stream, raw handle, torch/CuPy
    stream) defaults to the current stream of ``q``'s framework.

    ``validate`` (see :meth:`QSAPrefillWrapper.plan`): None (default) checks metadata that is on the
    host and never synchronises for device metadata; True also reads device tables back once.
    ``num_groups`` is the score width (``max(seq_lens) // r`` when ``seq_lens`` is on the host; for
    device ``seq_lens`` the index table's capacity unless given). Every check runs before any launch.
    Repeated calls of one layout reuse prepared launches; for the fastest path build a
    :class:`numqsa.QSAPrefillWrapper` once and call ``plan`` / ``run`` yourself.
    """
    for x, n, dims in ((qi, "qi", "[rows, Hi, Di]"), (q, "q", "[rows, Hq, D]"),
                       (k_cache, "k_cache", "[num_pages, page_size, Hkv, D]")):
        dev.array_kind(x, n)
        V._rank(x, n, len(dims.split(",")), dims)
    Kb = check_geometry_int(Kb, "Kb")
    r = check_geometry_int(r, "r")
    from .wrapper import _kernel_dtype
    qd = _kernel_dtype(q, "q", dev.array_kind(q, "q"))
    qid = _kernel_dtype(qi, "qi", dev.array_kind(qi, "qi"))
    if out_dtype is not None:
        try:
            out_dtype = dev.np_dtype(out_dtype).name
        except TypeError:
            raise V.QSAInputError(f"out_dtype {out_dtype!r} is not a dtype") from None
    geometry = dict(Hi=int(qi.shape[1]), Di=int(qi.shape[2]), Hq=int(q.shape[1]),
                    Hkv=int(k_cache.shape[2]), D=int(q.shape[2]), r=r, Kb=Kb, dtype=qd,
                    index_dtype=qid, out_dtype=out_dtype or qd, scale=scale)
    ks = tuple(k_cache.shape)
    if geometry["Hq"] % ks[2] and not geometry["Hq"] % ks[1] and ks[3] == geometry["D"]:
        raise V.QSAInputError(
            f"k_cache has shape {ks}, which looks head-major [num_pages, Hkv, page_size, D]; pass "
            f"k_cache.transpose(1, 2) (a view: no copy) so it reads [num_pages, page_size, Hkv, D]")
    if geometry["Hq"] % geometry["Hkv"]:
        raise V.QSAInputError(f"Hq = {geometry['Hq']} is not a positive multiple of Hkv = "
                              f"{geometry['Hkv']}")
    lead_kind = dev.array_kind(q, "q")
    handle = (dev.current_stream_handle(lead_kind, q) if stream is None
              else dev.stream_handle(stream))
    w = cached_wrapper("prefill", handle, workspace, **geometry)
    key = (w.out_dtype, handle)           # the kept outputs: shapes are compared on use
    w.plan(req_ids, positions, seq_lens, block_table, index_block_table, num_groups=num_groups,
           validate=validate, stream=handle)
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) not in (2, 4):
            raise V.QSAInputError("out must be a tuple (out, lse) or (out, lse, tokens, counts)")
        if len(out) == 2:
            out = tuple(out) + _fresh_selection(w, lead_kind, q, workspace, key)
    elif workspace is not None:
        specs = [("out", (w._rows, w.Hq, w.D), w.out_dtype), ("lse", (w._rows, w.Hq), "float32"),
                 ("tokens", (w._rows, w.width), "int32"), ("counts", (w._rows,), "int32")]
        out = workspace.outputs(key, specs, lead_kind, q, dev.resolve_stream(handle))
    result = w.run(qi, index_cache, q, k_cache, v_cache, out=out, return_selection=True,
                   stream=handle)
    if lead_kind == "numpy" and workspace is not None:
        s = dev.resolve_stream(handle)
        result = tuple(dev.host_like(x, True, s) if not isinstance(x, np.ndarray) else x
                       for x in result)
    return result


def _fresh_selection(w, kind, like, workspace, key):
    shapes = (((w._rows, w.width), "int32"), ((w._rows,), "int32"))
    if kind == "numpy":
        return tuple(np.empty(s, dt) for s, dt in shapes)
    return tuple(dev.new_array(kind, s, dt, like, None) for s, dt in shapes)
