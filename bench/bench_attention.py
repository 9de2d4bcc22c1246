"""Sparse attention, generic vs page-4 route, and the workload generator of the attention benchmarks.

The benchmark against the peers is ``bench/run.py``; launch-shape tuning of the grouped kernel is
``bench/attention_probe.py --tune``.

Workload: one request, rows at the last positions of a T-token context, Hq 6 / Hkv 1 / D 256,
float16, page size 64 in random physical order; each row selects Kb = 512 groups (2048 tokens) plus
its 0..3-token tail, keeping a fraction ``--overlap`` (default 0.82) of the previous row's groups
(the measured overlap is reported). Cases: both routes at 4095 / 4096 / 8192 rows x 32K and
8192 x 131K, a page-16 sweep of 64 / 512 / 2048 selected tokens at 4096 rows, the hybrid geometry's
784-token KV pages at 4096 x 32K (its 16-token pages are the index cache's, which attention never
reads), and a PyTorch eager gather + SDPA route when torch is importable.

Per case: median time of ``--iters`` launches (CUDA events; compilation and host copies outside),
effective TFLOP/s (``4 * Hq * D * sum(counts)``), unique K/V bytes per row group of ``group_rows``
rows, and the floor ``max(FLOP / 777e12, bytes / 4.24e12)`` (H200 float16 matmul peak and copy
bandwidth measured in NUMBA_NOTES.md), with bytes = unique K/V bytes of all groups + q + out.
Run: ``python bench/bench_attention.py [--json out.json] [--quick]``.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

PEAK_FLOPS = 777e12
PEAK_BYTES = 4.24e12
HQ, HKV, D, R = 6, 1, 256, 4


def make_workload(rows, context, *, page_size=64, kb=512, overlap=0.82, seed=0, dtype=np.float16):
    """Problem arrays (host), the selection ``tokens``/``counts`` and the measured row overlap."""
    rng = np.random.default_rng(seed)
    pos = np.arange(context - rows, context, dtype=np.int32)
    num_pages = -(-context // page_size)
    perm = rng.permutation(num_pages + num_pages // 8 + 1)
    table = perm[:num_pages][None, :].astype(np.int32)
    n_phys = int(perm.size)
    k = rng.standard_normal((n_phys, page_size, HKV, D), dtype=np.float32).astype(dtype)
    v = rng.standard_normal((n_phys, page_size, HKV, D), dtype=np.float32).astype(dtype)
    q = rng.standard_normal((rows, HQ, D), dtype=np.float32).astype(dtype)
    nb = (pos + 1) // R
    groups = np.empty((rows, kb), np.int64)
    prev = None
    same = []
    for i in range(rows):
        n = int(nb[i])
        k_i = min(kb, n)
        if prev is None:
            g = np.sort(rng.choice(n, size=k_i, replace=False))
        else:
            keep = prev[rng.random(prev.size) < overlap]
            keep = keep[keep < n]
            mask = np.ones(n, bool)
            mask[keep] = False
            free = np.flatnonzero(mask)
            g = np.sort(np.r_[keep, rng.choice(free, size=k_i - keep.size, replace=False)])
            same.append(np.intersect1d(g, prev, assume_unique=True).size / k_i)
        groups[i, :k_i] = g
        groups[i, k_i:] = -1
        prev = g
    tail = (pos + 1) - R * nb
    width = kb * R + R - 1
    tokens = np.full((rows, width), -1, np.int32)
    body = (groups[:, :, None] * R + np.arange(R)).reshape(rows, kb * R)
    tokens[:, :kb * R] = np.where(np.repeat(groups, R, axis=1) >= 0, body, -1)
    counts = np.minimum(nb, kb) * R + tail
    for t in range(1, R):
        rows_t = np.flatnonzero(tail >= t)
        tokens[rows_t, (np.minimum(nb, kb) * R)[rows_t] + t - 1] = R * nb[rows_t] + t - 1
    problem = dict(q=q, k_cache=k, v_cache=v, block_table=table,
                   req_ids=np.zeros(rows, np.int32), positions=pos,
                   seq_lens=np.array([context], np.int32))
    return dict(problem=problem, tokens=tokens, counts=counts.astype(np.int32),
                overlap=float(np.mean(same)) if same else 1.0)


def unique_kv_bytes(tokens, counts, group_rows):
    """K+V bytes a group of ``group_rows`` adjacent rows must read once (union of its tokens)."""
    total = 0
    for a in range(0, tokens.shape[0], group_rows):
        sel = [tokens[i, :counts[i]] for i in range(a, min(a + group_rows, tokens.shape[0]))]
        total += np.unique(np.concatenate(sel)).size
    return total * HKV * D * 2 * 2


def time_launches(fn, iters):
    from numba import cuda
    fn()                      # compile + warm up
    cuda.synchronize()
    start, stop = cuda.event(), cuda.event()
    times = []
    for _ in range(iters):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cuda.event_elapsed_time(start, stop) * 1e-3)
    return float(np.median(times))


def bench_case(name, w, route, iters, group_rows):
    from numba import cuda

    import numqsa
    p = w["problem"]
    dev = {k: cuda.to_device(np.ascontiguousarray(v)) for k, v in p.items()}
    tok, cnt = cuda.to_device(w["tokens"]), cuda.to_device(w["counts"])
    rows = p["q"].shape[0]
    out = cuda.device_array((rows, HQ, D), np.float16)
    lse = cuda.device_array((rows, HQ), np.float32)

    def run():
        numqsa.sparse_attention(dev["q"], dev["k_cache"], dev["v_cache"], dev["block_table"], tok, cnt,
                                dev["req_ids"], dev["seq_lens"], route_name=route, out=(out, lse))

    t = time_launches(run, iters)
    flop = 4.0 * HQ * D * float(w["counts"].sum())
    kv = unique_kv_bytes(w["tokens"], w["counts"], group_rows)
    io = 2 * rows * HQ * D * 2
    floor = max(flop / PEAK_FLOPS, (kv + io) / PEAK_BYTES)
    return dict(case=name, route=route, rows=rows, time_ms=t * 1e3, tflops=flop / t / 1e12,
                kv_bytes_per_group=kv / -(-rows // group_rows), floor_ms=floor * 1e3,
                overlap=w["overlap"], result=out.copy_to_host())


def bench_torch(name, w, iters):
    import torch
    p = w["problem"]
    dev = "cuda"
    k = torch.from_numpy(p["k_cache"]).to(dev)
    v = torch.from_numpy(p["v_cache"]).to(dev)
    q = torch.from_numpy(p["q"]).to(dev)
    table = torch.from_numpy(p["block_table"][0].astype(np.int64)).to(dev)
    tok = torch.from_numpy(np.maximum(w["tokens"], 0).astype(np.int64)).to(dev)
    valid = torch.from_numpy(w["tokens"] >= 0).to(dev)
    ps = k.shape[1]

    def run():
        outs = []
        for a in range(0, q.shape[0], 512):
            t = tok[a:a + 512]
            pg, sl = table[t // ps], t % ps
            ks, vs = k[pg, sl, 0], v[pg, sl, 0]                # [n, W, D]
            # Hkv = 1: the Hq heads of a row are the "query length" of one SDPA batch entry.
            outs.append(torch.nn.functional.scaled_dot_product_attention(
                q[a:a + 512], ks, vs, attn_mask=valid[a:a + 512][:, None, :]))
        return outs

    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        run()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e-3)
    t = float(np.median(times))
    flop = 4.0 * HQ * D * float(w["counts"].sum())
    return dict(case=name, route="torch_eager", rows=q.shape[0], time_ms=t * 1e3,
                tflops=flop / t / 1e12, kv_bytes_per_group=float("nan"), floor_ms=float("nan"),
                overlap=w["overlap"])


def environment():
    from numba import cuda
    import numba
    info = dict(python=platform.python_version(), numba=numba.__version__, numpy=np.__version__)
    try:
        dev = cuda.get_current_device()
        info.update(device=dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name),
                    cc=list(dev.compute_capability))
    except Exception as err:          # pragma: no cover - no GPU
        info["device"] = f"unavailable: {err}"
    try:
        info["git"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                     cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        info["git"] = None
    return info


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--overlap", type=float, default=0.82)
    ap.add_argument("--quick", action="store_true", help="only 4096 x 32K")
    ap.add_argument("--only", help="run the cases whose name contains this (e.g. _p784)")
    args = ap.parse_args(argv)
    from numqsa.stages.attention import route as plan_route
    t_start = time.time()
    gr = plan_route(4096, 64).profile.attention.group_rows
    env = environment()
    print(f"# {env}")
    cases = [(4096, 32768, 64, 512)] if args.quick else [
        (4095, 32768, 64, 512), (4096, 32768, 64, 512), (8192, 32768, 64, 512),
        (8192, 131072, 64, 512), (4096, 32768, 16, 16), (4096, 32768, 16, 128),
        (4096, 32768, 16, 512), (4096, 32768, 784, 512)]
    if args.only:
        cases = [c for c in cases if f"{c[0]}x{c[1] // 1024}K_p{c[2]}_sel{c[3] * 4}".find(args.only) >= 0]
    rows_out = []
    head = (f"{'case':28s} {'route':11s} {'ms':>8s} {'TFLOP/s':>8s} {'KV MB/grp':>9s} "
            f"{'floor ms':>8s} {'overlap':>7s}")
    print(head)
    for rows, ctx, ps, kb in cases:
        name = f"{rows}x{ctx // 1024}K_p{ps}_sel{kb * 4}"
        w = make_workload(rows, ctx, page_size=ps, kb=kb, overlap=args.overlap, seed=rows + ctx + kb)
        res = {}
        for route in ("generic", "page4"):
            r = bench_case(name, w, route, args.iters, gr)
            res[route] = r.pop("result")
            rows_out.append(r)
            print(f"{name:28s} {route:11s} {r['time_ms']:8.3f} {r['tflops']:8.1f} "
                  f"{r['kv_bytes_per_group'] / 1e6:9.2f} {r['floor_ms']:8.3f} {r['overlap']:7.3f}")
        diff = np.abs(res["page4"].astype(np.float32) - res["generic"].astype(np.float32))
        rel = float(np.linalg.norm(diff) / np.linalg.norm(res["generic"].astype(np.float32)))
        print(f"{'':28s} page4 vs generic: rel L2 {rel:.2e}, max abs {diff.max():.2e}")
        rows_out[-1]["rel_l2_vs_generic"] = rel
        if kb == 512 and ps == 64 and ctx == 32768 and rows == 4096:
            try:
                import torch  # noqa: F401
                r = bench_torch(name, w, max(2, args.iters // 3))
                rows_out.append(r)
                print(f"{name:28s} {'torch':11s} {r['time_ms']:8.3f} {r['tflops']:8.1f}")
            except Exception as err:
                print(f"# torch eager route skipped: {err}")
    print(f"# total {time.time() - t_start:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(environment=env, overlap=args.overlap, group_rows=gr, cases=rows_out), f,
                      indent=1)


if __name__ == "__main__":
    main()
