"""The functional API over :class:`numqsa.QSAPrefillWrapper`: :func:`qsa_prefill`, :func:`select`,
:func:`sparse_attention`.

Each call plans the batch and runs one layer (or one half) on a wrapper kept per geometry, device,
stream and thread (or in the caller's :class:`numqsa.Workspace`), so repeated calls of one layout
reuse the prepared launches. A call runs on the device of its CUDA arrays, all checked to be on one
device before any launch. The single-stage functions (``index_scores``, ``page4_plan``, ...) have
nothing to plan: they are their stages' launchers (:mod:`numqsa.stages`).
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from oracle import validate as V

from . import device as dev
from .stages.attention import attention_launch, check_common, host_checks, out_dtype_of
from .stages.common import fill_out, kernel_dtype
from .wrapper import Workspace, cached_wrapper

__all__ = ["qsa_prefill", "select", "sparse_attention"]

# a forced route runs the direct launcher, on its arrays' device
_attention_launch = dev.on_arrays_device(attention_launch)


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
    Kb = V.check_int(Kb, "Kb")
    r = V.check_int(r, "r")
    qd = kernel_dtype(q, "q", dev.array_kind(q, "q"))
    qid = kernel_dtype(qi, "qi", dev.array_kind(qi, "qi"))
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
    device = _device(qi=qi, index_cache=index_cache, index_block_table=index_block_table, q=q,
                     k_cache=k_cache, v_cache=v_cache, block_table=block_table, req_ids=req_ids,
                     positions=positions, seq_lens=seq_lens, out=out)
    with dev.on_device(device):
        handle = (dev.current_stream_handle(lead_kind, q) if stream is None
                  else dev.stream_handle(stream))
        w = cached_wrapper("prefill", handle, workspace, device, **geometry)
        key = (w.out_dtype, handle)           # the kept outputs: shapes are compared on use
        w.plan(req_ids, positions, seq_lens, block_table, index_block_table, num_groups=num_groups,
               validate=validate, stream=handle)
        if out is not None:
            if not isinstance(out, (tuple, list)) or len(out) not in (2, 4):
                raise V.QSAInputError("out must be a tuple (out, lse) or (out, lse, tokens, "
                                      "counts)")
            if len(out) == 2:
                out = tuple(out) + _fresh_selection(w, lead_kind, q, workspace, key)
        elif workspace is not None:
            specs = [("out", (w._rows, w.Hq, w.D), w.out_dtype),
                     ("lse", (w._rows, w.Hq), "float32"),
                     ("tokens", (w._rows, w.width), "int32"), ("counts", (w._rows,), "int32")]
            out = workspace.outputs(key, specs, lead_kind, q, dev.resolve_stream(handle))
        result = w.run(qi, index_cache, q, k_cache, v_cache, out=out, return_selection=True,
                       stream=handle)
        if lead_kind == "numpy" and workspace is not None:
            s = dev.resolve_stream(handle)
            result = tuple(dev.host_like(x, True, s) if not isinstance(x, np.ndarray) else x
                           for x in result)
        return result


def _device(**arrays):
    """The call's device: that of its first CUDA array (the query's: callers list it first); the
    current device when every array is NumPy. The wrapper checks every other array against it
    before any launch, each once: its plan the metadata, its run the layer's arrays and the ``out``
    buffers (raising :class:`QSAInputError` naming both). Checking them all here as well cost the
    functional calls 18-21 us of host time a call on the H200 (session 11)."""
    for name, a in arrays.items():
        if name == "out" and isinstance(a, (tuple, list)):
            named = [(f"{name}[{i}]", x) for i, x in enumerate(a)]
        else:
            named = [(name, a)]
        d = dev.same_device(named)
        if d is not None:
            return d
    return dev.current_device()


def _fresh_selection(w, kind, like, workspace, key):
    shapes = (((w._rows, w.width), "int32"), ((w._rows,), "int32"))
    if kind == "numpy":
        return tuple(np.empty(s, dt) for s, dt in shapes)
    return tuple(dev.new_array(kind, s, dt, like, None) for s, dt in shapes)


def select(qi, index_cache, index_block_table, req_ids, positions, seq_lens, *, Kb=512, r=4,
           out=None, stream=None, score_bytes=None, workspace=None, num_groups=None, validate=None):
    """Scores -> top-k -> expansion on the device: ``(tokens, counts, groups)``.

    Mirrors :func:`oracle.select`; a thin layer over :class:`numqsa.QSAPrefillWrapper` (``plan``
    then ``run_select`` on a wrapper kept per geometry, stream and thread), so repeated calls of
    one layout replay prepared launches. Rows are processed in chunks whose float32 score block
    stays under ``score_bytes`` (:data:`numqsa.stages.selection.SELECT_SCORE_BYTES`, 1 GiB),
    reused from chunk to chunk. Peak extra device memory: ``min(rows, score_bytes // (4*G)) * G *
    4`` bytes of scores, plus the outputs ``rows * (Kb*r + r - 1 + Kb + 1) * 4`` bytes. 16,384 rows
    at 1M tokens: 1 GiB of scores + 0.17 GiB of outputs.

    ``G`` (``num_groups``) defaults to ``max(seq_lens) // r`` for host ``seq_lens`` (or
    ``validate=True``), else to the index table's capacity ``cols * R``; a given ``num_groups`` must
    be at least ``max(seq_lens) // r``. ``validate``: None (default) checks host metadata and never
    reads device metadata back (no wait for the GPU; the kernels make a row needing a bad page id
    inert), True reads it back once, False checks shapes and dtypes only.
    ``out`` may be a ``(tokens, counts, groups)`` triple (``None`` entries are allocated);
    ``workspace`` a float32 device array of at least ``chunk * G`` elements to hold the scores, or a
    :class:`numqsa.Workspace` to keep the wrapper in. Arrays come back as ``qi`` came in (NumPy in,
    NumPy out, copied in and out); ``stream`` defaults to the current stream of ``qi``'s framework.
    With ``out=`` a repeated call of one layout allocates nothing and never synchronises
    (CUDA-graph capture).
    """
    r = V.check_r(r)
    rows, _ = V.check_batch(req_ids, positions, seq_lens)
    n_pages, R, di = V.check_index_cache(index_cache)
    hi = V.check_index_q(qi, rows, di)
    lead_kind = dev.array_kind(qi, "qi")
    qd = kernel_dtype(qi, "qi", lead_kind)
    kernel_dtype(index_cache, "index_cache", dev.array_kind(index_cache, "index_cache"))
    Kb = V.check_kb(Kb)
    if score_bytes is not None:
        score_bytes = V.check_int(score_bytes, "score_bytes")
    handle = (dev.current_stream_handle(lead_kind, qi) if stream is None
              else dev.stream_handle(stream))
    keep = workspace if isinstance(workspace, Workspace) else None
    device = _device(qi=qi, index_cache=index_cache, index_block_table=index_block_table,
                     req_ids=req_ids, positions=positions, seq_lens=seq_lens, out=out,
                     workspace=None if keep is not None else workspace)
    with dev.on_device(device):
        w = cached_wrapper("select", handle, keep, device, Hi=hi, Di=di, Hq=1, Hkv=1, D=1, r=r,
                           Kb=Kb, dtype=qd, score_bytes=score_bytes)
        w.plan(req_ids, positions, seq_lens, index_block_table, num_groups=num_groups,
               validate=validate, stream=handle)
        scores = None
        if workspace is not None and keep is None:
            need = w.score_elements(index_cache)
            V.check_array(workspace, "workspace")
            if rows and (V.dtype_name(workspace) != "float32"
                         or int(np.prod(workspace.shape)) < need):
                raise V.QSAInputError(f"workspace must be float32 with >= {need} elements")
            if not isinstance(workspace, np.ndarray):
                scores = workspace
        if out is not None:
            shapes = ((rows, w.width), (rows,), (rows, Kb))
            out = fill_out(out, ("tokens", "counts", "groups"),
                           lambda i: dev.new_array(lead_kind, shapes[i], np.int32, qi, None))
        return w.run_select(qi, index_cache, out=out, stream=handle, scores=scores)


def sparse_attention(q, k_cache, v_cache, block_table, tokens, counts, req_ids, seq_lens, *,
                     scale=None, r=4, out_dtype=None, out=None, stream=None, route_name=None,
                     workspace=None, validate=None):
    """``(out [rows, Hq, D], lse float32 [rows, Hq])`` over ``S_i = tokens[i, :counts[i]]``.

    Mirrors :func:`oracle.sparse_attention`; a thin layer over :class:`numqsa.QSAPrefillWrapper`
    (``plan`` then ``run_attention`` on a wrapper kept per geometry, stream and thread, or in
    ``workspace``, a :class:`numqsa.Workspace`), so repeated calls of one layout replay prepared
    launches. ``out`` (optional) may be a tuple ``(out, lse)`` of preallocated buffers (``None``
    entries are allocated). The output dtype is the query's unless ``out_dtype`` (float16/float32).
    Arrays come back as ``q`` came in (NumPy in, NumPy out, copied in and out); ``stream``
    defaults to the current stream of ``q``'s framework.

    ``validate``: None (default) checks host values only (host selections against host metadata,
    the page table when it and ``seq_lens`` are on the host) and never reads a device array back
    (no wait for the GPU); True reads device tables back once; False skips the page-table check.
    Inert rows and rows whose ids are out of range (the kernels check) give 0 / ``-inf``.
    ``route_name`` ("generic" or "page4") forces a route (tests and benchmarks): such a call runs
    the direct launcher (:func:`attention_launch`, same checks and results, no prepared launches);
    the page-4 route needs selections of whole aligned groups plus one tail run.
    """
    if route_name is not None:
        return _attention_launch(q, k_cache, v_cache, block_table, tokens, counts, req_ids,
                                 seq_lens, scale=scale, r=r, out_dtype=out_dtype, out=out,
                                 stream=stream, route_name=route_name, workspace=workspace,
                                 validate=validate)
    r, rows, num_pages, page_size, hkv, d, hq, qd, kd = check_common(q, k_cache, v_cache, req_ids,
                                                                      seq_lens, r)
    kb = V.check_selection(tokens, counts, rows, r)
    host_checks(tokens, counts, block_table, req_ids, seq_lens, page_size, num_pages,
                 validate)
    od = out_dtype_of(out_dtype, qd)
    lead_kind = dev.array_kind(q, "q")
    handle = (dev.current_stream_handle(lead_kind, q) if stream is None
              else dev.stream_handle(stream))
    keep = workspace if isinstance(workspace, Workspace) else None
    device = _device(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
                     tokens=tokens, counts=counts, req_ids=req_ids, seq_lens=seq_lens, out=out)
    with dev.on_device(device):
        w = cached_wrapper("attention", handle, keep, device, Hi=1, Di=1, Hq=hq, Hkv=hkv, D=d, r=r,
                           Kb=max(1, kb), dtype=qd, out_dtype=od, scale=scale)
        # the table was checked above (or not, as validate says): the plan does not check it again
        w.plan(req_ids, None, seq_lens, block_table, validate=False, stream=handle)
        if out is not None:
            shapes = (((rows, hq, d), od), ((rows, hq), "float32"))
            out = fill_out(out, ("out", "lse"),
                           lambda i: dev.new_array(lead_kind, shapes[i][0], shapes[i][1], q, None))
        return w.run_attention(q, k_cache, v_cache, tokens, counts, out=out, stream=handle)
