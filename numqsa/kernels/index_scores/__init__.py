"""Index scores (spec §4): ``score[i, e] = sum_h relu(<qi[i, h], kc[e]>) / sqrt(Di)``, ``-inf``
past ``nb``.

Two routes over the same output ``scores [rows, num_groups]`` float32:

- light (:func:`make_light_scores_kernel`): shared-memory tiles, fp32 FMA. For decode and short
  work, and the fallback everywhere. A block keeps ``TR`` query rows (all heads) in shared memory
  and walks ``keys_per_block`` compressed keys in tiles of ``TK``.
- tiled (:func:`make_tiled_scores_kernel`): tensor cores (mma.sync m16n8k16 on sm_80+, m8n8k4 on
  sm_70, through :mod:`numqsa.kernels.mma`), float16 inputs -- or bfloat16 on sm_80+ (m16n8k16
  ``.bf16``) -- float32 accumulation, ReLU and head sum in the epilogue. Admitted by
  :func:`numqsa.plan.plan_select`. On sm_80+ with ``Hi <= 4`` the keys are the mma's M side
  (:func:`make_keysm_scores_kernel`), and small blocks (:func:`direct_route`: a few rows) take
  :func:`make_direct_scores_kernel`, whose warps load their operands straight into registers;
  the two compute every score bitwise alike.

bfloat16 arrays reach the kernels as uint16 bit views (:func:`numqsa.kernels.common.bits16`); the
light kernel converts them element by element (any architecture), the tensor-core kernels feed the
bits to ``mma ... .bf16`` unchanged (sm_80+; on sm_70 bfloat16 scores take the light route).

Rows of one tile may belong to different requests (varlen batches): a block runs one pass per
distinct request among its rows, staging that request's keys; almost always there is one pass.
A page id outside ``[0, num_idx_pages)`` (the public API rejects those before launch) is never read:
its keys load as zeros.

Non-finite inputs propagate as the float64 math does (the oracle's contract): ReLU is
:func:`relu`, which keeps NaN, not ``max(x, 0)`` -- numba lowers a float ``max`` to ``fmaxf`` on a
GPU, which returns the non-NaN operand (the simulator's Python ``max`` keeps it: the two disagreed).

One module per kernel family, each with its own page of where it runs and the measurement that
chose it; this package re-exports what callers use, so ``index_scores.launch_tiled`` and the rest
keep their names:

- :mod:`.light`: the light kernel and :func:`launch_light`;
- :mod:`.tiled`: :func:`tiled_supported`, :func:`launch_tiled` (the tensor-core route's entry) and
  the per-warp-M kernel (sm_70 m8n8k4; sm_80+ m16n8k16 for ``Hi`` 8, 16);
- :mod:`.keysm`: the shared-memory keys-as-M kernel, :func:`keysm_supported`, :func:`launch_keysm`;
- :mod:`.direct`: the direct keys-as-M kernel and :func:`direct_route`;
- :mod:`.common`: what several of them share (:func:`relu`, the block's request passes, the
  keys-as-M word readers and per-head mma).

``RESOURCE_CASES`` (read from this package by :mod:`numqsa.resources`) stays here, in the report's
order.
"""
from .common import KEYSM_HEADS, NEG_INF, light_keys_per_block, relu
from .direct import DIRECT_ROWS, DIRECT_SCORES, direct_route, make_direct_scores_kernel
from .keysm import (KEYSM_SPAN_TILES, keysm_supported, launch_keysm, make_keysm_scores_kernel,
                    word_view)
from .light import launch_light, make_light_scores_kernel
from .tiled import TILED_HEADS, launch_tiled, make_tiled_scores_kernel, tiled_supported

__all__ = [
    "relu", "NEG_INF", "light_keys_per_block",
    "make_light_scores_kernel", "launch_light",
    "TILED_HEADS", "tiled_supported", "make_tiled_scores_kernel", "launch_tiled",
    "KEYSM_HEADS", "KEYSM_SPAN_TILES", "word_view", "make_keysm_scores_kernel", "keysm_supported",
    "launch_keysm",
    "DIRECT_ROWS", "DIRECT_SCORES", "direct_route", "make_direct_scores_kernel",
    "RESOURCE_CASES",
]


def _light_case(dtype, hi=4, di=128, r=4):
    k = make_light_scores_kernel(hi, di, r)
    sig = (f"void({dtype}[:, :, :], {dtype}[:, :, :], int32[:, :], int32[:], int32[:], int32[:], "
           f"int32, float32[:, :])")
    return k, sig, k.threads


RESOURCE_CASES = []
for _dt in ("float16", "float32"):
    _k, _sig, _nt = _light_case(_dt)
    for _cc in ((7, 0), (9, 0)):
        RESOURCE_CASES.append((f"index_scores.light.{_dt}", _k, _sig, _nt, 0, _cc))
for _kind, _ccs in (("m16n8k16", ((9, 0),)), ("m8n8k4", ((7, 0), (9, 0)))):
    _k = make_tiled_scores_kernel(_kind, 4, 128, 4)
    _sig = ("void(float16[:, :, :], float16[:, :, :], int32[:, :], int32[:], int32[:], int32[:], "
            "int32, float32[:, :])")
    for _cc in _ccs:
        RESOURCE_CASES.append((f"index_scores.tiled.{_kind}", _k, _sig, _k.threads, 0, _cc))
for _words in (True, False):
    _k = make_keysm_scores_kernel(4, 128, 4, _words)
    _t = "uint32" if _words else "float16"
    _sig = (f"void({_t}[:, :, :], {_t}[:, :, :], uint32[:], int32[:, :], int32[:], int32[:], "
            "int32[:], int32, float32[:, :])")
    RESOURCE_CASES.append((f"index_scores.keysm.{_t}", _k, _sig, _k.threads, 0, (9, 0)))
    _k = make_direct_scores_kernel(4, 128, 4, _words, tiles=2 if _words else 1)   # as launched
    _dsig = _sig.replace("int32[:], int32, float32", "int32[:], float32")
    RESOURCE_CASES.append((f"index_scores.direct.{_t}", _k, _dsig, _k.threads, 0, (9, 0)))
# bfloat16 (uint16 bit arrays): light on every architecture, tensor cores on sm_80+
_BF = ("void(uint16[:, :, :], uint16[:, :, :], int32[:, :], int32[:], int32[:], int32[:], int32, "
       "float32[:, :])")
_k = make_light_scores_kernel(4, 128, 4, True, True)
for _cc in ((7, 0), (9, 0)):
    RESOURCE_CASES.append(("index_scores.light.bf16", _k, _BF, _k.threads, 0, _cc))
_k = make_tiled_scores_kernel("m16n8k16", 8, 128, 4, True)
RESOURCE_CASES.append(("index_scores.tiled.m16n8k16.bf16", _k, _BF, _k.threads, 0, (9, 0)))
for _words in (True, False):
    _k = make_keysm_scores_kernel(4, 128, 4, _words, bf16=True)
    _sig = _BF.replace("uint16", "uint32") if _words else _BF
    _sig = _sig.replace("int32[:, :], int32[:]", "uint32[:], int32[:, :], int32[:]", 1)
    RESOURCE_CASES.append((f"index_scores.keysm.bf16.{'uint32' if _words else 'uint16'}", _k, _sig,
                           _k.threads, 0, (9, 0)))
