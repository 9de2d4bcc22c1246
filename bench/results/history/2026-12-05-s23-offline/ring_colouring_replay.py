"""Session 23: how many of the union kernel's ldmatrix page pairs a ring colouring could keep apart.

The K and V fragments of a chunk read two own pages' 4 token rows at one 16-byte chunk
(``ldmatrix``: 8 rows); with v30's swizzle (as with the padding before) the 8 rows meet 8 bank
groups only when the two pages sit on ring pages of opposite parity. A union window's ring
page is its union index (stages are 8 pages, so the parity is the index's), and a row's own pages
pair as (2i, 2i+1) of its span. This replays bench_attention's workload (rows at the end of the
context, ~0.82 adjacent-row overlap, windows of 6 rows, spans of 128 pages) in NumPy and counts
the pairs whose pages share a colour:

- parity (v28 / v30): the union index's;
- greedy: union entries in order, each the colour that splits more of its pairs with earlier
  entries, then single flips while any lowers the count (a sequential pass a window-span);
- parallel rounds: from the parity colouring, in round i the entries with index % M == i % M
  flip where more of their pairs are monochrome than not (what a 128-thread window plan could
  run in a few passes);
- first / middle row's parity: each union entry takes the parity of its own index in the lowest
  (or middle-most) row of the window that has it.

    python bench/results/history/2026-12-05-s23-offline/ring_colouring_replay.py [rows] [context]
"""
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", ".."))
import bench_attention as BA  # noqa: E402

G, SPAN = 6, 128


def own_groups(tokens, counts):
    """Each row's own pages as sorted logical groups (the tail's group last: the largest)."""
    return [np.unique(tokens[r, :counts[r]] // 4) for r in range(tokens.shape[0])]


def window_spans(own, rows):
    """(union of the window-span's groups, its rows' own segments) for every window and span."""
    for w0 in range(0, rows, G):
        rr = range(w0, min(rows, w0 + G))
        nv = [own[r].size for r in rr]
        nsp = [max(1, n // SPAN) for n in nv]
        for s in range(max(nsp)):
            segs = [own[r][s * SPAN:(n if s == ns - 1 else (s + 1) * SPAN)]
                    for r, n, ns in zip(rr, nv, nsp) if s < ns]
            yield np.unique(np.concatenate(segs)), segs


def pairs(uni, segs):
    e = []
    for sg in segs:
        u = np.searchsorted(uni, sg)
        m = (u.size // 2) * 2
        e.append(np.stack([u[0:m:2], u[1:m:2]], 1))
    return np.concatenate(e)


def greedy(n, e):
    adj = [[] for _ in range(n)]
    for a, b in e:
        adj[a].append(b)
        adj[b].append(a)
    c = np.full(n, -1)
    for v in range(n):
        s0 = sum(1 for x in adj[v] if c[x] == 0)
        s1 = sum(1 for x in adj[v] if c[x] == 1)
        c[v] = 1 if s0 > s1 else (0 if s1 > s0 else v % 2)
    for _ in range(10):
        moved = 0
        for v in range(n):
            same = sum(1 for x in adj[v] if c[x] == c[v])
            if 2 * same > len(adj[v]):
                c[v] ^= 1
                moved += 1
        if not moved:
            break
    return c


def rounds(n, e, m, r):
    c = np.arange(n) % 2
    idx = np.arange(n)
    for i in range(r):
        bad = np.zeros(n, np.int64)
        good = np.zeros(n, np.int64)
        same = c[e[:, 0]] == c[e[:, 1]]
        np.add.at(bad, e[same, 0], 1)
        np.add.at(bad, e[same, 1], 1)
        np.add.at(good, e[~same, 0], 1)
        np.add.at(good, e[~same, 1], 1)
        c = c ^ ((bad > good) & (idx % m == i % m))
    return c


def row_parity(uni, segs, order):
    c = np.zeros(uni.size, np.int64)
    for i in order:
        u = np.searchsorted(uni, segs[i])
        c[u] = np.arange(u.size) % 2
    return c


def main():
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    ctx = int(sys.argv[2]) if len(sys.argv) > 2 else 32768
    w = BA.make_workload(rows, ctx, seed=0)
    own = own_groups(w["tokens"], w["counts"])
    bad = {}
    total = 0
    for uni, segs in window_spans(own, rows):
        e = pairs(uni, segs)
        total += len(e)
        k = len(segs)
        colourings = {
            "parity (v30)": np.arange(uni.size) % 2,
            "greedy": greedy(uni.size, e),
            "parallel rounds (M 3, 9 rounds)": rounds(uni.size, e, 3, 9),
            "first row's parity": row_parity(uni, segs, range(k - 1, -1, -1)),
            "middle row's parity": row_parity(uni, segs, sorted(range(k), key=lambda i: -abs(i - k // 2))),
        }
        for name, c in colourings.items():
            bad[name] = bad.get(name, 0) + int((c[e[:, 0]] == c[e[:, 1]]).sum())
    print(f"{rows} rows x {ctx}: {total} page pairs")
    for name, b in bad.items():
        print(f"  {name:34s} {b / total:.3f} of pairs on ring pages of one colour")


if __name__ == "__main__":
    main()
