"""Offline resource report: every numqsa kernel compiled for sm_70 and sm_90 without a GPU.

``python -m numqsa.resources`` compiles each kernel module's ``RESOURCE_CASES`` to LTO-IR with the
install's CUDA toolchain (CUDA 12, ``numqsa[cu12]``, builds both architectures), links it with
nvJitLink as numba does at launch (so float16 helpers are inlined), and parses ptxas' report:
registers, static shared memory, stack frame and spills. With the launch's threads per block and
dynamic shared memory it derives the blocks per SM and occupancy on a V100 (sm_70) and an H200
(sm_90). ``--check`` exits non-zero on any spill, or on shared memory that does not fit a V100 block
(48 KB static) for sm_70 cases. ``--arch sm_90`` reports one architecture: a CUDA 13 install
(``numqsa[cu13]``) cannot build sm_70 and refuses it before compiling (:mod:`numqsa.toolchain`).

A ``RESOURCE_CASES`` entry is ``(name, kernel, signature, threads_per_block, dynamic_smem_bytes, cc)``
with ``kernel`` a ``cuda.jit`` dispatcher (or its Python function) and ``cc`` ``(7, 0)``, ``(9, 0)``
or ``None`` for both.

Compile once: each case's ptxas line is kept in a cache keyed by every source file of the numqsa
package (a kernel's code reaches into shared device functions, so any edit invalidates all), the
versions of numba, numba-cuda and the CUDA compiler wheels, the case and the architecture. The
cache lives in ``$NUMQSA_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/numqsa`` (``~/.cache/numqsa``),
under ``resources/``; ``NUMQSA_CACHE_DIR=off`` disables it, and deleting the directory clears it.
"""
import argparse
import contextlib
import hashlib
import importlib
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from .toolchain import ToolchainError, check_target, toolchain

KERNEL_MODULES = ("mma", "index_keys", "index_scores", "guard", "topk", "expand", "attention", "page4",
                  "grouped")


@dataclass(frozen=True)
class SMLimits:
    name: str
    regs: int = 65536
    max_threads: int = 2048
    max_blocks: int = 32
    smem: int = 96 * 1024          # per SM, at the largest carveout
    smem_block_static: int = 48 * 1024
    smem_reserved_per_block: int = 0
    reg_alloc_unit: int = 256      # registers are allocated per warp in units of 256


LIMITS = {
    (7, 0): SMLimits("V100"),
    (9, 0): SMLimits("H200", smem=228 * 1024, smem_reserved_per_block=1024),
}


