"""Keys-as-M tensor-core index scores (sm_80+, ``Hi`` 1, 2, 4): the shared-memory kernel and the
launcher of both keys-as-M kernels.

:func:`make_keysm_scores_kernel` puts the compressed keys on the M side of m16n8k16 and 8 query rows
per warp on N, so one A fragment (16 keys) feeds ``Hi`` mmas and the head sum stays inside each
thread; key tiles are double-buffered with ``cp.async`` and read by ``ldmatrix.x4``.
:func:`launch_keysm` (called by :func:`~numqsa.kernels.index_scores.tiled.launch_tiled` when
:func:`keysm_supported`) gives blocks of few rows to the direct kernel (:mod:`.direct`,
:func:`~numqsa.kernels.index_scores.direct.direct_route`) and the others to this one; it passes the
caches as 32-bit words (:func:`word_view`, :func:`_flat_words`) where their layout allows, as 16-bit
elements otherwise.

Where it runs: sm_80 and sm_90 with ``Hi`` 1, 2, 4, score blocks of more than 8 rows and 2^18
scores (the tiled route at every row count). It scores the shipped large shapes.

Why, on the H200 (GPU-only ms): against the per-warp-M kernel in run 2, 4096 x 32K 0.356 / 0.913,
8192 x 131K 2.647 / 6.906 (an earlier 8-warp version; ``scores.keysm.w8`` / ``scores.generic`` in
``bench/results/history/2026-11-29-fb253d2-selection-kernel-variants/bench_variants_run2.log``).
This version (``cp.async`` pipeline, 4 warps; e41e8ec, session 4) against TensorRT-LLM's Triton
kernel in that session's record run: 4096 x 32K 0.185 / 0.380, 8192 x 131K 1.298 / 2.653
(``docs/kernels/index_scores.md``, "Versions"); in the session-6 record
(``bench/results/latest.json``, ``docs/benchmark.md``) 0.192 / 0.380 and 1.329 / 2.655. Why 4
warps and not 8: :func:`_keysm_shape`.
"""
import functools
import math

import numpy as np
from numba import cuda, float32, int32, uint32

from ...jit import SIMULATOR, device_jit, jit
from ..common import bits16, is_bf16
from .common import (KEYSM_HEADS, NEG_INF, _distinct_requests, _head_mma, _key_locator,
                     _stage_block_rows, _word_bits, _word_f16, _word_u32)
from .direct import direct_route, make_direct_scores_kernel


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
    from .. import mma as M
    from ..smem import cp_async_16, cp_async_commit, cp_async_wait_fn, ldmatrix_x4, shared_base

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
        from ... import device as dev
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
