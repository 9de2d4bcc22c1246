"""Tensor-core primitives: one kernel source for the GPU (inline PTX) and the CUDA simulator (CI).

Two warp-wide matrix products, both ``D = A @ B + C`` with float16 (or bfloat16) inputs and float32
accumulators, exactly as PTX ``mma.sync.aligned`` defines them:

- ``mma_m16n8k16_f16(a, b, c, scratch, lane)`` (sm_80+, HMMA.16816): the warp multiplies one
  16x16 A by one 16x8 B. ``a`` is ``UniTuple(uint32, 4)``, ``b`` ``UniTuple(uint32, 2)``, ``c`` and
  the result ``UniTuple(float32, 4)``. ``mma_m16n8k16_bf16`` is the same with bfloat16 inputs.
- ``mma_m8n8k4_f16(a0, a1, b0, b1, c, scratch, lane)`` (sm_70+; the only tensor-core op of the V100;
  Hopper runs it emulated, correct but slow): the warp does FOUR independent 8x8x4 products, one per
  quad-pair. ``a0 a1 b0 b1`` are uint32, ``c`` and the result ``UniTuple(float32, 8)``.

Each uint32 operand register holds two 16-bit values: the LOWER half-word is the element with the
smaller column (A) / smaller k (B). :func:`pack_f16x2` and :func:`pack_bf16x2` build such words.
``g = lane >> 2`` (group id), ``t = lane & 3`` (thread in group) below.

Layout of m16n8k16 (A row-major M x K, B "col" i.e. each register holds two consecutive k of one n):
    A register j (0..3), half h: row ``g + 8*(j & 1)``, col ``2*t + h + 8*(j >> 1)``
    B register j (0..1), half h: k   ``2*t + h + 8*j``,   n   ``g``
    C/D element i (0..3):        row ``g + 8*(i >> 1)``, col ``2*t + (i & 1)``
  So D's two n8 tiles side by side (cols 0..15 of rows g, g+8) hold exactly the A fragment of a
  k16 step: a flash-attention P tile goes from the S accumulators to the P@V A operand in registers.

Layout of m8n8k4 (quad-pair ``q = (lane >> 2) & 3`` = lanes 4q..4q+3 and 4q+16..4q+19 owns product q;
``hi = lane >> 4``):
    A register j (0..1), half h: row ``(lane & 3) + 4*hi``, k ``2*j + h``           (A ``.row``)
    B register j (0..1), half h: k   ``2*j + h``,           n ``(lane & 3) + 4*hi``  (B ``.col``)
    C/D element i (0..7):        row ``(lane & 1) + (i & 2) + 4*hi``,
                                 col ``(i & 4) + (lane & 2) + (i & 1)``              (``.f32`` C)
  A usual arrangement: a warp covers a 16x16 D tile, quad-pair q taking rows ``8*(q & 1)`` and
  cols ``8*(q >> 1)`` (see :func:`m8n8k4_quadpair`).

These are the tables of the PTX ISA ("Matrix Fragments for mma.m16n8k16 with floating point type",
"Matrix Fragments for mma.m8n8k4 with .f16 floating point type"); the device functions
``m16n8k16_a_pos``/``_b_pos``/``_c_pos`` and ``m8n8k4_a_pos``/``_b_pos``/``_c_pos`` return them,
and ``load_*`` helpers gather fragments from any 2-D array (shared memory, usually).

Simulator. The simulator has neither inline PTX nor warp shuffles, so there each mma is a stand-in
with the same signature: every lane writes its A/B registers into ``scratch`` (a per-warp uint32
region of shared memory the caller allocates, :data:`SCRATCH_WORDS` words per warp), waits for the
other 31 lanes of its warp (a barrier keyed by the scratch region, not ``syncthreads``), then
computes its own D elements in float32 from the layouts above (alternate calls use alternate
halves of the scratch, so the next call cannot overwrite what a slow lane still reads). Hence, in kernels that use these primitives (the same rules as mma.sync):

- all 32 lanes of a warp call the mma together (never under a lane-dependent branch); blocks are
  whole warps. Different warps may run different numbers of mmas. A lane left waiting raises after
  two minutes instead of hanging.
- each warp passes its own scratch row, e.g. ``scr = cuda.shared.array((WARPS, SCRATCH_WORDS),
  uint32)`` then ``mma_...(..., scr[warp], lane)`` with ``lane = threadIdx.x % 32``. Import the
  name (``from numqsa.kernels.mma import SCRATCH_WORDS``) or close over it: written as
  ``mma.SCRATCH_WORDS`` inside a kernel it is not a compile-time constant and the shape fails to type.

On the GPU ``scratch`` and ``lane`` are ignored and :data:`SCRATCH_WORDS` is 1, so the scratch
costs nothing there (the unused shared array is optimised away).

Users: m16n8k16 (sm_80+) by the index scores' tiled, keys-as-M and direct kernels
(:mod:`numqsa.kernels.index_scores`), the grouped attention (:mod:`numqsa.kernels.grouped`) and the
page-4 kernel on unaligned caches; m8n8k4 by the sm_70 tiled scores and page-4 kernels. Each of
those modules' docstrings cites the measurement that chose its route.
"""
import functools
import threading

import numpy as np
from llvmlite import ir
from numba import cuda, float32, uint32
from numba.cuda.types import float16
from numba.cuda import cgutils, types
from numba.cuda.extending import intrinsic

from ..jit import SIMULATOR, device_jit, jit

