"""Where one planned attention call's GPU time goes: the recorded chain replayed as CUDA graphs of
its first 1, 2, ... launches (the differences are each launch's marginal cost inside the graph,
launch gap included), for each launch shape of ``--tune`` (``grouped.TUNING`` variants that keep
the bits: e.g. ``ds=1;ds=2;ds=4``), each checked bitwise against the first.

    python3 bench/chain_split.py --cases 1x32K,16x32K --tune 'ds=2;ds=4' [--iters 200] [--hq 12 --hkv 1]

GPU-only ms (CUDA events around one graph launch queued behind a spin kernel, median of
``--iters``). Rows as ``bench_attention.make_workload`` (page 64 in random order, D 256; Hq 6 and
Hkv 1 unless ``--hq``/``--hkv`` say otherwise).
With ``--floor`` each variant's line is followed by the same graph prefixes of empty kernels of
the recorded grids and blocks (the graph edges as recorded): what a node costs here before it does
any work.
"""
import argparse
import dataclasses
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1x32K,16x32K")
    ap.add_argument("--tune", default="")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--hq", type=int, default=6)
    ap.add_argument("--hkv", type=int, default=1)
    ap.add_argument("--floor", action="store_true",
                    help="also time empty kernels of the same grids")
    args = ap.parse_args()
    from numba import cuda

    import bench_attention as BA
    import numqsa
    from attention_probe import gpu_time, parse_case, spin_kernel
    from numqsa import launch
    from numqsa.kernels import grouped
    from numqsa.stages.attention import attention_launch
    spin = spin_kernel()
    BA.HQ, BA.HKV = args.hq, args.hkv

    @cuda.jit
    def empty():
        pass

    def prefixes(records, full=None):
        """Median GPU ms of the graphs of the first 1, 2, ... records (edges as recorded)."""
        times = []
        for k in range(1, len(records) + 1):
            sub = [dataclasses.replace(r, after=r.after if (r.after is None or r.after < k)
                                       else None) for r in records[:k]]
            prog = full if (full is not None and k == len(records)) else launch.Program(sub, [])
            times.append(gpu_time(lambda: prog([], 0), args.iters, spin))
        return times
    variants = [dict((kv.split("=")[0], int(kv.split("=")[1])) for kv in v.split(",") if kv)
                for v in args.tune.split(";")] if args.tune else [{}]
    print(f"{'case':>8} {'variant':>8} {'prefix ms (graph of the first k launches)':>44}  bitwise")
    for case in args.cases.split(","):
        rows, ctx = parse_case(case)
        w = BA.make_workload(rows, ctx, seed=rows + ctx)
        p = w["problem"]
        dv = {k: cuda.to_device(np.ascontiguousarray(v)) for k, v in p.items()}
        tok, cnt = cuda.to_device(w["tokens"]), cuda.to_device(w["counts"])
        out = cuda.device_array(p["q"].shape, np.float16)
        lse = cuda.device_array(p["q"].shape[:2], np.float32)
        ws = numqsa.Workspace()
        ref = None
        for tune in variants:
            grouped.TUNING.clear()
            grouped.TUNING.update(tune)
            with launch.recording() as records:
                attention_launch(dv["q"], dv["k_cache"], dv["v_cache"], dv["block_table"], tok, cnt,
                                 dv["req_ids"], dv["seq_lens"], route_name="page4",
                                 out=(out, lse), workspace=ws, validate=False)
            names = [(getattr(r.kernel, "__name__", None) or r.kernel.py_func.__name__)
                     .replace("grouped_", "").split("_d256")[0][:12] for r in records]
            full = launch.Program(records, [])
            full([], 0)
            cuda.synchronize()
            got = out.copy_to_host()
            same = ref is None or np.array_equal(got, ref, equal_nan=True)
            ref = got if ref is None else ref
            times = prefixes(records, full)
            tag = ",".join(f"{a}={b}" for a, b in tune.items()) or "default"
            print(f"{case:>8} {tag:>8} " + " ".join(f"{n}:{t * 1e3:6.1f}us" for n, t in
                                                      zip(names, times)) + f"  {same}", flush=True)
            if args.floor:
                empty[1, 32]()                     # compiled before it is recorded
                cuda.synchronize()
                with launch.recording() as blanks:
                    for r in records:
                        with launch.after(r.after):
                            empty[r.grid, r.block, 0, 0]()
                times = prefixes(blanks)
                print(f"{case:>8} {'empty':>8} " + " ".join(f"{n}:{t * 1e3:6.1f}us" for n, t in
                                                           zip(names, times)), flush=True)
    grouped.TUNING.clear()


if __name__ == "__main__":
    main()
