"""Page-4 route (spec §7): the virtual-page plan kernel and the sm_70 grouped attention kernel.

Plan: each row's selection (ascending token ids: whole aligned groups, then 0..r-1 tail tokens)
becomes virtual pages ``(physical page, first slot)`` in logical order, the partial tail page last.
A row whose ids are not of that shape or that needs a page id outside the cache becomes inert
(``num_vpages = 0``), so the attention kernel never reads out of bounds.

Route: the plan runs for the page-4 route on every architecture. The attention kernel serves sm_70
(m8n8k4, float16, at every row count: one route keeps a row's bits independent of its batch; the
seed measured the page-4 route 3.15x faster than the generic kernel on a V100 at 4096 rows and
took it only from there, which made a row's bits depend on the batch size)
and, on sm_80+, caches whose rows are not 16-byte aligned (m16n8k16 with element loads). On sm_80+
with aligned caches :mod:`numqsa.kernels.grouped` replaced it: 4-8x faster below 512 rows, 8-11%
slower at the large shapes, one route for every row count (``docs/kernels/page4.md``, "Versions").
"""
import functools
import math

import numpy as np
from numba import cuda, float32, int32, uint32
from numba.cuda.types import float16

from ..jit import SIMULATOR, device_jit, jit
from .mma import SCRATCH_WORDS, mma_m8n8k4_f16, mma_m16n8k16_f16, pack_f16x2

__all__ = ["make_plan_checks", "make_plan_kernel", "launch_plan", "make_page4_kernel", "make_window_keys_kernel",
           "launch_page4", "page4_windows", "stage_pages", "RESOURCE_CASES"]


