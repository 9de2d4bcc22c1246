"""The attention stage: sparse attention over a selection (spec §6) and the page-4 route (spec §7).

``out[i, h] = sum_{t in S_i} softmax_t(scale <q[i,h], K[t, h // (Hq/Hkv)]>) V[t, h // (Hq/Hkv)]``.

:func:`attention_launch` is the launcher :class:`numqsa.QSAPrefillWrapper` records (and
:func:`numqsa.sparse_attention` runs for a forced ``route_name``): check (``oracle.validate``,
before any launch) -> the device (:mod:`numqsa.device`; device arrays and CUDA tensors are used in
place, strided K/V views included) -> route (:func:`numqsa.plan.plan_attention`) -> launch -> NumPy
back if the query was NumPy, else device arrays. :func:`page4_plan` and :func:`page4_attention` are
the stage's two halves as public functions: each mirrors its :mod:`oracle` namesake argument for
argument, adding ``out=``, ``stream=`` (and ``out_dtype=`` for the attention outputs).

Routes, one per problem layout and never by row count (a row's bits must not depend on its batch):
the generic kernel (:mod:`numqsa.kernels.attention`, any selection, fp32 FMA) and the page-4 route:
:mod:`numqsa.kernels.grouped` on sm_80+ (16-byte aligned caches; behind the page-4 plan, except
direct one-row windows, whose blocks plan their own pieces with the plan's checks), else the page-4
plan and the m8n8k4 / element-load kernel of :mod:`numqsa.kernels.page4`. ``NUMQSA_PAGE4=0`` forces
the generic route.
"""
import contextlib
import numpy as np

from oracle import validate as V

from .. import device as dev
from .. import launch
from ..kernels import attention as _generic
from ..kernels import grouped as _grouped
from ..kernels import page4 as _page4
from ..plan import plan_attention
from .common import ints, values_checked

__all__ = ["attention_launch", "page4_plan", "page4_attention", "route"]


def check_common(q, k_cache, v_cache, req_ids, seq_lens, r):
    r = V.check_r(r)
    (rows,) = V._rank(req_ids, "req_ids", 1, "[rows]")
    V.check_batch(req_ids, req_ids, seq_lens)          # attention reads no positions
    num_pages, page_size, hkv, d = V.check_kv(k_cache, v_cache, r)
    hq = V.check_q(q, rows, hkv, d)
    qd = dev.float_dtype(q, "q")
    kd = dev.float_dtype(k_cache, "k_cache")
    return r, rows, num_pages, page_size, hkv, d, hq, qd, kd


def out_dtype_of(out_dtype, qd):
    name = qd if out_dtype is None else dev.np_dtype(out_dtype).name
    if name not in dev.KERNEL_FLOATS:
        raise V.QSAInputError(f"out_dtype {name} is not supported ({', '.join(dev.KERNEL_FLOATS)})")
    return name


def _page4_unsupported(qd, kd, d, r, profile=None):
    """Why the grouped tensor-core kernel cannot take a problem ('' if it can)."""
    if qd == kd == "bfloat16" and profile is not None and profile.attention.mma != "m16n8k16":
        return f"bfloat16 tensor cores need sm_80+ ({profile.name}); bfloat16 goes generic there"
    if qd != kd or qd not in ("float16", "bfloat16"):
        return (f"it multiplies float16 or bfloat16 on tensor cores (q {qd}, cache {kd}); other "
                f"dtypes go generic")
    if d % 32:
        return f"head dim {d} is not a multiple of 32"
    if r != 4:
        return f"its virtual pages are 4 tokens (r = {r})"
    return ""


def _grouped_ok(profile, q, k_cache, v_cache):
    """The grouped kernel (cp.async, ldmatrix: sm_80+) takes aligned caches with a contiguous D axis
    and head dims its copy lanes tile (:func:`numqsa.kernels.grouped.takes_head_dim`); sm_70 keeps
    the m8n8k4 page-4 kernel, which also takes the rest (d 96, 160, 192, ...)."""
    return (profile.attention.mma == "m16n8k16" and _grouped.takes_head_dim(k_cache.shape[3])
            and _grouped.words_view(k_cache) is not None
            and _grouped.words_view(v_cache) is not None and _grouped.words_view(q, 4) is not None)


