"""Index scores (spec §4): ``score[i, e] = sum_h relu(<qi[i, h], kc[e]>) / sqrt(Di)``, ``-inf`` past ``nb``.

Two routes over the same output ``scores [rows, num_groups]`` float32:

- light (:func:`make_light_scores_kernel`): shared-memory tiles, fp32 FMA. For decode and short work,
  and the fallback everywhere. A block keeps ``TR`` query rows (all heads) in shared memory and walks
  ``keys_per_block`` compressed keys in tiles of ``TK``.
- tiled (:mod:`numqsa.kernels.index_scores_mma` is not a separate module: see
  :func:`make_tiled_scores_kernel`): tensor cores (mma.sync m16n8k16 on sm_80+, m8n8k4 on sm_70).

Rows of one tile may belong to different requests (varlen batches): a block runs one pass per
distinct request among its rows, staging that request's keys; almost always there is one pass.
A page id outside ``[0, num_idx_pages)`` (the public API rejects those before launch) is never read:
its keys load as zeros.
"""
import functools
import math

import numpy as np
from numba import cuda, float32, int32, uint32

from ..jit import SIMULATOR, jit
from .common import row_state

NEG_INF = float32(-math.inf)


def _light_shape(hi, di):
    """(TK keys per tile, RG row groups, RPT rows per thread); threads = TK * RG, TR = RG * RPT.

    GPU: 32 keys x 4 row groups = 128 threads, 8 rows: q tile 8*Hi*Di*4 B (16 KB at Hi 4, Di 128),
    key tile 32*(Di+1)*4 B (16.5 KB). Simulator: 8 x 2 threads, 4 rows (each thread is an OS thread).
    """
    if SIMULATOR:
        return 8, 2, 2
    return 32, 4, 2


@functools.lru_cache(maxsize=None)
def make_light_scores_kernel(hi, di, r):
    """Light index-score kernel for ``Hi = hi``, ``Di = di``, compress ratio ``r``.

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
                v = float32(qi[row0 + rr, h, d])
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
                                    v = float32(index_cache[page, ek - col * rpp, d])
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
                                    tot += max(acc[rr * HI + h], float32(0.0))
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
    k = make_light_scores_kernel(int(qi.shape[1]), int(qi.shape[2]), int(r))
    tr = k.rows_per_block
    row_tiles = -(-rows // tr)
    span = light_keys_per_block(row_tiles, groups, k.keys_per_tile, profile.sm_count)
    grid = (-(-groups // span), row_tiles)
    k[grid, k.threads, stream](qi, index_cache, index_block_table, req_ids, positions, seq_lens,
                               np.int32(span), scores)
    return scores


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
