"""The union ring's copies alone: what a 512-byte token row costs in shared-memory wavefronts.

    python3 bench/copy_probe.py [--iters 20] [--variants ring,aligned,uncond,aligned-uncond,regs]
    M=smsp__inst_executed_op_ldgsts.sum,lts__t_sectors_srcunit_tex_op_read.sum
    M=$M,smsp__sass_l1tex_data_pipe_lsu_wavefronts_mem_shared_op_ldgsts.sum
    ncu --metrics $M -k regex:copy_probe python3 bench/copy_probe.py --iters 1

Session 21's Nsight Compute of the union kernel (grouped attention v28, 4096 x 32K) counted 10.5
shared wavefronts for each ``cp.async`` of a token row, where 4 carry 512 bytes, and 28% excess L2
sectors. The producers copy a page-4 group as the ring does: each of a warp's 32 lanes copies 16
bytes of each of the group's 4 token rows (one instruction a row, 512 contiguous bytes on both
sides). This probe runs that pattern alone, over an L2-resident pool, in four variants:

* ``ring``: rows 528 bytes apart (the ring's 16-byte padding), the copies under a runtime
  condition that is always true (compiled as predicated ``@P LDGSTS``);
* ``aligned``: rows 512 bytes apart, under the same condition;
* ``uncond``, ``aligned-uncond``: the same two without the condition;
* ``regs``: no ``cp.async``: each lane loads 4 words of each row into registers (32-bit loads,
  128 contiguous bytes an instruction), then stores them into the padded ring (the design that
  replaces the copies if no ``cp.async`` form reaches 4 wavefronts a row).

The kernel's copies are unpredicated ``LDGSTS`` inside a ``BSSY``/``BSYNC`` region (the page
lookup's branches), which no variant reproduces exactly: if every ``cp.async`` variant takes about 4
wavefronts a row, that region is the suspect; if every one takes about 10.5, ``LDGSTS`` itself costs
that here, and ``regs`` says whether copies through registers do better.

Each variant prints its time and bandwidth; under ``ncu`` its wavefronts an instruction. The copies'
bytes are checked against the pool (one warp's last group), so a variant that copies wrongly fails.

Session 22's answer (H200, 8.65 M ``LDGSTS`` a variant; ``history/2026-12-05-s22-copy-probe``):
the rows' alignment decides. Rows 528 bytes apart cost 10.5 wavefronts a copy (90.8 M) and 207 M
L2 sectors; rows 512 bytes apart 4.0 (34.6 M) and 134 M, and copy in 0.478 ms against 0.744 (with
or without the condition; Nsight Compute's per-instruction wavefront metric reads 0 for the
predicated variants). ``regs`` took 0.506 ms. Grouped attention v30 (branch ``s22-v30``) keeps the
ring's rows unpadded and swizzles their chunks instead.
"""
import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from numba import cuda, uint32  # noqa: E402  (after the path: numqsa's simulator switch)

from numqsa.jit import SIMULATOR, jit  # noqa: E402
from numqsa.kernels.smem import (cp_async_16, cp_async_commit, cp_async_wait_fn,  # noqa: E402
                                 shared_base)
from attention_probe import gpu_time, spin_kernel  # noqa: E402  (GPU-only median behind a spin)

WARPS = 8                 # a block's copying warps
SLOTS = 2                 # ring pages a warp (a page: 4 token rows)
ROW_WORDS = 128           # a token row's data: D 256 in 16 bits
# name: (row stride in words, runtime condition around the copies, through registers)
VARIANTS = {"ring": (132, True, False), "aligned": (128, True, False),
            "uncond": (132, False, False), "aligned-uncond": (128, False, False),
            "regs": (132, False, True)}


