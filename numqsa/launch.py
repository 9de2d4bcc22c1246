"""Prepared launches: record a stage's kernel launches once, then replay them with new array pointers.

Why: numba's dispatcher marshals every argument on every launch (about 5 us per array argument on
the H200); a QSA layer launches 4-6 kernels with 10-17 arrays each. A :class:`Program` does that
work once; a replay then launches one CUDA graph of the stage's kernels (``cuGraphLaunch``), after
re-pointing only the graph nodes whose input pointers changed since the last replay
(``cuGraphExecKernelNodeSetParams``), through ``cuda.bindings``, which numba-cuda already depends on.
Measured on the H200 with the GPU busy: one ``cuLaunchKernel`` costs 7-8 us of host time through
``cuda.bindings`` (9-11 us through ``ctypes``), a graph launch of all eight kernels of a prefill 6 us.

Contract for a stage launcher (``numqsa/kernels/*.py`` ``launch_*``):

1. It launches only through :func:`launch` ``(kernel, grid, block, stream, args, smem)`` (a plain
   ``kernel[grid, block, stream, smem](*args)`` is caught too, through the same hook, so launchers
   not yet converted still record).
2. Everything it decides on the host -- routes, grids, shared memory, derived views -- comes from
   shapes, strides, dtypes, the pointer's 16-byte alignment (``ptr % 16``), the launch profile and the
   environment; never from array *values* and never from a device-to-host copy.
3. Buffers it needs come from its arguments, a workspace, or :func:`numqsa.device.constant`; a
   temporary it allocates itself is kept alive by the recording (it is one of the recorded args).
4. Any array argument it derives from an input (a slice, a reshaped or retyped view) keeps a fixed
   byte offset from that input for a fixed layout.

Under :func:`recording` nothing is launched: each launch is appended to a list as a
:class:`Record` ``(kernel, grid, block, smem, args, callbacks)``. :class:`Program` turns records
plus the caller's "input" arrays (those whose memory may change between replays) into a replayable
sequence: array arguments that lie inside an input's memory are re-based on each replay; all other
arguments are frozen. On a GPU the replay is the graph above, or ``cuLaunchKernel`` per kernel with
a prepared ``void**`` while the caller's stream is being captured into the caller's own graph (and
with ``NUMQSA_GRAPH_LAUNCH=0``); in the numba CUDA simulator (no driver) it rebuilds the views and
calls the dispatcher, as it does on a GPU when ``NUMQSA_PREPARED_LAUNCH=0`` (for comparisons) or when
an argument kind is not understood. A graph launch runs the same kernels with the same parameters as
the direct launches (same bits); launches of one program on two streams are ordered one after the
other (one graph executable per program). The graph is the chain of the launches, except that a
launch recorded inside :func:`after` waits for one earlier record only (the attention stage's
generic kernel waits for the page-4 plan, beside the grouped kernels, whose rows it does not write,
or for the direct blocks that planned their own pieces, beside their merge); :func:`programmatic`
makes the edge into a launch leave its one dependency's programmatic port.

A program belongs to the device it was prepared on: its kernel handles come from numba's per-device
module cache (``CodeLibrary.get_cufunc`` loads a kernel into the current context, once per device)
and its graph is made in that context. :class:`numqsa.QSAPrefillWrapper` keys its programs by device
and replays each inside its device's context (:func:`numqsa.device.on_device`).
"""
import bisect
import ctypes
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from .jit import SIMULATOR

__all__ = ["Record", "launch", "recording", "mark", "after", "programmatic", "graph_dependencies",
           "Program", "array_span"]

_state = threading.local()


@dataclass
class Record:
    kernel: object          # numba dispatcher (or the simulator's FakeCUDAKernel)
    grid: tuple
    block: tuple
    smem: int
    args: tuple
    callbacks: tuple = ()   # numba pre-launch callbacks (e.g. the >48 KB shared-memory opt-in)
    config: object = None
    after: object = None    # the record this launch waits for (None: every one not yet waited for)
    programmatic: bool = False   # the graph's edge into it is programmatic (:func:`programmatic`)


def _recording():
    return getattr(_state, "records", None)


def _take_after():
    a = getattr(_state, "after", None)
    _state.after = None
    return a


def _take_programmatic():
    p = bool(getattr(_state, "programmatic", False))
    _state.programmatic = False
    return p


def mark():
    """Index of the last launch recorded on this thread so far (None when not recording)."""
    records = _recording()
    return None if records is None or not records else len(records) - 1


