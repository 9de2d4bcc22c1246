"""HF transformers' Qwen4Exp text model with its QSA layers run through numqsa.

``enable(model)`` makes every ``Qwen4ExpTextAttention`` of a loaded model (``Qwen4ExpTextModel``,
``Qwen4ExpForCausalLM``, ...) select its tokens and attend through :func:`numqsa.qsa_prefill`, in
prefill and in generation with HF's own cache; ``disable(model)`` undoes it. Needs the ``transformers``
extra (``pip install 'numqsa[transformers]'``).

How it hooks in (transformers 5.17):

- attention: the function ``"numqsa"`` is registered in transformers' ``AttentionInterface`` (and a
  mask function of the same name in ``AttentionMaskInterface``, which builds the mask of the model's
  previous implementation, eager or sdpa), and the model is switched to it with
  ``model.set_attn_implementation("numqsa")``. Projections, q/k norms, RoPE, the KV cache update
  and the output gate stay HF's code.
- indexer: HF has no extension point there, so each QSA layer's ``indexer`` gets an instance-level
  ``forward`` (``disable`` deletes it). It runs HF's own modules on the whole prompt at once: the
  index projection, the q norm and RoPE of the index queries, HF's cache update of the raw index
  keys, then the index keys pooled per ``r`` tokens, normed and rotated at each group's first token
  with HF's ``k_layernorm`` and cos/sin -- HF's rounding chain exactly, as one vectorised pass
  instead of HF's loop over query rows. Scores, top-k and the expansion (``numqsa.select``) and the
  sparse attention then run in numqsa, in ``qsa_prefill``, from the attention function.
- grouping: HF groups the tokens of a row by rank among the row's visible keys. Whenever every
  row of the mask sees a prefix ``0 .. c-1`` of the cache (causal prompts, generation, right padding)
  that is numqsa's grouping ``r*e .. r*e + r - 1`` with the row at position ``c - 1``; any other mask
  (left padding, packed sequences, custom 4-D masks) goes to HF's path.

Layouts (no copies of the caches): HF's ``DynamicCache`` holds K/V as ``[batch, Hkv, seq, D]``;
numqsa reads them as one page per request, ``[num_pages = batch, page_size = seq, Hkv, D]``
(``.transpose(1, 2)``, strides only), block table ``[[0], [1], ...]``. A page must hold a whole number
of groups: when ``seq % r != 0`` the view declares ``seq`` rounded up to ``r`` slots (a strided
``__cuda_array_interface__`` view; the kernels never read past ``seq``). The compressed index keys
(``seq // r`` per request, recomputed from HF's raw index-key cache at every call: ``O(seq * Di)``)
form an index cache of one page per request.

Dtypes: float16 and float32 run in the kernels as they are. CUDA bfloat16 (which the kernels refuse
today) is upcast to float32 by default -- exact, so the selection sees HF's bf16 index values bit for
bit -- at the cost of a float32 copy of the layer's K/V per call and numqsa's generic fp32 attention
kernel; ``enable(model, bf16_as="float16")`` converts to float16 instead (exact inside float16's
range; the tensor-core routes). The output is rounded back to bf16.
The attention then differs from HF eager's bf16 chain (bf16 logits and probabilities) by that chain's
rounding, not by numqsa's.

Several GPUs: every call runs on the device of its layer's tensors (``numqsa.qsa_prefill``), so a
model split over GPUs by ``device_map`` (accelerate's hooks moving activations between them) or
sharded by ``tp_plan`` (one process per GPU) runs each QSA layer where its tensors are; sharding and
the collectives stay HF's and torch.distributed's.

Fallbacks, each announced once with its reason (``warnings.warn``): CPU tensors (outside the numba
CUDA simulator, where CPU tensors run as NumPy arrays: tests only), other dtypes, autograd (numqsa has
no backward), attention dropout in training, masks that are not prefixes, multi-head masks. The
fallback is the model's previous implementation, untouched.
"""
from __future__ import annotations

import sys
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import numqsa
from numqsa.jit import SIMULATOR

__all__ = ["enable", "disable", "is_enabled", "NAME", "index_inputs", "visible_prefix"]

#: The name registered in transformers' attention and mask interfaces.
NAME = "numqsa"

# Elements of one [batch, rows, keys] block of the mask checked at once (bounds the temporaries).
_MASK_CHUNK = 1 << 26

_warned: set = set()


def _warn_once(why):
    if why not in _warned:
        _warned.add(why)
        warnings.warn(f"numqsa: this QSA call runs HF's own path: {why}", stacklevel=3)


