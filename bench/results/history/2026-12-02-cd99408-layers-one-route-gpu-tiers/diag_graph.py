"""Graph replay vs eager, per output, under the routing env of the caller (diagnostic)."""
import os, sys
import numpy as np
sys.path.insert(0, "tests")
import torch
import numqsa
from test_prefill import ARGS, _gpu_problem, args, host
seed = 696680913
p = _gpu_problem(seed)
t = [torch.from_numpy(np.ascontiguousarray(a)).cuda() for a in args(p)]
ws = numqsa.Workspace()
s = torch.cuda.Stream()
kw = dict(workspace=ws, num_groups=2048, validate=False, stream=s)
with torch.cuda.stream(s):
    numqsa.qsa_prefill(*t, **kw)
s.synchronize()
mode = os.environ.get("DIAG_MODE", "graph")
q2 = _gpu_problem(seed + 1)
if mode == "graph":
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        captured = numqsa.qsa_prefill(*t, **kw)
    for name in ("qi", "q"):
        t[ARGS.index(name)].copy_(torch.from_numpy(q2[name]))
    g.replay()
else:   # replay through the wrapper's own graph (no capture), new inputs in the same buffers
    for name in ("qi", "q"):
        t[ARGS.index(name)].copy_(torch.from_numpy(q2[name]))
    with torch.cuda.stream(s):
        captured = numqsa.qsa_prefill(*t, **kw)
torch.cuda.synchronize()
replayed = [host(x) for x in captured]
eager = [host(x) for x in numqsa.qsa_prefill(*t, **{**kw, "workspace": numqsa.Workspace()})]
s.synchronize()
env = " ".join(f"{k}={os.environ[k]}" for k in ("NUMQSA_ARCH", "NUMQSA_PAGE4", "NUMQSA_INDEXER_TILED") if k in os.environ)
res = []
for n, a, b in zip(("out", "lse", "tokens", "counts"), eager, replayed):
    same = np.array_equal(a.view(np.uint8), b.view(np.uint8))
    res.append(f"{n} {'same' if same else 'DIFF %.3f' % np.mean(a != b)}")
print(f"{mode:6s} [{env or 'sm_90 default'}]: " + ", ".join(res))
