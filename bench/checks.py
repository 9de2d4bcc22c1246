"""Every implementation's answer against the float64 oracle, on sampled rows (spec §8).

Selections (scores -> groups/tokens) are put in numqsa's canonical form first — tokens ascending,
-1 padded; groups the ascending ids of the whole groups they hold — so peers that emit top-k order
(TensorRT-LLM) are judged on their sets: counts and tails exact, the band rule on groups, tokens
exactly the expansion of the groups. Attention is compared with the oracle run on the
implementation's own selection (rel-L2 / cosine / max abs, all finite, the tolerance of the
input dtype). Scores are compared like attention outputs, with the ``-inf`` pattern exact.
"""
import numpy as np

import oracle
from numqsa.testing import assert_matches_oracle, assert_selection_matches

from .workloads import host


class Checker:
    """Oracle results of one problem, computed once for its sampled rows."""

    def __init__(self, prob):
        self.p = prob
        self.rows = prob.sample_rows()
        self._scores = None

    def _sub(self, x):
        return host(x)[self.rows] if x is not None else None

    def oracle_scores(self):
        """float64 oracle index scores of the sampled rows ``[n, G]``."""
        if self._scores is None:
            p, i = self.p, self.rows
            self._scores = oracle.index_scores(
                p.host("qi")[i], p.host("index_cache"), p.table_np, p.req_np[i], p.pos_np[i],
                p.lens_np, r=p.case.r, num_groups=p.G)
        return self._scores

    def selection_overlap(self, n=8):
        """Mean adjacent-row overlap of the oracle's top-Kb groups on the last ``n`` rows."""
        p = self.p
        if "_sel_ov" not in self.__dict__:
            i = np.arange(max(0, p.case.rows - n), p.case.rows)
            s = oracle.index_scores(p.host("qi")[i], p.host("index_cache"), p.table_np, p.req_np[i],
                                    p.pos_np[i], p.lens_np, r=p.case.r, num_groups=p.G)
            g = oracle.topk_groups(s, p.req_np[i], p.pos_np[i], p.lens_np, Kb=p.case.Kb,
                                   r=p.case.r)
            same = [np.intersect1d(g[k][g[k] >= 0], g[k - 1][g[k - 1] >= 0]).size / p.case.Kb
                    for k in range(1, i.size) if p.req_np[i[k]] == p.req_np[i[k - 1]]]
            self._sel_ov = float(np.mean(same)) if same else None
        return self._sel_ov

    def canonical(self, tokens=None, groups=None):
        """``(groups, tokens, counts)`` of the sampled rows in numqsa's canonical form."""
        p, i, r = self.p, self.rows, self.p.case.r
        kb = p.case.Kb
        nb = p.nb_np[i]
        if tokens is not None:
            t = np.asarray(self._sub(tokens), np.int64)
            t = np.where(t >= 0, t, np.iinfo(np.int64).max)
            t = np.sort(t, axis=1)
            valid = t != np.iinfo(np.int64).max
            t = np.where(valid, t, -1)
            counts = valid.sum(axis=1)
            g = np.full((i.size, kb), -1, np.int64)
            for k in range(i.size):
                body = t[k][(t[k] >= 0) & (t[k] < r * nb[k])]
                ids = np.unique(body // r)
                g[k, :min(ids.size, kb)] = ids[:kb]
            return g, t, counts
        g = np.asarray(self._sub(groups), np.int64)
        g = np.where(g >= 0, g, np.iinfo(np.int64).max)
        g = np.sort(g, axis=1)
        g = np.where(g == np.iinfo(np.int64).max, -1, g)
        t, counts = oracle.expand_tokens(g, p.req_np[i], p.pos_np[i], p.lens_np, r=r)
        return g, t, counts

    def selection(self, scores_of_rows, tokens=None, groups=None):
        p, i = self.p, self.rows
        g, t, counts = self.canonical(tokens, groups)
        W = p.case.Kb * p.case.r + p.case.r - 1
        if t.shape[1] != W:
            raise AssertionError(f"selection width {t.shape[1]} != {W}")
        assert_selection_matches(g, t, counts, scores_of_rows, p.req_np[i], p.pos_np[i],
                                 p.lens_np, Kb=p.case.Kb, r=p.case.r)
        return dict(rows=int(i.size)), (g, t, counts)

    def attention(self, out, tokens, counts):
        """``out`` of the sampled rows against the oracle on ``tokens``/``counts`` (sampled rows)."""
        p, i = self.p, self.rows
        ref, _ = oracle.sparse_attention(p.host("q")[i], p.host("k_cache"), p.host("v_cache"),
                                         p.table_np, tokens, counts, p.req_np[i], p.lens_np,
                                         r=p.case.r)
        return assert_matches_oracle(self._sub(out), ref, dtype=p.case.dtype, what="attention")

    def check(self, stage, res, impl=""):
        """Raise AssertionError (with the numbers) if ``res`` (a Call's result) is wrong; else return
        the comparison stats."""
        p, i = self.p, self.rows
        if stage == "scores":
            s = self._sub(res["scores"])[:, :p.G]
            return assert_matches_oracle(s, self.oracle_scores(), dtype=p.case.dtype, what="scores")
        if stage == "topk":
            ref = host(p.scores)[i].astype(np.float64)
            return self.selection(ref, groups=res["groups"])[0]
        if stage == "expand":
            g, t, c = self.canonical(tokens=res["tokens"])
            want, wc = p.tokens_np[i], p.counts_np[i]
            if not (np.array_equal(t, want) and np.array_equal(c, wc)):
                raise AssertionError("expanded tokens differ from the expansion of the groups")
            return dict(rows=int(i.size))
        if stage == "select":
            return self.selection(self.oracle_scores(), tokens=res.get("tokens"),
                                  groups=None if "tokens" in res else res["groups"])[0]
        if stage == "attention":
            if impl == "sdpa":
                return self.dense(res["out"])
            return self.attention(res["out"], p.tokens_np[i], p.counts_np[i])
        if stage == "prefill":
            st, (g, t, c) = self.selection(self.oracle_scores(), tokens=res["tokens"])
            st.update(self.attention(res["out"], t.astype(np.int32), c.astype(np.int32)))
            return st
        raise ValueError(stage)

    def dense(self, out):
        """Dense causal attention (every token ``0..p``) of the sampled rows."""
        p, i, r = self.p, self.rows, self.p.case.r
        pos = p.pos_np[i]
        need = int(pos.max()) + 1
        W = -(-max(need - (r - 1), 0) // r) * r + r - 1
        tok = np.full((i.size, W), -1, np.int32)
        for k, x in enumerate(pos):
            tok[k, :x + 1] = np.arange(x + 1)
        return self.attention(out, tok, (pos + 1).astype(np.int32))
