"""HF transformers' Qwen4Exp QSA layer, eager vs through numqsa: prefill time and peak memory.

    python3 bench/bench_hf.py --out bench/results/hf.json [--lengths 4096 16384 32768] [--dtype float16]
    python3 bench/bench_hf.py --table bench/results/hf.json [--readme]   # the README's table

One random-weight ``Qwen4ExpTextModel`` layer of the production QSA geometry (indexer 4 x 128,
budget 2048 = Kb 512, ratio 4; attention 24 / 2 / 256, partial rotary 0.25, theta 1e7; hidden 2048,
4 small experts), one request, the whole prompt in one forward (``use_cache=False``), HF's
``eager`` attention against the same model after ``numqsa.integrations.transformers.enable``.

Each (implementation, length) runs in its own process, killed after ``--timeout`` seconds (60):
HF's indexer loops over query rows in Python and materialises ``[queries, keys]`` masks and
logits, so long prompts take long or run out of memory; such a case is reported as ``timeout`` or
``oom``, not as a crash. Inside a case: a short warm-up (CUDA/cuBLAS start-up, numqsa's kernel
compilation), then the forward timed end to end (``perf_counter`` around the call, synchronised;
median of 3 when a call takes under 10 s, else one call). Memory: ``torch.cuda.max_memory_allocated``
during the timed call above what was allocated before it, plus the device memory held outside
torch's allocator after the call (numba's buffers: ``torch.cuda.mem_get_info`` before/after, less
the change in torch's reserved memory). The numqsa output is checked finite; correctness against
HF is the GPU tests' job (``tests/test_hf_transformers.py -m gpu``).
Writes JSON (device, versions, git revision, one record per case) and prints a table;
``--table JSON --readme`` rewrites the README's table (between its ``HF-TABLE`` markers) from it.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

IMPLS = ("eager", "numqsa")
LABEL = {"eager": "HF eager", "numqsa": "HF + numqsa"}
GEOMETRY = dict(vocab_size=1024, hidden_size=2048, num_attention_heads=24, num_key_value_heads=2,
                head_dim=256, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                shared_expert_intermediate_size=256, indexer_n_heads=4, indexer_kv_heads=1,
                indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=4,
                max_position_embeddings=32768)
GIB = float(1 << 30)


def build(torch, dtype):
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextModel
    cfg = Qwen4ExpTextConfig(**GEOMETRY, num_hidden_layers=1, layer_types=["qwen_sparse_attention"],
                             rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                              "partial_rotary_factor": 0.25})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Qwen4ExpTextModel(cfg).eval()
    freqs = [(m, m.inv_freq.clone()) for m in model.modules() if hasattr(m, "inv_freq")]
    model = model.to(device="cuda", dtype=getattr(torch, dtype))
    for m, f in freqs:           # from_pretrained keeps float32 RoPE frequencies
        m.inv_freq = f.cuda()
    return model


def is_oom(exc):
    text = f"{type(exc).__name__}: {exc}".lower()
    return "out of memory" in text or "outofmemory" in text or "cuda_error_out_of_memory" in text


def run_case(impl, length, dtype):
    """One case in this process: a dict with time, memory and status."""
    import torch
    model = build(torch, dtype)
    if impl == "numqsa":
        from numqsa.integrations import transformers as nt
        nt.enable(model)
    gen = torch.Generator().manual_seed(length)
    ids = torch.randint(0, GEOMETRY["vocab_size"], (1, length), generator=gen).cuda()
    rec = dict(impl=impl, length=length, dtype=dtype)
    try:
        with torch.no_grad():
            # numqsa: a sparse prompt compiles every kernel of the route (scores, top-k, page-4)
            model(ids[:, :min(length, 2600 if impl == "numqsa" else 256)], use_cache=False)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            reserved0, free0 = torch.cuda.memory_reserved(), torch.cuda.mem_get_info()[0]
            times = []
            while True:
                t0 = time.perf_counter()
                out = model(ids, use_cache=False).last_hidden_state
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                if len(times) == 1:
                    held = (free0 - torch.cuda.mem_get_info()[0]) - (torch.cuda.memory_reserved()
                                                                    - reserved0)
                    peak = torch.cuda.max_memory_allocated() - base
                if times[0] > 10 or len(times) == 3:
                    break
            finite = bool(torch.isfinite(out).all())
    except Exception as exc:       # noqa: BLE001 -- OOM of torch or numba is a result, not a crash
        if not is_oom(exc):
            raise
        rec.update(status="oom", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        return rec
    rec.update(status="ok" if finite else "non-finite output", ms=1e3 * statistics.median(times),
               reps=len(times), torch_peak_gib=peak / GIB, outside_torch_gib=max(held, 0) / GIB,
               peak_gib=(peak + max(held, 0)) / GIB)
    return rec


def child(args):
    rec = run_case(args.case, args.length, args.dtype)
    print("RESULT " + json.dumps(rec), flush=True)


def run_all(args):
    from bench.run import environment, revision
    import torch
    device, versions = environment(torch)
    import importlib.metadata as md
    versions["transformers"] = md.version("transformers")
    records = []
    print(f"{'case':<28} {'status':<10} {'ms':>10} {'peak GiB':>9} {'(torch + outside)':>19}")
    for length in args.lengths:
        for impl in IMPLS:
            cmd = [sys.executable, os.path.abspath(__file__), "--case", impl, "--length", str(length),
                   "--dtype", args.dtype]
            t0 = time.perf_counter()
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                                   cwd=ROOT)
                lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
                if lines:
                    rec = json.loads(lines[-1][7:])
                else:
                    tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
                    rec = dict(impl=impl, length=length, dtype=args.dtype,
                               status="oom" if any("out of memory" in t.lower() for t in tail)
                               else "error", error=" | ".join(tail)[:400])
            except subprocess.TimeoutExpired:
                rec = dict(impl=impl, length=length, dtype=args.dtype, status="timeout",
                           error=f"over {args.timeout} s (killed)")
            rec["case_s"] = round(time.perf_counter() - t0, 1)
            records.append(rec)
            name = f"{LABEL[impl]} {length}"
            if rec["status"] == "ok":
                print(f"{name:<28} {'ok':<10} {rec['ms']:>10.1f} {rec['peak_gib']:>9.2f} "
                      f"({rec['torch_peak_gib']:.2f} + {rec['outside_torch_gib']:.2f})")
            else:
                print(f"{name:<28} {rec['status']:<10} {rec.get('error', '')}")
    doc = dict(git_rev=revision(), device=device, versions=versions,
               command=" ".join([os.path.basename(sys.executable)] + sys.argv), dtype=args.dtype,
               geometry=GEOMETRY, timeout_s=args.timeout, records=records)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print()
    print(markdown(doc))
    print(f"\nwrote {args.out}")


def _cell(rec, key, fmt):
    if rec is None:
        return "n/a"
    if rec["status"] != "ok":
        return rec["status"]
    return format(rec[key], fmt)


def markdown(doc):
    """The README's table from a results document."""
    by = {(r["impl"], r["length"]): r for r in doc["records"]}
    lengths = sorted({r["length"] for r in doc["records"]})
    dev = doc.get("device") or {}
    lines = [f"`python3 bench/bench_hf.py` on {dev.get('name', '?')}, {doc.get('dtype')}, revision "
             f"`{(doc.get('git_rev') or '?')[:10]}`, transformers "
             f"{doc.get('versions', {}).get('transformers', '?')}: one QSA layer, one prompt, "
             f"end-to-end ms of the forward; peak GiB = torch's peak + memory held outside torch.",
             "",
             "| prompt tokens | HF eager ms | HF eager peak GiB | HF + numqsa ms | "
             "HF + numqsa peak GiB | speed-up |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for n in lengths:
        e, q = by.get(("eager", n)), by.get(("numqsa", n))
        both = e is not None and q is not None and e["status"] == q["status"] == "ok"
        speed = f"{e['ms'] / q['ms']:.1f}x" if both else "n/a"
        lines.append(f"| {n} | {_cell(e, 'ms', '.0f')} | {_cell(e, 'peak_gib', '.2f')} | "
                     f"{_cell(q, 'ms', '.0f')} | {_cell(q, 'peak_gib', '.2f')} | {speed} |")
    return "\n".join(lines)


def write_readme(table):
    path = os.path.join(ROOT, "README.md")
    with open(path) as f:
        text = f.read()
    begin, end = "<!-- HF-TABLE:BEGIN -->", "<!-- HF-TABLE:END -->"
    a, b = text.index(begin) + len(begin), text.index(end)
    note = "<!-- generated by `python3 bench/bench_hf.py --table ... --readme`; do not edit by hand -->"
    with open(path, "w") as f:
        f.write(text[:a] + "\n" + note + "\n" + table + "\n" + text[b:])
    print(f"updated {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="JSON results path (e.g. bench/results/hf.json)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--dtype", default="float16", choices=["float16", "float32", "bfloat16"])
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per case (default 60)")
    ap.add_argument("--table", metavar="JSON", help="print the markdown table of a results file")
    ap.add_argument("--readme", action="store_true", help="with --table: write it into README.md")
    ap.add_argument("--case", choices=IMPLS, help=argparse.SUPPRESS)
    ap.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.table:
        with open(args.table) as f:
            table = markdown(json.load(f))
        print(table)
        if args.readme:
            write_readme(table)
    elif args.case:
        child(args)
    elif args.out:
        run_all(args)
    else:
        ap.error("give --out PATH (run the benchmark) or --table PATH (print its table)")


if __name__ == "__main__":
    main()
