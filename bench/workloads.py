"""The benchmark's workloads: the case list of issue 13, fast problem generation, FLOP/byte floors.

A problem is one batch of requests (rows at the end of each request's context, page size 64 in
random physical order unless the case says otherwise, Hi 4 / Di 128 / r 4 / Kb 512 / Hq 6 / Hkv 1 /
D 256). On a GPU every large tensor is drawn with torch directly on the device; the attention
selection is drawn on the host in vectorised NumPy (a few ms at 8192 rows) and copied once.

Selections for the attention stage: slot ``j`` of a row's ``Kb`` groups always holds a group of
residue class ``j mod Kb`` and is redrawn with probability ``1 - overlap`` from one row to the next
(else kept), so rows are duplicate-free, causal, and adjacent rows share ``~overlap`` of their
groups; the realised overlap is measured and reported. Index queries of adjacent rows follow an
AR(1) process, ``qi[i] = c qi[i-1] + sqrt(1 - c^2) noise`` with ``c = 0.978``, so the selections
that scores + top-k make (select / prefill stages) overlap like the attention ones: on random
keys at 32K, c = 0.97 / 0.99 / 0.995 gave 0.78 / 0.88 / 0.92 adjacent top-512 overlap (NumPy, 48
rows); independent queries would share ~6%, which no serving workload does. The realised overlap
of the oracle's selection on 8 consecutive rows is reported with the select / prefill rows.

Floors: ``max(FLOP / 777e12, bytes / 4.24e12)``, the H200's measured fp16 tensor matmul and
device-to-device copy rates (NUMBA_NOTES.md), with the minimal counts of the oracle docstrings.
"""
from dataclasses import dataclass, replace

import numpy as np

PEAK_FLOPS, PEAK_BYTES = 777e12, 4.24e12
STAGES = ("scores", "topk", "expand", "select", "attention", "prefill")
DISTS = ("relu", "concentrated", "plateau", "fewvalues")


@dataclass(frozen=True)
class Case:
    name: str
    seq_lens: tuple
    rows_per_req: tuple
    stages: tuple
    section: str
    page_size: int = 64
    Kb: int = 512
    dtype: str = "float16"
    dist: str = "relu"             # top-k stage's synthetic score distribution
    overlap: float = 0.82
    qi_corr: float = 0.978          # AR(1) correlation of adjacent rows' index queries (see below)
    Hq: int = 6
    Hkv: int = 1
    D: int = 256
    Hi: int = 4
    Di: int = 128
    r: int = 4
    host_lines: bool = False
    seed: int = 0

    @property
    def rows(self):
        return int(sum(self.rows_per_req))

    @property
    def context(self):
        return int(max(self.seq_lens))


def _k(n):
    """Case-name context: 32768 -> "32K", 131072 -> "131K" (the issue's names)."""
    if n == 131072:
        return "131K"
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def one(rows, ctx, stages, section, suffix="", **kw):
    name = f"{rows}x{_k(ctx)}" + suffix
    return Case(name, (ctx,), (rows,), tuple(stages), section, **kw)


PREFILL = ("scores", "topk", "expand", "select", "attention", "prefill")
SMALL = ("scores", "select", "attention", "prefill")