def _launch_grouped_route(q, k_cache, v_cache, pages, nv, tl, tokens, req_ids, scale, out, lse, od,
                          profile, stream, r, bufs, empty_rows=True, selection=None, verdict=None):
    """The grouped kernel of this device and layout over a page-4 plan. ``tokens`` (the selection
    the plan came from) lets windows of rows share loads; without it each row is its own window.
    ``empty_rows=False``: the tensor-core grouped kernel leaves rows without pages to the generic
    kernel. ``selection`` and ``verdict``: no plan ran; one-row windows plan their own pieces
    (:func:`numqsa.kernels.grouped.plans_own_pieces`). Returns whether the grouped kernel ran (the
    m8n8k4 page-4 kernel writes every row) and its attention kernel's record."""
    if _grouped_ok(profile, q, k_cache, v_cache):
        attn = _grouped.launch_grouped(q, k_cache, v_cache, pages, nv, tl, tokens, req_ids, scale,
                                       out, lse, profile, stream, bufs, empty_rows=empty_rows,
                                       selection=selection, verdict=verdict)
        return True, attn
    else:
        keys = None if tokens is None else bufs("page4.keys", _page4.keys_shape(tokens, pages, r),
                                                np.int32)
        _page4.launch_page4(q, k_cache, v_cache, pages, nv, tl, req_ids, scale, out, lse, profile,
                            stream, r, tokens=tokens, keys=keys)
        return False, None


def route(rows, page_size, r=4, cc=None):
    """The :class:`numqsa.plan.AttentionPlan` the public functions follow on this device."""
    return plan_attention(rows, dev.device_cc() if cc is None else cc, page_size, r)


def host_checks(tokens, counts, block_table, req_ids, seq_lens, page_size, num_pages, validate):
    """Value checks: host selections against host metadata (whatever ``validate``), the page table
    when it and ``seq_lens`` are on the host (or ``validate=True`` reads them back)."""
    if dev.is_host(tokens) and values_checked(validate or None, counts, req_ids, seq_lens):
        V.check_tokens(tokens, counts, req_ids, seq_lens)
    if values_checked(validate, block_table, seq_lens):
        V.check_table(block_table, seq_lens, units_per_page=page_size, num_pages=num_pages)


