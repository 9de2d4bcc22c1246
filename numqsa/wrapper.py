"""Plan once per batch, run per layer: :class:`QSAPrefillWrapper` (FlashInfer's wrapper pattern).

``QSAPrefillWrapper(Hi=, Di=, Hq=, Hkv=, D=, r=, Kb=, dtype=)`` fixes the geometry; ``plan(...)``
takes the batch metadata (request ids, positions, sequence lengths, page tables), validates it once,
converts it to int32 on the device and keeps it; ``run(...)`` takes one layer's tensors (index queries
and index cache, queries and K/V caches) and only launches. ``run_select`` / ``run_attention`` run
one half.

The first ``run`` for a new layout (dtypes, shapes, strides, pointer alignment of its arrays)
checks the arrays against the geometry and the plan's tables, then *records* the stage launchers'
kernel launches (nothing runs while recording, so every check happens before any launch) into a
:class:`numqsa.launch.Program`. Later runs of that layout re-point the recorded launches at the new
arrays and launch them as one CUDA graph (``cuGraphLaunch``; only the graph nodes whose pointers
changed are re-pointed): no argument marshalling, no allocation (with ``out=``), no synchronisation.
While the caller's stream is being captured the launches go one by one into the caller's capture
instead. Up to ``max_programs`` layouts are kept.

Devices: a plan lives on the device of its device metadata (NumPy metadata are copied to the
current device); ``run`` takes its device from its first array, refuses arrays of another device
(and a layer on another device than the plan's) before any launch, and runs inside that device's
context (:func:`numqsa.device.on_device`), leaving the caller's current device as it was. Programs,
buffers and streams are kept per device; under ``device_map``, keep one wrapper per device.

CUDA graphs: run once eagerly (compiles, prepares), then capture ``run`` on the capturing stream
(``torch.cuda.graph(g, stream=s)`` and ``stream=s``, with ``out=`` buffers), write new inputs into
the same tensors and ``g.replay()``.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Any, Optional, Sequence

import numpy as np

from oracle import validate as V

from . import device as dev
from .launch import Program, recording
from .stages.attention import attention_launch
from .stages.common import Buffers, guard_positions, ints, kernel_dtype
from .stages.selection import select_chunk_rows, select_launch

__all__ = ["QSAPrefillWrapper", "Workspace", "cached_wrapper"]

META = ("req_ids", "positions", "seq_lens", "block_table", "index_block_table")
MAX_KB, MAX_R = V.MAX_KB, V.MAX_R


class QSAPrefillWrapper:
    """QSA prefill for one geometry: ``plan`` per batch, ``run`` per layer.

    ``out[i, h] = sum_{t in S_i} softmax_t(scale <q[i,h], K[t, h // (Hq/Hkv)]>) V[t, h // (Hq/Hkv)]``
    with ``S_i`` the top-``Kb`` groups of ``r`` tokens by index score plus the row's tail (see
    ``docs/contract.md``). Shapes: ``qi [rows, Hi, Di]``, ``index_cache [idx_pages, R, Di]``,
    ``q [rows, Hq, D]``, ``k_cache``/``v_cache [num_pages, page_size, Hkv, D]`` (any strides).

    ``dtype`` is the attention tensors' (q, K/V) dtype, ``index_dtype`` (default ``dtype``) that of
    ``qi`` and the index cache; ``out_dtype`` defaults to ``dtype``; ``scale`` to ``1/sqrt(D)``.
    ``score_bytes`` bounds the float32 score block of one row chunk of the selection
    (:data:`numqsa.stages.selection.SELECT_SCORE_BYTES` by default, see :func:`numqsa.select`).
    Dtypes: ``"float16"``, ``"bfloat16"`` (torch.bfloat16 / ml_dtypes.bfloat16 arrays; tensor cores
    on sm_80+, the FMA routes on sm_70) or ``"float32"``.

    Device memory the wrapper keeps beyond the caller's arrays (``G = num_groups``; a row's page-4
    plan holds ``K + 1`` pages, ``K = min(Kb, G, block table capacity)``
    (:func:`numqsa.kernels.page4.plan_pages`: what rows can select, not ``Kb``), in ``P`` spans of
    128, ``P = max(1, (K + 1) // 128)``): the selection's ``min(rows, score_bytes // (4*G)) * G * 4``
    bytes of scores plus ``rows * Kb * 4`` (groups, when the caller does not take them) and its
    outputs when not given; ``rows * 4`` (guarded positions, for tables not checked on the host);
    the grouped attention route's ``rows * (K + 1) * 12`` (page plan, own-page lists),
    ``ceil(rows / 8) * P * 8 * min(K + 1, 256) * 8`` (window unions) and, when ``K + 1 >= 64``,
    ``rows * Hq * P * (D + 4) * 4`` (spans before their merge; a batch of one-row windows, a few
    rows, keeps ``rows * Hq * Q * (D + 2) * 4`` for its ``Q = (K + 1) // 32`` pieces of 32 pages
    instead: :mod:`numqsa.kernels.grouped`). 16,384 rows at 1M tokens (Kb 512,
    Hq 6, D 256): 1.63 GiB, of which 1 GiB of scores (``bench/bench_million.py``; a chain holding
    all the scores would need 16 GiB for them alone).
    """

    def __init__(self, *, Hi: int = 4, Di: int = 128, Hq: int = 6, Hkv: int = 1, D: int = 256,
                 r: int = 4, Kb: int = 512, dtype: Any = "float16", index_dtype: Any = None,
                 out_dtype: Any = None, scale: Optional[float] = None, max_programs: int = 8,
                 score_bytes: Optional[int] = None) -> None:
        self.Hi = V.check_int(Hi, "Hi")
        self.Di = V.check_int(Di, "Di")
        self.Hq = V.check_int(Hq, "Hq")
        self.Hkv = V.check_int(Hkv, "Hkv")
        self.D = V.check_int(D, "D")
        self.r = V.check_int(r, "r", 1, MAX_R)
        self.Kb = V.check_int(Kb, "Kb", 1, MAX_KB)
        if self.Hq % self.Hkv:
            raise V.QSAInputError(f"Hq = {self.Hq} is not a multiple of Hkv = {self.Hkv}")
        self.dtype = self._dtype_arg(dtype, "dtype")
        self.index_dtype = self._dtype_arg(index_dtype or dtype, "index_dtype")
        self.out_dtype = self._dtype_arg(out_dtype or self.dtype, "out_dtype")
        self.scale = 1.0 / np.sqrt(self.D) if scale is None else float(scale)
        self.width = self.Kb * self.r + self.r - 1
        self.max_programs = int(max_programs)
        self.score_bytes = None if score_bytes is None else V.check_int(score_bytes,
                                                                               "score_bytes")
        self._ws = Buffers()
        self._programs = OrderedDict()
        self._streams = {}
        self._planned = False
        self._device = None         # the plan's device (that of its metadata)
        self._rows = 0

    @staticmethod
    def _dtype_arg(dtype, name):
        try:
            dt = dev.np_dtype(dtype).name
        except TypeError:
            raise V.QSAInputError(f"{name} {dtype!r} is not a dtype") from None
        if dt not in dev.KERNEL_FLOATS:
            raise V.QSAInputError(f"{name} {dt} is not supported ({', '.join(dev.KERNEL_FLOATS)})")
        return dt

    # -------------------------------------------------------------------------------- plan
    def plan(self, req_ids: Any, positions: Any, seq_lens: Any, block_table: Any,
             index_block_table: Any = None, *, num_groups: Optional[int] = None,
             validate: Optional[bool] = True, stream: Any = None) -> "QSAPrefillWrapper":
        """Take one batch's metadata (spec §1-§2); validate it; keep it on the device as int32.

        ``index_block_table`` defaults to ``block_table`` (index pages shared with the main pages,
        ``R = page_size // r`` rows each). ``positions`` may be None for a plan that only runs
        :meth:`run_attention` (attention reads no positions); ``run`` and ``run_select`` then
        refuse. ``num_groups`` is the score width (default ``max(seq_lens) // r``; when
        ``seq_lens`` stays on the device and is not read back, the index table's capacity
        ``cols * R``). ``validate``: True reads device-resident metadata back once (one
        synchronisation) to check page ids and lengths; None checks host metadata only (device
        tables are then guarded on the device, :mod:`numqsa.kernels.guard`: a row needing a bad
        page id is inert, with count 0 and ``-1`` tokens); False checks nothing but shapes and
        dtypes (and the kernels guard every table). Host metadata are copied into buffers the
        wrapper keeps, device int32 metadata are used in place (keep them alive and unchanged until the last run
        of this plan), device int64 metadata are converted on the device into kept buffers. Copies
        and conversions go on ``stream`` (default: the current stream of ``req_ids``' framework);
        run the layers on the same stream.
        """
        attention_only = positions is None
        shared = index_block_table is None
        given = (("req_ids", req_ids), ("positions", req_ids if attention_only else positions),
                 ("seq_lens", seq_lens), ("block_table", block_table),
                 ("index_block_table", block_table if shared else index_block_table))
        kinds = [dev.array_kind(x, n) for n, x in given]
        rows, num_reqs = V.check_batch(given[0][1], given[1][1], seq_lens)
        for n, x in given[3:]:
            V._rank(x, n, 2, "[num_reqs, cols]")
            V._dtype(x, n, V.INT_DTYPES)
        # an alias (positions of an attention-only plan, a shared index table) is copied once
        alias = {"positions": "req_ids" if attention_only else None,
                 "index_block_table": "block_table" if shared else None}
        host, host32 = {}, {}
        for (n, x), kind in zip(given, kinds):
            if alias.get(n):
                if alias[n] in host:
                    host[n] = host[alias[n]]
            elif kind == "numpy":
                host[n] = host32[n] = dev.host_int32(x, n)      # int32 range (before any copy)
            elif validate:
                host[n] = V.host_ints(x)
        for n in ("block_table", "index_block_table"):
            if n in host and host[n].shape[0] < num_reqs:
                raise V.QSAInputError(f"{n} has {host[n].shape[0]} rows but there are {num_reqs} "
                                      f"requests")
        need = None
        if "seq_lens" in host:
            lens = host["seq_lens"]
            need = int(lens.max()) // self.r if lens.size else 0
        if num_groups is not None:
            num_groups = V.check_int(num_groups, "num_groups", 0)
            if need is not None and num_groups < need:
                q = int(np.argmax(host["seq_lens"]))
                raise V.QSAInputError(
                    f"num_groups = {num_groups} is below the longest request's {need} groups "
                    f"(request {q}, seq_len {int(host['seq_lens'][q])}, r = {self.r}); pass "
                    f"num_groups >= max(seq_lens) // r or leave it out")
        # the plan's device: its device metadata's (one device), else the current one, which
        # receives the host metadata's copies
        device = dev.same_device(given)
        device = dev.current_device() if device is None else device
        with dev.on_device(device):
            stream_h = (dev.current_stream_handle(kinds[0], req_ids) if stream is None
                        else dev.stream_handle(stream))
            nstream = self._numba_stream(stream_h)
            arrays = {}
            for (n, x), kind in zip(given, kinds):
                if alias.get(n):
                    arrays[n] = arrays[alias[n]]
                elif kind == "numpy":
                    arrays[n] = (self._ws.put(f"meta.{n}", host32[n], nstream), "numba")
                else:
                    arrays[n] = self._device_ints(x, kind, n, nstream)
        self._rows, self._num_reqs = int(rows), int(num_reqs)
        self._groups = num_groups if num_groups is not None else need
        self._host = host
        self._validate = validate
        # tables the host did not check (device tables not read back, or validate=False): the
        # kernels guard them (numqsa.kernels.guard), so a row needing a bad page id is inert
        self._guard = validate is False or any(
            n not in host for n in ("seq_lens", "block_table", "index_block_table"))
        self._attention_only = attention_only
        # the caller's own arrays (numba views are made only to record or replay slowly)
        self._meta_objs = [arrays[n] for n in META]
        self._meta_views = None
        described = [dev.describe(a, k) for a, k in self._meta_objs]
        self._meta_ptrs = [p for p, _ in described]
        self._meta_key = tuple(k for _, k in described)
        self._checked = set()
        self._device = device
        self._meta_where = next((n for (n, _), k in zip(given, kinds) if k != "numpy"), None)
        self._planned = True
        return self

    def _device_ints(self, x, kind, name, nstream):
        """``(array, kind)``: device int32 metadata as it is; int64 converted (saturated) on the
        device into a kept buffer."""
        if kind in ("torch", "cupy", "numba") and V.dtype_name(x) == "int32":
            return x, kind
        d = dev.as_numba(x, name)
        if V.dtype_name(d) == "int32":
            return d, "numba"
        buf = self._ws.buffer(f"meta.{name}", d.shape, np.int32, nstream)
        return ints(d, nstream, name, out=buf), "numba"

    @property
    def _meta(self):
        """The plan's metadata as numba device arrays, in ``META`` order (made on first use)."""
        if self._meta_views is None:
            self._meta_views = [a if k == "numba" else dev.as_numba(a) for a, k in self._meta_objs]
        return self._meta_views

    # -------------------------------------------------------------------------------- run
    def run(self, qi: Any, index_cache: Any, q: Any, k_cache: Any, v_cache: Any, *,
            out: Optional[Sequence[Any]] = None, return_selection: bool = False,
            stream: Any = None) -> tuple:
        """``(out [rows, Hq, D], lse float32 [rows, Hq])``: selection then attention, one layer.

        ``out`` may be ``(out, lse)`` or ``(out, lse, tokens, counts)`` buffers (any framework;
        NumPy buffers are written after a copy back); otherwise fresh arrays of ``q``'s framework
        are returned. ``return_selection=True`` also returns ``(tokens int32 [rows, Kb*r + r - 1],
        counts int32 [rows])``. ``stream`` defaults to the current stream of ``q``'s framework.
        """
        specs = [("out", (self._rows, self.Hq, self.D), self.out_dtype),
                 ("lse", (self._rows, self.Hq), "float32")]
        if return_selection or (isinstance(out, (tuple, list)) and len(out) == 4):
            specs += [("tokens", (self._rows, self.width), "int32"),
                      ("counts", (self._rows,), "int32")]
        res = self._execute("prefill", [("q", q), ("qi", qi), ("index_cache", index_cache),
                                        ("k_cache", k_cache), ("v_cache", v_cache)], specs, out, stream)
        return res if return_selection else res[:2]

    def run_select(self, qi: Any, index_cache: Any, *, out: Optional[Sequence[Any]] = None,
                   stream: Any = None, scores: Any = None) -> tuple:
        """``(tokens, counts, groups)`` of one layer (:func:`numqsa.select` semantics).

        ``scores`` (optional): a contiguous float32 device array of at least ``chunk * G`` elements
        (:meth:`score_elements`) that holds the score block instead of a buffer the wrapper keeps.
        """
        specs = [("tokens", (self._rows, self.width), "int32"), ("counts", (self._rows,), "int32"),
                 ("groups", (self._rows, self.Kb), "int32")]
        inputs = [("qi", qi), ("index_cache", index_cache)]
        if scores is not None:
            inputs.append(("scores", scores))
        return self._execute("select", inputs, specs, out, stream)

    def score_elements(self, index_cache: Any) -> int:
        """Float32 elements of the selection's score block for this plan and index cache layout."""
        G = self._score_groups(index_cache)
        return select_chunk_rows(self._rows, G, self.score_bytes) * max(G, 1)

    def _score_groups(self, index_cache):
        if self._groups is not None:
            return self._groups
        # device seq_lens, not read: the index table's capacity
        return int(self._meta_objs[4][0].shape[1]) * int(index_cache.shape[1])

    def run_attention(self, q: Any, k_cache: Any, v_cache: Any, tokens: Any, counts: Any, *,
                      out: Optional[Sequence[Any]] = None, stream: Any = None) -> tuple:
        """``(out, lse)`` over a given selection (:func:`numqsa.sparse_attention` semantics)."""
        specs = [("out", (self._rows, self.Hq, self.D), self.out_dtype),
                 ("lse", (self._rows, self.Hq), "float32")]
        return self._execute("attention", [("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                                           ("tokens", tokens), ("counts", counts)], specs, out, stream)

    # -------------------------------------------------------------------------------- internals
    def _numba_stream(self, handle):
        key = (dev.current_device(), handle)     # handle 0 names each device's own default stream
        s = self._streams.get(key)
        if s is None:
            s = self._streams[key] = dev.resolve_stream(handle)
        return s

    def _execute(self, mode, inputs, specs, out, stream):
        if not self._planned:
            raise V.QSAInputError("call plan(...) with the batch metadata before run(...)")
        if self._attention_only and mode != "attention":
            raise V.QSAInputError("this plan has no positions (plan(req_ids, None, ...)): it runs "
                                  "run_attention only; plan with positions to select")
        lead_name, lead = inputs[0]
        lead_kind = dev.array_kind(lead, lead_name)
        # the call's device, from its first array (NumPy: the plan's); every other CUDA array is
        # checked against it below, the plan's metadata here
        device = None if lead_kind == "numpy" else dev.array_device(lead, lead_kind)
        if device is None:
            device = self._device
        elif device != self._device:
            raise self._plan_device_error(lead_name, device)
        with dev.on_device(device):
            return self._execute_on(device, mode, inputs, lead_kind, specs, out, stream)

    def _plan_device_error(self, name, device):
        where = (f"this plan's {self._meta_where}" if self._meta_where else
                 "this plan's metadata (NumPy, copied to the device current at plan time)")
        return V.QSAInputError(
            f"{name} is on {dev.device_name(device)} but {where} is on "
            f"{dev.device_name(self._device)}: a wrapper runs on the device it was planned on; "
            f"plan one wrapper per device (NumPy metadata go to the current device: plan inside "
            f"torch.cuda.device({device}) or numba's cuda.gpus[{device}])")

    def _execute_on(self, device, mode, inputs, lead_kind, specs, out, stream):
        lead_name, lead = inputs[0]
        handle = (dev.current_stream_handle(lead_kind, lead) if stream is None
                  else dev.stream_handle(stream))
        nstream = None
        arrays, kinds, ptrs, keys = [], [], [], []
        for name, x in inputs:
            kind = lead_kind if x is lead else dev.array_kind(x, name)
            if kind != "numpy" and x is not lead:
                d = dev.array_device(x, kind)
                if d != device and d is not None:
                    raise dev.device_error((lead_name, device), (name, d))
            if kind == "numpy":
                nstream = nstream or self._numba_stream(handle)
                h = np.asarray(x)
                if name in ("tokens", "counts"):
                    h = dev.host_int32(h, name)
                x = self._ws.put(f"stage.{name}", np.ascontiguousarray(h), nstream)
                kind = "numba"
            p, k = dev.describe(x, kind)
            arrays.append(x)
            kinds.append(kind)
            ptrs.append(p)
            keys.append(k)
        # outputs: the caller's buffers, or fresh arrays of the lead's framework
        if out is not None and (not isinstance(out, (tuple, list)) or len(out) != len(specs)):
            if not isinstance(out, (tuple, list)):
                raise V.QSAInputError(f"out must be a tuple of buffers "
                                      f"({', '.join(n for n, _, _ in specs)}), got "
                                      f"{type(out).__name__}")
            raise V.QSAInputError(f"out has {len(out)} buffers; this call writes {len(specs)} "
                                  f"({', '.join(n for n, _, _ in specs)})")
        outs, host_outs = [], []
        for i, (name, shape, dt) in enumerate(specs):
            if out is not None:
                b = out[i]
                okind = dev.array_kind(b, f"out[{i}] ({name})")
                want = dt if isinstance(dt, str) else dev.np_dtype(dt).name
                if tuple(b.shape) != tuple(shape) or V.dtype_name(b) != want:
                    raise V.QSAInputError(
                        f"out[{i}] ({name}) must be {want} {tuple(shape)}, got {V.dtype_name(b)} "
                        f"{tuple(b.shape)}")
                d = None if okind == "numpy" else dev.array_device(b, okind)
                if d != device and d is not None:
                    raise dev.device_error((lead_name, device), (f"out[{i}] ({name})", d))
            else:
                okind = lead_kind
                b = None if okind == "numpy" else dev.new_array(okind, shape, dt, lead, None)
            if okind == "numpy":
                nstream = nstream or self._numba_stream(handle)
                host_outs.append((i, b))
                b = self._ws.buffer(f"stage.out.{name}", shape, dt, nstream)
                okind = "numba"
            p, k = dev.describe(b, okind)
            outs.append((b, okind))
            ptrs.append(p)
            keys.append(k)
        key = (mode, device, self._meta_key, self._groups, self._guard, tuple(keys))
        all_ptrs = self._meta_ptrs + ptrs
        prog = self._programs.get(key)
        if prog is not None and any(all_ptrs[j] - all_ptrs[i] != prog.base_ptrs[j] - prog.base_ptrs[i]
                                    for i, j in prog.pairs):
            prog = None
        if prog is None:
            prog = self._prepare(mode, inputs, arrays, kinds, outs)
            self._programs[key] = prog
            while len(self._programs) > self.max_programs:
                self._programs.popitem(last=False)
        else:
            self._programs.move_to_end(key)
            for t in prog.tables:            # a new plan's tables against this layout's caches
                self._check_table(*t)
        views = None
        if not prog.fast:
            views = (self._meta + [dev.as_numba(a) if k != "numba" else a
                                   for a, k in zip(arrays, kinds)]
                     + [dev.as_numba(b) if k != "numba" else b for b, k in outs])
        prog(all_ptrs, handle, views)
        result = [b for b, _ in outs]
        if host_outs:
            nstream = nstream or self._numba_stream(handle)
            for i, b in host_outs:
                h = result[i].copy_to_host(stream=nstream)
                result[i] = h if b is None else b
                if b is not None:
                    nstream.synchronize()
                    b[...] = h
            nstream.synchronize()
        return tuple(result)

    def _prepare(self, mode, inputs, arrays, kinds, outs):
        """Check one layout against the geometry and the plan, then record its launches."""
        named = dict(inputs)
        dev_arrays = {}
        for (name, x), a, kind in zip(inputs, arrays, kinds):
            if name not in ("tokens", "counts", "scores"):
                kernel_dtype(x, name, "numpy" if isinstance(x, np.ndarray) else kind)
            dev_arrays[name] = a if kind == "numba" else dev.as_numba(a, name)
        rows = self._rows
        req, pos, lens, bt, ibt = self._meta
        if "q" in named:
            kc, vc = dev_arrays["k_cache"], dev_arrays["v_cache"]
            self._check_kv_layout(kc)
            num_pages, page_size, hkv, d = V.check_kv(kc, vc, self.r)
            if (hkv, d) != (self.Hkv, self.D):
                raise V.QSAInputError(
                    f"k_cache has shape {tuple(kc.shape)} (Hkv = {hkv}, D = {d}); expected "
                    f"[num_pages, page_size, Hkv = {self.Hkv}, D = {self.D}], this wrapper's geometry")
            hq = V.check_q(dev_arrays["q"], rows, hkv, d)
            if hq != self.Hq:
                raise V.QSAInputError(
                    f"q has shape {tuple(dev_arrays['q'].shape)} (Hq = {hq}); expected [rows = "
                    f"{rows}, Hq = {self.Hq}, D = {self.D}], this wrapper's geometry")
            self._check_table("block_table", num_pages, page_size, 1)
        if "qi" in named:
            ic = dev_arrays["index_cache"]
            n_ipages, R, di = V.check_index_cache(ic)
            if di != self.Di:
                raise V.QSAInputError(
                    f"index_cache has shape {tuple(ic.shape)} (Di = {di}); expected "
                    f"[num_idx_pages, idx_page_rows, Di = {self.Di}], this wrapper's geometry")
            hi = V.check_index_q(dev_arrays["qi"], rows, di)
            if hi != self.Hi:
                raise V.QSAInputError(
                    f"qi has shape {tuple(dev_arrays['qi'].shape)} (Hi = {hi}); expected [rows = "
                    f"{rows}, Hi = {self.Hi}, Di = {self.Di}], this wrapper's geometry")
            self._check_table("index_block_table", n_ipages, R, self.r)
            G = self._score_groups(ic)
        if mode == "attention":
            V.check_selection(dev_arrays["tokens"], dev_arrays["counts"], rows, self.r)
        out_arrays = [b if k == "numba" else dev.as_numba(b) for b, k in outs]
        with recording() as records:
            if mode in ("prefill", "select"):
                if mode == "select":
                    sel = tuple(out_arrays)
                elif len(out_arrays) == 4:
                    sel = (out_arrays[2], out_arrays[3],
                           self._ws.buffer("sel.groups", (rows, self.Kb), "int32", None))
                else:
                    sel = tuple(self._ws.buffer(f"sel.{n}", s, "int32", None) for n, s in
                                (("tokens", (rows, self.width)), ("counts", (rows,)),
                                 ("groups", (rows, self.Kb))))
                chunk = select_chunk_rows(rows, G, self.score_bytes)
                if self._guard:
                    pos = self._guard_rows(mode, req, pos, lens, ibt, ic, bt, dev_arrays)
                scores = dev_arrays.get("scores")
                if scores is None:
                    scores = self._ws.buffer("scores", (max(1, chunk * max(G, 1)),), "float32",
                                             None)
                tokens, counts, _ = select_launch(dev_arrays["qi"], ic, ibt, req, pos, lens,
                                                  Kb=self.Kb, r=self.r, out=sel, workspace=scores,
                                                  num_groups=G, score_bytes=self.score_bytes,
                                                  validate=False)
            else:
                tokens, counts = dev_arrays["tokens"], dev_arrays["counts"]
            if mode in ("prefill", "attention"):
                attention_launch(dev_arrays["q"], kc, vc, bt, tokens, counts, req, lens,
                                 scale=self.scale, r=self.r, out_dtype=self.out_dtype,
                                 out=(out_arrays[0], out_arrays[1]), workspace=self._ws,
                                 validate=False, max_groups=self._groups)
        inputs_all = self._meta + [dev_arrays[n] for n, _ in inputs] + out_arrays
        prog = Program(records, inputs_all)
        prog.tables = self._table_geometry(dev_arrays)
        return prog

    def _guard_rows(self, mode, req, pos, lens, ibt, ic, bt, dev_arrays):
        """Positions with -1 for the rows needing a bad page id of the tables this mode reads
        (the index table; in prefill also the block table): every later stage sees them inert."""
        out = self._ws.buffer("guard.positions", (self._rows,), "int32", None)
        kv = dict(block_table=bt, k_cache=dev_arrays["k_cache"]) if mode == "prefill" else {}
        return guard_positions(req, pos, lens, ibt, ic, out, dev.resolve_stream(None), self.r, **kv)

    def _check_kv_layout(self, kc):
        """Point at the likely mistake when a head-major cache arrives untransposed."""
        s = tuple(kc.shape)
        if len(s) == 4 and s[1] == self.Hkv and s[2] != self.Hkv and s[3] == self.D:
            raise V.QSAInputError(
                f"k_cache has shape {s}, which looks head-major [num_pages, Hkv, page_size, D]; "
                f"pass k_cache.transpose(1, 2) (a view: no copy) so it reads "
                f"[num_pages, page_size, Hkv, D]")

    def _check_table(self, name, num_pages, units_per_page, r):
        """Page ids of the needed columns, on the plan's host copy (once per cache geometry)."""
        if self._validate is False or (name, num_pages, units_per_page) in self._checked:
            return
        tab = self._host.get(name)
        if tab is None or "seq_lens" not in self._host:
            return
        V.check_table(tab, self._host["seq_lens"], units_per_page=units_per_page,
                      num_pages=num_pages, r=r, name=name)
        self._checked.add((name, num_pages, units_per_page))

    def _table_geometry(self, dev_arrays):
        out = []
        if "index_cache" in dev_arrays:
            n, R, _ = dev_arrays["index_cache"].shape
            out.append(("index_block_table", int(n), int(R), self.r))
        if "k_cache" in dev_arrays:
            n, ps = dev_arrays["k_cache"].shape[:2]
            out.append(("block_table", int(n), int(ps), 1))
        return tuple(out)

    @property
    def num_programs(self):
        return len(self._programs)


#: Environment switches that change a route (numqsa/plan.py): part of a cached wrapper's key, so a
#: functional call after a change records its launches again instead of replaying the old route.
ROUTE_ENV = ("NUMQSA_ARCH", "NUMQSA_PAGE4", "NUMQSA_INDEXER_TILED")
MAX_CACHED = 32
_CACHE = {}


def cached_wrapper(mode, handle, workspace=None, device=0, **geometry):
    """The wrapper a functional call (``qsa_prefill``, ``select``, ``sparse_attention``) plans and
    runs on: one per call kind, geometry, device, stream, thread and routing environment, kept in
    the caller's :class:`numqsa.Workspace` or module-wide (at most ``MAX_CACHED`` of either)."""
    env = os.environ
    key = (mode, tuple(geometry.values()), device, handle, threading.get_ident(),
           tuple(env.get(n) for n in ROUTE_ENV))
    store = _CACHE if workspace is None else workspace._wrappers
    w = store.get(key)
    if w is None:
        if len(store) >= MAX_CACHED:
            store.clear()
        w = store[key] = QSAPrefillWrapper(**geometry)
    return w


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
        self._scratch = Buffers()

    def buffer(self, name, shape, dtype, stream):
        """A scratch device buffer kept by name (``select``/``sparse_attention``'s ``workspace=``)."""
        return self._scratch.buffer(name, shape, dtype, stream)

    def outputs(self, key, specs, like_kind, like, stream):
        """The kept outputs of ``key`` on the current device (fresh when the shapes change)."""
        key = (dev.current_device(), key)
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
