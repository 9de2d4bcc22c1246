"""Grouped sparse attention over page-4 virtual pages (spec §7), sm_80+ (m16n8k16 tensor cores).

The arithmetic of a row, fixed by its own selection alone: its virtual pages (the page-4 plan's,
in logical order, the partial tail page last) are cut into *pieces* of ``PIECE`` = 32 pages (4
chunks of 8) and *spans* of ``SPAN`` = 128 pages (4 pieces); the last piece, and the last span,
take the remainder (``max(1, nv // PIECE)`` pieces). Each piece runs its own online softmax over
its chunks; a span's pieces are folded in order (:func:`_fold_step`); the spans are folded with a
common maximum (:func:`_fold_weight`, :func:`_fold_add`, :func:`_fold_finish`).

Kernels after the page-4 plan (:mod:`numqsa.kernels.page4`):

1. **window plan** (:func:`make_window_plan_kernel`): a *window* is up to ``G`` consecutive rows.
   For each (window, span) it builds the union of the rows' pages of that span, ordered by (request
   run, logical group) through a bitmap of the logical groups in shared memory, and for every own
   page its index in that union. A row whose chunk of 8 own pages would spread over more union
   stages than the attention kernel's ring holds is marked *solo* for that span.
2. **attention** (:func:`make_grouped_kernel`): one block per (window, span, KV head): warp
   ``w < G * HT`` = (row ``w // HT``, head tile ``w % HT``), then ``producers`` copy warps. The
   producers stream the union through a ring of ``NB`` shared-memory stages of ``SP`` pages with
   ``cp.async``; per stage a ``full`` mbarrier (landed) and an ``empty`` one (released by every
   row's warp). A row's warp, per chunk of its own pages, releases the stages before the chunk,
   waits on the stage holding its last page and consumes it: ``S^T = K Q^T`` (K fragments by
   ``ldmatrix``) for the chunk's two halves of 16 tokens, one online-softmax step per chunk of 32,
   ``O^T += V^T P^T`` (V fragments by ``ldmatrix.trans``, P^T by ``movmatrix``). At each piece's
   end the warp folds the piece into its span's state (kept in global memory, L2-resident: one
   warp's 8 KB). Solo rows are then streamed one at a time with their own pages only. In the
   *fused* schedule (many windows: ``FUSE_WAVES``) one block runs all of its window's spans in
   turn and folds each row's spans itself; else a block per (window, span) and the merge kernel.
   *Direct* blocks (one-row windows: few rows) stream one piece of one row each, with no window
   plan: a row spreads over 16 blocks at Kb 512. Under :func:`numqsa.sparse_attention` they plan
   their own pieces from the selection with the page-4 plan's checks, so no plan kernel runs
   before them (:func:`plans_own_pieces`); their verdicts give the generic kernel its rows.
3. **merge** (:func:`make_merge_kernel`): a row's spans (direct: its pieces, folded into spans
   first) in order.

Invariance: which rows share its window, how the union is staged, whether it runs solo, direct,
split or fused, the page placement and the batch never change which numbers are added in which
order; they only change where the operands are loaded from and who folds.

Shared memory: ``NB * SP * 2 (K, V) * 4 tokens * max(D * 2, 128)`` bytes of dynamic memory and 128
for its alignment (D 256, NB 6, SP 8: 192 KB; direct blocks NB 3: 96 KB, two blocks an SM): token
rows at a pitch of 128-byte lines, their 16-byte chunks swizzled against bank conflicts
(:func:`row_words`, :func:`ring_offset`).

Route: the attention of every row count on sm_80 and sm_90, for float16 and bfloat16 with
``r = 4`` and 16-byte aligned caches with a contiguous D axis; sm_70 and unaligned caches take
:mod:`numqsa.kernels.page4`'s kernel, float32 and mixed dtypes :mod:`numqsa.kernels.attention`.
``NB`` is 6 on sm_90 and 4 on sm_80 (not measured on an A100). The versions, their times on the
H200 and the counters that limit them: ``docs/kernels/grouped.md``.
"""
import contextlib
import functools
import math

import numpy as np
from numba import cuda, float32, int32, int64, uint32, uint64
from numba.cuda.types import float16

from ..jit import SIMULATOR, device_jit, jit
from ..launch import after, mark, programmatic
from .common import bits16, is_bf16
from .page4 import make_plan_checks
from .mma import SCRATCH_WORDS, mma_m16n8k16_bf16, mma_m16n8k16_f16, pack_bf16x2, pack_f16x2
from .smem import (shared_base, ld_shared_i32, cp_async_16, cp_async_mbar_arrive, grid_dep_launch,
                   grid_dep_wait, ldmatrix_x4, ldmatrix_x4_trans, mbar_arrive, mbar_init, mbar_ref,
                   mbar_test_wait, mbar_try_wait, movmatrix_trans, shfl_xor_f32, warp_any)

__all__ = ["GroupedConfig", "grouped_config", "plans_own_pieces", "window_size", "takes_head_dim",
           "make_window_plan_kernel", "make_grouped_kernel", "make_merge_kernel", "launch_grouped",
           "ring_offset", "at_step", "RESOURCE_CASES"]

#: No sm_70 build: cp.async and ldmatrix / movmatrix need sm_80 / sm_75; sm_70 runs the m8n8k4
#: page-4 kernel (numqsa.kernels.page4).
SM70 = False

PIECE = 32             # pages a piece (arithmetic): 513 pages (Kb 512 + tail) -> 16 pieces
SPAN = 128             # pages a span: its 4 pieces fold in order (arithmetic too); a union block
#                        streams one span per phase
DIRECT_STAGES = 3      # ring stages of a direct block: 101 KB, two blocks an SM
FUSE_WAVES = 8         # windows per SM from which one block runs all of a window's spans
MAX_WARPS = 8          # warps per attention block (ptxas budgets registers for warps in fours)
PRODUCERS = 2          # of them copy warps (one leaves the rows' warps waiting on data: session 8)
SMEM_BLOCK_MAX = 227 * 1024   # opt-in shared memory of one sm_90 block (sm_80: 4 stages fit 163 KB)
RING_ALIGN = 128       # the ring's base rounded up to a 128-byte line (the swizzle's XORs need it)
CHUNK = 8              # own pages per online-softmax step: 32 tokens, two m16 halves (session 10)
HEAD_TILE = 8          # query heads per warp: the n8 of m16n8k16 (S^T = K Q^T is tokens x heads)
BITMAP_WORDS = 1024    # window plan: logical groups per bitmap pass = 32 * 1024
NEG_INF = float32(-math.inf)
NAN = float32(math.nan)

if SIMULATOR:
    @device_jit
    def fexp(x):
        return math.exp(x)
else:
    from .mma import ex2_approx_ftz
    LOG2E = float32(math.log2(math.e))

    @device_jit(forceinline=True)
    def fexp(x):
        """``ex2.approx.ftz`` of ``x * log2(e)``: ~2 ulp, against ~20 instructions and a branch for
        ``expf``; libdevice's ``fast_expf`` (the same product) adds a subnormal range fix, 3 of the
        5 instructions an exponential took in the chunk's SASS. A weight below 2^-126 is 0."""
        return ex2_approx_ftz(x * LOG2E)


