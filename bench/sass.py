"""A kernel's SASS without a GPU: its tensor-core loops, block by block.

    python bench/sass.py grouped grouped_attn_g6 [--cc 9.0] [--out FILE.sass] [--all]

Builds ``RESOURCE_CASES`` entry ``NAME`` of ``numqsa.kernels.MODULE`` as numba links it at launch
(:func:`numqsa.resources.link`: LTO-IR, nvJitLink), disassembles the cubin with ``nvdisasm``, and
prints the innermost loop that holds ``HMMA`` (``--all``: every such loop, innermost first) as
basic blocks: address, label, instruction count, the counts of the instructions that set its pace
(``HMMA``, ``LDSM``, ``SYNCS`` mbarrier waits and arrivals, ``SHFL``, ``MUFU``, ``LDS``, ``STS``,
``BAR``) and the branch that ends it. Adding up the blocks a chunk runs gives its instruction
count on the executed path (docs/kernels/grouped.md's versions table has them).

``nvdisasm`` is CUDA's (on ``PATH``) or the wheel's: ``pip install nvidia-cuda-nvdisasm`` (CUDA
13.2 and newer on PyPI: it reads sm_90 cubins and refuses sm_70's, which need CUDA 13.0's or
older). It compiles real kernels, as ``python -m numqsa.resources``
does: ``NUMBA_ENABLE_CUDASIM=1`` is refused, and unset it means 0 (no simulator fallback).
"""
import argparse
import collections
import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")      # before numqsa: real kernels, no GPU

PACE = ("HMMA", "LDSM", "SYNCS", "SHFL", "MUFU", "LDS", "STS", "BAR")


def nvdisasm():
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia
    except ImportError:
        nvidia = None
    for root in getattr(nvidia, "__path__", []):
        for sub in ("cu13", "cu12", "cuda_nvdisasm", ""):
            p = os.path.join(root, sub, "bin", "nvdisasm")
            if os.access(p, os.X_OK):
                return p
    sys.exit("no nvdisasm: pip install nvidia-cuda-nvdisasm, or put CUDA's bin on PATH")


def disassemble(module, name, cc):
    from numqsa.resources import link
    mod = importlib.import_module(f"numqsa.kernels.{module}")
    cases = {c[0]: c for c in getattr(mod, "RESOURCE_CASES", ())}
    if name not in cases:
        sys.exit(f"{module} has no case {name!r}; it has: {', '.join(cases) or 'none'}")
    _, kernel, sig, _, _, case_cc = cases[name]
    cubin, _ = link(kernel, sig, tuple(case_cc or cc))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        run = subprocess.run([nvdisasm(), "-c", f.name], capture_output=True, text=True)
    if run.returncode:
        sys.exit(f"nvdisasm: {run.stderr.strip()}")
    return run.stdout


def parse(text):
    """Instructions ``(address, predicate, opcode, operands)`` and labels (name -> index)."""
    ins, labels = [], {}
    for line in text.splitlines():
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            labels[m[1]] = len(ins)
            continue
        m = re.match(r"\s*/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*(.*?);", line)
        if m:
            ins.append((int(m[1], 16), (m[2] or "").strip(), m[3], m[4]))
    return ins, labels


def target(op, operands):
    m = re.search(r"`\((\.L_x_\d+)\)", operands) if op.startswith("BRA") else None
    return m[1] if m else None


def mma_loops(ins, labels):
    """``(first, last)`` index of every loop (a backward branch) whose body holds ``HMMA``,
    innermost (shortest) first."""
    loops = []
    for i, (_, _, op, operands) in enumerate(ins):
        t = target(op, operands)
        if t is not None and labels.get(t, len(ins)) <= i:
            s = labels[t]
            if any(x[2].startswith("HMMA") for x in ins[s:i + 1]):
                loops.append((i - s, s, i))
    return [(s, e) for _, s, e in sorted(loops)]


def blocks(ins, labels, s, e):
    starts = {s} | {v for v in labels.values() if s <= v <= e}
    starts |= {i + 1 for i in range(s, e) if ins[i][2].startswith(("BRA", "EXIT", "RET"))}
    starts = sorted(starts)
    names = {v: k for k, v in labels.items()}
    out = []
    for n, b in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else e + 1
        body = ins[b:end]
        c = collections.Counter(x[2].split(".")[0] for x in body)
        last = body[-1]
        br = f"{last[1]} {target(last[2], last[3])}".strip() if last[2].startswith("BRA") else ""
        out.append((ins[b][0], names.get(b, ""), len(body),
                    " ".join(f"{k} {c[k]}" for k in PACE if c[k]), br))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("module")
    ap.add_argument("name")
    ap.add_argument("--cc", default="9.0", help="architecture of a case built for both (default 9.0)")
    ap.add_argument("--out", help="also write the whole disassembly here")
    ap.add_argument("--all", action="store_true", help="every loop holding HMMA, not the innermost")
    args = ap.parse_args(argv)
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        sys.exit("sass.py compiles real kernels: unset NUMBA_ENABLE_CUDASIM")
    import warnings
    warnings.simplefilter("ignore")
    text = disassemble(args.module, args.name, tuple(int(x) for x in args.cc.split(".")))
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    ins, labels = parse(text)
    loops = mma_loops(ins, labels)
    print(f"{args.module}.{args.name}: {len(ins)} instructions, {len(loops)} loops holding HMMA")
    for s, e in loops if args.all else loops[:1]:
        mix = collections.Counter(x[2].split(".")[0] for x in ins[s:e + 1])
        print(f"\nloop {ins[s][0]:#x}-{ins[e][0]:#x}: {e - s + 1} instructions; "
              + ", ".join(f"{k} {v}" for k, v in mix.most_common(12)))
        for addr, name, n, pace, br in blocks(ins, labels, s, e):
            print(f"  {addr:6x} {name:10s} {n:4d}  {pace:34s} {br}")


if __name__ == "__main__":
    main()
