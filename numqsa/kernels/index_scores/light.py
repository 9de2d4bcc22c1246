"""Light index-score route: fp32 FMA over shared-memory tiles, on every architecture.

:func:`make_light_scores_kernel` keeps a block's ``TR`` query rows (all heads) in shared memory and
walks its keys in tiles of ``TK``; :func:`launch_light` launches it over a whole score block.

Where it runs (:func:`numqsa.plan.plan_select`, then ``_launch_scores`` in
``numqsa/stages/selection.py``), never chosen by batch size (a row's bits would then depend on its
batch; sm_70 and sm_80 took it below 512 rows and 2^20 scores until that was found):

- inputs no tensor-core kernel takes (:func:`~numqsa.kernels.index_scores.tiled.tiled_supported`):
  float32 or mixed dtypes, bfloat16 on sm_70, ``Hi`` not in 1, 2, 4, 8, 16, ``Di`` not a multiple
  of 16;
- everything under ``NUMQSA_INDEXER_TILED=0``.

It is only that fallback; on the H200 the tensor-core route also beat it at every size measured. GPU-only ms, tiled / light: run 1 (the
per-warp-M kernel) 1024 x 32K 0.705 / 1.423, 4096 x 32K 2.723 / 5.233
(``bench/results/history/2026-11-29-467347a-first-correct-kernels/bench_selection.log``); run 2
64 x 32K 0.051 / 0.136, 512 x 32K 0.079 / 0.796
(``bench/results/history/2026-11-29-fb253d2-selection-kernel-variants/bench_variants_run2.log``);
session 3 (keys-as-M) 1 x 32K 0.015 / 0.023, 16 x 32K 0.016 / 0.037, 256 x 131K 0.115 / 1.42
(the sm_90 profile's comment in ``numqsa/plan.py``).
"""
import functools
import math

import numpy as np
from numba import cuda, float32, int32, uint32

from ...jit import SIMULATOR, jit
from ..common import bits16, is_bf16, loader
from .common import NEG_INF, _stage_block_rows, light_keys_per_block, relu


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

        _stage_block_rows(row0, tid, TR, rows, ngroups, req_ids, positions, seq_lens, r, r_req, r_nb)
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
