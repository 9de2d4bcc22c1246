"""What more than one index-score kernel uses; no kernel of its own.

Serves every route of :mod:`numqsa.kernels.index_scores`, on the architectures its callers run on:

- every route, any architecture: :func:`relu`, which keeps NaN (the oracle's contract), and
  ``NEG_INF``; :func:`light_keys_per_block`, the key span per block of the light launcher and of
  the per-warp-M tensor-core launcher (:mod:`.light`, :mod:`.tiled`);
- the two block-tiled tensor-core kernels (per-warp-M in :mod:`.tiled`, keys-as-M in
  :mod:`.keysm`): :func:`_stage_block_rows` and :func:`_distinct_requests`, a block's row states
  and its one pass per distinct request (varlen batches); :func:`_pack_bits`, two bfloat16 bit
  patterns in one mma operand word (sm_80+);
- the two keys-as-M kernels (:mod:`.keysm`, :mod:`.direct`; sm_80+, ``Hi`` in ``KEYSM_HEADS``):
  the word readers ``_word_u32`` / ``_word_f16`` / ``_word_bits``, :func:`_key_locator` (where a
  group's key lies) and :func:`_head_mma`, their whole arithmetic. One ``_head_mma`` for both is
  what keeps a row's scores bitwise the same whichever of the two kernels its block takes
  (``test_gpu_scores_batch_invariance``; ``docs/kernels/index_scores.md``, "Invariants"); sharing
  it left the SASS unchanged (commit 2f1a827).
"""
import functools
import math

from numba import cuda, float32, int32, uint32

from ...jit import device_jit
from ..common import row_state
from ..mma import pack_f16x2 as _pack_pair


NEG_INF = float32(-math.inf)


@device_jit
def relu(x):
    """``max(x, 0)`` that keeps NaN (``NaN < 0`` is false), as NumPy's ``maximum`` in the oracle."""
    if x < float32(0.0):
        return float32(0.0)
    return x


def light_keys_per_block(rows, num_groups, tile_keys, sm_count):
    """Keys walked per block: long spans amortise the q tile; keep at least ~4 blocks per SM."""
    row_tiles = max(1, rows)
    span = tile_keys * 8
    while span > tile_keys and row_tiles * -(-num_groups // span) < 4 * sm_count:
        span //= 2
    return span


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


@device_jit(forceinline=True)
def _pack_bits(lo, hi):
    """Two 16-bit words (bfloat16 bits) -> one uint32, ``lo`` in the low half."""
    return (uint32(lo) & uint32(0xFFFF)) | ((uint32(hi) & uint32(0xFFFF)) << uint32(16))


KEYSM_HEADS = (1, 2, 4)


@device_jit
def _word_u32(a, i, j, w):
    return a[i, j, w]


@device_jit
def _word_f16(a, i, j, w):
    from_ = uint32(2) * w
    return _pack_pair(a[i, j, from_], a[i, j, from_ + uint32(1)])


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
    from .. import mma as M
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
