"""The selection stages (spec §3-§5): pre-indexer, index scores, top-k groups, expansion.

Each public function here is one stage, mirroring its :mod:`oracle` namesake argument for argument
and adding ``out=``, ``stream=`` and ``validate=``: check (``oracle.validate``, before any launch)
-> the device (:mod:`numqsa.device`) -> plan (:func:`numqsa.plan.plan_select`) -> launch -> NumPy
back if the inputs were NumPy, else device arrays (no copies of device inputs; any strides).
:func:`select_launch` chains scores, top-k and expansion over row chunks: the launches
:class:`numqsa.QSAPrefillWrapper` records for :func:`numqsa.select` and :func:`numqsa.qsa_prefill`.

``validate`` (every function here): None (default) checks the values of host arrays only and never
reads a device array back, so a call on device arrays never waits for the GPU (the kernels guard
device tables: a row needing a bad page id is inert); True also reads device metadata back (one
synchronisation) and checks it as if it were on the host; False checks shapes and dtypes only.

Kernels: :mod:`numqsa.kernels.index_keys`, :mod:`~numqsa.kernels.index_scores`,
:mod:`~numqsa.kernels.topk`, :mod:`~numqsa.kernels.expand`.
"""
import numpy as np

from oracle import validate as V
from oracle.batch import row_states

from .. import device as dev
from ..kernels import expand as _expand
from ..kernels import index_keys as _pre
from ..kernels import index_scores as _scores
from ..kernels import topk as _topk
from ..plan import plan_select
from .common import guard_positions, ints, values_checked

__all__ = ["index_keys", "index_queries", "index_scores", "topk_groups", "expand_tokens",
           "select_launch", "select_chunk_rows", "SELECT_SCORE_BYTES"]

#: Fused ``select``: the float32 score block of one row chunk stays below this many bytes, so at 1M
#: tokens (262,144 groups) a chunk is 1,024 rows and 16,384 rows need 1 GiB of scores, not 16 GiB.
SELECT_SCORE_BYTES = 1 << 30


def _dummy_ints(stream):
    return dev.constant(np.zeros(1, np.int32), stream)


def _rope_positions(rope_positions, n, stream, name):
    if rope_positions is None:
        return _dummy_ints(stream), False
    (m,) = V._rank(rope_positions, "rope_positions", 1, f"[{name}]")
    if m != n:
        raise V.QSAInputError(f"rope_positions has {m} entries, expected {n} ({name})")
    return ints(rope_positions, stream), True


def _emulate_f16(emulate_dtype):
    if emulate_dtype is None:
        return False
    name = dev.np_dtype(emulate_dtype).name
    if name == "float32":
        return False          # rounding a float32 mean to float32 changes nothing
    if name == "float16":
        return True
    if name == "bfloat16":
        return "bfloat16"
    raise V.QSAInputError(f"emulate_dtype {name} is not supported (float16, bfloat16, float32 or "
                          f"None)")


def _check_key_pages(reqs, eids, tab, ic):
    """Each group's request and group id in range and its index page a valid page id."""
    for g in range(reqs.shape[0]):
        q, e = int(reqs[g]), int(eids[g])
        if not 0 <= q < tab.shape[0] or e < 0:
            raise V.QSAInputError(f"group {g}: request {q} / group id {e} out of range")
        c = e // ic[1]
        if c >= tab.shape[1] or not 0 <= tab[q, c] < ic[0]:
            page = tab[q, c] if c < tab.shape[1] else "missing"
            raise V.QSAInputError(f"index_block_table[{q}, {c}] = {page} is not a valid page id "
                                  f"(num_idx_pages = {ic[0]}) for request {q}, column {c} (group {e})")


