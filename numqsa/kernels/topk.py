"""Top-k groups per row (spec §5): exactly ``min(Kb, nb)`` groups by (score desc, group id asc).

Every visible group gets the 64-bit key ``(ordered score bits) << 32 | (~group id)``; the keys are
unique, so the ``Kb`` largest form a set with no ties to break. The kernels never build the keys:
a radix select over the 32 ordered score bits finds the ``Kb``-th best score ``s*`` and how many
groups ``m`` scoring exactly ``s*`` are needed; those are the ``m`` lowest group ids among the
equal ones (the low key half). The result is bitwise deterministic (atomics only count), holds on
plateaus of exact zeros, and is written ascending. Three kernels, one block per row, routed by the
row length (:func:`topk_route`):

- **registers** (up to 8,192 groups: 32K tokens): the row read once into registers, level 1 binned
  relative to the row's best score (:func:`make_topk_register_kernel`);
- **bitmap** (up to 32,768 groups: 131K tokens): a 4096-bin first level, then candidates in shared
  memory, or the bin's ties straight away (:func:`make_topk_bitmap_kernel`);
- **radix** (longer rows): four 8-bit levels streamed from global memory (:func:`make_topk_kernel`).

Scores are read as their uint32 bit patterns (a float32 array viewed as uint32); ``-0.0`` counts as
``+0.0``. A NaN score ranks above every number, NaNs tying (lowest group ids first), as in the oracle.

Every architecture; the register kernel's block is 512 threads x 16 keys on sm_80+ and 1024 x 8 on
sm_70, where 512 x 16 spills (``TopkProfile.register_threads``, the resource report). Why these
routes, on the H200 (GPU-only ms; ``docs/kernels/topk.md``): the register kernel's record at
4096 x 32K is 0.209 against ``torch.topk``'s 0.634, where the bitmap kernel took 0.372 (session
4); the bitmap kernel against radix in run 2, 4096 x 32K 0.368 / 0.454 and 8192 x 131K 1.609 /
4.146 (``bench/results/history/2026-11-29-fb253d2-selection-kernel-variants/``). Radix takes the
rows past the bitmap kernel's 32,768 groups.
"""
import functools

from numba import cuda, int32, uint32, uint64

from ..jit import SIMULATOR, device_jit, jit
from .common import row_state

FULL_MASK = uint32(0xFFFFFFFF)
SIGN = uint32(0x80000000)
EXP_MASK = uint32(0x7F800000)     # +inf; larger magnitudes are NaN
ABS_MASK = uint32(0x7FFFFFFF)
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
    """float32 bits -> uint32 whose unsigned order is the float order; -0.0 maps like +0.0.

    Every NaN (either sign, any payload) maps to the one largest key: NaN ranks above +inf, and
    NaNs tie, so the lowest group ids among them win (``torch.topk``'s order; the oracle's rule).
    Branch-free (selects): it runs once per score and pass."""
    b = uint32(0) if b == SIGN else b
    flip = uint32(uint32(0) - (b >> uint32(31)))  # all ones for negatives
    k = uint32(b ^ (flip | SIGN))                 # negatives: ~b, others: b | sign
    return FULL_MASK if (b & ABS_MASK) > EXP_MASK else k


@device_jit(forceinline=True)
def _visible(i, req_ids, positions, seq_lens, r, width):
    """Row ``i``'s visible groups (spec §4), at most the score block's ``width``."""
    req, p, nbi = row_state(i, req_ids, positions, seq_lens, r)
    return uint32(min(nbi, int32(width)))


@device_jit(forceinline=True)
def _take_all(groups, i, nb, tid, threads, kb):
    """A row that sees ``nb <= Kb`` groups takes groups ``0 .. nb-1`` and pads with -1 (no select)."""
    for j in range(tid, uint32(kb), uint32(threads)):
        g = int32(-1)
        if j < nb:
            g = int32(j)
        groups[i, j] = g


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
        nb = _visible(i, req_ids, positions, seq_lens, r, score_bits.shape[1])
        if nb <= uint32(KB):
            _take_all(groups, i, nb, tid, NT, KB)
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
                    run_bin, run_cnt = _count(hist, (k >> shift) & uint32(255), run_bin, run_cnt)
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


ROUTES = ("registers", "bitmap", "radix")


