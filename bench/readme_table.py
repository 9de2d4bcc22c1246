"""Regenerate the performance tables of README.md and docs/benchmark.md from ``bench/results/latest.json``.

    python3 bench/readme_table.py [--json bench/results/latest.json] [--readme README.md]
                                  [--doc docs/benchmark.md] [--check]

Replaces the text between ``<!-- PERF-TABLE:BEGIN -->`` and ``<!-- PERF-TABLE:END -->``: in the
README with the summary (numqsa's time over the fastest peer's for selection, attention and the
whole prefill per case, and each stage's geometric mean), in ``docs/benchmark.md`` with one row per
(case, stage): GPU ms of numqsa (planned route) and of each peer, numqsa's ratio to the fastest
peer, then the host-overhead lines. ``--check`` exits 1 if either file is not up to date.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BEGIN, END = "<!-- PERF-TABLE:BEGIN -->", "<!-- PERF-TABLE:END -->"


def _rev(doc):
    """The record's revision, a full commit hash shortened to git's 7 characters."""
    rev = str(doc.get("git_rev"))
    return rev[:7] if len(rev) == 40 and all(c in "0123456789abcdef" for c in rev) else rev


COLS = (("numqsa", "numqsa"), ("trtllm", "TensorRT-LLM"), ("sglang", "SGLang"),
        ("torch", "PyTorch eager"), ("sdpa", "dense SDPA"))


def cell(r):
    if r is None:
        return ""
    if not r["ok"]:
        return "n/a" if r.get("skipped") else "**FAIL**"
    return f"{r['ms_gpu']:.3f}" if r["ms_gpu"] is not None else "-"


def table(doc):
    res = doc["results"]
    by = {}
    order = []
    for r in res:
        if r["stage"] == "host":
            continue
        key = (r["case"], r["stage"])
        if key not in by:
            by[key] = {}
            order.append(key)
        by[key][r["impl"]] = r
    dev = doc["device"]
    lines = [f"`{doc.get('command', 'python3 bench/run.py')}` on {dev.get('name')} (cc "
             f"{'.'.join(map(str, dev.get('cc', [])))}, driver {dev.get('driver')}), revision "
             f"`{_rev(doc)}`; GPU-only ms (median of 20, L2 flushed, behind a spin kernel). "
             f"The ratio is numqsa's GPU time over the fastest peer's (dense SDPA excluded); "
             f"`bench/results/latest.json` has end-to-end times, TFLOP/s, GB/s, floors and checks.",
             "",
             "| case | stage | " + " | ".join(n for _, n in COLS) + " | numqsa / fastest peer |",
             "| --- | --- | " + " | ".join("---:" for _ in COLS) + " | ---: |"]
    for key in order:
        row = by[key]
        cells = [cell(row.get(k)) for k, _ in COLS]
        if not any(cells[1:]) and key[1] not in ("topk", "expand"):
            pass
        n = row.get("numqsa")
        ratio = f"{n['vs_fastest_peer']:.2f}x" if n and n.get("vs_fastest_peer") else ""
        others = [f"{k.split('.', 1)[1]} {cell(v)}" for k, v in sorted(row.items())
                  if k.startswith("numqsa.")]
        if others and n and n.get("route"):
            cells[0] += f" ({n['route']}; " + ", ".join(others) + ")"
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + f" | {ratio} |")
    host = [r for r in res if r["stage"] == "host" and r["ok"]]
    if host:
        loops = any(r.get("ms_host_loop") is not None for r in host)
        lines += ["", "Host time of one call while the GPU is busy: alone behind a spin (median of "
                  "50)" + ("; and among 20 back-to-back calls (median of 5 rounds)" if loops else "")
                  + ":", ""]
        lines += (["| case | call | host ms | in a loop |", "| --- | --- | ---: | ---: |"] if loops
                  else ["| case | call | host ms |", "| --- | --- | ---: |"])
        for r in host:
            note = " (synchronises; GPU idle)" if r.get("syncs") else ""
            row = f"| {r['case']} | `{r['impl']}` | {r['ms_e2e']:.3f}{note} |"
            if loops:
                lp = r.get("ms_host_loop")
                row += f" {lp:.3f} |" if lp is not None else " n/a |"
            lines.append(row)
    return "\n".join(lines)


def summary(doc):
    """The README's table: numqsa / fastest peer per case for selection, attention and the whole
    prefill, then each stage's geometric mean."""
    ratio = {}
    cases = []
    for r in doc["results"]:
        if r["impl"] != "numqsa" or r.get("section") not in ("prefill", "small", "mixed", "bf16"):
            continue
        if r["case"] not in ratio:
            ratio[r["case"]] = {}
            cases.append(r["case"])
        v = r.get("vs_fastest_peer")
        ratio[r["case"]][r["stage"]] = f"{v:.2f}" if r["ok"] and v else ("**FAIL**" if not r["ok"] else "")
    dev = doc["device"]
    lines = [f"numqsa's GPU time over the fastest peer's (TensorRT-LLM, SGLang, PyTorch eager; below 1 "
             f"is faster) on {dev.get('name')}, revision `{_rev(doc)}` "
             f"(`{doc.get('command', 'python3 bench/run.py')}`); every time, peer and check is in "
             f"[docs/benchmark.md](docs/benchmark.md#latest-record).",
             "",
             "| case | selection | attention | whole prefill |",
             "| --- | ---: | ---: | ---: |"]
    for c in cases:
        row = ratio[c]
        lines.append(f"| {c} | {row.get('select', '')} | {row.get('attention', '')} | "
                     f"{row.get('prefill', '')} |")
    gm = [g for g in doc.get("geomean", []) if g["impl"] == "numqsa"]
    if gm:
        lines += ["", "Geometric means over all cases: " + ", ".join(
            f"{g['stage']} {g['geomean_vs_fastest_peer']:.2f}x ({g['cases']})" for g in gm) + "."]
    return "\n".join(lines)


def _replace(path, body, src):
    """(``path``'s text, that text with ``body`` between the markers)."""
    text = open(path).read()
    if BEGIN not in text or END not in text:
        sys.exit(f"{path} has no {BEGIN} ... {END} markers")
    a, rest = text.split(BEGIN, 1)
    _, b = rest.split(END, 1)
    return text, (f"{a}{BEGIN}\n<!-- generated by `python3 bench/readme_table.py` from {src}; "
                  f"do not edit by hand -->\n{body}\n{END}{b}")


def main(argv=None):
    root = os.path.dirname(HERE)
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=os.path.join(HERE, "results", "latest.json"))
    ap.add_argument("--readme", default=os.path.join(root, "README.md"))
    ap.add_argument("--doc", default=os.path.join(root, "docs", "benchmark.md"))
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    doc = json.load(open(args.json))
    stale = 0
    for path, body in ((args.readme, summary(doc)), (args.doc, table(doc))):
        src = os.path.relpath(os.path.abspath(args.json), root)
        old, new = _replace(path, body, src)
        if args.check:
            stale |= new != old
        elif new != old:
            open(path, "w").write(new)
            print(f"updated {path} from {args.json}")
    return int(stale)


if __name__ == "__main__":
    sys.exit(main())
