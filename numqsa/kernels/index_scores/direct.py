"""Direct keys-as-M index scores for small blocks (sm_80+, ``Hi`` 1, 2, 4): independent warps, no
shared-memory staging, no block barrier.

In :func:`make_direct_scores_kernel` each lane loads its A (keys) and B (queries) fragments straight
from global memory into registers; the mma k-steps run in the same order on the same fragments as
in :mod:`.keysm`'s kernel (``_head_mma`` in :mod:`.common`), so a score is bitwise that kernel's and
a row's scores do not depend on the batch it is in. :func:`direct_route` picks it for blocks of at
most ``DIRECT_ROWS`` rows or ``DIRECT_SCORES`` scores;
:func:`~numqsa.kernels.index_scores.keysm.launch_keysm` launches it.

Where it runs: sm_80 and sm_90, decode and short blocks (the tiled route at every row count);
it and the keys-as-M kernel give a row the same bits, so the switch between them by block size
keeps a row's scores independent of its batch.

Why, on the H200 (GPU-only ms, no L2 flush; direct / shared-memory keys-as-M / TensorRT-LLM,
session 6, ``docs/kernels/index_scores.md`` "Versions", direct v1): 1 x 32K 0.0070 / 0.0125 /
0.0050, 8 x 32K 0.0085 / 0.0164 / 0.0112, 32 x 32K 0.0116 / 0.0164 / 0.0319, 4 x 131K 0.0103 /
0.0178 / 0.0180; the shared-memory kernel wins from 64 x 32K (0.0191 / 0.0173) and 16 x 131K
(0.0198 / 0.0192), hence the thresholds. The shipped version prefetches the page ids (31a6a70,
direct v2: 5-10% slower than v1 in the probe); record run (L2 flushed), numqsa / TensorRT-LLM:
1 x 32K 0.0102 / 0.0066, 1 x 131K 0.0129 / 0.0090.
"""
import functools
import math

from numba import cuda, float32, int32, uint32

from ...jit import SIMULATOR, device_jit, jit
from ..common import row_state
from .common import NEG_INF, KEYSM_HEADS, _head_mma, _key_locator, _word_bits, _word_f16, _word_u32


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
    from .. import mma as M

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
