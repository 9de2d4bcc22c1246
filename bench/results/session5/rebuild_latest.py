"""Rebuild ``latest.json`` of the session-5 record run from the files that came back.

The device returned at most 8 files of that call, and ``latest.json`` / ``latest.log`` were among
those it left out. This script rebuilds the JSON from what did come back: ``latest.csv`` (every
row, the CSV columns) and ``bench.log`` (the run's stdout: device, versions, section times,
geometric means, row count and seconds). ``flop`` and ``bytes`` are recovered from TFLOP/s, GB/s
and the GPU time; ``section`` and ``num_reqs`` from the case list. Then the plots are redrawn. Lost, so absent: each row's ``check`` details,
``reps``, ``note``, ``gen_s`` and the host rows' ``ms_host_loop``.

    python3 bench/results/session5/rebuild_latest.py   # writes bench/results/latest.json
"""
import ast
import csv
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..", "..")
sys.path.insert(0, ROOT)

INTS = ("rows", "context", "hq", "hkv", "page_size", "kb")
FLOATS = ("ms_gpu", "ms_e2e", "tflops", "gbs", "pct_floor", "floor_ms", "vs_fastest_peer")
BOOLS = ("ok", "syncs", "overlap")
GIT_REV = "351f331"        # the tree the device ran (its copy reported the stale 87ade70)


def value(key, s):
    if s == "":
        return None
    if key in INTS:
        return int(s)
    if key in FLOATS:
        return float(s)
    if key in BOOLS:
        return s == "True"
    return s


def main():
    from bench.workloads import case_list
    cases = {c.name: c for c in case_list()}
    with open(os.path.join(ROOT, "bench", "results", "latest.csv")) as f:
        results = [{k: value(k, v) for k, v in r.items()} for r in csv.DictReader(f)]
    for r in results:
        r["section"] = cases[r["case"]].section
        r["num_reqs"] = len(cases[r["case"]].seq_lens)
        ms = r.get("ms_gpu")
        if ms:
            if r.get("tflops") is not None:
                r["flop"] = r["tflops"] * 1e12 * ms / 1e3
            if r.get("gbs") is not None:
                r["bytes"] = r["gbs"] * 1e9 * ms / 1e3
    log = open(os.path.join(ROOT, "bench", "results", "latest.log")).read()
    dev = re.search(r"^# device (\{.*\})\s+git (\w+)", log, re.M)
    vers = ast.literal_eval(re.search(r"^# versions (\{.*\})", log, re.M).group(1))
    secs = {m.group(1): float(m.group(2))
            for m in re.finditer(r"^# section (\w+): ([\d.]+) s", log, re.M)}
    geo = [dict(stage=m.group(1), impl=m.group(2), geomean_vs_fastest_peer=float(m.group(3)),
                cases=int(m.group(4)))
           for m in re.finditer(r"^  (\w+)\s+(\S+)\s+([\d.]+)x over (\d+) cases", log, re.M)]
    total = re.search(r"^(\d+) rows, (\d+) ok, (\d+) failed, (\d+) skipped; (\d+) s", log, re.M)
    assert int(total.group(1)) == len(results), "the CSV and the log disagree on the row count"
    doc = dict(git_rev=GIT_REV, device=ast.literal_eval(dev.group(1)), versions=vers,
               command="python3 bench/run.py --out DIR", smoke=False,
               seconds=float(total.group(5)), sections=secs,
               floors="max(FLOP / 777e12, bytes / 4.24e12)", geomean=geo, results=results,
               git_rev_device=dev.group(2),
               notes="Record run of session 5 (tree 351f331: register top-k, keys-as-M scores "
                     "with one-round query staging and a one-warp shape up to 8 rows). Rebuilt "
                     "by bench/results/session5/rebuild_latest.py from latest.csv and the run's "
                     "stdout (bench.log): the device left latest.json out of the files it "
                     "returned. Absent for that reason: per-row check details, reps, notes, "
                     "gen_s and the host rows' ms_host_loop. The device's copy of the repository "
                     "reported stale git metadata (git_rev_device).")
    out = os.path.join(ROOT, "bench", "results", "latest.json")
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    from bench.plots import plots
    made = plots(doc, os.path.dirname(out))
    print(f"wrote {os.path.normpath(out)}: {len(results)} rows, {len(geo)} geometric means; "
          f"plots {made}")


if __name__ == "__main__":
    main()
