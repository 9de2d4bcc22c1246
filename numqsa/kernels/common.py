"""Device helpers shared by every stage: the batch description of spec §1 read on the device, and
bfloat16 element conversions.

Every route uses them on every architecture, sm_70 included (the bfloat16 conversions are integer
arithmetic); no kernel of its own, so no route to choose.
"""
import numpy as np
from llvmlite import ir
from numba import cuda, float32, int32, uint32
from numba.cuda import types
from numba.cuda.extending import intrinsic

from ..device import is_bf16
from ..jit import SIMULATOR, device_jit


@device_jit
def row_state(i, req_ids, positions, seq_lens, r):
    """Spec §1/§4 for query row ``i``: ``(req, p, nb)``.

    ``req`` is -1 for an inert row (request id out of range, negative position, empty request);
    ``p`` is the clamped position and ``nb`` the number of visible complete groups
    ``min((p + 1) // r, seq_len // r)``. Inert rows return ``(-1, -1, 0)``.
    """
    req = int32(req_ids[i])
    pos = int32(positions[i])
    if req < int32(0) or req >= int32(seq_lens.shape[0]) or pos < int32(0):
        return int32(-1), int32(-1), int32(0)
    slen = int32(seq_lens[req])
    if slen <= int32(0):
        return int32(-1), int32(-1), int32(0)
    p = min(pos, slen - int32(1))
    nb = min((p + int32(1)) // int32(r), slen // int32(r))
    return req, p, nb


# ------------------------------------------------------------------------------------------------
# bfloat16 as 16-bit words. numba has no bfloat16 array type: the launchers pass bfloat16 arrays
# as uint16 views (:func:`bits16`) and kernels convert element by element. Both directions are plain
# integer and bit-cast arithmetic, so they build for sm_70 too (the FMA routes take bfloat16 there).
# ------------------------------------------------------------------------------------------------

@intrinsic
def _gpu_bits_as_f32(typingctx, w):
    if not isinstance(w, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[0], sig.args[0], types.uint32)
        return builder.bitcast(v, ir.FloatType())
    return types.float32(w), codegen


@intrinsic
def _gpu_f32_as_bits(typingctx, x):
    if not isinstance(x, (types.Float, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[0], sig.args[0], types.float32)
        return builder.bitcast(v, ir.IntType(32))
    return types.uint32(x), codegen


def _sim_bits_as_f32(w):
    return np.array([int(w) & 0xFFFFFFFF], np.uint32).view(np.float32)[0]


def _sim_f32_as_bits(x):
    return np.array([x], np.float32).view(np.uint32)[0]


bits_as_f32 = cuda.jit(device=True)(_sim_bits_as_f32) if SIMULATOR else _gpu_bits_as_f32
f32_as_bits = cuda.jit(device=True)(_sim_f32_as_bits) if SIMULATOR else _gpu_f32_as_bits


@device_jit(forceinline=True)
def bf16_to_f32(h):
    """float32 value of the bfloat16 bits ``h`` (uint16/int16/uint32: the low 16 bits), exact."""
    return bits_as_f32((uint32(h) & uint32(0xFFFF)) << uint32(16))


@device_jit(forceinline=True)
def f32_to_bf16(x):
    """bfloat16 bits (uint32, low half) of float32 ``x``, round to nearest even; NaN stays NaN
    (0x7FC0, the quiet NaN), overflow rounds to inf, as ``cvt.rn.bf16.f32`` and ml_dtypes do."""
    b = f32_as_bits(x)
    if (b & uint32(0x7FFFFFFF)) > uint32(0x7F800000):
        return uint32(0x7FC0) | ((b >> uint32(16)) & uint32(0x8000))
    return (b + uint32(0x7FFF) + ((b >> uint32(16)) & uint32(1))) >> uint32(16)


@device_jit(forceinline=True)
def _as_f32(x):
    return float32(x)


@device_jit(forceinline=True)
def _keep(x):
    return x


def loader(bf16):
    """Element -> float32: bfloat16 bits (a uint16 view) when ``bf16``, else a plain conversion."""
    return bf16_to_f32 if bf16 else _as_f32


def storer(bf16):
    """float32 -> stored element: bfloat16 bits when ``bf16``, else the value (the array's own
    dtype conversion on store, as before)."""
    return f32_to_bf16 if bf16 else _keep


def bits16(a):
    """A uint16 view of a bfloat16 device array (no copy); other arrays are returned as they are."""
    return a.view(np.uint16) if is_bf16(a) else a
