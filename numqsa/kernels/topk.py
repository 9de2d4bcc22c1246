"""Top-k groups per row (spec §5): exactly ``min(Kb, nb)`` groups by (score desc, group id asc).

Every visible group gets the 64-bit key ``(ordered score bits) << 32 | (~group id)``; the keys are
unique, so the ``Kb`` largest form a set with no ties to break. The kernel never builds the keys:
a radix select over the 32 ordered score bits (four 8-bit digits, most significant first) finds the
``Kb``-th best score ``s*`` and how many groups ``m`` scoring exactly ``s*`` are needed; those are the
``m`` lowest group ids among the equal ones (the low key half), which a compaction pass in ascending
group order takes first. The result is bitwise deterministic (no atomics decide anything: the
histogram is exact counts), holds on plateaus of exact zeros, and is written ascending.

Scores are read as their uint32 bit patterns (a float32 array viewed as uint32); ``-0.0`` counts as
``+0.0``. Visible scores must not be NaN (the oracle's contract).
"""
import functools

import numpy as np
from numba import cuda, int32, uint32

from ..jit import SIMULATOR, device_jit, jit
from .common import row_state

FULL_MASK = uint32(0xFFFFFFFF)
SIGN = uint32(0x80000000)
BINS = 256


def scan_scratch(threads):
    """Shared int32 elements the block scan needs: one per warp on a GPU, one per thread in the simulator."""
    return threads if SIMULATOR else max(1, threads // 32)


@functools.lru_cache(maxsize=None)
def make_block_scan(threads):
    """Device fn ``scan(v, tid, scratch) -> (inclusive, total)`` over int32; every thread calls it.

    GPU: warp shuffles then a serial pass over per-warp totals; simulator (no shuffles): Hillis-Steele
    over a shared array. Synchronises the block (twice on a GPU).
    """
    if threads & (threads - 1) or threads < 1:
        raise ValueError(f"block scan needs a power-of-two thread count, got {threads}")
    NT = threads

    if SIMULATOR:
        @device_jit
        def block_scan(v, tid, scratch):
            scratch[tid] = v
            cuda.syncthreads()
            off = uint32(1)
            while off < uint32(NT):
                x = int32(0)
                if tid >= off:
                    x = scratch[tid - off]
                cuda.syncthreads()
                scratch[tid] = scratch[tid] + x
                cuda.syncthreads()
                off *= uint32(2)
            incl = scratch[tid]
            total = scratch[NT - 1]
            cuda.syncthreads()
            return incl, total
        return block_scan

    NW = max(1, NT // 32)

    @device_jit
    def block_scan(v, tid, scratch):
        lane = tid & uint32(31)
        w = tid >> uint32(5)
        off = uint32(1)
        while off < uint32(32):
            n = cuda.shfl_up_sync(FULL_MASK, v, off)
            if lane >= off:
                v += n
            off *= uint32(2)
        if lane == uint32(31):
            scratch[w] = v
        cuda.syncthreads()
        base = int32(0)
        total = int32(0)
        for j in range(NW):
            x = scratch[j]
            if uint32(j) < w:
                base += x
            total += x
        cuda.syncthreads()
        return v + base, total
    return block_scan


@device_jit
def ordered_bits(b):
    """float32 bits -> uint32 whose unsigned order is the float order; -0.0 maps like +0.0."""
    if b == SIGN:
        b = uint32(0)
    if b & SIGN:
        return ~b
    return b | SIGN


@functools.lru_cache(maxsize=None)
def make_topk_kernel(threads, kb, r):
    """Top-k kernel: one block of ``threads`` threads per row; grid ``rows``.

    Radix passes: each thread streams the row's visible scores (stride ``threads``, coalesced) and
    counts digits of the keys that match the prefix found so far into a 256-bin shared histogram
    (run-length merged, so an all-zero plateau costs one atomic per thread and not one per element);
    a block scan over the bins finds the digit holding the ``need``-th best key. A pass stops early
    once that bin holds exactly ``need`` keys. Compaction: chunks of ``threads`` groups in ascending
    order; one packed block scan counts (greater, equal) keys before each group, and a group is
    written at ``#greater_before + min(#equal_before, m)``.
    Rows with ``nb <= Kb`` take groups ``0..nb-1`` and pad with -1 (no pass at all).
    Shared memory: ``256*4 + 16 + scan scratch`` bytes (1.1 KB at 256 threads).
    """
    NT = threads
    KB = kb
    BPT = max(1, BINS // NT)      # bins per thread in the bin search
    SCR = scan_scratch(NT)
    block_scan = make_block_scan(NT)

    @jit
    def topk(score_bits, req_ids, positions, seq_lens, groups):
        hist = cuda.shared.array(BINS, int32)
        state = cuda.shared.array(4, int32)
        scr = cuda.shared.array(SCR, int32)
        tid = uint32(cuda.threadIdx.x)
        i = uint32(cuda.blockIdx.x)
        req, p, nbi = row_state(i, req_ids, positions, seq_lens, r)
        nb = uint32(min(nbi, int32(score_bits.shape[1])))
        if nb <= uint32(KB):
            for j in range(tid, uint32(KB), uint32(NT)):
                g = int32(-1)
                if j < nb:
                    g = int32(j)
                groups[i, j] = g
            return

        prefix = uint32(0)
        mask = uint32(0)
        need = int32(KB)
        for dig in range(4):
            shift = uint32(24) - uint32(8) * uint32(dig)
            for b in range(tid, uint32(BINS), uint32(NT)):
                hist[b] = int32(0)
            cuda.syncthreads()
            run_bin = uint32(0)
            run_cnt = int32(0)
            for e in range(tid, nb, uint32(NT)):
                k = ordered_bits(score_bits[i, e])
                if (k & mask) == prefix:
                    b = (k >> shift) & uint32(255)
                    if b == run_bin:
                        run_cnt += int32(1)
                    else:
                        if run_cnt > int32(0):
                            cuda.atomic.add(hist, run_bin, run_cnt)
                        run_bin = b
                        run_cnt = int32(1)
            if run_cnt > int32(0):
                cuda.atomic.add(hist, run_bin, run_cnt)
            cuda.syncthreads()
            # thread t owns bins 255 - t*BPT - j (descending), so an inclusive scan counts keys above
            local = int32(0)
            for j in range(BPT):
                bb = int32(BINS - 1) - int32(tid) * int32(BPT) - int32(j)
                if bb >= int32(0):
                    local += hist[bb]
            incl, total = block_scan(local, tid, scr)
            above = incl - local
            for j in range(BPT):
                bb = int32(BINS - 1) - int32(tid) * int32(BPT) - int32(j)
                if bb >= int32(0):
                    c = hist[bb]
                    if above < need and need <= above + c:
                        state[0] = bb
                        state[1] = need - above
                        state[2] = int32(1) if c == need - above else int32(0)
                    above += c
            cuda.syncthreads()
            prefix |= uint32(state[0]) << shift
            mask |= uint32(255) << shift
            need = state[1]
            done = state[2]
            cuda.syncthreads()
            if done != int32(0):
                break

        base_gt = int32(0)
        base_eq = int32(0)
        c0 = uint32(0)
        while c0 < nb:
            e = c0 + tid
            gt = int32(0)
            eq = int32(0)
            if e < nb:
                km = ordered_bits(score_bits[i, e]) & mask
                if km > prefix:
                    gt = int32(1)
                elif km == prefix:
                    eq = int32(1)
            v = gt | (eq << int32(16))
            incl, total = block_scan(v, tid, scr)
            excl = incl - v
            eq_before = base_eq + (excl >> int32(16))
            gt_before = base_gt + (excl & int32(0xFFFF))
            if gt != int32(0):
                groups[i, gt_before + min(eq_before, need)] = int32(e)
            elif eq != int32(0) and eq_before < need:
                groups[i, gt_before + eq_before] = int32(e)
            base_gt += total & int32(0xFFFF)
            base_eq += total >> int32(16)
            c0 += uint32(NT)

    topk.threads = NT
    return topk


def topk_threads(profile):
    """Threads per top-k block: the profile's on a GPU, 32 in the simulator (each thread is an OS thread)."""
    return 32 if SIMULATOR else int(profile.topk.threads)


def launch_topk(score_bits, req_ids, positions, seq_lens, groups, profile, stream, r=4):
    """``score_bits`` is the float32 score matrix viewed as uint32; ``groups [rows, Kb]`` int32 is written."""
    rows, kb = groups.shape
    if rows == 0:
        return groups
    k = make_topk_kernel(topk_threads(profile), int(kb), int(r))
    k[rows, k.threads, stream](score_bits, req_ids, positions, seq_lens, groups)
    return groups


_SIG = "void(uint32[:, :], int32[:], int32[:], int32[:], int32[:, :])"
RESOURCE_CASES = [
    (f"topk.kb512.t{t}", make_topk_kernel(t, 512, 4), _SIG, t, 0, cc)
    for t in (256,) for cc in ((7, 0), (9, 0))
]