@contextmanager
def after(index):
    """The first launch recorded inside waits for record ``index`` (a :func:`mark`) only, so that
    in the replay graph it runs beside the launches recorded between the two (they must write
    disjoint memory); the launch after the block waits for both branches. Launched directly (not
    recording, or replayed one by one) everything stays in stream order."""
    _state.after = index
    try:
        yield
    finally:
        _state.after = None


@contextmanager
def programmatic():
    """The first launch recorded inside is a *programmatic* dependent of the one launch it waits
    for: in the replay graph its edge leaves that kernel's programmatic port, so it launches once
    every block of that kernel has issued ``griddepcontrol.launch_dependents`` (or exited), and it
    must run ``griddepcontrol.wait`` (:func:`numqsa.kernels.smem.grid_dep_wait`) before reading
    anything that kernel writes. Launched in stream order, the wait returns at once (sm_90+; the
    launcher asks for it only there)."""
    _state.programmatic = True
    try:
        yield
    finally:
        _state.programmatic = False


def graph_dependencies(records):
    """Per record, the indices of the records it waits for in the replay graph: its ``after``, else
    every earlier one nothing waits for yet (a chain, unless a launch branched off)."""
    deps_all, sinks = [], []
    for i, rec in enumerate(records):
        deps = list(sinks) if rec.after is None else [rec.after]
        sinks = [x for x in sinks if x not in deps] + [i]
        deps_all.append(deps)
    return deps_all


def launch(kernel, grid, block, stream, args, smem=0):
    """Launch ``kernel[grid, block, stream, smem](*args)`` now, or record it inside :func:`recording`."""
    return kernel[grid, block, stream, smem](*args)


def _norm3(d):
    d = tuple(d) if isinstance(d, tuple) else (d,)
    return tuple(int(x) for x in d) + (1,) * (3 - len(d))


_HOOKED = []


def _install_hook():
    """Wrap numba's launch entry (once) so a thread inside :func:`recording` records instead."""
    if _HOOKED:
        return
    if SIMULATOR:
        from numba.cuda.simulator.kernel import FakeCUDAKernel
        original = FakeCUDAKernel.__call__

        def call(self, *args):
            records = _recording()
            if records is None or self._device:
                return original(self, *args)
            records.append(Record(self, _norm3(self.grid_dim), _norm3(self.block_dim),
                                  int(self.dynshared_size or 0), args, after=_take_after(),
                                  programmatic=_take_programmatic()))
        FakeCUDAKernel.__call__ = call
    else:
        from numba.cuda.dispatcher import _LaunchConfiguration
        original = _LaunchConfiguration.__call__

        def call(self, *args):
            records = _recording()
            if records is None:
                return original(self, *args)
            records.append(Record(self.dispatcher, _norm3(self.griddim), _norm3(self.blockdim),
                                  int(self.sharedmem or 0), args, tuple(self.pre_launch_callbacks),
                                  self, _take_after(), _take_programmatic()))
        _LaunchConfiguration.__call__ = call
    _HOOKED.append(original)


@contextmanager
def recording():
    """``with recording() as records:`` -- launches on this thread are recorded, not run."""
    _install_hook()
    prev = _recording()
    _state.records = records = []
    try:
        yield records
    finally:
        _state.records = prev


# ------------------------------------------------------------------------------------------------
# Array facts: pointer and byte span, for numba device arrays (real or simulated)
# ------------------------------------------------------------------------------------------------

def _host_of(a):
    """The NumPy array behind a simulator device array (or a NumPy array itself)."""
    return a if isinstance(a, np.ndarray) else getattr(a, "_ary", None)


def array_span(a):
    """``(ptr, lo, hi)``: data pointer and the byte range ``[lo, hi)`` the array can touch."""
    if SIMULATOR:
        h = _host_of(a)
        ptr = int(h.__array_interface__["data"][0])
        shape, strides, itemsize = h.shape, h.strides, h.itemsize
    else:
        # numba's own fields: its __cuda_array_interface__ fails for arrays allocated on an
        # external stream (numba-cuda 0.30.4, seen on the H200)
        ptr = int(a.device_ctypes_pointer.value or 0)
        shape, strides = tuple(a.shape), tuple(a.strides)
        itemsize = np.dtype(a.dtype).itemsize
    if any(n == 0 for n in shape):
        return ptr, ptr, ptr
    lo = ptr + sum(min(0, (n - 1) * s) for n, s in zip(shape, strides))
    hi = ptr + sum(max(0, (n - 1) * s) for n, s in zip(shape, strides)) + itemsize
    return ptr, lo, hi