__all__ = [
    "mma_m16n8k16_f16", "mma_m16n8k16_bf16", "mma_m8n8k4_f16",
    "pack_f16x2", "pack_bf16x2", "unpack_f16x2", "ld_global_nc_v4_u32", "ex2_approx_ftz",
    "SCRATCH_WORDS", "SIM_SCRATCH_WORDS_M16N8K16", "SIM_SCRATCH_WORDS_M8N8K4",
    "m16n8k16_a_pos", "m16n8k16_b_pos", "m16n8k16_c_pos",
    "m8n8k4_quadpair", "m8n8k4_a_pos", "m8n8k4_b_pos", "m8n8k4_c_pos",
    "load_a_m16n8k16", "load_b_m16n8k16", "load_bt_m16n8k16",
    "load_a_m16n8k16_u32", "load_bt_m16n8k16_u32",
    "load_a_m8n8k4", "load_b_m8n8k4", "load_bt_m8n8k4",
    "load_a_m8n8k4_u32", "load_bt_m8n8k4_u32",
    "store_c_m16n8k16", "store_c_m8n8k4", "c_pair_to_a_f16", "c_pair_to_a_bf16",
    "DEMO_KINDS", "make_demo_gemm_kernel", "demo_gemm", "RESOURCE_CASES",
]

# uint32 words per warp the simulator stand-ins exchange through: the A then B registers of all 32
# lanes, twice (alternate calls use alternate halves, so one warp barrier per mma suffices).
SIM_SCRATCH_WORDS_M16N8K16 = 2 * (32 * 4 + 32 * 2)   # 384
SIM_SCRATCH_WORDS_M8N8K4 = 2 * (32 * 2 + 32 * 2)     # 256
# What a kernel allocates per warp (uint32): enough for either shape in the simulator, 1 on a GPU.
SCRATCH_WORDS = SIM_SCRATCH_WORDS_M16N8K16 if SIMULATOR else 1


# ------------------------------------------------------------------------------------------------
# GPU intrinsics (inline PTX through llvmlite)
# ------------------------------------------------------------------------------------------------

def _int_tuple(ty, n):
    return (isinstance(ty, types.BaseTuple) and len(ty) == n
            and all(isinstance(t, types.Integer) for t in ty))


def _num_tuple(ty, n):
    return (isinstance(ty, types.BaseTuple) and len(ty) == n
            and all(isinstance(t, (types.Integer, types.Float)) for t in ty))


def _tuple_elems(context, builder, ty, val, to):
    return [context.cast(builder, builder.extract_value(val, i), ty[i], to) for i in range(len(ty))]


def _f32_tuple(context, builder, ret, asm_result, n):
    return context.make_tuple(builder, ret, [builder.extract_value(asm_result, i) for i in range(n)])


def _make_mma16816(ab_type):
    opcode = f"mma.sync.aligned.m16n8k16.row.col.f32.{ab_type}.{ab_type}.f32"
    text = (opcode + " {$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};")
    constraints = ",".join(["=f"] * 4 + ["r"] * 6 + ["f"] * 4)

    def typer(typingctx, a, b, c, scratch, lane):
        if not (_int_tuple(a, 4) and _int_tuple(b, 2) and _num_tuple(c, 4)):
            return None
        ret = types.UniTuple(types.float32, 4)
        sig = ret(a, b, c, scratch, lane)

        def codegen(context, builder, sig, args):
            a_v, b_v, c_v = args[0], args[1], args[2]
            ta, tb, tc = sig.args[0], sig.args[1], sig.args[2]
            ops = (_tuple_elems(context, builder, ta, a_v, types.uint32)
                   + _tuple_elems(context, builder, tb, b_v, types.uint32)
                   + _tuple_elems(context, builder, tc, c_v, types.float32))
            f32, i32 = ir.FloatType(), ir.IntType(32)
            fnty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4)
            res = builder.call(ir.InlineAsm(fnty, text, constraints), ops)
            return _f32_tuple(context, builder, sig.return_type, res, 4)
        return sig, codegen
    typer.__name__ = f"mma_m16n8k16_{ab_type}"
    return intrinsic(typer)


_gpu_mma_m16n8k16_f16 = _make_mma16816("f16")
_gpu_mma_m16n8k16_bf16 = _make_mma16816("bf16")

_M884_TEXT = ("mma.sync.aligned.m8n8k4.row.col.f32.f16.f16.f32 {$0,$1,$2,$3,$4,$5,$6,$7}, "
              "{$8,$9}, {$10,$11}, {$12,$13,$14,$15,$16,$17,$18,$19};")
_M884_CONSTRAINTS = ",".join(["=f"] * 8 + ["r"] * 4 + ["f"] * 8)


@intrinsic
def _gpu_mma_m8n8k4_f16(typingctx, a0, a1, b0, b1, c, scratch, lane):
    if not (all(isinstance(t, types.Integer) for t in (a0, a1, b0, b1)) and _num_tuple(c, 8)):
        return None
    ret = types.UniTuple(types.float32, 8)
    sig = ret(a0, a1, b0, b1, c, scratch, lane)

    def codegen(context, builder, sig, args):
        ops = [context.cast(builder, args[i], sig.args[i], types.uint32) for i in range(4)]
        ops += _tuple_elems(context, builder, sig.args[4], args[4], types.float32)
        f32, i32 = ir.FloatType(), ir.IntType(32)
        fnty = ir.FunctionType(ir.LiteralStructType([f32] * 8), [i32] * 4 + [f32] * 8)
        res = builder.call(ir.InlineAsm(fnty, _M884_TEXT, _M884_CONSTRAINTS), ops)
        return _f32_tuple(context, builder, sig.return_type, res, 8)
    return sig, codegen


def _is_bf16(ty):
    return str(ty) in ("bfloat16", "__nv_bfloat16")


def _pack_bits_codegen(context, builder, sig, args):
    """Two 16-bit scalars (float16 / bfloat16 are i16 in numba-cuda's data model) -> one word."""
    i32 = ir.IntType(32)
    lo32 = builder.zext(args[0], i32)
    hi32 = builder.zext(args[1], i32)
    return builder.or_(lo32, builder.shl(hi32, ir.Constant(i32, 16)))