class GroupedConfig:
    """Launch shape of the grouped route; none of it changes a row's arithmetic except ``piece``."""

    def __init__(self, d, hg, stages, stage_pages, rows_per_window, plan_threads, piece=PIECE,
                 producers=PRODUCERS, fused=False, span=None):
        self.d = int(d)
        self.piece = int(piece)                                  # arithmetic: fixed per platform
        # pages of a span, whose pieces fold in order into one partial (arithmetic, as the piece)
        self.span = self.piece if span is None else int(span)
        if self.span % self.piece:
            raise ValueError(f"span {self.span} is not a multiple of the piece {self.piece}")
        self.head_tiles = -(-int(hg) // HEAD_TILE)              # HT
        self.heads_per_tile = -(-int(hg) // self.head_tiles)     # balanced: 12 -> 2 x 6
        self.stages = int(stages)                                # NB
        self.stage_pages = int(stage_pages)                      # SP
        self.producers = int(producers)                          # copy warps beside the rows' warps
        self.rows_per_window = int(rows_per_window)              # G
        self.plan_threads = int(plan_threads)
        self.fused = bool(fused)             # one block runs all of a window's spans and folds them

    @property
    def keep(self):
        """Stages a chunk may span: every stage of the ring stays readable until each row's warp
        has released it (the producer refills a stage only then)."""
        return self.stages

    @property
    def smem_bytes(self):
        """The ring: K and V, 4 token rows a page (``row_words``), and room to align it to 128."""
        return self.stages * self.stage_pages * 2 * 4 * 4 * row_words(self.d) + RING_ALIGN


#: Benchmark-only overrides of :func:`grouped_config`'s choices (bench/attention_probe.py --tune).
TUNING = {}
# direct blocks' merge launched programmatically behind them (sm_90): 2, the blocks trigger it
# after their last store (session 16: 0.2-0.4 us at 1-16 rows; 1, after their set-up, made 16 rows
# 2 us slower: the merge's blocks wait on the SMs); ``TUNING["pdl"]`` overrides
PDL = 2
# direct blocks plan their own pieces, no page-4 plan (session 16; ``TUNING["self"]``)
SELF_PLAN = True


def grouped_config(d, hg, rows, kb1, hkv, profile, single=False):
    """Choose the window size: windows of :func:`window_rows` rows share their loads; few rows get
    narrower windows (more blocks) down to single rows.
    ``single``: one-row windows (a plan without the tokens that order a union)."""
    ht = -(-int(hg) // HEAD_TILE)
    if SIMULATOR:       # small stages, pieces and spans so CI exercises the ring, solo rows, spans
        g = 1 if single else max(1, 2 // ht)     # of two pieces and the merge
        return GroupedConfig(d, hg, 3, 4, g, 32, piece=8, producers=1, fused=-(-rows // g) >= 2,
                             span=16)
    producers = TUNING.get("np", PRODUCERS)
    sms = int(profile.sm_count)
    g = 1 if single else TUNING.get("g", window_size(rows, ht, kb1, hkv, sms,
                                                     window_rows(hg, producers)))
    direct = g == 1 and not single
    stages = TUNING.get("nb", 6 if profile.smem_per_sm >= 200 * 1024 else 4)
    if direct:
        stages = TUNING.get("nbd", DIRECT_STAGES)
    # fused: a block per window runs its spans in turn and folds them (no merge kernel), where the
    # windows alone fill FUSE_WAVES waves of the SMs (direct blocks never: launch_grouped)
    fused = bool(TUNING.get("fu", -(-rows // g) * hkv >= FUSE_WAVES * sms))
    return GroupedConfig(d, hg, stages, TUNING.get("sp", 8), g, 128, piece=PIECE,
                         producers=producers, fused=fused, span=SPAN)


def plans_own_pieces(d, hg, rows, kb1, hkv, profile):
    """The pieces a row can have when :func:`launch_grouped` runs direct blocks that plan their own
    pieces (``SELF_PLAN``: one-row windows) for this problem, else 0. Then no page-4 plan runs:
    the blocks' verdicts (``verdict``) tell the generic kernel its rows. Planning changes no bits."""
    cfg = grouped_config(d, hg, rows, kb1, hkv, profile)
    if cfg.rows_per_window != 1 or not TUNING.get("self", SELF_PLAN):
        return 0
    return pieces_of(kb1, cfg.piece)


def takes_head_dim(d):
    """Whether a producer lane's copies of a page fit the compile-time offsets of
    :func:`make_grouped_kernel`: ``d / 8`` 16-byte chunks a token row dividing 32 or a multiple of
    it (d 32, 64, 128, 256, 512, ...; TensorRT-LLM's kernel takes powers of two only)."""
    n = int(d) // 8
    return int(d) % 8 == 0 and n > 0 and (32 % n == 0 or n % 32 == 0)


def row_words(d):
    """Words of a token row in the ring: ``d / 2``, at least one 128-byte line (d 32). Rows are
    not padded: a padded row (session 6-21: 16 bytes more) made each 512-byte ``cp.async`` row
    cost 10.5 shared-memory wavefronts instead of 4 (session 22, ``bench/copy_probe.py``); the
    8 rows an ``ldmatrix`` reads are kept apart by :func:`ring_offset`'s swizzle instead."""
    return max(int(d) // 2, 32)


def window_size(rows, head_tiles, kb1, hkv, sms, most):
    """Rows per window (1 .. ``most``): the fewest waves times a block's time; the larger window on
    a tie. One-row windows run direct: a block per piece (4 chunks), two blocks an SM; wider ones a
    block per span (16 chunks) and one an SM, plus the window plan. A block's time, modelled from
    session 11's chains on the H200 (16 chunks: 29 us for one row's warp, about 42 us for six):
    ``3 + chunks * (1.46 + 0.16 * warps)`` us; the window plan about 6 us. Windows change no row's
    arithmetic, only which rows share loads."""
    best, best_g = None, 1
    for g in range(1, int(most) + 1):
        span, per_sm, plan = (PIECE, 2, 0.0) if g == 1 else (SPAN, 1, 6.0)
        blocks = -(-int(rows) // g) * pieces_of(kb1, span) * int(hkv)
        waves = -(-blocks // (int(sms) * per_sm))
        chunks = min(int(kb1), span) / CHUNK
        cost = plan + waves * (3.0 + chunks * (1.46 + 0.16 * g * int(head_tiles)))
        if best is None or cost <= best:
            best, best_g = cost, g
    return best_g


def window_rows(hg, producers=PRODUCERS):
    """Rows of a full window: the rows' warps and the producers fill ``MAX_WARPS``."""
    return max(1, (MAX_WARPS - int(producers)) // -(-int(hg) // HEAD_TILE))


# ------------------------------------------------------------------------------------------------
# Window plan
# ------------------------------------------------------------------------------------------------

@device_jit(forceinline=True)
def _piece_range(nv, piece, pc):
    """(first page, end page) of piece ``piece`` of a row with ``nv`` pages (empty past its pieces)."""
    npc = max(int32(1), int32(nv // int32(pc)))
    if piece >= npc:
        return int32(0), int32(0)
    k0 = int32(piece * int32(pc))   # (int32 sums: numba's int32 + int32 is int64, and these
    k1 = int32(k0 + int32(pc))      # bounds meet every page of the chunk loop)
    if piece == int32(npc - int32(1)):
        k1 = int32(nv)
    return k0, k1


@device_jit(forceinline=True)
def _key(tokens, keyed, row, k):
    """Logical group of own page ``k`` (its first token // 4), or ``k`` itself for unkeyed plans
    (one-row windows over a bare page-4 plan, whose union is the row's own pages in order)."""
    if keyed == int32(0):
        return k
    return int32(tokens[row, 4 * k]) >> int32(2)


@functools.lru_cache(maxsize=None)
def make_window_plan_kernel(threads, piece, stage_pages, keep, rows_per_window):
    """Grid ``(windows, pieces)``, ``threads`` threads, windows of up to ``rows_per_window`` rows;
    static shared memory ~9 KB + 16 bytes per own page a piece can hold (``2 * piece`` a row).

    Outputs per (window, piece): ``wunion[w, p, u] = (page, slot)`` of union entry ``u``,
    ``wmeta[w, p] = (union size, solo-row bit mask, malformed-row bit mask)``; per row
    ``ownu[row, k]`` = union index of own page ``k`` (within its piece's union). Rows are cut into
    runs of equal ``req_ids`` (keys of different requests never merge); within a run the union is
    ordered by logical group. The piece's keys and page ids of every row are read once, all loads
    in flight together, into shared memory; every pass after works there (session 10: the passes
    read them from global memory, one row after another, and the kernel took 120-168 us of
    4096 x 32K's 1.2 ms).
    """
    NT, PC, SP, KEEP, G = (int(v) for v in (threads, piece, stage_pages, keep, rows_per_window))
    NBW = BITMAP_WORDS
    WPT = NBW // NT                           # bitmap words per thread in the scan
    NBITS = 32 * NBW
    UNT = uint32(NT)
    OWN = 2 * PC                              # own pages of a row in one piece, at most
    SLOTS = G * OWN
    ITERS = -(-SLOTS // NT)

    def kernel(tokens, keyed, pages, num_vpages, tail_len, req_ids, windows, num_pages, page_size,
               wunion, wmeta, ownu):
        bits = cuda.shared.array(NBW, uint32)
        pref = cuda.shared.array(NBW, int32)
        scan = cuda.shared.array(NT, int32)
        ssolo = cuda.shared.array(2, uint32)
        srow = cuda.shared.array((G, 3), int32)      # per row: piece start, piece end, request
        skey = cuda.shared.array(SLOTS, int32)       # own page's logical group, row x at x * OWN
        spg = cuda.shared.array((SLOTS, 2), int32)   # its (page, slot)
        sun = cuda.shared.array(SLOTS, int32)        # its union index
        tid = uint32(cuda.threadIdx.x)
        win = uint32(cuda.blockIdx.x)
        piece_ = int32(cuda.blockIdx.y)
        first = int32(windows[win, 0])
        cnt = int32(windows[win, 1])
        if tid == uint32(0):
            ssolo[0] = uint32(0)
            ssolo[1] = uint32(0)
        cuda.syncthreads()
        # A row whose plan names a page or slot outside the cache (or is not ascending) is inert in
        # every piece: each block checks the whole row. A keyed plan is the page-4 plan kernel's
        # own, valid by construction (its rows are planned or inert): checked there.
        for x in range(cnt if keyed == int32(0) else 0):
            row = first + x
            nv = int32(num_vpages[row])
            tl = int32(tail_len[row])
            if tl < int32(0) or tl > int32(3) or nv > int32(pages.shape[1]):
                if tid == uint32(0):
                    cuda.atomic.or_(ssolo, 1, uint32(1) << uint32(x))
                continue
            for k in range(int32(tid), nv, int32(NT)):
                pg = int32(pages[row, k, 0])
                sl = int32(pages[row, k, 1])
                ln = int32(4)
                if k == nv - int32(1) and tl > int32(0):
                    ln = tl
                bad = pg < int32(0) or pg >= num_pages or sl < int32(0) or sl + ln > page_size
                if k > int32(0):
                    bad = bad or _key(tokens, keyed, row, k) <= _key(tokens, keyed, row, k - int32(1))
                if bad:
                    cuda.atomic.or_(ssolo, 1, uint32(1) << uint32(x))
        cuda.syncthreads()
        if tid < uint32(cnt):
            nv = int32(num_vpages[first + int32(tid)])
            if (ssolo[1] >> tid) & uint32(1):
                nv = int32(0)
            k0, k1 = _piece_range(nv, piece_, PC)
            srow[tid, 0] = k0
            srow[tid, 1] = k1
            srow[tid, 2] = int32(req_ids[first + int32(tid)])
        cuda.syncthreads()
        for it in range(ITERS):             # a constant trip count: the loads issue together
            e = tid + uint32(it * NT)
            x = int32(e // uint32(OWN))
            if e < uint32(SLOTS) and x < cnt:
                k = srow[x, 0] + int32(e % uint32(OWN))
                if k < srow[x, 1]:
                    skey[e] = _key(tokens, keyed, first + x, k)
                    spg[e, 0] = pages[first + x, k, 0]
                    spg[e, 1] = pages[first + x, k, 1]
        cuda.syncthreads()
        offset = int32(0)
        w = int32(0)
        while w < cnt:
            we = w + int32(1)
            while we < cnt and srow[we, 2] == srow[w, 2]:
                we += int32(1)
            kmin = int32(2147483647)
            kmax = int32(-1)
            for x in range(w, we):
                n = srow[x, 1] - srow[x, 0]
                if n > int32(0):
                    kmin = min(kmin, skey[x * OWN])
                    kmax = max(kmax, skey[x * OWN + n - int32(1)])
            base = kmin
            while base <= kmax:
                for i in range(tid, uint32(NBW), UNT):
                    bits[i] = uint32(0)
                cuda.syncthreads()
                for x in range(w, we):
                    for kk in range(int32(tid), srow[x, 1] - srow[x, 0], int32(NT)):
                        key = skey[x * OWN + kk] - base
                        if key >= int32(0) and key < int32(NBITS):
                            cuda.atomic.or_(bits, key >> int32(5), uint32(1) << uint32(key & int32(31)))
                cuda.syncthreads()
                own = int32(0)
                for i in range(WPT):
                    own += int32(cuda.popc(bits[tid * uint32(WPT) + uint32(i)]))
                scan[tid] = own
                cuda.syncthreads()
                step = uint32(1)
                while step < UNT:          # Hillis-Steele inclusive scan of the thread sums
                    v = int32(0)
                    if tid >= step:
                        v = scan[tid - step]
                    cuda.syncthreads()
                    scan[tid] += v
                    cuda.syncthreads()
                    step *= uint32(2)
                run = scan[tid] - own
                for i in range(WPT):
                    wd = tid * uint32(WPT) + uint32(i)
                    pref[wd] = run
                    run += int32(cuda.popc(bits[wd]))
                total = scan[UNT - uint32(1)]
                cuda.syncthreads()
                for x in range(w, we):
                    for kk in range(int32(tid), srow[x, 1] - srow[x, 0], int32(NT)):
                        e = x * OWN + kk
                        key = skey[e] - base
                        if key >= int32(0) and key < int32(NBITS):
                            wd = key >> int32(5)
                            below = bits[wd] & ((uint32(1) << uint32(key & int32(31))) - uint32(1))
                            u = offset + pref[wd] + int32(cuda.popc(below))
                            sun[e] = u
                            wunion[win, piece_, u, 0] = spg[e, 0]
                            wunion[win, piece_, u, 1] = spg[e, 1]
                offset += total
                cuda.syncthreads()
                base += int32(NBITS)
            w = we
        cuda.syncthreads()
        for it in range(ITERS):
            e = tid + uint32(it * NT)
            x = int32(e // uint32(OWN))
            if e < uint32(SLOTS) and x < cnt:
                k = srow[x, 0] + int32(e % uint32(OWN))
                if k < srow[x, 1]:
                    ownu[first + x, k] = sun[e]
        # A chunk (own pages 8c..8c+7 of the piece) is consumed when its last page lands; its first
        # page must still be in one of the KEEP readable stages, else the row runs solo.
        for x in range(cnt):
            n = srow[x, 1] - srow[x, 0]
            nch = (n + int32(CHUNK - 1)) // int32(CHUNK)
            for c in range(int32(tid), nch, int32(NT)):
                ka = x * OWN + int32(CHUNK) * c
                kz = x * OWN + min(int32(CHUNK) * c + int32(CHUNK - 1), n - int32(1))
                if sun[ka] // int32(SP) + int32(KEEP - 1) < sun[kz] // int32(SP):
                    cuda.atomic.or_(ssolo, 0, uint32(1) << uint32(x))
        cuda.syncthreads()
        if tid == uint32(0):
            wmeta[win, piece_, 0] = offset
            wmeta[win, piece_, 1] = int32(ssolo[0])
            wmeta[win, piece_, 2] = int32(ssolo[1])

    kernel.__name__ = f"grouped_window_plan_t{NT}_p{PC}_s{SP}_k{KEEP}_g{G}"
    kernel.__qualname__ = kernel.__name__
    return jit(kernel)


# ------------------------------------------------------------------------------------------------
# Fold of a row's pieces: one arithmetic for the merge kernel and the fused schedule's epilogue
# ------------------------------------------------------------------------------------------------

@device_jit(forceinline=True)
def _fold_weight(m, mx):
    """``e^(m_p - M)`` of a piece (0 for a piece whose max is -inf)."""
    w = float32(0)
    if m != NEG_INF:
        w = math.exp(m - mx)
    return w


@device_jit(forceinline=True)
def _fold_add(acc, x, w):
    return acc + x * w


@device_jit(forceinline=True)
def _fold_step(state, a, x, b):
    """One step of a span's sequential fold: ``state * a + x * b`` as one rounding of the product
    ``x * b`` and one fused multiply-add (written out, so that no compiler contracts it otherwise)."""
    return cuda.fma(state, a, x * b)


@device_jit(forceinline=True)
def _fold_finish(acc, lsum):
    """``acc / L``; rows here have tokens, so a zero ``L`` (every score -inf) is NaN."""
    o = NAN
    if lsum > float32(0) or lsum != lsum:
        o = acc / lsum
    return o


@device_jit(forceinline=True)
def _fold_lse(mx, lsum):
    lv = NAN
    if lsum > float32(0) or lsum != lsum:
        lv = mx + math.log(lsum)
    return lv


# ------------------------------------------------------------------------------------------------
# Attention
# ------------------------------------------------------------------------------------------------

@device_jit(forceinline=True)
def _col_max(x, lane, scr):
    """Max over the 8 lanes sharing ``lane % 4`` (a column of an m16n8 accumulator)."""
    x = max(x, shfl_xor_f32(x, 4, scr, lane))
    x = max(x, shfl_xor_f32(x, 8, scr, lane))
    return max(x, shfl_xor_f32(x, 16, scr, lane))


@device_jit(forceinline=True)
def _col_sum(x, lane, scr):
    x += shfl_xor_f32(x, 4, scr, lane)
    x += shfl_xor_f32(x, 8, scr, lane)
    return x + shfl_xor_f32(x, 16, scr, lane)


@device_jit(forceinline=True)
def _page_len(k, k1, nv, tl):
    """Valid tokens of own page ``k`` (0 past the piece end; the tail page has ``tl`` if > 0)."""
    if k >= k1:
        return int32(0)
    if k == int32(nv - int32(1)) and tl > int32(0):
        return tl
    return int32(4)


@device_jit(forceinline=True)
def _whole(k0, k1, nv, tl):
    """Whether the chunk of own pages ``k0 .. k0+7`` has 8 whole pages (every chunk but a row's
    last): then no token is masked (the same in every lane: no divergence)."""
    kl = int32(k1 - int32(1))
    k7 = int32(k0 + int32(CHUNK - 1))
    return k7 < kl or (k7 == kl and (k1 < nv or tl == int32(0)))


@device_jit(forceinline=True)
def _ring_row(x, solo_phase, sown, oaddr, ubase, rp_count):
    """Ring page holding the piece's own page ``x``: its stream index (union index, or ``x`` itself
    when solo) past the ``ubase`` pages streamed by earlier phases, modulo the ring. ``sown`` is
    the block's flat table of own pages' union indices, this row's from shared address ``oaddr``."""
    u = x
    if not solo_phase:
        u = ld_shared_i32(sown, uint32(oaddr + uint32(4) * uint32(x)))
    return uint32(uint32(ubase) + uint32(u)) % uint32(rp_count)   # 32-bit: numba widens sums


@device_jit(forceinline=True)
def ring_offset(row, chunk, pitch):
    """Byte offset of 16-byte ``chunk`` of ring token row ``row`` (rows ``pitch`` bytes apart, a
    multiple of 128; unsigned): the chunk's low three bits XORed with the row's, so the 8
    consecutive rows an ``ldmatrix`` reads at one chunk meet 8 different bank groups, as the
    padded rows did before session 22 (a page's 4 rows, and the next page's 4 when its ring page
    has the other parity)."""
    return uint32(pitch * row + uint32(16) * (chunk ^ (row & uint32(7))))


@device_jit(forceinline=True)
def at_step(a, j):
    """Address of a lane's 16-byte chunk ``c + 2 j`` of a ring row whose chunk ``c`` is at ``a``
    (:func:`ring_offset`, the ring 128-byte aligned), where ``c % 8 + 2 (j % 4)`` does not carry
    past 8: ``a`` with bits 5-6 XORed by ``j % 4``, ``j // 4`` lines on. ``j`` is a compile-time
    step: one XOR a step, held in a register across a chunk's steps, and the line an immediate
    offset of the ``ldmatrix``."""
    return uint32((a ^ uint32(32 * (j % 4))) + uint32(128 * (j // 4)))


@device_jit(forceinline=True)
def _mask2(o2, ln):
    """Word mask keeping tokens ``o2`` (low half) and ``o2 + 1`` (high half) of a page of ``ln``."""
    m = uint32(0)
    if o2 < ln:
        m |= uint32(0x0000FFFF)
    if o2 + int32(1) < ln:
        m |= uint32(0xFFFF0000)
    return m


@functools.lru_cache(maxsize=None)
def _out_conv(out_kind):
    """float32 -> the output element: float32, float16, or bfloat16 bits (a uint16 output array)."""
    if out_kind == "f32":
        def conv(x):
            return float32(x)
    elif out_kind == "f16":
        def conv(x):
            return float16(x)
    else:
        def conv(x):
            return pack_bf16x2(x, float32(0)) & uint32(0xFFFF)
    return device_jit(conv, forceinline=True)


@functools.lru_cache(maxsize=None)
def make_grouped_kernel(d, hg, stages, stage_pages, rows_per_window, piece, dtype, out_kind,
                        producers=PRODUCERS, sm90=False, slot_strides=None, direct=False, span=None,
                        parts=True, empty_rows=True, dsplit=None, pdl=False, self_plan=False):
    """Grid ``(windows, spans, Hkv)`` (direct: ``(rows, pieces, Hkv)``), block ``32 * (rows_per_window
    * HT * DS + producers)`` threads (``DS`` warps a head tile in direct blocks: 4 at one head
    tile, 2 at two, ``dsplit`` if given; else 1),
    dynamic shared memory ``GroupedConfig.smem_bytes``. ``piece`` and ``span``: the arithmetic's
    (module docstring); ``parts``: rows can have several spans (direct: pieces), so every row leaves
    its partials for the fold. ``dtype`` "f16"/"bf16" (q, K, V);
    ``out_kind`` "f32", "f16" or "bf16" (the last written as uint16 bits). ``sm90``: waits sleep
    (``mbarrier.try_wait``) instead of polling. ``slot_strides``: the K and V caches' word strides
    between a page's token rows (compile-time, so a producer lane's copies of a page sit at immediate
    offsets from one address; default: contiguous ``[pages, page_size, 1, d]``). ``direct``
    (one-row windows over the page-4 plan kernel's own plan): no window plan ran; the block streams
    its row's pages of one piece in order, as a solo phase does (``wunion``, ``wmeta`` and ``ownu``
    are not read), each head tile on ``DS`` warps: each its share of O^T's m-tiles (every
    ``DS``-th from the warp's own: the dims of O are independent sums) and of S^T's accumulation
    chains, which the warps exchange through shared memory every chunk (``qk_split``); every warp
    then runs the same softmax step on the same scores: the bits of one warp.
    ``pdl`` (direct blocks, sm_90): every thread lets the merge kernel launch
    (``griddepcontrol.launch_dependents``), 1: once the block's barriers are set up, so that the
    merge's launch overlaps this whole grid, 2: after the block's last store (TensorRT-LLM's
    place); the merge waits for this grid's completion before its first read of it.
    ``self_plan`` (direct blocks): no page-4 plan; a block checks and maps its own piece from the
    selection (``tokens``, ``counts``, ``block_table``, ``req_ids``, ``seq_lens``, ``geometry``)
    with the plan kernel's checks (:func:`numqsa.kernels.page4.make_plan_checks`: the same pages,
    so the same arithmetic), one thread a page; block ``(row, y, 0)`` writes its verdict
    ``verdict[row, y]`` (the row's page count, 0 where the plan would leave the row: the generic
    kernel's rows are those with a 0) and block ``(row, 0, 0)`` the row's page count to
    ``num_vpages`` for the merge (``pages`` gives only the plan's width, ``tail_len`` is not read).
    A piece the plan would reject leaves zeros and ``l = -1`` in its partials (the merge then
    leaves the row); one-piece rows write nothing.
    ``empty_rows``: rows without pages (``num_vpages = 0``) get ``out = 0``, ``lse = -inf``; else
    they are left to another kernel (the generic one, beside this one in the graph) and only rows
    the window plan found malformed are written so.

    Warps ``0 .. G*HT-1`` are the rows' (consumers); the last ``producers`` warps only copy. Stage
    ``s`` of the block's stream (every phase's stages in one sequence) goes to ring buffer
    ``s % NB``; ``full[s % NB]`` completes when its copies have landed (each producer lane arrives
    through ``cp.async.mbarrier.arrive``), ``empty[s % NB]`` when every consumer lane has released it.
    The producer refills a buffer only after its ``empty`` phase; a consumer releases stages in order,
    each after waiting on its ``full`` phase, so no warp waits for another's chunks."""
    D, HG, NB, SP, G, PA = (int(v) for v in (d, hg, stages, stage_pages, rows_per_window, piece))
    DIRECT = bool(direct)
    PDL = int(pdl) if DIRECT else 0
    SELF = bool(self_plan)
    if SELF and (not DIRECT or empty_rows):
        raise ValueError("direct blocks plan their own pieces only, beside the generic kernel's rows")
    # pages a block streams per phase: a span (union windows), one piece (direct blocks)
    PC = PA if DIRECT or span is None else int(span)
    if PC % PA:
        raise ValueError(f"span {PC} is not a multiple of the piece {PA}")
    # rows can have several spans (direct blocks: pieces): each leaves its partial for the fold,
    # which also finishes one-span rows (one arithmetic, no out path)
    PARTS = bool(parts)
    EMPTY = bool(empty_rows)
    NPW = int(producers)
    if DIRECT and G != 1:
        raise ValueError("the direct grouped kernel runs one-row windows")
    if D % 16:
        raise ValueError(f"the grouped kernel needs d % 16 == 0, got {D}")
    HT = -(-HG // HEAD_TILE)
    HH = -(-HG // HT)
    NKS = D // 16                      # k-steps of S^T, m-tiles of O^T
    # direct: a row's (head tile) work on DS warps, each its 1/DS of O^T's m-tiles (the dims of O
    # are independent sums) and a share of S^T's four accumulation chains (two halves of 16
    # tokens, even and odd k-steps: DS 2 a parity, DS 4 one chain), exchanged through shared
    # memory; each warp then forms the same S^T and softmax step from the same four chains: the
    # bits of one warp
    DS = 1
    if DIRECT:
        DS = 4 if NKS % 4 == 0 and HT == 1 else (2 if NKS % 2 == 0 else 1)
        if dsplit is not None:
            DS = int(dsplit)
    if DS not in (1, 2, 4) or NKS % DS or (DS > 1 and not DIRECT):
        raise ValueError(f"D split {DS} needs direct blocks and {DS} dividing D / 16 = {NKS}")
    QST = 2 if DS > 1 else 1           # k-step stride of a warp's chains (a parity each)
    NCW = G * HT * DS                  # consumer warps: (row, D part, head tile)
    NW = NCW + NPW
    NT = 32 * NW
    NQF = 2 * NKS // QST               # Q^T fragment words per lane (its parity's k-steps)
    NMT = NKS // DS                    # O^T m-tiles of one warp
    NOA = 4 * NMT                      # O^T accumulators per lane
    FQ = 4 if NMT % 4 == 0 else 1      # fold_out: parts of O^T's m-tiles folded in turn
    RW = row_words(D)                  # words per token row in the ring
    PB = 4 * RW                        # its bytes: a multiple of 128 (ring_offset's swizzle)
    PW = 4 * RW                        # words per page
    RP = NB * SP                       # ring pages
    OWNMAX = 2 * PC                    # own pages of one span, at most (the last takes the rest)
    VOFF = RP * PW                     # V region offset (words)
    NCH16 = D // 8                     # 16-byte chunks per token row
    if not (32 % NCH16 == 0 or NCH16 % 32 == 0):
        raise ValueError(f"the grouped kernel's copy lanes need d / 8 to divide or be a multiple of 32, "
                         f"got d = {D}")
    HALF = 4 * NCH16                   # 16-byte copies of a page's K (and of its V): 4 token rows
    IPH = -(-HALF // 32)               # of them per producer lane
    WIDE = NCH16 > 32                  # a lane's copies: chunks c0 + 32 m of rows; else rows r0 + RPI i
    CPR = NCH16 // 32 if WIDE else 1   # copies of one token row per lane (wide rows)
    RPI = 1 if WIDE else 32 // NCH16   # token rows one copy instruction covers (narrow rows)
    KP = -(-SP // NPW)                 # pages of a stage one producer warp copies (every NPW-th)
    # a warp's ring pages of a stage all have its parity (SP, NPW even): one swizzle a warp
    FLIP1 = SP % 2 == 0 and NPW % 2 == 0
    KS1, VS1 = (int(x) for x in (slot_strides or (D // 2, D // 2)))
    UCAP = G * OWNMAX                  # union entries of one span, at most (launch_grouped's cap)
    # the piece's page ids staged in shared memory (the copy loop reads them per page: a global
    # load there stalls on long scoreboard), when they fit beside the ring
    XSH = (HT, 2, 4, 4, 32) if DS > 1 else (1, 1, 1, 1, 1)   # S^T exchange: (tile, buffer, chain,
    #                                                          word, lane), float32
    NPF = -(-2 * UCAP // NT) if DIRECT else 1   # page-table words a thread prefetches (direct)
    STAGE_U = (8 * RP * PW + RING_ALIGN + 4 * G * OWNMAX + 8 * UCAP + 4 * NW * SCRATCH_WORDS
               + 16 * NB + 4 * math.prod(XSH) <= SMEM_BLOCK_MAX)
    SUW = 2 * UCAP if STAGE_U else 2   # words of the staged entries
    if SELF and not (STAGE_U and NT >= OWNMAX):
        raise ValueError("self-planned direct blocks stage their piece's pages, one thread a page")
    row_pages, ids_ok, column, entry = make_plan_checks(4)
    U0, U1, U2, U3, U4 = (uint32(v) for v in (0, 1, 2, 3, 4))
    UNT = uint32(NT)
    UNB = uint32(NB)
    NBAR = 2 * NB + (HT if DS > 1 else 0)   # full, empty; the head tiles' S^T exchanges
    F0, F1 = float32(0), float32(1)
    mma = mma_m16n8k16_bf16 if dtype == "bf16" else mma_m16n8k16_f16
    pack = pack_bf16x2 if dtype == "bf16" else pack_f16x2
    conv = _out_conv(out_kind)
    test = mbar_try_wait if sm90 else mbar_test_wait

    @device_jit(forceinline=True)
    def wait_phase(bar, b, par):
        """Until the phase of parity ``par`` of mbarrier ``b`` has completed."""
        while test(bar, b, par) == int32(0):
            pass

    @device_jit(forceinline=True)
    def wait_full(bar, gs):
        """Until stage ``gs`` of the stream has landed (phase ``gs // NB`` of ``full[gs % NB]``)."""
        wait_phase(bar, uint32(gs) % UNB, (uint32(gs) // UNB) & U1)

    @device_jit(forceinline=True)
    def page_id(u, solo_row, kstart_s, su, subase, wunion, win, span_, pages):
        """(physical page, first slot) of stream entry ``u``: the union's, or the solo (or direct)
        row's own; staged ones (``su``, words ``2 u``, ``2 u + 1``) read at 32-bit shared
        addresses from ``subase``."""
        if (solo_row < int32(0) or DIRECT) and STAGE_U:
            a = uint32(subase + uint32(8) * uint32(u))
            return ld_shared_i32(su, a), ld_shared_i32(su, uint32(a + U4))
        if solo_row < int32(0):
            return wunion[win, span_, u, 0], wunion[win, span_, u, 1]
        return pages[solo_row, kstart_s + u, 0], pages[solo_row, kstart_s + u, 1]

    @device_jit(forceinline=True)
    def produce(dyn, sb, bar, gs, u0, nq, solo_row, kstart_s, su, subase, wunion, win, span_, pages,
                kw, vw, ks0, vs0, lk, lv, offs, copies, pw):
        """cp.async of the stream's pages ``u0 .. u0+nq-1`` (stage ``gs``) into ring buffer
        ``gs % NB``, producer warp ``pw``'s pages of it (``pw``, ``pw + NPW``, ...: ``KP`` at
        most), once every consumer lane has released the buffer's previous stage; then one
        arrival of each lane on ``full`` when its copies land. A page's K and its V are ``HALF``
        copies of 16 bytes each (4 token rows, chunks fastest: coalesced rows). The warp's pages
        are read first, then copied (session 23: a page at a time, 58 SASS instructions a page,
        each page's copies waited on its id's load and a 64-bit address chain). A lane's copies
        sit at its own offsets (``lk``, ``lv`` words in the caches, the head's included) plus
        compile-time ones, the same on every page, and at the same swizzled offsets ``offs`` of
        each ring page (:func:`ring_offset` of its rows ``r0 + dr`` and chunks ``c0 + dc``, the
        warp's parity applied where ``FLIP1``; else a page's parity flips bit 2 of every chunk).
        Cache offsets are 64-bit (pools past 8 GiB of words overflow int32): a page's is one
        32 x 32 -> 64-bit product and an add (pages and slots are not negative).
        ``copies``: whether the lane copies (lanes past ``HALF`` idle)."""
        slot = uint32(gs) % UNB
        if gs >= int32(NB):       # the buffer's previous stage released (``empty``)
            wait_phase(bar, NB + slot, ((uint32(gs) // UNB) - U1) & U1)
        pgs = cuda.local.array(KP, uint32)
        sls = cuda.local.array(KP, uint32)
        for k in range(KP):       # (clamped to the stage's last page: no read past the staged)
            pg, sl = page_id(int32(u0 + min(int32(pw + NPW * k), int32(nq - int32(1)))), solo_row,
                             kstart_s, su, subase, wunion, win, span_, pages)
            pgs[k] = uint32(pg)
            sls[k] = uint32(sl)
        for k in range(KP):
            q = int32(pw + NPW * k)
            if copies and q < nq:
                rpg = uint32(uint32(SP) * slot + uint32(q))     # the ring page
                page = uint32(sb + uint32(4 * PB) * rpg)
                flip = U0 if FLIP1 else uint32(64) * (rpg & U1)
                bk = uint64(lk + uint64(uint32(sls[k] * uint32(KS1)))) + \
                    uint64(pgs[k]) * uint64(uint32(ks0))
                bv = uint64(lv + uint64(uint32(sls[k] * uint32(VS1)))) + \
                    uint64(pgs[k]) * uint64(uint32(vs0))
                for i in range(IPH):
                    # token row dr and chunk dc of the lane's i-th copy, past its own: constants
                    dr = i // CPR if WIDE else i * RPI
                    dc = 32 * (i % CPR) if WIDE else 0
                    off = uint32(page + (offs[i] ^ flip))
                    cp_async_16(dyn, off, kw, uint64(bk + uint64(dr * KS1 + 4 * dc)), 16)
                    cp_async_16(dyn, uint32(off + uint32(4 * VOFF)), vw,
                                uint64(bv + uint64(dr * VS1 + 4 * dc)), 16)
        cp_async_mbar_arrive(bar, slot)

    @device_jit(forceinline=True)
    def release(bar, gs, waited):
        """Release stage ``gs`` (each lane arrives on ``empty`` after its reads), after waiting on its
        ``full`` phase unless a later stage was waited on (``waited``); returns the new ``waited``."""
        if gs > waited:
            wait_full(bar, gs)
            waited = gs
        mbar_arrive(bar, uint32(NB) + uint32(gs) % UNB)
        return waited

    def make_pv(masked):
        """O^T += V^T P^T over the chunk's 32 tokens: two k-steps of 16 (the halves' V rows, the
        lane's chunk of the warp's first m-tile at ``vh0`` / ``vh1``, P^T in ``bq0, bq1`` /
        ``bq2, bq3``), in that order; the warp's m-tiles are every ``DS``-th (``at_step``); V rows
        ANDed with the token masks when ``masked`` (a compile-time choice: full chunks skip it)."""
        @device_jit(forceinline=True)
        def pv(dyn, vh0, vh1, bq0, bq1, bq2, bq3, oacc, scr, lane, mka, mkb, mkc, mkd):
            for mt in range(NMT):
                a = ldmatrix_x4_trans(dyn, at_step(vh0, DS * mt), scr, lane)
                e = ldmatrix_x4_trans(dyn, at_step(vh1, DS * mt), scr, lane)
                cc = (oacc[4 * mt], oacc[4 * mt + 1], oacc[4 * mt + 2], oacc[4 * mt + 3])
                if masked:
                    cc = mma((a[0] & mka, a[1] & mka, a[2] & mkb, a[3] & mkb), (bq0, bq1), cc, scr,
                             lane)
                    cc = mma((e[0] & mkc, e[1] & mkc, e[2] & mkd, e[3] & mkd), (bq2, bq3), cc, scr,
                             lane)
                else:
                    cc = mma(a, (bq0, bq1), cc, scr, lane)
                    cc = mma(e, (bq2, bq3), cc, scr, lane)
                oacc[4 * mt] = cc[0]
                oacc[4 * mt + 1] = cc[1]
                oacc[4 * mt + 2] = cc[2]
                oacc[4 * mt + 3] = cc[3]
        return pv

    pv_full, pv_masked = make_pv(False), make_pv(True)

    Z4 = (F0, F0, F0, F0)

    @device_jit(forceinline=True)
    def qk_warp(dyn, kh0, kh1, qf, scr, lane, dh, xch, bar, xbi, nc):
        """S^T's four accumulation chains on one warp: the first half's (tokens 0-15 of the chunk,
        K rows from ``kh0``) over the even and the odd k-steps, the second half's (``kh1``)."""
        xa = Z4
        xb = Z4
        ya = Z4
        yb = Z4
        for ks in range(NKS):
            a = ldmatrix_x4(dyn, at_step(kh0, ks), scr, lane)
            e = ldmatrix_x4(dyn, at_step(kh1, ks), scr, lane)
            b = (qf[2 * ks], qf[2 * ks + 1])
            if ks % 2 == 0:
                xa = mma(a, b, xa, scr, lane)
                ya = mma(e, b, ya, scr, lane)
            else:
                xb = mma(a, b, xb, scr, lane)
                yb = mma(e, b, yb, scr, lane)
        return xa, xb, ya, yb

    @device_jit(forceinline=True)
    def chain(dyn, kb, qf, scr, lane):
        """One accumulation chain: a half's K rows from ``kb`` (the lane's chunk of its parity's
        first k-step) against the warp's Q^T fragments, every second k-step in order."""
        c = Z4
        for i in range(NKS // 2):
            c = mma(ldmatrix_x4(dyn, at_step(kb, 2 * i), scr, lane),
                    (qf[2 * i], qf[2 * i + 1]), c, scr, lane)
        return c

    @device_jit(forceinline=True)
    def put(xch, buf, ch, lane, c):
        for r in range(4):
            xch[buf, ch, r, lane] = c[r]

    @device_jit(forceinline=True)
    def take(xch, buf, ch, lane):
        return (xch[buf, ch, 0, lane], xch[buf, ch, 1, lane], xch[buf, ch, 2, lane],
                xch[buf, ch, 3, lane])

    @device_jit(forceinline=True)
    def qk_split(dyn, kh0, kh1, qf, scr, lane, dh, xch, bar, xbi, nc):
        """The same four chains over the head tile's ``DS`` warps: warp ``dh`` runs the k-steps of
        parity ``dh & 1``, of both halves (DS 2) or of half ``dh >> 1`` (DS 4), and leaves its
        chains in buffer ``nc & 1`` of ``xch`` (chain ``2 * half + parity``); after every warp's
        arrival on ``bar[xbi]`` (phase ``nc``) each reads all four. Two buffers: a warp writes
        buffer ``b`` again two chunks later, past the next phase, which every warp completes only
        after its reads of this one."""
        pr = dh & U1
        buf = uint32(nc) & U1
        off = uint32(32) * pr              # k-step pr: at_step(kb, pr), pr a runtime parity
        if DS == 4:
            hx = dh >> U1
            kb = kh0
            if hx != U0:
                kb = kh1
            put(xch, buf, U2 * hx + pr, lane, chain(dyn, uint32(kb ^ off), qf, scr, lane))
        else:
            put(xch, buf, pr, lane, chain(dyn, uint32(kh0 ^ off), qf, scr, lane))
            put(xch, buf, U2 + pr, lane, chain(dyn, uint32(kh1 ^ off), qf, scr, lane))
        mbar_arrive(bar, xbi)
        wait_phase(bar, xbi, buf)
        return take(xch, buf, 0, lane), take(xch, buf, 1, lane), take(xch, buf, 2, lane), \
            take(xch, buf, 3, lane)

    qk = qk_warp if DS == 1 else qk_split

    @device_jit(forceinline=True)
    def row_addr(kk, kl, kstart, tr, c, solo_phase, sown, oaddr, ubase):
        """Byte offset in the K region of 16-byte chunk ``c`` of token row ``tr & 3`` of own page
        ``min(kk, kl)``: :func:`ring_offset`."""
        rp = _ring_row(int32(min(kk, kl) - kstart), solo_phase, sown, oaddr, ubase, RP)
        return ring_offset(uint32(rp * U4 + (tr & U3)), c, uint32(PB))

    @device_jit(forceinline=True)
    def chunk(dyn, sb, scr, lane, qf, oacc, ml, k0, kstart, k1, nv, tl, solo_phase, sown, oaddr, ubase,
              scale, dcol, dh, xch, bar, xbi, nc):
        """One chunk (own pages k0 .. k0+7: two halves of 16 tokens): online-softmax update of
        ``oacc`` and ``ml``. The halves' products are independent chains; one max, one rescale.
        ``dcol``: the 16-byte chunk of a V row where the warp's first O^T m-tile starts (its D
        part: m-tile ``dh``); ``dh``, ``xch``, ``xbi``, ``nc``: the warp's D part, its head
        tile's exchange of S^T's chains and their mbarrier ``bar[xbi]``, the block's chunk count
        so far (``qk``)."""
        g = lane >> U2
        t = lane & U3
        # K fragment rows: token tk = (lane & 7) + 8 * ((lane >> 3) & 1); V: (lane & 7) + 8 * (lane >> 4)
        tk = uint32((lane & uint32(7)) + uint32(8) * ((lane >> U3) & U1))
        tv = uint32((lane & uint32(7)) + uint32(8) * (lane >> U4))
        # (int32(...) around each sum: numba types int32 + int32 as int64, and 64-bit index
        # arithmetic was a fifth of the chunk's instructions in session 8's SASS profile)
        kl = int32(k1 - int32(1))
        pk = int32(k0 + int32(tk >> U2))
        pv_ = int32(k0 + int32(tv >> U2))
        hik = lane >> U4
        hiv = (lane >> U3) & U1
        # the lane's swizzled chunk formed once: each step's address is then one XOR and a line
        # (``at_step``; session 11's SASS: 48 register adds a chunk when the offsets were held in
        # registers across chunks)
        kh0 = uint32(sb + row_addr(pk, kl, kstart, tk, hik, solo_phase, sown, oaddr, ubase))
        kh1 = uint32(sb + row_addr(int32(pk + int32(4)), kl, kstart, tk, hik, solo_phase, sown,
                                   oaddr, ubase))
        vreg = uint32(sb + uint32(4 * VOFF))
        cv = uint32(dcol + hiv)
        vh0 = uint32(vreg + row_addr(pv_, kl, kstart, tv, cv, solo_phase, sown, oaddr, ubase))
        vh1 = uint32(vreg + row_addr(int32(pv_ + int32(4)), kl, kstart, tv, cv, solo_phase, sown,
                                     oaddr, ubase))
        xa, xb, ya, yb = qk(dyn, kh0, kh1, qf, scr, lane, dh, xch, bar, xbi, nc)
        s0 = (xa[0] + xb[0]) * scale
        s1 = (xa[1] + xb[1]) * scale
        s2 = (xa[2] + xb[2]) * scale
        s3 = (xa[3] + xb[3]) * scale
        s4 = (ya[0] + yb[0]) * scale
        s5 = (ya[1] + yb[1]) * scale
        s6 = (ya[2] + yb[2]) * scale
        s7 = (ya[3] + yb[3]) * scale
        # tokens past a page's length are -inf, in a chunk that has such a page (a row's last)
        full = _whole(k0, k1, nv, tl)
        if not full:
            gp = int32(g >> U2)
            tg = int32(g & U3)
            if tg >= _page_len(int32(k0 + gp), k1, nv, tl):
                s0 = NEG_INF
                s1 = NEG_INF
            if tg >= _page_len(int32(k0 + int32(2) + gp), k1, nv, tl):
                s2 = NEG_INF
                s3 = NEG_INF
            if tg >= _page_len(int32(k0 + int32(4) + gp), k1, nv, tl):
                s4 = NEG_INF
                s5 = NEG_INF
            if tg >= _page_len(int32(k0 + int32(6) + gp), k1, nv, tl):
                s6 = NEG_INF
                s7 = NEG_INF
        m0 = ml[0]
        m1 = ml[1]
        mn0 = max(m0, _col_max(max(max(s0, s2), max(s4, s6)), lane, scr))
        mn1 = max(m1, _col_max(max(max(s1, s3), max(s5, s7)), lane, scr))
        # selects, not branches: fexp(-inf) is 0, and only an all -inf max needs a guard (NaN);
        # the scores subtract a max of -inf as 0 (-inf - 0 is -inf: the same 0), so no score
        # needs a guard of its own
        al0 = fexp(m0 - mn0) if mn0 != NEG_INF else F1
        al1 = fexp(m1 - mn1) if mn1 != NEG_INF else F1
        mx0 = mn0 if mn0 != NEG_INF else F0
        mx1 = mn1 if mn1 != NEG_INF else F0
        p0 = fexp(s0 - mx0)
        p1 = fexp(s1 - mx1)
        p2 = fexp(s2 - mx0)
        p3 = fexp(s3 - mx1)
        p4 = fexp(s4 - mx0)
        p5 = fexp(s5 - mx1)
        p6 = fexp(s6 - mx0)
        p7 = fexp(s7 - mx1)
        ml[0] = mn0
        ml[1] = mn1
        ml[2] = ml[2] * al0 + ((p0 + p2) + (p4 + p6))
        ml[3] = ml[3] * al1 + ((p1 + p3) + (p5 + p7))
        bq0 = movmatrix_trans(pack(p0, p1), scr, lane)
        bq1 = movmatrix_trans(pack(p2, p3), scr, lane)
        bq2 = movmatrix_trans(pack(p4, p5), scr, lane)
        bq3 = movmatrix_trans(pack(p6, p7), scr, lane)
        # O^T rescale only when a running max moved in some lane (x * 1 is x: same bits either way)
        if warp_any(al0 != F1 or al1 != F1, scr, lane):
            for x in range(NMT):
                oacc[4 * x] *= al0
                oacc[4 * x + 1] *= al1
                oacc[4 * x + 2] *= al0
                oacc[4 * x + 3] *= al1
        # V rows past a partial page's tokens must not reach O (0 * NaN): masked, but only in the
        # chunk that has such a page (a row's last)
        if full:
            pv_full(dyn, vh0, vh1, bq0, bq1, bq2, bq3, oacc, scr, lane, U0, U0, U0, U0)
        else:
            o2 = int32(2) * int32(t & U1)
            tp = int32(t >> U1)
            mka = _mask2(o2, _page_len(int32(k0 + tp), k1, nv, tl))
            mkb = _mask2(o2, _page_len(int32(k0 + int32(2) + tp), k1, nv, tl))
            mkc = _mask2(o2, _page_len(int32(k0 + int32(4) + tp), k1, nv, tl))
            mkd = _mask2(o2, _page_len(int32(k0 + int32(6) + tp), k1, nv, tl))
            pv_masked(dyn, vh0, vh1, bq0, bq1, bq2, bq3, oacc, scr, lane, mka, mkb, mkc, mkd)

    @device_jit(forceinline=True)
    def load_q(qf, qw, qs0, qs1, row, h0, g, t, ok, pr):
        """The lane's Q^T fragments: head ``h0 + g``, dims ``8 ks + 4 jj + t`` (words) of its
        k-steps ``ks`` (every one; in a D split those of parity ``pr``), zeros where not ``ok``
        (lanes past the heads, rows without work)."""
        # one unsigned base index (numba wraps no negative index then), immediate offsets
        base = uint64(int64(row) * qs0 + int64(h0 + g) * qs1 + int64(uint32(8) * pr + t))
        for i in range(NKS // QST):
            for jj in range(2):
                wq = U0
                if ok:
                    wq = uint32(qw[base + uint64(8 * QST * i + 4 * jj)])
                qf[2 * i + jj] = wq

    @device_jit(forceinline=True)
    def prefetch_pages(pre, pages, row, k0, tid):
        """Words ``tid + NT i`` of the page table's entries ``k0 ..`` of ``row`` (within the
        table), for the direct block's staging of its piece (``su``)."""
        for i in range(NPF):
            x = tid + uint32(i * NT)
            e = int32(k0 + int32(x >> U1))
            w = int32(-1)
            if x < uint32(2 * UCAP) and e < int32(pages.shape[1]):
                w = int32(pages[row, e, x & U1])
            pre[i] = w

    @device_jit(forceinline=True)
    def piece_ids(ids, tokens, counts, req_ids, row, piece, tid):
        """The first round trip of the block's own plan (``self_plan``), issued before anything
        else: thread ``tid``'s ids of the piece's page ``tid`` and the one before it (``ids[0]``,
        its last id; clamped into the row, -1 past ``OWNMAX`` threads), the row's request and its
        count of ids. Returns ``(req, n)``."""
        width = int32(tokens.shape[1])
        ur = uint32(row)
        for x in range(5):
            ids[x] = int32(-1)
        if tid < uint32(OWNMAX) and width > int32(0):
            # 32-bit clamps (an int32 sum is 64-bit in numba: 70 instructions before these loads)
            v4 = int32(U4 * (uint32(piece * int32(PA)) + tid))
            hi = int32(width - int32(1))
            for x in range(5):
                ids[x] = int32(tokens[ur, uint32(min(max(int32(v4 + int32(x - 1)), int32(0)), hi))])
        return int32(req_ids[ur]), int32(counts[ur])

    @device_jit(forceinline=True)
    def plan_piece(su, ids, req, n, width, table, seq_lens, geometry, slots, piece, tid):
        """The rest of the block's own plan (``self_plan``; :func:`piece_ids` loaded ``ids``,
        ``req`` and ``n``): thread ``tid`` checks the piece's page ``tid`` and stages its
        ``(physical page, first slot)`` in ``su``; the request's length and the page's table entry
        are the second round trip, as in the plan kernel. Returns the row's
        ``(num_vpages, tail_len)`` (``(0, 0)`` for a row the plan cannot express as a whole) and
        whether the piece passed (a block barrier)."""
        v = uint32(piece * int32(PA)) + tid
        ps = int32(geometry[1])
        cols = int32(table.shape[1])
        slen = int32(0)
        pg = int32(-1)
        c = column(ids[1], ps)
        if req >= int32(0) and req < int32(seq_lens.shape[0]) and req < int32(table.shape[0]):
            slen = int32(seq_lens[uint32(req)])
            if tid < uint32(OWNMAX) and ids[1] >= int32(0) and c < uint32(cols):
                pg = int32(table[uint32(req), c])
        nv, tail = row_pages(n, width, slen, slots)
        k0, k1 = _piece_range(int32(nv), piece, PA)
        ok = True
        if v < uint32(k1):
            len_v = U4
            if v == nv - U1 and tail > U0:
                len_v = tail
            pg, sl = entry(pg, ids[1], c, ps, cols, int32(geometry[0]))
            ok = ids_ok(ids, len_v, v, slen) and pg >= int32(0)
            su[U2 * tid] = pg
            su[U2 * tid + U1] = sl
        return int32(nv), int32(tail), cuda.syncthreads_or(int32(0 if ok else 1)) == 0

    @device_jit(forceinline=True)
    def blank_piece(lane, row, h0, nh, part_o, part_ml, slot, d0, l):
        """A slot without a piece's partial (``self_plan``): zeros in ``O`` and ``(m, l) =
        (-inf, l)``: ``l = -1`` for a piece the plan would reject, which tells the merge to leave
        the row; ``l = 0`` for a slot past the row's pieces (or of a row without pages), which the
        merge loads beside the others but never folds."""
        g = lane >> U2
        hA = U2 * (lane & U3)
        for i in range(2):
            if hA + uint32(i) < nh:
                part_ml[row, h0 + hA + uint32(i), slot, 0] = NEG_INF
                part_ml[row, h0 + hA + uint32(i), slot, 1] = l
        for mt in range(NMT):
            for i in range(4):
                hh = hA + (uint32(i) & U1)
                if hh < nh:
                    part_o[row, h0 + hh, slot, o_dim(d0, g, mt, i)] = F0

    @device_jit(forceinline=True)
    def init_ring(bar, tid):
        """The ring's mbarriers (then a block barrier before their first use)."""
        if tid < UNB:
            mbar_init(bar, tid, 32 * NPW)              # full: every producer lane's copies
            mbar_init(bar, tid + UNB, 32 * NCW)        # empty: every consumer lane
        if DS > 1 and tid < uint32(HT):
            mbar_init(bar, tid + U2 * UNB, 32 * DS)    # S^T's exchange: a head tile's lanes

    @device_jit(forceinline=True)
    def o_dim(d0, g, mt, i):
        """The dim of O^T accumulator ``4 * mt + i`` of a lane in row group ``g`` (its head is
        ``2 * (lane & 3) + (i & 1)``): the m16n8 accumulator layout, the warp's m-tile ``mt``
        (O^T's m-tile ``d0 / 16 + DS * mt``: a D part's m-tiles are every ``DS``-th)."""
        return d0 + uint32(16 * DS * mt) + g + uint32(8) * (uint32(i) >> U1)

    @device_jit(forceinline=True)
    def piece_end(lane, scr, oacc, ml, slot, mrd, mwr, fold, last, row, h0, nh, out, lse, part_o,
                  part_ml, d0, lsew):
        """A piece's end: its ``(O, m, l)`` (``l`` summed over the column's lanes), folded into the
        span's state when ``fold`` (a span's pieces after its first: ``M' = max(M, m)``,
        ``L' = L a + l b``, ``O' = O a + O_p b`` with ``a = e^(M - M')``, ``b = e^(m - M')``:
        :func:`_fold_step`), then stored: the state for the span's next piece, or, when ``last``,
        the span's partial for the fold over spans (:func:`fold_out`, the merge kernel), or
        without ``PARTS`` the row's ``out``/``lse``. O is kept in slot ``slot`` (each element is
        one lane's: it reads back its own writes); ``(m, l)``, which the 8 lanes of a column share,
        is read from ``part_ml`` slot ``mrd`` and written to ``mwr``, never the same within a fold
        (a lane's write must not reach a lane that has not read yet). ``lsew``: the warp writes
        ``lse`` (one of a row's D parts). A head whose weights sum to 0 although the row has tokens
        (every score -inf) is 0 / 0: NaN, as the math says. No branch in the store loops: one there
        keeps them from unrolling, and oacc goes to the stack."""
        g = lane >> U2
        t = lane & U3
        hA = U2 * t
        lt0 = _col_sum(ml[2], lane, scr)
        lt1 = _col_sum(ml[3], lane, scr)
        m0 = ml[0]
        m1 = ml[1]
        if fold:
            ha = h0 + min(hA, nh - U1)             # lanes past the heads read a real one, store none
            hb = h0 + min(hA + U1, nh - U1)
            sa = part_ml[row, ha, mrd, 0]
            sb_ = part_ml[row, hb, mrd, 0]
            na = max(sa, m0)
            nb = max(sb_, m1)
            aa = _fold_weight(sa, na)
            ba = _fold_weight(m0, na)
            ab = _fold_weight(sb_, nb)
            bb = _fold_weight(m1, nb)
            lt0 = _fold_step(part_ml[row, ha, mrd, 1], aa, lt0, ba)
            lt1 = _fold_step(part_ml[row, hb, mrd, 1], ab, lt1, bb)
            m0 = na
            m1 = nb
            for mt in range(NMT):
                for i in range(4):
                    dd = o_dim(d0, g, mt, i)
                    if (i & 1) == 0:
                        oacc[4 * mt + i] = _fold_step(part_o[row, ha, slot, dd], aa,
                                                      oacc[4 * mt + i], ba)
                    else:
                        oacc[4 * mt + i] = _fold_step(part_o[row, hb, slot, dd], ab,
                                                      oacc[4 * mt + i], bb)
        direct_out = last and not PARTS
        for i in range(2):
            hh = hA + uint32(i)
            li = lt0
            mi = m0
            if i == 1:
                li = lt1
                mi = m1
            if hh < nh:
                if direct_out:
                    lv = NAN
                    if li > F0 or li != li:
                        lv = mi + math.log(li)
                    if g == U0 and lsew:
                        lse[row, h0 + hh] = lv
                else:
                    # every lane of the column writes the (same) values
                    part_ml[row, h0 + hh, mwr, 0] = mi
                    part_ml[row, h0 + hh, mwr, 1] = li
        for mt in range(NMT):
            for i in range(4):
                dd = o_dim(d0, g, mt, i)
                hh = hA + (uint32(i) & U1)
                if hh < nh:
                    if direct_out:
                        den = lt0
                        if (i & 1) == 1:
                            den = lt1
                        out[row, h0 + hh, dd] = conv(oacc[4 * mt + i] / den)
                    else:
                        part_o[row, h0 + hh, slot, dd] = oacc[4 * mt + i]

    @device_jit(forceinline=True)
    def empty_out(lane, row, h0, nh, out, lse, part_ml, d0, lsew):
        """A row with no tokens: ``out = 0``, ``lse = -inf`` (its lanes' dims and heads); with
        ``PARTS`` its first partial's ``l`` is -1, which tells the merge kernel to leave the row
        (a row the window plan found malformed has pages in ``num_vpages``)."""
        g = lane >> U2
        hA = U2 * (lane & U3)
        for i in range(2):
            if g == U0 and lsew and hA + uint32(i) < nh:
                lse[row, h0 + hA + uint32(i)] = NEG_INF
                if PARTS:
                    part_ml[row, h0 + hA + uint32(i), 0, 1] = float32(-1)
        for mt in range(NMT):
            for i in range(4):
                dd = o_dim(d0, g, mt, i)
                hh = hA + (uint32(i) & U1)
                if hh < nh:
                    out[row, h0 + hh, dd] = conv(F0)

    @device_jit(forceinline=True)
    def fold_out(lane, oacc, npc, row, h0, nh, out, lse, part_o, part_ml, d0, lsew):
        """The fused schedule's fold of a row's spans, each element's arithmetic the merge
        kernel's (:func:`_fold_weight`, :func:`_fold_add`, :func:`_fold_finish`) in span order;
        a lane reads back the partials it wrote itself (dims ``d0 ..``, as :func:`piece_end`).
        O's m-tiles are folded a quarter at a time (fewer loads in flight: registers)."""
        g = lane >> U2
        t = lane & U3
        hA = U2 * t
        ha = h0 + min(hA, nh - U1)                 # lanes past the heads read a real one, store none
        hb = h0 + min(hA + U1, nh - U1)
        mxa = NEG_INF
        mxb = NEG_INF
        for p in range(npc):
            mxa = max(mxa, part_ml[row, ha, p, 0])
            mxb = max(mxb, part_ml[row, hb, p, 0])
        la = F0
        lb = F0
        for p in range(npc):
            la = _fold_add(la, part_ml[row, ha, p, 1], _fold_weight(part_ml[row, ha, p, 0], mxa))
            lb = _fold_add(lb, part_ml[row, hb, p, 1], _fold_weight(part_ml[row, hb, p, 0], mxb))
        for i in range(2):
            hh = hA + uint32(i)
            if g == U0 and hh < nh and lsew:
                if i == 0:
                    lse[row, h0 + hh] = _fold_lse(mxa, la)
                else:
                    lse[row, h0 + hh] = _fold_lse(mxb, lb)
        for x in range(NOA):
            oacc[x] = F0
        for part in range(FQ):
            for p in range(npc):
                wa = _fold_weight(part_ml[row, ha, p, 0], mxa)
                wb = _fold_weight(part_ml[row, hb, p, 0], mxb)
                for mh in range(NMT // FQ):
                    mt = mh + part * (NMT // FQ)
                    for i in range(4):
                        dd = o_dim(d0, g, mt, i)
                        if (i & 1) == 0:
                            oacc[4 * mt + i] = _fold_add(oacc[4 * mt + i], part_o[row, ha, p, dd],
                                                         wa)
                        else:
                            oacc[4 * mt + i] = _fold_add(oacc[4 * mt + i], part_o[row, hb, p, dd],
                                                         wb)
        for mt in range(NMT):
            for i in range(4):
                dd = o_dim(d0, g, mt, i)
                hh = hA + (uint32(i) & U1)
                if hh < nh:
                    if (i & 1) == 0:
                        out[row, h0 + hh, dd] = conv(_fold_finish(oacc[4 * mt + i], la))
                    else:
                        out[row, h0 + hh, dd] = conv(_fold_finish(oacc[4 * mt + i], lb))

    def kernel(qw, qs0, qs1, kw, vw, ks0, ks2, vs0, vs2, pages, num_vpages, tail_len,
               windows, wunion, wmeta, ownu, scale, out, lse, part_o, part_ml, fused, nspans,
               tokens, counts, table, req_ids, seq_lens, geometry, verdict):
        dyn = cuda.shared.array(0, uint32)
        # full[0..NB-1], empty[0..NB-1], exchanges; the calls take its shared address, formed once
        bar = mbar_ref(cuda.shared.array(NBAR, uint64))
        xall = cuda.shared.array(XSH, float32)
        scr_all = cuda.shared.array((NW, SCRATCH_WORDS), uint32)
        sown = cuda.shared.array(UCAP, int32)          # per row (OWNMAX each): own pages' union indices
        su = cuda.shared.array(SUW, int32)     # (page, slot) of entry x: words 2x, 2x+1
        subase = shared_base(su)
        tid = uint32(cuda.threadIdx.x)
        warp = tid >> uint32(5)
        lane = tid & uint32(31)
        g = lane >> U2
        t = lane & U3
        scr = scr_all[warp]
        win = uint32(cuda.blockIdx.x)
        j = uint32(cuda.blockIdx.z)
        producer = warp >= uint32(NCW)
        wslot = int32(warp // uint32(HT * DS))
        ht = warp % uint32(HT)
        dh = (warp // uint32(HT)) % uint32(DS)         # the warp's D part (direct), else 0
        d0 = uint32(16) * dh                           # its first dim (m-tiles dh, dh + DS, ...)
        h0 = j * uint32(HG) + ht * uint32(HH)
        nh = min(uint32(HH), uint32(HG) - ht * uint32(HH))
        if DIRECT:
            # one-row windows: window w is row w (launch_grouped), no load before the row's own
            first = int32(win)
            cnt = int32(1)
        else:
            first = int32(windows[win, 0])    # (windows: a constant of the launch)
            cnt = int32(windows[win, 1])
        row = first + wslot
        live = wslot < cnt and not producer
        qf = cuda.local.array(NQF, uint32)
        pre = cuda.local.array(NPF, int32)
        nv = int32(0)
        tl = int32(0)
        if DIRECT:
            # q's loads first, in flight beside the piece's own plan (``self_plan``) or beside
            # the plan's outputs: the piece's page ids (at most OWNMAX entries from its first,
            # every one written by the plan) beside the row's page count, which says how many of
            # them are the piece's; then the barriers
            y = int32(cuda.blockIdx.y)
            if SELF:
                # the plan's first round trip before q's loads, the ring's set-up before its
                # barrier (the one block barrier before the first copy)
                ids = cuda.local.array(5, int32)
                req, n = piece_ids(ids, tokens, counts, req_ids, first, y, tid)
                load_q(qf, qw, qs0, qs1, row, h0, g, t, live and g < nh, dh & U1)
                init_ring(bar, tid)
                nv, tl, passed = plan_piece(su, ids, req, n, int32(tokens.shape[1]), table,
                                            seq_lens, geometry, int32(pages.shape[1]), y, tid)
                if tid == U0 and j == U0:
                    verdict[first, y] = nv if passed else int32(0)   # the generic's
                    if y == int32(0):
                        num_vpages[first] = nv        # the merge's
                # every slot of the row is written: the merge loads them all at once
                npa0 = max(int32(1), nv // int32(PA))
                if live and PARTS and (not passed or nv == int32(0) or y >= npa0):
                    blank_piece(lane, first, h0, nh, part_o, part_ml, y, d0,
                                float32(-1) if not passed and y < npa0 else F0)
                if not passed:
                    nv = int32(0)
                live = live and nv > int32(0)
            else:
                load_q(qf, qw, qs0, qs1, row, h0, g, t, live and g < nh, dh & U1)
                if STAGE_U:
                    prefetch_pages(pre, pages, first, y * int32(PA), tid)
                init_ring(bar, tid)
            if PDL == 1:
                grid_dep_launch()
        if SELF:
            pass
        elif live:
            nv = int32(num_vpages[row])
            tl = int32(tail_len[row])
            if not DIRECT and (uint32(wmeta[win, 0, 2]) >> uint32(wslot)) & U1:
                nv = int32(0)             # a malformed plan row: inert (the window plan checked it)
            elif not EMPTY and nv == int32(0):
                live = False              # a row without pages: another kernel's
        elif DIRECT:                      # the producers stream the window's one row
            nv = int32(num_vpages[first])
        npc = max(int32(1), nv // int32(PC))       # spans
        npa = max(int32(1), nv // int32(PA))       # pieces (the arithmetic's)
        # split: this block's span (the merge kernel folds); fused: every span, folded below
        p_lo = int32(cuda.blockIdx.y)
        p_hi = int32(p_lo + int32(1))
        if fused != int32(0):
            p_lo = int32(0)
            p_hi = int32(nspans)

        if not DIRECT:
            load_q(qf, qw, qs0, qs1, row, h0, g, t, live and p_lo < npc and g < nh, U0)
        oacc = cuda.local.array(NOA, float32)
        ml = cuda.local.array(4, float32)      # running max of heads 2t, 2t+1, lane partial sums
        # the ring's base rounded up to a line: at_step's XORs act on the address's low bits
        sb = uint32(shared_base(dyn) + uint32(RING_ALIGN - 1)) & uint32(0x100000000 - RING_ALIGN)
        obase = uint32(min(wslot, int32(G - 1))) * uint32(OWNMAX)
        oaddr = uint32(shared_base(sown) + uint32(4) * obase)   # (read through 32-bit addresses)
        if not DIRECT:
            init_ring(bar, tid)

        gs0 = int32(0)                 # stages streamed by earlier phases and spans
        nc = int32(0)                  # chunks run so far (the S^T exchange's phase)
        xch = xall[min(ht, uint32(XSH[0] - 1))]
        for span_ in range(p_lo, p_hi):
            writer = live and span_ < npc
            kstart, kend = _piece_range(nv, span_, PC)
            if DIRECT:
                nstream0 = int32(kend - kstart)
                solo = U0
            else:
                nstream0 = int32(wmeta[win, span_, 0])
                solo = uint32(wmeta[win, span_, 1])
            if not SELF:               # (self-planned: one span, staged before plan_piece's barrier)
                cuda.syncthreads()     # the previous span's tables are read no more
            if writer and ht == U0 and not DIRECT:
                # 32-bit while loops here: a range's 64-bit trip count held a register across
                # the span (session 22: a 4-byte spill at 12 heads)
                xo = uint32(lane)
                while xo < uint32(kend - kstart):
                    sown[obase + xo] = ownu[row, uint32(kstart) + xo]
                    xo += uint32(32)
            if SELF:
                pass                  # staged by plan_piece
            elif STAGE_U and DIRECT:
                for i in range(NPF):
                    x = tid + uint32(i * NT)
                    if x < uint32(2 * nstream0):
                        su[x] = pre[i]
            elif STAGE_U:
                xs = tid
                while xs < uint32(2 * nstream0):
                    su[xs] = wunion[win, span_, xs >> U1, xs & U1]
                    xs += UNT
            if not SELF:
                cuda.syncthreads()
            nph = int32(1) + int32(cuda.popc(solo))
            rest_ = solo
            for ph in range(nph):
                solo_row = int32(-1)
                sbit = int32(-1)
                nstream = nstream0
                kst = int32(0)
                if DIRECT:
                    solo_row = first
                    kst = kstart
                if ph > 0:
                    sbit = int32(cuda.ffs(rest_)) - int32(1)
                    rest_ &= rest_ - U1
                    solo_row = first + sbit
                    a0, a1 = _piece_range(int32(num_vpages[solo_row]), span_, PC)
                    kst = a0
                    nstream = a1 - a0
                nst = (nstream + int32(SP - 1)) // int32(SP)
                if producer:
                    # a lane's 16-byte copies of a page (the same on every page): copy e = lane
                    # + 32 i of K (of V) is token row e // NCH16, chunk e % NCH16; the lane's own
                    # row r0 and chunk c0 (formed here: no registers held across the rows' chunks)
                    r0 = U0 if WIDE else lane // uint32(NCH16)
                    c0 = lane if WIDE else lane % uint32(NCH16)
                    # (unsigned: numba makes an int64 / uint64 mix a float64)
                    lk = uint64(uint64(j) * uint64(ks2) + uint64(r0 * uint32(KS1) + U4 * c0))
                    lv = uint64(uint64(j) * uint64(vs2) + uint64(r0 * uint32(VS1) + U4 * c0))
                    copies = lane < uint32(HALF)
                    pw = int32(int32(warp) - int32(NCW))
                    offs = cuda.local.array(IPH, uint32)
                    for i in range(IPH):
                        dr = i // CPR if WIDE else i * RPI
                        dc = 32 * (i % CPR) if WIDE else 0
                        offs[i] = ring_offset(uint32(r0 + uint32(dr)), uint32(c0 + uint32(dc)),
                                              uint32(PB))
                        if FLIP1:
                            offs[i] ^= uint32(64) * (uint32(pw) & U1)
                    s = int32(0)
                    while s < nst:
                        u0 = int32(s * int32(SP))
                        produce(dyn, sb, bar, int32(gs0 + s), u0, min(int32(SP), int32(nstream - u0)),
                                solo_row, kst, su, subase, wunion, win, span_, pages, kw, vw, ks0,
                                vs0, lk, lv, offs, copies, pw)
                        s = int32(s + int32(1))
                else:
                    mine = writer and kend > kstart
                    if ph == 0:
                        mine = mine and ((solo >> uint32(wslot)) & U1) == U0
                    else:
                        mine = mine and wslot == sbit
                    waited = int32(gs0 - int32(1))
                    rel = gs0              # the next stage to release
                    # the span's pieces: whole ones, the row's last taking the rest
                    pi = int32(kstart // int32(PA))
                    pe = npa if kend == nv else int32(kend // int32(PA))
                    if not mine:
                        pe = pi
                    while pi < pe:
                        c, k1 = _piece_range(nv, pi, PA)
                        kl = int32(k1 - int32(1))
                        for x in range(NOA):
                            oacc[x] = F0
                        ml[0] = NEG_INF
                        ml[1] = NEG_INF
                        ml[2] = F0
                        ml[3] = F0
                        while c < k1:
                            ka = int32(c - kstart)
                            kz = int32(min(int32(c + int32(CHUNK - 1)), kl) - kstart)
                            if ph == 0 and not DIRECT:
                                ka = ld_shared_i32(sown, uint32(oaddr + uint32(4) * uint32(ka)))
                                kz = ld_shared_i32(sown, uint32(oaddr + uint32(4) * uint32(kz)))
                            # stages of the chunk's first and last pages
                            lo = int32(gs0 + int32(uint32(ka) // uint32(SP)))
                            hi = int32(gs0 + int32(uint32(kz) // uint32(SP)))
                            while rel < lo:
                                waited = release(bar, rel, waited)
                                rel = int32(rel + int32(1))
                            if hi > waited:
                                wait_full(bar, hi)
                                waited = hi
                            chunk(dyn, sb, scr, lane, qf, oacc, ml, c, kstart, k1, nv, tl,
                                  ph > 0 or DIRECT, sown, oaddr, int32(gs0 * int32(SP)), scale,
                                  uint32(2) * dh, dh, xch, bar, uint32(2 * NB) + ht, nc)
                            c = int32(c + int32(CHUNK))
                            nc = int32(nc + int32(1))
                        # direct: the block's one piece, in slot ``pi`` for the merge kernel;
                        # else the span's state, folded in slot ``span_``
                        if DIRECT:
                            piece_end(lane, scr, oacc, ml, pi, pi, pi, False, True, row, h0, nh,
                                      out, lse, part_o, part_ml, d0, dh == U0)
                        else:
                            # (m, l) alternate between slot span_ and span_ + nspans, the last
                            # piece's landing in span_ (the span's partial)
                            kth = int32(pi - kstart // int32(PA))
                            left = int32(pe - int32(1) - pi)
                            mwr = span_ if left % int32(2) == int32(0) else span_ + nspans
                            mrd = span_ + nspans if left % int32(2) == int32(0) else span_
                            piece_end(lane, scr, oacc, ml, span_, mrd, mwr, kth > int32(0),
                                      left == int32(0), row, h0, nh, out, lse, part_o, part_ml,
                                      d0, dh == U0)
                        pi = int32(pi + int32(1))
                    end = int32(gs0 + nst)
                    while rel < end:
                        waited = release(bar, rel, waited)
                        rel = int32(rel + int32(1))
                gs0 = int32(gs0 + nst)
            if writer and kend == kstart:           # a row with no pages: out 0, lse -inf
                empty_out(lane, row, h0, nh, out, lse, part_ml, d0, dh == U0)
        if PARTS and fused != int32(0) and live and nv > int32(0):
            fold_out(lane, oacc, npc, row, h0, nh, out, lse, part_o, part_ml, d0, dh == U0)

        if PDL == 2:
            grid_dep_launch()

    kernel.__name__ = (f"grouped_attn_d{D}_g{HG}_w{G}_nb{NB}_sp{SP}_np{NPW}_{dtype}_{out_kind}"
                       f"{'_direct' if DIRECT else ''}{'_self' if SELF else ''}"
                       f"{f'_pdl{PDL}' if PDL else ''}")
    kernel.__qualname__ = kernel.__name__
    k = jit(kernel, launch_bounds=(NT, 1))   # registers fit one block of NT threads
    k.threads = NT
    return k


@functools.lru_cache(maxsize=None)
def make_merge_kernel(d, out_kind, piece, span, npieces, nspans, direct, pdl=False, self_plan=False):
    """Grid ``(rows, Hq)``, block ``d`` threads: every row with tokens folds its spans in span
    order: ``M = max M_s``, ``L = sum_s L_s e^(M_s - M)``, ``out = sum_s O_s e^(M_s - M) / L``,
    ``lse = M + log L`` (one span: ``O / L``, the bits of a direct division). The union kernel left
    one partial per span; ``direct`` blocks one per piece, and the span's partial is first folded
    from its pieces in order as the union kernel folds them (:func:`_fold_step`). Rows without
    tokens were written by the attention kernel (``l_0 = -1`` marks a row it found malformed).

    The fold's weights are the same for every dimension of a head: thread ``x`` of the block works
    out slot ``x``'s (:func:`_slot_weights`, the span's running max replayed in slot order), so that
    a dimension's chain is one fused multiply-add a slot, not two ``exp`` behind a max (1,430
    instructions a warp at 16 slots, 5.1 us at one row in Nsight Compute). Every slot of ``O`` is
    loaded first, the index clamped to the row's own slots (no read of an unwritten one).
    ``pdl``: launched programmatically behind the attention kernel (sm_90): the row's page count
    (the page-4 plan's, complete before that kernel began) is read first, then
    ``griddepcontrol.wait`` until the attention kernel's partials are complete and visible.
    ``self_plan``: the page count is the direct blocks' own, read after the wait beside every slot
    (the blocks write all of them, blank past the row's pieces: one round trip); a row with a
    rejected piece (``l = -1`` in any slot) is left to the generic kernel."""
    D, PA, PC, NP, NS = (int(v) for v in (d, piece, span, npieces, nspans))
    DIRECT = bool(direct)
    PDL = bool(pdl)
    SELF = bool(self_plan)
    R = PC // PA if DIRECT else 1         # slots of a span (the row's last span takes the rest)
    NL = NP if DIRECT else NS             # slots a row can have
    UD = uint32(D)
    U0, U1 = uint32(0), uint32(1)
    F0 = float32(0)
    conv = _out_conv(out_kind)
    span_start, row_max, fold_slots = _make_fold(NL, R)

    @device_jit(forceinline=True)
    def stage_ml(sm, sl, part_ml, row, h, x, last, nsl):
        """Slot ``x``'s ``(m, l)`` (its index clamped to ``last``) into shared memory; 1 for a
        rejected piece (``l < 0``: self-planned blocks) among the row's ``nsl`` slots."""
        q = min(x, last)
        sm[x] = part_ml[row, h, q, U0]
        sl[x] = part_ml[row, h, q, U1]
        return int32(1) if x < uint32(nsl) and sl[x] < F0 else int32(0)

    def kernel(num_vpages, part_o, part_ml, out, lse):
        sm = cuda.shared.array(NL, float32)      # a slot's max and sum
        sl = cuda.shared.array(NL, float32)
        sa = cuda.shared.array(NL, float32)      # weight of the span's state before slot x
        sb = cuda.shared.array(NL, float32)      # weight of slot x
        sw = cuda.shared.array(NL, float32)      # weight of the span that ends at slot x
        row = uint32(cuda.blockIdx.x)
        h = uint32(cuda.blockIdx.y)
        dd = uint32(cuda.threadIdx.x)
        ov = cuda.local.array(NL, float32)
        nv = int32(0)
        if not SELF:
            nv = int32(num_vpages[row])
        if PDL:
            grid_dep_wait()
        if SELF:
            # every slot written (blank past the row's pieces): the page count and all the slots
            # in one round trip after the wait
            nv = int32(num_vpages[row])
        elif nv <= int32(0) or part_ml[row, h, U0, U1] < F0:   # no tokens: written by the kernel
            return
        # (32-bit: nv >= 0 wherever the spans are used; numba's int32 // int32 is 64-bit)
        unv = uint32(max(nv, int32(0)))
        nsp = int32(max(U1, uint32(unv // uint32(PC))))
        nsl = int32(max(U1, uint32(unv // uint32(PA)))) if DIRECT else nsp
        # else no read of an unwritten slot; unsigned indices: no negative-index wrap
        last = uint32(NL - 1) if SELF else uint32(nsl - int32(1))
        for x in range(NL):
            ov[x] = part_o[row, h, min(uint32(x), last), dd]
        bad = int32(0)
        if NL <= D:
            # thread x stages slot x: straight-line code, so its loads issue beside O's (a
            # loop's 64-bit trip count put ~100 instructions between them: session 23's SASS)
            if dd < uint32(NL):
                bad = stage_ml(sm, sl, part_ml, row, h, dd, last, nsl)
        else:
            for x in range(dd, uint32(NL), UD):
                bad |= stage_ml(sm, sl, part_ml, row, h, x, last, nsl)
        if SELF:
            # no tokens, the plan's leaving, or a rejected piece: the generic kernel's row
            if cuda.syncthreads_or(bad) != 0 or nv <= int32(0):
                return
        else:
            cuda.syncthreads()
        mx = row_max(sm, nsl)
        if NL <= D:
            if dd < uint32(nsl):
                _slot_weights(sm, sa, sb, sw, int32(dd), span_start(int32(dd), nsp), mx)
        else:
            for x in range(dd, uint32(NL), UD):
                if x < uint32(nsl):
                    _slot_weights(sm, sa, sb, sw, int32(x), span_start(int32(x), nsp), mx)
        cuda.syncthreads()
        acc, lsum = fold_slots(ov, sl, sa, sb, sw, nsl, nsp)
        out[row, h, dd] = conv(_fold_finish(acc, lsum))
        if dd == U0:
            lse[row, h] = _fold_lse(mx, lsum)

    kernel.__name__ = (f"grouped_merge_d{D}_{out_kind}_n{NL}{'_direct' if DIRECT else ''}"
                       f"{'_self' if SELF else ''}{'_pdl' if PDL else ''}")
    kernel.__qualname__ = kernel.__name__
    return jit(kernel)


@functools.lru_cache(maxsize=None)
def _make_fold(nl, r):
    """The merge kernel's fold of a row's ``nl`` slots (spans of ``r`` slots) as device functions:
    ``span_start(x, nsp)``, the first slot of slot ``x``'s span;
    ``row_max(sm, nsl)``, ``M`` over the slots' maxima in slot order; ``fold_slots(ov, sl, sa, sb,
    sw, nsl, nsp)``, ``(sum O, L)`` of one dimension in one pass: a span's state folds its slots in
    order (weights of :func:`_slot_weights`), and each span's state joins the sum over spans when
    the next span (or the row's end) begins."""
    NL, R = int(nl), int(r)

    @device_jit(forceinline=True)
    def span_start(x, nsp):
        # (32-bit: x >= 0, nsp >= 1; numba's int32 // int32 is a 64-bit floor division)
        return int32(uint32(min(uint32(x) // uint32(R), uint32(nsp - int32(1)))) * uint32(R))

    @device_jit(forceinline=True)
    def row_max(sm, nsl):
        # every slot loaded (all are written), the row's own selected: max(mx, mx) is mx, so the
        # same bits as a branch, and the loads need no predicate (which had kept ptxas from
        # sharing their shared-window address: 16 reads of SR_CgaCtaId)
        mx = NEG_INF
        for x in range(NL):
            v = sm[x]
            mx = max(mx, v if x < nsl else mx)
        return mx

    @device_jit(forceinline=True)
    def fold_slots(ov, sl, sa, sb, sw, nsl, nsp):
        # every operand loaded and both steps formed, then selected (no branch between the
        # shared loads: they issue together); a slot's step is the same expression either way
        ls = sl[0]
        o = ov[0]
        lsum = float32(0)
        acc = float32(0)
        for x in range(1, NL + 1):
            xc = min(x, NL - 1)
            a = sa[xc]
            b = sb[xc]
            lx = sl[xc]
            ox = ov[xc]
            w = sw[x - 1]
            ls_step = _fold_step(ls, a, lx, b)
            o_step = _fold_step(o, a, ox, b)
            lsum_end = _fold_add(lsum, ls, w)
            acc_end = _fold_add(acc, o, w)
            on = int32(x) <= nsl
            step = on and int32(x) < nsl and span_start(int32(x), nsp) != int32(x)
            end = on and not step
            if end:
                lsum = lsum_end
                acc = acc_end
            if step:
                ls = ls_step
                o = o_step
            elif end:
                ls = lx
                o = ox
        return acc, lsum

    return span_start, row_max, fold_slots


@device_jit(forceinline=True)
def _slot_weights(sm, sa, sb, sw, x, x0, mx):
    """Slot ``x``'s weights in a fold of its span (first slot ``x0``) in slot order: the span's
    running max before and at ``x`` (the same ``max`` calls in the same order as a sequential
    fold), ``a = e^(m_(x-1) - m_x)``, ``b = e^(s_x - m_x)`` (``s_x`` the slot's own max), and the
    span's weight in the row, ``e^(m_x - M)``, used where the span ends at ``x``."""
    m = sm[x0]
    mp = m
    j = int32(x0 + int32(1))
    while j <= x:                 # (a 32-bit loop: a range's trip count is 64-bit)
        mp = m
        m = max(m, sm[j])
        j = int32(j + int32(1))
    sa[x] = _fold_weight(mp, m)
    sb[x] = _fold_weight(sm[x], m)
    sw[x] = _fold_weight(m, mx)


# ------------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------------

def pieces_of(kb1, piece):
    """Most pieces a row of ``kb1`` virtual-page slots can have."""
    return max(1, int(kb1) // int(piece))


def launch_grouped(q, k_cache, v_cache, pages, num_vpages, tail_len, tokens, req_ids, scale, out,
                   lse, profile, stream, buffers, dtype=None, out_kind=None, empty_rows=True,
                   selection=None, verdict=None):
    """Grouped route on device arrays after the page-4 plan (``pages``, ``num_vpages``,
    ``tail_len``); ``buffers(name, shape, dtype)`` returns scratch device arrays (a workspace's).
    ``tokens`` (the selection the plan came from) orders the windows' unions by logical group;
    without it every row is its own window (same arithmetic, no shared loads).
    K/V must have a contiguous D axis and 16-byte aligned rows (see :func:`words_view`).
    ``dtype`` ("f16"/"bf16", q and K/V) and ``out_kind`` ("f32"/"f16"/"bf16") default to the
    arrays' own; a bfloat16 ``out`` is written through its uint16 bits. ``empty_rows=False``: rows
    without pages are another kernel's to write (:func:`make_grouped_kernel`).
    ``selection`` ``(tokens, counts, block_table, req_ids, seq_lens, geometry)``, the page-4 plan's
    own inputs (with ``empty_rows=False``, where :func:`plans_own_pieces` says so; no plan ran):
    direct blocks plan their own pieces from it and leave their verdicts in ``verdict``
    (``[rows, pieces]``). Returns the attention kernel's record (:func:`numqsa.launch.mark`)."""
    from .. import device as dev
    rows, hq, d = q.shape
    hkv = int(k_cache.shape[2])
    if rows == 0:
        return out, lse
    hg = hq // hkv
    kb1 = int(pages.shape[1])
    cfg = grouped_config(d, hg, rows, kb1, hkv, profile, single=tokens is None)
    pc, span = cfg.piece, cfg.span
    npieces = pieces_of(kb1, pc)
    nspans = pieces_of(kb1, span)
    g = cfg.rows_per_window
    nwin = -(-rows // g)
    first = np.arange(0, rows, g, dtype=np.int32)
    windows = dev.constant(np.stack([first, np.minimum(g, rows - first)], 1).astype(np.int32), stream)
    # One-row windows over the page-4 plan kernel's own plan (valid by construction) need no window
    # plan: the union is the row's own pages in order (session 11: 5.6 of 45 us at one row).
    direct = g == 1 and tokens is not None
    self_plan = selection is not None
    if self_plan and not (direct and not empty_rows and verdict is not None):
        raise ValueError("direct blocks plan their own pieces beside the generic kernel only")
    fused = cfg.fused and not direct
    # a row's partials, and the blocks along y of the split schedule: one per span (union
    # windows), one per piece (direct)
    nslots = npieces if direct else nspans
    cap = g * min(kb1, 2 * span)
    wunion = buffers("grouped.wunion", (1, 1, 1, 2) if direct else (nwin, nspans, cap, 2), np.int32)
    wmeta = buffers("grouped.wmeta", (1, 1, 3) if direct else (nwin, nspans, 3), np.int32)
    ownu = buffers("grouped.ownu", (1, 1) if direct else (rows, kb1), np.int32)
    if not direct:
        kp = make_window_plan_kernel(cfg.plan_threads, span, cfg.stage_pages, cfg.keep, g)
        keyed = np.int32(tokens is not None)
        if tokens is None:
            tokens = dev.constant(np.zeros((1, 1), np.int32), stream)
        kp[(nwin, nspans), cfg.plan_threads, stream](tokens, keyed, pages, num_vpages, tail_len,
                                                      req_ids, windows, np.int32(k_cache.shape[0]),
                                                      np.int32(k_cache.shape[1]), wunion, wmeta,
                                                      ownu)
    kv, vv = words_view(k_cache), words_view(v_cache)
    qv = words_view(q, align=4)
    if kv is None or vv is None or qv is None:
        raise ValueError("grouped route needs K/V/q with a contiguous, aligned D axis")
    if max(int(x) for x in (*kv[1], *vv[1])) >= 2 ** 31:
        raise ValueError("grouped route needs K/V strides below 2**31 words (page * stride stays 64-bit)")
    dtype = dtype or ("bf16" if is_bf16(q) else "f16")
    ok = out_kind or _out_kind_of(out)
    ob = bits16(out)
    sm90 = dev.device_cc() >= (9, 0)
    # direct blocks and their merge: a programmatic edge between them (sm_90; ``TUNING["pdl"]``)
    pdl = int(TUNING.get("pdl", PDL)) if direct and sm90 and nslots > 1 and not fused else 0
    k = make_grouped_kernel(int(d), hg, cfg.stages, cfg.stage_pages, g, pc, dtype, ok, cfg.producers,
                            sm90, (int(kv[1][1]), int(vv[1][1])), direct,
                            span, nslots > 1, empty_rows, TUNING.get("ds") if direct else None, pdl,
                            self_plan)
    # a row's partials, or (a span of several pieces) the state of its span's fold
    held = rows if npieces > 1 else 1
    part_o = buffers("grouped.part_o", (held, hq, nslots, d), np.float32)
    # union windows: a span's (m, l) alternate with a second slot while its pieces are folded
    part_ml = buffers("grouped.part_ml", (held, hq, nslots if direct else 2 * nslots, 2),
                      np.float32)
    if self_plan:
        # the row's page count for the merge: the direct blocks' own
        num_vpages = buffers("grouped.num_vpages", (rows,), np.int32)
        sel = tuple(selection) + (verdict,)
    else:
        sel = (windows,) * 7           # not read
    i64 = np.int64
    args = (qv[0], i64(qv[1][0]), i64(qv[1][1]), kv[0], vv[0], i64(kv[1][0]), i64(kv[1][2]),
            i64(vv[1][0]), i64(vv[1][2]),
            pages, num_vpages, tail_len, windows, wunion, wmeta, ownu, np.float32(scale), ob, lse,
            part_o, part_ml)
    _launch_dynamic(k, (nwin, 1 if fused else nslots, hkv), k.threads, stream, cfg.smem_bytes,
                    args + (np.int32(fused), np.int32(nslots)) + sel)
    attn = mark()
    if nslots > 1 and not fused:
        km = make_merge_kernel(int(d), ok, pc, span, npieces, nspans, direct, pdl > 0, self_plan)
        with after(attn), programmatic() if pdl else contextlib.nullcontext():
            km[(rows, hq), int(d), stream](num_vpages, part_o, part_ml, ob, lse)
    return attn


def _out_kind_of(out):
    from oracle.validate import dtype_name
    return {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}[dtype_name(out)]


_DYN_OPTED = {}


def _launch_dynamic(k, grid, threads, stream, smem, args):
    """Launch with ``smem`` bytes of dynamic shared memory, opting in above 48 KB (sm_80+).

    numba-cuda has no API for CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES; a pre-launch
    callback sets it on the compiled kernel's handle once (the same driver call numba uses for the
    carveout attribute).
    """
    cfg = k[grid, threads, stream, smem]
    if not SIMULATOR and smem > 48 * 1024:
        def opt_in(kernel, launch_config):
            key = id(kernel)
            if _DYN_OPTED.get(key, 0) >= smem:
                return
            from numba.cuda.cudadrv.driver import binding, driver
            cufunc = kernel._codelibrary.get_cufunc()
            attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            driver.cuKernelSetAttribute(attr, int(smem), cufunc.handle, cufunc.device.id)
            _DYN_OPTED[key] = smem
        cfg.pre_launch_callbacks.append(opt_in)
    cfg(*args)


def words_view(a, align=16):
    """``(uint32 1-D view over a's span, word strides of every axis but the last)`` when the last
    axis is contiguous 16-bit data and the other strides and the base are ``align``-byte aligned;
    else ``None``."""
    try:
        strides = tuple(int(s) for s in a.strides)
        shape = tuple(int(s) for s in a.shape)
    except (AttributeError, TypeError):
        return None
    if strides[-1] != 2 or any(s % align or s < 0 for s in strides[:-1]) or shape[-1] % (align // 2):
        return None
    span = sum((n - 1) * s for n, s in zip(shape[:-1], strides[:-1])) + 2 * shape[-1]
    if span % 4:
        return None
    sw = np.array([s // 4 for s in strides[:-1]], np.int64)
    if SIMULATOR:
        host = getattr(a, "_ary", None)
        if host is None or host.ctypes.data % align:
            return None
        flat = np.lib.stride_tricks.as_strided(host, shape=(span // 2,), strides=(2,))
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        return FakeCUDAArray(flat.view(np.uint32)), sw
    gpu_data = getattr(a, "gpu_data", None)
    if gpu_data is None:
        return None
    from numba.cuda.cudadrv.devicearray import DeviceNDArray
    if int(a.device_ctypes_pointer.value or 0) % align:
        return None
    return DeviceNDArray((span // 4,), (4,), np.dtype(np.uint32), gpu_data=gpu_data), sw


def _resource_cases():
    cases = [("grouped_window_plan", make_window_plan_kernel(128, SPAN, 8, 6, window_rows(6)),
              "void(int32[:, :], int32, int32[:, :, :], int32[:], int32[:], int32[:], int32[:, :], int32, "
              "int32, int32[:, :, :, :], int32[:, :, :], int32[:, :])", 128, 0, (9, 0))]
    # as sparse_attention launches them (empty rows the generic kernel's): C-contiguous word views
    # (words_view) and plan buffers; out/lse the caller's
    sig = ("void(uint32[::1], int64, int64, uint32[::1], uint32[::1], int64, int64, int64, int64, "
           "int32[:, :, ::1], int32[::1], int32[::1], int32[:, ::1], "
           "int32[:, :, :, ::1], int32[:, :, ::1], int32[:, ::1], float32, float16[:, :, :], "
           "float32[:, :], float32[:, :, :, ::1], float32[:, :, :, ::1], int32, int32, "
           + "int32[:, ::1], " * 6 + "int32[:, ::1])")      # (the selection: not read)
    # direct blocks that plan their own pieces: the selection (tokens, counts, block table, req_ids,
    # seq_lens, geometry) and their verdicts
    sig_self = sig.replace("int32[:, ::1], " * 6 + "int32[:, ::1])",
                           "int32[:, ::1], int32[::1], int32[:, ::1], int32[::1], int32[::1], "
                           "int32[::1], int32[:, ::1])")
    for hg in (6, 12):
        cfg = GroupedConfig(256, hg, 6, 8, window_rows(hg), 256, span=SPAN)
        k = make_grouped_kernel(256, hg, 6, 8, cfg.rows_per_window, PIECE, "f16", "f16", sm90=True,
                                span=SPAN, empty_rows=False)
        cases.append((f"grouped_attn_g{hg}", k, sig, k.threads, cfg.smem_bytes, (9, 0)))
    # one-row windows (1-64 rows x 32K): no window plan, a block per piece, a head tile over four
    # warps (O's dims and S^T's chains), a ring of DIRECT_STAGES (two blocks an SM)
    cfg = GroupedConfig(256, 6, DIRECT_STAGES, 8, 1, 256)
    k = make_grouped_kernel(256, 6, DIRECT_STAGES, 8, 1, PIECE, "f16", "f16", sm90=True, direct=True,
                            span=SPAN, empty_rows=False, pdl=PDL, self_plan=SELF_PLAN)
    cases.append(("grouped_attn_direct_g6", k, sig_self, k.threads, cfg.smem_bytes, (9, 0)))
    # bfloat16 q/K/V, output bfloat16 bits (uint16)
    sig_bf = sig.replace("float16[:, :, :], float32[:, :]", "uint16[:, :, :], float32[:, :]")
    for hg in (6, 12):
        cfg = GroupedConfig(256, hg, 6, 8, window_rows(hg), 256, span=SPAN)
        k = make_grouped_kernel(256, hg, 6, 8, cfg.rows_per_window, PIECE, "bf16", "bf16", sm90=True,
                                span=SPAN, empty_rows=False)
        cases.append((f"grouped_attn_bf16_g{hg}", k, sig_bf, k.threads, cfg.smem_bytes, (9, 0)))
    cases.append(("grouped_merge_bf16", make_merge_kernel(256, "bf16", PIECE, SPAN, 16, 4, False),
                  "void(int32[:], float32[:, :, :, :], float32[:, :, :, :], uint16[:, :, :], "
                  "float32[:, :])", 256, 0, (9, 0)))
    cases.append(("grouped_merge_direct_bf16", make_merge_kernel(256, "bf16", PIECE, SPAN, 16, 4, True),
                  "void(int32[:], float32[:, :, :, :], float32[:, :, :, :], uint16[:, :, :], "
                  "float32[:, :])", 256, 0, (9, 0)))
    return cases


RESOURCE_CASES = _resource_cases() if not SIMULATOR else []
