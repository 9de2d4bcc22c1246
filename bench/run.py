"""The peer benchmark (issue 13): every workload, numqsa and each peer on the same inputs, checked.

    python3 bench/run.py [--quick] [--only TEXT] [--impls numqsa,trtllm,...] [--stages attention]
                         [--out DIR]
    python3 bench/run.py --smoke          # CPU only: tiny case in the numba CUDA simulator

For each case (``bench/workloads.py``: prefill 4096/8192 x 32K, 1024/8192 x 131K; 1-256 rows at 32K
and 131K; a mixed batch of five requests; top-k on concentrated / plateau / few-valued scores; the
page-16 sweep; 784-token pages; bfloat16), each stage and each implementation (``bench/peers/``:
numqsa, TensorRT-LLM's Triton kernels, SGLang's Triton sparse attention, PyTorch eager, dense SDPA):
run once, check against the float64 oracle on sampled rows (``bench/checks.py``; a red check prints
no time), then time GPU-only and end-to-end (``bench/timing.py``), and measure the host overhead of
the public calls on the cases marked for it. Prints one fixed-width line per (case, stage, impl) —
GPU ms, e2e ms, TFLOP/s, GB/s, % of floor, ratio to the fastest peer — then the geometric mean per
stage, and writes ``latest.json`` (issue 13's schema plus extra keys), ``latest.csv``, PNG plots and
``latest.log`` to ``--out`` (default ``bench/results``). ``NUMQSA_REV`` gives the git revision where
the checkout has no ``.git``. The smoke mode (also taken when no GPU is usable) prints no timings and
writes nothing unless ``--out`` is given.

Kernel-tuning sweeps stay in ``bench/bench_selection.py --variants`` and
``bench/bench_attention.py --sweep``; ``bench/readme_table.py`` regenerates the README's table.
"""
import argparse
import csv
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

PEER_EXCLUDED_FROM_FASTEST = {"sdpa"}      # dense attention: a reference, not a QSA peer


class Tee:
    def __init__(self, path):
        self.f = open(path, "w") if path else None
        self.out = sys.stdout

    def write(self, s):
        self.out.write(s)
        if self.f:
            self.f.write(s)
            self.f.flush()

    def flush(self):
        self.out.flush()
        if self.f:
            self.f.flush()


def revision():
    rev = os.environ.get("NUMQSA_REV")
    if rev:
        return rev
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        return out.stdout.strip() or None
    except OSError:
        return None


def gpu_usable():
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return None
    try:
        import torch
        return torch if torch.cuda.is_available() else None
    except ImportError:
        return None


def environment(torch):
    import importlib.metadata as md
    import numba
    import numpy as np
    env = dict(python=platform.python_version(), numpy=np.__version__, numba=numba.__version__)
    for pkg in ("numba-cuda", "triton", "torch", "cuda-bindings"):
        try:
            env[pkg] = md.version(pkg)
        except Exception:
            pass
    dev = {}
    if torch is not None:
        props = torch.cuda.get_device_properties(0)
        dev = dict(name=props.name, cc=list(torch.cuda.get_device_capability()),
                   memory_gb=round(props.total_memory / 2**30, 1), sms=props.multi_processor_count)
        env["torch_cuda"] = torch.version.cuda
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True)
            dev["driver"] = q.stdout.strip().splitlines()[0]
        except Exception:
            dev["driver"] = None
        try:
            from numba import cuda
            env["cuda_runtime_numba"] = ".".join(map(str, cuda.runtime.get_version()))
            env["cuda_driver_api"] = cuda.cudadrv.driver.driver.get_version()
        except Exception:
            pass
    else:
        from numqsa.device import device_cc
        dev = dict(name="numba CUDA simulator", cc=list(device_cc()), driver=None)
    return dev, env


def fmt(x, spec, width):
    return f"{x:{width}{spec}}" if x is not None else f"{'-':>{width}s}"


HEAD = (f"{'case':24s} {'stage':9s} {'impl':16s} {'GPU ms':>9s} {'e2e ms':>9s} {'TFLOP/s':>8s} "
        f"{'GB/s':>7s} {'floor%':>6s} {'vs peer':>8s}  note")


