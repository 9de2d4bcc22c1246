"""Shared-memory data movement for tensor-core kernels: one source for the GPU and the simulator.

Shared memory is addressed by 32-bit byte addresses in the shared window: ``shared_base(arr)`` is
that of ``arr[0]`` (0 in the simulator, where an address is a byte offset into ``arr``), so index
arithmetic stays 32-bit. ``ld_shared_i32(arr, addr)`` loads the int32 at such an address of
``arr`` (an array's own indexing forms its generic address again at every load).

- ``cp_async_16(dst, daddr, src, si, nbytes)``: copy 16 bytes ``src[si:si+4]`` (global, uint32
  words) to shared address ``daddr`` (in the array ``dst``) asynchronously (``cp.async.cg``, sm_80+, bypasses L1);
  ``nbytes`` 0 writes zeros and reads nothing. ``cp_async_commit()`` closes a group;
  ``cp_async_wait(n)`` (``n`` a compile-time constant, see :func:`cp_async_wait_fn`) waits until at
  most ``n`` groups are in flight. A ``syncthreads`` after the wait makes the data visible block-wide.
- ``ldmatrix_x4(arr, addr, scratch, lane)`` / ``ldmatrix_x4_trans``: four 8x8 b16 matrices from
  shared memory (``ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16``, sm_75+). Lane ``l`` gives
  the address of row ``l % 8`` of matrix ``l // 8`` (16 contiguous bytes); lane ``4g + t``
  receives word ``i`` = row ``g``, halves ``2t, 2t+1`` of matrix ``i`` (``.trans``: the transposed
  matrix, i.e. the halves at column ``g`` of rows ``2t`` and ``2t + 1``).
- ``movmatrix_trans(w, scratch, lane)``: the warp's 8x8 b16 matrix (lane ``4g + t`` holding row ``g``,
  columns ``2t, 2t+1``) transposed in registers (``movmatrix.sync.aligned.m8n8.trans.b16``, sm_75+).
- ``shfl_xor_f32(x, mask, scratch, lane)``: ``x`` of lane ``lane ^ mask``.
- ``warp_any(pred, scratch, lane)``: whether ``pred`` holds in any lane of the warp (``vote.any``).
- mbarriers (sm_80+), ``bar`` a shared ``uint64`` array, or ``mbar_ref(bar)`` (its shared address,
  formed once: each call is then an add where the array's generic address is converted again),
  and ``i`` the barrier's index in it:
  ``mbar_init(bar, i, count)`` (one thread, then a ``syncthreads``); ``mbar_test_wait(bar, i,
  parity)``: whether the phase of that parity has completed (``mbarrier.test_wait.parity``: the
  n-th phase, counted from 0, has parity ``n & 1``; loop on it to wait); ``mbar_try_wait`` the same
  but the thread sleeps until the phase completes or a time limit passes (sm_90, ``try_wait``);
  ``mbar_arrive(bar, i)``: this thread's arrival (release: its earlier shared-memory reads and
  writes come first); ``cp_async_mbar_arrive(bar, i)``: one arrival when this thread's earlier
  cp.async copies have landed (``cp.async.mbarrier.arrive.noinc``: ``count`` at init includes
  these arrivals).

Simulator stand-ins: the copies are synchronous; the warp-wide ones exchange through the warp's mma
scratch row with the mma module's per-warp barrier, so (as for the mma stand-ins) all 32 lanes of a
warp call them together and different warps may make different numbers of calls.

Architectures: ``cp.async`` and mbarriers sm_80+, ``ldmatrix`` / ``movmatrix`` sm_75+, ``try_wait``
sm_90; its users are sm_80+ kernels only: the keys-as-M index scores
(:mod:`numqsa.kernels.index_scores.keysm`) and the grouped attention
(:mod:`numqsa.kernels.grouped`).
"""
import functools
import threading

import numpy as np
from llvmlite import ir
from numba import cuda
from numba.cuda import cgutils, types
from numba.cuda.extending import intrinsic

from ..jit import SIMULATOR, device_jit
from .mma import SIM_SCRATCH_WORDS_M16N8K16, _pick, _sim_buffer, _warp_sync

__all__ = ["shared_base", "ld_shared_i32", "cp_async_16", "cp_async_commit", "cp_async_wait_fn", "ldmatrix_x4",
           "ldmatrix_x4_trans", "movmatrix_trans", "shfl_xor_f32", "warp_any", "mbar_ref", "mbar_init",
           "mbar_test_wait", "mbar_try_wait", "mbar_arrive", "cp_async_mbar_arrive", "grid_dep_wait", "grid_dep_launch"]

