"""Tensor-core index scores: the tiled route's launcher and its per-warp-M kernel.

:func:`tiled_supported` says which inputs the tensor-core route takes (float16, or bfloat16 on an
m16n8k16 profile; ``Hi`` in ``TILED_HEADS``; ``Di`` a multiple of 16) and :func:`launch_tiled`
runs it: sm_80+ with ``Hi <= 4`` goes to the keys-as-M launcher (:mod:`.keysm`, which sends small
blocks on to :mod:`.direct`), everything else to :func:`make_tiled_scores_kernel`: one GEMM per
warp with M = 16 (query row, head) pairs, N = keys, K = Di; ReLU and the head sum in the epilogue
(xor shuffles).

Where this kernel runs:

- sm_70 (V100): m8n8k4, the V100's only tensor-core op, float16 only, at every row count (one
  route keeps a row's bits independent of its batch; never timed on a V100; the H200 runs m8n8k4
  emulated, correct but slow: :mod:`numqsa.kernels.mma`);
- sm_80+: m16n8k16 (float16 or bfloat16) with ``Hi`` 8 or 16, which the keys-as-M kernels do not
  take; the repository has no timing at those head counts (the benchmark's workload is ``Hi`` 4).

Why tensor cores, and why not this kernel at ``Hi <= 4``, on the H200 (GPU-only ms): run 1, this
kernel / light, 1024 x 32K 0.705 / 1.423, 4096 x 32K 2.723 / 5.233
(``bench/results/history/2026-11-29-467347a-first-correct-kernels/bench_selection.log``); run 2,
this kernel / an 8-warp keys-as-M kernel, 4096 x 32K 0.913 / 0.356, 8192 x 131K 6.906 / 2.647
(``scores.generic`` / ``scores.keysm.w8`` in
``bench/results/history/2026-11-29-fb253d2-selection-kernel-variants/bench_variants_run2.log``).
``launch_tiled(..., variant="generic")`` still forces this kernel at ``Hi <= 4`` (tests, benches).
"""
import functools
import math

import numpy as np
from numba import cuda, float32, int32, uint32

from ...jit import SIMULATOR, device_jit, jit
from ..common import bits16, is_bf16
from .common import (NEG_INF, _distinct_requests, _pack_bits, _stage_block_rows,
                     light_keys_per_block, relu)
from .keysm import keysm_supported, launch_keysm


def _tiled_shape():
    """(warps per block, keys per shared tile). GPU: 8 warps, 64 keys (17 KB of keys);
    simulator: 2 warps, 16 keys (each thread is an OS thread)."""
    return (2, 16) if SIMULATOR else (8, 64)


TILED_HEADS = (1, 2, 4, 8, 16)


def tiled_supported(qi, index_cache, profile=None):
    """The tensor-core route: float16 queries and keys (or bfloat16 both, on an m16n8k16
    ``profile``: sm_80+), Hi in 1, 2, 4, 8, 16, Di a multiple of 16."""
    from oracle.validate import dtype_name
    dq, dk = dtype_name(qi), dtype_name(index_cache)
    kinds = ("float16", "bfloat16") if profile is None or profile.scores.mma == "m16n8k16" \
        else ("float16",)
    return (dq == dk and dq in kinds and qi.shape[1] in TILED_HEADS and qi.shape[2] % 16 == 0)


if SIMULATOR:
    @device_jit
    def _xor_add(v, mask, lane, scr):
        # shfl_xor stand-in through this warp's shared row; every thread of the block calls it
        scr[lane] = v
        cuda.syncthreads()
        o = scr[lane ^ mask]
        cuda.syncthreads()
        return v + o
else:
    @device_jit
    def _xor_add(v, mask, lane, scr):
        return v + cuda.shfl_xor_sync(uint32(0xFFFFFFFF), v, mask)


