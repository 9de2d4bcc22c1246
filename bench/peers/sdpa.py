"""Dense causal ``scaled_dot_product_attention`` over each request's whole context: what sparsity buys.

Conversion (outside the timed call): each request's K/V are gathered once from the paged cache into
contiguous ``[1, Hkv, seq_len, D]`` tensors (a dense engine keeps its own layout). Rows are the last
positions of their request, so the mask is causal aligned to the lower right
(``torch.nn.attention.bias.causal_lower_right``); flash / memory-efficient kernels only (the math
fallback would materialise the full score matrix). Its check is against the oracle's dense attention
(every token ``0..p``), and its floor counts the dense FLOP and one read of the context's K/V.
"""
from . import Call, Skip, torch_gpu_missing

NAME = "sdpa"


def _causal_lower_right():
    from torch.nn.attention.bias import causal_lower_right  # noqa: F401


def load(args):
    return torch_gpu_missing("needs torch >= 2.3 with causal_lower_right", _causal_lower_right)


def versions():
    return {}


def prepare(stage, p, route=None):
    if stage != "attention":
        raise Skip("dense attention only")
    torch = p.torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    F = torch.nn.functional
    c = p.case
    ps = c.page_size
    parts = []
    at = 0
    for q, n in enumerate(c.rows_per_req):
        T = int(c.seq_lens[q])
        pages = p.block_table[q, :-(-T // ps)].long()
        k = p.k_cache[pages].reshape(-1, c.Hkv, c.D)[:T].transpose(0, 1)[None].contiguous()
        v = p.v_cache[pages].reshape(-1, c.Hkv, c.D)[:T].transpose(0, 1)[None].contiguous()
        if c.Hkv != c.Hq:
            k = k.repeat_interleave(c.Hq // c.Hkv, dim=1)
            v = v.repeat_interleave(c.Hq // c.Hkv, dim=1)
        parts.append((at, at + n, k, v, causal_lower_right(n, T)))
        at += n
    out = torch.empty_like(p.q)
    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]

    def gpu():
        with sdpa_kernel(backends):
            for a, b, k, v, mask in parts:
                qs = p.q[a:b].transpose(0, 1)[None]            # [1, Hq, n, D]
                o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask)
                out[a:b] = o[0].transpose(0, 1)
    return Call(gpu=gpu, result=lambda: {"out": out})
