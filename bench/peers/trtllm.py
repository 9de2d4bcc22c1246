"""TensorRT-LLM's Triton QSA kernels (``tensorrt_llm/_torch/attention_backend/sparse/qsa/kernels.py``).

Imported from an installed ``tensorrt_llm`` when there is one, else from the file given by
``--trtllm-kernels PATH`` (default ``.peers/trtllm/kernels.py`` of the checkout; the public file at
commit 1a471ef5306e507790e29a1c3754c757dfdb3888, 77,641 characters, never committed). For the file,
stand-ins are supplied for the two modules it imports (``tensorrt_llm._utils.get_sm_version``,
``tensorrt_llm.logger.logger``) and ``TRTLLM_ENABLE_PDL=0`` is set.

Conversions (outside the timed call, views of the same memory where possible):
- index cache: TensorRT-LLM keeps the compressed key of group ``e`` at token slot ``4e+3`` of a
  token-paged side cache ``[pages, page_size, 1, Di]``. The problem allocates numqsa's canonical
  ``[pages, page_size/4, Di]`` cache inside a buffer shifted by ``3*Di/4`` elements, so the strided
  view ``(16*Di, Di/4, Di, 1)`` puts exactly those keys at slots ``4e+3``: no copy.
- K/V: read head-major (HND) ``[pages, Hkv, page_size, D]``: the ``permute(0, 2, 1, 3)`` view.
- top-k: ``torch.topk`` over its scores (its own fallback), ids of ``-inf`` scores set to -1 and cast
  to int32 (its expansion wants prefix-packed int32 ids). Tokens come out in top-k order, tail last.
- per-row ``sequence_lengths`` for the expansion: ``seq_lens[req_ids]``, computed once.
``select`` is scores + top-k + expansion; ``prefill`` that chain + ``triton_qsa_paged_sparse_gqa``
(passing ``query_positions``/``compress_ratio``: its causal-prefix path, as its backend does).
"""
import hashlib
import importlib.util
import os
import sys
import types

from . import Call, Skip, triton_missing

NAME = "trtllm"
_K = {}


def _stand_ins(torch):
    if "tensorrt_llm._utils" in sys.modules:
        return
    pkg = types.ModuleType("tensorrt_llm")
    pkg.__path__ = []
    utils = types.ModuleType("tensorrt_llm._utils")

    def get_sm_version():
        major, minor = torch.cuda.get_device_capability()
        return major * 10 + minor
    utils.get_sm_version = get_sm_version
    log = types.ModuleType("tensorrt_llm.logger")

    class _Logger:
        def __getattr__(self, name):          # info, warning, info_once, warning_once, ...
            return lambda *a, **k: None
    log.logger = _Logger()
    sys.modules.update({"tensorrt_llm": pkg, "tensorrt_llm._utils": utils,
                        "tensorrt_llm.logger": log})


def load(args):
    missing = triton_missing()
    if missing:
        return missing
    try:
        from tensorrt_llm._torch.attention_backend.sparse.qsa import kernels
        _K.update(mod=kernels, source="installed tensorrt_llm")
        return None
    except Exception:
        pass
    path = args.trtllm_kernels
    if not path or not os.path.exists(path):
        return f"TensorRT-LLM is not installed and its kernels file is absent ({path})"
    import torch
    os.environ["TRTLLM_ENABLE_PDL"] = "0"
    _stand_ins(torch)
    spec = importlib.util.spec_from_file_location("trtllm_qsa_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    data = open(path, "rb").read()
    _K.update(mod=mod, source=os.path.abspath(path), sha256=hashlib.sha256(data).hexdigest(),
              chars=len(data.decode()))
    return None


def versions():
    v = {k: _K[k] for k in ("source", "sha256", "chars") if k in _K}
    if _K.get("source", "").startswith("installed"):
        import importlib.metadata as md
        v["version"] = md.version("tensorrt_llm")
    else:
        v["commit"] = "1a471ef5306e507790e29a1c3754c757dfdb3888"
    return v


def _topk(torch, scores, kb):
    k = min(kb, scores.shape[1])
    vals, idx = torch.topk(scores, k, dim=1)
    idx = torch.where(vals == float("-inf"), -1, idx).to(torch.int32)
    if k < kb:
        idx = torch.nn.functional.pad(idx, (0, kb - k), value=-1)
    return idx


def prepare(stage, p, route=None):
    K = _K["mod"]
    torch = p.torch
    c = p.case
    if c.dtype not in ("float16", "bfloat16"):
        raise Skip(f"its kernels take float16/bfloat16, not {c.dtype}")
    r, kb, ps = c.r, c.Kb, c.page_size
    prefill_rows = c.rows > 256 and len(c.seq_lens) * 8 < c.rows

    def scores():
        return K.triton_qsa_paged_index_scores(
            q=p.qi, index_cache=p.index_trt, block_table=p.block_table,
            query_positions=p.positions, request_indices=p.req_ids, tokens_per_block=ps,
            compress_ratio=r, only_visible_blocks=False, context_rows=prefill_rows)

    def expand(groups):
        return K.triton_expand_qsa_block_indices(groups, p.positions, p.row_lens,
                                                 compress_ratio=r, token_topk=kb * r)

    def attention(tokens):
        return K.triton_qsa_paged_sparse_gqa(
            q=p.q, k_cache=p.k_cache.permute(0, 2, 1, 3), v_cache=p.v_cache.permute(0, 2, 1, 3),
            block_table=p.block_table, selected_tokens=tokens, request_indices=p.req_ids,
            tokens_per_block=ps, softmax_scale=c.D ** -0.5, query_positions=p.positions,
            compress_ratio=r)

    box = {}
    if stage == "scores":
        def gpu():
            box["s"] = scores()
        return Call(gpu=gpu, result=lambda: {"scores": box["s"]},
                    host={"trtllm.triton_qsa_paged_index_scores": gpu})
    if stage == "topk":
        raise Skip("its top-k is torch.topk (the torch row)")
    if stage == "expand":
        def gpu():
            box["t"] = expand(p.groups)
        return Call(gpu=gpu, result=lambda: {"tokens": box["t"]},
                    host={"trtllm.triton_expand_qsa_block_indices": gpu})
    if stage == "select":
        def gpu():
            box["t"] = expand(_topk(torch, scores(), kb))
        return Call(gpu=gpu, result=lambda: {"tokens": box["t"]})
    if stage == "attention":
        def gpu():
            box["o"] = attention(p.tokens)
        return Call(gpu=gpu, result=lambda: {"out": box["o"]},
                    host={"trtllm.triton_qsa_paged_sparse_gqa": gpu})
    if stage == "prefill":
        def gpu():
            box["t"] = expand(_topk(torch, scores(), kb))
            box["o"] = attention(box["t"])
        return Call(gpu=gpu, result=lambda: {"out": box["o"], "tokens": box["t"]},
                    host={"trtllm.prefill_chain": gpu})
    raise Skip(f"no {stage} stage")
