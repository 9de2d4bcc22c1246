"""Bad input raises QSAInputError with a message that says what is wrong, before any launch.

Each case runs against the oracle and against numqsa's public API (same checks, shared code).
"""
import numpy as np
import pytest

import oracle
from oracle.problems import make_problem
from oracle.validate import QSAInputError


def _apis():
    apis = [pytest.param(oracle, id="oracle")]
    try:
        import numqsa
        apis.append(pytest.param(numqsa, id="numqsa"))
    except ImportError:   # the kernels' API is not importable yet: test the shared checks alone
        pass
    return apis


@pytest.fixture
def prob(seed):
    return make_problem([40, 20], positions=[39, 19], req_ids=[0, 1], page_size=8, Hq=4, Hkv=2,
                        D=16, Hi=2, Di=16, dtype=np.float16, seed=seed)


def attention(api, p, **over):
    p = {**p, **over}
    tokens = np.full((2, 11), -1, np.int32)
    tokens[:, :3] = [0, 1, 2]
    counts = np.array([3, 3], np.int32)
    return api.sparse_attention(p["q"], p["k_cache"], p["v_cache"], p["block_table"],
                                over.get("tokens", tokens), counts, p["req_ids"], p["seq_lens"])


def scores(api, p, **over):
    p = {**p, **over}
    return api.index_scores(p["qi"], p["index_cache"], p["index_block_table"], p["req_ids"],
                            p["positions"], p["seq_lens"])


@pytest.mark.parametrize("api", _apis())
class TestMessages:
    def test_page_id_out_of_range_names_request_and_column(self, api, prob):
        bad = prob["block_table"].copy()
        bad[1, 2] = 10_000
        with pytest.raises(QSAInputError, match=r"block_table\[1, 2\] = 10000 .*request 1, column 2"):
            attention(api, prob, block_table=bad)

    def test_negative_page_id(self, api, prob):
        bad = prob["index_block_table"].copy()
        bad[0, 1] = -1
        with pytest.raises(QSAInputError, match=r"index_block_table\[0, 1\] = -1 .*request 0, column 1"):
            scores(api, prob, index_block_table=bad)

    def test_table_too_short(self, api, prob):
        with pytest.raises(QSAInputError, match=r"block_table has 2 columns but request 0 .*needs 5"):
            attention(api, prob, block_table=prob["block_table"][:, :2].copy())

    def test_hq_not_multiple_of_hkv(self, api, prob):
        q = np.zeros((2, 3, 16), np.float16)
        with pytest.raises(QSAInputError, match=r"Hq = 3 is not a positive multiple of Hkv = 2"):
            attention(api, prob, q=q)

    def test_page_size_not_multiple_of_r(self, api, prob):
        k = np.zeros((10, 6, 2, 16), np.float16)
        with pytest.raises(QSAInputError, match=r"page_size 6 is not a multiple of r = 4"):
            attention(api, prob, k_cache=k, v_cache=k)

    def test_kv_geometry_mismatch(self, api, prob):
        v = np.zeros(prob["k_cache"].shape[:3] + (8,), np.float16)
        with pytest.raises(QSAInputError, match=r"k_cache shape .* differs from v_cache shape"):
            attention(api, prob, v_cache=v)

    def test_kv_dtype_mismatch(self, api, prob):
        with pytest.raises(QSAInputError, match=r"k_cache dtype float16 differs from v_cache dtype float32"):
            attention(api, prob, v_cache=prob["v_cache"].astype(np.float32))

    def test_wrong_rank(self, api, prob):
        with pytest.raises(QSAInputError, match=r"q must have rank 3"):
            attention(api, prob, q=prob["q"][0])

    def test_wrong_dtype(self, api, prob):
        with pytest.raises(QSAInputError, match=r"index_cache has dtype int32"):
            scores(api, prob, index_cache=prob["index_cache"].astype(np.int32))

    def test_integer_batch_dtypes(self, api, prob):
        with pytest.raises(QSAInputError, match=r"positions has dtype float64"):
            scores(api, prob, positions=prob["positions"].astype(np.float64))

    def test_rows_disagree(self, api, prob):
        with pytest.raises(QSAInputError, match=r"positions has 1 rows but req_ids has 2"):
            scores(api, prob, positions=prob["positions"][:1].copy())

    def test_head_dim_mismatch(self, api, prob):
        with pytest.raises(QSAInputError, match=r"q head dim 8 differs from the cache's D = 16"):
            attention(api, prob, q=np.zeros((2, 4, 8), np.float16))

    def test_index_head_dim_mismatch(self, api, prob):
        with pytest.raises(QSAInputError, match=r"qi head dim 8 differs from the index cache's Di = 16"):
            scores(api, prob, qi=np.zeros((2, 2, 8), np.float16))

    def test_token_out_of_sequence(self, api, prob):
        tokens = np.full((2, 11), -1, np.int32)
        tokens[:, :3] = [0, 1, 25]     # request 1 has 20 tokens
        with pytest.raises(QSAInputError, match=r"row 1: selected tokens must lie in 0..19"):
            attention(api, prob, tokens=tokens)

    def test_selection_width(self, api, prob):
        with pytest.raises(QSAInputError, match=r"tokens width 10 is not Kb\*r \+ r - 1"):
            attention(api, prob, tokens=np.zeros((2, 10), np.int32))
