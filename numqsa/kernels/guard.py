"""Row guard (spec §2): a row that needs a page id outside its cache is made inert before any stage reads.

A row ``i`` (request ``q``, clamped position ``p``, ``nb`` visible groups) needs the index pages of
its groups ``0 .. nb - 1`` (index table columns ``0 .. (nb - 1) // R``) and, where attention follows,
the KV pages of its tokens ``0 .. p`` (columns ``0 .. p // page_size``). A needed entry outside
``[0, num_pages)``, a needed column past the table's width, or a request past the table's rows is a
bad page id. Host tables are checked before any launch (the public API refuses them); device tables
are not read back by default, so this kernel checks them on the device and writes a copy of
``positions`` with ``-1`` for every row that needs a bad id. Every later stage reads such a row as
inert through the spec §1 rule it already applies (:func:`numqsa.kernels.common.row_state`): scores
``-inf``, no groups, no tail, count 0, so attention gives ``out = 0``, ``lse = -inf``. The rule is
:func:`oracle.batch.bad_page_rows`'s.

Every architecture; launched (by ``index_scores``, ``select``, ``qsa_prefill`` and the wrapper's
``run`` / ``run_select``) only for tables the host did not check; no route to choose. Its time has
not been measured in a record run yet (``docs/benchmark.md``).
"""
import functools

import numpy as np
from numba import cuda, int32, uint32

from ..jit import SIMULATOR, jit
from .common import row_state

__all__ = ["make_guard_kernel", "launch_guard", "guard_threads", "RESOURCE_CASES"]


@functools.lru_cache(maxsize=None)
def make_guard_kernel(threads, r, kv):
    """Grid ``ceil(rows / threads)``, block ``threads``; thread ``t`` owns row ``x * threads + t``.

    ``kv``: also check the KV table (``ktable``, ``n_kpages``, page size ``kps``); otherwise only the
    index table (``itable``, ``n_ipages``, ``ipp`` rows per index page) and ``ktable`` is unused.
    Each thread finds its row's needed column counts and the first row of the block with the same
    request (its leader); thread 0 numbers the leaders; then the threads stride over every leader's
    needed columns at once (no barrier between requests), keeping each request's first bad column
    with a shared atomic min. A row is inert if it needs a column at or past that one. Reads per
    block: each distinct request's needed table columns once (not once per row).
    Shared memory: ``9 * threads * 4 + 4`` bytes (4.5 KB at 128 threads).
    """
    NT = int(threads)
    R = int(r)
    KV = bool(kv)
    UNT = uint32(NT)

    @jit
    def guard(req_ids, positions, seq_lens, itable, n_ipages, ipp, ktable, n_kpages, kps, pos_out):
        s_req = cuda.shared.array(NT, int32)
        s_ni = cuda.shared.array(NT, int32)      # index columns the row needs
        s_nk = cuda.shared.array(NT, int32)      # KV columns the row needs
        s_ld = cuda.shared.array(NT, int32)      # leader's slot in the block, then its request number
        u_req = cuda.shared.array(NT, int32)
        u_need = cuda.shared.array(NT, int32)    # the most index columns any row of request u needs
        u_fbi = cuda.shared.array(NT, int32)     # request u's first bad index column
        u_needk = cuda.shared.array(NT, int32)   # ... and KV columns
        u_fbk = cuda.shared.array(NT, int32)     # ... and KV column
        n_u = cuda.shared.array(1, int32)
        tid = uint32(cuda.threadIdx.x)
        rows = uint32(positions.shape[0])
        i = uint32(cuda.blockIdx.x) * UNT + tid
        req = int32(-1)
        ni = int32(0)
        nk = int32(0)
        if i < rows:
            req, p, nb = row_state(i, req_ids, positions, seq_lens, R)
            if req >= int32(0):
                ni = (nb + ipp - int32(1)) // ipp
                if KV:
                    nk = p // kps + int32(1)
        s_req[tid] = req
        s_ni[tid] = ni
        s_nk[tid] = nk
        cuda.syncthreads()
        ld = int32(-1)
        if req >= int32(0):
            for s in range(NT):
                if ld < int32(0) and s_req[s] == req:
                    ld = int32(s)
        s_ld[tid] = ld
        cuda.syncthreads()
        if tid == uint32(0):
            n = int32(0)
            for s in range(NT):
                if s_ld[s] == int32(s):
                    u_req[n] = s_req[s]
                    s_ld[s] = int32(NT) + n          # a leader's entry now holds NT + its number
                    n += int32(1)
            n_u[0] = n
        cuda.syncthreads()
        nu = n_u[0]
        if tid < uint32(nu):
            q = u_req[tid]
            mi = int32(0)
            mk = int32(0)
            for s in range(NT):
                if s_req[s] == q:
                    mi = max(mi, s_ni[s])
                    mk = max(mk, s_nk[s])
            ok_i = q < int32(itable.shape[0])
            icols = int32(itable.shape[1]) if ok_i else int32(0)
            u_fbi[tid] = icols                   # columns past the table are missing: bad
            u_need[tid] = min(mi, icols)
            kcols = int32(0)
            if KV and q < int32(ktable.shape[0]):
                kcols = int32(ktable.shape[1])
            u_fbk[tid] = kcols
            u_needk[tid] = min(mk, kcols)
        cuda.syncthreads()
        for u in range(nu):
            q = u_req[u]
            for c in range(tid, uint32(u_need[u]), UNT):
                pg = int32(itable[q, c])
                if pg < int32(0) or pg >= n_ipages:
                    cuda.atomic.min(u_fbi, u, int32(c))
            if KV:
                for c in range(tid, uint32(u_needk[u]), UNT):
                    pg = int32(ktable[q, c])
                    if pg < int32(0) or pg >= n_kpages:
                        cuda.atomic.min(u_fbk, u, int32(c))
        cuda.syncthreads()
        if i < rows:
            pos = int32(positions[i])
            if ld >= int32(0):
                u = s_ld[ld] - int32(NT)
                if ni > u_fbi[u] or (KV and nk > u_fbk[u]):
                    pos = int32(-1)
            pos_out[i] = pos

    guard.threads = NT
    return guard


def guard_threads():
    return 32 if SIMULATOR else 128


def launch_guard(req_ids, positions, seq_lens, itable, n_ipages, ipp, pos_out, stream, r=4,
                 ktable=None, n_kpages=0, page_size=1):
    """Write ``pos_out [rows]`` int32: ``positions``, or ``-1`` where the row needs a bad page id of
    ``itable`` (``n_ipages`` pages of ``ipp`` groups) or, when given, ``ktable`` (``n_kpages`` pages
    of ``page_size`` tokens). Device int32 arrays; nothing is read back."""
    rows = pos_out.shape[0]
    if rows == 0:
        return pos_out
    kv = ktable is not None
    k = make_guard_kernel(guard_threads(), int(r), kv)
    k[-(-rows // k.threads), k.threads, stream](
        req_ids, positions, seq_lens, itable, np.int32(n_ipages), np.int32(ipp),
        ktable if kv else itable, np.int32(n_kpages), np.int32(max(1, page_size)), pos_out)
    return pos_out


_SIG = ("void(int32[:], int32[:], int32[:], int32[:, :], int32, int32, int32[:, :], int32, int32, "
        "int32[:])")
RESOURCE_CASES = [(f"guard.{'kv' if kv else 'index'}", make_guard_kernel(128, 4, kv), _SIG, 128, 0, cc)
                  for kv in (False, True) for cc in ((7, 0), (9, 0))]