@intrinsic
def _gpu_pack_f16x2(typingctx, lo, hi):
    if lo == types.float16 and hi == types.float16:
        return types.uint32(lo, hi), _pack_bits_codegen
    if isinstance(lo, (types.Float, types.Integer)) and isinstance(hi, (types.Float, types.Integer)):
        # Round to nearest even, like float16(x); two scalar cvt so sm_70 assembles it too.
        def codegen(context, builder, sig, args):
            f32, i32 = ir.FloatType(), ir.IntType(32)
            ops = [context.cast(builder, args[i], sig.args[i], types.float32) for i in range(2)]
            asm = ir.InlineAsm(
                ir.FunctionType(i32, [f32, f32]),
                "{ .reg .b16 l, h; cvt.rn.f16.f32 l, $1; cvt.rn.f16.f32 h, $2; "
                "mov.b32 $0, {l, h}; }",
                "=r,f,f")
            return builder.call(asm, ops)
        return types.uint32(lo, hi), codegen
    return None


@intrinsic
def _gpu_ex2_approx_ftz(typingctx, x):
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        f32 = ir.FloatType()
        asm = ir.InlineAsm(ir.FunctionType(f32, [f32]), "ex2.approx.ftz.f32 $0, $1;", "=f,f")
        return builder.call(asm, [args[0]])
    return types.float32(x), codegen


@intrinsic
def _gpu_pack_bf16x2(typingctx, lo, hi):
    if _is_bf16(lo) and _is_bf16(hi):
        return types.uint32(lo, hi), _pack_bits_codegen
    if not (isinstance(lo, (types.Float, types.Integer))
            and isinstance(hi, (types.Float, types.Integer))):
        return None

    def codegen(context, builder, sig, args):
        f32, i32 = ir.FloatType(), ir.IntType(32)
        ops = [context.cast(builder, args[i], sig.args[i], types.float32) for i in range(2)]
        # cvt.rn.bf16x2.f32 d, a, b puts a in the UPPER half (sm_80+).
        asm = ir.InlineAsm(ir.FunctionType(i32, [f32, f32]), "cvt.rn.bf16x2.f32 $0, $2, $1;",
                           "=r,f,f")
        return builder.call(asm, ops)
    return types.uint32(lo, hi), codegen


@intrinsic
def _gpu_unpack_f16x2(typingctx, w):
    if not isinstance(w, types.Integer):
        return None
    ret = types.UniTuple(types.float16, 2)

    def codegen(context, builder, sig, args):
        i16, i32 = ir.IntType(16), ir.IntType(32)
        v = context.cast(builder, args[0], sig.args[0], types.uint32)
        lo = builder.trunc(v, i16)
        hi = builder.trunc(builder.lshr(v, ir.Constant(i32, 16)), i16)
        return context.make_tuple(builder, sig.return_type, [lo, hi])
    return ret(w), codegen


@intrinsic
def _gpu_ld_global_nc_v4_u32(typingctx, arr, idx):
    if not (isinstance(arr, types.Array) and arr.dtype == types.uint32 and arr.ndim == 1
            and isinstance(idx, types.Integer)):
        return None
    ret = types.UniTuple(types.uint32, 4)

    def codegen(context, builder, sig, args):
        arrty = sig.args[0]
        ary = context.make_array(arrty)(context, builder, value=args[0])
        index = context.cast(builder, args[1], sig.args[1], types.intp)
        ptr = cgutils.get_item_pointer(context, builder, arrty, ary, [index], wraparound=False)
        i32 = ir.IntType(32)
        asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([i32] * 4), [ptr.type]),
                           "ld.global.nc.v4.u32 {$0,$1,$2,$3}, [$4];", "=r,=r,=r,=r,l")
        res = builder.call(asm, [ptr])
        return context.make_tuple(builder, sig.return_type,
                                  [builder.extract_value(res, i) for i in range(4)])
    return ret(arr, idx), codegen


# ------------------------------------------------------------------------------------------------
# Simulator stand-ins (plain Python run by the simulator's threads)
# ------------------------------------------------------------------------------------------------

def _table_16816():
    """Float16 slot (in scratch viewed as float16) of A[row, k] and B[k, n] for m16n8k16."""
    a = np.empty((16, 16), np.int64)
    for row in range(16):
        for k in range(16):
            ln = 4 * (row & 7) + ((k & 7) >> 1)
            j = (row >> 3) + 2 * (k >> 3)
            a[row, k] = 2 * (4 * ln + j) + (k & 1)
    b = np.empty((16, 8), np.int64)
    for k in range(16):
        for n in range(8):
            ln = 4 * n + ((k & 7) >> 1)
            b[k, n] = 2 * (128 + 2 * ln + (k >> 3)) + (k & 1)
    return a, b


def _table_884():
    """Float16 slot of A_q[row, k] (q, 8, 4) and B_q[k, n] (q, 4, 8) for m8n8k4."""
    a = np.empty((4, 8, 4), np.int64)
    b = np.empty((4, 4, 8), np.int64)
    for q in range(4):
        for x in range(8):
            ln = 4 * q + (x & 3) + 16 * (x >> 2)
            for k in range(4):
                a[q, x, k] = 2 * (2 * ln + (k >> 1)) + (k & 1)
                b[q, k, x] = 2 * (64 + 2 * ln + (k >> 1)) + (k & 1)
    return a, b


_A16816, _B16816 = _table_16816()
_A884, _B884 = _table_884()


_WARP_BARRIERS = {}
_WARP_BARRIERS_LOCK = threading.Lock()
# A lane that waits this long for its warp is in a kernel whose lanes do not all reach the mma.
_WARP_BARRIER_TIMEOUT_S = 120.0
_LANE = threading.local()   # per simulated thread: mma calls made per scratch region


