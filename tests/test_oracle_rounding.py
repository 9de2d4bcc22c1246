"""The oracle's emulated engine rounding chains (oracle/rounding.py): a hand-computed case, the
float32-angle RoPE error the contract quotes, and identities. NumPy only (no torch, no GPU)."""
import numpy as np
import pytest

import oracle
from oracle import rounding as R

pytest.importorskip("ml_dtypes")


def test_chain_names():
    assert R.parse("hf-bf16") == ("hf", "bfloat16")
    assert R.parse("trtllm-fp16") == ("trtllm", "float16")
    for bad in ("hf", "hf-int8", "vllm-bf16", None):
        with pytest.raises(oracle.QSAInputError):
            R.parse(bad)


def test_round_to_bfloat16_by_hand():
    # bfloat16 keeps 8 significant bits: the ulp at 1 is 2^-7; halfway cases go to even.
    x = np.array([1 + 2 ** -9, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 0.1])
    np.testing.assert_array_equal(R.round_to(x, "bfloat16"), [1.0, 1.0, 1 + 2 ** -6, 0.10009765625])


def test_hf_bf16_rope_by_hand():
    # x = (1, 0), rot 2, position 1: the angle is 1 (inv_freq[0] = 1). bf16 cos(1) = 138/256,
    # sin(1) = 215/256; x*cos = (138/256, 0), rotate_half(x)*sin = (0, 215/256).
    cos, sin = R.rope_tables(np.array([1]), rot=2, theta=1e7, dtype="bfloat16")
    np.testing.assert_array_equal(cos, [[138 / 256, 138 / 256]])
    np.testing.assert_array_equal(sin, [[215 / 256, 215 / 256]])
    y = R.rope(np.array([[1.0, 0.0, 3.0]]), cos, sin, "bfloat16")
    np.testing.assert_array_equal(y, [[138 / 256, 215 / 256, 3.0]])
    np.testing.assert_allclose(oracle.rope(np.array([1.0, 0.0, 3.0]), 1, rot=2), [np.cos(1), np.sin(1), 3],
                               rtol=1e-15)


def test_hf_float32_angles_error_as_the_contract_says():
    # Contract §3: HF's float32 RoPE angles put cos/sin off by up to 1.4e-4 below position 4096.
    pos = np.arange(4096)
    cos, sin = R.rope_tables(pos, rot=64, theta=1e7, dtype="float32")
    half = 32
    ang = pos[:, None] * 1e7 ** (-2.0 * np.arange(half) / 64)
    err = max(np.abs(cos[:, :half] - np.cos(ang)).max(), np.abs(sin[:, :half] - np.sin(ang)).max())
    assert 1e-4 < err < 2e-4, err
    np.testing.assert_array_equal(cos[:, :half], cos[:, half:])


def test_hf_bf16_index_key_by_hand():
    # One group of four raw keys, Di = 4, rot = 2, at position 0 (cos 1, sin 0: RoPE is the identity).
    # The float32 mean of each column is (1, 1, 1, 1 + 2^-9); bf16 rounds the last to 1, so the normed
    # key is 1 / sqrt(1 + 1e-6) per element, which bf16 rounds to 1. float64 keeps the 2^-9.
    k_raw = np.ones((1, 4, 4))
    k_raw[0, 0, 3] = 1 + 2 ** -7
    kc = R.index_keys(k_raw, np.zeros(4), np.array([0]), rounding="hf-bf16", rot=2)
    np.testing.assert_array_equal(kc, np.ones((1, 4)))
    truth = oracle.gnorm(k_raw.mean(axis=1), np.zeros(4))
    assert truth[0, 3] > truth[0, 0]


def _raw(rng, shape, dtype):
    return R.round_to(rng.standard_normal(shape), dtype)


