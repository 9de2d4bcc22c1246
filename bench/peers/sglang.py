"""SGLang's QSA Triton sparse attention (``sglang/srt/layers/attention/qsa/sparse_attn.py``,
``sparse_gqa_paged_prefill_triton``) from the PyPI wheel ``sglang==0.5.23``.

Loaded by file path, without importing the rest of sglang: from an installed sglang's files, or from
``--sglang-root DIR`` (default ``.peers/sglang`` of the checkout, holding the wheel's
``sglang/srt/layers/attention/qsa/`` and ``sglang/srt/batch_invariant_ops/``). The one import
``sparse_attn.py`` makes, ``sglang.srt.batch_invariant_ops.is_batch_invariant_mode_enabled``, is
taken from ``batch_invariant_ops.py`` when that loads alone; it imports more of sglang (DeepGEMM
configuration, utils), so otherwise a stand-in returns False, that module's own default.

Conversions (outside the timed call): SGLang reads K/V from a token-slot pool ``[slots, Hkv, D]``:
the ``reshape(pages * page_size, Hkv, D)`` view of the paged cache (no copy); its ``slot_table``
(the ``req_to_token`` pool SGLang keeps anyway) maps request-local token ``t`` to slot
``block_table[q, t // page_size] * page_size + t % page_size``; ``cu_q`` the rows of each request
(rows are the last ``q_len`` positions of each request, as its kernel assumes); ``kv_lens = seq_lens``;
``indices`` are the selection's tokens (logical positions, -1 padded). Attention only: the rest of
its QSA path (indexer, top-k) lives in modules that import the whole of sglang.
"""
import importlib.util
import os
import sys
import types

from . import Call, Skip, triton_missing

NAME = "sglang"
_S = {}


def _load_file(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def load(args):
    missing = triton_missing()
    if missing:
        return missing
    root = None
    spec = importlib.util.find_spec("sglang")
    if spec is not None and spec.submodule_search_locations:
        root = os.path.dirname(list(spec.submodule_search_locations)[0])
        _S["source"] = "installed sglang"
    elif args.sglang_root and os.path.isdir(args.sglang_root):
        root = args.sglang_root
        _S["source"] = os.path.abspath(root)
    else:
        return f"sglang is not installed and its wheel files are absent ({args.sglang_root})"
    path = os.path.join(root, "sglang", "srt", "layers", "attention", "qsa", "sparse_attn.py")
    if not os.path.exists(path):
        return f"{path} is absent"
    if "sglang.srt.batch_invariant_ops" not in sys.modules:
        for name in ("sglang", "sglang.srt"):
            if name not in sys.modules:
                m = types.ModuleType(name)
                m.__path__ = []
                sys.modules[name] = m
        try:
            bio = _load_file("sglang.srt.batch_invariant_ops",
                             os.path.join(root, "sglang", "srt", "batch_invariant_ops",
                                          "batch_invariant_ops.py"))
            _S["batch_invariant_ops"] = "loaded"
        except Exception as err:
            sys.modules.pop("sglang.srt.batch_invariant_ops", None)
            bio = types.ModuleType("sglang.srt.batch_invariant_ops")
            bio.is_batch_invariant_mode_enabled = lambda: False
            sys.modules["sglang.srt.batch_invariant_ops"] = bio
            _S["batch_invariant_ops"] = f"stand-in (returns False): {type(err).__name__}"
    _S["mod"] = _load_file("sglang_qsa_sparse_attn", path)
    _S["path"] = os.path.abspath(path)
    return None


def versions():
    v = {k: _S[k] for k in ("source", "path", "batch_invariant_ops") if k in _S}
    try:
        import importlib.metadata as md
        v["version"] = md.version("sglang")
    except Exception:
        v["version"] = "0.5.23 (wheel files)"
    return v


def prepare(stage, p, route=None):
    if stage != "attention":
        raise Skip("only its sparse attention is loadable without the rest of sglang")
    S = _S["mod"]
    torch = p.torch
    c = p.case
    if c.dtype not in ("float16", "bfloat16"):
        raise Skip(f"float16/bfloat16 only, not {c.dtype}")
    ps = c.page_size
    slots = p.num_pages * ps
    kpool = p.k_cache.reshape(slots, c.Hkv, c.D)
    vpool = p.v_cache.reshape(slots, c.Hkv, c.D)
    t = torch.arange(p.table_np.shape[1] * ps, device="cuda")
    tab = p.block_table.long()
    slot_table = (tab[:, t // ps] * ps + t % ps).to(torch.int32).contiguous()
    per = torch.tensor([0] + list(c.rows_per_req), device="cuda").cumsum(0).to(torch.int32)
    kv_lens = p.seq_lens
    max_q = int(max(c.rows_per_req))
    box = {}

    def gpu():
        box["o"] = S.sparse_gqa_paged_prefill_triton(p.q, kpool, vpool, slot_table, p.tokens, per,
                                                     kv_lens, c.D ** -0.5, max_q=max_q)
    return Call(gpu=gpu, result=lambda: {"out": box["o"]},
                host={"sglang.sparse_gqa_paged_prefill_triton": gpu})