def _is_array(x):
    return hasattr(x, "shape") and hasattr(x, "dtype") and (
        hasattr(x, "device_ctypes_pointer") or hasattr(x, "_ary"))


def _locate(a, spans):
    """``(input index, byte offset)`` of array ``a`` inside one of ``spans``, or None (frozen).

    An array inside several inputs (views of one allocation, e.g. ``kv[:, 0]`` and ``kv[:, 1]``) is
    attributed to the input starting exactly at its pointer, else the nearest one starting below it;
    :class:`Program` keys such inputs' pointer differences, so any attribution replays the same.
    """
    ptr, lo, hi = array_span(a)
    if hi == lo:
        return None
    cands = [j for j, (p, l, h) in enumerate(spans) if h > l and l <= ptr < h]
    if not cands:
        return None
    exact = [j for j in cands if spans[j][0] == ptr]
    below = [j for j in cands if spans[j][0] <= ptr]
    best = exact[0] if exact else (max(below, key=lambda j: spans[j][0]) if below else cands[0])
    return None if best is None else (best, ptr - spans[best][0])


def overlapping_pairs(spans):
    """Pairs of inputs whose byte ranges overlap (their pointer difference is part of a layout)."""
    out = []
    for i in range(len(spans)):
        for j in range(i + 1, len(spans)):
            (_, li, hi), (_, lj, hj) = spans[i], spans[j]
            if li < hj and lj < hi and hi > li and hj > lj:
                out.append((i, j))
    return tuple(out)


# ------------------------------------------------------------------------------------------------
# Replay
# ------------------------------------------------------------------------------------------------