@dev.on_arrays_device
def index_keys(k_raw, w_k, group_req_ids, group_ids, index_cache, index_block_table, *, eps=1e-6,
               rot=64, theta=1e7, emulate_dtype=None, rope_positions=None, out=None, stream=None,
               validate=None):
    """Compressed keys ``kc[g] = rope(gnorm(mean(k_raw[g]), w_k), r * group_ids[g])``, stored in place.

    Shapes: ``k_raw [G, r, Di]`` -> ``kc float32 [G, Di]`` (before rounding to the cache dtype); each
    key is also written to ``index_cache[index_block_table[q, e // R], e % R]`` in the cache's dtype
    (a NumPy cache is updated in place too). Pooling in float32; ``emulate_dtype=float16`` rounds the
    mean to float16 before the norm, as the serving engines' references do. Request, group and page
    ids are checked when they are on the host (or ``validate=True``); on the device the kernel skips
    the store of a key whose page is out of range.
    """
    V.check_array(w_k, "w_k")
    s = V._rank(k_raw, "k_raw", 3, "[G, r, Di]")
    G, r, di = s
    dev.float_dtype(k_raw, "k_raw")
    if tuple(w_k.shape) != (di,):
        raise V.QSAInputError(f"w_k must have shape ({di},), got {tuple(w_k.shape)}")
    if rot % 2 or rot > di:
        raise V.QSAInputError(f"rot = {rot} must be even and <= Di = {di}")
    ic = V.check_index_cache(index_cache)
    dev.float_dtype(index_cache, "index_cache")
    if ic[2] != di:
        raise V.QSAInputError(f"index_cache Di = {ic[2]} differs from k_raw's Di = {di}")
    V.check_array(group_req_ids, "group_req_ids")
    V.check_array(group_ids, "group_ids")
    rs, es = tuple(group_req_ids.shape), tuple(group_ids.shape)
    if rs != (G,) or es != (G,):
        raise V.QSAInputError(f"group_req_ids {rs} and group_ids {es} must be ({G},)")
    V._rank(index_block_table, "index_block_table", 2, "[num_reqs, cols]")
    if values_checked(validate, group_req_ids, group_ids, index_block_table):
        _check_key_pages(V.host_ints(group_req_ids), V.host_ints(group_ids),
                         V.host_ints(index_block_table), ic)
    emulate = _emulate_f16(emulate_dtype)
    stream = dev.caller_stream(stream, k_raw)
    was_host = dev.is_host(k_raw)
    d_k = dev.as_device(k_raw, stream)[0]
    d_w = dev.as_device(w_k, stream)[0]
    d_ic, ic_host = dev.as_device(index_cache, stream)
    rp, has_rp = _rope_positions(rope_positions, G, stream, "G")
    kc, kc_ret = dev.output(out, (G, di), np.float32, stream, "index_keys", k_raw)
    _pre.launch_index_keys(d_k, d_w, ints(group_req_ids, stream), ints(group_ids, stream), rp,
                           has_rp, d_ic, ints(index_block_table, stream), kc, stream, eps=eps,
                           rot=rot, theta=theta, emulate_f16=emulate)
    if ic_host:
        index_cache[...] = d_ic.copy_to_host(stream=stream)
        stream.synchronize()
    return dev.finish(kc, was_host, out, stream, kc_ret)


@dev.on_arrays_device
def index_queries(q_raw, w_q, req_ids, positions, seq_lens, *, eps=1e-6, rot=64, theta=1e7,
                  rope_positions=None, out=None, stream=None):
    """Index queries ``qi[i, h] = rope(gnorm(q_raw[i, h], w_q), p_i)``; inert rows 0.

    Shapes: ``q_raw [rows, Hi, Di]`` -> ``[rows, Hi, Di]`` in ``q_raw``'s dtype (float32 math).
    """
    V.check_array(w_q, "w_q")
    rows, _ = V.check_batch(req_ids, positions, seq_lens)
    s = V._rank(q_raw, "q_raw", 3, "[rows, Hi, Di]")
    dt = dev.float_dtype(q_raw, "q_raw")
    if s[0] != rows:
        raise V.QSAInputError(f"q_raw must be [rows={rows}, Hi, Di], got shape {s}")
    if tuple(w_q.shape) != (s[2],):
        raise V.QSAInputError(f"w_q must have shape ({s[2]},), got {tuple(w_q.shape)}")
    if rot % 2 or rot > s[2]:
        raise V.QSAInputError(f"rot = {rot} must be even and <= Di = {s[2]}")
    stream = dev.caller_stream(stream, q_raw)
    was_host = dev.is_host(q_raw)
    rp, has_rp = _rope_positions(rope_positions, rows, stream, "rows")
    qi, qi_ret = dev.output(out, s, dt, stream, "index_queries", q_raw)
    _pre.launch_index_queries(dev.as_device(q_raw, stream)[0], dev.as_device(w_q, stream)[0],
                              ints(req_ids, stream), ints(positions, stream),
                              ints(seq_lens, stream), rp, has_rp, qi, stream, eps=eps, rot=rot,
                              theta=theta)
    return dev.finish(qi, was_host, out, stream, qi_ret)


