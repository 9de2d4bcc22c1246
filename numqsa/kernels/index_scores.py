"""Index scores (spec §4): ``score[i, e] = sum_h relu(<qi[i, h], kc[e]>) / sqrt(Di)``, ``-inf`` past ``nb``.

Two routes over the same output ``scores [rows, num_groups]`` float32:

- light (:func:`make_light_scores_kernel`): shared-memory tiles, fp32 FMA. For decode and short work,
  and the fallback everywhere. A block keeps ``TR`` query rows (all heads) in shared memory and walks
  ``keys_per_block`` compressed keys in tiles of ``TK``.
- tiled (:func:`make_tiled_scores_kernel`): tensor cores (mma.sync m16n8k16 on sm_80+, m8n8k4 on
  sm_70, through :mod:`numqsa.kernels.mma`), float16 inputs -- or bfloat16 on sm_80+ (m16n8k16
  ``.bf16``) -- float32 accumulation, ReLU and head sum in the epilogue. Admitted by
  :func:`numqsa.plan.plan_select`. On sm_80+ with ``Hi <= 4`` the keys are the mma's M side
  (:func:`make_keysm_scores_kernel`), and small blocks (:func:`direct_route`: a few rows) take
  :func:`make_direct_scores_kernel`, whose warps load their operands straight into registers;
  the two compute every score bitwise alike.

bfloat16 arrays reach the kernels as uint16 bit views (:func:`numqsa.kernels.common.bits16`); the
light kernel converts them element by element (any architecture), the tensor-core kernels feed the
bits to ``mma ... .bf16`` unchanged (sm_80+; on sm_70 bfloat16 scores take the light route).

Rows of one tile may belong to different requests (varlen batches): a block runs one pass per
distinct request among its rows, staging that request's keys; almost always there is one pass.
A page id outside ``[0, num_idx_pages)`` (the public API rejects those before launch) is never read:
its keys load as zeros.

Non-finite inputs propagate as the float64 math does (the oracle's contract): ReLU is
:func:`relu`, which keeps NaN, not ``max(x, 0)`` -- numba lowers a float ``max`` to ``fmaxf`` on a
GPU, which returns the non-NaN operand (the simulator's Python ``max`` keeps it: the two disagreed).
"""
import functools
import math

import numpy as np
from numba import cuda, float32, int32, uint32

from ..jit import SIMULATOR, device_jit, jit
from .common import bits16, is_bf16, loader, row_state
from .mma import pack_f16x2 as _pack_pair

NEG_INF = float32(-math.inf)


@device_jit
def relu(x):
    """``max(x, 0)`` that keeps NaN (``NaN < 0`` is false), as NumPy's ``maximum`` in the oracle."""
    if x < float32(0.0):
        return float32(0.0)
    return x


def _light_shape(hi, di):
    """(TK keys per tile, RG row groups, RPT rows per thread); threads = TK * RG, TR = RG * RPT.

    GPU: 32 keys x 4 row groups = 128 threads, 8 rows: q tile 8*Hi*Di*4 B (16 KB at Hi 4, Di 128),
    key tile 32*(Di+1)*4 B (16.5 KB). Simulator: 8 x 2 threads, 4 rows (each thread is an OS thread).
    """
    if SIMULATOR:
        return 8, 2, 2
    return 32, 4, 2