@functools.lru_cache(maxsize=None)
def make_tiled_scores_kernel(kind, hi, di, r, bf16=False):
    """Tensor-core index scores; ``kind`` is ``"m16n8k16"`` (sm_80+) or ``"m8n8k4"`` (sm_70).
    ``bf16`` (m16n8k16 only): queries and keys are bfloat16 bits (uint16 arrays), multiplied by
    ``mma ... .bf16``.

    The product is one GEMM per warp with M = 16 (query row, head) pairs (``16 // Hi`` query rows x
    ``Hi`` heads), N = keys, K = Di: the warp's A fragments (its queries, float16) are loaded once
    into registers (Di/2 words per lane for m16n8k16 ... ``Di/16 * 4`` registers) and reused for every
    key of the block's span. Keys are staged per tile of ``TN`` in shared memory as packed f16x2
    words with a padded row (``Di/2 + 4`` words: fragment loads are bank-conflict free). The
    epilogue applies ReLU to each (row, head) product and sums the heads of a row with xor shuffles
    (the heads of a row are the low bits of M, which map to lane bits), then scales by 1/sqrt(Di).

    Grid ``(ceil(G / keys_per_block), ceil(rows / TM))``, ``TM = warps * 16 // Hi`` rows per block,
    block ``32 * warps`` threads. Shared memory: ``TN * (Di/2 + 4) * 4 + 8 * TM`` bytes plus the
    simulator's mma scratch (17.5 KB at TN 64, Di 128 on a GPU).
    Entries past a row's ``nb`` (and inert rows) are written ``-inf`` by a separate coalesced sweep,
    so every element is written once.
    """
    from .. import mma as M

    WARPS, TN = _tiled_shape()
    NT = 32 * WARPS
    HI = hi
    RW = 16 // hi               # query rows per warp
    TM = WARPS * RW
    DIW = di // 2
    DIWP = DIW + 4
    KS = di // 16               # m16n8k16 k-steps; m8n8k4 takes 4*KS k4-steps
    HB = hi - 1
    inv_sqrt = float32(1.0 / math.sqrt(di))
    SCRW = M.SCRATCH_WORDS
    XS = 32 if SIMULATOR else 1
    U2, U3, U4, U8, U31 = uint32(2), uint32(3), uint32(4), uint32(8), uint32(31)
    F0 = float32(0.0)
    mma16 = M.mma_m16n8k16_bf16 if bf16 else M.mma_m16n8k16_f16
    mma884 = M.mma_m8n8k4_f16
    pack = _pack_bits if bf16 else M.pack_f16x2
    if bf16 and kind != "m16n8k16":
        raise ValueError("bfloat16 tensor-core scores need m16n8k16 (sm_80+)")
    if kind == "m16n8k16":
        AREG = KS * 4
    elif kind == "m8n8k4":
        AREG = KS * 8
    else:
        raise ValueError(f"unknown mma kind {kind!r}")
    IS16 = kind == "m16n8k16"

    @jit
    def tiled_scores(qi, index_cache, index_block_table, req_ids, positions, seq_lens,
                     keys_per_block, scores):
        k_s = cuda.shared.array((TN, DIWP), uint32)
        r_req = cuda.shared.array(TM, int32)
        r_nb = cuda.shared.array(TM, int32)
        u_req = cuda.shared.array(TM, int32)
        u_nb = cuda.shared.array(TM, int32)
        n_u = cuda.shared.array(1, int32)
        scr = cuda.shared.array((WARPS, SCRW), uint32)
        xs = cuda.shared.array((WARPS, XS), float32)
        a_reg = cuda.local.array(AREG, uint32)

        tid = uint32(cuda.threadIdx.x)
        warp = tid >> uint32(5)
        lane = tid & U31
        rows = uint32(scores.shape[0])
        ngroups = uint32(scores.shape[1])
        row0 = uint32(cuda.blockIdx.y) * uint32(TM)
        span0 = uint32(cuda.blockIdx.x) * uint32(keys_per_block)
        span1 = min(span0 + uint32(keys_per_block), ngroups)
        n_pages = int32(index_cache.shape[0])
        rpp = uint32(index_cache.shape[1])
        tcols = uint32(index_block_table.shape[1])

        _stage_block_rows(row0, tid, TM, rows, ngroups, req_ids, positions, seq_lens, r, r_req, r_nb)
        nu = _distinct_requests(r_req, r_nb, u_req, u_nb, n_u, tid, TM)

        # A fragments of this warp's 16 (row, head) pairs, straight from global memory
        wrow0 = row0 + warp * uint32(RW)
        if IS16:
            g = lane >> U2
            t = lane & U3
            for ks in range(KS):
                for j in range(4):
                    m = g + U8 * (uint32(j) & uint32(1))
                    col = uint32(16 * ks) + U2 * t + U8 * (uint32(j) >> uint32(1))
                    qrow = wrow0 + m // uint32(HI)
                    h = m % uint32(HI)
                    w = uint32(0)
                    if qrow < rows:
                        w = pack(qi[qrow, h, col], qi[qrow, h, col + uint32(1)])
                    a_reg[ks * 4 + j] = w
        else:
            q = (lane >> U2) & U3
            m = (lane & U3) + U4 * (lane >> uint32(4)) + U8 * (q & uint32(1))
            qrow = wrow0 + m // uint32(HI)
            h = m % uint32(HI)
            for ks in range(KS * 4):
                for j in range(2):
                    col = uint32(4 * ks) + U2 * uint32(j)
                    w = uint32(0)
                    if qrow < rows:
                        w = pack(qi[qrow, h, col], qi[qrow, h, col + uint32(1)])
                    a_reg[ks * 2 + j] = w
        cuda.syncthreads()

        e0 = span0
        while e0 < span1:
            for u in range(nu):
                target = u_req[u]
                nbmax = u_nb[u]
                if int32(e0) < nbmax:                 # uniform across the block
                    for idx in range(tid, uint32(TN * DIW), uint32(NT)):
                        kk = idx // uint32(DIW)
                        wd = idx - kk * uint32(DIW)
                        ek = e0 + kk
                        v = uint32(0)
                        if int32(ek) < nbmax:
                            col = ek // rpp
                            if col < tcols:
                                page = int32(index_block_table[target, col])
                                if page >= int32(0) and page < n_pages:
                                    rr_ = ek - col * rpp
                                    v = pack(index_cache[page, rr_, U2 * wd],
                                             index_cache[page, rr_, U2 * wd + uint32(1)])
                        k_s[kk, wd] = v
                    cuda.syncthreads()
                    if IS16:
                        g = lane >> U2
                        t = lane & U3
                        for nt in range(TN // 8):
                            acc = (F0, F0, F0, F0)
                            for ks in range(KS):
                                n = uint32(8 * nt) + g
                                kw = uint32(8 * ks) + t
                                b = (k_s[n, kw], k_s[n, kw + U4])
                                a = (a_reg[ks * 4], a_reg[ks * 4 + 1], a_reg[ks * 4 + 2],
                                     a_reg[ks * 4 + 3])
                                acc = mma16(a, b, acc, scr[warp], lane)
                            for ii in range(4):
                                v = relu(acc[ii])
                                if HI >= 16:
                                    v += relu(acc[ii ^ 2])
                                if HI >= 2:
                                    v = _xor_add(v, uint32(4), lane, xs[warp])
                                if HI >= 4:
                                    v = _xor_add(v, uint32(8), lane, xs[warp])
                                if HI >= 8:
                                    v = _xor_add(v, uint32(16), lane, xs[warp])
                                m = g + U8 * (uint32(ii) >> uint32(1))
                                if (m & uint32(HB)) == uint32(0):
                                    rl = warp * uint32(RW) + m // uint32(HI)
                                    e = e0 + uint32(8 * nt) + U2 * t + (uint32(ii) & uint32(1))
                                    if (row0 + rl < rows and r_req[rl] == target
                                            and int32(e) < r_nb[rl] and e < span1):
                                        scores[row0 + rl, e] = v * inv_sqrt
                    else:
                        q = (lane >> U2) & U3
                        hi4 = lane >> uint32(4)
                        for nt in range(TN // 16):
                            acc = (F0, F0, F0, F0, F0, F0, F0, F0)
                            n = uint32(16 * nt) + U8 * (q >> uint32(1)) + (lane & U3) + U4 * hi4
                            for ks in range(KS * 4):
                                acc = mma884(a_reg[ks * 2], a_reg[ks * 2 + 1],
                                             k_s[n, uint32(2 * ks)], k_s[n, uint32(2 * ks + 1)],
                                             acc, scr[warp], lane)
                            for ii in range(8):
                                v = relu(acc[ii])
                                if HI >= 4:
                                    v += relu(acc[ii ^ 2])
                                if HI >= 2:
                                    v = _xor_add(v, uint32(1), lane, xs[warp])
                                if HI >= 8:
                                    v = _xor_add(v, uint32(16), lane, xs[warp])
                                if HI >= 16:
                                    v = _xor_add(v, uint32(4), lane, xs[warp])
                                m = ((lane & uint32(1)) + (uint32(ii) & U2) + U4 * hi4
                                     + U8 * (q & uint32(1)))
                                if (m & uint32(HB)) == uint32(0):
                                    rl = warp * uint32(RW) + m // uint32(HI)
                                    e = (e0 + uint32(16 * nt) + U8 * (q >> uint32(1))
                                         + (uint32(ii) & U4) + (lane & U2) + (uint32(ii) & uint32(1)))
                                    if (row0 + rl < rows and r_req[rl] == target
                                            and int32(e) < r_nb[rl] and e < span1):
                                        scores[row0 + rl, e] = v * inv_sqrt
                    cuda.syncthreads()
            # -inf past each row's nb (and for inert rows): one coalesced sweep of the tile
            for idx in range(tid, uint32(TM * TN), uint32(NT)):
                rl = idx // uint32(TN)
                e = e0 + (idx - rl * uint32(TN))
                if row0 + rl < rows and e < span1 and int32(e) >= r_nb[rl]:
                    scores[row0 + rl, e] = NEG_INF
            e0 += uint32(TN)

    tiled_scores.rows_per_block = TM
    tiled_scores.threads = NT
    tiled_scores.keys_per_tile = TN
    return tiled_scores


def launch_tiled(qi, index_cache, index_block_table, req_ids, positions, seq_lens, scores,
                 profile, stream, r=4, variant=None, **keysm_options):
    """Launch the tensor-core route: the keys-as-M kernel on sm_80+ with Hi <= 4, else the
    per-warp-M kernel (``profile.scores.mma`` picks m16n8k16 or m8n8k4); ``variant`` "keysm" or
    "generic" forces one (tests, benchmarks)."""
    rows, groups = scores.shape
    if rows == 0 or groups == 0:
        return scores
    if variant is None:
        variant = "keysm" if keysm_supported(profile, qi) else "generic"
    if variant == "keysm":
        return launch_keysm(qi, index_cache, index_block_table, req_ids, positions, seq_lens,
                            scores, profile, stream, r=r, **keysm_options)
    k = make_tiled_scores_kernel(profile.scores.mma, int(qi.shape[1]), int(qi.shape[2]), int(r),
                                 is_bf16(qi))
    row_tiles = -(-rows // k.rows_per_block)
    span = light_keys_per_block(row_tiles, groups, k.keys_per_tile, profile.sm_count)
    grid = (-(-groups // span), row_tiles)
    k[grid, k.threads, stream](bits16(qi), bits16(index_cache), index_block_table, req_ids, positions, seq_lens,
                               np.int32(span), scores)
    return scores
