"""compute-sanitizer over every kernel and route: memcheck, racecheck, synccheck, initcheck x sm_90, sm_70.

Each (tool, architecture) pair runs ``bench/sanitize_cases.py`` (one small and one boundary case per
kernel and route, every production head geometry, results checked against the oracle) under
``compute-sanitizer --tool <tool>``; the pairs run as concurrent processes on the one GPU so the
whole matrix fits in a few minutes of H200 time. racecheck instruments every shared-memory access
and is the slow one: it runs the 12/1 geometry only (``--quick``: the one whose tile shrinks) unless
``--full``. Writes ``<out>/summary.txt`` (the table), ``<out>/summary.json`` and one log per pair.

    python3 bench/sanitize.py [--out DIR] [--tools memcheck,racecheck,...] [--arch sm_90,sm_70]
                              [--routes generic,page4,NEW_ROUTE] [--full] [--timeout S]

A new attention kernel launched through ``numqsa.sparse_attention(..., route_name=NAME)`` is
covered by adding ``NAME`` to ``--routes`` (or to ``NUMQSA_SANITIZE_ROUTES``). Exit status 0 iff
every pair reports 0 sanitizer errors and all its cases matched the oracle.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
ARCHS = ("sm_90", "sm_70")


def command(tool, arch, routes, quick):
    cmd = ["compute-sanitizer", "--tool", tool, "--error-exitcode", "9", "--print-limit", "20"]
    if tool == "racecheck":
        cmd += ["--racecheck-report", "all"]
    if tool == "initcheck":
        cmd += ["--track-unused-memory", "no"]
    cmd += [sys.executable, os.path.join(HERE, "sanitize_cases.py"), "--arch", arch,
            "--routes", ",".join(routes)]
    return cmd + (["--quick"] if quick else [])


def parse(log, rc):
    m = re.findall(r"ERROR SUMMARY: (\d+) error", log)
    cases = re.findall(r"cases: (\d+) ok", log)
    hazards = re.findall(r"RACECHECK SUMMARY: (\d+) hazard", log)
    return dict(rc=rc, errors=int(m[-1]) if m else None, cases=int(cases[-1]) if cases else 0,
                hazards=int(hazards[-1]) if hazards else None,
                ok=rc == 0 and bool(m) and int(m[-1]) == 0 and bool(cases))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/numqsa-sanitize"))
    ap.add_argument("--tools", default=",".join(TOOLS))
    ap.add_argument("--arch", default=",".join(ARCHS))
    ap.add_argument("--routes", default=os.environ.get("NUMQSA_SANITIZE_ROUTES", "generic,page4"))
    ap.add_argument("--full", action="store_true", help="racecheck at every geometry too")
    ap.add_argument("--timeout", type=float, default=270.0, help="seconds per pair")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    routes = [r for r in a.routes.split(",") if r]
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", PYTHONUNBUFFERED="1")
    procs = {}
    t0 = time.time()
    for tool in a.tools.split(","):
        for arch in a.arch.split(","):
            quick = tool == "racecheck" and not a.full
            log = open(os.path.join(a.out, f"sanitize_{tool}_{arch}.log"), "w")
            procs[(tool, arch)] = (subprocess.Popen(command(tool, arch, routes, quick), stdout=log,
                                                    stderr=subprocess.STDOUT, env=env),
                                   log, time.time(), quick)
    rows = []
    for (tool, arch), (p, log, start, quick) in procs.items():
        try:
            rc = p.wait(timeout=max(1.0, a.timeout - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            rc = p.wait()
            rc = "timeout"
        log.close()
        with open(log.name) as f:
            text = f.read()
        r = parse(text, rc)
        r.update(tool=tool, arch=arch, seconds=round(time.time() - start),
                 geometries="12/1" if quick else "3/1 6/1 12/1 24/2")
        rows.append(r)
    head = f"{'tool':<10} {'arch':<6} {'errors':>6} {'cases':>5} {'rc':>7} {'s':>4}  geometries  result"
    lines = [f"compute-sanitizer, routes {','.join(routes)}", head]
    for r in rows:
        lines.append(f"{r['tool']:<10} {r['arch']:<6} {str(r['errors']):>6} {r['cases']:>5} "
                     f"{str(r['rc']):>7} {r['seconds']:>4}  {r['geometries']:<18} "
                     f"{'ok' if r['ok'] else 'FAIL'}")
    lines.append(f"total {time.time() - t0:.0f} s; {sum(r['ok'] for r in rows)}/{len(rows)} clean")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(a.out, "summary.txt"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(dict(routes=routes, results=rows), f, indent=1)
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()