def attention_launch(q, k_cache, v_cache, block_table, tokens, counts, req_ids, seq_lens, *,
                     scale=None, r=4, out_dtype=None, out=None, stream=None, route_name=None,
                     workspace=None, validate=None, max_groups=None):
    """The direct launcher behind :func:`sparse_attention` (same arguments and results): what
    :class:`numqsa.QSAPrefillWrapper` records, and what a forced ``route_name`` runs.

    ``workspace`` (a :class:`numqsa.Workspace`) keeps the page-4 plan's buffers between calls.
    ``max_groups`` (the plan's ``max(seq_lens) // r`` when the host knows it) bounds the page-4
    plan's width with the table's capacity (:func:`numqsa.kernels.page4.plan_pages`).
    """
    r, rows, num_pages, page_size, hkv, d, hq, qd, kd = check_common(q, k_cache, v_cache, req_ids,
                                                                      seq_lens, r)
    V.check_selection(tokens, counts, rows, r)
    host_checks(tokens, counts, block_table, req_ids, seq_lens, page_size, num_pages, validate)
    od = out_dtype_of(out_dtype, qd)
    scale = 1.0 / np.sqrt(d) if scale is None else float(scale)
    plan = route(rows, page_size, r)
    name = route_name or plan.route
    if name not in ("generic", "page4"):
        raise V.QSAInputError(f"unknown route {name!r}")
    why = _page4_unsupported(qd, kd, d, r, plan.profile)
    if name == "page4" and why:
        if route_name == "page4":
            raise V.QSAInputError(f"the page-4 route cannot run this problem: {why}")
        name = "generic"
    stream = dev.caller_stream(stream, q)
    was_host = dev.is_host(q)
    qd_, kc, vc = (dev.as_device(x, stream)[0] for x in (q, k_cache, v_cache))
    if name == "page4" and qd == "bfloat16" and not _grouped_ok(plan.profile, qd_, kc, vc):
        name = "generic"       # the m8n8k4 page-4 kernel multiplies float16 only
    tab, tok, cnt, rid, lens = (ints(x, stream) for x in (block_table, tokens, counts, req_ids,
                                                            seq_lens))
    out_buf, lse_buf = (None, None) if out is None else out
    o, o_ret = dev.output(out_buf, (rows, hq, d), od, stream, "out", q)
    lse, l_ret = dev.output(lse_buf, (rows, hq), "float32", stream, "lse", q)
    if name == "page4":
        kb = _page4.plan_pages((tok.shape[1] - (r - 1)) // r, tab.shape[1], page_size, r,
                               max_groups)
        bufs = ((lambda n, shape, dt: workspace.buffer(n, shape, dt, stream)) if workspace is not None
                else (lambda n, shape, dt: dev.empty(shape, dt, stream)))

        def int_buffer(n, shape):
            return bufs(n, shape, np.int32)
        pages, nv, tl = (int_buffer("page4.pages", (rows, kb + 1, 2)),
                         int_buffer("page4.num_vpages", (rows,)), int_buffer("page4.tail_len", (rows,)))
        geometry = dev.constant(np.array([num_pages, page_size], np.int32), stream)
        # one-row windows of the grouped kernel plan their own pieces: no page-4 plan then
        pieces = (_grouped_ok(plan.profile, qd_, kc, vc)
                  and _grouped.plans_own_pieces(d, hq // hkv, rows, kb + 1, hkv, plan.profile))
        if pieces:
            verdict = int_buffer("grouped.verdict", (rows, pieces))
            skip = verdict
        else:
            verdict = None
            skip = nv.reshape(rows, 1)
            _page4.launch_plan(tok, cnt, tab, rid, lens, geometry, pages, nv, tl, plan.profile,
                               stream, r)
        planned = launch.mark()
        grouped, attn = _launch_grouped_route(
            qd_, kc, vc, pages, nv, tl, tok, rid, scale, o, lse, od, plan.profile, stream, r, bufs,
            empty_rows=False, selection=(tok, cnt, tab, rid, lens, geometry) if pieces else None,
            verdict=verdict)
        # A selection the plan cannot express as whole aligned groups plus one tail run (a hand-made
        # one; select() never makes such) left its row inert above: the generic kernel takes exactly
        # those rows (and the empty ones), so the route choice never changes which tokens a row
        # attends to. Beside the grouped kernels' rows (disjoint), it waits for the plan only, or,
        # where the direct blocks planned themselves, for their verdicts (beside the merge).
        # Behind self-planned blocks on sm_90 it is launched programmatically, as their merge is
        # (``grouped.TUNING["pdl"]``): its launch overlaps them, and it waits for their verdicts
        # in the kernel.
        pdl = bool(pieces and grouped and dev.device_cc() >= (9, 0)
                   and int(_grouped.TUNING.get("pdl", _grouped.PDL)))
        with launch.after((attn if pieces else planned) if grouped else None), \
                launch.programmatic() if pdl else contextlib.nullcontext():
            _generic.launch_attention(qd_, kc, vc, tab, tok, cnt, rid, lens, scale, o, lse,
                                      plan.profile, stream, skip=skip, pdl=pdl)
    else:
        _generic.launch_attention(qd_, kc, vc, tab, tok, cnt, rid, lens, scale, o, lse, plan.profile,
                                  stream)
    return (dev.finish(o, was_host, out_buf, stream, o_ret),
            dev.finish(lse, was_host, lse_buf, stream, l_ret))


@dev.on_arrays_device
def page4_plan(tokens, counts, block_table, req_ids, seq_lens, *, page_size, num_pages, r=4,
               out=None, stream=None):
    """``(pages int32 [rows, Kb+1, 2], num_vpages int32 [rows], tail_len int32 [rows])``.

    Mirrors :func:`oracle.page4_plan`: each selected group as ``(physical page, first slot)`` in
    logical order, the partial tail page (1..r-1 tokens) last; malformed rows and rows needing an
    out-of-range page id become inert (``num_vpages = 0``). ``out`` may be a tuple of the three buffers.
    """
    r = V.check_r(r)
    rows, _ = V.check_batch(req_ids, np.zeros(np.shape(req_ids)[0], np.int32), seq_lens)
    kb = V.check_selection(tokens, counts, rows, r)
    V.check_page_size(page_size, r)
    V._rank(block_table, "block_table", 2, "[num_reqs, cols]")
    stream = dev.caller_stream(stream, tokens)
    was_host = dev.is_host(tokens)
    tok, cnt, tab, rid, lens = (ints(x, stream) for x in (tokens, counts, block_table, req_ids,
                                                            seq_lens))
    prof = route(rows, page_size, r).profile
    bufs = (None, None, None) if out is None else out
    made = [dev.output(b, shape, "int32", stream, n, tokens) for b, shape, n in
            zip(bufs, ((rows, kb + 1, 2), (rows,), (rows,)), ("pages", "num_vpages", "tail_len"))]
    (pages, _), (nv, _), (tl, _) = made
    geometry = dev.constant(np.array([num_pages, page_size], np.int32), stream)
    _page4.launch_plan(tok, cnt, tab, rid, lens, geometry, pages, nv, tl, prof, stream, r)
    return tuple(dev.finish(x, was_host, b, stream, native)
                 for (x, native), b in zip(made, bufs))


@dev.on_arrays_device
def page4_attention(q, k_cache, v_cache, pages, num_vpages, tail_len, req_ids, *, scale=None, r=4,
                    out_dtype=None, out=None, stream=None):
    """``(out, lse)`` over a page-4 plan with the grouped tensor-core kernel.

    Mirrors :func:`oracle.page4_attention`. Each row attends to exactly its own pages, with the same
    arithmetic (so the same bits) as :func:`sparse_attention`'s page-4 route; without the selection
    to order a shared union, every row is its own window (see :mod:`numqsa.kernels.grouped`).
    """
    r = V.check_r(r)
    (rows,) = V._rank(req_ids, "req_ids", 1, "[rows]")
    num_pages, page_size, hkv, d = V.check_kv(k_cache, v_cache, r)
    hq = V.check_q(q, rows, hkv, d)
    qd = dev.float_dtype(q, "q")
    dev.float_dtype(k_cache, "k_cache")
    ps = V._rank(pages, "pages", 3, "[rows, Kb+1, 2]")
    if ps[0] != rows or ps[2] != 2:
        raise V.QSAInputError(f"pages shape {ps} does not match {rows} rows x (page, slot)")
    prof = route(rows, page_size, r).profile
    why = _page4_unsupported(qd, V.dtype_name(k_cache), d, r, prof)
    if why:
        raise V.QSAInputError(f"page4_attention: {why}")
    od = out_dtype_of(out_dtype, qd)
    scale = 1.0 / np.sqrt(d) if scale is None else float(scale)
    stream = dev.caller_stream(stream, q)
    was_host = dev.is_host(q)
    qd_, kc, vc = (dev.as_device(x, stream)[0] for x in (q, k_cache, v_cache))
    if qd == "bfloat16" and not _grouped_ok(prof, qd_, kc, vc):
        raise V.QSAInputError("page4_attention: bfloat16 needs the grouped kernel's 16-byte "
                              "aligned caches with a contiguous D axis, and a head dim it tiles "
                              "(32, 64, 128, 256, 512, ...)")
    pg, nv, tl, rid = (ints(x, stream) for x in (pages, num_vpages, tail_len, req_ids))
    out_buf, lse_buf = (None, None) if out is None else out
    o, o_ret = dev.output(out_buf, (rows, hq, d), od, stream, "out", q)
    lse, l_ret = dev.output(lse_buf, (rows, hq), "float32", stream, "lse", q)
    _launch_grouped_route(qd_, kc, vc, pg, nv, tl, None, rid, scale, o, lse, od, prof, stream, r,
                          lambda n, shape, dt: dev.empty(shape, dt, stream))
    return (dev.finish(o, was_host, out_buf, stream, o_ret),
            dev.finish(lse, was_host, lse_buf, stream, l_ret))