def line(r):
    note = ""
    if not r["ok"]:
        note = "SKIP " + r["skipped"] if r.get("skipped") else "FAIL " + (r.get("error") or "")
    elif r.get("e2e_error"):
        note = "e2e FAIL " + r["e2e_error"]
    elif r.get("syncs"):
        note = "synchronises: host time measured with the GPU idle"
    elif r["ms_gpu"] is None and r["ms_e2e"] is None:
        note = "check ok (no timing in the smoke run)"
    elif r.get("route"):
        note = f"route {r['route']}"
    if r["stage"] == "host":
        loop = r.get("ms_host_loop")
        note = r["impl"] + (f"  in a loop {loop:.3f}" if loop is not None else "") + (
            "  " + note if note else "")
    vs = r.get("vs_fastest_peer")
    return (f"{r['case'][:24]:24s} {r['stage']:9s} {r['impl'][:16]:16s} "
            f"{fmt(r['ms_gpu'], '.3f', 9)} {fmt(r['ms_e2e'], '.3f', 9)} {fmt(r.get('tflops'), '.1f', 8)} "
            f"{fmt(r.get('gbs'), '.0f', 7)} {fmt(r.get('pct_floor'), '.1f', 6)} "
            f"{(f'{vs:7.2f}x' if vs is not None else f'{chr(45):>8s}')}  {note[:110]}")


def record(case, stage, impl):
    return dict(case=case.name, rows=case.rows, context=case.context, dtype=case.dtype, hq=case.Hq,
                hkv=case.Hkv, stage=stage, impl=impl, ms_gpu=None, ms_e2e=None, ok=False,
                section=case.section, page_size=case.page_size, kb=case.Kb,
                num_reqs=len(case.seq_lens), dist=case.dist if stage == "topk" else None)


def short(err):
    s = " ".join(str(err).split())
    return f"{type(err).__name__}: {s}"[:300]


def run_one(mod, stage, prob, checker, timer, route=None, smoke=False):
    from bench.peers import Skip
    c = prob.case
    impl = mod.NAME + (f".{route}" if route else "")
    rec = record(c, stage, impl)
    try:
        call = mod.prepare(stage, prob, route)
    except Skip as s:
        rec["skipped"] = str(s)
        return rec, None
    except Exception as err:
        rec["error"] = short(err)
        return rec, None
    if mod.NAME == "numqsa" and stage == "attention" and route is None:
        from bench.peers.numqsa_api import routes
        rec["route"] = routes(prob)[0]
    if call.note:
        rec["note"] = call.note
    try:
        call.gpu()
        if prob.torch is not None:
            prob.torch.cuda.synchronize()
        rec["check"] = checker.check(stage, call.result(), mod.NAME)
        rec["ok"] = True
    except AssertionError as err:
        rec["error"] = "check: " + short(err)
        return rec, None
    except Exception as err:
        if type(err).__name__ == "QSAInputError" and "dtype" in str(err):
            rec["skipped"] = "refuses the input dtype: " + short(err)
            return rec, None
        rec["error"] = short(err)
        if os.environ.get("BENCH_TRACE"):
            traceback.print_exc()
        return rec, None
    if smoke:
        return rec, call
    rec["ms_gpu"], rec["reps"] = timer.gpu(call.gpu)
    try:
        rec["ms_e2e"] = timer.e2e(call.e2e or call.gpu, slow=rec["ms_gpu"] > 50)
    except Exception as err:
        rec["e2e_error"] = short(err)
    floor, flop, nbytes = prob.floor_ms(stage, mod.NAME)
    ms = rec["ms_gpu"]
    rec.update(floor_ms=floor, flop=flop, bytes=nbytes, tflops=flop / ms / 1e9 if flop else None,
               gbs=nbytes / ms / 1e6, pct_floor=100 * floor / ms)
    if stage == "attention" and prob.overlap is not None:
        rec["overlap"] = prob.overlap
    if stage in ("select", "prefill"):
        rec["overlap"] = checker.selection_overlap()
    return rec, call


