"""Timeline of the 1-row attention graph from globaltimer stamps (grouped.TUNING ts=1): a stamp
kernel before the graph (t_a) and after it (t_b), the direct blocks' and the merge blocks' stamps.
L2 flushed before each repetition, as the bench does. Medians over --iters repetitions, in us."""
import argparse, os, sys
import numpy as np
HERE = "/work/main/bench" if os.path.exists("/work/main/bench") else os.path.join(os.getcwd(), "bench")
sys.path.insert(0, HERE); sys.path.insert(0, os.path.dirname(HERE))
from numba import cuda, uint32, int32
import bench_attention as BA
import numqsa
from numqsa import launch
from numqsa.kernels import grouped
from numqsa.kernels.smem import global_timer
from numqsa.stages.attention import attention_launch
from attention_probe import parse_case


@cuda.jit
def mark(buf, i):
    buf[i] = int32(global_timer())


@cuda.jit
def flush(buf):
    i = cuda.grid(1)
    s = cuda.gridsize(1)
    while i < buf.size:
        buf[i] = 0
        i += s


def rel(x, t0):
    return ((x.astype(np.int64) - int(t0)) % (1 << 32)).astype(np.float64) / 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1x32K,16x32K")
    ap.add_argument("--tune", default="")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--no-flush", action="store_true", help="keep L2 warm (code, K/V, ids)")
    args = ap.parse_args()
    fb = cuda.device_array(64 * 1024 * 1024, np.float32)
    tb = cuda.device_array(4, np.int32)
    variants = [dict((kv.split("=")[0], int(kv.split("=")[1])) for kv in v.split(",") if kv)
                for v in args.tune.split(";")] if args.tune else [{}]
    # the stamp kernels alone
    base = []
    for _ in range(args.iters):
        flush[264, 256](fb); mark[1, 1](tb, 0); mark[1, 1](tb, 1); cuda.synchronize()
        t = tb.copy_to_host(); base.append(rel(t[1:2], t[0])[0])
    print(f"mark -> mark alone: {np.median(base):.2f} us")
    for case in args.cases.split(","):
        rows, ctx = parse_case(case)
        w = BA.make_workload(rows, ctx, seed=rows + ctx)
        p = w["problem"]
        dv = {k: cuda.to_device(np.ascontiguousarray(v)) for k, v in p.items()}
        tok, cnt = cuda.to_device(w["tokens"]), cuda.to_device(w["counts"])
        out = cuda.device_array(p["q"].shape, np.float16)
        lse = cuda.device_array(p["q"].shape[:2], np.float32)
        for tune in variants:
            ws = numqsa.Workspace()
            grouped.TUNING.clear(); grouped.TUNING.update(tune); grouped.TUNING["ts"] = 1
            with launch.recording() as records:
                attention_launch(dv["q"], dv["k_cache"], dv["v_cache"], dv["block_table"], tok, cnt,
                                 dv["req_ids"], dv["seq_lens"], route_name="page4",
                                 out=(out, lse), workspace=ws, validate=False)
            st = grouped.TUNING["_stamps"]
            prog = launch.Program(records, [])
            prog([], 0); cuda.synchronize()
            nm = rows * p["q"].shape[1]
            nb = st.shape[0] - nm
            res = {}
            for it in range(args.iters):
                if not args.no_flush:
                    flush[264, 256](fb)
                mark[1, 1](tb, 0); prog([], 0); mark[1, 1](tb, 1)
                cuda.synchronize()
                t = tb.copy_to_host(); s = st.copy_to_host()
                t0 = t[0]
                d, m = s[:nb], s[nb:]
                vals = {"direct first entry": rel(d[:, 0], t0).min(),
                        "direct last entry": rel(d[:, 0], t0).max(),
                        "verdict (median block)": np.median(rel(d[:, 1], t0)),
                        "stage 0 landed (median)": np.median(rel(d[:, 2], t0)),
                        "chunk 1 ready (median)": np.median(rel(d[:, 12], t0)),
                        "chunk 1 done (median)": np.median(rel(d[:, 3], t0)),
                        "chunk 2 ready (median)": np.median(rel(d[:, 13], t0)),
                        "chunk 2 done (median)": np.median(rel(d[:, 4], t0)),
                        "chunk 3 ready (median)": np.median(rel(d[:, 14], t0)),
                        "chunk 3 done (median)": np.median(rel(d[:, 5], t0)),
                        "chunk 4 ready (median)": np.median(rel(d[:, 15], t0)),
                        "chunk 4 done (median)": np.median(rel(d[:, 6], t0)),
                        "consumer end (median)": np.median(rel(d[:, 10], t0)),
                        "consumer end (last)": rel(d[:, 10], t0).max(),
                        "producer end (last)": rel(d[:, 11], t0).max(),
                        "merge first entry": rel(m[:, 0], t0).min(),
                        "merge wait done (last)": rel(m[:, 1], t0).max(),
                        "merge loads (last)": rel(m[:, 2], t0).max(),
                        "merge end (last)": rel(m[:, 3], t0).max(),
                        "t_b (mark after graph)": rel(t[1:2], t0)[0]}
                for k, v in vals.items():
                    res.setdefault(k, []).append(v)
            tag = (",".join(f"{a}={b}" for a, b in tune.items()) or "default") + (
                " (L2 warm)" if args.no_flush else " (L2 flushed)")
            print(f"--- {case} {tag}: {nb} direct blocks, {nm} merge blocks (us from t_a, median of {args.iters})")
            for k, v in res.items():
                print(f"  {k:28s} {np.median(v):7.2f}   (p10 {np.percentile(v, 10):6.2f}, p90 {np.percentile(v, 90):6.2f})")
    grouped.TUNING.clear()


if __name__ == "__main__":
    main()