def _check_scores_inputs(qi, index_cache, index_block_table, req_ids, positions, seq_lens, r,
                         validate=None):
    r = V.check_r(r)
    rows, _ = V.check_batch(req_ids, positions, seq_lens)
    n_pages, rows_per_page, di = V.check_index_cache(index_cache)
    V.check_index_q(qi, rows, di)
    dev.float_dtype(qi, "qi")
    dev.float_dtype(index_cache, "index_cache")
    V._rank(index_block_table, "index_block_table", 2, "[num_reqs, cols]")
    V._dtype(index_block_table, "index_block_table", V.INT_DTYPES)
    if values_checked(validate, index_block_table, seq_lens):
        V.check_table(index_block_table, seq_lens, units_per_page=rows_per_page, num_pages=n_pages,
                      r=r, name="index_block_table")
    return r, rows


def _default_groups(seq_lens, r):
    lens = V.host_ints(seq_lens)
    return int(lens.max()) // r if lens.size else 0


def _score_width(index_cache, index_block_table, seq_lens, r, validate):
    """``max(seq_lens) // r`` when seq_lens are on the host (or may be read back), else the index
    table's capacity ``cols * R`` (groups past a row's ``nb`` score ``-inf``)."""
    if isinstance(seq_lens, np.ndarray) or validate:
        return _default_groups(seq_lens, r)
    return int(index_block_table.shape[1]) * int(index_cache.shape[1])


def _launch_scores(qi, ic, ibt, req, pos, lens, scores, r, stream, route=None):
    """Route and launch one score block (device arrays). Returns the route taken."""
    rows, groups = scores.shape
    plan = plan_select(rows, groups, dev.device_cc())
    route = route or plan.scores_route
    if route == "tiled" and _scores.tiled_supported(qi, ic, plan.profile):
        _scores.launch_tiled(qi, ic, ibt, req, pos, lens, scores, plan.profile, stream, r=r)
        return "tiled"
    _scores.launch_light(qi, ic, ibt, req, pos, lens, scores, plan.profile, stream, r=r)
    return "light"


@dev.on_arrays_device
def index_scores(qi, index_cache, index_block_table, req_ids, positions, seq_lens, *, r=4,
                 num_groups=None, out=None, stream=None, validate=None):
    """``score[i, e] = sum_h relu(<qi[i, h], kc[e]>) / sqrt(Di)`` for ``e < nb_i``, else ``-inf``.

    Shapes: ``qi [rows, Hi, Di]``, ``index_cache [pages, R, Di]`` (any strides) ->
    ``float32 [rows, num_groups]``. ``num_groups`` defaults to ``max(seq_lens) // r`` for host
    ``seq_lens`` (or ``validate=True``); for device ``seq_lens`` (not read back) to ``out``'s width
    if ``out`` is given, else the index table's capacity ``cols * R`` (the extra columns are
    ``-inf``). Tensor-core tiles for long prefill (float16 inputs, :func:`numqsa.plan.plan_select`),
    a light fp32 kernel otherwise. A row needing an index page id outside the cache (a device table
    not read back: :func:`numqsa.kernels.guard`) is inert: all ``-inf``.
    """
    r, rows = _check_scores_inputs(qi, index_cache, index_block_table, req_ids, positions,
                                   seq_lens, r, validate)
    if num_groups is not None:
        num_groups = V.check_int(num_groups, "num_groups", 0)
    elif (out is not None and not isinstance(seq_lens, np.ndarray) and not validate
          and len(getattr(out, "shape", ())) == 2):
        num_groups = int(out.shape[1])
    else:
        num_groups = _score_width(index_cache, index_block_table, seq_lens, r, validate)
    stream = dev.caller_stream(stream, qi)
    was_host = dev.is_host(qi)
    scores, ret = dev.output(out, (rows, int(num_groups)), np.float32, stream, "index_scores", qi)
    ibt, req, pos, lens = (ints(x, stream) for x in (index_block_table, req_ids, positions,
                                                         seq_lens))
    if not values_checked(validate, index_block_table, seq_lens):
        pos = guard_positions(req, pos, lens, ibt, index_cache, dev.empty((rows,), np.int32, stream),
                              stream, r)
    _launch_scores(dev.as_device(qi, stream)[0], dev.as_device(index_cache, stream)[0], ibt, req,
                   pos, lens, scores, r, stream)
    return dev.finish(scores, was_host, out, stream, ret)