@dataclass
class _Pending:
    """What the indexer hands to the attention function of the same layer."""
    qi: Any          # [B*S, Hi, Di] finished index queries (HF's chain)
    kc: Any          # [B, G, Di] finished compressed keys (HF's chain)
    positions: Any   # [B*S] int32: visible keys of the row minus one
    Kb: int
    r: int


def _modeling(module):
    return sys.modules[type(module).__module__]


def _qsa_modules(model):
    """The model's QSA attention modules (``Qwen4ExpTextAttention``, each with its ``indexer``)."""
    return [m for m in model.modules()
            if type(m).__name__ == "Qwen4ExpTextAttention" and hasattr(m, "indexer")]


def _fallback_name(config):
    return getattr(config, "_numqsa_fallback", "sdpa")


def _mask(*args, config=None, **kwargs):
    """The mask of the implementation numqsa replaced: HF's indexer and fallback need it."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    return ALL_MASK_ATTENTION_FUNCTIONS[_fallback_name(config)](*args, config=config, **kwargs)


def _register():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, _mask)


def is_enabled(model):
    """True if ``enable`` hooked this model's QSA layers."""
    mods = _qsa_modules(model)
    return bool(mods) and all(_hooked(m.indexer) for m in mods)


def _hooked(indexer):
    return getattr(indexer.__dict__.get("forward"), "_numqsa", False)


def enable(model, *, keep_selection=False, bf16_as="float32"):
    """Run ``model``'s QSA layers (index selection + sparse attention) through numqsa; returns ``model``.

    ``bf16_as``: the kernel dtype of bfloat16 models -- ``"float32"`` (exact upcast, the generic
    fp32 attention kernel) or ``"float16"`` (exact for values inside float16's range, the tensor-core
    routes; values beyond 65504 overflow). ``keep_selection=True`` keeps each QSA attention module's last numqsa selection as
    ``module.numqsa_selection = (tokens [rows, Kb*r + r - 1], counts [rows])`` (rows = batch x query
    tokens, row-major), for inspection.
    """
    mods = _qsa_modules(model)
    if not mods:
        raise ValueError(f"{type(model).__name__} has no Qwen4Exp QSA attention layers")
    if bf16_as not in ("float32", "float16"):
        raise ValueError(f"bf16_as must be 'float32' or 'float16', got {bf16_as!r}")
    if is_enabled(model):
        return model
    _register()
    current = model.config._attn_implementation
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and getattr(cfg, "_attn_implementation", None) not in (None, NAME):
            cfg._numqsa_fallback = cfg._attn_implementation
    if current != NAME:
        model.config._numqsa_fallback = current
    model.set_attn_implementation(NAME)
    for attn in mods:
        indexer = attn.indexer
        # An instance-level forward already there (accelerate's device hooks) is kept: it is HF's
        # path for the fallback, and disable() puts it back.
        indexer._numqsa_prev = indexer.__dict__.get("forward")
        hf_forward = indexer.forward

        def forward(hidden_states, position_embeddings, attention_mask, past_key_values,
                    _indexer=indexer, _attn=attn, _hf=hf_forward):
            return _indexer_forward(_indexer, _attn, _hf, hidden_states, position_embeddings,
                                    attention_mask, past_key_values)
        forward._numqsa = True
        indexer.forward = forward
        attn._numqsa_keep = bool(keep_selection)
        attn._numqsa_bf16 = getattr(torch, bf16_as)
        attn._numqsa_pending = None
    return model


def disable(model):
    """Undo :func:`enable`: HF's indexer and the previous attention implementation."""
    for attn in _qsa_modules(model):
        indexer = attn.indexer
        if _hooked(indexer):
            prev = indexer.__dict__.pop("_numqsa_prev", None)
            del indexer.forward
            if prev is not None:
                indexer.forward = prev
        for name in ("_numqsa_pending", "_numqsa_keep", "_numqsa_bf16", "numqsa_selection"):
            attn.__dict__.pop(name, None)
    if model.config._attn_implementation == NAME:
        cfg = model.config
        subs = [k for k in getattr(cfg, "sub_configs", {}) if getattr(cfg, k, None) is not None]
        model.set_attn_implementation({"": _fallback_name(cfg),
                                       **{k: _fallback_name(getattr(cfg, k)) for k in subs}})
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and "_numqsa_fallback" in vars(cfg):
            del cfg._numqsa_fallback
    return model


