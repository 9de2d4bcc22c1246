"""Repeated qsa_prefill calls on one Workspace vs fresh ones, per route; each against the oracle."""
import os, sys
import numpy as np
sys.path.insert(0, "tests")
import torch
import numqsa, oracle
from test_prefill import ARGS, _gpu_problem, args, host
seed = 696680913
p = _gpu_problem(seed); q2 = _gpu_problem(seed + 1)
t = [torch.from_numpy(np.ascontiguousarray(a)).cuda() for a in args(p)]
s = torch.cuda.Stream()
ws = numqsa.Workspace()
kw = dict(workspace=ws, num_groups=2048, validate=False, stream=s)
def call(w):
    with torch.cuda.stream(s):
        r = numqsa.qsa_prefill(*t, **{**kw, "workspace": w})
    s.synchronize()
    return [host(x).copy() for x in r]
A = call(ws)
with torch.cuda.stream(s):
    for name in ("qi", "q"):
        t[ARGS.index(name)].copy_(torch.from_numpy(q2[name]))
s.synchronize()
B = call(ws); B2 = call(ws)
C = call(numqsa.Workspace()); C2 = call(numqsa.Workspace())
d = {n: x for n, x in zip(ARGS, t)}
with torch.cuda.stream(s):
    D = numqsa.sparse_attention(d["q"], d["k_cache"], d["v_cache"], d["block_table"], torch.from_numpy(B[2]).cuda(),
                                torch.from_numpy(B[3]).cuda(), d["req_ids"], d["seq_lens"], route_name="generic", stream=s)
s.synchronize(); D = [host(x) for x in D]
rows = np.arange(0, 1024, 97)
ref, ref_lse = oracle.sparse_attention(q2["q"][rows], p["k_cache"], p["v_cache"], p["block_table"], B[2][rows], B[3][rows],
                                       p["req_ids"][rows], p["seq_lens"])
def err(x): return float(np.abs(x[0][rows].astype(np.float64) - ref).max())
eq = lambda a, b: all(np.array_equal(x.view(np.uint8), y.view(np.uint8)) for x, y in zip(a[:2], b[:2]))
env = " ".join(f"{k}={os.environ[k]}" for k in ("NUMQSA_ARCH", "NUMQSA_PAGE4") if k in os.environ) or "sm_90"
bad = np.any(B[0] != C[0], axis=(1, 2))
print(f"[{env}] B==A(stale) {eq(B, A)}; tokens B==C {np.array_equal(B[2], C[2])}; B==B2 {eq(B, B2)}; C==C2 {eq(C, C2)}; B==C {eq(B, C)}; "
      f"rows B!=C {int(bad.sum())}/1024 first {np.flatnonzero(bad)[:6].tolist()}; max|err| vs oracle (13 rows): "
      f"A(old q) {err(A):.3g} B {err(B):.3g} C {err(C):.3g} D(direct generic) {err(D):.3g}")