@dev.on_arrays_device
def topk_groups(scores, req_ids, positions, seq_lens, *, Kb=512, r=4, out=None, stream=None,
                validate=None):
    """Row ``i`` keeps ``min(Kb, nb_i)`` groups by (score desc, group id asc), ascending, -1 padded.

    The rule is applied bitwise to float32 scores (``-0.0 == +0.0``); NumPy scores of another dtype
    are rounded to float32 first, device scores must already be C-contiguous float32. A NaN score
    (either sign, any payload) ranks above every number and NaNs tie, so a row takes its NaN groups
    first, lowest ids first, then ``+inf`` -- :func:`oracle.topk_groups`'s rule and ``torch.topk``'s
    order, on host and device scores alike. Shapes: ``scores [rows, G]`` -> ``int32 [rows, Kb]``.
    With host metadata (or ``validate=True``) a row seeing more than ``G`` groups is refused; on
    the device the kernel ranks the first ``G`` only.
    """
    r = V.check_r(r)
    rows, _ = V.check_batch(req_ids, positions, seq_lens)
    s = V._rank(scores, "scores", 2, "[rows, groups]")
    if s[0] != rows:
        raise V.QSAInputError(f"scores must be [rows={rows}, groups], got shape {s}")
    Kb = V.check_kb(Kb)
    nb = None
    if values_checked(validate, req_ids, positions, seq_lens):
        _, _, _, nb = row_states(V.host_ints(req_ids), V.host_ints(positions),
                                 V.host_ints(seq_lens), r)
        if nb.size and int(nb.max()) > s[1]:
            raise V.QSAInputError(f"scores has {s[1]} groups but a row sees {int(nb.max())}")
    stream = dev.caller_stream(stream, scores)
    was_host = dev.is_host(scores)
    if was_host:
        scores = np.ascontiguousarray(scores, dtype=np.float32)
    elif V.dtype_name(scores) != "float32":
        raise V.QSAInputError(f"device scores must be float32, got {V.dtype_name(scores)}")
    d_s = dev.as_device(scores, stream)[0]
    if not d_s.is_c_contiguous():
        raise V.QSAInputError("device scores must be C-contiguous (they are read as uint32 bits)")
    groups, ret = dev.output(out, (rows, int(Kb)), np.int32, stream, "topk_groups", scores)
    _topk.launch_topk(d_s.view(np.uint32), ints(req_ids, stream), ints(positions, stream),
                      ints(seq_lens, stream), groups, plan_select(rows, s[1], dev.device_cc()).profile,
                      stream, r=r)
    return dev.finish(groups, was_host, out, stream, ret)


def _check_groups_host(g, req_ids, positions, seq_lens, r):
    """The expansion kernel reads groups as top-k writes them: ascending ids < nb, then -1."""
    _, _, _, nb = row_states(V.host_ints(req_ids), V.host_ints(positions), V.host_ints(seq_lens), r)
    for i in range(g.shape[0]):
        row = g[i]
        valid = row >= 0
        n = int(valid.sum())
        if n and (not valid[:n].all() or np.any(np.diff(row[:n]) <= 0) or row[n - 1] >= nb[i]):
            raise V.QSAInputError(f"groups row {i} must hold ascending ids in 0..{nb[i] - 1} "
                                  f"followed by -1 padding")


@dev.on_arrays_device
def expand_tokens(groups, req_ids, positions, seq_lens, *, r=4, out=None, stream=None,
                  validate=None):
    """Token ids of the selected groups, ascending, then the forced tail ``r*nb .. p``.

    ``groups [rows, Kb]`` (ascending ids ``< nb``, then -1, as :func:`topk_groups` writes them;
    checked for NumPy groups with host metadata, or ``validate=True``; on the device the kernel
    reads a row up to its first id that breaks the rule) -> ``(tokens int32 [rows, Kb*r + r - 1],
    counts int32 [rows])``. ``out`` may be a ``(tokens, counts)`` pair.
    """
    r = V.check_r(r)
    rows, _ = V.check_batch(req_ids, positions, seq_lens)
    gs = V._rank(groups, "groups", 2, "[rows, Kb]")
    if gs[0] != rows:
        raise V.QSAInputError(f"groups must be [rows={rows}, Kb], got shape {gs}")
    V._dtype(groups, "groups", ("int32",))
    stream = dev.caller_stream(stream, groups)
    was_host = dev.is_host(groups)
    if was_host and values_checked(validate, req_ids, positions, seq_lens):
        _check_groups_host(groups, req_ids, positions, seq_lens, r)
    out_t, out_c = out if out is not None else (None, None)
    tokens, t_ret = dev.output(out_t, (rows, gs[1] * r + r - 1), np.int32, stream, "tokens", groups)
    counts, c_ret = dev.output(out_c, (rows,), np.int32, stream, "counts", groups)
    prof = plan_select(rows, 0, dev.device_cc()).profile
    _expand.launch_expand(dev.as_device(groups, stream)[0], ints(req_ids, stream),
                          ints(positions, stream), ints(seq_lens, stream), tokens, counts, prof,
                          stream, r=r)
    return (dev.finish(tokens, was_host, out_t, stream, t_ret),
            dev.finish(counts, was_host, out_c, stream, c_ret))


