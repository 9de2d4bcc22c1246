"""Selection kernel-tuning sweeps: index scores (tiled / light), top-k, expansion and the chain.

The benchmark against the peers is ``bench/run.py``; this script stays for kernel variants
(``--variants``) and route crossovers.

One request, query rows at the last positions of a T-token context, page size 64 in random physical
order, Hi 4, Di 128, r 4, Kb 512, float16. Times are medians of CUDA-event timings over reps after a
warm-up, with L2 flushed (a 256 MB write) before each rep. One line per case, then JSON with device,
versions and git revision to the path given.

    python bench/bench_selection.py results/selection.json [--quick]

Rates are against the H200's 777 TFLOP/s (fp16 dense, measured torch matmul) and 4.24 TB/s
(measured device-to-device copy). Minimal counts (oracle docstrings): scores FLOP 2*Hi*Di*sum(nb),
bytes rows*Hi*Di*2 + G*Di*2 + rows*G*4; top-k bytes rows*G*4 + rows*Kb*4; expansion bytes
rows*Kb*4 + rows*W*4; chain = scores + the top-k's writes + expansion.
TRT-LLM reference on this H200: scores 0.32 / top-k 0.66 / expand 0.04 ms at 4096 x 32K;
2.52 / 4.26 / 0.55 ms at 8192 x 131K.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np
from numba import cuda

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

PEAK_TFLOPS = 777.0
PEAK_TBS = 4.24
HI, DI, R, KB = 4, 128, 4, 512
TRT_MS = {(4096, 32768): dict(scores=0.32, topk=0.66, expand=0.04),
          (8192, 131072): dict(scores=2.52, topk=4.26, expand=0.55)}


def make_inputs(rows, ctx, seed=0):
    """Device arrays of one request: rows at positions ctx-rows..ctx-1, pages shuffled."""
    from numba import cuda
    rng = np.random.default_rng(seed)
    ps = 64
    G = ctx // R
    npages = -(-ctx // ps)
    table = rng.permutation(npages).astype(np.int32)[None, :]
    icache = rng.standard_normal((npages, ps // R, DI)).astype(np.float16)
    qi = rng.standard_normal((rows, HI, DI)).astype(np.float16)
    req = np.zeros(rows, np.int32)
    pos = np.arange(ctx - rows, ctx, dtype=np.int32)
    lens = np.array([ctx], np.int32)
    host = dict(qi=qi, index_cache=icache, index_block_table=table, req_ids=req, positions=pos,
                seq_lens=lens)
    dev = {k: cuda.to_device(v) for k, v in host.items()}
    nb = (pos + 1) // R
    return host, dev, G, int(nb.sum())


ARG_NAMES = ("qi", "index_cache", "index_block_table", "req_ids", "positions", "seq_lens")


class Case:
    """One workload: device inputs (``args`` in the public API's order), score and output buffers,
    and the minimal FLOP and byte counts of each stage (see the module docstring)."""

    def __init__(self, rows, ctx):
        self.rows, self.ctx = rows, ctx
        self.host, d, self.G, nbsum = make_inputs(rows, ctx)
        self.args = [d[k] for k in ARG_NAMES]
        self.req, self.pos, self.lens = self.args[3:]
        self.scores = cuda.device_array((rows, self.G), np.float32)
        self.groups = cuda.device_array((rows, KB), np.int32)
        self.tokens = cuda.device_array((rows, KB * R + R - 1), np.int32)
        self.counts = cuda.device_array(rows, np.int32)
        self.flop = 2.0 * HI * DI * nbsum
        self.sbytes = rows * HI * DI * 2 + self.G * DI * 2 + rows * self.G * 4
        self.tbytes = rows * self.G * 4 + rows * KB * 4
        self.ebytes = rows * KB * 4 + rows * (KB * R + R - 1) * 4
        self.trt = TRT_MS.get((rows, ctx), {})

    def ref(self, stage):
        return f"  (TRT-LLM {self.trt[stage]:.2f} ms)" if stage in self.trt else ""

    def line(self, name, ms, flop=None, nbytes=None, extra=""):
        return line(name, self.rows, self.ctx, ms, flop, nbytes, extra)


def _setup(args):
    """``(profile, stream, timer, t_start)`` shared by the standard run and the variants."""
    from numqsa.device import device_cc
    from numqsa.plan import arch_profile
    stream = cuda.default_stream()
    return arch_profile(device_cc()), stream, Timer(stream, args.tiny), time.time()


def crossover(results, timer, prof, stream, cases, reps, t_start=None, budget=None):
    """Tiled vs light score route at each ``(rows, ctx)``."""
    from numqsa.kernels import index_scores as KS
    for rows, ctx in cases:
        if budget is not None and time.time() - t_start > budget:
            print(f"(crossover sweep cut short: {budget} s budget)")
            break
        c = Case(rows, ctx)
        ms_t = timer(lambda: KS.launch_tiled(*c.args, c.scores, prof, stream), reps=reps, warmup=1)
        ms_l = timer(lambda: KS.launch_light(*c.args, c.scores, prof, stream), reps=reps, warmup=1)
        results.append(c.line("crossover.tiled", ms_t, c.flop, c.sbytes))
        results.append(c.line("crossover.light", ms_l, c.flop, c.sbytes))
        del c


@cuda.jit
def _fill(buf):
    i = cuda.grid(1)
    if i < buf.size:
        buf[i] = 0.0


class Timer:
    def __init__(self, stream, tiny=False):
        from numba import cuda
        self.tiny = tiny
        self.cuda = cuda
        self.stream = stream
        self.flush_buf = cuda.device_array(64 if tiny else 64 * 1024 * 1024, np.float32)  # 256 MB > L2
        self.fill = _fill[(self.flush_buf.size + 255) // 256, 256, stream]

    def flush(self):
        self.fill(self.flush_buf)

    def __call__(self, fn, reps=10, warmup=2):
        cuda = self.cuda
        if self.tiny:
            reps, warmup = 1, 0
        for _ in range(warmup):
            fn()
        cuda.synchronize()
        times = []
        for _ in range(reps):
            self.flush()
            a, b = cuda.event(), cuda.event()
            a.record(self.stream)
            fn()
            b.record(self.stream)
            b.synchronize()
            times.append(a.elapsed_time(b) if self.tiny else cuda.event_elapsed_time(a, b))
        return float(np.median(times))


def line(name, rows, ctx, ms, flop=None, nbytes=None, extra=""):
    tf = flop / ms / 1e9 if flop else None
    gbs = nbytes / ms / 1e6 if nbytes else None
    s = f"{name:22s} rows={rows:6d} ctx={ctx:7d} {ms:9.3f} ms"
    if tf is not None:
        s += f" {tf:8.2f} TFLOP/s ({100 * tf / PEAK_TFLOPS:5.1f}%)"
    if gbs is not None:
        s += f" {gbs:8.1f} GB/s ({100 * gbs / 1e3 / PEAK_TBS:5.1f}%)"
    print(s + extra, flush=True)
    return dict(name=name, rows=rows, ctx=ctx, ms=ms, tflops=tf, gbs=gbs)


def torch_route(host, G):
    """PyTorch eager baseline: fp32 matmul + relu + head sum, torch.topk, expansion."""
    import torch
    dev = torch.device("cuda")
    q = torch.from_numpy(host["qi"]).to(dev).float()
    icache = torch.from_numpy(host["index_cache"]).to(dev)
    table = torch.from_numpy(host["index_block_table"]).to(dev).long()
    pos = torch.from_numpy(host["positions"]).to(dev).long()
    e = torch.arange(G, device=dev)
    rows_pp = icache.shape[1]
    nb = (pos + 1) // R

    def scores():
        keys = icache[table[0, e // rows_pp], e % rows_pp].float()          # [G, Di]
        s = torch.relu(torch.einsum("rhd,gd->rhg", q, keys)).sum(1) / DI ** 0.5
        return s.masked_fill(e[None, :] >= nb[:, None], float("-inf"))

    def topk(s):
        return torch.topk(s, min(KB, G), dim=1).indices.sort(dim=1).values

    def expand(g):
        tok = (g[:, :, None] * R + torch.arange(R, device=dev)).flatten(1)
        tail = R * nb[:, None] + torch.arange(R - 1, device=dev)[None, :]
        tail = torch.where(tail <= pos[:, None], tail, -1)
        return torch.cat([tok, tail], 1)

    return torch, scores, topk, expand


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("json_out")
    ap.add_argument("--quick", action="store_true", help="fewer cases (smoke run)")
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)   # simulator smoke test
    ap.add_argument("--variants", action="store_true",
                    help="kernel variants (score tiles, top-k threads) and the tiled/light "
                         "crossover at small row counts, instead of the standard cases")
    args = ap.parse_args()
    if args.variants:
        return variants(args)

    import numqsa
    from numqsa.kernels import expand as KE, index_scores as KS, topk as KT

    prof, stream, timer, t_start = _setup(args)
    results = []
    cases = [(1024, 8192), (1024, 32768), (1024, 131072), (8192, 8192), (8192, 32768),
             (8192, 131072), (4096, 32768)]
    if args.quick:
        cases = [(1024, 32768), (8192, 131072)]
    if args.tiny:
        cases = [(8, 2304)]
    try:
        import torch
        have_torch = torch.cuda.is_available()
    except ImportError:
        have_torch = False
    if not have_torch:
        print("# PyTorch with CUDA is not installed: the PyTorch eager peer is skipped", flush=True)

    for rows, ctx in cases:
        c = Case(rows, ctx)
        a, sc, groups, tokens, counts = c.args, c.scores, c.groups, c.tokens, c.counts
        ms = timer(lambda: KS.launch_tiled(*a, sc, prof, stream))
        results.append(c.line("scores.tiled", ms, c.flop, c.sbytes, c.ref("scores")))
        if rows * c.G <= 8192 * 32768:
            ms = timer(lambda: KS.launch_light(*a, sc, prof, stream), reps=3, warmup=1)
            results.append(c.line("scores.light", ms, c.flop, c.sbytes))
        bits = sc.view(np.uint32)
        ms = timer(lambda: KT.launch_topk(bits, c.req, c.pos, c.lens, groups, prof, stream))
        results.append(c.line("topk", ms, None, c.tbytes, c.ref("topk")))
        ms = timer(lambda: KE.launch_expand(groups, c.req, c.pos, c.lens, tokens, counts, prof,
                                            stream))
        results.append(c.line("expand", ms, None, c.ebytes, c.ref("expand")))
        chain_bytes = c.sbytes + c.tbytes + c.ebytes

        def chain():
            KS.launch_tiled(*a, sc, prof, stream)
            KT.launch_topk(bits, c.req, c.pos, c.lens, groups, prof, stream)
            KE.launch_expand(groups, c.req, c.pos, c.lens, tokens, counts, prof, stream)
        ms = timer(chain)
        results.append(c.line("chain.kernels", ms, c.flop, chain_bytes))
        out = (tokens, counts, groups)
        ws = sc.reshape(-1)
        ms = timer(lambda: numqsa.select(*a, Kb=KB, out=out, stream=stream, workspace=ws,
                                      num_groups=c.G))
        chain_ref = f"  (TRT-LLM sum {sum(c.trt.values()):.2f} ms)" if c.trt else ""
        results.append(c.line("select.api", ms, c.flop, chain_bytes,
                              chain_ref + " incl. the API's host path"))
        if have_torch and rows * c.G <= 8192 * 32768 * 4:
            torch, t_scores, t_topk, t_expand = torch_route(c.host, c.G)
            ts = t_scores()
            ms_s = timer(t_scores, reps=5)
            ms_t = timer(lambda: t_topk(ts), reps=5)
            tg = t_topk(ts)
            ms_e = timer(lambda: t_expand(tg), reps=5)
            results.append(c.line("torch.scores", ms_s, c.flop, c.sbytes))
            results.append(c.line("torch.topk", ms_t, None, c.tbytes))
            results.append(c.line("torch.expand", ms_e, None, c.ebytes))
            del ts, tg
            torch.cuda.empty_cache()
        del c, a, sc, bits, groups, tokens, counts, out, ws   # free before the next case allocates

    # crossover: tiled vs light at one context
    sweep = [1024, 2048, 4096, 8192, 16384, 32768]
    sweep = [1024, 4096] if args.quick else [] if args.tiny else sweep
    crossover(results, timer, prof, stream, [(rows, 32768) for rows in sweep], reps=3,
              t_start=t_start, budget=150)

    try:
        rev = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True,
                                      stderr=subprocess.DEVNULL).strip()
    except Exception:
        rev = None
    import numba
    from numqsa.device import device_cc
    name = getattr(cuda.get_current_device(), "name", "numba simulator")
    meta = dict(device=name.decode() if isinstance(name, bytes) else str(name), cc=list(device_cc()),
                profile=prof.name, numba=numba.__version__, numpy=np.__version__,
                python=platform.python_version(), git=rev, peak_tflops=PEAK_TFLOPS,
                peak_tbs=PEAK_TBS, seconds=time.time() - t_start)
    os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
    with open(args.json_out, "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=1)
    print(f"wrote {args.json_out} ({meta['seconds']:.0f} s)")


def variants(args):
    """Score-kernel and top-k variants at the issue-3 shapes; tiled vs light at small row counts."""
    from numqsa.kernels import expand as KE, index_scores as KS, topk as KT

    prof, stream, timer, t_start = _setup(args)
    results = []
    cases = [(8, 2304)] if args.tiny else [(4096, 32768), (8192, 131072)]
    score_vars = [("scores.keysm.w4", dict(variant="keysm", warps=4, minb=1)),
                  ("scores.keysm.w8", dict(variant="keysm", warps=8, minb=1)),
                  ("scores.keysm.w8b2", dict(variant="keysm", warps=8, minb=2)),
                  ("scores.keysm.w4s4", dict(variant="keysm", warps=4, minb=1, span_tiles=4)),
                  ("scores.generic", dict(variant="generic"))]
    for rows, ctx in cases:
        c = Case(rows, ctx)
        a, sc = c.args, c.scores
        for name, kw in score_vars:
            ms = timer(lambda: KS.launch_tiled(*a, sc, prof, stream, **kw), reps=5, warmup=1)
            results.append(c.line(name, ms, c.flop, c.sbytes, c.ref("scores")))
        KS.launch_tiled(*a, sc, prof, stream)
        bits = sc.view(np.uint32)
        tvars = [("topk.radix", dict(route="radix"))]
        if c.G <= KT.bitmap_shape()[1]:
            tvars = [("topk.bitmap.t512", dict(route="bitmap", threads=512)),
                     ("topk.bitmap.t1024", dict(route="bitmap", threads=1024))] + tvars
        if c.G <= KT.register_groups():
            tvars = [(f"topk.registers.t{t}", dict(route="registers", threads=t))
                     for t in (512, 1024)] + tvars
        for name, kw in tvars:
            ms = timer(lambda: KT.launch_topk(bits, c.req, c.pos, c.lens, c.groups, prof, stream,
                                              **kw), reps=5, warmup=1)
            results.append(c.line(name, ms, None, c.tbytes, c.ref("topk")))

        def chain():
            KS.launch_tiled(*a, sc, prof, stream)
            KT.launch_topk(bits, c.req, c.pos, c.lens, c.groups, prof, stream)
            KE.launch_expand(c.groups, c.req, c.pos, c.lens, c.tokens, c.counts, prof, stream)
        ms = timer(chain, reps=5, warmup=1)
        results.append(c.line("chain.kernels", ms, c.flop, c.sbytes + c.tbytes + c.ebytes))
        del c, a, sc, bits
    crossover(results, timer, prof, stream,
              [] if args.tiny else [(64, 32768), (128, 32768), (256, 32768), (512, 32768),
                                    (256, 8192), (1024, 8192)], reps=5)
    os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
    with open(args.json_out, "w") as f:
        json.dump(dict(meta=dict(profile=prof.name, seconds=time.time() - t_start),
                       results=results), f, indent=1)
    print(f"wrote {args.json_out} ({time.time() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
