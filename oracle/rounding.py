"""Engines' rounding chains (spec §3), on request beside the float64 truth.

The float64 oracle defines QSA; an engine computes it in its storage dtype, rounding at points of its
own. Reproducing those points tells a rounding difference from a bug: run the oracle with
``rounding="hf-bf16"`` and HF's bf16 selection must match it on every row but ties. A chain is
``"<engine>-<dtype>"``, engine ``hf`` or ``trtllm``, dtype ``bf16``, ``fp16`` or ``fp32``:

- ``hf`` (transformers 5.17, ``Qwen4ExpTextQSAIndexer`` and eager attention): RoPE tables from
  float32 angles (``inv_freq = 1 / theta ** (arange(0, rot, 2) / rot)`` and ``inv_freq * pos`` in
  float32), float32 cos/sin rounded to the dtype; RMSNorm in float32, rounded to the dtype; RoPE as
  three dtype operations (``x*cos``, ``rotate_half(x)*sin``, their sum), each rounded; the pooled key
  is the float32 mean rounded to the dtype before its norm. Attention: logits ``q.K`` rounded to the
  dtype, times ``scale`` rounded again, softmax in float32 rounded to the dtype, ``P.V`` rounded.
- ``trtllm`` (TensorRT-LLM's QSA pre-indexer): float32 mean, norm and RoPE (float32 angles), one
  rounding to the dtype when the key or query is stored. Attention: float32 softmax, one rounding
  of the output.

Scores (``q.kc`` sums) are left to :func:`oracle.index_scores` in float64: engines accumulate them in
float32 in an order no NumPy call reproduces, so their rankings agree with the emulated chain's up
to float32 accumulation (relative ~1e-6), which counts as a tie.
Everything returned is float64 holding values of the chain's dtype. Never imports numba; bfloat16
rounding comes from ``ml_dtypes``.
"""
import numpy as np

from . import validate as V

__all__ = ["CHAINS", "parse", "round_to", "rope_tables", "norm", "rope", "index_keys",
           "index_queries", "attend"]

ENGINES = ("hf", "trtllm")
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
CHAINS = tuple(f"{e}-{d}" for e in ENGINES for d in DTYPES)
_F32 = np.float32


def parse(rounding):
    """``(engine, dtype name)`` of a chain name such as ``"hf-bf16"``; refuses unknown chains."""
    engine, _, short = str(rounding).partition("-")
    if engine not in ENGINES or short not in DTYPES:
        raise V.QSAInputError(f"rounding {rounding!r} is not one of {', '.join(CHAINS)}")
    return engine, DTYPES[short]


def _np_dtype(name):
    if name == "bfloat16":
        import ml_dtypes
        return ml_dtypes.bfloat16
    return np.dtype(name)


def round_to(x, dtype):
    """``x`` rounded (to nearest even) to ``dtype`` and back to float64."""
    return np.asarray(x).astype(_np_dtype(dtype)).astype(np.float64)


def rope_tables(pos, rot=64, theta=1e7, dtype="float32"):
    """HF's ``(cos, sin)`` ``[..., rot]`` for positions ``pos``: float32 angles, float32 cos/sin
    rounded to ``dtype``, the half-table repeated (``cat((f, f))``) as ``rotate_half`` pairs it."""
    exponent = np.arange(0, rot, 2, dtype=_F32) / _F32(rot)
    # torch's float32 pow is correctly rounded here (checked on CPU, where HF builds the table)
    power = (float(theta) ** exponent.astype(np.float64)).astype(_F32)
    inv_freq = (_F32(1.0) / power).astype(_F32)
    ang = (np.asarray(pos, dtype=_F32)[..., None] * inv_freq).astype(_F32)
    # float64 cos/sin of the float32 angle, rounded once: float32 libm differs by at most an ulp
    cos = round_to(np.cos(ang.astype(np.float64)).astype(_F32), dtype)
    sin = round_to(np.sin(ang.astype(np.float64)).astype(_F32), dtype)
    return np.concatenate([cos, cos], axis=-1), np.concatenate([sin, sin], axis=-1)