def occupancy(lim, regs, threads, smem_block):
    """Theoretical resident blocks per SM and warp occupancy."""
    warps = -(-threads // 32)
    regs_warp = -(-max(regs, 1) * 32 // lim.reg_alloc_unit) * lim.reg_alloc_unit
    by_regs = lim.regs // (regs_warp * warps)
    by_threads = lim.max_threads // (warps * 32)
    smem = smem_block + lim.smem_reserved_per_block
    by_smem = lim.smem // smem if smem else lim.max_blocks
    blocks = min(by_regs, by_threads, by_smem, lim.max_blocks)
    return blocks, blocks * warps / (lim.max_threads // 32)


@contextlib.contextmanager
def _offline_device(cc):
    """Lazily compiled device functions ask for the current device's cc; with no GPU, pretend."""
    import numba.cuda.dispatcher as disp

    class _Device:
        compute_capability = tuple(cc)
        name = b"offline"
        id = 0

    saved = disp.get_current_device
    disp.get_current_device = lambda: _Device()
    try:
        yield
    finally:
        disp.get_current_device = saved


def link(kernel, sig, cc):
    """``(cubin bytes, link log)`` of ``kernel`` at ``sig`` for ``cc``, linked as numba links it at
    launch (LTO), with no GPU (``bench/sass.py`` disassembles the cubin)."""
    from numba import cuda
    try:
        from cuda.core import Linker, LinkerOptions, ObjectCode
    except ImportError:  # older cuda-core
        from cuda.core.experimental import Linker, LinkerOptions, ObjectCode
    pyfunc = getattr(kernel, "py_func", kernel)
    opts = dict(getattr(kernel, "targetoptions", {}) or {})
    kw = {k: opts[k] for k in ("fastmath", "lineinfo", "launch_bounds") if opts.get(k)}
    with _offline_device(cc):
        codes, _ = cuda.compile_all(pyfunc, sig, device=False, abi="numba", cc=cc,
                                    output="ltoir", **kw)
    objs = []
    for i, c in enumerate(codes):
        if isinstance(c, (bytes, bytearray)):
            objs.append(ObjectCode.from_ltoir(bytes(c), name=f"m{i}"))
        elif isinstance(c, ObjectCode):
            objs.append(c)
        else:
            kind = getattr(c, "kind", "ltoir")
            ctor = {"ptx": ObjectCode.from_ptx, "cubin": ObjectCode.from_cubin,
                    "fatbin": ObjectCode.from_fatbin}.get(kind, ObjectCode.from_ltoir)
            objs.append(ctor(c.data, name=getattr(c, "name", f"m{i}")))
    linker = Linker(*objs, options=LinkerOptions(
        arch=f"sm_{cc[0]}{cc[1]}", verbose=True, link_time_optimization=True,
        max_register_count=opts.get("max_registers")))
    obj = linker.link("cubin")
    return bytes(obj.code), linker.get_info_log()


def _parse(log):
    """The entry kernel's line of the ptxas report (the last 'Compiling entry function' block)."""
    blocks = re.split(r"ptxas info\s*: Compiling entry function", log)[1:]
    if not blocks:
        raise RuntimeError("no ptxas report in the link log:\n" + log)
    blk = blocks[-1]
    num = lambda pat: int(m[1]) if (m := re.search(pat, blk)) else 0
    return dict(regs=num(r"Used (\d+) registers"), smem=num(r"(\d+) bytes smem"),
                stack=num(r"(\d+) bytes stack frame"), spill_st=num(r"(\d+) bytes spill stores"),
                spill_ld=num(r"(\d+) bytes spill loads"))


# The distributions whose versions change what a kernel compiles to.
TOOLCHAIN = ("numba", "numba-cuda", "llvmlite", "cuda-core", "cuda-bindings", "cuda-toolkit",
             "nvidia-cuda-nvcc-cu12", "nvidia-nvjitlink-cu12", "nvidia-cuda-nvrtc-cu12",
             "nvidia-cuda-nvcc", "nvidia-nvjitlink", "nvidia-cuda-nvrtc", "nvidia-nvvm")


def cache_dir():
    """The resource cache's directory, or ``None`` when ``NUMQSA_CACHE_DIR=off``."""
    root = os.environ.get("NUMQSA_CACHE_DIR")
    if root is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "numqsa")
    elif root.lower() in ("off", "0", ""):
        return None
    return Path(root) / "resources"


def source_key():
    """A hash of every numqsa source file and the compiler toolchain: its wheels' versions, the
    NVRTC version and the libNVVM numba-cuda loads (path, size and time: a machine's own toolkit)."""
    from importlib import metadata
    h = hashlib.sha256()
    pkg = Path(__file__).resolve().parent
    for path in sorted(pkg.rglob("*.py")):
        h.update(str(path.relative_to(pkg)).encode() + b"\0" + path.read_bytes() + b"\0")
    for dist in TOOLCHAIN:
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            version = "-"
        h.update(f"{dist}={version}\0".encode())
    t = toolchain()
    nvvm = os.stat(t.nvvm) if t.nvvm and os.path.exists(t.nvvm) else None
    h.update(repr((t.nvrtc, t.nvvm, nvvm and (nvvm.st_size, nvvm.st_mtime_ns))).encode())
    return h.hexdigest()


def _read_cached(where):
    if where is not None and where.is_file():
        try:
            return json.loads(where.read_text())
        except (OSError, ValueError):
            pass                                    # a torn or foreign file: compile again
    return None


def _write_cached(where, r):
    if where is None:
        return
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        tmp = where.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(r))
        os.replace(tmp, where)
    except OSError:
        pass                                        # a read-only cache only costs the recompile


_JOBS = []      # (kernel, signature, cc) of the compiles a forked worker runs, by index


def _compile(i):
    kernel, sig, target = _JOBS[i]
    return _parse(link(kernel, sig, target)[1])


def _compile_all(jobs):
    """ptxas lines of ``jobs``, compiled in forked workers (one per CPU) when there are several."""
    workers = min(len(jobs), os.cpu_count() or 1)
    _JOBS[:] = jobs
    try:
        if workers > 1:
            import multiprocessing
            with multiprocessing.get_context("fork").Pool(workers) as pool:
                return pool.map(_compile, range(len(jobs)), chunksize=1)
        return [_compile(i) for i in range(len(jobs))]
    finally:
        _JOBS.clear()


def collect_cases(modules=KERNEL_MODULES):
    cases = []
    for mod in modules:
        try:
            m = importlib.import_module(f"numqsa.kernels.{mod}")
        except ModuleNotFoundError as err:
            if err.name == f"numqsa.kernels.{mod}":
                continue      # stage not written yet
            raise
        for case in getattr(m, "RESOURCE_CASES", ()):
            cases.append((mod,) + tuple(case))
    return cases


def report(modules=KERNEL_MODULES, ccs=((7, 0), (9, 0))):
    for target in ccs:           # refuse a target the toolchain cannot build before compiling any
        check_target(target)
    root = cache_dir()
    key = source_key() if root is not None else None
    env = sorted((k, v) for k, v in os.environ.items()
                 if k.startswith("NUMQSA_") and k not in ("NUMQSA_CACHE_DIR", "NUMQSA_SEED"))
    cases = []
    for mod, name, kernel, sig, threads, dyn_smem, cc in collect_cases(modules):
        for target in ccs:
            if cc is not None and tuple(cc) != target:
                continue
            where = None
            if root is not None:
                case = hashlib.sha256(f"{key}|{env}|{mod}|{name}|{sig}|{threads}|{dyn_smem}|"
                                      f"{target}".encode()).hexdigest()
                where = root / f"{case[:32]}.json"
            cases.append((mod, name, kernel, sig, threads, dyn_smem, target, where))
    found = [_read_cached(c[-1]) for c in cases]
    missing = [i for i, r in enumerate(found) if r is None]
    for i, r in zip(missing, _compile_all([(cases[i][2], cases[i][3], cases[i][6])
                                           for i in missing])):
        found[i] = r
        _write_cached(cases[i][-1], r)
    rows = []
    for (mod, name, _, _, threads, dyn_smem, target, _), r in zip(cases, found):
        lim = LIMITS[target]
        blocks, occ = occupancy(lim, r["regs"], threads, r["smem"] + dyn_smem)
        rows.append(dict(module=mod, kernel=name, arch=f"sm_{target[0]}{target[1]}",
                         gpu=lim.name, threads=threads, dyn_smem=dyn_smem, **r,
                         blocks_per_sm=blocks, occupancy=occ))
    return rows


def problems(rows):
    """Spills anywhere; shared memory that a V100 block cannot have; kernels that cannot launch."""
    out = []
    for r in rows:
        where = f"{r['kernel']} ({r['arch']})"
        if r["spill_st"] or r["spill_ld"]:
            out.append(f"{where}: spills {r['spill_st']} B stored / {r['spill_ld']} B loaded")
        if r["arch"] == "sm_70" and r["smem"] > LIMITS[(7, 0)].smem_block_static:
            out.append(f"{where}: {r['smem']} B static shared memory > 48 KB")
        if r["blocks_per_sm"] < 1:
            out.append(f"{where}: not even one block fits an SM")
    return out


def format_table(rows):
    head = (f"{'kernel':34s} {'arch':5s} {'thr':>4s} {'regs':>4s} {'smem':>6s} {'dyn':>6s} "
            f"{'stack':>5s} {'spill':>5s} {'blk/SM':>6s} {'occ':>5s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['kernel'][:34]:34s} {r['arch']:5s} {r['threads']:4d} {r['regs']:4d} "
                     f"{r['smem']:6d} {r['dyn_smem']:6d} {r['stack']:5d} "
                     f"{r['spill_st'] + r['spill_ld']:5d} {r['blocks_per_sm']:6d} {r['occupancy']:5.0%}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write the rows as JSON here")
    ap.add_argument("--check", action="store_true", help="exit 1 on spills or V100-illegal shared memory")
    ap.add_argument("--arch", action="append", choices=["sm_70", "sm_90"],
                    help="report this architecture only (repeatable; default: sm_70 and sm_90)")
    ap.add_argument("modules", nargs="*", default=list(KERNEL_MODULES))
    args = ap.parse_args(argv)
    ccs = tuple((int(a[3]), int(a[4])) for a in sorted(set(args.arch or ["sm_70", "sm_90"])))
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        sys.exit("the resource report compiles real kernels: unset NUMBA_ENABLE_CUDASIM")
    import warnings
    warnings.simplefilter("ignore")
    try:
        rows = report(args.modules, ccs)
    except ToolchainError as err:
        sys.exit(f"numqsa.resources: {err}\n(--arch sm_90 reports what this install can build)")
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    bad = problems(rows)
    for b in bad:
        print("PROBLEM:", b)
    if args.check and (bad or not rows):
        sys.exit(1 if bad else "no kernels found")


if __name__ == "__main__":
    main()