def topk_route(num_groups):
    """The kernel a score block of ``num_groups`` columns takes: the register kernel up to
    :func:`register_groups`, the bitmap kernel up to ``bitmap_shape()[1]``, then the radix one."""
    if num_groups <= register_groups():
        return "registers"
    return "bitmap" if num_groups <= bitmap_shape()[1] else "radix"


def launch_topk(score_bits, req_ids, positions, seq_lens, groups, profile, stream, r=4,
                route=None, threads=None):
    """``score_bits`` is the float32 score matrix viewed as uint32; ``groups [rows, Kb]`` int32 is written.

    ``route`` (one of :data:`ROUTES`; default :func:`topk_route`) and ``threads`` force a kernel and
    its block size, for tests and benchmarks; a route too small for the rows is refused."""
    rows, kb = groups.shape
    if rows == 0:
        return groups
    width = score_bits.shape[1]
    route = route or topk_route(width)
    if route == "registers":
        nt, per = register_shape(threads or profile.topk.register_threads)
        k = make_topk_register_kernel(nt, per, int(kb), int(r))
    elif route == "bitmap":
        k = make_topk_bitmap_kernel(*bitmap_shape(threads), int(kb), int(r))
    elif route == "radix":
        k = make_topk_kernel(threads or topk_threads(profile), int(kb), int(r))
    else:
        raise ValueError(f"unknown top-k route {route!r}; expected one of {ROUTES}")
    if width > getattr(k, "gmax", width):
        raise ValueError(f"the {route} top-k takes rows of at most {k.gmax} groups, got {width}")
    k[rows, k.threads, stream](score_bits, req_ids, positions, seq_lens, groups)
    return groups




# ------------------------------------------------------------------------------------------------
# Bitmap top-k: rows of up to ``gmax`` groups (32,768 on a GPU: 131K tokens at r = 4)
# ------------------------------------------------------------------------------------------------

HIST_BINS = 4096
LOAD_BATCH = 8      # scores loaded per thread before any is processed (16 spills: docs/kernels/topk.md)
# radix levels over the 32 ordered bits: (shift, width), most significant first
LEVELS = ((20, 12), (8, 12), (0, 8))

if SIMULATOR:
    @device_jit
    def _mark_word(bm, e, pred, lane):
        if pred:
            cuda.atomic.or_(bm, e >> uint32(5), uint32(1) << (e & uint32(31)))

    @device_jit
    def _append_slot(cnt, pred, lane):
        slot = int32(-1)
        if pred:
            slot = cuda.atomic.add(cnt, 0, int32(1))
        return slot
else:
    @device_jit
    def _mark_word(bm, e, pred, lane):
        # the 32 lanes hold e = 32*w + lane: one ballot is bitmap word w (plain store, no atomics)
        w = cuda.ballot_sync(FULL_MASK, pred)
        if lane == uint32(0):
            bm[uint32(e >> uint32(5))] = w

    @device_jit
    def _append_slot(cnt, pred, lane):
        # warp-aggregated append: one shared atomic per warp, slots in lane order
        b = cuda.ballot_sync(FULL_MASK, pred)
        slot = int32(-1)
        if b != uint32(0):
            base = int32(0)
            if lane == uint32(0):
                base = cuda.atomic.add(cnt, 0, int32(cuda.popc(b)))
            base = cuda.shfl_sync(FULL_MASK, base, 0)
            if pred:
                slot = base + int32(cuda.popc(b & ((uint32(1) << lane) - uint32(1))))
        return slot


if SIMULATOR:
    @device_jit
    def _block_max(v, lane, slot, at):
        cuda.atomic.max(slot, at, v)
else:
    @device_jit
    def _block_max(v, lane, slot, at):
        """``slot[at] = max(slot[at], v over the block)``; ``slot[at]`` zeroed and synced before."""
        # butterfly over the warp (unsigned keys through 32-bit shuffles), one atomic per warp
        off = uint32(16)
        while off > uint32(0):
            v = max(v, uint32(cuda.shfl_xor_sync(FULL_MASK, int32(v), off)))
            off >>= uint32(1)
        if lane == uint32(0):
            cuda.atomic.max(slot, at, v)


@device_jit
def _count(hist, b, run_bin, run_cnt):
    """Run-length merged histogram add: an atomic only when the bin changes. -> (run_bin, run_cnt)"""
    if b == run_bin:
        return run_bin, int32(run_cnt + int32(1))
    if run_cnt > int32(0):
        cuda.atomic.add(hist, run_bin, run_cnt)
    return b, int32(1)