def select_chunk_rows(rows, num_groups, budget=None):
    """Rows per chunk of the fused ``select`` so one float32 score block fits ``budget`` bytes."""
    budget = SELECT_SCORE_BYTES if budget is None else budget
    if num_groups == 0:
        return max(1, rows)
    return max(1, min(rows, budget // (4 * num_groups)))


def select_launch(qi, index_cache, index_block_table, req_ids, positions, seq_lens, *, Kb=512,
                  r=4, out=None, stream=None, score_bytes=None, workspace=None, num_groups=None,
                  validate=False):
    """The launches of :func:`select` (what :class:`numqsa.QSAPrefillWrapper` records).

    Rows are processed in chunks whose float32 score block stays under ``score_bytes``
    (:data:`SELECT_SCORE_BYTES`, 1 GiB), reused from chunk to chunk. Peak extra device memory:
    ``min(rows, score_bytes // (4*G)) * G * 4`` bytes of scores (``G = max(seq_lens) // r``), plus
    the outputs ``rows * (Kb*r + r - 1 + Kb + 1) * 4`` bytes and the int32 copies of small index
    arrays. 16,384 rows at 1M tokens: 1 GiB of scores + 0.17 GiB of outputs.
    ``out`` may be a ``(tokens, counts, groups)`` triple; ``workspace`` a 1-D float32 device array
    of at least ``chunk * G`` elements to hold the scores (saves the allocation on repeated calls).
    ``num_groups`` gives ``G`` without reading ``seq_lens`` back (it must be at least
    ``max(seq_lens) // r``); ``validate`` as in :func:`select` (False here: the wrapper checked).
    """
    r, rows = _check_scores_inputs(qi, index_cache, index_block_table, req_ids, positions,
                                   seq_lens, r, validate)
    Kb = V.check_kb(Kb)
    if num_groups is None:
        G = _default_groups(seq_lens, r)
    else:
        G = V.check_int(num_groups, "num_groups", 0)
        if isinstance(seq_lens, np.ndarray) and G < _default_groups(seq_lens, r):
            raise V.QSAInputError(
                f"num_groups = {G} is below the longest request's {_default_groups(seq_lens, r)} "
                f"groups (max(seq_lens) // r); pass num_groups >= max(seq_lens) // r or leave it out")
    stream = dev.resolve_stream(stream)
    was_host = dev.is_host(qi)
    out_t, out_c, out_g = out if out is not None else (None, None, None)
    tokens = dev.out_buffer(out_t, (rows, Kb * r + r - 1), np.int32, stream, "tokens")
    counts = dev.out_buffer(out_c, (rows,), np.int32, stream, "counts")
    groups = dev.out_buffer(out_g, (rows, int(Kb)), np.int32, stream, "groups")
    d_qi = dev.as_device(qi, stream)[0]
    d_ic = dev.as_device(index_cache, stream)[0]
    d_ibt = ints(index_block_table, stream, "index_block_table")
    req, pos, lens = (ints(req_ids, stream, "req_ids"), ints(positions, stream, "positions"),
                      ints(seq_lens, stream, "seq_lens"))
    prof = plan_select(rows, G, dev.device_cc()).profile
    chunk = select_chunk_rows(rows, G, score_bytes)
    width = max(G, 1)
    if workspace is not None and rows:
        if V.dtype_name(workspace) != "float32" or workspace.size < chunk * width:
            raise V.QSAInputError(f"workspace must be float32 with >= {chunk * width} elements")
        buf = dev.as_device(workspace, stream)[0].reshape(-1)[:chunk * width].reshape(chunk, width)
    else:
        buf = dev.empty((chunk, width), np.float32, stream) if rows else None
    for a in range(0, rows, chunk):
        b = min(rows, a + chunk)
        sc = buf[:b - a]
        _launch_scores(d_qi[a:b], d_ic, d_ibt, req[a:b], pos[a:b], lens, sc, r, stream)
        _topk.launch_topk(sc.view(np.uint32), req[a:b], pos[a:b], lens, groups[a:b], prof, stream,
                          r=r)
    if rows:
        _expand.launch_expand(groups, req, pos, lens, tokens, counts, prof, stream, r=r)
    return (dev.finish(tokens, was_host, out_t, stream), dev.finish(counts, was_host, out_c, stream),
            dev.finish(groups, was_host, out_g, stream))
