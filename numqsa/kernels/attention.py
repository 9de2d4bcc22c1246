"""Generic sparse attention (spec §6): each query row attends to its selected tokens through the page table.

Any page size, any K/V element strides (contiguous, interleaved ``kv[:, 0]``, head-major views are
read in place), any token order. float32 FMA arithmetic; inputs float16/float32/bfloat16 (bfloat16 as
uint16 bit views, :func:`numqsa.kernels.common.bits16`; on every architecture, sm_70 included: the
conversions are integer arithmetic), output in the query dtype or float32.

Reduction order (what makes results bitwise reproducible and independent of page placement and of
the other rows of the batch): a row's tokens are consumed in list order in chunks of ``r`` = 4
consecutive entries -- for a selection as the expansion stage writes it (ascending whole groups, then
the tail) a chunk is exactly one logical group, the "virtual page" of spec §7 -- and the online
softmax updates its running max, rescales, then adds the chunk's terms in order. The page-4 grouped
route (:mod:`numqsa.kernels.page4`) uses the same per-page chunking.

Route: the generic attention, on every architecture: float32 and mixed dtypes, page sizes not a
multiple of ``r``, bfloat16 on sm_70, ``NUMQSA_PAGE4=0``, the rows the page-4 plan leaves inert (a
selection not of whole groups). Never by row count: a threshold between this kernel and a page-4
one would give a row other bits when rows join its batch (``numqsa/plan.py``; until this change
sm_70 took this kernel below 4096 rows, the seed's V100 crossover). A page-4 kernel wins, as this is
fp32-FMA bound (2.3 TFLOP/s, each row re-reading its K/V; ``docs/kernels/attention.md``). On the
H200 (GPU-only ms, 32K context, 2051 selected), grouped kernel / this one: 1 row 0.095 / 3.03,
16 rows 0.20 / 2.28, 256 rows 0.29 / 2.29 (``docs/kernels/grouped.md``, v3); the seed measured
the page-4 route 3.15x faster than this one on a V100 at 4096 rows (``docs/kernels/page4.md``).
"""
import functools
import math

import numpy as np
from numba import cuda, float32, int32, uint32

from ..jit import SIMULATOR, jit
from .common import bits16, is_bf16, loader, storer
from .smem import grid_dep_wait

__all__ = ["make_attention_kernel", "launch_attention", "attention_tile", "RESOURCE_CASES"]

SMEM_BUDGET = 44 * 1024      # static shared memory we allow one block (V100: 48 KB per block)
CHUNK = 4                    # tokens per online-softmax step: one logical group (r = 4)


def attention_tile(d, hg):
    """Tokens staged per step: 16 if the float32 tiles fit the shared-memory budget, else 8 or 4."""
    for tile in (16, 8, 4):
        if _smem_bytes(d, hg, tile) <= SMEM_BUDGET:
            return tile
    raise ValueError(f"head dim {d} with {hg} query heads per KV head does not fit shared memory")


