"""Host time per call on a GPU kept busy (launches only enqueue): ``python tests/gpu_host_time.py OUT.json``.

Median of 50 calls each, torch tensors in: the wrapper's ``run`` (whole prefill), ``run_select``,
``run_attention``, and the functional ``qsa_prefill`` with default arguments (device int32
metadata). A call that synchronised would take the busy GPU's remaining time instead.
"""
import json
import sys
import time

import numpy as np
import torch

import numqsa
from oracle.problems import make_problem

META = ("req_ids", "positions", "seq_lens", "block_table", "index_block_table")
LAYER = ("qi", "index_cache", "q", "k_cache", "v_cache")
ARGS = ("qi", "index_cache", "index_block_table", "q", "k_cache", "v_cache", "block_table",
        "req_ids", "positions", "seq_lens")


def median_us(fn, n=50):
    torch.cuda.synchronize()
    torch.cuda._sleep(int(1e9))                     # ~0.5 s of GPU work queued ahead
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    busy = torch.cuda.current_stream().query() is False
    torch.cuda.synchronize()
    return float(np.median(ts) * 1e6), busy


def main(path):
    res = {"device": torch.cuda.get_device_name(), "numba_cuda": __import__("numba_cuda").__version__}
    for rows, ctx in ((1, 4096), (1024, 8192)):
        p = make_problem([ctx], rows_per_req=[rows], page_size=64, dtype=np.float16, seed=0)
        t = {k: torch.from_numpy(np.ascontiguousarray(v)).cuda() for k, v in p.items()
             if isinstance(v, np.ndarray)}
        w = numqsa.QSAPrefillWrapper(Hi=4, Di=128, Hq=6, Hkv=1, D=256, r=4, Kb=512)
        w.plan(*[t[k] for k in META])
        layer = [t[k] for k in LAYER]
        o = torch.empty(rows, 6, 256, dtype=torch.float16, device="cuda")
        lse = torch.empty(rows, 6, dtype=torch.float32, device="cuda")
        w.run(*layer, out=(o, lse))
        tok, cnt, _ = w.run_select(t["qi"], t["index_cache"])
        w.run_attention(t["q"], t["k_cache"], t["v_cache"], tok, cnt)
        torch.cuda.synchronize()
        progs = list(w._programs.values())
        case = {"launches": [pr.num_launches for pr in progs], "fast": [pr.fast for pr in progs],
                "fallback": [pr.fallback_reason for pr in progs]}
        for name, fn in (("run_out", lambda: w.run(*layer, out=(o, lse))),
                         ("run_fresh", lambda: w.run(*layer)),
                         ("run_select", lambda: w.run_select(t["qi"], t["index_cache"])),
                         ("run_attention", lambda: w.run_attention(t["q"], t["k_cache"], t["v_cache"],
                                                                   tok, cnt)),
                         ("qsa_prefill_default", lambda: numqsa.qsa_prefill(*[t[k] for k in ARGS]))):
            fn()
            us, busy = median_us(fn)
            case[name + "_us"] = round(us, 1)
            case[name + "_gpu_still_busy"] = busy
        case["run_us_per_launch"] = round(case["run_out_us"] / max(1, progs[0].num_launches), 1)
        res[f"{rows}x{ctx}"] = case
        print(rows, ctx, case, flush=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