def case_list(quick=False, smoke=False):
    """Every workload of issue 13 in run order (``quick``: one per section, to debug adapters)."""
    if smoke:
        # Tiny shapes for the numba CUDA simulator: a real top-k (Kb 8 of 72 groups) and both
        # attention routes' inputs; Hi/Di/Hq/D shrunk to keep simulated blocks few.
        kw = dict(Kb=8, Hq=2, Hkv=1, D=32, Hi=2, Di=32, page_size=16)
        return [Case("3x288", (288,), (3,), PREFILL, "smoke", **kw)]
    cases = []
    for rows, ctx in ((4096, 32768), (8192, 32768), (1024, 131072), (8192, 131072)):
        cases.append(one(rows, ctx, PREFILL, "prefill", host_lines=(rows, ctx) == (4096, 32768)))
    for ctx in (32768, 131072):
        for rows in (1, 4, 16, 64, 256):
            cases.append(one(rows, ctx, SMALL, "small", host_lines=(rows, ctx) == (1, 131072)))
    cases.append(Case("mixed5", (1000, 8192, 24576, 65536, 131072), (200, 1024, 2048, 768, 256),
                      SMALL, "mixed"))
    for rows, ctx in ((4096, 32768), (8192, 131072)):
        for dist in DISTS[1:]:
            cases.append(one(rows, ctx, ("topk",), "topk", f"/{dist}", dist=dist))
    for kb in (16, 128, 512):
        cases.append(one(4096, 32768, ("attention",), "page16", f"/p16-sel{kb * 4}",
                         page_size=16, Kb=kb))
    cases.append(one(4096, 32768, ("attention",), "hybrid", "/p784", page_size=784))
    cases.append(one(4096, 32768, ("select", "attention", "prefill"), "bf16", "/bf16",
                     dtype="bfloat16"))
    # issues 20 and 21: attention in bfloat16 at few rows, and the other tensor-parallel head
    # shapes (TP8 3/1, TP2 12/1, 24/2) at few rows and at 4096 x 32K, beside the same peers
    for rows in (1, 16, 256):
        cases.append(one(rows, 32768, ("attention",), "bf16", "/bf16", dtype="bfloat16"))
    for hq, hkv in ((3, 1), (12, 1), (24, 2)):
        for rows in (1, 16, 256, 4096):
            cases.append(one(rows, 32768, ("attention",), "heads", f"/h{hq}-{hkv}", Hq=hq, Hkv=hkv))
    # issue 20's other bfloat16 row counts and 131K (last, so that every earlier case keeps its seed)
    for ctx, counts in ((32768, (4, 64)), (131072, (1, 4, 16, 64, 256))):
        for rows in counts:
            cases.append(one(rows, ctx, ("attention",), "bf16", "/bf16", dtype="bfloat16"))
    if quick:
        keep = {"4096x32K", "16x131K", "mixed5", "4096x32K/concentrated", "4096x32K/p16-sel64",
                "4096x32K/p784", "4096x32K/bf16"}
        cases = [c for c in cases if c.name in keep]
    return [replace(c, seed=i + 1) for i, c in enumerate(cases)]


class Gen:
    """Random arrays on the device (torch) or, without a GPU, on the host (NumPy)."""

    def __init__(self, seed, torch=None):
        self.torch = torch
        self.rng = np.random.default_rng(seed)
        if torch is not None:
            self.g = torch.Generator(device="cuda")
            self.g.manual_seed(seed)

    def normal(self, shape, dtype):
        if self.torch is None:
            return self.rng.standard_normal(shape, dtype=np.float32).astype(dtype)
        t = self.torch
        return t.randn(shape, generator=self.g, device="cuda", dtype=t.float32).to(getattr(t, dtype))

    def uniform(self, shape):
        if self.torch is None:
            return self.rng.random(shape, dtype=np.float32)
        return self.torch.rand(shape, generator=self.g, device="cuda")

    def dev(self, a):
        """A host array on the device (int32/float arrays keep their dtype)."""
        if self.torch is None:
            return np.ascontiguousarray(a)
        return self.torch.from_numpy(np.ascontiguousarray(a)).cuda()

    def empty(self, shape, dtype):
        name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
        if self.torch is None:
            return np.empty(shape, name)
        return self.torch.empty(shape, dtype=getattr(self.torch, name), device="cuda")