# Every stand-in exchanges through halves of the same size as the m16n8k16 stand-in, so calls of
# either kind may alternate on one scratch row (see mma._sim_buffer).
_NEED = SIM_SCRATCH_WORDS_M16N8K16


def _ptr(context, builder, arrty, arr, idx, idxty):
    ary = context.make_array(arrty)(context, builder, value=arr)
    index = context.cast(builder, idx, idxty, types.intp)
    return cgutils.get_item_pointer(context, builder, arrty, ary, [index], wraparound=False)


def _u32_array(ty):
    return isinstance(ty, types.Array) and ty.dtype == types.uint32 and ty.ndim == 1


def _u64_array(ty):
    return isinstance(ty, types.Array) and ty.dtype == types.uint64 and ty.ndim == 1


def _i32_array(ty):
    return isinstance(ty, types.Array) and ty.dtype == types.int32 and ty.ndim == 1


@intrinsic
def _gpu_cp_async_16(typingctx, dst, daddr, src, si, nbytes):
    if not (_u32_array(dst) and _u32_array(src) and all(isinstance(t, types.Integer)
                                                        for t in (daddr, si, nbytes))):
        return None
    sig = types.void(dst, daddr, src, si, nbytes)

    def codegen(context, builder, sig, args):
        d = context.cast(builder, args[1], sig.args[1], types.uint32)
        ps = _ptr(context, builder, sig.args[2], args[2], args[3], sig.args[3])
        n = context.cast(builder, args[4], sig.args[4], types.uint32)
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i32, ps.type, i32])
        asm = ir.InlineAsm(fnty, "{ .reg .u64 s; cvta.to.global.u64 s, $1; "
                                 "cp.async.cg.shared.global [$0], [s], 16, $2; }",
                           "r,l,r,~{memory}", side_effect=True)
        builder.call(asm, [d, ps, n])
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def _gpu_shared_base(typingctx, arr):
    if not (_u32_array(arr) or _u64_array(arr) or _i32_array(arr)):
        return None
    sig = types.uint32(arr)

    def codegen(context, builder, sig, args):
        p = _ptr(context, builder, sig.args[0], args[0], context.get_constant(types.intp, 0),
                 types.intp)
        asm = ir.InlineAsm(ir.FunctionType(ir.IntType(32), [p.type]),
                           "{ .reg .u64 a; cvta.to.shared.u64 a, $1; cvt.u32.u64 $0, a; }", "=r,l")
        return builder.call(asm, [p])
    return sig, codegen


@intrinsic
def _gpu_ld_shared_i32(typingctx, arr, addr):
    if not (_i32_array(arr) and isinstance(addr, types.Integer)):
        return None
    sig = types.int32(arr, addr)

    def codegen(context, builder, sig, args):
        a = context.cast(builder, args[1], sig.args[1], types.uint32)
        i32 = ir.IntType(32)
        asm = ir.InlineAsm(ir.FunctionType(i32, [i32]), "ld.shared.b32 $0, [$1];", "=r,r",
                           side_effect=True)
        return builder.call(asm, [a])
    return sig, codegen


def _void_asm(name, text):
    """An intrinsic ``name()`` running the PTX ``text`` (a memory clobber: no access moves across)."""
    def typer(typingctx):
        sig = types.void()

        def codegen(context, builder, sig, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, "~{memory}",
                               side_effect=True)
            builder.call(asm, [])
            return context.get_dummy_value()
        return sig, codegen
    typer.__name__ = name
    return intrinsic(typer)


_gpu_cp_async_commit = _void_asm("cp_async_commit", "cp.async.commit_group;")


@functools.lru_cache(maxsize=None)
def _gpu_cp_async_wait(n):
    return _void_asm(f"cp_async_wait_{int(n)}", f"cp.async.wait_group {int(n)};")


# programmatic dependent launch (sm_90): a kernel launched programmatically behind another may
# start while that one runs; ``griddepcontrol.wait`` returns once it has completed and its memory
# is visible (at once when the kernel was launched in stream order); ``launch_dependents`` lets the
# dependent launch once every block of this grid has issued it or exited
_gpu_grid_dep_wait = _void_asm("grid_dep_wait", "griddepcontrol.wait;")
_gpu_grid_dep_launch = _void_asm("grid_dep_launch", "griddepcontrol.launch_dependents;")


