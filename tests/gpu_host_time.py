"""Host time per call on a GPU kept busy (launches only enqueue): ``python tests/gpu_host_time.py OUT.json``.

Median of 100 calls each, torch tensors in (device int32 metadata): the wrapper's ``run`` (whole
prefill), ``run_select``, ``run_attention``; the functional ``qsa_prefill``, ``select`` and
``sparse_attention`` with default arguments and in their repeated form (``out=``, ``workspace=``,
``num_groups=``, ``validate=False``); the stage functions ``index_scores``, ``topk_groups`` and
``expand_tokens`` with default arguments. ``<name>_gpu_still_busy`` says whether the GPU was still
busy after the 100 calls, i.e. no call waited for it (a call that synchronised would also take the
busy GPU's remaining time, about a second). ``<call>_new_rows``: median of 20 calls that each
see a new row count, so each records and prepares its launches anew (first call of a layout).
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
SEL = ("qi", "index_cache", "index_block_table", "req_ids", "positions", "seq_lens")


def median_us(fn, n=100):
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))                     # ~1 s of GPU work queued ahead
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
        G = ctx // 4
        sel_args = [t[k] for k in SEL]
        batch = [t[k] for k in ("req_ids", "positions", "seq_lens")]
        att_args = [t["q"], t["k_cache"], t["v_cache"], t["block_table"], tok, cnt, t["req_ids"],
                    t["seq_lens"]]
        sel_out = (torch.empty_like(tok), torch.empty_like(cnt),
                   torch.empty(rows, 512, dtype=torch.int32, device="cuda"))
        chunk = numqsa.stages.selection.select_chunk_rows(rows, G)
        sel_ws = torch.empty(chunk * G, dtype=torch.float32, device="cuda")
        att_out = (torch.empty_like(o), torch.empty_like(lse))
        att_ws = numqsa.Workspace()
        scores = numqsa.index_scores(*sel_args, num_groups=G)
        groups = numqsa.topk_groups(scores, *batch, Kb=512)
        full_ws = numqsa.Workspace()
        for name, fn in (("run_out", lambda: w.run(*layer, out=(o, lse))),
                         ("run_fresh", lambda: w.run(*layer)),
                         ("run_select", lambda: w.run_select(t["qi"], t["index_cache"])),
                         ("run_attention", lambda: w.run_attention(t["q"], t["k_cache"], t["v_cache"],
                                                                   tok, cnt)),
                         ("qsa_prefill_default", lambda: numqsa.qsa_prefill(*[t[k] for k in ARGS])),
                         ("qsa_prefill_repeated", lambda: numqsa.qsa_prefill(
                             *[t[k] for k in ARGS], workspace=full_ws, num_groups=G,
                             validate=False)),
                         ("select_default", lambda: numqsa.select(*sel_args)),
                         ("select_repeated", lambda: numqsa.select(
                             *sel_args, out=sel_out, workspace=sel_ws, num_groups=G,
                             validate=False)),
                         ("sparse_attention_default", lambda: numqsa.sparse_attention(*att_args)),
                         ("sparse_attention_repeated", lambda: numqsa.sparse_attention(
                             *att_args, out=att_out, workspace=att_ws, validate=False)),
                         ("index_scores_default", lambda: numqsa.index_scores(*sel_args)),
                         ("topk_groups_default", lambda: numqsa.topk_groups(scores, *batch, Kb=512)),
                         ("expand_tokens_default", lambda: numqsa.expand_tokens(groups, *batch))):
            fn()
            us, busy = median_us(fn)
            case[name + "_us"] = round(us, 1)
            case[name + "_gpu_still_busy"] = busy
        if rows > 1:
            # a new row count on every call (a serving loop whose batch changes): each call records
            # and prepares its launches again, the cost of the first call of a layout
            sizes = iter(range(rows - 1, 0, -1))

            def shrunk(names, n):
                return [t[k][:n] if k in ("qi", "q", "req_ids", "positions") else t[k]
                        for k in names]

            def sel_new():
                numqsa.select(*shrunk(SEL, next(sizes)))

            def att_new():
                n = next(sizes)
                numqsa.sparse_attention(t["q"][:n], t["k_cache"], t["v_cache"], t["block_table"],
                                        tok[:n], cnt[:n], t["req_ids"][:n], t["seq_lens"])

            def prefill_new():
                numqsa.qsa_prefill(*shrunk(ARGS, next(sizes)))
            for name, fn in (("select_new_rows", sel_new), ("sparse_attention_new_rows", att_new),
                             ("qsa_prefill_new_rows", prefill_new)):
                us, busy = median_us(fn, n=20)
                case[name + "_us"] = round(us, 1)
                case[name + "_gpu_still_busy"] = busy
        case["run_us_per_launch"] = round(case["run_out_us"] / max(1, progs[0].num_launches), 1)
        res[f"{rows}x{ctx}"] = case
        print(rows, ctx, case, flush=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