def _warp_sync(key):
    """Barrier of the 32 lanes sharing one scratch region (one warp), like mma.sync's own
    convergence: cheaper than the simulator's block-wide syncthreads, and other warps may differ."""
    with _WARP_BARRIERS_LOCK:
        bar = _WARP_BARRIERS.get(key)
        if bar is None or bar.broken:
            bar = _WARP_BARRIERS[key] = threading.Barrier(32)
    try:
        bar.wait(timeout=_WARP_BARRIER_TIMEOUT_S)
    except threading.BrokenBarrierError:
        raise RuntimeError("mma stand-in: not all 32 lanes of the warp reached the mma "
                           "(lane-dependent branch, or a block that is not whole warps)") from None


def _sim_buffer(scratch, need, check_block=True):
    """(this call's half of the warp's scratch as uint32 words, barrier key).

    Call n of a warp writes half n % 2, waits for the warp, and reads it. A lane can only write
    that half again at call n + 2, after every lane has reached call n + 1's barrier, that is,
    after every lane has finished reading call n: one barrier per call is enough."""
    words = np.asarray(scratch).reshape(-1).view(np.uint32)
    if words.size < need:
        raise ValueError(f"mma scratch has {words.size} words per warp, needs {need} "
                         "(allocate SCRATCH_WORDS per warp)")
    # (the block check reads the simulator's cuda module, swapped in for this module's callers only)
    bd = cuda.blockDim if check_block else None
    if bd is not None and (bd.x * bd.y * bd.z) % 32:
        raise ValueError("mma needs whole warps: the block size must be a multiple of 32")
    key = words.__array_interface__["data"][0]
    calls = getattr(_LANE, "calls", None)
    if calls is None:
        calls = _LANE.calls = {}
    n = calls.get(key, 0)
    calls[key] = n + 1
    half = need // 2
    return words[(n & 1) * half:(n & 1) * half + half], key


def _f16_values(words):
    return words.view(np.float16).astype(np.float32)


def _bf16_values(words):
    halves = np.empty(2 * words.size, np.uint32)
    halves[0::2] = (words & np.uint32(0xFFFF)) << np.uint32(16)
    halves[1::2] = words & np.uint32(0xFFFF0000)
    return halves.view(np.float32)


def _sim_mma16816(a, b, c, scratch, lane, values):
    lane = int(lane)
    words, key = _sim_buffer(scratch, SIM_SCRATCH_WORDS_M16N8K16)
    for j in range(4):
        words[4 * lane + j] = a[j]
    for j in range(2):
        words[128 + 2 * lane + j] = b[j]
    _warp_sync(key)
    vals = values(words)
    g, t = lane >> 2, lane & 3
    out = []
    for i in range(4):
        row, col = g + 8 * (i >> 1), 2 * t + (i & 1)
        prod = np.dot(vals[_A16816[row]], vals[_B16816[:, col]])
        out.append(np.float32(np.float32(c[i]) + prod))
    return tuple(out)


def _sim_mma_m16n8k16_f16(a, b, c, scratch, lane):
    return _sim_mma16816(a, b, c, scratch, lane, _f16_values)


def _sim_mma_m16n8k16_bf16(a, b, c, scratch, lane):
    return _sim_mma16816(a, b, c, scratch, lane, _bf16_values)


def _sim_mma_m8n8k4_f16(a0, a1, b0, b1, c, scratch, lane):
    lane = int(lane)
    words, key = _sim_buffer(scratch, SIM_SCRATCH_WORDS_M8N8K4)
    words[2 * lane] = a0
    words[2 * lane + 1] = a1
    words[64 + 2 * lane] = b0
    words[64 + 2 * lane + 1] = b1
    _warp_sync(key)
    vals = _f16_values(words)
    q, hi = (lane >> 2) & 3, lane >> 4
    out = []
    for i in range(8):
        row = (lane & 1) + (i & 2) + 4 * hi
        col = (i & 4) + (lane & 2) + (i & 1)
        prod = np.dot(vals[_A884[q, row]], vals[_B884[q, :, col]])
        out.append(np.float32(np.float32(c[i]) + prod))
    return tuple(out)


def _sim_pack_f16x2(lo, hi):
    with np.errstate(over="ignore"):   # float32 beyond float16's range rounds to inf, as cvt.rn
        return np.array([lo, hi], dtype=np.float16).view(np.uint32)[0]