def host(x):
    """NumPy copy of a torch tensor (bfloat16 widened to float32), numba device array or ndarray."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "copy_to_host"):
        return x.copy_to_host()
    if str(x.dtype) == "torch.bfloat16":
        x = x.float()
    return x.detach().cpu().numpy()


def draw_groups(nb, kb, overlap, rng):
    """Groups ``[rows, kb]`` (ascending, -1 padded) of rows with visible group counts ``nb`` (one
    request, non-decreasing ``nb``), adjacent rows sharing ~``overlap``; and the realised overlap."""
    rows = nb.size
    g = np.full((rows, kb), -1, np.int64)
    short = nb <= kb
    for i in np.flatnonzero(short):
        g[i, :nb[i]] = np.arange(nb[i])
    idx = np.flatnonzero(~short)
    if idx.size == 0:
        return g, None
    n = nb[idx][:, None]
    j = np.arange(kb)[None, :]
    cnt = (n - 1 - j) // kb + 1
    val = j + kb * np.floor(rng.random((idx.size, kb)) * cnt).astype(np.int64)
    event = rng.random((idx.size, kb)) >= overlap
    event[0] = True
    last = np.maximum.accumulate(np.where(event, np.arange(idx.size)[:, None], 0), axis=0)
    sel = np.take_along_axis(val, last, axis=0)
    same = (sel[1:] == sel[:-1]).mean() if idx.size > 1 else None
    g[idx] = np.sort(sel, axis=1)
    return g, same


def expand_np(groups, nb, pos, r):
    """Tokens ascending (tail last), -1 padded, and counts, of groups ``[rows, kb]`` (spec §5)."""
    rows, kb = groups.shape
    big = np.iinfo(np.int64).max
    body = np.where(groups[:, :, None] >= 0, groups[:, :, None] * r + np.arange(r), big)
    tail = r * nb[:, None] + np.arange(r - 1)[None, :]
    tail = np.where(tail <= pos[:, None], tail, big)
    tok = np.sort(np.concatenate([body.reshape(rows, kb * r), tail], axis=1), axis=1)
    counts = (tok != big).sum(axis=1)
    return np.where(tok == big, -1, tok).astype(np.int32), counts.astype(np.int32)


class Problem:
    """Inputs of one case, shared by every implementation (the same device memory).

    Tensors (torch on a GPU, NumPy in the simulator smoke run): ``req_ids``, ``positions``,
    ``seq_lens``, ``row_lens`` (seq_len of each row) int32; ``block_table [reqs, cols]`` int32;
    ``k_cache``/``v_cache [pages, page_size, Hkv, D]``; ``q [rows, Hq, D]``; ``qi [rows, Hi, Di]``;
    ``index_cache [pages, page_size // r, Di]`` (numqsa's canonical layout) and ``index_trt``, a
    ``[pages, page_size, 1, Di]`` view of the same memory that holds key ``e`` at token slot
    ``r*e + r-1`` (TensorRT-LLM's side cache; its other slots alias neighbouring keys and are never
    read by scoring); ``tokens``/``counts``/``groups`` the drawn attention selection; ``scores``
    (top-k stage input). Host copies for the oracle come from :meth:`host`.
    """

    def __init__(self, case, torch=None):
        self.case, self.torch = case, torch
        c = case
        gen = self.gen = Gen(c.seed, torch)
        rng = gen.rng
        lens = np.asarray(c.seq_lens, np.int64)
        per = np.asarray(c.rows_per_req, np.int64)
        self.req_np = np.concatenate([np.full(k, q) for q, k in enumerate(per)]).astype(np.int32)
        self.pos_np = np.concatenate([np.arange(lens[q] - k, lens[q])
                                      for q, k in enumerate(per)]).astype(np.int32)
        self.lens_np = lens.astype(np.int32)
        self.nb_np = np.minimum((self.pos_np.astype(np.int64) + 1) // c.r, lens[self.req_np] // c.r)
        self.G = int(lens.max()) // c.r
        ps = c.page_size
        npg = -(-lens // ps)
        cols = int(npg.max())
        self.num_pages = int(npg.sum()) + int(npg.sum()) // 8 + 1
        perm = rng.permutation(self.num_pages)
        table = np.full((lens.size, cols), -1, np.int64)
        at = 0
        for q, n in enumerate(npg):
            table[q, :n] = perm[at:at + n]
            at += n
        self.table_np = table.astype(np.int32)
        self.req_ids, self.positions, self.seq_lens = (gen.dev(x) for x in
                                                       (self.req_np, self.pos_np, self.lens_np))
        self.row_lens = gen.dev(self.lens_np[self.req_np])
        self.block_table = gen.dev(self.table_np)
        st = set(c.stages)
        rows = c.rows
        self.index_cache = self.index_trt = self.qi = None
        if st & {"scores", "select", "prefill"}:
            self.qi = self._ar_rows((rows, c.Hi, c.Di), c.qi_corr, c.dtype)
            per_page = ps // c.r
            shift = (c.r - 1) * c.Di // c.r          # key e sits at token slot r*e + r-1
            n = self.num_pages * per_page * c.Di
            flat = gen.normal((n + shift,), c.dtype)
            self.index_cache = flat[shift:].reshape(self.num_pages, per_page, c.Di)
            if torch is not None:
                self.index_trt = torch.as_strided(flat, (self.num_pages, ps, 1, c.Di),
                                                  (per_page * c.Di, c.Di // c.r, c.Di, 1))
        self.k_cache = self.v_cache = self.q = None
        if st & {"attention", "prefill"}:
            shape = (self.num_pages, ps, c.Hkv, c.D)
            self.k_cache, self.v_cache = gen.normal(shape, c.dtype), gen.normal(shape, c.dtype)
            self.q = gen.normal((rows, c.Hq, c.D), c.dtype)
        self.overlap = None
        if "attention" in st:
            groups = np.full((rows, c.Kb), -1, np.int64)
            ov = []
            for q in range(lens.size):
                i = np.flatnonzero(self.req_np == q)
                g, same = draw_groups(self.nb_np[i], c.Kb, c.overlap, rng)
                groups[i] = g
                if same is not None:
                    ov.append((same, i.size))
            self.overlap = (float(sum(s * n for s, n in ov) / sum(n for _, n in ov)) if ov else None)
            tok, cnt = expand_np(groups, self.nb_np, self.pos_np, c.r)
            self.groups_np, self.tokens_np, self.counts_np = groups.astype(np.int32), tok, cnt
            self.tokens, self.counts, self.groups = (gen.dev(x) for x in (tok, cnt, self.groups_np))
        self.scores = None
        if "topk" in st:
            self.scores = self._scores(c.dist)
        self._host = {}

    def _ar_rows(self, shape, corr, dtype):
        """Rows of an AR(1) process along axis 0 (unit variance), per request segment."""
        gen = self.gen
        x = gen.normal(shape, "float32")
        b = (1 - corr * corr) ** 0.5
        starts = set(np.flatnonzero(np.r_[True, self.req_np[1:] != self.req_np[:-1]]).tolist())
        for i in range(1, shape[0]):
            if i not in starts:
                x[i] = corr * x[i - 1] + b * x[i]
        if self.torch is None:
            return x.astype(dtype)
        return x.to(getattr(self.torch, dtype))

    def _scores(self, dist):
        """Synthetic float32 scores ``[rows, G]``, ``-inf`` beyond each row's visible groups."""
        c, gen = self.case, self.gen
        shape = (c.rows, self.G)
        if dist == "relu":                 # a head sum of ReLU'd dot products, as the indexer's
            s = gen.uniform(shape) * 0
            for _ in range(c.Hi):
                s += gen.normal(shape, "float32").clip(0)
            s *= c.Di ** -0.5
        elif dist == "concentrated":       # 32 large scores per row, the rest near zero
            s = gen.uniform(shape) * 1e-3
            hot = gen.uniform(shape) < 32.0 / self.G
            s = s + hot * (1.0 + gen.uniform(shape))
        elif dist == "plateau":            # ~0.6% positive, the rest exact zeros (ties)
            s = (gen.normal(shape, "float32") - 2.5).clip(0)
        elif dist == "fewvalues":          # 8 distinct values
            u = gen.uniform(shape) * 8
            s = (np.floor(u) if self.torch is None else u.floor()) / 8
        else:
            raise ValueError(dist)
        e = np.arange(self.G)
        if self.torch is None:
            return np.where(e[None, :] < self.nb_np[:, None], s, -np.inf).astype(np.float32)
        t = self.torch
        vis = t.from_numpy(e).cuda()[None, :] < t.from_numpy(self.nb_np).cuda()[:, None]
        return t.where(vis, s, t.full_like(s, float("-inf"))).contiguous()

    def host(self, name):
        """Host (NumPy) copy of a problem tensor, cached."""
        if name not in self._host:
            self._host[name] = host(getattr(self, name))
        return self._host[name]

    def sample_rows(self, n=8):
        """Rows the oracle checks: the first, the last, and random others (seeded per case)."""
        rows = self.case.rows
        if rows <= n:
            return np.arange(rows)
        rng = np.random.default_rng(self.case.seed + 12345)
        mid = rng.choice(np.arange(1, rows - 1), size=n - 2, replace=False)
        return np.unique(np.r_[0, mid, rows - 1])

    # ---- FLOP / byte counts (oracle docstrings) ----
    def counts_for(self, stage, impl=""):
        """``(flop, bytes)`` the stage must do at least."""
        c = self.case
        rows, G, kb, r = c.rows, self.G, c.Kb, c.r
        isz = 2 if c.dtype in ("float16", "bfloat16") else 4
        W = kb * r + r - 1
        nb = self.nb_np
        s_flop = 2.0 * c.Hi * c.Di * float(nb.sum())
        keys = float(sum(n // r for n in c.seq_lens))
        s_bytes = rows * c.Hi * c.Di * isz + keys * c.Di * isz + rows * G * 4
        t_bytes = rows * G * 4 + rows * kb * 4
        e_bytes = rows * kb * 4 + rows * (W + 1) * 4
        if stage == "scores":
            return s_flop, s_bytes
        if stage == "topk":
            return 0.0, t_bytes
        if stage == "expand":
            return 0.0, e_bytes
        if stage == "select":
            return s_flop, s_bytes + t_bytes + e_bytes
        a_flop, a_bytes = self.attention_counts(impl)
        if stage == "attention":
            return a_flop, a_bytes
        return s_flop + a_flop, s_bytes + t_bytes + e_bytes + a_bytes

    def attention_counts(self, impl=""):
        c = self.case
        isz = 2 if c.dtype in ("float16", "bfloat16") else 4
        io = 2 * c.rows * c.Hq * c.D * isz
        if impl == "sdpa":                 # dense causal: every visible token, K/V read once
            vis = self.pos_np.astype(np.float64) + 1
            return 4.0 * c.Hq * c.D * vis.sum(), io + 2 * c.Hkv * c.D * isz * float(sum(c.seq_lens))
        cnt = getattr(self, "counts_np", None)
        if cnt is None:                    # prefill without a drawn selection: the expected count
            cnt = np.minimum(self.nb_np, c.Kb) * c.r + (self.pos_np + 1 - c.r * self.nb_np)
        flop = 4.0 * c.Hq * c.D * float(np.sum(cnt))
        return flop, io + self.unique_kv_bytes()

    def unique_kv_bytes(self, group_rows=8):
        """K+V bytes that groups of ``group_rows`` adjacent rows must read once (issue 4's floor)."""
        if "_ukv" in self._host:
            return self._host["_ukv"]
        c = self.case
        tok = getattr(self, "tokens_np", None)
        if tok is None:
            cnt = np.minimum(self.nb_np, c.Kb) * c.r + (self.pos_np + 1 - c.r * self.nb_np)
            v = float(np.sum(cnt))
        else:
            rows, W = tok.shape
            pad = (-rows) % group_rows
            key = np.where(tok >= 0, tok.astype(np.int64) + self.req_np[:, None].astype(np.int64)
                           * (1 << 32), -1)
            key = np.concatenate([key, np.full((pad, W), -1, np.int64)]).reshape(-1, group_rows * W)
            if self.torch is not None:
                t = self.torch.from_numpy(key).cuda().sort(dim=1).values
                distinct = ((t[:, 1:] != t[:, :-1]) & (t[:, 1:] >= 0)).sum() + (t[:, 0] >= 0).sum()
                v = float(distinct.item())
            else:
                s = np.sort(key, axis=1)
                v = float(((s[:, 1:] != s[:, :-1]) & (s[:, 1:] >= 0)).sum() + (s[:, 0] >= 0).sum())
        isz = 2 if c.dtype in ("float16", "bfloat16") else 4
        self._host["_ukv"] = v * 2 * c.Hkv * c.D * isz
        return self._host["_ukv"]

    def floor_ms(self, stage, impl=""):
        flop, nbytes = self.counts_for(stage, impl)
        return max(flop / PEAK_FLOPS, nbytes / PEAK_BYTES) * 1e3, flop, nbytes
