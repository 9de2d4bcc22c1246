"""The comparator itself must fail where it should: a test that cannot fail is a defect."""
import numpy as np
import pytest

import oracle
from numqsa.testing import assert_matches_oracle, assert_selection_matches, poison, INT_POISON


def test_accepts_float16_rounding(rng):
    ref = rng.standard_normal(1000)
    assert_matches_oracle(ref.astype(np.float16), ref, dtype="float16")


@pytest.mark.parametrize("damage", ["nan", "one_wrong", "scaled", "inf_pattern"])
def test_rejects(rng, damage):
    ref = rng.standard_normal(1000)
    ref[:3] = -np.inf
    got = ref.astype(np.float32)
    if damage == "nan":
        got[500] = np.nan
    elif damage == "one_wrong":
        got[500] += 1.0
    elif damage == "scaled":
        got[3:] *= 1.01
    else:
        got[0] = 0.0
    with pytest.raises(AssertionError):
        assert_matches_oracle(got, ref, dtype="float16")


def test_poison():
    f = poison(np.zeros(4, np.float32))
    i = poison(np.zeros(4, np.int32))
    assert np.isnan(f).all() and (i == INT_POISON).all()


def test_selection_comparator_band(rng):
    nb, kb = 40, 8
    args = (np.array([0], np.int32), np.array([nb * 4 - 1], np.int32), np.array([nb * 4], np.int32))
    scores = rng.standard_normal((1, nb))
    scores[0, 10] = scores[0, 11] + 1e-6     # near-tie: either may be chosen if at the boundary
    groups = oracle.topk_groups(scores, *args, Kb=kb)
    tokens, counts = oracle.expand_tokens(groups, *args)
    assert_selection_matches(groups, tokens, counts, scores, *args, Kb=kb)
    worst = np.argsort(scores[0])[0]          # swap the best choice for the worst group
    bad = groups.copy()
    bad[0, np.argmax(scores[0, groups[0]])] = worst
    bad.sort(axis=1)
    bt, bc = oracle.expand_tokens(bad, *args)
    with pytest.raises(AssertionError, match="above the band|below the band"):
        assert_selection_matches(bad, bt, bc, scores, *args, Kb=kb)
    with pytest.raises(AssertionError, match="expansion"):
        assert_selection_matches(groups, np.roll(tokens, 1, axis=1), counts, scores, *args, Kb=kb)
