"""The comparator itself must fail where it should: a test that cannot fail is a defect."""
import numpy as np
import pytest

import oracle
from numqsa.testing import (INT_POISON, TOLERANCES, assert_matches_oracle, assert_selection_matches,
                            compare, matmul_accumulating_in, poison, sum_in)


def test_accepts_float16_rounding(rng):
    ref = rng.standard_normal((40, 6, 32))
    assert_matches_oracle(ref.astype(np.float16), ref, dtype="float16")


def test_accepts_float32_rounding(rng):
    ref = rng.standard_normal((40, 6, 32))
    assert_matches_oracle(ref.astype(np.float32), ref, dtype="float32")


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


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_one_row_off_fails_the_row_bound(rng, dtype):
    """One lse in 288 off (by 0.04 / 2e-4), one head of one row of out scaled: within the whole
    tensor's bound, outside the row's."""
    lse = rng.standard_normal((48, 6)) + 3.0
    got = lse.astype(np.float32).astype(np.float64)
    got[17, 4] += 0.04 if dtype == "float16" else 2e-4
    st = compare(got, lse)
    assert st["rel_l2"] <= TOLERANCES[dtype].rel_l2, "the damage must pass the global bound"
    with pytest.raises(AssertionError, match=r"worst row \(17,\)"):
        assert_matches_oracle(got, lse, dtype=dtype, what="lse")
    out = rng.standard_normal((48, 6, 32))
    bad = out.astype(np.float16).astype(np.float64)
    bad[5, 2] *= 1 + 2.5 * TOLERANCES["float16"].row_rel_l2
    assert compare(bad, out)["rel_l2"] <= TOLERANCES["float16"].rel_l2
    with pytest.raises(AssertionError, match=r"worst row \(5, 2\)"):
        assert_matches_oracle(bad, out, dtype="float16")


def test_rows_near_zero_judged_on_the_tensor_scale(rng):
    """A row of tiny values carries the tensor's absolute rounding error: accepted; the same error
    on every row's scale is not."""
    ref = rng.standard_normal((20, 16))
    ref[3] *= 1e-6
    got = ref + 1e-7 * rng.standard_normal(ref.shape)      # ~4e-7 relative to a typical row
    assert_matches_oracle(got, ref, dtype="float32")
    with pytest.raises(AssertionError):
        assert_matches_oracle(ref + 1e-4 * rng.standard_normal(ref.shape), ref, dtype="float32")


def test_float32_tolerance_rejects_float16_accumulation(rng):
    """Sums of O(1) terms accumulated in float16 instead of float32: the float32 row fails them,
    the float16 row takes them."""
    a, b = rng.standard_normal((24, 64)), rng.standard_normal((64, 16))
    want = a @ b
    assert_matches_oracle(matmul_accumulating_in(a, b, np.float32), want, dtype="float32")
    f16 = matmul_accumulating_in(a, b, np.float16)
    with pytest.raises(AssertionError):
        assert_matches_oracle(f16, want, dtype="float32")
    np.testing.assert_array_equal(sum_in(np.ones(3000), np.float16), 2048.0)   # float16 stalls


def test_poison():
    f = poison(np.zeros(4, np.float32))
    i = poison(np.zeros(4, np.int32))
    assert np.isnan(f).all() and (i == INT_POISON).all()


def _selection_case(rng, nb=40, kb=8):
    args = (np.array([0, 0], np.int32), np.array([nb * 4 - 1, 5], np.int32),
            np.array([nb * 4], np.int32))
    scores = rng.standard_normal((2, nb))
    scores[0, 10] = scores[0, 11] + 1e-6     # near-tie: either may be chosen if at the boundary
    groups = oracle.topk_groups(scores, *args, Kb=kb)
    tokens, counts = oracle.expand_tokens(groups, *args)
    return scores, args, groups, tokens, counts, kb


def test_selection_comparator_band(rng):
    scores, args, groups, tokens, counts, kb = _selection_case(rng)
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


def test_selection_comparator_padding_and_width(rng):
    """Row 1 sees one group: ``[g, -1, ...]``. Padding moved into the middle, a missing trailing
    column, a wider token array and an inert row that selects all fail."""
    scores, args, groups, tokens, counts, kb = _selection_case(rng)
    assert groups[1, 0] >= 0 and np.all(groups[1, 1:] == -1)
    mid = groups.copy()
    mid[1, :2] = [-1, groups[1, 0]]              # [-1, g, -1, ...]: same ids, padding misplaced
    with pytest.raises(AssertionError, match="-1 padding"):
        assert_selection_matches(mid, tokens, counts, scores, *args, Kb=kb)
    with pytest.raises(AssertionError, match="groups shape"):
        assert_selection_matches(groups[:, :-1], tokens, counts, scores, *args, Kb=kb)
    wide = np.concatenate([tokens, np.full((2, 1), -1, tokens.dtype)], axis=1)
    with pytest.raises(AssertionError, match="tokens shape"):
        assert_selection_matches(groups, wide, counts, scores, *args, Kb=kb)
    inert = (np.array([0, 3], np.int32),) + args[1:]     # row 1's request does not exist
    g, (t, c) = groups.copy(), oracle.expand_tokens(np.where(np.arange(2)[:, None] == 1, -1, groups),
                                                    *inert)
    with pytest.raises(AssertionError, match="-1 padding"):
        assert_selection_matches(g, t, c, scores, *inert, Kb=kb)