def _make_ldmatrix(trans):
    text = (f"ldmatrix.sync.aligned.m8n8.x4{'.trans' if trans else ''}.shared.b16 "
            "{$0,$1,$2,$3}, [$4];")

    def typer(typingctx, arr, addr, scratch, lane):
        if not (_u32_array(arr) and isinstance(addr, types.Integer)):
            return None
        ret = types.UniTuple(types.uint32, 4)
        sig = ret(arr, addr, scratch, lane)

        def codegen(context, builder, sig, args):
            a = context.cast(builder, args[1], sig.args[1], types.uint32)
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(ir.LiteralStructType([i32] * 4), [i32])
            res = builder.call(ir.InlineAsm(fnty, text, "=r,=r,=r,=r,r", side_effect=True), [a])
            return context.make_tuple(builder, sig.return_type,
                                      [builder.extract_value(res, i) for i in range(4)])
        return sig, codegen
    typer.__name__ = "ldmatrix_x4_trans" if trans else "ldmatrix_x4"
    return intrinsic(typer)


_gpu_ldmatrix_x4 = _make_ldmatrix(False)
_gpu_ldmatrix_x4_trans = _make_ldmatrix(True)


@intrinsic
def _gpu_movmatrix_trans(typingctx, w, scratch, lane):
    if not isinstance(w, types.Integer):
        return None
    sig = types.uint32(w, scratch, lane)

    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[0], sig.args[0], types.uint32)
        i32 = ir.IntType(32)
        asm = ir.InlineAsm(ir.FunctionType(i32, [i32]),
                           "movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r")
        return builder.call(asm, [v])
    return sig, codegen


def _gpu_shfl_xor_f32(x, mask, scratch, lane):
    return cuda.shfl_xor_sync(0xFFFFFFFF, x, mask)


def _gpu_warp_any(pred, scratch, lane):
    return cuda.any_sync(0xFFFFFFFF, pred)


def _mbar_asm(name, body, with_value, returns):
    """An intrinsic ``name(bar, i[, v])`` running the PTX ``body`` with ``a`` the 32-bit shared
    address of mbarrier ``i`` of ``bar`` (a shared ``uint64`` array, or :func:`mbar_ref`'s address of
    one: then ``a`` is integer arithmetic that the compiler keeps and reuses, where an array's
    generic address is converted in every call), ``$v`` the uint32 operand ``v`` and ``$r`` the
    int32 result (if ``returns``)."""
    first = 1 if returns else 0
    text = body.replace("$r", "$0").replace("$v", f"${first + 1}")
    decl = "{ .reg .u64 ga; .reg .u32 a; .reg .pred p; .reg .b64 st; "
    text_arr = f"{decl}cvta.to.shared.u64 ga, ${first}; cvt.u32.u64 a, ga; {text} }}"
    text_ref = f"{decl}mov.u32 a, ${first}; {text} }}"

    def build(sig, context, builder, args):
        i32 = ir.IntType(32)
        if isinstance(sig.args[0], types.Integer):
            base = context.cast(builder, args[0], sig.args[0], types.uint32)
            idx = context.cast(builder, args[1], sig.args[1], types.uint32)
            p = builder.add(base, builder.mul(idx, ir.Constant(i32, 8)))
            text, kind = text_ref, "r"
        else:
            p = _ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            text, kind = text_arr, "l"
        ops = [p] + ([context.cast(builder, args[2], sig.args[2], types.uint32)] if with_value else [])
        cons = ",".join((["=r"] if returns else []) + [kind] + (["r"] if with_value else [])
                        + ["~{memory}"])
        fnty = ir.FunctionType(i32 if returns else ir.VoidType(), [x.type for x in ops])
        res = builder.call(ir.InlineAsm(fnty, text, cons, side_effect=True), ops)
        return res if returns else context.get_dummy_value()

    def _bar(ty):
        return _u64_array(ty) or isinstance(ty, types.Integer)

    ret = types.int32 if returns else types.void
    if with_value:
        def typer(typingctx, bar, i, v):
            if not (_bar(bar) and isinstance(i, types.Integer) and isinstance(v, types.Integer)):
                return None
            return ret(bar, i, v), lambda c, b, sig, args: build(sig, c, b, args)
    else:
        def typer(typingctx, bar, i):
            if not (_bar(bar) and isinstance(i, types.Integer)):
                return None
            return ret(bar, i), lambda c, b, sig, args: build(sig, c, b, args)
    typer.__name__ = name
    return intrinsic(typer)