@pytest.mark.parametrize("chain", ["hf-bf16", "hf-fp16", "trtllm-bf16", "hf-fp32"])
def test_chain_values_are_in_the_chain_dtype_and_close_to_the_truth(rng, chain):
    _, dtype = R.parse(chain)
    k_raw, w = _raw(rng, (9, 4, 32), dtype), _raw(rng, (32,), dtype) * 0.3
    pos = 4 * np.arange(9) + 4 * int(rng.integers(0, 1000))
    kc = R.index_keys(k_raw, w, pos, rounding=chain, rot=16)
    np.testing.assert_array_equal(R.round_to(kc, dtype), kc)
    truth = oracle.rope(oracle.gnorm(k_raw.mean(axis=1), w), pos, rot=16)
    err = np.abs(kc - truth).max() / np.abs(truth).max()
    ulp = {"bfloat16": 2 ** -8, "float16": 2 ** -11, "float32": 2 ** -24}[dtype]
    assert err < 8 * ulp + 1e-4, err     # + the float32 angles' error at positions below 4096 * 4
    if dtype != "float32":
        assert err > 0


def test_trtllm_rounds_once(rng):
    q_raw = _raw(rng, (5, 2, 32), "bfloat16")
    w, pos = _raw(rng, (32,), "bfloat16"), rng.integers(0, 4000, 5)
    once = R.index_queries(q_raw, w, pos, rounding="trtllm-bf16", rot=16)
    fp32 = R.index_queries(q_raw, w, pos, rounding="trtllm-fp32", rot=16)
    np.testing.assert_array_equal(once, R.round_to(fp32, "bfloat16"))


def test_oracle_functions_take_a_chain(rng):
    G, di = 6, 32
    k_raw, w = _raw(rng, (G, 4, di), "bfloat16"), _raw(rng, (di,), "bfloat16")
    cache = np.zeros((2, 4, di))
    table = np.array([[1, 0]])
    kc = oracle.index_keys(k_raw, w, np.zeros(G, np.int32), np.arange(G), cache, table,
                           rot=16, rounding="hf-bf16")
    np.testing.assert_array_equal(kc, R.index_keys(k_raw, w, 4 * np.arange(G), rounding="hf-bf16",
                                                   rot=16))
    np.testing.assert_array_equal(cache[1], kc[:4])
    with pytest.raises(oracle.QSAInputError):
        oracle.index_keys(k_raw, w, np.zeros(G, np.int32), np.arange(G), cache, table,
                          emulate_dtype=np.float16, rounding="hf-bf16")
    q_raw = _raw(rng, (3, 2, di), "bfloat16")
    qi = oracle.index_queries(q_raw, w, np.zeros(3, np.int32), np.array([5, -1, 30]),
                              np.array([24]), rot=16, rounding="hf-bf16")
    assert not qi[1].any()                                     # inert row
    np.testing.assert_array_equal(qi[2], R.index_queries(q_raw[2:], w, np.array([23]), rounding="hf-bf16",
                                                         rot=16)[0])   # stale position clamped


def test_attention_chain(rng):
    q, k, v = (_raw(rng, s, "bfloat16") for s in ((4, 16), (40, 2, 16), (40, 2, 16)))
    scale = 16 ** -0.5
    truth, _ = oracle.attention.attend(q, k, v, scale)
    np.testing.assert_allclose(R.attend(q, k, v, scale, "hf-fp32"), truth, rtol=0, atol=1e-6)
    hf = R.attend(q, k, v, scale, "hf-bf16")
    np.testing.assert_array_equal(R.round_to(hf, "bfloat16"), hf)
    assert 0 < np.linalg.norm(hf - truth) / np.linalg.norm(truth) < 2e-2
    assert R.attend(q, k[:0], v[:0], scale, "hf-bf16").shape == (4, 16)
    p = oracle.sparse_attention(q[None], k[None], v[None], np.zeros((1, 1), np.int32),
                                np.r_[np.arange(40), [-1, -1, -1]].astype(np.int32)[None], np.array([40]),
                                np.zeros(1, np.int32), np.array([40]),
                                scale=scale, r=4, rounding="hf-bf16")[0]
    np.testing.assert_array_equal(p[0], hf)
