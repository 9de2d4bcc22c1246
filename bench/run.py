"""The one benchmark command: every bench case, one table, one JSON, PNG plots.

    python bench/run.py [--quick] [--json bench/results/h200.json] [--plots bench/results]

Runs ``bench_selection.py`` (scores on both routes, top-k, expansion, the chain, the tiled/light
crossover, PyTorch eager peers) and ``bench_attention.py`` (generic vs page-4 routes, page-16 sweep,
PyTorch eager peer), each in its own process, then prints one line per case — time, TFLOP/s, GB/s,
percent of the floor ``max(FLOP / 777 TFLOP/s, bytes / 4.24 TB/s)`` (the H200's measured fp16 tensor
matmul and copy ceilings), speedup over PyTorch eager and over the generic route — and writes one JSON
with the device, compute capability, versions and git revision (``NUMQSA_REV`` overrides ``git``).
Peers that are not installed are skipped by the sub-benchmarks, which say so.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PEAK_FLOPS, PEAK_BYTES = 777e12, 4.24e12
TORCH_PEER = {"scores.tiled": "torch.scores", "scores.light": "torch.scores", "topk": "torch.topk",
              "expand": "torch.expand"}


def revision():
    rev = os.environ.get("NUMQSA_REV")
    if rev:
        return rev
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True,
                              text=True).stdout.strip() or None
    except OSError:
        return None


def run_step(i, n, name, cmd):
    print(f"[{i}/{n}] {name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=os.path.dirname(HERE))
    print(f"[{i}/{n}] {name}: {'done' if proc.returncode == 0 else f'FAILED ({proc.returncode})'} "
          f"in {time.time() - t0:.0f} s", flush=True)
    return proc.returncode


def selection_rows(sel):
    """Unified rows from bench_selection's JSON; the floor is derived from its FLOP and byte counts."""
    res = sel["results"]
    torch = {(r["name"], r["rows"], r["ctx"]): r["ms"] for r in res if r["name"].startswith("torch.")}
    light = {(r["rows"], r["ctx"]): r["ms"] for r in res if r["name"] == "scores.light"}
    out = []
    for r in res:
        if r["name"].startswith(("torch.", "crossover.")):
            continue
        ms = r["ms"]
        flop = (r["tflops"] or 0) * ms * 1e9
        nbytes = (r["gbs"] or 0) * ms * 1e6
        floor = max(flop / PEAK_FLOPS, nbytes / PEAK_BYTES) * 1e3
        key = (r["rows"], r["ctx"])
        if r["name"] in TORCH_PEER:
            peer = torch.get((TORCH_PEER[r["name"]],) + key)
        elif r["name"] in ("chain.kernels", "select.api"):
            parts = [torch.get((p,) + key) for p in ("torch.scores", "torch.topk", "torch.expand")]
            peer = sum(parts) if all(parts) else None
        else:
            peer = None
        generic = light.get(key) if r["name"] == "scores.tiled" else None
        out.append(dict(stage="select", case=f"{r['rows']}x{r['ctx'] // 1024}K", route=r["name"],
                        ms=ms, tflops=r["tflops"], gbs=r["gbs"], floor_ms=floor,
                        vs_torch=peer / ms if peer else None,
                        vs_generic=generic / ms if generic else None))
    return out


def attention_rows(att):
    cases = att["cases"]
    torch = {c["case"]: c["time_ms"] for c in cases if c["route"] == "torch_eager"}
    generic = {c["case"]: c["time_ms"] for c in cases if c["route"] == "generic"}
    out = []
    for c in cases:
        if c["route"] == "torch_eager":
            continue
        ms = c["time_ms"]
        peer, gen = torch.get(c["case"]), generic.get(c["case"])
        out.append(dict(stage="attention", case=c["case"], route=c["route"], ms=ms,
                        tflops=c["tflops"], gbs=None, floor_ms=c["floor_ms"],
                        vs_torch=peer / ms if peer else None,
                        vs_generic=gen / ms if gen and c["route"] != "generic" else None,
                        overlap=c.get("overlap")))
    return out


def fmt(x, spec, width, suffix=""):
    return f"{x:{width - len(suffix)}{spec}}{suffix}" if x is not None else f"{'-':>{width}s}"