_gpu_mbar_init = _mbar_asm("mbar_init", "mbarrier.init.shared.b64 [a], $v;", True, False)
_gpu_mbar_test_wait = _mbar_asm("mbar_test_wait", "mbarrier.test_wait.parity.shared.b64 p, [a], $v; "
                                "selp.u32 $r, 1, 0, p;", True, True)
_gpu_mbar_try_wait = _mbar_asm("mbar_try_wait", "mbarrier.try_wait.parity.shared.b64 p, [a], $v; "
                               "selp.u32 $r, 1, 0, p;", True, True)
_gpu_mbar_arrive = _mbar_asm("mbar_arrive", "mbarrier.arrive.shared.b64 st, [a];", False, False)
_gpu_cp_async_mbar_arrive = _mbar_asm("cp_async_mbar_arrive",
                                      "cp.async.mbarrier.arrive.noinc.shared.b64 [a];", False, False)


# ------------------------------------------------------------------------------------------------
# Simulator stand-ins
# ------------------------------------------------------------------------------------------------

def _sim_cp_async_16(dst, daddr, src, si, nbytes):
    di, si = int(daddr) // 4, int(si)
    for x in range(4):
        dst[di + x] = np.uint32(src[si + x]) if int(nbytes) else np.uint32(0)


def _sim_cp_async_commit():
    pass


def _sim_grid_dep():
    """The simulator launches in stream order: a dependency has completed before the kernel starts."""
    pass


def _sim_cp_async_wait(n):
    def wait():
        pass
    return wait


def _sim_exchange(scratch, lane, words_of_lane):
    """Write this lane's words, wait for the warp, return (all lanes' words [32, k])."""
    buf, key = _sim_buffer(scratch, _NEED, check_block=False)
    k = len(words_of_lane)
    for x in range(k):
        buf[k * lane + x] = np.uint32(words_of_lane[x])
    _warp_sync(key)
    return np.array(buf[:32 * k]).reshape(32, k)


def _sim_shared_base(arr):
    return np.uint32(0)


