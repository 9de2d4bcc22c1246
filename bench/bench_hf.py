"""HF transformers' Qwen4Exp QSA layer, eager vs through numqsa: prefill time and peak memory.

    python3 bench/bench_hf.py --out bench/results/hf.json [--lengths 4096 16384 32768] [--dtype float16]
    python3 bench/bench_hf.py --table bench/results/hf.json [--readme]   # the README's table
    python3 bench/bench_hf.py --smoke      # CPU only: the flow at a tiny size in the simulator

One random-weight ``Qwen4ExpTextModel`` layer of the production QSA geometry (indexer 4 x 128,
budget 2048 = Kb 512, ratio 4; attention 24 / 2 / 256, partial rotary 0.25, theta 1e7; hidden 2048,
4 small experts), one request, the whole prompt in one forward (``use_cache=False``), HF's
``eager`` attention against the same model after ``numqsa.integrations.transformers.enable``.

HF eager runs each length in its own process, killed after ``--timeout`` seconds (60): HF's
indexer loops over query rows in Python and materialises ``[queries, keys]`` masks and logits, so
long prompts take long or run out of memory; such a case is reported as ``timeout`` or ``oom``, not
as a crash. numqsa runs all lengths in one process (numba compiles its kernels once, in a warm-up
outside the timings; the timeout is per length plus a compilation allowance). Per case: the forward
timed end to end (``perf_counter`` around the call, synchronised;
median of 3 when a call takes under 10 s, else one call). Memory: ``torch.cuda.max_memory_allocated``
during the timed call above what was allocated before it, plus the device memory held outside
torch's allocator after the call (numba's buffers: ``torch.cuda.mem_get_info`` before/after, less
the change in torch's reserved memory). Check (see :func:`check`): the last 256 output rows of numqsa
against HF eager in float32 on the same (rounded) weights, rel-L2 within twice HF eager's own in the
benchmark's dtype (float16 / bfloat16; HF eager in float32 runs as a reference case with the same
timeout, ``--no-reference`` skips it), or against HF eager of the same dtype within ``CHECK_TOL``
(float32, or no reference); a failed check prints no speed-up. The full comparison is the GPU tests' (``tests/test_hf_transformers.py -m gpu``).
Writes JSON (device, versions, git revision, one record per case) and prints a table;
``--table JSON --readme`` rewrites the README's table (between its ``HF-TABLE`` markers) from it.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
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
# --smoke: the same flow on the CPU in the numba CUDA simulator, at a size it can run (no timings)
SMOKE = dict(GEOMETRY, hidden_size=64, num_attention_heads=4, head_dim=32, moe_intermediate_size=32,
             shared_expert_intermediate_size=32, hc_count=2, hc_lowrank=8, indexer_n_heads=2,
             indexer_head_dim=16, indexer_budget=4, max_position_embeddings=256)
GIB = float(1 << 30)
CHECK_ROWS = 256      # output rows compared between HF eager and HF + numqsa
# rel-L2 allowed between the two outputs: the issue's 1e-3 in float32; in float16 / bfloat16 twice
# HF eager's own error against the float32 model with the same weights, measured on this geometry
# (CPU, 512 tokens): 1.08e-3 in float16, 1.77e-2 in bfloat16 (projections and experts included).
CHECK_TOL = {"float32": 1e-3, "float16": 2.2e-3, "bfloat16": 3.5e-2}
COMPILE_S = 180       # allowance for numba's first compilation of numqsa's kernels


def build(torch, dtype, smoke=False, round_to=None):
    """The one-layer model in ``dtype``; ``round_to``: its weights rounded to that dtype first (the
    float32 reference of a float16 / bfloat16 run has that run's weights)."""
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextModel
    cfg = Qwen4ExpTextConfig(**(SMOKE if smoke else GEOMETRY), num_hidden_layers=1, layer_types=["qwen_sparse_attention"],
                             rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                              "partial_rotary_factor": 0.25})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Qwen4ExpTextModel(cfg).eval()
    freqs = [(m, m.inv_freq.clone()) for m in model.modules() if hasattr(m, "inv_freq")]
    device = "cpu" if smoke else "cuda"
    if round_to:
        model = model.to(dtype=getattr(torch, round_to))
    model = model.to(device=device, dtype=getattr(torch, dtype))
    for m, f in freqs:           # from_pretrained keeps float32 RoPE frequencies
        m.inv_freq = f.to(device)
    return model


def is_oom(exc):
    text = f"{type(exc).__name__}: {exc}".lower()
    return "out of memory" in text or "outofmemory" in text or "cuda_error_out_of_memory" in text