def table(rows):
    head = (f"{'stage':9s} {'case':22s} {'route':14s} {'ms':>9s} {'TFLOP/s':>8s} {'GB/s':>7s} "
            f"{'floor%':>6s} {'vs torch':>8s} {'vs gen':>6s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        pct = 100 * r["floor_ms"] / r["ms"] if r["floor_ms"] else None
        lines.append(f"{r['stage']:9s} {r['case'][:22]:22s} {r['route'][:14]:14s} {r['ms']:9.3f} "
                     f"{fmt(r['tflops'], '.1f', 8)} {fmt(r['gbs'], '.0f', 7)} {fmt(pct, '.1f', 6)} "
                     f"{fmt(r['vs_torch'], '.2f', 8, 'x')} {fmt(r['vs_generic'], '.2f', 6, 'x')}")
    return "\n".join(lines)


def plots(sel, att, folder):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots")
        return []
    made = []
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for name, style in (("crossover.tiled", "o-"), ("crossover.light", "s--")):
        pts = sorted((r["rows"], r["ms"]) for r in sel["results"] if r["name"] == name)
        if pts:
            ax[0].plot(*zip(*pts), style, label=name.split(".")[1])
    ax[0].set(xscale="log", yscale="log", xlabel="query rows", ylabel="ms",
              title="index scores vs rows (32K context)")
    ax[0].legend()
    for rows, style in ((1024, "o-"), (8192, "s-")):
        pts = sorted((r["ctx"], r["ms"]) for r in sel["results"]
                     if r["name"] == "chain.kernels" and r["rows"] == rows)
        if pts:
            ax[1].plot(*zip(*pts), style, label=f"chain, {rows} rows")
    ax[1].set(xscale="log", yscale="log", xlabel="context tokens", ylabel="ms",
              title="selection chain vs context")
    ax[1].legend()
    path = os.path.join(folder, "selection.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    made.append(path)
    fig, ax = plt.subplots(figsize=(6, 4))
    by_route = {}
    for c in att["cases"]:
        if c["case"].endswith("_p64_sel2048") and "x32K" in c["case"]:
            by_route.setdefault(c["route"], []).append((c["rows"], c["time_ms"], c.get("floor_ms")))
    for route, pts in sorted(by_route.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=route)
    floor = sorted({(p[0], p[2]) for pts in by_route.values() for p in pts if p[2] == p[2] and p[2]})
    if floor:
        ax.plot(*zip(*floor), "k:", label="floor")
    ax.set(yscale="log", xlabel="query rows", ylabel="ms", title="sparse attention, 32K context")
    ax.legend()
    path = os.path.join(folder, "attention.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    made.append(path)
    return made


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=os.path.join(HERE, "results", "bench.json"))
    ap.add_argument("--plots", default=None, help="folder for PNG plots (default: next to --json)")
    ap.add_argument("--quick", action="store_true", help="one case per benchmark")
    args = ap.parse_args(argv)
    tmp = tempfile.mkdtemp()
    sel_json, att_json = os.path.join(tmp, "selection.json"), os.path.join(tmp, "attention.json")
    quick = ["--quick"] if args.quick else []
    rc = run_step(1, 2, "selection", [sys.executable, os.path.join(HERE, "bench_selection.py"),
                                      sel_json] + quick)
    rc |= run_step(2, 2, "attention", [sys.executable, os.path.join(HERE, "bench_attention.py"),
                                       "--json", att_json] + quick)
    sel = json.load(open(sel_json)) if os.path.exists(sel_json) else {"meta": {}, "results": []}
    att = json.load(open(att_json)) if os.path.exists(att_json) else {"environment": {}, "cases": []}
    rows = selection_rows(sel) + attention_rows(att)
    env = dict(att.get("environment") or {}, **{k: v for k, v in sel.get("meta", {}).items()
                                               if k in ("device", "cc", "profile", "numba", "numpy")})
    env["git"] = revision()
    print()
    print(table(rows))
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(dict(environment=env, table=rows, selection=sel, attention=att), f, indent=1)
    made = plots(sel, att, args.plots or os.path.dirname(os.path.abspath(args.json)))
    print(f"\nwrote {args.json}" + "".join(f", {p}" for p in made))
    return rc


if __name__ == "__main__":
    sys.exit(main())