def make_kernel(row_stride, cond, regs=False):
    """Kernel over ``(blocks,)`` x ``32 * WARPS``: each warp copies ``iters`` pseudo-random page-4
    groups of the pool (``ngroups``, a power of two) into its ``SLOTS`` ring pages (rows
    ``row_stride`` words apart), then writes its last group back to ``out[block, warp]`` for the
    check. ``regs``: through registers instead of ``cp.async``."""
    RS = int(row_stride)
    PAGE = 4 * RS                              # words a ring page
    COND = bool(cond)
    REGS = bool(regs)
    wait_all = cp_async_wait_fn(0)

    def copy_probe(pool, ngroups, iters, limit, out):
        dyn = cuda.shared.array(0, uint32)
        lane = uint32(cuda.threadIdx.x) % uint32(32)
        warp = uint32(cuda.threadIdx.x) // uint32(32)
        base = shared_base(dyn) + uint32(4 * SLOTS * PAGE) * warp + uint32(16) * lane
        wlane = uint32(SLOTS * PAGE) * warp + lane          # regs: the lane's first word
        h = (uint32(cuda.blockIdx.x) * uint32(WARPS) + warp) * uint32(2654435761)
        g = uint32(0)
        for it in range(iters):
            g = (h + uint32(it) * uint32(40503)) & uint32(ngroups - 1)
            slot = uint32(it) % uint32(SLOTS)
            row0 = g * uint32(4 * ROW_WORDS)         # the group's first word in the pool
            page = base + uint32(4 * PAGE) * slot
            src = row0 + uint32(4) * lane
            if REGS:
                # the group's 16 words of this lane (words lane + 32 x of each row) in registers,
                # then stored: 4 loads and 4 stores of 128 contiguous bytes a row
                v = cuda.local.array(16, uint32)
                for r in range(4):
                    for x in range(4):
                        v[4 * r + x] = pool[row0 + uint32(ROW_WORDS * r + 32 * x) + lane]
                w = wlane + uint32(PAGE) * slot
                for r in range(4):
                    for x in range(4):
                        dyn[w + uint32(RS * r + 32 * x)] = v[4 * r + x]
            elif COND:
                if lane < uint32(limit):
                    for r in range(4):
                        cp_async_16(dyn, page + uint32(4 * RS * r), pool,
                                    src + uint32(ROW_WORDS * r), 16)
            else:
                for r in range(4):
                    cp_async_16(dyn, page + uint32(4 * RS * r), pool, src + uint32(ROW_WORDS * r),
                                16)
            if slot == uint32(SLOTS - 1):
                cp_async_commit()
                wait_all()
        cp_async_commit()
        wait_all()
        cuda.syncthreads()
        # the last group's 4 rows: this lane's 4 words of each, from its last ring page
        last = uint32(iters - 1) % uint32(SLOTS)
        w0 = (uint32(SLOTS * PAGE) * warp + uint32(PAGE) * last + uint32(4) * lane)
        for r in range(4):
            for x in range(4):
                out[cuda.blockIdx.x, warp, r, 4 * lane + x] = dyn[w0 + uint32(RS * r + x)]

    copy_probe.__name__ = f"copy_probe_rs{RS}{'_cond' if COND else ''}{'_regs' if REGS else ''}"
    copy_probe.__qualname__ = copy_probe.__name__
    return jit(copy_probe)


def expected(pool, blocks, ngroups, iters):
    """Each (block, warp)'s last group, as the kernel picks it."""
    w = np.arange(blocks * WARPS, dtype=np.uint64)
    h = (w * np.uint64(2654435761)) & np.uint64(0xFFFFFFFF)
    g = ((h + np.uint64((iters - 1) * 40503)) & np.uint64(0xFFFFFFFF)) & np.uint64(ngroups - 1)
    rows = pool.reshape(-1, 4, ROW_WORDS)[g.astype(np.int64)]
    return rows.reshape(blocks, WARPS, 4, ROW_WORDS)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--iters", type=int, default=20,
                    help="timed launches a variant (median, each behind a spin kernel)")
    ap.add_argument("--blocks", type=int, default=132 * 4)
    ap.add_argument("--groups", type=int, default=4096,
                    help="page-4 groups in the pool, a power of two (4096: 8 MB, L2-resident)")
    ap.add_argument("--copies", type=int, default=512, help="groups a warp copies a launch")
    a = ap.parse_args()
    if a.groups & (a.groups - 1):
        ap.error("--groups must be a power of two")
    rng = np.random.default_rng(0)
    pool = rng.integers(0, 2 ** 32, a.groups * 4 * ROW_WORDS, dtype=np.uint64).astype(np.uint32)
    dpool = cuda.to_device(pool)
    out = cuda.device_array((a.blocks, WARPS, 4, ROW_WORDS), np.uint32)
    want = expected(pool, a.blocks, a.groups, a.copies)
    nbytes = a.blocks * WARPS * a.copies * 4 * ROW_WORDS * 4
    spin = None if SIMULATOR else spin_kernel()
    print(f"{'variant':<16} {'row B':>5} {'cond':>5} {'regs':>5} {'ms':>8} {'GB/s':>8}  check")
    for name in a.variants.split(","):
        rs, cond, regs = VARIANTS[name]
        k = make_kernel(rs, cond, regs)
        smem = 4 * WARPS * SLOTS * 4 * rs
        launch = k[a.blocks, 32 * WARPS, 0, smem]
        launch(dpool, a.groups, a.copies, 32, out)
        cuda.synchronize()
        ok = np.array_equal(out.copy_to_host(), want)
        ms = float("nan") if SIMULATOR else gpu_time(
            lambda: launch(dpool, a.groups, a.copies, 32, out), a.iters, spin)
        print(f"{name:<16} {4 * rs:>5} {str(cond):>5} {str(regs):>5} {ms:>8.4f} "
              f"{nbytes / ms / 1e6:>8.1f}  {'ok' if ok else 'WRONG'}")
        if not ok:
            sys.exit(1)


if __name__ == "__main__":
    main()
