"""numqsa through its public functions (this module is the one to switch when a plan/run API lands).

End-to-end and host lines call the public functions as a user does: ``index_scores``,
``topk_groups``, ``expand_tokens``, ``select``, ``sparse_attention``, ``qsa_prefill`` with default
arguments, on the problem's torch tensors (used in place, no copies); by default
(``validate=None``) none of them reads a device array back, so none waits for the GPU (``select``,
``sparse_attention`` and ``qsa_prefill`` plan and run a cached ``QSAPrefillWrapper``). GPU-only
times of the fused calls use the repeated-call arguments (``out=``, ``workspace=``,
``num_groups=``, ``validate=False``), which also allocate nothing; those of
``index_scores``/``topk_groups``/``expand_tokens`` (which allocate their outputs) are the kernel
launcher they call (``numqsa.stages.selection._launch_scores``, ``numqsa.kernels.topk.launch_topk``,
``numqsa.kernels.expand.launch_expand``). Attention gives one row for the planned route
(``numqsa``, its route recorded) and one per other route (``numqsa.<route>``, ``route_name=``,
which runs the direct launcher ``numqsa.stages.attention.attention_launch``).
"""
import numpy as np

from . import Call, Skip

NAME = "numqsa"


def load(args):
    try:
        import numqsa  # noqa: F401
    except Exception as err:          # pragma: no cover - the checkout always has it
        return f"numqsa does not import: {err}"
    return None


def versions():
    import numqsa
    return {"numqsa": numqsa.__version__}


def _nb(x):
    """A numba device view of a torch tensor (or the array itself); bfloat16 tensors come out as
    numba arrays of dtype ml_dtypes.bfloat16, as the API sees them."""
    import numqsa.device as dev
    if hasattr(x, "copy_to_host") or isinstance(x, np.ndarray):
        return x
    return dev.as_numba(x)


def _stream(p):
    from numba import cuda
    if p.torch is None:
        return cuda.default_stream()
    import numqsa.device as dev
    return dev.resolve_stream(p.torch.cuda.current_stream())


def _empty(p, shape, dtype):
    """A fresh output buffer, poisoned (NaN / -7777) so an element a kernel forgot shows up."""
    if p.torch is None:
        from numba import cuda
        from numqsa.device import np_dtype
        from numqsa.testing import poison
        return poison(cuda.device_array(shape, np_dtype(dtype)))
    x = p.gen.empty(shape, dtype)
    _poison(x)
    return x


_FIELDS = ("qi", "index_cache", "block_table", "req_ids", "positions", "seq_lens", "q", "k_cache",
           "v_cache", "tokens", "counts", "groups", "scores")


def _inputs(p):
    """The problem's arrays as numqsa takes them: torch tensors as they are; in the simulator smoke
    run (NumPy problem) numba device arrays, copied once."""
    if "_numqsa_inputs" not in p.__dict__:
        from types import SimpleNamespace
        d = {}
        for k in _FIELDS:
            x = getattr(p, k, None)
            if isinstance(x, np.ndarray):
                from numba import cuda
                x = cuda.to_device(x)
            d[k] = x
        p._numqsa_inputs = SimpleNamespace(**d)
    return p._numqsa_inputs


def _poison(x):
    if hasattr(x, "fill_"):
        x.fill_(float("nan") if x.dtype.is_floating_point else -7777)
    elif isinstance(x, np.ndarray):
        x[...] = np.nan if x.dtype.kind == "f" or x.dtype.name == "bfloat16" else -7777


def routes(p):
    """``(planned, others)`` attention routes for this problem."""
    import numqsa.stages.attention as A
    planned = A.route(p.case.rows, p.case.page_size, p.case.r).route
    return planned, [x for x in ("generic", "page4") if x != planned]