class Program:
    """A recorded launch sequence, replayable with new input pointers.

    ``inputs`` are the numba device arrays the records were made with whose memory may change
    between replays (per-layer tensors, caller-owned outputs, caller-owned metadata). Replay with
    :meth:`__call__` ``(ptrs, stream_handle, views)``: ``ptrs`` the new data pointers in input order;
    ``views`` (simulator / fallback only) the new input arrays themselves.
    """

    def __init__(self, records, inputs):
        self.records = list(records)
        spans = [array_span(x) for x in inputs]
        self.base_ptrs = [s[0] for s in spans]
        self.pairs = overlapping_pairs(spans)
        # per record: list of (arg index, input index, byte offset, array)
        self.patches = []
        for rec in self.records:
            pts = []
            for k, a in enumerate(rec.args):
                if _is_array(a):
                    loc = _locate(a, spans)
                    if loc is not None:
                        pts.append((k, loc[0], loc[1], a))
            self.patches.append(pts)
        self.fast = False
        self.fallback_reason = "simulator" if SIMULATOR else ""
        if not SIMULATOR and os.environ.get("NUMQSA_PREPARED_LAUNCH", "1").strip() == "0":
            self.fallback_reason = "NUMQSA_PREPARED_LAUNCH=0"
        elif not SIMULATOR:
            try:
                self._prepare_params()
                self.fast = True
            except Exception as err:        # unknown argument kind: replay through the dispatcher
                self.fallback_reason = f"{type(err).__name__}: {err}"
        if self.fast:
            self._release_inputs()
        self._exec = None           # the CUDA graph executable (built on the first replay)
        self._graph_state = None    # the input pointers its nodes hold
        self._storage_state = None  # the input pointers the parameter buffer holds
        self.graph = (self.fast and
                      os.environ.get("NUMQSA_GRAPH_LAUNCH", "1").strip() != "0")

    def _release_inputs(self):
        """Drop the recorded arrays that lie in an input (a replay re-points them anyway), so a kept
        program does not keep a caller's tensors alive; frozen arguments (buffers the launchers or
        the wrapper own) stay referenced, their pointers are in the parameter buffer."""
        for rec, pts in zip(self.records, self.patches):
            located = {k for k, _, _, _ in pts}
            rec.args = tuple(None if k in located else a for k, a in enumerate(rec.args))
        self.patches = [[(k, j, off, None) for k, j, off, _ in pts] for pts in self.patches]

    @property
    def num_launches(self):
        return len(self.records)

    # -- GPU: one parameter buffer for all launches ---------------------------------------------
    def _prepare_params(self):
        from cuda.bindings import driver as cu
        from numba.core import types
        self._cu = cu
        self._ok = cu.CUresult.CUDA_SUCCESS
        self._not_capturing = cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE
        chunks, launches, patch_slots, patch_inputs, patch_offsets = [], [], [], [], []
        nslots = 0
        for rec, pts in zip(self.records, self.patches):
            disp = rec.kernel
            argtypes = tuple(disp.typeof_pyval(a) for a in rec.args)
            kernel = disp.compile(argtypes)
            for cb in rec.callbacks:
                cb(kernel, rec.config)
            kargs, data_slot = [], {}
            for k, (t, v) in enumerate(zip(kernel.argument_types, rec.args)):
                n0 = len(kargs)
                kernel._prepare_args(t, v, 0, [], kargs)
                if isinstance(t, types.Array):
                    data_slot[k] = n0 + 4       # (meminfo, parent, nitems, itemsize, data, ...)
            first = nslots
            chunks.append(kargs)
            nslots += len(kargs)
            for k, j, off, _ in pts:
                patch_slots.append(first + data_slot[k])
                patch_inputs.append(j)
                patch_offsets.append(off)
            handle = kernel._codelibrary.get_cufunc().handle
            launches.append((cu.CUfunction(int(handle)), rec.grid, rec.block, rec.smem, first,
                             len(kargs)))
        storage = np.zeros(max(1, nslots), np.uint64)
        raw = storage.view(np.uint8)
        k = 0
        for kargs in chunks:
            for a in kargs:
                if isinstance(a, (bool, np.bool_)):
                    raw[8 * k] = int(a)
                elif isinstance(a, (int, np.integer)):
                    storage[k] = int(a) & 0xFFFFFFFFFFFFFFFF
                elif isinstance(a, ctypes._SimpleCData):
                    b = np.frombuffer(bytes(a), np.uint8)
                    if b.size > 8:
                        raise TypeError(f"kernel parameter of {b.size} bytes")
                    raw[8 * k:8 * k + b.size] = b
                else:
                    raise TypeError(f"kernel parameter {type(a).__name__}")
                k += 1
        base = storage.ctypes.data
        pointers = np.arange(storage.size, dtype=np.uint64) * np.uint64(8) + np.uint64(base)
        self._storage, self._pointers = storage, pointers
        self._launches = [(fn, g, b, s, int(pointers.ctypes.data) + 8 * first)
                          for fn, g, b, s, first, _ in launches]
        self._patch = list(zip(patch_slots, patch_inputs, patch_offsets))
        # the launches whose parameters hold an input pointer: the graph nodes a replay re-points
        firsts = [first for _, _, _, _, first, _ in launches]
        self._patched_launches = sorted({bisect.bisect_right(firsts, slot) - 1
                                         for slot in patch_slots})
        self._inputs_used = sorted(set(patch_inputs))

    # -- GPU: the launches as one graph ---------------------------------------------------------
    def _build_graph(self):
        """One CUDA graph of the launches, instantiated; its nodes' parameters are copies of the
        parameter buffer as it is now, its edges :func:`graph_dependencies`; the edge into a
        :func:`programmatic` launch from its one dependency leaves that kernel's programmatic port.
        (Programmatic edges from port ``LAUNCH_ORDER`` into every kernel of the chain, each
        beginning with ``griddepcontrol.wait``, were measured in session 13: one row's attention
        chain took 25.2 us with them, 20.8 without.)"""
        cu = self._cu
        err, graph = cu.cuGraphCreate(0)
        self._check(err, "cuGraphCreate")
        try:
            nodes = []
            for (fn, g, b, smem, params), deps, rec in zip(self._launches,
                                                           graph_dependencies(self.records),
                                                           self.records):
                prev = [nodes[x][0] for x in deps]
                pdl = rec.programmatic and len(prev) == 1
                if pdl:
                    prev = []
                node_params = cu.CUDA_KERNEL_NODE_PARAMS()
                node_params.kern = cu.CUkernel(int(fn))    # numba-cuda loads libraries: CUkernel
                node_params.gridDimX, node_params.gridDimY, node_params.gridDimZ = g
                node_params.blockDimX, node_params.blockDimY, node_params.blockDimZ = b
                node_params.sharedMemBytes = smem
                node_params.kernelParams = params
                err, node = cu.cuGraphAddKernelNode(graph, prev, len(prev), node_params)
                self._check(err, "cuGraphAddKernelNode")
                if pdl:
                    self._programmatic_edge(graph, nodes[deps[0]][0], node)
                nodes.append((node, node_params))
            err, exe = cu.cuGraphInstantiate(graph, 0)
            self._check(err, "cuGraphInstantiate")
        except Exception:
            cu.cuGraphDestroy(graph)
            raise
        self._graph_handle, self._exec = graph, exe
        self._nodes = [nodes[i] for i in self._patched_launches]

    def _programmatic_edge(self, graph, src, dst):
        """``src -> dst`` from ``src``'s programmatic port (``cuGraphAddDependencies_v2`` in CUDA 12,
        whose edge data CUDA 13 moved into ``cuGraphAddDependencies``)."""
        cu = self._cu
        edge = cu.CUgraphEdgeData()
        edge.type = cu.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
        edge.from_port = cu.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
        add = getattr(cu, "cuGraphAddDependencies_v2", cu.cuGraphAddDependencies)
        err, = add(graph, [src], [dst], [edge], 1)
        self._check(err, "cuGraphAddDependencies")

    def _check(self, err, what):
        if err != self._ok:
            raise RuntimeError(f"{what} failed: {err}")

    def _capturing(self, stream_handle):
        err, status = self._cu.cuStreamIsCapturing(stream_handle)
        self._check(err, "cuStreamIsCapturing")
        return status != self._not_capturing

    def __del__(self):
        exe = getattr(self, "_exec", None)
        if exe is not None:
            try:
                self._cu.cuGraphExecDestroy(exe)
                self._cu.cuGraphDestroy(self._graph_handle)
            except Exception:
                pass

    def __call__(self, ptrs, stream_handle=0, views=None):
        if self.fast:
            state = tuple(ptrs[j] for j in self._inputs_used)
            if state != self._storage_state:
                st = self._storage
                for slot, j, off in self._patch:
                    st[slot] = ptrs[j] + off
                self._storage_state = state
            if self.graph and not self._capturing(stream_handle) and \
                    self._graph_replay(state, stream_handle):
                return
            launch_kernel = self._cu.cuLaunchKernel
            ok = self._ok
            for fn, g, b, smem, params in self._launches:
                err, = launch_kernel(fn, g[0], g[1], g[2], b[0], b[1], b[2], smem, stream_handle,
                                     params, 0)
                if err != ok:
                    raise RuntimeError(f"cuLaunchKernel failed: {err}")
            return
        self._replay_dispatch(ptrs, stream_handle, views)

    def _graph_replay(self, state, stream_handle):
        """Launch the graph re-pointed at ``state``; False if graphs cannot be built here."""
        cu = self._cu
        if self._exec is None:
            try:
                self._build_graph()
            except Exception as err:        # no graphs here: launch one by one from now on
                self.graph = False
                self.fallback_reason = f"no graph launch: {type(err).__name__}: {err}"
                return False
        elif state != self._graph_state:
            for node, node_params in self._nodes:
                err, = cu.cuGraphExecKernelNodeSetParams(self._exec, node, node_params)
                self._check(err, "cuGraphExecKernelNodeSetParams")
        self._graph_state = state
        err, = cu.cuGraphLaunch(self._exec, stream_handle)
        self._check(err, "cuGraphLaunch")
        return True

    # -- simulator / fallback: rebuild the views, call the dispatcher ---------------------------
    def _replay_dispatch(self, ptrs, stream_handle, views):
        from numba import cuda
        stream = 0
        if not SIMULATOR and stream_handle:
            stream = cuda.external_stream(int(stream_handle))
        for rec, pts in zip(self.records, self.patches):
            args = list(rec.args)
            for k, j, off, a in pts:
                args[k] = _view_like(a, ptrs[j] + off, views[j] if views is not None else None)
            cfg = rec.kernel[rec.grid, rec.block, stream, rec.smem]
            if rec.callbacks:            # e.g. the >48 KB shared-memory opt-in, as in _prepare_params
                cfg.pre_launch_callbacks.extend(rec.callbacks)
            cfg(*args)


class _HostView:
    def __init__(self, ptr, shape, strides, dtype, owner):
        self.__array_interface__ = {"data": (int(ptr), False), "shape": tuple(shape),
                                    "strides": tuple(strides), "typestr": dtype.str, "version": 3}
        self.owner = owner


class _DeviceView:
    def __init__(self, ptr, shape, strides, dtype, owner):
        self.__cuda_array_interface__ = {"data": (int(ptr), False), "shape": tuple(shape),
                                         "strides": tuple(strides), "typestr": dtype.str,
                                         "version": 3, "stream": None}
        self.owner = owner


def _view_like(a, ptr, owner):
    """An array like ``a`` (shape, strides, dtype) at ``ptr``, aliasing ``owner``'s memory."""
    from numba import cuda
    dtype = np.dtype(a.dtype)
    if SIMULATOR:
        h = _host_of(a)
        arr = np.asarray(_HostView(ptr, h.shape, h.strides, dtype, owner)).view(dtype)
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        return FakeCUDAArray(arr)
    return cuda.as_cuda_array(_DeviceView(ptr, tuple(a.shape), tuple(a.strides), dtype, owner),
                              sync=False)