def _sim_ld_shared_i32(arr, addr):
    return np.int32(arr[int(addr) // 4])


def _sim_ldmatrix(arr, addr, scratch, lane, trans):
    lane = int(lane)
    rows = _sim_exchange(scratch, lane, [int(addr) // 4])[:, 0]     # row word index per lane
    g, t = lane >> 2, lane & 3
    out = []
    for i in range(4):
        if not trans:
            out.append(np.uint32(arr[int(rows[8 * i + g]) + t]))
        else:
            lo = int(arr[int(rows[8 * i + 2 * t]) + (g >> 1)])
            hi = int(arr[int(rows[8 * i + 2 * t + 1]) + (g >> 1)])
            sh = 16 * (g & 1)
            out.append(np.uint32(((lo >> sh) & 0xFFFF) | (((hi >> sh) & 0xFFFF) << 16)))
    return tuple(out)


def _sim_ldmatrix_x4(arr, idx, scratch, lane):
    return _sim_ldmatrix(arr, idx, scratch, lane, False)


def _sim_ldmatrix_x4_trans(arr, idx, scratch, lane):
    return _sim_ldmatrix(arr, idx, scratch, lane, True)


def _sim_movmatrix_trans(w, scratch, lane):
    lane = int(lane)
    words = _sim_exchange(scratch, lane, [int(w)])[:, 0]
    g, t = lane >> 2, lane & 3
    sh = 16 * (g & 1)
    lo = (int(words[4 * (2 * t) + (g >> 1)]) >> sh) & 0xFFFF
    hi = (int(words[4 * (2 * t + 1) + (g >> 1)]) >> sh) & 0xFFFF
    return np.uint32(lo | (hi << 16))


def _sim_shfl_xor_f32(x, mask, scratch, lane):
    lane = int(lane)
    words = _sim_exchange(scratch, lane, [np.float32(x).view(np.uint32)])[:, 0]
    return np.uint32(words[lane ^ int(mask)]).view(np.float32)


def _sim_warp_any(pred, scratch, lane):
    words = _sim_exchange(scratch, int(lane), [1 if pred else 0])[:, 0]
    return bool(words.any())


# An mbarrier of the simulator: [completed phases, pending arrivals, count] beside the array word
# (which mirrors the completed phases). Threads of a simulated block are Python threads: a thread
# whose phase has not completed sleeps until an arrival (or 10 ms) instead of spinning on the GIL.
_MBAR_LOCK = threading.Condition()
_MBAR = {}


def _mbar_key(bar, i):
    return (np.asarray(bar).__array_interface__["data"][0], int(i))


def _sim_mbar_ref(bar):
    return bar                                     # the stand-ins key on the array


def _sim_mbar_init(bar, i, count):
    with _MBAR_LOCK:
        _MBAR[_mbar_key(bar, i)] = [0, int(count), int(count)]
        bar[i] = np.uint64(0)


def _sim_mbar_arrive(bar, i):
    with _MBAR_LOCK:
        st = _MBAR[_mbar_key(bar, i)]
        st[1] -= 1
        if st[1] == 0:
            st[0], st[1] = st[0] + 1, st[2]
            bar[i] = np.uint64(st[0])
            _MBAR_LOCK.notify_all()


def _sim_mbar_test_wait(bar, i, parity):
    with _MBAR_LOCK:
        st = _MBAR[_mbar_key(bar, i)]
        done = (st[0] & 1) != (int(parity) & 1)
        if not done:
            _MBAR_LOCK.wait(0.01)
            done = (st[0] & 1) != (int(parity) & 1)
    return 1 if done else 0


def _sim_cp_async_mbar_arrive(bar, i):
    _sim_mbar_arrive(bar, i)                       # the simulator's copies are synchronous


cp_async_16 = _pick(_sim_cp_async_16, _gpu_cp_async_16, "16-byte async global->shared copy.")
shared_base = _pick(_sim_shared_base, _gpu_shared_base,
                    "Shared-window byte address of a shared uint32, int32 or uint64 array (0 in the "
                    "simulator).")
ld_shared_i32 = _pick(_sim_ld_shared_i32, _gpu_ld_shared_i32,
                      "The int32 at shared address ``addr`` of the shared int32 array ``arr``.")
cp_async_commit = _pick(_sim_cp_async_commit, _gpu_cp_async_commit, "Close a cp.async group.")
grid_dep_wait = _pick(_sim_grid_dep, _gpu_grid_dep_wait,
                      "Until the grid this one depends on has completed (sm_90, programmatic launch).")
grid_dep_launch = _pick(_sim_grid_dep, _gpu_grid_dep_launch,
                        "Let the dependent grid launch (sm_90, programmatic launch).")
ldmatrix_x4 = _pick(_sim_ldmatrix_x4, _gpu_ldmatrix_x4, "Four 8x8 b16 matrices from shared.")
ldmatrix_x4_trans = _pick(_sim_ldmatrix_x4_trans, _gpu_ldmatrix_x4_trans,
                          "Four transposed 8x8 b16 matrices from shared.")
movmatrix_trans = _pick(_sim_movmatrix_trans, _gpu_movmatrix_trans, "8x8 b16 transpose in registers.")
shfl_xor_f32 = (cuda.jit(device=True)(_sim_shfl_xor_f32) if SIMULATOR
                else device_jit(_gpu_shfl_xor_f32, forceinline=True))
warp_any = (cuda.jit(device=True)(_sim_warp_any) if SIMULATOR
            else device_jit(_gpu_warp_any, forceinline=True))

mbar_ref = _pick(_sim_mbar_ref, _gpu_shared_base,
                 "What the mbarrier calls take for ``bar``: its shared address (the array itself in "
                 "the simulator).")
mbar_init = _pick(_sim_mbar_init, _gpu_mbar_init, "Initialise mbarrier ``bar[i]`` for ``count`` arrivals.")
mbar_test_wait = _pick(_sim_mbar_test_wait, _gpu_mbar_test_wait,
                       "1 if the phase of ``parity`` of mbarrier ``bar[i]`` has completed, else 0.")
mbar_try_wait = _pick(_sim_mbar_test_wait, _gpu_mbar_try_wait,
                      "mbar_test_wait that first suspends the thread for a while (sm_90+).")
cp_async_mbar_arrive = _pick(_sim_cp_async_mbar_arrive, _gpu_cp_async_mbar_arrive,
                             "Arrive on ``bar[i]`` when this thread's earlier cp.async copies land.")
mbar_arrive = _pick(_sim_mbar_arrive, _gpu_mbar_arrive, "This thread's arrival on mbarrier ``bar[i]``.")


@functools.lru_cache(maxsize=None)
def cp_async_wait_fn(n):
    """A device function waiting until at most ``n`` (a Python int) cp.async groups are pending."""
    if SIMULATOR:
        return cuda.jit(device=True)(_sim_cp_async_wait(n))
    return _gpu_cp_async_wait(int(n))