BITMAP_THREADS = 512


def bitmap_shape(threads=None):
    """(threads, gmax, candidate capacity). GPU: 512 threads (51 registers: 2 blocks per SM keep
    ~34 MB of 128 KB rows in flight, inside the H200's 50 MB L2, so the second read of a row hits
    L2), 32,768 groups (8 KB of bitmaps), 2,048 candidates (16 KB). Simulator: 32 threads, 128
    groups, 16 candidates (small enough that the tests exercise the fallback over global memory)."""
    if SIMULATOR:
        return 32, 128, 16
    return threads or BITMAP_THREADS, 32768, 2048


@functools.lru_cache(maxsize=None)
def make_emit(threads, words):
    """Device fn ``emit(gt, eq, need, ties, groups, i, tid, scr)``: write row ``i``'s selection,
    ascending.

    ``gt`` and ``eq`` are shared bitmaps of ``words`` words over the row's groups: the groups above
    the threshold and those equal to it. All of ``gt`` is taken, then the ``need`` lowest groups of
    ``eq`` (the tie rule). Thread ``t`` owns words ``t*WPT .. t*WPT + WPT - 1``; two block scans
    (popcounts of the equal, then of the kept words) give each word its place; ``ties`` False (the
    block agrees) means ``eq`` is empty and skips the first. Every thread calls it.
    """
    NT = threads
    WORDS = words
    WPT = max(1, -(-WORDS // NT))
    block_scan = make_block_scan(NT)

    @device_jit
    def emit(gt, eq, need, ties, groups, i, tid, scr):
        selw = cuda.local.array(WPT, uint32)
        w0 = tid * uint32(WPT)
        eb = int32(0)
        if ties:
            eqc = int32(0)
            for j in range(WPT):
                if w0 + uint32(j) < uint32(WORDS):
                    eqc += int32(cuda.popc(eq[w0 + uint32(j)]))
            incl, total = block_scan(eqc, tid, scr)
            eb = incl - eqc
        cnt = int32(0)
        for j in range(WPT):
            s = uint32(0)
            if w0 + uint32(j) < uint32(WORDS):
                q = eq[w0 + uint32(j)] if ties else uint32(0)
                pq = int32(cuda.popc(q))
                keep = need - eb
                if keep <= int32(0):
                    q = uint32(0)
                elif keep < pq:            # the `keep` lowest bits of q
                    x = q
                    for _ in range(keep):
                        x &= x - uint32(1)
                    q ^= x
                eb += pq
                s = gt[w0 + uint32(j)] | q
            selw[j] = s
            cnt += int32(cuda.popc(s))
        incl, total = block_scan(cnt, tid, scr)
        pos = incl - cnt
        for j in range(WPT):
            s = selw[j]
            base = (w0 + uint32(j)) * uint32(32)
            while s != uint32(0):
                low = s & (~s + uint32(1))
                groups[i, pos] = int32(base + uint32(cuda.popc(low - uint32(1))))
                pos += int32(1)
                s ^= low
    return emit


@functools.lru_cache(maxsize=None)
def make_topk_bitmap_kernel(threads, gmax, cap, kb, r):
    """Top-k of rows with ``nb <= gmax``: radix select with a 4096-bin histogram, then bitmaps.

    One block of ``threads`` per row. Level 1 histograms the top 12 ordered bits of the row's
    visible scores (one read of the row); the bin holding the ``Kb``-th best key is found by a block
    scan. If that bin holds at most ``cap`` keys, a second read marks every key of a higher bin in
    the "greater" bitmap (one ballot per 32 groups) and appends the bin's keys to a shared candidate
    list, and the remaining 12 + 8 bits are resolved in shared memory. Otherwise the second read
    marks the groups above the bin and in it and finds the bin's min and max key: equal, the bin's
    keys are exact ties (zero plateaus, few distinct values) and the marks are the answer; else the
    levels continue over global memory and a last read marks "greater" and "equal" bitmaps with
    the exact threshold. The per-score loops are written in 32-bit arithmetic (numba widens uint32
    to 64 bits otherwise: 7% of the time at 8192 x 131K). Output: exclusive scans over the bitmap
    words give each selected group its place; the ``m`` lowest equal groups are kept (the tie
    rule), so the result is exact, deterministic (no atomic order matters) and ascending.
    Shared memory: ``4096*4 + cap*8 + gmax/4 + scan scratch`` bytes (40 KB on a GPU).
    """
    NT = threads
    KB = kb
    WORDS = gmax // 32
    if WORDS % NT and WORDS > NT:
        raise ValueError("gmax/32 must be a multiple of threads")
    BPTMAX = max(1, HIST_BINS // NT)
    SCR = scan_scratch(NT)
    CAP = cap
    block_scan = make_block_scan(NT)
    emit = make_emit(NT, WORDS)
    U31 = uint32(31)
    UN = LOAD_BATCH

    @device_jit
    def _load_batch(score_bits, i, e, nb, vals):
        # UN independent loads in flight per thread: one dependent load per element left the
        # passes latency-bound (~1 TB/s measured on the H200)
        for j in range(UN):
            x = uint32(e + uint32(NT * j))
            v = uint32(0)
            if x < nb:
                v = score_bits[i, x]
            vals[j] = v

    @jit(launch_bounds=(NT, max(1, 1024 // NT)))   # <= 64 registers: two 512-thread blocks per SM
    def topk_bitmap(score_bits, req_ids, positions, seq_lens, groups):
        hist = cuda.shared.array(HIST_BINS, int32)
        cand_k = cuda.shared.array(CAP, uint32)
        cand_e = cuda.shared.array(CAP, uint32)
        gt = cuda.shared.array(WORDS, uint32)
        eq = cuda.shared.array(WORDS, uint32)
        state = cuda.shared.array(3, int32)
        mm = cuda.shared.array(2, uint32)       # a big bin's max key and max ~key
        ccount = cuda.shared.array(1, int32)
        scr = cuda.shared.array(SCR, int32)
        vals = cuda.local.array(UN, uint32)
        tid = uint32(cuda.threadIdx.x)
        lane = tid & U31
        i = uint32(cuda.blockIdx.x)
        nb = _visible(i, req_ids, positions, seq_lens, r, score_bits.shape[1])
        if nb <= uint32(KB):
            _take_all(groups, i, nb, tid, NT, KB)
            return
        nbpad = (nb + U31) & ~U31          # whole warps in the marking loops (ballots)

        for w in range(tid, uint32(WORDS), uint32(NT)):
            gt[w] = uint32(0)
            eq[w] = uint32(0)
        if tid == uint32(0):
            ccount[0] = int32(0)
            mm[0] = uint32(0)
            mm[1] = uint32(0)
        prefix = uint32(0)
        mask = uint32(0)
        need = int32(KB)
        collected = False
        single = False                       # gt and eq hold the exact selection and ties
        for lev in range(3):
            shift = uint32(20) if lev == 0 else (uint32(8) if lev == 1 else uint32(0))
            nbins = uint32(HIST_BINS) if lev < 2 else uint32(256)
            bmask = nbins - uint32(1)
            for b in range(tid, nbins, uint32(NT)):
                hist[b] = int32(0)
            cuda.syncthreads()
            if collected:
                ncand = uint32(ccount[0])
                for j in range(tid, ncand, uint32(NT)):
                    k = cand_k[j]
                    if uint32(k & mask) == prefix:
                        cuda.atomic.add(hist, uint32(uint32(k >> shift) & bmask), int32(1))
            else:
                # run-length merged: an all-zero plateau costs one atomic per thread, not one per
                # score (a warp-aggregated match.any measured slower: 0.57 vs 0.47 ms at 4096 x 32K)
                # (32-bit casts throughout the per-score loops: numba widens uint32 arithmetic)
                run_bin = uint32(0)
                run_cnt = int32(0)
                e0 = uint32(0)
                while e0 < nb:
                    _load_batch(score_bits, i, uint32(e0 + tid), nb, vals)
                    for j in range(UN):
                        if uint32(e0 + tid + uint32(NT * j)) < nb:
                            k = ordered_bits(vals[j])
                            if uint32(k & mask) == prefix:
                                run_bin, run_cnt = _count(hist, uint32(uint32(k >> shift) & bmask),
                                                          run_bin, run_cnt)
                    e0 = uint32(e0 + uint32(NT * UN))
                if run_cnt > int32(0):
                    cuda.atomic.add(hist, run_bin, run_cnt)
            cuda.syncthreads()
            # thread t owns bins nbins-1 - t*bpt - j (descending): an inclusive scan counts keys above
            bpt = max(uint32(1), nbins // uint32(NT))
            local = int32(0)
            for j in range(BPTMAX):
                bb = int32(nbins) - int32(1) - int32(tid * bpt) - int32(j)
                if uint32(j) < bpt and bb >= int32(0):
                    local += hist[bb]
            incl, total = block_scan(local, tid, scr)
            above = incl - local
            for j in range(BPTMAX):
                bb = int32(nbins) - int32(1) - int32(tid * bpt) - int32(j)
                if uint32(j) < bpt and bb >= int32(0):
                    c = hist[bb]
                    if above < need and need <= above + c:
                        state[0] = bb
                        state[1] = need - above
                        state[2] = c
                    above += c
            cuda.syncthreads()
            prefix = uint32(prefix | uint32(uint32(state[0]) << shift))
            mask = uint32(mask | uint32(bmask << shift))
            need = state[1]
            cbin = state[2]
            cuda.syncthreads()
            if cbin == need:                 # the whole bin is taken: no finer digit matters
                break
            if lev == 0 and cbin > int32(CAP):
                # a bin too big to list (plateaus, few distinct values): mark the groups above it
                # and in it while finding its keys' min and max; one value means exact ties
                hi = uint32(0)
                nlo = uint32(0)
                e0 = uint32(0)
                while e0 < nbpad:
                    _load_batch(score_bits, i, uint32(e0 + tid), nb, vals)
                    for j in range(UN):
                        e = uint32(e0 + tid + uint32(NT * j))
                        if e < nbpad:
                            k = ordered_bits(vals[j])
                            km = uint32(k & mask)
                            inside = e < nb and km == prefix
                            _mark_word(gt, e, e < nb and km > prefix, lane)
                            _mark_word(eq, e, inside, lane)
                            if inside:
                                hi = max(hi, k)
                                nlo = max(nlo, uint32(FULL_MASK - k))   # ~k, which numba widens
                    e0 = uint32(e0 + uint32(NT * UN))
                _block_max(hi, lane, mm, 0)
                _block_max(nlo, lane, mm, 1)
                cuda.syncthreads()
                if mm[0] == uint32(FULL_MASK - mm[1]):
                    single = True
                    break
                for w in range(tid, uint32(WORDS), uint32(NT)):    # several values: unmark
                    gt[w] = uint32(0)
                    eq[w] = uint32(0)
                cuda.syncthreads()
            if (not collected) and lev < 2 and cbin <= int32(CAP):
                e0 = uint32(0)
                while e0 < nbpad:
                    _load_batch(score_bits, i, uint32(e0 + tid), nb, vals)
                    for j in range(UN):
                        e = uint32(e0 + tid + uint32(NT * j))
                        if e < nbpad:                # whole warps: the ballots below
                            k = ordered_bits(vals[j])
                            km = uint32(k & mask)
                            _mark_word(gt, e, e < nb and km > prefix, lane)
                            slot = _append_slot(ccount, e < nb and km == prefix, lane)
                            if slot >= int32(0):
                                cand_k[slot] = k
                                cand_e[slot] = e
                    e0 = uint32(e0 + uint32(NT * UN))
                collected = True
                cuda.syncthreads()

        if single:                           # the big bin's marks are the selection and its ties
            pass
        elif collected:
            ncand = uint32(ccount[0])
            for j in range(tid, ncand, uint32(NT)):
                km = uint32(cand_k[j] & mask)
                e = cand_e[j]
                if km > prefix:
                    cuda.atomic.or_(gt, e >> uint32(5), uint32(1) << (e & U31))
                elif km == prefix:
                    cuda.atomic.or_(eq, e >> uint32(5), uint32(1) << (e & U31))
        else:
            e0 = uint32(0)
            while e0 < nbpad:
                _load_batch(score_bits, i, uint32(e0 + tid), nb, vals)
                for j in range(UN):
                    e = uint32(e0 + tid + uint32(NT * j))
                    if e < nbpad:
                        km = uint32(ordered_bits(vals[j]) & mask)
                        _mark_word(gt, e, e < nb and km > prefix, lane)
                        _mark_word(eq, e, e < nb and km == prefix, lane)
                e0 = uint32(e0 + uint32(NT * UN))
        cuda.syncthreads()

        emit(gt, eq, need, True, groups, i, tid, scr)

    topk_bitmap.threads = NT
    topk_bitmap.gmax = gmax
    return topk_bitmap


# ------------------------------------------------------------------------------------------------
# Register top-k: rows of up to ``threads * per_thread`` groups (8,192 on a GPU: 32K tokens at r = 4)
# ------------------------------------------------------------------------------------------------

REL_SHIFT = 15        # level 1 bins (best key - key) >> 15: 256 bins an octave below the row's best
REL_BINS = 4096       # 16 octaves; every key further below shares the last bin
REGISTER_GROUPS = 8192  # longest row of the register kernel on a GPU (32K tokens at r = 4)
RANK_MAX = 128        # level-1 bins of at most this many keys are ranked directly


def register_groups():
    """Longest row the register kernel takes: 8,192 groups on a GPU; 64 in the simulator (so the
    tests also route rows to the bitmap kernel)."""
    return 64 if SIMULATOR else REGISTER_GROUPS


def register_shape(threads):
    """(threads, keys per thread) of a register kernel of ``threads`` threads: a row of
    :func:`register_groups` groups read once (the sm_90 profile's 512 x 16 keeps two blocks of
    <= 64 registers per SM); 32 x 2 in the simulator, whatever ``threads``."""
    if SIMULATOR:
        return 32, 2
    return threads, REGISTER_GROUPS // threads


@functools.lru_cache(maxsize=None)
def make_find_bin(threads, max_bins):
    """Device fn ``find_bin(hist, nbins, need, tid, scr, state)``: the bin holding the ``need``-th key,
    bin 0 the best. Thread ``t`` owns bins ``t*bpt ..`` (ascending), a block scan counts the keys in
    better bins; writes ``state[0..2] = (bin, need within it, keys in it)``. Every thread calls it."""
    NT = threads
    BPTMAX = max(1, max_bins // NT)
    block_scan = make_block_scan(NT)

    @device_jit
    def find_bin(hist, nbins, need, tid, scr, state):
        bpt = max(uint32(1), uint32(nbins // uint32(NT)))
        b0 = uint32(tid * bpt)
        local = int32(0)
        for j in range(BPTMAX):
            bb = uint32(b0 + uint32(j))
            if uint32(j) < bpt and bb < nbins:
                local = int32(local + hist[bb])
        incl, total = block_scan(local, tid, scr)
        above = int32(incl - local)
        for j in range(BPTMAX):
            bb = uint32(b0 + uint32(j))
            if uint32(j) < bpt and bb < nbins:
                c = hist[bb]
                if above < need and need <= above + c:
                    state[0] = bb
                    state[1] = uint32(need - above)
                    state[2] = uint32(c)
                above = int32(above + c)
        cuda.syncthreads()
    return find_bin


@functools.lru_cache(maxsize=None)
def make_topk_register_kernel(threads, per_thread, kb, r, rank_max=None):
    """Top-k of rows with ``nb <= threads * per_thread``: the row read once, into registers.

    One block of ``threads`` per row; thread ``t`` holds the relative keys ``d = best - key`` of
    groups ``t + threads*j`` (``j < per_thread``; 0 for the row's best, NaN included; smaller is
    better). The select narrows an interval ``[lo, last]`` of ``d`` that holds the ``Kb``-th best
    key; every key below ``lo`` is selected.

    - Level 1 bins ``min(d >> 15, 4095)``: 256 bins an octave below the best, so the few octaves a
      row of scores spans spread over hundreds of bins and the shared atomics rarely collide; keys
      16 octaves or more below share the last bin, counted without atomics.
    - If the chosen bin holds at most ``rank_max`` keys (the usual case: a bin is 1/256 of an
      octave), they are listed in shared memory and thread ``c`` ranks key ``c`` by (d, group id)
      against the list: the ``need`` best are taken. No ties are left and no further level runs.
    - Otherwise the block's min and max of the bin's keys narrow the interval (equal min and max:
      one value, all ties: a plateau of zeros, say), and the bits below their common prefix are
      resolved 8 at a time by shared histograms; a digit whose bin is taken whole ends it. The keys
      left are exact ties, of which the ``need`` lowest groups are taken (the tie rule).

    Ballots write the selected and tied groups as bitmaps and :func:`make_emit` writes the row
    ascending. Exact and deterministic: atomics only count and list, and no list order matters.
    Rows with ``nb <= Kb`` take groups ``0..nb-1`` and pad with -1. ``rank_max`` None:
    :data:`RANK_MAX` (0: always histograms). Shared memory: ``4096*4 + threads*per_thread/4 +
    8*rank_max`` bytes plus the scan scratch and state (19.1 KB on a GPU).
    """
    NT = threads
    RK = per_thread
    KB = kb
    RMAX = RANK_MAX if rank_max is None else rank_max
    CAND = max(1, RMAX)
    GMAX = NT * RK
    WORDS = max(1, GMAX // 32)
    SCR = scan_scratch(NT)
    emit = make_emit(NT, WORDS)
    find_bin = make_find_bin(NT, REL_BINS)
    LAST = uint32(REL_BINS - 1)
    FAR = uint32((REL_BINS - 1) << REL_SHIFT)           # the last bin's first key
    LOW = uint32((1 << REL_SHIFT) - 1)
    U31 = uint32(31)

    @jit(launch_bounds=(NT, max(1, 1024 // NT)))   # <= 64 registers: two 512-thread blocks per SM
    def topk_registers(score_bits, req_ids, positions, seq_lens, groups):
        hist = cuda.shared.array(REL_BINS, int32)
        gt = cuda.shared.array(WORDS, uint32)
        eq = cuda.shared.array(WORDS, uint32)
        cand_d = cuda.shared.array(CAND, uint32)
        cand_e = cuda.shared.array(CAND, uint32)
        state = cuda.shared.array(7, uint32)     # bin, need in it, keys in it; best, max d, max ~d,
        scr = cuda.shared.array(SCR, int32)      # listed keys
        keys = cuda.local.array(RK, uint32)
        tid = uint32(cuda.threadIdx.x)
        lane = tid & U31
        i = uint32(cuda.blockIdx.x)
        nb = _visible(i, req_ids, positions, seq_lens, r, score_bits.shape[1])
        if nb <= uint32(KB):
            _take_all(groups, i, nb, tid, NT, KB)
            return

        # numba widens uint32 arithmetic to 64 bits: the casts keep the per-key work 32-bit
        nv = uint32(0)                           # this thread's keys j < nv are visible groups
        if tid < nb:
            nv = uint32((nb - tid + uint32(NT - 1)) // uint32(NT))
        for j in range(RK):                      # every load in flight before any is used
            v = uint32(0)
            if uint32(j) < nv:
                v = score_bits[i, uint32(tid + uint32(NT * j))]
            keys[j] = v
        best = uint32(0)
        for j in range(RK):
            k = ordered_bits(keys[j])
            keys[j] = k
            if uint32(j) < nv:
                best = max(best, k)
        for b in range(tid, uint32(REL_BINS), uint32(NT)):
            hist[b] = int32(0)
        for w in range(tid, uint32(WORDS), uint32(NT)):   # the simulator's ballots are atomic ORs
            gt[w] = uint32(0)
            eq[w] = uint32(0)
        if tid < uint32(4):
            state[3 + tid] = uint32(0)
        cuda.syncthreads()
        _block_max(best, lane, state, 3)
        cuda.syncthreads()
        best = state[3]

        # level 1: octaves below the best
        far = int32(0)
        for j in range(RK):
            d = uint32(best - keys[j])
            keys[j] = d
            if uint32(j) < nv:
                if d >= FAR:
                    far = int32(far + int32(1))
                else:
                    cuda.atomic.add(hist, uint32(d >> uint32(REL_SHIFT)), int32(1))
        if far > int32(0):
            cuda.atomic.add(hist, LAST, far)
        cuda.syncthreads()
        find_bin(hist, uint32(REL_BINS), int32(KB), tid, scr, state)
        bstar = state[0]
        need = int32(state[1])
        cbin = int32(state[2])
        cuda.syncthreads()
        lo = uint32(bstar << uint32(REL_SHIFT))
        last = FULL_MASK if bstar == LAST else uint32(lo | LOW)
        taken = cbin == need                     # the whole interval is selected
        ranked = False                           # the interval's keys are listed, ranked below
        top = uint32(0)                          # bits of d still to resolve by histograms
        if (not taken) and cbin <= int32(RMAX):
            for j in range(RK):
                d = keys[j]
                if uint32(j) < nv and d >= lo and d <= last:
                    slot = cuda.atomic.add(state, 6, uint32(1))
                    cand_d[slot] = d
                    cand_e[slot] = uint32(tid + uint32(NT * j))
            ranked = True
        elif not taken:                          # narrow to the keys' min and max
            hi = uint32(0)
            nlo = uint32(0)
            for j in range(RK):
                d = keys[j]
                if uint32(j) < nv and d >= lo and d <= last:
                    hi = max(hi, d)
                    nlo = max(nlo, uint32(FULL_MASK - d))      # ~d, which numba widens
            _block_max(hi, lane, state, 4)
            _block_max(nlo, lane, state, 5)
            cuda.syncthreads()
            lo = uint32(FULL_MASK - state[5])
            last = state[4]
            # clz must see 32 bits
            top = uint32(32) - uint32(cuda.clz(uint32(lo ^ last))) if lo != last else uint32(0)

        while top > uint32(0) and not taken:
            w = min(uint32(8), top)
            shift = uint32(top - w)
            nbins = uint32(uint32(1) << w)
            for b in range(tid, nbins, uint32(NT)):
                hist[b] = int32(0)
            cuda.syncthreads()
            run_bin = uint32(0)
            run_cnt = int32(0)
            for j in range(RK):
                d = keys[j]
                if uint32(j) < nv and d >= lo and d <= last:
                    run_bin, run_cnt = _count(hist, uint32((d >> shift) & (nbins - uint32(1))),
                                              run_bin, run_cnt)
            if run_cnt > int32(0):
                cuda.atomic.add(hist, run_bin, run_cnt)
            cuda.syncthreads()
            find_bin(hist, nbins, need, tid, scr, state)
            bstar = state[0]
            need = int32(state[1])
            cbin = int32(state[2])
            cuda.syncthreads()
            # the digit's interval: lo's bits above `top`, the digit, then zeros / ones
            base = uint32(uint32((uint64(lo) >> uint64(top)) << uint64(top)) | (bstar << shift))
            lo = max(lo, base)
            last = min(last, uint32(base | ((uint32(1) << shift) - uint32(1))))
            taken = cbin == need
            top = shift

        ties = not (taken or ranked)
        for j in range(RK):                      # one ballot per 32 groups and bitmap
            e = uint32(tid + uint32(NT * j))
            d = keys[j]
            ok = uint32(j) < nv
            inside = ok and d >= lo and d <= last
            _mark_word(gt, e, ok and (d < lo or (taken and inside)), lane)
            _mark_word(eq, e, ties and inside, lane)
        cuda.syncthreads()
        if ranked:                               # listed key c by (d, group id) among the list
            for c in range(tid, uint32(cbin), uint32(NT)):
                d = cand_d[c]
                e = cand_e[c]
                rank = int32(0)
                for x in range(cbin):
                    dx = cand_d[x]
                    if dx < d or (dx == d and cand_e[x] < e):
                        rank += int32(1)
                if rank < need:
                    cuda.atomic.or_(gt, e >> uint32(5), uint32(1) << (e & U31))
            cuda.syncthreads()
        emit(gt, eq, need, ties, groups, i, tid, scr)

    topk_registers.threads = NT
    topk_registers.gmax = GMAX
    return topk_registers


# as launched: C-contiguous score blocks, metadata and outputs
_SIG = "void(uint32[:, ::1], int32[::1], int32[::1], int32[::1], int32[:, ::1])"
RESOURCE_CASES = [
    (f"topk.kb512.t{t}", make_topk_kernel(t, 512, 4), _SIG, t, 0, cc)
    for t in (256,) for cc in ((7, 0), (9, 0))
] + [
    (f"topk.bitmap.kb512.t{t}", make_topk_bitmap_kernel(*bitmap_shape(t), 512, 4), _SIG,
     bitmap_shape(t)[0], 0, cc) for t in (512, 1024) for cc in ((7, 0), (9, 0))
] + [
    (f"topk.registers.kb512.t{t}", make_topk_register_kernel(*register_shape(t), 512, 4), _SIG, t,
     0, cc) for t, cc in ((512, (9, 0)), (1024, (7, 0)))
]
