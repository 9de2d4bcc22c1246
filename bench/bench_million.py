"""The largest documented problem: 16,384 query rows at the end of a 1M-token context, on one GPU.

``python bench/bench_million.py --out bench/results/million.json``

One request of 1,048,576 tokens (page size 64, physical pages in random order, the index cache
sharing the main page table), Hi 4 / Di 128 / Hq 6 / Hkv 1 / D 256 / r 4 / Kb 512, float16, inputs
drawn on the device (torch). Through :class:`numqsa.QSAPrefillWrapper`: ``run_select`` (scores,
top-k, expansion) and ``run`` (the whole prefill), GPU time by CUDA events (median of 3), and the
device memory the wrapper holds beyond the inputs (``cuMemGetInfo`` before ``plan`` and after the
runs; the wrapper keeps every buffer it uses, so that is its peak) beside the formula of
:func:`numqsa.select` and what a chain that materialises the ``[rows, groups]`` float32 score
matrix at once would need. Sampled rows are checked against the float64 oracle (selection by
spec §8, attention within the float16 tolerance), and a second ``run`` must give the same bits.
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GIB = 1 << 30


def gpu_ms(torch, fn, reps=3):
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return float(np.median(times)), [round(t, 3) for t in times]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--context", type=int, default=1 << 20)
    ap.add_argument("--sample", type=int, default=12, help="rows checked against the oracle")
    args = ap.parse_args()

    import torch
    import numqsa
    import oracle
    from numqsa.stages.selection import SELECT_SCORE_BYTES, select_chunk_rows
    from numqsa.testing import assert_matches_oracle, assert_selection_matches

    rows, ctx, page, r, Kb = args.rows, args.context, 64, 4, 512
    Hi, Di, Hq, Hkv, D = 4, 128, 6, 1, 256
    G = ctx // r
    pages = ctx // page
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    t0 = time.perf_counter()
    meta = {
        "req_ids": torch.zeros(rows, dtype=torch.int32, device=dev),
        "positions": torch.arange(ctx - rows, ctx, dtype=torch.int32, device=dev),
        "seq_lens": torch.tensor([ctx], dtype=torch.int32, device=dev),
        "block_table": torch.randperm(pages, generator=g, device=dev).to(torch.int32)[None],
    }
    f16 = dict(dtype=torch.float16, device=dev, generator=g)
    qi = torch.randn(rows, Hi, Di, **f16)
    index_cache = torch.randn(pages, page // r, Di, **f16)
    q = torch.randn(rows, Hq, D, **f16)
    k_cache = torch.randn(pages, page, Hkv, D, **f16)
    v_cache = torch.randn(pages, page, Hkv, D, **f16)
    torch.cuda.synchronize()
    input_bytes = sum(x.numel() * x.element_size() for x in
                      (qi, index_cache, q, k_cache, v_cache, *meta.values()))
    outs = (torch.empty(rows, Hq, D, dtype=torch.float16, device=dev),
            torch.empty(rows, Hq, dtype=torch.float32, device=dev),
            torch.empty(rows, Kb * r + r - 1, dtype=torch.int32, device=dev),
            torch.empty(rows, dtype=torch.int32, device=dev))
    groups = torch.empty(rows, Kb, dtype=torch.int32, device=dev)
    output_bytes = sum(x.numel() * x.element_size() for x in (*outs, groups))
    print(f"inputs {input_bytes / GIB:.2f} GiB, outputs {output_bytes / GIB:.2f} GiB, drawn in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)

    torch.cuda.synchronize()
    free0, total = torch.cuda.mem_get_info()
    w = numqsa.QSAPrefillWrapper(Hi=Hi, Di=Di, Hq=Hq, Hkv=Hkv, D=D, r=r, Kb=Kb)
    w.plan(meta["req_ids"], meta["positions"], meta["seq_lens"], meta["block_table"],
           num_groups=G, validate=True)
    t0 = time.perf_counter()
    w.run_select(qi, index_cache, out=(outs[2], outs[3], groups))
    w.run(qi, index_cache, q, k_cache, v_cache, out=outs)
    torch.cuda.synchronize()
    print(f"first calls (compile + prepare) {time.perf_counter() - t0:.1f} s", flush=True)
    sel_ms, sel_all = gpu_ms(torch, lambda: w.run_select(qi, index_cache,
                                                         out=(outs[2], outs[3], groups)))
    run_ms, run_all = gpu_ms(torch, lambda: w.run(qi, index_cache, q, k_cache, v_cache, out=outs))
    free1, _ = torch.cuda.mem_get_info()
    held = free0 - free1
    first = [x.clone() for x in outs]
    w.run(qi, index_cache, q, k_cache, v_cache, out=outs)
    torch.cuda.synchronize()
    bitwise = all(bool(torch.equal(a.view(torch.int16) if a.dtype == torch.float16 else a,
                                   b.view(torch.int16) if b.dtype == torch.float16 else b))
                  for a, b in zip(first, outs))
    chunk = select_chunk_rows(rows, G)
    formula = chunk * G * 4 + rows * (Kb * r + r - 1 + Kb + 1) * 4
    print(f"select {sel_ms:.2f} ms, run {run_ms:.2f} ms; wrapper holds {held / GIB:.2f} GiB "
          f"(kept buffers {w._ws.nbytes / GIB:.2f} GiB); score chunk {chunk} rows", flush=True)

    # sampled rows against the oracle
    rng = np.random.default_rng(1)
    idx = np.unique(np.concatenate([[0, 1, rows // 2, rows - 2, rows - 1],
                                    rng.choice(rows, max(0, args.sample - 5), replace=False)]))
    h = {k: v.cpu().numpy() for k, v in meta.items()}
    ic_h = index_cache.cpu().numpy()
    sub = dict(req_ids=h["req_ids"][idx], positions=h["positions"][idx], seq_lens=h["seq_lens"])
    t0 = time.perf_counter()
    ref_scores = oracle.index_scores(qi.cpu().numpy()[idx], ic_h, h["block_table"], r=r, **sub)
    tok, cnt, grp = (outs[2].cpu().numpy()[idx], outs[3].cpu().numpy()[idx],
                     groups.cpu().numpy()[idx])
    assert_selection_matches(grp, tok, cnt, ref_scores, sub["req_ids"], sub["positions"],
                             sub["seq_lens"], Kb=Kb, r=r)
    del ic_h
    ref_out, ref_lse = oracle.sparse_attention(q.cpu().numpy()[idx], k_cache.cpu().numpy(),
                                               v_cache.cpu().numpy(), h["block_table"], tok, cnt,
                                               sub["req_ids"], sub["seq_lens"], r=r)
    st = assert_matches_oracle(outs[0].cpu().numpy()[idx], ref_out, dtype="float16")
    st_lse = assert_matches_oracle(outs[1].cpu().numpy()[idx], ref_lse, dtype="float32",
                                   what="lse")
    print(f"oracle on {idx.size} rows ({time.perf_counter() - t0:.0f} s): selection ok (spec §8), "
          f"out rel-L2 {st['rel_l2']:.2e}, lse rel-L2 {st_lse['rel_l2']:.2e}; rerun bitwise "
          f"{bitwise}", flush=True)

    res = {
        "what": "16,384 rows x 1M-token context, QSAPrefillWrapper, float16",
        "git_rev": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                  text=True).stdout.strip() or None,
        "device": torch.cuda.get_device_name(), "total_gib": round(total / GIB, 1),
        "shape": dict(rows=rows, context=ctx, page_size=page, groups=G, Hi=Hi, Di=Di, Hq=Hq,
                      Hkv=Hkv, D=D, r=r, Kb=Kb),
        "ms_gpu": {"run_select": round(sel_ms, 3), "run": round(run_ms, 3),
                   "reps": {"run_select": sel_all, "run": run_all}},
        "memory_gib": {
            "inputs": round(input_bytes / GIB, 3), "outputs_caller": round(output_bytes / GIB, 3),
            "wrapper_held": round(held / GIB, 3), "wrapper_buffers": round(w._ws.nbytes / GIB, 3),
            "select_formula": round(formula / GIB, 3),
            "select_formula_text": "min(rows, score_bytes // (4*G)) * G * 4 + "
                                   "rows * (Kb*r + r - 1 + Kb + 1) * 4",
            "score_bytes": SELECT_SCORE_BYTES, "score_chunk_rows": chunk,
            "materialising_scores": round(rows * G * 4 / GIB, 3),
        },
        "checks": {"rows_checked": idx.tolist(), "selection_spec8": True,
                   "out_rel_l2": st["rel_l2"], "lse_rel_l2": st_lse["rel_l2"],
                   "rerun_bitwise": bitwise},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res["ms_gpu"]), json.dumps(res["memory_gib"]))
    if not bitwise:
        sys.exit("rerun not bitwise equal")


if __name__ == "__main__":
    main()
