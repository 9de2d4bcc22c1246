"""Expansion (spec §5): selected groups -> ascending token ids, the forced tail last, -1 padding, counts.

Input ``groups [rows, Kb]`` int32 as the top-k kernel writes them: ascending valid ids (< nb) first,
then -1. A caller's groups are read up to the first entry that is not a visible group (``0 <= g < nb``)
strictly above its predecessor: an out-of-range id (a future group, whose tokens lie past the row's
position), a repeat or a descent ends the row's groups there, so the output is always a causal,
ascending selection without repeats (issue 12: a group past ``nb`` was expanded and attended to). Token slot ``j`` of a row with ``ng`` groups holds ``r*groups[j // r] + j % r`` for
``j < r*ng``, then the tail ``r*nb .. p`` (``p + 1 - r*nb`` tokens), then -1. Inert rows: all -1, count 0.

One kernel on every architecture, launched once after the last row chunk's top-k; no route to
choose. Shipped: 0.048 ms at 8192 x 131K in the session-6 record run (``docs/kernels/expand.md``).
"""
import functools

from numba import cuda, int32, uint32

from ..jit import SIMULATOR, jit
from .common import row_state


@functools.lru_cache(maxsize=None)
def make_expand_kernel(threads, r):
    """One block of ``threads`` threads per row (grid ``rows``).

    The row's group count ``ng`` is found in parallel (the index of the first entry that does not
    continue a strictly ascending run of visible ids: a shared-memory atomic min), then threads stride over the ``Kb*r + r - 1`` token slots
    (coalesced writes; a group id is read by ``r`` neighbouring threads from L1).
    Shared memory: 4 bytes.
    """
    NT = threads
    R = r

    @jit
    def expand(groups, req_ids, positions, seq_lens, tokens, counts):
        ng_s = cuda.shared.array(1, int32)
        tid = uint32(cuda.threadIdx.x)
        i = uint32(cuda.blockIdx.x)
        kb = uint32(groups.shape[1])
        width = uint32(tokens.shape[1])
        req, p, nb = row_state(i, req_ids, positions, seq_lens, R)
        if tid == uint32(0):
            ng_s[0] = int32(kb)
            if req < int32(0):
                ng_s[0] = int32(0)
        cuda.syncthreads()
        if req >= int32(0):
            for j in range(tid, kb, uint32(NT)):
                g = groups[i, j]
                prev = int32(-1)
                if j > uint32(0):
                    prev = groups[i, j - uint32(1)]
                stop = g < int32(0) or g >= nb or (j > uint32(0) and g <= prev)
                # an entry after a -1 is not the first stop: one atomic per well-formed row
                if stop and not (j > uint32(0) and prev < int32(0)):
                    cuda.atomic.min(ng_s, 0, int32(j))
        cuda.syncthreads()
        ng = uint32(ng_s[0])
        tail = uint32(0)
        if req >= int32(0):
            tail = uint32(p + int32(1) - int32(R) * nb)
        full = ng * uint32(R)
        cnt = full + tail
        for j in range(tid, width, uint32(NT)):
            t = int32(-1)
            if j < full:
                gi = j // uint32(R)
                t = groups[i, gi] * int32(R) + int32(j - gi * uint32(R))
            elif j < cnt:
                t = int32(R) * nb + int32(j - full)
            tokens[i, j] = t
        if tid == uint32(0):
            counts[i] = int32(cnt)

    expand.threads = NT
    return expand


def expand_threads(profile):
    return 32 if SIMULATOR else int(profile.topk.threads)


def launch_expand(groups, req_ids, positions, seq_lens, tokens, counts, profile, stream, r=4):
    """Write ``tokens [rows, Kb*r + r - 1]`` and ``counts [rows]`` (int32 device arrays)."""
    rows = groups.shape[0]
    if rows == 0:
        return tokens, counts
    k = make_expand_kernel(expand_threads(profile), int(r))
    k[rows, k.threads, stream](groups, req_ids, positions, seq_lens, tokens, counts)
    return tokens, counts


_SIG = "void(int32[:, :], int32[:], int32[:], int32[:], int32[:, :], int32[:])"
RESOURCE_CASES = [("expand.r4.t256", make_expand_kernel(256, 4), _SIG, 256, 0, cc)
                  for cc in ((7, 0), (9, 0))]
