"""Attention development loop: one GPU call compiles, checks against the oracle, times, prints a table.

    python3 bench/attention_probe.py [--cases 4096x32K,1x32K] [--iters 20] [--hq 6 --hkv 1]

Per case (bench_attention's workload: one request, rows at the end of the context, page size 64
permuted, 2051 selected, adjacent rows sharing ~82% of their groups): the planned route of
``numqsa.sparse_attention`` (GPU-only time: the calls are enqueued behind a spin kernel, CUDA events,
median of ``--iters``), checked against the float64 oracle on sampled rows (rel L2, cosine) and
bitwise over reruns and against the case's first ``--tune`` variant (or ``--ref``'s saved
output, across processes). With ``--trtllm PATH`` the TensorRT-LLM kernel is timed on the same
inputs through ``bench/peers`` when that adapter exists.
"""
import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)


CACHE = {}


def parse_case(s):
    rows, ctx = s.lower().split("x")
    return int(rows), int(ctx.rstrip("k")) * 1024


def spin_kernel():
    from numba import cuda

    @cuda.jit
    def spin(n):
        if cuda.threadIdx.x == 0:
            for _ in range(n):
                cuda.nanosleep(1000)
    return spin


def gpu_time(fn, iters, spin):
    """Median GPU-only ms of ``fn`` (enqueued behind a spin kernel so host time is hidden)."""
    from numba import cuda
    fn()
    cuda.synchronize()
    times = []
    for _ in range(iters):
        spin[1, 32](5000)
        a, b = cuda.event(), cuda.event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(cuda.event_elapsed_time(a, b))
    return float(np.median(times))


def check_rows(out, lse, w, rows_idx):
    import oracle
    p = w["problem"]
    q = p["q"][rows_idx]
    eo, el = oracle.sparse_attention(q, p["k_cache"], p["v_cache"], p["block_table"],
                                     w["tokens"][rows_idx], w["counts"][rows_idx],
                                     p["req_ids"][rows_idx], p["seq_lens"])
    got = out[rows_idx].astype(np.float64)
    err = np.linalg.norm(got - eo) / max(np.linalg.norm(eo), 1e-30)
    cos = float(np.sum(got * eo) / max(np.linalg.norm(got) * np.linalg.norm(eo), 1e-30))
    finite = bool(np.isfinite(got).all() and np.isfinite(lse[rows_idx]).all())
    lerr = float(np.max(np.abs(lse[rows_idx] - el)))
    return err, cos, lerr, finite


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="4096x32K,8192x32K,1024x131K,8192x131K,1x32K,16x32K,256x32K")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--hq", type=int, default=6)
    ap.add_argument("--hkv", type=int, default=1)
    ap.add_argument("--check", type=int, default=12, help="rows checked against the oracle")
    ap.add_argument("--reruns", type=int, default=3)
    ap.add_argument("--tune", default="", help="';'-separated variants of grouped.TUNING, e.g. "
                    "'g=8,nf=2;g=4,nf=3' (benchmark-only launch shapes)")
    ap.add_argument("--ref", default=None, help="folder of each case's first output (written when "
                    "absent), so that runs in separate processes compare bitwise too")
    args = ap.parse_args()
    import bench_attention as BA
    BA.HQ, BA.HKV = args.hq, args.hkv
    from numba import cuda

    import numqsa
    spin = spin_kernel()
    ws = numqsa.Workspace()
    from numqsa.kernels import grouped
    table = []
    first = {}            # a case's first variant's output: every launch shape gives its bits
    variants = [dict((kv.split("=")[0], int(kv.split("=")[1])) for kv in v.split(",") if kv)
                for v in args.tune.split(";")] if args.tune else [{}]
    for case, tune in [(c, t) for c in args.cases.split(",") for t in variants]:
        grouped.TUNING.clear()
        grouped.TUNING.update(tune)
        rows, ctx = parse_case(case)
        t0 = time.time()
        key = (rows, ctx)
        if key not in CACHE:
            CACHE.clear()
            CACHE[key] = BA.make_workload(rows, ctx, seed=rows + ctx)
        w = CACHE[key]
        p = w["problem"]
        dev = {k: cuda.to_device(np.ascontiguousarray(v)) for k, v in p.items()}
        tok, cnt = cuda.to_device(w["tokens"]), cuda.to_device(w["counts"])
        out = cuda.device_array(p["q"].shape, np.float16)
        lse = cuda.device_array(p["q"].shape[:2], np.float32)
        plan = numqsa.stages.attention.route(rows, 64)

        def run(route=None):
            numqsa.sparse_attention(dev["q"], dev["k_cache"], dev["v_cache"], dev["block_table"],
                                    tok, cnt, dev["req_ids"], dev["seq_lens"], route_name=route,
                                    out=(out, lse), workspace=ws, validate=False)
        route = "page4"
        case = f"{case} {','.join(f'{k}={v}' for k, v in tune.items())}"
        run(route)
        cuda.synchronize()
        o1, l1 = out.copy_to_host(), lse.copy_to_host()
        if args.ref and key not in first:
            path = os.path.join(args.ref, f"{rows}x{ctx // 1024}K.npy")
            if os.path.exists(path):
                first[key] = np.load(path)
            else:
                os.makedirs(args.ref, exist_ok=True)
                np.save(path, o1)
        same = bool(np.array_equal(o1, first.setdefault(key, o1), equal_nan=True))
        for _ in range(args.reruns):
            run(route)
            same &= bool(np.array_equal(out.copy_to_host(), o1, equal_nan=True))
        rng = np.random.default_rng(0)
        idx = np.unique(np.r_[0, rows - 1, rng.integers(0, rows, args.check)])
        err, cos, lerr, finite = check_rows(o1, l1, w, idx)
        ms = gpu_time(lambda: run(route), args.iters, spin)
        table.append((case, plan.route, ms, err, cos, lerr, finite, same, w["overlap"], time.time() - t0))
        print(f"{case:>18} {route:>7} {ms:8.3f} ms  relL2 {err:.2e} cos {cos:.6f} lse {lerr:.1e} "
              f"finite {finite} bitwise {same} overlap {w['overlap']:.2f} ({time.time() - t0:.0f} s)",
              flush=True)
    print("\ncase        ms_gpu   relL2     cos       ok")
    for case, r, ms, err, cos, lerr, finite, same, ov, _ in table:
        ok = finite and same and err <= 1e-3 and cos >= 0.99999
        print(f"{case:>18} {ms:8.3f} {err:9.2e} {cos:9.6f} {'ok' if ok else 'FAIL'}")


if __name__ == "__main__":
    main()