@functools.lru_cache(maxsize=None)
def make_light_scores_kernel(hi, di, r, q_bf16=False, k_bf16=False):
    """Light index-score kernel for ``Hi = hi``, ``Di = di``, compress ratio ``r``; ``q_bf16`` /
    ``k_bf16``: the queries / index cache are bfloat16 bits (uint16 views).

    Grid ``(ceil(num_groups / keys_per_block), ceil(rows / TR))``, block ``TK * RG`` threads.
    Thread ``t`` owns key ``t % TK`` of the current tile and rows ``(t // TK) * RPT + 0..RPT-1`` of the
    block's ``TR`` rows; it accumulates ``RPT * Hi`` dot products over ``Di`` in float32 registers.
    Shared memory (static): ``TR*Hi*Di*4 + TK*(Di+1)*4 + 8*TR`` bytes (32.6 KB at Hi 4, Di 128).
    """
    TK, RG, RPT = _light_shape(hi, di)
    TR = RG * RPT
    NT = TK * RG
    HI, DI = hi, di
    DIP = di + 1          # padded key row: lanes reading k_s[key, d] hit distinct banks
    QN = TR * hi * di
    ACC = RPT * hi
    KN = TK * di
    inv_sqrt = float32(1.0 / math.sqrt(di))
    ldq, ldk = loader(q_bf16), loader(k_bf16)

    @jit(fastmath=False)
    def light_scores(qi, index_cache, index_block_table, req_ids, positions, seq_lens,
                     keys_per_block, scores):
        q_s = cuda.shared.array((TR, HI, DI), float32)
        k_s = cuda.shared.array((TK, DIP), float32)
        r_req = cuda.shared.array(TR, int32)
        r_nb = cuda.shared.array(TR, int32)
        acc = cuda.local.array(ACC, float32)
        res = cuda.local.array(RPT, float32)

        tid = uint32(cuda.threadIdx.x)
        rows = uint32(scores.shape[0])
        ngroups = uint32(scores.shape[1])
        row0 = uint32(cuda.blockIdx.y) * uint32(TR)
        span0 = uint32(cuda.blockIdx.x) * uint32(keys_per_block)
        span1 = min(span0 + uint32(keys_per_block), ngroups)
        n_pages = int32(index_cache.shape[0])
        rpp = uint32(index_cache.shape[1])
        tcols = uint32(index_block_table.shape[1])

        if tid < uint32(TR):
            i = row0 + tid
            rq = int32(-1)
            nbv = int32(0)
            if i < rows:
                rq, p, nbv = row_state(i, req_ids, positions, seq_lens, r)
            r_req[tid] = rq
            r_nb[tid] = min(nbv, int32(ngroups))
        for idx in range(tid, uint32(QN), uint32(NT)):
            rr = idx // uint32(HI * DI)
            rem = idx - rr * uint32(HI * DI)
            h = rem // uint32(DI)
            d = rem - h * uint32(DI)
            v = float32(0.0)
            if row0 + rr < rows:
                v = ldq(qi[row0 + rr, h, d])
            q_s[rr, h, d] = v
        cuda.syncthreads()

        key = tid % uint32(TK)
        rbase = (tid // uint32(TK)) * uint32(RPT)
        e0 = span0
        while e0 < span1:
            e = e0 + key
            for rr in range(RPT):
                res[rr] = NEG_INF
            for s in range(TR):
                target = r_req[s]
                first = target >= int32(0)
                nbmax = int32(0)
                for s2 in range(TR):
                    if r_req[s2] == target:
                        if s2 < s:
                            first = False
                        nbmax = max(nbmax, r_nb[s2])
                # uniform: every thread reads the same shared values
                if first and int32(e0) < nbmax:
                    for idx in range(tid, uint32(KN), uint32(NT)):
                        kk = idx // uint32(DI)
                        d = idx - kk * uint32(DI)
                        ek = e0 + kk
                        v = float32(0.0)
                        if int32(ek) < nbmax:
                            col = ek // rpp
                            if col < tcols:
                                page = int32(index_block_table[target, col])
                                if page >= int32(0) and page < n_pages:
                                    v = ldk(index_cache[page, ek - col * rpp, d])
                        k_s[kk, d] = v
                    cuda.syncthreads()
                    mine = False
                    for rr in range(RPT):
                        if r_req[rbase + rr] == target and int32(e) < r_nb[rbase + rr]:
                            mine = True
                    if mine:
                        for a in range(ACC):
                            acc[a] = float32(0.0)
                        for d in range(DI):
                            kv = k_s[key, d]
                            for rr in range(RPT):
                                for h in range(HI):
                                    acc[rr * HI + h] += q_s[rbase + rr, h, d] * kv
                        for rr in range(RPT):
                            if r_req[rbase + rr] == target and int32(e) < r_nb[rbase + rr]:
                                tot = float32(0.0)
                                for h in range(HI):
                                    tot += relu(acc[rr * HI + h])
                                res[rr] = tot * inv_sqrt
                    cuda.syncthreads()
            if e < span1:
                for rr in range(RPT):
                    if row0 + rbase + uint32(rr) < rows:
                        scores[row0 + rbase + uint32(rr), e] = res[rr]
            e0 += uint32(TK)

    light_scores.rows_per_block = TR
    light_scores.threads = NT
    light_scores.keys_per_tile = TK
    return light_scores


def light_keys_per_block(rows, num_groups, tile_keys, sm_count):
    """Keys walked per block: long spans amortise the q tile; keep at least ~4 blocks per SM."""
    row_tiles = max(1, rows)
    span = tile_keys * 8
    while span > tile_keys and row_tiles * -(-num_groups // span) < 4 * sm_count:
        span //= 2
    return span


def launch_light(qi, index_cache, index_block_table, req_ids, positions, seq_lens, scores,
                 profile, stream, r=4):
    """Launch the light route on device arrays; ``scores [rows, G]`` float32 is written in full."""
    rows, groups = scores.shape
    if rows == 0 or groups == 0:
        return scores
    k = make_light_scores_kernel(int(qi.shape[1]), int(qi.shape[2]), int(r), is_bf16(qi),
                                 is_bf16(index_cache))
    tr = k.rows_per_block
    row_tiles = -(-rows // tr)
    span = light_keys_per_block(row_tiles, groups, k.keys_per_tile, profile.sm_count)
    grid = (-(-groups // span), row_tiles)
    k[grid, k.threads, stream](bits16(qi), bits16(index_cache), index_block_table, req_ids, positions, seq_lens,
                               np.int32(span), scores)
    return scores



@device_jit(forceinline=True)
def _stage_block_rows(row0, tid, tm, rows, ngroups, req_ids, positions, seq_lens, r, r_req, r_nb):
    """Threads ``0..tm-1`` write the request (-1 if inert) and visible-group count (capped at the
    score width) of the block's rows ``row0 + tid`` into shared ``r_req`` / ``r_nb``."""
    if tid < uint32(tm):
        i = row0 + tid
        rq = int32(-1)
        nbv = int32(0)
        if i < rows:
            rq, p, nbv = row_state(i, req_ids, positions, seq_lens, r)
        r_req[tid] = rq
        r_nb[tid] = min(nbv, int32(ngroups))


@device_jit
def _distinct_requests(r_req, r_nb, u_req, u_nb, n_u, tid, tm):
    """Once per block: the distinct valid requests among the block's ``tm`` rows (``r_req``), in
    first-row order, into ``u_req[:n]`` with each request's largest ``nb`` in ``u_nb``; returns n.
    Every thread calls it (it synchronises the block three times)."""
    cuda.syncthreads()
    if tid < uint32(tm):
        rq = r_req[tid]
        lead = rq >= int32(0)
        nbm = int32(0)
        for s2 in range(tm):
            if r_req[s2] == rq:
                if uint32(s2) < tid:
                    lead = False
                nbm = max(nbm, r_nb[s2])
        u_nb[tid] = nbm if lead else int32(-1)
    cuda.syncthreads()
    if tid == uint32(0):
        n = int32(0)
        for s in range(tm):
            if u_nb[s] >= int32(0):
                u_req[n] = r_req[s]
                u_nb[n] = u_nb[s]
                n += int32(1)
        n_u[0] = n
    cuda.syncthreads()
    return n_u[0]


# ------------------------------------------------------------------------------------------------
# Tiled tensor-core route
# ------------------------------------------------------------------------------------------------

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
    from . import mma as M

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



# ------------------------------------------------------------------------------------------------
# Keys-as-M tensor-core route (m16n8k16, Hi <= 4): the head sum stays inside each thread
# ------------------------------------------------------------------------------------------------

KEYSM_HEADS = (1, 2, 4)


def word_view(a):
    """A uint32 view (pairs of float16 or bfloat16 along the last axis) of a 16-bit float array, or
    None.

    Needs the last axis contiguous with an even length and 4-byte aligned rows; any other strides
    are kept (interleaved or transposed caches)."""
    from oracle.validate import dtype_name
    shape, strides = tuple(a.shape), tuple(a.strides)
    if dtype_name(a) not in ("float16", "bfloat16") or shape[-1] % 2 or strides[-1] != 2:
        return None
    if any(st % 4 for st in strides[:-1]):
        return None
    if SIMULATOR:
        return a.view(np.uint32) if a.is_c_contiguous() else None
    if a.device_ctypes_pointer.value % 4:
        return None
    if a.is_c_contiguous():
        return a.view(np.uint32)
    from numba.cuda.cudadrv.devicearray import DeviceNDArray
    return DeviceNDArray(shape=shape[:-1] + (shape[-1] // 2,),
                         strides=strides[:-1] + (4,), dtype=np.dtype(np.uint32),
                         stream=a.stream, gpu_data=a.gpu_data)


@device_jit
def _word_u32(a, i, j, w):
    return a[i, j, w]


@device_jit
def _word_f16(a, i, j, w):
    from_ = uint32(2) * w
    return _pack_pair(a[i, j, from_], a[i, j, from_ + uint32(1)])


@device_jit(forceinline=True)
def _pack_bits(lo, hi):
    """Two 16-bit words (bfloat16 bits) -> one uint32, ``lo`` in the low half."""
    return (uint32(lo) & uint32(0xFFFF)) | ((uint32(hi) & uint32(0xFFFF)) << uint32(16))


@device_jit
def _word_bits(a, i, j, w):
    from_ = uint32(2) * w
    return _pack_bits(a[i, j, from_], a[i, j, from_ + uint32(1)])


@functools.lru_cache(maxsize=None)
def _key_locator(words):
    """Device fn ``key_at(index_cache, ek, target, index_block_table, tcols, rpp, n_pages)``: where
    group ``ek`` of request ``target`` lies -- its first word in the flat word view (``words``: the
    cache's strides address it) or its row ``page * rpp + row`` (otherwise); -1 on no page."""
    WORDS = bool(words)

    @device_jit(forceinline=True)
    def key_at(index_cache, ek, target, index_block_table, tcols, rpp, n_pages):
        col = ek // rpp
        at = int32(-1)
        if col < tcols:
            page = int32(index_block_table[target, col])
            if page >= int32(0) and page < n_pages:
                rr_ = ek - col * rpp
                if WORDS:
                    at = int32(uint32(page) * uint32(index_cache.strides[0] // 4)
                               + rr_ * uint32(index_cache.strides[1] // 4))
                else:
                    at = int32(uint32(page) * rpp + rr_)
        return at
    return key_at


@functools.lru_cache(maxsize=None)
def _head_mma(hi, ksteps, bf16):
    """The keys-as-M kernels' arithmetic, one A fragment (16 keys) feeding ``hi`` mmas, one a
    head: ``head_step(a, b_reg, acc, ks, scr, lane)`` adds k-step ``ks`` of every head into
    ``acc`` (``hi * 4`` floats, head ``h`` at ``4h .. 4h + 3``; ``b_reg`` the B fragments, head
    ``h`` and k-step ``ks`` at ``2 (h * ksteps + ks)``); ``head_sum(acc, ii)`` is the ReLU sum over
    the heads of accumulator element ``ii``. Shared by both kernels, so they compute a score alike."""
    from . import mma as M
    HI, KS = hi, ksteps
    mma16 = M.mma_m16n8k16_bf16 if bf16 else M.mma_m16n8k16_f16

    @device_jit(forceinline=True)
    def head_step(a, b_reg, acc, ks, scr, lane):
        for h in range(HI):
            c = (acc[h * 4], acc[h * 4 + 1], acc[h * 4 + 2], acc[h * 4 + 3])
            bi = (h * KS + ks) * 2
            d = mma16(a, (b_reg[bi], b_reg[bi + 1]), c, scr, lane)
            acc[h * 4] = d[0]
            acc[h * 4 + 1] = d[1]
            acc[h * 4 + 2] = d[2]
            acc[h * 4 + 3] = d[3]

    @device_jit(forceinline=True)
    def head_sum(acc, ii):
        v = float32(0.0)
        for h in range(HI):
            v += relu(acc[h * 4 + ii])
        return v
    return head_step, head_sum


def _keysm_shape(warps, tile_keys):
    """(warps, keys per shared tile). GPU: ``warps`` x 8 query rows, ``tile_keys`` keys (17 KB a
    buffer at 64); simulator: 2 warps, 16 keys. 4 warps (4 blocks of 124 registers a thread per SM)
    measured faster than 8 on the H200 at 1 x 131K (0.017 / 0.036 ms) and 4096 x 32K (0.186 /
    0.211), equal at 8192 x 131K (1.30 / 1.29)."""
    return (2, 16) if SIMULATOR else (warps, tile_keys)


#: Key tiles a keys-as-M block scores at most (its page ids are staged in shared memory at once).
KEYSM_SPAN_TILES = 16


@functools.lru_cache(maxsize=None)
def make_keysm_scores_kernel(hi, di, r, words, warps=4, minb=4, bf16=False, tile_keys=64):
    """Tensor-core index scores with the keys as the M side of m16n8k16 (sm_80+, ``Hi`` 1, 2, 4).

    Each warp owns 8 query rows (the N = 8 of the mma) and keeps their queries for all ``Hi`` heads
    as B fragments in registers (``Hi * Di / 8`` words per lane, loaded once per block through
    shared memory, coalesced). The block scores a span of up to
    ``KEYSM_SPAN_TILES`` tiles of ``TN`` keys, one pass per distinct request of its rows: the pass
    stages where each of the span's keys lies (page and row, from the block table) in shared
    memory once, then streams the key tiles through two shared
    buffers -- tile ``i + 1`` is copied (``cp.async``, 16 bytes a thread and chunk) while tile ``i``
    is multiplied, so the copy latency hides behind the mma. Keys are packed f16x2 words, rows
    padded to ``Di/2 + 4`` words, read by ``ldmatrix.x4`` (one per k-step and 16 keys, conflict
    free), and one A fragment feeds ``Hi`` mmas, one per head. The accumulator element ``(key,
    row)`` of head ``h`` sits in the same lane and register for every head, so ReLU and the head
    sum are plain register arithmetic; the 4 results of a lane go straight to global memory (8
    consecutive keys of 4 rows per store: whole 32-byte sectors).

    ``words``: the keys and queries are uint32 views (:func:`word_view`) and ``flat`` is the key
    words as one 1-D array (``index_cache``'s strides address it); otherwise float16 (or bfloat16
    bit) arrays read per element, packed and stored synchronously (``flat`` unused). ``bf16``: the
    pairs are bfloat16, multiplied by ``mma ... .bf16``. Grid ``(ceil(G / keys_per_block),
    ceil(rows / TM))`` with ``keys_per_block <= KEYSM_SPAN_TILES * TN``, ``TM = 8 * warps`` rows,
    ``32 * warps`` threads. Shared memory: ``2 * TN * (Di/2 + 4) * 4 + 4 * KEYSM_SPAN_TILES * TN``
    bytes plus small row tables (39.6 KB at TN 64, Di 128, 4 warps). Entries past ``nb`` (and inert rows)
    get ``-inf``.
    """
    from . import mma as M
    from .smem import cp_async_16, cp_async_commit, cp_async_wait_fn, ldmatrix_x4, shared_base

    if hi not in KEYSM_HEADS or di % 16:
        raise ValueError(f"keys-as-M scores need Hi in {KEYSM_HEADS} and Di % 16 == 0")
    WARPS, TN = _keysm_shape(warps, tile_keys)
    if TN % 16:
        raise ValueError(f"tile_keys must be a multiple of 16, got {TN}")
    if WARPS * 8 > 2 * TN:
        raise ValueError(f"{WARPS} warps' queries do not fit the two key buffers of {TN} keys")
    NT = 32 * WARPS
    TM = WARPS * 8
    MT = TN // 16
    HI = hi
    DIW = di // 2
    DIWP = DIW + 4
    CH = DIW // 4                       # 16-byte chunks of a key
    BUFW = TN * DIWP                    # words of one key buffer
    KBUF = 2 * BUFW
    SPAN = TN * KEYSM_SPAN_TILES
    KS = di // 16
    BREG = hi * KS * 2
    ACC = hi * 4
    HPR = max(1, min(hi, 2 * TN // (8 * WARPS)))   # heads whose query slices fit the key buffers
    inv_sqrt = float32(1.0 / math.sqrt(di))
    SCRW = M.SCRATCH_WORDS
    U2, U3, U4, U8, U31 = uint32(2), uint32(3), uint32(4), uint32(8), uint32(31)
    F0 = float32(0.0)
    head_step, head_sum = _head_mma(hi, KS, bool(bf16))
    word = _word_u32 if words else (_word_bits if bf16 else _word_f16)
    WORDS = bool(words)
    MINB = minb
    wait_one, wait_none = cp_async_wait_fn(1), cp_async_wait_fn(0)

    key_at = _key_locator(WORDS)

    @device_jit(forceinline=True)
    def load_tile(k_s, kbase, buf, first, nkeys, tid, s_at, index_cache, flat, rpp):
        """Start copying keys ``first .. first + TN - 1`` of the span into buffer ``buf`` (zeros
        for keys past ``nkeys`` or on no page)."""
        for c in range(tid, uint32(TN * CH), uint32(NT)):
            kk = c // uint32(CH)
            ch = c - kk * uint32(CH)
            key = first + kk
            at = int32(-1)
            if key < nkeys:
                at = s_at[key]
            w0 = buf * uint32(BUFW) + kk * uint32(DIWP) + U4 * ch
            if WORDS:
                if at >= int32(0):
                    cp_async_16(k_s, kbase + U4 * w0, flat, uint32(at) + U4 * ch, 16)
                else:
                    cp_async_16(k_s, kbase + U4 * w0, flat, uint32(0), 0)
            else:
                pg = uint32(at) // rpp
                for x in range(4):
                    v = uint32(0)
                    if at >= int32(0):
                        v = word(index_cache, pg, uint32(at) - pg * rpp, U4 * ch + uint32(x))
                    k_s[w0 + uint32(x)] = v

    @jit(launch_bounds=(NT, MINB))
    def keysm_scores(qi, index_cache, flat, index_block_table, req_ids, positions, seq_lens,
                     keys_per_block, scores):
        k_s = cuda.shared.array(KBUF, uint32)
        s_at = cuda.shared.array(SPAN, int32)
        r_req = cuda.shared.array(TM, int32)
        r_nb = cuda.shared.array(TM, int32)
        r_nbm = cuda.shared.array(TM, int32)
        u_req = cuda.shared.array(TM, int32)
        u_nb = cuda.shared.array(TM, int32)
        n_u = cuda.shared.array(1, int32)
        scr = cuda.shared.array((WARPS, SCRW), uint32)
        b_reg = cuda.local.array(BREG, uint32)
        acc = cuda.local.array(ACC, float32)

        tid = uint32(cuda.threadIdx.x)
        warp = tid >> uint32(5)
        lane = tid & U31
        g = lane >> U2
        t = lane & U3
        rows = uint32(scores.shape[0])
        ngroups = uint32(scores.shape[1])
        row0 = uint32(cuda.blockIdx.y) * uint32(TM)
        span0 = uint32(cuda.blockIdx.x) * uint32(keys_per_block)
        span1 = min(span0 + uint32(keys_per_block), ngroups)
        n_pages = int32(index_cache.shape[0])
        rpp = uint32(index_cache.shape[1])
        tcols = uint32(index_block_table.shape[1])
        kbase = shared_base(k_s)

        _stage_block_rows(row0, tid, TM, rows, ngroups, req_ids, positions, seq_lens, r, r_req, r_nb)
        nu = _distinct_requests(r_req, r_nb, u_req, u_nb, n_u, tid, TM)
        if tid < uint32(TM):                  # the longest nb among this row's request's rows
            r_nbm[tid] = int32(0)
            for u in range(nu):
                if u_req[u] == r_req[tid]:
                    r_nbm[tid] = u_nb[u]
        cuda.syncthreads()

        # this lane's two output rows (the accumulator columns 2t, 2t+1 of its warp's 8 rows)
        la = warp * U8 + U2 * t

        # B fragments: query row g of the warp, head h, k-step ks: words 8ks + t (+4). HPR heads
        # at a time (all of them on a GPU: one round of loads) through this warp's slices of the
        # key buffers: coalesced loads, and rows DIWP words apart make the fragment reads
        # conflict free (block barriers: the simulator has no syncwarp)
        for h0 in range(0, HI, HPR):
            for hh in range(HPR):
                if h0 + hh < HI:
                    qs = (warp * uint32(HPR) + uint32(hh)) * uint32(8 * DIWP)
                    for idx in range(lane, uint32(8 * DIW), uint32(32)):
                        qr = idx // uint32(DIW)
                        wq = idx - qr * uint32(DIW)
                        v = uint32(0)
                        if row0 + warp * U8 + qr < rows:
                            v = word(qi, row0 + warp * U8 + qr, uint32(h0 + hh), wq)
                        k_s[qs + qr * uint32(DIWP) + wq] = v
            cuda.syncthreads()
            for hh in range(HPR):
                if h0 + hh < HI:
                    qs = (warp * uint32(HPR) + uint32(hh)) * uint32(8 * DIWP)
                    for ks in range(KS):
                        for j in range(2):
                            b_reg[((h0 + hh) * KS + ks) * 2 + j] = k_s[
                                qs + g * uint32(DIWP) + uint32(8 * ks + 4 * j) + t]
            cuda.syncthreads()

        # ldmatrix: lane l gives row (l & 7) + 8 ((l >> 3) & 1) of the 16-key slice, words
        # 4 (l >> 4) on: matrices (keys 0-7, k 0-7), (keys 8-15, k 0-7), (0-7, 8-15), (8-15, 8-15)
        a_lane = kbase + U4 * (((lane & uint32(7)) + U8 * ((lane >> U3) & uint32(1)))
                               * uint32(DIWP) + U4 * (lane >> U4))

        for u in range(nu):
            target = u_req[u]
            nbmax = u_nb[u]
            if int32(span0) < nbmax:                  # uniform across the block
                hi_e = min(span1, uint32(nbmax))
                nkeys = hi_e - span0
                for kk in range(tid, nkeys, uint32(NT)):
                    s_at[kk] = key_at(index_cache, span0 + kk, target, index_block_table, tcols,
                                      rpp, n_pages)
                cuda.syncthreads()
                ntiles = (nkeys + uint32(TN - 1)) // uint32(TN)
                load_tile(k_s, kbase, uint32(0), uint32(0), nkeys, tid, s_at, index_cache, flat,
                          rpp)
                cp_async_commit()
                for it in range(ntiles):
                    if it + uint32(1) < ntiles:
                        load_tile(k_s, kbase, (it + uint32(1)) & uint32(1),
                                  (it + uint32(1)) * uint32(TN), nkeys, tid, s_at, index_cache,
                                  flat, rpp)
                        cp_async_commit()
                        wait_one()
                    else:
                        wait_none()
                    cuda.syncthreads()
                    e0 = span0 + it * uint32(TN)
                    boff = U4 * (it & uint32(1)) * uint32(BUFW)
                    for mt in range(MT):
                        for a_ in range(ACC):
                            acc[a_] = F0
                        arow = a_lane + boff + uint32(16 * 4 * DIWP * mt)
                        for ks in range(KS):
                            a = ldmatrix_x4(k_s, arow + uint32(32 * ks), scr[warp], lane)
                            head_step(a, b_reg, acc, ks, scr[warp], lane)
                        m = uint32(16 * mt) + g
                        for ii in range(4):
                            v = head_sum(acc, ii)
                            e = e0 + m + U8 * (uint32(ii) >> uint32(1))
                            lr = la + uint32(ii & 1)
                            orow = row0 + lr
                            if orow < rows and r_req[lr] == target and e < span1:
                                if int32(e) < r_nb[lr]:
                                    scores[orow, e] = v * inv_sqrt
                                else:
                                    scores[orow, e] = NEG_INF
                    cuda.syncthreads()
        # the tiles no pass covered for a row (inert, or every group of the tile past its
        # request's longest row): -inf, in the same store pattern
        e0 = span0
        while e0 < span1:
            for ab in range(2):
                lr = la + uint32(ab)
                if row0 + lr < rows and not (r_req[lr] >= int32(0) and int32(e0) < r_nbm[lr]):
                    for mt in range(MT):
                        for half in range(2):
                            e = e0 + uint32(16 * mt) + g + U8 * uint32(half)
                            if e < span1:
                                scores[row0 + lr, e] = NEG_INF
            e0 += uint32(TN)

    keysm_scores.rows_per_block = TM
    keysm_scores.threads = NT
    keysm_scores.keys_per_tile = TN
    return keysm_scores



#: Score blocks of at most ``DIRECT_ROWS`` rows, or of at most ``DIRECT_SCORES`` scores, take the
#: direct kernel (:func:`make_direct_scores_kernel`). H200, ms against the shared-memory kernel
#: (``docs/kernels/index_scores.md``, session 6): 1x32K 0.0070 / 0.0125, 8x32K 0.0085 / 0.0164, 32x32K 0.0116 /
#: 0.0164, 4x131K 0.0103 / 0.0178; but 64x32K 0.0191 / 0.0173 and 16x131K 0.0198 / 0.0192.
DIRECT_ROWS = 8
DIRECT_SCORES = 1 << 18


def direct_route(rows, groups):
    """Whether a ``rows x groups`` score block takes the direct keys-as-M kernel (in the simulator
    by the row count alone, so the tests' small blocks also reach the shared-memory kernel)."""
    return rows <= DIRECT_ROWS or (not SIMULATOR and rows * groups <= DIRECT_SCORES)


@functools.lru_cache(maxsize=None)
def make_direct_scores_kernel(hi, di, r, words, bf16=False, warps=4, tiles=2):
    """Few-row keys-as-M scores: independent warps, no shared memory staging, no block barrier.

    The block's ``warps`` warps share 8 query rows (grid y: ``ceil(rows / 8)``); warp ``w`` of block
    ``x`` scores the ``16 * tiles`` keys from ``(x * warps + w) * 16 * tiles``. Each lane loads its
    operands straight from global memory into registers: the B fragments (query row ``g``, words
    ``8 ks + t`` and ``+ 4`` of every head and k-step), then, per distinct request of the rows, the
    A fragments of every tile (key rows ``g`` and ``g + 8``, the same words: what ``ldmatrix``
    gives :func:`make_keysm_scores_kernel` from shared memory). Its chain is three dependent loads
    (row state, page id, key) and the mma; the keys-as-M block's serial barriers are what bounded
    it at 1-8 rows (``docs/kernels/index_scores.md``). The mma k-steps run in the same order on the same
    fragments, so a score is bitwise the keys-as-M kernel's: a row's scores do not depend on the
    batch it is in. Signature as the keys-as-M kernel without ``keys_per_block``; grid
    ``(ceil(G / (16 * tiles * warps)), ceil(rows / 8))``, ``32 * warps`` threads, no shared memory
    on a GPU (the simulator's mma scratch only). Entries past ``nb`` (and inert rows) get ``-inf``.
    """
    from . import mma as M

    if hi not in KEYSM_HEADS or di % 16:
        raise ValueError(f"keys-as-M scores need Hi in {KEYSM_HEADS} and Di % 16 == 0")
    WARPS = 2 if SIMULATOR else warps
    TILES = tiles
    KPW = 16 * TILES                    # keys per warp
    NT = 32 * WARPS
    HI = hi
    KS = di // 16
    AREG = TILES * KS * 4
    ATS = 2 * TILES
    BREG = hi * KS * 2
    ACC = hi * 4
    inv_sqrt = float32(1.0 / math.sqrt(di))
    SCRW = M.SCRATCH_WORDS
    U2, U3, U8, U31 = uint32(2), uint32(3), uint32(8), uint32(31)
    F0 = float32(0.0)
    head_step, head_sum = _head_mma(hi, KS, bool(bf16))
    word = _word_u32 if words else (_word_bits if bf16 else _word_f16)
    WORDS = bool(words)
    key_at = _key_locator(WORDS)

    @device_jit(forceinline=True)
    def key_word(index_cache, flat, at, w, rpp):
        """Word ``w`` of the key at ``at`` (:func:`_key_locator`); 0 for no key (``at < 0``)."""
        v = uint32(0)
        if at >= int32(0):
            if WORDS:
                v = flat[uint32(at) + w]
            else:
                pg = uint32(at) // rpp
                v = word(index_cache, pg, uint32(at) - pg * rpp, w)
        return v

    @jit(launch_bounds=(NT, 1))
    def direct_scores(qi, index_cache, flat, index_block_table, req_ids, positions, seq_lens,
                      scores):
        scr = cuda.shared.array((WARPS, SCRW), uint32)
        a_reg = cuda.local.array(AREG, uint32)
        b_reg = cuda.local.array(BREG, uint32)
        acc = cuda.local.array(ACC, float32)
        rq = cuda.local.array(8, int32)
        rnb = cuda.local.array(8, int32)

        tid = uint32(cuda.threadIdx.x)
        warp = tid >> uint32(5)
        lane = tid & U31
        g = lane >> U2
        t = lane & U3
        rows = uint32(scores.shape[0])
        ngroups = uint32(scores.shape[1])
        row0 = uint32(cuda.blockIdx.y) * U8
        e_w = (uint32(cuda.blockIdx.x) * uint32(WARPS) + warp) * uint32(KPW)
        if e_w >= ngroups:                         # uniform across the warp
            return
        n_pages = int32(index_cache.shape[0])
        rpp = uint32(index_cache.shape[1])
        tcols = uint32(index_block_table.shape[1])

        # where this lane's keys lie for the first row's request, loaded beside the rows' states
        # (the page ids then wait on one load, not on the row's visibility)
        spec = int32(req_ids[row0])
        if spec < int32(0) or spec >= int32(seq_lens.shape[0]):
            spec = int32(-1)
        at_s = cuda.local.array(ATS, int32)
        for j in range(TILES):
            for half in range(2):
                at = int32(-1)
                if spec >= int32(0):
                    at = key_at(index_cache, e_w + uint32(16 * j + 8 * half) + g, spec,
                                index_block_table, tcols, rpp, n_pages)
                at_s[2 * j + half] = at

        # the 8 rows' requests and visible groups (every lane: broadcast loads), and this lane's
        # two output rows 2t, 2t+1 (the accumulator columns)
        for s in range(8):
            q_ = int32(-1)
            nbv = int32(0)
            if row0 + uint32(s) < rows:
                q_, p, nbv = row_state(row0 + uint32(s), req_ids, positions, seq_lens, r)
            rq[s] = q_
            rnb[s] = min(nbv, int32(ngroups))
        my_rq0, my_rq1 = int32(-1), int32(-1)
        my_nb0, my_nb1 = int32(0), int32(0)
        if row0 + U2 * t < rows:
            my_rq0, p, my_nb0 = row_state(row0 + U2 * t, req_ids, positions, seq_lens, r)
        if row0 + U2 * t + uint32(1) < rows:
            my_rq1, p, my_nb1 = row_state(row0 + U2 * t + uint32(1), req_ids, positions, seq_lens,
                                          r)
        my_nb0 = min(my_nb0, int32(ngroups))
        my_nb1 = min(my_nb1, int32(ngroups))

        qrow = row0 + g                            # B fragments: query row g
        for h in range(HI):
            for ks in range(KS):
                for j in range(2):
                    v = uint32(0)
                    if qrow < rows:
                        v = word(qi, qrow, uint32(h), uint32(8 * ks + 4 * j) + t)
                    b_reg[(h * KS + ks) * 2 + j] = v

        # one pass per distinct request, in first-row order (a bitmask of the rows done, so the
        # row arrays are only read at constant indices: they stay in registers)
        done = uint32(0)
        for s in range(8):
            if rq[s] < int32(0):
                done |= uint32(1 << s)
        while done != uint32(0xFF):                # uniform across the warp
            target = int32(-1)
            for s in range(8):
                if target < int32(0) and (done >> uint32(s)) & uint32(1) == uint32(0):
                    target = rq[s]
            nbmax = int32(0)
            for s in range(8):
                if rq[s] == target:
                    nbmax = max(nbmax, rnb[s])
                    done |= uint32(1 << s)
            if int32(e_w) < nbmax:
                for j in range(TILES):
                    for half in range(2):
                        e = e_w + uint32(16 * j + 8 * half) + g
                        at = int32(-1)
                        if int32(e) < nbmax:
                            if target == spec:
                                at = at_s[2 * j + half]
                            else:
                                at = key_at(index_cache, e, target, index_block_table, tcols,
                                            rpp, n_pages)
                        for ks in range(KS):
                            for q in range(2):
                                a_reg[(j * KS + ks) * 4 + half + 2 * q] = key_word(
                                    index_cache, flat, at, uint32(8 * ks + 4 * q) + t, rpp)
                for j in range(TILES):
                    for a_ in range(ACC):
                        acc[a_] = F0
                    for ks in range(KS):
                        ab = (j * KS + ks) * 4
                        a = (a_reg[ab], a_reg[ab + 1], a_reg[ab + 2], a_reg[ab + 3])
                        head_step(a, b_reg, acc, ks, scr[warp], lane)
                    for ii in range(4):
                        v = head_sum(acc, ii)
                        e = e_w + uint32(16 * j) + g + U8 * (uint32(ii) >> uint32(1))
                        odd = (ii & 1) == 1
                        lr = U2 * t + uint32(ii & 1)
                        mine = my_rq1 == target if odd else my_rq0 == target
                        nbr = my_nb1 if odd else my_nb0
                        if row0 + lr < rows and mine and e < ngroups:
                            if int32(e) < nbr:
                                scores[row0 + lr, e] = v * inv_sqrt
                            else:
                                scores[row0 + lr, e] = NEG_INF

        # this lane's rows no pass covered (inert, or every key of the warp past the longest row
        # of the row's request): -inf, in the same store pattern
        for ab in range(2):
            mq = my_rq1 if ab == 1 else my_rq0
            nbm = int32(0)
            for s in range(8):
                if rq[s] == mq:
                    nbm = max(nbm, rnb[s])
            lr = U2 * t + uint32(ab)
            if row0 + lr < rows and not (mq >= int32(0) and int32(e_w) < nbm):
                for j in range(TILES):
                    for half in range(2):
                        e = e_w + uint32(16 * j + 8 * half) + g
                        if e < ngroups:
                            scores[row0 + lr, e] = NEG_INF

    direct_scores.threads = NT
    direct_scores.keys_per_block = KPW * WARPS
    return direct_scores


def keysm_supported(profile, qi):
    return profile.scores.mma == "m16n8k16" and int(qi.shape[1]) in KEYSM_HEADS


def launch_keysm(qi, index_cache, index_block_table, req_ids, positions, seq_lens, scores,
                 profile, stream, r=4, span_tiles=KEYSM_SPAN_TILES, warps=None, minb=4,
                 tile_keys=None, direct=None, direct_shape=(4, 2)):
    """Launch the keys-as-M route: the direct kernel for small blocks (:func:`direct_route`;
    ``direct`` forces it on or off, ``direct_shape`` is its (warps, tiles)), else the
    shared-memory kernel with ``span_tiles`` key tiles per block at most (the queries are loaded
    into registers once per block), ``warps`` (4) and ``tile_keys`` (64)."""
    rows, groups = scores.shape
    if rows == 0 or groups == 0:
        return scores
    if not 1 <= span_tiles <= KEYSM_SPAN_TILES:
        raise ValueError(f"span_tiles must be in 1..{KEYSM_SPAN_TILES}, got {span_tiles}")
    hi, di = int(qi.shape[1]), int(qi.shape[2])
    wq, wk = word_view(qi), word_view(index_cache)
    flat = _flat_words(wk)
    words = wq is not None and flat is not None
    bf16 = is_bf16(qi)
    if words:
        qi, index_cache = wq, wk
    else:
        qi, index_cache = bits16(qi), bits16(index_cache)
        from .. import device as dev
        flat = dev.constant(np.zeros(4, np.uint32), stream)
    if direct_route(rows, groups) if direct is None else direct:
        w_, t_ = direct_shape              # element loads: one tile (two stay in local memory)
        k = make_direct_scores_kernel(hi, di, int(r), words, bf16, w_, t_ if words else 1)
        grid = (-(-groups // k.keys_per_block), -(-rows // 8))
        k[grid, k.threads, stream](qi, index_cache, flat, index_block_table, req_ids, positions,
                                   seq_lens, scores)
        return scores
    k = make_keysm_scores_kernel(hi, di, int(r), words, warps or 4, minb, bf16, tile_keys or 64)
    row_tiles = -(-rows // k.rows_per_block)
    tn = k.keys_per_tile
    span = tn * span_tiles
    while span > tn and row_tiles * -(-groups // span) < 4 * profile.sm_count:
        span //= 2
    grid = (-(-groups // span), row_tiles)
    k[grid, k.threads, stream](qi, index_cache, flat, index_block_table, req_ids, positions,
                               seq_lens, np.int32(span), scores)
    return scores


def _flat_words(w):
    """The words a 3-D uint32 key view ``w`` spans as one 1-D array from its first element (its
    strides index it), or None: no view, negative strides, or 2**31 words or more."""
    if w is None or any(st < 0 for st in w.strides):
        return None
    n = sum((d - 1) * st for d, st in zip(w.shape, w.strides)) // 4 + 1 if w.size else 1
    if n >= 2 ** 31:
        return None
    if w.is_c_contiguous():
        return w.reshape(-1)
    if SIMULATOR:
        return None
    from numba.cuda.cudadrv.devicearray import DeviceNDArray
    return DeviceNDArray(shape=(n,), strides=(4,), dtype=np.dtype(np.uint32), stream=w.stream,
                         gpu_data=w.gpu_data)


def _light_case(dtype, hi=4, di=128, r=4):
    k = make_light_scores_kernel(hi, di, r)
    sig = (f"void({dtype}[:, :, :], {dtype}[:, :, :], int32[:, :], int32[:], int32[:], int32[:], "
           f"int32, float32[:, :])")
    return k, sig, k.threads


RESOURCE_CASES = []
for _dt in ("float16", "float32"):
    _k, _sig, _nt = _light_case(_dt)
    for _cc in ((7, 0), (9, 0)):
        RESOURCE_CASES.append((f"index_scores.light.{_dt}", _k, _sig, _nt, 0, _cc))
for _kind, _ccs in (("m16n8k16", ((9, 0),)), ("m8n8k4", ((7, 0), (9, 0)))):
    _k = make_tiled_scores_kernel(_kind, 4, 128, 4)
    _sig = ("void(float16[:, :, :], float16[:, :, :], int32[:, :], int32[:], int32[:], int32[:], "
            "int32, float32[:, :])")
    for _cc in _ccs:
        RESOURCE_CASES.append((f"index_scores.tiled.{_kind}", _k, _sig, _k.threads, 0, _cc))
for _words in (True, False):
    _k = make_keysm_scores_kernel(4, 128, 4, _words)
    _t = "uint32" if _words else "float16"
    _sig = (f"void({_t}[:, :, :], {_t}[:, :, :], uint32[:], int32[:, :], int32[:], int32[:], "
            "int32[:], int32, float32[:, :])")
    RESOURCE_CASES.append((f"index_scores.keysm.{_t}", _k, _sig, _k.threads, 0, (9, 0)))
    _k = make_direct_scores_kernel(4, 128, 4, _words, tiles=2 if _words else 1)   # as launched
    _dsig = _sig.replace("int32[:], int32, float32", "int32[:], float32")
    RESOURCE_CASES.append((f"index_scores.direct.{_t}", _k, _dsig, _k.threads, 0, (9, 0)))
# bfloat16 (uint16 bit arrays): light on every architecture, tensor cores on sm_80+
_BF = ("void(uint16[:, :, :], uint16[:, :, :], int32[:, :], int32[:], int32[:], int32[:], int32, "
       "float32[:, :])")
_k = make_light_scores_kernel(4, 128, 4, True, True)
for _cc in ((7, 0), (9, 0)):
    RESOURCE_CASES.append(("index_scores.light.bf16", _k, _BF, _k.threads, 0, _cc))
_k = make_tiled_scores_kernel("m16n8k16", 8, 128, 4, True)
RESOURCE_CASES.append(("index_scores.tiled.m16n8k16.bf16", _k, _BF, _k.threads, 0, (9, 0)))
for _words in (True, False):
    _k = make_keysm_scores_kernel(4, 128, 4, _words, bf16=True)
    _sig = _BF.replace("uint16", "uint32") if _words else _BF
    _sig = _sig.replace("int32[:, :], int32[:]", "uint32[:], int32[:, :], int32[:]", 1)
    RESOURCE_CASES.append((f"index_scores.keysm.bf16.{'uint32' if _words else 'uint16'}", _k, _sig,
                           _k.threads, 0, (9, 0)))