def norm(x, w, eps=1e-6, dtype="float32", engine="hf"):
    """Gemma RMSNorm in float32 (``x * rsqrt(mean(x^2) + eps) * (1 + w)``), rounded to ``dtype``
    (``hf``) or left in float32 (``trtllm`` rounds once, at storage)."""
    x32 = np.asarray(x, dtype=np.float64).astype(_F32)
    ms = np.mean(x32 * x32, axis=-1, keepdims=True, dtype=_F32)
    y = (x32 * (_F32(1.0) / np.sqrt(ms + _F32(eps)))).astype(_F32)
    y = (y * (_F32(1.0) + np.asarray(w, dtype=np.float64).astype(_F32))).astype(_F32)
    return round_to(y, dtype) if engine == "hf" else y.astype(np.float64)


def rope(x, cos, sin, dtype="float32"):
    """HF's ``x*cos + rotate_half(x)*sin`` on the first ``cos.shape[-1]`` dims, each of the three
    operations rounded to ``dtype``; ``cos``/``sin`` broadcast against ``x[..., :rot]``."""
    x = np.asarray(x, dtype=np.float64)
    rot = cos.shape[-1]
    half = rot // 2
    xr = x[..., :rot]
    turned = np.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    y = round_to(round_to(xr * cos, dtype) + round_to(turned * sin, dtype), dtype)
    return np.concatenate([y, x[..., rot:]], axis=-1)


def _rope_chain(x, pos, rot, theta, engine, dtype):
    if engine == "hf":
        cos, sin = rope_tables(pos, rot, theta, dtype)
        return rope(x, cos, sin, dtype)
    cos, sin = rope_tables(pos, rot, theta, "float32")
    return round_to(rope(x, cos, sin, "float32"), dtype)


def index_keys(k_raw, w_k, positions, *, rounding, eps=1e-6, rot=64, theta=1e7):
    """Compressed keys ``[G, Di]`` as the chain stores them: ``k_raw [G, r, Di]`` (the engine's raw
    keys, already in its dtype) pooled, normed, rotated at ``positions [G]`` (each group's first token).
    """
    engine, dtype = parse(rounding)
    mean = np.asarray(k_raw, dtype=np.float64).astype(_F32).mean(axis=1, dtype=_F32)
    if engine == "hf":
        mean = round_to(mean, dtype)
    y = norm(mean, w_k, eps, dtype, engine)
    return _rope_chain(y, np.asarray(positions), rot, theta, engine, dtype)


def index_queries(q_raw, w_q, positions, *, rounding, eps=1e-6, rot=64, theta=1e7):
    """Index queries ``[rows, Hi, Di]`` as the chain computes them from ``q_raw`` (in its dtype),
    rotated at ``positions [rows]``."""
    engine, dtype = parse(rounding)
    y = norm(q_raw, w_q, eps, dtype, engine)
    return _rope_chain(y, np.asarray(positions)[:, None], rot, theta, engine, dtype)


def attend(q_row, k_sel, v_sel, scale, rounding):
    """One row of attention through the chain: ``q_row [Hq, D]``, ``k_sel, v_sel [n, Hkv, D]`` ->
    ``out [Hq, D]`` (float64 holding dtype values). Dot products and sums themselves in float64."""
    engine, dtype = parse(rounding)
    hq, d = q_row.shape
    n, hkv = k_sel.shape[:2]
    if n == 0:
        return np.zeros((hq, d))
    qh = np.asarray(q_row, np.float64).reshape(hkv, hq // hkv, d)
    logits = np.einsum("jgd,njd->jgn", qh, np.asarray(k_sel, np.float64))
    if engine == "hf":
        logits = round_to(round_to(logits, dtype) * round_to(scale, dtype), dtype)
    else:
        logits = logits * scale
    logits = logits.astype(_F32)
    w = np.exp(logits - logits.max(axis=-1, keepdims=True)).astype(_F32)
    p = (w / w.sum(axis=-1, keepdims=True, dtype=_F32)).astype(_F32)
    if engine == "hf":
        p = round_to(p, dtype)
    out = np.einsum("jgn,njd->jgd", p.astype(np.float64), np.asarray(v_sel, np.float64))
    return round_to(out, dtype).reshape(hq, d)