def finish_table(results):
    """Ratio of every timed row to the fastest peer of its (case, stage); geometric means."""
    best = {}
    for r in results:
        lib = r["impl"].split(".")[0]
        if r["ms_gpu"] is None or lib == "numqsa" or lib in PEER_EXCLUDED_FROM_FASTEST:
            continue
        key = (r["case"], r["stage"])
        if key not in best or r["ms_gpu"] < best[key][0]:
            best[key] = (r["ms_gpu"], r["impl"])
    for r in results:
        b = best.get((r["case"], r["stage"]))
        if r["ms_gpu"] is not None and b:
            r["vs_fastest_peer"] = r["ms_gpu"] / b[0]
            r["fastest_peer"] = b[1]
    geo = {}
    for r in results:
        if r.get("vs_fastest_peer"):
            geo.setdefault((r["stage"], r["impl"]), []).append(math.log(r["vs_fastest_peer"]))
    return [dict(stage=s, impl=i, geomean_vs_fastest_peer=math.exp(sum(v) / len(v)), cases=len(v))
            for (s, i), v in sorted(geo.items())]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one case per section (adapter debugging)")
    ap.add_argument("--smoke", action="store_true", help="tiny simulator case, no timings")
    ap.add_argument("--only", help="comma-separated substrings of case names or sections to run")
    ap.add_argument("--impls", help="comma-separated implementations (default: all)")
    ap.add_argument("--stages", help="comma-separated stages to run of each case (default: all)")
    ap.add_argument("--out", help="folder for latest.json/csv/log and plots "
                                  "(default bench/results; smoke: nothing written unless given)")
    ap.add_argument("--trtllm-kernels", default=None,
                    help="TensorRT-LLM kernels.py when tensorrt_llm is not installed "
                         "(default .peers/trtllm/kernels.py of the checkout)")
    ap.add_argument("--sglang-root", default=None,
                    help="folder holding the sglang wheel's sglang/srt/... files "
                         "(default .peers/sglang of the checkout)")
    ap.add_argument("--no-host", action="store_true", help="skip the host-overhead lines")
    args = ap.parse_args(argv)
    t_start = time.time()
    # numba warns on every small grid (decode-size cases): noise in the report, not a finding
    warnings.filterwarnings("ignore", message=".*will likely result in GPU under-utilization.*")
    torch = gpu_usable()
    smoke = args.smoke or torch is None
    if smoke and not os.environ.get("NUMBA_ENABLE_CUDASIM"):
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
        torch = None
    peers_dir = os.path.join(ROOT, ".peers")
    args.trtllm_kernels = args.trtllm_kernels or os.path.join(peers_dir, "trtllm", "kernels.py")
    args.sglang_root = args.sglang_root or os.path.join(peers_dir, "sglang")
    out_dir = args.out if (args.out or smoke) else os.path.join(HERE, "results")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    sys.stdout = Tee(os.path.join(out_dir, "latest.log") if out_dir else None)

    from bench import peers
    from bench.checks import Checker
    from bench.workloads import Problem, case_list
    if smoke:
        print("# SMOKE RUN in the numba CUDA simulator: correctness checks only, NO TIMINGS are "
              "printed or recorded" + ("" if out_dir else "; nothing is written"))
    device, env = environment(torch)
    rev = revision()
    print(f"# device {device}  git {rev}")
    print(f"# versions {env}")
    mods = []
    wanted = set(args.impls.split(",")) if args.impls else None
    for m in peers.modules():
        if wanted and m.NAME not in wanted:
            continue
        why = m.load(args)
        if why:
            print(f"# {m.NAME}: skipped: {why}")
            continue
        mods.append(m)
        print(f"# {m.NAME}: {m.versions()}")
    vers = dict(env, peers={m.NAME: m.versions() for m in mods})
    timer = None
    if not smoke:
        from bench.timing import Timer
        timer = Timer(torch)
    cases = case_list(quick=args.quick, smoke=smoke)
    if args.only:
        keys = args.only.split(",")
        cases = [c for c in cases if any(k in c.name or k == c.section for k in keys)]
    results, sections = [], {}
    print(HEAD)
    section, t_sec = None, time.time()
    for case in cases:
        if case.section != section:
            if section:
                sections[section] = time.time() - t_sec
                print(f"# section {section}: {sections[section]:.1f} s (elapsed {time.time() - t_start:.0f} s)")
            section, t_sec = case.section, time.time()
        t0 = time.time()
        try:
            prob = Problem(case, torch)
        except Exception as err:
            print(f"# {case.name}: problem generation failed: {short(err)}")
            continue
        checker = Checker(prob)
        gen_s = time.time() - t0
        hosts = {}
        for stage in case.stages:
            if args.stages and stage not in args.stages.split(","):
                continue
            for m in mods:
                variants = [None]
                if m.NAME == "numqsa" and stage == "attention":
                    from bench.peers.numqsa_api import routes
                    try:
                        variants += routes(prob)[1]
                    except Exception:
                        pass
                for route in variants:
                    rec, call = run_one(m, stage, prob, checker, timer, route, smoke)
                    rec["gen_s"] = round(gen_s, 2)
                    results.append(rec)
                    print(line(rec), flush=True)
                    if call is not None and rec["ok"]:
                        hosts.update(call.host)
                        if smoke:          # each host-line call runs once, so none is untried
                            for fn in call.host.values():
                                fn()
        if case.host_lines and not smoke and not args.no_host:
            for name, fn in hosts.items():
                rec = record(case, "host", name)
                try:
                    rec["ms_e2e"], rec["syncs"] = timer.host(fn)
                    rec["ms_host_busy"] = timer.last_busy_ms
                    if not rec["syncs"]:
                        rec["ms_host_loop"] = timer.host_loop(fn)
                    rec["ok"] = True
                except Exception as err:
                    rec["error"] = short(err)
                results.append(rec)
                print(line(rec), flush=True)
        del prob, checker, hosts
        if torch is not None:
            torch.cuda.empty_cache()
    if section:
        sections[section] = time.time() - t_sec
        print(f"# section {section}: {sections[section]:.1f} s (elapsed {time.time() - t_start:.0f} s)")

    geo = finish_table(results)
    print("\n" + HEAD)
    print("-" * len(HEAD))
    for r in results:
        print(line(r))
    if geo:
        print("\ngeometric mean of GPU time / fastest peer's, per stage:")
        for g in geo:
            print(f"  {g['stage']:9s} {g['impl']:16s} {g['geomean_vs_fastest_peer']:7.2f}x "
                  f"over {g['cases']} cases")
    red = [r for r in results if not r["ok"] and not r.get("skipped")]
    print(f"\n{len(results)} rows, {sum(r['ok'] for r in results)} ok, {len(red)} failed, "
          f"{sum(bool(r.get('skipped')) for r in results)} skipped; {time.time() - t_start:.0f} s")
    if out_dir:
        cmd = "python3 bench/run.py " + " ".join(argv if argv is not None else sys.argv[1:])
        doc = dict(git_rev=rev, device=device, versions=vers, command=cmd.strip(), smoke=smoke,
                   seconds=round(time.time() - t_start, 1), sections=sections,
                   floors="max(FLOP / 777e12, bytes / 4.24e12)", geomean=geo, results=results)
        jpath = os.path.join(out_dir, "latest.json")
        with open(jpath, "w") as f:
            json.dump(doc, f, indent=1, default=float)
        cpath = os.path.join(out_dir, "latest.csv")
        cols = ["case", "stage", "impl", "rows", "context", "dtype", "hq", "hkv", "page_size", "kb",
                "ms_gpu", "ms_e2e", "ms_host_loop", "ok", "tflops", "gbs", "pct_floor", "floor_ms",
                "vs_fastest_peer", "fastest_peer", "overlap", "route", "dist", "syncs", "skipped",
                "error"]
        with open(cpath, "w", newline="") as f:
            w = csv.DictWriter(f, cols, extrasaction="ignore")
            w.writeheader()
            w.writerows(results)
        made = []
        if not smoke:
            from bench.plots import plots
            made = plots(doc, out_dir)
        print(f"wrote {jpath}, {cpath}" + "".join(f", {p}" for p in made))
    return 1 if red else 0


if __name__ == "__main__":
    sys.exit(main())