def prepare(stage, p, route=None):
    import numqsa
    from numqsa.plan import plan_select
    from numqsa.device import device_cc
    c = p.case
    prob, p = p, _inputs(p)
    p.torch, p.gen = prob.torch, prob.gen
    st = _stream(p)
    r, kb, G = c.r, c.Kb, prob.G
    W = kb * r + r - 1
    base = (p.qi, p.index_cache, p.block_table, p.req_ids, p.positions, p.seq_lens)

    if stage == "scores":
        from numqsa.stages import selection as S
        out = _empty(prob, (c.rows, G), "float32")
        nb_args = [_nb(x) for x in base]
        box = {}

        def gpu():
            box["route"] = S._launch_scores(*nb_args, _nb(out), r, st)

        def e2e():
            box["res"] = numqsa.index_scores(*base, r=r)
        return Call(gpu=gpu, e2e=e2e, result=lambda: {"scores": box.get("res", out)},
                    host={"numqsa.index_scores.default": e2e}, note="gpu: _launch_scores")

    if stage == "topk":
        from numqsa.kernels import topk as KT
        groups = _empty(prob, (c.rows, kb), "int32")
        prof = plan_select(c.rows, G, device_cc()).profile
        bits = _nb(p.scores).view(np.uint32)
        req, pos, lens = (_nb(x) for x in (p.req_ids, p.positions, p.seq_lens))
        box = {}

        def gpu():
            KT.launch_topk(bits, req, pos, lens, _nb(groups), prof, st, r=r)

        def e2e():
            box["res"] = numqsa.topk_groups(p.scores, p.req_ids, p.positions, p.seq_lens, Kb=kb, r=r)
        return Call(gpu=gpu, e2e=e2e, result=lambda: {"groups": box.get("res", groups)},
                    host={"numqsa.topk_groups.default": e2e}, note="gpu: kernels.topk.launch_topk")

    if stage == "expand":
        from numqsa.kernels import expand as KE
        tokens, counts = _empty(prob, (c.rows, W), "int32"), _empty(prob, (c.rows,), "int32")
        prof = plan_select(c.rows, 0, device_cc()).profile
        req, pos, lens = (_nb(x) for x in (p.req_ids, p.positions, p.seq_lens))
        g = _nb(p.groups)
        box = {}

        def gpu():
            KE.launch_expand(g, req, pos, lens, _nb(tokens), _nb(counts), prof, st, r=r)

        def e2e():
            box["res"] = numqsa.expand_tokens(p.groups, p.req_ids, p.positions, p.seq_lens, r=r)[0]
        return Call(gpu=gpu, e2e=e2e, result=lambda: {"tokens": box.get("res", tokens)},
                    host={"numqsa.expand_tokens.default": e2e},
                    note="gpu: kernels.expand.launch_expand")

    if stage == "select":
        out = (_empty(prob, (c.rows, W), "int32"), _empty(prob, (c.rows,), "int32"),
               _empty(prob, (c.rows, kb), "int32"))
        chunk = numqsa.stages.selection.select_chunk_rows(c.rows, G)
        # a numba view: select() reads ``workspace.size`` as an attribute (a method on torch tensors)
        ws = _nb(_empty(prob, (chunk * max(G, 1),), "float32"))
        box = {}

        def gpu():
            numqsa.select(*base, Kb=kb, r=r, out=out, workspace=ws, num_groups=G, validate=False,
                          stream=st)

        def e2e():
            box["res"] = numqsa.select(*base, Kb=kb, r=r)
        return Call(gpu=gpu, e2e=e2e,
                    result=lambda: {"tokens": (box["res"] if "res" in box else out)[0]},
                    host={"numqsa.select.default": e2e, "numqsa.select.repeated": gpu})

    args = (p.q, p.k_cache, p.v_cache, p.block_table)
    if stage == "attention":
        o, lse = _empty(prob, (c.rows, c.Hq, c.D), c.dtype), _empty(prob, (c.rows, c.Hq), "float32")
        ws = numqsa.Workspace()
        box = {}

        def gpu():
            numqsa.sparse_attention(*args, p.tokens, p.counts, p.req_ids, p.seq_lens, r=r,
                                    out=(o, lse), workspace=ws, validate=False, stream=st,
                                    route_name=route)

        def e2e():
            box["res"] = numqsa.sparse_attention(*args, p.tokens, p.counts, p.req_ids, p.seq_lens,
                                                 r=r, route_name=route)[0]
        host = {} if route else {"numqsa.sparse_attention.default": e2e,
                                 "numqsa.sparse_attention.repeated": gpu}
        return Call(gpu=gpu, e2e=e2e, result=lambda: {"out": box.get("res", o)}, host=host,
                    route=route)

    if stage == "prefill":
        ws = numqsa.Workspace()
        full = (p.qi, p.index_cache, p.block_table, p.q, p.k_cache, p.v_cache, p.block_table,
                p.req_ids, p.positions, p.seq_lens)
        box = {}

        def gpu():
            box["res"] = numqsa.qsa_prefill(*full, Kb=kb, r=r, workspace=ws, num_groups=G,
                                            validate=False, stream=st)

        def e2e():
            box["res"] = numqsa.qsa_prefill(*full, Kb=kb, r=r)

        wrap = {}

        def run_prefill(repoint=False):
            """The plan/run object: planned once per batch, then ``run`` per layer (host line);
            ``repoint``: the outputs alternate between two buffers, so every call re-points the
            launch graph (a layer's new tensors) instead of replaying it as it is."""
            if not wrap:
                rows, hi, di = p.qi.shape
                _, hq, d = p.q.shape
                w = numqsa.QSAPrefillWrapper(Hi=hi, Di=di, Hq=hq, Hkv=p.k_cache.shape[2], D=d, r=r,
                                             Kb=kb, dtype=c.dtype)
                w.plan(p.req_ids, p.positions, p.seq_lens, p.block_table, p.block_table,
                       num_groups=G, validate=False, stream=st)
                wrap["w"] = w
                wrap["outs"] = [(_empty(prob, (rows, hq, d), c.dtype),
                                 _empty(prob, (rows, hq), "float32")) for _ in range(2)]
                wrap["k"] = 0
            if repoint:
                wrap["k"] ^= 1
            wrap["w"].run(p.qi, p.index_cache, p.q, p.k_cache, p.v_cache,
                          out=wrap["outs"][wrap["k"]], stream=st)
        return Call(gpu=gpu, e2e=e2e,
                    result=lambda: {"out": box["res"][0], "tokens": box["res"][2]},
                    host={"numqsa.qsa_prefill.default": e2e, "numqsa.qsa_prefill.repeated": gpu,
                          "numqsa.run.prefill": run_prefill,
                          "numqsa.run.prefill.repoint": lambda: run_prefill(True)})
    raise Skip(f"no {stage} stage")