def _smem_bytes(d, hg, tile):
    return 4 * (hg * d + tile * (d + 1) + tile * d + hg * tile + hg * (tile // CHUNK) + 2 * tile) + 4


@functools.lru_cache(maxsize=None)
def make_attention_kernel(d, hg, threads, q_bf16=False, kv_bf16=False, out_bf16=False, pdl=False):
    """Kernel over grid ``(rows, Hkv)``; block = ``threads`` threads = one (row, KV head) pair.

    ``q_bf16`` / ``kv_bf16`` / ``out_bf16``: that array is bfloat16 passed as uint16 bits.

    The block serves the ``hg = Hq // Hkv`` query heads of its KV head. Per step it stages
    ``T`` = :func:`attention_tile` selected tokens: their (page, slot) into shared memory, then K and V
    (converted to float32; K rows padded to ``d + 1`` words so the per-token dot products do not
    collide on a bank). Thread ``e < hg*T`` computes the score of (head ``e // T``, token ``e % T``)
    as one sequential d-ordered dot product; thread ``h < hg`` runs head ``h``'s online softmax over
    the ``T / 4`` chunks; every thread owns the output elements ``e = tid + i*threads`` of the
    ``hg x d`` block (register accumulators) and applies each chunk's rescale and terms in order.
    Non-finite values follow the float64 math (:func:`oracle.attention.attend`): a head with a NaN or
    +inf score, or with every score -inf, gets NaN ``out`` and ``lse``; NaN/inf in V reach the output
    elements they multiply (``0 * inf`` is NaN). A token listed twice is weighted twice.
    Before anything, the row's token ids are checked (``0 <= t < seq_len``, table column and page
    id in range): any bad id makes the row inert, so the kernel never reads out of bounds.
    ``pdl``: launched programmatically behind the kernel that writes ``skip`` (sm_90): the block
    waits for that kernel's completion (``griddepcontrol.wait``) before anything else.
    Shared memory: ``4*(hg*d + T*(d+1) + T*d + hg*T + hg*T/4 + 2T) + 4`` bytes
    (hg 6, d 256, T 16: 39.8 KB; hg 12, d 256: 45.9 KB -> T 8).
    """
    D, HG, NT = int(d), int(hg), int(threads)
    PDL = bool(pdl)
    T = attention_tile(D, HG)
    NCH = T // CHUNK
    DP = D + 1
    NPER = -(-HG * D // NT)
    UD, UT, UNT, UCH, UHG = uint32(D), uint32(T), uint32(NT), uint32(CHUNK), uint32(HG)
    UNCH = uint32(NCH)     # chunks per staged tile (T // CHUNK: 4 at T 16, 2 at T 8)
    U0 = uint32(0)
    NEG_INF = float32(-math.inf)
    POS_INF = float32(math.inf)
    NAN = float32(math.nan)
    F0, F1 = float32(0), float32(1)
    ldq, ldkv, st = loader(q_bf16), loader(kv_bf16), storer(out_bf16)

    def kernel(q, k_cache, v_cache, block_table, tokens, counts, req_ids, seq_lens, scale, out, lse,
               skip):
        sq = cuda.shared.array((HG, D), float32)
        sk = cuda.shared.array((T, DP), float32)
        sv = cuda.shared.array((T, D), float32)
        sp = cuda.shared.array((HG, T), float32)       # scores, then probabilities
        sa = cuda.shared.array((HG, NCH), float32)     # per-chunk rescale factors
        spage = cuda.shared.array(T, int32)
        sslot = cuda.shared.array(T, int32)
        sflag = cuda.shared.array(1, int32)
        tid = uint32(cuda.threadIdx.x)
        row = uint32(cuda.blockIdx.x)
        j = uint32(cuda.blockIdx.y)
        if PDL:
            grid_dep_wait()
        if row < uint32(skip.shape[0]):
            # already written by the page-4 route when every entry of the row is > 0 (block-uniform)
            done = True
            for c in range(skip.shape[1]):
                if skip[row, c] <= int32(0):
                    done = False
            if done:
                return
        num_pages = int32(k_cache.shape[0])
        page_size = int32(k_cache.shape[1])
        cols = int32(block_table.shape[1])
        width = int32(tokens.shape[1])

        req = int32(req_ids[row])
        slen = int32(0)
        if req >= int32(0) and req < int32(seq_lens.shape[0]) and req < int32(block_table.shape[0]):
            slen = int32(seq_lens[req])
        n = int32(0)
        if slen > int32(0):
            n = min(max(int32(counts[row]), int32(0)), width)
        if tid == U0:
            sflag[0] = int32(0)
        cuda.syncthreads()
        for k in range(tid, uint32(n), UNT):
            t = int32(tokens[row, k])
            bad = t < int32(0) or t >= slen
            if not bad:
                c = t // page_size
                bad = c >= cols
                if not bad:
                    pg = int32(block_table[req, c])
                    bad = pg < int32(0) or pg >= num_pages
            if bad:
                sflag[0] = int32(1)
        cuda.syncthreads()
        if sflag[0] != int32(0):
            n = int32(0)

        for e in range(tid, UHG * UD, UNT):
            h = e // UD
            dd = e - h * UD
            sq[h, dd] = ldq(q[row, j * UHG + h, dd])
        m = NEG_INF       # running max and sum of head tid (threads tid < HG)
        l = F0
        bad = False       # head tid saw a NaN or +inf score: its softmax is NaN (the float64 math's)
        acc = cuda.local.array(NPER, float32)
        for i in range(NPER):
            acc[i] = F0

        for base in range(int32(0), n, int32(T)):
            if tid < UT:
                kk = base + int32(tid)
                pg = int32(0)
                sl = int32(-1)
                if kk < n:
                    t = int32(tokens[row, kk])
                    pg = int32(block_table[req, t // page_size])
                    sl = t - (t // page_size) * page_size
                spage[tid] = pg
                sslot[tid] = sl
            cuda.syncthreads()
            for e in range(tid, UT * UD, UNT):
                tt = e // UD
                dd = e - tt * UD
                sl = sslot[tt]
                kv = F0
                vv = F0
                if sl >= int32(0):
                    kv = ldkv(k_cache[spage[tt], sl, j, dd])
                    vv = ldkv(v_cache[spage[tt], sl, j, dd])
                sk[tt, dd] = kv
                sv[tt, dd] = vv
            cuda.syncthreads()
            for e in range(tid, UHG * UT, UNT):
                h = e // UT
                tt = e - h * UT
                s = NEG_INF
                if sslot[tt] >= int32(0):
                    dot = F0
                    for dd in range(UD):
                        dot += sq[h, dd] * sk[tt, dd]
                    s = dot * scale
                sp[h, tt] = s
            cuda.syncthreads()
            if tid < UHG:
                for c in range(UNCH):
                    t0 = c * UCH
                    cmax = NEG_INF
                    for x in range(UCH):
                        s = sp[tid, t0 + x]
                        cmax = max(cmax, s)      # fmaxf: skips NaN, which ``bad`` records
                        if math.isnan(s) or s == POS_INF:
                            bad = True
                    alpha = F1
                    if cmax > m:     # max unchanged -> alpha exactly 1, as if rescaled by exp(0)
                        alpha = F0
                        if m != NEG_INF:
                            alpha = math.exp(m - cmax)
                        m = cmax
                    l *= alpha
                    for x in range(UCH):
                        s = sp[tid, t0 + x]
                        p = F0
                        if s != NEG_INF:
                            p = math.exp(s - m)
                        l += p
                        sp[tid, t0 + x] = p
                    sa[tid, c] = alpha
            cuda.syncthreads()
            for i in range(NPER):
                e = tid + uint32(i) * UNT
                if e < UHG * UD:
                    h = e // UD
                    dd = e - h * UD
                    o = acc[i]
                    for c in range(UNCH):
                        o *= sa[h, c]
                        for x in range(UCH):
                            o += sp[h, c * UCH + x] * sv[c * UCH + x, dd]
                    acc[i] = o
            cuda.syncthreads()

        if tid < UHG:
            lv = NEG_INF
            if n > int32(0):
                # exp(s - max) with a NaN or +inf max, or a max of -inf (every score -inf), is NaN
                if bad or m == NEG_INF:
                    l = NAN
                lv = m + math.log(l)
            sp[tid, 0] = l
            lse[row, j * UHG + tid] = lv
        cuda.syncthreads()
        for i in range(NPER):
            e = tid + uint32(i) * UNT
            if e < UHG * UD:
                h = e // UD
                dd = e - h * UD
                o = F0
                if n > int32(0):
                    o = acc[i] / sp[h, 0]
                out[row, j * UHG + h, dd] = st(o)

    tag = "".join(n for n, b in (("_qb", q_bf16), ("_kvb", kv_bf16), ("_ob", out_bf16),
                                 ("_pdl", PDL)) if b)
    kernel.__name__ = f"sparse_attention_d{D}_g{HG}_t{NT}{tag}"
    kernel.__qualname__ = kernel.__name__
    k = jit(kernel)
    k.threads = NT
    k.tile = T
    return k


def generic_threads(profile):
    """Threads per block: the profile's, fewer in the simulator (one OS thread per CUDA thread)."""
    return 64 if SIMULATOR else int(profile.attention.threads)


def launch_attention(q, k_cache, v_cache, block_table, tokens, counts, req_ids, seq_lens, scale,
                     out, lse, profile, stream, skip=None, pdl=False):
    """Generic route on device arrays; ``out [rows, Hq, D]`` and ``lse [rows, Hq]`` float32 are written.

    ``skip`` (int32 ``[rows, n]``, optional): rows whose ``n`` entries are all ``> 0`` are left as
    they are (the page-4 route passes its plan's page counts, ``n = 1``, or the verdicts of direct
    blocks that planned their own pieces, one a piece; so only the rows it could not plan are
    computed here). ``pdl``: the kernel is launched programmatically behind the one that writes
    ``skip`` (:func:`numqsa.launch.programmatic`) and waits for it first.
    """
    from .. import device as dev
    rows, hq, d = q.shape
    if skip is None:
        skip = dev.constant(np.zeros((0, 1), np.int32), stream)
    hkv = k_cache.shape[2]
    if rows == 0:
        return out, lse
    k = make_attention_kernel(int(d), int(hq // hkv), generic_threads(profile), is_bf16(q),
                              is_bf16(k_cache), is_bf16(out), bool(pdl))
    k[(rows, hkv), k.threads, stream](bits16(q), bits16(k_cache), bits16(v_cache), block_table,
                                      tokens, counts, req_ids, seq_lens, np.float32(scale),
                                      bits16(out), lse, skip)
    return out, lse


def _resource_cases():
    cases = []
    for dt in ("float16", "float32"):
        for hg in (6, 12):
            k = make_attention_kernel(256, hg, 128)
            sig = (f"void({dt}[:, :, :], {dt}[:, :, :, :], {dt}[:, :, :, :], int32[:, :], int32[:, :], "
                   f"int32[:], int32[:], int32[:], float32, {dt}[:, :, :], float32[:, :], int32[:, :])")
            if dt == "float32" and hg == 12:
                continue
            cases.append((f"attention_generic_{dt}_g{hg}", k, sig, 128, 0, None))
    for hg in (6, 12):
        k = make_attention_kernel(256, hg, 128, True, True, True)
        sig = ("void(uint16[:, :, :], uint16[:, :, :, :], uint16[:, :, :, :], int32[:, :], "
               "int32[:, :], int32[:], int32[:], int32[:], float32, uint16[:, :, :], float32[:, :], "
               "int32[:, :])")
        cases.append((f"attention_generic_bf16_g{hg}", k, sig, 128, 0, None))   # sm_70 too
    return cases


RESOURCE_CASES = _resource_cases()
