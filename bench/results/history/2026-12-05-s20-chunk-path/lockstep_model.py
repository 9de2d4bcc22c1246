"""Lockstep model of a union window's ring (session 20, README.md): rows of one warp each, a chunk
of 8 own pages taking time 1, share a FIFO ring of NB stages of SP union pages; stage s lands L after
every row released stage s - NB. Prints the README's table (40 windows of the bench's 4096 x 32K
selection, the second span)."""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from workloads import draw_groups  # noqa: E402


def block_time(u, NB, SP, L, CH=8):
    """Rows release the stages before their chunk's first page when they reach it (before waiting on
    its last page's stage, as the kernel does); stage s lands L after every row released s - NB."""
    G, n = u.shape
    nch = n // CH
    lo = u[:, 0::CH][:, :nch] // SP
    hi = u[:, CH - 1::CH][:, :nch] // SP
    solo = ((hi - lo) > NB - 1).any(axis=1)
    lo, hi = lo[~solo], hi[~solo]
    Gk = lo.shape[0]
    S = int(u.max()) // SP + 1
    # the chunk at whose start each row releases stage s (its first chunk past s; nch: the row's end)
    past = np.stack([np.searchsorted(lo[r], np.arange(S), side="right") for r in range(Gk)])
    fill = np.full(S, float(L))
    for it in range(1000):
        reach = np.zeros((Gk, nch)); fin = np.zeros((Gk, nch))
        for r in range(Gk):
            t = 0.0
            for c in range(nch):
                reach[r, c] = t
                t = max(t, fill[hi[r, c]]) + 1
                fin[r, c] = t
        # reach past the last chunk is the row's end
        ends = np.concatenate([reach, fin[:, -1:]], axis=1)
        rel = np.take_along_axis(ends, past, axis=1).max(axis=0)
        new = np.array([L if s < NB else rel[s - NB] + L for s in range(S)])
        if np.array_equal(new, fill):
            return fin.max(), int(solo.sum())
        fill = new
    raise RuntimeError("no fixpoint")


if __name__ == "__main__":
    rng = np.random.default_rng(0)
    rows, ctx, kb, G, SPAN = 4096, 32768, 512, 6, 128
    nb = (ctx - rows + np.arange(rows)) // 4
    g, _ = draw_groups(nb, kb, 0.82, rng)
    blocks = []
    for w0 in range(0, 240, G):
        own = g[w0:w0 + G, SPAN:2 * SPAN]
        U = np.unique(own)
        blocks.append(np.searchsorted(U, own))
    for SP, NB in ((8, 4), (8, 5), (8, 6), (4, 12), (8, 8), (8, 12)):
        for L in (0.5, 1, 2, 3):
            r = [block_time(b, NB, SP, L) for b in blocks]
            print(f"SP {SP} NB {NB:2d} L {L}: block {np.mean([x[0] for x in r]):6.2f} chunk-times "
                  f"(ideal {16 + L}), solo rows a window {np.mean([x[1] for x in r]):.2f}")
