"""What a ``Kb`` past the visible groups costs (issue 22 point 4): one prefill per ``Kb``, a 2-line table.

    python3 bench/kb_probe.py [--case 4096x32K] [--kb 512,20000] [--iters 10]

Per ``Kb``: one :class:`numqsa.QSAPrefillWrapper` planned on a batch of rows at the end of one
request (page size 64 in random physical order, Hi 4 / Di 128 / Hq 6 / Hkv 1 / D 256, float16),
then ``run`` with ``out=`` buffers. GPU: the median GPU-only time of ``--iters`` calls
(``attention_probe.gpu_time``: behind a spin kernel, between CUDA events); simulator: the wall time of
one call (default case 3x300, ``Kb`` 8 and 20000). Each line gives the page-4 plan's width
(``pages.shape[1]``: ``min(Kb, visible groups) + 1`` since issue 22) and checks the counts against
the oracle's rule (``min(Kb, nb) * r`` plus the tail): a wrong count prints FAIL, not a time.
"""
import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)


def parse_case(s):
    rows, ctx = s.lower().split("x")
    return int(rows), int(ctx[:-1]) * 1024 if ctx.endswith("k") else int(ctx)


def main():
    from numqsa.jit import SIMULATOR
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="3x300" if SIMULATOR else "4096x32K")
    ap.add_argument("--kb", default="8,20000" if SIMULATOR else "512,20000")
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    from numba import cuda

    import numqsa
    from attention_probe import gpu_time, spin_kernel
    spin = None if SIMULATOR else spin_kernel()
    from oracle.batch import row_states
    from oracle.problems import make_problem
    rows, ctx = parse_case(a.case)
    small = SIMULATOR
    geo = (dict(Hi=2, Di=16, Hq=2, Hkv=1, D=32) if small else
           dict(Hi=4, Di=128, Hq=6, Hkv=1, D=256))
    p = make_problem([ctx], rows_per_req=[rows], page_size=16 if small else 64, dtype=np.float16,
                     seed=1, **geo)
    d = {k: cuda.to_device(np.ascontiguousarray(v)) for k, v in p.items()}
    _, _, pos, nb = row_states(p["req_ids"], p["positions"], p["seq_lens"], 4)
    print(f"case {a.case} ({'simulator, one call' if small else 'GPU ms, median of %d' % a.iters})")
    for kb in (int(x) for x in a.kb.split(",")):
        w = numqsa.QSAPrefillWrapper(Kb=kb, **geo)
        w.plan(d["req_ids"], d["positions"], d["seq_lens"], d["block_table"])
        out = (cuda.device_array((rows, geo["Hq"], geo["D"]), np.float16),
               cuda.device_array((rows, geo["Hq"]), np.float32),
               cuda.device_array((rows, w.width), np.int32), cuda.device_array(rows, np.int32))
        args = [d[k] for k in ("qi", "index_cache", "q", "k_cache", "v_cache")]

        def call():
            return w.run(*args, out=out, return_selection=True)
        if small:
            t0 = time.perf_counter()
            call()
            ms = 1e3 * (time.perf_counter() - t0)
        else:
            call()
            ms = gpu_time(call, a.iters, spin)
        cuda.synchronize()
        counts = out[3].copy_to_host()
        want = 4 * np.minimum(kb, nb) + (pos + 1 - 4 * nb)
        width = w._ws.kept("page4.pages").shape[1]
        check = "ok" if np.array_equal(counts, want) else "FAIL"
        print(f"Kb {kb:>6}: {('%.3f ms' % ms) if check == 'ok' else 'n/a':>12}  page-4 plan "
              f"{width} pages  counts {check}", flush=True)


if __name__ == "__main__":
    main()