def _sim_pack_bf16x2(lo, hi):
    bits = np.array([lo, hi], dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = np.isnan(np.array([lo, hi], dtype=np.float32))
    # Round to nearest even on the 16 dropped bits; NaN stays a quiet NaN.
    r = (bits + np.uint64(0x7FFF) + ((bits >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
    r = np.where(nan, np.uint64(0x7FC0), r & np.uint64(0xFFFF))
    return np.uint32(int(r[0]) | (int(r[1]) << 16))


def _sim_unpack_f16x2(w):
    v = np.array([w], dtype=np.uint32).view(np.float16)
    return v[0], v[1]


def _sim_ex2_approx_ftz(x):
    with np.errstate(over="ignore"):
        y = np.float32(2.0) ** np.float32(x)
    return np.float32(0) if abs(y) < np.finfo(np.float32).tiny else y


def _sim_ld_global_nc_v4_u32(arr, idx):
    i = int(idx)
    return (np.uint32(arr[i]), np.uint32(arr[i + 1]), np.uint32(arr[i + 2]), np.uint32(arr[i + 3]))


def _pick(sim, gpu, doc):
    """The simulator stand-in (as a simulated device function) or the GPU intrinsic."""
    fn = cuda.jit(device=True)(sim) if SIMULATOR else gpu
    try:
        fn.__doc__ = doc
    except (AttributeError, TypeError):
        pass
    return fn


mma_m16n8k16_f16 = _pick(_sim_mma_m16n8k16_f16, _gpu_mma_m16n8k16_f16, """\
D = A @ B + C for one warp, m16n8k16, float16 A/B, float32 C/D (sm_80+).
a: UniTuple(uint32, 4), b: UniTuple(uint32, 2), c: UniTuple(float32, 4) -> UniTuple(float32, 4).
scratch: this warp's uint32 shared region (SCRATCH_WORDS); lane = threadIdx.x % 32.""")

mma_m16n8k16_bf16 = _pick(_sim_mma_m16n8k16_bf16, _gpu_mma_m16n8k16_bf16, """\
As mma_m16n8k16_f16 with bfloat16 A/B words (pack_bf16x2); sm_80+.""")

mma_m8n8k4_f16 = _pick(_sim_mma_m8n8k4_f16, _gpu_mma_m8n8k4_f16, """\
Four 8x8x4 products per warp (one per quad-pair), float16 A/B, float32 C/D (sm_70+).
a0, a1, b0, b1: uint32; c: UniTuple(float32, 8) -> UniTuple(float32, 8).""")

pack_f16x2 = _pick(_sim_pack_f16x2, _gpu_pack_f16x2, """\
uint32 holding float16(lo) in the low and float16(hi) in the high half. float16 arguments are
taken bit for bit; float32 (or int) arguments are rounded to nearest even.""")

pack_bf16x2 = _pick(_sim_pack_bf16x2, _gpu_pack_bf16x2, """\
uint32 holding bfloat16(lo) low, bfloat16(hi) high: bfloat16 arguments bit for bit, float32 (or
int) arguments rounded to nearest even (cvt.rn.bf16x2.f32, sm_80+).""")

unpack_f16x2 = _pick(_sim_unpack_f16x2, _gpu_unpack_f16x2, """\
(lo, hi) float16 halves of a uint32.""")

ex2_approx_ftz = _pick(_sim_ex2_approx_ftz, _gpu_ex2_approx_ftz, """\
2^x, float32, ~2 ulp; results (and inputs) below 2^-126 flushed to zero: one MUFU.EX2.""")

ld_global_nc_v4_u32 = _pick(_sim_ld_global_nc_v4_u32, _gpu_ld_global_nc_v4_u32, """\
arr[idx:idx+4] of a 1-D uint32 GLOBAL array as one 16-byte read-only load (ld.global.nc.v4.u32).
arr's data must be 16-byte aligned at idx (idx % 4 == 0 on an aligned buffer) and must not be
written during the kernel.""")


# ------------------------------------------------------------------------------------------------
# Fragment layouts (same code on both sides)
# ------------------------------------------------------------------------------------------------

@device_jit(forceinline=True)
def m16n8k16_a_pos(lane, j, h):
    """(row, col) of half h of A register j of this lane, m16n8k16 (uint32)."""
    g = uint32(lane) >> uint32(2)
    t = uint32(lane) & uint32(3)
    row = g + uint32(8) * (uint32(j) & uint32(1))
    col = uint32(2) * t + uint32(h) + uint32(8) * (uint32(j) >> uint32(1))
    return row, col


@device_jit(forceinline=True)
def m16n8k16_b_pos(lane, j, h):
    """(k, n) of half h of B register j of this lane, m16n8k16 (uint32)."""
    g = uint32(lane) >> uint32(2)
    t = uint32(lane) & uint32(3)
    return uint32(2) * t + uint32(h) + uint32(8) * uint32(j), g


@device_jit(forceinline=True)
def m16n8k16_c_pos(lane, i):
    """(row, col) of C/D element i (0..3) of this lane, m16n8k16 (uint32)."""
    g = uint32(lane) >> uint32(2)
    t = uint32(lane) & uint32(3)
    return g + uint32(8) * (uint32(i) >> uint32(1)), uint32(2) * t + (uint32(i) & uint32(1))


@device_jit(forceinline=True)
def m8n8k4_quadpair(lane):
    """Quad-pair q (0..3) of this lane: lanes 4q..4q+3 and 4q+16..4q+19 share one 8x8x4 product."""
    return (uint32(lane) >> uint32(2)) & uint32(3)


@device_jit(forceinline=True)
def m8n8k4_a_pos(lane, j, h):
    """(row, k) of half h of A register j (0..1) in this lane's quad-pair product (uint32)."""
    row = (uint32(lane) & uint32(3)) + uint32(4) * (uint32(lane) >> uint32(4))
    return row, uint32(2) * uint32(j) + uint32(h)


@device_jit(forceinline=True)
def m8n8k4_b_pos(lane, j, h):
    """(k, n) of half h of B register j (0..1) in this lane's quad-pair product (uint32)."""
    n = (uint32(lane) & uint32(3)) + uint32(4) * (uint32(lane) >> uint32(4))
    return uint32(2) * uint32(j) + uint32(h), n


@device_jit(forceinline=True)
def m8n8k4_c_pos(lane, i):
    """(row, col) of C/D element i (0..7) in this lane's quad-pair 8x8 product (uint32)."""
    ln = uint32(lane)
    ii = uint32(i)
    row = (ln & uint32(1)) + (ii & uint32(2)) + uint32(4) * (ln >> uint32(4))
    col = (ii & uint32(4)) + (ln & uint32(2)) + (ii & uint32(1))
    return row, col


# ------------------------------------------------------------------------------------------------
# Fragment loaders. ``s`` is any 2-D array (float16 taken bit for bit, float32 rounded); the
# ``_u32`` forms read a uint32 array whose word [x, kw] holds elements k = 2*kw (low), 2*kw + 1.
# No bounds checks: stage zero-padded tiles. In shared memory, a row stride of S words with
# S % 8 == 4 (e.g. 16 float16 + 8 padding = 12 words) makes the m16n8k16 _u32 loads conflict-free.
# ------------------------------------------------------------------------------------------------

@device_jit(forceinline=True)
def load_a_m16n8k16(s, r0, k0, lane):
    """A fragment of the 16x16 tile s[r0:r0+16, k0:k0+16] (s indexed [m, k])."""
    r = uint32(r0) + (uint32(lane) >> uint32(2))
    k = uint32(k0) + uint32(2) * (uint32(lane) & uint32(3))
    return (pack_f16x2(s[r, k], s[r, k + uint32(1)]),
            pack_f16x2(s[r + uint32(8), k], s[r + uint32(8), k + uint32(1)]),
            pack_f16x2(s[r, k + uint32(8)], s[r, k + uint32(9)]),
            pack_f16x2(s[r + uint32(8), k + uint32(8)], s[r + uint32(8), k + uint32(9)]))


@device_jit(forceinline=True)
def load_b_m16n8k16(s, k0, n0, lane):
    """B fragment of the 16x8 tile s[k0:k0+16, n0:n0+8] (s indexed [k, n], e.g. V rows)."""
    n = uint32(n0) + (uint32(lane) >> uint32(2))
    k = uint32(k0) + uint32(2) * (uint32(lane) & uint32(3))
    return (pack_f16x2(s[k, n], s[k + uint32(1), n]),
            pack_f16x2(s[k + uint32(8), n], s[k + uint32(9), n]))


@device_jit(forceinline=True)
def load_bt_m16n8k16(s, n0, k0, lane):
    """B fragment from B^T: s[n0:n0+8, k0:k0+16] (s indexed [n, k], e.g. K rows for Q @ K^T)."""
    n = uint32(n0) + (uint32(lane) >> uint32(2))
    k = uint32(k0) + uint32(2) * (uint32(lane) & uint32(3))
    return (pack_f16x2(s[n, k], s[n, k + uint32(1)]),
            pack_f16x2(s[n, k + uint32(8)], s[n, k + uint32(9)]))


@device_jit(forceinline=True)
def load_a_m16n8k16_u32(w, r0, kw0, lane):
    """A fragment from packed words: rows r0..r0+15, words kw0..kw0+7 (k0 = 2*kw0)."""
    r = uint32(r0) + (uint32(lane) >> uint32(2))
    kw = uint32(kw0) + (uint32(lane) & uint32(3))
    return (uint32(w[r, kw]), uint32(w[r + uint32(8), kw]),
            uint32(w[r, kw + uint32(4)]), uint32(w[r + uint32(8), kw + uint32(4)]))


@device_jit(forceinline=True)
def load_bt_m16n8k16_u32(w, n0, kw0, lane):
    """B fragment from packed B^T words: rows (n) n0..n0+7, words kw0..kw0+7."""
    n = uint32(n0) + (uint32(lane) >> uint32(2))
    kw = uint32(kw0) + (uint32(lane) & uint32(3))
    return uint32(w[n, kw]), uint32(w[n, kw + uint32(4)])


@device_jit(forceinline=True)
def load_a_m8n8k4(s, r0, k0, lane):
    """(a0, a1) of this lane's quad-pair: its 8x4 A is s[r0:r0+8, k0:k0+4] (r0 per quad-pair)."""
    r = uint32(r0) + (uint32(lane) & uint32(3)) + uint32(4) * (uint32(lane) >> uint32(4))
    k = uint32(k0)
    return (pack_f16x2(s[r, k], s[r, k + uint32(1)]),
            pack_f16x2(s[r, k + uint32(2)], s[r, k + uint32(3)]))


@device_jit(forceinline=True)
def load_b_m8n8k4(s, k0, n0, lane):
    """(b0, b1) of this lane's quad-pair: its 4x8 B is s[k0:k0+4, n0:n0+8] (s indexed [k, n])."""
    n = uint32(n0) + (uint32(lane) & uint32(3)) + uint32(4) * (uint32(lane) >> uint32(4))
    k = uint32(k0)
    return (pack_f16x2(s[k, n], s[k + uint32(1), n]),
            pack_f16x2(s[k + uint32(2), n], s[k + uint32(3), n]))


@device_jit(forceinline=True)
def load_bt_m8n8k4(s, n0, k0, lane):
    """(b0, b1) from B^T: this quad-pair's B is s[n0:n0+8, k0:k0+4] transposed (s indexed [n, k])."""
    n = uint32(n0) + (uint32(lane) & uint32(3)) + uint32(4) * (uint32(lane) >> uint32(4))
    k = uint32(k0)
    return (pack_f16x2(s[n, k], s[n, k + uint32(1)]),
            pack_f16x2(s[n, k + uint32(2)], s[n, k + uint32(3)]))


@device_jit(forceinline=True)
def load_a_m8n8k4_u32(w, r0, kw0, lane):
    """(a0, a1) from packed words: quad-pair rows r0..r0+7, words kw0, kw0+1 (k0 = 2*kw0)."""
    r = uint32(r0) + (uint32(lane) & uint32(3)) + uint32(4) * (uint32(lane) >> uint32(4))
    return uint32(w[r, uint32(kw0)]), uint32(w[r, uint32(kw0) + uint32(1)])


@device_jit(forceinline=True)
def load_bt_m8n8k4_u32(w, n0, kw0, lane):
    """(b0, b1) from packed B^T words: quad-pair rows (n) n0..n0+7, words kw0, kw0+1."""
    n = uint32(n0) + (uint32(lane) & uint32(3)) + uint32(4) * (uint32(lane) >> uint32(4))
    return uint32(w[n, uint32(kw0)]), uint32(w[n, uint32(kw0) + uint32(1)])


@device_jit(forceinline=True)
def store_c_m16n8k16(s, r0, c0, d, lane):
    """s[r0:r0+16, c0:c0+8] = the m16n8k16 accumulators d (cast to s's dtype)."""
    r = uint32(r0) + (uint32(lane) >> uint32(2))
    c = uint32(c0) + uint32(2) * (uint32(lane) & uint32(3))
    s[r, c] = d[0]
    s[r, c + uint32(1)] = d[1]
    s[r + uint32(8), c] = d[2]
    s[r + uint32(8), c + uint32(1)] = d[3]


@device_jit(forceinline=True)
def store_c_m8n8k4(s, r0, c0, d, lane):
    """s[r0:r0+8, c0:c0+8] = this lane's quad-pair accumulators d (r0, c0 per quad-pair)."""
    ln = uint32(lane)
    r = uint32(r0) + (ln & uint32(1)) + uint32(4) * (ln >> uint32(4))
    c = uint32(c0) + (ln & uint32(2))
    for i in range(8):
        ii = uint32(i)
        s[r + (ii & uint32(2)), c + (ii & uint32(4)) + (ii & uint32(1))] = d[i]


@device_jit(forceinline=True)
def c_pair_to_a_f16(d0, d1):
    """A fragment (float16) of a 16x16 tile held as two m16n8k16 accumulators: d0 its cols 0..7,
    d1 cols 8..15 (e.g. softmax P of two key tiles, then P @ V without leaving registers)."""
    return (pack_f16x2(d0[0], d0[1]), pack_f16x2(d0[2], d0[3]),
            pack_f16x2(d1[0], d1[1]), pack_f16x2(d1[2], d1[3]))


@device_jit(forceinline=True)
def c_pair_to_a_bf16(d0, d1):
    """As :func:`c_pair_to_a_f16`, rounding to bfloat16 (sm_80+)."""
    return (pack_bf16x2(d0[0], d0[1]), pack_bf16x2(d0[2], d0[3]),
            pack_bf16x2(d1[0], d1[1]), pack_bf16x2(d1[2], d1[3]))


# ------------------------------------------------------------------------------------------------
# Demo GEMM: the primitives end to end (tests, resource report, an example for kernel authors)
# ------------------------------------------------------------------------------------------------

DEMO_KINDS = ("m16n8k16", "m16n8k16_bf16", "m8n8k4")


@functools.lru_cache(maxsize=None)
def make_demo_gemm_kernel(kind, warps):
    """``C[M, N] = A[M, K] @ B[K, N]`` with float32 accumulation, one tile per warp.

    kind ``"m16n8k16"`` (float16 A/B, one 16x8 C tile per warp), ``"m16n8k16_bf16"`` (float32 A/B
    rounded to bfloat16 while staging, 16x8 tiles) or ``"m8n8k4"`` (float16, one 16x16 C tile per
    warp: quad-pair q computes rows 8*(q&1), cols 8*(q>>1)). ``warps`` warps per block, block
    ``32*warps`` threads, grid ``ceil(tiles / warps)``; every warp walks K in 16-deep steps (also
    warps without a tile, so all warps reach each mma together), staging a zero-padded A tile
    and B (or B^T for bf16) tile in its own shared memory. Shared memory per warp: m16n8k16 16x16 +
    16x8 float16 (768 B); bf16 16x8 + 8x8 uint32 words (768 B); m8n8k4 2 x 16x16 float16 (1 KiB);
    plus SCRATCH_WORDS uint32 (4 B on a GPU).
    """
    if kind not in DEMO_KINDS:
        raise ValueError(f"kind must be one of {DEMO_KINDS}, got {kind!r}")
    W = uint32(warps)
    U0, U1, U2, U4, U8, U16, U31 = (uint32(v) for v in (0, 1, 2, 4, 8, 16, 31))
    F0 = float32(0)

    if kind == "m16n8k16":
        def kernel(a, b, c):
            sa = cuda.shared.array((warps, 16, 16), float16)
            sb = cuda.shared.array((warps, 16, 8), float16)
            scr = cuda.shared.array((warps, SCRATCH_WORDS), uint32)
            tid = uint32(cuda.threadIdx.x)
            warp = tid >> uint32(5)
            lane = tid & U31
            m, kdim, n = uint32(a.shape[0]), uint32(a.shape[1]), uint32(b.shape[1])
            tiles_n = (n + U8 - U1) // U8
            tile = uint32(cuda.blockIdx.x) * W + warp
            r0 = (tile // tiles_n) * U16
            n0 = (tile % tiles_n) * U8
            acc = (F0, F0, F0, F0)
            for k0 in range(U0, kdim, U16):
                for e in range(lane, uint32(256), uint32(32)):
                    gr, gk = r0 + (e >> U4), k0 + (e & uint32(15))
                    v = float16(0)
                    if gr < m and gk < kdim:
                        v = a[gr, gk]
                    sa[warp, e >> U4, e & uint32(15)] = v
                for e in range(lane, uint32(128), uint32(32)):
                    gk, gn = k0 + (e >> uint32(3)), n0 + (e & uint32(7))
                    v = float16(0)
                    if gk < kdim and gn < n:
                        v = b[gk, gn]
                    sb[warp, e >> uint32(3), e & uint32(7)] = v
                cuda.syncthreads()
                fa = load_a_m16n8k16(sa[warp], U0, U0, lane)
                fb = load_b_m16n8k16(sb[warp], U0, U0, lane)
                acc = mma_m16n8k16_f16(fa, fb, acc, scr[warp], lane)
                cuda.syncthreads()
            for i in range(4):
                row, col = m16n8k16_c_pos(lane, i)
                if r0 + row < m and n0 + col < n:
                    c[r0 + row, n0 + col] = acc[i]

    elif kind == "m16n8k16_bf16":
        def kernel(a, b, c):
            wa = cuda.shared.array((warps, 16, 8), uint32)
            wb = cuda.shared.array((warps, 8, 8), uint32)
            scr = cuda.shared.array((warps, SCRATCH_WORDS), uint32)
            tid = uint32(cuda.threadIdx.x)
            warp = tid >> uint32(5)
            lane = tid & U31
            m, kdim, n = uint32(a.shape[0]), uint32(a.shape[1]), uint32(b.shape[1])
            tiles_n = (n + U8 - U1) // U8
            tile = uint32(cuda.blockIdx.x) * W + warp
            r0 = (tile // tiles_n) * U16
            n0 = (tile % tiles_n) * U8
            acc = (F0, F0, F0, F0)
            for k0 in range(U0, kdim, U16):
                for e in range(lane, uint32(128), uint32(32)):
                    r, kw = e >> uint32(3), e & uint32(7)
                    gr, gk = r0 + r, k0 + U2 * kw
                    lo = F0
                    hi = F0
                    if gr < m and gk < kdim:
                        lo = float32(a[gr, gk])
                    if gr < m and gk + U1 < kdim:
                        hi = float32(a[gr, gk + U1])
                    wa[warp, r, kw] = pack_bf16x2(lo, hi)
                for e in range(lane, uint32(64), uint32(32)):
                    nn, kw = e >> uint32(3), e & uint32(7)
                    gn, gk = n0 + nn, k0 + U2 * kw
                    lo = F0
                    hi = F0
                    if gn < n and gk < kdim:
                        lo = float32(b[gk, gn])
                    if gn < n and gk + U1 < kdim:
                        hi = float32(b[gk + U1, gn])
                    wb[warp, nn, kw] = pack_bf16x2(lo, hi)
                cuda.syncthreads()
                fa = load_a_m16n8k16_u32(wa[warp], U0, U0, lane)
                fb = load_bt_m16n8k16_u32(wb[warp], U0, U0, lane)
                acc = mma_m16n8k16_bf16(fa, fb, acc, scr[warp], lane)
                cuda.syncthreads()
            for i in range(4):
                row, col = m16n8k16_c_pos(lane, i)
                if r0 + row < m and n0 + col < n:
                    c[r0 + row, n0 + col] = acc[i]

    else:
        def kernel(a, b, c):
            sa = cuda.shared.array((warps, 16, 16), float16)
            sb = cuda.shared.array((warps, 16, 16), float16)
            scr = cuda.shared.array((warps, SCRATCH_WORDS), uint32)
            tid = uint32(cuda.threadIdx.x)
            warp = tid >> uint32(5)
            lane = tid & U31
            q = m8n8k4_quadpair(lane)
            qr = U8 * (q & U1)
            qn = U8 * (q >> U1)
            m, kdim, n = uint32(a.shape[0]), uint32(a.shape[1]), uint32(b.shape[1])
            tiles_n = (n + U16 - U1) // U16
            tile = uint32(cuda.blockIdx.x) * W + warp
            r0 = (tile // tiles_n) * U16
            n0 = (tile % tiles_n) * U16
            acc = (F0, F0, F0, F0, F0, F0, F0, F0)
            for k0 in range(U0, kdim, U16):
                for e in range(lane, uint32(256), uint32(32)):
                    x, y = e >> U4, e & uint32(15)
                    v = float16(0)
                    if r0 + x < m and k0 + y < kdim:
                        v = a[r0 + x, k0 + y]
                    sa[warp, x, y] = v
                    w = float16(0)
                    if k0 + x < kdim and n0 + y < n:
                        w = b[k0 + x, n0 + y]
                    sb[warp, x, y] = w
                cuda.syncthreads()
                for kk in range(U0, U16, U4):
                    a0, a1 = load_a_m8n8k4(sa[warp], qr, kk, lane)
                    b0, b1 = load_b_m8n8k4(sb[warp], kk, qn, lane)
                    acc = mma_m8n8k4_f16(a0, a1, b0, b1, acc, scr[warp], lane)
                cuda.syncthreads()
            for i in range(8):
                row, col = m8n8k4_c_pos(lane, i)
                gr, gc = r0 + qr + row, n0 + qn + col
                if gr < m and gc < n:
                    c[gr, gc] = acc[i]

    kernel.__name__ = f"demo_gemm_{kind}_w{warps}"
    kernel.__qualname__ = kernel.__name__
    return jit(kernel)


def demo_gemm(a, b, kind="m16n8k16", warps=4, stream=0):
    """Run the demo GEMM on host arrays a [M, K], b [K, N]; returns float32 C [M, N] on the host."""
    m, k = a.shape
    n = b.shape[1]
    tile_m, tile_n = (16, 16) if kind == "m8n8k4" else (16, 8)
    tiles = -(-m // tile_m) * -(-n // tile_n)
    blocks = max(1, -(-tiles // warps))
    dt = np.float32 if kind == "m16n8k16_bf16" else np.float16
    da = cuda.to_device(np.ascontiguousarray(a, dtype=dt), stream=stream)
    db = cuda.to_device(np.ascontiguousarray(b, dtype=dt), stream=stream)
    dc = cuda.to_device(np.full((m, n), np.nan, np.float32), stream=stream)
    make_demo_gemm_kernel(kind, warps)[blocks, 32 * warps, stream](da, db, dc)
    return dc.copy_to_host(stream=stream)


def _resource_cases():
    """The demo kernels (4 warps): m16n8k16 needs sm_80+, so it is built for sm_90 only."""
    cases = []
    for kind, dt, cc in (("m16n8k16", "float16", (9, 0)),
                         ("m16n8k16_bf16", "float32", (9, 0)),
                         ("m8n8k4", "float16", None)):
        k = make_demo_gemm_kernel(kind, 4)
        sig = f"void({dt}[:, ::1], {dt}[:, ::1], float32[:, ::1])"
        cases.append((f"mma_demo_{kind}", getattr(k, "py_func", k), sig, 128, 0, cc))
    return cases


RESOURCE_CASES = _resource_cases()