def _why_unsupported(attn, hidden_states, attention_mask):
    """Why numqsa cannot take this call ('' if it can), from cheap checks only."""
    if not hidden_states.is_cuda and not SIMULATOR:
        return (f"tensors on {hidden_states.device.type} (numqsa runs on CUDA; CPU tensors only in the "
                f"numba CUDA simulator)")
    if hidden_states.dtype not in (torch.float16, torch.float32, torch.bfloat16):
        return f"dtype {hidden_states.dtype} (numqsa takes float16, float32, bfloat16 via float32)"
    if torch.is_grad_enabled() and (hidden_states.requires_grad or attn.training):
        return "autograd (numqsa kernels have no backward; run under torch.no_grad())"
    if attn.training and attn.attention_dropout > 0:
        return "attention dropout in training (numqsa attends without dropout)"
    if attention_mask is None or attention_mask.ndim != 4:
        return "no 4-D attention mask"
    if attention_mask.shape[1] != 1:
        return f"a mask with {attention_mask.shape[1]} heads (custom 4-D mask)"
    return ""


_memo: dict = {}


def visible_prefix(attention_mask):
    """``(counts int32 [B, S], why)``: each row's visible keys if they are a prefix of the cache.

    HF's indexer ranks a row's visible keys; when those are ``0 .. c-1`` the rank is the key's index
    and the row is a numqsa row at position ``c - 1``. ``why`` says why not otherwise (counts None).
    The mask (bool, or additive float with 0 = visible) is read in chunks; one host read at the end.
    """
    key = id(attention_mask)
    hit = _memo.get(key)
    if hit is not None and hit[0]() is attention_mask:
        return hit[1], hit[2]
    vis_all = attention_mask[:, 0]
    B, S, K = vis_all.shape
    ar = torch.arange(K, device=attention_mask.device)
    counts = torch.empty((B, S), dtype=torch.int32, device=attention_mask.device)
    bad = torch.zeros((), dtype=torch.bool, device=attention_mask.device)
    step = max(1, _MASK_CHUNK // max(1, B * K))
    for a in range(0, S, step):
        v = vis_all[:, a:a + step]
        v = v if v.dtype == torch.bool else v == 0
        c = v.sum(-1)
        bad |= (v != (ar < c[..., None])).any()
        counts[:, a:a + step] = c
    why = ""
    if bool(bad):
        why = ("a mask whose rows do not see a prefix of the cache (left padding, packed sequences "
               "or a custom 4-D mask)")
    elif S and bool((counts == 0).any()):
        why = "a query row that sees no key"
    result = (None, why) if why else (counts, "")
    _memo.clear()
    _memo[key] = (weakref.ref(attention_mask), *result)
    return result


def index_inputs(indexer, hidden_states, position_embeddings, past_key_values=None):
    """HF's index queries and compressed keys for a whole prompt: ``(qi [B, S, Hi, Di], kc [B, G, Di])``.

    HF's own modules and RoPE, vectorised: the queries as HF's indexer computes them; the keys as
    HF pools (float32 mean rounded to the cache dtype), norms and rotates (at the group's first
    token) each group of ``r`` raw index keys -- HF does it per query row over the row's visible keys,
    the same values for prefix masks. Updates ``past_key_values``'s raw index keys as HF does.
    """
    hf = _modeling(indexer)
    B, S, _ = hidden_states.shape
    hi, di, r = indexer.index_n_heads, indexer.index_head_dim, indexer.compress_ratio
    full_cos, full_sin = position_embeddings
    q, raw = indexer.index_qk_proj(hidden_states).split([hi * di, indexer.index_kv_heads * di], dim=-1)
    q = indexer.q_layernorm(q.reshape(B, S, hi, di))
    q = hf.apply_rotary_pos_emb(q, cos=full_cos[:, -S:], sin=full_sin[:, -S:], unsqueeze_dim=2)
    raw = raw.reshape(B, S, di)
    if past_key_values is not None:
        raw = past_key_values.update_indexer(raw, indexer.layer_idx)
    G = raw.shape[1] // r
    pooled = raw[:, :G * r].reshape(B, G, r, di).float().mean(dim=2).to(raw.dtype)
    kc = hf.apply_rotary_pos_emb(indexer.k_layernorm(pooled).unsqueeze(2), cos=full_cos[:, :G * r:r],
                                 sin=full_sin[:, :G * r:r], unsqueeze_dim=2).squeeze(2)
    return q, kc


def _indexer_forward(indexer, attn, hf_forward, hidden_states, position_embeddings, attention_mask,
                     past_key_values):
    attn._numqsa_pending = None
    why = _why_unsupported(attn, hidden_states, attention_mask)
    counts = None
    if not why:
        counts, why = visible_prefix(attention_mask)
    if why:
        _warn_once(why)
        return hf_forward(hidden_states, position_embeddings, attention_mask, past_key_values)
    qi, kc = index_inputs(indexer, hidden_states, position_embeddings, past_key_values)
    B, S = hidden_states.shape[:2]
    attn._numqsa_pending = _Pending(qi=qi.reshape(B * S, *qi.shape[2:]), kc=kc,
                                    positions=(counts - 1).reshape(-1), Kb=indexer.block_topk,
                                    r=indexer.compress_ratio)
    # HF combines this with the causal mask (``&`` or ``+``); a neutral scalar keeps it as it is.
    if attention_mask.dtype == torch.bool:
        return attention_mask.new_ones((), dtype=torch.bool)
    return attention_mask.new_zeros(())


class _StridedView:
    """A ``__cuda_array_interface__`` view with the caller's shape and strides (no bounds: the
    kernels never read the slots past the cache's length it declares)."""

    def __init__(self, t, shape, strides):
        item = t.element_size()
        self.__cuda_array_interface__ = {
            "data": (t.data_ptr(), False), "shape": tuple(shape),
            "strides": tuple(s * item for s in strides),
            "typestr": {torch.float16: "<f2", torch.float32: "<f4"}[t.dtype], "version": 3,
            "stream": None}
        self.owner = t


def _pages(x, r):
    """``[B, H, S, D]`` (HF's cache) as numqsa pages ``[B, S rounded up to r, H, D]``, one per request."""
    B, H, S, D = x.shape
    pad = -S % r
    if x.is_cuda:
        if not pad:
            return x.transpose(1, 2)
        from numba import cuda

        from numqsa import device as dev
        sb, sh, ss, sd = x.stride()
        with dev.on_device(x.get_device()):      # a numba view names the context it was made in
            return cuda.as_cuda_array(_StridedView(x, (B, S + pad, H, D), (sb, ss, sh, sd)),
                                      sync=False)
    a = x.transpose(1, 2).numpy()           # the simulator: NumPy, copied in by numqsa anyway
    return np.concatenate([a, np.zeros((B, pad, H, D), a.dtype)], axis=1) if pad else a


def _run(p, query, key, value, scaling, bf16_as=torch.float32):
    """numqsa's selection and attention for one layer: ``[B, S, Hq, D]`` in the query's dtype."""
    B, hq, S, D = query.shape
    skv, dev = key.shape[2], query.device
    kd = bf16_as if query.dtype == torch.bfloat16 else query.dtype
    G = p.kc.shape[1]
    q = query.transpose(1, 2).reshape(B * S, hq, D).to(kd)
    qi = p.qi.to(kd)
    ic = p.kc.to(kd) if G else torch.zeros((B, 1, p.kc.shape[2]), dtype=kd, device=dev)
    kp, vp = _pages(key.to(kd), p.r), _pages(value.to(kd), p.r)
    req = torch.arange(B, dtype=torch.int32, device=dev).repeat_interleave(S)
    lens = torch.full((B,), skv, dtype=torch.int32, device=dev)
    table = torch.arange(B, dtype=torch.int32, device=dev)[:, None]
    meta = [req, p.positions, lens, table]
    if not query.is_cuda:
        q, qi, ic = q.numpy(), qi.contiguous().numpy(), ic.contiguous().numpy()
        meta = [m.numpy() for m in meta]
    req, pos, lens, table = meta
    out, _, tokens, counts = numqsa.qsa_prefill(qi, ic, table, q, kp, vp, table, req, pos, lens,
                                                Kb=p.Kb, r=p.r, scale=scaling, num_groups=G)
    if isinstance(out, np.ndarray):
        out, tokens, counts = (torch.from_numpy(x) for x in (out, tokens, counts))
    return out.reshape(B, S, hq, D).to(query.dtype), (tokens, counts)


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function ``"numqsa"``: QSA through numqsa for the layers whose indexer
    prepared it (see :func:`enable`), the model's previous implementation for everything else."""
    p = getattr(module, "_numqsa_pending", None)
    if p is None:
        fallback = _fallback_name(module.config)
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        fn = (ALL_ATTENTION_FUNCTIONS[fallback] if fallback != "eager"
              else _modeling(module).eager_attention_forward)
        return fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                  **kwargs)
    module._numqsa_pending = None
    scale = module.scaling if scaling is None else scaling
    out, selection = _run(p, query, key, value, scale, getattr(module, "_numqsa_bf16", torch.float32))
    if getattr(module, "_numqsa_keep", False):
        module.numqsa_selection = selection
    return out, None