@functools.lru_cache(maxsize=None)
def make_plan_checks(r):
    """The plan's checks as device functions, shared by the plan kernel and the direct attention
    blocks that plan their own piece (:func:`numqsa.kernels.grouped.make_grouped_kernel`), so both
    reach the same verdict on every row:

    - ``row_pages(n, width, slen, slots)``: ``(virtual pages, tail tokens)`` of a row of ``n``
      selected ids, or ``(0, 0)`` when the row cannot be planned (no tokens, ``n`` past the
      selection's width, an empty request, more pages than the plan's ``slots``);
    - ``ids_ok(ids, len_v, v, slen)``: whether virtual page ``v``'s ids ``ids[1 .. len_v]`` are
      ``t0, t0+1, ...`` with ``t0 % r == 0``, inside the request (``< slen``), and above the previous
      page's last id ``ids[0]`` (read only for ``v > 0``);
    - ``column(t0, ps)``: the table column ``t0 // ps`` of an id ``t0 >= 0`` (any value for a
      negative one, which ``ids_ok`` rejects);
    - ``entry(pg, t0, c, ps, cols, npg)``: the page's ``(physical page, first slot)`` from its
      table column ``c = column(t0, ps)`` (whose entry ``pg`` the caller loaded, any value when
      the column is past the table), or ``(-1, -1)`` when ``t0`` is negative or the column or
      page is out of range.

    All of it is 32-bit (session 23): numba's ``int32 // int32`` is a 64-bit floor division, a
    call to a software routine in the SASS, three of them on the direct blocks' path to their
    verdict; ids are ``0 <= t0 < 2**31``, so unsigned 32-bit arithmetic gives the same verdicts
    and entries."""
    R = int(r)
    UR = uint32(R)
    U0, U1 = uint32(0), uint32(1)

    @device_jit(forceinline=True)
    def row_pages(n, width, slen, slots):
        if slen <= int32(0) or n <= int32(0) or n > width:
            return U0, U0
        nfull = uint32(uint32(n) // UR)
        tail = uint32(uint32(n) - uint32(nfull * UR))
        nv = uint32(nfull + (U1 if tail > U0 else U0))
        if nv > uint32(slots):
            return U0, U0
        return nv, tail

    @device_jit(forceinline=True)
    def ids_ok(ids, len_v, v, slen):
        t0 = ids[1]
        # (t0 >= 0 before the unsigned sum, which then cannot wrap)
        ok = (t0 >= int32(0) and uint32(uint32(t0) % UR) == U0
              and uint32(uint32(t0) + uint32(len_v)) <= uint32(max(slen, int32(0))))
        if ok:                    # (t0 >= 0: the unsigned sums below cannot wrap)
            for x in range(1, R):
                if uint32(x) < len_v and uint32(ids[1 + x]) != uint32(uint32(t0) + uint32(x)):
                    ok = False
        if v > U0 and ids[0] >= t0:
            ok = False
        return ok

    @device_jit(forceinline=True)
    def column(t0, ps):
        return uint32(uint32(t0) // uint32(ps))

    @device_jit(forceinline=True)
    def entry(pg, t0, c, ps, cols, npg):
        if t0 < int32(0) or c >= uint32(cols) or pg < int32(0) or pg >= npg:
            return int32(-1), int32(-1)
        return pg, int32(uint32(t0) - uint32(c * uint32(ps)))

    return row_pages, ids_ok, column, entry


@functools.lru_cache(maxsize=None)
def make_plan_kernel(threads, r):
    """One block of ``threads`` threads per row (grid ``rows``).

    Pass 1: thread ``tid`` checks virtual pages ``v = tid, tid + threads, ...`` of the row
    (:func:`make_plan_checks`: the ``r`` (or, for the last, ``tail``) ids of page ``v`` must be
    ``t0, t0+1, ...`` with ``t0 % r == 0``, ``t0`` above the previous page's last id, ``< seq_len``,
    and the table column and page id in range, and the row's pages must fit ``pages.shape[1]``
    (:func:`plan_pages`)); any failure sets a shared flag. Pass 2 (after a barrier) writes every
    entry of ``pages[row]`` -- the plan or ``-1`` -- plus ``num_vpages`` and ``tail_len``. A
    thread's first page (``v = tid``) is read before the first barrier, beside the row's metadata.
    Shared memory: 4 bytes.
    """
    NT, R = int(threads), int(r)
    R1 = R + 1
    UNT, UR = uint32(NT), uint32(R)
    row_pages, ids_ok, column, entry = make_plan_checks(R)

    @jit
    def plan(tokens, counts, block_table, req_ids, seq_lens, num_pages, pages, num_vpages, tail_len):
        sbad = cuda.shared.array(1, int32)
        tid = uint32(cuda.threadIdx.x)
        row = uint32(cuda.blockIdx.x)
        width = int32(tokens.shape[1])
        slots = uint32(pages.shape[1])
        cols = int32(block_table.shape[1])
        ps = int32(num_pages[1])
        npg = int32(num_pages[0])
        req = int32(req_ids[row])
        n = int32(counts[row])
        # the ids of page v = tid and the one before it, and its table entry, loaded beside the
        # row's metadata (clamped into the row; used only where the checks below read them), so
        # that the row's loads are two round trips, not four
        tk = cuda.local.array(R1, int32)
        k0s = int32(tid * UR)
        for x in range(R1):
            tk[x] = int32(-1)
            if width > int32(0):
                tk[x] = int32(tokens[row, min(max(k0s + int32(x - 1), int32(0)), width - int32(1))])
        rq = req >= int32(0) and req < int32(seq_lens.shape[0]) and req < int32(block_table.shape[0])
        slen = int32(0)
        pg0 = int32(-1)
        if rq:
            slen = int32(seq_lens[req])
            if tk[1] >= int32(0) and column(tk[1], ps) < uint32(cols):
                pg0 = int32(block_table[req, column(tk[1], ps)])
        nv, tail = row_pages(n, width, slen, slots)
        nfull = nv - uint32(1 if tail > uint32(0) else 0)
        if tid == uint32(0):
            sbad[0] = int32(0)
        cuda.syncthreads()
        ids = cuda.local.array(R1, int32)
        for v in range(tid, nv, UNT):
            own = v == tid
            k0 = v * UR
            len_v = UR
            if v == nfull:
                len_v = tail
            for x in range(R1):
                ids[x] = tk[x]
                if not own and (uint32(x) <= len_v and (x > 0 or v > uint32(0))):
                    ids[x] = int32(tokens[row, k0 + uint32(x) - uint32(1)])
            ok = ids_ok(ids, len_v, v, slen)
            if ok:
                pg = pg0
                c = column(ids[1], ps)
                if not own and c < uint32(cols):
                    pg = int32(block_table[req, c])
                ok = entry(pg, ids[1], c, ps, cols, npg)[0] >= int32(0)
            if not ok:
                sbad[0] = int32(1)
        cuda.syncthreads()
        if sbad[0] != int32(0):
            nv = uint32(0)
            tail = uint32(0)
        for v in range(tid, slots, UNT):
            pg = int32(-1)
            sl = int32(-1)
            if v < nv:
                own = v == tid
                t0 = tk[1] if own else int32(tokens[row, v * UR])
                c = column(t0, ps)
                pg, sl = entry(pg0 if own else int32(block_table[req, c]), t0, c, ps, cols, npg)
            pages[row, v, 0] = pg
            pages[row, v, 1] = sl
        if tid == uint32(0):
            num_vpages[row] = int32(nv)
            tail_len[row] = int32(tail)

    plan.threads = NT
    return plan


def plan_pages(kb, cols, page_size, r, max_groups=None):
    """Full pages a row's plan holds (its ``pages`` are ``[rows, plan_pages + 1, 2]``): ``Kb``, but
    no more than a row can select -- its request's groups, at most ``max_groups`` (the host's
    ``max(seq_lens) // r``, when known) and the block table's capacity ``cols * page_size // r``
    (a token past it has no page) -- so no launch after the plan grows with ``Kb`` past what the
    rows see. A row needing more pages (a caller's selection beyond a wrong ``max_groups``) is left
    inert by the plan for the generic kernel, as any selection the plan cannot express."""
    bound = int(cols) * int(page_size) // int(r)
    if max_groups is not None:
        bound = min(bound, int(max_groups))
    return max(1, min(int(kb), bound))


def keys_shape(tokens, pages, r):
    """Shape of the window keys (:func:`make_window_keys_kernel`): the tokens of the planned pages,
    ``pages.shape[1] * r`` at most."""
    return int(tokens.shape[0]), min(int(tokens.shape[1]), int(pages.shape[1]) * int(r))


def plan_threads(profile, slots=1, rows=1):
    """Threads of a row's block: 128, or one per plan entry (``slots``, a multiple of 32, up to
    1024) while the rows' blocks fit the GPU at once, so that every page's loads issue together
    (H200, session 11, 513 slots: one row 8.8 -> 5.3 us, 256 rows 9.6 -> 6.5 us; but at 4096 rows
    33.5 -> 50 us, where 128-thread blocks already fill every SM). The plan is integers: its
    launch shape changes no bits. The simulator runs 32 (its loops cover the rest)."""
    if SIMULATOR:
        return 32
    wide = min(1024, max(128, 32 * -(-int(slots) // 32)))
    fits = int(rows) * wide <= int(profile.sm_count) * int(profile.max_threads_per_sm)
    return wide if fits else 128


def launch_plan(tokens, counts, block_table, req_ids, seq_lens, geometry, pages, num_vpages,
                tail_len, profile, stream, r=4):
    """Write ``pages [rows, Kb+1, 2]``, ``num_vpages``, ``tail_len`` (int32 device arrays).

    ``geometry`` is a device int32 array ``(num_pages, page_size)``.
    """
    rows = tokens.shape[0]
    if rows == 0:
        return pages, num_vpages, tail_len
    k = make_plan_kernel(plan_threads(profile, pages.shape[1], rows), int(r))
    k[rows, k.threads, stream](tokens, counts, block_table, req_ids, seq_lens, geometry, pages,
                               num_vpages, tail_len)
    return pages, num_vpages, tail_len



# ------------------------------------------------------------------------------------------------
# Grouped tensor-core attention over virtual pages
# ------------------------------------------------------------------------------------------------

HEAD_TILE = 8          # query heads per block (the n8 of both mma shapes); Hq/Hkv > 8 -> more blocks
KEY_WINDOW = 256       # logical groups scanned per stage (a 256-bit map in shared memory)
INT_MAX = 2147483647


@functools.lru_cache(maxsize=None)
def _warp_sync_fn():
    # The simulator has no syncwarp; there every warp runs the same barriers (see make_page4_kernel).
    if SIMULATOR:
        def ws():
            cuda.syncthreads()
    else:
        def ws():
            cuda.syncwarp()
    return device_jit(ws)


def stage_pages(d, group_rows, kind="m16n8k16"):
    """Virtual pages staged per step: K and V of 8 pages of d=256 float16 are 32 KB (V100 budget)."""
    per_page = 2 * 4 * d * 2
    parts = 1 if kind == "m16n8k16" else 2
    per_warp = parts * 16 * HEAD_TILE * 4 + 4 * HEAD_TILE * 4 + HEAD_TILE * 4 + 4 * 4
    if SIMULATOR:
        per_warp += 4 * SCRATCH_WORDS
    budget = 48 * 1024 - group_rows * per_warp - 3 * 1024
    if SIMULATOR:
        budget = min(budget, 4 * per_page)        # small stages so CI exercises the stage logic
    c = max(4, min(16, budget // per_page))
    return c


@functools.lru_cache(maxsize=None)
def make_page4_kernel(d, group_rows, kind, r=4):
    """Grouped page-4 attention. Grid ``(groups, Hkv, ceil(Hg / 8))``, block ``32 * group_rows``.

    Block = one group of up to ``group_rows`` adjacent rows of one request x one KV head x 8 query
    heads; warp ``w`` owns row ``group_start + w`` (its O accumulators, running max and sum).
    The block walks the UNION of its rows' virtual pages in logical order, in stages: each stage
    marks, in a 256-bit map over logical groups ``[F, F + 256)`` (``F`` = the smallest next key of
    any row), every key some row selects, keeps the first ``C`` (:func:`stage_pages`) set keys, and
    loads those pages' K and V (4 tokens x d, float16) once into shared memory. Each warp then
    processes ITS OWN pages of the stage, in its own logical order, finding a page's stage slot by
    a popcount in the map:

    - Q.K^T on tensor cores, 4 own pages (16 tokens) per tile: S^T[token, head] = K Q^T
      (m16n8k16: A = K rows gathered from the stage, B = Q^T held in registers; m8n8k4: the four
      quad-pairs split the tile into 2 token halves x 2 d halves, summed in a fixed order);
    - online softmax PER VIRTUAL PAGE in page order (max, rescale, terms in token order), by lanes
      0..7 (one per head) through a per-warp shared tile; masked tokens (tail beyond ``tail_len``)
      get probability 0 and a zero V operand;
    - P.V on tensor cores, one mma chain per page: O^T[d, head] = O^T * alpha + V^T P^T with the
      page's 4 tokens in k (m16n8k16: k slots 4..15 are zero; m8n8k4: k = 4 exactly).

    Invariance: a row's arithmetic is a function of its own pages only -- the same tiles, the same
    per-page chunking, the same k placement in every mma -- whatever other rows share the group,
    where the stage boundaries fall, or where the pages sit physically. Each score is one mma
    element (independent of the other columns of its tile); each P.V mma holds only this row's page.
    So the output is bitwise independent of grouping, batch composition and relocation.

    Shared memory (d 256, 8 rows, C 8): K, V stages 2*C*4*d*2 = 32 KB, per-warp score/probability
    tiles 16x8 float32 and 4x8 rescale factors (5 KB), the key map and its page ids (2 KB).
    """
    D, G, R = int(d), int(group_rows), int(r)
    if D % 32:
        raise ValueError(f"the page-4 kernel needs d % 32 == 0, got {D}")
    M16 = kind == "m16n8k16"
    C = stage_pages(D, G, kind)
    NPART = 1 if M16 else 2
    CT = C * 4
    NT = 32 * G
    NW = KEY_WINDOW // 32
    NMT = D // 16 if M16 else D // 32                  # O^T d-tiles per warp
    NOACC = NMT * (4 if M16 else 8)
    NQ = (D // 16) * 2 if M16 else (D // 8) * 2        # Q^T B-fragment words per lane
    DH = D // 2
    U0, U1, U2, U3, U4, U8, U31 = (uint32(v) for v in (0, 1, 2, 3, 4, 8, 31))
    UD, UR, UNT = uint32(D), uint32(R), uint32(NT)
    F0, F1 = float32(0), float32(1)
    NEG_INF = float32(-math.inf)
    HT = HEAD_TILE
    ws = _warp_sync_fn()
    mma16 = mma_m16n8k16_f16
    mma884 = mma_m8n8k4_f16

    def kernel(q, k_cache, v_cache, pages, num_vpages, tail_len, keysrc, use_keys, groups, scale,
               out, lse):
        sk = cuda.shared.array((CT, D), float16)
        sv = cuda.shared.array((CT, D), float16)
        ss = cuda.shared.array((G, NPART, 16, HT), float32)   # scores (2 d-half partials on m8n8k4) -> P
        sa = cuda.shared.array((G, 4, HT), float32)       # per-page rescale factors
        sl_ = cuda.shared.array((G, HT), float32)          # final sums
        sbits = cuda.shared.array(NW, uint32)
        spre = cuda.shared.array(NW, int32)
        sppg = cuda.shared.array(KEY_WINDOW, int32)
        spsl = cuda.shared.array(KEY_WINDOW, int32)
        skey = cuda.shared.array(16, int32)
        sctl = cuda.shared.array(4, int32)                 # frontier, cut, stage count, max tiles
        swc = cuda.shared.array(G, int32)                  # per-warp: bad flag, then pages in stage
        scr = cuda.shared.array((G, SCRATCH_WORDS), uint32)
        tid = uint32(cuda.threadIdx.x)
        warp = tid >> uint32(5)
        lane = tid & U31
        grp = uint32(cuda.blockIdx.x)
        j = uint32(cuda.blockIdx.y)
        ht = uint32(cuda.blockIdx.z)
        num_pages = int32(k_cache.shape[0])
        page_size = int32(k_cache.shape[1])
        hkv = uint32(k_cache.shape[2])
        hg = uint32(q.shape[1]) // hkv
        h0 = j * hg + ht * uint32(HT)
        nh = min(uint32(HT), hg - ht * uint32(HT))
        g0 = uint32(groups[grp, 0])
        gcount = uint32(groups[grp, 1])
        row = g0 + warp
        live = warp < gcount
        keyed = use_keys != int32(0)

        # ---- validate this warp's row: page ids, slots and keys in range, keys increasing
        if lane == U0:
            swc[warp] = int32(0)
        nv = int32(0)
        tl = int32(0)
        if live:
            nv = min(max(int32(num_vpages[row]), int32(0)), int32(pages.shape[1]))
            tl = int32(tail_len[row])
        cuda.syncthreads()
        if live:
            if _lane_finds_bad_page(row, lane, nv, tl, pages, keysrc, keyed, num_pages, page_size, R):
                swc[warp] = int32(1)
        cuda.syncthreads()
        if swc[warp] != int32(0):
            nv = int32(0)
        cuda.syncthreads()

        # ---- Q^T fragments of this row's 8 heads (zero for padding heads / idle warps)
        qf = cuda.local.array(NQ, uint32)
        for x in range(NQ):
            ks = uint32(x) >> U1
            jj = uint32(x) & U1
            if M16:
                n = lane >> U2
                dd = uint32(16) * ks + U2 * (lane & U3) + U8 * jj
            else:
                n = (lane & U3) + U4 * (lane >> uint32(4))
                dd = ((lane >> U3) & U1) * uint32(DH) + U4 * ks + U2 * jj   # d half of the quad-pair
            w = uint32(0)
            if live and n < nh and dd < UD:
                w = pack_f16x2(float32(q[row, h0 + n, dd]), float32(q[row, h0 + n, dd + U1]))
            qf[x] = w
        oacc = cuda.local.array(NOACC, float32)
        for x in range(NOACC):
            oacc[x] = F0
        sv4 = cuda.local.array(4, float32)
        m_run = NEG_INF          # lanes 0..7: running max and sum of head `lane`
        l_run = F0

        cur = int32(0)
        while True:
            if tid == U0:
                sctl[0] = int32(INT_MAX)
            cuda.syncthreads()
            if lane == U0 and cur < nv:
                kf = cur
                if keyed:
                    kf = int32(keysrc[row, uint32(cur) * UR]) // int32(R)
                cuda.atomic.min(sctl, 0, kf)
            for x in range(tid, uint32(NW), UNT):
                sbits[x] = U0
            cuda.syncthreads()
            front = sctl[0]
            if front == int32(INT_MAX):
                break
            # mark the keys of every row inside the window
            for v in range(uint32(cur) + lane, uint32(nv), uint32(32)):
                kk = int32(v)
                if keyed:
                    kk = int32(keysrc[row, v * UR]) // int32(R)
                off = kk - front
                if off >= int32(KEY_WINDOW):
                    break
                cuda.atomic.or_(sbits, off >> int32(5), U1 << uint32(off & int32(31)))
                sppg[off] = int32(pages[row, v, 0])
                spsl[off] = int32(pages[row, v, 1])
            cuda.syncthreads()
            # thread 0: keep the first C marked keys; prefix counts for the slot lookup
            if tid == U0:
                acc = int32(0)
                cut = int32(KEY_WINDOW)
                for x in range(NW):
                    wbits = sbits[x]
                    c = int32(cuda.popc(wbits))
                    if acc + c > int32(C):
                        keep = int32(C) - acc
                        rest = wbits
                        for _ in range(keep):
                            rest &= rest - U1
                        pos = int32(cuda.ffs(rest)) - int32(1)     # first key left out
                        if cut == int32(KEY_WINDOW):
                            cut = int32(x) * int32(32) + pos
                        wbits = wbits & ((U1 << uint32(pos)) - U1)
                    sbits[x] = wbits
                    spre[x] = acc
                    bits = wbits
                    while bits != U0:
                        pos = int32(cuda.ffs(bits)) - int32(1)
                        skey[acc] = int32(x) * int32(32) + pos
                        acc += int32(1)
                        bits &= bits - U1
                sctl[1] = cut
                sctl[2] = acc
                sctl[3] = int32(0)
            cuda.syncthreads()
            nstage = uint32(sctl[2])
            cut = sctl[1]
            # load the stage: K and V of nstage pages, 4 tokens each (slots past the page end -> 0)
            for e in range(tid, nstage * U4 * UD, UNT):
                tt = e // UD
                dd = e - tt * UD
                off = skey[tt >> U2]
                pg = sppg[off]
                sl = spsl[off] + int32(tt & U3)
                kx = float16(0)
                vx = float16(0)
                if sl < page_size:
                    kx = float16(k_cache[pg, sl, j, dd])
                    vx = float16(v_cache[pg, sl, j, dd])
                sk[tt, dd] = kx
                sv[tt, dd] = vx
            # this warp's pages in the stage: keys below front + cut
            if lane == U0:
                cnt = int32(0)
                v = cur
                while v < nv:
                    kk = v
                    if keyed:
                        kk = int32(keysrc[row, uint32(v) * UR]) // int32(R)
                    if kk - front >= cut:
                        break
                    cnt += int32(1)
                    v += int32(1)
                swc[warp] = cnt
                cuda.atomic.max(sctl, 3, (cnt + int32(3)) // int32(4))
            cuda.syncthreads()
            mine = swc[warp]
            ntiles = sctl[3]
            for tile in range(ntiles):
                tb = cur + int32(tile) * int32(4)
                # ---- S^T = K Q^T for the tile's 4 pages
                if M16:
                    g = lane >> U2
                    t = lane & U3
                    ok0, base0, len0 = _page_row(cur, mine, tb, g >> U2, keysrc, row, keyed, front,
                                                 sbits, spre, nv, tl, UR)
                    ok1, base1, len1 = _page_row(cur, mine, tb, U2 + (g >> U2), keysrc, row, keyed,
                                                 front, sbits, spre, nv, tl, UR)
                    r0 = base0 + (g & U3)
                    r1 = base1 + (g & U3)
                    sacc = (F0, F0, F0, F0)
                    for ks in range(D // 16):
                        c0 = uint32(16) * uint32(ks) + U2 * t
                        a0 = U0
                        a1 = U0
                        a2 = U0
                        a3 = U0
                        if ok0:
                            a0 = pack_f16x2(sk[r0, c0], sk[r0, c0 + U1])
                            a2 = pack_f16x2(sk[r0, c0 + U8], sk[r0, c0 + uint32(9)])
                        if ok1:
                            a1 = pack_f16x2(sk[r1, c0], sk[r1, c0 + U1])
                            a3 = pack_f16x2(sk[r1, c0 + U8], sk[r1, c0 + uint32(9)])
                        sacc = mma16((a0, a1, a2, a3), (qf[2 * ks], qf[2 * ks + 1]), sacc,
                                     scr[warp], lane)
                    for i in range(4):
                        tok = g + U8 * (uint32(i) >> U1)
                        okp = ok0
                        lnp = len0
                        if i >= 2:
                            okp = ok1
                            lnp = len1
                        s = NEG_INF
                        if okp and int32(tok & U3) < lnp:
                            s = sacc[i] * scale
                        ss[warp, 0, tok, U2 * t + (uint32(i) & U1)] = s
                else:
                    qp = (lane >> U2) & U3
                    hi = lane >> uint32(4)
                    th = qp & U1
                    dh = qp >> U1
                    okp, basep, lnp = _page_row(cur, mine, tb, U2 * th + hi, keysrc, row, keyed,
                                                front, sbits, spre, nv, tl, UR)
                    rr = basep + (lane & U3)
                    sacc8 = (F0, F0, F0, F0, F0, F0, F0, F0)
                    for ks in range(D // 8):
                        c0 = dh * uint32(DH) + U4 * uint32(ks)
                        a0 = U0
                        a1 = U0
                        if okp:
                            a0 = pack_f16x2(sk[rr, c0], sk[rr, c0 + U1])
                            a1 = pack_f16x2(sk[rr, c0 + U2], sk[rr, c0 + U3])
                        sacc8 = mma884(a0, a1, qf[2 * ks], qf[2 * ks + 1], sacc8, scr[warp], lane)
                    for i in range(8):
                        tok = U8 * th + (lane & U1) + (uint32(i) & U2) + U4 * hi
                        col = (uint32(i) & U4) + (lane & U2) + (uint32(i) & U1)
                        ss[warp, dh, tok, col] = sacc8[i]
                ws()
                # ---- online softmax, one virtual page at a time (lanes 0..7 = heads)
                if lane < uint32(HT):
                    for p in range(4):
                        okq, baseq, lnq = _page_row(cur, mine, tb, uint32(p), keysrc, row, keyed,
                                                    front, sbits, spre, nv, tl, UR)
                        cmax = NEG_INF
                        for x in range(4):
                            tok = uint32(4 * p + x)
                            if M16:
                                s = ss[warp, 0, tok, lane]
                            else:
                                s = NEG_INF
                                if okq and int32(x) < lnq:
                                    s = (ss[warp, 0, tok, lane] + ss[warp, 1, tok, lane]) * scale
                            sv4[x] = s
                            cmax = max(cmax, s)
                        alpha = F1
                        if cmax > m_run:
                            alpha = F0
                            if m_run != NEG_INF:
                                alpha = math.exp(m_run - cmax)
                            m_run = cmax
                        l_run *= alpha
                        for x in range(4):
                            pr = F0
                            if sv4[x] != NEG_INF:
                                pr = math.exp(sv4[x] - m_run)
                            l_run += pr
                            ss[warp, 0, uint32(4 * p + x), lane] = pr
                        sa[warp, p, lane] = alpha
                ws()
                # ---- O^T = O^T * alpha + V^T P^T, one page per mma chain
                for p in range(4):
                    okq, baseq, lnq = _page_row(cur, mine, tb, uint32(p), keysrc, row, keyed, front,
                                                sbits, spre, nv, tl, UR)
                    if M16:
                        g = lane >> U2
                        t = lane & U3
                        al0 = sa[warp, p, U2 * t]
                        al1 = sa[warp, p, U2 * t + U1]
                        b0 = U0
                        tk0 = U2 * t
                        use = okq and t < U2
                        v0ok = use and int32(tk0) < lnq
                        v1ok = use and int32(tk0 + U1) < lnq
                        if use:
                            b0 = pack_f16x2(ss[warp, 0, uint32(4 * p) + tk0, g],
                                            ss[warp, 0, uint32(4 * p) + tk0 + U1, g])
                        for mt in range(NMT):
                            dd = uint32(16 * mt) + g
                            x0 = float16(0)
                            x1 = float16(0)
                            y0 = float16(0)
                            y1 = float16(0)
                            if v0ok:
                                x0 = sv[baseq + tk0, dd]
                                y0 = sv[baseq + tk0, dd + U8]
                            if v1ok:
                                x1 = sv[baseq + tk0 + U1, dd]
                                y1 = sv[baseq + tk0 + U1, dd + U8]
                            cc = (oacc[4 * mt] * al0, oacc[4 * mt + 1] * al1,
                                  oacc[4 * mt + 2] * al0, oacc[4 * mt + 3] * al1)
                            res = mma16((pack_f16x2(x0, x1), pack_f16x2(y0, y1), U0, U0), (b0, U0),
                                        cc, scr[warp], lane)
                            for i in range(4):
                                oacc[4 * mt + i] = res[i]
                    else:
                        nn = (lane & U3) + U4 * (lane >> uint32(4))
                        b0 = U0
                        b1 = U0
                        if okq:
                            b0 = pack_f16x2(ss[warp, 0, uint32(4 * p), nn],
                                            ss[warp, 0, uint32(4 * p + 1), nn])
                            b1 = pack_f16x2(ss[warp, 0, uint32(4 * p + 2), nn],
                                            ss[warp, 0, uint32(4 * p + 3), nn])
                        qp = (lane >> U2) & U3
                        for mt in range(NMT):
                            dd = uint32(32 * mt) + U8 * qp + (lane & U3) + U4 * (lane >> uint32(4))
                            e0 = float16(0)
                            e1 = float16(0)
                            e2 = float16(0)
                            e3 = float16(0)
                            if okq:
                                if lnq > int32(0):
                                    e0 = sv[baseq, dd]
                                if lnq > int32(1):
                                    e1 = sv[baseq + U1, dd]
                                if lnq > int32(2):
                                    e2 = sv[baseq + U2, dd]
                                if lnq > int32(3):
                                    e3 = sv[baseq + U3, dd]
                            cc8 = (oacc[8 * mt] * sa[warp, p, (lane & U2)],
                                   oacc[8 * mt + 1] * sa[warp, p, (lane & U2) + U1],
                                   oacc[8 * mt + 2] * sa[warp, p, (lane & U2)],
                                   oacc[8 * mt + 3] * sa[warp, p, (lane & U2) + U1],
                                   oacc[8 * mt + 4] * sa[warp, p, U4 + (lane & U2)],
                                   oacc[8 * mt + 5] * sa[warp, p, U4 + (lane & U2) + U1],
                                   oacc[8 * mt + 6] * sa[warp, p, U4 + (lane & U2)],
                                   oacc[8 * mt + 7] * sa[warp, p, U4 + (lane & U2) + U1])
                            res8 = mma884(pack_f16x2(e0, e1), pack_f16x2(e2, e3), b0, b1, cc8,
                                          scr[warp], lane)
                            for i in range(8):
                                oacc[8 * mt + i] = res8[i]
                ws()
            cur += mine
            cuda.syncthreads()

        # ---- normalise and write (idle warps write nothing)
        if lane < uint32(HT):
            sl_[warp, lane] = l_run
            if live and lane < nh:
                lv = NEG_INF
                if l_run > F0:
                    lv = m_run + math.log(l_run)
                lse[row, h0 + lane] = lv
        ws()
        if live:
            for mt in range(NMT):
                for i in range(4 if M16 else 8):
                    if M16:
                        dd = uint32(16 * mt) + (lane >> U2) + U8 * (uint32(i) >> U1)
                        hh = U2 * (lane & U3) + (uint32(i) & U1)
                        val = oacc[4 * mt + i]
                    else:
                        dd = (uint32(32 * mt) + U8 * ((lane >> U2) & U3) + (lane & U1)
                              + (uint32(i) & U2) + U4 * (lane >> uint32(4)))
                        hh = (uint32(i) & U4) + (lane & U2) + (uint32(i) & U1)
                        val = oacc[8 * mt + i]
                    if hh < nh:
                        lh = sl_[warp, hh]
                        o = F0
                        if lh > F0:
                            o = val / lh
                        out[row, h0 + hh, dd] = o

    kernel.__name__ = f"page4_attention_{kind}_d{D}_g{G}"
    kernel.__qualname__ = kernel.__name__
    k = jit(kernel)
    k.threads = NT
    k.stage_pages = C
    return k


@device_jit(forceinline=True)
def _page_row(cur, mine, tb, p, keysrc, row, keyed, front, sbits, spre, nv, tl, ur):
    """Page ``p`` (0..3) of the tile starting at own page ``tb``: (valid, first stage row, length)."""
    v = tb + int32(p)
    if v >= cur + mine or v < int32(0):
        return False, uint32(0), int32(0)
    kk = v
    if keyed:
        kk = int32(keysrc[row, uint32(v) * ur]) // int32(ur)
    off = uint32(kk - front)
    w = off >> uint32(5)
    b = off & uint32(31)
    below = sbits[w] & ((uint32(1) << b) - uint32(1))
    slot = uint32(spre[w]) + uint32(cuda.popc(below))
    ln = int32(4)
    if v == nv - int32(1) and tl > int32(0):
        ln = tl
    return True, slot * uint32(4), ln



@device_jit(forceinline=True)
def _lane_finds_bad_page(row, lane, nv, tl, pages, keysrc, keyed, num_pages, page_size, r):
    """Whether one of this lane's virtual pages of ``row`` (``lane, lane + 32, ...``) is malformed:
    a page id or slot range outside the cache, a tail length outside ``0..r-1``, or (``keyed``) a
    logical key that is negative or not increasing. The caller makes such a row inert."""
    bad = tl < int32(0) or tl >= int32(r)
    for v in range(uint32(lane), uint32(nv), uint32(32)):
        pg = int32(pages[row, v, 0])
        sl = int32(pages[row, v, 1])
        ln = int32(r)
        if int32(v) == nv - int32(1) and tl > int32(0):
            ln = tl
        if pg < int32(0) or pg >= num_pages or sl < int32(0) or sl + ln > page_size:
            bad = True
        if keyed:
            kv = int32(keysrc[row, v * uint32(r)])
            if kv < int32(0):
                bad = True
            if v > uint32(0):
                if int32(keysrc[row, (v - uint32(1)) * uint32(r)]) // int32(r) >= kv // int32(r):
                    bad = True
    return bad



def page4_windows(rows, group_rows):
    """``[n, 2]`` int32 (first row, count): consecutive windows of ``group_rows`` rows.

    Windows depend on the row count alone, so they are formed without reading ``req_ids`` on the host
    (no synchronisation; CUDA-graph capturable). Rows of different requests may share a window:
    :func:`make_window_keys_kernel` keeps their keys apart.
    """
    first = np.arange(0, rows, max(1, int(group_rows)), dtype=np.int32)
    return np.stack([first, np.minimum(int(group_rows), rows - first)], axis=1).astype(np.int32)


#: Keys of rows of different requests inside one window differ by a multiple of this (token ids
#: stay below it: 2^27 = 134M tokens); at most 7 request changes fit a window of 8 rows in int32.
KEY_REQ_STRIDE = 1 << 27


@functools.lru_cache(maxsize=None)
def make_window_keys_kernel(group_rows, threads):
    """``keys[i, k] = tokens[i, k] + KEY_REQ_STRIDE * c_i``, ``c_i`` the request changes between the
    first row of row ``i``'s window and row ``i``.

    The grouped kernel shares staged pages between rows whose logical keys are equal; adding the
    change count makes equal keys imply the same request, so any window of rows is safe. One block
    per row, ``threads`` threads over the row's tokens; no shared memory.
    """
    GR, NT = uint32(group_rows), uint32(threads)
    STRIDE = int32(KEY_REQ_STRIDE)

    def kernel(tokens, req_ids, keys):
        row = uint32(cuda.blockIdx.x)
        first = (row // GR) * GR
        changes = int32(0)
        for x in range(first + uint32(1), row + uint32(1)):
            if req_ids[x] != req_ids[x - uint32(1)]:
                changes += int32(1)
        for k in range(uint32(cuda.threadIdx.x), uint32(keys.shape[1]), NT):
            keys[row, k] = tokens[row, k] + changes * STRIDE

    kernel.__name__ = f"page4_window_keys_g{group_rows}"
    kernel.__qualname__ = kernel.__name__
    return jit(kernel)


#: One warp per row holds that row's O^T (d 256 x 8 heads) in registers: ~160-210 registers a
#: thread (resource report), so 8 warps is the largest block that fits 64K registers. A profile
#: asking for 16 rows gets 8 until a two-rows-per-warp variant exists.
MAX_GROUP_ROWS = 8


def page4_group_rows(profile):
    """Rows per group: the profile's (at most 8); 4 in the simulator (one OS thread per CUDA thread)."""
    return 4 if SIMULATOR else min(MAX_GROUP_ROWS, int(profile.attention.group_rows))


def _window_keys(tokens, req_ids, keys, gr, stream):
    """Fill ``keys`` for windows of ``gr`` rows (see :func:`make_window_keys_kernel`)."""
    k = make_window_keys_kernel(int(gr), 32 if SIMULATOR else 256)
    k[tokens.shape[0], 32 if SIMULATOR else 256, stream](tokens, req_ids, keys)
    return keys


def launch_page4(q, k_cache, v_cache, pages, num_vpages, tail_len, req_ids, scale, out, lse, profile,
                 stream, r=4, tokens=None, keys=None, group_rows=None):
    """Grouped route on device arrays.

    With ``tokens`` (the selection the plan was made from) rows are taken in windows of
    ``group_rows`` consecutive rows that share staged pages by logical key; ``keys`` is an int32
    buffer shaped like ``tokens`` for those keys (allocated when None; pass a workspace buffer to
    keep repeated calls allocation-free). Without ``tokens`` every row is its own group. Nothing is
    read back to the host and launch metadata comes from :func:`numqsa.device.constant`, so the
    launch can be captured in a CUDA graph.
    """
    from .. import device as dev
    rows, hq, d = q.shape
    hkv = k_cache.shape[2]
    if rows == 0:
        return out, lse
    kind = profile.attention.mma
    gr = int(group_rows or page4_group_rows(profile))
    if tokens is None:
        gr = 1
        keys = dev.constant(np.zeros((1, 1), np.int32), stream)
        use_keys = np.int32(0)
    else:
        if keys is None:       # keys of the planned pages' first tokens only
            keys = dev.empty(keys_shape(tokens, pages, r), np.int32, stream)
        _window_keys(tokens, req_ids, keys, gr, stream)
        use_keys = np.int32(1)
    windows = page4_windows(rows, gr)
    dgroups = dev.constant(windows, stream)
    hg = hq // hkv
    grid = (windows.shape[0], hkv, -(-hg // HEAD_TILE))
    k = make_page4_kernel(int(d), gr, kind, int(r))
    k[grid, k.threads, stream](q, k_cache, v_cache, pages, num_vpages, tail_len, keys, use_keys,
                               dgroups, np.float32(scale), out, lse)
    return out, lse


def _resource_cases():
    k = make_plan_kernel(128, 4)
    sig = ("void(int32[:, :], int32[:], int32[:, :], int32[:], int32[:], int32[:], int32[:, :, :], "
           "int32[:], int32[:])")
    cases = [("page4_plan", k, sig, 128, 0, None),
             ("page4_window_keys", make_window_keys_kernel(6, 256),
              "void(int32[:, :], int32[:], int32[:, :])", 256, 0, None)]
    gsig = ("void(float16[:, :, :], float16[:, :, :, :], float16[:, :, :, :], int32[:, :, :], int32[:], "
            "int32[:], int32[:, :], int32, int32[:, :], float32, float16[:, :, :], float32[:, :])")
    for kind, cc, rows in (("m8n8k4", (7, 0), 4), ("m8n8k4", (7, 0), 8), ("m8n8k4", (9, 0), 8),
                           ("m16n8k16", (9, 0), 8)):
        kern = make_page4_kernel(256, rows, kind)
        cases.append((f"page4_{kind}_g{rows}", kern, gsig, 32 * rows, 0, cc))
    return cases


RESOURCE_CASES = _resource_cases()
