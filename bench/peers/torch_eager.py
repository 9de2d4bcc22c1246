"""PyTorch eager: what a user writes without a QSA library.

- scores: gather each request's compressed keys through the page table, float32 ``einsum`` with the
  index queries, ReLU, head sum, ``-inf`` beyond each row's visible groups;
- top-k: ``torch.topk`` (ids of ``-inf`` scores -> -1);
- expansion: ``4g + [0..3]`` per group, then the 0-3 tail tokens;
- attention: gather the selected K/V rows (512 query rows at a time) and
  ``scaled_dot_product_attention`` with a mask of the valid columns;
- select / prefill: the chains of the above.
"""
from . import Call, Skip, torch_gpu_missing

NAME = "torch"
CHUNK = 512


def load(args):
    return torch_gpu_missing("torch is not installed")


def versions():
    import torch
    return {"torch": torch.__version__}


def make(p):
    torch = p.torch
    c = p.case
    r, kb, G = c.r, c.Kb, p.G
    per_page = c.page_size // r
    req = p.req_ids.long()
    pos = p.positions.long()
    nb = torch.from_numpy(p.nb_np).cuda()
    e = torch.arange(G, device="cuda")
    segs = []
    at = 0
    for q, n in enumerate(c.rows_per_req):
        segs.append((q, at, at + n))
        at += n
    table = p.block_table.long()

    def scores():
        out = torch.empty((c.rows, G), dtype=torch.float32, device="cuda")
        for q, a, b in segs:
            n = int(c.seq_lens[q]) // r
            keys = p.index_cache[table[q, e[:n] // per_page], e[:n] % per_page].float()   # [n, Di]
            s = torch.relu(torch.einsum("rhd,gd->rhg", p.qi[a:b].float(), keys)).sum(1) * c.Di ** -0.5
            out[a:b, :n] = s
            out[a:b, n:] = float("-inf")
        return out.masked_fill(e[None, :] >= nb[:, None], float("-inf"))

    def topk(s):
        k = min(kb, s.shape[1])
        vals, idx = torch.topk(s, k, dim=1)
        idx = torch.where(vals == float("-inf"), -1, idx)
        if k < kb:
            idx = torch.nn.functional.pad(idx, (0, kb - k), value=-1)
        return idx

    def expand(g):
        g = g.long()
        tok = torch.where(g[:, :, None] >= 0, g[:, :, None] * r + torch.arange(r, device="cuda"),
                          -1).flatten(1)
        tail = r * nb[:, None] + torch.arange(r - 1, device="cuda")[None, :]
        tail = torch.where(tail <= pos[:, None], tail, -1)
        return torch.cat([tok, tail], 1)

    def attention(tokens):
        tokens = tokens.long()
        out = torch.empty_like(p.q)
        grp = c.Hq // c.Hkv
        for a in range(0, c.rows, CHUNK):
            b = min(c.rows, a + CHUNK)
            t = tokens[a:b]
            valid = t >= 0
            t = t.clamp(min=0)
            pg = table[req[a:b, None], t // c.page_size]
            sl = t % c.page_size
            ks = p.k_cache[pg, sl].transpose(1, 2)            # [n, Hkv, W, D]
            vs = p.v_cache[pg, sl].transpose(1, 2)
            qs = p.q[a:b].view(b - a, c.Hkv, grp, c.D)
            o = torch.nn.functional.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=valid[:, None, None, :])
            out[a:b] = o.reshape(b - a, c.Hq, c.D)
        return out
    return scores, topk, expand, attention


def prepare(stage, p, route=None):
    scores, topk, expand, attention = make(p)
    box = {}
    if stage == "scores":
        def gpu():
            box["s"] = scores()
        return Call(gpu=gpu, result=lambda: {"scores": box["s"]})
    if stage == "topk":
        def gpu():
            box["g"] = topk(p.scores)
        return Call(gpu=gpu, result=lambda: {"groups": box["g"]}, host={"torch.topk": gpu})
    if stage == "expand":
        def gpu():
            box["t"] = expand(p.groups)
        return Call(gpu=gpu, result=lambda: {"tokens": box["t"]})
    if stage == "select":
        def gpu():
            box["t"] = expand(topk(scores()))
        return Call(gpu=gpu, result=lambda: {"tokens": box["t"]})
    if stage == "attention":
        def gpu():
            box["o"] = attention(p.tokens)
        return Call(gpu=gpu, result=lambda: {"out": box["o"]})
    if stage == "prefill":
        def gpu():
            box["t"] = expand(topk(scores()))
            box["o"] = attention(box["t"])
        return Call(gpu=gpu, result=lambda: {"out": box["o"], "tokens": box["t"]})
    raise Skip(f"no {stage} stage")