def run_cases(impl, lengths, dtype, keep_dir, smoke=False, round_to=None):
    """The cases of one implementation in this process (one model, one warm-up): yields records.

    Each record has time, memory and status; the last ``CHECK_ROWS`` rows of the output are saved
    to ``keep_dir`` for the parent's check of numqsa against HF eager."""
    import numpy as np
    import torch
    model = build(torch, dtype, smoke, round_to)
    gpu = not smoke
    if impl == "numqsa":
        from numqsa.integrations import transformers as nt
        nt.enable(model)
    warm = True
    for length in lengths:
        gen = torch.Generator().manual_seed(length)
        ids = torch.randint(0, GEOMETRY["vocab_size"], (1, length), generator=gen)
        ids = ids.cuda() if gpu else ids
        rec = dict(impl=impl, length=length, dtype=dtype)
        t_case = time.perf_counter()
        try:
            with torch.no_grad():
                if warm:   # numqsa: a sparse prompt compiles every kernel of its route
                    model(ids[:, :min(length, 2600 if impl == "numqsa" else 256)], use_cache=False)
                    warm = False
                if gpu:
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    reserved0, free0 = torch.cuda.memory_reserved(), torch.cuda.mem_get_info()[0]
                times, held, peak = [], 0, 0
                while True:
                    t0 = time.perf_counter()
                    out = model(ids, use_cache=False).last_hidden_state
                    if gpu:
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                    if len(times) == 1 and gpu:
                        held = ((free0 - torch.cuda.mem_get_info()[0])
                                - (torch.cuda.memory_reserved() - reserved0))
                        peak = torch.cuda.max_memory_allocated() - base
                    if times[0] > 10 or len(times) == 3 or smoke:
                        break
                tail = out[0, -CHECK_ROWS:].double().cpu().numpy()
                del out
        except Exception as exc:   # noqa: BLE001 -- an OOM of torch or numba is a result
            if not is_oom(exc):
                raise
            rec.update(status="oom", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            if gpu:
                torch.cuda.empty_cache()
            yield rec
            continue
        np.save(os.path.join(keep_dir, f"{impl}_{dtype}_{length}.npy"), tail)
        held = max(held, 0)
        rec.update(status="ok" if np.isfinite(tail).all() else "non-finite output",
                   ms=1e3 * statistics.median(times), reps=len(times), torch_peak_gib=peak / GIB,
                   outside_torch_gib=held / GIB, peak_gib=(peak + held) / GIB,
                   case_s=round(time.perf_counter() - t_case, 1))
        yield rec


def child(args):
    for rec in run_cases(args.case, args.length, args.dtype, args.keep, args.smoke, args.round_to):
        print("RESULT " + json.dumps(rec), flush=True)


def _spawn(impl, lengths, args, keep, timeout, dtype=None):
    """Run ``lengths`` of ``impl`` in a child process; a record per length (timeout/error too)."""
    dtype = dtype or args.dtype
    rounding = ["--round-to", args.dtype] if dtype != args.dtype else []
    cmd = [sys.executable, os.path.abspath(__file__), "--case", impl, "--dtype", dtype, *rounding,
           "--keep", keep, *(["--smoke"] if args.smoke else []), "--length", *map(str, lengths)]
    stdout, err, status = "", "", None
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        stdout, err = p.stdout, (p.stderr or "").strip().splitlines()[-3:]
        status = "oom" if any("out of memory" in t.lower() for t in err) else "error"
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err, status = [f"over {timeout:.0f} s (killed)"], "timeout"
    got = {}
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            rec = json.loads(line[7:])
            got[rec["length"]] = rec
    return [got.get(n) or dict(impl=impl, length=n, dtype=dtype, status=status,
                               error=" | ".join(err)[:400]) for n in lengths]


def check(records, keep, dtype):
    """numqsa's last rows against a reference where one ran.

    With HF eager in float32 on the same weights (the reference run of a float16 / bfloat16
    benchmark): numqsa's rel-L2 to it within twice HF eager's own (same dtype as numqsa), or within
    ``CHECK_TOL`` when that is larger. A sparse row's output moves with every group that changes
    rank near its 512th, and the lower the precision of the scores and the more groups a row sees,
    the more do: HF's own low-precision error measures that at each length. Without the float32
    reference: numqsa against HF eager of the same dtype, rel-L2 within ``CHECK_TOL``."""
    import numpy as np
    from numqsa.testing import compare
    tol = CHECK_TOL[dtype]

    def rel(a, b):
        st = compare(np.load(a), np.load(b))
        return st["rel_l2"] if st["finite"] else float("inf")

    for rec in records:
        if rec["impl"] != "numqsa" or rec["status"] != "ok" or rec.get("reference"):
            continue
        n = rec["length"]
        mine = os.path.join(keep, f"numqsa_{dtype}_{n}.npy")
        ref32 = os.path.join(keep, f"eager_float32_{n}.npy")
        same = os.path.join(keep, f"eager_{dtype}_{n}.npy")
        if dtype != "float32" and os.path.exists(ref32):
            rec["check_ref"] = "HF eager float32"
            rec["check_rel_l2"] = err = rel(mine, ref32)
            bound = tol
            if os.path.exists(same):
                rec["check_hf_rel_l2"] = hf = rel(same, ref32)
                bound = max(2 * hf, tol)
            rec["check"] = "pass" if err <= bound else f"FAIL (bound {bound:.1e})"
        elif os.path.exists(same):
            rec["check_ref"] = f"HF eager {dtype}"
            rec["check_rel_l2"] = err = rel(mine, same)
            rec["check"] = "pass" if err <= tol else f"FAIL (tol {tol:.0e})"
        else:
            rec["check"] = "no reference output to compare"


def run_all(args):
    from bench.run import environment, revision
    import torch
    device, versions = environment(None if args.smoke else torch)
    import importlib.metadata as md
    versions["transformers"] = md.version("transformers")
    keep = tempfile.mkdtemp(prefix="bench_hf_")
    records = []
    # HF eager: one process per length, killed at the timeout. numqsa: one process for all lengths
    # (numba compiles the kernels once, outside the timed calls), the timeout per length plus
    # COMPILE_S for the compilation.
    for n in args.lengths:
        records += _spawn("eager", [n], args, keep, args.timeout)
        if args.dtype != "float32" and not args.no_reference:
            for rec in _spawn("eager", [n], args, keep, args.timeout, dtype="float32"):
                rec["reference"] = True
                records.append(rec)
    records += _spawn("numqsa", args.lengths, args, keep,
                      args.timeout * len(args.lengths) + COMPILE_S)
    check(records, keep, args.dtype)
    print(f"{'case':<24} {'status':<9} {'ms':>10} {'peak GiB':>9} {'(torch + outside)':>18} check")
    for rec in sorted(records, key=lambda r: (r["length"], r["impl"], bool(r.get("reference")))):
        name = f"{LABEL[rec['impl']]} {rec['length']}" + (" (f32 ref)" if rec.get("reference") else "")
        if rec["status"] == "ok":
            print(f"{name:<24} {'ok':<9} {rec['ms']:>10.1f} {rec['peak_gib']:>9.2f} "
                  f"({rec['torch_peak_gib']:6.2f} + {rec['outside_torch_gib']:5.2f}) "
                  f"{rec.get('check', '')} {rec.get('check_rel_l2', '')} "
                  f"{rec.get('check_hf_rel_l2', '')}")
        else:
            print(f"{name:<24} {rec['status']:<9} {rec.get('error', '')}")
    doc = dict(git_rev=revision(), device=device, versions=versions,
               command=" ".join([os.path.basename(sys.executable)] + sys.argv), dtype=args.dtype,
               geometry=GEOMETRY, timeout_s=args.timeout, check_rows=CHECK_ROWS, records=records)
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
    by = {(r["impl"], r["length"]): r for r in doc["records"] if not r.get("reference")}
    lengths = sorted({r["length"] for r in doc["records"]})
    dev = doc.get("device") or {}
    lines = [f"`python3 bench/bench_hf.py` on {dev.get('name', '?')}, {doc.get('dtype')}, revision "
             f"`{(doc.get('git_rev') or '?')[:10]}`, transformers "
             f"{doc.get('versions', {}).get('transformers', '?')}: one QSA layer, one prompt, "
             f"end-to-end ms of the forward; peak GiB = torch's peak + memory held outside torch.",
             "",
             "| prompt tokens | HF eager ms | HF eager peak GiB | HF + numqsa ms | "
             "HF + numqsa peak GiB | speed-up | check (rel-L2 numqsa / HF eager, vs reference) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for n in lengths:
        e, q = by.get(("eager", n)), by.get(("numqsa", n))
        both = (e is not None and q is not None and e["status"] == q["status"] == "ok"
                and q.get("check") == "pass")
        speed = f"{e['ms'] / q['ms']:.1f}x" if both else "n/a"
        chk = "n/a"
        if q is not None and q.get("check"):
            chk = q["check"]
            if "check_rel_l2" in q:
                hf = f" / {q['check_hf_rel_l2']:.1e}" if "check_hf_rel_l2" in q else ""
                chk += f": {q['check_rel_l2']:.1e}{hf} vs {q.get('check_ref', 'HF eager')}"
        lines.append(f"| {n} | {_cell(e, 'ms', '.0f')} | {_cell(e, 'peak_gib', '.2f')} | "
                     f"{_cell(q, 'ms', '.0f')} | {_cell(q, 'peak_gib', '.2f')} | {speed} | "
                     f"{chk} |")
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
    ap.add_argument("--dtype", choices=["float16", "float32", "bfloat16"],
                    help="float16 (default; float32 with --smoke)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per case (default 60)")
    ap.add_argument("--no-reference", action="store_true",
                    help="float16/bfloat16: skip HF eager in float32 (the check's reference)")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU only: the whole flow at a tiny size in the numba CUDA simulator")
    ap.add_argument("--table", metavar="JSON", help="print the markdown table of a results file")
    ap.add_argument("--readme", action="store_true", help="with --table: write it into README.md")
    ap.add_argument("--case", choices=IMPLS, help=argparse.SUPPRESS)
    ap.add_argument("--length", type=int, nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--keep", help=argparse.SUPPRESS)
    ap.add_argument("--round-to", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.dtype = args.dtype or ("float32" if args.smoke else "float16")
    if args.smoke:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
        args.lengths = [10]
        args.timeout = max(args.timeout, 120.0)
        args.out = args.out or os.path.join(tempfile.gettempdir(), "bench_hf_smoke.json")
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
