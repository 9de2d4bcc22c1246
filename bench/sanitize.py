"""compute-sanitizer over every kernel and route: memcheck, racecheck, synccheck, initcheck x sm_90, sm_70.

Each (tool, architecture) pair runs ``bench/sanitize_cases.py`` (one small and one boundary case per
kernel and route, every production head geometry, results checked against the oracle) under
``compute-sanitizer --tool <tool>``; the pairs run as concurrent processes on the one GPU so the
whole matrix fits in a few minutes of H200 time. racecheck instruments every shared-memory access
and is the slow one: ``--quick-racecheck`` limits it to the 6/1 and 12/1 geometries (12/1's tile
shrinks; the direct blocks' S^T exchange runs over four warps at 6/1 and two at 12/1); on the
H200 the whole matrix took 129 s of wall time at b5eb02e with 12/1 alone (racecheck 77 s on sm_90,
memcheck 127 s) and 88 s at 033fdcc with both (racecheck 68 s, memcheck 87 s). Writes ``<out>/summary.txt`` (the table), ``<out>/summary.json`` and
``<out>/sanitize_logs.tgz`` (one log per pair).

    python3 bench/sanitize.py [--out DIR] [--tools memcheck,racecheck,...] [--arch sm_90,sm_70]
                              [--routes generic,page4,NEW_ROUTE] [--quick-racecheck] [--timeout S]
    python3 bench/sanitize.py --from-logs DIR     # the table again from the logs of a run

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
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
ARCHS = ("sm_90", "sm_70")
# head geometries of a run (sanitize_cases.py's GEOMETRIES), and those --quick keeps
GEOMETRIES = ("3/1", "6/1", "12/1", "24/2")
QUICK = ("6/1", "12/1")


# synccheck's table of tracked barriers (``--num-cuda-barriers``; its default, 0, detects the count
# from the compiler's records, which numba's kernels may not carry). Its overflow first appeared
# with v28, whose mbarrier calls take the ring's shared address (mbar_ref) instead of a generic one:
# at the default and at 32 the table overflowed in the union windows at 12/1 and the launch failed;
# at 1024 all 83 sm_90 cases ran clean (session 21)
CUDA_BARRIERS = 1024


def command(tool, arch, routes, quick):
    cmd = ["compute-sanitizer", "--tool", tool, "--error-exitcode", "9", "--print-limit", "20"]
    if tool == "racecheck":
        cmd += ["--racecheck-report", "all"]
    if tool == "synccheck":
        cmd += ["--num-cuda-barriers", str(CUDA_BARRIERS)]
    cmd += [sys.executable, os.path.join(HERE, "sanitize_cases.py"), "--arch", arch,
            "--routes", ",".join(routes)]
    return cmd + (["--quick"] if quick else [])


def parse(log, rc):
    """Errors from ``ERROR SUMMARY: N errors`` (racecheck prints ``RACECHECK SUMMARY: N hazards
    displayed (E errors, W warnings)`` instead; its hazards count as errors)."""
    m = re.findall(r"ERROR SUMMARY: (\d+) error", log)
    race = re.findall(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warning", log)
    cases = re.findall(r"cases: (\d+) ok", log)
    errors = int(m[-1]) if m else (sum(int(x) for x in race[-1]) if race else None)
    return dict(rc=rc, errors=errors, cases=int(cases[-1]) if cases else 0,
                ok=rc == 0 and errors == 0 and bool(cases))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/numqsa-sanitize"))
    ap.add_argument("--tools", default=",".join(TOOLS))
    ap.add_argument("--arch", default=",".join(ARCHS))
    ap.add_argument("--routes", default=os.environ.get("NUMQSA_SANITIZE_ROUTES", "generic,page4"))
    ap.add_argument("--quick-racecheck", action="store_true", help="racecheck at 6/1 and 12/1 only")
    ap.add_argument("--from-logs", help="rebuild the summary from the logs in this folder")
    ap.add_argument("--timeout", type=float, default=270.0, help="seconds per pair")
    a = ap.parse_args()
    routes = [r for r in a.routes.split(",") if r]
    if a.from_logs:
        rows = []
        for tool in a.tools.split(","):
            for arch in a.arch.split(","):
                path = os.path.join(a.from_logs, f"sanitize_{tool}_{arch}.log")
                text = open(path).read() if os.path.exists(path) else ""
                r = parse(text, 0 if text else "no log")
                # a quick run's log names no geometry past QUICK
                rest = "|".join(g for g in GEOMETRIES if g not in QUICK)
                quick = re.search(rf"attention \S+ ({rest})\b", text) is None
                r.update(tool=tool, arch=arch, seconds="-",
                         geometries=" ".join(QUICK if quick and text else GEOMETRIES))
                rows.append(r)
        os.makedirs(a.out, exist_ok=True)
        return report(rows, routes, a.out, 0.0)
    os.makedirs(a.out, exist_ok=True)
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", PYTHONUNBUFFERED="1")
    procs = {}
    t0 = time.time()
    for tool in a.tools.split(","):
        for arch in a.arch.split(","):
            quick = tool == "racecheck" and a.quick_racecheck
            log = open(os.path.join(a.out, f"sanitize_{tool}_{arch}.log"), "w")
            procs[(tool, arch)] = (subprocess.Popen(command(tool, arch, routes, quick), stdout=log,
                                                    stderr=subprocess.STDOUT, env=env),
                                   log, time.time(), quick)
    ends = {}
    while len(ends) < len(procs) and time.time() - t0 < a.timeout:
        for key, (p, *_rest) in procs.items():
            if key not in ends and p.poll() is not None:
                ends[key] = (p.returncode, time.time())
        time.sleep(0.5)
    rows = []
    for (tool, arch), (p, log, start, quick) in procs.items():
        if (tool, arch) not in ends:          # past the time limit
            p.kill()
            p.wait()
            ends[(tool, arch)] = ("timeout", time.time())
        rc, end = ends[(tool, arch)]
        log.close()
        with open(log.name) as f:
            text = f.read()
        r = parse(text, rc)
        r.update(tool=tool, arch=arch, seconds=round(end - start),
                 geometries=" ".join(QUICK if quick else GEOMETRIES))
        rows.append(r)
    # the device returns a few files only: the per-pair logs travel as one tarball
    with tarfile.open(os.path.join(a.out, "sanitize_logs.tgz"), "w:gz") as tar:
        for (tool, arch), (_, log, *_rest) in procs.items():
            tar.add(log.name, arcname=os.path.basename(log.name))
            os.remove(log.name)
    return report(rows, routes, a.out, t0)


def report(rows, routes, out, t0):
    head = f"{'tool':<10} {'arch':<6} {'errors':>6} {'cases':>5} {'rc':>7} {'s':>4}  geometries  result"
    lines = [f"compute-sanitizer, routes {','.join(routes)}", head]
    for r in rows:
        lines.append(f"{r['tool']:<10} {r['arch']:<6} {str(r['errors']):>6} {r['cases']:>5} "
                     f"{str(r['rc']):>7} {r['seconds']:>4}  {r['geometries']:<18} "
                     f"{'ok' if r['ok'] else 'FAIL'}")
    wall = f"total {time.time() - t0:.0f} s; " if t0 else ""
    lines.append(f"{wall}{sum(r['ok'] for r in rows)}/{len(rows)} clean")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(dict(routes=routes, results=rows), f, indent=1)
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()
